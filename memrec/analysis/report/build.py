"""``memrec report``: per GPU, where the memory went, when, and who took it.

:func:`build_report` replays a :class:`memrec.trace.model.Trace` once and returns a
:class:`~memrec.analysis.report.model.Report` (typed sections; ``to_json()`` is ``report --json``);
:func:`memrec.analysis.report.text.render_text` turns it into fixed-width text. Byte counts are
exact ints; ``*_s`` fields are seconds since the trace start.

Per GPU: traced peak (and when) and final bytes, by category and by process; by phase where
markers exist; what each process still held when it exited (freed implicitly); every failed call
with who held what on that GPU at that instant; NVML beside it, and per NVML sample the traced
bytes of each process and of the GPU with the rest as "untraced" (:mod:`memrec.analysis.untraced.reconcile`,
section ``reconciliation``). "Traced" means owned memory the
probes saw (driver allocations + VMM physical); ``ipc_mapped`` is peers' memory mapped by a
process, shown in its view and never added to a GPU's total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from memrec.analysis.report.answer import Answer
from memrec.analysis.report.answer import build_answer
from memrec.analysis.names import api_name
from memrec.analysis.names import kind_name
from memrec.analysis.names import process_title
from memrec.analysis.names import result_name
from memrec.engine.phases import Phases
from memrec.engine.phases import Attribution
from memrec.engine.phases import UsageTable
from memrec.engine.phases import held_by_phase
from memrec.engine.journal import Journal
from memrec.analysis.untraced.reconcile import reconcile
from memrec.analysis.report.gpu import ReportContext
from memrec.analysis.report.gpu import gpu_section
from memrec.analysis.report.gpu import holding_row
from memrec.analysis.report.phase_rows import PhaseList
from memrec.analysis.report.phase_rows import PhaseTimes
from memrec.analysis.report.phase_rows import jsonable
from memrec.analysis.report.model import FailedCall
from memrec.analysis.report.model import HeldPhase
from memrec.analysis.report.model import HeldThen
from memrec.analysis.report.model import Holder
from memrec.analysis.report.model import InstantEntry
from memrec.analysis.report.model import ProcessEntry
from memrec.analysis.report.model import Report
from memrec.analysis.report.model import ReportFilter
from memrec.analysis.report.model import TraceSummary
from memrec.engine.replay import initial_state
from memrec.engine.replay import trace_bounds
from memrec.engine.replay import trace_phases
from memrec.analysis.sglang.section import build_sglang_section
from memrec.analysis.sglang.section import has_sglang_markers
from memrec.analysis.report.tensors import TensorFeed
from memrec.analysis.report.sites import SITES_JSON
from memrec.analysis.report.sites import SitesFeed
from memrec.analysis.report.sites import sites_feed
from memrec.analysis.text import seconds
from memrec.terms.ranks import pid_labels
from memrec.engine.replay import Timeline
from memrec.engine.replay import Replay
from memrec.engine.source import EventSource
from memrec.engine.source import TraceEvents
from memrec.engine.stream import KeptEvents
from memrec.engine.stream import replay_pass
from memrec.trace.model import GpuIds
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


def build_report(trace: Any, gpu: int | None = None, pid: int | None = None, all_sites: bool = False,
                 events: TraceEvents | None = None, phases: Phases | None = None) -> Report:
    """Replay ``trace`` and summarise it per GPU (:meth:`Report.to_json` is ``report --json``).

    Args:
        trace: a :class:`memrec.trace.model.Trace`; its ``event_columns["gpu"]`` are filled in where the
            replay knows them.
        gpu: only this GPU (-1: the host / unknown-GPU section).
        pid: only this process's memory (peaks, phases, exits, failed calls are its own; the
            holders at its failed calls still show every process on that GPU).
        all_sites: keep every allocation site of each phase (``report --all``), not the first
            :data:`~memrec.analysis.report.sites.SITES_JSON`.
        events: the trace's events when ``trace`` holds none (``memrec report`` reads them from
            the file a record at a time, :func:`memrec.engine.source.scan_trace`: its memory does
            not follow the events); default: ``trace.event_columns``.
        phases: the trace's phases (:func:`~memrec.engine.replay.trace_phases`) when the caller has
            them already (a view that draws them too: plot, the exports); built otherwise.
    """
    if events is None:
        events = TraceEvents.of(trace.event_columns)
    run = _replay(trace, events, gpu, pid, phases)
    procs = _processes(trace, run.tl, run.exits, events.census.pids)
    ctx = ReportContext(trace=trace, start=run.start, pid=pid, procs=procs, exits=run.exits,
                        usage=run.usage, exit_usage=run.exit_usage, phases=run.phases,
                        rec=reconcile(trace, run.tl, run.phases, events=run.kept.rows, pids=events.census.pids),
                        phase_s=PhaseTimes(run.phases.table, run.start))
    report = Report(
        memrec_report=REPORT_VERSION,
        filter=ReportFilter(gpu, pid),
        trace=_trace_summary(trace, run, gpu, pid, len(procs)),
        merged=merged_summary(trace.header),
        processes=[p for p in procs.values() if pid is None or p.pid == pid],
        gpus=[],
        host=None,
        phases=_phase_list(ctx.phase_s, pid),
        instants=_instant_list(run.phases, run.start, pid),
        failures_unknown_gpu=[],
    )
    failures_by_gpu = _place_failures(report, run, ctx)
    _add_gpu_sections(report, run, ctx, failures_by_gpu, events.gpu_ids)
    report.sglang = run.sglang
    report.tensors = run.tensors.section(trace.header, trace.trailer, pid=pid, gpu=gpu)
    if run.sites is not None:  # a trace with stacks (format 2.3); without, the report is as it was
        sites = run.sites.section(trace, limit=None if all_sites else SITES_JSON)
        if sites is not None:
            report.sites = sites
    _peak_by_phase(report, trace, run.tl, run.phases, events.source)
    report.answer = build_answer(report)
    return report


def trace_answer(trace: Any, events: TraceEvents | None = None, phases: Phases | None = None) -> Answer:
    """The answer ``memrec report`` prints first (:mod:`memrec.analysis.report.answer`), for the views
    that lead with it (TUI, plot, exports): built from the same report, so that they agree.
    ``events``, ``phases``: as :func:`build_report`'s (the TUI's events are read from the file; a
    view's :class:`~memrec.api.Recording` has the phases: not built twice, 25,000 of them)."""
    answer = build_report(trace, events=events, phases=phases).answer
    assert answer is not None  # build_report always sets it
    return answer


@dataclass
class _Replayed:
    """What one replay of the trace gives the report: the timeline, the failed calls (each with
    its GPU, ``(gpu, inferred)``, and the holders then), the exits and anomalies of the recording
    (not of a rotated file's predecessors), usage by phase and the SGLang section."""

    kept: KeptEvents
    n_events: int
    start: int
    end: int
    phases: Phases
    notes: list[str]
    tl: Timeline
    failed_idx: list[int]
    failed_gpu: dict[int, tuple[int, bool]]
    snapshots: dict[int, HeldThen]
    exits: list[dict]
    anomalies: dict[str, int]
    usage: UsageTable
    exit_usage: UsageTable
    sglang: dict | None
    tensors: TensorFeed
    sites: SitesFeed | None


def _replay(trace: Any, events: TraceEvents, gpu: int | None, pid: int | None, phases: Phases | None) -> _Replayed:
    """One pass over the events, a chunk at a time (:func:`memrec.engine.stream.replay_pass`):
    the live state's replay (its series, the holders at each failed call, usage by phase), the
    tensor section's replay, the allocation sites (with stacks), the failed calls' GPUs and the
    rows the sections keep."""
    census = events.census
    start, end = trace_bounds(trace, census)
    failed_idx: list[int] = []
    failed_gpu: dict[int, tuple[int, bool]] = {}
    last_gpu: dict[int, int] = {}  # pid -> the last GPU an event of it named (before the replay)
    snapshots: dict[int, HeldThen] = {}
    cache: dict[tuple[int, int], HeldThen] = {}
    if phases is None:
        phases = trace_phases(trace, census)

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
            exit_usage_of.add(journal.take(journal.exit_mask(replay.exits)))

    def stops(first: int, chunk: Batch) -> list[int]:
        failed = first + np.flatnonzero(failed_calls(chunk))
        failed_gpu.update(_failure_gpus(chunk, first, failed, last_gpu))
        failed_idx.extend(failed.tolist())
        return failed.tolist()

    # The journal (35 B a change) is attributed chunk by chunk as the replay goes and let go,
    # unless the SGLang section needs it whole.
    whole = has_sglang_markers(trace.markers)
    replay = Replay(census.n, start, initial, at_stop, None if whole else attribute_rows)
    tensors = TensorFeed(phases, start, census.tensor_events, census.tensor_pids,
                         trace.stacks if trace.stacks and census.stacked else None)
    sites = sites_feed(trace, events, phases, end, pid, gpu)
    kept = replay_pass(trace, events, replay, [tensors] if sites is None else [tensors, sites], stops)
    tl = replay.finish()
    if whole:
        attribute_rows(tl.journal)
    # The replay holds attribute_rows, which holds the replay (and the trace): without this the
    # trace, a marker object each, waited for a full collection of the cycle after the report.
    del replay
    anomalies = {
        k: v - prior_anomalies.get(k, 0) for k, v in sorted(tl.state.anomalies.items()) if v > prior_anomalies.get(k, 0)
    }
    usage = usage_of.table()
    # (the SGLang section reads the usage as objects: without SGLang's markers there is none)
    sglang = build_sglang_section(trace, phases, tl.journal, usage.rows() if whole else [], start, gpu=gpu, pid=pid,
                                  events=kept.rows)
    # Nothing after this reads the journal: its columns (35 B a change) go before the
    # reconciliation makes its temporaries (the report's peak memory on 10M events).
    tl.journal = tl.journal.take(np.zeros(len(tl.journal), dtype=bool))
    return _Replayed(kept, census.n, start, end, phases, notes, tl, failed_idx, failed_gpu, snapshots,
                     tl.state.exit_records()[prior_exits:], anomalies, usage, exit_usage_of.table(), sglang, tensors,
                     sites)


def _hosts_complete(header: dict) -> bool:
    """Whether every host's trace a merged trace was made of ended cleanly (True for one
    recording): `memrec merge` writes a trailer of its own, so a cut host's trace shows only here."""
    merged = merged_summary(header)
    return merged is None or all(h["complete"] is not False for h in merged["hosts"])


def _trace_summary(trace: Any, run: _Replayed, gpu: int | None, pid: int | None, processes: int) -> TraceSummary:
    pids = run.kept.rows["pid"]
    return TraceSummary(
        host=trace.header.get("host"),
        start_ts=run.start,
        end_ts=run.end,
        duration_s=seconds(run.end - run.start),
        events=run.n_events,
        failed_calls=sum(  # of the filter's selection
            1 for i in run.failed_idx
            if (pid is None or int(pids[run.kept.at(i)]) == pid) and (gpu is None or run.failed_gpu[i][0] == gpu)
        ),
        failed_calls_all=len(run.failed_idx),
        processes=processes,
        lost=int(trace.lost),
        complete=trace.trailer is not None and _hosts_complete(trace.header),
        warnings=list(trace.warnings) + run.notes,
        phase_warnings=list(run.phases.warnings),
        anomalies=run.anomalies,
        markers=len(trace.markers),
        nvml_samples=int(len(trace.nvml)),
    )


def _place_failures(report: Report, run: _Replayed, ctx: ReportContext) -> dict[int, list[FailedCall]]:
    """Each failed call of the filter's selection, with its phase, NVML's free bytes before it and
    (on a known GPU) the holders then: by GPU, or on the report's unknown-GPU list."""
    by_gpu: dict[int, list[FailedCall]] = {}
    rows = run.kept.rows
    for i in run.failed_idx:
        g, inferred = run.failed_gpu[i]
        at = run.kept.at(i)
        if ctx.pid is not None and int(rows["pid"][at]) != ctx.pid:
            continue
        f = _failure(rows, at, i, g, inferred, run.start, ctx.procs)
        f.phase = run.phases.label(run.phases.phase_at(f.pid, f.ts))
        f.nvml_free = _nvml_free_before(ctx.trace, g, f.ts)
        if g < 0 and not _is_host_kind(int(rows["kind"][at])):
            report.failures_unknown_gpu.append(f)
            continue
        f.held = run.snapshots[i]
        by_gpu.setdefault(g, []).append(f)
    return by_gpu


def _add_gpu_sections(report: Report, run: _Replayed, ctx: ReportContext,
                      failures_by_gpu: dict[int, list[FailedCall]], named: GpuIds) -> None:
    """A section per GPU the replay, the failed calls, the trace's GPU list or NVML saw (the
    filter's GPU only); GPU -1 (pinned host memory, unknown GPU) is the report's ``host``.
    ``named``: the GPUs the trace names (:meth:`memrec.trace.model.Trace.gpu_ids`)."""
    trace = ctx.trace
    gpu_ids = set(run.tl.gpus) | {g for g, _ in run.failed_gpu.values()}
    gpu_ids |= set(named.sorted())
    gpu_ids |= set(ctx.rec.gpus())
    gpu_info = {gi.index: gi for gi in trace.gpus}
    want = report.filter.gpu
    for g in sorted(gpu_ids):
        if want is not None and g != want:
            continue
        section = gpu_section(ctx, g, run.tl.gpus.get(g), gpu_info.get(g), failures_by_gpu.get(g, []))
        if section is None:
            continue
        if g < 0:
            report.host = section
        else:
            report.gpus.append(section)


def _peak_by_phase(report: Report, trace: Any, tl: Timeline, phases: Phases, source: EventSource) -> None:
    """What the GPU with the highest peak held at that peak, by phase (the answer's second line).

    One GPU only: the state there comes from the nearest keyframe and a replay of the rest (a
    second pass over the file from that keyframe's record on).
    """
    secs = [s for s in report.gpus if s.peak.bytes]
    if not secs:
        return
    sec = max(secs, key=lambda s: (s.peak.bytes, -s.gpu))
    series = tl.gpus[sec.gpu]
    _, _, row = series.peak(report.filter.pid)
    state = state_at(source, int(series.event_index[row]) + 1, trace.keyframes)
    sec.peak.by_phase = _held_by_phase(state, sec.gpu, phases, report.filter.pid)


def _is_host_kind(kind: int) -> bool:
    return kind in (Kind.HOST_ALLOC, Kind.HOST_FREE, Kind.HOST_REGISTER, Kind.HOST_UNREGISTER)


def _failure_gpus(events: Batch, first: int, failed: np.ndarray, last_gpu: dict[int, int]
                  ) -> dict[int, tuple[int, bool]]:
    """Each failed call's GPU among ``events`` (``first``: the index of the first; ``failed``:
    the failed calls' indexes): its own, else its process's last known GPU before it (inferred).
    ``last_gpu`` (pid -> the last GPU an event of it named, before these) is moved on past them.
    Read before the replay fills in the GPUs."""
    out: dict[int, tuple[int, bool]] = {}
    gpus = events["gpu"]
    pids = events["pid"]
    known = np.flatnonzero(gpus >= 0)
    known_pids = pids[known]
    per_pid: dict[int, np.ndarray] = {}
    for i in (failed - first).tolist():
        g = int(gpus[i])
        kind = int(events["kind"][i])
        if g >= 0 or _is_host_kind(kind):
            out[first + i] = (g if not _is_host_kind(kind) else -1, False)
            continue
        p = int(pids[i])
        if p not in per_pid:
            per_pid[p] = known[known_pids == p]
        idx = per_pid[p]
        k = int(np.searchsorted(idx, i)) - 1
        if k >= 0:
            out[first + i] = (int(gpus[idx[k]]), True)
        else:
            before = last_gpu.get(p)
            out[first + i] = (before, True) if before is not None else (-1, False)
    if len(known):  # each process's last known GPU: its last row among the known ones
        rev_pids = known_pids[::-1]
        uniq, last = np.unique(rev_pids, return_index=True)
        last_gpu.update(zip(uniq.tolist(), gpus[known[::-1][last]].tolist()))
    return out


def _holders_snapshot(state: LiveState, g: int, phases: Phases) -> HeldThen:
    return HeldThen(
        owned_on_gpu=state.owned_bytes(gpu=g),
        mapped_on_gpu=state.mapped_bytes(gpu=g),
        holders=[Holder(h["pid"], h["owned"], h["mapped"], h["by_category"], [holding_row(x) for x in h["largest"]])
                 for h in state.holders(g, n=HOLDER_LARGEST)],
        largest=[holding_row(h) for h in state.largest(g, GPU_LARGEST)],
        by_phase=_held_by_phase(state, g, phases),
    )


def _held_by_phase(state: LiveState, g: int, phases: Phases, pid: int | None = None, n: int = 5) -> list[HeldPhase]:
    """What ``g`` holds now (owned; of ``pid`` alone when given), by the phase that allocated each
    piece: the ``n`` largest (:func:`memrec.engine.phases.held_by_phase`, the TUI's cursor panel
    reads the same)."""
    return [HeldPhase(r.phase, r.bytes, list(r.pids)) for r in held_by_phase(state, g, phases, pid)[:n]]


def _nvml_free_before(trace: Any, g: int, ts: int) -> int | None:
    """NVML's free bytes on ``g`` at the last sample at or before ``ts`` (None without one)."""
    nv = trace.nvml
    if not len(nv) or g < 0:
        return None
    s = nv[(nv["gpu"] == g) & (nv["ts"] <= ts) & (nv["free"] >= 0)]
    if not len(s):
        return None
    return int(s["free"][np.argmax(s["ts"])])


def _failure(events: Any, at: int, i: int, g: int, inferred: bool, start: int,
             procs: dict[int, ProcessEntry]) -> FailedCall:
    """The failed call ``i`` (the trace's event index), row ``at`` of ``events``."""
    e = events[at]
    p = int(e["pid"])
    kind = int(e["kind"])
    proc = procs.get(p)
    return FailedCall(
        index=i,
        ts=int(e["ts"]),
        t_s=seconds(int(e["ts"]) - start),
        pid=p,
        tid=int(e["tid"]),
        process=proc.short if proc else "",
        kind=kind_name(kind),
        api=api_name(int(e["api"])),
        size=int(e["size"]),
        result=int(e["result"]),
        result_name=result_name(int(e["result"])),
        gpu=g,
        gpu_inferred=inferred,
    )


def _processes(trace: Any, tl: Timeline, exit_records: list[dict], event_pids: list[int]) -> dict[int, ProcessEntry]:
    pids = set(trace.processes) | {p for s in tl.gpus.values() for p in s.pids()} | set(event_pids)
    exits = {r["pid"]: r["ts"] for r in exit_records}
    ranks = pid_labels(trace.markers, trace.processes)  # "TP0" from the markers' tp/pp/dp_rank, else ProcessInfo.rank
    gpus_of: dict[int, list[int]] = {}
    for g in sorted(tl.gpus):
        for p in tl.gpus[g].pids():
            gpus_of.setdefault(p, []).append(g)
    # One title per command line: a host's 100,000 workers share a few (issue 26).
    titles: dict[tuple[str, ...], str] = {}
    out = {}
    for p in sorted(pids):
        info = trace.processes.get(p)
        if info is None:
            short, cmdline = "", []
        else:
            cmdline = list(info.cmdline)
            key = tuple(cmdline)
            short = titles.get(key)
            if short is None:
                short = titles[key] = process_title(info)
        out[p] = ProcessEntry(
            pid=p,
            ppid=info.ppid if info else None,
            short=short,
            cmdline=cmdline,
            rank=ranks.get(p, ""),
            cuda_visible_devices=info.cuda_visible_devices if info else None,
            gpus=gpus_of.get(p, []),
            exit_ts=exits.get(p),
        )
    return out


def _phase_list(times: PhaseTimes, pid: int | None) -> PhaseList:
    """The phases (``pid``'s only, when given), each made a row when read."""
    ids = np.arange(len(times.table)) if pid is None else np.flatnonzero(times.table.pid == pid)
    return PhaseList(times, ids)


def _instant_list(phases: Phases, start: int, pid: int | None) -> list[InstantEntry]:
    return [
        InstantEntry(pid=i.pid, name=i.name, ts=i.ts, t_s=seconds(i.ts - start), phase=phases.label(i.phase),
                     gpu=i.gpu, values=jsonable(i.values))
        for i in phases.instants
        if pid is None or i.pid == pid
    ]
