"""``memrec dump``'s event lines built a chunk at a time with numpy, no Python per event.

A line is a fixed sequence of pieces: constant text, and one field per column. Each field is
formatted for the whole chunk at once into a NUL-padded ``S<w>`` array (``w`` the widest value):
decimal with ``astype("S")``, hex from nibbles, names and small ranges through a table. A column
whose values are all equal becomes constant text. The pieces are the fields of one structured
array (a row = a line), and dropping every NUL byte of its buffer leaves exactly the lines
(JSON text never holds a NUL). The output is byte for byte what ``json`` gives for the same
dict (``memrec.export.jsonl.event_lines``; the tests compare both).
"""

from __future__ import annotations

import json
from typing import Callable
from typing import Mapping

import numpy as np

_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_SHIFTS = np.arange(60, -4, -4, dtype=np.uint64)
#: Columns with at most this many distinct values in a small range go through a table.
_TABLE_RANGE = 1024

#: A field: how a column's value is written ("d" decimal, "x" hex after "0x", "j" a JSON string
#: named by ``names``), in the order of memrec dump's event lines.
Field = tuple[str, str, str]  # (key, column, format)

EVENT_FIELDS: list[Field] = [
    ("kind", "kind", "j"), ("api", "api", "j"), ("ts", "ts", "d"), ("pid", "pid", "d"), ("tid", "tid", "d"),
    ("gpu", "gpu", "d"), ("ordinal", "ordinal", "d"), ("ptr", "ptr", "x"), ("size", "size", "d"),
    ("handle", "handle", "x"), ("aux", "aux", "d"), ("flags", "flags", "d"), ("result", "result", "d"),
    ("result_name", "result", "j"),
]


def _decimal(col: np.ndarray) -> np.ndarray | bytes:
    lo, hi = int(col.min()), int(col.max())
    if lo == hi:
        return str(lo).encode()
    if hi - lo < min(_TABLE_RANGE, len(col)) and hi < 2**63:
        table = np.array([str(v).encode() for v in range(lo, hi + 1)])
        return table[(col.astype(np.int64) - lo)]
    width = max(len(str(lo)), len(str(hi)))
    return col.astype(f"S{width}")


def _hexadecimal(col: np.ndarray) -> np.ndarray | bytes:
    values = col.astype(np.uint64, copy=False)
    lo, hi = int(values.min()), int(values.max())
    if lo == hi:
        return f"{lo:x}".encode()
    digits = max(1, (hi.bit_length() + 3) // 4)
    nibbles = ((values[:, None] >> _SHIFTS[16 - digits :]) & np.uint64(15)).astype(np.uint8)
    keep = np.maximum.accumulate(nibbles != 0, axis=1)
    keep[:, -1] = True
    out = _HEX[nibbles]
    out[~keep] = 0
    return out.view(f"S{digits}").reshape(-1)


def _named(col: np.ndarray, name: Callable[[int], str], encode: Callable[[str], str]) -> np.ndarray | bytes:
    values, inverse = np.unique(col, return_inverse=True)
    texts = [encode(name(v)).encode() for v in values.tolist()]
    if len(texts) == 1:
        return texts[0]
    return np.array(texts)[inverse.reshape(-1)]


def format_lines(
    columns: Mapping[str, np.ndarray],
    fields: list[Field],
    head: str,
    names: Mapping[str, Callable[[int], str]],
    encode: Callable[[str], str],
) -> bytes:
    """The JSON lines ``{<head>"key": value, ...}`` of every row of ``columns`` (UTF-8).

    ``head``: the text after ``{`` (e.g. ``'"type": "event", '``); ``names[column]`` names a
    value of a ``"j"`` field; ``encode`` JSON-encodes a string (the dump's encoder).
    """
    n = len(next(iter(columns.values())))
    if not n:
        return b""
    pieces: list[np.ndarray | bytes] = []
    text = "{" + head
    for i, (key, column, form) in enumerate(fields):
        col = columns[column]
        if form == "d":
            value = _decimal(col)
        elif form == "x":
            value = _hexadecimal(col)
        else:
            value = _named(col, names[column], encode)
        text += ("" if i == 0 else ", ") + f'"{key}": ' + ('"0x' if form == "x" else "")
        if isinstance(value, bytes):
            text += value.decode()
        else:
            pieces.append(text.encode())
            pieces.append(value)
            text = ""
        if form == "x":
            text += '"'
    pieces.append((text + "}\n").encode())
    layout = np.dtype([(f"p{i}", f"S{len(p) if isinstance(p, bytes) else p.dtype.itemsize}")
                       for i, p in enumerate(pieces)])
    lines = np.empty(n, dtype=layout)
    for i, piece in enumerate(pieces):
        lines[f"p{i}"] = piece
    flat = lines.view(np.uint8)
    return flat[flat != 0].tobytes()
