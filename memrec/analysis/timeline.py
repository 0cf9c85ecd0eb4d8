"""Per-GPU step series of bytes over time, built from one replay of a trace's events.

One replay with :class:`memrec.state.LiveState` (journal on) records every change of a
(gpu, pid, category) total, implicit frees at process exit included. :func:`build_timeline` turns
that journal into one :class:`GpuSeries` per GPU: for each event that changed something on the
GPU, the bytes every (pid, category) held right after it. Owned totals leave ``ipc_mapped`` out
(mapped, not owned); GPU -1 is the host (pinned memory) and device memory of unknown GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Callable
from typing import Sequence

import numpy as np

from memrec.events import CATEGORIES
from memrec.events import OWNED
from memrec.state import JOURNAL_FIELDS
from memrec.state import LiveState



@dataclass
class Journal:
    """The state's journal as columns: one row per change of a (gpu, pid, category) total."""

    index: np.ndarray  # event index (into the replayed events) that caused the change
    ts: np.ndarray
    gpu: np.ndarray
    pid: np.ndarray
    category: np.ndarray  # index into memrec.events.CATEGORIES
    delta: np.ndarray  # signed bytes

    @classmethod
    def from_state(cls, state: LiveState) -> Journal:
        """The journal of a state built with ``journal=True``."""
        if state.journal is None:
            raise ValueError("the state was built without journal=True")
        flat = np.frombuffer(state.journal, dtype=np.int64) if len(state.journal) else np.zeros(0, np.int64)
        cols = flat.reshape(-1, len(JOURNAL_FIELDS)).T.copy()
        return cls(*cols)

    def __len__(self) -> int:
        return len(self.index)


@dataclass
class GpuSeries:
    """Bytes held on one GPU after each event that changed them (a step function of time).

    ``values[i, k]`` is what ``keys[k] = (pid, category)`` held right after event
    ``event_index[i]`` (at ``ts[i]``). Row 0 is the state before the first change (at ``start``).
    """

    gpu: int
    ts: np.ndarray
    event_index: np.ndarray  # -1 for the initial row
    keys: list[tuple[int, str]]
    values: np.ndarray  # shape (len(ts), len(keys)), int64

    def _cols(self, pid: int | None, categories: tuple[str, ...] | None) -> list[int]:
        return [
            k
            for k, (p, c) in enumerate(self.keys)
            if (pid is None or p == pid) and (categories is None or c in categories)
        ]

    def series(self, pid: int | None = None, categories: tuple[str, ...] | None = OWNED) -> np.ndarray:
        """Bytes over time summed over the selected keys (default: every pid, owned categories)."""
        cols = self._cols(pid, categories)
        if not cols:
            return np.zeros(len(self.ts), dtype=np.int64)
        return self.values[:, cols].sum(axis=1)

    def total(self, pid: int | None = None) -> np.ndarray:
        """Owned bytes over time (ipc_mapped left out), of every process or of ``pid``."""
        return self.series(pid, OWNED)

    def by_category(self, pid: int | None = None) -> dict[str, np.ndarray]:
        """One series per category present (ipc_mapped included: it is the importers' view)."""
        present = {c for _, c in self.keys}
        return {c: self.series(pid, (c,)) for c in CATEGORIES if c in present}

    def by_pid(self, categories: tuple[str, ...] | None = OWNED) -> dict[int, np.ndarray]:
        """One series per process (owned categories by default), pids ascending."""
        return {p: self.series(p, categories) for p in sorted({p for p, _ in self.keys})}

    def pids(self) -> list[int]:
        """Processes that held or mapped anything on this GPU."""
        return sorted({p for p, _ in self.keys})

    def index_at(self, ts: int) -> int:
        """Row holding the state at time ``ts`` (after every event at or before it); 0 before any."""
        return max(int(np.searchsorted(self.ts, ts, side="right")) - 1, 0)

    def at(self, ts: int, pid: int | None = None, categories: tuple[str, ...] | None = OWNED) -> int:
        """Bytes held at ``ts`` (owned by default)."""
        return int(self.series(pid, categories)[self.index_at(ts)])

    def peak(self, pid: int | None = None, categories: tuple[str, ...] | None = OWNED) -> tuple[int, int, int]:
        """(bytes, ts, row) of the highest point; the first one when it is reached several times."""
        s = self.series(pid, categories)
        i = int(np.argmax(s)) if len(s) else 0
        return int(s[i]), int(self.ts[i]), i

    def row(self, i: int) -> dict[tuple[int, str], int]:
        """What every (pid, category) held at row ``i`` (zeros left out)."""
        return {k: int(v) for k, v in zip(self.keys, self.values[i].tolist()) if v}


@dataclass
class Timeline:
    """Everything one replay gives: series per GPU, the journal and the final state."""

    gpus: dict[int, GpuSeries]
    journal: Journal
    state: LiveState
    start: int
    events: np.ndarray = field(repr=False)


def build_timeline(
    events: np.ndarray,
    start: int | None = None,
    state: LiveState | None = None,
    stops: Sequence[int] = (),
    at_stop: Callable[[int, LiveState], None] | None = None,
) -> Timeline:
    """Replay ``events`` (filling in their ``gpu``) and build every GPU's series.

    Args:
        events: EVENT_DTYPE in time order.
        start: the time of each series' initial row (default: the first event's ts).
        state: a state to continue from (e.g. restored from a keyframe, with ``journal=True``);
            its holdings are the initial row. Default: empty.
        stops: event indexes (into ``events``, ascending) where ``at_stop(index, state)`` is
            called with the state just *before* that event: who held what at a failed call.
    """
    if state is None:
        state = LiveState(journal=True)
    elif state.journal is None:
        raise ValueError("build_timeline needs a state with journal=True")
    initial = state.counters()  # (gpu, pid, category index) -> bytes
    first_index = state.n_events
    done = 0
    for stop in stops:
        if stop < done:
            raise ValueError("stops must be ascending")
        state.apply(events[done:stop])
        done = stop
        if at_stop is not None:
            at_stop(stop, state)
    state.apply(events[done:])
    journal = Journal.from_state(state)
    if start is None:
        start = int(events["ts"][0]) if len(events) else 0
    gpus = sorted({int(g) for g in np.unique(journal.gpu)} | {g for g, _, _ in initial})
    out = {}
    for g in gpus:
        out[g] = _gpu_series(g, journal, initial, start, first_index)
    return Timeline(gpus=out, journal=journal, state=state, start=start, events=events)


def _gpu_series(g: int, j: Journal, initial: dict, start: int, first_index: int) -> GpuSeries:
    m = j.gpu == g
    pid = j.pid[m]
    cat = j.category[m]
    delta = j.delta[m]
    index = j.index[m]
    ts = j.ts[m]
    keyset = {(int(p), int(c)) for p, c in zip(pid.tolist(), cat.tolist())}
    keyset |= {(p, c) for (gg, p, c) in initial if gg == g}
    keys = sorted(keyset)
    col = {k: i for i, k in enumerate(keys)}
    n = len(delta)
    steps = np.zeros((n + 1, len(keys)), dtype=np.int64)
    for (gg, p, c), b in initial.items():
        if gg == g:
            steps[0, col[(p, c)]] = b
    if n:
        kidx = np.fromiter((col[(p, c)] for p, c in zip(pid.tolist(), cat.tolist())), dtype=np.intp, count=n)
        steps[np.arange(1, n + 1), kidx] = delta
    values = np.cumsum(steps, axis=0)
    # One row per event: several changes from one event (a process exit) collapse to the last.
    last = np.ones(n, dtype=bool)
    if n > 1:
        last[:-1] = index[1:] != index[:-1]
    keep = np.concatenate(([True], last))
    return GpuSeries(
        gpu=g,
        ts=np.concatenate(([start], ts))[keep].astype(np.int64),
        event_index=np.concatenate(([first_index - 1], index))[keep].astype(np.int64),
        keys=[(p, CATEGORIES[c]) for p, c in keys],
        values=values[keep],
    )


def state_at(events: np.ndarray, index: int, keyframes: list | None = None) -> LiveState:
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
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # not a LiveState snapshot (another version): try an earlier one
        state.n_events = kf.event_index
        state.apply(events[kf.event_index : index])
        return state
    state = LiveState()
    state.apply(events[:index])
    return state
