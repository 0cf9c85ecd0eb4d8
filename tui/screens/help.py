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

from memrec.tui.screens.keys import KEYS


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
