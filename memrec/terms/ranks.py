"""Rank labels (``TP0``, ``DP1 TP3``): one vocabulary for the report, diff, ``memrec.load`` and the TUI.

A rank is a process: SGLang's hooks put ``tp_rank`` / ``pp_rank`` / ``dp_rank`` in the markers a
scheduler process sends; a process without them may carry a rank in its ProcessInfo (set by the
daemon from the environment). Below :mod:`memrec.analysis` and ``tui/`` so that both read it
without importing each other or the SGLang report.
"""

from __future__ import annotations

import operator
from typing import Iterable

import numpy as np

from memrec.terms.events import Marker

#: (short name, marker value) of each rank dimension, in display order.
RANK_DIMS = (("dp", "dp_rank"), ("pp", "pp_rank"), ("tp", "tp_rank"))


def _as_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


_VALUES = operator.attrgetter("values")
_TS = operator.attrgetter("ts")


def marker_ranks(markers: Iterable[Marker]) -> dict[int, dict[str, int]]:
    """Per pid, ``{"dp": d, "pp": p, "tp": t}`` (the parts known) from markers' ``*_rank`` values."""
    out: dict[int, dict[str, int]] = {}
    # only markers with values can name a rank (a step loop's 50,000 markers mostly carry none)
    for m in sorted(filter(_VALUES, markers), key=_TS):  # (no generator: a step loop's 50,000 markers)
        values = m.values
        for short, key in RANK_DIMS:
            v = _as_int(values.get(key))
            if v is not None:
                out.setdefault(m.pid, {}).setdefault(short, v)
    return out


def process_info_ranks(rank: dict | None) -> dict[str, int]:
    """``ProcessInfo.rank`` (``{"tp": 0}`` or ``{"tp_rank": 0}``) as ``{"tp": 0}``; other keys dropped."""
    out: dict[str, int] = {}
    for short, key in RANK_DIMS:
        for name in (short, key):
            v = _as_int((rank or {}).get(name))
            if v is not None:
                out.setdefault(short, v)
    return out


def shown_dims(ranks: Iterable[dict[str, int]]) -> tuple[str, ...]:
    """The rank dimensions worth printing: TP always, DP and PP when some rank is not 0 in them."""
    ranks = list(ranks)
    return tuple(s for s, _ in RANK_DIMS if s == "tp" or any(r.get(s) for r in ranks))


def format_rank(rank: dict[str, int], dims: tuple[str, ...] = ("tp",), draft: bool = False) -> str:
    """``TP0``, ``DP1 TP3``, … (dimensions in ``dims`` that are known; all known when none is)."""
    parts = [f"{s.upper()}{rank[s]}" for s, _ in RANK_DIMS if s in dims and s in rank]
    if not parts:
        parts = [f"{s.upper()}{rank[s]}" for s, _ in RANK_DIMS if s in rank]
    if draft:
        parts.append("draft")
    return " ".join(parts)


def rank_labels(markers: Iterable[Marker]) -> dict[int, str]:
    """Per pid whose markers carry ``tp_rank`` / ``pp_rank`` / ``dp_rank``: ``TP0`` style labels.

    DP and PP are shown when some process in the trace has a non-zero rank in them.
    """
    ranks = marker_ranks(markers)
    dims = shown_dims(ranks.values())
    return {pid: format_rank(r, dims) for pid, r in ranks.items()}


def rank_sort_key(rank: dict[str, int] | tuple) -> tuple:
    """Sort by (dp, pp, tp), unknown parts last."""
    values = [rank.get(s) for s, _ in RANK_DIMS] if isinstance(rank, dict) else list(rank[:3])
    return tuple((v is None, v or 0) for v in values)


def process_label(rank: dict | None) -> str:
    """A ProcessInfo rank as a label (``tp0``): what a process without rank markers shows."""
    if not rank:
        return ""
    return " ".join(f"{k}{v}" for k, v in sorted(rank.items()))


def pid_labels(markers: Iterable[Marker], processes: dict) -> dict[int, str]:
    """pid -> label: from the markers' ranks (:func:`rank_labels`), else the process's own rank
    (``ProcessInfo.rank``); processes with neither are left out."""
    out = {p: process_label(info.rank) for p, info in processes.items() if info is not None and info.rank}
    out.update(rank_labels(markers))
    return out
