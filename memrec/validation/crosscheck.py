"""Check PyTorch's own account of its segments against what memrec recorded.

PyTorch's memory history (``torch.cuda.memory._record_memory_history``) reports each segment the
caching allocator takes from the driver (``segment_alloc``/``segment_free``) and, with expandable
segments, each range it maps (``segment_map``/``segment_unmap``). Every one must appear in memrec
with the same address and size: one ``cuMemAlloc_v2``/``cuMemFree_v2`` per segment, or
``cuMemMap``/``cuMemUnmap`` calls that tile the mapped range exactly (PyTorch maps a range one
physical granule at a time).
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

import numpy as np

from memrec.terms.events import Kind


@dataclass
class CrossCheck:
    """How many of PyTorch's segment actions memrec recorded, and which it did not."""

    matched: int = 0
    total: int = 0
    missing: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.total > 0 and self.matched == self.total


def _tiles(events: np.ndarray, candidates: np.ndarray, addr: int, size: int) -> np.ndarray | None:
    """Indices of candidate events whose [ptr, ptr+size) ranges tile [addr, addr+size) exactly."""
    ptr = events["ptr"].astype(np.int64)
    inside = candidates & (ptr >= addr) & (ptr < addr + size)
    idx = np.flatnonzero(inside)
    if len(idx) == 0:
        return None
    order = idx[np.argsort(ptr[idx], kind="stable")]
    cursor = addr
    chosen = []
    for i in order:
        if int(ptr[i]) == cursor:
            chosen.append(i)
            cursor += int(events["size"][i])
            if cursor == addr + size:
                return np.array(chosen)
    return None


def crosscheck_segments(actions: list[dict], pid: int, events: np.ndarray) -> CrossCheck:
    """Match PyTorch segment actions of process ``pid`` against recorded events."""
    result = CrossCheck()
    used = np.zeros(len(events), dtype=bool)
    mine = (events["pid"] == pid) & (events["result"] == 0)
    for action in actions:
        result.total += 1
        addr, size = int(action["addr"]), int(action["size"])
        kind = action["action"]
        hit: np.ndarray | None = None
        if kind in ("segment_alloc", "segment_free"):
            want = Kind.ALLOC if kind == "segment_alloc" else Kind.FREE
            candidates = mine & ~used & (events["kind"] == want) & (events["ptr"] == np.uint64(addr))
            if kind == "segment_alloc":
                candidates &= events["size"] == np.uint64(size)
            found = np.flatnonzero(candidates)
            hit = found[:1] if len(found) else None
        elif kind in ("segment_map", "segment_unmap"):
            want = Kind.VMM_MAP if kind == "segment_map" else Kind.VMM_UNMAP
            hit = _tiles(events, mine & ~used & (events["kind"] == want), addr, size)
        if hit is None:
            result.missing.append(action)
            continue
        used[hit] = True
        result.matched += 1
    return result
