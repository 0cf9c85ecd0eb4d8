"""The keys that move the main screen's view: which GPU, the cursor, zoom, pan, the jumps, the
filter box, the y scale, pause and follow, help.

Kept apart from :mod:`memrec.tui.screens.main` (which lays the screen out, draws it and routes the
source's messages) because these are the view's arithmetic and nothing else: each action changes
the view's fields (``gpu``, ``t0``/``t1``, ``cursor_ts``, ``follow``, ...) and asks for a redraw.
:class:`ViewKeys` is a mixin of :class:`~memrec.tui.screens.main.MainScreen` (Textual finds
``action_*`` methods by name on the screen); the handlers decorated with ``@on`` stay in the screen
itself, where Textual collects them.
"""

from __future__ import annotations

from textual.css.query import NoMatches
from textual.widgets import Input

from memrec.tui.navigation import JUMP_NAMES
from memrec.tui.navigation import jump
from memrec.terms.units import fmt_at
from memrec.tui.widgets.panels import EventsTable
from memrec.tui.widgets.panels import HoldersTable
from memrec.tui.widgets.timeline import GUTTER
from memrec.tui.widgets.timeline import TimelineGraph

MIN_SPAN = 10_000  # ns: the deepest zoom


class ViewKeys:
    """The view's key actions (see the module docstring); the screen supplies the view's fields,
    ``refresh_all``, ``_select_tab``, ``_update_status`` and Textual's ``query_one``/``notify``."""

    def action_show_gpu(self, gpu: int) -> None:
        if gpu != -1 and gpu not in self._gpu_ids:
            self.notify(f"no GPU{gpu} in this trace", severity="warning", timeout=2)
            return
        self.gpu = gpu
        self._select_tab()
        self.refresh_all()

    def action_next_gpu(self, step: int) -> None:
        order = self._gpu_ids + [-1]
        i = order.index(self.gpu) if self.gpu in order else 0
        self.action_show_gpu(order[(i + step) % len(order)])

    def _graph_width(self) -> int:
        try:
            w = self.query_one("#timeline", TimelineGraph).size.width - GUTTER
        except NoMatches:
            w = 0
        return max(w, 10)

    def _set_cursor(self, ts: int, follow: bool = False) -> None:
        lo, hi = self.model.time_range()
        self.cursor_ts = int(min(max(ts, lo), hi))
        self.follow = follow
        span = self.t1 - self.t0
        if self.cursor_ts < self.t0:
            self.t0 = self.cursor_ts - span // 10
            self.t1 = self.t0 + span
        elif self.cursor_ts >= self.t1:
            self.t1 = self.cursor_ts + span // 10
            self.t0 = self.t1 - span
        self.refresh_all()

    def action_move(self, cols: int) -> None:
        step = (self.t1 - self.t0) / self._graph_width()
        self._set_cursor(int(self.cursor_ts + cols * step))

    def action_jump_edge(self, end: int) -> None:
        lo, hi = self.model.time_range()
        self._set_cursor(hi if end else lo, follow=bool(end) and self.live)

    def action_zoom(self, factor: float, around: int | None = None) -> None:
        c = self.cursor_ts if around is None else around
        span = max(int((self.t1 - self.t0) * factor), MIN_SPAN)
        lo, hi = self.model.time_range()
        span = min(span, max(hi - lo, MIN_SPAN) * 2)
        frac = (c - self.t0) / max(self.t1 - self.t0, 1)
        frac = min(max(frac, 0.0), 1.0)
        self.t0 = int(c - frac * span)
        self.t1 = self.t0 + span
        self.refresh_all()

    def action_fit(self) -> None:
        lo, hi = self.model.time_range()
        self.t0, self.t1 = lo, hi + max((hi - lo) // self._graph_width(), 1)
        self.refresh_all()

    def action_pan(self, frac: float) -> None:
        d = int((self.t1 - self.t0) * frac)
        self.t0 += d
        self.t1 += d
        self.follow = False
        self.refresh_all()

    def action_jump(self, what: str, direction: int) -> None:
        fwd = direction > 0
        where = jump(self.model, what, self.cursor_ts, fwd, None if self.gpu == -1 else self.gpu)
        if where is None:
            self.notify(f"no {'next' if fwd else 'previous'} {JUMP_NAMES[what]}", timeout=2)
            return
        self.landing = where
        self._set_cursor(where.ts)

    def action_cycle_holders(self) -> None:
        table = self.query_one("#holders", HoldersTable)
        table.cycle()
        table.show(self.cursor_state, self.other_state)

    def action_show_stack(self) -> None:
        """The stack screen (:mod:`memrec.tui.screens.stack`) of the selected allocation."""
        from memrec.tui.screens.stack import StackScreen
        from memrec.tui.screens.stack import stack_text

        seq = self._selected_seq()
        view = self.model.stack_view(seq) if seq is not None else None
        who = self.model.pid_label(view.pid) if view is not None else ""
        when = "+" + fmt_at(view.ts - self.origin, self._resolution()) if view is not None else ""
        self.app.push_screen(StackScreen(stack_text(view, who, when, self.size.width)))

    def _selected_seq(self) -> int | None:
        """The largest holders' row while that table has the focus, else the events table's row."""
        holders = self.query_one("#holders", HoldersTable)
        st = self.cursor_state
        if holders.has_focus and holders.view_name == "largest" and st is not None \
                and 0 <= holders.cursor_row < len(st.largest):
            a = st.largest[holders.cursor_row]
            return self.model.allocation_seq(a.pid, a.address, a.ts)
        events = self.query_one("#events", EventsTable)
        if events.seqs:
            return events.seqs[min(max(events.cursor_row, 0), len(events.seqs) - 1)]
        return None

    def action_filter(self) -> None:
        if self.gpu == -1:
            return
        box = self.query_one("#filter", Input)
        box.display = True
        box.value = self.flt_text
        box.focus()

    def action_leave_filter(self) -> None:
        box = self.query_one("#filter", Input)
        if box.has_focus:
            box.display = bool(self.flt_text)
            self.query_one("#timeline").focus()

    def action_toggle_scale(self) -> None:
        self.scale_full = not self.scale_full
        self.refresh_all()

    def action_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused:
            self._dirty = True
        self._update_status()

    def action_follow(self) -> None:
        self.follow = True
        self.paused = False
        self._dirty = True

    def action_help(self) -> None:
        from memrec.tui.screens.help import HelpScreen

        self.app.push_screen(HelpScreen())
