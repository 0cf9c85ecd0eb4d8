"""``memrec report``: per GPU, where the memory went, when, and who took it.

:func:`build_report` replays a :class:`memrec.trace.model.Trace` once and returns a JSON-able dict
(plain ints, floats, strings, lists, dicts with string keys); :func:`render_text` turns it into
fixed-width text. Byte counts are exact ints; ``*_s`` fields are seconds since the trace start.

Per GPU: traced peak (and when) and final bytes, by category and by process; by phase where
markers exist; what each process still held when it exited (freed implicitly); every failed call
with who held what on that GPU at that instant; NVML beside it, and per NVML sample the traced
bytes of each process and of the GPU with the rest as "untraced" (:mod:`memrec.analysis.reconcile`,
section ``reconciliation``). "Traced" means owned memory the
probes saw (driver allocations + VMM physical); ``ipc_mapped`` is peers' memory mapped by a
process, shown in its view and never added to a GPU's total.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memrec.analysis.answer import Answer
from memrec.analysis.answer import build_answer
from memrec.analysis.names import api_name
from memrec.analysis.names import process_title
from memrec.analysis.names import result_name
from memrec.engine.phases import Phases
from memrec.engine.phases import Attribution
from memrec.engine.phases import held_by_phase
from memrec.engine.group import distinct
from memrec.engine.journal import Journal
from memrec.analysis.reconcile import reconcile
from memrec.analysis.report_gpu import gpu_section
from memrec.analysis.report_gpu import holding_json
from memrec.engine.replay import initial_state
from memrec.engine.replay import trace_bounds
from memrec.engine.replay import trace_phases
from memrec.analysis.sglang_report import build_sglang_section
from memrec.analysis.sglang_report import has_sglang_markers
from memrec.analysis.sites import sites_section
from memrec.analysis.tensors import tensor_section
from memrec.analysis.text import seconds
from memrec.terms.ranks import pid_labels
from memrec.engine.replay import Timeline
from memrec.engine.replay import build_timeline
from memrec.engine.replay import state_at
from memrec.terms.columns import failed_calls
from memrec.terms.events import Kind
from memrec.state import LiveState
from memrec.state.batch import Batch
from memrec.analysis.merge_text import merged_summary

REPORT_VERSION = 1
#: How many holders' largest allocations the snapshot at a failed call lists, and how many on the GPU.
HOLDER_LARGEST = 3
GPU_LARGEST = 5



# ----------------------------------------------------------------------------------------- build


def build_report(trace: Any, gpu: int | None = None, pid: int | None = None) -> dict:
    """Replay ``trace`` and summarise it per GPU (JSON-able).

    Args:
        trace: a :class:`memrec.trace.model.Trace`; its ``event_columns["gpu"]`` are filled in where the
            replay knows them.
        gpu: only this GPU (-1: the host / unknown-GPU section).
        pid: only this process's memory (peaks, phases, exits, failed calls are its own; the
            holders at its failed calls still show every process on that GPU).
    """
    events = Batch.of(trace.event_columns)  # the loaded columns, never the 130-byte rows
    start, end = trace_bounds(trace)
    n = len(events)
    kinds = events["kind"] if n else np.zeros(0, np.uint16)
    failed_idx = np.nonzero(failed_calls(events))[0].tolist() if n else []
    failed_gpu = _failure_gpus(events, failed_idx)

    snapshots: dict[int, dict] = {}
    cache: dict[tuple[int, int], dict] = {}
    phases = trace_phases(trace)

    def at_stop(index: int, state: LiveState, changes: int) -> None:
        g = failed_gpu[index][0]
        # The journal grows with every change: failed calls in a row with nothing in between
        # see the same state, computed once.
        key = (changes, g)
        snap = cache.get(key)
        if snap is None:
            cache.clear()
            snap = cache[key] = _holders_snapshot(state, g, phases)
        snapshots[index] = snap

    initial, notes = initial_state(trace)
    prior_exits = len(initial.exit_records()) if initial is not None else 0
    prior_anomalies = dict(initial.anomalies) if initial is not None else {}
    usage_of, exit_usage_of = Attribution(phases), Attribution(phases)

    def attribute_rows(journal: Journal) -> None:
        if trace.markers:
            usage_of.add(journal)
            exit_usage_of.add(journal.take(journal.exit_mask(events)))

    # The journal (35 B a change) is attributed chunk by chunk as the replay goes and let go,
    # unless the SGLang section needs it whole.
    whole = has_sglang_markers(trace.markers)
    tl = build_timeline(events, start=start, state=initial, stops=failed_idx, at_stop=at_stop,
                        on_journal=None if whole else attribute_rows)
    if whole:
        attribute_rows(tl.journal)
    exits = tl.state.exit_records()[prior_exits:]
    anomalies = {
        k: v - prior_anomalies.get(k, 0) for k, v in sorted(tl.state.anomalies.items()) if v > prior_anomalies.get(k, 0)
    }
    usage, exit_usage = usage_of.usage(), exit_usage_of.usage()
    sglang = build_sglang_section(trace, phases, tl.journal, usage, start, gpu=gpu, pid=pid)
    # Nothing below reads the journal: its columns (35 B a change) go before the reconciliation
    # makes its temporaries (the report's peak memory on 10M events).
    tl.journal = tl.journal.take(np.zeros(len(tl.journal), dtype=bool))
    procs = _processes(trace, tl, exits)
    rec = reconcile(trace, tl, phases)

    gpu_ids = set(tl.gpus) | {g for g, _ in failed_gpu.values()}
    gpu_ids |= set(trace.gpu_ids())
    gpu_ids |= set(rec.gpus())
    gpu_info = {gi.index: gi for gi in trace.gpus}

    report: dict = {
        "memrec_report": REPORT_VERSION,
        "filter": {"gpu": gpu, "pid": pid},
        "trace": {
            "host": trace.header.get("host"),
            "start_ts": start,
            "end_ts": end,
            "duration_s": seconds(end - start),
            "events": n,
            "failed_calls": sum(  # of the filter's selection
                1 for i in failed_idx
                if (pid is None or int(events["pid"][i]) == pid) and (gpu is None or failed_gpu[i][0] == gpu)
            ),
            "failed_calls_all": len(failed_idx),
            "processes": len(procs),
            "lost": int(trace.lost),
            "complete": trace.trailer is not None,
            "warnings": list(trace.warnings) + notes,
            "phase_warnings": list(phases.warnings),
            "anomalies": anomalies,
            "markers": len(trace.markers),
            "nvml_samples": int(len(trace.nvml)),
        },
        "merged": merged_summary(trace.header),
        "processes": [p for p in procs.values() if pid is None or p["pid"] == pid],
        "gpus": [],
        "host": None,
        "phases": _phase_list(phases, start, pid),
        "instants": [
            {"pid": i.pid, "name": i.name, "ts": i.ts, "t_s": seconds(i.ts - start), "phase": phases.label(i.phase),
             "gpu": i.gpu, "values": _jsonable(i.values)}
            for i in phases.instants
            if pid is None or i.pid == pid
        ],
        "failures_unknown_gpu": [],
    }
    failures_by_gpu: dict[int, list[dict]] = {}
    for i in failed_idx:
        g, inferred = failed_gpu[i]
        if pid is not None and int(events["pid"][i]) != pid:
            continue
        f = _failure(events, i, g, inferred, start, procs)
        f["phase"] = phases.label(phases.phase_at(f["pid"], f["ts"]))
        f["nvml_free"] = _nvml_free_before(trace, g, f["ts"])
        if g < 0 and not _is_host_kind(int(kinds[i])):
            report["failures_unknown_gpu"].append(f)
            continue
        f.update(snapshots[i])
        failures_by_gpu.setdefault(g, []).append(f)

    for g in sorted(gpu_ids):
        if gpu is not None and g != gpu:
            continue
        section = gpu_section(
            g, tl.gpus.get(g), gpu_info.get(g), start, pid, procs, exits, (usage, exit_usage), phases,
            failures_by_gpu.get(g, []), trace, rec,
        )
        if section is None:
            continue
        if g < 0:
            report["host"] = section
        else:
            report["gpus"].append(section)
    report["sglang"] = sglang
    report["tensors"] = tensor_section(events, phases, start, trace.header, trace.trailer, pid=pid, gpu=gpu)
    sites = sites_section(trace, phases, pid=pid, gpu=gpu, end_ts=end)
    if sites is not None:  # a trace with stacks (format 2.3); without, the report is as it was
        report["sites"] = sites.to_json()
    _peak_by_phase(report, trace, tl, phases)
    report["answer"] = build_answer(report).to_json()
    return report


def trace_answer(trace: Any) -> Answer:
    """The answer ``memrec report`` prints first (:mod:`memrec.analysis.answer`), for the views
    that lead with it (TUI, plot, exports): built from the same report, so that they agree."""
    return Answer.from_json(build_report(trace)["answer"])


def _peak_by_phase(report: dict, trace: Any, tl: Timeline, phases: Phases) -> None:
    """What the GPU with the highest peak held at that peak, by phase (the answer's second line).

    One GPU only: the state there comes from the nearest keyframe and a replay of the rest.
    """
    secs = [s for s in report["gpus"] if s.get("peak") and s["peak"]["bytes"]]
    if not secs:
        return
    sec = max(secs, key=lambda s: (s["peak"]["bytes"], -s["gpu"]))
    series = tl.gpus[sec["gpu"]]
    _, _, row = series.peak(report["filter"]["pid"])
    state = state_at(tl.events, int(series.event_index[row]) + 1, trace.keyframes)
    sec["peak"]["by_phase"] = _held_by_phase(state, sec["gpu"], phases)


def _is_host_kind(kind: int) -> bool:
    return kind in (Kind.HOST_ALLOC, Kind.HOST_FREE, Kind.HOST_REGISTER, Kind.HOST_UNREGISTER)


def _failure_gpus(events: np.ndarray, failed_idx: list[int]) -> dict[int, tuple[int, bool]]:
    """Each failed call's GPU: its own, else its process's last known GPU before it (inferred)."""
    out: dict[int, tuple[int, bool]] = {}
    if not failed_idx:
        return out
    gpus = events["gpu"]
    pids = events["pid"]
    known = np.nonzero(gpus >= 0)[0]
    known_pids = pids[known]
    per_pid: dict[int, np.ndarray] = {}
    for i in failed_idx:
        g = int(gpus[i])
        kind = int(events["kind"][i])
        if g >= 0 or _is_host_kind(kind):
            out[i] = (g if not _is_host_kind(kind) else -1, False)
            continue
        p = int(pids[i])
        if p not in per_pid:
            per_pid[p] = known[known_pids == p]
        idx = per_pid[p]
        k = int(np.searchsorted(idx, i)) - 1
        out[i] = (int(gpus[idx[k]]), True) if k >= 0 else (-1, False)
    return out


def _holders_snapshot(state: LiveState, g: int, phases: Phases) -> dict:
    return {
        "owned_on_gpu": state.owned_bytes(gpu=g),
        "mapped_on_gpu": state.mapped_bytes(gpu=g),
        "holders": [holding_json(h) for h in state.holders(g, n=HOLDER_LARGEST)],
        "largest": [holding_json(h._asdict()) for h in state.largest(g, GPU_LARGEST)],
        "by_phase": _held_by_phase(state, g, phases),
    }


def _held_by_phase(state: LiveState, g: int, phases: Phases, n: int = 5) -> list[dict]:
    """What ``g`` holds now (owned), by the phase that allocated each piece: the ``n`` largest
    (:func:`memrec.engine.phases.held_by_phase`, the TUI's cursor panel reads the same)."""
    return [{"phase": r.phase, "bytes": r.bytes, "pids": list(r.pids)} for r in held_by_phase(state, g, phases)[:n]]


def _nvml_free_before(trace: Any, g: int, ts: int) -> int | None:
    """NVML's free bytes on ``g`` at the last sample at or before ``ts`` (None without one)."""
    nv = trace.nvml
    if not len(nv) or g < 0:
        return None
    s = nv[(nv["gpu"] == g) & (nv["ts"] <= ts) & (nv["free"] >= 0)]
    if not len(s):
        return None
    return int(s["free"][np.argmax(s["ts"])])


def _failure(events: np.ndarray, i: int, g: int, inferred: bool, start: int, procs: dict) -> dict:
    e = events[i]
    p = int(e["pid"])
    kind = int(e["kind"])
    return {
        "index": i,
        "ts": int(e["ts"]),
        "t_s": seconds(int(e["ts"]) - start),
        "pid": p,
        "tid": int(e["tid"]),
        "process": procs.get(p, {}).get("short", ""),
        "kind": Kind(kind).name if kind in Kind._value2member_map_ else str(kind),
        "api": api_name(int(e["api"])),
        "size": int(e["size"]),
        "result": int(e["result"]),
        "result_name": result_name(int(e["result"])),
        "gpu": g,
        "gpu_inferred": inferred,
    }


def _processes(trace: Any, tl: Timeline, exit_records: list[dict]) -> dict[int, dict]:
    pids = set(trace.processes) | {p for s in tl.gpus.values() for p in s.pids()}
    if len(trace.event_columns):
        pids |= set(distinct(trace.event_columns["pid"]))
    exits = {r["pid"]: r["ts"] for r in exit_records}
    ranks = pid_labels(trace.markers, trace.processes)  # "TP0" from the markers' tp/pp/dp_rank, else ProcessInfo.rank
    gpus_of: dict[int, set[int]] = {}
    for g, s in tl.gpus.items():
        for p in s.pids():
            gpus_of.setdefault(p, set()).add(g)
    out = {}
    for p in sorted(pids):
        info = trace.processes.get(p)
        out[p] = {
            "pid": p,
            "ppid": info.ppid if info else None,
            "short": process_title(info),
            "cmdline": list(info.cmdline) if info else [],
            "rank": ranks.get(p, ""),
            "cuda_visible_devices": info.cuda_visible_devices if info else None,
            "gpus": sorted(gpus_of.get(p, ())),
            "exit_ts": exits.get(p),
        }
    return out


def _phase_list(phases: Phases, start: int, pid: int | None) -> list[dict]:
    return [
        {
            "id": ph.id,
            "pid": ph.pid,
            "name": ph.name,
            "path": ph.path,
            "depth": ph.depth,
            "start_ts": ph.start,
            "end_ts": ph.end,
            "start_s": seconds(ph.start - start),
            "end_s": seconds(ph.end - start),
            "closed": ph.closed,
            "gpu": ph.gpu,
            "values": _jsonable(ph.values),
        }
        for ph in phases.phases
        if pid is None or ph.pid == pid
    ]


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).hex()
    if isinstance(v, np.generic):
        return v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)
