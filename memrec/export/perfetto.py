"""A Perfetto trace (``.pftrace``) of a recording, written with the ``perfetto`` package's trace builder.

What opens in ui.perfetto.dev:

- per GPU a group of counter tracks: one per category (``GPU 0 driver``, ``GPU 0 vmm``,
  ``GPU 0 ipc_mapped``; the host's ``host_pinned``), and NVML's ``used`` and ``reserved``;
- per process (named by rank and title) a counter of the bytes it owns on each GPU
  (``held on GPU 0``), its phases as nested slices (marker values as arguments) with its instant
  markers, its failed driver calls as instants named by their result
  (``CUDA_ERROR_OUT_OF_MEMORY``, with api, size and GPU as arguments), and its IPC calls: each
  ``cuIpcOpenMemHandle_v2`` is the end of a flow that starts at the exporter's
  ``cuIpcGetMemHandle`` of the same 64 handle bytes.

Timestamps are the trace's own (CLOCK_MONOTONIC ns). Packets are streamed to the file one by one
(the builder's streaming mode): memory stays in proportion to one GPU's series, not the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from memrec._files import create_file
from memrec.analysis.names import api_name
from memrec.analysis.names import process_title
from memrec.analysis.names import result_name
from memrec.events import OWNED
from memrec.api import Recording
from memrec.columns import failed_calls
from memrec.engine.ipc import IpcOpens
from memrec.export import require

#: Every packet comes from one writer: one trusted sequence.
SEQUENCE_ID = 1


class _Writer:
    """Track uuids and packets on one stream (the perfetto package's StreamingTraceProtoBuilder)."""

    def __init__(self, f: Any) -> None:
        builder_mod = require("perfetto.trace_builder.proto_builder", "export", "--to perfetto")
        pb = require("perfetto.protos.perfetto.trace.perfetto_trace_pb2", "export", "--to perfetto")
        self.pb = pb
        self.builder = builder_mod.StreamingTraceProtoBuilder(f)
        self.next_uuid = 1
        self.first = True
        self.counts = {"tracks": 0, "counter_values": 0, "slices": 0, "instants": 0, "flows": 0}

    def packet(self) -> Any:
        p = self.builder.create_packet()
        p.trusted_packet_sequence_id = SEQUENCE_ID
        if self.first:
            p.sequence_flags = self.pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            self.first = False
        return p

    def track(self, name: str, parent: int = 0, counter: bool = False, pid: int | None = None) -> int:
        """Declare a track (a process track when ``pid`` is given) and return its uuid."""
        uuid = self.next_uuid
        self.next_uuid += 1
        p = self.packet()
        d = p.track_descriptor
        d.uuid = uuid
        if parent:
            d.parent_uuid = parent
        if pid is not None:
            if 0 <= pid < 2**31:  # (perfetto's pid is an int32; a merge of many hosts goes past it)
                d.process.pid = pid
            d.process.process_name = name
        else:
            d.name = name
        if counter:
            d.counter.unit = self.pb.CounterDescriptor.UNIT_SIZE_BYTES
        self.builder.write_packet(p)
        self.counts["tracks"] += 1
        return uuid

    def counter(self, track: int, ts: np.ndarray, values: np.ndarray) -> None:
        """Counter values at each change (repeats of the previous value left out)."""
        keep = np.ones(len(values), dtype=bool)
        keep[1:] = values[1:] != values[:-1]
        for t, v in zip(ts[keep].tolist(), values[keep].tolist()):
            p = self.packet()
            p.timestamp = int(t)
            e = p.track_event
            e.type = self.pb.TrackEvent.TYPE_COUNTER
            e.track_uuid = track
            e.counter_value = int(v)
            self.builder.write_packet(p)
            self.counts["counter_values"] += 1

    def event(self, track: int, ts: int, kind: str, name: str = "", args: dict | None = None,
              flows: list[int] = (), ends_flows: list[int] = ()) -> None:
        """A slice begin/end or an instant, with debug arguments and flow ids."""
        p = self.packet()
        p.timestamp = int(ts)
        e = p.track_event
        e.type = getattr(self.pb.TrackEvent, kind)
        e.track_uuid = track
        if name:
            e.name = name
        for k, v in (args or {}).items():
            _annotate(e.debug_annotations.add(), k, v)
        e.flow_ids.extend(flows)
        e.terminating_flow_ids.extend(ends_flows)
        self.builder.write_packet(p)
        if kind == "TYPE_SLICE_BEGIN":
            self.counts["slices"] += 1
        elif kind == "TYPE_INSTANT":
            self.counts["instants"] += 1
        self.counts["flows"] += len(ends_flows)


def _annotate(a: Any, key: str, value: Any) -> None:
    a.name = str(key)
    if isinstance(value, bool):
        a.bool_value = value
    elif isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        a.int_value = value
    elif isinstance(value, float):
        a.double_value = value
    else:
        a.string_value = str(value)


def write_perfetto(rec: Recording, path: Path) -> dict[str, int]:
    """Write ``rec`` as a Perfetto trace at ``path``; return how many tracks, values, slices... it has."""
    with create_file(path) as f:
        w = _Writer(f)
        _gpu_tracks(w, rec)
        _process_tracks(w, rec)
    return w.counts


def _gpu_tracks(w: _Writer, rec: Recording) -> None:
    info = {g.index: g for g in rec.trace.gpus}
    nv = rec.trace.nvml
    gpus = sorted(set(rec.timeline.gpus) | set(np.unique(nv["gpu"]).tolist()))
    for g in gpus:
        label = f"GPU {g}" if g >= 0 else "host"
        title = f"{label} {info[g].name}" if g in info else label
        parent = w.track(title if g >= 0 else "host (pinned memory) and unknown GPU")
        series = rec.timeline.gpus.get(g)
        if series is not None:
            for category, values in series.by_category().items():
                w.counter(w.track(f"{label} {category}", parent, counter=True), series.ts, values)
        s = nv[nv["gpu"] == g]
        s = s[np.argsort(s["ts"], kind="stable")]
        for field in ("used", "reserved"):
            ok = s[field] >= 0
            if ok.any():
                w.counter(w.track(f"{label} NVML {field}", parent, counter=True), s["ts"][ok], s[field][ok])


def _process_tracks(w: _Writer, rec: Recording) -> None:
    ev = rec.timeline.events
    phases = rec.phases
    pids = sorted(
        {int(p) for p in np.unique(ev["pid"])} | {ph.pid for ph in phases.phases} | {i.pid for i in phases.instants}
    )
    flows_out, flows_in = _ipc_flows(rec.ipc_opens)
    failed = np.nonzero(failed_calls(ev))[0]
    for pid in pids:
        title = process_title(rec.trace.processes.get(pid), rec.ranks.get(pid, "")) or f"pid {pid}"
        proc = w.track(title, pid=pid)
        for g, series in sorted(rec.timeline.gpus.items()):
            if pid in series.pids():
                where = f"GPU {g}" if g >= 0 else "host"
                w.counter(w.track(f"held on {where}", proc, counter=True), series.ts, series.series(pid, OWNED))
        _phase_slices(w, rec, pid, proc)
        mine = failed[ev["pid"][failed] == pid]
        if len(mine):
            track = w.track("failed calls", proc)
            for i in mine.tolist():
                e = ev[i]
                args = {"api": api_name(int(e["api"])), "size": int(e["size"]), "gpu": int(e["gpu"]),
                        "result": int(e["result"])}
                w.event(track, int(e["ts"]), "TYPE_INSTANT", result_name(int(e["result"])), args)
        ipc = [i for i in sorted(set(flows_out) | set(flows_in)) if int(ev["pid"][i]) == pid]
        if ipc:
            track = w.track("IPC", proc)
            for i in ipc:
                e = ev[i]
                args = {"ptr": f"{int(e['ptr']):#x}", "gpu": int(e["gpu"])}
                w.event(track, int(e["ts"]), "TYPE_INSTANT", api_name(int(e["api"])), args,
                        flows=flows_out.get(i, []), ends_flows=flows_in.get(i, []))


def _phase_slices(w: _Writer, rec: Recording, pid: int, proc: int) -> None:
    mine = [ph for ph in rec.phases.phases if ph.pid == pid]
    instants = [i for i in rec.phases.instants if i.pid == pid]
    if not mine and not instants:
        return
    track = w.track("phases", proc)
    points: list[tuple] = []  # (ts, order, tie, kind, name, args): ends before begins at one time
    for ph in mine:
        points.append((ph.start, 1, ph.id, "TYPE_SLICE_BEGIN", ph.name, ph.values))
        # A phase that ends at its own start must end after its begin; otherwise inner ends first.
        points.append((ph.end, 2 if ph.end == ph.start else 0, -ph.depth, "TYPE_SLICE_END", "", None))
    for n, i in enumerate(instants):
        points.append((i.ts, 1, 1 << 40 | n, "TYPE_INSTANT", i.name, i.values))
    for ts, _, _, kind, name, args in sorted(points, key=lambda p: p[:3]):
        w.event(track, ts, kind, name, args)


def _ipc_flows(opens: IpcOpens) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Flows from each export to each open of the same handle bytes (:mod:`memrec.engine.ipc`):
    event index -> flow ids it starts, and -> flow ids it ends."""
    out: dict[int, list[int]] = {}
    into: dict[int, list[int]] = {}
    next_id = 1
    for i in np.nonzero(opens.source >= 0)[0].tolist():
        src = int(opens.source[i])
        out.setdefault(src, []).append(next_id)
        into.setdefault(i, []).append(next_id)
        next_id += 1
    return out, into
