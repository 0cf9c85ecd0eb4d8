"""Read a trace: stream its records, or load all of it into a :class:`~memrec.trace.model.Trace`.

Reading never loads the file at once: records are decoded from 1 MiB reads through a feed-mode
msgpack Unpacker. Damage is reported, not raised: a trace cut anywhere (a crash, or a file still
being written) yields every complete record before the cut and a warning in ``.warnings``.
Only a file that is not a trace, or a trace of a newer major format version, raises
:class:`~memrec.base.errors.TraceFormatError` (when opened).
"""

from __future__ import annotations

import collections
import itertools
import os
from concurrent.futures import Executor
from concurrent.futures import Future
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from typing import Callable
from typing import Iterator

import msgpack
import numpy as np

from memrec.base.collector import paused
from memrec.base.errors import TraceFormatError
from memrec.base.untrusted import MAX_DEPTH
from memrec.base.untrusted import clean_text
from memrec.base.untrusted import too_deep
from memrec.terms.events import Marker
from memrec.trace import mapped as _mapped
from memrec.trace.budget import OverBudget
from memrec.trace.budget import read_budget
from memrec.trace.chunks import COLUMNAR_TYPE
from memrec.trace.chunks import ROWS_KEY
from memrec.trace.chunks import ColumnChunk
from memrec.trace.chunks import Schema
from memrec.trace.format import HEADER
from memrec.trace.format import MARKER
from memrec.trace.format import RECORD_TYPES
from memrec.trace.format import TRAILER
from memrec.trace.format import check_header
from memrec.trace.format import decode_record
from memrec.trace.format import header_prefix_plausible
from memrec.trace.format import parse_schema
from memrec.trace.format import shallow_marker
from memrec.trace.format import unpacker
from memrec.trace.model import Trace
from memrec.trace.records import RecordSink
from memrec.trace.records import TraceBuilder
from memrec.trace.records import check_record
from memrec.trace.records import deliver

#: The largest header a reader looks for before calling a file "not a trace".
MAX_HEADER_SIZE = 16 << 20
#: The largest single record a reader accepts (a keyframe of a huge state, a giant chunk).
MAX_RECORD_SIZE = 1 << 30
#: How far from the end :meth:`TraceReader.tail_trailer` looks for the trailer; its first
#: bytes: a fixmap whose first entry is "type": "trailer" (how the writer writes it).
_TRAILER_WINDOW = 1 << 16
_TRAILER_KEY = b"\xa4type\xa7trailer"


class TraceReader:
    """Streams the records of one trace file.

    The header is read and checked when the reader is created; iterating (``for rec in reader``,
    or :meth:`records`) yields every record after it in file order, decoded (columnar records carry
    a structured array under ``"events"`` / ``"samples"``), the trailer included. Each iteration
    starts over from the first record and sees what the file holds then, so a file still being
    written can be read again for more.

    Attributes:
        path: the file.
        header: the header record (``{}`` when the file ends inside its header: a warning says so).
        schema: the column dtypes the header declares.
        trailer: the trailer record once an iteration reached it, else None.
        warnings: what the last iteration found wrong (truncated tail, no trailer, skipped records).
        records_read: complete records the last iteration went through (header not counted).
        offset: the byte offset of the record an iteration yielded last (where ``items(start=)``
            can begin again).

    Raises:
        OSError: the file cannot be opened (FileNotFoundError etc.; the caller reports it).
        TraceFormatError: not a memrec trace, or a newer major format version.
    """

    def __init__(self, path: str | os.PathLike, *, read_size: int = 1 << 20) -> None:
        self.path = os.fspath(path)
        self._read_size = read_size
        self._file = open(self.path, "rb")
        try:
            self._header_warnings: list[str] = []
            self.header, self._data_start = self._read_header()
            self.schema: Schema = parse_schema(self.header)
        except BaseException:
            self._file.close()
            raise
        self.trailer: dict | None = None
        self.warnings: list[str] = list(self._header_warnings)
        self.records_read = 0
        self.offset = 0

    # -- header ---------------------------------------------------------------------------------

    def _read_header(self) -> tuple[dict, int]:
        up = unpacker(MAX_HEADER_SIZE)
        prefix = b""
        fed = 0
        while True:
            chunk = self._file.read(min(self._read_size, MAX_HEADER_SIZE - fed)) if fed < MAX_HEADER_SIZE else b""
            if chunk:
                if len(prefix) < 64:
                    prefix += chunk[: 64 - len(prefix)]
                up.feed(chunk)
                fed += len(chunk)
            try:
                obj = up.unpack()
            except msgpack.OutOfData:
                if chunk:
                    continue
                if header_prefix_plausible(prefix) and fed < MAX_HEADER_SIZE:
                    self._header_warnings.append(
                        f"trace ends inside its header ({fed} bytes): no records (still being created, or cut)"
                    )
                    return {}, fed
                raise TraceFormatError(f"{self.path}: not a memrec trace (bad magic)") from None
            except (ValueError, TypeError, msgpack.UnpackException):
                raise TraceFormatError(f"{self.path}: not a memrec trace (bad magic)") from None
            return check_header(obj, self.path), up.tell()

    # -- records --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict]:
        return self.records()

    def records(self) -> Iterator[dict]:
        """Yield every record after the header, decoded (see :func:`~memrec.trace.format.decode_record`)."""
        schema = self.schema
        return self._scan(lambda obj: decode_record(obj, schema, self._budget), lambda marker, obj: obj)

    def identity(self) -> tuple[int, int, int]:
        """(device, inode, size) of the open file: what a later read of the same path compares,
        so a file replaced or cut between two passes is an error, not another trace's report."""
        st = os.fstat(self._file.fileno())
        return st.st_dev, st.st_ino, st.st_size

    def raw_records(self) -> Iterator[dict]:
        """Yield every record after the header as msgpack gave it (columns as bytes)."""
        return self._scan(lambda obj: obj, lambda marker, obj: obj)

    def items(self, *, mapped: bool = False, threads: int = 0, start: int | None = None) -> Iterator[tuple[str, Any]]:
        """Yield ``(type, item)`` for every usable record, each checked the same way for every caller
        (:func:`memrec.trace.records.check_record`).

        Items: :class:`~memrec.trace.format.ColumnChunk` for events / nvml / procmem,
        :class:`~memrec.terms.events.Marker`, :class:`~memrec.terms.events.ProcessInfo`,
        :class:`~memrec.trace.model.Keyframe`, the cumulative total (int) for lost, the record
        itself for the trailer and any other type. A record that fails its check is skipped and
        counted in ``warnings``.

        ``mapped``: read through a memory mapping (format-1 columns stay views of the file; a
        format-2 chunk is decompressed straight from the mapping); a file that cannot be mapped
        is streamed.

        ``threads``: decode columnar records in that many threads, a few records ahead, yielded
        in order all the same (zstd and numpy let go of the GIL: the TUI's first frame waits for
        this scan).

        ``start``: begin at this byte offset (a record's :attr:`offset` from an earlier scan of the
        same file; streamed, not mapped): a second pass over part of a file reads only that part.
        """
        schema = self.schema
        return self._scan(lambda obj: check_record(obj, schema, self._budget), lambda marker, obj: (MARKER, marker),
                          mapped=mapped, threads=threads, start=start)

    def entries(self, *, mapped: bool = False) -> Iterator[tuple[str, Any, dict]]:
        """Like :meth:`items`, with each record as msgpack gave it: ``(type, item, record)``
        (``memrec dump`` prints a marker's or a trailer's own keys, checked as every reader's)."""
        schema = self.schema
        return self._scan(lambda obj: (*check_record(obj, schema, self._budget), obj),
                          lambda marker, obj: (MARKER, marker, obj), mapped=mapped)

    def feed(self, sink: RecordSink, *, mapped: bool = False) -> None:
        """Hand every usable record to ``sink`` (see :meth:`items`); warnings as for :meth:`items`."""
        on_marker = sink.on_marker
        schema = self.schema

        def take(marker: Marker, obj: dict) -> None:
            on_marker(marker)  # taken: nothing to yield

        # a marker record of the writer's goes to the sink as it is read (most records of a step
        # loop's trace: no item made, no dispatch); every other record as items() gives it
        records = self._scan(lambda obj: check_record(obj, schema, self._budget), take, mapped=mapped)
        # A step loop's 50,000 marker records leave 150,000 objects that make no cycles (each
        # record's map, its values and its Marker): with the collector running, their allocation
        # set off collections that walked the growing trace, most of reading a marker's cost.
        with paused():
            for kind, item in records:
                deliver(kind, item, sink)

    def _stream_objects(self, start: int | None = None) -> Iterator[tuple[int, Any]]:
        """``(offset, object)`` for each msgpack object after the header (or from ``start``), from
        1 MiB reads.

        Damage ends the iteration and sets ``self._damage`` (a warning without the record count).
        """
        begin = self._data_start if start is None else max(start, self._data_start)
        self._file.seek(begin)
        up = unpacker(MAX_RECORD_SIZE)
        fed = 0
        consumed = 0  # end of the last complete object (tell() is unreliable after OutOfData)
        while True:
            chunk = self._file.read(self._read_size)
            if not chunk:
                break
            try:
                up.feed(chunk)
            except msgpack.BufferFull:
                self._damage = (f"at byte {begin + consumed}: a record is larger than "
                                f"{MAX_RECORD_SIZE} bytes; the rest is skipped")
                return
            fed += len(chunk)
            while True:
                offset = begin + consumed
                try:
                    obj = up.unpack()
                except msgpack.OutOfData:
                    break
                except (ValueError, TypeError, msgpack.UnpackException) as error:
                    self._damage = f"at byte {offset} ({error or type(error).__name__}); the rest is skipped"
                    return
                consumed = up.tell()
                yield offset, obj
        if fed > consumed:
            self._tail = (fed - consumed, begin + consumed)

    def _mapped_objects(self) -> Iterator[tuple[int, Any]]:
        """Like :meth:`_stream_objects`, through a memory mapping (columns stay views of the file)."""
        try:
            yield from _mapped.objects(self._file.fileno(), self._data_start)
        except _mapped.Truncated as cut:
            self._tail = (os.fstat(self._file.fileno()).st_size - cut.at, cut.at)
        except _mapped.Damaged as error:
            self._damage = f"at byte {error.at} ({error}); the rest is skipped"

    def _scan(self, decode: Callable[[dict], Any], marker: Callable[[Marker, dict], Any], *, mapped: bool = False,
              threads: int = 0, start: int | None = None) -> Iterator[Any]:
        """Yield ``decode(obj)`` for every well-formed record; turn damage into warnings.

        ``marker(m, obj)``: what to yield for a marker record of the writer's own shape
        (:func:`~memrec.trace.format.shallow_marker` gives ``m``), the same as ``decode(obj)``
        would, or None when it took the marker itself (:meth:`feed`): such a record needs no depth
        walk (a step loop's trace is mostly marker records). ``start``: as for :meth:`items`.
        """
        if threads:
            with ThreadPoolExecutor(threads, thread_name_prefix="memrec-decode") as pool:
                try:
                    yield from self._scan_from(decode, marker, mapped, pool, 2 * threads, start)
                finally:  # stopped early: no decoding left running over a mapping about to close
                    pool.shutdown(wait=True, cancel_futures=True)
        else:
            yield from self._scan_from(decode, marker, mapped, None, 0, start)

    def _scan_from(self, decode: Callable[[dict], Any], marker: Callable[[Marker, dict], Any], mapped: bool,
                   pool: Executor | None, ahead: int, start: int | None = None) -> Iterator[Any]:
        self.trailer = None
        self.warnings = list(self._header_warnings)
        self.records_read = 0
        self._damage: str | None = None
        self._tail: tuple[int, int] | None = None
        # One budget for this read, in proportion to the file's size (a compression bomb stops here)
        self._budget = read_budget(os.fstat(self._file.fileno()).st_size, self.path)
        if not self.header:
            return
        warnings = self.warnings
        unknown: collections.Counter[str] = collections.Counter()
        malformed: list[str] = []
        last_ts: int | None = None
        stopped = False  # over the read's budget
        source = self._stream_objects(start)
        if mapped and start is None:
            objects = self._mapped_objects()
            try:
                first = next(objects, None)
            except _mapped.Unsupported:
                pass
            else:
                source = itertools.chain([first] if first is not None else [], objects)
        for (offset, obj), decoded in _decoded_ahead(source, decode, pool, ahead):
            self.records_read += 1
            kind = obj.get("type") if isinstance(obj, dict) else None
            if kind == MARKER:
                shallow = shallow_marker(obj)
                if shallow is not None:
                    if last_ts is None or shallow.ts > last_ts:
                        last_ts = shallow.ts
                    item = marker(shallow, obj)
                    if item is not None:  # None: taken (feed)
                        self.offset = offset
                        yield item
                    continue
            if not isinstance(kind, str):
                malformed.append(f"byte {offset}: not a map with a string 'type'")
                continue
            if kind not in RECORD_TYPES:
                unknown[clean_text(kind, 40)] += 1
                continue
            if kind == HEADER:
                malformed.append(f"byte {offset}: a second header (concatenated traces?)")
                continue
            if kind not in COLUMNAR_TYPE and too_deep(obj):
                malformed.append(f"byte {offset}: nested deeper than {MAX_DEPTH} levels")
                continue
            try:
                item = decoded.result() if decoded is not None else decode(obj)
            except OverBudget as error:
                warnings.append(f"stopped reading after {self.records_read - 1} records, at byte {offset}: {error}; "
                                "the rest is skipped")
                stopped = True
                break
            except TraceFormatError as error:
                malformed.append(f"byte {offset}: {error}")
                continue
            ts = _record_ts(obj, item)
            if ts is not None and (last_ts is None or ts > last_ts):
                last_ts = ts
            if kind == TRAILER:
                self.trailer = obj
            self.offset = offset
            yield item
        ends = "no record with a time was read" if last_ts is None else f"trace ends at ts {last_ts}"
        if self._damage is not None:
            warnings.append(f"corrupt trace after {self.records_read} records {self._damage}")
        elif self._tail is not None:
            tail, at = self._tail
            warnings.append(
                f"truncated tail after {self.records_read} records: {ends} "
                f"({tail} bytes of an incomplete record at byte {at} skipped)"
            )
        for kind, count in sorted(unknown.items()):
            warnings.append(
                f"skipped {count} record(s) of unknown type {kind!r} (written by a newer memrec? "
                f"this one reads format {self.header.get('version')}.x)"
            )
        if malformed:
            warnings.append(f"skipped {len(malformed)} malformed record(s); first at {malformed[0]}")
        if self.trailer is None and not stopped:
            warnings.append(
                f"no trailer after {self.records_read} records: the recording did not finish "
                f"(still being written, or the writer crashed); {ends}"
            )

    def expected_events(self) -> int:
        """The events the trailer counts, read from the file's last bytes without a scan; 0 when
        there is no trailer there (a crash, a file still written) or it does not parse.

        Only a hint for sizing (``load_trace`` allocates its columns once): nothing relies on it.
        """
        trailer = self.tail_trailer()
        counts = trailer.get("counts") if trailer is not None else None
        count = counts.get("events") if isinstance(counts, dict) else None
        if isinstance(count, int) and 0 <= count <= 256 * os.fstat(self._file.fileno()).st_size:
            return count
        return 0

    def tail_trailer(self) -> dict | None:
        """The trailer as the file's last bytes hold it, read without a scan (the TUI's first
        frame takes the trace's end from it); None when there is none there (a crash, a file
        still written) or it does not parse.

        Unchecked, so only a hint: a scan's :attr:`trailer` is the record as checked.
        """
        size = os.fstat(self._file.fileno()).st_size
        start = max(self._data_start, size - _TRAILER_WINDOW)
        self._file.seek(start)
        tail = self._file.read(size - start)
        at = tail.rfind(_TRAILER_KEY)
        for start in (at - 1, at - 3):  # after a fixmap's one byte, or a map16's three
            if start < 0:
                continue
            try:
                obj = msgpack.unpackb(tail[start:], raw=False, strict_map_key=False)
            except (ValueError, TypeError, msgpack.UnpackException):
                continue  # not the trailer's first bytes after all (extra data, a cut)
            if isinstance(obj, dict):
                return obj
        return None

    # -- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _record_ts(obj: dict, item: Any) -> int | None:
    """The latest ts a record holds (its last row's for columnar ones), or None."""
    if obj.get("type") in COLUMNAR_TYPE:
        chunk = item[1] if isinstance(item, tuple) else item
        if isinstance(chunk, ColumnChunk):
            return chunk.last_ts
        rows = chunk.get(ROWS_KEY[COLUMNAR_TYPE[obj["type"]]]) if isinstance(chunk, dict) else None
        if rows is not None:
            return int(rows["ts"][-1]) if len(rows) else None
        columns = obj.get("columns")  # raw format-1 records
        ts = columns.get("ts") if isinstance(columns, dict) else None
        if isinstance(ts, (bytes, memoryview)) and len(ts) >= 8:
            return int(np.frombuffer(bytes(ts[-8:]), dtype="<u8")[0])
        return None
    ts = obj.get("ts") if obj.get("type") != TRAILER else obj.get("end_ts")
    return ts if isinstance(ts, int) else None


#: What a reader says of an empty file (a daemon's before it wrote its header, or not a trace).
EMPTY_FILE = "empty file, not a memrec trace (yet?)"


def nothing_read(trace: Any, path: str | os.PathLike) -> str | None:
    """Why ``trace`` (read from ``path`` by :func:`load_trace` or a scan) holds nothing to show: an
    empty file, or one cut inside its header; None when it has its header. Every command and
    ``memrec.load`` refuse such a trace alike."""
    if trace.header:
        return None
    return EMPTY_FILE if os.path.getsize(path) == 0 else trace.warnings[0]


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a whole trace into memory.

    Events, NVML and procmem samples are joined in file order (the writer writes them in time
    order) with one numpy copy per column, no per-event Python; the events stay columns
    (``Trace.event_columns``) until ``Trace.events`` is used. Processes are keyed by pid (a later
    record for a pid replaces the earlier one); ``lost`` is the last cumulative total.

    Raises:
        OSError: the file cannot be opened.
        TraceFormatError: not a memrec trace, or a newer major format version.
    """
    with TraceReader(path) as reader:
        builder = TraceBuilder(reader.header, expected_events=reader.expected_events())
        reader.feed(builder)
        return builder.finish(reader.warnings)


def _decoded_ahead(source: Iterator[tuple[int, Any]], decode: Callable[[dict], Any], pool: Executor | None,
                   ahead: int) -> Iterator[tuple[tuple[int, Any], Future | None]]:
    """``((offset, object), decoding)`` in the source's order: each columnar record's ``decode`` is
    started in ``pool`` up to ``ahead`` records before it is needed (None: not started; without a
    pool, no generator of its own between the source and the reader: a step loop's trace is
    mostly small marker records)."""
    if pool is None:
        return zip(source, itertools.repeat(None))
    return _submitted_ahead(source, decode, pool, ahead)


def _submitted_ahead(source: Iterator[tuple[int, Any]], decode: Callable[[dict], Any], pool: Executor,
                     ahead: int) -> Iterator[tuple[tuple[int, Any], Future | None]]:
    """:func:`_decoded_ahead` with a pool."""
    waiting: collections.deque = collections.deque()
    for offset, obj in source:
        kind = obj.get("type") if isinstance(obj, dict) else None
        columnar = isinstance(kind, str) and kind in COLUMNAR_TYPE
        waiting.append(((offset, obj), pool.submit(decode, obj) if columnar else None))
        if len(waiting) > ahead:
            yield waiting.popleft()
    while waiting:
        yield waiting.popleft()
