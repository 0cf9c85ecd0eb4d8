"""``memrec diff``'s result, typed: :func:`memrec.analysis.diff.build.diff_traces` builds a
:class:`Diff`; the text (:mod:`memrec.analysis.diff.text`), the verdict the TUI and the plot show
(:func:`memrec.analysis.diff.build.verdict_of`) and ``diff --json`` (:meth:`Diff.to_json`, the JSON the
diff always printed) read it.

The rows are typed too: the windows' (:class:`WindowDiff`, :class:`WindowChange`), the phases'
(:class:`PhaseChange`), the tensors' (:class:`TensorChange`), the failures (:class:`Failure`: the
fields a kind does not have are left out of the JSON) and the untraced band's
(:class:`memrec.analysis.untraced.diff.UntracedChange`) and the KV budgets side by side
(:class:`KvChange`). What stays a dict: the KV budgets' deltas (keyed by the names of
:class:`~memrec.analysis.sglang.kv_budget.KvBudget`'s numbers, only those both runs have) and the
relation (:meth:`memrec.analysis.diff.related.Relation.to_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass

from memrec.analysis.sections import OMITTED
from memrec.analysis.sections import Section
from memrec.analysis.sections import renamed
from memrec.analysis.sglang.kv_budget_diff import BudgetDiff
from memrec.analysis.diff.sites import SitesDiff
from memrec.analysis.untraced.diff import UntracedChange


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
class KvChange:
    """One rank's KV budget in both runs (:class:`BudgetDiff`), named by the diff's rank label
    (which also replaces each run's own label in the JSON)."""

    budgets: BudgetDiff
    label: str

    def to_json(self) -> dict:
        out = self.budgets.to_dict()
        out["label"] = self.label
        for side in ("before", "after"):
            if out[side] is not None:
                out[side]["label"] = self.label
        return out


@dataclass
class WindowChange(Section):
    """One (phase, rank) in a window of one GPU: owned and IPC-mapped bytes in each run (None:
    not in that run), by category, and B − A."""

    phase: str
    rank: str
    weights: bool  # the phase loads the weights
    a_owned: int | None
    b_owned: int | None
    a_mapped: int | None
    b_mapped: int | None
    a_by_category: dict[str, int]
    b_by_category: dict[str, int]
    delta_owned: int
    delta_mapped: int


@dataclass
class WindowDiff(Section):
    """One GPU's window in both runs (``in_a``/``in_b``: the run has one there) and its totals."""

    gpu: int
    in_a: bool
    in_b: bool
    rows: list[WindowChange]
    a_owned: int
    b_owned: int


@dataclass
class PhaseChange(Section):
    """Net bytes of one phase × rank × GPU × category in each run (None: the phase did not run
    there with that rank) and B − A."""

    phase: str
    rank: str
    rank_key: list
    gpu: int
    category: str
    owned: bool  # the category counts as owned (not ipc_mapped)
    a: int | None
    b: int | None
    delta: int


@dataclass
class TensorChange(Section):
    """The tensor blocks' peaks of one phase × rank × GPU in each run (None: no blocks) and B − A."""

    phase: str
    rank: str
    rank_key: list
    gpu: int
    a_allocated: int | None
    b_allocated: int | None
    a_reserved: int | None
    b_reserved: int | None
    delta_allocated: int
    delta_reserved: int


@dataclass
class Failure(Section):
    """An SGLang error (``sglang_error``), a KV budget <= 0 (``kv_budget``) or failed driver calls
    of one API and result (``driver_call``); ``where``: in run ``"a"``, ``"b"`` or ``"both"`` (JSON
    ``in``), with each run's count when in both. Fields a kind does not have are not in the JSON."""

    kind: str
    rank: str
    rank_key: list
    phase: str = OMITTED  # sglang_error, kv_budget
    error: str = OMITTED
    gpu: int = OMITTED  # driver_call
    api: str = OMITTED
    result: str = OMITTED
    count: int = 0
    bytes: int = OMITTED  # driver_call
    where: str = renamed("in")
    count_a: int = OMITTED
    count_b: int = OMITTED


@dataclass
class DiffWindows(Section):
    """Per GPU, what each (phase, rank) allocated between the memory baseline and the KV sizing,
    and before the baseline, in both runs."""

    between: list[WindowDiff]
    before: list[WindowDiff]


@dataclass
class Diff(Section):
    memrec_diff: int
    a: DiffSide
    b: DiffSide
    verdict: DiffVerdict
    related: dict
    kv: list[KvChange]
    windows: DiffWindows
    phases: list[PhaseChange]
    failures: list[Failure]
    untraced: list[UntracedChange]
    tensors: list[TensorChange]
    #: Allocation sites whose held bytes changed (runs with stacks; absent from the JSON without).
    sites: SitesDiff = OMITTED

    def side(self, which: str) -> DiffSide:
        """``"a"`` or ``"b"``."""
        return self.a if which == "a" else self.b
