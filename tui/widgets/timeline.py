"""The timeline graph: memory over time stacked by category, NVML used as a line, phase bands,
failed driver calls, a time axis and the cursor.

:func:`render_timeline` is pure (a :class:`~memrec.tui.views.SeriesView` in, Rich strips out) so
tests check it without an app; :class:`TimelineGraph` only hands it the current view and serves
its lines from ``render_line``.

Cells use eighth blocks: a cell where a layer ends draws ``▁..▇`` in the lower layer's colour on
the upper layer's colour, so a 10-row chart resolves 80 levels. Without colour (``NO_COLOR``)
each layer gets its own shading character instead (█ ▓ ▒ ░ :). The Linux console
(``TERM=linux``) has a font of 256 or 512 glyphs without eighth blocks, ``✗``, ``•``, ``┃`` or
``…``: :data:`CONSOLE_GLYPHS` draws with half blocks and ASCII there (:func:`glyphs_for`).

The colours are 256-colour palette entries chosen so that in a 16-colour terminal (the Linux
console, ``TERM=xterm``) every layer still gets an ANSI colour of its own (tests check the
downgrade).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from dataclasses import field

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.geometry import Size
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

from memrec.terms.events import ARRAY
from memrec.terms.events import DRIVER
from memrec.terms.events import HOST_PINNED
from memrec.terms.events import IPC_MAPPED
from memrec.terms.events import VMM
from memrec.tui.views import PhaseSpan
from memrec.tui.views import SeriesView
from memrec.terms.units import fmt_bytes
from memrec.terms.units import fmt_at

#: Layers bottom to top: (name, colour (a 256-colour palette entry), no-colour character). In 16
#: colours: bright blue, bright green, yellow, magenta, bright black, cyan.
LAYERS = (
    ("driver", "#5f87ff", "█"),
    ("vmm", "#5fd787", "▓"),
    ("array", "#d7af00", "▚"),
    ("host_pinned", "#af00d7", "▒"),
    ("untraced", "#6c6c6c", "░"),
    ("ipc_mapped", "#00afaf", ":"),
)
LAYER_COLOURS = {name: colour for name, colour, _ in LAYERS}
NVML_COLOUR = "#ffd75f"
FAIL_COLOUR = "#ff5f5f"
OTHER_COLOUR = "#ff87ff"
CURSOR_BG = "#d0d0d0"
BAND_COLOURS = ("#5f5f87", "#5f875f", "#875f5f", "#5f8787", "#875f87", "#87875f", "#444444", "#585858")
#: Columns left of the chart: the value axis ("140.00 GiB┤") and the phase bands' rank labels.
GUTTER = 11


@dataclass(frozen=True)
class Glyphs:
    """The characters the timeline and the panels draw with (see the module docstring)."""

    eighths: str = " ▁▂▃▄▅▆▇█"  # a cell filled 0/8 .. 8/8 from below
    fail: str = "✗"
    other: str = "•"  # diff mode: the other run's traced total
    above: str = "↑"  # NVML used above the chart
    instant: str = "┃"  # an instant marker in a phase band
    more: str = "…"  # a name cut short
    live: str = "●"
    stale: str = "⚠"


UNICODE_GLYPHS = Glyphs()
#: Only what the Linux console's fonts have (CP437's blocks and box drawing, ASCII): a half block
#: stands for 3/8 to 5/8, a full block from 6/8.
CONSOLE_GLYPHS = Glyphs(eighths="   ▄▄▄███", fail="x", other="*", above="^", instant="|", more="~", live="*", stale="!")


def glyphs_for(term: str | None) -> Glyphs:
    """The glyphs for a terminal type (``$TERM``): the console's own for ``linux``."""
    return CONSOLE_GLYPHS if (term or "").split("-")[0] == "linux" else UNICODE_GLYPHS


def band_colour(name: str) -> str:
    h = 0
    for ch in name:
        h = (h * 31 + ord(ch)) & 0xFFFF
    return BAND_COLOURS[h % len(BAND_COLOURS)]


def layer_values(view: SeriesView) -> np.ndarray:
    """(6, width) bytes per drawn layer (see :data:`LAYERS`)."""
    c = view.cats
    return np.stack([c[DRIVER], c[VMM], c[ARRAY], c[HOST_PINNED], view.untraced, c[IPC_MAPPED]])


@dataclass
class TimelineOptions:
    height: int
    scale: int  # bytes at the top of the chart
    cursor_ts: int | None = None
    origin_ts: int = 0  # what the axis counts from
    bands: list[tuple[str, list[PhaseSpan]]] | None = None
    max_bands: int = 2
    failures: np.ndarray | None = None  # timestamps
    color: bool = True
    axis: bool = True
    event_row: bool = True
    glyphs: Glyphs = field(default_factory=Glyphs)


def render_timeline(view: SeriesView, opt: TimelineOptions) -> list[Strip]:
    """Render ``view`` into ``opt.height`` strips of ``GUTTER + view.width`` cells."""
    w = view.width
    bands = (opt.bands or [])[: opt.max_bands]
    fixed = (1 if opt.axis else 0) + (1 if opt.event_row else 0) + len(bands)
    if opt.height - fixed < 2:
        bands = bands[: max(0, opt.height - 2 - (1 if opt.axis else 0) - (1 if opt.event_row else 0))]
        fixed = (1 if opt.axis else 0) + (1 if opt.event_row else 0) + len(bands)
    chart_h = max(opt.height - fixed, 1)
    span = (view.t1 - view.t0) / w
    cursor_col = None
    if opt.cursor_ts is not None and view.t0 <= opt.cursor_ts < view.t1 + span:
        cursor_col = min(int((opt.cursor_ts - view.t0) / span), w - 1)
    scale = max(int(opt.scale), 1)
    layers = layer_values(view).astype(np.float64) * (chart_h / scale)
    tops = np.cumsum(layers, axis=0)  # (6, w) in rows
    nvml = np.where(view.nvml_used >= 0, view.nvml_used * (chart_h / scale), -1.0)
    other = view.other_total * (chart_h / scale) if view.other_total is not None else None
    styles = [Style(color=c) for _, c, _ in LAYERS]
    # plain Python lists: numpy calls per cell would let a busy worker thread take the GIL each time
    cols = tops.T.tolist()
    nvml = nvml.tolist()
    other = other.tolist() if other is not None else None
    has_data = view.has_data.tolist()
    coarse = view.coarse.tolist()
    base = Style()
    dim = Style(dim=True)
    strips: list[Strip] = []
    g = opt.glyphs
    for row in range(chart_h):
        r = chart_h - 1 - row  # 0 = bottom row
        segs: list[Segment] = []
        if row == 0:
            label = fmt_bytes(scale)
        elif row == chart_h - 1:
            label = fmt_bytes(0)
        elif row == chart_h // 2 and chart_h >= 5:
            label = fmt_bytes(scale // 2)
        else:
            label = ""
        segs.append(Segment(label.rjust(GUTTER - 1)[: GUTTER - 1] + ("┤" if label else "│"), dim))
        for k in range(w):
            ch, st = _cell(cols[k], r, opt.color, styles, g.eighths)
            if nvml[k] >= 0 and int(nvml[k]) == r and nvml[k] < chart_h:
                ch = "─" if opt.color else "-"
                st = (st or base) + Style(color=NVML_COLOUR, bold=True)
            elif nvml[k] >= chart_h and r == chart_h - 1:
                ch, st = g.above, Style(color=NVML_COLOUR, bold=True)
            if other is not None and int(other[k]) == r and other[k] < chart_h:
                ch = g.other
                st = (st or base) + Style(color=OTHER_COLOUR, bold=True)
            if not has_data[k]:
                ch, st = " ", base
            elif coarse[k] and st is not None:
                st = st + dim
            if k == cursor_col:
                st = (st or base) + Style(bgcolor=CURSOR_BG) if opt.color else (st or base) + Style(reverse=True)
                if ch == " ":
                    ch = "│" if not opt.color else " "
            segs.append(Segment(ch, st or base))
        strips.append(Strip(segs))
    if opt.event_row:
        segs = [Segment(" " * (GUTTER - 1) + "│", dim)]
        cols = np.zeros(w, dtype=bool)
        if opt.failures is not None and len(opt.failures):
            idx = ((opt.failures.astype(np.float64) - view.t0) / span).astype(np.int64)
            idx = idx[(idx >= 0) & (idx < w)]
            cols[idx] = True
        for k in range(w):
            st = Style(color=FAIL_COLOUR, bold=True) if cols[k] else base
            ch = g.fail if cols[k] else " "
            if k == cursor_col:
                st = st + (Style(bgcolor=CURSOR_BG) if opt.color else Style(reverse=True))
            segs.append(Segment(ch, st or base))
        strips.append(Strip(segs))
    for label, spans in bands:
        strips.append(_band_row(view, label, spans, cursor_col, opt.color, g))
    if opt.axis:
        strips.append(_axis_row(view, opt.origin_ts, cursor_col))
    return strips


def _cell(top: list[float], r: int, color: bool, styles: list[Style], eighths: str) -> tuple[str, Style | None]:
    """Character and style of the cell spanning rows [r, r+1) given the layers' tops."""
    if not color:
        mid = r + 0.5
        for j in range(len(top)):
            if mid < top[j]:
                return LAYERS[j][2], None
        return " ", None
    # layer covering the bottom of the cell
    j_bot = bisect.bisect_right(top, r)
    if j_bot >= len(top):
        return " ", None
    j_top = bisect.bisect_right(top, r + 1 - 1e-9)
    if j_top == j_bot:
        return "█", styles[j_bot]
    f = top[j_bot] - r  # fraction of the cell the bottom layer fills
    eighth = int(round(f * 8))
    upper = styles[j_top].color if j_top < len(top) else None
    if eighth <= 0:
        return ("█", styles[j_top]) if j_top < len(top) else (" ", None)
    if eighth >= 8:
        return "█", styles[j_bot]
    ch = eighths[eighth]
    if ch == " ":  # too little of the lower layer for this terminal's glyphs: the upper one fills the cell
        return ("█", styles[j_top]) if j_top < len(top) else (" ", None)
    if ch == "█":
        return "█", styles[j_bot]
    return ch, Style(color=styles[j_bot].color, bgcolor=upper)


def _band_row(view: SeriesView, label: str, spans: list[PhaseSpan], cursor_col: int | None, color: bool,
              g: Glyphs) -> Strip:
    w = view.width
    span = (view.t1 - view.t0) / w
    names = [""] * w
    starts = [False] * w
    for s in spans:
        a = int(np.floor((s.begin - view.t0) / span))
        if s.end == s.begin:
            if 0 <= a < w:
                names[a] = names[a] or "┃" + s.name
                starts[a] = True
            continue
        end = view.t1 + span if s.end >= 2**62 else s.end
        b = int(np.ceil((end - view.t0) / span))
        a2, b2 = max(a, 0), min(b, w)
        for k in range(a2, b2):
            names[k] = s.name  # later (inner) spans win
        if 0 <= a < w:
            starts[a] = True
    chars: list[str] = []
    styles: list[Style] = []
    full: tuple[int, int, str, Style] | None = None  # the cursor's phase, when its name was cut
    k = 0
    while k < w:
        name = names[k]
        j = k + 1
        while j < w and names[j] == name and not starts[j]:
            j += 1
        text = name.lstrip("┃")
        if name.startswith("┃"):
            cell = (g.instant + " " * (j - k))[: j - k]
        else:
            room = j - k - (1 if j < w and names[j] and j - k > 2 else 0)  # a gap before the next name
            cell = text if len(text) <= room else text[: room - 1] + g.more if room >= 2 else text[:room]
            cell = cell.ljust(j - k) if text else " " * (j - k)
        if text and color:
            st = Style(color="#ffffff", bgcolor=band_colour(text))
        elif text:
            st = Style(reverse=True)
        else:
            st = Style()
        if text and cursor_col is not None and k <= cursor_col < j and not cell.startswith(text):
            full = (k, j, text, st)
        chars.extend(cell)
        styles.extend([st] * len(cell))
        k = j
    if full is not None:
        # A phase too short for its name at this zoom: with the cursor in it, its whole name is
        # written over its neighbours (the cursor is where the user looks), kept on screen.
        k, j, text, st = full
        start = max(0, min(k, w - len(text)))
        end = start + len(text[:w])
        chars[start:end], styles[start:end] = list(text[:w]), [st] * (end - start)
        if start > 0 and chars[start - 1] not in (" ", g.instant):
            chars[start - 1] = " "  # a neighbour's last letter before it would read as this name's first
        c = end  # what is left of a neighbour's name after it would read as part of this one
        while c < w and c > 0 and names[c] == names[end] and not starts[c] and names[c]:
            chars[c] = " "
            c += 1
    segs = [Segment(label[: GUTTER - 1].ljust(GUTTER - 1) + "│", Style(dim=True))]
    for col, (ch, st) in enumerate(zip(chars, styles)):
        if col == cursor_col:
            st = st + Style(bgcolor=CURSOR_BG) if color else st + Style(reverse=True)
        segs.append(Segment(ch, st))
    return Strip(segs)


def _axis_row(view: SeriesView, origin: int, cursor_col: int | None) -> Strip:
    w = view.width
    span_ns = view.t1 - view.t0
    cells = [" "] * w
    step = 12
    k = 0
    while k < w - 4:
        t = view.t0 + span_ns * k / w
        text = "└" + (fmt_at(t - origin, span_ns * step / max(w, 1)) if t - origin else "0s")
        if k + len(text) <= w:
            for i, ch in enumerate(text):
                cells[k + i] = ch
        k += max(step, len(text) + 2)
    segs = [Segment(" " * GUTTER, Style())]
    for k, ch in enumerate(cells):
        segs.append(Segment(ch, Style(dim=True) if k != cursor_col else Style(reverse=True)))
    return Strip(segs)


class TimelineGraph(Widget, can_focus=True):
    """Draws one GPU's timeline; the app gives it views with :meth:`show`."""

    @dataclass
    class Clicked(Message):
        """The user clicked (or dragged) in the chart at time ``ts``."""

        graph: TimelineGraph
        ts: int

    @dataclass
    class Scrolled(Message):
        """Mouse wheel over the chart: zoom in (``direction`` < 0) or out around ``ts``."""

        graph: TimelineGraph
        ts: int
        direction: int

    def __init__(self, gpu: int = 0, *, compact: bool = False, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.gpu = gpu
        self.compact = compact
        self._strips: list[Strip] = []
        self._view: SeriesView | None = None
        self._producer = None

    def set_producer(self, producer) -> None:
        """``producer(width, height) -> (SeriesView, TimelineOptions)`` called on every redraw."""
        self._producer = producer
        self.redraw()

    def redraw(self) -> None:
        width = self.size.width - GUTTER
        height = self.size.height
        if self._producer is None or width < 4 or height < 1:
            self._strips = []
        else:
            view, opt = self._producer(width, height)
            opt.color = not getattr(self.app, "no_color", False)
            self._view = view
            self._strips = render_timeline(view, opt)
        self.refresh()

    def on_resize(self, event: events.Resize) -> None:
        self.redraw()

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return 4 if self.compact else 10

    def render_line(self, y: int) -> Strip:
        if y < len(self._strips):
            return self._strips[y].crop_extend(0, self.size.width, self.rich_style)
        return Strip.blank(self.size.width, self.rich_style)

    def ts_at(self, x: int) -> int | None:
        v = self._view
        if v is None or x < GUTTER:
            return None
        k = min(x - GUTTER, v.width - 1)
        return int(v.t0 + (v.t1 - v.t0) * (k + 0.5) / v.width)

    def on_click(self, event: events.Click) -> None:
        ts = self.ts_at(event.x)
        if ts is not None:
            self.post_message(self.Clicked(self, ts))

    def on_mouse_move(self, event: events.MouseMove) -> None:
        if event.button == 1:
            ts = self.ts_at(event.x)
            if ts is not None:
                self.post_message(self.Clicked(self, ts))

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        ts = self.ts_at(event.x)
        if ts is not None:
            event.stop()
            self.post_message(self.Scrolled(self, ts, -1))

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        ts = self.ts_at(event.x)
        if ts is not None:
            event.stop()
            self.post_message(self.Scrolled(self, ts, 1))
