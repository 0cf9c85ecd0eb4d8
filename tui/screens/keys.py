"""The keys: the main screen's bindings and what the help screen (and docs/tui.md) say about them,
side by side so that one is never changed without the other."""

from __future__ import annotations

from textual.binding import Binding

BINDINGS: list[Binding] = [
    Binding("question_mark", "help", "help"),
    Binding("q", "app.quit", "quit"),
    Binding("left", "move(-1)", "cursor", key_display="←→"),
    Binding("right", "move(1)", "cursor", show=False),
    Binding("shift+left", "move(-10)", show=False),
    Binding("shift+right", "move(10)", show=False),
    Binding("home", "jump_edge(0)", show=False),
    Binding("end", "jump_edge(1)", show=False),
    Binding("plus,equals_sign", "zoom(0.5)", "zoom", key_display="+-"),
    Binding("minus", "zoom(2)", show=False),
    Binding("f", "fit", "fit", show=False),
    Binding("comma", "pan(-0.5)", show=False),
    Binding("full_stop", "pan(0.5)", show=False),
    Binding("m", "jump('marker', 1)", "marker", key_display="mM"),
    Binding("M", "jump('marker', -1)", show=False),
    Binding("p", "jump('phase', 1)", "phase", key_display="pP"),
    Binding("P", "jump('phase', -1)", show=False),
    Binding("o", "jump('failure', 1)", "failure", key_display="oO"),
    Binding("O", "jump('failure', -1)", show=False),
    Binding("b", "jump('big', 1)", "big", key_display="bB"),
    Binding("B", "jump('big', -1)", show=False),
    Binding("h", "cycle_holders", "holders", show=False),
    Binding("s", "show_stack", "stack", show=False),
    Binding("slash", "filter", "filter", key_display="/"),
    Binding("escape", "leave_filter", show=False),
    Binding("a", "show_gpu(-1)", "all GPUs", show=False),
    Binding("g", "next_gpu(1)", show=False),
    Binding("G", "next_gpu(-1)", show=False),
    Binding("y", "toggle_scale", show=False),
    Binding("space", "pause", "pause", show=False),
    Binding("F", "follow", show=False),
] + [Binding(str(i), f"show_gpu({i})", show=False) for i in range(10)]

#: Actions that only mean something while following a live stream.
LIVE_ACTIONS = frozenset({"pause", "follow"})

#: (keys, what they do): the single list the help screen and docs/tui.md show.
KEYS = (
    ("← →", "move the cursor one column (shift: ten)"),
    ("home end", "cursor to the start / end of the trace"),
    ("+ -", "zoom in / out around the cursor (mouse wheel: around the pointer)"),
    ("f", "zoom to fit the whole trace"),
    (", .", "pan left / right by half a screen"),
    ("click", "put the cursor where you click (drag to scrub)"),
    ("m M", "next / previous marker (named in the status line)"),
    ("p P", "next / previous phase begin on this GPU"),
    ("o O", "next / previous failure (as memrec report counts them)"),
    ("b B", "next / previous big allocation (≥ 1 GiB)"),
    ("0-9", "show GPU n"),
    ("a", "all GPUs overview"),
    ("g G", "next / previous GPU tab"),
    ("h", "holders at the cursor: by process, phase, largest, category, context, untraced"),
    ("s", "stack of the selected allocation (events row, a free's: its allocation; or the largest holders' row)"),
    ("/", "filter events: pid:N kind:alloc,free size>=1G phase:NAME fail TEXT"),
    ("esc", "leave the filter box / close this screen"),
    ("y", "y axis: fitted to the data on screen / the GPU's total memory"),
    ("space", "live: pause / resume the display (recording goes on)"),
    ("F", "live: follow the newest events"),
    ("?", "this help"),
    ("q", "quit"),
)
