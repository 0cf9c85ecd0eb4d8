"""Zero-copy walk of a trace file (the TUI's first frame comes from it).

The streaming reader decodes every record through msgpack, which copies each binary value. Here
the file is memory-mapped and the records are walked with a minimal msgpack parser that returns
the *offsets* of binary values: columnar records come back in wire form with their binary values
as views of the mapping (a format-2 chunk's Zstandard frame is decompressed from there; a
format-1 file's columns stay views, read by the kernel only when the replay touches them); every
other record (header, keyframe, marker, process, lost, trailer) is small and is decoded by
msgpack as usual.

This module only finds records; :class:`memrec.trace.reader.TraceReader` checks them, so a file
read this way gives the same records and the same warnings as one streamed. The caller falls
back to streaming when :func:`objects` raises :class:`Unsupported`.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any
from typing import Iterator

import msgpack

from memrec.base.untrusted import MAX_DEPTH
from memrec.trace.chunks import COLUMNAR_TYPE

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


class Unsupported(Exception):
    """The file cannot be mapped (a pipe, an empty file...)."""


class Truncated(Exception):
    """The file ends inside the record that starts at byte ``at``."""

    def __init__(self, at: int = -1) -> None:
        super().__init__(at)
        self.at = at


class Damaged(ValueError):
    """The record at byte ``at`` is not msgpack (or nests too deep); ``str()`` says why."""

    def __init__(self, at: int, reason: str) -> None:
        super().__init__(reason)
        self.at = at


class _Bin:
    """A binary value: where it lies in the mapping."""

    __slots__ = ("start", "end")

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end


def _parse(buf: Any, pos: int, size: int, want_bins: bool, depth: int = 0) -> tuple[Any, int]:
    """Parse one msgpack object at ``pos``; bins come back as :class:`_Bin` (when ``want_bins``).

    Raises:
        Truncated: the buffer ends inside the object.
        ValueError: not msgpack, or nested deeper than MAX_DEPTH.
    """
    if depth > MAX_DEPTH:
        raise ValueError(f"a record nests deeper than {MAX_DEPTH} levels")
    if pos >= size:
        raise Truncated
    b = buf[pos]
    pos += 1
    if b <= 0x7F:
        return b, pos
    if 0x80 <= b <= 0x8F:
        return _map(buf, pos, size, b & 0x0F, want_bins, depth)
    if 0x90 <= b <= 0x9F:
        return _array(buf, pos, size, b & 0x0F, want_bins, depth)
    if 0xA0 <= b <= 0xBF:
        n = b & 0x1F
        return _str(buf, pos, size, n)
    if b >= 0xE0:
        return b - 0x100, pos
    if b == 0xC0:
        return None, pos
    if b in (0xC2, 0xC3):
        return b == 0xC3, pos
    if b in (0xC4, 0xC5, 0xC6):
        width = {0xC4: 1, 0xC5: 2, 0xC6: 4}[b]
        n, pos = _len(buf, pos, size, width)
        if pos + n > size:
            raise Truncated
        if want_bins:
            return _Bin(pos, pos + n), pos + n
        return bytes(buf[pos : pos + n]), pos + n
    if b in (0xD9, 0xDA, 0xDB):
        n, pos = _len(buf, pos, size, {0xD9: 1, 0xDA: 2, 0xDB: 4}[b])
        return _str(buf, pos, size, n)
    if b in (0xDE, 0xDF):
        n, pos = _len(buf, pos, size, 2 if b == 0xDE else 4)
        return _map(buf, pos, size, n, want_bins, depth)
    if b in (0xDC, 0xDD):
        n, pos = _len(buf, pos, size, 2 if b == 0xDC else 4)
        return _array(buf, pos, size, n, want_bins, depth)
    fixed = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
             0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
    if b in fixed:
        end = pos + fixed[b]
        if end > size:
            raise Truncated
        return msgpack.unpackb(bytes(buf[pos - 1 : end]), raw=False, strict_map_key=False), end
    if b in (0xC7, 0xC8, 0xC9):  # ext 8/16/32: skip (not used by memrec)
        n, pos = _len(buf, pos, size, {0xC7: 1, 0xC8: 2, 0xC9: 4}[b])
        if pos + 1 + n > size:
            raise Truncated
        return None, pos + 1 + n
    raise ValueError(f"byte {b:#x} is not msgpack")


def _len(buf: Any, pos: int, size: int, width: int) -> tuple[int, int]:
    if pos + width > size:
        raise Truncated
    st = {1: _U8, 2: _U16, 4: _U32}[width]
    return st.unpack_from(buf, pos)[0], pos + width


def _str(buf: Any, pos: int, size: int, n: int) -> tuple[str, int]:
    if pos + n > size:
        raise Truncated
    return bytes(buf[pos : pos + n]).decode("utf-8", "replace"), pos + n


def _map(buf: Any, pos: int, size: int, n: int, want_bins: bool, depth: int) -> tuple[dict, int]:
    if pos + n > size:  # every entry takes at least 2 bytes: do not loop on a made-up count
        raise Truncated
    out = {}
    for _ in range(n):
        k, pos = _parse(buf, pos, size, want_bins, depth + 1)
        v, pos = _parse(buf, pos, size, want_bins, depth + 1)
        try:
            out[k] = v
        except TypeError:  # an unhashable key (a list, a map): msgpack itself refuses these
            raise ValueError("a map key is not hashable") from None
    return out, pos


def _array(buf: Any, pos: int, size: int, n: int, want_bins: bool, depth: int) -> tuple[list, int]:
    if pos + n > size:
        raise Truncated
    out = []
    for _ in range(n):
        v, pos = _parse(buf, pos, size, want_bins, depth + 1)
        out.append(v)
    return out, pos


def _skip_or_type(buf: Any, pos: int, size: int) -> tuple[str | None, int]:
    """The ``type`` of the map record at ``pos`` if it is the first key, without parsing the rest."""
    b = buf[pos]
    if 0x80 <= b <= 0x8F:
        p = pos + 1
    elif b == 0xDE:
        p = pos + 3
    elif b == 0xDF:
        p = pos + 5
    else:
        return None, pos
    try:
        k, p = _parse(buf, p, size, False)
        if k != "type":
            return None, pos
        v, p = _parse(buf, p, size, False)
        return (v if isinstance(v, str) else None), pos
    except Truncated:
        return None, pos


def objects(fileno: int, data_start: int) -> Iterator[tuple[int, Any]]:
    """Yield ``(offset, object)`` for every msgpack object after the header of the open file
    ``fileno`` (the reader's own: the path opened again could be another file by now, whose
    records would follow this one's header).

    Columnar records come in wire form with their columns (and ipc bytes) as views of the
    mapping; every other object as msgpack decodes it.

    Raises:
        Unsupported: the file cannot be memory-mapped (raised at the first ``next``).
        Truncated: the file ends inside an object (after every object before it was yielded).
        Damaged: bytes that are not msgpack, or nested too deep.
    """
    try:
        mm = mmap.mmap(fileno, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as error:
        raise Unsupported(str(error)) from None
    view = memoryview(mm)
    size = len(mm)
    pos = data_start
    # Every other record (a keyframe can hold a big flat list) through msgpack's own parser: one
    # unpacker for a run of them, fed from the mapping as it needs (an unpacker made for each of
    # a step loop's 50,000 marker records, each reading 64 KiB ahead, was most of the TUI's scan).
    up: msgpack.Unpacker | None = None  # holds the file's bytes [base, fed), in step with pos
    base = fed = pos
    while pos < size:
        start = pos
        try:
            if view[pos + 1 : pos + _MARKER_END] != _MARKER_START and _skip_or_type(view, pos, size)[0] in COLUMNAR_TYPE:
                obj, pos = _columnar(view, pos, size)
                up = None
            else:
                if up is None:
                    up = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 30)
                    base = fed = pos
                while True:
                    try:
                        obj = up.unpack()
                        break
                    except msgpack.OutOfData:
                        if fed >= size:
                            raise Truncated from None
                        step = max(1 << 16, fed - pos)  # a large record: twice as far each time
                        up.feed(view[fed : fed + step])
                        fed = min(fed + step, size)
                pos = base + up.tell()
        except Truncated:
            raise Truncated(start) from None
        except (ValueError, TypeError, msgpack.UnpackException) as error:
            raise Damaged(start, str(error) or type(error).__name__) from None
        yield start, obj


#: How a marker record of the writer's begins after its map's first byte: most records of a step
#: loop's trace, known to be small without parsing their type.
_MARKER_START = b"\xa4type\xa6marker"
_MARKER_END = 1 + len(_MARKER_START)


def _columnar(view: memoryview, start: int, size: int) -> tuple[dict, int]:
    """The columnar record at ``start`` in wire form, its binary values views of the mapping."""
    obj, pos = _parse(view, start, size, True)
    wire = {k: (view[v.start : v.end] if isinstance(v, _Bin) else v) for k, v in obj.items()}
    columns = obj.get("columns")
    if isinstance(columns, dict):
        wire["columns"] = {k: (view[v.start : v.end] if isinstance(v, _Bin) else v) for k, v in columns.items()}
    return wire, pos
