"""Where a batch's IPC exports and opens may join a run applied at once (:class:`Planner`).

:meth:`memrec.state.LiveState.apply` cuts a batch into runs at process exits and at exports and
opens whose outcome the allocations and frees before them in the run could change; the rest join
the run, so that a busy exporter (NCCL, SGLang's weight sharing) does not cut every run short.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

import numpy as np

from memrec.terms.events import FLAG_IPC_BYTES
from memrec.state.allocs import key_hash
from memrec.state.allocs import key_hash1
from memrec.state.allocs import top_order
from memrec.state.fields import FREE
from memrec.state.fields import IPC_EXPORT
from memrec.state.fields import IPC_OPEN
from memrec.state.fields import MAX_SIZE
from memrec.state.fields import MAX_TS
from memrec.state.fields import PROC_EXIT

if TYPE_CHECKING:
    from memrec.state.batch import Batch
    from memrec.state.tables import Tables


class Planner:
    """Whether an IPC export or open can join the run being gathered, for one batch.

    In a run the other kinds go first, event by event, and the allocations and frees after, at
    once. An export reads the allocation at its pointer: it joins when the run has no earlier
    event on that (pid, ptr) and the table has it, or the run's earlier events on it are
    allocations only (the last one's row is handed over as a hint; a free between would forget
    the export), or the run has no earlier event of that process at all (the interior look-up
    sees the table as it was). An open reads the export of its handle: it joins unless the run
    frees that export's allocation before it. A process exit never joins.
    """

    def __init__(self, tables: Tables, events: Batch, plain_ok: np.ndarray) -> None:
        self.tables = tables
        self.events = events
        self.kinds = events["kind"]
        self.pids = events["pid"]
        self.ptrs = events["ptr"]
        self.keys = key_hash(self.pids, self.ptrs)
        # The batch's successful allocations and frees as (top bits of the key hash, position)
        # in one sorted uint64 each: a key's events are a range, in event order.
        self.plain = np.flatnonzero(plain_ok)
        self.shift = np.uint64(max(20, len(self.kinds).bit_length()))
        self.low = (1 << int(self.shift)) - 1
        tops = self.keys[self.plain] >> self.shift
        order = top_order(tops)
        self.by_key = (tops[order] << self.shift) | self.plain[order].astype(np.uint64)
        self.key_pos = (self.by_key & np.uint64(self.low)).astype(np.int64)
        self._of_pid: dict[int, np.ndarray] = {}
        self.joined: dict[bytes, int] = {}  # handle bytes -> key hash of the allocation, of exports joined
        self._exports: dict[int, tuple] | None = None  # see _export_facts
        self._opens: dict[int, bytes | None] | None = None  # position -> an open's handle bytes
        self._frees: list[int] = []  # the frees of by_key

    def restart(self) -> None:
        """A new run begins."""
        self.joined.clear()

    def joins(self, lo: int, b: int) -> bool:
        """Whether event ``b`` (an export, open or exit) joins the run that began at ``lo``."""
        kind = int(self.kinds[b])
        if kind == PROC_EXIT:
            return False
        if kind == IPC_EXPORT:
            return self._export_joins(lo, b)
        return self._open_joins(lo, b)

    def _on_key(self, key: int, lo: int, b: int) -> np.ndarray:
        """Positions in [lo, b) of allocations and frees whose key hash has ``key``'s top bits
        (its key's events, and any of another key that shares them)."""
        top = (key >> int(self.shift)) << int(self.shift)
        i0, i1 = np.searchsorted(self.by_key, np.array([top | lo, top | b], np.uint64)).tolist()
        return self.key_pos[i0:i1]

    def _pid_has_events(self, pid: int, lo: int, b: int) -> bool:
        pos = self._of_pid.get(pid)
        if pos is None:
            pos = self._of_pid[pid] = self.plain[self.pids[self.plain] == pid]
        i = np.searchsorted(pos, lo)
        return bool(i < len(pos) and pos[i] < b)

    def _export_facts(self) -> dict[int, tuple]:
        """For each successful export of the batch (by position), found with numpy at once: its
        pid, ptr and key hash, the position of the last allocation or free of its (pid, ptr)
        before it (-1: none), of the last free of a key with its hash's top bits before it (-1:
        none), the hint that last event gives, and its handle bytes (None: none). None instead
        where the last event before it of a key with those top bits is another key's (then
        :meth:`_export_joins_slowly` looks item by item)."""
        ev = self.events
        at = np.flatnonzero((self.kinds == IPC_EXPORT) & (ev["result"] == 0))
        prev = prev_free = np.full(len(at), -1)
        shared = np.zeros(len(at), bool)
        sp = self.key_pos
        if len(sp):
            comp, shift = self.by_key, self.shift
            top = (self.keys[at] >> shift) << shift
            g0 = np.searchsorted(comp, top)
            last = np.searchsorted(comp, top | at.astype(np.uint64)) - 1
            here = last >= g0  # a key with those top bits has events before the export
            last = np.maximum(last, 0)
            prev = np.where(here, sp[last], -1)
            shared = here & ((self.pids[sp[last]] != self.pids[at]) | (self.ptrs[sp[last]] != self.ptrs[at]))
            # A free of any key with those top bits cuts: never wrong, and another key's is rare.
            free_at = np.maximum.accumulate(np.where(self.kinds[sp] == FREE, np.arange(len(sp)), -1))[last]
            prev_free = np.where(here & (free_at >= g0), sp[np.maximum(free_at, 0)], -1)
        j = np.maximum(prev, 0)
        hints = zip(np.minimum(ev["size"][j], MAX_SIZE).tolist(), ev["gpu"][j].tolist(),
                    np.minimum(ev["ts"][j], MAX_TS).tolist(), ev["api"][j].tolist())
        hb = ev.ipc_bytes_at(at, (ev["flags"][at] & FLAG_IPC_BYTES) != 0)
        cols = (at.tolist(), self.pids[at].tolist(), self.ptrs[at].tolist(), self.keys[at].tolist(), prev.tolist(),
                prev_free.tolist(), shared.tolist(), hints, hb)
        return {b: None if sh else (pid, ptr, key, pv, pf, hint, h)
                for b, pid, ptr, key, pv, pf, sh, hint, h in zip(*cols)}

    def _export_joins(self, lo: int, b: int) -> bool:
        if self._exports is None:
            self._exports = self._export_facts()
        facts = self._exports[b]
        if facts is None:
            return self._export_joins_slowly(lo, b)
        tables = self.tables
        pid, ptr, key, prev, prev_free, hint, hb = facts
        index = tables.n_events + b
        if prev >= lo:
            if prev_free >= lo:
                return False  # the free forgets exports made before it only: keep it in order
            tables.alloc_hints[index] = (ptr, hint)
        elif tables.allocs.find(pid, ptr)[0] < 0:
            if self._pid_has_events(pid, lo, b):
                return False
            key = self._interior_key(pid, ptr, key, index)
        if hb is not None:
            self.joined[hb] = key
        return True

    def _export_joins_slowly(self, lo: int, b: int) -> bool:
        """:meth:`_export_joins` for an export whose key hash another key shares."""
        tables = self.tables
        pid, ptr, key = int(self.pids[b]), int(self.ptrs[b]), int(self.keys[b])
        same = self._on_key(key, lo, b)
        same = same[(self.pids[same] == pid) & (self.ptrs[same] == ptr)]
        index = tables.n_events + b
        if len(same):
            if np.any(self.kinds[same] == FREE):
                return False
            tables.alloc_hints[index] = (ptr, self._hint(int(same[-1])))
        elif tables.allocs.find(pid, ptr)[0] < 0:
            if self._pid_has_events(pid, lo, b):
                return False
            key = self._interior_key(pid, ptr, key, index)
        if int(self.events["flags"][b]) & FLAG_IPC_BYTES:
            self.joined[self.events.ipc_bytes(b)] = key
        return True

    def _hint(self, j: int) -> tuple[int, int, int, int]:
        """The allocation event ``j`` makes, as the table would hold it: (size, gpu, ts, api)."""
        ev = self.events
        return int(min(ev["size"][j], MAX_SIZE)), int(ev["gpu"][j]), int(min(ev["ts"][j], MAX_TS)), int(ev["api"][j])

    def _interior_key(self, pid: int, ptr: int, key: int, index: int) -> int:
        """The key hash of the allocation holding ``ptr`` (``key`` when none does)."""
        base, found = self.tables.alloc_at(pid, ptr, index)
        if found is None:
            return key
        return key_hash1(pid, base)

    def _open_joins(self, lo: int, b: int) -> bool:
        tables = self.tables
        if self._opens is None:
            at = np.flatnonzero((self.kinds == IPC_OPEN) & ((self.events["flags"] & FLAG_IPC_BYTES) != 0))
            self._opens = dict(zip(at.tolist(), self.events.ipc_bytes_at(at, np.ones(len(at), bool))))
            frees = self.by_key[self.kinds[self.key_pos] == FREE]
            self._frees = frees.tolist()  # sorted: bisect on Python ints beats a numpy call per open
        hb = self._opens.get(b)
        if hb is None:
            return True  # it reads no export
        key = self.joined.get(hb)
        if key is None:
            ex = tables.exports.get(hb)
            if ex is None or not (0 <= ex[0] < 1 << 32 and 0 <= ex[1] < 1 << 64):
                return True
            key = key_hash1(ex[0], ex[1])
        # A free in [lo, b) of a key whose hash has the allocation's top bits: keep the open in order.
        top = (key >> int(self.shift)) << int(self.shift)
        i = bisect_left(self._frees, top | lo)
        return not (i < len(self._frees) and self._frees[i] < top | b)
