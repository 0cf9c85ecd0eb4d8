"""The one answer model: what failed, what caused it, what to change, and when to look.

:func:`build_answer` reads the report's own sections (nothing is replayed again) and returns an
:class:`Answer`. ``memrec report`` prints its three lines first; the TUI opens on its window with its
failure in the status line and ``o`` visits its failures; the plot marks its failures and window;
the Perfetto trace carries its failures as instants; the memory-viz export snapshots at its
failure. No view works the answer out again its own way: they all render this model (the report's
JSON keeps it under ``answer``, read back with :meth:`Answer.from_json`).

Each line is a label and parts: the first part must be shown, the later ones are added while the
line fits the terminal (:meth:`Line.fit`), so an 80-column report loses detail, never a number cut
in half. The cases, in order:

1. SGLang's KV-cache sizing failed (the markers carry SGLang's own numbers): the ranks and the
   error; the phases that took memory between SGLang's baseline and its sizing, other than the
   weights, on the GPU of the worst rank; the ``--mem-fraction-static`` that works and the flag
   that drops the phase that took most (custom all-reduce, CUDA graphs). Window: from the
   baseline to the sizing's failure on that GPU.
2. A driver call failed: the first out-of-memory (else the first failed call), with what the
   GPU held then, by the phase that allocated it, and how much would have had to be free.
   Window: from when the largest pieces then held were allocated (out of memory), or from the
   start of the phase the call failed in, to the call.
3. A phase or instant marker carries an ``error`` (and neither of the above): that error. Window:
   the phase.
4. Nothing failed: the highest traced peak, what held it by phase, and the headroom left.
   Window: from the start of the phases held at the peak to the peak.

:attr:`Answer.failures` lists every failure the answer counts, in time order: each failed driver
call, each rank's failed KV sizing, and each other marker with an ``error``.

With stacks (format 2.3), a ``SITE`` line follows the three: the failed call's own site (the
innermost user frame of its stack, :mod:`memrec.analysis.report.sites`), and the site that held the
most in the phase the second line names first (``custom_ar_init took most from
custom_all_reduce.py:123 CustomAllreduce.__init__: 36.00 GiB on 2 ranks``). Without stacks there
is no such line.

A trace without a trailer (the recorder crashed or was killed, a file still being written, a
partial copy) says so in the first line: ``PARTIAL cut short (no trailer): ...`` instead of
``OK``, and "(trace cut short)" after a failure, since what was not read may hold the failure or the peak.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from typing import TYPE_CHECKING

from memrec.base.untrusted import clean_text
from memrec.analysis.report.sites import Site
from memrec.analysis.text import human
from memrec.engine.phases import NO_PHASE
from memrec.analysis.untraced.split import EXPLAINED_SHARE_MIN

if TYPE_CHECKING:  # the report's sections hold an Answer: the types only, for the checker
    from memrec.analysis.report.model import FailedCall
    from memrec.analysis.report.model import GpuSection
    from memrec.analysis.report.model import ProcessEntry
    from memrec.analysis.report.model import Report
    from memrec.analysis.sglang.model import SglangSection
    from memrec.analysis.sglang.model import SglangSummary
    from memrec.analysis.sglang.windows import ShownWindow

#: SGLang phases (memrec's hook names) whose memory a server flag removes or shrinks.
PHASE_FLAGS = {
    "custom_ar_init": "--disable-custom-all-reduce",
    "cuda_graph_capture": "--disable-cuda-graph or a smaller --cuda-graph-max-bs",
    "attention_workspace": "a smaller --max-running-requests",
}
#: What a failed call's result means when it is not a lack of memory.
RESULT_HINTS = {
    "CUDA_ERROR_NOT_PERMITTED": "not allowed now (e.g. inside a CUDA graph capture)",
    "CUDA_ERROR_INVALID_VALUE": "an argument the driver refused (size 0, bad flags)",
    "CUDA_ERROR_INVALID_CONTEXT": "no CUDA context current on the calling thread",
    "CUDA_ERROR_NOT_INITIALIZED": "cuInit was not called in this process",
    "CUDA_ERROR_INVALID_DEVICE": "a device ordinal this process cannot see",
}
OOM = "CUDA_ERROR_OUT_OF_MEMORY"
LABEL_WIDTH = 8
#: SGLang phases whose error is the KV cache sizing's.
KV_PHASES = ("kv_budget", "kv_pool")
#: Failure kinds, the order a headline prefers among failures at one time.
KV_SIZING, DRIVER_OOM, DRIVER_CALL, ERROR_MARKER = "kv_sizing", "driver_oom", "driver_call", "error_marker"


@dataclass(frozen=True)
class Line:
    """One answer line: a label (``FAILED``, ``CAUSE``, ``FIX``...) and its parts, the first one
    always shown."""

    label: str
    parts: tuple[str, ...]

    def fit(self, width: int) -> str:
        """The label, the first part, then each later part while the line fits ``width``."""
        first, *rest = self.parts
        text = f"{self.label:<{LABEL_WIDTH}}{first}"
        for part in rest:
            if len(text) + len(part) <= width:
                text += part
        return text

    @property
    def short(self) -> str:
        """The first part alone (a status line's room)."""
        return self.parts[0]


@dataclass(frozen=True)
class Failure:
    """One failure the answer counts: when (trace clock ns, and seconds from the trace's start),
    on which GPU (None: unknown or the host), by whom, and what failed in a few words."""

    kind: str  # KV_SIZING | DRIVER_OOM | DRIVER_CALL | ERROR_MARKER
    ts: int
    t_s: float
    gpu: int | None
    pid: int
    who: str  # "TP0", else "pid 123"
    what: str  # "cuMemAlloc_v2 of 2.0 GiB: CUDA_ERROR_OUT_OF_MEMORY", "KV cache sizing: Not enough memory"
    phase: str = ""


@dataclass(frozen=True)
class Window:
    """The time to look at: ``start_ts``..``end_ts`` (trace clock ns; ``*_s`` from the trace's
    start) on ``gpu`` (None: every GPU), and why these bounds."""

    start_ts: int
    end_ts: int
    start_s: float
    end_s: float
    gpu: int | None
    why: str

    def padded(self, fraction: float = 0.1, minimum: int = 1_000_000) -> tuple[int, int]:
        """The window widened by ``fraction`` of its span on each side (at least ``minimum`` ns in
        all): a view that zooms to it shows what leads in and out, and a zero-length window
        (a peak at one instant) is still a range."""
        pad = max(int((self.end_ts - self.start_ts) * fraction), (minimum - (self.end_ts - self.start_ts)) // 2, 1)
        return max(self.start_ts - pad, 0), self.end_ts + pad


@dataclass(frozen=True)
class Answer:
    """The trace's answer (see the module): ``status`` ``failed``, ``ok`` or ``empty``; its lines;
    the failure the headline names (``failure``, None when nothing failed) among all the failures;
    the window to look at."""

    status: str
    lines: tuple[Line, ...]
    failures: tuple[Failure, ...] = ()
    failure: Failure | None = None
    window: Window | None = None

    @property
    def headline(self) -> Line:
        return self.lines[0]

    @property
    def cause(self) -> Line | None:
        return self.lines[1] if len(self.lines) > 1 else None

    @property
    def fix(self) -> Line | None:
        return self.lines[2] if len(self.lines) > 2 else None

    def text(self, width: int) -> list[str]:
        """The lines as ``memrec report`` prints them first."""
        return [line.fit(width) for line in self.lines]

    def to_json(self) -> dict:
        """The report's ``answer``: ``lines`` as ``[label, part, ...]`` lists, the rest as dicts."""
        return {
            "status": self.status,
            "lines": [[line.label, *line.parts] for line in self.lines],
            "failures": [asdict(f) for f in self.failures],
            "failure": asdict(self.failure) if self.failure else None,
            "window": asdict(self.window) if self.window else None,
        }

    @classmethod
    def from_json(cls, d: dict) -> Answer:
        """The inverse of :meth:`to_json` (a report dict's ``answer``)."""
        return cls(
            d["status"],
            tuple(Line(x[0], tuple(x[1:])) for x in d["lines"]),
            tuple(Failure(**f) for f in d.get("failures") or ()),
            Failure(**d["failure"]) if d.get("failure") else None,
            Window(**d["window"]) if d.get("window") else None,
        )


def build_answer(report: Report) -> Answer:
    """The answer of ``report`` (:func:`memrec.analysis.report.build.build_report`'s); its second
    line ends with the window (``; window +7.738–7.745s``) where it fits. After the three lines,
    one ``UNTRACED`` line per process and GPU whose NVML used is under
    :data:`~memrec.analysis.untraced.split.EXPLAINED_SHARE_MIN` traced or explained."""
    answer = _cut_short(report, _build(report))
    lines = answer.lines
    w = answer.window
    if w is not None and len(lines) >= 2:
        when = f"window +{w.start_s:.3f}–{w.end_s:.3f}s" if w.end_ts > w.start_ts else f"at +{w.end_s:.3f}s"
        lines = (lines[0], Line(lines[1].label, lines[1].parts + (f"; {when}",)), *lines[2:])
    return Answer(answer.status, lines + _unexplained(report), answer.failures, answer.failure, w)


def _unexplained(report: Report) -> tuple[Line, ...]:
    """What no measurement explains, per GPU and process, where it is over 2 % of NVML used: said
    as unexplained, never given a cause (issue 21)."""
    out = []
    for sec in report.gpus:
        for r in sec.reconciliation.processes if sec.reconciliation else ():
            share = r.explained_share
            if share is None or share >= EXPLAINED_SHARE_MIN or not r.nvml_used_last:
                continue
            gone = (r.split or {}).get("unexplained", 0)
            pct = round(100 * (1 - share))
            out.append(Line("UNTRACED", (f"GPU {sec.gpu}: {human(gone)} ({pct} %) of pid {r.pid}'s memory is unexplained",)))
    return tuple(out)


def _cut_short(report: Report, answer: Answer) -> Answer:
    """The answer of a trace without a trailer says so first: what was not read may hold the
    failure or the peak, so neither "OK" nor a lone failure is the whole answer."""
    if report.trace.complete:
        return answer
    first = answer.lines[0]
    if first.label == "OK":
        text = first.parts[0].replace(" in this trace", "")
        first = Line("PARTIAL", (f"cut short (no trailer): {text}", " in what was read", *first.parts[1:]))
    else:
        first = Line(first.label, (f"{first.parts[0]} (trace cut short)", *first.parts[1:]))
    return Answer(answer.status, (first, *answer.lines[1:]), answer.failures, answer.failure, answer.window)


def _selection(report: Report) -> str:
    """What the report covers, as the end of a sentence: the trace, or the process and GPU that
    -p and -g kept (a launcher's pid holds nothing in a trace that holds plenty)."""
    f = report.filter
    if f.pid is None and f.gpu is None:
        return "in this trace"
    return " ".join(x for x in (f"by pid {f.pid}" if f.pid is not None else "",
                                "" if f.gpu is None else "in the host section" if f.gpu < 0 else f"on GPU {f.gpu}")
                    if x)


def _build(report: Report) -> Answer:
    failures = _all_failures(report)
    sg = report.sglang
    summary = sg.summary if sg is not None else None
    if sg is not None and summary is not None and summary.failed and summary.kv_failed:
        lines, window = _sglang_failed(report, sg)
        kv = [f for f in failures if f.kind == KV_SIZING]
        failure = next((f for f in kv if window is not None and f.gpu == window.gpu), kv[0] if kv else None)
        return Answer("failed", lines, failures, failure, window)
    calls = _driver_failures(report)
    if calls:
        lines, f = _call_failed(report, calls)
        failure = next(x for x in failures if x.kind in (DRIVER_OOM, DRIVER_CALL) and (x.ts, x.pid) == (f.ts, f.pid))
        return Answer("failed", lines, failures, failure, _call_window(report, f))
    marked = [f for f in failures if f.kind in (ERROR_MARKER, KV_SIZING)]
    if marked:
        lines, failure, window = _marker_failed(report, marked)
        return Answer("failed", lines, failures, failure, window)
    secs = [s for s in report.gpus if s.peak.bytes]
    if not secs:
        return Answer("empty", (Line("OK", (f"no GPU memory was allocated {_selection(report)}",)),))
    lines, window = _no_failure(report, secs, summary)
    return Answer("ok", lines, window=window)


def span(labels: list[str]) -> str:
    """Rank labels as a range where they run on: TP0, TP1, ..., TP7 -> "TP0–TP7"."""
    parsed = [re.fullmatch(r"([A-Za-z ]*?)(\d+)", x) for x in labels]
    if len(labels) > 2 and all(parsed) and len({m.group(1) for m in parsed}) == 1:
        nums = sorted(int(m.group(2)) for m in parsed)
        if nums == list(range(nums[0], nums[0] + len(nums))):
            prefix = parsed[0].group(1)
            return f"{prefix}{nums[0]}–{prefix}{nums[-1]}"
    return ", ".join(labels)


def _gib(x: float) -> str:
    return f"{x:.2f} GiB"


def _short_error(text: str) -> str:
    """The error's first sentence without the exception class: "Not enough memory"."""
    text = text.split(". ")[0].rstrip(".")
    return re.sub(r"^[A-Za-z_.]*(Error|Exception): ", "", text)


def _t_s(report: Report, ts: int) -> float:
    return round((ts - report.trace.start_ts) / 1e9, 6)


def _window(report: Report, start: int, end: int, gpu: int | None, why: str) -> Window:
    start = min(start, end)
    return Window(start, end, _t_s(report, start), _t_s(report, end), gpu, why)


# ----------------------------------------------------------------------------------- the failures


def _driver_failures(report: Report) -> list[FailedCall]:
    """Every failed driver call of the report's selection (per GPU, the host's, unknown GPU's)."""
    return report.failures()


def _all_failures(report: Report) -> tuple[Failure, ...]:
    """Every failure the answer counts, in time order (see the module)."""
    procs = report.process_map()
    out: list[Failure] = []
    for f in _driver_failures(report):
        size = f" of {human(f.size)}" if f.size else ""
        out.append(Failure(DRIVER_OOM if f.result_name == OOM else DRIVER_CALL, f.ts, f.t_s,
                           f.gpu if f.gpu >= 0 else None, f.pid, _who([f.pid], procs),
                           f"{f.api}{size}: {f.result_name}", f.phase or ""))
    sized: set[int] = set()  # pids whose KV sizing failure is counted (its phase's error is that one)
    for r in report.sglang.ranks if report.sglang is not None else ():
        for b in (rb.budget for rb in r.budgets):
            if b.ok or b.ts is None:
                continue
            gpu = b.gpu if b.gpu is not None else r.gpu
            what = (f"KV cache sizing: {_short_error(b.error)}" if b.error
                    else f"KV cache sizing: rest {_gib(b.rest_gib)}" if b.rest_gib is not None
                    else "KV cache sizing: budget <= 0")
            out.append(Failure(KV_SIZING, b.ts, _t_s(report, b.ts), gpu, r.pid, r.label, what, "kv_budget"))
            sized.add(r.pid)
    # only the markers with values can hold an error (a step loop's 25,000 phases have none)
    marked = [(ph.pid, ph.end_ts, ph.gpu, ph.path, ph.name, ph.values) for ph in report.phases.with_values()]
    marked += [(i.pid, i.ts, i.gpu, i.phase, i.name, i.values) for i in report.instants if i.values]
    for pid, ts, gpu, phase, name, values in marked:
        err = values.get("error")
        if not err or (pid in sized and name in KV_PHASES):
            continue
        out.append(Failure(ERROR_MARKER, ts, _t_s(report, ts), gpu if gpu is not None and gpu >= 0 else None,
                           pid, _who([pid], procs), f"{name}: {_short_error(str(err))}", phase))
    order = (KV_SIZING, DRIVER_OOM, DRIVER_CALL, ERROR_MARKER)
    return tuple(sorted(out, key=lambda f: (f.ts, order.index(f.kind), f.pid)))


# ------------------------------------------------------------------------------------ the cases


def _sglang_failed(report: Report, sg: SglangSection) -> tuple[tuple[Line, ...], Window | None]:
    summary = sg.summary
    error = _short_error((summary.errors or ["KV cache sizing failed"])[0])
    first = ["FAILED", f"SGLang's KV cache sizing on {span(sorted(summary.failed_labels))}: {error}"]
    if summary.min_rest_gib is not None:
        first.append(f" (rest {_gib(summary.min_rest_gib)})")
    ranks = sg.ranks  # (only the filtered process's with -p)
    worst = summary.min_rest_label
    rank = next((r for r in ranks if r.label == worst), None)
    if rank is None:  # the worst rank is filtered out: the first shown rank whose sizing failed
        rank = next((r for r in ranks if any(not rb.budget.ok for rb in r.budgets)), ranks[0] if ranks else None)
        worst = rank.label if rank else worst
    gpu = rank.gpu if rank else None
    window = next((w for w in sg.windows if w.gpu == gpu), sg.windows[0] if sg.windows else None)
    if window is not None:
        gpu = window.gpu
    order = _took_between(window)
    if order:
        name, e = order[0]
        cause = ["CAUSE", f"GPU {gpu}: {name} took {human(e.owned)}"]
        cause.append(f" ({span(sorted(e.labels))})")
        cause.append(" after SGLang's memory baseline")
        for other, o in order[1:3]:
            cause.append(f"; {other} {human(o.owned)}")
    else:
        cause = ["CAUSE", f"GPU {gpu}: the weights and what was already in use left too little for the KV cache"]
    need = summary.needed_mem_fraction_static
    fix = ["FIX"]
    if need is not None and need < 1:
        fix.append(f"--mem-fraction-static {math.ceil(need * 100) / 100:.2f}+")
        if summary.mem_fraction_static:
            fix.append(f" (was {summary.mem_fraction_static[0]:.3f})")
    else:
        fix.append("no --mem-fraction-static below 1 fits: free memory before the KV sizing")
    if order and order[0][0] in PHASE_FLAGS:
        fix.append(f", or {PHASE_FLAGS[order[0][0]]}")
    if order:
        diag = next((rb.diagnosis for r in ranks for rb in r.budgets if r.label == worst and rb.diagnosis), None)
        if diag and diag.rest_without_extras_gib is not None:
            fix.append(f" (without it rest = {_gib(diag.rest_without_extras_gib)})")
    lines = _lines(first, cause, fix, _site_line(report, order[0][0] if order else None))
    if window is None:
        return lines, None
    ends = [rb.budget.ts for r in ranks if r.gpu == gpu for rb in r.budgets
            if not rb.budget.ok and rb.budget.ts is not None]
    end = max(ends + [window.sizing_ts])
    return lines, _window(report, window.baseline_ts, end, gpu, "from SGLang's memory baseline to its failed KV sizing")


@dataclass
class _Took:
    """What one phase took in a window, over the ranks that ran it."""

    owned: int = 0
    labels: list[str] = field(default_factory=list)


def _took_between(window: ShownWindow | None) -> list[tuple[str, _Took]]:
    """What each phase other than the weights took between the baseline and the KV sizing on the
    window's GPU (``owned`` and the ranks' labels), largest first."""
    extras: dict[str, _Took] = {}
    for row in window.between if window is not None else ():
        if row.weights or not row.owned:
            continue
        e = extras.setdefault(row.name, _Took())
        e.owned += row.owned
        e.labels.append(row.label)
    return sorted(extras.items(), key=lambda kv: -kv[1].owned)


def _who(pids: list[int], procs: dict[int, ProcessEntry]) -> str:
    labels = [(procs[p].rank if p in procs else "") or f"pid {p}" for p in pids]
    return span(labels)


def _call_failed(report: Report, failures: list[FailedCall]) -> tuple[tuple[Line, ...], FailedCall]:
    procs = report.process_map()
    f = next((x for x in failures if x.result_name == OOM), failures[0])
    where = f"GPU {f.gpu}" if f.gpu >= 0 else "an unknown GPU"
    size = f" of {human(f.size)}" if f.size else ""
    first = ["FAILED", f"{f.api}{size} on {where}: {f.result_name}",
             f", {_who([f.pid], procs)} at +{f.t_s:.3f}s"]
    if len(failures) > 1:
        first.append(f" (+{len(failures) - 1} more failed call{'s' if len(failures) > 2 else ''})")
    if f.result_name != OOM:
        hint = RESULT_HINTS.get(f.result_name, "see the call's arguments and state")
        cause = ["CAUSE", f"not a lack of memory: {hint}"]
        phase = f" in {f.phase}" if f.phase and not f.phase.startswith("(") else ""
        fix = ["FIX", f"nothing to free: see what {_who([f.pid], procs)} did at +{f.t_s:.3f}s{phase}"]
        return _lines(first, cause, fix, _site_line(report, None, f)), f
    phases = f.held.by_phase if f.held is not None else []
    owned_then = f.held.owned_on_gpu if f.held is not None else 0
    cause = ["CAUSE", f"{where} held {human(owned_then)} then"]
    for k, ph in enumerate(phases[:3]):
        cause.append(f"{':' if k == 0 else ','} {ph.phase} {human(ph.bytes)} ({_who(ph.pids, procs)})")
    sec = next((s for s in report.gpus if s.gpu == f.gpu), None)
    fix = _call_fix(f, where, sec.total if sec else None, owned_then)
    if phases and fix[0] == "FIX":  # a phase names the holder; outside any, its processes do
        top = phases[0]
        fix.append(f"; the largest holder is {_who(top.pids, procs) if top.phase == NO_PHASE else top.phase}")
    return _lines(first, cause, fix, _site_line(report, phases[0].phase if phases else None, f)), f


def _call_fix(f: FailedCall, where: str, total: int | None, owned_then: int) -> list[str]:
    """What to change for a call that ran out of memory: ask for less, or free what was short."""
    free = f.nvml_free
    if total and f.size > total:
        return ["FIX", f"ask for less: {human(f.size)} is more than {where}'s {human(total)}"]
    if free is not None:
        short = f.size - free
        if short > 0:
            return ["FIX", f"free {human(short)} on {where} first",
                    f" (it needed {human(f.size)}, NVML had {human(free)} free)"]
        return ["FIX", f"NVML had {human(free)} free for {human(f.size)}: see NVML vs traced below",
                " (memory memrec did not see: contexts, other processes)"]
    if total:
        room = total - owned_then
        return ["FIX", f"free {human(max(f.size - room, 0))} on {where} first",
                f" (it needed {human(f.size)}; {human(total)} total minus what memrec saw held)"]
    return ["FIX", f"free memory on {where} before this call or ask for less than {human(f.size)}"]


def _lines(*lines: list[str]) -> tuple[Line, ...]:
    """The lines that have parts (a ``SITE`` line without stacks has none)."""
    return tuple(Line(x[0], tuple(x[1:])) for x in lines if len(x) > 1)


def _site_line(report: Report, phase: str | None, failure: FailedCall | None = None) -> list[str]:
    """The ``SITE`` line of a trace with stacks (:mod:`memrec.analysis.report.sites`): the failed call's
    own site, and the site that held the most in ``phase`` (the phase the line before names);
    without stacks no parts, and :func:`_lines` leaves the line out."""
    section = report.sites
    if not section:
        return ["SITE"]
    out = ["SITE"]
    site: Site | None = section.failure_site(failure.index) if failure is not None else None
    if site is not None:
        out.append(f"the failed call came from {clean_text(site.label, 100)}")
    row = section.top_in(phase) if phase else None
    if row is not None and row.peak:
        out.append(f"{'; ' if site else ''}{phase} took most from {clean_text(row.site.label, 100)}: "
                   f"{human(row.peak)} at its peak on {row.who}")
    return out


def _call_window(report: Report, f: FailedCall) -> Window:
    """A failed call's window: out of memory, from when the largest pieces the GPU then held were
    allocated; otherwise from the start of the phase it failed in (else the call alone)."""
    gpu = f.gpu if f.gpu >= 0 else None
    if f.result_name == OOM and f.held is not None and f.held.largest:
        start = min(h.ts for h in f.held.largest)
        return _window(report, start, f.ts, gpu, "from the largest allocations it held then to the failed call")
    start = report.phases.latest_start([f.pid], f.phase or "", f.ts)
    if start is None:
        return _window(report, f.ts, f.ts, gpu, "the failed call")
    return _window(report, start, f.ts, gpu, f"the phase {f.phase} up to the failed call")


def _marker_failed(report: Report, marked: list[Failure]) -> tuple[tuple[Line, ...], Failure, Window]:
    """A marker said a phase failed (and no driver call and no KV sizing did): its error."""
    f = marked[0]
    first = ["FAILED", f"{f.what}", f", {f.who} at +{f.t_s:.3f}s"]
    if len(marked) > 1:
        first.append(f" (+{len(marked) - 1} more error{'s' if len(marked) > 2 else ''})")
    cause = ["CAUSE", "the program reported the error in a marker; no driver call failed"]
    fix = ["FIX", f"see the error's traceback in `memrec dump` and what {f.who} did in {f.phase or 'its phases'}"]
    start = report.phases.latest_start([f.pid], f.phase, f.ts)
    window = _window(report, f.ts if start is None else start, f.ts, f.gpu,
                     "the failed call" if start is None else f"the phase {f.phase}")
    return _lines(first, cause, fix), f, window


def _no_failure(report: Report, secs: list[GpuSection], summary: SglangSummary | None) -> tuple[tuple[Line, ...], Window]:
    procs = report.process_map()
    sec = max(secs, key=lambda s: (s.peak.bytes, -s.gpu))
    pk = sec.peak
    by_phase = pk.by_phase or []  # OMITTED (falsy) on a GPU the peak's phases were not worked out for
    first = ["OK", f"no failed call; highest peak {human(pk.bytes)} on GPU {sec.gpu} at +{pk.t_s:.3f}s"]
    if sec.total:
        first.append(f" of {human(sec.total)}")
    others = [s.gpu for s in secs if s is not sec and s.peak.bytes == pk.bytes]
    if others:
        first.append(f" (same on GPU {span([str(g) for g in others])})")
    held = ["PEAK", f"held at the peak on GPU {sec.gpu}"]
    for k, ph in enumerate(by_phase):
        if k == 3:
            break
        held.append(f"{':' if k == 0 else ','} {ph.phase} {human(ph.bytes)} ({_who(ph.pids, procs)})")
    if len(held) == 2:
        held = ["PEAK", f"GPU {sec.gpu} held {human(pk.bytes)} at its peak (no phase markers)"]
    third = ["ROOM"]
    if summary is not None and summary.min_rest_gib is not None:
        third.append(f"KV cache sized on every rank: smallest rest {_gib(summary.min_rest_gib)}"
                     f" ({summary.min_rest_label})")
        if summary.min_tokens is not None:
            third.append(f", {summary.min_tokens:,} tokens")
    elif sec.total:
        used = sec.nvml.peak_used if sec.nvml is not None else None
        if used is not None:
            third.append(f"GPU {sec.gpu}: {human(sec.total - used)} never used (NVML peak {human(used)})")
        else:
            third.append(f"GPU {sec.gpu}: {human(sec.total - pk.bytes)} above the traced peak"
                         " (contexts and untraced memory not counted)")
    else:
        third.append("GPU totals unknown (no NVML in this trace)")
    starts = [s for ph in by_phase[:3] if (s := report.phases.latest_start(ph.pids, ph.phase, pk.ts)) is not None]
    window = _window(report, min(starts, default=pk.ts), pk.ts, sec.gpu,
                     "from the start of the phases held at the peak to the peak" if starts else "the peak")
    return _lines(first, held, third, _site_line(report, by_phase[0].phase if by_phase else None)), window
