"""Snapshots (keyframes) of a :class:`memrec.state.LiveState`: build, check and restore.

A snapshot is a dict of plain ints, bytes, str keys and flat lists, so msgpack carries it as it
is. Versions 2 and 3 store the driver allocations, nearly all of a large state, as one compressed
column of bytes per field (:func:`encode_allocs`: Zstandard, or zlib in files written before
``allocs["z"]`` said which; version 3 stores pointers as gaps and times as differences):
taking it is a copy of numpy columns, and the rest (sort, compression) can run in another
thread, not a million Python lists on the daemon's loop. Version 1 (one flat list of rows) is still read, and :func:`alloc_rows` gives any
snapshot's allocations in that form for tools that edit rows (``memrec merge``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Iterator
import zlib

import numpy as np

from memrec.base.errors import TraceFormatError
from memrec.base.untrusted import short_repr
from memrec.terms.events import CATEGORIES
from memrec.state.fields import ALLOC_COLUMNS
from memrec.state.fields import ALLOC_FIELDS
from memrec.trace import codec

if TYPE_CHECKING:
    from memrec.state.allocs import AllocTable

def flat(rows: list[list]) -> list:
    out: list = []
    for row in rows:
        out.extend(row)
    return out


def flat_nested(table: dict[int, dict]) -> list:
    """pid -> key -> row (a list, or one value) as one flat list [pid, key, *row, ...], sorted."""
    out: list = []
    ext = out.extend
    app = out.append
    for p in sorted(table):
        d = table[p]
        for k in sorted(d):
            ext((p, k))
            r = d[k]
            if isinstance(r, list):
                ext(r)
            else:
                app(r)
    return out


def flat_keyed(table: dict) -> list:
    """key -> row as one flat list [key, *row, ...], sorted by key."""
    out: list = []
    for k in sorted(table):
        out.append(k)
        out.extend(table[k])
    return out


def check_table(flat: Any, name: str, fields: tuple[str, ...], *, none_ok: bool = False) -> None:
    """Raise TypeError unless ``flat`` is a snapshot table of rows ``fields`` whose every value
    can be what its field is: bytes for handle bytes, an int16 for a GPU, a category index for a
    category, a 64-bit int for the rest (None too with ``none_ok``). Checked before use: a damaged
    keyframe must fail here, not later in a view or a numpy column.

    Tables of plain ints (nearly all) are checked with numpy in one pass; others item by item.
    """
    if not isinstance(flat, list):
        raise TypeError(f"{name} is not a list")
    stride = len(fields)
    if not any(f.endswith("_bytes") for f in fields) and len(flat) % stride == 0:
        try:
            arr = np.asarray(flat)
        except (ValueError, OverflowError):
            arr = None
        if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu":
            rows = arr.reshape(-1, stride)
            for i, field in enumerate(fields):
                col = rows[:, i]
                if "gpu" in field and len(col) and (col.min() < -(2**15) or col.max() >= 2**15):
                    raise TypeError(f"{name}: a {field} is out of range")
                if field == "category" and len(col) and (col.min() < 0 or col.max() >= len(CATEGORIES)):
                    raise TypeError(f"{name}: a category is out of range")
            return
    for i, v in enumerate(flat):
        field = fields[i % stride]
        if field.endswith("_bytes"):
            ok = isinstance(v, bytes)
        elif not isinstance(v, int) or isinstance(v, bool):
            ok = none_ok and v is None
        elif "gpu" in field:
            ok = -(2**15) <= v < 2**15
        elif field == "category":
            ok = 0 <= v < len(CATEGORIES)
        else:
            ok = -(2**63) <= v < 2**64
        if not ok:
            raise TypeError(f"{name}[{i}] ({field}) cannot be {short_repr(v, 40)}")


def rows(flat: list, stride: int) -> Iterator[list]:
    if len(flat) % stride:
        raise ValueError(f"snapshot table length {len(flat)} is not a multiple of {stride}")
    for i in range(0, len(flat), stride):
        yield flat[i : i + stride]



#: The key of version 2's ``allocs`` that names its columns' codec (absent: zlib), and its value.
_CODEC = "z"
ZSTD = "zstd"
#: The key of version 3's ``allocs`` that says ``ptr`` holds gaps and ``ts`` differences
#: (:func:`encode_allocs`), and its value.
_FORM = "form"
GAPS = "gaps"
#: Bytes of one allocation row, and the most a keyframe's columns may inflate (row bytes per
#: compressed byte).
_ROW_BYTES = sum(np.dtype(dt).itemsize for dt in ALLOC_COLUMNS.values())
_MAX_INFLATE = 256
#: The most Zstandard shrinks anything (a 128 KiB block of one byte value in 4 bytes): regular
#: columns (one pid, one size) come close, so only this bound holds for them.
_MAX_UNZSTD = 1 << 15


def capture_allocs(table: AllocTable) -> dict[str, np.ndarray]:
    """Copies of the table's live rows, column by column (plain copies: cheap, on the caller's
    thread); :func:`encode_allocs` turns them into a snapshot's ``allocs`` anywhere later."""
    rows = np.flatnonzero(table.live[: table.used])
    return {name: getattr(table, name)[rows] for name in ALLOC_COLUMNS}


def encode_allocs(cols: dict[str, np.ndarray]) -> dict:
    """Version 3's ``allocs``: ``n`` rows, sorted by (pid, ptr); each column little-endian and
    compressed, ``ptr`` as its gap after the end of the process's previous block (its difference
    from the row before, less that row's size when it is of the same process; mod 2^64) and ``ts``
    as differences from the row before (``"form": "gaps"``; version 2's ``ptr`` was the difference
    alone, and ``ts`` as it is). ``"z": "zstd"`` says the columns are Zstandard frames (the
    trace's codec); without it (older files) they are zlib.

    Gaps, not differences: a process's blocks mostly follow one another (a caching allocator's
    segments, a heap's blocks), so the gap is 0 or small where the difference is the block's size.
    At 1M live allocations of bench/bench_realistic.py a keyframe took 5.6 bytes an allocation
    with version 2 and takes about 3 with version 3 (ptr 1.7 → 0.8, ts 3.0 → 1.3): the keyframes
    stay within a fifth of a file whose events trace format 2.3 halved (issue 26).

    ``cols`` (:func:`capture_allocs`'s) is emptied as each column is encoded: at a million live
    allocations a keyframe being built held every column twice (the copy and its sorted form)
    and was the daemon's peak memory (issue 26); now one column at a time (and the sorted pids
    and sizes until the pointers are done).

    Zstandard, not zlib: at 1M live allocations the keyframe record is 14% smaller (5.1 vs 6.0 MB)
    and built in about 2/3 of the time, and the record's own Zstandard frame, made on the daemon's
    loop when the keyframe is written, costs a quarter (bench/bench_keyframe_codec.py). Raw columns
    would leave all the compression to that frame: smaller still in total, but ~100 ms on the loop.

    numpy's sort and Zstandard let go of the interpreter lock: run in a thread, this leaves the
    daemon's loop alone.
    """
    order = np.lexsort((cols["ptr"], cols["pid"]))
    pid = cols["pid"][order]
    size = cols["size"][order].astype(np.uint64)  # (two's complement: exact modulo 2^64)
    out: dict = {"n": len(order), _CODEC: ZSTD, _FORM: GAPS}
    for name, dt in ALLOC_COLUMNS.items():
        col = np.ascontiguousarray(cols.pop(name)[order], dtype=dt)
        if name == "ptr" and len(col):
            col[1:] = np.diff(col) - np.where(pid[1:] == pid[:-1], size[:-1], np.uint64(0))
            del pid, size
        elif name == "ts" and len(col):
            col[1:] = np.diff(col)  # (wraps modulo 2^64, as cumsum does back)
        out[name] = codec.compress(col)
        del col
    return out


def alloc_arrays(value: Any) -> dict[str, np.ndarray]:
    """A snapshot's ``allocs`` (version 3's or 2's columns, or version 1's flat list) as numpy columns.

    Raises:
        TypeError: a column is missing, not zlib / Zstandard data of ``n`` rows, or a row of a flat list is
            not ints.
    """
    if isinstance(value, dict):
        n = value["n"]
        zipped = value.get(_CODEC)
        if zipped not in (None, ZSTD):
            raise TypeError(f"allocs: unknown column codec {short_repr(zipped, 20)}")
        form = value.get(_FORM)
        if form not in (None, GAPS):
            raise TypeError(f"allocs: unknown column form {short_repr(form, 20)}")
        packed = sum(len(value[name]) for name in ALLOC_COLUMNS if isinstance(value.get(name), bytes))
        # Real columns shrink about 5x; a damaged count may not make a reader inflate without bound.
        most = (_MAX_INFLATE if zipped is None else _MAX_UNZSTD) * packed + (1 << 20)
        if not isinstance(n, int) or not 0 <= n * _ROW_BYTES <= most:
            raise TypeError("allocs.n is not a row count its columns can hold")
        inflate = _inflate if zipped is None else _unzstd
        out = {}
        for name, dt in ALLOC_COLUMNS.items():
            out[name] = np.frombuffer(inflate(value[name], n * np.dtype(dt).itemsize, name), dt)
        steps = out["ptr"]
        if form == GAPS and n:
            pid = out["pid"]
            steps = steps.copy()
            steps[1:] += np.where(pid[1:] == pid[:-1], out["size"][:-1].astype(np.uint64), np.uint64(0))
            out["ts"] = np.cumsum(out["ts"], dtype=np.int64)
        out["ptr"] = np.cumsum(steps, dtype=np.uint64)
    else:
        check_table(value, "allocs", ALLOC_FIELDS)
        stride = len(ALLOC_FIELDS)
        if len(value) % stride:
            raise ValueError(f"snapshot table length {len(value)} is not a multiple of {stride}")
        flat = np.array(value, dtype=object).reshape(-1, stride) if value else np.zeros((0, stride), object)
        out = {name: flat[:, i].astype(dt) for i, (name, dt) in enumerate(ALLOC_COLUMNS.items())}
    if len(out["size"]) and (out["size"].min() < 0 or out["ts"].min() < 0):
        raise TypeError("allocs: a size or ts is negative")
    return out


def _inflate(data: Any, size: int, name: str) -> bytes:
    """Exactly ``size`` bytes from zlib ``data`` (never more: a damaged count cannot blow up)."""
    if not isinstance(data, bytes):
        raise TypeError(f"allocs.{name} is not bytes")
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, size)
    except zlib.error as error:
        raise TypeError(f"allocs.{name}: {error}") from None
    if len(out) != size or d.unconsumed_tail or (size and not d.eof and d.decompress(b"", 1)):
        raise TypeError(f"allocs.{name} does not hold {size} bytes")
    return out


def _unzstd(data: Any, size: int, name: str) -> bytes:
    """Exactly ``size`` bytes from one Zstandard frame ``data`` (never more)."""
    if not isinstance(data, bytes):
        raise TypeError(f"allocs.{name} is not bytes")
    try:
        out = codec.decompress(data, size)
    except TraceFormatError as error:
        raise TypeError(f"allocs.{name} {error}") from None
    if len(out) != size:
        raise TypeError(f"allocs.{name} does not hold {size} bytes")
    return out


def alloc_rows(snap: dict) -> list:
    """A snapshot's driver allocations as one flat list of rows (``ALLOC_FIELDS``), any version."""
    cols = alloc_arrays(snap.get("allocs") or [])
    rows = np.stack([cols[name].astype(object) for name in ALLOC_COLUMNS], axis=1) if len(cols["pid"]) else ()
    return [int(v) for row in rows for v in row]
