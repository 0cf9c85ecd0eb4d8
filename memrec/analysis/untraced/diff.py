"""``memrec diff``'s comparison of the untraced band: context, module code, pools, before, unexplained.

Why its own module: a run that fails where another works often differs outside the allocations:
a custom all-reduce binds a context on every peer GPU, NCCL loads its kernels, a pool keeps what
was freed. Per rank (processes matched as the rest of the diff matches them) and GPU, each run's
split at its processes' last samples (:mod:`memrec.analysis.untraced.split`) and the difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any

from memrec.analysis.sections import Section
from memrec.analysis.untraced.reconcile import Reconciliation
from memrec.analysis.text import table
from memrec.analysis.untraced.split import SPLIT
from memrec.analysis.untraced.split import SPLIT_HEADINGS

RankKey = tuple


@dataclass
class UntracedCell:
    """One rank's untraced band on one GPU (or the change of it): the split summed over its
    processes (keys :data:`SPLIT`), how many contexts were bound, how many of them foreign, and
    ``sampled``: whether NVML listed any of its processes there (without it the split is unknown,
    not 0). The JSON is one flat object, the split's keys first."""

    split: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLIT, 0))
    contexts: int = 0
    foreign: int = 0
    sampled: int = 0

    def minus(self, other: UntracedCell | None) -> UntracedCell:
        """``self - other`` in every column (``other`` None: zeros)."""
        o = other or UntracedCell()
        return UntracedCell({k: self.split[k] - o.split[k] for k in SPLIT}, self.contexts - o.contexts,
                            self.foreign - o.foreign, self.sampled - o.sampled)

    def to_json(self) -> dict:
        return {**self.split, "contexts": self.contexts, "foreign": self.foreign, "sampled": self.sampled}


@dataclass
class UntracedChange(Section):
    """One (rank, GPU) in either run: both runs' cells (None where absent) and B − A."""

    rank: str
    gpu: int
    a: UntracedCell | None
    b: UntracedCell | None
    delta: UntracedCell


def split_by_rank(rec: Reconciliation, rank_of: dict[int, RankKey]) -> dict[tuple[RankKey, int], UntracedCell]:
    """(rank, GPU) -> the split summed over that rank's processes (the last live sample of each)
    and the contexts bound (:class:`UntracedCell`)."""
    out: dict[tuple[RankKey, int], UntracedCell] = {}
    for g in rec.gpus():
        for row in rec.gpu_summary(g).processes:
            if not row.split:
                continue
            c = out.setdefault((rank_of.get(row.pid, ()), g), UntracedCell())
            c.sampled = 1
            for k in SPLIT:
                c.split[k] += row.split[k]
    for ctx in rec.contexts:
        c = out.setdefault((rank_of.get(ctx.pid, ()), ctx.gpu), UntracedCell())
        c.contexts += 1
        c.foreign += int(ctx.foreign)
    return out


def untraced_rows(a: dict[tuple[RankKey, int], UntracedCell], b: dict[tuple[RankKey, int], UntracedCell],
                  label: Any) -> list[UntracedChange]:
    """One row per (rank, GPU) in either run: both cells (None where absent) and B − A per column."""
    rows = []
    for key in sorted(set(a) | set(b), key=lambda k: (k[1], tuple((x is None, x) for x in k[0]))):
        sa, sb = a.get(key), b.get(key)
        rows.append(UntracedChange(label(key[0]), key[1], sa, sb, (sb or UntracedCell()).minus(sa)))
    return rows


def render_untraced(rows: list[UntracedChange], human: Any, signed: Any) -> list[str]:
    """The table: per rank and GPU, A, B and Δ of each column (bytes), and the contexts bound."""
    if not rows:
        return []
    out = ["", "untraced band per rank and GPU (at the last NVML sample, '-': none; contexts: bound (foreign))"]
    body = []
    for r in rows:
        for tag, side in (("A", r.a), ("B", r.b)):
            if side is None:
                body.append([r.rank, str(r.gpu), tag, *([""] * len(SPLIT)), "(not in this run)"])
            else:
                values = [human(side.split[k]) if side.sampled else "-" for k in SPLIT]
                body.append([r.rank, str(r.gpu), tag, *values, f"{side.contexts} ({side.foreign})"])
        d = r.delta
        both = all(side is not None and side.sampled for side in (r.a, r.b))
        body.append(["", "", "Δ", *(signed(d.split[k]) if both else "-" for k in SPLIT),
                     f"{d.contexts:+d} ({d.foreign:+d})"])
    out.extend(table(["RANK", "GPU", "RUN", *(SPLIT_HEADINGS[k] for k in SPLIT), "CONTEXTS"],
                     body, right={1, *range(3, 3 + len(SPLIT))}, indent="  "))
    return out
