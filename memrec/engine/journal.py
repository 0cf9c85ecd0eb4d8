"""The replay's journal as columns: one row per change of a (gpu, pid, category) total.

:class:`memrec.state.LiveState` built with ``journal=True`` appends one row per change
(``memrec.state.JOURNAL_FIELDS``), implicit frees at a process exit included. Every series, phase
attribution and window in the engine is numpy over these columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields

import numpy as np

from memrec.events import Kind
from memrec.state import JOURNAL_FIELDS
from memrec.state import LiveState


@dataclass
class Journal:
    """The state's journal as columns: one row per change of a (gpu, pid, category) total."""

    index: np.ndarray  # event index (into the replayed events) that caused the change
    ts: np.ndarray
    gpu: np.ndarray
    pid: np.ndarray
    category: np.ndarray  # index into memrec.events.CATEGORIES
    delta: np.ndarray  # signed bytes

    def __len__(self) -> int:
        return len(self.index)

    def take(self, mask: np.ndarray) -> Journal:
        """The rows where ``mask`` is true."""
        return Journal(*(getattr(self, f.name)[mask] for f in fields(self)))

    def exit_mask(self, events: np.ndarray) -> np.ndarray:
        """Rows a process exit caused (the implicit frees of what it still held)."""
        n = len(events)
        if not len(self) or not n:
            return np.zeros(len(self), dtype=bool)
        idx = np.clip(self.index, 0, n - 1)
        return (self.index >= 0) & (self.index < n) & (events["kind"][idx] == int(Kind.PROC_EXIT))


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


class JournalBuffer:
    """A replay's journal gathered chunk by chunk into one (fields × rows) array.

    ``take(state)`` moves what the state journaled since the last call in (one transposing copy
    per chunk into preallocated columns: the state's own journal stays short, and no concatenation
    at the end); :meth:`journal` gives the columns (contiguous views, no copy).
    """

    def __init__(self, capacity: int = 0) -> None:
        # np.empty does not touch its pages: capacity not used costs no memory
        self._buf = np.empty((len(JOURNAL_FIELDS), max(capacity, 1024)), dtype=np.int64)
        self.n = 0

    def take(self, state: LiveState) -> None:
        """Move ``state``'s journal rows in (the state goes on with an empty journal)."""
        rows = take_rows(state)
        m = len(rows)
        if not m:
            return
        if self.n + m > self._buf.shape[1]:
            grown = np.empty((len(JOURNAL_FIELDS), max(2 * self._buf.shape[1], self.n + m)), dtype=np.int64)
            grown[:, : self.n] = self._buf[:, : self.n]
            self._buf = grown
        self._buf[:, self.n : self.n + m] = rows.T
        self.n += m

    def journal(self) -> Journal:
        """The rows taken so far, as columns."""
        return Journal(*(self._buf[k, : self.n] for k in range(len(JOURNAL_FIELDS))))
