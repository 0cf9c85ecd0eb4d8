"""Length-prefixed msgpack frames: the marker/subscriber socket's wire format.

A frame is a 4-byte big-endian payload length followed by one msgpack map (one record, the same
bytes a trace file holds for it). Client frames (markers) are at most :data:`MAX_CLIENT_FRAME`
bytes; frames to live subscribers carry event chunks and keyframes, so readers of that stream
allow up to :data:`MAX_SUBSCRIBER_FRAME`.

* ``encode_frame(rec_or_bytes)``: frame a logical record, or the bytes a :class:`TraceWriter` tee
  handed over (so a subscriber gets exactly the file's bytes);
* ``FrameDecoder(max_size).feed(data) -> list[dict]``: incremental decoding for a non-blocking
  socket; it remembers a header record's column schema for the records after it;
* ``iter_frames(stream)``: blocking iteration over a file-like object (``sock.makefile("rb")``).

A frame over the limit, or a payload that is not a msgpack map with a string ``type``, raises
:class:`FrameError`; the stream cannot be resynchronised after that, so close the connection.
"""

from __future__ import annotations

from typing import Any
from typing import BinaryIO
from typing import Iterator

from memrec.terms import protocol
from memrec.base.errors import MemrecError
from memrec.base.errors import TraceFormatError
from memrec.trace.format import DEFAULT_SCHEMA
from memrec.trace.format import HEADER
from memrec.trace.format import Schema
from memrec.trace.format import check_header
from memrec.trace.format import decode_record
from memrec.trace.format import encode_record
from memrec.trace.format import parse_schema
from memrec.trace.format import unpackb

#: The length prefix, and the largest frame a client (marker sender) may send: the protocol's.
LENGTH = protocol.LENGTH
MAX_CLIENT_FRAME = protocol.MAX_CLIENT_FRAME
#: The largest frame a live subscriber accepts (an event chunk or a keyframe).
MAX_SUBSCRIBER_FRAME = protocol.MAX_SERVER_FRAME


class FrameError(MemrecError):
    """A frame over the size limit, or one that does not hold a record.

    ``records`` holds the records decoded from the same ``feed`` before the bad frame.
    """

    def __init__(self, message: str, records: list[dict] | None = None) -> None:
        super().__init__(message)
        self.records = records or []


def encode_frame(rec: dict | bytes | bytearray | memoryview, *, max_size: int | None = None) -> bytes:
    """Frame one record: a logical record dict, or an already encoded record's bytes.

    Raises:
        FrameError: the payload is larger than ``max_size``.
    """
    payload = bytes(rec) if isinstance(rec, (bytes, bytearray, memoryview)) else encode_record(rec)
    limit = max_size if max_size is not None else 0xFFFFFFFF
    if len(payload) > limit:
        raise FrameError(f"frame of {len(payload)} bytes is over the limit of {limit} bytes")
    return LENGTH.pack(len(payload)) + payload


def decode_payload(payload: bytes, *, decode: bool = True, schema: Schema | None = None) -> dict:
    """Decode one frame's payload into a record (logical form when ``decode``).

    Raises:
        FrameError: not msgpack, or not a map with a string ``type``, or a malformed record.
    """
    try:
        obj: Any = unpackb(payload)
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise FrameError(f"bad frame: not one msgpack object ({type(error).__name__}: {error})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise FrameError("bad frame: not a map with a string 'type'")
    if not decode:
        return obj
    try:
        return decode_record(obj, schema)
    except TraceFormatError as error:
        raise FrameError(f"bad frame: {error}") from None


class FrameDecoder(protocol.FrameDecoder):
    """Incremental frame decoder for one connection.

    Args:
        max_size: the largest payload accepted; a larger length prefix raises FrameError at once
            (before its payload is buffered).
        decode: give records in logical form (numpy rows); False gives them as msgpack gave them.
    """

    def __init__(self, max_size: int = MAX_CLIENT_FRAME, *, decode: bool = True) -> None:
        super().__init__(max_size)
        self.decode = decode
        self.schema: Schema = DEFAULT_SCHEMA

    def feed(self, data: bytes) -> list[dict]:
        """Add received bytes; return every record completed by them, in order.

        Raises:
            FrameError: a frame over ``max_size`` or a bad payload (``.records`` holds the records
                completed before it). A header record of a newer major version raises
                FrameError too.
        """
        return super().feed(data)

    def _too_large(self, size: int, done: list[dict]) -> Exception:
        return FrameError(f"frame of {size} bytes is over the limit of {self.max_size} bytes", done)

    def _decode(self, body: bytes, done: list[dict]) -> dict:
        try:
            return self._record(body)
        except FrameError as error:
            error.records = done
            raise

    def _record(self, payload: bytes) -> dict:
        rec = decode_payload(payload, decode=self.decode, schema=self.schema)
        if rec.get("type") == HEADER:
            try:
                check_header(rec, "stream")
                self.schema = parse_schema(rec)
            except TraceFormatError as error:
                raise FrameError(str(error)) from None
        return rec


def _read_exactly(stream: BinaryIO, n: int) -> bytes:
    parts = []
    left = n
    while left:
        data = stream.read(left)
        if not data:
            break
        parts.append(data)
        left -= len(data)
    return b"".join(parts)


def iter_frames(stream: BinaryIO, max_size: int = MAX_SUBSCRIBER_FRAME, *, decode: bool = True) -> Iterator[dict]:
    """Yield the records of a blocking byte stream until it ends cleanly (EOF between frames).

    Raises:
        FrameError: a frame over ``max_size``, a bad payload, or EOF inside a frame.
    """
    decoder = FrameDecoder(max_size, decode=decode)
    while True:
        prefix = _read_exactly(stream, LENGTH.size)
        if not prefix:
            return
        if len(prefix) < LENGTH.size:
            raise FrameError("stream ended inside a frame's length")
        (size,) = LENGTH.unpack(prefix)
        if size > max_size:
            raise FrameError(f"frame of {size} bytes is over the limit of {max_size} bytes")
        payload = _read_exactly(stream, size)
        if len(payload) < size:
            raise FrameError(f"stream ended inside a frame ({len(payload)} of {size} bytes)")
        yield decoder._record(payload)
