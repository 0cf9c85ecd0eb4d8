"""``memrec diff``'s result, typed: :func:`memrec.analysis.diff.build.diff_traces` builds a
:class:`Diff`; the text (:mod:`memrec.analysis.diff.text`), the verdict the TUI and the plot show
(:func:`memrec.analysis.diff.build.verdict_of`) and ``diff --json`` (:meth:`Diff.to_json`, the JSON the
diff always printed) read it.

The rows stay plain dicts, built and read as JSON by their own functions: the KV budgets side by
side (:meth:`memrec.analysis.sglang.kv_budget_diff.BudgetDiff.to_dict`), the windows' and phases' rows,
the failures (their keys depend on their kind), the untraced rows
(:mod:`memrec.analysis.untraced.diff`), the tensors' rows and the relation
(:meth:`memrec.analysis.diff.related.Relation.to_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass

from memrec.analysis.sections import OMITTED
from memrec.analysis.sections import Section
from memrec.analysis.diff.sites import SitesDiff


@dataclass
class DiffSide(Section):
    """One run: its name, whether it failed, how many driver calls ran out of memory, its ranks."""

    name: str
    failed: bool
    driver_ooms: int
    ranks: int


@dataclass
class DiffVerdict(Section):
    headline: str
    lines: list[str]


@dataclass
class DiffWindows(Section):
    """Per GPU, what each (phase, rank) allocated between the memory baseline and the KV sizing,
    and before the baseline, in both runs."""

    between: list[dict]
    before: list[dict]


@dataclass
class Diff(Section):
    memrec_diff: int
    a: DiffSide
    b: DiffSide
    verdict: DiffVerdict
    related: dict
    kv: list[dict]
    windows: DiffWindows
    phases: list[dict]
    failures: list[dict]
    untraced: list[dict]
    tensors: list[dict]
    #: Allocation sites whose held bytes changed (runs with stacks; absent from the JSON without).
    sites: SitesDiff = OMITTED

    def side(self, which: str) -> DiffSide:
        """``"a"`` or ``"b"``."""
        return self.a if which == "a" else self.b
