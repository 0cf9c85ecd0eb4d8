"""Tensor blocks inside the caching allocator's segments, per process: :class:`TensorBlocks`.

Why apart from :class:`memrec.state.LiveState`: blocks are not driver memory (a block lives
inside memory the driver already counts), they come and go a hundred times faster than
segments, and what is asked of them is about PyTorch's allocator: how much of what it reserved
holds tensors, and how it is cut up. The daemon keeps one for its metrics; the report's replay
(:mod:`memrec.analysis.report.tensors`) extends it with phases and failed calls.

Definitions (docs/report.md, "Tensor blocks"):
    - A block's **segment** is the driver allocation (``cuMemAlloc``) or VMM mapping
      (expandable segments) of the same process that holds its address; blocks whose segment
      was never seen (allocated before the recording) are counted in :attr:`unjoined`.
    - **reserved**: the bytes of the live segments that have held a block (the caching
      allocator's; a process's other driver memory, NCCL's or cuBLAS's, is not reserved here).
    - **allocated**: the bytes of live blocks, as PyTorch asked for them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from memrec.terms.events import Kind
from memrec.state.fields import MAX_SIZE

ALLOC, FREE = int(Kind.ALLOC), int(Kind.FREE)
MAP, UNMAP = int(Kind.VMM_MAP), int(Kind.VMM_UNMAP)
EXIT = int(Kind.PROC_EXIT)
T_ALLOC, T_FREE = int(Kind.TENSOR_ALLOC), int(Kind.TENSOR_FREE)
#: The events the tracker reads (successful ones).
TRACKED_KINDS = (ALLOC, FREE, MAP, UNMAP, EXIT, T_ALLOC, T_FREE)
_COLUMNS = ("kind", "pid", "ptr", "size", "gpu", "ts")
_MAX_SIZE = int(MAX_SIZE)
#: The caching allocator's smallest block and rounding (kMinBlockSize).
BLOCK_ROUND = 512


#: Events turned into Python values at a time (a 10M-event trace never becomes 10M-long lists).
ROWS_CHUNK = 1 << 18


def rows(events: Any, idx: np.ndarray, names: tuple[str, ...],
         aligned: dict[str, np.ndarray] | None = None) -> Iterator[tuple]:
    """The events at ``idx`` as tuples of the columns ``names`` (Python ints), chunk by chunk;
    a name in ``aligned`` is read from that array (one value per ``idx`` entry) instead."""
    aligned = aligned or {}
    for lo in range(0, len(idx), ROWS_CHUNK):
        part = idx[lo:lo + ROWS_CHUNK]
        yield from zip(*((aligned[name][lo:lo + ROWS_CHUNK] if name in aligned else events[name][part]).tolist()
                         for name in names))


def rounded(size: int) -> int:
    """A request's block size in the caching allocator (at least, and a multiple of, 512 bytes)."""
    return max(BLOCK_ROUND, -(-size // BLOCK_ROUND) * BLOCK_ROUND)


@dataclass
class Fragmentation:
    """One (process, GPU)'s blocks and segments at one moment."""

    allocated: int = 0
    reserved: int = 0
    free: int = 0  # reserved - allocated
    largest_free: int = 0  # the longest free stretch inside the segments (contiguous ones joined)
    blocks: int = 0
    segments: int = 0


class Block:
    """A live tensor block (slots: a process may hold a hundred thousand of them)."""

    __slots__ = ("size", "gpu", "ts", "segment", "phase")

    def __init__(self, size: int, gpu: int, ts: int, segment: int | None, phase: int = -1) -> None:
        self.size = size
        self.gpu = gpu
        self.ts = ts
        self.segment = segment  # the address of the segment holding it (None: not seen)
        self.phase = phase  # the phase that allocated it (the report's replay sets it)


class TensorBlocks:
    """Blocks and segments of every process, applied event by event."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, int], Block] = {}
        #: pid -> sorted segment starts, and (pid, start) -> [size, gpu, holds-a-block]
        self.starts: dict[int, list[int]] = {}
        self.segments: dict[tuple[int, int], list] = {}
        #: (pid, gpu) -> [allocated, reserved, blocks] of processes that have had a block
        self.totals: dict[tuple[int, int], list[int]] = {}
        self.unjoined = 0  # blocks placed in a segment never seen
        self.unknown_frees = 0  # frees of blocks never seen allocated
        self.events = 0  # tensor events applied

    # -- a batch, as the daemon applies it
    def apply(self, events: Any) -> None:
        """Apply a batch of events (EVENT_DTYPE rows or columns, ``gpu`` filled, in time order)."""
        kinds = events["kind"]
        idx = np.flatnonzero(np.isin(kinds, TRACKED_KINDS) & (events["result"] == 0))
        for k, p, ptr, size, g, ts in rows(events, idx, _COLUMNS):
            self.apply_one(k, p, ptr, size, g, ts)

    def apply_one(self, kind: int, pid: int, ptr: int, size: int, gpu: int, ts: int, phase: int = -1) -> None:
        """Apply one successful event of :data:`TRACKED_KINDS` (a size past 4 PiB clamped, as the live
        state clamps it: a damaged size of 2^64 - 1 made the totals overflow int64)."""
        size = min(size, _MAX_SIZE)
        if kind == T_ALLOC:
            self.alloc(pid, ptr, size, gpu, ts, phase)
        elif kind == T_FREE:
            self.free(pid, ptr, phase)
        elif kind == ALLOC or kind == MAP:
            self.add_segment(pid, ptr, size, gpu)
        elif kind == FREE:
            self.drop_segment(pid, ptr)
        elif kind == UNMAP:
            self.drop_range(pid, ptr, size)
        elif kind == EXIT:
            self.exit(pid)

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
        """The start of the segment of ``pid`` that holds ``ptr``, or None."""
        starts = self.starts.get(pid)
        if not starts:
            return None
        k = bisect.bisect_right(starts, ptr) - 1
        if k < 0:
            return None
        s = starts[k]
        return s if ptr < s + self.segments[(pid, s)][0] else None

    # -- blocks
    def alloc(self, pid: int, ptr: int, size: int, gpu: int, ts: int, phase: int = -1) -> None:
        if (pid, ptr) in self.blocks:
            self.free(pid, ptr, phase)
        self.events += 1
        seg = self.segment_of(pid, ptr)
        if seg is None:
            self.unjoined += 1
        tot = self.totals.setdefault((pid, gpu), [0, 0, 0])
        if seg is not None:
            s = self.segments[(pid, seg)]
            if not s[2]:  # the segment is the caching allocator's: its device is the block's
                s[1], s[2] = gpu, True
                tot[1] += s[0]
        tot[0] += size
        tot[2] += 1
        self.blocks[(pid, ptr)] = Block(size, gpu, ts, seg, phase)

    def free(self, pid: int, ptr: int, phase: int = -1) -> Block | None:
        """Drop a block; return it (None: never seen allocated)."""
        self.events += 1
        b = self.blocks.pop((pid, ptr), None)
        if b is None:
            self.unknown_frees += 1
            return None
        tot = self.totals[(pid, b.gpu)]
        tot[0] -= b.size
        tot[2] -= 1
        return b

    def exit(self, pid: int) -> None:
        for key in [k for k in self.blocks if k[0] == pid]:
            del self.blocks[key]
        for s in list(self.starts.get(pid, [])):
            self.drop_segment(pid, s)
        self.starts.pop(pid, None)
        for key in [k for k in self.totals if k[0] == pid]:
            del self.totals[key]

    # -- views
    def blocks_of(self, pid: int, gpu: int) -> list[tuple[int, Block]]:
        """The live blocks of (pid, gpu) as (address, block), by address."""
        return sorted(((ptr, b) for (p, ptr), b in self.blocks.items() if p == pid and b.gpu == gpu),
                      key=lambda item: item[0])

    def fragmentation(self, pid: int, gpu: int) -> Fragmentation:
        """Blocks and the caching allocator's segments of (pid, gpu) now."""
        allocated, reserved, _n = self.totals.get((pid, gpu), [0, 0, 0])
        mine = [(ptr, b.size) for ptr, b in self.blocks_of(pid, gpu)]
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


class BlockSeries:
    """(pid, gpu) -> (ts, allocated, reserved) after each tensor event of that process and GPU:
    the counters the Perfetto export draws, from a replay's chunks in order (:meth:`add`: the
    blocks alive carry over; nothing else of a chunk is kept)."""

    def __init__(self) -> None:
        self._tb = TensorBlocks()

    def add(self, events: Any) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The counters' points of ``events`` (each chunk's driver events too: the segments
        the blocks are in; a trace without tensor events needs none of this)."""
        kinds = events["kind"]
        tb = self._tb
        out: dict[tuple[int, int], tuple[list, list, list]] = {}
        idx = np.flatnonzero(np.isin(kinds, TRACKED_KINDS) & (events["result"] == 0))
        for k, p, ptr, size, g, ts in rows(events, idx, _COLUMNS):
            if k == T_FREE:
                b = tb.blocks.get((p, ptr))
                g = b.gpu if b is not None else -1
            tb.apply_one(k, p, ptr, size, g, ts)
            if (k == T_ALLOC or k == T_FREE) and (p, g) in tb.totals:
                tot = tb.totals[(p, g)]
                ts_l, a_l, r_l = out.setdefault((p, g), ([], [], []))
                ts_l.append(ts)
                a_l.append(tot[0])
                r_l.append(tot[1])
        return {key: (np.asarray(t, np.uint64), np.asarray(a, np.int64), np.asarray(r, np.int64))
                for key, (t, a, r) in out.items()}
