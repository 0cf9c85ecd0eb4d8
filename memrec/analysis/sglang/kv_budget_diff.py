"""The same SGLang ranks' KV budgets in two runs (``memrec diff``): ``after − before`` for each
number both have, and what made ``rest`` move (:func:`compare_budgets`)."""

from __future__ import annotations

from dataclasses import dataclass

from memrec.analysis.sglang.kv_budget import KvBudget
from memrec.analysis.sglang.kv_budget import gib_text
from memrec.analysis.sglang.kv_budget import none_last


_DELTA_FIELDS = (
    "pre_model_load_memory",
    "available_gpu_memory",
    "mem_fraction_static",
    "slack_gib",
    "rest_gib",
    "tokens",
    "max_total_num_tokens",
    "min_mem_fraction_static",
    "weight_load_mem_usage",
    "local_free_at_baseline_gib",
    "local_free_at_budget_gib",
)


@dataclass(frozen=True)
class BudgetDiff:
    """The same rank in two runs: ``after − before`` for each number both have."""

    label: str
    rank_key: tuple
    before: KvBudget | None
    after: KvBudget | None
    deltas: dict
    explanation: list[str]

    def to_dict(self) -> dict:
        """Plain dict (for JSON)."""
        return {
            "label": self.label,
            "rank_key": list(self.rank_key),
            "before": self.before.to_dict() if self.before else None,
            "after": self.after.to_dict() if self.after else None,
            "deltas": dict(self.deltas),
            "explanation": list(self.explanation),
        }


def _delta(a: KvBudget, b: KvBudget, name: str) -> float | int | None:
    x, y = getattr(a, name), getattr(b, name)
    if x is None or y is None:
        return None
    return y - x


def _explain_diff(a: KvBudget, b: KvBudget, deltas: dict) -> list[str]:
    lines = []
    d_rest = deltas.get("rest_gib")
    if d_rest is not None:
        d_avail = deltas.get("available_gpu_memory") or 0.0
        d_slack = deltas.get("slack_gib") or 0.0
        lines.append(
            f"rest {d_rest:+.2f} GiB ({gib_text(a.rest_gib)} → {gib_text(b.rest_gib)}) = "
            f"available after weights {d_avail:+.2f} GiB − slack {d_slack:+.2f} GiB"
        )
        d_pre = deltas.get("pre_model_load_memory")
        d_frac = deltas.get("mem_fraction_static")
        if d_pre:
            lines.append(
                f"  pre_model_load_memory {d_pre:+.2f} GiB: memory taken (or freed) before the weights, "
                "after NCCL and the custom all-reduce (WORLD MIN)"
            )
        if d_frac:
            lines.append(f"  mem_fraction_static {d_frac:+.3f}")
        d_weights = deltas.get("weight_load_mem_usage")
        if d_avail and d_pre is not None:
            # available = pre − (what the weights and everything since took)
            consumed = d_pre - d_avail
            if abs(consumed) >= 0.005:
                lines.append(
                    f"  between the baseline and sizing, {consumed:+.2f} GiB more was taken"
                    + (f" (weights {d_weights:+.2f} GiB)" if d_weights is not None else "")
                )
    if deltas.get("tokens") is not None:
        lines.append(f"tokens {deltas['tokens']:+,} ({a.tokens:,} → {b.tokens:,})")
    if a.ok != b.ok:
        lines.append("sizing " + ("now fails: " + (b.error or "budget <= 0") if not b.ok else "now succeeds"))
    return lines


def compare_budgets(before: list[KvBudget], after: list[KvBudget]) -> list[BudgetDiff]:
    """Match ranks of two runs (by dp/pp/tp rank and draft) and explain what moved.

    Ranks found in only one run come with the other side None. The change in ``rest`` is split
    exactly into the change in available memory after the weights and the change in slack
    (``Δrest = Δavailable − Δslack``).
    """
    index_a = {b.rank_key: b for b in before}
    index_b = {b.rank_key: b for b in after}
    keys = sorted(set(index_a) | set(index_b), key=lambda k: (none_last(k[0]), none_last(k[1]), none_last(k[2]), k[3]))
    out = []
    for key in keys:
        a, b = index_a.get(key), index_b.get(key)
        label = (b or a).label  # type: ignore[union-attr]
        if a is None or b is None:
            out.append(BudgetDiff(label, key, a, b, {}, ["only in the " + ("second" if a is None else "first") + " run"]))
            continue
        deltas = {name: _delta(a, b, name) for name in _DELTA_FIELDS}
        deltas = {k: v for k, v in deltas.items() if v is not None}
        out.append(BudgetDiff(label, key, a, b, deltas, _explain_diff(a, b, deltas)))
    return out
