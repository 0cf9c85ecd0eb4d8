"""Phases from markers, the one phase of a process at any time, and the bytes each phase moved.

The semantics (``docs/report.md``, "Phases"), the same for ``memrec report``, ``memrec diff``,
``memrec.load``, the exports and the TUI:

- A phase is a begin/end marker pair of one process with the same name. An end closes *its own*
  begin: the latest begin of that name in that process still open. Phases of other names stay
  open, whatever their order (SGLang's hooks nest by construction; hand-written markers may not).
- While several phases of a process are open, its phase is their path from the earliest begun
  to the latest, joined by "/" (``load_weights/kv_pool``). A phase that outlives the phase it
  began in (B begun inside A, A ended first) goes on under the path still open (``A/B`` until
  A's end, ``B`` after): its span is split in two pieces, the second :attr:`Phase.resumes` the
  first; a warning says so.
- A phase never ended ends at the trace's end (``closed`` False); an end without a begin is
  ignored with a warning. Instants are single markers; they have the phase open at their time.
- Spans are half-open, ``[start, end)``: at the time of an end marker the phase is over; several
  markers at one time all apply before that time is read.
- Markers are per process (pid); a rank is a process (its markers carry ``tp_rank`` &c.). A
  shell's ``memrec mark`` is a new process each time, so it stamps its marker with the process it
  speaks for: the leader of the shell's session by default (``--scope session``), so that the
  begin and the end of one script, Makefile or ``bash -c`` pair here like any other process's
  (:func:`memrec.commands.mark.scope_process`); nothing here special-cases shells.

Attribution: every change of a (gpu, pid, category) total (the replay's journal, implicit frees
at exit included) belongs to the innermost phase of *its* process open at that moment; a process
without markers, or a change outside all of its phases, is ``(no phase)`` (phase id -1). Bytes
still held are attributed to the phase of the process that allocated them, when it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Iterable

import numpy as np

from memrec.engine.group import group
from memrec.engine.group import group_sum
from memrec.engine.journal import Journal
from memrec.terms.events import CATEGORIES
from memrec.terms.events import IPC_MAPPED
from memrec.terms.events import Marker

NO_PHASE = "(no phase)"
#: Up to this many processes with markers, :meth:`Phases.assign` masks the rows once per process.
FEW_PROCESSES = 64
#: End time of a phase not ended yet when the end of the trace is not known (a live stream).
OPEN_END = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Phase:
    """One begin/end span of one process (or a piece of one: see :attr:`resumes`)."""

    id: int  # index in Phases.phases (numbered in order of their begin)
    pid: int
    name: str
    path: str  # names of the phases open in this process, earliest begun first, joined by "/"
    start: int
    end: int
    depth: int  # 0 outermost
    parent: int  # id of the enclosing phase, -1 none
    closed: bool  # ended by its own end marker (False: the trace's end, or split: see resumes)
    gpu: int | None = None  # the GPU the begin marker named
    values: dict = field(default_factory=dict)  # the begin marker's values, updated by the end's
    resumes: int = -1  # id of the piece this one continues (an enclosing phase ended first), -1 none


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
        if not self.segments or not len(ts):
            return out
        pids = np.asarray(pids)
        ts = np.asarray(ts).astype(np.int64, copy=False)
        for pid, sel in self._rows_by_pid(pids):
            starts, ids = self.segments[pid]
            k = np.searchsorted(starts, ts[sel], side="right") - 1
            out[sel] = np.where(k >= 0, ids[np.maximum(k, 0)], -1)
        return out

    def _rows_by_pid(self, pids: np.ndarray) -> Iterable[tuple[int, np.ndarray]]:
        """``(pid, its rows)`` for each process with markers that ``pids`` names: a mask per such
        process when they are few, else one sort of the rows (100,000 processes with markers
        made a mask each over every row: O(processes × rows))."""
        if len(self.segments) <= FEW_PROCESSES:
            for pid in self.segments:
                sel = np.flatnonzero(pids == pid)
                if len(sel):
                    yield pid, sel
            return
        order = np.argsort(pids, kind="stable")
        grouped = pids[order]
        cut = np.flatnonzero(grouped[1:] != grouped[:-1]) + 1
        for lo, hi in zip([0, *cut.tolist()], [*cut.tolist(), len(order)]):
            pid = int(grouped[lo])
            if pid in self.segments:
                yield pid, order[lo:hi]

    def phase_at(self, pid: int, ts: int) -> int:
        """The innermost phase of ``pid`` open at ``ts`` (-1 none)."""
        return int(self.assign(np.array([pid]), np.array([ts], dtype=np.int64))[0])

    def label_at(self, pid: int, ts: int) -> str:
        """The phase path of ``pid`` at ``ts`` (``(no phase)`` outside its phases)."""
        return self.label(self.phase_at(pid, ts))

    def labels(self, ids: Iterable[int]) -> list[str]:
        """:meth:`label` of each id."""
        return [self.label(i) for i in ids]


def build_phases(markers: Iterable[Marker], end_ts: int = OPEN_END) -> Phases:
    """Pair begin/end markers per process (see the module docstring); unclosed phases end at
    ``end_ts`` (or the last marker, if later).

    The phases are built as columns (a list per field) and made :class:`Phase` at the end: a step
    loop's 25,000 pairs spent most of this in a dict per phase and its keyword construction.
    """
    markers = list(markers)
    times = np.array([m.ts for m in markers], dtype=np.int64)
    order = np.argsort(times, kind="stable").tolist()  # stable: markers at one time in file order
    end_ts = max(end_ts, int(times.max())) if len(markers) else end_ts
    # the phases being built, a list per field of Phase (ids are indices)
    pids: list[int] = []
    names: list[str] = []
    paths: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    depths: list[int] = []
    parents: list[int] = []
    closed: list[bool] = []
    gpus: list[int | None] = []
    values: list[dict] = []
    resumes: list[int] = []
    instants: list[Marker] = []
    warnings: list[str] = []
    # pid -> (open phase ids in begin order, times, the innermost phase id from each time on)
    per_pid: dict[int, tuple[list[int], list[int], list[int]]] = {}

    def open_phase(stack: list[int], pid: int, name: str, ts: int, gpu: int | None, vals: dict, resumed: int) -> None:
        parent = stack[-1] if stack else -1
        stack.append(len(pids))
        pids.append(pid)
        names.append(name)
        paths.append(f"{paths[parent]}/{name}" if parent >= 0 else name)
        starts.append(ts)
        ends.append(end_ts)
        depths.append(len(stack) - 1)
        parents.append(parent)
        closed.append(False)
        gpus.append(gpu)
        values.append(vals)
        resumes.append(resumed)

    for mk in map(markers.__getitem__, order):
        pid, phase, ts = mk.pid, mk.phase, mk.ts
        known = per_pid.get(pid)
        if known is None:
            known = per_pid[pid] = ([], [], [])
        stack, at, ids = known
        if phase == "begin":
            open_phase(stack, pid, mk.name, ts, mk.gpu, dict(mk.values) if mk.values else {}, -1)
        elif phase == "end":
            name = mk.name
            if stack and names[stack[-1]] == name:  # the innermost: most ends
                j = len(stack) - 1
            else:
                j = next((k for k in range(len(stack) - 2, -1, -1) if names[stack[k]] == name), None)
            if j is None:
                warnings.append(f"pid {pid}: end of {name!r} at {ts} without a begin (ignored)")
                continue
            ended = stack[j]
            ends[ended] = ts
            closed[ended] = True
            if mk.values:
                values[ended].update(mk.values)
            later = stack[j + 1 :]
            del stack[j:]
            for inner in later:  # begun inside the phase that ended: they go on, one level up
                ends[inner] = ts
                open_phase(stack, pid, names[inner], ts, gpus[inner], dict(values[inner]), inner)
                warnings.append(
                    f"pid {pid}: {name!r} ended at {ts} while {names[inner]!r} begun inside it was open; "
                    f"{names[inner]!r} goes on as {paths[-1]!r}"
                )
        elif phase == "instant":
            instants.append(mk)
            continue
        else:
            warnings.append(f"pid {pid}: marker {mk.name!r} with unknown phase {phase!r} (ignored)")
            continue
        innermost = stack[-1] if stack else -1
        if at and at[-1] == ts:  # several markers at one time: the last one wins
            ids[-1] = innermost
        else:
            at.append(ts)
            ids.append(innermost)
    segments = {pid: (np.asarray(at, dtype=np.int64), np.asarray(ids, dtype=np.int64))
                for pid, (_, at, ids) in per_pid.items() if at}
    phases = Phases(list(map(Phase, range(len(pids)), pids, names, paths, starts, ends, depths, parents, closed, gpus,
                             values, resumes)), [], warnings, segments)
    # Instants take the phase open at their time once every marker at that time applied.
    at = phases.assign(np.array([x.pid for x in instants], dtype=np.int64),
                       np.array([x.ts for x in instants], dtype=np.int64)).tolist()
    phases.instants = [Instant(x.pid, x.name, x.ts, ph, x.gpu, dict(x.values) if x.values else {})
                       for x, ph in zip(instants, at)]
    return phases


#: Journal rows per attribution step: the temporaries (phase ids, group codes) stay bounded (a
#: whole 10M-row journal at once took 560 MB more than the journal itself).
ATTRIBUTE_CHUNK = 1 << 20


def attribute(phases: Phases, journal: Journal) -> list[PhaseUsage]:
    """Bytes allocated and freed per (phase, pid, gpu, category), ordered by gpu, pid, phase, category."""
    out = Attribution(phases)
    out.add(journal)
    return out.usage()


class Attribution:
    """:func:`attribute` over journal rows given a part at a time (a replay's chunks, which it
    need not keep): each part is grouped a chunk of rows at a time, then every part's (few)
    groups once more in :meth:`usage`."""

    def __init__(self, phases: Phases) -> None:
        self.phases = phases
        self._parts: list[list[np.ndarray]] = []

    def add(self, journal: Journal) -> None:
        """Group ``journal``'s rows (nothing of it is kept)."""
        for lo in range(0, len(journal), ATTRIBUTE_CHUNK):
            pid = journal.pid[lo : lo + ATTRIBUTE_CHUNK]
            phase = self.phases.assign(pid, journal.ts[lo : lo + ATTRIBUTE_CHUNK])
            inverse, keys = group([journal.gpu[lo : lo + ATTRIBUTE_CHUNK], pid, phase,
                                   journal.category[lo : lo + ATTRIBUTE_CHUNK]])
            d = journal.delta[lo : lo + ATTRIBUTE_CHUNK]
            self._parts.append(keys + [group_sum(inverse, len(keys[0]), np.maximum(d, 0)),
                                       group_sum(inverse, len(keys[0]), np.maximum(-d, 0))])

    def usage(self) -> list[PhaseUsage]:
        """The usage of every row added so far."""
        if not self._parts:
            return []
        cols = [np.concatenate(c) for c in zip(*self._parts)]
        inverse, (g, p, ph, c) = group(cols[:4])
        allocated = group_sum(inverse, len(g), cols[4])
        freed = group_sum(inverse, len(g), cols[5])
        # positional, a row per (phase, pid, gpu, category): a step loop's 25,000 phases
        return list(map(PhaseUsage, ph.tolist(), p.tolist(), g.tolist(), [CATEGORIES[c_] for c_ in c.tolist()],
                        allocated.tolist(), freed.tolist()))


@dataclass(frozen=True)
class HeldByPhase:
    """Owned bytes one GPU holds now that were allocated in one phase (``(no phase)`` outside)."""

    phase: str
    bytes: int
    count: int  # allocations
    pids: tuple[int, ...]


def held_by_phase(state: Any, gpu: int, phases: Phases, pid: int | None = None) -> list[HeldByPhase]:
    """What ``gpu`` holds in ``state`` (a LiveState; owned, ``ipc_mapped`` left out), by the phase
    the owner was in when it allocated each piece; largest first (then by path). ``pid``: only
    that process's pieces (a report filtered to one process names only its own phases)."""
    held = [h for h in state.holdings(gpu=gpu, pid=pid) if h.category != CATEGORIES[IPC_MAPPED]]
    if not held:
        return []
    ids = phases.assign(np.array([h.pid for h in held], dtype=np.int64), np.array([h.ts for h in held], dtype=np.int64))
    out: dict[str, list] = {}
    for h, ph in zip(held, ids.tolist()):
        row = out.setdefault(phases.label(ph), [0, 0, set()])
        row[0] += h.size
        row[1] += 1
        row[2].add(h.pid)
    rows = [HeldByPhase(k, b, n, tuple(sorted(p))) for k, (b, n, p) in out.items()]
    rows.sort(key=lambda r: (-r.bytes, r.phase))
    return rows
