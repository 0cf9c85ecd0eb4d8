"""One replay of a trace: where it starts, the span it covers, its series, the state at an event.

A rotated file continues the previous file's state: its keyframe at event 0 is the state the replay
starts from (:func:`initial_state`). The span of a trace (:func:`trace_bounds`) is what every
``+N.NNNs`` a user reads is relative to, so the report, ``memrec.load``, the plot, the exports and
the TUI agree on it. :func:`build_timeline` is the whole-trace replay (``LiveState.apply`` with its
journal, then numpy); :func:`state_at` is the state after some events, from the nearest snapshot
plus the gap (:func:`advance`), never a replay from the start when a snapshot is nearer.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Callable
from typing import Iterable
from typing import Sequence

import numpy as np

from memrec.engine.journal import Journal
from memrec.engine.journal import JournalBuffer
from memrec.engine.phases import Phases
from memrec.engine.phases import build_phases
from memrec.engine.series import GpuSeries
from memrec.engine.series import SeriesBuilder
from memrec.state import LiveState
from memrec.state.batch import Batch

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


def trace_bounds(trace: Any) -> tuple[int, int]:
    """The trace's first and last timestamp over events, markers and samples (trailer end if later).

    The recording's start (the header's monotonic anchor) counts as a first timestamp: times are
    relative to when memrec started recording, not to the first event.
    """
    firsts: list[int] = []
    lasts: list[int] = []
    # a loaded Trace's columns (no rows built); a view made of rows (the TUI's) has events only
    events = trace.event_columns if hasattr(trace, "event_columns") else trace.events
    for arr in (events, trace.nvml, trace.procmem):
        if len(arr):
            firsts.append(int(arr["ts"].min()))
            lasts.append(int(arr["ts"].max()))
    if trace.markers:
        times = [m.ts for m in trace.markers]
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
    events: np.ndarray | Batch = field(repr=False)  # the rows replayed, or a Batch over the columns


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
    the series are built from it a chunk at a time as the replay goes.
    """
    if state is None:
        state = LiveState(journal=True)
    elif state.journal is None:
        raise ValueError("build_timeline needs a state with journal=True")
    if not isinstance(events, np.ndarray):
        events = Batch.of(events)
    if start is None:
        start = int(events["ts"][0]) if len(events) else 0
    initial = state.counters()  # (gpu, pid, category index) -> bytes
    series = SeriesBuilder(initial, start, state.n_events)
    # about a change per event; a chunk's worth when the rows are let go after each chunk
    rows = JournalBuffer(capacity=(len(events) if on_journal is None else min(len(events), APPLY_CHUNK)) * 9 // 8)
    rows.take(state)  # what the state had journaled before (normally nothing)
    state.journal_sink = rows
    let_go = 0  # rows handed on and let go (on_journal)
    fed = 0  # rows of the buffer the series have

    def hand_on(done: int) -> None:
        nonlocal fed, let_go
        part = rows.journal(fed)
        series.add(part, done / max(len(events), 1))
        if on_journal is None:
            fed = rows.n
        else:
            on_journal(part)
            let_go += rows.n
            rows.clear()

    try:
        done = 0
        for stop in [*stops, len(events)]:
            if stop < done:
                raise ValueError("stops must be ascending")
            for lo in range(done, stop, APPLY_CHUNK):
                state.apply(events[lo : min(stop, lo + APPLY_CHUNK)])
                rows.take(state)
                if rows.n - fed >= APPLY_CHUNK // 4:  # not per stop: failed calls cut short chunks
                    hand_on(min(stop, lo + APPLY_CHUNK))
            done = stop
            if at_stop is not None and stop < len(events):
                at_stop(stop, state, let_go + rows.n)
        if fed < rows.n:
            hand_on(len(events))
    finally:
        state.journal_sink = None
    return Timeline(gpus=series.series(), journal=rows.journal(), state=state, start=start, events=events)


def advance(state: LiveState, covered: int, chunks: Iterable[np.ndarray | Batch]) -> LiveState:
    """``state`` (valid after ``covered`` events: a snapshot restored, or empty) moved on by ``chunks``."""
    state.n_events = covered
    for chunk in chunks:
        state.apply(chunk)
    return state


def state_at(events: np.ndarray | Batch, index: int, keyframes: list | None = None) -> LiveState:
    """The state after the first ``index`` events, starting from the latest keyframe at or before it.

    ``keyframes``: :class:`memrec.trace.model.Keyframe` items (``event_index``, ``state``); one that
    is not a :meth:`LiveState.snapshot` of this version is skipped (replayed over instead).
    """
    usable = sorted(
        (kf for kf in keyframes or () if 0 <= kf.event_index <= index), key=lambda kf: kf.event_index, reverse=True
    )
    for kf in usable:
        try:
            state = LiveState.from_snapshot(kf.state)
        except BAD_SNAPSHOT:
            continue  # not a LiveState snapshot (another version): try an earlier one
        return advance(state, kf.event_index, [events[kf.event_index : index]])
    return advance(LiveState(), 0, [events[:index]])


def trace_phases(trace: Any) -> Phases:
    """The trace's phases, unclosed ones ending at the trace's end (:func:`trace_bounds`): what
    the report, diff, ``memrec.load`` and the reconciliation all read."""
    return build_phases(trace.markers, trace_bounds(trace)[1])
