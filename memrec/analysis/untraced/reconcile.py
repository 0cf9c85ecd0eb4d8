"""NVML vs traced: memrec's numbers beside the GPU's own, and the rest explained as "untraced".

For every NVML per-process sample (a ``procmem`` row: one process's used memory on one GPU), the
*traced* bytes are what that process owned on that GPU at the sample's ``ts`` according to the
replay (driver allocations + VMM physical, ``ipc_mapped`` left out: a peer's memory is counted at
its owner). The difference is the explicit **untraced** band of that process::

    untraced = NVML used - traced

memory the driver API calls memrec sees do not account for. :mod:`memrec.analysis.untraced.split` splits
it into context | module code | pools | before recording | unexplained (``splits``, and every
context bound with its cost in ``contexts``); the rest is the allocator's page rounding (the
driver hands out 2 MiB pages; memrec counts the bytes asked) and whatever no probed call explains.

For every NVML device sample the same is done for the whole GPU: NVML ``used`` beside the owned
total of every process memrec traced on it, ``untraced = used - traced`` (other processes memrec did
not record, every process's untraced band, the driver's own use), with NVML ``reserved`` beside it
(nvmlMemory_v2: memory the driver/firmware set aside, *not* part of ``used``; -1 when only v1
was available, where ``used`` includes it).

Negative untraced (traced > NVML) is kept, never clipped, and counted (``negative_samples``): it
happens when memrec counts bytes that are not resident (VMM handles created but not backed yet,
managed memory not touched), or when a sample was taken between a driver call and NVML noticing
it (the sample's ``ts`` is when the sampler's tick started; the call itself may take milliseconds).

The lookup is "the state after every event at or before ``ts``" (:meth:`GpuSeries.index_at`),
vectorised with ``np.searchsorted`` over one replay's step series: no replay per sample.
Samples whose NVML value was unavailable (-1) are left out of the arrays and counted
(``unavailable``).

A process's samples taken at or after its recorded exit (``PROC_EXIT``) stay in the arrays but are
left out of the summary (``after_exit_samples``): the driver tears a context down some time after
the process exits (tens of ms were measured on an H200), so NVML still lists the process with all
of its memory while memrec has already freed it; that is not memory memrec missed. Device samples
have the same lag (``used`` stays up for a while after an exit) and are not corrected.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any

import numpy as np

from memrec.analysis.sections import OMITTED
from memrec.analysis.sections import Section
from memrec.analysis.text import seconds
from memrec.engine.group import distinct
from memrec.engine.replay import initial_state
from memrec.engine.replay import trace_phases
from memrec.engine.series import GpuSeries
from memrec.engine.replay import Timeline
from memrec.engine.replay import build_timeline
from memrec.analysis.untraced.split import SEVERAL
from memrec.analysis.untraced.split import SPLIT
from memrec.analysis.untraced.split import ContextRecord
from memrec.analysis.untraced.split import Explainers
from memrec.analysis.untraced.split import UntracedSplit
from memrec.analysis.untraced.split import contexts
from memrec.analysis.untraced.split import pool_held
from memrec.analysis.untraced.split import explained_share
from memrec.analysis.untraced.split import split_process
from memrec.terms.events import Kind
from memrec.terms.events import OWNED

#: Steps listed per process in a summary (the largest first); the totals hold every step.
MAX_STEPS = 12


class _Samples:
    """What both series share: ``ts`` and ``untraced`` arrays, one entry per NVML sample."""

    ts: np.ndarray
    untraced: np.ndarray

    @property
    def negative(self) -> np.ndarray:
        """Mask of the samples where traced > NVML used."""
        return self.untraced < 0

    def __len__(self) -> int:
        return len(self.ts)


@dataclass
class ProcessSeries(_Samples):
    """One process on one GPU: each NVML per-process sample beside the traced owned bytes.

    Arrays are int64, one entry per sample NVML gave a value for, in time order (samples after
    the process's recorded exit included: :attr:`live` masks them out).
    """

    gpu: int
    pid: int
    ts: np.ndarray
    nvml_used: np.ndarray
    traced: np.ndarray
    untraced: np.ndarray  # nvml_used - traced; negative where traced > NVML (kept, not clipped)
    unavailable: int = 0  # samples NVML listed the process in without a value (left out)
    recorded: bool = True  # memrec recorded events of this process (False: NVML alone knows it)
    exit_ts: int | None = None  # the process's recorded exit (PROC_EXIT), if any

    @property
    def live(self) -> np.ndarray:
        """Mask of the samples taken before the process's recorded exit (all of them without one)."""
        if self.exit_ts is None:
            return np.ones(len(self.ts), dtype=bool)
        return self.ts < self.exit_ts


@dataclass
class DeviceSeries(_Samples):
    """One GPU: each NVML device sample beside the owned total of every traced process.

    Arrays are int64, one entry per sample with an NVML ``used`` value, in time order;
    ``reserved`` is -1 where NVML could not say (nvmlDeviceGetMemoryInfo v1).
    """

    gpu: int
    ts: np.ndarray
    used: np.ndarray
    reserved: np.ndarray
    traced: np.ndarray
    untraced: np.ndarray  # used - traced; negative where traced > NVML (kept, not clipped)
    unavailable: int = 0


# ------------------------------------------------------------------- one GPU's summary, typed


@dataclass
class UntracedStep(Section):
    """One step of a process's untraced band: when, how many bytes, the category and the call
    that explains it (``cause``, None: unexplained), the phase and the library (module code)."""

    ts: int
    bytes: int
    category: str
    cause: str | None
    cause_ts: int | None
    phase: str
    library: str | None
    #: Seconds since the trace's start, set by the report (absent from :meth:`Reconciliation.summary`).
    t_s: float | None = OMITTED
    cause_t_s: float | None = OMITTED


@dataclass
class PhaseSplit:
    """The untraced steps of one phase, summed per split category (keys :data:`SPLIT`)."""

    phase: str
    split: dict[str, int]

    def to_json(self) -> dict:
        return {"phase": self.phase, **self.split}


@dataclass
class NvmlProcess(Section):
    """One process NVML listed on a GPU: its numbers over the samples taken before its recorded
    exit (``samples``; those after it only counted, ``after_exit_samples``), None without any.
    ``split`` is the untraced band's split at the last of them (keys :data:`SPLIT`); the fields
    after ``explained_share`` are there only with a split."""

    pid: int
    recorded: bool
    samples: int
    unavailable: int
    after_exit_samples: int
    exit_ts: int | None
    last_ts: int | None = None
    nvml_used_last: int | None = None
    traced_last: int | None = None
    untraced_last: int | None = None
    untraced_min: int | None = None
    untraced_median: int | None = None
    untraced_max: int | None = None
    untraced_max_ts: int | None = None
    negative_samples: int = 0
    split: dict[str, int] | None = None
    explained_share: float | None = None
    unexplained_max_abs: int = OMITTED
    split_by_phase: list[PhaseSplit] = OMITTED
    module_code_by_library: dict[str, int] = OMITTED
    #: The largest steps up to the last sample (:data:`MAX_STEPS`), in time order.
    steps: list[UntracedStep] = OMITTED
    last_t_s: float | None = OMITTED  # the report's seconds since the start, as UntracedStep's
    untraced_max_t_s: float | None = OMITTED
    exit_t_s: float | None = OMITTED


@dataclass
class NvmlDevice(Section):
    """The whole GPU: NVML ``used`` beside every traced process's owned bytes, None without
    samples; ``reserved_last`` None where NVML could not say; ``split`` the sum of the processes'
    (absent when the summary is of one process)."""

    samples: int
    unavailable: int
    last_ts: int | None = None
    used_last: int | None = None
    reserved_last: int | None = None
    traced_last: int | None = None
    untraced_last: int | None = None
    untraced_min: int | None = None
    untraced_max: int | None = None
    untraced_max_ts: int | None = None
    negative_samples: int = 0
    split: dict[str, int] | None = OMITTED
    last_t_s: float | None = OMITTED
    untraced_max_t_s: float | None = OMITTED


@dataclass
class ContextRow(Section):
    """A context bound on the GPU and its cost (NVML's steps over the bind and its first kernel);
    ``foreign``: its process owns no traced memory on this GPU."""

    pid: int
    gpu: int
    handle: int
    api: str
    ts: int
    phase: str
    cost: int | None  # None: no NVML reading of the process on that GPU
    foreign: bool
    t_s: float | None = OMITTED


@dataclass
class GpuReconciliation(Section):
    """One GPU's reconciliation (:meth:`Reconciliation.gpu_summary`): the report's
    ``reconciliation`` section, the diff's untraced rows and the answer's UNTRACED lines read it."""

    gpu: int
    processes: list[NvmlProcess]
    device: NvmlDevice | None
    #: The share of its processes' NVML used (last samples) that is traced or explained.
    explained_share: float | None
    unsampled_pids: list[int]
    contexts: list[ContextRow]

    def with_seconds(self, start: int) -> GpuReconciliation:
        """Every time also as seconds since ``start`` (the ``*_t_s`` fields), as the report shows them."""
        def s(ts: int | None) -> float | None:
            return seconds(ts - start) if ts is not None else None

        for p in self.processes:
            for st in p.steps or ():
                st.t_s, st.cause_t_s = s(st.ts), s(st.cause_ts)
            p.last_t_s, p.untraced_max_t_s, p.exit_t_s = s(p.last_ts), s(p.untraced_max_ts), s(p.exit_ts)
        if self.device is not None:
            self.device.last_t_s, self.device.untraced_max_t_s = s(self.device.last_ts), s(self.device.untraced_max_ts)
        for c in self.contexts:
            c.t_s = s(c.ts)
        return self


@dataclass
class Reconciliation:
    """NVML vs traced for every GPU with NVML samples (see the module docstring)."""

    processes: dict[tuple[int, int], ProcessSeries] = field(default_factory=dict)  # (gpu, pid) ->
    devices: dict[int, DeviceSeries] = field(default_factory=dict)
    #: Per GPU: processes that owned traced memory on it at some point (for "never sampled").
    traced_pids: dict[int, list[int]] = field(default_factory=dict)
    #: Whether the trace has any NVML per-process sample (of any GPU).
    process_sampling: bool = False
    #: (gpu, pid) -> the untraced band split (one per process series).
    splits: dict[tuple[int, int], UntracedSplit] = field(default_factory=dict)
    #: Every context bound, in time order.
    contexts: list[ContextRecord] = field(default_factory=list)
    #: phase id -> its path (the labels of the splits' steps).
    phase_label: Any = None

    def gpus(self) -> list[int]:
        """GPUs with NVML samples (device or per-process), ascending."""
        return sorted(set(self.devices) | {g for g, _ in self.processes})

    def process(self, gpu: int, pid: int) -> ProcessSeries | None:
        """The series of ``pid`` on ``gpu``, or None when NVML never listed it there."""
        return self.processes.get((gpu, pid))

    def gpu_summary(self, gpu: int, pid: int | None = None) -> GpuReconciliation:
        """One GPU's reconciliation (``pid``: only that process's row).

        ``processes``: one row per process NVML listed on this GPU, pids ascending (see
        :class:`NvmlProcess`); ``device``: the whole GPU (never filtered by ``pid``), None without
        device samples; ``unsampled_pids``: processes that owned traced memory on this GPU but never
        appeared in NVML's per-process samples of it (empty when the trace has no per-process
        samples at all).
        """
        label = self.phase_label or (lambda _i: "(no phase)")
        rows = [
            _process_row(s, self.splits.get((g, p)), label)
            for (g, p), s in sorted(self.processes.items())
            if g == gpu and (pid is None or p == pid)
        ]
        sampled = {p for g, p in self.processes if g == gpu}
        unsampled = []
        if self.process_sampling:
            unsampled = [p for p in self.traced_pids.get(gpu, []) if p not in sampled and (pid is None or p == pid)]
        dev = self.devices.get(gpu)
        device = _device_row(dev) if dev is not None else None
        if device is not None and pid is None:
            device.split = _sum_splits(rows)
        split_rows = [r for r in rows if r.split]
        used = sum(r.nvml_used_last or 0 for r in split_rows)
        gone = sum(r.split["unexplained"] for r in split_rows)
        return GpuReconciliation(
            gpu=gpu,
            processes=rows,
            device=device,
            explained_share=max(0.0, min(1.0, 1 - gone / used)) if used > 0 else None,
            unsampled_pids=unsampled,
            contexts=[_context_row(c, label) for c in self.contexts
                      if c.gpu == gpu and (pid is None or c.pid == pid)],
        )

    def summary(self) -> dict[str, dict]:
        """Every GPU's :meth:`gpu_summary` as JSON, keyed by the GPU index as a string (JSON keys)."""
        return {str(g): self.gpu_summary(g).to_json() for g in self.gpus()}


def reconcile(trace: Any, timeline: Timeline | None = None, phases: Any = None, events: Any = None,
              pids: list[int] | None = None) -> Reconciliation:
    """Put NVML's per-process and device samples of ``trace`` beside the traced owned bytes.

    Args:
        trace: a :class:`memrec.trace.model.Trace` (its ``nvml``, ``procmem`` and ``events``).
        timeline: the replay of the trace's events to look the traced bytes up in (the report passes
            its own); default: one replay here, from the file's keyframe at event 0 if it has one
            (a rotated file continues the previous one's state), as :func:`build_report` does.
        phases: the trace's :class:`~memrec.engine.phases.Phases` (the report passes its own);
            default: built here from the markers.
        events, pids: the events the explanations read (default: the timeline's; the report's
            pass over a file keeps all but the tensor blocks', which none of them reads) and
            every process an event names (default: those of ``events``).
    """
    if timeline is None:
        initial, _ = initial_state(trace)
        timeline = build_timeline(trace.event_columns, state=initial)
    out = Reconciliation()
    recorded: set[int] = set()
    exits: dict[int, int] = {}
    ev = timeline.events if events is None else events
    recorded |= set(pids) if pids is not None else set(distinct(ev["pid"]) if len(ev) else ())
    if len(ev):
        ex = ev[ev["kind"] == int(Kind.PROC_EXIT)]
        for p, t in zip(ex["pid"].tolist(), ex["ts"].tolist()):
            exits[p] = t  # the last one (a reused pid exits again later)
    for g, s in timeline.gpus.items():
        owned = s.per_pid(OWNED)
        out.traced_pids[g] = owned.pids[(owned.peak != 0) | (owned.low != 0)].tolist()
        recorded |= set(s.pids())

    pm = trace.procmem
    out.process_sampling = bool(len(pm))
    if len(pm):
        # Plain int64 columns first: sorting and gathering a structured array is several times slower.
        key = (pm["gpu"].astype(np.int64) << 32) | pm["pid"].astype(np.int64)  # gpu, then pid (u4)
        order = _by_key_then_time(key, pm["ts"])
        key, ts, used = key[order], pm["ts"].astype(np.int64)[order], pm["used"].astype(np.int64)[order]
        cut = np.nonzero(key[1:] != key[:-1])[0] + 1
        for lo, hi in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [len(ts)])).tolist()):
            g, p = int(key[lo] >> 32), int(key[lo] & 0xFFFFFFFF)
            ok = used[lo:hi] >= 0
            t, u = ts[lo:hi][ok], used[lo:hi][ok]
            series = timeline.gpus.get(g)
            traced = _lookup_pid(series, p, t)
            out.processes[(g, p)] = ProcessSeries(
                gpu=g, pid=p, ts=t, nvml_used=u, traced=traced, untraced=u - traced,
                unavailable=int((~ok).sum()), recorded=p in recorded, exit_ts=exits.get(p),
            )

    threads = {g.index: g.resident_threads for g in getattr(trace, "gpus", None) or ()}
    _split_untraced(out, ev, phases if phases is not None else trace_phases(trace), threads)

    nv = trace.nvml
    if len(nv):
        gpu = nv["gpu"].astype(np.int64)
        order = _by_key_then_time(gpu, nv["ts"])
        gpu, ts = gpu[order], nv["ts"].astype(np.int64)[order]
        used, reserved = nv["used"].astype(np.int64)[order], nv["reserved"].astype(np.int64)[order]
        cut = np.nonzero(gpu[1:] != gpu[:-1])[0] + 1
        for lo, hi in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [len(ts)])).tolist()):
            g = int(gpu[lo])
            ok = used[lo:hi] >= 0
            t, u = ts[lo:hi][ok], used[lo:hi][ok]
            series = timeline.gpus.get(g)
            traced = _lookup(series, series.total() if series is not None else None, t)
            out.devices[g] = DeviceSeries(
                gpu=g, ts=t, used=u, reserved=reserved[lo:hi][ok], traced=traced, untraced=u - traced,
                unavailable=int((~ok).sum()),
            )
    return out


def _split_untraced(out: Reconciliation, events: np.ndarray, phases: Any, threads: dict[int, int | None]) -> None:
    """Fill ``out.splits`` and ``out.contexts`` (memrec.analysis.untraced.split); ``threads``: GPU ->
    its resident threads (the stack limit's cost per byte), where the trace's header knows it."""
    out.phase_label = phases.label
    phase_of = phases.phase_at if len(phases.table) else (lambda _pid, _ts: -1)
    explainers = Explainers(events)
    held = pool_held(events)
    until: dict[tuple[int, int], int | None] = {}
    for key, s in out.processes.items():
        out.splits[key] = split_process(key[0], key[1], s.ts, s.nvml_used, s.traced, held.get(key), explainers, phase_of,
                                        threads.get(key[0]))
        live = np.nonzero(s.live)[0]
        until[key] = int(s.ts[live[-1]]) if len(live) else None
    owners = {g: set(pids) for g, pids in out.traced_pids.items()}
    out.contexts = contexts(events, out.splits, owners, phase_of, until)


def _by_key_then_time(key: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """The order that sorts rows by ``key``, then by ``ts`` (stable: equal rows keep file order).

    One int64 key and contiguous columns: lexsort of a structured array's fields is several times
    slower on hours of samples."""
    return np.lexsort((ts.astype(np.int64), key))


def _lookup(series: GpuSeries | None, values: np.ndarray | None, ts: np.ndarray) -> np.ndarray:
    """``values`` (one per row of ``series``) at each of ``ts``: the row after every event at or
    before it, row 0 (the initial state) before any; zeros without a series."""
    if series is None or values is None or not len(series.ts):
        return np.zeros(len(ts), dtype=np.int64)
    rows = np.searchsorted(series.ts, ts, side="right") - 1
    return values[np.maximum(rows, 0)].astype(np.int64)


def _lookup_pid(series: GpuSeries | None, pid: int, ts: np.ndarray) -> np.ndarray:
    """What ``pid`` owned at each of ``ts`` (as :func:`_lookup` of its total), from its own change
    points: O(its changes + samples), so a host of many processes costs O(changes) in all."""
    owned = series.per_pid(OWNED) if series is not None and len(series.ts) else None
    i = owned.index(pid) if owned is not None else None
    if i is None:
        return np.zeros(len(ts), dtype=np.int64)
    return owned.at_rows(i, np.searchsorted(series.ts, ts, side="right") - 1)


def _lower_median(a: np.ndarray) -> int:
    """The median as an exact int: the lower of the two middle values for an even count."""
    return int(np.sort(a)[(len(a) - 1) // 2])


def _process_row(s: ProcessSeries, split: UntracedSplit | None, label: Any) -> NvmlProcess:
    live = s.live
    after = int((~live).sum())
    row = NvmlProcess(pid=s.pid, recorded=s.recorded, samples=len(s) - after, unavailable=s.unavailable,
                      after_exit_samples=after, exit_ts=s.exit_ts)
    if not live.any():
        return row
    u = s.untraced[live]
    last = int(np.nonzero(live)[0][-1])
    row.last_ts = int(s.ts[last])
    row.nvml_used_last = int(s.nvml_used[last])
    row.traced_last = int(s.traced[last])
    row.untraced_last = int(u[-1])
    row.untraced_min = int(u.min())
    row.untraced_median = _lower_median(u)
    row.untraced_max = int(u.max())
    row.untraced_max_ts = int(s.ts[live][int(np.argmax(u))])
    row.negative_samples = int((u < 0).sum())
    if split is None:
        return row
    row.split = split.at(last)
    row.explained_share = explained_share(int(s.nvml_used[last]), int(s.traced[last]), row.split)
    counted = [st for st in split.steps if st.ts <= s.ts[last]]
    row.unexplained_max_abs = int(np.abs(split.unexplained[live]).max())
    by_phase: dict[str, dict[str, int]] = {}
    for st in counted:
        cell = by_phase.setdefault(label(st.phase), dict.fromkeys(SPLIT, 0))
        cell[st.category] += st.bytes
    row.split_by_phase = [PhaseSplit(name, cells) for name, cells in by_phase.items()]
    by_library: dict[str, int] = {}
    for st in counted:
        if st.category == "module_code":
            by_library[st.library or "(unknown)"] = by_library.get(st.library or "(unknown)", 0) + st.bytes
    if SEVERAL in by_library:  # a step over calls of several libraries: the split would mislead
        by_library = {SEVERAL: sum(by_library.values())}
    row.module_code_by_library = dict(sorted(by_library.items(), key=lambda kv: -abs(kv[1])))
    largest = sorted(counted, key=lambda st: -abs(st.bytes))[:MAX_STEPS]
    row.steps = [UntracedStep(st.ts, st.bytes, st.category, st.cause, st.cause_ts, label(st.phase), st.library)
                 for st in sorted(largest, key=lambda st: st.ts)]
    return row


def _sum_splits(rows: list[NvmlProcess]) -> dict | None:
    """The device's split: the sum of its processes' (at their last samples)."""
    splits = [r.split for r in rows if r.split]
    if not splits:
        return None
    return {name: sum(sp[name] for sp in splits) for name in SPLIT}


def _context_row(c: ContextRecord, label: Any) -> ContextRow:
    return ContextRow(c.pid, c.gpu, c.handle, c.api, c.ts, label(c.phase), c.cost, c.foreign)


def _device_row(d: DeviceSeries) -> NvmlDevice:
    row = NvmlDevice(samples=len(d), unavailable=d.unavailable)
    if len(d):
        u = d.untraced
        reserved = int(d.reserved[-1])
        row.last_ts = int(d.ts[-1])
        row.used_last = int(d.used[-1])
        row.reserved_last = reserved if reserved >= 0 else None
        row.traced_last = int(d.traced[-1])
        row.untraced_last = int(u[-1])
        row.untraced_min = int(u.min())
        row.untraced_max = int(u.max())
        row.untraced_max_ts = int(d.ts[int(np.argmax(u))])
        row.negative_samples = int((u < 0).sum())
    return row
