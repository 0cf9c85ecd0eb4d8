"""Where a batch's IPC exports and opens may join a run applied at once (:class:`Planner`).

:meth:`memrec.state.LiveState.apply` cuts a batch into runs at process exits and at exports and
opens whose outcome the allocations and frees before them in the run could change; the rest join
the run, so that a busy exporter (NCCL, SGLang's weight sharing) does not cut every run short.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import compress
from itertools import repeat
from typing import TYPE_CHECKING
from typing import Iterator
from typing import NamedTuple

import numpy as np

from memrec.terms.events import FLAG_IPC_BYTES
from memrec.state.allocs import key_bits
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


class _Exports(NamedTuple):
    """A batch's successful exports, found at once (see Planner._export_arrays)."""

    at: np.ndarray  # positions
    prev: np.ndarray  # the last allocation or free of its (pid, ptr) before it (-1: none)
    prev_free: np.ndarray  # the last free of a key with its top bits before it (-1: none)
    shared: np.ndarray  # the last event before it of a key with its top bits is another key's
    hb: list  # handle bytes (None: none)


class _Sure(NamedTuple):
    """Per barrier of a batch, what decides whether it surely joins a run (see Planner._surely_join)."""

    whole: np.ndarray  # an export whose key hash's top bits no other key of the batch has
    prev: np.ndarray  # an export's last allocation or free of its key before it (-1: none)
    prev_free: np.ndarray  # an export's last free of a key with its top bits before it (-1: none)
    open_alone: np.ndarray  # an open without handle bytes (it reads no export)
    export_of: np.ndarray  # an open's export: the barrier of the last one before it with its bytes (-1: none)
    top: np.ndarray  # the top bits of that export's key hash, in by_key's form
    rank: np.ndarray  # whole exports before each barrier (one more value: all of them)
    hints: list  # per whole export: (event index, (ptr, hint)) as joins records it
    joined: list  # per whole export: (handle bytes or None, key hash)


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

    def __init__(self, tables: Tables, events: Batch, plain_ok: np.ndarray, barriers: np.ndarray) -> None:
        self.tables = tables
        self.events = events
        self.barriers = barriers  # positions of the batch's exits and successful exports and opens
        self.kinds = events["kind"]
        self.pids = events["pid"]
        self.ptrs = events["ptr"]
        self.keys = key_hash(self.pids, self.ptrs)
        # The batch's successful allocations and frees as (top bits of the key hash, position)
        # in one sorted uint64 each: a key's events are a range, in event order.
        self.plain = np.flatnonzero(plain_ok)
        self.shift = np.uint64(key_bits(len(self.kinds)))
        self.low = (1 << int(self.shift)) - 1
        tops = self.keys[self.plain] >> self.shift
        order = top_order(tops)
        self.by_key = (tops[order] << self.shift) | self.plain[order].astype(np.uint64)
        self.key_pos = (self.by_key & np.uint64(self.low)).astype(np.int64)
        self._of_pid: dict[int, np.ndarray] = {}
        self.joined: dict[bytes, int] = {}  # handle bytes -> key hash of the allocation, of exports joined
        self._exports: _Exports | None = None  # see _export_arrays
        self._opens: dict[int, bytes | None] | None = None  # position -> an open's handle bytes
        self._frees: list[int] = []  # the frees of by_key, as ints for bisect
        self._frees_at: np.ndarray | None = None  # the same as an array (see _free_tops)
        self._sure: _Sure | None = None  # see _sure_facts
        self._rank: np.ndarray | None = None  # batch position -> its number among the allocations and frees

    def run_order(self, lo: int, hi: int) -> np.ndarray | None:
        """:func:`memrec.state.allocs.by_key`'s radix order of the successful allocations and frees
        in ``[lo, hi)`` (numbered from 0 in event order), cut out of the batch's (a stable sort
        restricted to a range is the range's own stable sort); None when the run's
        :func:`~memrec.state.allocs.key_bits` are not the batch's (a batch past 2^20 events)."""
        i0, i1 = np.searchsorted(self.plain, (lo, hi)).tolist()
        if key_bits(i1 - i0) != int(self.shift):
            return None
        if self._rank is None:
            self._rank = np.zeros(len(self.kinds), np.int64)
            self._rank[self.plain] = np.arange(len(self.plain))
        pos = self.key_pos
        if i1 - i0 < len(pos):
            pos = pos[(pos >= lo) & (pos < hi)]
        return self._rank[pos] - i0

    def restart(self) -> None:
        """A new run begins."""
        self.joined.clear()

    def next_cut(self, lo: int, k: int) -> int:
        """The first of :attr:`barriers` from the ``k``-th on (the first at or after ``lo``)
        that does not join the run begun at ``lo``; ``len(barriers)`` when all do.

        The barriers that surely join are found with numpy at once (:meth:`_surely_join`) and
        recorded in bulk as :meth:`joins` would one by one; the others go through
        :meth:`joins`, in order, each after the sure ones before it are recorded.
        """
        if self._sure is None:
            self._sure = self._sure_facts()
        sure = self._surely_join(lo, k)
        for j in (np.flatnonzero(~sure) + k).tolist():
            self._record(k, j)
            if not self.joins(lo, int(self.barriers[j])):
                return j
            k = j + 1
        self._record(k, len(self.barriers))
        return len(self.barriers)

    def _sure_facts(self) -> _Sure:
        """What :meth:`_surely_join` reads, per barrier, found once per batch (every successful
        export is a barrier)."""
        ex = self._export_arrays()
        bars, ev = self.barriers, self.events
        kinds = self.kinds[bars]
        at = np.searchsorted(bars, ex.at)
        whole = np.zeros(len(bars), bool)
        whole[at] = ~ex.shared
        prev = np.full(len(bars), -1)
        prev[at] = ex.prev
        prev_free = np.full(len(bars), -1)
        prev_free[at] = ex.prev_free
        # What joins records of each whole export, built by zip (no Python step per export).
        w = ex.at[~ex.shared]
        j = np.maximum(ex.prev[~ex.shared], 0)
        hints = list(zip((w + self.tables.n_events).tolist(), zip(self.ptrs[w].tolist(), self._hints(j))))
        joined = list(zip(compress(ex.hb, (~ex.shared).tolist()), self.keys[w].tolist()))
        # An open's export: the last successful export before it with the same handle bytes.
        flagged = (ev["flags"][bars] & FLAG_IPC_BYTES) != 0
        ex_bars = at[flagged[at]]
        op_bars = np.flatnonzero((kinds == IPC_OPEN) & flagged)
        export_of = np.full(len(bars), -1)
        if len(ex_bars) and len(op_bars):
            ex_hb = list(compress(ex.hb, flagged[at].tolist()))
            ids = dict(zip(ex_hb, range(len(ex_hb))))  # equal bytes, equal number
            ex_ids = np.fromiter(map(ids.__getitem__, ex_hb), np.int64, len(ex_hb))
            op_hb = ev.ipc_bytes_at(bars[op_bars], np.ones(len(op_bars), bool))
            op_ids = np.fromiter(map(ids.get, op_hb, repeat(-1)), np.int64, len(op_bars))
            width = len(bars) + 1
            comp = np.sort(ex_ids * width + ex_bars)
            want = op_ids * width + op_bars
            i = np.maximum(np.searchsorted(comp, want) - 1, 0)
            hit = (op_ids >= 0) & (comp[i] // width == op_ids) & (comp[i] < want)
            export_of[op_bars[hit]] = comp[i[hit]] % width
        top = (self.keys[bars[np.maximum(export_of, 0)]] >> self.shift) << self.shift
        return _Sure(whole, prev, prev_free, (kinds == IPC_OPEN) & ~flagged, export_of, top,
                     np.concatenate(([0], np.cumsum(whole))), hints, joined)

    def _surely_join(self, lo: int, k: int) -> np.ndarray:
        """Whether each barrier from the ``k``-th on joins the run begun at ``lo`` if every one
        before it does, where that follows from the batch alone (False: ask :meth:`joins`): an
        export whose last allocation or free before it is in the run, an allocation (see
        :meth:`_export_joins`); an open without handle bytes, or of an export surely joined in the
        run with no free of a key with its top bits in the run before it (see :meth:`_open_joins`)."""
        sure, bars = self._sure, self.barriers[k:]
        export = sure.whole[k:] & (sure.prev[k:] >= lo) & (sure.prev_free[k:] < lo)
        of = sure.export_of[k:]
        read = of >= k
        joined_export = np.zeros(len(bars), bool)
        joined_export[read] = export[of[read] - k]
        frees = self._free_tops()
        if len(frees):
            top = sure.top[k:]
            i = np.minimum(np.searchsorted(frees, top | np.uint64(lo)), len(frees) - 1)
            joined_export &= (frees[i] < (top | np.uint64(lo))) | (frees[i] >= (top | bars.astype(np.uint64)))
        return export | sure.open_alone[k:] | joined_export

    def _record(self, k: int, j: int) -> None:
        """Record what :meth:`joins` would for the barriers ``k`` to ``j`` (all surely joined):
        each export's hint, and its key under its handle bytes."""
        sure = self._sure
        r0, r1 = int(sure.rank[k]), int(sure.rank[j])
        if r1 > r0:
            self.tables.alloc_hints.update(sure.hints[r0:r1])
            self.joined.update(p for p in sure.joined[r0:r1] if p[0] is not None)

    def _free_tops(self) -> np.ndarray:
        """The batch's frees in :attr:`by_key` (top bits of the key hash, position), ascending."""
        if self._frees_at is None:
            self._frees_at = self.by_key[self.kinds[self.key_pos] == FREE]
        return self._frees_at

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

    def _export_arrays(self) -> _Exports:
        """The batch's successful exports (by position) and, found with numpy at once, the
        position of the last allocation or free of each one's (pid, ptr) before it (-1: none),
        of the last free of a key with its hash's top bits before it (-1: none), whether the
        last event before it of a key with those top bits is another key's (then
        :meth:`_export_joins_slowly` looks item by item), and its handle bytes (None: none)."""
        if self._exports is not None:
            return self._exports
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
        hb = ev.ipc_bytes_at(at, (ev["flags"][at] & FLAG_IPC_BYTES) != 0)
        self._exports = _Exports(at, prev, prev_free, shared, hb)
        return self._exports

    def _hints(self, j: np.ndarray) -> Iterator[tuple[int, int, int, int]]:
        """The allocation each event of ``j`` makes, as the table would hold it: (size, gpu, ts, api)."""
        ev = self.events
        return zip(np.minimum(ev["size"][j], MAX_SIZE).tolist(), ev["gpu"][j].tolist(),
                   np.minimum(ev["ts"][j], MAX_TS).tolist(), ev["api"][j].tolist())

    def _export_joins(self, lo: int, b: int) -> bool:
        ex = self._export_arrays()
        i = int(np.searchsorted(ex.at, b))
        if ex.shared[i]:
            return self._export_joins_slowly(lo, b)
        tables = self.tables
        pid, ptr, key, prev, prev_free = int(self.pids[b]), int(self.ptrs[b]), int(self.keys[b]), int(ex.prev[i]), int(ex.prev_free[i])
        index = tables.n_events + b
        if prev >= lo:
            if prev_free >= lo:
                return False  # the free forgets exports made before it only: keep it in order
            tables.alloc_hints[index] = (ptr, next(self._hints(np.array([prev]))))
        elif tables.allocs.find(pid, ptr)[0] < 0:
            if self._pid_has_events(pid, lo, b):
                return False
            key = self._interior_key(pid, ptr, key, index)
        if ex.hb[i] is not None:
            self.joined[ex.hb[i]] = key
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
            tables.alloc_hints[index] = (ptr, next(self._hints(same[-1:])))
        elif tables.allocs.find(pid, ptr)[0] < 0:
            if self._pid_has_events(pid, lo, b):
                return False
            key = self._interior_key(pid, ptr, key, index)
        if int(self.events["flags"][b]) & FLAG_IPC_BYTES:
            self.joined[self.events.ipc_bytes(b)] = key
        return True


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
            self._frees = self._free_tops().tolist()  # sorted: bisect on Python ints beats a numpy call per open
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
