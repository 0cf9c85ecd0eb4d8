"""One pass over a trace's events, a chunk at a time: the replay, and what reads the events after it.

``memrec report`` and ``memrec diff`` read a trace in this pass (:func:`replay_pass`): each chunk
of events (a record of the file, or a slice of loaded columns) goes to the live state's replay
(:class:`~memrec.engine.replay.Replay`, which fills in the chunk's GPUs), then to each reader
that needs the GPUs filled in (the tensor section's own replay, the allocation sites), then into the rows kept for the
sections that read events after the pass (:class:`KeptEvents`). Nothing else of a chunk
outlives it: the memory is the live state, the series' change points and the kept rows, not
the events (issue 26: 100M events in bounded memory).
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Iterator
from typing import Protocol
from typing import Sequence

import numpy as np

from memrec.engine.replay import Replay
from memrec.engine.source import ColumnSource
from memrec.engine.source import TraceEvents
from memrec.state.batch import Batch
from memrec.terms.columns import empty_events
from memrec.terms.events import TENSOR_KINDS
from memrec.trace.model import GpuIds

_TENSOR = np.array([int(k) for k in TENSOR_KINDS])


class ChunkReader(Protocol):
    """What reads each chunk of events after the replay has filled in its GPUs."""

    def add(self, first: int, events: Batch) -> None: ...


class KeptEvents:
    """The events the sections read after the pass, with their indexes: every one but the
    successful tensor blocks' (the failed calls, exits, contexts, pools and the driver's calls:
    what the reconciliation, the failed calls and the SGLang facts read; the tensor section and
    the allocation sites have their own readers in the pass). Events already in memory are used
    in place."""

    def __init__(self, events: TraceEvents) -> None:
        source = events.source
        self._whole = source.events if isinstance(source, ColumnSource) else None
        self._parts: list[Batch] = []
        self._index: list[np.ndarray] = []
        self.rows: Any = self._whole
        self.index: np.ndarray | None = None  # the events' indexes (None: every event, in order)

    def add(self, first: int, chunk: Batch) -> None:
        if self._whole is not None:
            return
        keep = np.flatnonzero((chunk["result"] != 0) | ~np.isin(chunk["kind"], _TENSOR))
        if len(keep):
            self._parts.append(chunk[keep])
            self._index.append(keep + first)

    def finish(self) -> None:
        if self._whole is not None:
            return
        self.rows = Batch.concat(self._parts) if self._parts else Batch.of(empty_events(0))
        self.index = np.concatenate(self._index) if self._index else np.zeros(0, np.int64)
        self._parts, self._index = [], []

    def at(self, index: int) -> int:
        """The position among :attr:`rows` of the event at ``index`` (one kept)."""
        return index if self.index is None else int(np.searchsorted(self.index, index))


def replayed(trace: Any, events: TraceEvents, replay: Replay,
             stops: Callable[[int, Batch], list[int]] | None = None) -> Iterator[tuple[int, Batch]]:
    """Feed every chunk of ``trace``'s ``events`` to ``replay`` (not finished here) and hand each
    on, ``(index of its first event, events)``, its GPUs filled in: what reads the events in the
    replay's own pass (:func:`replay_pass`'s readers, the exports' tables). Once every chunk is
    read, ``events.gpu_ids`` is set (the GPUs the trace names, as
    :meth:`memrec.trace.model.Trace.gpu_ids`, with the events' GPUs filled in).
    ``stops(first, chunk)``: the chunk's events (indexes into the trace) where the replay stops
    to look at the state (called before the replay fills in the chunk's GPUs)."""
    gpu_ids = GpuIds()
    gpu_ids.add_header(trace.header)
    for first, chunk in events.source.chunks():
        replay.feed(chunk, stops(first, chunk) if stops is not None else ())
        gpu_ids.add_column(chunk["gpu"])
        yield first, chunk
    gpu_ids.add_column(trace.nvml["gpu"])
    events.gpu_ids = gpu_ids


def replay_pass(trace: Any, events: TraceEvents, replay: Replay, readers: Sequence[ChunkReader] = (),
                stops: Callable[[int, Batch], list[int]] | None = None) -> KeptEvents:
    """:func:`replayed`, each chunk given to each of ``readers`` then to the rows kept; return
    the rows kept."""
    kept = KeptEvents(events)
    for first, chunk in replayed(trace, events, replay, stops):
        for reader in readers:
            reader.add(first, chunk)
        kept.add(first, chunk)
    kept.finish()
    return kept
