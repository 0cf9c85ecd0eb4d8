"""The column codec of trace format 2: a columnar chunk as one Zstandard frame.

Format 1 stored each column as its raw little-endian bytes (66 bytes per event). Format 2 keeps the
columns apart but encodes each one so that a general-purpose compressor finds little left to do:

* **delta** where that narrows a column (timestamps, pointers that walk a heap): the first value,
  then the differences;
* **frame of reference**: the column's (or the differences') minimum is stored once and every value
  as its offset from it, in the fewest bytes that hold the largest offset (0, 1, 2, 4 or 8): a
  constant column (``result`` = 0, ``gpu`` = 3) takes no bytes at all;
* the rare ``ipc`` bytes stay sparse, as in format 1 (their row indices, then 64 bytes each);

and the whole chunk is then one Zstandard frame (``zstandard``, the reference library's binding)
with its content checksum, so that a damaged byte in a chunk is found, not decoded into events.
All arithmetic is modulo 2^64, so every integer column round-trips exactly whatever its values.

The payload (what the frame decompresses to); *varint* is an unsigned LEB128 integer, *zigzag*
a signed 64-bit value as a varint (0, -1, 1, -2... as 0, 1, 2, 3...); blocks are little-endian::

    n (varint: rows, the same as the record's ``n``), k (varint: rows with ipc bytes)
    per column, in the order of the header's column schema for this record type (``ipc`` left out):
        code (u1: transform << 4 | width code), base (zigzag), first (zigzag; delta columns only)
    per column: its block: n values (raw) or n - 1 differences (delta), ``width`` bytes each
    k row indices (u4), then k × 64 ipc bytes (events only)

A value is ``base + stored`` (raw), or ``first`` followed by the running sum of ``base + stored``
(delta), all modulo 2^64, then taken as the column's dtype (its low bytes).

``decode_payload`` checks every length against ``n`` before it allocates, so a damaged chunk is
refused (:class:`~memrec._errors.TraceFormatError`) rather than decoded into nonsense or memory.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from memrec._errors import TraceFormatError

#: Column transforms (the high nibble of a column's code).
RAW = 0
DELTA = 1
#: Bytes per stored value; a code's low nibble is one of these.
WIDTHS = (0, 1, 2, 4, 8)
#: The Zstandard level the writer uses. Measured on 1M events (2026-12-01, CPU time): level 3
#: gives 1.16 B/event on bench_tui.py's events at 16.2M events/s and 15.4 on bench_trace.py's
#: random ones at 11.3M/s; level 1 gives 1.31 and 15.8 at 19.1M/s and 16.9M/s.
LEVEL = 3

_MASK = (1 << 64) - 1
_U64 = np.uint64
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    """One compressor per thread: a zstd context is not thread-safe, and is reused (not made per chunk)."""
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=LEVEL, write_checksum=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def _width(span: int) -> int:
    for w in WIDTHS:
        if span < 1 << (8 * w):
            return w
    return 8


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _zigzag(value: int) -> bytes:
    """A value given as its 64-bit pattern, read as signed, zigzag-encoded as a varint."""
    value &= _MASK
    if value >= 1 << 63:
        value -= 1 << 64
    return _varint(value << 1 if value >= 0 else ((-value) << 1) - 1)


class _Cursor:
    """Reads the payload's varints, refusing what runs past its end or past 64 bits."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def varint(self) -> int:
        value = shift = 0
        while True:
            if self.pos >= len(self.data) or shift > 63:
                raise TraceFormatError("column data ends inside its directory")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    def zigzag(self) -> int:
        z = self.varint()
        return ((z >> 1) if not z & 1 else -((z + 1) >> 1)) & _MASK

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise TraceFormatError("column data ends inside its directory")
        self.pos += 1
        return self.data[self.pos - 1]


def _encode_column(col: np.ndarray) -> tuple[bytes, bytes]:
    """(directory entry, block) of one integer column."""
    signed = col.dtype.kind == "i"
    v = col.astype(np.int64 if signed else _U64, copy=False)
    n = len(v)
    lo, hi = (int(v.min()), int(v.max())) if n else (0, 0)
    transform, width, base, first, values = RAW, _width(hi - lo), lo, 0, v
    if n > 2 and width:
        u = v.view(_U64)
        d = (u[1:] - u[:-1]).view(np.int64)
        dlo, dhi = int(d.min()), int(d.max())
        dwidth = _width(dhi - dlo)
        if dwidth < width:
            transform, width, base, first, values = DELTA, dwidth, dlo, int(u[0]), d
    entry = bytes([transform << 4 | WIDTHS.index(width)]) + _zigzag(base)
    if transform == DELTA:
        entry += _zigzag(first)
    if not width:
        return entry, b""
    stored = values.view(_U64) - _U64(base & _MASK)  # wraps modulo 2^64: exact for every span
    return entry, stored.astype(f"<u{width}").tobytes()


def encode_payload(columns: list[np.ndarray], ipc_index: np.ndarray | None = None, ipc: bytes = b"") -> bytes:
    """One compressed chunk of ``columns`` (equal lengths, schema order) and its sparse ipc rows."""
    k = 0 if ipc_index is None else len(ipc_index)
    entries = [_varint(len(columns[0]) if columns else 0), _varint(k)]
    blocks = []
    for col in columns:
        entry, block = _encode_column(col)
        entries.append(entry)
        blocks.append(block)
    if k:
        blocks.append(np.asarray(ipc_index, dtype="<u4").tobytes())
        blocks.append(bytes(ipc))
    return _compressor().compress(b"".join(entries + blocks))


def payload_bound(n: int, ncols: int, sparse: bool) -> int:
    """The most bytes a valid payload of ``n`` rows and ``ncols`` columns decompresses to."""
    return 20 + ncols * (21 + 8 * n) + (n * 68 if sparse else 0)


def decode_payload(
    data: bytes | memoryview, n: int, dtypes: list[np.dtype | None], *, sparse: bool
) -> tuple[list[np.ndarray | None], np.ndarray | None, bytes]:
    """Decode one compressed chunk of ``n`` rows.

    ``dtypes``: per column in schema order, the dtype to decode it into (None: a column this
    version does not know, skipped). Returns the columns (new contiguous arrays), the ipc row
    indices (u4, or None) and their 64-byte rows.

    Raises:
        TraceFormatError: not a Zstandard frame, or lengths that do not match ``n``.
    """
    try:
        raw = decompress(data, payload_bound(n, len(dtypes), sparse))
    except TraceFormatError as error:
        raise TraceFormatError(f"column data {error}") from None
    buf = memoryview(raw)
    cursor = _Cursor(buf)
    rows, k = cursor.varint(), cursor.varint()
    if rows != n:
        raise TraceFormatError(f"column data holds {rows} rows, the record says {n}")
    if k > n or (k and not sparse):
        raise TraceFormatError(f"{k} ipc rows for {n} rows")
    entries = []
    sizes = []
    for _ in dtypes:
        code = cursor.byte()
        transform, wcode = code >> 4, code & 0x0F
        if transform not in (RAW, DELTA) or wcode >= len(WIDTHS):
            raise TraceFormatError(f"unknown column code {code:#x}")
        base = cursor.zigzag()
        first = cursor.zigzag() if transform == DELTA else 0
        entries.append((code, base, first))
        sizes.append((n - 1 if transform == DELTA and n else n) * WIDTHS[wcode])
    expected = cursor.pos + sum(sizes) + k * 68
    if len(raw) != expected:
        raise TraceFormatError(f"column data has {len(raw)} bytes where {n} rows take {expected}")
    out: list[np.ndarray | None] = []
    pos = cursor.pos
    for (code, base, first), size, dtype in zip(entries, sizes, dtypes):
        if dtype is not None:
            out.append(_decode_column(buf[pos : pos + size], n, code, base, first, dtype))
        else:
            out.append(None)
        pos += size
    if not k:
        return out, None, b""
    index = np.frombuffer(buf[pos : pos + 4 * k], dtype="<u4").copy()
    pos += 4 * k
    if int(index.max()) >= n:
        raise TraceFormatError("an ipc index is out of range")
    return out, index, bytes(buf[pos : pos + 64 * k])


def _decode_column(block: memoryview, n: int, code: int, base: int, first: int, dtype: np.dtype) -> np.ndarray:
    """One column, computed in the unsigned type of its own width: arithmetic modulo 2^(8·size)
    gives the low bytes of the modulo-2^64 values, which are the values (no 8-byte temporary).

    A constant column comes back as a read-only broadcast view of its one value (no memory).
    """
    transform, width = code >> 4, WIDTHS[code & 0x0F]
    unsigned = np.dtype(f"<u{dtype.itemsize}")
    mask = (1 << (8 * dtype.itemsize)) - 1
    if transform == RAW and not width:
        return np.broadcast_to(np.array(base & mask, dtype=unsigned).view(dtype), (n,))
    out = np.empty(n, dtype=unsigned)
    if not n:
        return out.view(dtype)
    if transform == DELTA and not width:  # a constant step: first, first + base, ...
        np.multiply(np.arange(n, dtype=unsigned), unsigned.type(base & mask), out=out)
        out += unsigned.type(first & mask)
        return out.view(dtype)
    body = out if transform == RAW else out[1:]
    if transform == DELTA:
        out[0] = first & mask
    if len(body):
        stored = np.frombuffer(block, dtype=f"<u{width}")
        if width > dtype.itemsize:
            stored = stored.astype(unsigned)  # (a narrower column than its values: wraps)
        np.add(stored, unsigned.type(base & mask), out=body, casting="unsafe")
    if transform == DELTA:
        np.cumsum(out, dtype=unsigned, out=out)
    return out.view(dtype)


def compress(data: bytes) -> bytes:
    """One Zstandard frame (with its checksum) of ``data``: a keyframe's packed state."""
    return _compressor().compress(data)


def decompress(data: bytes | memoryview, limit: int) -> bytes:
    """The bytes of one Zstandard frame, refused past ``limit`` bytes.

    Raises:
        TraceFormatError: not a Zstandard frame, damaged, or larger than ``limit``.
    """
    try:
        out = _decompressor().decompress(data, max_output_size=limit)
    except zstandard.ZstdError as error:
        raise TraceFormatError(f"does not decompress ({error})") from None
    if len(out) > limit:
        raise TraceFormatError(f"decompresses to more than {limit} bytes")
    return out
