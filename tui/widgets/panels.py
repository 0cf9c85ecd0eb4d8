"""The panels around the timeline: the GPU header, who-holds-what at the cursor, the event table,
and the status line. They format what the model computed; none of them computes anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.cells import cell_len
from rich.markup import escape
from rich.text import Text
from textual.widget import Widget
from textual.widgets import DataTable
from textual.widgets import Static

from memrec.engine.phases import NO_PHASE
from memrec.terms.events import CATEGORIES
from memrec.terms.events import UNTRACED_HEADINGS
from memrec.terms.events import UNTRACED_SPLIT
from memrec.terms.events import GpuInfo
from memrec.terms.events import OWNED
from memrec.terms.events import cu_result_name
from memrec.tui.filters import KIND_NAMES
from memrec.tui.navigation import Landing
from memrec.tui.store import EventRows
from memrec.tui.views import CursorState
from memrec.tui.views import diff_rows
from memrec.tui.widgets.timeline import FAIL_COLOUR
from memrec.tui.widgets.timeline import UNICODE_GLYPHS
from memrec.tui.widgets.timeline import Glyphs
from memrec.tui.widgets.timeline import LAYER_COLOURS
from memrec.tui.widgets.timeline import NVML_COLOUR
from memrec.terms.units import fmt_bytes
from memrec.terms.units import fmt_at
from memrec.terms.units import fmt_dur

HOLDER_VIEWS = ("process", "phase", "largest", "category", "context", "untraced", "tensors")


#: What the header and the holders say where NVML's used memory is below the traced memory: NVML
#: samples lag the driver calls (10 Hz), so right after an allocation the difference is negative
#: for a moment; that is not memory anyone holds.
NVML_LAG = "NVML lag"


def untraced_text(used: int, owned: int) -> str:
    """NVML used - traced, or :data:`NVML_LAG` when that is negative."""
    return NVML_LAG if used < owned else fmt_bytes(used - owned)


def legend(no_color: bool = False, glyphs: Glyphs = UNICODE_GLYPHS) -> Text:
    """The colour key of the timeline."""
    from memrec.tui.widgets.timeline import LAYERS

    t = Text()
    for name, colour, ch in LAYERS:
        t.append(ch if no_color else "█", style=None if no_color else colour)
        t.append(f"{name} ")
    t.append("─" if not no_color else "-", style=None if no_color else f"bold {NVML_COLOUR}")
    t.append("NVML used ")
    t.append(glyphs.fail, style=None if no_color else f"bold {FAIL_COLOUR}")
    t.append("failed call")
    return t


def header_text(gpu: GpuInfo | None, gpu_id: int, cursor_rel: str, st: CursorState | None, series_owned: int | None,
                nvml: dict | None, other: CursorState | None = None, wide: bool = True, narrow: bool = False,
                no_color: bool = False, glyphs: Glyphs = UNICODE_GLYPHS, aligned: str = "") -> Text:
    """The GPU header: identity on the first line, the memory at the cursor on the second
    (``narrow``: without NVML's reserved memory and BAR1, so that it stays one line at 80 columns;
    ``aligned``: diff mode, what the two runs are aligned on)."""
    t = Text(no_wrap=False, overflow="ellipsis")
    name = gpu.name if gpu else "(no NVML: name and size not recorded)"
    t.append(f"GPU{gpu_id} ", style="bold")
    t.append(f"{name} ")
    if gpu is not None:
        if gpu.uuid:
            t.append(f"{gpu.uuid[:16]}{glyphs.more} " if len(gpu.uuid) > 17 and not wide else f"{gpu.uuid} ", style="dim")
        t.append(f"total {fmt_bytes(gpu.total)} ")
    t.append("│ ", style="dim")
    t.append(f"t={cursor_rel}", style="bold")
    if wide:
        t.append("   ")
        t.append_text(legend(no_color, glyphs))
    t.append("\n")
    if nvml:
        t.append("used ", style="dim")
        t.append(fmt_bytes(nvml["used"]), style=None if no_color else f"bold {NVML_COLOUR}")
        if not narrow:
            t.append(" rsv ", style="dim")
            t.append(fmt_bytes(nvml["reserved"]) if nvml["reserved"] >= 0 else "-")
    else:
        t.append("used - ", style="dim")
    owned = st.owned if st is not None else series_owned
    t.append(" │ traced ", style="dim")
    t.append(fmt_bytes(owned) if owned is not None else "…", style="bold")
    if st is not None and wide:
        for c in ("driver", "vmm", "array", "host_pinned"):
            if st.by_category.get(c):
                t.append(f" {c[:6]} ", style="dim")
                t.append(fmt_bytes(st.by_category[c]), style=None if no_color else LAYER_COLOURS[c])
    t.append(" untraced ", style="dim")
    if nvml and owned is not None and nvml["used"] >= 0:
        lag = nvml["used"] < owned
        t.append(untraced_text(nvml["used"], owned), style="dim italic" if lag else "")
    else:
        t.append("-")
    if st is not None and st.by_category.get("ipc_mapped"):
        t.append(" │ ipc ", style="dim")
        t.append(fmt_bytes(st.by_category["ipc_mapped"]))
    if nvml and nvml.get("bar1_total", -1) > 0 and not narrow:
        t.append(" │ BAR1 ", style="dim")
        t.append(f"{fmt_bytes(nvml['bar1_used'])}/{fmt_bytes(nvml['bar1_total'])}")
    if other is not None:
        t.append(" │ other traced ", style="dim")
        t.append(fmt_bytes(other.owned))
        if st is not None:
            t.append(f" ({fmt_bytes(other.owned - st.owned, signed=True)})", style="bold")
        if aligned:
            t.append(f" {aligned}", style="dim")
    return t


def overview_label(gpu_id: int, gpu: GpuInfo | None, nvml: dict | None, owned: int | None) -> str:
    """One GPU's line in the all-GPUs overview: NVML used and traced at the cursor, of its total."""
    parts = [f"[b]GPU{gpu_id}[/] {gpu.name if gpu else ''}"]
    if nvml:
        parts.append(f"used {fmt_bytes(nvml['used'])}")
    if owned is not None:
        parts.append(f"traced {fmt_bytes(owned)}")
    if gpu:
        parts.append(f"of {fmt_bytes(gpu.total)}")
    return "  ".join(parts)


@dataclass(frozen=True)
class StatusFacts:
    """What the status line says about a trace at the cursor (the live connection aside)."""

    title: str | None  # the file(s); None live
    events: int
    progress: str
    failure_here: str | None  # the failed call at the cursor ("cuMemAlloc_v2: CUDA_ERROR_...")
    failures: int
    landing: Landing | None  # what the last jump landed on, while the cursor is there
    lost: int | None  # None: not worth a word (a file that lost nothing)
    warnings: int
    span: int  # ns on screen


def status_parts(f: StatusFacts, narrow: bool, glyphs: Glyphs = UNICODE_GLYPHS) -> list[str]:
    """The status line's pieces (markup); ``narrow`` (80 columns): what the cursor landed on
    comes before the file name and the event count, which it then leaves out."""
    parts = []
    if not (narrow and f.landing is not None):
        if f.title is not None:
            parts.append(f.title)
        parts.append(f"{f.events:,} events")
    if f.progress:
        parts.append(f.progress)
    if f.landing is not None and f.landing.window is not None:  # the trace's answer, where it opened
        headline = escape(f.landing.text.replace("CUDA_ERROR_", "") if narrow else f.landing.text)
        parts.append(f"[b red]{glyphs.fail} {headline}[/]" if f.landing.failure else f"[b]{headline}[/]")
    elif f.failure_here:  # the cursor is on a failure (key o): what failed (a call's CUresult's name), and where
        where = f" {f.landing.text}" if f.landing is not None and f.landing.failure else ""
        what = f.failure_here.replace("CUDA_ERROR_", "") if narrow else f.failure_here
        parts.append(f"[b red]{glyphs.fail} {what}{where}[/]")
    elif f.failures:
        parts.append(f"[b red]{f.failures} failure{'s' if f.failures > 1 else ''}[/]")
    if f.landing is not None and not f.landing.failure and f.landing.window is None:
        parts.append(f"[b]{f.landing.text}[/]")
    if f.lost is not None:
        parts.append(f"[b yellow]lost {f.lost:,}[/]" if f.lost else "lost 0")
    if f.warnings:
        parts.append(f"[yellow]{f.warnings} warning{'s' if f.warnings > 1 else ''}[/]")
    parts.append(f"view {fmt_dur(f.span)}")
    return parts


#: Below this many columns the status line takes its narrow form when the wide one does not fit.
NARROW_STATUS = 100


def fit_status(prefix: list[str], f: StatusFacts, width: int, glyphs: Glyphs = UNICODE_GLYPHS) -> str:
    """The status line in ``width`` cells: every piece if they fit, else the narrow pieces, else
    without the file name, the event count, the view's span and the warnings' count (`memrec report`
    lists the warnings), in that order. What the cursor landed on and what failed there are what
    the line is read for; cut at the edge, it would end mid-phrase (``... in (no``). Where the view
    opened on the answer, its cause follows its headline (the first part, then the details that
    fit), before the pieces that make room for it."""
    sep = " │ "

    def fits(parts: list[str]) -> bool:
        return Text.from_markup(sep.join(parts)).cell_len <= width

    cause = f.landing.cause if f.landing is not None and f.landing.window is not None else ()

    def with_cause(parts: list[str]) -> list[str] | None:
        """``parts`` with the cause after the headline, when its first part fits (else None)."""
        if not cause:
            return parts if fits(parts) else None
        at = next((i + 1 for i, p in enumerate(parts) if escape(f.landing.text[:20]) in p), len(parts))
        text = cause[0]
        for part in cause[1:]:
            if fits(parts[:at] + [escape(text + part)] + parts[at:]):
                text += part
        out = parts[:at] + [escape(text)] + parts[at:]
        return out if fits(out) else None

    parts = prefix + status_parts(f, False, glyphs)
    done = with_cause(parts)
    if done is not None:
        return sep.join(done)
    parts = prefix + status_parts(f, width < NARROW_STATUS, glyphs)
    warned = f"[yellow]{f.warnings} warning{'s' if f.warnings > 1 else ''}[/]"
    for piece in (f.title, f"{f.events:,} events", f"view {fmt_dur(f.span)}", warned, None):
        done = with_cause(parts)
        if done is not None:
            return sep.join(done)
        if piece in parts[len(prefix) :]:
            parts.remove(piece)
    return sep.join(parts)


def settle_widths(table: DataTable) -> None:
    """Fix each column's width to its widest cell now. Textual measures auto-width columns only
    when idle, and a frame drawn before that caches the cells at the header's width: at 120x36
    the times read ``7.72`` and the phases ``custo`` until the next update."""
    for i, col in enumerate(table.ordered_columns):
        widest = max((cell_len(str(row[i])) for row in (table.get_row_at(r) for r in range(table.row_count))), default=0)
        col.width = max(col.label.cell_len, widest)
        col.auto_width = False


class GpuHeader(Static):
    """Name, UUID, total; NVML used/reserved, traced, untraced, BAR1 at the cursor."""


class StatusLine(Static):
    """Source, progress, connection, lost events, warnings."""


class HoldersTable(DataTable):
    """Who holds what on this GPU at the cursor; ``h`` cycles the grouping."""

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.view_name = HOLDER_VIEWS[0]
        #: Under 100 columns (32 for this table): by process shows owned and ipc (driver and vmm
        #: are the "by category" view), the largest show size, phase and rank.
        self.narrow = False

    def show(self, st: CursorState | None, other: CursorState | None = None) -> None:
        """The holders at the cursor (``other``: diff mode, the other run's beside them)."""
        self._show(st, other)
        settle_widths(self)

    def _show(self, st: CursorState | None, other: CursorState | None = None) -> None:
        self.clear(columns=True)
        self.border_title = f"at cursor: by {self.view_name} [dim](h)[/]"
        if st is None:
            self.add_column("")
            self.add_row("…")
            return
        v = self.view_name
        if other is not None and v not in ("largest", "context", "untraced", "tensors"):
            self._show_diff(st, other)
            return
        if v == "process":
            # the categories (memrec.terms.events' table) someone holds here, no column of zeros; one
            # owned category alone is the "owned" column already
            held = [c for c in CATEGORIES if any(cats.get(c, 0) for _, _, cats, _ in st.by_process)]
            if len([c for c in held if c in OWNED]) < 2:
                held = [c for c in held if c not in OWNED]
            cats_shown = ["ipc_mapped"] if self.narrow else held  # narrow: owned and ipc, always
            self.add_columns("rank" if self.narrow else "rank/pid", "owned", *({"ipc_mapped": "ipc"}.get(c, c) for c in cats_shown))
            for pid, label, cats, owned in st.by_process:
                # narrow: the rank alone (TP0), so that its bytes fit in 32 columns
                lab = label if label == str(pid) or self.narrow else f"{label} {pid}"
                self.add_row(lab, fmt_bytes(owned), *(fmt_bytes(cats.get(c, 0)) for c in cats_shown))
        elif v == "phase":
            self.add_columns("phase", "bytes", "allocs")
            for name, b, n in st.by_phase:
                self.add_row(name, fmt_bytes(b), str(n))
        elif v == "category":
            self.add_columns("category", "bytes")
            for c, b in st.by_category.items():
                self.add_row(c, fmt_bytes(b))
            if st.nvml and st.nvml.get("used", -1) >= 0:
                self.add_row("untraced", untraced_text(st.nvml["used"], st.owned))
                self.add_row("NVML used", fmt_bytes(st.nvml["used"]))
        elif v == "context":
            self.add_columns("rank/pid", "context", "bound", "cost", "")
            for label, api, ts, cost, foreign in st.contexts:
                self.add_row(label, api, fmt_dur(max(st.ts - ts, 0)) + " ago", fmt_bytes(cost) if cost is not None else "-",
                             "foreign: allocates nothing here" if foreign else "")
        elif v == "untraced":
            self.add_columns("rank/pid", *(UNTRACED_HEADINGS[k].lower() for k in UNTRACED_SPLIT))
            for label, sp in st.untraced_split:
                self.add_row(label, *(fmt_bytes(sp.get(k, 0)) for k in UNTRACED_SPLIT))
        elif v == "tensors":
            self.add_columns("rank/pid", "allocated", "reserved", "resv-alloc", "largest free", "blocks")
            for label, fr in st.tensors:
                self.add_row(label, fmt_bytes(fr.allocated), fmt_bytes(fr.reserved), fmt_bytes(fr.free),
                             fmt_bytes(fr.largest_free), f"{fr.blocks:,}")
        elif self.narrow:
            self.add_columns("size", "phase", "rank")
            for a in st.largest:
                self.add_row(fmt_bytes(a.size), a.phase or NO_PHASE, a.label)
        else:
            self.add_columns("size", "age", "phase", "rank", "category", "address")
            for a in st.largest:
                self.add_row(fmt_bytes(a.size), fmt_dur(a.age), a.phase or NO_PHASE, a.label, a.category, f"{a.address:#x}")
        if not self.row_count:
            empty = st.untraced_note if v in ("context", "untraced") and st.untraced_note else (
                "(no tensor blocks: record with memrec daemon --tensors)" if v == "tensors" else "(nothing)")
            self.add_row(*([empty] + [""] * (len(self.columns) - 1)))

    def _show_diff(self, st: CursorState, other: CursorState) -> None:
        v = self.view_name
        if v == "process":
            a = {label: owned for _, label, _, owned in st.by_process}
            b = {label: owned for _, label, _, owned in other.by_process}
        elif v == "phase":
            a = {n: b for n, b, _ in st.by_phase}
            b = {n: x for n, x, _ in other.by_phase}
        else:
            a, b = dict(st.by_category), dict(other.by_category)
        self.add_columns(v, "base", "other", "Δ")
        for key, x, y, d in diff_rows(a, b):
            self.add_row(key, fmt_bytes(x), fmt_bytes(y), fmt_bytes(d, signed=True))

    def cycle(self) -> None:
        self.view_name = HOLDER_VIEWS[(HOLDER_VIEWS.index(self.view_name) + 1) % len(HOLDER_VIEWS)]


class EventsTable(DataTable):
    """The events around the cursor (the row at the cursor is highlighted)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.seqs: list[int] = []

    def on_mount(self) -> None:
        # Size and result before rank: at 80 columns a long rank label (a process title) must not
        # push the size's unit ("80.0" for 80.00 GiB) or the result out of view.
        self.add_columns("time", "kind", "size", "result", "rank", "phase", "address")

    def show(self, ev: EventRows | None, origin: int, label, flt_text: str = "", resolution: int = 10_000_000) -> None:
        """The events around the cursor; times with the decimals one column of the chart
        (``resolution`` ns) needs."""
        self.clear()
        # The frame is the events pane's, around the filter box and this table (tui/app.tcss).
        frame = self.parent if isinstance(self.parent, Widget) else self
        frame.border_title = "events" + (f" [dim]filter:[/] {flt_text}" if flt_text else " [dim](/ to filter)[/]")
        if ev is None:
            self.seqs = []
            return
        rows = ev.rows
        self.seqs = ev.seqs.tolist()
        for i in range(len(rows)):
            r = rows[i]
            res = int(r["result"])
            kind = KIND_NAMES.get(int(r["kind"]), str(int(r["kind"])))
            size = int(r["size"])
            res_text = Text("ok" if res == 0 else cu_result_name(res).replace("CUDA_ERROR_", ""),
                            style="" if res == 0 else f"bold {FAIL_COLOUR}")
            self.add_row(
                fmt_at(int(r["ts"]) - origin, resolution),
                kind,
                fmt_bytes(size) if size else "",
                res_text,
                label(int(r["pid"])),
                ev.phases[i] or "",
                f"{int(r['ptr']):#x}" if r["ptr"] else "",
            )
        settle_widths(self)
        if ev.center >= 0 and self.row_count:
            self.move_cursor(row=min(ev.center, self.row_count - 1), animate=False)
