"""Events column by column, as :meth:`memrec.state.LiveState.apply` and the replay read them.

A loaded trace holds its events as contiguous columns (``memrec.trace.model.EventColumns``); the
daemon and the tests hand over ``EVENT_DTYPE`` rows. :class:`Batch` is one view over either, with
no copy: a 10M-event replay from columns never builds the 130-byte rows (1.3 GB, seconds to fill),
and the GPU the replay fills in lands in the caller's own ``gpu`` column (the rows' field, or the
trace's column). The 64-byte ``ipc`` field is kept sparse: the few events that carry handle bytes.
"""

from __future__ import annotations

from typing import Any
from typing import Iterator

import numpy as np

from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import FLAG_NAME
from memrec.state.fields import REQUIRED_COLUMNS

_IPC = EVENT_DTYPE["ipc"]
_NO_IPC = bytes(_IPC.itemsize)
#: Rows up to which :meth:`Batch.of` copies the columns it reads out of EVENT_DTYPE rows.
_COPY_ROWS = 1 << 20
_COPIED = frozenset(REQUIRED_COLUMNS) - {"gpu", "ipc"}


class Batch:
    """Events as a dict of columns plus sparse ``ipc`` bytes; indexing by a column name gives
    the column, by a slice, an index array or a mask gives the Batch of those events, by an int
    that event's fields (a dict)."""

    __slots__ = ("n", "columns", "ipc_index", "ipc", "_ipc_list")

    def __init__(self, n: int, columns: dict[str, np.ndarray], ipc_index: np.ndarray, ipc: np.ndarray) -> None:
        self.n = n
        self.columns = columns
        self.ipc_index = ipc_index  # ascending positions of the events with ipc bytes
        self.ipc = ipc  # their bytes (V64), one per ipc_index
        self._ipc_list: list[bytes] | None = None  # the same as bytes objects, made on the first read

    @classmethod
    def of(cls, events: Any) -> Batch:
        """A Batch over ``events``: EVENT_DTYPE rows, an ``EventColumns`` (anything with
        ``columns``, ``ipc_index`` and ``ipc``), a dict of columns (a dense ``ipc`` optional), or
        a Batch (itself). Columns are read in place, but for rows of up to ``_COPY_ROWS``
        events, whose read-only columns are copied contiguous (see below); ``gpu`` never is.

        Raises:
            TypeError: a required column is missing.
        """
        if isinstance(events, Batch):
            return events
        if isinstance(events, np.ndarray):
            names = events.dtype.names or ()
            # A daemon's batch: the columns the state reads, copied contiguous once (each of the
            # many passes over a view would read 130-byte strides), but ``gpu``, which the
            # fill-in writes into the caller's rows; a huge array keeps views (no second copy).
            copy = len(events) <= _COPY_ROWS
            cols = {n: np.ascontiguousarray(events[n]) if copy and n in _COPIED else events[n]
                    for n in names if n != "ipc"}
            dense = events["ipc"] if "ipc" in names else None
        elif hasattr(events, "ipc_index"):  # EventColumns, or a trace file's ColumnChunk
            index = events.ipc_index
            if index is None:
                index, ipc = np.zeros(0, np.int64), np.zeros(0, _IPC)
            else:
                index, ipc = index.astype(np.int64, copy=False), events.ipc
            if hasattr(events, "column"):  # a chunk: a column the file left out reads as its default
                cols = {name: events.column(name) for name in EVENT_DTYPE.names if name != "ipc"}
            else:
                cols = dict(events.columns)
            return cls._checked(events.n, cols, index, ipc)
        else:
            cols = {n: c for n, c in dict(events).items() if n != "ipc"}
            dense = events.get("ipc")
        n = len(next(iter(cols.values()))) if cols else 0
        if dense is None:
            return cls._checked(n, cols, np.zeros(0, np.int64), np.zeros(0, _IPC))
        flags = cols.get("flags")
        has = np.flatnonzero(flags & (FLAG_IPC_BYTES | FLAG_NAME)) if flags is not None else np.zeros(0, np.int64)
        return cls._checked(n, cols, has, dense[has])

    @classmethod
    def _checked(cls, n: int, cols: dict, ipc_index: np.ndarray, ipc: np.ndarray) -> Batch:
        missing = [c for c in REQUIRED_COLUMNS if c != "ipc" and c not in cols]
        if missing:
            raise TypeError(f"events lack the columns {missing}: expected EVENT_DTYPE")
        return cls(n, cols, ipc_index, ipc)

    @classmethod
    def concat(cls, batches: list[Batch]) -> Batch:
        """One Batch of ``batches`` in order (columns copied; one Batch is returned as it is)."""
        if len(batches) == 1:
            return batches[0]
        starts = np.cumsum([0] + [b.n for b in batches[:-1]])
        return cls(
            sum(b.n for b in batches),
            {k: np.concatenate([b.columns[k] for b in batches]) for k in batches[0].columns},
            np.concatenate([b.ipc_index + s for b, s in zip(batches, starts.tolist())]),
            np.concatenate([b.ipc for b in batches]),
        )

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[dict]:
        """Each event's fields (a dict), in order."""
        return (self[i] for i in range(self.n))

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            if key == "ipc":  # full rows of bytes: for the subsets that read them
                out = np.zeros(self.n, dtype=_IPC)
                out[self.ipc_index] = self.ipc
                return out
            return self.columns[key]
        if isinstance(key, (int, np.integer)):  # one event, as a dict of its fields
            i = int(key) + self.n if key < 0 else int(key)
            return {**{k: c[i] for k, c in self.columns.items()}, "ipc": self.ipc_bytes(i)}
        if isinstance(key, slice):
            lo, hi, step = key.indices(self.n)
            if step != 1:
                return self[np.arange(lo, hi, step)]
            a, b = np.searchsorted(self.ipc_index, [lo, hi])
            return Batch(max(hi - lo, 0), {k: c[lo:hi] for k, c in self.columns.items()},
                         self.ipc_index[a:b] - lo, self.ipc[a:b])
        idx = np.asarray(key)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        cols = {k: c[idx] for k, c in self.columns.items()}
        if not len(self.ipc_index):
            return Batch(len(idx), cols, self.ipc_index, self.ipc)
        pos = np.searchsorted(self.ipc_index, idx)
        pos = np.minimum(pos, len(self.ipc_index) - 1)
        hit = self.ipc_index[pos] == idx
        return Batch(len(idx), cols, np.flatnonzero(hit), self.ipc[pos[hit]])

    @property
    def dtype(self) -> np.dtype:
        """EVENT_DTYPE: a Batch reads as the rows it stands for."""
        return EVENT_DTYPE

    @property
    def writeable(self) -> bool:
        """Whether the replay may fill in the ``gpu`` column."""
        return bool(self.columns["gpu"].flags.writeable)

    def ipc_bytes(self, i: int) -> bytes:
        """Event ``i``'s 64 ipc bytes (zeros when it has none)."""
        j = int(np.searchsorted(self.ipc_index, i))
        if j < len(self.ipc_index) and int(self.ipc_index[j]) == i:
            return self._ipc_bytes()[j]
        return _NO_IPC

    def _ipc_bytes(self) -> list[bytes]:
        """:attr:`ipc` as bytes objects, cut out of one copy once: the planner and the
        event-by-event path both read an export's or open's bytes, and a ``tobytes`` per value
        costs several times a slice."""
        if self._ipc_list is None:
            raw, width = self.ipc.tobytes(), _IPC.itemsize
            self._ipc_list = [raw[k : k + width] for k in range(0, len(raw), width)]
        return self._ipc_list

    def ipc_bytes_at(self, at: np.ndarray, flagged: np.ndarray) -> list[bytes | None]:
        """:meth:`ipc_bytes` of the events ``at`` that are ``flagged`` (None for the others),
        with one search."""
        index = self.ipc_index
        j = np.minimum(np.searchsorted(index, at), max(len(index) - 1, 0))
        hit = (index[j] == at) if len(index) else np.zeros(len(at), bool)
        # Each event's value picked by number out of the values, zeros and None (no Python step each).
        values = self._ipc_bytes() if hit.any() else []
        pick = np.where(flagged, np.where(hit, j, len(values)), len(values) + 1)
        return list(map([*values, _NO_IPC, None].__getitem__, pick.tolist()))
