"""Phases from markers, and the bytes each phase allocated on each GPU.

A phase is a begin/end marker pair of one process with the same name; phases of a process nest
(an end closes the innermost open phase of that name; phases still open inside it end with it,
flagged as not closed). Phases never closed end at the trace's end. Instants are single markers.

Attribution: every change of a (gpu, pid, category) total (the replay's journal, implicit frees
at exit included) belongs to the innermost phase of *its* process open at that moment: a phase
covers ``[start, end)``. A process without markers, or a change outside all of its phases, is
``(no phase)`` (phase id -1).
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

import numpy as np

from memrec.analysis.timeline import Journal
from memrec.events import CATEGORIES
from memrec.events import Marker

NO_PHASE = "(no phase)"


@dataclass(frozen=True)
class Phase:
    """One begin/end span of one process."""

    id: int  # index in Phases.phases (phases are numbered in order of their begin)
    pid: int
    name: str
    path: str  # names from the outermost phase down, joined by "/"
    start: int
    end: int
    depth: int  # 0 outermost
    parent: int  # id of the enclosing phase, -1 none
    closed: bool  # ended by its own end marker (False: trace end, or an outer phase ended)
    gpu: int | None = None  # the GPU the begin marker named
    values: dict = field(default_factory=dict)  # the begin marker's values, updated by the end's


@dataclass(frozen=True)
class Instant:
    """One instant marker, with the phase of its process open at that moment."""

    pid: int
    name: str
    ts: int
    phase: int  # innermost open phase id, -1 none
    gpu: int | None = None
    values: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PhaseUsage:
    """Bytes one process allocated and freed on one GPU, in one category, during one phase."""

    phase: int  # -1: (no phase)
    pid: int
    gpu: int
    category: str
    allocated: int
    freed: int

    @property
    def net(self) -> int:
        return self.allocated - self.freed


@dataclass
class Phases:
    """The phases and instants of a trace, and per process which phase is innermost when."""

    phases: list[Phase]
    instants: list[Instant]
    warnings: list[str]
    #: pid -> (segment start times, innermost phase id from that time on, -1 none)
    segments: dict[int, tuple[np.ndarray, np.ndarray]]

    def label(self, phase_id: int) -> str:
        """A phase's path, or ``(no phase)``."""
        return NO_PHASE if phase_id < 0 else self.phases[phase_id].path

    def assign(self, pids: np.ndarray, ts: np.ndarray) -> np.ndarray:
        """The innermost phase id (-1 none) of each (pid, ts)."""
        out = np.full(len(ts), -1, dtype=np.int64)
        for pid, (starts, ids) in self.segments.items():
            m = pids == pid
            if not m.any():
                continue
            k = np.searchsorted(starts, ts[m], side="right") - 1
            out[m] = np.where(k >= 0, ids[np.maximum(k, 0)], -1)
        return out

    def phase_at(self, pid: int, ts: int) -> int:
        """The innermost phase of ``pid`` open at ``ts`` (-1 none)."""
        return int(self.assign(np.array([pid]), np.array([ts], dtype=np.int64))[0])


def build_phases(markers: list[Marker], end_ts: int) -> Phases:
    """Pair begin/end markers per process into nested phases; unclosed ones end at ``end_ts``."""
    order = sorted(range(len(markers)), key=lambda i: (markers[i].ts, i))
    end_ts = max([end_ts] + [markers[i].ts for i in order])
    rows: list[dict] = []  # mutable phases while building
    instants: list[Instant] = []
    warnings: list[str] = []
    stacks: dict[int, list[int]] = {}
    points: dict[int, list[tuple[int, int]]] = {}  # pid -> [(ts, innermost id after this marker)]
    for i in order:
        mk = markers[i]
        stack = stacks.setdefault(mk.pid, [])
        if mk.phase == "begin":
            parent = stack[-1] if stack else -1
            path = f"{rows[parent]['path']}/{mk.name}" if parent >= 0 else mk.name
            rows.append(
                dict(
                    id=len(rows), pid=mk.pid, name=mk.name, path=path, start=mk.ts, end=end_ts,
                    depth=len(stack), parent=parent, closed=False, gpu=mk.gpu, values=dict(mk.values or {}),
                )
            )
            stack.append(len(rows) - 1)
        elif mk.phase == "end":
            j = next((k for k in range(len(stack) - 1, -1, -1) if rows[stack[k]]["name"] == mk.name), None)
            if j is None:
                warnings.append(f"pid {mk.pid}: end of {mk.name!r} at {mk.ts} without a begin (ignored)")
                continue
            for inner in stack[j + 1 :]:
                rows[inner]["end"] = mk.ts
                warnings.append(
                    f"pid {mk.pid}: {rows[inner]['name']!r} was still open when {mk.name!r} ended; ended with it"
                )
            row = rows[stack[j]]
            row["end"] = mk.ts
            row["closed"] = True
            row["values"].update(mk.values or {})
            del stack[j:]
        elif mk.phase == "instant":
            instants.append(Instant(mk.pid, mk.name, mk.ts, stack[-1] if stack else -1, mk.gpu, dict(mk.values or {})))
            continue
        else:
            warnings.append(f"pid {mk.pid}: marker {mk.name!r} with unknown phase {mk.phase!r} (ignored)")
            continue
        points.setdefault(mk.pid, []).append((mk.ts, stack[-1] if stack else -1))
    segments = {}
    for pid, pts in points.items():
        starts: list[int] = []
        ids: list[int] = []
        for ts, pid_phase in pts:
            if starts and starts[-1] == ts:  # several markers at one time: the last one wins
                ids[-1] = pid_phase
            else:
                starts.append(ts)
                ids.append(pid_phase)
        segments[pid] = (np.asarray(starts, dtype=np.int64), np.asarray(ids, dtype=np.int64))
    return Phases([Phase(**r) for r in rows], instants, warnings, segments)


def attribute(phases: Phases, journal: Journal) -> list[PhaseUsage]:
    """Bytes allocated and freed per (phase, pid, gpu, category), ordered by gpu, pid, phase, category."""
    if len(journal) == 0:
        return []
    phase = phases.assign(journal.pid, journal.ts)
    keys = np.stack([journal.gpu, journal.pid, phase, journal.category], axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    allocated = np.zeros(len(uniq), dtype=np.int64)
    freed = np.zeros(len(uniq), dtype=np.int64)
    d = journal.delta
    np.add.at(allocated, inverse, np.where(d > 0, d, 0))
    np.add.at(freed, inverse, np.where(d < 0, -d, 0))
    out = []
    for (g, p, ph, c), a, f in zip(uniq.tolist(), allocated.tolist(), freed.tolist()):
        out.append(PhaseUsage(phase=ph, pid=p, gpu=g, category=CATEGORIES[c], allocated=a, freed=f))
    return out
