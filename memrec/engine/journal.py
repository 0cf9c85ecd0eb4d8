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

    @classmethod
    def from_rows(cls, raw: bytes | bytearray | memoryview) -> Journal:
        """Columns (contiguous, owned) from raw journal rows (``JOURNAL_FIELDS`` int64 each)."""
        flat = np.frombuffer(raw, dtype=np.int64) if len(raw) else np.zeros(0, np.int64)
        rows = flat.reshape(-1, len(JOURNAL_FIELDS))
        return cls(*(rows[:, k].copy() for k in range(len(JOURNAL_FIELDS))))

    @classmethod
    def from_state(cls, state: LiveState, consume: bool = False) -> Journal:
        """The journal of a state built with ``journal=True``; ``consume`` empties the state's own
        (a replay takes it chunk by chunk, so it is never held twice)."""
        if state.journal is None:
            raise ValueError("the state was built without journal=True")
        raw = state.journal
        if consume:
            state.journal = raw[:0]  # a new, empty journal of the same kind; `raw` goes with this call
        return cls.from_rows(raw)

    @classmethod
    def concat(cls, parts: list[Journal]) -> Journal:
        """One journal of ``parts`` in order (column by column: one column's copy at a time)."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls.empty()
        cols = []
        for f in fields(cls):
            cols.append(np.concatenate([getattr(p, f.name) for p in parts]))
            for p in parts:
                setattr(p, f.name, None)  # each part's column goes as soon as it is copied
        return cls(*cols)

    @classmethod
    def empty(cls) -> Journal:
        return cls(*(np.zeros(0, np.int64) for _ in range(len(JOURNAL_FIELDS))))

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
