"""One path for every record a reader meets: one check, one dispatch, one sink protocol.

A trace file (:class:`memrec.trace.reader.TraceReader`), a whole-trace load
(:func:`memrec.trace.reader.load_trace`), the TUI's model (file or live) and the daemon's live
stream all take records the same way:

1. :func:`check_record` turns one record as msgpack gave it (wire form, format 1 or 2) into a
   checked item — a :class:`~memrec.trace.format.ColumnChunk`, a Marker, a ProcessInfo, a
   Keyframe, a lost total — or raises :class:`~memrec._errors.TraceFormatError`;
2. :func:`deliver` hands the item to a :class:`RecordSink`, the one protocol every consumer
   implements (:class:`TraceBuilder` here, ``TraceModel`` in the TUI).

So a damaged record gets the same verdict wherever it is read: skipped and reported, never raised
into a consumer.
"""

from __future__ import annotations

from typing import Any
from typing import Protocol

import numpy as np

from memrec._errors import TraceFormatError
from memrec.columns import EVENT_DTYPE
from memrec.events import Marker
from memrec.events import ProcessInfo
from memrec.trace.format import COLUMNAR
from memrec.trace.format import EVENTS
from memrec.trace.format import HEADER
from memrec.trace.format import KEYFRAME
from memrec.trace.format import LOST
from memrec.trace.format import MARKER
from memrec.trace.format import NVML
from memrec.trace.format import PROCESS
from memrec.trace.format import PROCMEM
from memrec.trace.format import SPARSE_COLUMN
from memrec.trace.format import TRAILER
from memrec.trace.format import ColumnChunk
from memrec.trace.format import Schema
from memrec.trace.format import check_keyframe
from memrec.trace.format import decode_columns
from memrec.trace.format import marker_from_record
from memrec.trace.format import process_from_record
from memrec.trace.model import EventColumns
from memrec.trace.model import Keyframe
from memrec.trace.model import Trace


class RecordSink(Protocol):
    """What takes the records of a trace, in file (or stream) order, each already checked."""

    def on_header(self, header: dict) -> None:
        """The header (a live stream starts with one; a file's comes from its reader)."""

    def on_events(self, chunk: ColumnChunk) -> None:
        """One events chunk, decoded into columns."""

    def on_nvml(self, chunk: ColumnChunk) -> None:
        """One chunk of NVML device samples."""

    def on_procmem(self, chunk: ColumnChunk) -> None:
        """One chunk of NVML per-process samples."""

    def on_marker(self, marker: Marker) -> None:
        """A phase marker."""

    def on_process(self, process: ProcessInfo) -> None:
        """What is known about a process (a later one for the same pid replaces it)."""

    def on_keyframe(self, keyframe: Keyframe) -> None:
        """A keyframe (the state itself is checked when the consumer restores it)."""

    def on_lost(self, total: int) -> None:
        """The cumulative count of events lost so far."""

    def on_trailer(self, trailer: dict) -> None:
        """The trailer: the recording ended cleanly."""


def check_record(obj: dict, schema: Schema | None = None) -> tuple[str, Any]:
    """The ``(type, item)`` of one record in wire form; the one check every reader applies.

    Items: :class:`ColumnChunk` for events / nvml / procmem, :class:`Marker`,
    :class:`ProcessInfo`, :class:`Keyframe`, the cumulative total (int) for lost, the record
    itself for the header, the trailer and any other type.

    Raises:
        TraceFormatError: the record is malformed.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise TraceFormatError("malformed record: not a map with a string 'type'")
    kind = obj["type"]
    if kind in COLUMNAR:
        return kind, decode_columns(obj, schema)
    if kind == MARKER:
        return kind, marker_from_record(obj)
    if kind == PROCESS:
        return kind, process_from_record(obj)
    if kind == KEYFRAME:
        return kind, Keyframe(*check_keyframe(obj))
    if kind == LOST:
        total = obj.get("total")
        if not isinstance(total, int) or isinstance(total, bool) or not 0 <= total < 2**63:
            raise TraceFormatError("malformed lost record: needs an int total")
        return kind, total
    return kind, obj


def deliver(kind: str, item: Any, sink: RecordSink) -> None:
    """Hand one checked item (from :func:`check_record`) to ``sink``; other types are ignored."""
    if kind == EVENTS:
        sink.on_events(item)
    elif kind == NVML:
        sink.on_nvml(item)
    elif kind == PROCMEM:
        sink.on_procmem(item)
    elif kind == MARKER:
        sink.on_marker(item)
    elif kind == PROCESS:
        sink.on_process(item)
    elif kind == KEYFRAME:
        sink.on_keyframe(item)
    elif kind == LOST:
        sink.on_lost(item)
    elif kind == TRAILER:
        sink.on_trailer(item)
    elif kind == HEADER:
        sink.on_header(item)


class TraceBuilder:
    """A :class:`RecordSink` that builds a :class:`Trace` (``load_trace``, a live session saved).

    Event chunks are kept as their decoded columns and joined once, column by column, at
    :meth:`finish` (each chunk's column is released as it is copied, so the peak is the trace's
    columns plus one column of chunks); the EVENT_DTYPE rows are built only when
    ``Trace.events`` is first used.
    """

    def __init__(self, header: dict | None = None) -> None:
        self.trace = Trace(header=header or {})
        self._chunks: dict[str, list[ColumnChunk]] = {EVENTS: [], NVML: [], PROCMEM: []}
        self._lost = 0

    def on_header(self, header: dict) -> None:
        self.trace.header = header

    def on_events(self, chunk: ColumnChunk) -> None:
        self._chunks[EVENTS].append(chunk)

    def on_nvml(self, chunk: ColumnChunk) -> None:
        self._chunks[NVML].append(chunk)

    def on_procmem(self, chunk: ColumnChunk) -> None:
        self._chunks[PROCMEM].append(chunk)

    def on_marker(self, marker: Marker) -> None:
        self.trace.markers.append(marker)

    def on_process(self, process: ProcessInfo) -> None:
        self.trace.processes[process.pid] = process

    def on_keyframe(self, keyframe: Keyframe) -> None:
        self.trace.keyframes.append(keyframe)

    def on_lost(self, total: int) -> None:
        self._lost = total

    def on_trailer(self, trailer: dict) -> None:
        self.trace.trailer = trailer

    def finish(self, warnings: list[str] = ()) -> Trace:  # type: ignore[assignment]
        """The trace: events, NVML and procmem joined in file order; ``lost`` the last total."""
        trace = self.trace
        trace.event_columns = join_events(self._chunks[EVENTS])
        trace.nvml = _concat(NVML, self._chunks[NVML])
        trace.procmem = _concat(PROCMEM, self._chunks[PROCMEM])
        self._chunks = {EVENTS: [], NVML: [], PROCMEM: []}
        trailer_lost = (trace.trailer or {}).get("lost")
        trace.lost = max(self._lost, trailer_lost) if isinstance(trailer_lost, int) else self._lost
        trace.warnings = list(warnings)
        return trace


def join_events(chunks: list[ColumnChunk]) -> EventColumns:
    """Every chunk's events as one set of contiguous columns (each chunk's column released as
    it is copied: the peak is the result plus one column of chunks)."""
    n = sum(c.n for c in chunks)
    columns = {}
    for name in EVENT_DTYPE.names:
        if name == SPARSE_COLUMN:
            continue
        out = np.empty(n, dtype=EVENT_DTYPE[name])
        start = 0
        for c in chunks:
            out[start : start + c.n] = c.column(name)
            c.columns.pop(name, None)
            start += c.n
        columns[name] = out
    starts = np.cumsum([0] + [c.n for c in chunks[:-1]]) if chunks else []
    index = [c.ipc_index.astype(np.int64) + s for c, s in zip(chunks, starts) if c.ipc_index is not None]
    ipc = [c.ipc for c in chunks if c.ipc_index is not None]
    return EventColumns(
        n,
        columns,
        np.concatenate(index) if index else np.zeros(0, np.int64),
        np.concatenate(ipc) if ipc else np.zeros(0, EVENT_DTYPE[SPARSE_COLUMN]),
    )


def _concat(kind: str, chunks: list[ColumnChunk]) -> np.ndarray:
    """One structured array of every chunk's rows (NVML and procmem: small)."""
    out = np.zeros(sum(c.n for c in chunks), dtype=COLUMNAR[kind])
    start = 0
    for chunk in chunks:
        chunk.fill(out, start)
        start += chunk.n
    return out
