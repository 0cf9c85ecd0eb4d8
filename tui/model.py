"""The TUI's data model: pure numpy + :class:`memrec.state.LiveState`, no Textual.

A :class:`TraceModel` holds what a trace (a file being read, or a live daemon stream) says, and
answers what the screen asks for:

- a *time index* over the events (``seq`` = position in the trace, ``ts`` = CLOCK_MONOTONIC ns):
  event chunks are kept as they were read (zero-copy column views for a file), with a monotone
  envelope of the timestamps to turn a time into a ``seq``;
- per-GPU *series* of bytes by category, built by replaying the events through a journaling
  :class:`LiveState` (:meth:`TraceModel.index_step`, run in a worker thread for a file so that
  the first frame never waits for it); until the replay reaches a time, the series there comes
  from the trace's keyframes (coarse, drawn dim);
- :meth:`TraceModel.viewport`: the series downsampled to one column per cell for a time range:
  each column shows the stack at the instant of its peak (a block-max pyramid keeps this
  O(columns) however many events the range holds), NVML's used memory beside it;
- :meth:`TraceModel.state_at`: who holds what at a ``seq``: the nearest checkpoint (a file
  keyframe, or a snapshot the replay took every ``checkpoint_every`` events) restored with
  ``LiveState.from_snapshot`` plus a replay of the gap — never a replay from the start;
- :meth:`TraceModel.events_window`: the events around a ``seq`` that pass an :class:`EventFilter`;
- :attr:`TraceModel.landmarks`: failed driver calls and big allocations, where the cursor jumps
  (:mod:`memrec.tui.navigation`); the events live in an :class:`~memrec.tui.store.EventStore`
  and the table's filter language is :mod:`memrec.tui.filters`.

Live mode bounds memory: :meth:`TraceModel.trim` drops the oldest event chunks, checkpoints and
series points beyond ``max_events``.
"""

from __future__ import annotations

import bisect
import dataclasses
import marshal
import threading
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Iterable

import numpy as np

from memrec._errors import TraceFormatError
from memrec._untrusted import clean_marker
from memrec._untrusted import clean_text
from memrec.columns import EVENT_DTYPE
from memrec.events import CATEGORIES
from memrec.events import GpuInfo
from memrec.events import IPC_MAPPED
from memrec.events import OWNED_CATEGORIES as OWNED
from memrec.events import Marker
from memrec.events import ProcessInfo
from memrec.engine.phases import OPEN_END
from memrec.engine.phases import Phases
from memrec.engine.phases import build_phases
from memrec.engine.phases import held_by_phase
from memrec.engine.journal import take_rows
from memrec.engine.replay import advance
from memrec.engine.series import CategorySeries
from memrec.engine.series import Grow
from memrec.ranks import process_label
from memrec.ranks import rank_labels
from memrec.state import LiveState
from memrec.trace.chunks import DEFAULT_SCHEMA
from memrec.trace.format import gpus_from_header
from memrec.trace.format import parse_schema
from memrec.trace.model import GpuIds
from memrec.tui.filters import API_NAMES
from memrec.tui.filters import EventFilter
from memrec.tui.filters import event_mask
from memrec.tui.navigation import Landmarks
from memrec.tui.store import EventRows
from memrec.tui.store import EventStore

NCAT = len(CATEGORIES)
NEVER = OPEN_END


# ----------------------------------------------------------------------------------------------
# phases


@dataclass(frozen=True)
class PhaseSpan:
    """A phase piece as the phase bands draw it (an instant marker has ``end == begin``); a view of
    :class:`memrec.engine.phases.Phase`."""

    name: str
    pid: int
    gpu: int | None
    begin: int
    end: int  # NEVER while still open
    values: dict = field(default_factory=dict, compare=False, hash=False)
    path: str = ""  # the phase path (memrec.engine.phases); "" for an instant
    resumed: bool = False  # continues a piece cut where an enclosing phase ended: not a begin


def phase_spans(markers: Iterable[Marker]) -> list[PhaseSpan]:
    """The phases of ``markers`` (the engine's semantics) and the instants, in begin order."""
    return PhaseIndex(build_phases(markers)).spans


class PhaseIndex:
    """Which phase a process was in at a time: a view of :class:`memrec.engine.phases.Phases`
    (the report's and diff's phases), with "" for no phase."""

    def __init__(self, phases: Phases) -> None:
        self.phases = phases
        spans = [PhaseSpan(p.name, p.pid, p.gpu, p.start, p.end, p.values, p.path, p.resumes >= 0)
                 for p in phases.phases]
        spans += [PhaseSpan(i.name, i.pid, i.gpu, i.ts, i.ts, i.values) for i in phases.instants]
        spans.sort(key=lambda s: (s.begin, s.pid, s.name))
        self.spans = spans

    def phase_of(self, pid: int, ts: int) -> str:
        ph = self.phases.phase_at(pid, ts)
        return self.phases.label(ph) if ph >= 0 else ""

    def phases_of(self, pids: np.ndarray, tss: np.ndarray) -> list[str]:
        ids = self.phases.assign(np.asarray(pids), np.asarray(tss).astype(np.int64))
        return ["" if i < 0 else self.phases.phases[i].path for i in ids.tolist()]


# ----------------------------------------------------------------------------------------------
# views returned to the widgets


@dataclass
class SeriesView:
    """One GPU's series over ``width`` columns of a time range (bytes, int64 arrays)."""

    t0: int
    t1: int
    width: int
    cats: np.ndarray  # (NCAT, width): bytes of each category at the column's peak
    nvml_used: np.ndarray  # (width,) max NVML used in the column, -1 when no sample yet
    coarse: np.ndarray  # (width,) bool: from keyframes (the replay has not reached it)
    has_data: np.ndarray  # (width,) bool: inside the trace's time range
    other_total: np.ndarray | None = None  # (width,) diff mode: the other trace's owned total

    @property
    def owned(self) -> np.ndarray:
        return self.cats[list(OWNED)].sum(axis=0)

    @property
    def untraced(self) -> np.ndarray:
        return np.where(self.nvml_used >= 0, np.maximum(self.nvml_used - self.owned, 0), 0)

    def peak(self) -> int:
        top = self.owned + self.untraced + self.cats[IPC_MAPPED]
        return int(max(top.max(initial=0), self.nvml_used.max(initial=0)))


@dataclass
class LiveAlloc:
    pid: int
    label: str
    category: str
    size: int
    address: int
    ts: int
    age: int
    phase: str
    api: str


@dataclass
class CursorState:
    """Who holds what on one GPU after the event ``seq`` (at time ``ts``)."""

    gpu: int
    seq: int
    ts: int
    by_category: dict[str, int]
    by_process: list[tuple[int, str, dict[str, int], int]]  # pid, label, category -> bytes, owned
    by_phase: list[tuple[str, int, int]]  # phase, bytes, count
    largest: list[LiveAlloc]
    nvml: dict[str, int] | None
    exact: bool = True
    #: Contexts bound on this GPU up to the cursor: (label, api, ts, cost or None, foreign).
    contexts: list[tuple[str, str, int, int | None, bool]] = field(default_factory=list)
    #: Per process, its untraced band split at its last NVML sample up to the cursor:
    #: (label, {context, module_code, pools, before_recording, unexplained}).
    untraced_split: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    #: Why the two lists above are empty, when they are ("" when they are known).
    untraced_note: str = ""

    @property
    def owned(self) -> int:
        return sum(self.by_category.get(CATEGORIES[c], 0) for c in OWNED)

    @property
    def untraced(self) -> int | None:
        if not self.nvml or self.nvml.get("used", -1) < 0:
            return None
        return self.nvml["used"] - self.owned


# ----------------------------------------------------------------------------------------------
# NVML samples


class NvmlSeries:
    def __init__(self) -> None:
        self.ts = Grow(np.uint64)
        self.used = Grow(np.int64)
        self.reserved = Grow(np.int64)
        self.total = Grow(np.int64)
        self.bar1_used = Grow(np.int64)
        self.bar1_total = Grow(np.int64)

    def append(self, s: np.ndarray) -> None:
        self.ts.extend(s["ts"])
        self.used.extend(s["used"])
        self.reserved.extend(s["reserved"])
        self.total.extend(s["total"])
        self.bar1_used.extend(s["bar1_used"])
        self.bar1_total.extend(s["bar1_total"])

    def at(self, ts: int) -> dict[str, int] | None:
        i = int(np.searchsorted(self.ts.a, np.uint64(max(ts, 0)), side="right")) - 1
        if i < 0:
            return None
        return {
            "ts": int(self.ts.a[i]),
            "used": int(self.used.a[i]),
            "reserved": int(self.reserved.a[i]),
            "total": int(self.total.a[i]),
            "bar1_used": int(self.bar1_used.a[i]),
            "bar1_total": int(self.bar1_total.a[i]),
        }


# ----------------------------------------------------------------------------------------------
# the model


class TraceModel:
    """Everything the TUI shows about one trace (see the module docstring).

    Args:
        checkpoint_every: events between two snapshots the replay keeps (bounds a cursor move's
            replay); 0 keeps none.
        max_events: live mode: events (and series points) kept; older ones are dropped.
    """

    def __init__(self, checkpoint_every: int = 32768, max_events: int | None = None) -> None:
        self.lock = threading.RLock()
        self.header: dict = {}
        self.gpus: dict[int, GpuInfo] = {}
        self._gpu_ids = GpuIds()  # every GPU named so far (header, events, samples, keyframes)
        self.store = EventStore()
        self.nvml: dict[int, NvmlSeries] = {}
        self.markers: list[Marker] = []
        self._rank_cache: tuple[int, dict[int, str]] | None = None
        self.processes: dict[int, ProcessInfo] = {}
        self.keyframes: list[tuple[int, int, dict]] = []  # (event_index, ts, state)
        self.lost = 0
        self.warnings: list[str] = []
        self.trailer: dict | None = None
        self.checkpoint_every = checkpoint_every
        self.max_events = max_events
        self.series: dict[int, CategorySeries] = {}
        # (seq, snapshot) taken by the replay, the snapshot marshalled: one bytes object instead of
        # flat lists of ~10^4 ints each, which every full GC pass would walk (300 checkpoints of a
        # 10M-event trace made each gen-2 collection ~110 ms, stalling whichever thread ran it)
        self._checkpoints: list[tuple[int, bytes]] = []
        self._live = LiveState(journal=True)
        self._since_checkpoint = 0
        self.frontier = 0  # events replayed (seq of the next to replay)
        self._kf_points: list[tuple[int, dict[int, np.ndarray]]] = []  # (ts, gpu -> bytes per cat)
        self.landmarks = Landmarks()  # failed calls and big allocations (the jumps' targets)
        self._phase_cache: tuple[int, PhaseIndex] | None = None
        self.t_end_hint: int | None = None  # trailer's end_ts
        self._gpu_pids: dict[int, set[int]] = {}  # pids that ever held memory on a GPU
        self._gpu_res = Grow(np.int16)  # per replayed event: its GPU as the replay resolved it
        self._gpu_res_base = 0  # seq of _gpu_res[0]
        #: The untraced band split (memrec.analysis.reconcile.Reconciliation): a file source sets
        #: it once the replay is done (the same engine as ``memrec report``); None until then.
        self.reconciliation: Any = None
        self.untraced_note = "computed once the trace is replayed"
        self._schema = DEFAULT_SCHEMA  # a live stream's column schema (its header's)
        self._live_stream = False
        self._skipped = 0  # malformed records a stream sent
        self._skipped_at = 0  # where the warning that counts them is

    # ------------------------------------------------------------------ ingest

    def set_header(self, header: dict) -> None:
        with self.lock:
            self.header = header
            self._gpu_ids.add_header(header)
            for info in gpus_from_header(header):
                self.gpus[info.index] = info

    def add_events(self, chunk: Any) -> None:
        """Add an events chunk (EVENT_DTYPE array or a column chunk) in trace order."""
        with self.lock:
            start = self.store.append(chunk)
            n = self.store.n - start
            if not n:
                return
            cols = (lambda name: chunk[name]) if isinstance(chunk, np.ndarray) else chunk.column
            self._gpu_ids.add_column(cols("gpu"))
            self.landmarks.add(cols, start)

    def add_nvml(self, samples: np.ndarray) -> None:
        with self.lock:
            self._gpu_ids.add_column(samples["gpu"])
            for g in np.unique(samples["gpu"]).tolist():
                self.nvml.setdefault(int(g), NvmlSeries()).append(samples[samples["gpu"] == g])

    def add_marker(self, marker: Marker) -> None:
        marker = clean_marker(marker)  # a client's text must not drive the terminal
        with self.lock:
            keys = [m.ts for m in self.markers]
            self.markers.insert(bisect.bisect_right(keys, marker.ts), marker)

    def add_process(self, process: ProcessInfo) -> None:
        process = dataclasses.replace(process, cmdline=[clean_text(a) for a in process.cmdline],
                                      exe=None if process.exe is None else clean_text(process.exe))
        with self.lock:
            self.processes[process.pid] = process

    def add_keyframe(self, event_index: int, ts: int, state: dict) -> None:
        """A keyframe of the trace: a checkpoint for :meth:`state_at`, and a coarse series point."""
        with self.lock:
            try:
                s = LiveState.from_snapshot(state)
            except ValueError as error:  # never kept: the cursor must not restore from it later
                self.warnings.append(f"keyframe at ts {ts} not usable: {error}")
                return
            self.keyframes.append((event_index, ts, state))
            if self.max_events and len(self.keyframes) > 64:
                del self.keyframes[:-64]
                del self._kf_points[:-64]
            self._kf_points.append((ts, _totals_by_gpu(s)))
            if event_index == 0 and self.frontier == 0 and not self._checkpoints and self.store.n == 0:
                # the trace starts with a state (a rotated file, or a live subscription)
                s.n_events = 0
                s.journal = self._live.journal
                self._live = s
                for g, values in _totals_by_gpu(s).items():
                    self._gpu_ids.add(g)
                    self.series.setdefault(g, CategorySeries()).set_initial(values, -1, ts)

    def set_lost(self, total: int) -> None:
        self.lost = max(self.lost, int(total))

    # RecordSink (memrec.trace.records): the one dispatch that file scans and the live stream use

    def on_header(self, header: dict) -> None:
        self.set_header(header)
        try:
            self._schema = parse_schema(header)
        except TraceFormatError as error:
            self.warnings.append(f"stream header: {error}")

    def on_events(self, chunk: Any) -> None:
        self.add_events(chunk)

    def on_nvml(self, chunk: Any) -> None:
        self.add_nvml(chunk.to_array())

    def on_procmem(self, chunk: Any) -> None:
        """Per-process samples are not drawn (the untraced split reads them from the file)."""

    def on_marker(self, marker: Marker) -> None:
        self.add_marker(marker)

    def on_process(self, process: ProcessInfo) -> None:
        self.add_process(process)

    def on_keyframe(self, keyframe: Any) -> None:
        # a live stream's keyframes index the daemon's file: for the stream they hold at the
        # events received so far
        self.add_keyframe(self.store.n if self._live_stream else keyframe.event_index, keyframe.ts, keyframe.state)

    def on_lost(self, total: int) -> None:
        self.set_lost(total)

    def on_trailer(self, trailer: dict) -> None:
        self.trailer = trailer
        if isinstance(trailer.get("end_ts"), int):
            self.t_end_hint = trailer["end_ts"]
        if isinstance(trailer.get("lost"), int):
            self.set_lost(trailer["lost"])

    def add_record(self, rec: dict, live: bool = False) -> None:
        """Add one record as a live stream delivers it (wire form: ``FrameDecoder(decode=False)``).

        It is checked exactly as a file's records are (:func:`memrec.trace.records.check_record`);
        a malformed one is skipped and counted in ``warnings``, never raised into the app.
        ``live``: the record comes from a daemon's stream (see :meth:`on_keyframe`).
        """
        from memrec.trace.records import check_record
        from memrec.trace.records import deliver

        try:
            kind, item = check_record(rec, self._schema)
        except TraceFormatError as error:
            self._skipped += 1
            message = f"skipped {self._skipped} malformed record(s) from the stream; last: {error}"
            if self._skipped == 1:
                self._skipped_at = len(self.warnings)
                self.warnings.append(message)
            else:  # one line, kept up to date
                self.warnings[self._skipped_at] = message
            return
        self._live_stream = live
        deliver(kind, item, self)

    @classmethod
    def from_trace(cls, trace: Any, index: bool = True, **kwargs: Any) -> TraceModel:
        """Build a model from a loaded :class:`memrec.trace.model.Trace` (tests, small traces)."""
        m = cls(**kwargs)
        m.set_header(trace.header)
        for p in trace.processes.values():
            m.add_process(p)
        for mk in trace.markers:
            m.add_marker(mk)
        kfs = sorted(trace.keyframes, key=lambda k: k.event_index)
        if kfs and kfs[0].event_index == 0:
            m.add_keyframe(0, kfs[0].ts, kfs[0].state)
            kfs = kfs[1:]
        if len(trace.nvml):
            m.add_nvml(trace.nvml)
        if len(trace.events):
            m.add_events(trace.events)
        for k in kfs:
            m.add_keyframe(k.event_index, k.ts, k.state)
        m.lost = trace.lost
        m.trailer = trace.trailer
        m.warnings.extend(trace.warnings)
        if index:
            while m.index_step(1 << 20):
                pass
        return m

    # ------------------------------------------------------------------ replay

    @property
    def indexed(self) -> bool:
        return self.frontier >= self.store.n

    def index_step(self, budget: int = 65536) -> int:
        """Replay up to ``budget`` more events into the series; return how many were replayed."""
        lo = self.frontier
        with self.lock:
            hi = min(self.store.n, lo + budget)
            if hi <= lo:
                return 0
            pieces = self.store.pieces(lo, hi)
        events = self.store.batch(pieces)
        done = 0
        while done < len(events):
            step = len(events) - done
            if self.checkpoint_every:
                step = min(step, self.checkpoint_every - self._since_checkpoint)
            part = events[done : done + step]
            self._live.apply(part)
            with self.lock:
                self._gpu_res.extend(part["gpu"])
            done += step
            self._since_checkpoint += step
            self._commit_journal()
            if self.checkpoint_every and self._since_checkpoint >= self.checkpoint_every:
                snap = self._live.snapshot()
                try:
                    snap = marshal.dumps(snap)
                except ValueError:  # an int or str subclass got in: keep the dict
                    pass
                with self.lock:
                    self._checkpoints.append((self._live.n_events, snap))
                self._since_checkpoint = 0
            with self.lock:
                self.frontier = lo + done
        return done

    def _commit_journal(self) -> None:
        rows = take_rows(self._live)
        if not len(rows):
            return
        with self.lock:
            gpus = rows[:, 2]
            pairs = np.unique(rows[:, 2] * (1 << 32) + rows[:, 3])
            for pair in pairs.tolist():
                self._gpu_pids.setdefault(pair >> 32, set()).add(pair & 0xFFFFFFFF)
            for g in np.unique(gpus).tolist():
                sel = rows[gpus == g]
                self._gpu_ids.add(int(g))
                series = self.series.setdefault(int(g), CategorySeries())
                series.append(sel[:, 0], sel[:, 1].astype(np.uint64), sel[:, 4].astype(np.int8), sel[:, 5])
                series.blocks()  # keep the max pyramid current: redraws never build it

    def trim(self) -> None:
        """Live mode: keep at most ``max_events`` events (and what depends on them)."""
        if not self.max_events:
            return
        with self.lock:
            if len(self.store) <= self.max_events:
                return
            want = min(self.store.n - self.max_events // 2, self.frontier)
            cps = [c[0] for c in self._checkpoints if c[0] <= want]
            if not cps:
                return  # no checkpoint to restart from yet: keep everything
            self.store.drop_before(cps[-1])
            cut = self.store.base
            self._gpu_res.drop_front(cut - self._gpu_res_base)
            self._gpu_res_base = cut
            self._checkpoints = [c for c in self._checkpoints if c[0] >= cps[-1]]
            self.keyframes = [k for k in self.keyframes if k[0] >= cut]
            for s in self.series.values():
                s.drop_before_seq(cut)
            self.landmarks.drop_before_seq(cut)
            t_cut = self.store.first_ts() or 0
            for nv in self.nvml.values():
                k = int(np.searchsorted(nv.ts.a, np.uint64(t_cut))) - 1
                for g in (nv.ts, nv.used, nv.reserved, nv.total, nv.bar1_used, nv.bar1_total):
                    g.drop_front(k)
            self._kf_points = [p for p in self._kf_points if p[0] >= t_cut]

    # ------------------------------------------------------------------ time range

    def time_range(self) -> tuple[int, int]:
        """(first ts, last ts) over events, NVML samples and markers (0, 1 when empty)."""
        lo, hi = [], []
        f, l = self.store.first_ts(), self.store.last_ts()
        if f is not None:
            lo.append(f)
            hi.append(l)
        for nv in self.nvml.values():
            if nv.ts.n:
                lo.append(int(nv.ts.a[0]))
                hi.append(int(nv.ts.a[-1]))
        if self.markers:
            lo.append(self.markers[0].ts)
            hi.append(self.markers[-1].ts)
        for _, ts, _ in self.keyframes:
            lo.append(ts)
            hi.append(ts)
        if self.t_end_hint:
            hi.append(self.t_end_hint)
        if not lo:
            return (0, 1)
        a, b = min(lo), max(hi)
        return (a, max(b, a + 1))

    def gpu_ids(self) -> list[int]:
        """Every GPU named so far: it grows while a file is read and a live stream goes on (a
        trace without NVML names its GPUs only in its events), so the view asks again after each
        change (see :class:`memrec.trace.model.GpuIds`)."""
        with self.lock:
            return self._gpu_ids.sorted()

    def frontier_ts(self) -> int:
        """Time up to which the series are exact (the replay's frontier)."""
        if self.frontier >= self.store.n:
            return self.time_range()[1] + 1
        return self.store.ts_of(self.frontier) if self.frontier > self.store.base else -1

    # ------------------------------------------------------------------ viewport

    def viewport(self, gpu: int, t0: int, t1: int, width: int) -> SeriesView:
        """The series of ``gpu`` over [t0, t1) in ``width`` columns (see the module docstring)."""
        width = max(int(width), 1)
        t1 = max(t1, t0 + 1)
        edges = t0 + (np.arange(width + 1, dtype=np.float64) * ((t1 - t0) / width))
        edges_u = np.maximum(edges, 0).astype(np.uint64)
        cats = np.zeros((NCAT, width), dtype=np.int64)
        nv_used = np.full(width, -1, dtype=np.int64)
        coarse = np.zeros(width, dtype=bool)
        with self.lock:
            lo_t, hi_t = self.time_range()
            has = (edges[1:] > lo_t) & (edges[:-1] <= hi_t)
            ftime = self.frontier_ts()
            s = self.series.get(gpu)
            if s is not None and len(s):
                pos = np.searchsorted(s.ts.a, edges_u, side="left")
                for k in range(width):
                    a, b = int(pos[k]), int(pos[k + 1])
                    lo = max(a - 1, 0)
                    if b <= lo:
                        if a == 0:
                            continue
                        i = a - 1
                    else:
                        i = s.argmax(lo, b) if b - lo > 1 else lo
                    cats[:, k] = s.values_at(i)
            # beyond the replay's frontier: keyframes (coarse)
            if ftime <= hi_t and self._kf_points:
                kts = np.array([p[0] for p in self._kf_points], dtype=np.float64)
                ks = np.flatnonzero(edges[1:] > ftime)
                js = (np.searchsorted(kts, edges[ks + 1], side="right") - 1).tolist()
                zero = np.zeros(NCAT, np.int64)
                for k, j in zip(ks.tolist(), js):
                    if j >= 0:
                        cats[:, k] = self._kf_points[j][1].get(gpu, zero)
                coarse[ks] = True
            elif ftime <= hi_t:
                coarse[edges[1:] > ftime] = True
            nv = self.nvml.get(gpu)
            if nv is not None and nv.ts.n:
                pos = np.searchsorted(nv.ts.a, edges_u, side="left")
                used = nv.used.a
                for k in range(width):
                    a, b = int(pos[k]), int(pos[k + 1])
                    if b > a:
                        nv_used[k] = int(used[a:b].max())
                    elif a > 0 and has[k]:
                        nv_used[k] = int(used[a - 1])
        cats[:, ~has] = 0
        return SeriesView(t0, t1, width, cats, nv_used, coarse, has)

    # ------------------------------------------------------------------ phases, labels

    def phase_index(self) -> PhaseIndex:
        with self.lock:
            n = len(self.markers)
            if self._phase_cache is None or self._phase_cache[0] != n:
                self._phase_cache = (n, PhaseIndex(build_phases(self.markers)))
            return self._phase_cache[1]

    def pid_label(self, pid: int) -> str:
        """``TP0`` from the process's markers (as ``memrec report`` names ranks), else its
        ProcessInfo rank, else the pid."""
        label = self._rank_labels().get(pid)
        if label:
            return label
        p = self.processes.get(pid)
        return (process_label(p.rank) if p is not None else "") or str(pid)

    def _rank_labels(self) -> dict[int, str]:
        with self.lock:
            n = len(self.markers)
            if self._rank_cache is None or self._rank_cache[0] != n:
                self._rank_cache = (n, rank_labels(self.markers))
            return self._rank_cache[1]

    def pid_command(self, pid: int) -> str:
        p = self.processes.get(pid)
        if p is None or not p.cmdline:
            return ""
        return " ".join(p.cmdline)

    def gpu_pids(self, gpu: int) -> list[int]:
        """Processes seen on ``gpu`` (holding memory there, or told so by a marker or their map)."""
        pids: set[int] = set()
        for p in self.processes.values():
            if gpu in (p.gpu_map or []):
                pids.add(p.pid)
        for m in self.markers:
            if m.gpu == gpu:
                pids.add(m.pid)
        pids |= self._gpu_pids.get(gpu, set())
        return sorted(pids)

    def bands(self, gpu: int) -> list[tuple[str, list[PhaseSpan]]]:
        """Phase spans per rank for ``gpu``'s processes: [(label, spans)], at most one row per pid."""
        spans = self.phase_index().spans
        pids = set(self.gpu_pids(gpu))
        if not pids:
            pids = {s.pid for s in spans}
        rows: dict[int, list[PhaseSpan]] = {}
        for s in spans:
            if s.pid in pids or s.gpu == gpu:
                rows.setdefault(s.pid, []).append(s)
        return [(self.pid_label(pid), rows[pid]) for pid in sorted(rows, key=lambda p: (self.pid_label(p), p))]

    # ------------------------------------------------------------------ state at the cursor

    def _best_checkpoint(self, seq: int) -> tuple[int, dict | bytes | None]:
        """The latest checkpoint valid after ``seq + 1`` events or fewer: (events covered, snapshot,
        marshalled when the replay took it)."""
        best: tuple[int, dict | bytes | None] = (0, None)
        cps = self._checkpoints
        i = bisect.bisect_right([c[0] for c in cps], seq + 1) - 1
        if i >= 0:
            best = cps[i]
        elif cps and self.store.base:
            best = cps[0]  # live mode after trimming: the oldest state still known
        for ei, _ts, state in self.keyframes:
            if best[0] < ei <= seq + 1 and state.get("v") is not None:
                best = (ei, state)
        return best

    def live_state_at(self, seq: int) -> LiveState:
        """A LiveState after the events up to and including ``seq`` (nearest checkpoint + gap)."""
        with self.lock:
            covered, snap = self._best_checkpoint(seq)
            if snap is None and covered > 0:
                covered = 0
            if snap is None and self._kf_points and self.keyframes and self.keyframes[0][0] == 0:
                snap = self.keyframes[0][2]
            pieces = self.store.pieces(covered, seq + 1) if seq + 1 > covered else []
        if isinstance(snap, bytes):
            snap = marshal.loads(snap)
        s = LiveState.from_snapshot(snap) if snap is not None else LiveState()
        # chunk by chunk, outside the lock: no 100-MB concatenation
        return advance(s, covered, (self._writable(self.store.materialize([piece])) for piece in pieces))

    @staticmethod
    def _writable(events: np.ndarray) -> np.ndarray:
        return events if events.flags.writeable else events.copy()

    def state_at(self, seq: int, gpu: int, ts: int | None = None, n_largest: int = 50) -> CursorState:
        """Who holds what on ``gpu`` after event ``seq`` (see :class:`CursorState`)."""
        ts = self.store.ts_of(seq) if ts is None else ts
        s = self.live_state_at(seq)
        tot = s.totals().get(gpu, {})
        by_cat: dict[str, int] = {}
        procs = []
        for pid, cats in tot.items():
            for c, b in cats.items():
                by_cat[c] = by_cat.get(c, 0) + b
            owned = sum(b for c, b in cats.items() if c != "ipc_mapped")
            procs.append((pid, self.pid_label(pid), dict(cats), owned))
        procs.sort(key=lambda r: (-r[3], -sum(r[2].values()), r[0]))
        pix = self.phase_index()
        by_phase = [(r.phase, r.bytes, r.count) for r in held_by_phase(s, gpu, pix.phases)]
        largest = [
            LiveAlloc(
                h.pid,
                self.pid_label(h.pid),
                h.category,
                h.size,
                h.address,
                h.ts,
                max(ts - h.ts, 0),
                pix.phase_of(h.pid, h.ts),
                API_NAMES.get(h.api, str(h.api)),
            )
            for h in s.largest(gpu, n_largest, mapped=True)
        ]
        nv = self.nvml.get(gpu)
        contexts, untraced = self.untraced_at(gpu, ts)
        return CursorState(gpu, seq, ts, by_cat, procs, by_phase, largest, nv.at(ts) if nv else None,
                           contexts=contexts, untraced_split=untraced, untraced_note=self.untraced_note)

    def untraced_at(self, gpu: int, ts: int) -> tuple[list, list]:
        """The contexts bound on ``gpu`` up to ``ts`` with their cost, and each process's untraced
        split at its last NVML sample up to ``ts`` (empty until :attr:`reconciliation` is set)."""
        rec = self.reconciliation
        if rec is None:
            return [], []
        contexts = [(self.pid_label(c.pid), c.api, c.ts, c.cost, c.foreign)
                    for c in rec.contexts if c.gpu == gpu and c.ts <= ts]
        untraced = []
        for (g, pid), split in sorted(rec.splits.items()):
            if g != gpu:
                continue
            i = int(np.searchsorted(split.ts, ts, side="right")) - 1
            if i >= 0:
                untraced.append((self.pid_label(pid), split.at(i)))
        return contexts, untraced

    def nvml_at(self, gpu: int, ts: int) -> dict[str, int] | None:
        nv = self.nvml.get(gpu)
        return nv.at(ts) if nv else None

    def series_at(self, gpu: int, ts: int) -> np.ndarray | None:
        """Bytes per category on ``gpu`` at ``ts`` from the series (None beyond the replay)."""
        with self.lock:
            if ts >= self.frontier_ts():
                return None
            s = self.series.get(gpu)
            if s is None or not len(s):
                return np.zeros(NCAT, np.int64)
            v = s.at_time(ts)
            return v if v is not None else np.zeros(NCAT, np.int64)

    # ------------------------------------------------------------------ events around the cursor

    def events_window(
        self, seq: int, flt: EventFilter, gpu: int | None = None, before: int = 100, after: int = 100, max_scan: int = 2_000_000
    ) -> EventRows:
        """Up to ``before`` matching events at or before ``seq`` and ``after`` after it."""
        with self.lock:
            base, n = self.store.base, self.store.n
            seq = min(max(seq, base - 1), n - 1)
            pix = self.phase_index() if flt.phase or flt.text else None
            back: list[np.ndarray] = []
            back_seq: list[np.ndarray] = []
            got = 0
            hi = seq + 1
            scanned = 0
            step = 4096
            while got < before and hi > base and scanned < max_scan:
                lo = max(base, hi - step)
                rows = self._resolve_gpu(self.store.slice(lo, hi), lo)
                m = self._match(rows, flt, gpu, pix)
                idx = np.flatnonzero(m)
                back.append(rows[idx])
                back_seq.append(idx + lo)
                got += len(idx)
                scanned += hi - lo
                hi = lo
                step = min(step * 2, 1 << 18)
            fwd: list[np.ndarray] = []
            fwd_seq: list[np.ndarray] = []
            got_f = 0
            lo = seq + 1
            step = 4096
            scanned_f = 0
            while got_f < after and lo < n and scanned_f < max_scan:
                hi = min(n, lo + step)
                rows = self._resolve_gpu(self.store.slice(lo, hi), lo)
                m = self._match(rows, flt, gpu, pix)
                idx = np.flatnonzero(m)
                fwd.append(rows[idx])
                fwd_seq.append(idx + lo)
                got_f += len(idx)
                scanned_f += hi - lo
                lo = hi
                step = min(step * 2, 1 << 18)
        b_rows = np.concatenate(back[::-1]) if back else np.zeros(0, EVENT_DTYPE)
        b_seq = np.concatenate(back_seq[::-1]) if back_seq else np.zeros(0, np.int64)
        b_rows, b_seq = b_rows[-before:] if before else b_rows[:0], b_seq[-before:] if before else b_seq[:0]
        f_rows = np.concatenate(fwd)[:after] if fwd else np.zeros(0, EVENT_DTYPE)
        f_seq = np.concatenate(fwd_seq)[:after] if fwd_seq else np.zeros(0, np.int64)
        rows = np.concatenate([b_rows, f_rows])
        seqs = np.concatenate([b_seq, f_seq]).astype(np.int64)
        pix = self.phase_index()
        phases = pix.phases_of(rows["pid"], rows["ts"])
        return EventRows(rows, seqs, phases, len(b_rows) - 1, scanned < max_scan and scanned_f < max_scan)

    def _resolve_gpu(self, rows: np.ndarray, lo: int) -> np.ndarray:
        """``rows`` (events from seq ``lo``) with the GPU the replay resolved (frees, unmaps...)."""
        res = self._gpu_res
        start = lo - self._gpu_res_base
        n = min(len(rows), max(res.n - start, 0))
        if n <= 0 or not (rows["gpu"][:n] < 0).any():
            return rows
        if not rows.flags.writeable:
            rows = rows.copy()
        rows["gpu"][:n] = res.a[start : start + n]
        return rows

    def _match(self, rows: np.ndarray, flt: EventFilter, gpu: int | None, pix: PhaseIndex | None) -> np.ndarray:
        return event_mask(rows, flt, gpu, self._gpu_pids.get(gpu, ()), pix.phases_of if pix is not None else None,
                          self._pids_named)

    def _pids_named(self, text: str) -> list[int]:
        """Processes whose rank label or command line contains ``text`` (lower case)."""
        return [p for p in self.processes if text in self.pid_label(p).lower() or text in self.pid_command(p).lower()]


def _totals_by_gpu(s: LiveState) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for g, pids in s.totals().items():
        v = out.setdefault(g, np.zeros(NCAT, np.int64))
        for cats in pids.values():
            for c, b in cats.items():
                v[CATEGORIES.index(c)] += b
    return out


def diff_rows(a: dict[str, int], b: dict[str, int]) -> list[tuple[str, int, int, int]]:
    """(key, a, b, b - a) for every key of either mapping, biggest change first."""
    keys = set(a) | set(b)
    rows = [(k, a.get(k, 0), b.get(k, 0), b.get(k, 0) - a.get(k, 0)) for k in keys]
    rows.sort(key=lambda r: (-abs(r[3]), r[0]))
    return rows


__all__ = [
    "CursorState",
    "LiveAlloc",
    "PhaseSpan",
    "SeriesView",
    "TraceModel",
    "diff_rows",
    "phase_spans",
]
