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

import functools
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Iterable

import numpy as np

from memrec.engine.group import group
from memrec.engine.group import group_sum
from memrec.engine.journal import Journal
from memrec.terms.events import CATEGORIES
from memrec.terms.events import Marker
from memrec.terms.events import MarkerColumns

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
class PhaseTable:
    """Every phase as columns, by id (:class:`Phase`'s fields): what the report reads, a step
    loop's 25,000 phases without an object each; :attr:`Phases.phases` makes the objects."""

    pid: np.ndarray  # int64
    start: np.ndarray  # int64
    end: np.ndarray  # int64
    depth: np.ndarray  # int64
    parent: np.ndarray  # int64
    closed: np.ndarray  # bool
    resumes: np.ndarray  # int64
    name: list[str]
    path: list[str]
    gpu: list[int | None]
    values: list[dict]  # the begin marker's, updated by the end's; read only (may be a marker's own)

    def __len__(self) -> int:
        return len(self.name)


@dataclass
class Phases:
    """The phases and instants of a trace, and per process which phase is innermost when."""

    table: PhaseTable
    instants: list[Instant]
    warnings: list[str]
    #: pid -> (segment start times, innermost phase id from that time on, -1 none)
    segments: dict[int, tuple[np.ndarray, np.ndarray]]

    @functools.cached_property
    def phases(self) -> list[Phase]:
        """Every phase as a :class:`Phase`, by id (made on first use: the report reads the table)."""
        t = self.table
        return list(map(Phase, range(len(t)), t.pid.tolist(), t.name, t.path, t.start.tolist(), t.end.tolist(),
                        t.depth.tolist(), t.parent.tolist(), t.closed.tolist(), t.gpu, [dict(v) for v in t.values],
                        t.resumes.tolist()))

    def label(self, phase_id: int) -> str:
        """A phase's path, or ``(no phase)``."""
        return NO_PHASE if phase_id < 0 else self.table.path[phase_id]

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


#: A marker's phase as a code (:func:`build_phases`).
_BEGIN, _END, _INSTANT, _UNKNOWN = range(4)
_PHASE_CODE = {"begin": _BEGIN, "end": _END, "instant": _INSTANT}


def build_phases(markers: Iterable[Marker], end_ts: int = OPEN_END) -> Phases:
    """Pair begin/end markers per process (see the module docstring); unclosed phases end at
    ``end_ts`` (or the last marker, if later).

    The phases come out as columns (:class:`PhaseTable`): a step loop's 25,000 phases spent most
    of this in an object each. A step loop's markers (each process's begins and ends
    alternating, each end closing the begin before it) are paired with numpy
    (:func:`_flat_pairs`); any other shape is walked in time order (:func:`_walk`).
    """
    cols = markers if isinstance(markers, MarkerColumns) else MarkerColumns.of(markers)
    times = np.asarray(cols.ts, dtype=np.int64)
    order = np.argsort(times, kind="stable")  # stable: markers at one time in file order
    end_ts = max(end_ts, int(times.max())) if len(times) else end_ts
    code = np.array([_PHASE_CODE.get(p, _UNKNOWN) for p in cols.phase], dtype=np.int8)
    built = _flat_pairs(cols, times, order, code, end_ts)
    table, segments, warnings = built if built is not None else _walk(cols, order.tolist(), end_ts)
    phases = Phases(table, [], warnings, segments)
    # Instants take the phase open at their time once every marker at that time applied.
    instants = order[code[order] == _INSTANT]
    at = phases.assign(np.asarray(cols.pid, dtype=np.int64)[instants], times[instants]).tolist()
    phases.instants = [Instant(cols.pid[i], cols.name[i], cols.ts[i], ph, cols.gpu[i],
                               dict(cols.values[i]) if cols.values[i] else {})
                       for i, ph in zip(instants.tolist(), at)]
    return phases


def _flat_pairs(cols: MarkerColumns, times: np.ndarray, order: np.ndarray, code: np.ndarray,
                end_ts: int) -> tuple[PhaseTable, dict, list[str]] | None:
    """The phases of markers that never nest, with numpy; None for any other shape.

    That shape: in time order, each process's begins and ends alternate, a begin first, each end
    naming the begin before it (a process's last begin may stay open); instants anywhere, no
    unknown phase. Then each phase is a begin and the end after it, at depth 0, and what
    :func:`_walk` would build (ids in the order of the begins, a process's segments the phase from
    its begin and none from its end, the last marker at one time winning) is computed per column.
    """
    if (code == _UNKNOWN).any():
        return None
    paired = order[code[order] < _INSTANT]  # begins and ends, in time order
    pids = np.asarray(cols.pid, dtype=np.int64)[paired]
    by_pid = np.argsort(pids, kind="stable")
    seq = paired[by_pid]  # each process's begins and ends, in time order
    pid = pids[by_pid]
    n = len(seq)
    first = np.ones(n, dtype=bool)
    first[1:] = pid[1:] != pid[:-1]
    group_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    nth = np.arange(n) - group_start  # position in its process's sequence
    is_begin = code[seq] == _BEGIN
    if not np.array_equal(is_begin, nth % 2 == 0):
        return None
    names = np.array(cols.name, dtype=object)
    ends = np.flatnonzero(~is_begin)
    if len(ends) and not (names[seq[ends]] == names[seq[ends - 1]]).all():
        return None
    # phase ids: the begins in time order (their place in ``seq`` by their place in ``order``)
    begin_at = np.flatnonzero(is_begin)
    rank = np.empty(len(times), dtype=np.int64)
    rank[order] = np.arange(len(order))
    begin_at = begin_at[np.argsort(rank[seq[begin_at]], kind="stable")]
    phase_of = np.full(n, -1, dtype=np.int64)  # the phase a begin opens
    phase_of[begin_at] = np.arange(len(begin_at))
    begins = seq[begin_at]
    has_end = begin_at + 1 < n
    has_end[has_end] = ~first[begin_at[has_end] + 1]
    end_marker = np.where(has_end, seq[np.minimum(begin_at + 1, n - 1)], -1)
    m = len(begins)
    begin_list, end_list = begins.tolist(), end_marker.tolist()
    name = [cols.name[i] for i in begin_list]
    marker_values = cols.values
    values = [marker_values[i] for i in begin_list]  # read only (Phases.phases copies)
    for k, e in enumerate(end_list):
        if e >= 0 and marker_values[e]:
            values[k] = {**values[k], **marker_values[e]}
    table = PhaseTable(
        pid=pids[by_pid][begin_at], start=times[begins], end=np.where(has_end, times[end_marker], end_ts),
        depth=np.zeros(m, dtype=np.int64), parent=np.full(m, -1, dtype=np.int64), closed=has_end,
        resumes=np.full(m, -1, dtype=np.int64), name=name, path=list(name), gpu=[cols.gpu[i] for i in begin_list],
        values=values)
    # segments: each marker's innermost phase from its time on; of markers at one time, the last
    at = times[seq]
    last = np.ones(n, dtype=bool)
    last[:-1] = (at[1:] != at[:-1]) | first[1:]
    kept = np.flatnonzero(last)
    seg_ts, seg_id, seg_pid = at[kept], phase_of[kept], pid[kept]
    starts = np.flatnonzero(np.diff(seg_pid, prepend=-1)).tolist() + [len(kept)]
    segments = {int(seg_pid[lo]): (seg_ts[lo:hi], seg_id[lo:hi]) for lo, hi in zip(starts, starts[1:])}
    return table, segments, []


def _walk(cols: MarkerColumns, order: list[int], end_ts: int) -> tuple[PhaseTable, dict, list[str]]:
    """The phases of markers of any shape, walked in time order (``order``): the module
    docstring's semantics, nesting, resumed pieces, unknown phases and warnings included."""
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

    c_ts, c_pid, c_name, c_phase, c_gpu, c_values = cols.ts, cols.pid, cols.name, cols.phase, cols.gpu, cols.values
    for i in order:
        pid, phase, ts = c_pid[i], c_phase[i], c_ts[i]
        known = per_pid.get(pid)
        if known is None:
            known = per_pid[pid] = ([], [], [])
        stack, at, ids = known
        if phase == "begin":
            open_phase(stack, pid, c_name[i], ts, c_gpu[i], dict(c_values[i]) if c_values[i] else {}, -1)
        elif phase == "end":
            name = c_name[i]
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
            if c_values[i]:
                values[ended].update(c_values[i])
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
            continue
        else:
            warnings.append(f"pid {pid}: marker {c_name[i]!r} with unknown phase {phase!r} (ignored)")
            continue
        innermost = stack[-1] if stack else -1
        if at and at[-1] == ts:  # several markers at one time: the last one wins
            ids[-1] = innermost
        else:
            at.append(ts)
            ids.append(innermost)
    segments = {pid: (np.asarray(at, dtype=np.int64), np.asarray(ids, dtype=np.int64))
                for pid, (_, at, ids) in per_pid.items() if at}
    i64 = functools.partial(np.array, dtype=np.int64)
    table = PhaseTable(i64(pids), i64(starts), i64(ends), i64(depths), i64(parents), np.array(closed, dtype=bool),
                       i64(resumes), names, paths, gpus, values)
    return table, segments, warnings


#: Journal rows per attribution step: the temporaries (phase ids, group codes) stay bounded (a
#: whole 10M-row journal at once took 560 MB more than the journal itself).
ATTRIBUTE_CHUNK = 1 << 20


def attribute(phases: Phases, journal: Journal) -> list[PhaseUsage]:
    """Bytes allocated and freed per (phase, pid, gpu, category), ordered by gpu, pid, phase, category."""
    return attribute_table(phases, journal).rows()


def attribute_table(phases: Phases, journal: Journal) -> UsageTable:
    """:func:`attribute` as columns (a step loop's 25,000 phases: as many rows, no object each)."""
    out = Attribution(phases)
    out.add(journal)
    return out.table()


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

    def table(self) -> UsageTable:
        """The usage of every row added so far, as columns."""
        if not self._parts:
            return UsageTable(*(np.zeros(0, dtype=np.int64) for _ in range(6)))
        cols = [np.concatenate(c) for c in zip(*self._parts)]
        inverse, (g, p, ph, c) = group(cols[:4])
        return UsageTable(ph.astype(np.int64), p.astype(np.int64), g.astype(np.int64), c.astype(np.int64),
                          group_sum(inverse, len(g), cols[4]), group_sum(inverse, len(g), cols[5]))

    def usage(self) -> list[PhaseUsage]:
        """The usage of every row added so far."""
        return self.table().rows()


@dataclass
class UsageTable:
    """:class:`PhaseUsage` rows as columns, ordered by gpu, pid, phase, category (the report's
    by-phase rows read these: a step loop's 25,000 phases make as many rows)."""

    phase: np.ndarray  # -1: (no phase)
    pid: np.ndarray
    gpu: np.ndarray
    category: np.ndarray  # index in CATEGORIES
    allocated: np.ndarray
    freed: np.ndarray

    def __len__(self) -> int:
        return len(self.phase)

    def rows(self) -> list[PhaseUsage]:
        """Each row as a :class:`PhaseUsage`."""
        return list(map(PhaseUsage, self.phase.tolist(), self.pid.tolist(), self.gpu.tolist(),
                        [CATEGORIES[c] for c in self.category.tolist()], self.allocated.tolist(), self.freed.tolist()))


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
    that process's pieces (a report filtered to one process names only its own phases).

    Summed as columns (:meth:`memrec.state.queries.Queries.owned_columns`, grouped by phase and
    process): the TUI asks it at every cursor move, and a Python step per allocation was most of
    a seek at a million live allocations."""
    pids, ts, sizes = state.owned_columns(gpu=gpu, pid=pid)
    if not len(pids):
        return []
    inverse, (ids, owners) = group([phases.assign(pids, ts), pids])
    sums = group_sum(inverse, len(ids), sizes)
    counts = np.bincount(inverse, minlength=len(ids))
    out: dict[str, list] = {}
    for ph, p, b, n in zip(ids.tolist(), owners.tolist(), sums.tolist(), counts.tolist()):
        row = out.setdefault(phases.label(ph), [0, 0, set()])
        row[0] += b
        row[1] += n
        row[2].add(p)
    rows = [HeldByPhase(k, b, n, tuple(sorted(p))) for k, (b, n, p) in out.items()]
    rows.sort(key=lambda r: (-r.bytes, r.phase))
    return rows
