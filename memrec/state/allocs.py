"""Live state tables keyed (pid, a 64-bit key), held in columns with a numpy hash index.

The daemon keeps a million live allocations on a busy host and applies hundreds of thousands of
events a second. A dict of lists costs about 260 bytes per allocation and one Python step per
event; here each allocation is one row of six numpy columns (33 bytes) plus 8–16 bytes of index,
and :mod:`memrec.state.plain` looks up, inserts and removes whole batches at once. VMM handles
(:class:`HandleTable`) and mappings (:class:`MapTable`) are the same kind of table, so that
:mod:`memrec.state.vmm_run` applies their runs at once too.

The index is open addressing with linear probing over ``int32`` slots holding row numbers
(:data:`EMPTY`, :data:`TOMB` for a removed key). Keys are unique: a key is inserted only when it
is absent. The scalar methods (:meth:`AllocTable.find`, ...) serve the per-event path that rare
kinds and short runs take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Union

import numpy as np

EMPTY = -1
TOMB = -2
_M64 = (1 << 64) - 1
_C1 = 0x9E3779B97F4A7C15
_C2 = 0xBF58476D1CE4E5B9
#: The index is rebuilt larger once live keys plus removed ones fill this share of its slots.
_MAX_LOAD = 0.5
_MIN_SLOTS_BITS = 10
_MIN_ROWS = 1024
#: A batch's look-up or indexing goes on key by key in Python once this few keys are still
#: probing: a round of numpy calls (a dozen) costs more than the Python steps of so few keys, and
#: with linear probing the last keys go on for many rounds (about half of those left end each).
_TAIL = 32

Col = Union[np.ndarray, int]  # one row's value or a column of them


def key_hash(pids: np.ndarray, ptrs: np.ndarray) -> np.ndarray:
    """A 64-bit mix of (pid, ptr) keys (equal keys, equal hashes; the index takes its top bits)."""
    x = ptrs.astype(np.uint64) ^ (pids.astype(np.uint64) * np.uint64(_C1))
    x *= np.uint64(_C2)
    return x


def radix_order(*parts: np.ndarray) -> np.ndarray:
    """The stable order by ``parts`` (8- or 16-bit columns of one length, the last one the most
    significant): one radix pass each (numpy sorts 16-bit keys stably by radix, several times
    faster than any sort of a 64-bit key), a part holding one value throughout skipped."""
    order = None
    for part in parts:
        if order is not None:
            part = part[order]
        if len(part) and part.min() == part.max():
            continue
        step = np.argsort(part, kind="stable")
        order = step if order is None else order[step]
    return np.arange(len(parts[0])) if order is None else order


def top_order(tops: np.ndarray) -> np.ndarray:
    """The stable order of ``tops`` (uint64 below 2^48: a key hash's top bits), as three radix passes."""
    mask = np.uint64(0xFFFF)
    return radix_order(*((tops >> np.uint64(s) & mask).astype(np.uint16) for s in (0, 16, 32)))


def by_key(pid: np.ndarray, ptr: np.ndarray, hashes: np.ndarray | None = None,
           order: np.ndarray | None = None) -> np.ndarray:
    """The order that groups equal (pid, ptr) keys, each group in event order (``hashes``: their
    :func:`key_hash`, when the caller has them; ``order``: the stable order of those hashes'
    top :func:`key_bits`, when the caller has it: the planner sorted the whole batch's).

    A stable radix sort of the key hash's top bits (fast); when two keys share those bits (rare:
    then their events could interleave) a stable sort by (pid, ptr).
    """
    bits = np.uint64(key_bits(len(pid)))
    tops = (key_hash(pid, ptr) if hashes is None else hashes) >> bits
    if order is None:
        order = top_order(tops)
    sp, sq, sh = pid[order], ptr[order], tops[order]
    if np.any((sh[1:] == sh[:-1]) & ((sp[1:] != sp[:-1]) | (sq[1:] != sq[:-1]))):
        return np.lexsort((ptr, pid))
    return order


def key_bits(n: int) -> int:
    """How many low bits of a key hash :func:`by_key` drops for ``n`` keys: the rest (at most 44
    bits) sort in three 16-bit radix passes."""
    return max(20, n.bit_length())


def key_hash1(pid: int, ptr: int) -> int:
    """:func:`key_hash` of one key, in Python ints."""
    return (((ptr & _M64) ^ (pid * _C1 & _M64)) * _C2) & _M64


class KeyTable:
    """Rows ``pid``, :attr:`KEY` and :attr:`FIELDS` (``live`` marks used rows) and a hash index
    over (pid, key). A subclass names its key column and value columns; each is an attribute."""

    #: The 64-bit key column's name (with ``pid``, the key).
    KEY = "key"
    #: Value columns and their types, in a row's order.
    FIELDS: dict[str, type] = {}

    if TYPE_CHECKING:  # each column (pid, the key, the fields, live) is an attribute

        def __getattr__(self, name: str) -> np.ndarray: ...

    def __init__(self) -> None:
        self.names = ("pid", self.KEY, *self.FIELDS)
        self._types = {"pid": np.uint32, self.KEY: np.uint64, **self.FIELDS, "live": bool}
        for name, dt in self._types.items():
            setattr(self, name, np.zeros(_MIN_ROWS, dt))
        self._columns = [getattr(self, name) for name in self.names]  # in names order, for _write
        self._top = 0  # rows [0, top) have been used; freed ones below it are in _free
        self._free = np.zeros(64, np.int32)  # a stack of freed rows: the first _nfree
        self._nfree = 0
        self._bits = _MIN_SLOTS_BITS
        self._slots = np.full(1 << self._bits, EMPTY, np.int32)
        self._tombs = 0
        #: Live allocations.
        self.count = 0

    def __len__(self) -> int:
        return self.count

    @property
    def used(self) -> int:
        """Rows below this have been used (live or freed); none above."""
        return self._top

    def nbytes(self) -> int:
        """Bytes of numpy storage held (rows, free list and index)."""
        cols = [getattr(self, name) for name in self._types]
        return sum(c.nbytes for c in cols) + self._free.nbytes + self._slots.nbytes

    # ------------------------------------------------------------------ hashing

    def _home(self, hashes: np.ndarray) -> np.ndarray:
        """The home slots of keys of these :func:`key_hash` values."""
        return (hashes >> np.uint64(64 - self._bits)).astype(np.int64)

    def _hash1(self, pid: int, ptr: int) -> int:
        return key_hash1(pid, ptr) >> (64 - self._bits)

    # ------------------------------------------------------------------ batches

    def lookup(self, pids: np.ndarray, ptrs: np.ndarray,
               hashes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows and index slots of keys ``(pids[i], ptrs[i])``: -1 where absent (``hashes``: their
        :func:`key_hash`, when the caller has them)."""
        n = len(pids)
        if n == 0 or self.count == 0:
            return np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        pids = pids.astype(np.uint32, copy=False)
        ptrs = ptrs.astype(np.uint64, copy=False)
        mask = (1 << self._bits) - 1
        pos = self._home(key_hash(pids, ptrs) if hashes is None else hashes)
        keys = getattr(self, self.KEY)
        # The first probe, for every key at once (most end there); then those that go on.
        s = self._slots[pos]
        r = np.maximum(s, 0)
        hit = (s >= 0) & (self.pid[r] == pids) & (keys[r] == ptrs)
        rows = np.where(hit, s, -1).astype(np.int64)
        where = np.where(hit, pos, -1)
        pending = np.flatnonzero(~hit & (s != EMPTY))
        pos = (pos[pending] + 1) & mask
        while len(pending):
            if len(pending) <= _TAIL:
                for i, p, pid, key in zip(pending.tolist(), pos.tolist(), pids[pending].tolist(), ptrs[pending].tolist()):
                    rows[i], where[i] = self._probe(p, pid, key)
                break
            s = self._slots[pos].astype(np.int64)
            r = np.maximum(s, 0)
            hit = (s >= 0) & (self.pid[r] == pids[pending]) & (keys[r] == ptrs[pending])
            rows[pending[hit]] = s[hit]
            where[pending[hit]] = pos[hit]
            go = ~hit & (s != EMPTY)
            pending = pending[go]
            pos = (pos[go] + 1) & mask
        return rows, where

    def insert(self, *columns: np.ndarray, hashes: np.ndarray | None = None) -> None:
        """Add rows (columns in :attr:`names` order) whose keys are absent and distinct from each
        other (``hashes``: their :func:`key_hash`, when the caller has them)."""
        n = len(columns[0])
        if n == 0:
            return
        rows = self._take_rows(n)
        self._write(rows, *columns)
        self.count += n
        if (self.count + self._tombs) > _MAX_LOAD * len(self._slots):
            self._rehash()
        else:
            self._index(rows, hashes)

    def _write(self, rows: Col, *values: Col) -> None:
        """Fill rows (one, or an array of them; values in :attr:`names` order) and mark them live."""
        for column, value in zip(self._columns, values):
            column[rows] = value
        self.live[rows] = True

    def remove(self, rows: np.ndarray, where: np.ndarray) -> None:
        """Drop rows found by :meth:`lookup` (``where``: their slots), each once."""
        if len(rows) == 0:
            return
        self._slots[where] = TOMB
        self._tombs += len(rows)
        self._untomb(where)
        self.live[rows] = False
        self.count -= len(rows)
        self._push_free(rows)

    def _untomb(self, where: np.ndarray) -> None:
        """Empty the removed slots that no probe needs to pass: a removed slot before an empty one
        (no key beyond an empty slot was placed past it), and so on backwards. Fewer removed
        slots, shorter probes and fewer rebuilds of the index (each counts them as used)."""
        mask = len(self._slots) - 1
        slots = self._slots
        while len(where):
            where = where[(slots[(where + 1) & mask] == EMPTY) & (slots[where] == TOMB)]
            slots[where] = EMPTY
            self._tombs -= len(where)
            where = (where - 1) & mask

    def _push_free(self, rows: np.ndarray) -> None:
        need = self._nfree + len(rows)
        if need > len(self._free):
            grown = np.zeros(max(need, 2 * len(self._free)), np.int32)
            grown[: self._nfree] = self._free[: self._nfree]
            self._free = grown
        self._free[self._nfree : need] = rows
        self._nfree = need

    def _take_rows(self, n: int) -> np.ndarray:
        k = min(n, self._nfree)
        self._nfree -= k
        rows = self._free[self._nfree : self._nfree + k].astype(np.int64)
        more = n - k
        if more:
            if self._top + more > len(self.live):
                self._grow(self._top + more)
            rows = np.concatenate((rows, np.arange(self._top, self._top + more)))
            self._top += more
        return rows

    def _grow(self, need: int) -> None:
        cap = max(need, len(self.live) + len(self.live) // 2)
        for name in self._types:
            old = getattr(self, name)
            new = np.zeros(cap, old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
        self._columns = [getattr(self, name) for name in self.names]

    def shrink(self) -> bool:
        """Compact the live rows into columns and an index sized for them once at most a quarter
        of the rows are live (processes exited, a burst freed): the daemon then gives that memory
        back instead of keeping its peak (the columns were only ever grown). Row numbers change:
        call it between batches, never while rows found by :meth:`lookup` are in use. Returns
        whether it compacted (the capacity halves at least each time; growth is × 1.5 when full,
        so a table never swings between the two)."""
        cap = len(self.live)
        if cap <= _MIN_ROWS or 4 * self.count > cap:
            return False
        rows = np.flatnonzero(self.live[: self._top])
        size = max(_MIN_ROWS, 2 * len(rows))
        for name in self._types:
            new = np.zeros(size, getattr(self, name).dtype)
            new[: len(rows)] = getattr(self, name)[rows]
            setattr(self, name, new)
        self._columns = [getattr(self, name) for name in self.names]
        self._top = len(rows)
        self._free = np.zeros(64, np.int32)
        self._nfree = 0
        self._rehash()
        return True

    def _rehash(self) -> None:
        bits = _MIN_SLOTS_BITS
        while self.count > _MAX_LOAD * 0.75 * (1 << bits):
            bits += 1
        self._bits = bits
        self._slots = np.full(1 << bits, EMPTY, np.int32)
        self._tombs = 0
        self._index(np.flatnonzero(self.live[: self._top]))

    def _index(self, rows: np.ndarray, hashes: np.ndarray | None = None) -> None:
        """Put ``rows`` (keys not in the index) into free slots, claiming each slot once."""
        mask = (1 << self._bits) - 1
        pos = self._home(key_hash(self.pid[rows], getattr(self, self.KEY)[rows]) if hashes is None else hashes)
        pending = rows
        while len(pending):
            if len(pending) <= _TAIL:
                for row, p in zip(pending.tolist(), pos.tolist()):
                    self._claim(row, p)
                return
            s = self._slots[pos]
            free = s < 0
            cand = np.flatnonzero(free)
            taken = np.zeros(len(pending), bool)
            if len(cand):
                # Every candidate writes its row; the one a slot kept is the slot's winner.
                where = pos[cand]
                was_tomb = s[cand] == TOMB
                self._slots[where] = pending[cand]
                won = self._slots[where] == pending[cand]
                self._tombs -= int(np.count_nonzero(was_tomb & won))
                taken[cand[won]] = True
            stay = ~taken
            # A loser of a claimed slot sees it taken next round and moves on then.
            step = np.where(free[stay], 0, 1)
            pending = pending[stay]
            pos = (pos[stay] + step) & mask

    # ------------------------------------------------------------------ one key

    def find(self, pid: int, ptr: int) -> tuple[int, int]:
        """(row, slot) of one key, (-1, -1) when absent."""
        if self.count == 0:
            return -1, -1
        return self._probe(self._hash1(pid, ptr), pid, ptr)

    def _probe(self, pos: int, pid: int, key: int) -> tuple[int, int]:
        """(row, slot) of one key, probing from slot ``pos`` on; (-1, -1) when absent."""
        mask = (1 << self._bits) - 1
        slots = self._slots
        keys = getattr(self, self.KEY)
        while True:
            s = int(slots[pos])
            if s == EMPTY:
                return -1, -1
            if s >= 0 and int(keys[s]) == key and int(self.pid[s]) == pid:
                return s, pos
            pos = (pos + 1) & mask

    def add(self, pid: int, ptr: int, *values: int) -> None:
        """Add one absent key, values in :attr:`FIELDS` order (item by item: cheaper than numpy
        calls for one row)."""
        if self._nfree:
            self._nfree -= 1
            row = int(self._free[self._nfree])
        else:
            if self._top == len(self.live):
                self._grow(self._top + 1)
            row = self._top
            self._top += 1
        self._write(row, pid, ptr, *values)
        self.count += 1
        if self.count + self._tombs > _MAX_LOAD * len(self._slots):
            self._rehash()
            return
        self._claim(row, self._hash1(pid, ptr))

    def _claim(self, row: int, pos: int) -> None:
        """Put one row (its key not in the index) into the first free slot from ``pos`` on."""
        mask = (1 << self._bits) - 1
        slots = self._slots
        while slots[pos] >= 0:
            pos = (pos + 1) & mask
        if slots[pos] == TOMB:
            self._tombs -= 1
        slots[pos] = row

    def drop(self, row: int, slot: int) -> None:
        """Remove one key found by :meth:`find` (its slot emptied as :meth:`_untomb` would)."""
        slots, mask = self._slots, len(self._slots) - 1
        if slots[(slot + 1) & mask] == EMPTY:
            slots[slot] = EMPTY
            slot = (slot - 1) & mask
            while slots[slot] == TOMB:  # the next one is empty now
                slots[slot] = EMPTY
                self._tombs -= 1
                slot = (slot - 1) & mask
        else:
            slots[slot] = TOMB
            self._tombs += 1
        self.live[row] = False
        self.count -= 1
        if self._nfree == len(self._free):
            self._push_free(np.array([row]))
        else:
            self._free[self._nfree] = row
            self._nfree += 1

    def row(self, row: int) -> tuple[int, ...]:
        """The :attr:`FIELDS` of a row, as ints."""
        return tuple(int(getattr(self, name)[row]) for name in self.FIELDS)

    def set(self, pid: int, key: int, *values: int) -> None:
        """Add or replace the row of (pid, key) (a damaged keyframe may repeat a key: the last wins)."""
        row, slot = self.find(pid, key)
        if row >= 0:
            self.drop(row, slot)
        self.add(pid, key, *values)

    # ------------------------------------------------------------------ whole tables

    def rows_of(self, pid: int | None = None) -> np.ndarray:
        """Live rows (of one process), in row order."""
        live = self.live[: self._top]
        if pid is not None:
            live = live & (self.pid[: self._top] == pid)
        return np.flatnonzero(live)

    def drop_pid(self, pid: int) -> None:
        """Forget every allocation of ``pid``."""
        rows = self.rows_of(pid)
        if len(rows):
            found, where = self.lookup(self.pid[rows], getattr(self, self.KEY)[rows])
            self.remove(found, where)

    def sorted_rows(self, pid: int | None = None) -> np.ndarray:
        """Live rows (of one process) ordered by (pid, key): the canonical order of a snapshot."""
        rows = self.rows_of(pid)
        return rows[np.lexsort((getattr(self, self.KEY)[rows], self.pid[rows]))]

    def flat(self) -> list:
        """The live rows as one flat list ``[pid, key, *fields, ...]`` of ints, sorted by (pid, key)."""
        rows = self.sorted_rows()
        cols = [getattr(self, name)[rows].tolist() for name in self.names]
        return [v for row in zip(*cols) for v in row]

    def check(self) -> None:
        """Raise AssertionError unless every live row is found at its key and counts agree."""
        rows = self.rows_of()
        assert len(rows) == self.count, f"{len(rows)} live rows, count {self.count}"
        found, _ = self.lookup(self.pid[rows], getattr(self, self.KEY)[rows])
        assert np.array_equal(found, rows), "the index does not find every live row"
        used = np.count_nonzero(self._slots >= 0)
        assert used == self.count, f"{used} index slots for {self.count} rows"
        assert np.count_nonzero(self._slots == TOMB) == self._tombs, "removed-slot count is off"
        tombs = np.flatnonzero(self._slots == TOMB)
        assert not np.any(self._slots[(tombs + 1) % len(self._slots)] == EMPTY), "a removed slot before an empty one"

    @property
    def removed_slots(self) -> int:
        """Index slots of removed keys: counted as used until the index is rebuilt."""
        return self._tombs


class AllocTable(KeyTable):
    """Driver allocations: (pid, ptr) -> size, gpu, ts, api."""

    KEY = "ptr"
    FIELDS = {"size": np.int64, "gpu": np.int16, "ts": np.int64, "api": np.uint16}


class HandleTable(KeyTable):
    """VMM physical handles (created, or imported from a peer): (pid, handle) -> the
    ``HANDLE_FIELDS`` of a snapshot."""

    KEY = "handle"
    FIELDS = {"size": np.int64, "gpu": np.int16, "ts": np.int64, "category": np.int8, "refs": np.int64,
              "nmaps": np.int64, "exporter": np.int64, "api": np.uint16}


class MapTable(KeyTable):
    """VMM mappings: (pid, va) -> size, handle, offset, ts (``MAP_FIELDS``)."""

    KEY = "va"
    FIELDS = {"size": np.int64, "handle": np.uint64, "offset": np.uint64, "ts": np.int64}
