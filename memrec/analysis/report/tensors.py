"""Tensor blocks inside the caching allocator's segments: allocated vs reserved, fragmentation,
and the blocks alive at a failed call (``memrec report``'s ``tensors`` section).

Why a replay of its own: blocks are not driver memory (the live state skips them), and what a
user asks of them is about the allocator, not the GPU total: how much of what PyTorch reserved
holds tensors, how it is cut up, and which tensors held it when a segment allocation failed
(an out-of-memory in PyTorch). The replay reads the driver allocations and VMM mappings of the
processes (the segments), PyTorch's ``pytorch:malloc``/``free`` probe events (the blocks), exits
and failed calls, in trace order.

Blocks, segments, reserved and allocated are :class:`memrec.state.tensors.TensorBlocks`'s;
fragmentation adds reserved − allocated, the largest free stretch inside the segments (contiguous
mappings joined; blocks taken at the allocator's 512-byte rounding) and the number of blocks.
Snapshots are taken where a process leaves a phase, at its exit, at a failed call and at the
end of the trace; peaks are exact.
"""

from __future__ import annotations

from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import numpy as np

from memrec.analysis.report.sites import Site
from memrec.analysis.sections import Section
from memrec.analysis.text import seconds
from memrec.engine.phases import Phases
from memrec.engine.source import ColumnSource
from memrec.terms.events import Kind
from memrec.state.tensors import T_ALLOC
from memrec.state.tensors import T_FREE
from memrec.state.tensors import TRACKED_KINDS
from memrec.state.tensors import Block
from memrec.state.tensors import Fragmentation
from memrec.state.tensors import TensorBlocks
from memrec.state.tensors import rows
from memrec.trace.stacks import StackTable

_SEGMENT_FAILS = (int(Kind.ALLOC), int(Kind.VMM_CREATE))
#: Rows of the trace selected at a time (the masks, indices and phases of one chunk).
SELECT_CHUNK = 1 << 20
#: How many of the largest blocks a failed call lists.
BLOCKS_AT_FAILURE = 10


@dataclass
class TensorRow:
    """One (process, GPU, phase): peaks, and the fragmentation where the process left the phase."""

    pid: int
    gpu: int
    phase: str
    allocs: int = 0
    frees: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    last: Fragmentation = field(default_factory=Fragmentation)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class BlockAtFailure:
    """A live block when a segment allocation failed."""

    ptr: int
    size: int
    age_s: float
    segment: int | None  # the address of the segment holding it (None: not seen)
    phase: str
    #: the line of code that allocated it (a trace with stacks: the innermost user frame of the
    #: block's stack, as the report's allocation sites name it); None without a stack
    site: Site | None = None


@dataclass
class FailureBlocks:
    """Who held the caching allocator's memory when a segment allocation failed."""

    index: int
    t_s: float
    pid: int
    gpu: int
    size: int  # what the failed call asked for
    state: Fragmentation
    largest: list[BlockAtFailure]

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class TorchLibrary(Section):
    """A libc10_cuda.so the daemon tried: which probes it attached, or the problem (None: none)."""

    path: str
    attached: list[str]
    problem: str | None


@dataclass
class TensorSection(Section):
    """The report's ``tensors`` section: the installs tried, how many block events, blocks and
    frees from before the recording, per (GPU, process, phase) rows and the failed segment
    allocations with the blocks alive then."""

    libraries: list[TorchLibrary]
    events: int
    unjoined_blocks: int
    unknown_frees: int
    rows: list[TensorRow]
    failures: list[FailureBlocks]


class _Replay(TensorBlocks):
    """The tracker, with per-phase rows and the blocks alive at failed calls."""

    def __init__(self, phases: Phases, start: int, stacks: StackTable | None = None) -> None:
        super().__init__()
        self.phases = phases
        self.start = start
        self.stacks = stacks  # a trace with stacks: each live block's stack id is kept
        self.stack_of: dict[tuple[int, int], int] = {}  # (pid, ptr) -> the live block's stack id
        self.rows: dict[tuple[int, int, str], TensorRow] = {}
        self.by_id: dict[tuple[int, int, int], TensorRow] = {}  # (pid, gpu, phase id) -> its row
        self.phase_of: dict[int, int] = {}  # pid -> the phase id of its last tensor event
        self.failures: list[FailureBlocks] = []

    # -- blocks
    def row(self, pid: int, gpu: int, phase: int) -> TensorRow:
        r = self.by_id.get((pid, gpu, phase))
        if r is None:  # phase instances with one path share a row
            key = (pid, gpu, self.phases.label(phase))
            r = self.rows.get(key)
            if r is None:
                r = self.rows[key] = TensorRow(pid, gpu, key[2])
            self.by_id[(pid, gpu, phase)] = r
        return r

    def enter(self, pid: int, phase: int) -> None:
        """Snapshot the process's rows of the phase it leaves."""
        before = self.phase_of.get(pid)
        if before is not None and before != phase:
            self.snapshot_pid(pid, before)
        self.phase_of[pid] = phase

    def alloc(self, pid: int, ptr: int, size: int, gpu: int, ts: int, phase: int = -1) -> None:
        super().alloc(pid, ptr, size, gpu, ts, phase)
        tot = self.totals[(pid, gpu)]
        r = self.row(pid, gpu, phase)
        r.allocs += 1
        r.peak_allocated = max(r.peak_allocated, tot[0])
        r.peak_reserved = max(r.peak_reserved, tot[1])

    def free(self, pid: int, ptr: int, phase: int = -1) -> Block | None:
        b = super().free(pid, ptr, phase)
        if b is not None:
            self.row(pid, b.gpu, phase).frees += 1
        return b

    def exit(self, pid: int) -> None:
        phase = self.phase_of.pop(pid, None)
        if phase is not None:
            self.snapshot_pid(pid, phase)
        super().exit(pid)

    # -- snapshots
    def snapshot_pid(self, pid: int, phase: int) -> None:
        for p, g in [k for k in self.totals if k[0] == pid]:
            key = (p, g, self.phases.label(phase))
            if key in self.rows:
                self.rows[key].last = self.fragmentation(p, g)

    def failed(self, index: int, ts: int, pid: int, gpu: int, size: int) -> None:
        gpus = [g for p, g in self.totals if p == pid and (gpu < 0 or g == gpu)]
        for g in gpus:
            mine = sorted(self.blocks_of(pid, g), key=lambda item: -item[1].size)[:BLOCKS_AT_FAILURE]
            largest = [BlockAtFailure(ptr, b.size, seconds(ts - b.ts), b.segment, self.phases.label(b.phase),
                                      self._site(pid, ptr)) for ptr, b in mine]
            self.failures.append(FailureBlocks(index, seconds(ts - self.start), pid, g, size,
                                               self.fragmentation(pid, g), largest))


    def _site(self, pid: int, ptr: int) -> Site | None:
        sid = self.stack_of.get((pid, ptr), 0)
        return Site.of(self.stacks.stack(sid)) if sid and self.stacks is not None else None


def _libraries(value: Any) -> list[TorchLibrary] | None:
    """The header's or trailer's ``torch`` list as the report shows it: ``{path, attached, problem}``
    per entry, whatever a damaged or foreign file holds there (the format leaves ``probes`` free-form);
    None when there is no list."""
    if value is None:
        return None
    out = []
    for lib in value if isinstance(value, list) else []:
        if not isinstance(lib, dict):
            continue
        path, attached, problem = lib.get("path"), lib.get("attached"), lib.get("problem")
        out.append(TorchLibrary(path if isinstance(path, str) else "(no path)",
                                [a for a in attached if isinstance(a, str)] if isinstance(attached, list) else [],
                                problem if isinstance(problem, str) else None))
    return out


class TensorFeed:
    """The tensor section's replay, fed the trace's events a chunk at a time (:meth:`add`, in
    order, after the live state's replay has filled in their GPUs), then :meth:`section`.

    Args:
        phases: the trace's phases; start: the trace's first ts.
        tensor_events, tensor_pids: how many tensor events the trace has and which processes
            (a first pass: only processes with tensor events matter, their exits and segments
            included).
        stacks: the trace's stacks (format 2.3) when any event names one: the blocks alive at a
            failed call name the line that allocated each.
    """

    def __init__(self, phases: Phases, start: int, tensor_events: int, tensor_pids: np.ndarray,
                 stacks: StackTable | None = None) -> None:
        self.phases = phases
        self.count = tensor_events
        self.pids_with = tensor_pids
        self.with_stacks = stacks is not None
        self.rp = _Replay(phases, start, stacks)

    def add(self, first: int, events: Any) -> None:
        """The next events (``first``: the index of the first), a chunk of rows at a time."""
        if not self.count:
            return
        rp, phases, with_stacks = self.rp, self.phases, self.with_stacks
        names = ("index", "phase", "kind", "pid", "ptr", "size", "gpu", "ts", "result", "stack")
        # A chunk of rows at a time: the masks and indices of a whole 100M-event trace were 3 GB.
        for lo in range(0, len(events), SELECT_CHUNK):
            part = events[lo : lo + SELECT_CHUNK]
            kinds, ok = part["kind"], part["result"] == 0
            wanted = (ok & np.isin(kinds, TRACKED_KINDS)) | (~ok & np.isin(kinds, _SEGMENT_FAILS))
            idx = np.flatnonzero(wanted & np.isin(part["pid"], self.pids_with))
            aligned = {"index": first + lo + idx, "phase": phases.assign(part["pid"][idx], part["ts"][idx])}
            if not with_stacks:
                aligned["stack"] = np.zeros(len(idx), np.int64)
            for i, ph, k, p, ptr, size, g, ts, result, sid in rows(part, idx, names, aligned):
                if result != 0:
                    rp.failed(i, ts, p, g, size)
                    continue
                if k == T_ALLOC or k == T_FREE:
                    rp.enter(p, ph)
                    if with_stacks:  # the live block's stack, for the blocks alive at a failed call
                        if k == T_ALLOC and sid:
                            rp.stack_of[(p, ptr)] = sid
                        else:
                            rp.stack_of.pop((p, ptr), None)
                rp.apply_one(k, p, ptr, size, g, ts, ph)

    def section(self, header: dict, trailer: dict | None = None, pid: int | None = None,
                gpu: int | None = None) -> TensorSection | None:
        """The report's ``tensors`` section, or None when the trace has no tensor events and no
        PyTorch install was tried (``header["probes"]["torch"]``).

        Args:
            header, trailer: the trace's (which libc10_cuda.so files gave probes, which did not,
                why: the trailer lists those found during the recording too, the header those at
                its start).
            pid, gpu: the report's filter.
        """
        probes = header.get("probes")
        libraries = _libraries((trailer or {}).get("torch", probes.get("torch") if isinstance(probes, dict) else None))
        if not self.count and libraries is None:
            return None
        rp = self.rp
        for p, phase in list(rp.phase_of.items()):
            rp.snapshot_pid(p, phase)

        def keep(p: int, g: int) -> bool:
            return (pid is None or p == pid) and (gpu is None or g == gpu)

        return TensorSection(
            libraries=libraries or [],
            events=self.count,
            unjoined_blocks=rp.unjoined,
            unknown_frees=rp.unknown_frees,
            rows=[r for r in sorted(rp.rows.values(), key=lambda r: (r.gpu, r.pid, r.phase)) if keep(r.pid, r.gpu)],
            failures=[f for f in rp.failures if keep(f.pid, f.gpu)],
        )


def tensor_section(events: Any, phases: Phases, start: int, header: dict, trailer: dict | None = None,
                   pid: int | None = None, gpu: int | None = None, stacks: StackTable | None = None
                   ) -> TensorSection | None:
    """The ``tensors`` section of events in memory (a Batch or columns; ``gpu`` filled by the
    replay): a :class:`TensorFeed` over them a chunk at a time (see there; ``stacks``: the
    trace's, used when an event names one)."""
    source = ColumnSource(events)
    census = source.census()
    feed = TensorFeed(phases, start, census.tensor_events, census.tensor_pids,
                      stacks if stacks and census.stacked else None)
    for first, chunk in source.chunks():
        feed.add(first, chunk)
    return feed.section(header, trailer, pid=pid, gpu=gpu)
