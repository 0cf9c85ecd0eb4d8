"""The TUI's event storage: event chunks in trace order, kept as they were read (zero-copy column
views of a mapped file, or arrays from a live stream), with a monotone envelope of their
timestamps to turn a time into a position (``seq``) and back.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np

from memrec.terms.columns import EVENT_DTYPE
from memrec.trace.chunks import SPARSE_COLUMN
from memrec.state.batch import Batch


@dataclass
class EventRows:
    """Events around a cursor: ``rows`` (EVENT_DTYPE), their seqs and phases; ``center`` is the
    row index of the last event at or before the cursor (-1 if none)."""

    rows: np.ndarray
    seqs: np.ndarray
    phases: list[str]
    center: int
    scanned_all: bool = True


class EventStore:
    """Event chunks in trace order, each an EVENT_DTYPE array or a lazily converted column chunk."""

    def __init__(self, cache_chunks: int = 16) -> None:
        self._chunks: list[Any] = []
        self._starts: list[int] = []  # seq of each chunk's first event
        self.base = 0  # seq of the first event still held
        self.n = 0  # events seen (seq of the next)
        self._env: list[np.ndarray] = []  # per chunk: monotone envelope of ts (a view when sorted)
        self._firsts: list[int] = []  # per chunk: env[0]
        self._cache: dict[int, np.ndarray] = {}
        self._cache_max = cache_chunks

    def __len__(self) -> int:
        return self.n - self.base

    def append(self, chunk: Any) -> int:
        """Add a chunk (EVENT_DTYPE array or an object with ``.n``, ``.columns`` and ``.to_array()``)."""
        n = len(chunk) if isinstance(chunk, np.ndarray) else chunk.n
        if n == 0:
            return self.n
        ts = chunk["ts"] if isinstance(chunk, np.ndarray) else chunk.columns["ts"]
        ts = ts.astype(np.uint64, copy=False)
        prev = int(self._env[-1][-1]) if self._env else 0
        if int(ts[0]) >= prev and (n < 2 or bool((ts[1:] >= ts[:-1]).all())):
            env = ts  # sorted (the usual case): the column itself, no copy
        else:
            env = np.maximum(np.maximum.accumulate(ts), np.uint64(prev))
        start = self.n
        self._chunks.append(chunk)
        self._starts.append(start)
        self._env.append(env)
        self._firsts.append(int(env[0]))
        self.n += n
        return start

    def first_ts(self) -> int | None:
        return self._firsts[0] if self._firsts else None

    def last_ts(self) -> int | None:
        return int(self._env[-1][-1]) if self._env else None

    def seq_at(self, ts: int) -> int:
        """The seq of the last event with ts <= ``ts`` (base - 1 if none)."""
        k = bisect.bisect_right(self._firsts, ts) - 1
        if k < 0:
            return self.base - 1
        i = int(np.searchsorted(self._env[k], np.uint64(max(ts, 0)), side="right")) - 1
        return self._starts[k] + i

    def ts_of(self, seq: int) -> int:
        if not self._env:
            return 0
        seq = min(max(seq, self.base), self.n - 1)
        k = bisect.bisect_right(self._starts, seq) - 1
        return int(self._env[k][seq - self._starts[k]])

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(chunk index, start, stop) covering seq [lo, hi): cheap; take it under the model's lock."""
        lo = max(lo, self.base)
        hi = min(hi, self.n)
        out = []
        if hi <= lo:
            return out
        k = bisect.bisect_right(self._starts, lo) - 1
        while k < len(self._chunks) and self._starts[k] < hi:
            s = self._starts[k]
            out.append((self._chunks[k], s, max(lo - s, 0), hi - s))
            k += 1
        return out

    def materialize(self, pieces: list) -> np.ndarray:
        """The events of :meth:`pieces` as one array (the slow part: no lock needed, chunks never change)."""
        if not pieces:
            return np.zeros(0, dtype=EVENT_DTYPE)
        parts = [self._array_of(c, s)[a:b] if isinstance(c, np.ndarray) or s in self._cache or 4 * (b - a) > c.n
                 else _rows(c, a, b) for c, s, a, b in pieces]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def batch(self, pieces: list) -> Batch:
        """The events of :meth:`pieces` as columns for ``LiveState.apply`` (no 130-byte rows
        built), with a ``gpu`` column of their own for the replay to fill in."""
        if not pieces:
            return Batch.of(np.zeros(0, dtype=EVENT_DTYPE))
        out = Batch.concat([Batch.of(c)[a:b] for c, _, a, b in pieces])
        out.columns["gpu"] = out.columns["gpu"].copy()
        return out

    def _array_of(self, c: Any, start: int) -> np.ndarray:
        if isinstance(c, np.ndarray):
            return c
        arr = self._cache.get(start)
        if arr is None:
            arr = c.to_array()
            if len(self._cache) >= self._cache_max:
                self._cache.pop(next(iter(self._cache)), None)
            self._cache[start] = arr
        return arr

    def slice(self, lo: int, hi: int) -> np.ndarray:
        """Events with seq in [lo, hi) as one EVENT_DTYPE array (a view when inside one chunk)."""
        return self.materialize(self.pieces(lo, hi))

    def column(self, name: str, lo: int, hi: int) -> np.ndarray:
        """One column for seq in [lo, hi), read from column views without converting chunks."""
        lo = max(lo, self.base)
        hi = min(hi, self.n)
        if hi <= lo:
            return np.zeros(0, dtype=EVENT_DTYPE[name])
        k = bisect.bisect_right(self._starts, lo) - 1
        parts = []
        while k < len(self._chunks) and self._starts[k] < hi:
            c = self._chunks[k]
            col = c[name] if isinstance(c, np.ndarray) else c.columns.get(name)
            s = self._starts[k]
            n = len(c) if isinstance(c, np.ndarray) else c.n
            if col is None:
                col = self._array_of(c, s)[name]
            parts.append(col[max(lo - s, 0) : min(hi - s, n)])
            k += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def drop_before(self, seq: int) -> None:
        """Forget whole chunks that end at or before ``seq``."""
        k = 0
        while k + 1 < len(self._chunks) and self._starts[k + 1] <= seq:
            k += 1
        if k == 0:
            return
        new_base = self._starts[k]
        for st in self._starts[:k]:
            self._cache.pop(st, None)
        del self._chunks[:k]
        del self._starts[:k]
        del self._env[:k]
        del self._firsts[:k]
        self.base = new_base


def _rows(chunk: Any, a: int, b: int) -> np.ndarray:
    """Rows [a, b) of a column chunk, built from its columns without converting (and caching) the
    whole chunk: the events around the cursor are a few thousand rows of a 65,536-row chunk, and
    the first frame waited for the whole chunk's 130-byte rows."""
    b = min(b, chunk.n)  # a piece may run past its chunk (slicing clips it)
    out = np.zeros(b - a, dtype=EVENT_DTYPE)
    for name in EVENT_DTYPE.names:
        if name != SPARSE_COLUMN:
            out[name] = chunk.column(name)[a:b]
    if chunk.ipc_index is not None and len(chunk.ipc_index):
        at = chunk.ipc_index.astype(np.intp)
        inside = (at >= a) & (at < b)
        out[SPARSE_COLUMN][at[inside] - a] = chunk.ipc[inside]
    return out
