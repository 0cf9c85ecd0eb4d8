"""Columnar records (events, NVML and per-process samples): rows ↔ chunks ↔ wire form.

A columnar record holds ``n`` rows of one of :data:`COLUMNAR`'s dtypes column by column. The
writer accumulates rows into per-column arrays (:class:`ChunkBuilder`) and the codec
(:mod:`memrec.trace.codec`) turns a full chunk into one Zstandard frame (format 2); a reader gets
a :class:`ColumnChunk` back (:func:`decode_columns`, format 1 or 2). ``docs/format.md`` is the spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from memrec.base.errors import TraceFormatError
from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import FLAG_NAME
from memrec.terms.events import IPC_HANDLE_SIZE
from memrec.trace import codec
from memrec.trace.budget import OverBudget
from memrec.trace.budget import ReadBudget

# The columnar record types (the value of their "type" key).
EVENTS = "events"
NVML = "nvml"
PROCMEM = "procmem"

#: Columnar record types and the numpy dtype of one row of each.
COLUMNAR: dict[str, np.dtype] = {EVENTS: EVENT_DTYPE, NVML: NVML_DTYPE, PROCMEM: PROCMEM_DTYPE}

#: The key of the structured array in a columnar record's logical form.
ROWS_KEY: dict[str, str] = {EVENTS: "events", NVML: "samples", PROCMEM: "samples"}

#: The events column stored sparsely (only rows whose flags have FLAG_IPC_BYTES or, since minor 1,
#: FLAG_NAME: a file or kernel name).
SPARSE_COLUMN = "ipc"
SPARSE_FLAGS = FLAG_IPC_BYTES | FLAG_NAME

#: Value of a column a chunk does not carry (older or newer writer). Unlisted columns default to 0.
COLUMN_DEFAULTS: dict[str, dict[str, int]] = {
    EVENTS: {"ordinal": -1, "gpu": -1},
    NVML: {"gpu": -1, "used": -1, "reserved": -1, "free": -1, "total": -1, "bar1_used": -1, "bar1_total": -1},
    PROCMEM: {"gpu": -1, "used": -1},
}

#: What the writer lets the codec predict from the previous row of the same process, GPU or
#: (process, GPU) rather than from the row before (format 2.3's context transform,
#: :class:`memrec.trace.codec.Context`), by column name: (key columns, columns to try it on,
#: (column, plus column) pairs). A process's next allocation starts near the end of its last one.
CONTEXTS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, str], ...]]] = {
    EVENTS: (("pid", "kind"), ("ordinal", "ptr", "handle", "aux", "gpu"), (("ptr", "size"),)),
    NVML: (("gpu",), ("used", "reserved", "free", "bar1_used"), ()),
    PROCMEM: (("gpu", "pid"), ("used",), ()),
}

#: The most rows a writer puts in one columnar record.
MAX_CHUNK_ROWS = 65536
#: The most rows a reader accepts in one format-2 columnar record (what a writer writes at most): a
#: constant column takes no bytes, so this bounds what one damaged record can make a reader
#: allocate (4.3 MB of columns).
MAX_RECORD_ROWS = MAX_CHUNK_ROWS

#: The record type a 2.1 writer gives each columnar type's records: one letter, as the type is
#: most of the envelope of a chunk of a few rows. A 2.0 reader skips them as unknown types.
SHORT_TYPE = {EVENTS: "e", NVML: "n", PROCMEM: "p"}
#: Every type a columnar record may have, and the columnar type (the logical one) it stands for.
COLUMNAR_TYPE: dict[str, str] = {**{kind: kind for kind in COLUMNAR}, **{v: k for k, v in SHORT_TYPE.items()}}

#: {record type: {column: dtype}}, as written by this version.
Schema = dict[str, dict[str, np.dtype]]

DEFAULT_SCHEMA: Schema = {
    kind: {name: dtype.fields[name][0] for name in dtype.names} for kind, dtype in COLUMNAR.items()
}



def context(kind: str, names: list[str]) -> codec.Context:
    """:data:`CONTEXTS`' entry for ``kind`` as the codec takes it: by index in ``names`` (the
    columns a chunk holds, in schema order)."""
    keys, columns, plus = CONTEXTS[kind]
    at = names.index
    return codec.Context(tuple(map(at, keys)), tuple(map(at, columns)), tuple((at(a), at(b)) for a, b in plus))


def as_rows(kind: str, arr: np.ndarray) -> np.ndarray:
    """Return ``arr`` with exactly the dtype of ``kind``'s rows, converting field by field by name.

    Raises:
        ValueError: ``arr`` is not a 1-D structured array with every field of the row dtype.
    """
    dtype = COLUMNAR[kind]
    if not isinstance(arr, np.ndarray) or arr.ndim != 1:
        raise ValueError(f"{kind}: expected a 1-D numpy structured array, got {type(arr).__name__}")
    if arr.dtype == dtype:
        return arr
    names = arr.dtype.names or ()
    missing = [name for name in dtype.names if name not in names]
    if missing:
        raise ValueError(f"{kind}: the array lacks the field(s) {', '.join(missing)} (dtype {arr.dtype})")
    out = np.empty(len(arr), dtype=dtype)
    for name in dtype.names:
        out[name] = arr[name]
    return out


class ChunkBuilder:
    """Accumulates rows of one columnar type straight into per-column arrays.

    ``append(arr)`` returns the wire form of every chunk it completed (``max_rows`` rows each,
    at most :data:`MAX_RECORD_ROWS`); ``take()`` returns the wire form of the rows left (or None).
    Each column is copied once, at append time, into a contiguous array, which the codec encodes
    and compresses when the chunk is complete (:func:`memrec.trace.codec.encode_payload`).
    """

    def __init__(self, kind: str, max_rows: int = MAX_CHUNK_ROWS) -> None:
        if kind not in COLUMNAR:
            raise ValueError(f"not a columnar record type: {kind!r}")
        if not 1 <= max_rows <= MAX_RECORD_ROWS:
            raise ValueError(f"max_rows must be between 1 and {MAX_RECORD_ROWS}")
        self.kind = kind
        self.max_rows = max_rows
        self._dtype = COLUMNAR[kind]
        self._sparse = kind == EVENTS
        self._names = [n for n in self._dtype.names if not (self._sparse and n == SPARSE_COLUMN)]
        self._context = context(kind, self._names)
        self._reset()

    def _reset(self) -> None:
        self.rows = 0
        self._cols: dict[str, np.ndarray] = {}
        self._ipc_index: list[np.ndarray] = []
        self._ipc: list[bytes] = []

    def _reserve(self, rows: int) -> None:
        """Make room for ``rows`` rows (doubling, capped at max_rows)."""
        capacity = len(next(iter(self._cols.values()))) if self._cols else 0
        if rows <= capacity:
            return
        new = min(self.max_rows, max(rows, 2 * capacity, 1024))
        for name in self._names:
            col = np.empty(new, dtype=self._dtype.fields[name][0])
            if capacity:
                col[: self.rows] = self._cols[name][: self.rows]
            self._cols[name] = col

    def append(self, arr: np.ndarray) -> list[dict]:
        """Add rows (converted to the row dtype by field name); return the chunks completed."""
        arr = as_rows(self.kind, arr)
        done = []
        start = 0
        while start < len(arr):
            take = min(self.max_rows - self.rows, len(arr) - start)
            part = arr[start : start + take]
            self._reserve(self.rows + take)
            end = self.rows + take
            for name in self._names:
                self._cols[name][self.rows : end] = part[name]
            if self._sparse:
                idx = np.flatnonzero(part["flags"] & SPARSE_FLAGS)
                if len(idx):
                    self._ipc_index.append((idx + self.rows).astype("<u4"))
                    self._ipc.append(part[SPARSE_COLUMN][idx].tobytes())
            self.rows = end
            start += take
            if self.rows >= self.max_rows:
                done.append(self._wire())
        return done

    def take(self) -> dict | None:
        """Return the wire form of the rows accumulated so far (None if there are none)."""
        return self._wire() if self.rows else None

    def _wire(self) -> dict:
        columns = [self._cols[n][: self.rows] if self.rows else np.zeros(0, self._dtype.fields[n][0])
                   for n in self._names]
        index = np.concatenate(self._ipc_index) if self._ipc_index else None
        key, payload = codec.encode_payload(columns, index, b"".join(self._ipc), self._context)
        self._reset()
        return {"type": SHORT_TYPE[self.kind], key: payload}  # (the payload holds n: a 2.1 record omits it)


def rows_to_wire(kind: str, arr: np.ndarray) -> dict:
    """The wire form of one columnar record holding every row of ``arr``.

    Raises:
        ValueError: more than :data:`MAX_RECORD_ROWS` rows (write them with a TraceWriter).
    """
    builder = ChunkBuilder(kind, max_rows=max(1, len(arr)))
    done = builder.append(arr)
    return done[0] if done else builder._wire()


@dataclasses.dataclass
class ColumnChunk:
    """One columnar record decoded without copying: a read-only numpy view per column."""

    kind: str
    n: int
    columns: dict[str, np.ndarray]
    ipc_index: np.ndarray | None = None  # <u4 row indices (events only)
    ipc: np.ndarray | None = None  # V64 rows, one per index

    def fill(self, out: np.ndarray, start: int = 0) -> None:
        """Write the chunk's rows into ``out[start:start + n]`` (``out`` zeroed by the caller)."""
        end = start + self.n
        defaults = COLUMN_DEFAULTS.get(self.kind, {})
        for name in out.dtype.names:
            col = self.columns.get(name)
            if col is not None:
                out[name][start:end] = col
            elif name in defaults:
                out[name][start:end] = defaults[name]
        if self.ipc_index is not None and len(self.ipc_index):
            out[SPARSE_COLUMN][start + self.ipc_index.astype(np.intp)] = self.ipc

    def column(self, name: str) -> np.ndarray:
        """One column's values: the chunk's own, or its default when the chunk does not carry it."""
        col = self.columns.get(name)
        if col is not None:
            return col
        dtype = COLUMNAR[self.kind].fields[name][0]
        return np.full(self.n, COLUMN_DEFAULTS.get(self.kind, {}).get(name, 0), dtype=dtype)

    def to_array(self) -> np.ndarray:
        """The chunk as a new structured array of its row dtype."""
        out = np.zeros(self.n, dtype=COLUMNAR[self.kind])
        self.fill(out)
        return out

    @property
    def last_ts(self) -> int | None:
        ts = self.columns.get("ts")
        return int(ts[-1]) if ts is not None and len(ts) else None


def decode_columns(obj: dict, schema: Schema | None = None, budget: ReadBudget | None = None) -> ColumnChunk:
    """Decode a columnar wire record: format 2 into new contiguous columns (one decompression),
    format 1 into zero-copy column views of the record's bytes.

    ``schema`` is :func:`parse_schema` of the trace's header (the columns in the order and dtype
    the writer wrote them); a format-1 column whose dtype differs from this version's is cast
    when filled. Unknown columns are ignored; missing ones take :data:`COLUMN_DEFAULTS`.
    ``budget``: the read's (:mod:`memrec.trace.budget`), charged the rows (and decompressed
    bytes) before they are decoded.

    Raises:
        OverBudget: past ``budget``.
        TraceFormatError: the record is malformed (a column's length does not match ``n``...).
    """
    kind = COLUMNAR_TYPE.get(obj.get("type"))  # type: ignore[arg-type]
    if kind is None:
        raise TraceFormatError(f"not a columnar record: {obj.get('type')!r}")
    n = obj.get("n")
    for key in codec.KEYS:
        if key in obj:
            return _decode_v2(kind, n, key, obj[key], schema, budget)
    return _decode_v1(kind, n, obj, schema, budget)


def _decode_v1(kind: str, n: Any, obj: dict, schema: Schema | None, budget: ReadBudget | None) -> ColumnChunk:
    """A format-1 record: one little-endian byte string per column (zero-copy views)."""
    columns = obj.get("columns")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0 or not isinstance(columns, dict):
        raise TraceFormatError(f"malformed {kind} record: bad 'n' or 'columns'")
    if n and not isinstance(columns.get("ts"), (bytes, bytearray, memoryview)):
        # Every writer writes ts; without it nothing ties n to bytes present, and n rows would be
        # allocated from a few bytes of input (n = 10 million: gigabytes).
        raise TraceFormatError(f"malformed {kind} record: {n} rows but no ts column")
    if budget is not None:
        budget.spend(rows=n)
    target = COLUMNAR[kind]
    written = (schema or DEFAULT_SCHEMA).get(kind, DEFAULT_SCHEMA[kind])
    out: dict[str, np.ndarray] = {}
    for name, data in columns.items():
        if name not in target.names:
            continue  # a column from a newer writer
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TraceFormatError(f"malformed {kind} record: column {name!r} is not binary")
        dtype = written.get(name, target.fields[name][0])
        if len(data) != n * dtype.itemsize:
            raise TraceFormatError(
                f"malformed {kind} record: column {name!r} has {len(data)} bytes for {n} rows of {dtype.str}"
            )
        out[name] = np.frombuffer(data, dtype=dtype)
    chunk = ColumnChunk(kind, n, out)
    if kind == EVENTS:
        index = obj.get("ipc_index", b"")
        ipc = obj.get("ipc", b"")
        if not isinstance(index, (bytes, bytearray, memoryview)) or not isinstance(ipc, (bytes, bytearray, memoryview)):
            raise TraceFormatError("malformed events record: 'ipc_index' / 'ipc' are not binary")
        if len(index) % 4 or len(ipc) != (len(index) // 4) * IPC_HANDLE_SIZE:
            raise TraceFormatError(
                f"malformed events record: {len(index) // 4} ipc indices for {len(ipc)} ipc bytes"
            )
        chunk.ipc_index = np.frombuffer(index, dtype="<u4")
        if len(chunk.ipc_index) and int(chunk.ipc_index.max()) >= n:
            raise TraceFormatError("malformed events record: an ipc index is out of range")
        chunk.ipc = np.frombuffer(ipc, dtype=f"V{IPC_HANDLE_SIZE}")
    return chunk


def _decode_v2(kind: str, n: Any, key: str, data: Any, schema: Schema | None, budget: ReadBudget | None) -> ColumnChunk:
    """A format-2 chunk; ``n`` None is a 2.1 record that leaves its row count to the payload."""
    if (n is not None or key == codec.ZSTD_V20) and (
        not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_RECORD_ROWS
    ):
        raise TraceFormatError(f"malformed {kind} record: bad 'n' (at most {MAX_RECORD_ROWS} rows)")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TraceFormatError(f"malformed {kind} record: {key!r} is not binary")
    target = COLUMNAR[kind]
    written = (schema or DEFAULT_SCHEMA).get(kind, DEFAULT_SCHEMA[kind])
    names = [name for name in written if not (kind == EVENTS and name == SPARSE_COLUMN)]
    dtypes = [target.fields[name][0] if name in target.names else None for name in names]
    try:
        n, cols, index, ipc = codec.decode_payload(key, data, n, dtypes, sparse=kind == EVENTS, max_rows=MAX_RECORD_ROWS,
                                                   budget=budget)
    except OverBudget:
        raise
    except TraceFormatError as error:
        raise TraceFormatError(f"malformed {kind} record: {error}") from None
    chunk = ColumnChunk(kind, n, {name: col for name, col in zip(names, cols) if col is not None})
    if kind == EVENTS:
        chunk.ipc_index = index if index is not None else np.zeros(0, "<u4")
        chunk.ipc = np.frombuffer(ipc, dtype=f"V{IPC_HANDLE_SIZE}")
    return chunk


