"""A picture of a recording for a bug report: one panel per GPU (matplotlib, Agg: no display needed).

Above the panels, the answer's three lines (:mod:`memrec.analysis.report.answer`, what ``memrec report``
prints first), or with a second recording ``memrec diff``'s verdict. Each panel stacks the owned
bytes by category (driver allocations, VMM physical; pinned host memory on the host panel) as step
areas, draws the bytes mapped from peers by IPC as a dotted line above them (mapped, not owned),
NVML's ``used`` and ``reserved`` as lines, the GPU's capacity as a line (the y axis reaches it),
the phases of the process that held most on that GPU as shaded bands with their names (past
:data:`NAMED` phases, the wide ones' names only, and the bands one strip of pixel columns, each
the average of the bands over it: a step loop's phases are narrower than a pixel), the
answer's window as a hatched band, and every failure the answer counts as a red cross with what
failed (a driver call's result, SGLang's KV sizing, a marker's error). Where NVML's ``used`` reads
far below what was traced (its samples lag the driver calls, up to a sampling period), a note
says so. Times are seconds since the recording started, or, with a second recording
(:func:`plot_diff`), since the marker both are aligned on (:func:`memrec.analysis.diff.build.align_markers`,
as ``tui --diff``), so the two line up.

Where a step is shorter than a column of about 2 px, each column is drawn to the highest value in
it (:func:`_steps`): a peak of microseconds in a run of seconds shows.

The x range is fitted to where something happened (memory changed, a phase, a failure; the frees
of a process exit aside, which come at teardown), with a margin: a 20 s recording whose startup
took 50 ms shows those 50 ms, not a vertical line.
"""

from __future__ import annotations

import atexit
import io
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memrec.base.files import create_output
from memrec.analysis.report.answer import Answer
from memrec.analysis.report.answer import DRIVER_CALL
from memrec.analysis.report.answer import DRIVER_OOM
from memrec.analysis.report.answer import Window
from memrec.analysis.diff.build import align_markers
from memrec.analysis.diff.build import diff_traces
from memrec.analysis.diff.build import verdict_of
from memrec.analysis.names import result_name
from memrec.analysis.report.build import trace_answer
from memrec.analysis.text import human
from memrec.engine.series import GpuSeries
from memrec.api import Recording
from memrec.terms.events import Kind
from memrec.export import require

#: Owned categories, bottom to top, and their colours (colour-blind safe, Okabe-Ito).
_STACK = (("driver", "#0072B2"), ("vmm", "#E69F00"), ("array", "#D55E00"), ("host_pinned", "#009E73"))
_MAPPED = "#CC79A7"
#: Opacity of the stacked areas (over white, or a phase band).
STACK_ALPHA = 0.85
_BAND = ("#f0f0f0", "#dcdcdc")
PANEL_HEIGHT_IN = 2.8
#: Characters per line of the answer above the panels (at 8 pt, the picture's width).
HEAD_WIDTH = 150
#: Inches per line of that text.
HEAD_LINE_IN = 0.17
_FAIL = "#D55E00"
#: NVML's used this far below what was traced (and at least 1 GiB) reads as its lag, with a note.
NVML_LAG_FRACTION = 0.5
WIDTH_IN = 12.0
DPI = 100
#: Columns a short step is drawn in per x range: half the picture's pixel columns, so a column
#: (1.8-2 px on a panel) always covers at least one whole pixel column, which the rasteriser fills.
COLUMNS = int(WIDTH_IN * DPI) // 2


@dataclass
class Panel:
    """What one panel shows: one GPU of one recording, with times shifted by ``offset`` ns, and
    the recording's answer (its failures and window)."""

    rec: Recording
    gpu: int
    offset: int  # ns subtracted from every timestamp (the recording's start, or a common marker)
    title: str
    answer: Answer | None = None


def _unit(top: float) -> tuple[str, int]:
    """The byte unit the y axis counts in: the largest one the highest value reaches."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if top >= 1 << shift:
            return unit, 1 << shift
    return "B", 1


def _human(n: int) -> str:
    unit, scale = _unit(n)
    return f"{n / scale:.4g} {unit}"


def _gpus(rec: Recording) -> list[int]:
    """GPUs with memory or NVML samples; the host (-1) only when it holds something."""
    gpus = {g for g in rec.timeline.gpus if g >= 0} | {int(g) for g in np.unique(rec.trace.nvml["gpu"])}
    host = rec.timeline.gpus.get(-1)
    if host is not None and host.total().any():
        gpus.add(-1)
    return sorted(gpus, key=lambda g: (g < 0, g))


def _title(rec: Recording, gpu: int, name: str) -> str:
    info = {g.index: g for g in rec.trace.gpus}
    text = "host (pinned memory) and unknown GPU" if gpu < 0 else f"GPU {gpu}"
    if gpu in info:
        text += f"  {info[gpu].name}"
    return f"{name}: {text}" if name else text


def plot(rec: Recording, out: Path, name: str = "", answer: Answer | None = None) -> int:
    """Draw ``rec`` to ``out`` (PNG, SVG or PDF by its suffix); return the number of panels.
    ``answer``: the recording's (:func:`memrec.analysis.report.build.trace_answer`, built when not given)."""
    answer = answer if answer is not None else trace_answer(rec.trace, phases=rec.phases)
    panels = [Panel(rec, g, rec.start, _title(rec, g, name), answer) for g in _gpus(rec)]
    head = [line.fit(HEAD_WIDTH) for line in answer.lines]
    return _draw(panels, out, "seconds since the recording started", head=head)


def plot_diff(a: Recording, b: Recording, out: Path, names: tuple[str, str]) -> tuple[int, str | None]:
    """Draw two recordings, GPU by GPU one above the other, aligned as ``tui --diff`` aligns them
    (:func:`memrec.analysis.diff.build.align_markers`), under ``memrec diff``'s verdict.

    Without a common marker both start at their recording's start. Returns the number of panels
    and the marker aligned on (None without one).
    """
    common = align_markers(a.trace.markers, b.trace.markers)
    offsets = (common[2], common[3]) if common else (a.start, b.start)
    verdict = verdict_of(diff_traces(a.trace, b.trace, *names))
    answers = (trace_answer(a.trace, phases=a.phases), trace_answer(b.trace, phases=b.phases))
    gpus = sorted(set(_gpus(a)) | set(_gpus(b)), key=lambda g: (g < 0, g))
    panels = []
    for g in gpus:
        for rec, off, name, ans in zip((a, b), offsets, names, answers):
            panels.append(Panel(rec, g, off, _title(rec, g, name), ans))
    marker = None if common is None else common[0] + ("" if common[1] == "instant" else f" {common[1]}")
    label = f"seconds since {marker!r}" if marker else "seconds since the recording started"
    head = _wrap(f"verdict: {verdict.headline}") + [x for line in verdict.lines[:2] for x in _wrap("  " + line)]
    return _draw(panels, out, label, same_scale=True, head=head), marker


def _wrap(text: str) -> list[str]:
    """``text`` in lines of :data:`HEAD_WIDTH` characters at most (at spaces)."""
    import textwrap

    return textwrap.wrap(text, HEAD_WIDTH, subsequent_indent="    ") or [""]


def _private_config_dir_if_needed() -> None:
    """Point MPLCONFIGDIR at a private temporary folder when matplotlib's own folders (under
    $XDG_CONFIG_HOME and $XDG_CACHE_HOME, else ~/.config and ~/.cache) cannot be written.

    matplotlib would make one itself, but with two warnings that are not the user's business (a
    service user, a read-only or missing HOME); its folders are used whenever they work.
    """
    if os.environ.get("MPLCONFIGDIR"):
        return
    try:
        home = Path.home()
    except (RuntimeError, KeyError):  # no HOME, and no password entry for this uid
        home = None
    for variable, default in (("XDG_CONFIG_HOME", ".config"), ("XDG_CACHE_HOME", ".cache")):
        base = os.environ.get(variable) or (home / default if home else None)
        if base is None:
            break
        folder = Path(base, "matplotlib")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            break
        if not (folder.is_dir() and os.access(folder, os.W_OK)):
            break
    else:
        return
    folder = tempfile.mkdtemp(prefix="memrec-matplotlib-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["MPLCONFIGDIR"] = folder


def _draw(panels: list[Panel], out: Path, xlabel: str, same_scale: bool = False, head: list[str] = ()) -> int:
    _private_config_dir_if_needed()
    matplotlib = require("matplotlib", "plot", "memrec plot")
    matplotlib.use("Agg")
    # An SVG keeps its words as text (searchable, and read back by tests), not as glyph outlines.
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter
    from matplotlib.ticker import MaxNLocator

    n = max(len(panels), 1)
    top_in = 0.6 + HEAD_LINE_IN * len(head)
    height = PANEL_HEIGHT_IN * n + top_in
    fig, axes = plt.subplots(n, 1, figsize=(WIDTH_IN, height), sharex=True, sharey=same_scale, squeeze=False)
    lo, hi = _x_range(panels)
    top_all = max((_top(p) for p in panels), default=0.0)
    # One y range for all with same_scale: the axes are shared, so each panel's own range would
    # set them all, and the last panel's (a host panel's few KiB) would cut the others off.
    ceiling_all = max((_ceiling(p) for p in panels), default=0.0)
    for ax, panel in zip(axes[:, 0], panels):
        unit, scale = _unit(top_all if same_scale else _top(panel))
        _panel(ax, panel, scale, (lo, hi))
        # Ticks at round numbers of the unit (10, 20 GiB), not of bytes (18.63 GiB).
        ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: f"{v:g} {u}"))
        ax.set_ylim(bottom=0, top=(ceiling_all if same_scale else _ceiling(panel)) / scale * 1.04 or None)
        ax.grid(axis="y", color="#e0e0e0", linewidth=0.6)
        ax.set_axisbelow(True)
    if not panels:
        axes[0, 0].text(0.5, 0.5, "no GPU memory in this recording", ha="center", va="center")
    axes[-1, 0].set_xlim(lo, hi)
    axes[-1, 0].set_xlabel(xlabel)
    handles, labels = {}, {}
    for ax in axes[:, 0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
            labels[lab] = lab
    for k, line in enumerate(head):  # the answer (or the verdict), as the report (or the diff) begins
        fig.text(0.01, 1 - (0.08 + HEAD_LINE_IN * k) / height, line, ha="left", va="top", fontsize=8,
                 family="monospace", color=_FAIL if k == 0 and line.startswith(("FAILED", "verdict")) and
                 "works" not in line.split(":")[1][:12] else "black")
    if handles:
        fig.legend(list(handles.values()), list(labels), loc="upper center", ncol=min(len(handles), 8),
                   frameon=False, fontsize=8, bbox_to_anchor=(0.5, 1 - (0.1 + HEAD_LINE_IN * len(head)) / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - (top_in - 0.25) / height))
    with io.BytesIO() as picture:  # drawn first: a drawing that fails leaves no empty file that -f must replace
        fig.savefig(picture, dpi=DPI, format=out.suffix[1:].lower())
        plt.close(fig)
        with create_output(out) as f:  # (never through a link planted at out)
            f.write(picture.getvalue())
    return len(panels)


def _top(p: Panel) -> float:
    """The highest value a panel draws (owned + mapped, NVML used/reserved)."""
    top = 0.0
    s = p.rec.timeline.gpus.get(p.gpu)
    if s is not None and len(s.ts):
        top = float((s.total() + s.series(categories=("ipc_mapped",))).max())
    nv = p.rec.trace.nvml
    nv = nv[nv["gpu"] == p.gpu]
    if len(nv):
        top = max(top, float(nv["used"].max()), float(nv["reserved"].max()))
    return top


def _ceiling(p: Panel) -> float:
    """What a panel's y axis must reach: its highest value, or the GPU's capacity line above it."""
    return max(_top(p), _capacity(p) or 0)


def _capacity(p: Panel) -> int | None:
    """The GPU's memory (the header's GPU list, else NVML's total), None unknown or the host."""
    if p.gpu < 0:
        return None
    info = {g.index: g for g in p.rec.trace.gpus}
    if p.gpu in info and info[p.gpu].total:
        return int(info[p.gpu].total)
    nv = p.rec.trace.nvml
    totals = nv["total"][(nv["gpu"] == p.gpu) & (nv["total"] > 0)] if len(nv) else []
    return int(totals.max()) if len(totals) else None


def _x_range(panels: list[Panel]) -> tuple[float, float]:
    """Seconds covering every memory change (process exits aside), phase and failure, with a 5% margin."""
    points: list[float] = []
    for p in panels:
        s = p.rec.timeline.gpus.get(p.gpu)
        if s is not None and len(s.ts) > 1:
            # Process exits free everything at teardown, often long after the story: left out.
            ev = p.rec.timeline.events
            idx = np.clip(s.event_index[1:], 0, max(len(ev) - 1, 0))
            keep = ev["kind"][idx] != int(Kind.PROC_EXIT) if len(ev) else np.zeros(0, bool)
            ts = s.ts[1:][keep]
            if len(ts):
                points += [(ts[0] - p.offset) / 1e9, (ts[-1] - p.offset) / 1e9]
        bands = _band_phases(p)
        for start, end in zip(bands.start, bands.end):
            points += [(start - p.offset) / 1e9, (end - p.offset) / 1e9]
        points += [(t - p.offset) / 1e9 for t, _ in _failures(p)]
        win = _window(p)
        if win is not None:
            points += [(win.start_ts - p.offset) / 1e9, (win.end_ts - p.offset) / 1e9]
    if not points:
        ends = [((p.rec.start - p.offset) / 1e9, (p.rec.end - p.offset) / 1e9) for p in panels] or [(0.0, 1.0)]
        points = [v for e in ends for v in e]
    lo, hi = min(points), max(points)
    pad = (hi - lo) * 0.05 if hi > lo else 1e-3
    return lo - pad, hi + pad


def _owner(p: Panel) -> int | None:
    """The process whose phases a panel shows: the one that held most on its GPU at the GPU's peak."""
    s = p.rec.timeline.gpus.get(p.gpu)
    with_phases = set(p.rec.phases.table.pid.tolist())
    if s is None or not with_phases:
        return None
    _, _, row = s.peak()
    owned = s.per_pid()
    held = {pid: b for pid, b in zip(owned.pids.tolist(), owned.at_row(row).tolist()) if pid in with_phases}
    if not held:
        return None
    return max(held, key=lambda pid: (held[pid], -pid))


#: Phases a panel names all of (past it, only the wide ones).
NAMED = 100


@dataclass
class Bands:
    """The phases a panel shades: its owner's outermost ones (:func:`_band_phases`), in order, as
    columns (a step loop's 25,000 phases made a :class:`~memrec.engine.phases.Phase` each)."""

    start: list[int]
    end: list[int]
    name: list[str]


def _band_phases(p: Panel) -> Bands:
    owner = _owner(p)
    t = p.rec.phases.table
    ids = [] if owner is None else np.flatnonzero((t.pid == owner) & (t.depth == 0)).tolist()
    return Bands(t.start[ids].tolist(), t.end[ids].tolist(), [t.name[i] for i in ids])


def _band_corners(x0: np.ndarray, width: np.ndarray) -> np.ndarray:
    """The corners of bands from ``x0`` to ``x0 + width`` and the axes' bottom to top, as
    ``Axes.broken_barh`` makes them (the same floats), without its Python step and unit
    conversion per band: 25,000 bands a panel took 0.65 s there."""
    corners = np.empty((len(x0), 4, 2))
    corners[:, :2, 0] = x0[:, None]
    corners[:, 2:, 0] = (x0 + width)[:, None]
    corners[:, :, 1] = (0.0, 1.0, 1.0, 0.0)
    return corners


def _band_strip(x0: np.ndarray, width: np.ndarray, view: tuple[float, float], columns: int) -> np.ndarray:
    """The bands from ``x0`` to ``x0 + width`` (every other one in each of the two colours) as one
    row of RGBA pixels over ``view``: each column's colour is what the two colours' collections
    drawn at a resolution without limit (the second over the first) average to over it.

    Exact for any bands, overlapping ones too: a column shows the second colour over the length
    the union of its bands covers there, the first over what the union of all bands adds to it."""
    from matplotlib.colors import to_rgb  # matplotlib is loaded by then (_draw)

    edges = np.linspace(view[0], view[1], columns + 1)
    end = x0 + width
    second = _covered(*_union(x0[1::2], end[1::2]), edges)
    every = _covered(*_union(x0, end), edges)
    rgba = np.zeros((1, columns, 4))
    over = np.maximum(every, np.finfo(float).tiny)
    rgba[0, :, :3] = (np.outer(every - second, to_rgb(_BAND[0])) + np.outer(second, to_rgb(_BAND[1]))) / over[:, None]
    rgba[0, :, 3] = every
    return np.clip(rgba, 0.0, 1.0)


def _union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The intervals from ``start`` to ``end`` merged where they overlap: sorted, disjoint."""
    if not len(start):
        return start, end
    order = np.argsort(start, kind="stable")
    start, reach = start[order], np.maximum.accumulate(end[order])
    first = np.flatnonzero(np.concatenate(([True], start[1:] > reach[:-1])))
    return start[first], reach[np.concatenate((first[1:] - 1, [len(start) - 1]))]


def _covered(start: np.ndarray, end: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Each column's share (between consecutive ``edges``) that the disjoint sorted intervals cover."""
    def to(points: np.ndarray) -> np.ndarray:  # for each edge, the sum of (edge - p) over the points before it
        before = np.searchsorted(points, edges, side="right")
        return before * edges - np.concatenate(([0.0], np.cumsum(points)))[before]

    return np.clip(np.diff(to(start) - to(end)) / np.diff(edges), 0.0, 1.0)


def _failures(p: Panel) -> list[tuple[int, str]]:
    """(ts, what) of the answer's failures on the panel's GPU (or of no known GPU, on GPU 0's
    panel or the host's): a driver call by its result and size, SGLang's KV sizing, a marker's error."""
    if p.answer is None:
        return []
    first = min((g for g in _gpus(p.rec)), default=p.gpu)
    out = []
    for f in p.answer.failures:
        if f.gpu == p.gpu or (f.gpu is None and p.gpu == first):
            what = f.what.split(": ", 1)[1] if f.kind in (DRIVER_OOM, DRIVER_CALL) else f.what
            out.append((f.ts, f"{what} · {f.who}"))
    return out


def _window(p: Panel) -> Window | None:
    """The answer's window when it concerns this panel's GPU (or every GPU)."""
    win = p.answer.window if p.answer is not None else None
    return win if win is not None and win.gpu in (None, p.gpu) else None


def _steps(s: GpuSeries, values: np.ndarray, p: Panel, scale: int,
           view: tuple[float, float] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (seconds) and the highest and lowest y (in units of ``scale``) of a step function holding
    each value to the next change, and the last one to the recording's end.

    With ``view`` (the x range drawn), when a step is shorter than a column (:data:`COLUMNS` per
    view, about 2 px) the function is drawn per column: its max and min within the column, held
    across it. An area filled only to the exact steps covers a fraction of a pixel there and the
    rasteriser leaves it out (a 6 µs allocation in a 20 s run), so the peak the picture is made to
    show would be missing.
    """
    x = np.append((s.ts - p.offset) / 1e9, (p.rec.end - p.offset) / 1e9)
    y = np.append(values, values[-1]) / scale
    if view is None or len(x) < 3:
        return x, y, y
    lo, hi = view
    width = (hi - lo) / COLUMNS
    inside = (x[:-1] < hi) & (x[1:] > lo)
    if not inside.any() or np.diff(x)[inside].min() >= width:
        return x, y, y
    edges = lo + width * np.arange(COLUMNS + 1)
    return edges, *_envelope(x, y, edges)


def _envelope(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per bin of ``edges``, the max and min of the step function ``y`` (held from ``x[i]`` to
    ``x[i + 1]``; nothing before ``x[0]`` or after ``x[-1]``), NaN where it is not defined; each
    repeated at the end, for ``step="post"``."""
    held = np.searchsorted(x, edges[:-1], side="right") - 1  # the step in force at each bin's start
    start = np.where((held >= 0) & (held < len(x) - 1), y[np.clip(held, 0, len(y) - 1)], np.nan)
    high, low = start.copy(), start.copy()
    within = (x[:-1] >= edges[0]) & (x[:-1] < edges[-1])  # steps that begin inside a bin
    if within.any():
        bins = np.searchsorted(edges, x[:-1][within], side="right") - 1
        values = y[:-1][within]
        first = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
        hit = bins[first]
        high[hit] = np.fmax(high[hit], np.maximum.reduceat(values, first))
        low[hit] = np.fmin(low[hit], np.minimum.reduceat(values, first))
    return np.append(high, high[-1]), np.append(low, low[-1])


def _panel(ax, p: Panel, scale: int, view: tuple[float, float]) -> None:
    from matplotlib.collections import PolyCollection  # matplotlib is loaded by then (_draw)
    from matplotlib.image import AxesImage

    ax.set_title(p.title, loc="left", fontsize=10)
    s = p.rec.timeline.gpus.get(p.gpu)
    if s is not None and len(s.ts):
        cats = s.by_category()
        base = np.zeros(len(s.ts), dtype=np.int64)
        for cat, colour in _STACK:
            if cat not in cats or not cats[cat].any():
                continue
            # Each layer is filled up to its top's per-column max (every peak shows), from the max of
            # the layer under it: the tops only grow layer by layer, so the layers never overlap.
            x, lower, _ = _steps(s, base, p, scale, view)
            top = base + cats[cat]
            _, upper, _ = _steps(s, top, p, scale, view)
            ax.fill_between(x, lower, upper, step="post", color=colour, alpha=STACK_ALPHA, linewidth=0, label=cat)
            base = top
        if "ipc_mapped" in cats and cats["ipc_mapped"].any():
            x, high, low = _steps(s, base + cats["ipc_mapped"], p, scale, view)
            style = {"color": _MAPPED, "linestyle": ":", "linewidth": 1.6}
            ax.step(x, high, where="post", label="+ ipc_mapped (peers', not owned)", **style)
            if low is not high:  # a line: the per-column min too, so brief dips show as well
                ax.step(x, low, where="post", **style)
    nv = p.rec.trace.nvml
    nv = nv[nv["gpu"] == p.gpu]
    nv = nv[np.argsort(nv["ts"], kind="stable")]
    for field, style in (("used", "-"), ("reserved", "--")):
        ok = nv[field] >= 0
        if ok.any():
            ax.step((nv["ts"][ok] - p.offset) / 1e9, nv[field][ok] / scale, where="post", color="black",
                    linestyle=style, linewidth=1.0, label=f"NVML {field}")
    bands = _band_phases(p)
    # One collection per colour, not a patch per phase; past NAMED phases only those wider than
    # 1/NAMED of the view are named: 3,000 phases a panel took minutes to draw, unreadable anyway.
    wide = (view[1] - view[0]) / NAMED if len(bands.name) > NAMED else 0.0
    x0 = (np.asarray(bands.start, dtype=np.int64) - p.offset) / 1e9
    width = (np.asarray(bands.end, dtype=np.int64) - p.offset) / 1e9 - x0
    for k in np.flatnonzero(~(width < wide)).tolist():
        # Names alternate between two heights: short phases side by side stay readable.
        ax.text(x0[k].item(), 0.98 if k % 2 == 0 else 0.55, f" {bands.name[k]}", transform=ax.get_xaxis_transform(),
                rotation=90, va="top", ha="left", fontsize=7, color="#303030", clip_on=True,
                bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 0.6})
    # Past NAMED phases the bands are one image a pixel column of the picture each, not a path
    # each: 25,000 of them were most of what 50,000 markers cost the plot (Agg drew every band the
    # panel's height, in a vector file too, rasterized), for bands narrower than a pixel.
    if len(bands.name) > NAMED:
        strip = AxesImage(ax, interpolation="antialiased", extent=(view[0], view[1], 0, 1), zorder=-2,
                          transform=ax.get_xaxis_transform())
        strip.set_data(_band_strip(x0, width, view, int(WIDTH_IN * DPI)))
        ax.add_image(strip)
    else:
        for k in (0, 1):  # every other band in a colour
            if len(x0[k::2]):
                ax.add_collection(PolyCollection(_band_corners(x0[k::2], width[k::2]), color=_BAND[k], zorder=-2,
                                                 linewidth=0, transform=ax.get_xaxis_transform()))
    win = _window(p)
    if win is not None:
        ax.axvspan((win.start_ts - p.offset) / 1e9, (win.end_ts - p.offset) / 1e9, facecolor="none", hatch="////",
                   edgecolor=_FAIL if p.answer.failure is not None else "#808080", linewidth=0, alpha=0.35,
                   zorder=-1, label="the answer's window")
    cap = _capacity(p)
    if cap:
        ax.axhline(cap / scale, color="#808080", linestyle="-.", linewidth=0.9, label="capacity")
        ax.annotate(f"capacity {human(cap)}", (1.0, cap / scale), xycoords=("axes fraction", "data"),
                    xytext=(-2, 2), textcoords="offset points", ha="right", va="bottom", fontsize=7, color="#606060")
    lag = _nvml_lag(p, s)
    if lag:
        ax.text(0.01, 0.04, lag, transform=ax.transAxes, fontsize=7, color="#606060", ha="left", va="bottom",
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 0.8})
    for ts, text in _failures(p):
        x = (ts - p.offset) / 1e9
        y = (s.at(ts) if s is not None else 0) / scale
        ax.plot([x], [y], marker="X", color=_FAIL, markersize=9, linestyle="none", label="failure")
        ax.annotate(text, (x, y), xytext=(4, 6), textcoords="offset points", fontsize=7, color=_FAIL)


def _nvml_lag(p: Panel, s: GpuSeries | None) -> str:
    """A note where NVML's used reads far below what was traced at the same time (its samples
    lag the driver calls), else ``""``."""
    nv = p.rec.trace.nvml
    nv = nv[(nv["gpu"] == p.gpu) & (nv["used"] >= 0)] if len(nv) else nv
    if s is None or not len(nv) or not len(s.ts):
        return ""
    traced = np.array([s.at(int(t)) for t in nv["ts"].tolist()])
    low = (nv["used"] < traced * NVML_LAG_FRACTION) & (traced >= 1 << 30)
    if not low.any():
        return ""
    return (f"NVML used reads below the traced bytes at {int(low.sum())} of {len(nv)} samples: "
            "NVML samples lag the driver calls (and miss what is freed between two)")
