"""Allocation sites: which line of the user's code took the memory, per phase, across ranks.

A trace with stacks (format 2.3, :mod:`memrec.trace.stacks`) names, for each allocation, the
stack of the thread that made it. Its **site** is the innermost *user* frame of that stack
(:func:`user_frame`): the line in the application (SGLang, the user's script) that asked for the
memory, not the allocator, PyTorch or memrec itself. A frame is not the user's when it is

* native (a frame of a shared library: the driver, libc10_cuda, libtorch, Python itself);
* not a file (``<frozen importlib._bootstrap>``, ``<string>``, ``<unreadable>``...);
* in PyTorch (a path with a ``torch`` package directory: ``.../site-packages/torch/...``);
* in memrec (a ``memrec`` package directory: its SGLang hooks);
* in the interpreter's standard library (``.../lib/python3.X/...`` outside ``site-packages`` /
  ``dist-packages``: importlib, runpy, threading, contextlib, functools...).

A stack with no user frame takes its innermost Python frame (else its innermost frame) as its
site; an unavailable stack is the site ``stack unavailable (reason)``, and so is a stack of native
frames only under a frame the recorder named ``<python stack unavailable>`` (line 0, the reason
as its function).

Per phase (the report's phases, by path, joined over processes: every rank's
``load_weights``) and per site: the bytes **allocated** there (successful allocations); of those,
the most the site held at once (**peak**: what it took; a process that died of an out-of-memory
error, or exited, holds nothing at the end, and its sites still show what they took), and the
bytes still **held** when the allocating process left the phase (not freed, its process not
exited; ``(no phase)``: at the end of the trace). Driver allocations (``cuMemAlloc*``,
``cuMemCreate``) and tensor blocks (PyTorch's caching allocator, inside the driver's segments) are
counted apart (``level``), since one holds the other. The section is absent from a trace without
stacks: every view of it stays as it was.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from memrec.engine.source import ColumnSource
from memrec.engine.source import TraceEvents
from memrec.terms.columns import failed_calls
from memrec.engine.phases import Phases
from memrec.terms.events import Kind
from memrec.terms.ranks import pid_labels
from memrec.state.fields import MAX_SIZE
from memrec.trace.stacks import Frame
from memrec.trace.stacks import Stack
from memrec.trace.stacks import StackTable
from memrec.trace.stacks import Unavailable

#: How many sites each phase lists (report text; the JSON has them all up to SITES_JSON, and
#: ``memrec report --all`` every one, in the text and the JSON).
SITES_SHOWN = 5
SITES_JSON = 50
#: How many failed calls' sites the section keeps (the answer names the first out-of-memory's).
FAILURES_KEPT = 1000
#: Allocation kind -> (its free kind, the column that pairs them, level).
_PAIRS = {
    int(Kind.ALLOC): (int(Kind.FREE), "ptr", "driver"),
    int(Kind.VMM_CREATE): (int(Kind.VMM_RELEASE), "handle", "driver"),
    int(Kind.TENSOR_ALLOC): (int(Kind.TENSOR_FREE), "ptr", "tensor"),
}
LEVELS = ("driver", "tensor")
#: A free kind -> (the allocation kind it ends, the column that pairs them): the stack of a free is
#: its allocation's (the TUI's ``s`` on a free).
ALLOCATION_OF = {free: (alloc, key) for alloc, (free, key, _) in _PAIRS.items()}
_STDLIB = re.compile(r"/lib(64)?/python\d+(\.\d+)?/")
_PACKAGES = ("/site-packages/", "/dist-packages/")
_NOT_USER_DIRS = ("/torch/", "/memrec/")


def is_user_frame(frame: Frame) -> bool:
    """Whether ``frame`` is the user's code (see the module docstring for the rule)."""
    path = frame.file
    if frame.native or not path or path.startswith("<"):
        return False
    if any(d in path for d in _NOT_USER_DIRS) or path.startswith(("torch/", "memrec/")):
        return False
    return not (_STDLIB.search(path) and not any(p in path for p in _PACKAGES))


def user_frame(stack: tuple[Frame, ...]) -> Frame | None:
    """The innermost user frame of ``stack`` (innermost first); else its innermost Python frame;
    else its innermost frame that is not a file (the recorder's ``<python stack unavailable>``
    before native frames says why there is no Python); else its innermost frame; None for none."""
    for frame in stack:
        if is_user_frame(frame):
            return frame
    python = [f for f in stack if not f.native and not f.file.startswith("<")]
    marks = [f for f in stack if not f.native and f.file.startswith("<")]
    return (python or marks or list(stack) or [None])[0]


@dataclass(frozen=True)
class Site:
    """Where an allocation came from: a user frame, or why the stack is unknown."""

    file: str  # full path ("" for an unavailable stack)
    line: int
    function: str
    native: bool = False
    unavailable: str | None = None  # the reason, for a stack memrec could not read

    @property
    def label(self) -> str:
        """``custom_all_reduce.py:123 CustomAllreduce.__init__``, as every view names a site."""
        if self.unavailable is not None:
            return f"stack unavailable ({self.unavailable})"
        frame = Frame(os.path.basename(self.file), self.line, self.function, self.native)
        return frame.label()

    @classmethod
    def of(cls, stack: Stack | None) -> Site | None:
        """The site of one stack (None: no stack, or no frames)."""
        if isinstance(stack, Unavailable):
            return cls("", 0, "", unavailable=stack.reason)
        frame = user_frame(stack) if stack else None
        if frame is not None and frame.file.startswith("<") and not frame.line and not frame.native:
            return cls("", 0, "", unavailable=f"{frame.file.strip('<>')}: {frame.function}")  # a reason, not code
        return None if frame is None else cls(frame.file, frame.line, frame.function, frame.native)


def stack_sites(stacks: StackTable, ids: np.ndarray) -> tuple[list[Site | None], np.ndarray]:
    """The distinct sites of stack ``ids`` (0: none) and each id's index among them (-1: none)."""
    sites: list[Site | None] = []
    index: dict[Site, int] = {}
    unique, inverse = np.unique(ids, return_inverse=True)
    of_unique = np.full(len(unique), -1, np.int64)
    for k, sid in enumerate(unique.tolist()):
        site = Site.of(stacks.stack(sid)) if sid else None
        if site is not None:
            of_unique[k] = index.setdefault(site, len(sites))
            if of_unique[k] == len(sites):
                sites.append(site)
    return sites, of_unique[inverse.reshape(-1)]


@dataclass(frozen=True)
class SiteRow:
    """One site in one phase at one level, joined over the processes that allocated there."""

    site: Site
    level: str  # "driver" or "tensor"
    allocated: int  # bytes of successful allocations
    held: int  # of those, bytes still held when the process left the phase
    allocations: int
    pids: tuple[int, ...]
    ranks: tuple[str, ...] = ()  # the rank labels of those pids that have one (TP0, ...)
    peak: int = 0  # the most bytes of these allocations held at once (within the phase)

    @property
    def who(self) -> str:
        """``2 ranks`` when every process has a rank, else ``2 processes``."""
        n = len(self.pids)
        word = "rank" if self.ranks and len(self.ranks) == n else "process"
        return f"{n} {word}{'s' if n != 1 and word == 'rank' else 'es' if n != 1 else ''}"


@dataclass(frozen=True)
class PhaseSites:
    """The sites of one phase (by path), the largest peak first."""

    phase: str
    rows: tuple[SiteRow, ...]
    more: int = 0  # sites of the phase left out past SITES_JSON (``report --all`` keeps them)


@dataclass(frozen=True)
class FailureSite:
    """The site of a failed call (``index``: its event's, as the report's failures name it)."""

    index: int
    site: Site


@dataclass(frozen=True)
class SitesSection:
    """``memrec report``'s allocation sites by phase (``report["sites"]``, present with stacks)."""

    phases: tuple[PhaseSites, ...]
    stacks: int  # stacks the trace defines
    with_stack: int  # successful allocations that name a stack
    without_stack: int  # and those that do not (stacks off for them, or below a size threshold)
    failures: tuple[FailureSite, ...] = ()  # failed calls that name a stack (the first FAILURES_KEPT)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> SitesSection:
        phases = tuple(
            PhaseSites(p["phase"], tuple(
                SiteRow(Site(**r["site"]), r["level"], r["allocated"], r["held"], r["allocations"], tuple(r["pids"]),
                        tuple(r.get("ranks", ())), r.get("peak", r["held"]))
                for r in p["rows"]), p.get("more", 0))
            for p in data["phases"]
        )
        failures = tuple(FailureSite(f["index"], Site(**f["site"])) for f in data.get("failures", ()))
        return cls(phases, data["stacks"], data["with_stack"], data["without_stack"], failures)

    def top_in(self, phase: str) -> SiteRow | None:
        """The site whose allocations in ``phase`` peaked highest (driver memory first; then held,
        then allocated the most), None without one. ``phase``: a path, or a phase's own name (every path that ends
        in it, joined: SGLang's ``custom_ar_init`` under each rank's ``load``)."""
        joined: dict[tuple[Site, str], SiteRow] = {}
        for p in self.phases:
            if p.phase != phase and p.phase.rsplit("/", 1)[-1] != phase:
                continue
            for r in p.rows:
                was = joined.get((r.site, r.level))
                joined[(r.site, r.level)] = r if was is None else SiteRow(
                    r.site, r.level, was.allocated + r.allocated, was.held + r.held, was.allocations + r.allocations,
                    tuple(sorted({*was.pids, *r.pids})), tuple(sorted({*was.ranks, *r.ranks})), was.peak + r.peak)
        return max(joined.values(), key=lambda r: (r.level == "driver", r.peak, r.held, r.allocated), default=None)

    def failure_site(self, index: int) -> Site | None:
        """The site of the failed call at event ``index``, None when it names no stack."""
        return next((f.site for f in self.failures if f.index == index), None)


#: Rows of allocations and frees a :class:`SitesFeed` gathers before it pairs them (bounds its memory).
BATCH = 1 << 18
#: Groups a :class:`SitesFeed` holds before it folds those of ended phases into their path's
#: (then twice as many as it kept).
FOLD_AT = 1 << 12
_NEVER = np.iinfo(np.int64).max
#: Event kind -> its pair's position in _PAIRS (-1: neither an allocation nor a free).
_PAIR_OF = np.full(1 << 16, -1, np.int64)
for _k, (_alloc, (_free, _, _)) in enumerate(_PAIRS.items()):
    _PAIR_OF[_alloc] = _PAIR_OF[_free] = _k
_BY_HANDLE = np.array([key == "handle" for _, key, _ in _PAIRS.values()])
_LEVEL_OF = np.array([LEVELS.index(level) for _, _, level in _PAIRS.values()], np.int64)
_ALLOC_KINDS = np.array(list(_PAIRS), np.int64)


class _Columns:
    """Columns of one length, kept together (the feed's rows, its pending allocations)."""

    def __init__(self, **columns: np.ndarray) -> None:
        self.__dict__.update(columns)

    def __len__(self) -> int:
        return len(next(iter(self.__dict__.values())))

    def take(self, rows: np.ndarray) -> _Columns:
        return _Columns(**{name: column[rows] for name, column in self.__dict__.items()})

    @classmethod
    def concat(cls, parts: list[_Columns]) -> _Columns:
        return cls(**{name: np.concatenate([getattr(p, name) for p in parts]) for name in vars(parts[0])})


def _pending(n: int = 0) -> _Columns:
    """``n`` pending allocations, zeroed: the columns :meth:`SitesFeed._pair` keeps of each."""
    return _Columns(pk=np.zeros(n, np.int64), pid=np.zeros(n, np.int64), addr=np.zeros(n, np.uint64),
                    ts=np.zeros(n, np.int64), size=np.zeros(n, np.int64), group=np.zeros(n, np.int64),
                    clip=np.zeros(n, np.int64), end=np.full(n, _NEVER, np.int64), open=np.zeros(n, bool))


class SitesFeed:
    """The sites section built a chunk at a time in the report's pass over the events (a
    :class:`~memrec.engine.stream.ChunkReader`: it reads each chunk after the replay filled in its
    GPUs), keeping per (phase, site, level) its sums and only the allocations whose end is not
    known yet, those still held: a trace with stacks is not kept whole to pair every allocation
    with its free (issue 26).

    An allocation ends at the next allocation or free of its process and address (or handle)
    among its level's kinds, if that is a free (else never), and at the latest at its process's
    first exit; its peak and held bytes count it until the end of its phase. In a trace in time
    order (``census.ordered``: every recorded one) an allocation is done with once it is freed,
    its process exited or its phase ended before the latest event, and each group's running sum
    is swept up to the latest event's instant a batch at a time; a group whose phase ended before
    that instant is final, and is folded into its path's (:meth:`_fold`), so the groups are those
    of the open phases, not of every phase of the trace. A trace out of time order keeps the
    allocations that name a stack and the groups until :meth:`section` (the sums over time need
    them all).
    """

    def __init__(self, stacks: StackTable, phases: Phases, end_ts: int, ordered: bool,
                 pid: int | None = None, gpu: int | None = None) -> None:
        self.stacks, self.phases, self.pid, self.gpu, self.ordered = stacks, phases, pid, gpu, ordered
        # each phase id's end, where its allocations stop counting (the last: no phase, the trace's end)
        self._phase_end = np.append(phases.table.end, np.int64(end_ts))
        self._exit: dict[int, int] = {}  # pid -> its first exit's ts
        self._site_of_stack: dict[int, int] = {}  # stack id -> index in _sites (-1: no site)
        self._site_index: dict[Site, int] = {}
        self._sites: list[Site] = []
        self._site_first: list[int] = []  # each site's smallest stack id: the order of the sites
        self._group_of: dict[tuple[int, int, int], int] = {}  # (phase id, site, level) -> group
        self._groups: list[tuple[int, int, int]] = []
        # per group: allocated, held, allocations, base (its sum at the sweep's instant), peak, phase id
        self._sums = np.zeros((0, 6), np.int64)
        self._pids: list[set[int]] = []
        self._fold_at = FOLD_AT
        # (phase path, site, level) -> [first phase id, allocated, held, allocations, pids, peak] of
        # the groups folded (:meth:`_fold`)
        self._folded: dict[tuple[str, int, int], list] = {}
        self._rows: list[_Columns] = []  # allocations and frees not paired yet
        self._buffered = 0
        self._pending = _pending()
        self._deltas: list[np.ndarray] = []  # (group, time, bytes) rows of the sums not swept yet
        self._now: int | None = None  # the latest event's ts (None: out of time order, or none yet)
        self._any_stack = False
        self.with_stack = 0
        self.without = 0
        self._failed: list[tuple[np.ndarray, np.ndarray]] = []
        self._failures = 0

    def add(self, first: int, chunk: Any) -> None:
        if not len(chunk):
            return
        kind = np.asarray(chunk["kind"])
        stack = np.asarray(chunk["stack"])
        self._any_stack = self._any_stack or bool(stack.any())
        pids = np.asarray(chunk["pid"]).astype(np.int64)
        ts = np.asarray(chunk["ts"]).astype(np.int64)
        for i in np.flatnonzero(kind == int(Kind.PROC_EXIT)).tolist():
            self._exit.setdefault(int(pids[i]), int(ts[i]))
        if self._failures < FAILURES_KEPT:
            failed = np.flatnonzero(failed_calls(chunk) & (stack != 0))[:FAILURES_KEPT - self._failures]
            self._failed.append((failed + first, stack[failed].astype(np.int64)))
            self._failures += len(failed)
        pair = _PAIR_OF[kind]
        rows = np.flatnonzero((pair >= 0) & (np.asarray(chunk["result"]) == 0))
        if len(rows):
            self._take_rows(chunk, rows, pair[rows], kind[rows], pids[rows], ts[rows], stack[rows].astype(np.int64))
        if self.ordered:
            self._now = int(ts[-1])
        if self._buffered >= BATCH:
            self._pair()

    def _take_rows(self, chunk: Any, rows: np.ndarray, pk: np.ndarray, kind: np.ndarray, pid: np.ndarray,
                   ts: np.ndarray, sid: np.ndarray) -> None:
        """Buffer a chunk's allocations and frees; count its allocations, begin those that name a
        site in their group's sum."""
        is_alloc = np.isin(kind, _ALLOC_KINDS)
        selected = np.ones(len(rows), bool)
        if self.pid is not None:
            selected &= pid == self.pid
        if self.gpu is not None:
            selected &= np.asarray(chunk["gpu"])[rows] == self.gpu
        self.without += int(np.count_nonzero(is_alloc & selected & (sid == 0)))
        tracked = np.flatnonzero(is_alloc & selected & (sid != 0))
        self.with_stack += len(tracked)
        group = np.full(len(rows), -1, np.int64)
        size = np.minimum(np.asarray(chunk["size"])[rows], MAX_SIZE).astype(np.int64)
        if len(tracked):
            site = self._site_ids(sid[tracked])
            tracked, site = tracked[site >= 0], site[site >= 0]
            phase = self.phases.assign(pid[tracked], ts[tracked])
            group[tracked] = self._group_ids(phase, site, _LEVEL_OF[pk[tracked]], pid[tracked], size[tracked])
            self._deltas.append(np.stack([group[tracked], ts[tracked], size[tracked]]))
        addr = np.where(_BY_HANDLE[pk], np.asarray(chunk["handle"])[rows], np.asarray(chunk["ptr"])[rows])
        # a damaged size past 4 PiB is clamped, as the live state clamps it (the sums stay in int64)
        self._rows.append(_Columns(pk=pk, alloc=is_alloc, pid=pid, addr=addr.astype(np.uint64), ts=ts, size=size,
                                   group=group))
        self._buffered += len(rows)

    def _site_ids(self, sids: np.ndarray) -> np.ndarray:
        """The index among the sites of each stack id (-1: it names no site)."""
        unique, inverse = np.unique(sids, return_inverse=True)
        of = np.empty(len(unique), np.int64)
        for k, sid in enumerate(unique.tolist()):
            got = self._site_of_stack.get(sid)
            if got is None:
                site = Site.of(self.stacks.stack(sid))
                got = -1 if site is None else self._site_index.setdefault(site, len(self._sites))
                if got == len(self._sites):
                    self._sites.append(site)
                    self._site_first.append(sid)
                elif got >= 0:
                    self._site_first[got] = min(self._site_first[got], sid)
                self._site_of_stack[sid] = got
            of[k] = got
        return of[inverse.reshape(-1)]

    def _group_ids(self, phase: np.ndarray, site: np.ndarray, level: np.ndarray, pid: np.ndarray,
                   size: np.ndarray) -> np.ndarray:
        """The group of each allocation (its phase, site and level), whose allocated bytes,
        allocations and processes it is added to."""
        # one int64 per (phase id, site, level): phase ids and sites are far below 2^30
        key = ((phase + 1) << 32 | site) << 1 | level
        unique, inverse = np.unique(key, return_inverse=True)
        of = np.array([self._group((k >> 33) - 1, (k >> 1) & 0xFFFF_FFFF, k & 1) for k in unique.tolist()], np.int64)
        group = of[inverse.reshape(-1)]
        np.add.at(self._sums[:, 0], group, size)
        np.add.at(self._sums[:, 2], group, 1)
        for pair in np.unique(group << 32 | pid).tolist():
            self._pids[pair >> 32].add(pair & 0xFFFF_FFFF)
        return group

    def _group(self, phase: int, site: int, level: int) -> int:
        key = (phase, site, level)
        g = self._group_of.get(key)
        if g is None:
            g = self._group_of[key] = len(self._groups)
            self._groups.append(key)
            self._pids.append(set())
            if g == len(self._sums):  # room for twice as many: a copy per new group was quadratic
                more = np.zeros((max(g, 64), 6), np.int64)
                more[:, 4] = np.iinfo(np.int64).min
                self._sums = np.concatenate([self._sums, more])
            self._sums[g, 5] = phase
        return g

    def _pair(self) -> None:
        """Pair the buffered allocations and frees with each other and with the allocations still
        open; end what has ended; sweep the sums up to the latest instant."""
        rows, self._rows, self._buffered = self._rows, [], 0
        pending = self._pending
        if rows:
            batch = _Columns.concat(rows)
            new = np.flatnonzero(batch.group >= 0)
            fresh = _pending(len(new))
            for name in ("pk", "pid", "addr", "ts", "size", "group"):
                getattr(fresh, name)[:] = getattr(batch, name)[new]
            fresh.clip = self._phase_end[self._sums[fresh.group, 5]]
            pending = _Columns.concat([pending, fresh])
            opened = np.flatnonzero(pending.open)
            # the open allocations first, then the batch in order: sorted by key, an allocation's
            # end is the next row of its key when that is a free (never when an allocation)
            ref = np.r_[opened, np.full(len(batch), -1, np.int64)]
            ref[len(opened) + new] = len(self._pending) + np.arange(len(new))
            pk = np.r_[pending.pk[opened], batch.pk]
            pid = np.r_[pending.pid[opened], batch.pid]
            addr = np.r_[pending.addr[opened], batch.addr]
            alloc = np.r_[np.ones(len(opened), bool), batch.alloc]
            ts = np.r_[pending.ts[opened], batch.ts]
            order = np.lexsort((np.arange(len(pk)), addr, pid, pk))
            pk, pid, addr, alloc, ts, ref = pk[order], pid[order], addr[order], alloc[order], ts[order], ref[order]
            same = np.r_[(pk[1:] == pk[:-1]) & (pid[1:] == pid[:-1]) & (addr[1:] == addr[:-1]), False]
            mine = ref >= 0
            pending.open[ref[mine]] = ~same[mine]
            ended = mine & same
            nxt = np.flatnonzero(ended) + 1
            pending.end[ref[ended]] = np.where(alloc[nxt], _NEVER, ts[nxt])
        self._pending = pending
        self._end(final=False)

    def _end(self, final: bool) -> None:
        """End the pending allocations whose end is known (``final``: every one), count what each
        held past its phase's end, and sweep the sums up to the latest instant."""
        p = self._pending
        exit_ts = np.full(len(p), _NEVER, np.int64)
        if self._exit and len(p):
            unique, inverse = np.unique(p.pid, return_inverse=True)
            exit_ts = np.array([self._exit.get(q, _NEVER) for q in unique.tolist()], np.int64)[inverse.reshape(-1)]
        if final:
            done = np.ones(len(p), bool)
        elif self._now is None:
            done = np.zeros(len(p), bool)
        else:
            # in time order, what comes later is at or after the latest instant: a freed
            # allocation's end is known, an open one's is its exit's, or past its phase's end
            freed = ~p.open & (p.end != _NEVER)
            done = freed | (exit_ts != _NEVER) | (p.clip < self._now)
        end = np.where(p.open, _NEVER, p.end)
        end = np.minimum(end, exit_ts)[done]
        gone = p.take(np.flatnonzero(done))
        self._pending = p.take(np.flatnonzero(~done))
        if len(gone):
            np.add.at(self._sums[:, 1], gone.group, np.where(end > gone.clip, gone.size, 0))
            self._deltas.append(np.stack([gone.group, np.maximum(np.minimum(end, gone.clip), gone.ts), -gone.size]))
        if final or self._now is not None:
            self._sweep(None if final else self._now)
        if not final and self._now is not None and len(self._groups) >= self._fold_at:
            self._fold()

    def _fold(self) -> None:
        """Fold the groups whose sums are final into their path's, what :meth:`section` joins them
        into (sums, a union of processes: the same whenever it is done), and keep the others.

        In time order a group is final once the sweep passed its phase's end (``self._now``
        after it): an allocation of the phase is at or before its end, and one made later is
        of another phase. A step phase per process makes a group per step and site: ~370,000
        at 100M events of ``bench_100m.py --stacks 256``, 220 MB; folded, the open phases'."""
        n = len(self._groups)
        phase = self._sums[:n, 5]
        final = (phase >= 0) & (self._phase_end[np.maximum(phase, 0)] < self._now)
        final[self._pending.group] = False
        for d in self._deltas:
            final[d[0]] = False
        for g in np.flatnonzero(final).tolist():
            ph, site, level = self._groups[g]
            allocated, held, count, _, peak, _ = self._sums[g].tolist()
            row = self._folded.setdefault((self.phases.label(ph), site, level), [ph, 0, 0, 0, set(), 0])
            row[0] = min(row[0], ph)
            row[1] += allocated
            row[2] += held
            row[3] += count
            row[4] |= self._pids[g]
            row[5] += peak
        kept = np.flatnonzero(~final)
        renumber = np.full(n, -1, np.int64)
        renumber[kept] = np.arange(len(kept))
        self._pending.group = renumber[self._pending.group]
        self._deltas = [np.stack([renumber[d[0]], d[1], d[2]]) for d in self._deltas]
        self._groups = [self._groups[g] for g in kept.tolist()]
        self._group_of = {key: g for g, key in enumerate(self._groups)}
        self._pids = [self._pids[g] for g in kept.tolist()]
        more = np.zeros((max(len(kept), 64), 6), np.int64)
        more[:, 4] = np.iinfo(np.int64).min
        self._sums = np.concatenate([self._sums[kept], more])
        self._fold_at = max(FOLD_AT, 2 * len(kept))

    def _sweep(self, until: int | None) -> None:
        """Add the changes before ``until`` (None: all) to each group's running sum, in time order
        and a free at the instant of an allocation first, so a buffer replaced in place is not
        counted twice; each group's peak is the most its sum reached."""
        if not self._deltas:
            return
        deltas = np.concatenate(self._deltas, axis=1)
        self._deltas = []
        if until is not None:
            later = deltas[1] >= until
            self._deltas = [deltas[:, later]]
            deltas = deltas[:, ~later]
        if not deltas.shape[1]:
            return
        group, time, delta = deltas
        order = np.lexsort((delta, time, group))
        group, delta = group[order], delta[order]
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
        total = np.cumsum(delta)
        before = np.r_[0, total][starts]
        g = group[starts]
        level = total - np.repeat(before - self._sums[g, 3], np.diff(np.r_[starts, len(group)]))
        self._sums[g, 4] = np.maximum(self._sums[g, 4], np.maximum.reduceat(level, starts))
        self._sums[g, 3] += np.add.reduceat(delta, starts)

    def section(self, trace: Any, limit: int | None = SITES_JSON) -> SitesSection | None:
        """The section (see the module docstring) once every chunk was added; None for a trace
        without stacks. ``limit``: the most sites kept per phase (None: every one)."""
        if not len(self.stacks) or not self._any_stack:
            return None
        self._pair()
        self._end(final=True)
        rank = np.argsort(np.argsort(np.array(self._site_first, np.int64), kind="stable"), kind="stable")
        # each group's (first phase id, site, level, allocated, held, allocations, pids, peak),
        # the folded ones' by path
        rows = [(ph, site, level, *sums[:3], self._pids[g], sums[4])
                for g, ((ph, site, level), sums) in enumerate(zip(self._groups, self._sums.tolist()))]
        rows += [(ph, site, level, allocated, held, count, pids, peak)
                 for (_, site, level), (ph, allocated, held, count, pids, peak) in self._folded.items()]
        groups: dict[tuple[str, int, int], list] = {}
        # in the order of (phase id, site, level): phases of one path (each rank's) summed
        for phase, site, level, allocated, held, count, pids, peak in sorted(
                rows, key=lambda r: (r[0], rank[r[1]], r[2])):
            row = groups.setdefault((self.phases.label(phase), site, level), [0, 0, 0, set(), 0])
            row[0] += allocated
            row[1] += held
            row[2] += count
            row[3].update(pids)
            row[4] += peak
        return SitesSection(_by_phase(trace, self.phases, self._sites, groups, limit), len(self.stacks),
                            self.with_stack, self.without, self._failure_sites())

    def _failure_sites(self) -> tuple[FailureSite, ...]:
        index = np.concatenate([i for i, _ in self._failed]) if self._failed else np.zeros(0, np.int64)
        stack = np.concatenate([s for _, s in self._failed]) if self._failed else np.zeros(0, np.int64)
        sites, of = stack_sites(self.stacks, stack)
        return tuple(FailureSite(int(i), sites[k]) for i, k in zip(index.tolist(), of.tolist()) if k >= 0)


def _by_phase(trace: Any, phases: Phases, sites: list[Site], groups: dict[tuple[str, int, int], list],
              limit: int | None) -> tuple[PhaseSites, ...]:
    """Each phase's rows, the phases in the order they began ((no phase) last), each phase's rows
    by level, the largest peak first."""
    labels = pid_labels(trace.markers, trace.processes)
    by_phase: dict[str, list[SiteRow]] = {}
    for (phase, site, level), (allocated_b, held_b, n, pids, peak) in groups.items():
        ranks = tuple(sorted({labels[p] for p in pids if p in labels}))
        by_phase.setdefault(phase, []).append(
            SiteRow(sites[site], LEVELS[level], allocated_b, held_b, n, tuple(sorted(pids)), ranks, peak))
    t = phases.table
    order = {t.path[i]: (s, i) for i, s in reversed(list(enumerate(t.start.tolist())))}
    out = []  # phases in the order they began; (no phase) last
    for phase in sorted(by_phase, key=lambda name: order.get(name, (np.iinfo(np.int64).max, 0))):
        rows = sorted(by_phase[phase], key=lambda r: (LEVELS.index(r.level), -r.peak, -r.held, -r.allocated,
                                                      r.site.label))
        kept = rows if limit is None else rows[:limit]
        out.append(PhaseSites(phase, tuple(kept), len(rows) - len(kept)))
    return tuple(out)


def sites_feed(trace: Any, events: TraceEvents, phases: Phases, end_ts: int, pid: int | None = None,
               gpu: int | None = None) -> SitesFeed | None:
    """A :class:`SitesFeed` for the report's (or the diff's) pass over ``events``, None when no
    event names a stack or the trace defines none (no section: every view stays as it was)."""
    if not events.census.stacked or not len(trace.stacks):
        return None
    return SitesFeed(trace.stacks, phases, end_ts, events.census.ordered, pid, gpu)


def sites_section(trace: Any, phases: Phases, end_ts: int, pid: int | None = None, gpu: int | None = None,
                  limit: int | None = SITES_JSON, columns: Any = None) -> SitesSection | None:
    """The sites section of events in memory (default ``trace.event_columns``, ``gpu`` filled in
    by a replay): a :class:`SitesFeed` over them a chunk at a time (see there). ``end_ts``: the
    trace's end (what ``(no phase)`` holds is what is held then)."""
    source = ColumnSource(trace.event_columns if columns is None else columns)
    feed = SitesFeed(trace.stacks, phases, end_ts, source.census().ordered, pid, gpu)
    for first, chunk in source.chunks():
        feed.add(first, chunk)
    return feed.section(trace, limit)
