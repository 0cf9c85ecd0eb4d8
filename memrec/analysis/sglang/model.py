"""The report's SGLang section, typed: per rank its phases, KV budgets and errors, and the summary
over every rank (:func:`memrec.analysis.sglang.section.build_sglang_section` builds it; the text,
the answer and ``report --json`` read it).

The windows between the baseline and the KV sizing are typed where they are built
(:class:`memrec.analysis.sglang.windows.ShownWindow`, rows :class:`~memrec.analysis.sglang.windows.WindowRow`).
The facts rows are typed where they are built (:mod:`memrec.analysis.sglang.facts`); what stays a
plain dict is SGLang's own marker values, passed through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dataclasses import field

from memrec.analysis.sglang.facts import CustomAllReduce
from memrec.analysis.sglang.facts import MarkersDropped
from memrec.analysis.sglang.facts import NcclVmm
from memrec.analysis.sglang.facts import OomAfterSizing
from memrec.analysis.sglang.facts import ProcessContext
from memrec.analysis.sglang.kv_budget import KvBudget
from memrec.analysis.sglang.windows import ShownWindow
from memrec.analysis.sections import OMITTED
from memrec.analysis.sections import Section
from memrec.analysis.sections import flatten


@dataclass
class SglangPhase(Section):
    """A phase (per GPU it took memory on) or an instant of one rank, placed against the KV sizing
    (``when``); ``torch_reserved`` / ``non_torch`` where the hooks recorded PyTorch's reserve."""

    kind: str  # "phase" | "instant"
    name: str
    path: str
    depth: int
    gpu: int | None
    start_ts: int
    end_ts: int
    start_s: float
    end_s: float
    closed: bool
    when: str | None
    by_category: dict[str, int]
    net: int
    mapped_net: int
    values: dict
    torch_reserved: int = OMITTED
    non_torch: int = OMITTED


@dataclass
class Diagnosis(Section):
    """Why a KV budget failed (:func:`memrec.analysis.sglang.section.diagnose`): the shortfall, what
    was taken between the baseline and the sizing other than the weights (``extra_owned``), the
    rest without it, and the lines that say so; ``weights_owned`` where the window has a baseline,
    ``other_gpu`` where another GPU's window explains the failure."""

    shortfall_gib: float | None = None
    extra_owned: int = 0
    rest_without_extras_gib: float | None = None
    lines: list[str] = field(default_factory=list)
    weights_owned: int = OMITTED
    other_gpu: int = OMITTED


@dataclass
class RankBudget:
    """One KV budget of a rank: SGLang's numbers (:class:`KvBudget`), the rank's label, the
    formula with its values and, for the target runner, the diagnosis (None without a window)."""

    budget: KvBudget
    label: str
    formula: list[str]
    diagnosis: Diagnosis | None

    def to_json(self) -> dict:
        """The budget's own dict with the rank's label over SGLang's (kept as ``sglang_label``)."""
        out = self.budget.to_dict()
        out["label"] = self.label
        out["sglang_label"] = self.budget.label
        out["formula"] = self.formula
        out["diagnosis"] = self.diagnosis.to_json() if self.diagnosis is not None else None
        return out


@dataclass
class RankError(Section):
    """An error a phase marker of the rank carried, where it was raised and its traceback."""

    phase: str
    error: str
    at: Any
    traceback: Any


@dataclass
class SglangRank(Section):
    pid: int
    label: str
    rank: dict[str, int]
    gpu: int | None
    gpus: list[int]
    phases: list[SglangPhase]
    budgets: list[RankBudget]
    errors: list[RankError]


@dataclass
class SglangSummary(Section):
    """Every rank at once (:func:`memrec.analysis.sglang.kv_budget.summarize`'s numbers first), then the
    facts: failed ranks, fractions, lost markers, custom all-reduce, contexts, NCCL's VMM, OOMs
    after the sizing."""

    ranks: int
    failed: bool
    errors: list[str]
    min_rest_gib: float | None
    min_rest_label: str | None
    min_tokens: int | None
    needed_mem_fraction_static: float | None
    local_free_spread_gib: float | None
    lowest_free_label: str | None
    failed_labels: list[str]
    kv_failed: bool
    mem_fraction_static: list[float]
    fraction_is_lower_bound: bool
    facts: SglangFacts = flatten()


@dataclass
class SglangFacts(Section):
    """What explains real startup failures (:mod:`memrec.analysis.sglang.facts`), the keys of the
    summary's JSON after the numbers."""

    markers_dropped: list[MarkersDropped]
    custom_all_reduce: CustomAllReduce | None
    contexts: list[ProcessContext]
    nccl_vmm: list[NcclVmm]
    oom_after_sizing: list[OomAfterSizing]


@dataclass
class SglangSection(Section):
    ranks: list[SglangRank]
    windows: list[ShownWindow]
    summary: SglangSummary
