"""``memrec diff``'s comparison of the untraced band: context, module code, pools, before, unexplained.

Why its own module: a run that fails where another works often differs outside the allocations:
a custom all-reduce binds a context on every peer GPU, NCCL loads its kernels, a pool keeps what
was freed. Per rank (processes matched as the rest of the diff matches them) and GPU, each run's
split at its processes' last samples (:mod:`memrec.analysis.untraced.split`) and the difference.
"""

from __future__ import annotations

from typing import Any

from memrec.analysis.untraced.reconcile import Reconciliation
from memrec.analysis.text import table
from memrec.analysis.untraced.split import SPLIT
from memrec.analysis.untraced.split import SPLIT_HEADINGS

RankKey = tuple


def split_by_rank(rec: Reconciliation, rank_of: dict[int, RankKey]) -> dict[tuple[RankKey, int], dict[str, int]]:
    """(rank, GPU) -> the split summed over that rank's processes (the last live sample of each),
    with ``contexts`` (how many were bound), ``foreign`` (how many of them are foreign) and
    ``sampled`` (whether NVML listed any of them there: without it the split is unknown, not 0)."""
    out: dict[tuple[RankKey, int], dict[str, int]] = {}

    def cell(key: tuple[RankKey, int]) -> dict[str, int]:
        return out.setdefault(key, dict.fromkeys((*SPLIT, "contexts", "foreign", "sampled"), 0))

    for g in rec.gpus():
        for row in rec.gpu_summary(g).processes:
            if not row.split:
                continue
            c = cell((rank_of.get(row.pid, ()), g))
            c["sampled"] = 1
            for k in SPLIT:
                c[k] += row.split[k]
    for ctx in rec.contexts:
        c = cell((rank_of.get(ctx.pid, ()), ctx.gpu))
        c["contexts"] += 1
        c["foreign"] += int(ctx.foreign)
    return out


def untraced_rows(a: dict[tuple[RankKey, int], dict], b: dict[tuple[RankKey, int], dict], label: Any) -> list[dict]:
    """One row per (rank, GPU) in either run: both splits (None where absent) and B − A per column."""
    rows = []
    for key in sorted(set(a) | set(b), key=lambda k: (k[1], tuple((x is None, x) for x in k[0]))):
        sa, sb = a.get(key), b.get(key)
        delta = {k: (sb or {}).get(k, 0) - (sa or {}).get(k, 0) for k in (*SPLIT, "contexts", "foreign", "sampled")}
        rows.append({"rank": label(key[0]), "gpu": key[1], "a": sa, "b": sb, "delta": delta})
    return rows


def render_untraced(rows: list[dict], human: Any, signed: Any) -> list[str]:
    """The table: per rank and GPU, A, B and Δ of each column (bytes), and the contexts bound."""
    if not rows:
        return []
    out = ["", "untraced band per rank and GPU (at the last NVML sample, '-': none; contexts: bound (foreign))"]
    body = []
    for r in rows:
        for tag, side in (("A", r["a"]), ("B", r["b"])):
            if side is None:
                body.append([r["rank"], str(r["gpu"]), tag, *([""] * len(SPLIT)), "(not in this run)"])
            else:
                values = [human(side[k]) if side["sampled"] else "-" for k in SPLIT]
                body.append([r["rank"], str(r["gpu"]), tag, *values, f"{side['contexts']} ({side['foreign']})"])
        d = r["delta"]
        both = all(side is not None and side["sampled"] for side in (r["a"], r["b"]))
        body.append(["", "", "Δ", *(signed(d[k]) if both else "-" for k in SPLIT),
                     f"{d['contexts']:+d} ({d['foreign']:+d})"])
    out.extend(table(["RANK", "GPU", "RUN", *(SPLIT_HEADINGS[k] for k in SPLIT), "CONTEXTS"],
                     body, right={1, *range(3, 3 + len(SPLIT))}, indent="  "))
    return out
