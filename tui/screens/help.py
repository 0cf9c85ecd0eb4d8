"""The help screen: every key, what the timeline's colours mean."""

from __future__ import annotations

import os

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Static

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
    ("o O", "next / previous failed driver call"),
    ("b B", "next / previous big allocation (≥ 1 GiB)"),
    ("0-9", "show GPU n"),
    ("a", "all GPUs overview"),
    ("g G", "next / previous GPU tab"),
    ("h", "holders at the cursor: by process, phase, largest, category, context, untraced"),
    ("/", "filter events: pid:N kind:alloc,free size>=1G phase:NAME fail TEXT"),
    ("esc", "leave the filter box / close this screen"),
    ("y", "y axis: fitted to the data on screen / the GPU's total memory"),
    ("space", "live: pause / resume the display (recording goes on)"),
    ("F", "live: follow the newest events"),
    ("?", "this help"),
    ("q", "quit"),
)


class HelpScreen(Screen[None]):
    """Keys and legend, on a screen of its own: at 80x24 the help fills the terminal anyway, and
    nothing of the (still updating) view behind it shows through."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        from memrec.tui.widgets.panels import legend
        from memrec.tui.widgets.timeline import glyphs_for

        table = Table(box=None, show_header=False, padding=(0, 1))
        table.add_column(style="bold")
        table.add_column()
        for keys, what in KEYS:
            table.add_row(keys, what)
        body = Text()
        body.append("memrec tui", style="bold")
        body.append(" — where did each GPU's memory go, when, and who took it\n\n")
        with VerticalScroll(id="help-body"):
            yield Static(body)
            yield Static(table)
            yield Static(Text("\nTimeline: ", style="bold") + legend(self.app.no_color, glyphs_for(os.environ.get("TERM"))))
            yield Static(
                "Stacked: owned memory by category; untraced = NVML used - traced (owned), \"NVML lag\" "
                "where NVML's sample has not caught up with the calls yet. "
                "ipc_mapped is a peer's memory mapped here: drawn on top, never counted as owned. "
                "Dim columns are drawn from keyframes while the replay has not reached them. "
                "Bands under the chart are the phases each rank marked."
            )

    def action_dismiss(self) -> None:
        self.dismiss(None)
