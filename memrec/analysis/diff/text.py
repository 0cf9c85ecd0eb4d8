"""``memrec diff`` as text: the verdict first, then the KV budgets, the windows, the phases, the
failures (:func:`render_diff` of :func:`memrec.analysis.diff.build.diff_traces`'s diff)."""

from __future__ import annotations

from memrec.analysis.diff.model import Diff
from memrec.analysis.diff.model import DiffWindows
from memrec.analysis.diff.model import Failure
from memrec.analysis.diff.model import KvChange
from memrec.analysis.diff.model import PhaseChange
from memrec.analysis.diff.model import TensorChange
from memrec.analysis.diff.sites import render_sites_diff
from memrec.analysis.text import fit_lines
from memrec.analysis.text import human
from memrec.analysis.text import signed_human
from memrec.analysis.text import table
from memrec.analysis.untraced.diff import render_untraced


def _g(v: float | None, digits: int = 2, sign: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def _n(v: int | None, sign: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+,}" if sign else f"{v:,}"


def render_diff(d: Diff, width: int | None = None) -> str:
    """The diff as text: the verdict first, then the KV budgets, the windows, the phases, the failures.

    With ``width``, the sentences and the tables' free-text columns (SGLang's error, what failed)
    wrap to fit it; the number columns stay on one line.
    """
    out = [f"memrec diff  A = {d.a.name}  B = {d.b.name}", ""]
    out.append(f"verdict: {d.verdict.headline}")
    out.extend(f"  {line}" for line in d.verdict.lines)
    if width is not None:
        out = fit_lines(out, width)
    out.extend(_kv_table(d.kv, width))
    out.extend(_window_tables(d.windows))
    out.extend(_phase_table(d.phases, width))
    out.extend(_tensor_table(d.tensors, width))
    if d.sites:
        out.append("")
        out.extend(render_sites_diff(d.sites, width))
    out.extend(render_untraced(d.untraced, human, signed_human))
    out.append("")
    out.extend(_failure_table(d.failures, width))
    return "\n".join(out) + "\n"


def _title(title: str, width: int | None) -> list[str]:
    return fit_lines([title], width) if width is not None else [title]


def _kv_table(kv: list[KvChange], width: int | None) -> list[str]:
    """Each rank's KV budget in both runs and the deltas."""
    if not kv:
        return []
    out = [""] + _title("KV budget per rank (GiB as SGLang measures them; rest = available − pre × (1 − fraction); "
                        "Δrest = Δavailable − Δslack)", width)
    rows = []
    for x in kv:
        for tag, side in (("A", x.budgets.before), ("B", x.budgets.after)):
            if side is None:
                rows.append([x.label, tag, "", "", "", "", "", "", "", "(not in this run)"])
                continue
            rows.append(
                [x.label, tag, _g(side.pre_model_load_memory), _g(side.available_gpu_memory),
                 _g(side.mem_fraction_static, 3), _g(side.slack_gib), _g(side.rest_gib), _n(side.tokens),
                 _g(side.min_mem_fraction_static, 4), side.error or ""]
            )
        dl = x.budgets.deltas
        if dl:
            rows.append(
                ["", "Δ", _g(dl.get("pre_model_load_memory"), sign=True), _g(dl.get("available_gpu_memory"), sign=True),
                 _g(dl.get("mem_fraction_static"), 3, True), _g(dl.get("slack_gib"), sign=True),
                 _g(dl.get("rest_gib"), sign=True), _n(dl.get("tokens"), True),
                 _g(dl.get("min_mem_fraction_static"), 4, True), ""]
            )
    out.extend(table(["RANK", "RUN", "PRE", "AVAILABLE", "FRACTION", "SLACK", "REST", "TOKENS", "MIN FRACTION", "ERROR"],
                     rows, right=set(range(2, 9)), indent="  ", width=width, drop=(8,), wrap=True))
    return out


def _window_tables(windows: DiffWindows) -> list[str]:
    """Per GPU, what each (phase, rank) took between the baseline and the sizing, and before it."""
    out: list[str] = []
    for which, title in (("between", "between the memory baseline and the KV sizing (lowers rest one for one)"),
                         ("before", "before the memory baseline (lowers pre_model_load_memory and the slack)")):
        for w in getattr(windows, which):
            if not w.rows:
                continue
            out.append("")
            out.append(f"GPU {w.gpu}, {title}")
            rows = [
                [r.phase, r.rank, human(r.a_owned) if r.a_owned is not None else "-",
                 human(r.b_owned) if r.b_owned is not None else "-", signed_human(r.delta_owned),
                 signed_human(r.delta_mapped) if r.delta_mapped else ""]
                for r in w.rows
            ]
            rows.append(["total", "", human(w.a_owned), human(w.b_owned), signed_human(w.b_owned - w.a_owned), ""])
            out.extend(table(["PHASE", "RANK", "A OWNED", "B OWNED", "Δ OWNED", "Δ IPC MAPPED"], rows,
                             right={2, 3, 4, 5}, indent="  "))
    return out


def _phase_table(phases: list[PhaseChange], width: int | None) -> list[str]:
    if not phases:
        return []
    out = [""] + _title("phases (net bytes per phase, rank, GPU and category; '-': the phase did not run; "
                        "exits left out)", width)
    rows = [
        [r.phase, r.rank, str(r.gpu) if r.gpu >= 0 else "host", r.category + ("" if r.owned else " (not owned)"),
         human(r.a) if r.a is not None else "-", human(r.b) if r.b is not None else "-", signed_human(r.delta)]
        for r in phases
    ]
    out.extend(table(["PHASE", "RANK", "GPU", "CATEGORY", "A", "B", "Δ"], rows, right={2, 4, 5, 6}, indent="  "))
    return out


def _tensor_table(tensors: list[TensorChange] | None, width: int | None) -> list[str]:
    if not tensors:
        return []
    out = [""] + _title("tensor blocks (peak allocated and reserved per phase, rank and GPU; '-': no blocks in that run)",
                        width)

    def opt(v: int | None) -> str:
        return human(v) if v is not None else "-"

    rows = [[r.phase, r.rank, str(r.gpu), opt(r.a_allocated), opt(r.b_allocated), signed_human(r.delta_allocated),
             opt(r.a_reserved), opt(r.b_reserved), signed_human(r.delta_reserved)] for r in tensors]
    out.extend(table(["PHASE", "RANK", "GPU", "A ALLOC", "B ALLOC", "Δ ALLOC", "A RESV", "B RESV", "Δ RESV"], rows,
                     right={2, 3, 4, 5, 6, 7, 8}, indent="  "))
    return out


def _failure_table(failures: list[Failure], width: int | None) -> list[str]:
    if not failures:
        return ["failures: none in either run"]
    rows = []
    for f in failures:
        where = {"both": "both", "a": "A only", "b": "B only"}[f.where]
        if f.kind == "driver_call":
            what = f"{f.api} {f.result} ×{f.count} on GPU {f.gpu}"
        else:
            what = f"{f.phase}: {f.error}"
        rows.append([where, f.rank, what])
    return ["failures"] + table(["IN", "RANK", "WHAT"], rows, right=set(), indent="  ", width=width, wrap=True)
