"""Where a pass over a trace's events comes from: a loaded trace's columns, or the file itself.

The report (and diff) read the events in passes, a chunk at a time, and keep only what they need
(the live state, the series' change points, the rows the sections keep): so a 100M-event trace
is reported in memory that does not follow its events (issue 26). :func:`scan_trace` is the
first pass over a file: everything but the events (markers, samples, keyframes, processes,
stacks, the trailer), the events' :class:`Census`, and where each events record begins, so that a
later pass can start at any event (:class:`FileSource`). A loaded trace's columns are a
:class:`ColumnSource`: the same passes over slices of memory (the TUI, ``memrec.load``, tests).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from memrec.base.errors import TraceFormatError
from memrec.engine.group import distinct
from memrec.engine.ipc import Export
from memrec.engine.ipc import ipc_exports
from memrec.state.batch import Batch
from memrec.terms.events import TENSOR_KINDS
from memrec.trace.chunks import EVENTS
from memrec.trace.model import GpuIds
from memrec.trace.model import Trace
from memrec.trace.reader import TraceReader
from memrec.trace.records import TraceBuilder

#: Events per chunk of a pass over loaded columns (the file's own records are its chunks).
CHUNK = 1 << 20
_TENSOR = np.array([int(k) for k in TENSOR_KINDS])


class Census:
    """What one pass learns about every event, before any section reads them: how many, their
    time span, whether they are in time order, the processes, which processes have tensor
    events (and the first of each), whether any names a stack, and the IPC exports (a later pass
    pairs an open with an export recorded after it: :class:`memrec.engine.ipc.IpcPairing`)."""

    def __init__(self) -> None:
        self.n = 0
        self.first_ts: int | None = None
        self.last_ts: int | None = None
        self.tensor_events = 0
        self.stacked = False
        self.ordered = True  # every event's ts at or after the one before it
        self._last: int | None = None
        self._pids: set[int] = set()
        self.tensor_since: dict[int, int] = {}  # pid -> the ts of its first tensor event
        self.ipc_exports: dict[bytes, list[Export]] = {}  # handle bytes -> its exports, in order

    def add(self, chunk: Batch) -> None:
        first = self.n
        self.n += len(chunk)
        if not len(chunk):
            return
        ts = chunk["ts"]
        lo, hi = int(ts.min()), int(ts.max())
        self.first_ts = lo if self.first_ts is None else min(self.first_ts, lo)
        self.last_ts = hi if self.last_ts is None else max(self.last_ts, hi)
        self.ordered = self.ordered and (self._last is None or int(ts[0]) >= self._last) and \
            bool((ts[1:] >= ts[:-1]).all())
        self._last = int(ts[-1])
        self._pids.update(distinct(chunk["pid"]))
        tensor = np.isin(chunk["kind"], _TENSOR)
        count = int(np.count_nonzero(tensor))
        if count:
            self.tensor_events += count
            pids = chunk["pid"][tensor]
            for pid in set(distinct(pids)).difference(self.tensor_since):  # a process's first: rare
                self.tensor_since[pid] = int(ts[tensor][np.argmax(pids == pid)])
        self.stacked = self.stacked or bool(np.asarray(chunk["stack"]).any())
        for blob, export in ipc_exports(chunk, first):
            self.ipc_exports.setdefault(blob, []).append(export)

    @property
    def pids(self) -> list[int]:
        """Every process an event names, ascending."""
        return sorted(self._pids)

    @property
    def tensor_pids(self) -> np.ndarray:
        """The processes with tensor events, ascending."""
        return np.array(sorted(self.tensor_since), dtype=np.int64)


@dataclass
class TraceEvents:
    """A trace's events as the report reads them: where a pass comes from, their census, and
    (once the report's replay has filled in their GPUs) every GPU the trace names."""

    source: EventSource
    census: Census
    gpu_ids: GpuIds | None = None

    @classmethod
    def of(cls, events: object) -> TraceEvents:
        """Events in memory (a loaded trace's columns): one pass for their census."""
        source = ColumnSource(events)
        return cls(source, source.census())


class EventSource:
    """The events of one trace, read again a chunk at a time from any event on."""

    n: int

    def chunks(self, start: int = 0, end: int | None = None) -> Iterator[tuple[int, Batch]]:
        """``(index of its first event, events)`` for the events from ``start`` to ``end``, in order."""
        raise NotImplementedError

    def census(self) -> Census:
        census = Census()
        for _, chunk in self.chunks():
            census.add(chunk)
        return census


class ColumnSource(EventSource):
    """A loaded trace's columns (or rows), a slice at a time: views, so the GPUs a replay fills in
    land in the caller's own columns."""

    def __init__(self, events: object) -> None:
        self.events = events if isinstance(events, np.ndarray) else Batch.of(events)
        self.n = len(self.events)

    def chunks(self, start: int = 0, end: int | None = None) -> Iterator[tuple[int, Batch]]:
        end = self.n if end is None else min(end, self.n)
        for lo in range(start, end, CHUNK):
            yield lo, self.events[lo : min(lo + CHUNK, end)]


class FileSource(EventSource):
    """A trace file's events, read again from the events record that holds ``start`` (its byte
    offset, from :func:`scan_trace`): each record's columns decoded, used and let go."""

    def __init__(self, path: str | os.PathLike, n: int, offsets: list[tuple[int, int]],
                 identity: tuple[int, int, int]) -> None:
        self.path = path
        self.n = n
        self._firsts = [first for first, _ in offsets]
        self._offsets = offsets
        self.identity = identity  # the scanned file's (TraceReader.identity): checked at each read

    def chunks(self, start: int = 0, end: int | None = None) -> Iterator[tuple[int, Batch]]:
        end = self.n if end is None else min(end, self.n)
        if start >= end or not self._offsets:
            return
        k = max(bisect.bisect_right(self._firsts, start) - 1, 0)
        lo, at = self._offsets[k]
        with TraceReader(self.path) as reader:
            check_same_file(reader, self.identity)
            for kind, item in reader.items(start=at):
                if kind != EVENTS:
                    continue
                chunk = writable(Batch.of(item))
                # each events record where and as long as the scan found it: a file rewritten in
                # place since then (same inode, other bytes) is caught here
                if k >= len(self._offsets) or reader.offset != self._offsets[k][1] or \
                        lo + len(chunk) != (self._firsts[k + 1] if k + 1 < len(self._firsts) else self.n):
                    raise TraceChanged(self.path)
                k += 1
                hi = min(lo + len(chunk), end)
                if hi > start:
                    yield max(lo, start), chunk[max(start - lo, 0) : hi - lo]
                lo += len(chunk)
                if lo >= end:
                    return
        raise TraceChanged(self.path)  # fewer events than the scan counted: cut since


class TraceChanged(TraceFormatError):
    """The trace file is not the one an earlier pass read (replaced, cut or rewritten since)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(f"{os.fspath(path)}: changed while it was read (replaced, cut or rewritten since the "
                         "first pass); read it again once it is whole")


def check_same_file(reader: TraceReader, identity: tuple[int, int, int]) -> None:
    """Raise :class:`TraceChanged` unless ``reader`` has the file ``identity`` was taken of: the
    same device and inode, at least as long (a trace still being written only grows)."""
    dev, ino, size = reader.identity()
    if (dev, ino) != identity[:2] or size < identity[2]:
        raise TraceChanged(reader.path)


def writable(chunk: Batch) -> Batch:
    """``chunk`` with a ``gpu`` column of its own that a replay can fill in (a decoded record's
    columns may be views of its bytes)."""
    gpu = chunk.columns["gpu"]
    if gpu.flags.writeable:
        return chunk
    return Batch(chunk.n, {**chunk.columns, "gpu": gpu.copy()}, chunk.ipc_index, chunk.ipc)


class _Scan(TraceBuilder):
    """A :class:`TraceBuilder` that keeps every record but the events: those are counted into a
    :class:`Census`, and where each record begins noted."""

    def __init__(self, reader: TraceReader) -> None:
        super().__init__(reader.header)
        self.reader = reader
        self.census = Census()
        self.offsets: list[tuple[int, int]] = []

    def on_events(self, chunk: object) -> None:
        self.offsets.append((self.census.n, self.reader.offset))
        self.census.add(Batch.of(chunk))


def scan_trace(path: str | os.PathLike, same_as: tuple[int, int, int] | None = None) -> tuple[Trace, TraceEvents]:
    """The first pass over a trace file: the :class:`Trace` without its events (``event_columns``
    empty), and its events as a :class:`FileSource` to read them again with their
    :class:`Census`. The reader's checks, budget and warnings are ``load_trace``'s (one reader).

    Raises:
        OSError: the file cannot be opened.
        TraceFormatError: not a memrec trace, or a newer major format version.
    """
    with TraceReader(path) as reader:
        identity = reader.identity()
        if same_as is not None:
            check_same_file(reader, same_as)
        scan = _Scan(reader)
        reader.feed(scan)  # a marker record goes to the scan as it is read
        trace = scan.finish(reader.warnings)
    return trace, TraceEvents(FileSource(path, scan.census.n, scan.offsets, identity), scan.census)
