"""One replay of a trace: where it starts, the span it covers, its series, the state at an event.

A rotated file continues the previous file's state: its keyframe at event 0 is the state the replay
starts from (:func:`initial_state`). The span of a trace (:func:`trace_bounds`) is what every
``+N.NNNs`` a user reads is relative to, so the report, ``memrec.load``, the plot, the exports and
the TUI agree on it. :func:`build_timeline` is the whole-trace replay (``LiveState.apply`` with its
journal, then numpy); :func:`state_at` is the state after some events, from the nearest snapshot
plus the gap (:func:`advance`), never a replay from the start when a snapshot is nearer.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Callable
from typing import Iterable
from typing import Sequence

import numpy as np

from memrec.engine.journal import Journal
from memrec.engine.journal import JournalBuffer
from memrec.engine.journal import exit_indexes
from memrec.engine.phases import Phases
from memrec.engine.phases import build_phases
from memrec.engine.series import GpuSeries
from memrec.engine.series import SeriesBuilder
from memrec.engine.source import Census
from memrec.engine.source import ColumnSource
from memrec.engine.source import EventSource
from memrec.state import LiveState
from memrec.state.batch import Batch
from memrec.state.fields import ALLOC
from memrec.state.fields import FREE
from memrec.state.fields import IPC_CLOSE
from memrec.state.fields import JOINABLE_KINDS
from memrec.state.fields import OTHER_KINDS
from memrec.state.fields import SHARE_EXPORT
from memrec.state.fields import SHARE_IMPORT
from memrec.state.fields import kind_mask

#: Events per LiveState.apply call in a whole-trace replay: what apply makes per call (lists of a
#: call's columns) and the state's own journal stay bounded however long the trace (one
#: 10M-event call took 2.5 GB).
APPLY_CHUNK = 1 << 20
#: What a snapshot that is not this version's LiveState raises in ``LiveState.from_snapshot``.
BAD_SNAPSHOT = (ValueError, KeyError, TypeError, AttributeError)


def initial_state(trace: Any) -> tuple[LiveState | None, list[str]]:
    """The state the file starts from (journal on): its keyframe at event 0, or None (empty).

    Returns the state and notes for the user (a keyframe this memrec cannot read is replayed over).
    """
    for kf in trace.keyframes:
        if kf.event_index != 0:
            continue
        try:
            state = LiveState.from_snapshot(kf.state, journal=True)
        except BAD_SNAPSHOT as error:
            return None, [f"the keyframe at the start is not a state this memrec reads ({error}): replayed from empty"]
        state.n_events = 0
        return state, []
    return None, []


_TS = operator.attrgetter("ts")


def trace_bounds(trace: Any, census: Census | None = None) -> tuple[int, int]:
    """The trace's first and last timestamp over events, markers and samples (trailer end if later).

    The recording's start (the header's monotonic anchor) counts as a first timestamp: times are
    relative to when memrec started recording, not to the first event. ``census``: the events'
    (a trace read from its file a chunk at a time holds none).
    """
    firsts: list[int] = []
    lasts: list[int] = []
    if census is not None:
        if census.n:
            firsts.append(census.first_ts)
            lasts.append(census.last_ts)
        arrays = (trace.nvml, trace.procmem)
    else:  # a loaded Trace's columns (no rows built); a view made of rows (the TUI's) has events only
        arrays = (trace.event_columns if hasattr(trace, "event_columns") else trace.events, trace.nvml, trace.procmem)
    for arr in arrays:
        if len(arr):
            firsts.append(int(arr["ts"].min()))
            lasts.append(int(arr["ts"].max()))
    if trace.markers:
        times = list(map(_TS, trace.markers))
        firsts.append(min(times))
        lasts.append(max(times))
    trailer = trace.trailer or {}
    for key in ("end_ts", "end"):
        if isinstance(trailer.get(key), int):
            lasts.append(trailer[key])
            break
    anchor = trace.header.get("anchor")
    if isinstance(anchor, dict) and isinstance(anchor.get("monotonic_ns"), int):
        firsts.append(anchor["monotonic_ns"])  # when the recording started
    start = min(firsts) if firsts else 0
    return start, max(lasts) if lasts else start


@dataclass
class Timeline:
    """Everything one replay gives: series per GPU, the journal and the final state."""

    gpus: dict[int, GpuSeries]
    journal: Journal
    state: LiveState
    start: int
    events: np.ndarray | Batch | None = field(repr=False)  # the rows replayed, a Batch over the columns, or
    # None (the report's replay from the file: the events were let go chunk by chunk)


def build_timeline(
    events: np.ndarray | Batch | Any,
    start: int | None = None,
    state: LiveState | None = None,
    stops: Sequence[int] = (),
    at_stop: Callable[[int, LiveState, int], None] | None = None,
    on_journal: Callable[[Journal], None] | None = None,
) -> Timeline:
    """Replay ``events`` (filling in their ``gpu``) and build every GPU's series.

    Args:
        events: in time order: EVENT_DTYPE rows, or columns (``Trace.event_columns``, a
            :class:`~memrec.state.batch.Batch`), replayed in place without building rows.
        start: the time of each series' initial row (default: the first event's ts).
        state: a state to continue from (e.g. restored from a keyframe, with ``journal=True``);
            its holdings are the initial row. Default: empty.
        stops: event indexes (into ``events``, ascending) where ``at_stop(index, state, changes)``
            is called with the state just *before* that event (who held what at a failed call)
            and the number of journal rows so far (equal for two stops: nothing changed between).
        on_journal: given, each applied chunk's journal rows go to it (views, valid during the
            call) and are then let go: :attr:`Timeline.journal` is empty. The report reads the
            journal this way and never holds it whole (35 B a change) beside the series.

    The journal moves into :attr:`Timeline.journal` as it grows (the state's own stays short);
    the series are built from it a chunk at a time as the replay goes (:class:`Replay`, which
    the report feeds from the file a record at a time instead).
    """
    if not isinstance(events, np.ndarray):
        events = Batch.of(events)
    if start is None:
        start = int(events["ts"][0]) if len(events) else 0
    replay = Replay(len(events), start, state, at_stop, on_journal)
    replay.feed(events, stops)
    return replay.finish(events)


class Replay:
    """One replay of a trace's ``n`` events fed a chunk at a time, in order (:meth:`feed`), then
    :meth:`finish`: what :func:`build_timeline` does with a whole trace, from chunks that need
    not all be in memory at once. See :func:`build_timeline` for the arguments; ``capacity``:
    the journal rows to make room for at first (default: a change per event). :attr:`exits`:
    the indexes of the exits fed so far (what :meth:`Journal.exit_mask` reads), each chunk's
    gathered before its journal rows are handed on."""

    def __init__(self, n: int, start: int, state: LiveState | None = None,
                 at_stop: Callable[[int, LiveState, int], None] | None = None,
                 on_journal: Callable[[Journal], None] | None = None, capacity: int | None = None) -> None:
        if state is None:
            state = LiveState(journal=True)
        elif state.journal is None:
            raise ValueError("build_timeline needs a state with journal=True")
        self.n, self.start, self.state = n, start, state
        self._at_stop, self._on_journal = at_stop, on_journal
        initial = state.counters()  # (gpu, pid, category index) -> bytes
        self._series = SeriesBuilder(initial, start, state.n_events)
        # about a change per event; a chunk's worth when the rows are let go after each chunk, or
        # when the caller says (``capacity``: a journal kept whole that grows as it needs)
        if capacity is None:
            capacity = n if on_journal is None else min(n, APPLY_CHUNK)
        self._rows = JournalBuffer(capacity=capacity * 9 // 8)
        self._rows.take(state)  # what the state had journaled before (normally nothing)
        state.journal_sink = self._rows
        self._let_go = 0  # rows handed on and let go (on_journal)
        self._fed = 0  # rows of the buffer the series have
        self.done = 0  # events applied
        self.exits = np.zeros(0, np.int64)  # the indexes of the exits (PROC_EXIT) among them

    def _hand_on(self, done: int) -> None:
        rows = self._rows
        part = rows.journal(self._fed)
        self._series.add(part, done / max(self.n, 1))
        if self._on_journal is None:
            self._fed = rows.n
        else:
            self._on_journal(part)
            self._let_go += rows.n
            rows.clear()

    def feed(self, events: np.ndarray | Batch, stops: Sequence[int] = ()) -> None:
        """Apply the next ``events``; ``stops``: indexes into the whole trace's events, ascending,
        within these (``at_stop`` is called just before each)."""
        state, rows, base = self.state, self._rows, self.done
        found = exit_indexes(events, base)  # before the journal's rows are handed on
        if len(found):
            self.exits = np.concatenate([self.exits, found])
        try:
            done = 0
            for stop in [*(s - base for s in stops), len(events)]:
                if stop < done:
                    raise ValueError("stops must be ascending")
                for lo in range(done, stop, APPLY_CHUNK):
                    state.apply(events[lo : min(stop, lo + APPLY_CHUNK)])
                    rows.take(state)
                    if rows.n - self._fed >= APPLY_CHUNK // 4:  # not per stop: failed calls cut short chunks
                        self._hand_on(base + min(stop, lo + APPLY_CHUNK))
                done = stop
                if self._at_stop is not None and stop < len(events):
                    self._at_stop(base + stop, state, self._let_go + rows.n)
        except BaseException:
            state.journal_sink = None
            raise
        self.done = base + len(events)

    def flush(self) -> None:
        """Hand the rows journaled so far on now (to the series, and ``on_journal``): what reads
        each chunk's journal rows beside the chunk's events (the exports) calls it after each
        :meth:`feed`. The series do not depend on where the rows are cut (whole events)."""
        if self._fed < self._rows.n:
            self._hand_on(self.done)

    def finish(self, events: np.ndarray | Batch | None = None) -> Timeline:
        """The timeline (``events``: what :attr:`Timeline.events` holds: the rows replayed)."""
        try:
            if self._fed < self._rows.n:
                self._hand_on(self.n)
        finally:
            self.state.journal_sink = None
        return Timeline(gpus=self._series.series(), journal=self._rows.journal(), state=self.state,
                        start=self.start, events=events)


def advance(state: LiveState, covered: int, chunks: Iterable[np.ndarray | Batch]) -> LiveState:
    """``state`` (valid after ``covered`` events: a snapshot restored, or empty) moved on by ``chunks``."""
    state.n_events = covered
    for chunk in chunks:
        state.apply(chunk)
    return state


#: Kinds whose events read or write another process's state: an IPC handle exported and opened,
#: a shareable handle exported and imported (every other kind changes its own process's tables).
_JOINING = kind_mask((*JOINABLE_KINDS, IPC_CLOSE, SHARE_EXPORT, SHARE_IMPORT))
#: Kinds that change the state (the others: contexts, forks, code, markers, tensor blocks do not).
_CHANGES = kind_mask((ALLOC, FREE, *OTHER_KINDS))


def advance_for_gpu(state: LiveState, covered: int, chunks: Callable[[], Iterable[Batch]], gpu: int) -> LiveState:
    """``advance`` as far as ``gpu`` goes: what ``state`` holds on ``gpu`` (its counters, driver
    allocations, VMM handles and IPC mappings there) is what ``advance`` gives; the rest (other
    GPUs, the failures, anomalies and exits kept, the peaks) may not be.

    Why: a seek's gap from a far keyframe is a million events or more, replayed at about a
    microsecond each, and the cursor shows one GPU. When no event of the gap joins two processes
    (IPC and shareable handles), each process's state follows from its own events, and memory
    on ``gpu`` comes only from an event on ``gpu`` (an allocation, a VMM handle, an array): the
    processes that hold nothing there at the start and have no such event in the gap are left
    out, on a host with a process per GPU all but one GPU's events. A gap with IPC events, and
    the host's view (``gpu`` -1, whose pinned memory an event of any GPU makes), replay every
    event. ``chunks()`` gives the gap's chunks, afresh each call: they are read twice (held
    between the two passes, a million events' columns would be tens of MB).
    """
    keep = _processes_on(state, chunks(), gpu) if gpu >= 0 else None
    if keep is None:
        return advance(state, covered, chunks())
    state.n_events = covered
    for chunk in chunks():
        state.apply(chunk[np.isin(chunk["pid"], keep)])
        covered += len(chunk)
    state.n_events = covered
    return state


def _processes_on(state: LiveState, chunks: Iterable[Batch], gpu: int) -> np.ndarray | None:
    """The processes :func:`advance_for_gpu` replays for ``gpu`` (None: every one)."""
    pids = [np.array([p for (g, p, _), b in state.tables.bytes.items() if g == gpu and b], np.int64)]
    for chunk in chunks:
        kinds, ok, g = chunk["kind"], chunk["result"] == 0, chunk["gpu"]
        if np.any(ok & _JOINING[kinds]):
            return None
        pids.append(np.unique(chunk["pid"][ok & _CHANGES[kinds] & (g == gpu)]))
    return np.unique(np.concatenate(pids))


def state_at(events: np.ndarray | Batch | EventSource, index: int, keyframes: list | None = None) -> LiveState:
    """The state after the first ``index`` events, starting from the latest keyframe at or before it.

    ``events``: the rows or columns, or an :class:`~memrec.engine.source.EventSource` (a file
    read again from the keyframe's record on). ``keyframes``: :class:`memrec.trace.model.Keyframe`
    items (``event_index``, ``state``); one that is not a :meth:`LiveState.snapshot` of this
    version is skipped (replayed over instead).
    """
    source = events if isinstance(events, EventSource) else ColumnSource(events)
    usable = sorted(
        (kf for kf in keyframes or () if 0 <= kf.event_index <= index), key=lambda kf: kf.event_index, reverse=True
    )
    for kf in usable:
        try:
            state = LiveState.from_snapshot(kf.state)
        except BAD_SNAPSHOT:
            continue  # not a LiveState snapshot (another version): try an earlier one
        return advance(state, kf.event_index, (c for _, c in source.chunks(kf.event_index, index)))
    return advance(LiveState(), 0, (c for _, c in source.chunks(0, index)))


def trace_phases(trace: Any, census: Census | None = None) -> Phases:
    """The trace's phases, unclosed ones ending at the trace's end (:func:`trace_bounds`): what
    the report, diff, ``memrec.load`` and the reconciliation all read."""
    return build_phases(trace.markers, trace_bounds(trace, census)[1])
