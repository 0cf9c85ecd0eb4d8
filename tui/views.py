"""What the TUI model hands to the widgets: plain values (dataclasses, numpy arrays), no Textual.

Kept apart from :mod:`memrec.tui.model` so that the widgets and the messages depend on the shapes
they draw (a :class:`SeriesView`, a :class:`CursorState`, the phase bands' :class:`PhaseSpan`) and
not on the model that computes them. The phases are views of :mod:`memrec.engine.phases` (the
report's and diff's), never a second phase logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Iterable

import numpy as np

from memrec.trace.stacks import Frame
from memrec.trace.stacks import Stack
from memrec.terms.events import CATEGORIES
from memrec.terms.events import IPC_MAPPED
from memrec.terms.events import OWNED_CATEGORIES as OWNED
from memrec.terms.events import Marker
from memrec.engine.phases import OPEN_END
from memrec.engine.phases import Phases
from memrec.engine.phases import build_phases
from memrec.state.tensors import Fragmentation

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


@dataclass(frozen=True)
class StackView:
    """The stack of one event (``s`` on the events or the largest allocations): what the event
    was (``kind``, ``size``, ``pid``, ``ts``) and its frames innermost first, Unavailable (with the
    reason), or None when none was recorded; ``site``: the frame the report names its site.
    A free selected shows the allocation it frees: then ``free_seq`` is the free's event, and
    ``free_unmatched`` says that its allocation is not among the events (made before them)."""

    seq: int
    kind: str
    size: int
    pid: int
    ts: int
    stack: Stack | None
    site: Frame | None
    free_seq: int | None = None
    free_unmatched: bool = False


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
    #: (label, {each column of memrec.analysis.untraced.split.SPLIT}).
    untraced_split: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    #: Why the two lists above are empty, when they are ("" when they are known).
    untraced_note: str = ""
    #: Per process with PyTorch tensor blocks on this GPU (a --tensors trace): (label, state).
    tensors: list[tuple[str, Fragmentation]] = field(default_factory=list)

    @property
    def owned(self) -> int:
        return sum(self.by_category.get(CATEGORIES[c], 0) for c in OWNED)

    @property
    def untraced(self) -> int | None:
        if not self.nvml or self.nvml.get("used", -1) < 0:
            return None
        return self.nvml["used"] - self.owned


def diff_rows(a: dict[str, int], b: dict[str, int]) -> list[tuple[str, int, int, int]]:
    """(key, a, b, b - a) for every key of either mapping, biggest change first."""
    keys = set(a) | set(b)
    rows = [(k, a.get(k, 0), b.get(k, 0), b.get(k, 0) - a.get(k, 0)) for k in keys]
    rows.sort(key=lambda r: (-abs(r[3]), r[0]))
    return rows
