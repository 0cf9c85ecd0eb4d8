"""The SGLang section of ``memrec report``: per rank, the startup phases and the KV budget.

Built from the markers ``memrec.sglang_hooks`` sends (``docs/sglang.md``) and the replay's
journal. For every scheduler process (a TP/PP/DP rank):

- each startup phase (``dist_init`` with NCCL and the custom all-reduce, ``memory_baseline``,
  ``load_weights``, ``kv_budget``, ``kv_pool``, ``attention_backends``, ``cuda_graph_capture``,
  …) with the net bytes it took per GPU and category, SGLang's own numbers from its markers, and
  where it falls against the KV sizing (before the baseline, between the baseline and the sizing,
  after the sizing);
- the KV budget worked out with the rank's real values
  (``rest = available_after_weights − pre_model_load_memory × (1 − mem_fraction_static)``), the
  token count and the minimum viable ``--mem-fraction-static``;
- what every process on the rank's GPU allocated between the memory baseline and the KV sizing
  (memory taken there lowers ``rest`` one for one), and, when sizing failed, the error SGLang
  raised and which phases' allocations made the difference.

Ranks come from the markers' ``tp_rank`` / ``pp_rank`` / ``dp_rank`` (:mod:`memrec.terms.ranks`).
``memrec diff`` (:mod:`memrec.analysis.diff.build`) uses the same windows (:mod:`memrec.analysis.sglang.windows`).

Pure: takes the trace's markers, :class:`~memrec.engine.phases.Phases` and the replay's
:class:`~memrec.engine.journal.Journal`; returns a :class:`~memrec.analysis.sglang.model.SglangSection`
(bytes exact ints, SGLang's GiB as floats under its own names; ``to_json()`` for the report's JSON).
"""

from __future__ import annotations

from typing import Any

from memrec.analysis.sglang.kv_budget import GIB
from memrec.analysis.sglang.kv_budget import PROFILERS
from memrec.analysis.sglang.kv_budget import KvBudget
from memrec.analysis.sglang.kv_budget import any_named
from memrec.analysis.sglang.kv_budget import kv_budgets
from memrec.analysis.sglang.kv_budget import summarize
from memrec.analysis.sglang.kv_budget import terms_lines
from memrec.engine.phases import NO_PHASE
from memrec.engine.phases import Phases
from memrec.analysis.sections import OMITTED
from memrec.analysis.sglang.facts import contexts_line
from memrec.analysis.sglang.facts import custom_ar_facts
from memrec.analysis.sglang.facts import custom_ar_line
from memrec.analysis.sglang.facts import jsonable
from memrec.analysis.sglang.facts import markers_dropped
from memrec.analysis.sglang.facts import nccl_line
from memrec.analysis.sglang.facts import nccl_vmm
from memrec.analysis.sglang.facts import oom_line
from memrec.analysis.sglang.facts import ooms_after_sizing
from memrec.analysis.sglang.facts import process_contexts
from memrec.analysis.sglang.facts import torch_reserved_delta
from memrec.terms.events import OWNED
from memrec.engine.journal import Journal
from memrec.terms.events import CATEGORIES
from memrec.terms.events import Marker
from memrec.terms.ranks import format_rank
from memrec.terms.ranks import marker_ranks
from memrec.terms.ranks import rank_sort_key
from memrec.terms.ranks import shown_dims
from memrec.analysis.sglang.model import Diagnosis
from memrec.analysis.sglang.model import RankBudget
from memrec.analysis.sglang.model import RankError
from memrec.analysis.sglang.model import SglangPhase
from memrec.analysis.sglang.model import SglangRank
from memrec.analysis.sglang.model import SglangFacts
from memrec.analysis.sglang.model import SglangSection
from memrec.analysis.sglang.model import SglangSummary
from memrec.analysis.sglang.windows import MAPPED
from memrec.analysis.sglang.windows import KvTimes
from memrec.analysis.sglang.windows import KvWindow
from memrec.analysis.sglang.windows import ShownWindow
from memrec.analysis.sglang.windows import WindowRow
from memrec.analysis.sglang.windows import kv_times
from memrec.analysis.sglang.windows import kv_windows
from memrec.analysis.sglang.windows import rank_gpus
from memrec.analysis.text import human
from memrec.analysis.text import scalar
from memrec.analysis.text import seconds
from memrec.analysis.text import table

#: Marker names the SGLang hooks (and the stand-in) send.
SGLANG_MARKERS = frozenset(
    {
        "dist_init", "custom_ar_init", "custom_ar_shared_buffer", "custom_ar_workspace",
        "custom_ar_graph_register", "memory_baseline", "load_weights", "kv_budget", "kv_pool",
        "attention_backends", "cuda_graph_capture", "init_model_worker", "gpu_memory_measured",
    }
)
#: Enough to call a trace an SGLang one ("load_weights" alone is too common a name).
_SPECIFIC = SGLANG_MARKERS - {"load_weights"}

#: Phase position against the KV sizing.
BEFORE = "before baseline"
BETWEEN = "baseline→sizing"
SIZING = "sizing"
AFTER = "after sizing"
AROUND_SIZING = "around sizing"
AROUND_BASELINE = "around baseline"

#: SGLang's values worth showing per marker (GiB floats under SGLang's names unless noted).
_SHOWN = {
    "dist_init": ("tp_size", "pp_size", "dp_size", "mem_fraction_static", "disable_custom_all_reduce",
                  "pre_model_load_memory"),
    "custom_ar_init": ("custom_ar_class", "class_name", "max_size", "world_size"),
    "custom_ar_shared_buffer": ("size_in_bytes",),
    "custom_ar_workspace": ("max_size",),
    "memory_baseline": ("pre_model_load_memory",),
    "load_weights": ("weight_load_mem_usage",),
    "gpu_memory_measured": ("result_gib", "distributed"),
    "kv_budget": ("available_gpu_memory", "rest_memory_bytes", "max_num_token"),
    "kv_pool": ("max_total_num_tokens", "cell_size"),
    "cuda_graph_capture": ("graph_memory_usage",),
}
_GIB_VALUES = {"pre_model_load_memory", "available_gpu_memory", "weight_load_mem_usage", "result_gib",
               "graph_memory_usage"}
_BYTE_VALUES = {"max_size", "size_in_bytes", "rest_memory_bytes"}
#: Instants listed among a rank's phases.
_INSTANTS = {"memory_baseline", "custom_ar_shared_buffer", "custom_ar_workspace"}


# ------------------------------------------------------------------------------------------ ranks


def has_sglang_markers(markers: list[Marker]) -> bool:
    """Whether the markers include ones only the SGLang hooks send."""
    return any_named(markers, _SPECIFIC)


# ---------------------------------------------------------------------------------------- section


def _shown_values(name: str, values: dict) -> dict:
    keys = _SHOWN.get(name, ())
    out = {}
    for k, v in values.items():
        if k in keys or (name == "cuda_graph_capture" and k.startswith("graph_memory_usage")):
            out[k] = jsonable(v)
    if values.get("error"):
        out["error"] = str(values["error"])
    return out


def _when(start: int, end: int, name: str, t: KvTimes | None) -> str | None:
    if t is None:
        return None
    if name == "kv_budget":
        return SIZING
    if t.baseline_ts is not None and end <= t.baseline_ts:
        return BEFORE
    if t.sizing_ts is not None and start >= t.sizing_ts:
        return AFTER
    if t.baseline_ts is not None and t.sizing_ts is not None and start >= t.baseline_ts and end <= t.sizing_ts:
        return BETWEEN
    if t.sizing_ts is not None and start <= t.sizing_ts <= end:
        return AROUND_SIZING  # e.g. kv_pool, whose span holds kv_budget (0.5.10, 0.5.23)
    if t.baseline_ts is not None and start <= t.baseline_ts <= end:
        return AROUND_BASELINE
    return None


def _phase_rows(pid: int, phases: Phases, usage: list, t: KvTimes | None, start: int, gpu: int | None,
                torch_delta: dict | None = None) -> list[SglangPhase]:
    """One row per (phase, GPU) of ``pid`` (a phase without memory: one row, its marker's GPU)."""
    mem: dict[int, dict[int, dict[str, int]]] = {}
    for u in usage:
        if u.pid == pid and u.phase >= 0:
            cats = mem.setdefault(u.phase, {}).setdefault(u.gpu, {})
            cats[u.category] = cats.get(u.category, 0) + u.net
    rows = []
    for ph in phases.phases:
        if ph.pid != pid:
            continue
        per_gpu = mem.get(ph.id) or {ph.gpu if ph.gpu is not None else -1: {}}
        for g, cats in sorted(per_gpu.items()):
            if gpu is not None and g != gpu:
                continue
            cats = {c: cats[c] for c in CATEGORIES if cats.get(c)}
            row = SglangPhase(
                kind="phase", name=ph.name, path=ph.path, depth=ph.depth,
                gpu=None if g < 0 else g, start_ts=ph.start, end_ts=ph.end,
                start_s=seconds(ph.start - start), end_s=seconds(ph.end - start), closed=ph.closed,
                when=_when(ph.start, ph.end, ph.name, t),
                by_category=cats,
                net=sum(v for c, v in cats.items() if c in OWNED),
                mapped_net=cats.get(MAPPED, 0),
                values=_shown_values(ph.name, ph.values),
            )
            delta = (torch_delta or {}).get((pid, ph.start, ph.name))
            if delta is not None and (ph.gpu is None or g in (ph.gpu, -1)):
                row.torch_reserved = delta
                row.non_torch = row.net - delta
            rows.append(row)
    for i in phases.instants:
        if i.pid != pid:
            continue
        profiler = i.name == "gpu_memory_measured" and str(i.values.get("caller", "")).endswith(PROFILERS)
        if i.name not in _INSTANTS and not profiler:
            continue
        depth = phases.phases[i.phase].depth + 1 if i.phase >= 0 else 0
        rows.append(
            SglangPhase(
                kind="instant", name=i.name, path=i.name, depth=depth, gpu=i.gpu,
                start_ts=i.ts, end_ts=i.ts, start_s=seconds(i.ts - start), end_s=seconds(i.ts - start),
                closed=True, when=None, by_category={}, net=0, mapped_net=0,
                values=_shown_values(i.name, i.values),
            )
        )
    rows.sort(key=lambda r: (r.start_ts, r.kind == "phase", r.depth))
    return rows


def _cats_text(r: WindowRow, human) -> str:
    owned = [f"{c} {human(v)}" for c, v in r.by_category.items() if c != MAPPED]
    text = ", ".join(owned)
    if r.mapped:
        text += ("; " if text else "") + f"{human(r.mapped)} of peers' memory mapped by IPC, not owned"
    return text


def _frac(value: float | None) -> str:
    return "?" if value is None else f"{value:.3f}"


_KV_ERRORS = ("no_memory_for_kv", "not_enough_memory", "pool_too_small")


def kv_failed(b: KvBudget) -> bool:
    """The KV sizing itself failed: a budget or token count <= 0, or one of SGLang's sizing errors.

    (``KvBudget.ok`` is also False when the worker failed later for another reason.) A draft
    runner sized by its target fails only by SGLang's own error.
    """
    if b.sized_by_target:
        return b.error_kind in _KV_ERRORS
    if b.tokens is not None and b.tokens_source == "sglang":
        return b.tokens <= 0 or b.error_kind in _KV_ERRORS
    if b.rest_gib is not None and b.rest_gib <= 0:
        return True
    if b.tokens is not None and b.tokens <= 0:
        return True
    return b.error_kind in _KV_ERRORS


def _took(r: WindowRow, human) -> str:
    """``TP1's custom_ar_init took 18.00 GiB`` / ``pid 7 took 2.00 GiB outside any phase``."""
    who = r.label or f"pid {r.pid}"
    if r.phase == NO_PHASE:
        return f"{who} took {human(r.owned)} outside any phase"
    return f"{who}'s {r.name} took {human(r.owned)}"


def _extras(window: KvWindow) -> list[WindowRow]:
    """What was taken between the baseline and the sizing, the weights left out (largest first)."""
    rows = [r for r in window.between if not r.weights and r.owned > 0]
    return sorted(rows, key=lambda r: (-r.owned, r.first_ts))


def diagnose(budget: KvBudget, window: KvWindow | None, windows: dict[int, KvWindow] | None = None) -> Diagnosis:
    """Which allocations between the baseline and the sizing made ``budget`` fail (or would have).

    ``window``: the rank's GPU; ``windows``: every GPU's (available_after_weights is a MIN over
    the ranks' GPUs, so when the rank's own GPU does not explain the failure another one may).
    """
    windows = windows or {}
    out = Diagnosis()
    if window is None or window.baseline_ts is None:
        return out
    extras = _extras(window)
    weights = sum(r.owned for r in window.between if r.weights)
    extra = sum(r.owned for r in extras)
    out.extra_owned = extra
    out.weights_owned = weights
    if budget.rest_gib is not None:
        out.shortfall_gib = -budget.rest_gib if budget.rest_gib <= 0 else 0.0
        out.rest_without_extras_gib = budget.rest_gib + extra / GIB
    if not kv_failed(budget):
        return out
    g = window.gpu
    lines = out.lines
    for r in sorted(extras, key=lambda r: r.pid != budget.pid):  # its own first
        if r.pid == budget.pid:
            what = "allocations outside any phase" if r.phase == NO_PHASE else r.name
            lines.append(
                f"between the baseline and the KV sizing, {what} took {human(r.owned)} on GPU {g} "
                f"({_cats_text(r, human)})"
            )
        else:
            lines.append(f"on the same GPU, {_took(r, human)} ({_cats_text(r, human)})")
    if budget.rest_gib is None:
        return out
    multi = len(windows) > 1
    short = -budget.rest_gib
    covered = bool(extras) and out.rest_without_extras_gib > 0
    if covered:
        caveat = " (if no other GPU measured less: available is a MIN over the ranks' GPUs)" if multi else ""
        lines.append(
            f"without these {human(extra)}, rest would have been {out.rest_without_extras_gib:.2f} GiB "
            f"instead of {budget.rest_gib:.2f} GiB{caveat}"
        )
        return out
    others = [(w, _extras(w)) for k, w in sorted(windows.items()) if k != g]
    others = [(w, x) for w, x in others if x]
    if multi and others:
        w, rows = max(others, key=lambda wx: (sum(r.owned for r in wx[1]), -wx[0].gpu))
        out.other_gpu = w.gpu
        lines.append(f"available_after_weights is a MIN over the ranks' GPUs; on GPU {w.gpu} in the same window:")
        for r in rows[:3]:
            lines.append(f"  {_took(r, human)} ({_cats_text(r, human)})")
    elif extras:
        lines.append(
            f"without these {human(extra)} rest would still be {out.rest_without_extras_gib:.2f} GiB: the weights "
            f"({human(weights)} on GPU {g}) leave too little at --mem-fraction-static="
            f"{_frac(budget.mem_fraction_static)} (shortfall {short:.2f} GiB)"
        )
    else:
        lines.append(
            f"nothing but the weights ({human(weights)} on GPU {g}) was allocated between the baseline and the "
            f"KV sizing: they leave too little at --mem-fraction-static={_frac(budget.mem_fraction_static)}"
            f" (shortfall {short:.2f} GiB)"
        )
    return out


def budget_lines(b: KvBudget) -> list[str]:
    """SGLang's formula with the rank's real numbers (GiB as SGLang measures them)."""
    if b.sized_by_target:
        own = f"; its own profile ({b.sglang_tokens:,} tokens) is discarded" if b.sglang_tokens is not None else ""
        return [f"sized by the target: the draft uses the target's pool size{own}"] + (
            [f"SGLang raised: {b.error}"] if b.error and b.error_kind in _KV_ERRORS else [])
    lines = []
    f = b.mem_fraction_static
    if b.rest_gib is not None and f is not None:
        rel = "≤" if b.unknown_terms else "="
        lines.append(f"rest   {rel} available_after_weights − pre_model_load_memory × (1 − mem_fraction_static)")
        lines.append(
            f"       {rel} {b.available_gpu_memory:.2f} GiB − {b.pre_model_load_memory:.2f} GiB × (1 − {f:.3f})"
            f" = {b.available_gpu_memory:.2f} GiB − {b.slack_gib:.2f} GiB = {b.rest_gib:.2f} GiB"
        )
    else:
        known = [
            f"{name} {value:.2f} GiB" if isinstance(value, float) and name != "mem_fraction_static" else f"{name} {value}"
            for name, value in (("pre_model_load_memory", b.pre_model_load_memory),
                                ("available_after_weights", b.available_gpu_memory), ("mem_fraction_static", f))
            if value is not None
        ]
        lines.append("incomplete: " + (", ".join(known) if known else "no SGLang numbers") + " (the rest was not recorded)")
    lines += terms_lines(b)
    if b.min_mem_fraction_static is not None:
        ran = "" if f is None else f" (ran with {f:.3f})"
        lines.append(
            f"minimum viable --mem-fraction-static {'≥' if b.unknown_terms else '='} 1 − "
            f"{b.available_gpu_memory:.2f} / {b.pre_model_load_memory:.2f} = {b.min_mem_fraction_static:.4f}{ran}"
        )
    if b.available_is_world_min:
        lines.append("(both measurements are MINs over every rank of the world)")
    if b.error and b.error_kind in _KV_ERRORS:
        lines.append(f"SGLang raised: {b.error}")
    return lines


def build_sglang_section(
    trace: Any, phases: Phases, journal: Journal, usage: list, start: int,
    gpu: int | None = None, pid: int | None = None, events: Any = None,
) -> SglangSection | None:
    """The SGLang section of the report (None when the trace has no SGLang markers).

    Args:
        trace: the Trace (its markers).
        phases, journal, usage: the report's phases, replay journal and per-phase attribution.
        start: the report's time origin (ns).
        gpu, pid: the report's filters.
        events: the trace's events (default ``trace.event_columns``; the report's pass over a file
            keeps those these facts read).
    """
    markers = trace.markers
    if not has_sglang_markers(markers):
        return None
    budgets = kv_budgets(markers)
    ranks = marker_ranks(markers)
    dims = shown_dims(ranks.values())
    labels = {p: format_rank(r, dims) for p, r in ranks.items()}
    times = kv_times(markers)
    torch_delta = torch_reserved_delta(markers)
    windows = kv_windows(markers, phases, journal, budgets, labels)
    gpus_of = rank_gpus(markers, journal, budgets)
    sglang_pids = sorted({m.pid for m in markers if m.name in SGLANG_MARKERS} | set(ranks),
                         key=lambda p: (rank_sort_key(ranks.get(p, {})), p))

    out_ranks = []
    for p in sglang_pids:
        if pid is not None and p != pid:
            continue
        g = gpus_of.get(p)
        if gpu is not None and g != gpu and not any(u.pid == p and u.gpu == gpu for u in usage):
            continue
        rows = _phase_rows(p, phases, usage, times.get(p), start, gpu, torch_delta)
        own = []
        for b in budgets:
            if b.pid != p:
                continue
            w = windows.get(g) if not b.draft and g is not None else None
            own.append(RankBudget(
                budget=b,
                label=format_rank(ranks.get(p, {}), dims, b.draft) or f"pid {p}" + (" draft" if b.draft else ""),
                formula=budget_lines(b),
                diagnosis=diagnose(b, w, windows) if w is not None else None,
            ))
        errors = [
            RankError(phase=ph.path, error=str(ph.values["error"]), at=ph.values.get("error_at"),
                      traceback=ph.values.get("error_traceback"))
            for ph in phases.phases
            if ph.pid == p and ph.values.get("error")
        ]
        out_ranks.append(SglangRank(
            pid=p, label=labels.get(p, ""), rank=dict(ranks.get(p, {})), gpu=g,
            gpus=sorted({r.gpu for r in rows if r.gpu is not None and r.by_category}),
            phases=rows, budgets=own, errors=errors,
        ))
    if not out_ranks and (pid is not None or gpu is not None):
        return None  # the filter leaves no SGLang process
    shown_windows = [w.shown(start) for g, w in windows.items() if gpu is None or g == gpu]
    facts = SglangFacts(
        markers_dropped=markers_dropped(markers, labels),
        custom_all_reduce=custom_ar_facts(markers),
        contexts=process_contexts(trace, sglang_pids, gpus_of, labels, events),
        nccl_vmm=nccl_vmm([(r.pid, r.label, [(x.kind, x.name, x.gpu, x.by_category) for x in r.phases])
                           for r in out_ranks]),
        oom_after_sizing=ooms_after_sizing(trace, phases, times, labels, budgets, events),
    )
    return SglangSection(ranks=out_ranks, windows=shown_windows, summary=_summary(budgets, ranks, dims, facts))


def _summary(budgets: list[KvBudget], ranks: dict, dims: tuple[str, ...], facts: SglangFacts) -> SglangSummary:
    """Every rank's KV sizing in a few numbers (:func:`summarize`), the rank that came out
    smallest by its marker rank, and the facts."""
    summary = summarize(budgets)
    targets = [b for b in budgets if not b.draft]
    if summary["min_rest_label"] is not None:
        worst = min((b for b in targets if b.rest_gib is not None), key=lambda b: b.rest_gib)  # type: ignore[arg-type,return-value]
        summary["min_rest_label"] = format_rank(ranks.get(worst.pid, {}), dims) or worst.label
    return SglangSummary(
        **jsonable(summary),
        failed_labels=[format_rank(ranks.get(b.pid, {}), dims, b.draft) or f"pid {b.pid}" for b in budgets if not b.ok],
        kv_failed=any(kv_failed(b) for b in budgets),
        mem_fraction_static=sorted({b.mem_fraction_static for b in targets if b.mem_fraction_static is not None}),
        fraction_is_lower_bound=any(b.unknown_terms for b in targets),
        facts=facts,
    )


def _fmt_value(k: str, v: Any, human) -> str:
    gib = k in _GIB_VALUES or k.startswith("graph_memory_usage")
    if gib and isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.2f} GiB"
    if k in _BYTE_VALUES and isinstance(v, int) and not isinstance(v, bool):
        return human(v)
    if k == "error":
        return str(v).split(":", 1)[0]
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000:
        return f"{v:,}"
    return scalar(v)


def render_sglang(section: SglangSection, width: int | None = None) -> list[str]:
    """The SGLang section as text lines (deterministic); tables fit ``width`` where they can."""
    title = "SGLang startup per rank: phases, memory by category, KV budget"
    out = [title, "=" * len(title)]
    out.extend(_summary_lines(section.summary))
    windows = {w.gpu: w for w in section.windows}
    shown: dict[int, str] = {}  # GPU -> the rank under which its window was printed
    for r in section.ranks:
        out.append("")
        head = f"{r.label or 'rank ?'}  pid {r.pid}" + (f"  GPU {r.gpu}" if r.gpu is not None else "")
        out.append(head)
        out.extend(_rank_phase_table(r, width))
        for b in r.budgets:
            out.extend(_budget_lines(r, b, windows, shown, width))
        out.extend(_rank_error_lines(r))
    return out


def _summary_lines(s: SglangSummary) -> list[str]:
    """Every rank at once: did the KV sizing fail, the smallest rest, the fraction that works, and
    the facts (NCCL's VMM, foreign contexts, OOMs after the sizing, custom all-reduce, lost markers)."""
    out = []
    if s.ranks:
        fr = s.mem_fraction_static or []
        ran = f" (ran with {', '.join(f'{x:.3f}' for x in fr)})" if fr else ""
        if s.failed:
            what = "KV sizing" if s.kv_failed else "startup"
            out.append(f"  {what} FAILED on {', '.join(s.failed_labels)}: " + " | ".join(s.errors or ["budget <= 0"]))
        else:
            out.append(f"  KV sizing ok on {s.ranks} rank{'' if s.ranks == 1 else 's'}")
        if s.min_rest_gib is not None:
            tokens = "" if s.min_tokens is None else f", fewest tokens {s.min_tokens:,}"
            out.append(f"  smallest rest {s.min_rest_gib:.2f} GiB ({s.min_rest_label}){tokens}")
        need = s.needed_mem_fraction_static
        if need is not None and need < 1:
            more = " at least (SGLang's other reservations are unknown: it raised)" if s.fraction_is_lower_bound else ""
            out.append(f"  every rank needs --mem-fraction-static > {need:.4f}{more}{ran}")
        elif need is not None:
            out.append(f"  no --mem-fraction-static can fit a KV cache: it would have to exceed {need:.4f}{ran}")
        if s.local_free_spread_gib:
            out.append(
                f"  per-GPU free memory at sizing differs by {s.local_free_spread_gib:.2f} GiB; lowest: {s.lowest_free_label}"
            )
    else:
        out.append("  no KV sizing in the markers")
    f = s.facts
    if f.nccl_vmm:
        out.append(nccl_line(f.nccl_vmm, human))
    foreign_line = contexts_line(f.contexts, human)
    if foreign_line:
        out.append(foreign_line)
    for o in f.oom_after_sizing:
        out.append(oom_line(o, human))
    if f.custom_all_reduce:
        out.append(custom_ar_line(f.custom_all_reduce, human))
    for d in f.markers_dropped:
        reasons = ", ".join(f"{k} {v}" for k, v in d.reasons.items() if v)
        out.append(f"  markers lost: {d.label or 'pid ' + str(d.pid)} dropped {d.dropped} marker(s)"
                   f" ({reasons}); phases around them may be missing")
    return out


def _rank_phase_table(r: SglangRank, width: int | None) -> list[str]:
    """A rank's phases and instants: when, against the KV sizing, bytes by category, its numbers."""
    cats = [c for c in CATEGORIES if any(c in x.by_category for x in r.phases)]
    split = any(x.torch_reserved is not OMITTED for x in r.phases)  # torch vs the rest, when recorded
    rows = []
    for x in r.phases:
        name = "  " * x.depth + ("* " if x.kind == "instant" else "") + x.name
        if x.kind == "phase" and not x.closed:
            name += " (unclosed)"
        dur = "" if x.kind == "instant" else f"{x.end_s - x.start_s:.3f}s"
        mem = [human(x.by_category[c]) if c in x.by_category else "-" for c in cats]
        net = human(x.net) if x.kind == "phase" else ""
        if x.kind == "instant":
            mem = [""] * len(cats)
        values = " ".join(f"{k}={_fmt_value(k, v, human)}" for k, v in x.values.items())
        torch_cols = [human(x.torch_reserved) if x.torch_reserved is not OMITTED else "",
                      human(x.non_torch) if x.non_torch is not OMITTED else ""] if split else []
        rows.append(
            [name, "" if x.gpu is None else str(x.gpu), f"+{x.start_s:.3f}s", dur, x.when or ""]
            + mem + [net] + torch_cols + [values]
        )
    extra = ["TORCH", "NOT TORCH"] if split else []
    return table(["PHASE", "GPU", "START", "DURATION", "VS KV SIZING"] + [c.upper() for c in cats]
                 + ["NET OWNED"] + extra + ["SGLANG'S NUMBERS"], rows,
                 right=set(range(1, 4)) | set(range(5, 6 + len(cats) + len(extra))),
                 indent="  ", width=width, drop=(3, 4), wrap=True)


def _budget_lines(r: SglangRank, rb: RankBudget, windows: dict[int, ShownWindow], shown: dict[int, str],
                  width: int | None) -> list[str]:
    """One KV budget: its formula, what was allocated on its GPU between the baseline and the
    sizing (once per GPU: ``shown`` remembers under which rank), and why it failed."""
    out = [f"  KV budget{' (draft runner)' if rb.budget.draft else ''}, GiB as SGLang measures them:"]
    out.extend("    " + line for line in rb.formula)
    w = windows.get(r.gpu) if not rb.budget.draft else None
    if w is not None and w.between and w.gpu in shown:
        out.append(f"  allocated on GPU {w.gpu} between the baseline and the KV sizing: as for {shown[w.gpu]} above")
    elif w is not None and w.between:
        shown[w.gpu] = r.label or f"pid {r.pid}"
        out.append(
            f"  allocated on GPU {w.gpu} between the baseline (+{w.baseline_s:.3f}s) and the KV sizing "
            f"(+{w.sizing_s:.3f}s), which lowers rest one for one:"
        )
        wrows = [[x.label or f"pid {x.pid}", x.phase, human(x.owned), _cats_text(x, human)] for x in w.between]
        out.extend(table(["RANK", "PHASE", "OWNED", "BY CATEGORY"], wrows, right={2}, indent="    ",
                         width=width, wrap=True))
    dg = rb.diagnosis
    if dg and dg.lines:
        out.append("  why it failed:")
        out.extend("    " + line for line in dg.lines)
    return out


def _rank_error_lines(r: SglangRank) -> list[str]:
    """What SGLang raised on the rank, other than the KV sizing's error its budget already says."""
    out = []
    told = {rb.budget.error for rb in r.budgets if rb.budget.error and rb.budget.error_kind in _KV_ERRORS}
    raised_at = set()
    for e in r.errors:
        if e.error not in told or e.phase.rsplit("/", 1)[-1] not in ("kv_budget", "kv_pool"):
            out.append(f"  SGLang raised in {e.phase}: {e.error}")
        if e.at and (e.error, e.at) not in raised_at:  # once per exception
            raised_at.add((e.error, e.at))
            out.append(f"    raised at {e.at}")
            if e.traceback and e.traceback != e.at:
                out.append(f"    traceback (innermost first): {e.traceback}")
    return out
