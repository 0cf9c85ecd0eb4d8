"""Grouped sums over integer columns in linear time where the keys allow it.

``np.unique(keys, axis=0)`` sorts rows as byte strings: on a 10M-row journal it was 38 % of a
report. Here each column is turned into dense codes (a lookup table when its values span a range
not much larger than the rows, a 1-D sort otherwise), the codes are combined into one integer key
(mixed radix), and that key is made dense by a presence table when the product of the column
cardinalities is small, by a 1-D sort otherwise. Groups come out in the order
``np.unique(axis=0)`` gives (lexicographic by column), so callers' output does not change.
"""

from __future__ import annotations

import numpy as np

#: Key spaces up to this many slots (or 4 slots per row) are made dense with a table, not a sort.
TABLE_MIN = 1 << 20


def _dense(key: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, sorted distinct values) of non-negative ``key`` < ``span``, by a presence table."""
    present = np.zeros(span, dtype=bool)
    present[key] = True
    code_of = np.cumsum(present, dtype=np.int64) - 1
    return code_of[key], np.flatnonzero(present)


def factorize(col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, uniques): ``uniques[codes] == col``, uniques ascending."""
    col = np.asarray(col)
    if not len(col):
        return np.zeros(0, dtype=np.int64), col[:0].copy()
    lo = int(col.min())
    span = int(col.max()) - lo + 1
    if span <= max(TABLE_MIN, 4 * len(col)):
        codes, present = _dense(col.astype(np.int64) - lo, span)
        return codes, (present + lo).astype(col.dtype)
    uniq, inverse = np.unique(col, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64), uniq


def distinct(col: np.ndarray, step: int = 1 << 20) -> list[int]:
    """The distinct values of an integer column, ascending: a presence table filled ``step``
    values at a time when they span a small range (pids, GPUs: no sort or hash of 10M values,
    no index-sized temporaries), ``np.unique`` otherwise."""
    col = np.asarray(col)
    if not len(col):
        return []
    lo, hi = int(col.min()), int(col.max())
    if hi - lo > max(TABLE_MIN, 4 * len(col)):
        return np.unique(col).tolist()
    present = np.zeros(hi - lo + 1, dtype=bool)
    for at in range(0, len(col), step):
        present[col[at : at + step].astype(np.int64) - lo] = True
    return (np.flatnonzero(present) + lo).tolist()


def _codes(col: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes of a column for :func:`group`: its offset from its minimum when its values span a
    small range (no pass to make them dense: values that never occur cost an empty slot of the
    combined key, which :func:`group` drops), else :func:`factorize`."""
    if len(col):
        lo, hi = int(col.min()), int(col.max())
        if hi - lo < 1 << 12:
            return np.subtract(col, lo, dtype=np.int64), np.arange(lo, hi + 1).astype(col.dtype)
    return factorize(col)


def group(cols: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Group rows by the values of ``cols`` (equal-length integer arrays).

    Returns ``(inverse, keys)``: ``inverse[i]`` is row ``i``'s group, ``keys[c][g]`` the value of
    column ``c`` in group ``g``; groups ordered lexicographically by the columns.
    """
    n = len(cols[0]) if cols else 0
    factors = [_codes(c, n) for c in cols]
    size = 1
    for _, u in factors:
        size *= max(len(u), 1)
    if size >= 1 << 62:  # the combined key would overflow: sort the rows instead
        stacked = np.stack([c.astype(np.int64) for c in cols], axis=1)
        uniq, inverse = np.unique(stacked, axis=0, return_inverse=True)
        return inverse.reshape(-1), [uniq[:, k].astype(cols[k].dtype) for k in range(len(cols))]
    combined = np.zeros(n, dtype=np.int64)
    for codes, u in factors:
        combined = combined * max(len(u), 1) + codes
    if size <= max(TABLE_MIN, 4 * n):
        inverse, present = _dense(combined, size)
    else:
        present, inverse = np.unique(combined, return_inverse=True)
        inverse = inverse.reshape(-1)
    keys: list[np.ndarray] = []
    rest = present
    for codes, u in reversed(factors):
        m = max(len(u), 1)
        keys.append(u[rest % m] if len(u) else u)
        rest = rest // m
    return inverse, keys[::-1]


def group_sum(inverse: np.ndarray, n_groups: int, values: np.ndarray) -> np.ndarray:
    """Exact int64 sums of ``values`` per group (``np.add.at``: no float rounding)."""
    out = np.zeros(n_groups, dtype=np.int64)
    np.add.at(out, inverse, values.astype(np.int64, copy=False))
    return out
