"""The report's phase rows kept as columns: ``report.phases`` (:class:`PhaseList`) and each GPU's
by-phase rows (:class:`GpuPhaseList`).

A step loop's 50,000 markers make 25,000 phases, and as many by-phase rows: an object for each
was most of what the markers added to a report whose text prints 200 rows a table. Here a row is
made a :class:`~memrec.analysis.report.model.PhaseEntry` or
:class:`~memrec.analysis.report.model.GpuPhase` when it is read (the JSON, ``--all``, the rows the
text shows); the text's folded tables (:func:`fold_runs`) and the answer's searches read the
columns. Both are sequences of those objects, so every view reads the one model.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import Iterator
from typing import Sequence

import numpy as np

from memrec.analysis.report.model import GpuPhase
from memrec.analysis.report.model import PhaseEntry
from memrec.analysis.text import seconds_of
from memrec.engine.phases import NO_PHASE
from memrec.engine.phases import PhaseTable
from memrec.engine.phases import UsageTable
from memrec.terms.events import CATEGORIES
from memrec.terms.events import OWNED_CATEGORIES


def jsonable(v: Any) -> Any:
    """A marker's values as JSON-able values (keys as text, bytes as hex, numpy scalars as Python's)."""
    if isinstance(v, dict):
        if not v:
            return {}
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).hex()
    if isinstance(v, np.generic):
        return v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


class PhaseTimes:
    """Each phase's start and end in seconds from the report's start (``*_s``), by phase id: worked
    out once, for the phase list and every GPU's by-phase rows."""

    def __init__(self, table: PhaseTable, start: int) -> None:
        self.table = table
        self.start = start

    @functools.cached_property
    def start_s(self) -> list[float]:
        return seconds_of(self.table.start - self.start)

    @functools.cached_property
    def end_s(self) -> list[float]:
        return seconds_of(self.table.end - self.start)


class PhaseList(Sequence[PhaseEntry]):
    """``report.phases``: the phases ``ids`` of a :class:`PhaseTable`, each a :class:`PhaseEntry`
    when read."""

    def __init__(self, times: PhaseTimes, ids: np.ndarray) -> None:
        self.times = times
        self.table = times.table
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self.entry(i) for i in self.ids[k].tolist()]
        return self.entry(int(self.ids[k]))

    def __iter__(self) -> Iterator[PhaseEntry]:
        return map(self.entry, self.ids.tolist())

    def entry(self, i: int) -> PhaseEntry:
        """Phase ``i`` (an id of the table) as the report shows it."""
        t = self.table
        values = t.values[i]
        return PhaseEntry(id=i, pid=int(t.pid[i]), name=t.name[i], path=t.path[i], depth=int(t.depth[i]),
                          start_ts=int(t.start[i]), end_ts=int(t.end[i]), start_s=self.times.start_s[i],
                          end_s=self.times.end_s[i], closed=bool(t.closed[i]), gpu=t.gpu[i],
                          values=jsonable(values) if values else {})

    def to_json(self) -> list[dict]:
        return [e.to_json() for e in self]

    def with_values(self) -> list[PhaseEntry]:
        """The phases whose markers carried values (a step loop's have none), in order."""
        values = self.table.values
        return [self.entry(i) for i in self.ids.tolist() if values[i]]

    def latest_start(self, pids: list[int], path: str, ts: int) -> int | None:
        """The latest start at or before ``ts`` of phase ``path`` (its path or its name) of one of ``pids``."""
        t = self.table
        ids = self.ids[np.isin(t.pid[self.ids], pids) & (t.start[self.ids] <= ts)].tolist()
        starts = [int(t.start[i]) for i in ids if path in (t.path[i], t.name[i])]
        return max(starts) if starts else None


def fold_runs(keys: list[np.ndarray], fewest: int) -> tuple[np.ndarray, np.ndarray]:
    """``(first, end)`` of each row of a folded table: a run of at least ``fewest`` consecutive
    rows whose ``keys`` are all equal is one, any other row is one alone."""
    n = len(keys[0])
    same = np.ones(max(n - 1, 0), dtype=bool)
    for k in keys:
        same &= k[1:] == k[:-1]
    lo = np.flatnonzero(np.concatenate([[True], ~same])) if n else np.zeros(0, np.int64)
    hi = np.append(lo[1:], n)
    starts = np.zeros(n, dtype=bool)
    starts[lo] = True
    starts |= np.repeat(hi - lo < fewest, hi - lo)  # a short run's rows: each one alone
    first = np.flatnonzero(starts)
    return first, np.append(first[1:], n)


class GpuPhaseList(Sequence[GpuPhase]):
    """One GPU's by-phase rows (per process and phase: bytes by category, allocated, freed, net,
    the part a process exit freed), by process, then in time order, (no phase) last; each a
    :class:`GpuPhase` when read."""

    def __init__(self, times: PhaseTimes, pid: np.ndarray, phase: np.ndarray, by_category: np.ndarray,
                 present: np.ndarray, exit_by_category: np.ndarray, allocated: np.ndarray, freed: np.ndarray,
                 net: np.ndarray, mapped_net: np.ndarray, exit_freed: np.ndarray) -> None:
        self.times = times
        self.pid = pid
        self.phase = phase
        self.by_category = by_category  # rows × CATEGORIES: net bytes
        self.present = present  # rows × CATEGORIES: a change of that category in the phase
        self.exit_by_category = exit_by_category  # rows × CATEGORIES: freed by a process exit (0: none)
        self.allocated = allocated
        self.freed = freed
        self.net = net
        self.mapped_net = mapped_net
        self.exit_freed = exit_freed

    @classmethod
    def of(cls, times: PhaseTimes, usage: UsageTable, exit_usage: UsageTable, gpu: int,
           pid: int | None) -> GpuPhaseList:
        """GPU ``gpu``'s rows of the usage by phase (``exit_usage``: the part process exits made),
        only process ``pid``'s when given; none without phases (a trace's instants alone)."""
        sel = usage.gpu == gpu
        if not len(times.table):
            sel[:] = False
        if pid is not None:
            sel &= usage.pid == pid
        u_pid, u_phase, cat = usage.pid[sel], usage.phase[sel], usage.category[sel]
        allocated, freed = usage.allocated[sel], usage.freed[sel]
        n = len(u_pid)
        first = np.ones(n, dtype=bool)  # usage is ordered by gpu, pid, phase, category
        first[1:] = (u_pid[1:] != u_pid[:-1]) | (u_phase[1:] != u_phase[:-1])
        row = np.cumsum(first) - 1
        rows = int(first.sum())
        net = allocated - freed
        by_category = np.zeros((rows, len(CATEGORIES)), dtype=np.int64)
        present = np.zeros((rows, len(CATEGORIES)), dtype=bool)
        by_category[row, cat] = net
        present[row, cat] = True
        at_exit = np.zeros(n, dtype=np.int64)
        e_sel = exit_usage.gpu == gpu
        if e_sel.any():
            freed_at = dict(zip(zip(exit_usage.pid[e_sel].tolist(), exit_usage.phase[e_sel].tolist(),
                                    exit_usage.category[e_sel].tolist()), exit_usage.freed[e_sel].tolist()))
            at_exit[:] = [freed_at.get(k, 0) for k in zip(u_pid.tolist(), u_phase.tolist(), cat.tolist())]
        exit_by_category = np.zeros((rows, len(CATEGORIES)), dtype=np.int64)
        exit_by_category[row, cat] = at_exit
        owned = np.isin(cat, OWNED_CATEGORIES)

        def summed(values: np.ndarray) -> np.ndarray:
            out = np.zeros(rows, dtype=np.int64)
            np.add.at(out, row, values)
            return out

        r_pid, r_phase = u_pid[first], u_phase[first]
        start = np.where(r_phase >= 0, times.table.start[np.maximum(r_phase, 0)] if len(times.table) else 0, 0)
        order = np.lexsort((r_phase, start, r_phase < 0, r_pid))
        return cls(times, r_pid[order], r_phase[order], by_category[order], present[order], exit_by_category[order],
                   summed(np.where(owned, allocated, 0))[order], summed(np.where(owned, freed, 0))[order],
                   summed(np.where(owned, net, 0))[order], summed(np.where(owned, 0, net))[order],
                   summed(np.where(owned, at_exit, 0))[order])

    def __len__(self) -> int:
        return len(self.pid)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self.row(i) for i in range(len(self))[k]]
        return self.row(range(len(self))[k])

    def __iter__(self) -> Iterator[GpuPhase]:
        return map(self.row, range(len(self)))

    def to_json(self) -> list[dict]:
        return [r.to_json() for r in self]

    def row(self, i: int) -> GpuPhase:
        """Row ``i`` as a :class:`GpuPhase`."""
        phase = int(self.phase[i])
        if phase >= 0:
            t, times = self.times.table, self.times
            out = GpuPhase(int(self.pid[i]), phase, t.path[phase], int(t.start[phase]), int(t.end[phase]),
                           times.start_s[phase], times.end_s[phase], bool(t.closed[phase]))
        else:
            out = GpuPhase(int(self.pid[i]), phase, NO_PHASE, None, None, None, None, None)
        out.by_category = _categories(self.by_category[i], self.present[i])
        out.allocated, out.freed, out.net = int(self.allocated[i]), int(self.freed[i]), int(self.net[i])
        out.mapped_net, out.exit_freed = int(self.mapped_net[i]), int(self.exit_freed[i])
        out.exit_by_category = _categories(self.exit_by_category[i], self.exit_by_category[i] != 0)
        return out

    def any_exit_frees(self) -> bool:
        """Whether a process exit freed anything in a row."""
        return bool(self.exit_freed.any() or self.exit_by_category.any())

    def without_exit_frees(self) -> GpuPhaseList:
        """The rows without the frees process exits made (a row with nothing left goes)."""
        by_category = self.by_category + self.exit_by_category
        present = self.present & (by_category != 0)
        freed = self.freed - self.exit_freed
        keep = present.any(axis=1) | (self.allocated != 0) | (freed != 0)
        return GpuPhaseList(self.times, self.pid[keep], self.phase[keep], by_category[keep], present[keep],
                            self.exit_by_category[keep], self.allocated[keep], freed[keep],
                            (self.net + self.exit_freed)[keep], self.mapped_net[keep], self.exit_freed[keep])

    def path_of(self) -> list[str]:
        """Each row's phase path (``(no phase)`` outside)."""
        path = self.times.table.path
        return [path[p] if p >= 0 else NO_PHASE for p in self.phase.tolist()]

    def folded(self, lo: int, hi: int, path: str) -> GpuPhase:
        """Rows ``lo`` to ``hi`` as one, named ``path``: the first start, the last end, the bytes summed."""
        first, last = self.row(lo), self.row(hi - 1)
        first.path, first.end_ts, first.end_s = path, last.end_ts, last.end_s
        first.by_category = _categories(self.by_category[lo:hi].sum(axis=0), self.present[lo:hi].any(axis=0))
        first.allocated = int(self.allocated[lo:hi].sum())
        first.freed = int(self.freed[lo:hi].sum())
        first.net = int(self.net[lo:hi].sum())
        return first


def _categories(values: np.ndarray, present: np.ndarray) -> dict[str, int]:
    """``{category: value}`` of the categories ``present``, in :data:`CATEGORIES` order."""
    return {CATEGORIES[c]: int(values[c]) for c in np.flatnonzero(present).tolist()}
