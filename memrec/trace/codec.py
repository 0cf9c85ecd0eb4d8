"""The column codec of trace format 2: a columnar chunk as one payload, compressed or raw.

Format 1 stored each column as its raw little-endian bytes (66 bytes per event). Format 2 keeps the
columns apart but encodes each one so that a general-purpose compressor finds little left to do:

* **delta** where that narrows a column (timestamps, pointers that walk a heap): the first value,
  then the differences;
* **frame of reference**: the column's (or the differences') minimum is stored once and every value
  as its offset from it, in the fewest bytes that hold the largest offset (0, 1, 2, 4 or 8): a
  constant column (``result`` = 0, ``gpu`` = 3) takes no bytes at all;
* the rare ``ipc`` bytes stay sparse (their row indices, then their bytes);

and the whole chunk is then one Zstandard frame (``zstandard``, the reference library's binding)
with its content checksum, so that a damaged byte in a chunk is found, not decoded into events.
All arithmetic is modulo 2^64, so every integer column round-trips exactly whatever its values.

Minor 1 (2.1) is for the chunks the recorder writes at low event rates (a flush every 200 ms: a
few rows each), where the frame's own bytes and a column's directory entry cost more than its
values. A chunk's payload is stored raw with a CRC-32 (key ``r``) when that is smaller than its
frame (``c``); all-zero columns leave the directory (a bitmap says which are present), a base of 0
is left out, and a chunk of up to :data:`LEAN_ROWS` rows may store a column as varints, as packed
bits or shifted (aligned sizes and pointers); the ipc section stores each distinct row once
(an IPC_OPEN's bytes are its IPC_EXPORT's) without its zero bytes. Each chunk stays self-contained.
``docs/format.md`` is the spec of both payloads; format 2.0's (key ``z``) is still read.

Minor 3 (2.3) adds one transform, **context** (:data:`CONTEXT`), for columns whose value follows
from the previous row *of the same process* rather than from the row before: on a host with many
processes their events interleave, and a pointer is close to the last pointer of its own process
(and an allocation's to the end of that process's previous block), not to another process's. The
rows are grouped by the values of key columns (``pid`` and ``kind`` for events); each row is
predicted from the previous row of its group (plus, optionally, that row's value in another
column: ``size`` for ``ptr``) and stored as the zigzag of the difference; each group's first
value is stored once. On 16 processes holding 1M live allocations this took the pointers from
4.5 to about 1.5 bytes an event (issue 26, ``bench/bench_realistic.py``).

``decode_payload`` checks every length against ``n`` before it allocates, so a damaged chunk is
refused (:class:`~memrec.base.errors.TraceFormatError`) rather than decoded into nonsense or memory.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any
import zlib

import numpy as np
import zstandard

from memrec.base.errors import TraceFormatError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see memrec.TYPE_CHECKING)

if TYPE_CHECKING:
    from memrec.trace.budget import ReadBudget

#: Column transforms (the high nibble of a column's code; bits 4-5 since 2.1).
RAW = 0
DELTA = 1
#: A 2.1 transform: the values of an earlier column of the chunk (its index, u1, follows the code)
#: plus ``base + stored`` (``tid`` is mostly ``pid``, ``gpu`` mostly ``ordinal``).
REF = 2
#: A 2.3 transform: the value of the previous row with the same values in the key columns, plus
#: (optionally) that row's value in a "plus" column, plus ``base + (zigzag⁻¹(stored) << shift)``;
#: each group's first value is stored apart (:class:`Context`).
CONTEXT = 3
#: Bytes per stored value; a code's low nibble is one of these (an index into it), or VARINT.
WIDTHS = (0, 1, 2, 4, 8)
#: The width code of a column stored as LEB128 values (since 2.1).
VARINT = len(WIDTHS)
#: Width codes BITS + b (b = 1..7, since 2.1): b bits per value, packed least significant first.
BITS = VARINT
CODES = BITS + 8
#: The most rows of a chunk whose columns the writer considers storing as LEB128, packed bits,
#: shifted or as references: those save the few bytes that matter in a chunk of a few rows (a
#: 200 ms flush), but decode slower than fixed widths, which Zstandard compresses better in a
#: large chunk (1M events of bench_tui.py, chunks of 65,536 rows, 2026-12-01: 0.56 B/event and
#: 0.16-0.20 s of CPU to load with them in every chunk, 0.48 B/event and 0.035-0.065 s without).
LEAN_ROWS = 256
#: A code bit (since 2.1): the column's base is 0 and left out of the directory.
ZERO_BASE = 0x80
#: A code bit (since 2.1): a shift s (u1) follows, and a stored value stands for stored << s
#: (sizes and pointers aligned to 2 MiB lose their 21 zero bits).
SHIFTED = 0x40
#: The entry of a column whose values are all 0, left out of a 2.1 directory (its bit in the
#: directory's bitmap is clear).
ABSENT = bytes([ZERO_BASE])
#: Record keys of a chunk's bytes: the 2.0 payload as a Zstandard frame; since 2.1, the 2.1
#: payload as a Zstandard frame, or as it is followed by its CRC-32 (little-endian u4).
ZSTD_V20 = "z"
ZSTD = "c"
RAW_PAYLOAD = "r"
KEYS = (ZSTD_V20, ZSTD, RAW_PAYLOAD)
#: The Zstandard level the writer uses. Measured on 1M events (2026-12-01, CPU time): level 3
#: gives 1.16 B/event on bench_tui.py's events at 16.2M events/s and 15.4 on bench_trace.py's
#: random ones at 11.3M/s; level 1 gives 1.31 and 15.8 at 19.1M/s and 16.9M/s.
LEVEL = 3

_MASK = (1 << 64) - 1
_U64 = np.uint64
_U64_DTYPE = np.dtype("<u8")
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    """One compressor per thread: a zstd context is not thread-safe, and is reused (not made per chunk)."""
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=LEVEL, write_checksum=True)
    return c


def _scratch(n: int, slot: int) -> np.ndarray:
    """A u8 array of ``n`` values for temporary use (one of three per thread, kept between
    chunks): a fresh 512 KiB array is mapped by the kernel page by page at its first touch, which
    cost more than the arithmetic done in it (most of a 65,536-row context column's decoding)."""
    bufs = getattr(_local, "scratch", None)
    if bufs is None or len(bufs[0]) < n:
        bufs = _local.scratch = [np.empty(max(n, 1 << 16), _U64) for _ in range(3)]
    return bufs[slot][:n]


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

    def take(self, size: int) -> bytes:
        if self.pos + size > len(self.data):
            raise TraceFormatError("column data ends inside its directory")
        self.pos += size
        return bytes(self.data[self.pos - size : self.pos])

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise TraceFormatError("column data ends inside its directory")
        self.pos += 1
        return self.data[self.pos - 1]


_VARINT_LIMITS = np.array([1 << bits for bits in range(7, 64, 7)], _U64)


def _varint_sizes(values: np.ndarray) -> np.ndarray:
    """The LEB128 length of each u8 value (1 to 10 bytes)."""
    return np.searchsorted(_VARINT_LIMITS, values, side="right").astype(np.uint8) + np.uint8(1)


def _varints(values: np.ndarray, sizes: np.ndarray) -> bytes:
    """``values`` (u8) as consecutive LEB128 integers of the given ``sizes``."""
    out = np.empty(int(sizes.sum(dtype=np.int64)), np.uint8)
    at = np.cumsum(sizes, dtype=np.int64) - sizes
    for j in range(int(sizes.max())):
        more = sizes > j
        byte = (values[more] >> _U64(7 * j)) & _U64(0x7F) | np.where(sizes[more] > j + 1, _U64(0x80), _U64(0))
        out[at[more] + j] = byte
    return out.tobytes()


def _bases(forms: list, lean: bool) -> list:
    """(transform, values, first or reference, base) to try: each form's minimum as its base,
    and in a small chunk also 0 (no base in the directory: LEB128 values that are small anyway,
    e.g. time steps)."""
    out = []
    for transform, values, first in forms:
        lo = int(values.view(np.int64).min()) if len(values) else 0
        out.append((transform, values, first, lo))
        if lean and lo > 0:
            out.append((transform, values, first, 0))
    return out


def _as_u64(col: np.ndarray) -> np.ndarray:
    """A column's values as their 64-bit patterns (signed ones sign-extended)."""
    return col.astype(np.int64 if col.dtype.kind == "i" else _U64, copy=False).view(_U64)


def _nearest(values: np.ndarray, i: int, allowed: np.ndarray | None = None) -> list[tuple[int, np.ndarray]]:
    """The earlier column (index, values) whose differences from column ``i`` span the least
    (``values``: every column's u8 values, one per row of a 2-D array; ``allowed``: the columns
    that may be referred to, every one when None), or none for the first."""
    if not i or not values.shape[1] or (allowed is not None and not allowed[:i].any()):
        return []
    diffs = (values[i] - values[:i]).view(np.int64)  # modulo 2^64
    spans = (diffs.max(axis=1) - diffs.min(axis=1)).view(_U64)  # exact: the true span is < 2^64
    if allowed is not None:
        spans = np.where(allowed[:i], spans, _U64(_MASK))
    j = int(np.argmin(spans))
    return [(j, values[j])]


@dataclasses.dataclass(frozen=True)
class Context:
    """What a writer lets the codec try the 2.3 context transform with, by column index: rows
    grouped by their values in the ``keys`` columns; ``plus`` pairs (column, plus column): the
    plus column's value at the group's previous row is added to the prediction (an allocation
    starts near where its process's previous one ended: ``ptr`` and ``size``); ``columns``: the
    columns to try it on (never a key or a plus column)."""

    keys: tuple[int, ...]
    columns: tuple[int, ...]
    plus: tuple[tuple[int, int], ...] = ()


#: The most distinct combined key codes grouped by one radix sort (a u2 code); past it a lexsort.
_RADIX = 1 << 16


@dataclasses.dataclass
class Groups:
    """Rows grouped by key (:func:`groups`): ``order`` takes them group after group (ascending
    key), each group in row order; ``starts`` marks, in that order, each group's first row."""

    order: np.ndarray
    starts: np.ndarray

    @functools.cached_property
    def heads(self) -> np.ndarray:
        """Where each group starts, in ``order``."""
        return np.flatnonzero(self.starts)

    @functools.cached_property
    def later(self) -> np.ndarray:
        """In ``order``: every row but a group's first."""
        return ~self.starts


def groups(keys: list[np.ndarray]) -> Groups:
    """Rows grouped by their values in the ``keys`` columns (u8 values, equal lengths, at least
    one row), in ascending order of those values (the first key the most significant).

    One stable sort of a u2 code (numpy sorts those by radix: O(n)) when the keys' spans multiply
    to at most 2^16, as a chunk's pids and kinds do; else the keys are factorised first, and
    lexsorted when even their factors do not fit one u2 code."""
    n = len(keys[0])
    codes = []
    tops = []
    for key in keys:
        code = np.subtract(key, key.min(), out=_scratch(n, 0))
        top = int(code.max()) + 1
        if top > _RADIX:
            code = np.unique(key, return_inverse=True)[1].ravel()
            top = int(code.max()) + 1
        codes.append(code.astype(np.uint16) if top <= _RADIX else code)
        tops.append(top)
    starts = np.ones(n, bool)
    if np.prod(tops, dtype=object) <= _RADIX:
        combined = codes[0]
        for code, top in zip(codes[1:], tops[1:]):
            combined *= np.uint16(top)  # (in place: the product fits 16 bits)
            combined += code
        order = np.argsort(combined, kind="stable")
        ordered = combined[order]
        starts[1:] = ordered[1:] != ordered[:-1]
        return Groups(order, starts)
    order = np.lexsort(codes[::-1])
    starts[1:] = False
    for code in codes:
        ordered = code[order]
        starts[1:] |= ordered[1:] != ordered[:-1]
    return Groups(order, starts)


def _context(u: np.ndarray, grouped: Groups, plus: np.ndarray | None, head: bytes) -> tuple:
    """Column ``u`` (u8 values) as a form :func:`_encode_column` weighs: (CONTEXT, the zigzag of
    each row's difference from its prediction shifted right by their common trailing zero bits,
    every row but each group's first, (``head``: the entry's bytes after its code, the firsts'
    bytes, the shift)). Zigzag: a process's next block is mostly
    a little after its last (a small positive difference), a freed one anywhere in its range."""
    ordered = u[grouped.order]  # group after group, each in row order
    diffs = np.empty_like(ordered)
    diffs[1:] = ordered[1:] - ordered[:-1]  # modulo 2^64
    if plus is not None:
        diffs[1:] -= plus[grouped.order][:-1]
    firsts = b"".join(_zigzag(v) for v in ordered[grouped.starts].tolist())
    signed = diffs[grouped.later].view(np.int64)
    ones = int(np.bitwise_or.reduce(signed)) if len(signed) else 0
    shift = (ones & -ones).bit_length() - 1 if ones else 0
    if shift:
        signed = signed >> np.int64(shift)
    return CONTEXT, ((signed << np.int64(1)) ^ (signed >> np.int64(63))).view(_U64), (head, firsts, shift)  # zigzag


def _encode_column(u: np.ndarray, earlier: list[tuple[int, np.ndarray]], context: tuple | None = None) -> tuple[bytes, bytes]:
    """(directory entry, block) of one integer column (its :func:`_as_u64` values): of the raw,
    delta, (``earlier``: an earlier column and its values, in a small chunk) reference and
    (``context``: :func:`_context`'s arguments after ``u``) context forms, each with fixed-width,
    LEB128 or packed values, the one of fewest bytes (on a tie the first tried)."""
    n = len(u)
    forms = [(RAW, u, 0)]
    if n > 2:
        forms.append((DELTA, u[1:] - u[:-1], int(u[0])))  # modulo 2^64
    forms += [(REF, u - e, j) for j, e in earlier]  # e.g. tid = pid, gpu = ordinal
    if context is not None:
        forms.append(_context(u, *context))
    best = None
    for transform, values, first, lo in _bases(forms, n <= LEAN_ROWS):
        stored = values - _U64(lo & _MASK)  # wraps modulo 2^64: exact for every span
        head = transform << 4 | (0 if lo & _MASK else ZERO_BASE)
        ahead, prefix, shifts = (bytes([first]), b"", [0]) if transform == REF else (b"", b"", [0])
        if transform == CONTEXT:  # shifted before its zigzag: stored as it is
            ahead, prefix, shift = first
            shifts = [shift]
        entry = bytes([head]) + ahead
        entry += (b"" if head & ZERO_BASE else _zigzag(lo)) + (_zigzag(first) if transform == DELTA else b"")
        if n <= LEAN_ROWS and len(values) and transform != CONTEXT:
            ones = int(np.bitwise_or.reduce(stored))
            if ones:
                shifts.append((ones & -ones).bit_length() - 1)
        for shift in dict.fromkeys(shifts):
            shifted = stored >> _U64(shift) if shift and transform != CONTEXT else stored
            span = int(shifted.max()) if len(values) else 0
            width = _width(span)
            candidates = [(len(values) * width, WIDTHS.index(width))]
            if n <= LEAN_ROWS and width == 1:
                bits = span.bit_length()
                candidates.append(((len(values) * bits + 7) // 8, BITS + bits))
            elif n <= LEAN_ROWS and width >= 2:
                candidates.append((int(_varint_sizes(shifted).sum(dtype=np.int64)), VARINT))
            for size, wcode in candidates:
                coded = bytes([entry[0] | wcode | (SHIFTED if shift else 0)]) + entry[1:] + (bytes([shift]) if shift else b"")
                if best is None or len(coded) + len(prefix) + size < best[0]:
                    best = (len(coded) + len(prefix) + size, coded, prefix, shifted, wcode)
    _, entry, prefix, stored, wcode = best
    if wcode == VARINT:
        return entry, prefix + _varints(stored, _varint_sizes(stored))
    if wcode > BITS:
        planes = (stored[:, None] >> np.arange(wcode - BITS, dtype=_U64)) & _U64(1)
        return entry, prefix + np.packbits(planes.astype(np.uint8), bitorder="little").tobytes()
    width = WIDTHS[wcode]
    return entry, prefix + (stored.astype(f"<u{width}").tobytes() if width else b"")


def encode_payload(columns: list[np.ndarray], ipc_index: np.ndarray | None = None, ipc: bytes = b"",
                   context: Context | None = None) -> tuple[str, bytes]:
    """One chunk of ``columns`` (equal lengths, schema order) and its sparse ipc rows, as
    ``(record key, bytes)``: a Zstandard frame (``"c"``), or the payload and its CRC-32 (``"r"``)
    when compression does not pay (a chunk of a few rows: the frame's own bytes cost more).
    ``context``: the columns to try the 2.3 context transform on, and its keys (None: not tried)."""
    n = len(columns[0]) if columns else 0
    k = 0 if ipc_index is None else len(ipc_index)
    entries = []
    blocks = []
    present = 0
    values = np.stack([_as_u64(col) for col in columns]) if columns else np.zeros((0, 0), _U64)
    trial: dict[int, tuple] = {}
    referable = np.ones(len(columns), bool)  # columns a reference form may refer to
    if context is not None and n > 1:
        grouped = groups([values[j] for j in context.keys])
        plus = dict(context.plus)
        head = bytes([len(context.keys), *context.keys])
        for i in context.columns:
            if i > max(context.keys) and i not in plus.values():
                trial[i] = (grouped, values[plus[i]] if i in plus else None, head + bytes([plus.get(i, -1) + 1]))
    for i, u in enumerate(values):
        entry, block = _encode_column(u, _nearest(values, i, referable) if n <= LEAN_ROWS else [], trial.get(i))
        if entry[0] >> 4 & 3 == CONTEXT:
            referable[i] = False  # decoded after the others
        if entry != ABSENT:
            present |= 1 << i
            entries.append(entry)
        blocks.append(block)
    entries[:0] = [_varint(n), _varint(k), present.to_bytes((len(columns) + 7) // 8, "little")]
    if k:
        blocks.append(_encode_ipc(n, np.asarray(ipc_index), bytes(ipc)))
    payload = b"".join(entries + blocks)
    frame = _compressor().compress(payload)
    if len(frame) < len(payload) + 4:
        return ZSTD, frame
    return RAW_PAYLOAD, payload + zlib.crc32(payload).to_bytes(4, "little")


def _encode_ipc(n: int, index: np.ndarray, ipc: bytes) -> bytes:
    """The ipc section: distinct rows once each, their zero bytes left out (module docstring)."""
    rows = np.frombuffer(ipc, np.uint8).reshape(-1, 64)
    distinct, first, which = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    if len(distinct) == len(rows):
        distinct, which = rows, None
    else:  # in order of first appearance (deterministic either way)
        order = np.argsort(first)
        distinct = distinct[order]
        which = np.argsort(order)[which.ravel()]
    nonzero = distinct != 0
    masks = np.packbits(nonzero, axis=1, bitorder="little")
    parts = [_varint(len(distinct)), index.astype(_small(n)).tobytes()]
    if which is not None:
        parts.append(which.astype(_small(len(distinct))).tobytes())
    parts += [masks.tobytes(), distinct[nonzero].tobytes()]
    return b"".join(parts)


def _small(count: int) -> str:
    """The index dtype of a table of ``count`` entries: u1 up to 256, else u2 (a chunk's rows fit)."""
    return "u1" if count <= 256 else "<u2"


def payload_bound(n: int, ncols: int, sparse: bool) -> int:
    """The most bytes a valid payload of ``n`` rows and ``ncols`` columns decompresses to."""
    return 30 + ncols * (23 + ncols + 10 * n) + (n * 76 if sparse else 0)


def decode_payload(
    key: str, data: bytes | memoryview, n: int | None, dtypes: list[np.dtype | None], *, sparse: bool, max_rows: int,
    budget: ReadBudget | None = None,
) -> tuple[int, list[np.ndarray | None], np.ndarray | None, bytes]:
    """Decode one chunk stored under record key ``key`` (:data:`KEYS`).

    ``n``: the rows the record says it holds (a 2.1 record need not say: None), at most
    ``max_rows`` in any case. ``dtypes``: per column in schema order, the dtype to decode it
    into (None: a column this version does not know, skipped). Returns the rows, the columns
    (new contiguous arrays), the ipc row indices (u4, or None) and their 64-byte rows.
    ``budget``: the read's (:mod:`memrec.trace.budget`), charged the payload's bytes and rows
    before any column is made.

    Raises:
        OverBudget: past ``budget``.
        TraceFormatError: not a Zstandard frame, a failed checksum, or lengths that do not
            match ``n``.
    """
    if key == RAW_PAYLOAD:
        raw = bytes(data)
        if len(raw) < 4 or zlib.crc32(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise TraceFormatError("column data fails its checksum")
        raw = raw[:-4]
    else:
        try:
            raw = decompress(data, payload_bound(max_rows if n is None else n, len(dtypes), sparse))
        except TraceFormatError as error:
            raise TraceFormatError(f"column data {error}") from None
    if budget is not None:
        budget.spend(nbytes=len(raw))
    lean = key != ZSTD_V20
    buf = memoryview(raw)
    cursor = _Cursor(buf)
    rows, k = cursor.varint(), cursor.varint()
    if n is not None and rows != n:
        raise TraceFormatError(f"column data holds {rows} rows, the record says {n}")
    if rows > max_rows:
        raise TraceFormatError(f"column data holds {rows} rows (at most {max_rows})")
    if budget is not None:
        budget.spend(rows=rows)
    n = rows
    if k > n or (k and not sparse):
        raise TraceFormatError(f"{k} ipc rows for {n} rows")
    present = -1
    if lean:
        size = (len(dtypes) + 7) // 8
        present = int.from_bytes(cursor.take(size), "little")
    entries = _directory(cursor, present, len(dtypes), lean)
    needed = {entry[3] for entry in entries if entry[0] == REF}
    for entry in entries:
        if entry[0] == CONTEXT:
            needed.update(entry[3][0])
            needed.add(entry[3][1])
    full: list[np.ndarray | None] = []  # each column's 64-bit values, when another one needs them
    out: list[np.ndarray | None] = []
    grouped: dict[tuple[int, ...], Groups] = {}
    later: list[tuple[int, Groups, np.ndarray, np.ndarray, int]] = []  # context columns, decoded last
    for i, ((transform, wcode, base, first, shift), dtype) in enumerate(zip(entries, dtypes)):
        count = n - 1 if transform == DELTA and n else n
        if transform == CONTEXT:
            keys = first[0]
            if keys not in grouped:
                grouped[keys] = groups([full[j] for j in keys]) if n else Groups(np.zeros(0, np.intp), np.zeros(0, bool))
            firsts, cursor.pos = _read_varints(buf, cursor.pos, len(grouped[keys].heads))
            count = n - len(firsts)
        if wcode == VARINT:
            stored, cursor.pos = _read_varints(buf, cursor.pos, count)
        elif wcode > BITS:
            stored, cursor.pos = _read_bits(buf, cursor.pos, count, wcode - BITS)
        else:
            size = count * WIDTHS[wcode]
            if cursor.pos + size > len(buf):
                raise TraceFormatError(f"column data has {len(buf)} bytes, too few for {n} rows")
            stored = np.frombuffer(buf[cursor.pos : cursor.pos + size], dtype=f"<u{WIDTHS[wcode]}") if size else None
            cursor.pos += size
        if transform == CONTEXT:  # (its shift applies after the zigzag)
            diffs = None
            if stored is not None or base:
                diffs = _decode_column(stored, count, RAW, base, 0, _U64_DTYPE)
                diffs = _unzigzag(diffs if stored is not None else np.array(diffs))  # (a new array)
            if shift and diffs is not None:
                diffs <<= _U64(shift)
            later.append((i, grouped[keys], _unzigzag(firsts.astype(_U64)), diffs, first[1]))
            full.append(None)
            out.append(None)
            continue
        if shift and stored is not None:
            stored = stored.astype(_U64) << _U64(shift)
        if transform == REF:
            full.append(_decode_column(stored, n, RAW, base, 0, _U64_DTYPE) + full[first])  # modulo 2^64
            out.append(None if dtype is None else full[-1].astype(f"<u{dtype.itemsize}").view(dtype))
            continue
        out.append(None if dtype is None else _decode_column(stored, n, transform, base, first, dtype))
        full.append(_decode_column(stored, n, transform, base, first, _U64_DTYPE) if i in needed else None)
    for i, grouping, firsts, diffs, plus in later:
        values = _decode_context(grouping, firsts, diffs, None if plus < 0 else full[plus])
        out[i] = None if dtypes[i] is None else values.astype(f"<u{dtypes[i].itemsize}", copy=False).view(dtypes[i])
    if lean:
        index, ipc = _decode_ipc(buf, cursor, n, k)
    else:
        if len(buf) != cursor.pos + 68 * k:
            raise TraceFormatError(f"column data has {len(buf)} bytes where {n} rows take {cursor.pos + 68 * k}")
        index = np.frombuffer(buf[cursor.pos : cursor.pos + 4 * k], dtype="<u4").copy()
        ipc = bytes(buf[cursor.pos + 4 * k :])
    if not k:
        return n, out, None, b""
    if int(index.max()) >= n:
        raise TraceFormatError("an ipc index is out of range")
    return n, out, index, ipc


def transforms(key: str, data: bytes | memoryview, ncols: int, max_rows: int) -> list[int]:
    """Each column's transform (:data:`RAW`, :data:`DELTA`, :data:`REF` or :data:`CONTEXT`) in
    one 2.1+ chunk of ``ncols`` columns and at most ``max_rows`` rows stored under ``key``: which
    form the writer chose (what the tests check it chose).

    Raises:
        TraceFormatError: a damaged chunk (as :func:`decode_payload`).
    """
    raw = decompress(data, payload_bound(max_rows, ncols, True)) if key == ZSTD else bytes(data)[:-4]
    cursor = _Cursor(memoryview(raw))
    cursor.varint(), cursor.varint()
    present = int.from_bytes(cursor.take((ncols + 7) // 8), "little")
    return [entry[0] for entry in _directory(cursor, present, ncols, True)]


def _directory(cursor: _Cursor, present: int, ncols: int, lean: bool) -> list[tuple[int, int, int, Any, int]]:
    """The payload's directory: per column (transform, width code, base, first, shift); ``first``
    is a delta's first value, a reference's column, a context's (key columns, plus column or -1).
    A reference to a context column, or a context whose keys are not earlier columns of another
    form, is refused: those are decoded after every other column, from them."""
    entries = []
    for i in range(ncols):
        code = cursor.byte() if present >> i & 1 else ABSENT[0]
        transform, wcode = (code >> 4) & (0x03 if lean else 0x0F), code & 0x0F
        if transform not in ((RAW, DELTA, REF, CONTEXT) if lean else (RAW, DELTA)) or wcode >= (CODES if lean else VARINT):
            raise TraceFormatError(f"unknown column code {code:#x}")
        first: Any = cursor.byte() if transform == REF else 0
        if transform == REF and first >= i:
            raise TraceFormatError(f"column {i} refers to column {first}")
        if transform == CONTEXT:
            keys = tuple(cursor.byte() for _ in range(cursor.byte()))
            first = (keys, cursor.byte() - 1)
            if not keys or max(keys) >= i or first[1] == i or first[1] >= ncols:
                raise TraceFormatError(f"column {i} is predicted from columns {keys} and {first[1]}")
        base = 0 if lean and code & ZERO_BASE else cursor.zigzag()
        first = cursor.zigzag() if transform == DELTA else first
        shift = cursor.byte() if lean and code & SHIFTED else 0
        if shift > 63:
            raise TraceFormatError(f"a column shifted by {shift} bits")
        entries.append((transform, wcode, base, first, shift))
    for i, (transform, _, _, first, _) in enumerate(entries):
        used = [first] if transform == REF else [*first[0], first[1]] if transform == CONTEXT else []
        if any(j >= 0 and entries[j][0] == CONTEXT for j in used):
            raise TraceFormatError(f"column {i} refers to a context column")
    return entries


def _unzigzag(stored: np.ndarray) -> np.ndarray:
    """Zigzag values (u8, a new array: changed in place) as the 64-bit patterns of the signed values."""
    sign = np.bitwise_and(stored, _U64(1), out=_scratch(len(stored), 1))
    np.negative(sign, out=sign)  # (modulo 2^64: all ones for an odd value)
    stored >>= _U64(1)
    stored ^= sign
    return stored


def _decode_context(grouping: Groups, firsts: np.ndarray, diffs: np.ndarray | None, plus: np.ndarray | None) -> np.ndarray:
    """A context column's u8 values: group after group (``grouping``), each group's first value
    (``firsts``), then each row the previous row's value, plus that row's ``plus`` value, plus
    its own difference (``diffs``, of every row but the groups' first, in that same order).

    Few arrays of a chunk's length are made (each is fresh memory the kernel maps page by page:
    at 65,536 rows that is most of the cost)."""
    n = len(grouping.order)
    heads = grouping.heads
    if not n:
        return np.zeros(0, _U64)
    if diffs is None and plus is None:  # every row its group's first value (a GPU per process)
        steps = np.repeat(firsts, np.diff(heads, append=n))
    else:
        steps = _scratch(n, 0)
        steps[:] = 0
        if diffs is not None:
            steps[grouping.later] = diffs
        if plus is not None:
            steps[1:] += np.take(plus, grouping.order[:-1], out=_scratch(n - 1, 1))
        # A group's first row steps from the previous group's last value to its own first value:
        # then one running sum makes every value (mod 2^64).
        steps[heads] = 0
        if len(heads) > 1:
            ends = np.add.reduceat(steps, heads)[:-1]
            ends += firsts[:-1]  # each group's last value
            firsts = firsts.copy()
            firsts[1:] -= ends
        steps[heads] = firsts
        np.cumsum(steps, dtype=_U64, out=steps)
    out = np.empty(n, _U64)
    out[grouping.order] = steps
    return out


def _decode_ipc(buf: memoryview, cursor: _Cursor, n: int, k: int) -> tuple[np.ndarray | None, bytes]:
    """The 2.1 ipc section (see :func:`_encode_ipc`), checked to end exactly where the payload does."""
    if not k:
        if cursor.pos != len(buf):
            raise TraceFormatError(f"column data has {len(buf) - cursor.pos} bytes past its {n} rows")
        return None, b""
    u = cursor.varint()
    if not 1 <= u <= k:
        raise TraceFormatError(f"{u} distinct ipc rows for {k}")
    tables = [(_small(n), k)] + ([(_small(u), k)] if u < k else []) + [("u1", 8 * u)]
    arrays = []
    for dtype, count in tables:
        size = count * np.dtype(dtype).itemsize
        if cursor.pos + size > len(buf):
            raise TraceFormatError("column data ends inside its ipc rows")
        arrays.append(np.frombuffer(buf[cursor.pos : cursor.pos + size], dtype=dtype))
        cursor.pos += size
    index, masks = arrays[0].astype("<u4"), arrays[-1]
    nonzero = np.unpackbits(masks.reshape(u, 8), axis=1, bitorder="little").astype(bool)
    if int(nonzero.sum()) != len(buf) - cursor.pos:
        raise TraceFormatError(f"column data has {len(buf) - cursor.pos} ipc bytes where its masks take {int(nonzero.sum())}")
    rows = np.zeros((u, 64), np.uint8)
    rows[nonzero] = np.frombuffer(buf[cursor.pos :], np.uint8)
    if u < k:
        which = arrays[1]
        if int(which.max()) >= u:
            raise TraceFormatError("an ipc row refers past the distinct rows")
        rows = rows[which]
    if len(index) > 1 and not (index[1:] > index[:-1]).all():
        raise TraceFormatError("the ipc indices are not ascending")
    return index, rows.tobytes()


def _read_bits(buf: memoryview, pos: int, count: int, bits: int) -> tuple[np.ndarray, int]:
    """``count`` values of ``bits`` bits each (packed least significant first) from ``pos`` (as u1)."""
    size = (count * bits + 7) // 8
    if pos + size > len(buf):
        raise TraceFormatError("column data ends inside a column")
    planes = np.unpackbits(np.frombuffer(buf[pos : pos + size], np.uint8), count=count * bits, bitorder="little")
    weights = (1 << np.arange(bits)).astype(np.uint8)
    return (planes.reshape(count, bits) * weights).sum(axis=1, dtype=np.uint8), pos + size


def _read_varints(buf: memoryview, pos: int, count: int) -> tuple[np.ndarray, int]:
    """``count`` LEB128 values from ``pos`` (as u8, modulo 2^64) and the position after them.

    Byte j of every value at once (a gather per byte position, as many as the longest value
    has): a 2.3 chunk of 65,536 rows stores its pointers' differences this way, and a pass over
    every byte (a shift per byte, then a segmented sum) took most of such a chunk's decoding."""
    if not count:
        return np.zeros(0, _U64), pos
    data = np.frombuffer(buf[pos : pos + 10 * count], np.uint8)  # (a value takes at most 10)
    ends = np.flatnonzero(data < 0x80)
    if len(ends) < count:
        raise TraceFormatError("column data ends inside a column")
    ends = ends[:count]
    starts = np.empty(count, ends.dtype)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    longest = int((ends - starts).max()) + 1
    if longest > 10:
        raise TraceFormatError("a column value is longer than 64 bits")
    values = (data[starts] & 0x7F).astype(_U64)
    for j in range(1, longest):
        at = np.minimum(starts + j, ends)  # past a value's end: its last byte again, masked off
        byte = (data[at] & 0x7F).astype(_U64) * (starts + j <= ends)
        values |= byte << _U64(7 * j)
    return values, pos + int(ends[-1]) + 1


def _decode_column(stored: np.ndarray | None, n: int, transform: int, base: int, first: int, dtype: np.dtype) -> np.ndarray:
    """One column from its stored values (None: width 0), computed in the unsigned type of its
    own width: arithmetic modulo 2^(8·size) gives the low bytes of the modulo-2^64 values, which
    are the values (no 8-byte temporary).

    A constant column comes back as a read-only broadcast view of its one value (no memory).
    """
    unsigned = np.dtype(f"<u{dtype.itemsize}")
    mask = (1 << (8 * dtype.itemsize)) - 1
    if transform == RAW and stored is None:
        return np.broadcast_to(np.array(base & mask, dtype=unsigned).view(dtype), (n,))
    out = np.empty(n, dtype=unsigned)
    if not n:
        return out.view(dtype)
    if transform == DELTA and stored is None:  # a constant step: first, first + base, ...
        np.multiply(np.arange(n, dtype=unsigned), unsigned.type(base & mask), out=out)
        out += unsigned.type(first & mask)
        return out.view(dtype)
    body = out if transform == RAW else out[1:]
    if transform == DELTA:
        out[0] = first & mask
    if len(body):
        if stored.itemsize > dtype.itemsize:
            stored = stored.astype(unsigned)  # (a narrower column than its values: wraps)
        np.add(stored, unsigned.type(base & mask), out=body, casting="unsafe")
    if transform == DELTA:
        np.cumsum(out, dtype=unsigned, out=out)
    return out.view(dtype)


def compress(data: bytes) -> bytes:
    """One Zstandard frame (with its checksum) of ``data``: a keyframe's packed state."""
    return _compressor().compress(data)


class TooLarge(TraceFormatError):
    """A Zstandard frame that decompresses to more than the caller's limit."""


def decompress(data: bytes | memoryview, limit: int) -> bytes:
    """The bytes of one Zstandard frame, refused past ``limit`` bytes before they are allocated.

    A frame that declares its size is checked against ``limit`` first: zstandard allocates the
    declared size whatever ``max_output_size`` says (a 33 KB file declared gigabytes).

    Raises:
        TooLarge: the frame decompresses (or says it does) to more than ``limit`` bytes.
        TraceFormatError: not a Zstandard frame, or damaged.
    """
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as error:
        raise TraceFormatError(f"does not decompress ({error})") from None
    if declared > limit:
        raise TooLarge(f"decompresses to {declared} bytes, more than {limit}")
    try:
        out = _decompressor().decompress(data, max_output_size=limit)
    except zstandard.ZstdError as error:  # (a frame of unknown size past the limit too: memrec declares sizes)
        raise TraceFormatError(f"does not decompress ({error})") from None
    if len(out) > limit:
        raise TooLarge(f"decompresses to more than {limit} bytes")
    return out
