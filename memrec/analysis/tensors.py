"""Tensor blocks inside the caching allocator's segments: allocated vs reserved, fragmentation,
and the blocks alive at a failed call (``memrec report``'s ``tensors`` section).

Why a replay of its own: blocks are not driver memory (the live state skips them), and what a
user asks of them is about the allocator, not the GPU total: how much of what PyTorch reserved
holds tensors, how it is cut up, and which tensors held it when a segment allocation failed
(an out-of-memory in PyTorch). The replay reads the driver allocations and VMM mappings of the
processes (the segments), PyTorch's ``pytorch:malloc``/``free`` probe events (the blocks), exits
and failed calls, in trace order.

Definitions:
    - A block's **segment** is the driver allocation (``cuMemAlloc``) or VMM mapping
      (expandable segments) of the same process that holds its address. Blocks whose segment
      the trace never saw (a process started before the daemon) count as ``unjoined``.
    - **reserved**: the bytes of the live segments that have held a block (the caching
      allocator's; a process's other driver memory, NCCL's or cuBLAS's, is not reserved here).
    - **allocated**: the bytes of live blocks, as PyTorch asked for them.
    - **fragmentation**: reserved − allocated, the largest free stretch inside the segments
      (contiguous mappings joined; blocks taken at the allocator's 512-byte rounding) and the
      number of blocks.
Snapshots are taken where a process leaves a phase, at its exit, at a failed call and at the
end of the trace; peaks are exact.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import numpy as np

from memrec.analysis.text import seconds
from memrec.engine.phases import Phases
from memrec.events import Kind

_ALLOC, _FREE = int(Kind.ALLOC), int(Kind.FREE)
_MAP, _UNMAP = int(Kind.VMM_MAP), int(Kind.VMM_UNMAP)
_EXIT = int(Kind.PROC_EXIT)
_T_ALLOC, _T_FREE = int(Kind.TENSOR_ALLOC), int(Kind.TENSOR_FREE)
_SEGMENT_FAILS = (int(Kind.ALLOC), int(Kind.VMM_CREATE))
#: The caching allocator's smallest block and rounding (kMinBlockSize).
BLOCK_ROUND = 512
#: How many of the largest blocks a failed call lists.
BLOCKS_AT_FAILURE = 10


def rounded(size: int) -> int:
    """A request's block size in the caching allocator (at least, and a multiple of, 512 bytes)."""
    return max(BLOCK_ROUND, -(-size // BLOCK_ROUND) * BLOCK_ROUND)


@dataclass
class Fragmentation:
    """One (process, GPU)'s blocks and segments at one moment."""

    allocated: int = 0
    reserved: int = 0
    free: int = 0  # reserved - allocated
    largest_free: int = 0
    blocks: int = 0
    segments: int = 0


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


@dataclass
class BlockAtFailure:
    """A live block when a segment allocation failed."""

    ptr: int
    size: int
    age_s: float
    segment: int | None  # the address of the segment holding it (None: not seen)
    phase: str


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


@dataclass
class _Block:
    size: int
    gpu: int
    ts: int
    segment: int | None
    phase: int


class _Replay:
    """Blocks and segments of every process, applied event by event."""

    def __init__(self, phases: Phases, start: int) -> None:
        self.phases = phases
        self.start = start
        self.blocks: dict[tuple[int, int], _Block] = {}
        #: pid -> sorted segment starts, and (pid, start) -> [size, gpu, holds-a-block]
        self.starts: dict[int, list[int]] = {}
        self.segments: dict[tuple[int, int], list] = {}
        #: (pid, gpu) -> [allocated, reserved]
        self.totals: dict[tuple[int, int], list[int]] = {}
        self.rows: dict[tuple[int, int, str], TensorRow] = {}
        self.phase_of: dict[int, int] = {}  # pid -> the phase id of its last tensor event
        self.failures: list[FailureBlocks] = []
        self.unjoined = 0
        self.unknown_frees = 0

    # -- segments
    def add_segment(self, pid: int, ptr: int, size: int, gpu: int) -> None:
        if (pid, ptr) in self.segments:
            self.drop_segment(pid, ptr)
        bisect.insort(self.starts.setdefault(pid, []), ptr)
        self.segments[(pid, ptr)] = [size, gpu, False]

    def drop_segment(self, pid: int, ptr: int) -> None:
        seg = self.segments.pop((pid, ptr), None)
        if seg is None:
            return
        starts = self.starts[pid]
        del starts[bisect.bisect_left(starts, ptr)]
        if seg[2]:
            self.totals[(pid, seg[1])][1] -= seg[0]

    def drop_range(self, pid: int, lo: int, size: int) -> None:
        starts = self.starts.get(pid, [])
        for s in starts[bisect.bisect_left(starts, lo):bisect.bisect_left(starts, lo + size)]:
            self.drop_segment(pid, s)

    def segment_of(self, pid: int, ptr: int) -> int | None:
        starts = self.starts.get(pid)
        if not starts:
            return None
        k = bisect.bisect_right(starts, ptr) - 1
        if k < 0:
            return None
        s = starts[k]
        return s if ptr < s + self.segments[(pid, s)][0] else None

    # -- blocks
    def row(self, pid: int, gpu: int, phase: int) -> TensorRow:
        key = (pid, gpu, self.phases.label(phase))
        r = self.rows.get(key)
        if r is None:
            r = self.rows[key] = TensorRow(pid, gpu, key[2])
        return r

    def enter(self, pid: int, phase: int) -> None:
        """Snapshot the process's rows of the phase it leaves."""
        before = self.phase_of.get(pid)
        if before is not None and before != phase:
            self.snapshot_pid(pid, before)
        self.phase_of[pid] = phase

    def alloc(self, pid: int, ptr: int, size: int, gpu: int, ts: int, phase: int) -> None:
        if (pid, ptr) in self.blocks:
            self.free(pid, ptr, phase)
        seg = self.segment_of(pid, ptr)
        if seg is None:
            self.unjoined += 1
        tot = self.totals.setdefault((pid, gpu), [0, 0])
        if seg is not None:
            s = self.segments[(pid, seg)]
            if not s[2]:  # the segment is the caching allocator's: its device is the block's
                s[1], s[2] = gpu, True
                tot[1] += s[0]
        tot[0] += size
        self.blocks[(pid, ptr)] = _Block(size, gpu, ts, seg, phase)
        r = self.row(pid, gpu, phase)
        r.allocs += 1
        r.peak_allocated = max(r.peak_allocated, tot[0])
        r.peak_reserved = max(r.peak_reserved, tot[1])

    def free(self, pid: int, ptr: int, phase: int) -> None:
        b = self.blocks.pop((pid, ptr), None)
        if b is None:
            self.unknown_frees += 1
            return
        self.totals[(pid, b.gpu)][0] -= b.size
        self.row(pid, b.gpu, phase).frees += 1

    def exit(self, pid: int) -> None:
        phase = self.phase_of.pop(pid, None)
        if phase is not None:
            self.snapshot_pid(pid, phase)
        for key in [k for k in self.blocks if k[0] == pid]:
            del self.blocks[key]
        for s in list(self.starts.get(pid, [])):
            self.drop_segment(pid, s)
        self.starts.pop(pid, None)
        for key in [k for k in self.totals if k[0] == pid]:
            del self.totals[key]

    # -- snapshots
    def fragmentation(self, pid: int, gpu: int) -> Fragmentation:
        """Blocks and the caching allocator's segments of (pid, gpu) now."""
        allocated, reserved = self.totals.get((pid, gpu), [0, 0])
        mine = sorted((ptr, b.size) for (p, ptr), b in self.blocks.items() if p == pid and b.gpu == gpu)
        spans: list[list[int]] = []  # contiguous segments joined (expandable segments map granules)
        for s in self.starts.get(pid, []):
            size, g, used = self.segments[(pid, s)]
            if g != gpu or not used:
                continue
            if spans and spans[-1][1] == s:
                spans[-1][1] = s + size
            else:
                spans.append([s, s + size])
        largest = 0
        k = 0
        for lo, hi in spans:
            at = lo
            while k < len(mine) and mine[k][0] < hi:
                ptr, size = mine[k]
                if ptr >= lo:
                    largest = max(largest, ptr - at)
                    at = max(at, ptr + rounded(size))
                k += 1
            largest = max(largest, hi - at)
        return Fragmentation(allocated, reserved, reserved - allocated, largest, len(mine), len(spans))

    def snapshot_pid(self, pid: int, phase: int) -> None:
        for p, g in [k for k in self.totals if k[0] == pid]:
            key = (p, g, self.phases.label(phase))
            if key in self.rows:
                self.rows[key].last = self.fragmentation(p, g)

    def failed(self, index: int, ts: int, pid: int, gpu: int, size: int) -> None:
        gpus = [g for p, g in self.totals if p == pid and (gpu < 0 or g == gpu)]
        for g in gpus:
            mine = sorted(((ptr, b) for (p, ptr), b in self.blocks.items() if p == pid and b.gpu == g),
                          key=lambda item: -item[1].size)[:BLOCKS_AT_FAILURE]
            largest = [BlockAtFailure(ptr, b.size, seconds(ts - b.ts), b.segment, self.phases.label(b.phase))
                       for ptr, b in mine]
            self.failures.append(FailureBlocks(index, seconds(ts - self.start), pid, g, size,
                                               self.fragmentation(pid, g), largest))


def tensor_section(events: Any, phases: Phases, start: int, header: dict,
                   pid: int | None = None, gpu: int | None = None) -> dict | None:
    """The report's ``tensors`` section, or None when the trace has no tensor events and no
    PyTorch install was tried (``header["probes"]["torch"]``).

    Args:
        events: the trace's events (a Batch or columns; ``gpu`` filled by the replay).
        phases: the trace's phases; start: the trace's first ts.
        header: the trace header (which libc10_cuda.so files gave probes, which did not, why).
        pid, gpu: the report's filter.
    """
    libraries = (header.get("probes") or {}).get("torch")
    kinds = events["kind"]
    tensor = (kinds == _T_ALLOC) | (kinds == _T_FREE)
    if not tensor.any() and libraries is None:
        return None
    ok = events["result"] == 0
    wanted = (ok & np.isin(kinds, (_ALLOC, _FREE, _MAP, _UNMAP, _EXIT, _T_ALLOC, _T_FREE))) | (
        ~ok & np.isin(kinds, _SEGMENT_FAILS))
    # Only processes with tensor events matter (their exits and segments included).
    pids_with = np.unique(events["pid"][tensor])
    idx = np.flatnonzero(wanted & np.isin(events["pid"], pids_with))
    rp = _Replay(phases, start)
    sub = {name: events[name][idx].tolist() for name in ("kind", "pid", "ptr", "size", "gpu", "ts", "result")}
    phase_ids = phases.assign(events["pid"][idx], events["ts"][idx]).tolist()
    for j in range(len(idx)):
        k, p, ptr = sub["kind"][j], sub["pid"][j], sub["ptr"][j]
        if sub["result"][j] != 0:
            rp.failed(int(idx[j]), sub["ts"][j], p, sub["gpu"][j], sub["size"][j])
        elif k == _T_ALLOC:
            rp.enter(p, phase_ids[j])
            rp.alloc(p, ptr, sub["size"][j], sub["gpu"][j], sub["ts"][j], phase_ids[j])
        elif k == _T_FREE:
            rp.enter(p, phase_ids[j])
            rp.free(p, ptr, phase_ids[j])
        elif k == _ALLOC or k == _MAP:
            rp.add_segment(p, ptr, sub["size"][j], sub["gpu"][j])
        elif k == _FREE:
            rp.drop_segment(p, ptr)
        elif k == _UNMAP:
            rp.drop_range(p, ptr, sub["size"][j])
        elif k == _EXIT:
            rp.exit(p)
    for p, phase in list(rp.phase_of.items()):
        rp.snapshot_pid(p, phase)

    def keep(p: int, g: int) -> bool:
        return (pid is None or p == pid) and (gpu is None or g == gpu)

    return {
        "libraries": libraries or [],
        "events": int(tensor.sum()),
        "unjoined_blocks": rp.unjoined,
        "unknown_frees": rp.unknown_frees,
        "rows": [asdict(r) for r in sorted(rp.rows.values(), key=lambda r: (r.gpu, r.pid, r.phase))
                 if keep(r.pid, r.gpu)],
        "failures": [asdict(f) for f in rp.failures if keep(f.pid, f.gpu)],
    }
