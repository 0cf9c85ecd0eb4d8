"""Snapshots (keyframes) of a :class:`memrec.state.LiveState`: build, check and restore.

A snapshot is a dict of plain ints, bytes, str keys and flat lists, so msgpack carries it as it
is. Version 2 stores the driver allocations, nearly all of a large state, as one column of bytes
per field (:data:`ALLOC_COLUMNS`): building and encoding it is a copy, not a million Python
lists. Version 1 (one flat list of rows) is still read, and :func:`alloc_rows` gives any
snapshot's allocations in that form for tools that edit rows (``memrec merge``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Iterator

import numpy as np

from memrec._untrusted import short_repr
from memrec.events import CATEGORIES
from memrec.state.fields import ALLOC_COLUMNS
from memrec.state.fields import ALLOC_FIELDS

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



def alloc_columns(table: AllocTable) -> dict[str, bytes]:
    """The live allocations as version 2's columns of bytes, rows sorted by (pid, ptr)."""
    order = table.sorted_rows()
    return {name: getattr(table, name)[order].astype(dt, copy=False).tobytes() for name, dt in ALLOC_COLUMNS.items()}


def alloc_arrays(value: Any) -> dict[str, np.ndarray]:
    """A snapshot's ``allocs`` (version 2 columns, or version 1's flat list) as numpy columns.

    Raises:
        TypeError: a column is missing, not bytes, of a length that is not whole rows, or the
            columns disagree on the number of rows; a row of a flat list is not ints.
    """
    if isinstance(value, dict):
        out = {}
        for name, dt in ALLOC_COLUMNS.items():
            raw = value[name]
            if not isinstance(raw, bytes) or len(raw) % np.dtype(dt).itemsize:
                raise TypeError(f"allocs.{name} is not a column of {dt}")
            out[name] = np.frombuffer(raw, dt)
        if len({len(c) for c in out.values()}) > 1:
            raise TypeError("the allocs columns differ in length")
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


def alloc_rows(snap: dict) -> list:
    """A snapshot's driver allocations as one flat list of rows (``ALLOC_FIELDS``), any version."""
    cols = alloc_arrays(snap.get("allocs") or [])
    rows = np.stack([cols[name].astype(object) for name in ALLOC_COLUMNS], axis=1) if len(cols["pid"]) else ()
    return [int(v) for row in rows for v in row]
