"""A picture of a recording for a bug report: one panel per GPU (matplotlib, Agg: no display needed).

Each panel stacks the owned bytes by category (driver allocations, VMM physical; pinned host memory
on the host panel) as step areas, draws the bytes mapped from peers by IPC as a dotted line above
them (mapped, not owned), NVML's ``used`` and ``reserved`` as lines, the phases of the process that
held most on that GPU as shaded bands with their names, and every failed call as a red cross with
its result. Times are seconds since the recording started, or, with a second recording
(:func:`plot_diff`), since the first marker name both recordings share, so the two line up.

Where a step is shorter than a column of about 2 px, each column is drawn to the highest value in
it (:func:`_steps`): a peak of microseconds in a run of seconds shows.

The x range is fitted to where something happened (memory changed, a phase, a failure; the frees
of a process exit aside, which come at teardown), with a margin: a 20 s recording whose startup
took 50 ms shows those 50 ms, not a vertical line.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memrec._files import create_file
from memrec.analysis.names import result_name
from memrec.engine.phases import Phase
from memrec.engine.series import GpuSeries
from memrec.api import Recording
from memrec.columns import failed_calls
from memrec.events import Kind
from memrec.export import require

#: Owned categories, bottom to top, and their colours (colour-blind safe, Okabe-Ito).
_STACK = (("driver", "#0072B2"), ("vmm", "#E69F00"), ("host_pinned", "#009E73"))
_MAPPED = "#CC79A7"
#: Opacity of the stacked areas (over white, or a phase band).
STACK_ALPHA = 0.85
_BAND = ("#f0f0f0", "#dcdcdc")
PANEL_HEIGHT_IN = 2.8
WIDTH_IN = 12.0
DPI = 100
#: Columns a short step is drawn in per x range: half the picture's pixel columns, so a column
#: (1.8-2 px on a panel) always covers at least one whole pixel column, which the rasteriser fills.
COLUMNS = int(WIDTH_IN * DPI) // 2


@dataclass
class Panel:
    """What one panel shows: one GPU of one recording, with times shifted by ``offset`` ns."""

    rec: Recording
    gpu: int
    offset: int  # ns subtracted from every timestamp (the recording's start, or a common marker)
    title: str


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


def plot(rec: Recording, out: Path, name: str = "") -> int:
    """Draw ``rec`` to ``out`` (PNG, SVG or PDF by its suffix); return the number of panels."""
    panels = [Panel(rec, g, rec.start, _title(rec, g, name)) for g in _gpus(rec)]
    return _draw(panels, out, "seconds since the recording started")


def common_marker(a: Recording, b: Recording) -> tuple[str, int, int] | None:
    """The first marker name (in ``a``'s time order) that ``b`` also has: (name, ts in a, ts in b)."""
    first_b: dict[str, int] = {}
    for m in sorted(b.trace.markers, key=lambda m: m.ts):
        first_b.setdefault(m.name, m.ts)
    for m in sorted(a.trace.markers, key=lambda m: m.ts):
        if m.name in first_b:
            return m.name, m.ts, first_b[m.name]
    return None


def plot_diff(a: Recording, b: Recording, out: Path, names: tuple[str, str]) -> tuple[int, str | None]:
    """Draw two recordings, GPU by GPU one above the other, aligned on their first common marker.

    Without a common marker both start at their recording's start. Returns the number of panels
    and the marker aligned on (None without one).
    """
    common = common_marker(a, b)
    offsets = (common[1], common[2]) if common else (a.start, b.start)
    gpus = sorted(set(_gpus(a)) | set(_gpus(b)), key=lambda g: (g < 0, g))
    panels = []
    for g in gpus:
        for rec, off, name in ((a, offsets[0], names[0]), (b, offsets[1], names[1])):
            panels.append(Panel(rec, g, off, _title(rec, g, name)))
    label = f"seconds since {common[0]!r}" if common else "seconds since the recording started"
    return _draw(panels, out, label, same_scale=True), common[0] if common else None


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


def _draw(panels: list[Panel], out: Path, xlabel: str, same_scale: bool = False) -> int:
    _private_config_dir_if_needed()
    matplotlib = require("matplotlib", "plot", "memrec plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter
    from matplotlib.ticker import MaxNLocator

    n = max(len(panels), 1)
    fig, axes = plt.subplots(n, 1, figsize=(WIDTH_IN, PANEL_HEIGHT_IN * n + 0.6), sharex=True, sharey=same_scale,
                             squeeze=False)
    lo, hi = _x_range(panels)
    top_all = max((_top(p) for p in panels), default=0.0)
    for ax, panel in zip(axes[:, 0], panels):
        unit, scale = _unit(top_all if same_scale else _top(panel))
        _panel(ax, panel, scale, (lo, hi))
        # Ticks at round numbers of the unit (10, 20 GiB), not of bytes (18.63 GiB).
        ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: f"{v:g} {u}"))
        ax.set_ylim(bottom=0)
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
    if handles:
        fig.legend(list(handles.values()), list(labels), loc="upper center", ncol=min(len(handles), 7),
                   frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (PANEL_HEIGHT_IN * n + 0.6)))
    with create_file(out) as f:  # (never through a link planted at out)
        fig.savefig(f, dpi=DPI, format=out.suffix[1:].lower())
    plt.close(fig)
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
        for ph in _band_phases(p):
            points += [(ph.start - p.offset) / 1e9, (ph.end - p.offset) / 1e9]
        points += [(t - p.offset) / 1e9 for t, _ in _failures(p)]
    if not points:
        ends = [((p.rec.start - p.offset) / 1e9, (p.rec.end - p.offset) / 1e9) for p in panels] or [(0.0, 1.0)]
        points = [v for e in ends for v in e]
    lo, hi = min(points), max(points)
    pad = (hi - lo) * 0.05 if hi > lo else 1e-3
    return lo - pad, hi + pad


def _owner(p: Panel) -> int | None:
    """The process whose phases a panel shows: the one that held most on its GPU at the GPU's peak."""
    s = p.rec.timeline.gpus.get(p.gpu)
    with_phases = {ph.pid for ph in p.rec.phases.phases}
    if s is None or not with_phases:
        return None
    _, _, row = s.peak()
    held = {pid: int(s.total(pid)[row]) for pid in s.pids() if pid in with_phases}
    if not held:
        return None
    return max(held, key=lambda pid: (held[pid], -pid))


def _band_phases(p: Panel) -> list[Phase]:
    owner = _owner(p)
    return [ph for ph in p.rec.phases.phases if ph.pid == owner and ph.depth == 0]


def _failures(p: Panel) -> list[tuple[int, str]]:
    ev = p.rec.timeline.events
    if not len(ev):
        return []
    idx = np.nonzero(failed_calls(ev) & (ev["gpu"] == p.gpu))[0]
    return [(int(ev["ts"][i]), f"{result_name(int(ev['result'][i]))} {_human(int(ev['size'][i]))}") for i in idx]


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
    for k, ph in enumerate(_band_phases(p)):
        x0, x1 = (ph.start - p.offset) / 1e9, (ph.end - p.offset) / 1e9
        ax.axvspan(x0, x1, color=_BAND[k % 2], zorder=-2, linewidth=0)
        # Names alternate between two heights: short phases side by side stay readable.
        ax.text(x0, 0.98 if k % 2 == 0 else 0.55, f" {ph.name}", transform=ax.get_xaxis_transform(), rotation=90,
                va="top", ha="left", fontsize=7, color="#303030", clip_on=True,
                bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 0.6})
    for ts, text in _failures(p):
        x = (ts - p.offset) / 1e9
        y = (s.at(ts) if s is not None else 0) / scale
        ax.plot([x], [y], marker="X", color="#D55E00", markersize=9, linestyle="none", label="failed call")
        ax.annotate(text, (x, y), xytext=(4, 6), textcoords="offset points", fontsize=7, color="#D55E00")
