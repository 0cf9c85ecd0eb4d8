"""The replay's journal as columns: one row per change of a (gpu, pid, category) total.

:class:`memrec.state.LiveState` built with ``journal=True`` appends one row per change
(``memrec.state.JOURNAL_FIELDS``), implicit frees at a process exit included. Every series, phase
attribution and window in the engine is numpy over these columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields
from typing import Any

import numpy as np

from memrec.terms.events import Kind
from memrec.state import JOURNAL_FIELDS
from memrec.state import LiveState


#: Journal rows per step of :meth:`Journal.exit_mask`.
MASK_CHUNK = 1 << 20


@dataclass
class Journal:
    """The state's journal as columns: one row per change of a (gpu, pid, category) total."""

    index: np.ndarray  # event index (into the replayed events) that caused the change
    ts: np.ndarray
    gpu: np.ndarray
    pid: np.ndarray
    category: np.ndarray  # index into memrec.terms.events.CATEGORIES
    delta: np.ndarray  # signed bytes

    def __len__(self) -> int:
        return len(self.index)

    @classmethod
    def concat(cls, parts: list[Journal]) -> Journal:
        """The rows of ``parts`` in order, as columns of their own (no part is a view of them)."""
        if not parts:
            return cls(*(np.zeros(0, t) for t in COLUMN_TYPES))
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)))

    def take(self, mask: np.ndarray) -> Journal:
        """The rows where ``mask`` is true."""
        return Journal(*(getattr(self, f.name)[mask] for f in fields(self)))

    def exit_mask(self, exits: np.ndarray) -> np.ndarray:
        """Rows a process exit caused (the implicit frees of what it still held).

        ``exits``: the indexes of the replayed events that are exits (``PROC_EXIT``), ascending
        (:func:`exit_indexes`; a replay from a file gathers them a chunk at a time). A million
        rows at a time: no index-sized temporaries over the whole journal.
        """
        out = np.zeros(len(self), dtype=bool)
        if not len(self) or not len(exits):
            return out
        last = len(exits) - 1
        for lo in range(0, len(self), MASK_CHUNK):
            idx = self.index[lo : lo + MASK_CHUNK]
            out[lo : lo + MASK_CHUNK] = exits[np.minimum(np.searchsorted(exits, idx), last)] == idx
        return out


def exit_indexes(events: Any, first: int = 0) -> np.ndarray:
    """The indexes of the exits (``PROC_EXIT``) among ``events`` (rows or columns: only ``kind``
    is read), ascending, counted from ``first`` (the index of ``events``' first event)."""
    return np.flatnonzero(events["kind"] == int(Kind.PROC_EXIT)).astype(np.int64) + first


def take_rows(state: LiveState) -> np.ndarray:
    """The rows ``state`` journaled so far, (rows × ``JOURNAL_FIELDS``) int64, moved out of it (the
    state goes on with an empty journal of the same kind): how every replay reads the journal."""
    raw = state.journal
    if raw is None:
        raise ValueError("the state was built without journal=True")
    state.journal = raw[:0]
    if not len(raw):
        return np.zeros((0, len(JOURNAL_FIELDS)), dtype=np.int64)
    return np.frombuffer(raw, dtype=np.int64).reshape(-1, len(JOURNAL_FIELDS))


#: The journal's column types: a GPU index is an int16 and a category one of four (13 bytes a row
#: less than six int64s: 130 MB on a 10M-event replay).
COLUMN_TYPES = (np.int64, np.int64, np.int16, np.int64, np.int8, np.int64)


class JournalBuffer:
    """A replay's journal gathered into preallocated typed columns (``COLUMN_TYPES``).

    Set as a state's ``journal_sink``, it receives the changes of every batch applied at once
    straight as columns (no rows built and transposed); ``take(state)`` moves in what the state
    journaled row by row (before each batch's columns, so the order is the events' order).
    :meth:`journal` gives the columns (views, no copy).
    """

    def __init__(self, capacity: int = 0) -> None:
        # np.empty does not touch its pages: capacity not used costs no memory
        cap = max(capacity, 1024)
        self._cols = [np.empty(cap, dtype=t) for t in COLUMN_TYPES]
        self.n = 0

    def take(self, state: LiveState) -> None:
        """Move ``state``'s journal rows in (the state goes on with an empty journal)."""
        rows = take_rows(state)
        if len(rows):
            self.add(*rows.T)

    def add(self, *columns: np.ndarray) -> None:
        """Append rows given as columns (``JOURNAL_FIELDS`` order)."""
        m = len(columns[0])
        if not m:
            return
        if self.n + m > len(self._cols[0]):
            cap = max(2 * len(self._cols[0]), self.n + m)
            grown = [np.empty(cap, dtype=t) for t in COLUMN_TYPES]
            for new, old in zip(grown, self._cols):
                new[: self.n] = old[: self.n]
            self._cols = grown
        for col, values in zip(self._cols, columns):
            col[self.n : self.n + m] = values
        self.n += m

    def journal(self, since: int = 0) -> Journal:
        """The rows taken so far (from row ``since`` on), as columns."""
        return Journal(*(c[since : self.n] for c in self._cols))

    def clear(self) -> None:
        """Let the rows go (the buffer is reused for the next ones)."""
        self.n = 0
