"""The text of ``memrec report``: the answer first, then per GPU the details.

:func:`render_text` turns :func:`memrec.analysis.report.build.build_report`'s report into fixed-width text
that fits ``width`` columns (long free-text cells wrap onto continuation lines; nothing is cut
with "..."). The default view leaves out what does not help an answer: rows that are all zero,
the frees a process's exit made implicitly (they are in "held at exit"), and zero peaks of
processes that only mapped peers' memory; ``show_all`` keeps them.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from typing import Any

import numpy as np

from memrec.analysis.sections import OMITTED
from memrec.analysis.report.model import FailedCall
from memrec.analysis.report.model import GpuSection
from memrec.analysis.report.model import HoldingRow
from memrec.analysis.report.model import InstantEntry
from memrec.analysis.report.model import PhaseEntry
from memrec.analysis.report.model import ProcessEntry
from memrec.analysis.report.model import Report
from memrec.analysis.report.model import TraceSummary
from memrec.engine.phases import NO_PHASE
from memrec.analysis.sglang.section import render_sglang
from memrec.analysis.report.tensors_text import render_tensors
from memrec.analysis.report.sites_text import render_sites
from memrec.analysis.text import count
from memrec.analysis.text import fit_lines
from memrec.analysis.text import human
from memrec.analysis.text import scalar
from memrec.analysis.text import seconds
from memrec.analysis.text import table
from memrec.analysis.untraced.reconcile import GpuReconciliation
from memrec.analysis.untraced.reconcile import PhaseSplit
from memrec.analysis.untraced.split import SPLIT
from memrec.analysis.untraced.split import SPLIT_HEADINGS
from memrec.terms.events import CATEGORIES
from memrec.analysis.merge_text import render_merged
from memrec.analysis.report.phase_rows import fold_runs

_CATEGORY_NOTE = {
    "driver": "cuMemAlloc*",
    "vmm": "cuMemCreate physical",
    "ipc_mapped": "peers' memory mapped here: not owned, not in totals",
    "host_pinned": "pinned host memory",
    "array": "CUDA arrays (descriptor bytes in 2 MiB granules)",
}


def _t(secs: float | None) -> str:
    return "-" if secs is None else f"+{secs:.3f}s"


def _values(values: dict) -> str:
    return ", ".join(f"{k}={_fmt_value(v)}" for k, v in values.items())


def _fmt_value(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 1 << 20:
        return human(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return scalar(v)


def _pid_label(pid: int, procs: dict[int, ProcessEntry]) -> str:
    p = procs.get(pid)
    bits = [f"pid {pid}"]
    if p is not None and p.rank:
        bits.append(p.rank)
    if p is not None and p.short:
        bits.append(p.short)
    return " ".join(bits)


def _rank_of(pid: int, procs: dict[int, ProcessEntry]) -> str:
    p = procs.get(pid)
    return p.rank if p is not None else ""


def _holding_text(h: HoldingRow) -> str:
    addr = f"handle {h.address:#x}" if h.category == "vmm" else f"{h.address:#x}"
    text = f"{human(h.size)} {h.category} {addr}"
    if h.category == "ipc_mapped" and h.peer:
        text += f" from pid {h.peer}"
    return text


def render_text(report: Report, width: int = 80, show_all: bool = False) -> str:
    """The report as text at most ``width`` columns wide, the answer in its first three lines.

    ``show_all`` keeps what the default view leaves out (see the module docstring). The same
    report and width always give the same text.
    """
    assert report.answer is not None  # build_report always sets it
    out: list[str] = report.answer.text(width)
    procs = report.process_map()
    out.append("")
    out.extend(_render_head(report))
    if report.sglang:
        out.append("")
        sglang = render_sglang(report.sglang, width)
        out.extend(sglang if show_all else collapse(sglang, _RANK_BLOCK, procs))
    gpu_lines: list[str] = []
    for sec in report.gpus:
        gpu_lines.append("")
        gpu_lines.extend(_render_gpu(sec, procs, width, show_all))
    out.extend(gpu_lines if show_all else collapse(gpu_lines, _GPU_BLOCK, procs))
    if report.host is not None:
        out.append("")
        out.extend(_render_gpu(report.host, procs, width, show_all))

    if report.tensors:
        out.append("")
        out.extend(render_tensors(report.tensors, width))

    if report.sites:
        out.append("")
        out.extend(render_sites(report.sites, width, show_all))

    if report.failures_unknown_gpu:
        out.append("")
        out.append("failed calls on an unknown GPU")
        failures, more = _capped(report.failures_unknown_gpu, "failed calls", show_all)
        out.extend(_failure_table(failures) + more)
    out.extend(_render_processes(report, width, show_all))
    out.extend(_render_phases(report, width, show_all))
    return "\n".join(fit_lines(out, width)) + "\n"


def _render_head(report: Report) -> list[str]:
    """The trace in one line, the merge, the filter, and what makes the numbers incomplete."""
    tr = report.trace
    out = ["memrec report"]
    out.append(
        f"  trace: {tr.duration_s:.3f} s, {count(tr.events, 'event')}, "
        f"{count(tr.failed_calls_all, 'failed call')}, {count(tr.processes, 'process')}, "
        f"{count(tr.markers, 'marker')}, {count(tr.nvml_samples, 'NVML sample')}"
    )
    if report.merged:
        out.extend(render_merged(report.merged))
    flt = report.filter
    if flt.gpu is not None or flt.pid is not None:
        parts = [f"{k} {v}" for k, v in (("gpu", flt.gpu), ("pid", flt.pid)) if v is not None]
        shown = f"{count(len(report.processes), 'process')}, {count(tr.failed_calls, 'failed call')}"
        out.append("  filter: " + ", ".join(parts) + f" ({shown})")
    if tr.lost:
        out.append(f"  !! LOST EVENTS: {tr.lost:,} events were dropped while recording; the numbers below miss them")
    if not tr.complete:
        whose = " (a merged host's trace)" if report.merged is not None else ""
        out.append(f"  !! no trailer{whose}: the recording did not end cleanly (the trace may stop early)")
    for w in tr.warnings:
        out.append(f"  !! reader warning: {w}")
    for w in tr.phase_warnings:
        out.append(f"  !  markers: {w}")
    if tr.anomalies:
        out.append(
            "  note: events that did not match the recorded state (usually memory from before the recording): "
            + ", ".join(f"{k} {v:,}" for k, v in tr.anomalies.items())
        )
    return out


def _render_processes(report: Report, width: int, show_all: bool) -> list[str]:
    if not report.processes:
        return []
    shown, more = _capped(report.processes, "processes", show_all)
    rows = [
        [str(p.pid), p.rank, ",".join("host" if g < 0 else str(g) for g in p.gpus) or "-",
         _t_exit(p, report.trace), p.short]
        for p in shown
    ]
    return ["", "processes"] + table(["PID", "RANK", "GPUS", "EXIT", "COMMAND"], rows, right={0}, width=width,
                                     wrap=True) + more


def _render_phases(report: Report, width: int, show_all: bool) -> list[str]:
    """Every phase and instant, by process and then in time order."""
    phases, instants = report.phases, report.instants
    if not len(phases) and not instants:
        return []
    # Sorted and folded as columns, only the rows shown made objects and text (50,000 markers:
    # 25,000 phases).
    t, ids, n = phases.table, phases.ids, len(phases)
    pid = np.concatenate([t.pid[ids], np.array([i.pid for i in instants], dtype=np.int64)])
    kind = np.repeat([0, 1], [n, len(instants)])  # phases first at one time
    order = np.lexsort((np.concatenate([ids, np.arange(len(instants))]), kind,
                        np.concatenate([t.start[ids], np.array([i.ts for i in instants], dtype=np.int64)]), pid))
    if not show_all and len(order) > MAX_ROWS:
        # a step loop's phases: a process's run of one name is one row (past a table's worth of rows)
        codes: dict[str, int] = {}
        names = [t.name[i] for i in ids.tolist()] + [i.name for i in instants]
        name = np.array([codes.setdefault(_numberless(x), len(codes)) for x in names], dtype=np.int64)
        depth = np.concatenate([t.depth[ids], np.zeros(len(instants), dtype=np.int64)])
        closed = np.concatenate([t.closed[ids], np.zeros(len(instants), dtype=bool)])
        first, end = fold_runs([x[order] for x in (pid, kind, depth, name, closed)], FOLD_MIN)
    else:
        first = np.arange(len(order))
        end = first + 1
    shown, more = _capped(list(zip(first.tolist(), end.tolist())), "phases and instants", show_all)
    order_ = order.tolist()
    start_s, end_s = phases.times.start_s, phases.times.end_s

    def item(k: int) -> PhaseEntry | InstantEntry:
        return phases.entry(int(ids[k])) if k < n else instants[k - n]

    rows = []
    for lo, hi in shown:
        x, last, n_ = item(order_[lo]), item(order_[hi - 1]), "" if hi - lo == 1 else f" ×{hi - lo:,}"
        if isinstance(x, InstantEntry):
            rows.append([str(x.pid), f"* {_run_name(x.name, last.name)}{n_}", _t(x.t_s), "", "",
                         _values(x.values) if not n_ else ""])
        else:
            name = "  " * x.depth + _run_name(x.name, last.name) + n_ + ("" if x.closed else " (unclosed)")
            run = [int(ids[k]) for k in order_[lo:hi]]
            duration = sum(end_s[i] - start_s[i] for i in run)
            rows.append([str(x.pid), name, _t(x.start_s), _t(last.end_s), f"{duration:.3f}s",
                         _values(x.values) if not n_ else ""])
    out = ["", "phases"] + table(["PID", "PHASE", "START", "END", "DURATION", "VALUES"], rows, right={0, 2, 3, 4},
                                 width=width, drop=(4, 3), wrap=True)
    if any(hi - lo > 1 for lo, hi in shown):
        out.append(_FOLDED)
    return out + more


#: The note under a table with folded rows.
_FOLDED = ("  (×N: a process's phases of one name in a row, numbers in the name aside, as one row: the first "
           "start, the last end, durations and bytes summed; --all lists each)")


#: Numbers in a phase's name: a loop's ``step-17``, ``step-18`` fold into one run.
_DIGITS = re.compile(r"\d+")


@functools.lru_cache(maxsize=1 << 12)
def _numberless(name: str) -> str:
    """``name`` with its numbers as ``#``: a run's key (a step loop's 25,000 phases have few names)."""
    return _DIGITS.sub("#", name)


def _run_name(first: str, last: str) -> str:
    """A run's name: the one name, or its first and last (``step-0 … step-99``)."""
    return first if first == last else f"{first} … {last}"


#: The fewest rows of one run that fold into one (two show as they are, with their values).
FOLD_MIN = 3


def _t_exit(p: ProcessEntry, tr: TraceSummary) -> str:
    if p.exit_ts is None:
        return "-"
    return _t(seconds(p.exit_ts - tr.start_ts))


def _render_gpu(sec: GpuSection, procs: dict[int, ProcessEntry], width: int, show_all: bool) -> list[str]:
    out = _render_gpu_head(sec)
    if sec.categories:
        out.append("")
        rows = [
            [c.category, human(c.peak), _t(c.peak_t_s), human(c.final), _CATEGORY_NOTE.get(c.category, "")]
            for c in sec.categories
        ]
        out.extend(table(["CATEGORY", "PEAK", "AT", "FINAL", ""], rows, right={1, 2, 3}))
    out.extend(_render_gpu_processes(sec, width, show_all))
    if sec.reconciliation:
        out.append("")
        out.extend(_render_reconciliation(sec.reconciliation, procs, width))
    out.extend(_render_gpu_phases(sec, width, show_all))
    if sec.held_at_exit:
        out.append("")
        out.append("  held at exit (freed implicitly when the process exited)")
        shown, more = _capped(sec.held_at_exit, "processes", show_all)
        rows = [
            [str(r.pid), _t(r.t_s), human(r.owned), human(r.mapped) if r.mapped else "-",
             str(r.count), "; ".join(_holding_text(h) for h in r.largest)]
            for r in shown
        ]
        out.extend(table(["PID", "EXIT AT", "OWNED", "MAPPED", "PIECES", "LARGEST"], rows, right={0, 1, 2, 3, 4},
                         width=width, wrap=True) + more)
    out.extend(_render_gpu_failures(sec, procs, show_all))
    return out


def _render_gpu_head(sec: GpuSection) -> list[str]:
    """The title (GPU, name, UUID, total), the traced peak and final, NVML beside them."""
    if sec.gpu < 0:
        title = "HOST (pinned memory) and device memory of unknown GPU"
    else:
        bits = [f"GPU {sec.gpu}"]
        if sec.name:
            bits.append(sec.name)
        if sec.uuid:
            bits.append(sec.uuid)
        if sec.total:
            bits.append(f"{human(sec.total)} total")
        title = "  ".join(bits)
    out = [title, "=" * len(title)]
    pk = sec.peak
    final = human(sec.final.bytes)
    out.append(f"  peak traced   {human(pk.bytes)} at {_t(pk.t_s)}    final traced   {final}")
    nv = sec.nvml
    if nv is not None:
        line = f"  NVML used     last {human(nv.last_used)}, peak {human(nv.peak_used)}"
        line += f" at {_t(nv.peak_used_t_s)}"
        line += f"; reserved last {human(nv.last_reserved)}, peak {human(nv.peak_reserved)}"
        out.append(line)
        if nv.untraced_at_last is not OMITTED:
            out.append(
                f"                not traced at the last sample: {human(nv.untraced_at_last)} "
                f"(contexts, pools, other processes)"
            )
    return out


def _render_gpu_processes(sec: GpuSection, width: int, show_all: bool) -> list[str]:
    shown, more = _capped([p for p in sec.processes if show_all or p.matters()], "processes", show_all)
    if not shown:
        return []
    rows = []
    for p in shown:
        no_peak = not p.peak and not show_all  # a peer that only mapped: no "0 B at +0.000s"
        rows.append(
            [str(p.pid), p.rank, "-" if no_peak else human(p.peak),
             "-" if no_peak else _t(p.peak_t_s), human(p.final),
             human(p.mapped_peak) if p.mapped_peak else "-",
             human(p.held_at_exit) if p.held_at_exit else "-",
             human(p.nvml_used) if p.nvml_used is not None else "-",
             p.process]
        )
    return [""] + table(
        ["PID", "RANK", "PEAK", "AT", "FINAL", "MAPPED", "AT EXIT", "NVML USED", "COMMAND"],
        rows, right={0, 2, 3, 4, 5, 6, 7}, width=width, drop=(4, 7), wrap=True,
    ) + more


def _render_gpu_phases(sec: GpuSection, width: int, show_all: bool) -> list[str]:
    """Net bytes per category during each phase (without the frees at exit unless ``show_all``)."""
    listed = sec.phases if show_all else sec.phases.without_exit_frees()
    if not len(listed):
        return []
    out = ["", "  by phase (net bytes per category during each phase of the process that made them; owned totals)"]
    if not show_all and sec.phases.any_exit_frees():
        out.append("  (frees at process exit are under \"held at exit\"; --all counts them here too)")
    folded = False
    if not show_all and len(listed) > MAX_ROWS:  # a step loop's phases: a run of one path, one row
        paths = listed.path_of()
        codes: dict[str, int] = {}
        path = np.array([codes.setdefault(_numberless(p), len(codes)) for p in paths], dtype=np.int64)
        first, end = fold_runs([listed.pid, path], FOLD_MIN)
        folded = len(first) < len(listed)
        units, more = _capped(list(zip(first.tolist(), end.tolist())), "phases", show_all)
        phase_rows = [listed.row(lo) if hi - lo == 1 else
                      listed.folded(lo, hi, f"{_run_name(paths[lo], paths[hi - 1])} ×{hi - lo:,}") for lo, hi in units]
    else:
        phase_rows, more = _capped(list(listed), "phases", show_all)
    cats = [c for c in CATEGORIES if any(c in r.by_category for r in phase_rows)]
    rows = []
    for r in phase_rows:
        rows.append(
            [str(r.pid), r.path, _t(r.start_s), _t(r.end_s)]
            + [human(r.by_category[c]) if c in r.by_category else "-" for c in cats]
            + [human(r.allocated), human(r.freed), human(r.net)]
        )
    out.extend(
        table(
            ["PID", "PHASE", "START", "END"] + [c.upper() for c in cats] + ["ALLOCATED", "FREED", "NET OWNED"],
            rows, right=set(range(2, 7 + len(cats))) | {0}, width=width, drop=(3, 2),
        )
        + ([_FOLDED] if folded else [])
        + more
    )
    return out


def _render_gpu_failures(sec: GpuSection, procs: dict[int, ProcessEntry], show_all: bool) -> list[str]:
    """Each failed call on the GPU, with who held what there at that instant."""
    if not sec.failures:
        return []
    out = ["", f"  failed calls ({len(sec.failures)}), each with who held what on GPU {sec.gpu} at that instant"]
    failures, more = _capped(sec.failures, "failed calls", show_all)
    failure_lines = _failure_table(failures)
    out.append(failure_lines[0])
    for f, row in zip(failures, failure_lines[1:]):
        out.append(row)
        held = f.held
        if held is None:
            continue
        out.append(
            f"        GPU {f.gpu} then: {human(held.owned_on_gpu)} owned"
            + (f", {human(held.mapped_on_gpu)} mapped from peers" if held.mapped_on_gpu else "")
        )
        for h in held.holders:
            cats = ", ".join(f"{c} {human(b)}" for c, b in h.by_category.items())
            out.append(f"          {_pid_label(h.pid, procs)}: {human(h.owned)} owned ({cats})")
            if h.largest:
                out.append("            largest: " + "; ".join(_holding_text(x) for x in h.largest))
    out.extend(more)
    if any(f.gpu_inferred for f in sec.failures):
        out.append("    (GPU n? = the call named no GPU: inferred from the process's previous calls)")
    return out


#: The most rows one table of the text report shows; the rest is one line that counts them (a
#: flood of 300,000 marker names printed 1.43 GB of text). ``--all`` and ``--json`` give them all.
MAX_ROWS = 200


def _capped(rows: list, what: str, show_all: bool) -> tuple[list, list[str]]:
    """The first :data:`MAX_ROWS` of ``rows`` (all with ``show_all``) and the line that says how
    many more there are (none when nothing was left out)."""
    if show_all or len(rows) <= MAX_ROWS:
        return rows, []
    return rows[:MAX_ROWS], [f"  … and {len(rows) - MAX_ROWS:,} more {what} (memrec report --all, or --json, lists all)"]


#: The first line of a block ``collapse`` compares: a GPU section's title, an SGLang rank's header.
_GPU_BLOCK = re.compile(r"^GPU \d+\b")
_WORD_OF_DIGITS = re.compile(r"\b\d+\b")
_RANK_BLOCK = re.compile(r"^((DP|PP|TP|EP)\d+ ?)+ +pid \d+")


def collapse(lines: list[str], header: re.Pattern, procs: dict) -> list[str]:
    """Blocks that say the same as the first one, pids, ranks, GPUs and times aside, become one line.

    A block starts at a line ``header`` matches and runs to the next one. A block whose lines (in
    any order, numbers that name a pid, rank, GPU, time or address masked) are those of the first
    block becomes "<its header>: same as <first>"; runs of such blocks are joined ("GPU 1–7:
    same as GPU 0"). One that differs in at most 3 lines shows only those lines.
    """
    starts = [i for i, text in enumerate(lines) if header.match(text)]
    if len(starts) < 2:
        return lines
    bounds = list(zip(starts, starts[1:] + [len(lines)]))
    # A pid is a whole word of digits: one pattern and a set, not an alternation of every pid
    # (100,000 processes made that regex, tried at every position, most of the report's time).
    pids = {str(p) for p in procs}

    def pid(m: re.Match) -> str:
        return "P" if m.group() in pids else m.group()

    def norm(text: str) -> str:
        text = _WORD_OF_DIGITS.sub(pid, text) if pids else text
        text = re.sub(r"\b(DP|PP|TP|EP)\d+", r"\1n", text)
        text = re.sub(r"\bGPU-[0-9a-fA-F-]+", "UUID", text)
        text = re.sub(r"\bGPU \d+", "GPU n", text)
        text = re.sub(r"[+-]?\d+\.\d+s\b", "T", text)
        text = re.sub(r"0x[0-9a-f]+", "ADDR", text)
        # Small bare numbers are GPU columns (a rank's own GPU, its peers'); counts with a unit stay.
        text = re.sub(r"(?<![\w.=,+-])\d{1,3}(?![\w.,]| ?(B|KiB|MiB|GiB|TiB)\b)", "N", text)
        return re.sub(r"\s+", " ", text).strip()

    first_head = lines[starts[0]].split("  ")[0].split(" pid ")[0].strip()
    base = Counter(norm(t) for t in lines[bounds[0][0] + 1 : bounds[0][1]] if t.strip() and not set(t) <= {"="})
    base_len = sum(base.values())
    out = lines[: bounds[0][1]]
    same_run: list[str] = []

    def flush() -> None:
        if same_run:
            names = same_run[0] if len(same_run) == 1 else f"{same_run[0]}–{same_run[-1].split()[-1]}"
            out.append(f"{names}: same as {first_head} (pids, ranks, times aside)")
            out.append("")
            same_run.clear()

    for lo, hi in bounds[1:]:
        head = lines[lo].split("  ")[0].split(" pid ")[0].strip()
        body = [t for t in lines[lo + 1 : hi] if t.strip() and not set(t) <= {"="}]
        # The lines the first block lacks (a multiset match); past 3 the block shows whole, so
        # the matching stops there (a block of 12,500 process rows needs a few lines normalised).
        extra = []
        if len(body) == base_len:
            rest = base.copy()
            for t in body:
                n = norm(t)
                if rest[n]:
                    rest[n] -= 1
                else:
                    extra.append(t)
                    if len(extra) > 3:
                        break
        if len(body) == base_len and not extra:
            same_run.append(head)
            continue
        flush()
        if len(body) == base_len and len(extra) <= 3:
            out.append(f"{head}: same as {first_head} except")
            out.extend(extra)
            out.append("")
        else:
            out.extend(lines[lo:hi])
    flush()
    while out and not out[-1].strip():
        out.pop()
    return out


def _render_reconciliation(rc: GpuReconciliation, procs: dict[int, ProcessEntry], width: int) -> list[str]:
    """The "NVML vs traced" table: each process NVML listed, then the whole GPU."""
    out = ["  NVML vs traced (at each NVML sample; untraced = NVML - traced, split below)"]
    rows = []
    for r in rc.processes:
        notes = []
        if not r.recorded:
            notes.append("not recorded by memrec")
        if r.negative_samples:
            notes.append(f"! traced > NVML in {r.negative_samples} of {r.samples} samples")
        if r.unavailable:
            notes.append(f"{count(r.unavailable, 'sample')} without a value")
        if r.after_exit_samples:
            notes.append(f"{count(r.after_exit_samples, 'sample')} after its exit left out"
                         " (the driver frees later)")
        rows.append(
            [str(r.pid), _rank_of(r.pid, procs), human(r.nvml_used_last), human(r.traced_last),
             human(r.untraced_last), _range(r.untraced_min, r.untraced_max), str(r.samples), "; ".join(notes)]
        )
    d = rc.device
    if d is not None:
        notes = []
        if d.reserved_last is not None:
            notes.append(f"reserved {human(d.reserved_last)} (driver/firmware, not in used)")
        else:
            notes.append("reserved unknown (NVML v1: used includes it)")
        if d.negative_samples:
            notes.append(f"! traced > NVML in {d.negative_samples} of {d.samples} samples")
        rows.append(
            ["GPU", "", human(d.used_last), human(d.traced_last), human(d.untraced_last),
             _range(d.untraced_min, d.untraced_max), str(d.samples), "; ".join(notes)]
        )
    out.extend(
        table(["PID", "RANK", "NVML USED", "TRACED", "UNTRACED", "UNTRACED MIN..MAX", "SAMPLES", ""], rows,
              right={0, 2, 3, 4, 5, 6}, width=width, drop=(6,), wrap=True)
    )
    if rc.unsampled_pids:
        out.append(
            "    traced here but never in NVML's process samples: "
            + ", ".join(f"pid {p}" for p in rc.unsampled_pids)
            + " (gone between samples, or another PID namespace)"
        )
    out.extend(_render_split(rc, procs, width))
    return out


def _render_split(rc: GpuReconciliation, procs: dict[int, ProcessEntry], width: int) -> list[str]:
    """The untraced band split (memrec.analysis.untraced.split), the contexts, and the split per phase."""
    rows = []
    split_rows = [r for r in rc.processes if r.split]
    d = rc.device
    device_split = d.split if d is not None else None
    cols = _split_columns([r.split for r in split_rows] + ([device_split] if device_split else []))
    shares = []
    for r in split_rows:
        rows.append([str(r.pid), _rank_of(r.pid, procs), human(r.untraced_last), *(human(r.split[k]) for k in cols)])
        shares.append(f"pid {r.pid} {_share(r.explained_share)}")
    if device_split:
        rows.append(["GPU", "", human(sum(device_split.values())), *(human(device_split[k]) for k in cols)])
    out: list[str] = []
    if rows:
        out.append("  Untraced, split at the last sample (unexplained = untraced - the rest)")
        out.extend(table(["PID", "RANK", "UNTRACED", *(SPLIT_HEADINGS[k] for k in cols)],
                         rows, right={0, *range(2, 3 + len(cols))}, width=width, drop=(1,)))
        if rc.explained_share is not None:
            shares.append(f"GPU {_share(rc.explained_share)}")
        out.append("    NVML used traced or explained by measurement: " + ", ".join(shares))
        for r in rc.processes:
            libs = {k: v for k, v in (r.module_code_by_library or {}).items() if v}
            if libs:
                out.append(f"    pid {r.pid} module code: " + "; ".join(f"{k} {human(v)}" for k, v in list(libs.items())[:6]))
    ctx_rows = []
    for c in rc.contexts:
        note = "foreign (owns nothing here)" if c.foreign else ""
        ctx_rows.append([_t(c.t_s), str(c.pid), c.api, c.phase, human(c.cost), note])
    if ctx_rows:
        out.append("  Contexts (cost: NVML's steps over the bind and its first kernel)")
        out.extend(table(["TIME", "PID", "API", "PHASE", "COST", ""], ctx_rows, right={0, 1, 4}, width=width,
                         drop=(3,), wrap=True))
    out.extend(_render_split_by_phase(rc, width))
    return out


def _render_split_by_phase(rc: GpuReconciliation, width: int) -> list[str]:
    """The untraced steps per phase and process (none without markers: the split says it all)."""
    phase_rows: list[tuple[str, PhaseSplit]] = []
    for r in rc.processes:
        phased = r.split_by_phase or []
        if all(ph.phase == NO_PHASE for ph in phased):
            continue  # no markers: the split above says it all
        for ph in phased:
            if any(ph.split[k] for k in SPLIT if k != "before_recording"):
                phase_rows.append((str(r.pid), ph))
    if not phase_rows:
        return []
    cols = [k for k in _split_columns([ph.split for _, ph in phase_rows]) if k != "before_recording"]
    return ["  Untraced steps per phase",
            *table(["PID", "PHASE", *(SPLIT_HEADINGS[k] for k in cols)],
                   [[pid, ph.phase, *(human(ph.split[k]) for k in cols)] for pid, ph in phase_rows],
                   right={0, *range(2, 2 + len(cols))}, width=width)]


#: Split columns shown only when some row has bytes there (issue 21's families: most traces have none).
_OPTIONAL = ("limits", "graph", "multicast")


def _split_columns(splits: list[dict]) -> list[str]:
    """The split's columns to show for these rows: the families only where some row has bytes."""
    return [k for k in SPLIT if k not in _OPTIONAL or any(sp.get(k) for sp in splits)]


def _share(share: float | None) -> str:
    """A share as a whole percent, floored so that 97.9 % never shows as 98 %."""
    return "-" if share is None else f"{int(share * 1000) / 10:.1f} %"


def _range(lo: int | None, hi: int | None) -> str:
    return "-" if lo is None or hi is None else f"{human(lo)}..{human(hi)}"


def _failure_table(failures: list[FailedCall]) -> list[str]:
    rows = []
    for f in failures:
        gpu = "?" if f.gpu < 0 else str(f.gpu) + ("?" if f.gpu_inferred else "")
        size = human(f.size) if f.size else "-"
        rows.append([_t(f.t_s), str(f.pid), gpu, f.api, size, f.result_name])
    return table(["TIME", "PID", "GPU", "API", "SIZE", "RESULT"], rows, right={0, 1, 4}, indent="    ")
