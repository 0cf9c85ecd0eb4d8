"""The stack screen (key ``s``): the frames of the selected allocation, innermost first.

The selection is the row of the events table (the event at the cursor until another row is
chosen), or, while the holders table shows the largest allocations and has the focus, the
allocation on its row. The frame the report names as the allocation's site (its innermost user
frame, :mod:`memrec.analysis.report.sites`) is marked ``▶``; native frames are dim. A screen of its own:
a stack of 30 frames needs the terminal's height at 80x24, and it scrolls.
"""

from __future__ import annotations

import os

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Static

from memrec.base.untrusted import clean_text
from memrec.trace.stacks import Frame
from memrec.trace.stacks import Unavailable
from memrec.tui.views import StackView
from memrec.terms.units import fmt_bytes


def frame_text(frame: Frame) -> str:
    """A frame as the screen shows it: a Python file by its path inside its package
    (``sglang/srt/mem_cache/memory_pool.py:210 ...``), a native module by its name."""
    path = frame.file
    if frame.native:
        path = os.path.basename(path)
    else:
        for marker in ("/site-packages/", "/dist-packages/"):
            if marker in path:
                path = path.rsplit(marker, 1)[1]
                break
    return Frame(path, frame.line, frame.function, frame.native).label()


def stack_text(view: StackView | None, who: str, when: str, width: int = 80) -> Text:
    """What the screen shows: one line naming the event, then a line per frame."""
    t = Text()
    if view is None:
        t.append("no event selected: move the cursor to an allocation (o, b) or pick a row of the events")
        return t
    size = f" {fmt_bytes(view.size)}" if view.size else ""
    t.append(f"{view.kind}{size} by {who} at {when}", style="bold")
    t.append(f"  (event {view.seq:,})\n", style="dim")
    if view.free_seq is not None:
        t.append(f"the allocation that event {view.free_seq:,} (the free selected) gives back\n", style="dim")
    if view.free_unmatched:
        t.append("no allocation of this free among the events: it was made before the recording (or, "
                 "live, before the events the view keeps)")
        return t
    if view.stack is None:
        t.append("no stack recorded for this event (stacks off, or below the size threshold)")
        return t
    if isinstance(view.stack, Unavailable):
        t.append(f"stack unavailable: {clean_text(view.stack.reason, width * 3)}")
        return t
    t.append("innermost first; ▶ the site memrec report names\n", style="dim")
    for frame in view.stack:
        mark = "▶ " if frame == view.site else "  "
        line = clean_text(frame_text(frame), max(width - 4, 20))
        t.append(mark, style="bold")
        t.append(line + "\n", style="dim" if frame.native else ("bold" if mark.strip() else ""))
    return t


class StackScreen(Screen[None]):
    """The stack of one event (see the module docstring); esc, q or s closes it."""

    BINDINGS = [Binding("escape,q,s", "dismiss", "close")]

    def __init__(self, body: Text) -> None:
        super().__init__()
        self.body = body

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="stack-body"):
            yield Static(self.body)

    def action_dismiss(self) -> None:
        self.dismiss(None)
