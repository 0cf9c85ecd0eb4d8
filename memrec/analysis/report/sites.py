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


@dataclass
class Allocations:
    """The successful allocations that name a stack, with when each stopped being held."""

    index: np.ndarray  # event index
    pid: np.ndarray
    ts: np.ndarray
    size: np.ndarray
    level: np.ndarray  # index into LEVELS
    stack: np.ndarray
    end_ts: np.ndarray  # when freed (or its process exited); int64 max: held to the end


def stacked_allocations(columns: Any, pid: int | None = None, gpu: int | None = None) -> tuple[Allocations, int]:
    """The successful allocations (driver and tensor blocks) that name a stack, each paired with
    its free (the next free of the same process and address or handle) or its process's exit;
    and how many successful allocations name none. ``columns``: a trace's event columns."""
    kind = np.asarray(columns["kind"])
    ok = np.asarray(columns["result"]) == 0
    stack = np.asarray(columns["stack"])
    pids = np.asarray(columns["pid"]).astype(np.int64)
    ts = np.asarray(columns["ts"]).astype(np.int64)
    selected = np.ones(len(kind), bool)
    if pid is not None:
        selected &= pids == pid
    if gpu is not None:
        selected &= np.asarray(columns["gpu"]) == gpu
    never = np.iinfo(np.int64).max
    parts, without = [], 0
    for level_kind, (free_kind, key, level) in _PAIRS.items():
        is_alloc = (kind == level_kind) & ok
        without += int((is_alloc & selected & (stack == 0)).sum())
        mine = np.flatnonzero(is_alloc & selected & (stack != 0))
        if not len(mine):
            continue
        # every allocation and free of this kind (any stack, any filter), ordered by key then time:
        # an allocation's end is the next event of its key when that is a free
        pair = np.flatnonzero((is_alloc | ((kind == free_kind) & ok)))
        addr = np.asarray(columns[key])[pair].astype(np.uint64)
        order = np.lexsort((pair, addr, pids[pair]))
        pair, addr = pair[order], addr[order]
        same_next = np.zeros(len(pair), bool)
        same_next[:-1] = (addr[1:] == addr[:-1]) & (pids[pair][1:] == pids[pair][:-1]) & (kind[pair][1:] == free_kind)
        ends = np.full(len(pair), never, np.int64)
        ends[:-1] = np.where(same_next[:-1], ts[pair][1:], never)
        by_index = np.argsort(pair)
        end_ts = ends[by_index][np.searchsorted(pair, mine, sorter=by_index)]
        parts.append((mine, end_ts, LEVELS.index(level)))
    if not parts:
        empty = np.zeros(0, np.int64)
        return Allocations(empty, empty, empty, empty, empty, empty, empty), without
    index = np.concatenate([p[0] for p in parts])
    end_ts = np.concatenate([p[1] for p in parts])
    level = np.concatenate([np.full(len(p[0]), p[2], np.int64) for p in parts])
    exits = np.flatnonzero(kind == int(Kind.PROC_EXIT))
    if len(exits):  # a process's exit frees what it held: each allocation's end is at most its exit
        exit_pids, first = np.unique(pids[exits], return_index=True)
        at = np.minimum(np.searchsorted(exit_pids, pids[index]), len(exit_pids) - 1)
        exited = exit_pids[at] == pids[index]
        end_ts = np.where(exited, np.minimum(end_ts, ts[exits][first][at]), end_ts)
    # a damaged size past 4 PiB is clamped, as the live state clamps it (the sums stay in int64)
    sizes = np.minimum(np.asarray(columns["size"])[index], MAX_SIZE).astype(np.int64)
    return Allocations(index, pids[index], ts[index], sizes, level, stack[index].astype(np.int64), end_ts), without


def _peaks(key: np.ndarray, start: np.ndarray, end: np.ndarray, size: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The most bytes held at once in each run of ``key`` (sorted; runs begin at ``starts``), from
    allocations of ``size`` held over [``start``, ``end``): a free at the instant of an allocation
    counts first, so a buffer replaced in place is not counted twice."""
    n = len(key)
    keys = np.r_[key, key]
    times = np.r_[start, np.maximum(end, start)]
    delta = np.r_[size, -size]
    order = np.lexsort((delta, times, keys))
    level = np.cumsum(delta[order])
    first = np.searchsorted(keys[order], key[starts])  # each run's first step in the merged order
    base = np.where(first > 0, level[first - 1], 0)  # the running sum before the run began
    return np.maximum.reduceat(level - np.repeat(base, np.diff(np.r_[first, 2 * n])), first)


def sites_section(trace: Any, phases: Phases, pid: int | None = None, gpu: int | None = None,
                  end_ts: int | None = None, limit: int | None = SITES_JSON, columns: Any = None) -> SitesSection | None:
    """Allocation sites by phase (see the module docstring); None for a trace without stacks.

    ``end_ts``: the trace's end (what ``(no phase)`` holds is what is held then). ``pid``,
    ``gpu``: only that process's allocations, only those on that GPU (after the replay has
    filled in the GPUs). ``limit``: the most sites kept per phase (None: every one).
    ``columns``: the trace's events (default ``trace.event_columns``; the report's, kept whole
    from its pass over the file when any names a stack).
    """
    if columns is None:
        columns = trace.event_columns
    if not len(trace.stacks) or not len(columns) or not np.asarray(columns["stack"]).any():
        return None
    allocs, without = stacked_allocations(columns, pid, gpu)
    sites, site_of = stack_sites(trace.stacks, allocs.stack)
    phase_ids = phases.assign(allocs.pid, allocs.ts)
    last = end_ts if end_ts is not None else (int(allocs.ts.max()) if len(allocs.ts) else 0)
    phase_end = np.append(phases.table.end, np.int64(last))
    held = allocs.end_ts > phase_end[phase_ids]  # -1 (no phase): the last entry, the trace's end
    groups: dict[tuple[str, int, int], list] = {}
    sel = np.flatnonzero(site_of >= 0)
    if len(sel):
        # one int64 key per (phase id, site, level), summed exactly (int64) over sorted runs
        span = 2 * len(sites)
        key = (phase_ids[sel] + 1) * span + site_of[sel] * 2 + allocs.level[sel]
        order = np.argsort(key, kind="stable")
        key, sel = key[order], sel[order]
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        sizes = allocs.size[sel]
        allocated = np.add.reduceat(sizes, starts)
        kept = np.add.reduceat(np.where(held[sel], sizes, 0), starts)
        peaks = _peaks(key, allocs.ts[sel], np.minimum(allocs.end_ts[sel], phase_end[phase_ids[sel]]), sizes, starts)
        counts = np.diff(np.r_[starts, len(key)])
        pairs = np.unique(np.repeat(np.arange(len(starts), dtype=np.int64), counts) << 32 | allocs.pid[sel])
        pids_of = np.split(pairs & 0xFFFFFFFF, np.flatnonzero(np.diff(pairs >> 32)) + 1)
        for k, group in enumerate(key[starts].tolist()):
            ph, rest = divmod(group, span)
            row = groups.setdefault((phases.label(ph - 1), rest // 2, rest % 2), [0, 0, 0, set(), 0])
            row[0] += int(allocated[k])
            row[1] += int(kept[k])
            row[2] += int(counts[k])
            row[3].update(pids_of[k].tolist())
            row[4] += int(peaks[k])  # phases of one path (each rank's): their peaks together
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
    failed = np.flatnonzero(failed_calls(columns) & (np.asarray(columns["stack"]) != 0))[:FAILURES_KEPT]
    failure_sites, failure_of = stack_sites(trace.stacks, np.asarray(columns["stack"])[failed])
    failures = tuple(FailureSite(int(i), failure_sites[k]) for i, k in zip(failed.tolist(), failure_of.tolist()) if k >= 0)
    return SitesSection(tuple(out), len(trace.stacks), int(len(allocs.index)), without, failures)
