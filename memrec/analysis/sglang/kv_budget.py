"""SGLang's KV-cache budget, rebuilt per rank from the markers ``memrec.sglang_hooks`` sends.

SGLang sizes its KV cache at startup from three numbers each scheduler process measured or was
given (every SGLang version since 0.4, see ``docs/sglang.md``)::

    rest_memory = available_after_weights − pre_model_load_memory × (1 − mem_fraction_static)
    tokens      = int(rest_memory × 2**30) // cell_size

- ``pre_model_load_memory`` (``total_gpu_memory`` / ``min_per_gpu_memory`` in older code): the
  free memory measured after NCCL and the custom all-reduce were set up and before the weights,
  as a MIN over every rank of the world (a collective). It is not the GPU's capacity.
- ``available_after_weights`` (``available_gpu_memory`` / ``post_model_load_memory``): the free
  memory measured again when the KV cache is sized, also a WORLD MIN.
- ``mem_fraction_static``: ``--mem-fraction-static``. The slack ``pre × (1 − fraction)`` is
  kept for activations, CUDA graphs and workspaces.

When ``rest_memory <= 0`` SGLang 0.5.23 raises ``ValueError("Loaded weights leave no GPU memory
for the KV cache ...")``; when the token count ends up ``<= 0`` every version raises
``RuntimeError("Not enough memory. Please try to increase --mem-fraction-static ...")``. The
smallest fraction that leaves a positive budget is ``1 − available / pre``.

Units: SGLang measures free memory as ``bytes / 2**30`` and prints it as "GB": those values are
GiB floats here too, under SGLang's names (``pre_model_load_memory``, ``available_gpu_memory``,
``rest_memory``, ``weight_load_mem_usage``). Fields ending in ``_bytes`` are bytes; ``_gib``
fields are GiB computed by memrec. ``cell_size`` is bytes of KV per token (all layers).

Everything here is a pure function of markers (:class:`memrec.terms.events.Marker`): no trace file,
no numpy. ``compare_budgets`` is the logic behind ``memrec diff``'s KV section.
"""

from __future__ import annotations

import math
import operator
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Iterable

from memrec.terms.events import Marker

#: Bytes in the "GB" SGLang prints (it divides by 1 << 30).
GIB = 1 << 30

#: Failure texts (see memrec.sglang_hooks.targets).
NO_MEMORY_FOR_KV = "Loaded weights leave no GPU memory"
NOT_ENOUGH_MEMORY = "Not enough memory"
POOL_TOO_SMALL = "Memory pool size is too small"

_KV_BUDGET = "kv_budget"
_KV_POOL = "kv_pool"
_BASELINE = "memory_baseline"
_LOAD = "load_weights"
_WORKER = "init_model_worker"
_DIST = "dist_init"
_MEASURED = "gpu_memory_measured"
#: Callers of SGLang's memory measurement that size the KV cache (0.5.10 and 0.5.23 names).
PROFILERS = ("profile_max_num_token", "_profile_available_bytes")
#: The names without which :func:`kv_budgets` finds no budget.
_SIZING = frozenset({_KV_BUDGET, _KV_POOL, _BASELINE})

_NAME = operator.attrgetter("name")


def any_named(markers: list[Marker], names: frozenset[str]) -> bool:
    """Whether one of ``markers`` has one of ``names``: the SGLang passes (a sort and a Python
    body per marker) skip a trace without them at this cost (a step loop's 50,000 markers)."""
    return not names.isdisjoint(map(_NAME, markers))  # (no generator: 50,000 markers)


def rest_memory(available: float, pre_model_load_memory: float, mem_fraction_static: float) -> float:
    """SGLang's KV budget in GiB: ``available − pre × (1 − mem_fraction_static)``."""
    return available - pre_model_load_memory * (1 - mem_fraction_static)


def slack_memory(pre_model_load_memory: float, mem_fraction_static: float) -> float:
    """The GiB kept out of the KV cache: ``pre × (1 − mem_fraction_static)``."""
    return pre_model_load_memory * (1 - mem_fraction_static)


def rest_bytes(rest_gib: float) -> int:
    """``int(rest × 2**30)``, as SGLang converts it."""
    return int(rest_gib * GIB)


def tokens_from_rest(rest_gib_or_bytes: float | int, cell_size: int, *, is_bytes: bool = False) -> int:
    """``int(rest × 2**30) // cell_size`` (0.5.7 – 0.5.10's ``profile_max_num_token``).

    Raises:
        ValueError: ``cell_size`` is not positive.
    """
    if cell_size <= 0:
        raise ValueError(f"cell_size must be positive, got {cell_size}")
    nbytes = int(rest_gib_or_bytes) if is_bytes else rest_bytes(rest_gib_or_bytes)
    return nbytes // cell_size


def min_mem_fraction_static(available: float, pre_model_load_memory: float) -> float | None:
    """The smallest ``mem_fraction_static`` with a positive budget: ``1 − available / pre``.

    (SGLang 0.5.23 prints it as "minimum viable"; any larger fraction gives ``rest > 0``.)
    None when ``pre`` is not positive.
    """
    if not pre_model_load_memory or pre_model_load_memory <= 0:
        return None
    return 1 - available / pre_model_load_memory


def classify_error(text: str | None) -> str | None:
    """``no_memory_for_kv`` | ``not_enough_memory`` | ``pool_too_small`` | ``other`` | None."""
    if not text:
        return None
    if NO_MEMORY_FOR_KV in text:
        return "no_memory_for_kv"
    if NOT_ENOUGH_MEMORY in text:
        return "not_enough_memory"
    if POOL_TOO_SMALL in text:
        return "pool_too_small"
    return "other"


@dataclass(frozen=True)
class KvBudget:
    """One scheduler process's KV sizing (``draft``: its speculative-decoding draft runner).

    GiB floats unless the name ends in ``_bytes`` / is a token count; None when not recorded.
    """

    pid: int
    tp_rank: int | None = None
    pp_rank: int | None = None
    dp_rank: int | None = None
    draft: bool = False
    gpu: int | None = None  # physical GPU (NVML index) the daemon resolved for the marker
    gpu_uuid: str | None = None
    cuda_device: int | None = None  # the process's device ordinal
    pre_model_load_memory: float | None = None
    available_gpu_memory: float | None = None  # after weights, as SGLang measured it
    available_is_world_min: bool | None = None  # measured with distributed=True
    mem_fraction_static: float | None = None
    slack_gib: float | None = None
    rest_gib: float | None = None  # reconstructed with the formula
    rest_bytes: int | None = None
    sglang_rest_bytes: int | None = None  # what SGLang returned (0.5.11+; includes its extra reservations)
    cell_size: int | None = None
    tokens: int | None = None  # SGLang's own count when it computed one, else memrec's
    tokens_source: str | None = None  # "sglang" (SGLang's count) | "cell_size" (memrec's rest // cell) | "pool"
    sglang_tokens: int | None = None  # SGLang's count: profile_max_num_token (≤ 0.5.10), calculate_pool_sizes (0.5.11+)
    memrec_tokens: int | None = None  # rest bytes // cell_size (SGLang's rest when it returned one)
    max_total_num_tokens: int | None = None  # the pool's final size (after caps, page alignment)
    #: SGLang's terms beyond the formula, GiB (negative: subtracted): "other_reservations" (mamba
    #: cache, multimodal, activation reserve: SGLang's rest − the formula's). None: not recorded.
    other_reservations_gib: float | None = None
    #: The terms SGLang reported on its own (hooks 0.5.7+ / 0.5.18+ / 0.5.22+): the mamba state
    #: cache (GiB, negative: taken from the rest), the multimodal reservation (GiB), the pool's
    #: fixed overhead (bytes) and page size (tokens).
    mamba_cache_gib: float | None = None
    mm_reservation_gib: float | None = None
    fixed_overhead_bytes: int | None = None
    page_size: int | None = None
    #: Terms SGLang used whose values are unknown because it raised before returning them; then
    #: ``rest_gib`` and ``min_mem_fraction_static`` are bounds (SGLang's rest ≤ rest_gib).
    unknown_terms: tuple[str, ...] = ()
    #: A speculative-decoding draft runner does not keep a budget of its own: the target's pool
    #: size overwrites it (``draft_runner_cache_size`` up to 0.5.10, the target's
    #: MemoryPoolConfig after), so its rest/tokens never fail or size anything.
    sized_by_target: bool = False
    min_mem_fraction_static: float | None = None
    weight_load_mem_usage: float | None = None
    local_free_at_baseline_gib: float | None = None  # this GPU alone (mem_get_info), not WORLD MIN
    local_free_at_budget_gib: float | None = None
    error: str | None = None
    error_kind: str | None = None
    ts: int | None = None  # when the budget was taken (kv_budget end)

    @property
    def ok(self) -> bool:
        """Sizing succeeded with a positive budget (as far as the markers tell)."""
        if self.error:
            return False
        if self.sized_by_target:
            return True
        if self.tokens is not None and self.tokens_source == "sglang":
            return self.tokens > 0  # SGLang's own count decides (it subtracts more than the formula)
        if self.rest_gib is not None and self.rest_gib <= 0:
            return False
        return not (self.tokens is not None and self.tokens <= 0)

    @property
    def rank_key(self) -> tuple:
        """What matches the same rank across two runs: ``(dp, pp, tp, draft)``."""
        return (self.dp_rank, self.pp_rank, self.tp_rank, self.draft)

    @property
    def label(self) -> str:
        """``DP0 PP0 TP3 draft`` style name (parts that are known)."""
        parts = []
        if self.dp_rank is not None:
            parts.append(f"DP{self.dp_rank}")
        if self.pp_rank is not None and self.pp_rank != 0:
            parts.append(f"PP{self.pp_rank}")
        parts.append(f"TP{self.tp_rank}" if self.tp_rank is not None else f"pid {self.pid}")
        if self.draft:
            parts.append("draft")
        return " ".join(parts)

    def to_dict(self) -> dict:
        """Plain dict (for JSON reports), with ``ok`` and ``label``."""
        out = asdict(self)
        out["unknown_terms"] = list(self.unknown_terms)  # JSON has no tuples
        out["ok"] = self.ok
        out["label"] = self.label
        return out


def _num(value: object) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def _int(value: object) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    return None


def _is_draft(marker: Marker) -> bool:
    return bool(marker.values.get("is_draft_worker", False))


@dataclass
class _Group:
    pid: int
    draft: bool
    budget: Marker | None = None  # kv_budget end
    pool: Marker | None = None  # kv_pool end
    baseline: Marker | None = None
    load: Marker | None = None
    worker: Marker | None = None
    dist: Marker | None = None
    measured: Marker | None = None  # last profiling measurement
    ranks: dict = field(default_factory=dict)


def _take_ranks(group: _Group, marker: Marker) -> None:
    for key in ("tp_rank", "pp_rank", "dp_rank"):
        value = marker.values.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            group.ranks.setdefault(key, value)


def kv_budgets(markers: Iterable[Marker]) -> list[KvBudget]:
    """The KV budget of every scheduler process (and draft runner) the markers show.

    A process (or draft runner) appears when it sent a ``kv_budget``, ``kv_pool`` or
    ``memory_baseline`` marker. When it sized more than once, the last sizing counts.
    Sorted by (dp, pp, tp, draft, pid).
    """
    markers = markers if isinstance(markers, list) else list(markers)
    if not any_named(markers, _SIZING):
        return []
    groups: dict[tuple[int, bool], _Group] = {}
    shared: dict[int, _Group] = {}  # per pid: markers that belong to the process as a whole

    for marker in sorted(markers, key=lambda m: m.ts):
        if marker.phase == "begin":
            continue
        name = marker.name
        whole = shared.setdefault(marker.pid, _Group(marker.pid, False))
        _take_ranks(whole, marker)
        if name in (_DIST, _WORKER):
            if name == _DIST:
                whole.dist = marker
            else:
                whole.worker = marker
            continue
        if name == _MEASURED:
            caller = str(marker.values.get("caller", ""))
            if caller.endswith(PROFILERS):
                whole.measured = marker
            continue
        if name not in (_KV_BUDGET, _KV_POOL, _BASELINE, _LOAD):
            continue
        key = (marker.pid, _is_draft(marker))
        group = groups.setdefault(key, _Group(marker.pid, key[1]))  # weights alone: dropped below
        _take_ranks(group, marker)
        if name == _KV_BUDGET:
            group.budget = marker
        elif name == _KV_POOL:
            group.pool = marker
        elif name == _BASELINE:
            group.baseline = marker
        else:
            group.load = marker

    out = []
    for (pid, _draft), group in groups.items():
        if group.budget is None and group.pool is None and group.baseline is None:
            continue
        out.append(_build(group, shared.get(pid)))
    out.sort(key=lambda b: (none_last(b.dp_rank), none_last(b.pp_rank), none_last(b.tp_rank), b.draft, b.pid))
    return out


def none_last(value: int | None) -> tuple:
    """Sort key: unknown (None) after every number."""
    return (value is None, value or 0)


def _first(*candidates: object) -> object:
    for value in candidates:
        if value is not None:
            return value
    return None


def _values(marker: Marker | None) -> dict:
    return marker.values if marker is not None else {}


def _build(group: _Group, whole: _Group | None) -> KvBudget:
    b, p, base = _values(group.budget), _values(group.pool), _values(group.baseline)
    load = _values(group.load)
    w = _values(whole.worker) if whole else {}
    d = _values(whole.dist) if whole else {}
    measured = _values(whole.measured) if whole else {}
    ranks = dict(whole.ranks) if whole else {}
    ranks.update(group.ranks)

    pre = _num(_first(b.get("pre_model_load_memory"), base.get("pre_model_load_memory"), p.get("pre_model_load_memory")))
    available, world_min = _available(b, measured, group.draft)
    fraction = _num(_first(b.get("mem_fraction_static"), d.get("mem_fraction_static")))
    cell = _int(_first(b.get("cell_size"), p.get("cell_size")))
    if cell is not None and cell <= 0:
        cell = None
    sglang_rest = _int(b.get("rest_memory_bytes"))
    sglang_tokens = _int(_first(b.get("max_num_token"), p.get("sglang_tokens")))
    final_tokens = _int(p.get("max_total_num_tokens"))

    slack = rest = None
    nbytes = None
    if pre is not None and fraction is not None:
        slack = slack_memory(pre, fraction)
        if available is not None:
            rest = available - slack
            nbytes = rest_bytes(rest)

    memrec_tokens = None
    if cell is not None and (sglang_rest is not None or nbytes is not None):
        memrec_tokens = (sglang_rest if sglang_rest is not None else nbytes) // cell  # type: ignore[operator]
    tokens, source = _tokens(sglang_tokens, memrec_tokens, final_tokens)
    other = _other_reservations(rest, sglang_rest, b, sglang_tokens, cell)

    before_mamba, after_mamba = _num(b.get("rest_before_mamba_gib")), _num(b.get("rest_after_mamba_gib"))

    minimum = min_mem_fraction_static(available, pre) if available is not None and pre is not None else None

    error = next((str(c["error"]) for c in ((b, p) if group.draft else (b, p, w)) if c.get("error")), None)
    # SGLang raised inside its budget function: whatever it subtracts beyond the formula is unknown.
    unknown = ("other_reservations",) if b.get("error") and sglang_rest is None and sglang_tokens is None else ()

    any_marker = group.budget or group.pool or group.baseline
    return KvBudget(
        pid=group.pid,
        tp_rank=ranks.get("tp_rank"),
        pp_rank=ranks.get("pp_rank"),
        dp_rank=ranks.get("dp_rank"),
        draft=group.draft,
        gpu=any_marker.gpu if any_marker is not None else None,
        gpu_uuid=_first(b.get("gpu_uuid"), p.get("gpu_uuid"), base.get("gpu_uuid")),  # type: ignore[arg-type]
        cuda_device=_int(_first(b.get("cuda_device"), p.get("cuda_device"), base.get("cuda_device"))),
        pre_model_load_memory=pre,
        available_gpu_memory=available,
        available_is_world_min=None if world_min is None else bool(world_min),
        mem_fraction_static=fraction,
        slack_gib=slack,
        rest_gib=rest,
        rest_bytes=nbytes,
        sglang_rest_bytes=sglang_rest,
        cell_size=cell,
        tokens=tokens,
        tokens_source=source,
        sglang_tokens=sglang_tokens,
        memrec_tokens=memrec_tokens,
        max_total_num_tokens=final_tokens,
        other_reservations_gib=other,
        mamba_cache_gib=after_mamba - before_mamba if before_mamba is not None and after_mamba is not None else None,
        mm_reservation_gib=_num(b.get("mm_reservation_gib")),
        fixed_overhead_bytes=_int(p.get("fixed_overhead_bytes")),
        page_size=_int(p.get("page_size")),
        unknown_terms=unknown,
        sized_by_target=group.draft,
        min_mem_fraction_static=minimum,
        weight_load_mem_usage=_num(load.get("weight_load_mem_usage")),
        local_free_at_baseline_gib=_gib_of(_int(base.get("free_bytes"))),
        local_free_at_budget_gib=_gib_of(_int(b.get("free_bytes"))),
        error=error,
        error_kind=classify_error(error),
        ts=group.budget.ts if group.budget is not None else None,
    )


def _gib_of(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / GIB


def _available(b: dict, measured: dict, draft: bool) -> tuple[float | None, Any]:
    """SGLang's available GPU memory and whether it is the world's minimum: the budget marker's,
    else (the target runner) what the hooks measured around its ``get_available_gpu_memory``."""
    available = _num(b.get("available_gpu_memory"))
    world_min = b.get("available_gpu_memory_distributed")
    if available is None and measured and not draft:
        available = _num(measured.get("result_gib"))
        world_min = measured.get("distributed")
    return available, world_min


def _tokens(sglang_tokens: int | None, memrec_tokens: int | None,
            final_tokens: int | None) -> tuple[int | None, str | None]:
    """The KV cache's token count and where it came from: SGLang's own, else rest / cell size,
    else the pool's final count."""
    if sglang_tokens is not None:
        return sglang_tokens, "sglang"
    if memrec_tokens is not None:
        return memrec_tokens, "cell_size"
    if final_tokens is not None:
        return final_tokens, "pool"
    return None, None


def _other_reservations(rest: float | None, sglang_rest: int | None, b: dict, sglang_tokens: int | None,
                        cell: int | None) -> float | None:
    """SGLang's terms beyond the formula (GiB): its own rest (0.5.11+), or what its token count
    implies (≤ 0.5.10: tokens × cell is its rest to within one cell)."""
    if rest is None:
        return None
    if sglang_rest is not None:
        return sglang_rest / GIB - rest
    if b.get("max_num_token") is not None and sglang_tokens is not None and cell is not None:
        implied = sglang_tokens * cell / GIB
        return implied - rest if abs(implied - rest) >= cell / GIB else 0.0
    return None


# -- explanation -------------------------------------------------------------------------------


def gib_text(value: float | None) -> str:
    """``12.34 GiB``, ``?`` when unknown."""
    return "?" if value is None else f"{value:.2f} GiB"


def explain(budget: KvBudget) -> list[str]:
    """Lines that show the formula with this rank's real numbers (for reports)."""
    b = budget
    where = f"{b.label} (pid {b.pid}" + (f", GPU {b.gpu}" if b.gpu is not None else "") + ")"
    if b.sized_by_target:
        own = f"; its own profile ({b.sglang_tokens:,} tokens) is discarded" if b.sglang_tokens is not None else ""
        return [f"{where}: sized by the target (the draft uses the target's pool size{own})"] + (
            [f"  sizing failed: {b.error}"] if b.error else [])
    lines = []
    if b.rest_gib is not None:
        lines.append(
            f"{where}: rest {'≤' if b.unknown_terms else '='} available {gib_text(b.available_gpu_memory)} − pre_model_load_memory "
            f"{gib_text(b.pre_model_load_memory)} × (1 − {b.mem_fraction_static:.3f}) = {gib_text(b.rest_gib)}"
        )
    else:
        lines.append(
            f"{where}: pre_model_load_memory {gib_text(b.pre_model_load_memory)}, available "
            f"{gib_text(b.available_gpu_memory)}, mem_fraction_static "
            f"{'?' if b.mem_fraction_static is None else f'{b.mem_fraction_static:.3f}'}"
        )
    lines += ["  " + line for line in terms_lines(b)]
    if b.min_mem_fraction_static is not None:
        lines.append(
            f"  minimum viable mem_fraction_static {'≥' if b.unknown_terms else '='} 1 − "
            f"{b.available_gpu_memory:.2f} / {b.pre_model_load_memory:.2f} = {b.min_mem_fraction_static:.4f}"
        )
    if b.error:
        lines.append(f"  sizing failed: {b.error}")
    return lines


def terms_lines(b: KvBudget) -> list[str]:
    """SGLang's own terms beyond the formula, its token count, and what is unknown."""
    lines = []
    if b.other_reservations_gib is not None and abs(b.other_reservations_gib) >= 0.005:
        own = f"{gib_text(b.sglang_rest_bytes / GIB)}" if b.sglang_rest_bytes is not None else "implied by its token count"
        known = [(name, v) for name, v in (("mamba cache", b.mamba_cache_gib),
                                            ("multimodal reservation", -b.mm_reservation_gib if b.mm_reservation_gib else None))
                 if v]
        rest = b.other_reservations_gib - sum(v for _, v in known)
        parts = [f"{name} {v:+.2f} GiB" for name, v in known]
        if abs(rest) >= 0.005 or not parts:
            parts.append(f"{'other (activation reserve, …)' if parts else 'mamba cache, multimodal, activation reserve'} "
                         f"{rest:+.2f} GiB")
        lines.append(f"SGLang's own rest: {own} ({b.other_reservations_gib:+.2f} GiB of its other terms: {', '.join(parts)})")
    if b.fixed_overhead_bytes:
        lines.append(f"pool: fixed overhead {b.fixed_overhead_bytes:,} B charged before dividing by the cell size")
    if b.unknown_terms:
        lines.append(
            "unknown: SGLang's other reservations (mamba cache, multimodal, activation reserve): it raised "
            "before returning its rest, so the rest above is an upper bound and the minimum fraction a lower one"
        )
    if b.tokens is not None:
        if b.tokens_source == "sglang":
            lines.append(f"→ {b.tokens:,} tokens (SGLang's own count)")
            if b.memrec_tokens is not None and b.memrec_tokens != b.tokens:
                lines.append(
                    f"  (rest // cell_size {b.cell_size:,} B/token would give {b.memrec_tokens:,}: SGLang subtracted "
                    f"{b.memrec_tokens - b.tokens:+,} tokens more: fixed overhead, page alignment or the reservations above)"
                )
        elif b.tokens_source == "cell_size":
            lines.append(f"→ {b.tokens:,} tokens (rest // cell {b.cell_size:,} B/token; SGLang's own count not recorded)")
        else:
            lines.append(f"→ {b.tokens:,} tokens (the pool's size)")
    if b.max_total_num_tokens is not None and b.max_total_num_tokens != b.tokens:
        lines.append(f"pool: max_total_num_tokens = {b.max_total_num_tokens:,} (after caps and page alignment)")
    return lines


def summarize(budgets: list[KvBudget]) -> dict:
    """One run's KV sizing in a few numbers.

    Returns a dict with ``ranks`` (target runners), ``failed`` (any rank failed),
    ``errors`` (distinct texts), ``min_rest_gib`` and ``min_rest_label``, ``min_tokens``,
    ``needed_mem_fraction_static`` (the largest per-rank minimum: the fraction that works for
    every rank), ``local_free_spread_gib`` (max − min of the per-GPU free memory at sizing: a
    large spread means one GPU pulled the WORLD MIN down) and ``lowest_free_label``.
    """
    targets = [b for b in budgets if not b.draft]
    rests = [b for b in targets if b.rest_gib is not None]
    worst = min(rests, key=lambda b: b.rest_gib) if rests else None  # type: ignore[arg-type,return-value]
    token_counts = [b.tokens for b in targets if b.tokens is not None]
    minimums = [b.min_mem_fraction_static for b in targets if b.min_mem_fraction_static is not None]
    frees = [b for b in targets if b.local_free_at_budget_gib is not None]
    lowest = min(frees, key=lambda b: b.local_free_at_budget_gib) if frees else None  # type: ignore[arg-type,return-value]
    return {
        "ranks": len(targets),
        "failed": any(not b.ok for b in budgets),
        "errors": sorted({b.error for b in budgets if b.error}),
        "min_rest_gib": worst.rest_gib if worst else None,
        "min_rest_label": worst.label if worst else None,
        "min_tokens": min(token_counts) if token_counts else None,
        "needed_mem_fraction_static": max(minimums) if minimums else None,
        "local_free_spread_gib": (
            max(b.local_free_at_budget_gib for b in frees) - min(b.local_free_at_budget_gib for b in frees)  # type: ignore[type-var,operator]
            if frees
            else None
        ),
        "lowest_free_label": lowest.label if lowest else None,
    }
