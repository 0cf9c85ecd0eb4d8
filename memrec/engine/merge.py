"""Join the traces of several hosts of one job into one trace, on their wall-clock anchors.

Each input trace counts time on its host's CLOCK_MONOTONIC and ties it to the wall clock once
(the header's ``anchor``). A host is its ``(boot_id, host)`` pair: traces of one host and boot
share a clock, a pid space and GPU numbers, so they are merged as one host. They must be the files
of one recording (one recorder's rotated parts): two separate runs of one host, recorded one after
the other by two ``memrec record``s, would become one run with twice the ranks, every ``TP0``
twice over, and KV-budget numbers of neither; they are refused, naming ``memrec diff``, which is
what compares two runs. The merged trace:

- counts time on the *reference* host's clock (the first host given): a host's timestamps move by
  ``(wall − monotonic)_host − (wall − monotonic)_reference``, so equal wall-clock instants get equal
  timestamps; the error of that is the error between the hosts' wall clocks (see
  :func:`expected_clock_error`);
- numbers GPUs host by host: host 0's GPUs first, then host 1's..., each named ``host:index``
  (with the model name) in the header; events, samples, markers and process maps follow;
- keeps host 0's pids and gives host *i*'s pid ``p`` the pid ``i × PID_STRIDE + p`` (Linux pids
  stay below 2^22 < PID_STRIDE), so ``10001234`` reads "host 1, pid 1234";
- starts from the hosts' initial keyframes joined into one state, and carries keyframes every
  ``KEYFRAME_EVENTS`` events, replayed here, so viewers can jump as in any trace;
- says all of it in the header's ``merged`` map: per host its name, boot id, files, pid base,
  GPUs (merged → own index), clock offset and NTP error estimate; and the expected clock error;
- numbers every file's stacks (format 2.3) once: an event names its stack by the merged file's id.

Readers need nothing new: report, diff, dump and the TUI read a merged trace like any other.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import numpy as np

from memrec.base.errors import MemrecError
from memrec.terms.events import Kind
from memrec.terms.events import ProcessInfo
from memrec.state import ALLOC_FIELDS
from memrec.state import EXPORT_FIELDS
from memrec.state import FABRIC_FIELDS
from memrec.state import FAILURE_FIELDS
from memrec.state import HANDLE_FIELDS
from memrec.state import HELD_FIELDS
from memrec.state import HOST_FIELDS
from memrec.state import LARGEST_FIELDS
from memrec.state import MAP_FIELDS
from memrec.state import OPEN_FIELDS
from memrec.state import PEAK_FIELDS
from memrec.state import ALIAS_FIELDS
from memrec.state import LiveState
from memrec.state import alloc_rows
from memrec.trace.clock import wall_offset_ns
from memrec.trace.format import make_header
from memrec.trace.model import Trace
from memrec.trace.stacks import StackInterner
from memrec.trace.writer import TraceWriter

#: Host i's pid p becomes i * PID_STRIDE + p (Linux's pid_max is at most 2^22).
PID_STRIDE = 10_000_000
#: A keyframe every this many merged events.
KEYFRAME_EVENTS = 200_000
#: Assumed error of one wall-clock anchor reading itself (two clock reads apart), ns.
ANCHOR_READ_NS = 10_000

_PID_FIELDS = {"pid", "exporter", "peer"}
_GPU_FIELDS = {"gpu", "owner_gpu"}
_TABLES = {
    "allocs": ALLOC_FIELDS, "handles": HANDLE_FIELDS, "maps": MAP_FIELDS, "aliases": ALIAS_FIELDS,
    "exports": EXPORT_FIELDS, "fabric": FABRIC_FIELDS, "opens": OPEN_FIELDS, "host": HOST_FIELDS,
    "peaks": PEAK_FIELDS, "failures": FAILURE_FIELDS,
}


class MergeError(MemrecError):
    """The traces cannot be merged (no wall-clock anchor, a pid beyond the stride...)."""


@dataclass
class Host:
    """One (boot id, host name) of the job and what it contributes."""

    index: int
    name: str
    boot_id: str | None
    traces: list[tuple[str, Trace]] = field(default_factory=list)
    offset_ns: int = 0  # added to this host's timestamps
    gpu_map: dict[int, int] = field(default_factory=dict)  # own GPU index -> merged index

    @property
    def key(self) -> tuple[str | None, str]:
        return (self.boot_id, self.name)

    @property
    def pid_base(self) -> int:
        return self.index * PID_STRIDE

    @property
    def anchor(self) -> dict:
        return self.traces[0][1].header["anchor"]

    def pid(self, p: int) -> int:
        return self.pid_base + p if p else p

    def gpu(self, g: int | None) -> int | None:
        return self.gpu_map.get(g, g) if g is not None and g >= 0 else g


def _wall_minus_mono(path: str, header: dict) -> int:
    offset = wall_offset_ns(header)
    if offset is None:
        raise MergeError(f"{path}: no wall-clock anchor in the header: cannot place it on a shared timeline")
    return offset


def group_hosts(traces: list[tuple[str, Trace]]) -> list[Host]:
    """Hosts in the order their first trace was given; each host's traces in time order."""
    hosts: dict[tuple[str | None, str], Host] = {}
    seen: dict[str, str] = {}  # one recording's identity -> the path it was first given as
    recorders: dict[tuple[str | None, str], tuple[int, str]] = {}  # host -> (recorder pid, first path)
    for path, trace in traces:
        ts = trace.events["ts"]
        identity = repr((trace.header.get("boot_id"), trace.header.get("anchor"), trace.header.get("daemon"),
                         len(ts), ts[:1].tolist(), ts[-1:].tolist()))
        if identity in seen:
            # Every event would count twice: twice the memory, then frees of freed memory.
            raise MergeError(f"{path}: the same recording as {seen[identity]}: give each trace once")
        seen[identity] = path
        name = str(trace.header.get("host") or "?")
        key = (trace.header.get("boot_id"), name)
        recorder = _recorder(trace.header)
        if recorder is not None:
            first = recorders.setdefault(key, (recorder, path))
            if first[0] != recorder:
                raise MergeError(
                    f"{path}: a separate recording on the same host as {first[1]} ({name}: recorder pid "
                    f"{recorder}, not {first[0]}); merge joins the hosts of one job or the files of one "
                    f"recording: compare two runs with `memrec diff {first[1]} {path}`"
                )
        if key not in hosts:
            hosts[key] = Host(len(hosts), name, key[0])
        hosts[key].traces.append((path, trace))
    for host in hosts.values():
        host.traces.sort(key=lambda pt: int(pt[1].header.get("anchor", {}).get("monotonic_ns", 0)))
    names = [h.name for h in hosts.values()]
    for host in hosts.values():
        if names.count(host.name) > 1:  # one host name over two boots: say which boot
            host.name = f"{host.name}@{(host.boot_id or '?')[:8]}"
    return list(hosts.values())


def _recorder(header: dict) -> int | None:
    """The pid of the daemon or ``memrec record`` that wrote the file (every rotated part of one
    recording has it), or None for a file that does not say."""
    daemon = header.get("daemon")
    pid = daemon.get("pid") if isinstance(daemon, dict) else None
    return pid if isinstance(pid, int) else None


def _host_gpus(host: Host) -> dict[int, dict]:
    """Every GPU index the host's traces name, with the header's info where there is some."""
    gpus: dict[int, dict] = {}
    for _, trace in host.traces:
        for g in trace.header.get("gpus") or []:
            gpus.setdefault(int(g["index"]), dict(g))
        seen = set()
        for arr in (trace.events, trace.nvml, trace.procmem):
            if len(arr):
                seen |= set(np.unique(arr["gpu"]).tolist())
        seen |= {m.gpu for m in trace.markers if m.gpu is not None}
        for info in trace.processes.values():
            seen |= set(info.gpu_map)
        for kf in trace.keyframes[:1]:  # memory held before the file began
            seen |= _snapshot_gpus(kf.state)
        for g in seen:
            if g >= 0:
                gpus.setdefault(int(g), {"index": int(g), "uuid": None, "name": "", "total": 0, "bar1_total": None})
    return dict(sorted(gpus.items()))


def _with_alloc_rows(snap: dict) -> dict:
    """``snap`` with its driver allocations as rows, whatever the keyframe's version (a damaged
    table is left for LiveState.from_snapshot to refuse)."""
    try:
        return dict(snap, allocs=alloc_rows(snap))
    except (TypeError, ValueError, KeyError, OverflowError):
        return snap


def _snapshot_gpus(snap: dict) -> set[int]:
    out: set[int] = set()
    snap = _with_alloc_rows(snap)
    for table, names in _TABLES.items():
        flat = snap.get(table) or []
        for i, name in enumerate(names):
            if name in _GPU_FIELDS:
                out |= {int(g) for g in flat[i :: len(names)] if isinstance(g, int)}
    return out


def expected_clock_error(hosts: list[Host]) -> tuple[int | None, str]:
    """The expected error (ns) of the merged timeline between any host and the reference, and why.

    It is the sum of the two hosts' NTP error estimates (``esterror`` from each header's
    ``clock_sync``) plus the anchor readings; None when a host's clock was not synchronized or
    its trace predates the estimate.
    """
    worst = 0
    ref = _sync(hosts[0])
    for host in hosts[1:]:
        sync = _sync(host)
        for h, s in ((hosts[0], ref), (host, sync)):
            if s is None:
                return None, f"unknown: {h.name}'s trace has no clock synchronization state"
            if not s.get("synchronized"):
                return None, f"unknown: {h.name}'s clock was not NTP-synchronized when it recorded"
        err = (int(ref["esterror_us"]) + int(sync["esterror_us"])) * 1000 + 2 * ANCHOR_READ_NS
        worst = max(worst, err)
    if len(hosts) == 1:
        return 0, "one host: one clock"
    return worst, "sum of the hosts' NTP error estimates at recording start (adjtimex esterror)"


def _sync(host: Host) -> dict | None:
    sync = host.traces[0][1].header.get("clock_sync")
    return sync if isinstance(sync, dict) else None


def _remap_row(row: list, names: tuple[str, ...], host: Host) -> list:
    out = list(row)
    for i, name in enumerate(names[: len(out)]):
        if name in _PID_FIELDS:
            out[i] = host.pid(out[i])
        elif name in _GPU_FIELDS:
            out[i] = host.gpu(out[i])
        elif name == "ts":
            out[i] = out[i] + host.offset_ns
    return out


def _remap_snapshot(snap: dict, host: Host) -> dict:
    snap = _with_alloc_rows(snap)
    out = dict(snap)
    for table, names in _TABLES.items():
        flat = snap.get(table) or []
        stride = len(names)
        rows = [_remap_row(flat[i : i + stride], names, host) for i in range(0, len(flat), stride)]
        out[table] = [v for r in rows for v in r]
    exits = []
    for pid, ts, held, largest in snap.get("exits") or []:
        h, k = len(HELD_FIELDS), len(LARGEST_FIELDS)
        held = [v for i in range(0, len(held), h) for v in _remap_row(held[i : i + h], HELD_FIELDS, host)]
        largest = [v for i in range(0, len(largest), k) for v in _remap_row(largest[i : i + k], LARGEST_FIELDS, host)]
        exits.append([host.pid(pid), ts + host.offset_ns, held, largest])
    out["exits"] = exits
    return out


def _initial_state(hosts: list[Host]) -> LiveState:
    """The hosts' first keyframes (at event 0), remapped and joined into one state."""
    joined: dict[str, Any] = {"v": None, "n": 0, "ts": 0, "n_failures": 0, "max_failures": 0, "anomalies": {}, "exits": []}
    for table in _TABLES:
        joined[table] = []
    for host in hosts:
        trace = host.traces[0][1]
        first = next((kf for kf in trace.keyframes if kf.event_index == 0), None)
        if first is None:
            continue
        snap = _remap_snapshot(first.state, host)
        joined["v"] = snap.get("v")
        for table in (*_TABLES, "exits"):
            joined[table] += snap.get(table) or []
        joined["ts"] = max(joined["ts"], int(snap.get("ts") or 0) + host.offset_ns)
        joined["n_failures"] += int(snap.get("n_failures") or 0)
        joined["max_failures"] = max(joined["max_failures"], int(snap.get("max_failures") or 0))
        for k, v in (snap.get("anomalies") or {}).items():
            joined["anomalies"][k] = joined["anomalies"].get(k, 0) + v
    if joined["v"] is None:
        return LiveState()
    try:
        state = LiveState.from_snapshot(joined)
    except (ValueError, KeyError, TypeError) as error:
        raise MergeError(f"cannot join the traces' starting states: {error}") from None
    state.n_events = 0
    return state


def _shifted(arr: np.ndarray, host: Host, pid_cols: tuple[str, ...] = ()) -> np.ndarray:
    out = arr.copy()
    ts = out["ts"].astype(np.int64) + host.offset_ns
    if len(ts) and int(ts.min()) < 0:
        raise MergeError(f"{host.name}'s records fall before the reference host booted: name another host's trace first")
    out["ts"] = ts
    g = out["gpu"].astype(np.int64)
    for own, merged in host.gpu_map.items():
        g[arr["gpu"] == own] = merged
    out["gpu"] = g
    for col in pid_cols:
        nonzero = out[col] != 0
        out[col][nonzero] += host.pid_base
    return out


def _events(host: Host, trace: Trace, stacks: StackInterner) -> np.ndarray:
    ev = _shifted(trace.events, host, ("pid",))
    if trace.stacks:  # the file's stack ids -> the merged file's (an id it does not define: none)
        ids = trace.stacks.id_map(stacks)
        lut = np.zeros(max(ids) + 1, np.uint32)
        lut[list(ids)] = list(ids.values())
        own = ev["stack"]
        ev["stack"] = np.where(own < len(lut), lut[np.minimum(own, len(lut) - 1)], 0)
    elif len(ev):
        ev["stack"] = 0
    if host.pid_base:
        fork = (ev["kind"] == int(Kind.PROC_FORK)) & (ev["ptr"] != 0)
        ev["ptr"][fork] += host.pid_base  # a fork's ptr is the child's pid
    return ev


def _check_pids(host: Host, trace: Trace, path: str) -> None:
    top = max([int(trace.events["pid"].max()) if len(trace.events) else 0, *trace.processes.keys(), 0])
    if top >= PID_STRIDE:
        raise MergeError(f"{path}: pid {top} is beyond {PID_STRIDE - 1}: cannot number processes per host")


def _sort_ts(arr: np.ndarray) -> np.ndarray:
    return arr[np.argsort(arr["ts"], kind="stable")] if len(arr) > 1 else arr


@dataclass
class MergeResult:
    """What :func:`merge_traces` wrote."""

    path: Path
    hosts: list[dict]
    events: int
    clock_error_ns: int | None
    clock_error_why: str


def merge_traces(traces: list[tuple[str, Trace]], out: str | os.PathLike) -> MergeResult:
    """Write one trace joining ``traces`` (path, loaded trace) of one job; see the module docstring.

    Raises:
        MergeError: an input has no anchor, or pids too large to number per host.
        OSError: the output cannot be written.
    """
    hosts = group_hosts(traces)
    first_path, first_trace = hosts[0].traces[0]
    ref = _wall_minus_mono(first_path, first_trace.header)
    gpus: list[dict] = []
    for host in hosts:
        path, trace = host.traces[0]
        host.offset_ns = _wall_minus_mono(path, trace.header) - ref
        for path, trace in host.traces:
            _check_pids(host, trace, path)
        for own, info in _host_gpus(host).items():
            host.gpu_map[own] = len(gpus)
            label = f"{host.name}:{own}"
            gpus.append({**info, "index": len(gpus), "name": f"{label} {info.get('name') or ''}".strip(),
                         "total": int(info.get("total") or 0)})
    parts = [(host, trace) for host in hosts for _, trace in host.traces]
    stacks = StackInterner()  # every file's stacks, numbered once for the merged file
    events = _sort_ts(np.concatenate([_events(h, t, stacks) for h, t in parts]))
    nvml = _sort_ts(np.concatenate([_shifted(t.nvml, h) for h, t in parts]))
    procmem = _sort_ts(np.concatenate([_shifted(t.procmem, h, ("pid",)) for h, t in parts]))
    markers = sorted(
        (dataclasses.replace(m, ts=m.ts + h.offset_ns, pid=h.pid(m.pid), gpu=h.gpu(m.gpu))
         for h, t in parts for m in t.markers),
        key=lambda m: m.ts,
    )
    error_ns, why = expected_clock_error(hosts)
    host_docs = [
        {
            "index": h.index, "host": h.name, "boot_id": h.boot_id, "files": [os.fspath(p) for p, _ in h.traces],
            "pid_base": h.pid_base, "gpus": {str(m): own for own, m in h.gpu_map.items()},
            "offset_ns": h.offset_ns, "anchor": h.anchor, "clock_sync": _sync(h),
            "events": int(sum(len(t.events) for _, t in h.traces)),
            "lost": int(sum(t.lost for _, t in h.traces)),
            "complete": all(t.trailer is not None for _, t in h.traces),
        }
        for h in hosts
    ]
    header = make_header(
        host=",".join(h.name for h in hosts),
        boot_id=hosts[0].boot_id,
        anchor=dict(hosts[0].anchor),
        gpus=gpus,
        probes={h.name: h.traces[0][1].header.get("probes", {}) for h in hosts},
        config={},
        clock_sync=None,
        merged={"hosts": host_docs, "reference": hosts[0].name, "clock_error_ns": error_ns, "clock_error_why": why},
    )
    state = _initial_state(hosts)
    lost = sum(d["lost"] for d in host_docs)
    with TraceWriter(out, header, stacks=stacks) as writer:
        for h, t in parts:
            for info in t.processes.values():
                writer.write_process(_process(info, h))
        start_ts = int(events["ts"][0]) if len(events) else int(hosts[0].anchor["monotonic_ns"])
        writer.write_keyframe(start_ts, 0, state.snapshot())
        marker_i = 0
        for lo in range(0, max(len(events), 1), KEYFRAME_EVENTS):
            chunk = events[lo : lo + KEYFRAME_EVENTS]
            end_ts = int(chunk["ts"][-1]) if len(chunk) else start_ts
            while marker_i < len(markers) and markers[marker_i].ts <= end_ts:
                writer.write_marker(markers[marker_i])
                marker_i += 1
            state.apply(chunk)
            writer.write_events(chunk)
            if len(chunk):
                writer.write_keyframe(end_ts, None, state.snapshot())
        for marker in markers[marker_i:]:
            writer.write_marker(marker)
        if len(nvml):
            writer.write_nvml(nvml)
        if len(procmem):
            writer.write_procmem(procmem)
        if lost:
            writer.write_lost(int(events["ts"][-1]) if len(events) else start_ts, lost)
        writer.close({"reason": "merge", "hosts": len(hosts)})
    return MergeResult(Path(out), host_docs, int(len(events)), error_ns, why)


def _process(info: ProcessInfo, host: Host) -> ProcessInfo:
    return ProcessInfo(
        pid=host.pid(info.pid),
        ppid=host.pid(info.ppid) if info.ppid else info.ppid,
        cmdline=list(info.cmdline),
        exe=info.exe,
        cuda_visible_devices=info.cuda_visible_devices,
        gpu_map=[host.gpu(g) for g in info.gpu_map],
        first_ts=info.first_ts + host.offset_ns,
        rank={**info.rank, "host": host.index} if host.index else dict(info.rank),
        gpu_map_source=info.gpu_map_source,
    )
