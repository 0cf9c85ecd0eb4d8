"""Write a trace: records go through a :class:`Sink` (a file, memory, or a callback).

``TraceWriter`` buffers events and samples into columnar chunks (at most ``max_chunk_rows`` rows
each) and writes the other records as they come. Every record is one msgpack object, written whole
with ``os.writev`` at :meth:`TraceWriter.flush` (or once 4 MiB are pending), so another process
can read the file while it is written, and a crash at any point leaves a trace whose only damage
is an incomplete last record (readers skip it with a warning).

Record order in the file is the order of the calls, except that events, NVML and procmem rows are
held back until their chunk is full, :meth:`~TraceWriter.flush`, a keyframe or
:meth:`~TraceWriter.close`. A keyframe always follows the events it covers.

A marker, process, lost or keyframe record that memrec's readers would skip as malformed (the
one rule, :func:`memrec.trace.records.check_record`) is refused with ``ValueError`` before any of
it is written.

For live subscribers, pass ``tee=callback``: it receives the bytes of every record (header
included) as the writer hands them to its sink — the same bytes the file gets. Frame them with
:func:`memrec.trace.frames.encode_frame`.
"""

from __future__ import annotations

import errno
import os
from typing import Callable
from typing import Hashable
from typing import Protocol
from typing import Sequence

import numpy as np

from memrec.base.errors import TraceFormatError
from memrec.base.files import create_new
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace.chunks import EVENTS
from memrec.trace.chunks import MAX_CHUNK_ROWS
from memrec.trace.chunks import NVML
from memrec.trace.chunks import PROCMEM
from memrec.trace.chunks import ChunkBuilder
from memrec.trace.format import KEYFRAME
from memrec.trace.format import LOST
from memrec.trace.format import MARKER
from memrec.trace.format import PROCESS
from memrec.trace.format import TRAILER
from memrec.trace.format import encode_record
from memrec.trace.format import finalize_header
from memrec.trace.format import keyframe_record
from memrec.trace.format import lost_record
from memrec.trace.format import marker_record
from memrec.trace.format import packb
from memrec.trace.format import process_record
from memrec.trace.format import unpackb
from memrec.trace.records import check_record
from memrec.trace.stacks import Frame
from memrec.trace.stacks import StackInterner
from memrec.trace.stacks import Unavailable


class Sink(Protocol):
    """Where encoded records go. ``write_record`` gets one whole record at a time."""

    def write_record(self, data: bytes) -> None:
        """Accept one encoded record (may buffer it)."""

    def flush(self) -> None:
        """Make every record accepted so far visible to readers."""

    def close(self) -> None:
        """Flush, make durable where that means something, and release resources."""


_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


#: Write errors that may pass (space freed, quota raised): records are held and retried.
RETRYABLE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
#: The most bytes a stalled FileSink holds before it drops new records (counted).
MAX_HELD_BYTES = 64 << 20


class FileSink:
    """Appends records to a file with ``os.write``; buffers up to ``buffer_size`` bytes.

    Only whole records are buffered and ``flush`` writes them with ``os.writev`` (no copy; resuming
    after short writes), so a reader in another process sees whole records except, at worst, the
    last one while it is being written.

    A full disk (ENOSPC, EDQUOT) does not raise: the sink *stalls* (``stalled`` holds the error),
    keeps the records (up to ``max_held`` bytes; later ones are dropped and counted in
    ``dropped_records`` / ``dropped_bytes``) and tries again at every flush, resuming exactly at
    the byte where the kernel stopped, so the stream stays whole. Closed while still stalled, the
    file is cut back to its last whole record: it ends cleanly, without the records that never fit.

    The file is created with :func:`memrec.base.files.create_new` (never through a symbolic link);
    ``replace`` allows replacing an existing regular file, and ``replaced`` tells whether one was.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        fsync_on_flush: bool = False,
        buffer_size: int = 4 << 20,
        mode: int = 0o666,
        replace: bool = True,
        max_held: int = MAX_HELD_BYTES,
    ) -> None:
        self.path = os.fspath(path)
        fd, self.replaced = create_new(self.path, mode, replace=replace)
        self._fd: int | None = fd
        self._pending: list[bytes | memoryview] = []
        self._pending_bytes = 0
        self._head_done = 0  # bytes of _pending[0] already in the file
        self._buffer_size = buffer_size
        self._max_held = max_held
        self.fsync_on_flush = fsync_on_flush
        self.bytes_written = 0  # bytes that reached the file
        #: the error that stalled the writes (None while writing works)
        self.stalled: OSError | None = None
        self.dropped_records = 0
        self.dropped_bytes = 0

    def write_record(self, data: bytes) -> None:
        if self.stalled is not None and self._pending_bytes + len(data) > self._max_held:
            self.dropped_records += 1
            self.dropped_bytes += len(data)
            return
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= self._buffer_size:
            self._write_out()

    def _write_out(self) -> None:
        """Write the pending records with os.writev, resuming after short writes and a full disk."""
        if self._fd is None:
            raise ValueError("write to a closed FileSink")
        pending = self._pending
        while pending:
            batch = pending[:_IOV_MAX]
            try:
                n = os.writev(self._fd, batch)
            except OSError as error:
                if error.errno not in RETRYABLE_ERRNOS:
                    raise
                self.stalled = error
                return
            self.stalled = None
            self.bytes_written += n
            self._pending_bytes -= n
            done = 0
            for part in batch:
                if n < len(part):
                    break
                n -= len(part)
                done += 1
            if done:
                self._head_done = 0
            del pending[:done]
            if n:
                pending[0] = memoryview(pending[0])[n:]
                self._head_done += n

    def flush(self) -> None:
        self._write_out()
        if self.fsync_on_flush and self.stalled is None:
            os.fsync(self._fd)  # type: ignore[arg-type]

    def sync(self) -> None:
        """Flush and fsync."""
        self._write_out()
        if self.stalled is None:
            os.fsync(self._fd)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.sync()
            if self.stalled is not None:  # never fitted: end the file at its last whole record
                self.dropped_records += len(self._pending)
                self.dropped_bytes += self._pending_bytes
                os.ftruncate(self._fd, self.bytes_written - self._head_done)
                self._pending.clear()
        finally:
            os.close(self._fd)
            self._fd = None


class BytesSink:
    """Keeps every record in memory: ``.data`` is the whole trace so far, ``.records`` each record."""

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.closed = False

    @property
    def data(self) -> bytes:
        return b"".join(self.records)

    def write_record(self, data: bytes) -> None:
        self.records.append(bytes(data))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class CallbackSink:
    """Calls ``callback(record_bytes)`` for every record (e.g. to fan out to live subscribers)."""

    def __init__(self, callback: Callable[[bytes], None]) -> None:
        self.callback = callback

    def write_record(self, data: bytes) -> None:
        self.callback(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _check_readable(rec: dict, data: bytes) -> None:
    """Refuse a record memrec's readers would skip as malformed, before the file or a subscriber
    gets it: the readers' one rule (:func:`~memrec.trace.records.check_record`) applied to the
    record as it will be read back. A keyframe is checked as given (ts, event_index, a map
    state): its state's Zstandard frame is not opened again (at 1M allocations that would cost
    more than writing it).

    Raises:
        ValueError: the record would be dropped by every reader (the reason names the field).
    """
    try:
        check_record(rec if rec.get("type") == KEYFRAME else unpackb(data))
    except TraceFormatError as error:
        raise ValueError(f"refusing to write a record memrec's readers would skip: {error}") from None


class TraceWriter:
    """Write one trace file (or sink): header at once, then records, then the trailer at close.

    Args:
        path_or_sink: a path (created with :class:`FileSink`, never through a symbolic link) or
            any :class:`Sink`.
        header: the caller's header fields (see :func:`memrec.trace.format.make_header`); the writer
            adds magic, version, type, column schema, and clock/anchor when missing.
        fsync_on_flush: fsync the file at every flush (only with a path).
        tee: called with the bytes of every record after the sink got them (live subscribers).
        max_chunk_rows: the most rows per columnar record.
        replace: with a path: replace an existing regular file (else FileExistsError);
            ``replaced`` says whether one was.
        stacks: the stacks this file starts with (``memrec merge`` numbers its inputs' stacks
            before it writes); by default none.

    Not thread-safe: one thread (the daemon's loop) calls it.
    """

    def __init__(
        self,
        path_or_sink: str | os.PathLike | Sink,
        header: dict,
        *,
        fsync_on_flush: bool = False,
        tee: Callable[[bytes], None] | None = None,
        max_chunk_rows: int = MAX_CHUNK_ROWS,
        replace: bool = True,
        stacks: StackInterner | None = None,
    ) -> None:
        # Encode the header first: a header msgpack cannot encode must not leave an empty file.
        self.header = finalize_header(header)
        self.header_bytes = encode_record(self.header)
        if isinstance(path_or_sink, (str, os.PathLike)):
            self.path: str | None = os.fspath(path_or_sink)
            self._sink: Sink = FileSink(self.path, fsync_on_flush=fsync_on_flush, replace=replace)
        else:
            self.path = getattr(path_or_sink, "path", None)
            self._sink = path_or_sink
        self._tee = tee
        self._builders = {kind: ChunkBuilder(kind, max_chunk_rows) for kind in (EVENTS, NVML, PROCMEM)}
        #: Rows (events, nvml, procmem) or records (the others) written so far, buffered included.
        self.counts: dict[str, int] = dict.fromkeys((EVENTS, NVML, PROCMEM, MARKER, PROCESS, LOST, KEYFRAME), 0)
        #: Encoded bytes handed to the sink (the file's size after :meth:`flush`).
        self.bytes_written = 0
        #: Encoded bytes of the keyframes so far, and where the last one ended (``bytes_written``
        #: then) and its size: what a cadence driven by bytes needs (:mod:`memrec.daemon.keyframes`).
        self.keyframe_bytes = 0
        self.last_keyframe_end = 0
        self.last_keyframe_size = 0
        self.records_written = 0
        self.lost = 0
        self.last_ts: int | None = None
        self._kinds = np.zeros(0, dtype=np.int64)
        self._stacks = stacks if stacks is not None else StackInterner()
        self.closed = False
        self._emit(self.header_bytes)
        self._sink.flush()

    # -- properties ---------------------------------------------------------------------------

    @property
    def replaced(self) -> bool:
        """Whether creating the file replaced an existing one."""
        return bool(getattr(self._sink, "replaced", False))

    @property
    def stalled(self) -> OSError | None:
        """The error (a full disk) that holds writes back now, None while writing works."""
        return getattr(self._sink, "stalled", None)

    @property
    def dropped(self) -> tuple[int, int]:
        """Records and bytes dropped because the disk stayed full (see :class:`FileSink`)."""
        return getattr(self._sink, "dropped_records", 0), getattr(self._sink, "dropped_bytes", 0)

    @property
    def event_count(self) -> int:
        """Events written so far (buffered included): the ``event_index`` of the next event."""
        return self.counts[EVENTS]

    @property
    def pending_rows(self) -> int:
        """Rows held back in unfinished chunks."""
        return sum(b.rows for b in self._builders.values())

    def event_kind_counts(self) -> dict[str, int]:
        """Events written so far per Kind name (only kinds seen)."""
        out = {}
        for number, count in enumerate(self._kinds.tolist()):
            if count:
                try:
                    name = Kind(number).name
                except ValueError:
                    name = f"KIND_{number}"
                out[name] = count
        return out

    # -- writing ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("write to a closed TraceWriter")

    def _emit(self, data: bytes) -> None:
        self._sink.write_record(data)
        self.bytes_written += len(data)
        self.records_written += 1
        if self._tee is not None:
            self._tee(data)

    def _emit_wire(self, wire: dict) -> None:
        self._emit(packb(wire))

    def _see_ts(self, ts: int) -> None:
        if self.last_ts is None or ts > self.last_ts:
            self.last_ts = ts

    def _write_rows(self, kind: str, arr: np.ndarray) -> None:
        self._check_open()
        if len(arr) == 0:
            return
        self._emit_stacks()
        builder = self._builders[kind]
        for wire in builder.append(arr):
            self._emit_wire(wire)
        self.counts[kind] += len(arr)
        self._see_ts(int(arr["ts"].max()))

    def write_events(self, events: np.ndarray) -> None:
        """Buffer events (EVENT_DTYPE, or any structured array with its fields), in time order.

        The rows are copied: the caller may reuse ``events`` at once.
        """
        self._write_rows(EVENTS, events)
        if len(events):
            counts = np.bincount(events["kind"].astype(np.intp))
            if len(counts) > len(self._kinds):
                counts[: len(self._kinds)] += self._kinds
                self._kinds = counts
            else:
                self._kinds[: len(counts)] += counts

    def write_nvml(self, samples: np.ndarray) -> None:
        """Buffer NVML device samples (NVML_DTYPE)."""
        self._write_rows(NVML, samples)

    def write_procmem(self, samples: np.ndarray) -> None:
        """Buffer NVML per-process samples (PROCMEM_DTYPE)."""
        self._write_rows(PROCMEM, samples)

    def write_record(self, rec: dict) -> None:
        """Write any logical record now (columnar ones go through their chunk buffer)."""
        self._check_open()
        kind = rec.get("type")
        if kind == EVENTS:
            self.write_events(rec["events"])
        elif kind in (NVML, PROCMEM):
            self._write_rows(kind, rec["samples"])
        else:
            data = encode_record(rec)
            _check_readable(rec, data)
            self._emit(data)
            if kind in self.counts:
                self.counts[kind] += 1
            if isinstance(rec.get("ts"), int):
                self._see_ts(rec["ts"])

    def write_marker(self, marker: Marker) -> None:
        """Write a phase marker."""
        self.write_record(marker_record(marker))

    def write_process(self, process: ProcessInfo) -> None:
        """Write what is known about a process (a later record for the same pid replaces it)."""
        self.write_record(process_record(process))

    def write_lost(self, ts: int, total: int) -> None:
        """Write the cumulative number of events lost so far (e.g. ring-buffer reserve failures)."""
        self.lost = int(total)
        self.write_record(lost_record(ts, total))

    def write_keyframe(self, ts: int, event_index: int | dict | None = None, state: dict | None = None) -> None:
        """Write a keyframe: the full live state at ``ts``, valid after the first ``event_index``
        events of this file (default: every event written so far).

        Buffered events are written first, so the keyframe follows the events it covers. The
        two-argument form ``write_keyframe(ts, state)`` is accepted too.
        """
        if isinstance(event_index, dict) and state is None:
            event_index, state = None, event_index
        if state is None:
            raise TypeError("write_keyframe needs a state")
        self._check_open()
        self._emit_pending()
        if event_index is None:
            event_index = self.event_count
        before = self.bytes_written
        self.write_record(keyframe_record(ts, event_index, state))
        self.last_keyframe_size = self.bytes_written - before
        self.last_keyframe_end = self.bytes_written
        self.keyframe_bytes += self.last_keyframe_size

    def intern_stack(self, stack: Sequence[Frame] | Unavailable, key: Hashable | None = None) -> int:
        """The id this file gives ``stack`` (frames innermost first, or Unavailable): what an
        event's ``stack`` column holds. New strings, frames and stacks are written once, in a
        ``stacks`` record before the next events chunk, so intern before writing the events.
        A repeated stack costs a dict lookup; ``key`` (any hashable the caller already has for
        this stack, e.g. the BPF program's stack id) makes it one on that key instead of the
        frames. Ids belong to this file: after a rotation the next file's writer numbers anew.

        Raises:
            ValueError: more frames than :data:`memrec.trace.stacks.MAX_DEPTH`, a name too long.
        """
        self._check_open()
        return self._stacks.intern(stack, key)

    def stack_definitions(self) -> dict | None:
        """One ``stacks`` record defining every stack interned so far (a live subscriber that
        joins mid-file needs it before the events; None when there are none). For a subscriber
        only: the file has these definitions already, and readers refuse an id defined twice."""
        return self._stacks.whole_record()

    def _emit_stacks(self) -> None:
        if self._stacks.pending():
            self._emit(packb(self._stacks.take_record()))

    def _emit_pending(self) -> None:
        self._emit_stacks()
        for builder in self._builders.values():
            wire = builder.take()
            if wire is not None:
                self._emit_wire(wire)

    def flush(self) -> None:
        """Write every buffered chunk and record to the sink and make them visible to readers."""
        self._check_open()
        self._emit_pending()
        self._sink.flush()

    def trailer(self, extra: dict | None = None) -> dict:
        """The trailer :meth:`close` would write now (``extra`` keys override the defaults)."""
        out = {
            "type": TRAILER,
            "counts": dict(self.counts),
            "event_kinds": self.event_kind_counts(),
            "lost": self.lost,
            "end_ts": self.last_ts,
        }
        if self._stacks.stacks:  # format 2.3, only in a file that has stacks (others stay as 2.2 wrote them)
            out["stacks"] = self._stacks.stacks
        out.update(extra or {})
        out["type"] = TRAILER
        return out

    def close(self, trailer: dict | None = None) -> None:
        """Flush, write the trailer (counts, lost, end_ts, plus ``trailer``'s keys), fsync, close."""
        if self.closed:
            return
        self._emit_pending()
        self._emit(encode_record(self.trailer(trailer)))
        self.closed = True
        self._sink.close()

    def abort(self) -> None:
        """Flush and close without a trailer (readers will warn that the trace is incomplete)."""
        if self.closed:
            return
        try:
            self._emit_pending()
        finally:
            self.closed = True
            self._sink.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
