"""One path for every record a reader meets: one check, one dispatch, one sink protocol.

A trace file (:class:`memrec.trace.reader.TraceReader`), a whole-trace load
(:func:`memrec.trace.reader.load_trace`), the TUI's model (file or live) and the daemon's live
stream all take records the same way:

1. :func:`check_record` turns one record as msgpack gave it (wire form, format 1 or 2) into a
   checked item — a :class:`~memrec.trace.format.ColumnChunk`, a Marker, a ProcessInfo, a
   Keyframe, a lost total — or raises :class:`~memrec.base.errors.TraceFormatError`;
2. :func:`deliver` hands the item to a :class:`RecordSink`, the one protocol every consumer
   implements (:class:`TraceBuilder` here, ``TraceModel`` in the TUI).

So a damaged record gets the same verdict wherever it is read: skipped and reported, never raised
into a consumer.
"""

from __future__ import annotations

from typing import Any
from typing import Protocol

import numpy as np

from memrec.base.errors import TraceFormatError
from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace.budget import ReadBudget
from memrec.trace.chunks import COLUMNAR
from memrec.trace.chunks import COLUMNAR_TYPE
from memrec.trace.chunks import EVENTS
from memrec.trace.chunks import NVML
from memrec.trace.chunks import PROCMEM
from memrec.trace.chunks import SPARSE_COLUMN
from memrec.trace.chunks import ColumnChunk
from memrec.trace.chunks import Schema
from memrec.trace.chunks import decode_columns
from memrec.trace.format import HEADER
from memrec.trace.format import KEYFRAME
from memrec.trace.format import LOST
from memrec.trace.format import MARKER
from memrec.trace.format import PROCESS
from memrec.trace.format import TRAILER
from memrec.trace.format import check_keyframe
from memrec.trace.format import marker_from_record
from memrec.trace.format import process_from_record
from memrec.trace.model import EventColumns
from memrec.trace.model import Keyframe
from memrec.trace.model import Trace
from memrec.trace.stacks import STACKS
from memrec.trace.stacks import StackDefs
from memrec.trace.stacks import check_stacks_record


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

    def on_stacks(self, defs: StackDefs) -> None:
        """Stack definitions (format 2.3), before the events that name them; the consumer adds them
        to its :class:`~memrec.trace.stacks.StackTable`, which refuses ids it does not hold."""

    def on_trailer(self, trailer: dict) -> None:
        """The trailer: the recording ended cleanly."""


def check_record(obj: dict, schema: Schema | None = None, budget: ReadBudget | None = None) -> tuple[str, Any]:
    """The ``(type, item)`` of one record in wire form; the one check every reader applies.

    Items: :class:`ColumnChunk` for events / nvml / procmem, :class:`Marker`,
    :class:`ProcessInfo`, :class:`Keyframe`, the cumulative total (int) for lost,
    :class:`~memrec.trace.stacks.StackDefs` for stacks, the record
    itself for the header, the trailer and any other type. ``budget``: the read's, charged
    what the record decompresses to (:mod:`memrec.trace.budget`).

    Raises:
        OverBudget: past ``budget``.
        TraceFormatError: the record is malformed.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise TraceFormatError("malformed record: not a map with a string 'type'")
    kind = obj["type"]
    if kind in COLUMNAR_TYPE:
        chunk = _checked_ts(decode_columns(obj, schema, budget))
        return chunk.kind, chunk
    if kind == MARKER:
        return kind, marker_from_record(obj)
    if kind == PROCESS:
        return kind, process_from_record(obj)
    if kind == KEYFRAME:
        return kind, Keyframe(*check_keyframe(obj, budget))
    if kind == LOST:
        total = obj.get("total")
        if not isinstance(total, int) or isinstance(total, bool) or not 0 <= total < 2**63:
            raise TraceFormatError("malformed lost record: needs an int total")
        return kind, total
    if kind == STACKS:
        return kind, check_stacks_record(obj, budget)
    return kind, obj


def _checked_ts(chunk: ColumnChunk) -> ColumnChunk:
    """``chunk``, unless a ts lies at or past 2^63: CLOCK_MONOTONIC never gets there (292 years of
    uptime), and the analysis holds times as int64 (a failed call at 2^63 made ``report`` exit 70
    with an OverflowError). Such a record is damaged, skipped with the others (issue 23, item 6)."""
    ts = chunk.columns.get("ts")
    if ts is not None and len(ts) and int(ts.astype(np.int64, copy=False).min()) < 0:  # (u8 past 2^63: < 0)
        raise TraceFormatError(f"malformed {chunk.kind} record: a ts at or past 2^63 ns")
    return chunk


#: The RecordSink method each record type goes to.
_METHODS = {
    HEADER: "on_header", EVENTS: "on_events", NVML: "on_nvml", PROCMEM: "on_procmem", MARKER: "on_marker",
    PROCESS: "on_process", KEYFRAME: "on_keyframe", LOST: "on_lost", STACKS: "on_stacks", TRAILER: "on_trailer",
}


def deliver(kind: str, item: Any, sink: RecordSink) -> None:
    """Hand one checked item (from :func:`check_record`) to ``sink``; other types are ignored."""
    method = _METHODS.get(kind)
    if method is not None:
        getattr(sink, method)(item)


class TraceBuilder:
    """A :class:`RecordSink` that builds a :class:`Trace` (``load_trace``, a live session saved).

    Each events chunk is copied into the trace's columns as it comes and then dropped, so the
    peak is the trace's columns plus one chunk. ``expected_events`` (the trailer's count, when the
    caller knows it) sizes the columns at once; without it, or past it, they double as needed.
    The EVENT_DTYPE rows are built only when ``Trace.events`` is first used.
    """

    def __init__(self, header: dict | None = None, expected_events: int = 0) -> None:
        self.trace = Trace(header=header or {})
        self._chunks: dict[str, list[ColumnChunk]] = {NVML: [], PROCMEM: []}
        self._events = _GrowingColumns(expected_events)
        self._lost = 0
        self._stack_problems: list[str] = []

    def on_header(self, header: dict) -> None:
        self.trace.header = header

    def on_events(self, chunk: ColumnChunk) -> None:
        self._events.append(chunk)

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

    def on_stacks(self, defs: StackDefs) -> None:
        try:
            self.trace.stacks.add(defs)
        except TraceFormatError as error:
            self._stack_problems.append(str(error))

    def on_trailer(self, trailer: dict) -> None:
        self.trace.trailer = trailer

    def finish(self, warnings: list[str] = ()) -> Trace:  # type: ignore[assignment]
        """The trace: events, NVML and procmem joined in file order; ``lost`` the last total."""
        trace = self.trace
        trace.event_columns = self._events.finish()
        trace.nvml = _concat(NVML, self._chunks[NVML])
        trace.procmem = _concat(PROCMEM, self._chunks[PROCMEM])
        self._chunks = {NVML: [], PROCMEM: []}
        self._events = _GrowingColumns(0)
        trailer_lost = (trace.trailer or {}).get("lost")
        trace.lost = max(self._lost, trailer_lost) if isinstance(trailer_lost, int) else self._lost
        trace.warnings = list(warnings)
        if self._stack_problems:
            trace.warnings.append(f"skipped {len(self._stack_problems)} stacks record(s) that name ids not defined "
                                  f"or define them twice; first: {self._stack_problems[0]}")
        return trace


#: Columns a load may keep as one value (everything but the GPU, which the replay fills in).
_FOLDABLE = frozenset(name for name in EVENT_DTYPE.names if name not in (SPARSE_COLUMN, "gpu"))


class _GrowingColumns:
    """Event columns that chunks are appended to (capacity doubles; trimmed at the end).

    A column holding one value in every event (no VMM handle, aux word, flag or device ordinal
    other than 0 in a trace of plain allocations: 24 of the 66 bytes an event) is kept as that
    value until an event differs, and finishes as a read-only broadcast view (no memory for any
    length): a 10M-event trace of driver allocations loads in 240 MB less, and never writes them.
    """

    def __init__(self, capacity: int) -> None:
        self.n = 0
        self._names = [name for name in EVENT_DTYPE.names if name != SPARSE_COLUMN]
        self._capacity = capacity
        self._cols = {name: np.empty(capacity, dtype=EVENT_DTYPE[name]) for name in self._names if name not in _FOLDABLE}
        self._one: dict[str, Any] = {name: None for name in self._names if name in _FOLDABLE}  # None: no event yet
        self._index: list[np.ndarray] = []
        self._ipc: list[np.ndarray] = []

    def append(self, chunk: ColumnChunk) -> None:
        end = self.n + chunk.n
        if end > self._capacity:
            self._capacity = max(end, 2 * self._capacity, 1 << 16)
            for name, col in self._cols.items():
                grown = np.empty(self._capacity, dtype=col.dtype)
                grown[: self.n] = col[: self.n]
                self._cols[name] = grown
        for name in self._names:
            values = chunk.column(name)
            if name in self._one and chunk.n:
                one = self._one[name]
                if one is None:  # the first events: their value, if they share one
                    one = values[0]
                if values[0] == one and values[-1] == one and bool((values == one).all()):
                    self._one[name] = one
                    continue
                del self._one[name]  # differs from here on: a real column
                self._cols[name] = np.empty(self._capacity, dtype=EVENT_DTYPE[name])
                self._cols[name][: self.n] = one
            if name in self._cols:
                self._cols[name][self.n : end] = values
        if chunk.ipc_index is not None and len(chunk.ipc_index):
            self._index.append(chunk.ipc_index.astype(np.int64) + self.n)
            self._ipc.append(chunk.ipc)
        self.n = end

    def finish(self) -> EventColumns:
        cols = {}
        for name in self._names:
            col = self._cols.get(name)
            if col is not None:
                cols[name] = col if len(col) == self.n else col[: self.n].copy()
            else:
                one = self._one[name]
                cols[name] = np.broadcast_to(np.array(0 if one is None else one, dtype=EVENT_DTYPE[name]), (self.n,))
        return EventColumns(
            self.n,
            cols,
            np.concatenate(self._index) if self._index else np.zeros(0, np.int64),
            np.concatenate(self._ipc) if self._ipc else np.zeros(0, EVENT_DTYPE[SPARSE_COLUMN]),
        )


def _concat(kind: str, chunks: list[ColumnChunk]) -> np.ndarray:
    """One structured array of every chunk's rows (NVML and procmem: small)."""
    out = np.zeros(sum(c.n for c in chunks), dtype=COLUMNAR[kind])
    start = 0
    for chunk in chunks:
        chunk.fill(out, start)
        start += chunk.n
    return out
