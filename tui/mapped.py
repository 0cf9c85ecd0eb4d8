"""Zero-copy scan of a trace file for the TUI's first frame.

:class:`memrec.trace.reader.TraceReader` decodes every record through msgpack, which copies each
column's bytes (for 10 million events, 600 MiB of fresh memory before the first frame). Here the
file is memory-mapped and the records are walked with a minimal msgpack parser that returns the
*offsets* of binary values: columnar records become numpy views of the mapping (the kernel
reads those pages only when the replay touches them); every other record (header, keyframe,
marker, process, lost, trailer) is small and is decoded by msgpack as usual.

Anything unexpected (a truncated tail, a malformed record) ends the scan with a warning, like
the reader; the caller falls back to the reader when :func:`scan` raises :class:`Unsupported`.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any
from typing import Iterator

import msgpack

from memrec.trace.format import COLUMNAR
from memrec.trace.format import decode_columns

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


class Unsupported(Exception):
    """The file cannot be mapped (a pipe, an empty file...)."""


class _Truncated(Exception):
    pass


class _Bin:
    """A binary value: where it lies in the mapping."""

    __slots__ = ("start", "end")

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end


def _parse(buf: Any, pos: int, size: int, want_bins: bool) -> tuple[Any, int]:
    """Parse one msgpack object at ``pos``; bins come back as :class:`_Bin` (when ``want_bins``)."""
    if pos >= size:
        raise _Truncated
    b = buf[pos]
    pos += 1
    if b <= 0x7F:
        return b, pos
    if 0x80 <= b <= 0x8F:
        return _map(buf, pos, size, b & 0x0F, want_bins)
    if 0x90 <= b <= 0x9F:
        return _array(buf, pos, size, b & 0x0F, want_bins)
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
            raise _Truncated
        if want_bins:
            return _Bin(pos, pos + n), pos + n
        return bytes(buf[pos : pos + n]), pos + n
    if b in (0xD9, 0xDA, 0xDB):
        n, pos = _len(buf, pos, size, {0xD9: 1, 0xDA: 2, 0xDB: 4}[b])
        return _str(buf, pos, size, n)
    if b in (0xDE, 0xDF):
        n, pos = _len(buf, pos, size, 2 if b == 0xDE else 4)
        return _map(buf, pos, size, n, want_bins)
    if b in (0xDC, 0xDD):
        n, pos = _len(buf, pos, size, 2 if b == 0xDC else 4)
        return _array(buf, pos, size, n, want_bins)
    fixed = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
             0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
    if b in fixed:
        end = pos + fixed[b]
        if end > size:
            raise _Truncated
        return msgpack.unpackb(bytes(buf[pos - 1 : end]), raw=False, strict_map_key=False), end
    if b in (0xC7, 0xC8, 0xC9):  # ext 8/16/32: skip (not used by memrec)
        n, pos = _len(buf, pos, size, {0xC7: 1, 0xC8: 2, 0xC9: 4}[b])
        return None, pos + 1 + n
    raise ValueError(f"byte {b:#x} is not msgpack")


def _len(buf: Any, pos: int, size: int, width: int) -> tuple[int, int]:
    if pos + width > size:
        raise _Truncated
    st = {1: _U8, 2: _U16, 4: _U32}[width]
    return st.unpack_from(buf, pos)[0], pos + width


def _str(buf: Any, pos: int, size: int, n: int) -> tuple[str, int]:
    if pos + n > size:
        raise _Truncated
    return bytes(buf[pos : pos + n]).decode("utf-8", "replace"), pos + n


def _map(buf: Any, pos: int, size: int, n: int, want_bins: bool) -> tuple[dict, int]:
    out = {}
    for _ in range(n):
        k, pos = _parse(buf, pos, size, want_bins)
        v, pos = _parse(buf, pos, size, want_bins)
        out[k] = v
    return out, pos


def _array(buf: Any, pos: int, size: int, n: int, want_bins: bool) -> tuple[list, int]:
    out = []
    for _ in range(n):
        v, pos = _parse(buf, pos, size, want_bins)
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
    except _Truncated:
        return None, pos


def scan(path: str, data_start: int, schema: Any, warnings: list[str]) -> Iterator[tuple[str, Any]]:
    """Yield ``(type, record)`` for every record after the header: columnar records as
    :class:`~memrec.trace.format.ColumnChunk` views of the mapping, others decoded.

    Raises:
        Unsupported: the file cannot be memory-mapped.
    """
    try:
        f = open(path, "rb")
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        finally:
            f.close()
    except (OSError, ValueError) as error:
        raise Unsupported(str(error)) from None
    view = memoryview(mm)
    size = len(mm)
    pos = data_start
    count = 0
    while pos < size:
        start = pos
        try:
            kind, _ = _skip_or_type(view, pos, size)
            if kind in COLUMNAR:
                obj, pos = _parse(view, pos, size, True)
                wire = {
                    "type": kind,
                    "n": obj.get("n"),
                    "columns": {name: view[v.start : v.end] for name, v in (obj.get("columns") or {}).items() if isinstance(v, _Bin)},
                }
                for key in ("ipc_index", "ipc"):
                    v = obj.get(key)
                    if isinstance(v, _Bin):
                        wire[key] = bytes(view[v.start : v.end])
                try:
                    yield kind, decode_columns(wire, schema)
                except Exception as error:  # a malformed chunk: skip it, say so
                    warnings.append(f"byte {start}: {error}")
            else:  # small records (a keyframe can hold a big flat list): msgpack's own parser
                mm.seek(start)
                up = msgpack.Unpacker(mm, raw=False, strict_map_key=False, max_buffer_size=1 << 30, read_size=1 << 16)
                try:
                    obj = up.unpack()
                except msgpack.OutOfData:
                    raise _Truncated from None
                pos = start + up.tell()
                if isinstance(obj, dict) and isinstance(obj.get("type"), str):
                    yield obj["type"], obj
        except _Truncated:
            warnings.append(f"truncated tail after {count} records ({size - start} bytes at byte {start} skipped)")
            return
        except (ValueError, msgpack.UnpackException) as error:
            warnings.append(f"corrupt trace after {count} records at byte {start} ({error}); the rest is skipped")
            return
        count += 1
