"""The memrec TUI: one tab per GPU (header, timeline, holders and events at the cursor), an
all-GPUs overview, a live mode that follows the daemon, and a diff of two traces.

The app takes its data source as an argument (:mod:`memrec.tui.sources`; tests pass their own).
Sources fill a :class:`~memrec.tui.model.TraceModel` and post messages; the timeline is redrawn
in the UI thread from the model's downsampled series (cheap), and the state at the cursor is
computed in a worker thread (nearest checkpoint + a short replay) so keys never wait for it.
"""

from __future__ import annotations

import gc
import time
from typing import Any
from typing import Callable

from textual import events
from textual import on
from textual import work
from textual.app import App
from textual.app import ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.containers import Horizontal
from textual.containers import Vertical
from textual.containers import VerticalScroll
from textual.widgets import ContentSwitcher
from textual.widgets import Footer
from textual.widgets import Input
from textual.widgets import Static
from textual.widgets import Tab
from textual.widgets import Tabs

from memrec.tui import messages
from memrec.tui.model import CursorState
from memrec.tui.model import EventFilter
from memrec.tui.model import TraceModel
from memrec.tui.model import fmt_dur
from memrec.tui.model import parse_filter
from memrec.tui.widgets.panels import EventsTable
from memrec.tui.widgets.panels import GpuHeader
from memrec.tui.widgets.panels import HoldersTable
from memrec.tui.widgets.panels import StatusLine
from memrec.tui.widgets.panels import header_text
from memrec.tui.widgets.timeline import GUTTER
from memrec.tui.widgets.timeline import TimelineGraph
from memrec.tui.widgets.timeline import TimelineOptions
from memrec.events import OWNED_CATEGORIES
from memrec.units import fmt_bytes

OVERVIEW = "overview"
MIN_SPAN = 10_000  # ns: the deepest zoom


class MemrecApp(App[None]):
    """memrec's TUI.

    Args:
        source: a FileSource, LiveSource or DiffSource (or anything with ``model``, ``kind``,
            ``title``, ``run(post)`` and ``stop()``).
        clock: seconds, monotonic (tests fix it); used for the stale-connection warning.
        stale_after: seconds without data from the daemon before the status line warns.
        refresh_interval: seconds between redraws while live data arrives.
    """

    CSS_PATH = "app.tcss"
    TITLE = "memrec"
    ENABLE_COMMAND_PALETTE = False

    BINDINGS = [
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
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
        Binding("o", "jump('failure', 1)", "failed", key_display="oO"),
        Binding("O", "jump('failure', -1)", show=False),
        Binding("b", "jump('big', 1)", "big", key_display="bB"),
        Binding("B", "jump('big', -1)", show=False),
        Binding("h", "cycle_holders", "holders", show=False),
        Binding("slash", "filter", "filter", key_display="/"),
        Binding("escape", "leave_filter", show=False),
        Binding("a", "show_gpu(-1)", "all GPUs", show=False),
        Binding("g", "next_gpu(1)", show=False),
        Binding("G", "next_gpu(-1)", show=False),
        Binding("y", "toggle_scale", show=False),
        Binding("space", "pause", "pause", show=False),
        Binding("F", "follow", show=False),
    ] + [Binding(str(i), f"show_gpu({i})", show=False) for i in range(10)]

    def __init__(self, source: Any, *, clock: Callable[[], float] = time.monotonic, stale_after: float = 3.0,
                 refresh_interval: float = 0.1) -> None:
        super().__init__()
        self.source = source
        self.model: TraceModel = source.model
        self.other_model: TraceModel | None = getattr(source, "other_model", None)
        self.clock = clock
        self.stale_after = stale_after
        self.refresh_interval = refresh_interval
        self.gpu: int = -1  # -1: the overview
        self.t0, self.t1 = self.model.time_range()
        self.cursor_ts = self.t1
        self.flt = EventFilter()
        self.flt_text = ""
        self.scale_fit = False
        self.paused = False
        self.follow = source.kind == "live"
        self.loaded = source.kind == "live"
        self.indexed = False
        self.progress = ""
        self.connected = False
        self.connection_note = ""
        self.last_data = clock()
        self.cursor_state: CursorState | None = None
        self.other_state: CursorState | None = None
        self.events_rows = None
        self._dirty = False
        self._gpu_ids: list[int] = []
        self._gpu_chosen = False
        self._tab_ids_added: dict = {}
        self._interacting_until = 0.0
        self._state_key: tuple | None = None
        #: Under 100 columns: the footer, the GPU header, the status line and the holders take
        #: their short forms, so that everything fits at 80x24 (docs/tui.md).
        self.narrow = False
        self.sub_title = source.title

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Tabs(id="gpu-tabs")
        with ContentSwitcher(initial="gpu-view", id="switcher"):
            with Vertical(id="gpu-view"):
                yield GpuHeader(id="gpu-header")
                yield TimelineGraph(id="timeline")
                with Horizontal(id="bottom"):
                    yield HoldersTable(id="holders")
                    with Vertical(id="events-pane"):
                        yield Input(placeholder="filter: pid:N kind:alloc size>=1G phase:NAME fail TEXT", id="filter")
                        yield EventsTable(id="events")
            yield VerticalScroll(id=OVERVIEW)
        yield StatusLine(id="status")
        yield Footer()

    def _q(self, selector: str, expect_type: type | None = None):
        """Query the main screen (not whichever screen is on top, e.g. the help)."""
        if not self.screen_stack:
            raise NoMatches(f"no screen yet (or any more) for {selector}")
        base = self.screen_stack[0]
        return base.query_one(selector, expect_type) if expect_type else base.query_one(selector)

    async def on_mount(self) -> None:
        self._q("#filter", Input).display = False
        self._q("#timeline", TimelineGraph).set_producer(self._produce_main)
        self.set_interval(self.refresh_interval, self._tick)
        if self.source.kind == "live":
            self.source.run(self.post_message)
        else:
            self.source.busy = lambda: time.monotonic() < self._interacting_until
            self.run_worker(lambda: self.source.run(self.post_message), thread=True, group="source", name="load")
        self._q("#timeline").focus()
        self.refresh_all()

    def on_key(self) -> None:
        self._interacting_until = time.monotonic() + 0.5

    def on_mouse_down(self) -> None:
        self._interacting_until = time.monotonic() + 0.5

    def on_unmount(self) -> None:
        self.source.stop()

    # ------------------------------------------------------------------ GPUs and tabs

    def _sync_gpus(self) -> bool:
        """One tab (and one overview graph) per GPU the model knows; new GPUs are added. True
        when some were (the caller redraws).

        The model learns GPUs at any time and from any record: a trace without NVML lists none in
        its header and names them only in its events, which the scan reads after the first frame
        and the live stream sends later still. So every redraw and every tick asks (a set lookup),
        whatever message came first. Synchronous on purpose (nothing awaited): it runs from timers
        and message handlers alike.
        """
        try:
            tabs = self._q("#gpu-tabs", Tabs)
        except NoMatches:
            return False
        ids = self.model.gpu_ids()
        new = [g for g in ids if g not in self._gpu_ids]
        if new:
            self._gpu_ids = sorted(set(self._gpu_ids) | set(ids))
            overview = self._q(f"#{OVERVIEW}", VerticalScroll)
            for g in new:
                tabs.add_tab(Tab(f"GPU{g}", id=f"tab-gpu{g}"), before="tab-all" if "all" in self._tab_ids_added else None)
                self._tab_ids_added[g] = True
                info = self.model.gpus.get(g)
                graph = TimelineGraph(g, compact=True, id=f"ov-graph{g}", classes="ov-graph")
                graph.set_producer(self._producer_for(g, compact=True))
                overview.mount(Static(f"GPU{g} {info.name if info else ''}", id=f"ov-label{g}", classes="ov-label"), graph)
            if "all" not in self._tab_ids_added and self._gpu_ids:
                tabs.add_tab(Tab("all GPUs", id="tab-all"))
                self._tab_ids_added["all"] = True
        if self.gpu not in self._gpu_ids and (self.gpu != -1 or not self._gpu_chosen):
            self.gpu = self._gpu_ids[0] if self._gpu_ids else -1
        self._gpu_chosen = self._gpu_chosen or bool(self._gpu_ids)
        self._select_tab()
        return bool(new)

    def _select_tab(self) -> None:
        tabs = self._q("#gpu-tabs", Tabs)
        want = "tab-all" if self.gpu == -1 else f"tab-gpu{self.gpu}"
        exists = "all" in self._tab_ids_added if self.gpu == -1 else self.gpu in self._tab_ids_added
        if exists and tabs.active != want:
            tabs.active = want
        self._q("#switcher", ContentSwitcher).current = OVERVIEW if self.gpu == -1 else "gpu-view"

    @on(Tabs.TabActivated, "#gpu-tabs")
    def _tab_activated(self, event: Tabs.TabActivated) -> None:
        if not self.is_running or not event.tab:
            return
        tab_id = event.tab.id or ""
        gpu = -1 if tab_id == "tab-all" else int(tab_id.removeprefix("tab-gpu")) if tab_id.startswith("tab-gpu") else -1
        if gpu != self.gpu:
            self.gpu = gpu
            self._select_tab()
            self.refresh_all()

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

    # ------------------------------------------------------------------ drawing

    @property
    def origin(self) -> int:
        return self.model.time_range()[0]

    def _scale(self, gpu: int, view) -> int:
        info = self.model.gpus.get(gpu)
        if self.scale_fit or info is None or not info.total:
            return max(view.peak(), 1) * 21 // 20
        return max(info.total, view.peak())

    def _producer_for(self, gpu: int, compact: bool):
        def produce(width: int, height: int):
            view = self.model.viewport(gpu, self.t0, self.t1, width)
            if self.other_model is not None:
                view.other_total = self._other_owned(gpu, width)
            if compact:
                opt = TimelineOptions(height, self._scale(gpu, view), self.cursor_ts, self.origin, None, 0,
                                      self.model.failures(gpu, self.t0, self.t1), axis=False, event_row=False)
            else:
                big = height >= 16
                opt = TimelineOptions(height, self._scale(gpu, view), self.cursor_ts, self.origin, self.model.bands(gpu),
                                      4 if big else 2, self.model.failures(gpu, self.t0, self.t1))
            return view, opt

        return produce

    def _produce_main(self, width: int, height: int):
        return self._producer_for(max(self.gpu, 0), compact=False)(width, height)

    def _other_owned(self, gpu: int, width: int):
        om = self.other_model
        shift = om.time_range()[0] - self.origin
        ov = om.viewport(gpu, self.t0 + shift, self.t1 + shift, width)
        return ov.owned

    def refresh_all(self) -> None:
        """Redraw the visible graphs, the header and the status line; ask for the cursor state."""
        try:
            self._refresh_all()
        except NoMatches:  # shutting down: the widgets are gone
            pass

    def _refresh_all(self) -> None:
        self._dirty = False
        self._sync_gpus()
        if self.gpu == -1:
            for g in self._gpu_ids:
                try:
                    self._q(f"#ov-graph{g}", TimelineGraph).redraw()
                    self._overview_label(g)
                except Exception:  # the overview is being rebuilt
                    pass
        else:
            self._q("#timeline", TimelineGraph).redraw()
            self._update_header()
        self._update_status()
        self._request_state()

    def _overview_label(self, g: int) -> None:
        info = self.model.gpus.get(g)
        nv = self.model.nvml_at(g, self.cursor_ts)
        owned = self.model.series_at(g, self.cursor_ts)
        parts = [f"[b]GPU{g}[/] {info.name if info else ''}"]
        if nv:
            parts.append(f"used {fmt_bytes(nv['used'])}")
        if owned is not None:
            parts.append(f"traced {fmt_bytes(int(owned[list(OWNED_CATEGORIES)].sum()))}")
        if info:
            parts.append(f"of {fmt_bytes(info.total)}")
        self._q(f"#ov-label{g}", Static).update("  ".join(parts))

    def _update_header(self) -> None:
        g = max(self.gpu, 0)
        st = self.cursor_state if self.cursor_state is not None and self.cursor_state.gpu == g else None
        owned = None
        if st is None:
            v = self.model.series_at(g, self.cursor_ts)
            owned = int(v[list(OWNED_CATEGORIES)].sum()) if v is not None else None
        nv = self.model.nvml_at(g, self.cursor_ts)
        text = header_text(self.model.gpus.get(g), g, fmt_dur(self.cursor_ts - self.origin), st, owned, nv,
                           self.other_state, wide=self.size.width >= 150, narrow=self.narrow, no_color=self.no_color)
        self._q("#gpu-header", GpuHeader).update(text)

    def _update_status(self) -> None:
        try:
            self._q("#status", StatusLine)
        except NoMatches:
            return
        m = self.model
        parts = []
        if self.source.kind == "live":
            if self.connected:
                quiet = self.clock() - self.last_data
                if quiet > self.stale_after:
                    parts.append(f"[b yellow]⚠ no data for {quiet:.0f}s[/] (daemon stalled?)")
                else:
                    parts.append("[b green]●[/] live")
            else:
                parts.append(f"[b red]✗[/] {self.connection_note or 'connecting'}")
            if self.paused:
                parts.append("[reverse] PAUSED [/]")
            elif self.follow:
                parts.append("following")
        else:
            parts.append(self.source.title)
        parts.append(f"{m.store.n:,} events")
        if self.progress:
            parts.append(self.progress)
        nf = m.failure_count()
        here = m.failure_text(self.cursor_ts, None if self.gpu == -1 else self.gpu) if nf else None
        if here:  # the cursor is on a failed call (key o): what failed, with the driver's name for it
            parts.append(f"[b red]✗ {here.replace('CUDA_ERROR_', '') if self.narrow else here}[/]")
        elif nf:
            parts.append(f"[b red]{nf} failed call{'s' if nf > 1 else ''}[/]")
        if m.lost or self.source.kind == "live":
            parts.append(f"lost {m.lost:,}" if not m.lost else f"[b yellow]lost {m.lost:,}[/]")
        if m.warnings:
            parts.append(f"[yellow]{len(m.warnings)} warning{'s' if len(m.warnings) > 1 else ''}[/]")
        span = self.t1 - self.t0
        parts.append(f"view {fmt_dur(span)}")
        self._q("#status", StatusLine).update(" │ ".join(parts))

    # ------------------------------------------------------------------ cursor state (worker)

    def _request_state(self) -> None:
        if self.gpu == -1 or not self.loaded:
            return
        seq = self.model.store.seq_at(self.cursor_ts)
        key = (id(self.model), self.gpu, seq, self.flt, self.model.frontier >= seq, self.model.store.n)
        if key == self._state_key:
            return
        self._state_key = key
        self._compute_state(key, seq, self.gpu, self.cursor_ts, self.flt)

    @work(thread=True, exclusive=True, group="cursor")
    def _compute_state(self, key: tuple, seq: int, gpu: int, ts: int, flt: EventFilter) -> None:
        model = self.model
        st = model.state_at(seq, gpu, ts)
        ev = model.events_window(seq, flt, gpu, before=60, after=60)
        other = None
        if self.other_model is not None:
            om = self.other_model
            ots = ts - self.origin + om.time_range()[0]
            other = om.state_at(om.store.seq_at(ots), gpu, ots)
        self.post_message(messages.CursorStateReady(key, (st, ev), other))

    def on_cursor_state_ready(self, message: messages.CursorStateReady) -> None:
        if message.key != self._state_key or not self.screen_stack:
            return
        st, ev = message.state
        self.cursor_state = st
        self.other_state = message.other
        self.events_rows = ev
        self._q("#holders", HoldersTable).show(st, message.other)
        self._q("#events", EventsTable).show(ev, self.origin, self.model.pid_label, self.flt_text)
        self._update_header()

    # ------------------------------------------------------------------ source messages

    def on_load_progress(self, message: messages.LoadProgress) -> None:
        if message.phase == "scan":
            self.progress = f"reading… {message.done:,} records"
        else:
            self.progress = f"replaying {100 * message.done / max(message.total, 1):.0f}%"
        if message.phase == "index":
            self._dirty = True
        else:
            self._update_status()

    async def on_loaded(self, message: messages.Loaded) -> None:
        self.loaded = True
        self.t0, self.t1 = self.model.time_range()
        self.t1 += max((self.t1 - self.t0) // 100, 1)
        self.cursor_ts = self._initial_cursor()
        self.refresh_all()
        self._freeze_heap()

    def _freeze_heap(self) -> None:
        """A file's model is built once and kept: move what is alive now out of the cyclic GC's
        reach (``gc.freeze``), so that a full collection, run by whichever thread allocates, walks
        only what came after (on a 10M-event trace one took 45-100 ms, stalling a key press).
        Not in live mode, whose model is trimmed and rebuilt: frozen cycles would never be freed."""
        if self.source.kind != "live":
            gc.freeze()

    def _initial_cursor(self) -> int:
        """The end of the trace: what a user opens a trace for (a failed call, the final state), and where
        the daemon's last keyframe (written at close) makes the state at the cursor free."""
        return self.model.time_range()[1]

    def on_indexed(self, message: messages.Indexed) -> None:
        self.indexed = True
        self._freeze_heap()
        self.progress = ""
        self._state_key = None
        self.refresh_all()

    def on_source_failed(self, message: messages.SourceFailed) -> None:
        self.progress = f"[b red]{message.error}[/]"
        self._update_status()

    def on_connected(self, message: messages.Connected) -> None:
        if self.model.store.n or self.model.header:
            # the daemon restarted (or we reconnected): its stream starts over with a header
            self.model = self.source.model = self.source.new_model()
            self._state_key = None
        self.connected = True
        self.connection_note = ""
        self.last_data = self.clock()
        self._dirty = True

    def on_disconnected(self, message: messages.Disconnected) -> None:
        self.connected = False
        self.connection_note = f"{message.reason}; retrying in {message.retry_in:.1f}s"
        self._update_status()

    async def on_records_received(self, message: messages.RecordsReceived) -> None:
        m = self.model
        for rec in message.records:
            m.add_record(rec, live=True)
        m.index_step(1 << 62)
        m.trim()
        self.last_data = self.clock()
        self._dirty = True

    async def _tick(self) -> None:
        """Periodic: redraw after new data (at most every ``refresh_interval``), stale warning."""
        if not self.screen_stack or not self.is_running:
            return
        if self._sync_gpus():
            self._dirty = True
        if self.source.kind == "live":
            if self._dirty and not self.paused:
                lo, hi = self.model.time_range()
                if self.follow:
                    span = max(self.t1 - self.t0, 1)
                    if self.t0 <= lo or hi - lo < span:
                        self.t0, self.t1 = lo, hi + max((hi - lo) // 50, 1)
                    else:
                        self.t0, self.t1 = hi - span, hi + max(span // 50, 1)
                    self.cursor_ts = hi
                self.refresh_all()
            else:
                self._update_status()
        elif self._dirty:
            self.refresh_all()

    # ------------------------------------------------------------------ actions

    def _graph_width(self) -> int:
        try:
            w = self._q("#timeline", TimelineGraph).size.width - GUTTER
        except Exception:
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
        self._set_cursor(hi if end else lo, follow=bool(end) and self.source.kind == "live")

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
        gpu = None if self.gpu == -1 else self.gpu
        m = self.model
        if what == "marker":
            ts = m.next_marker_ts(self.cursor_ts, fwd)
        elif what == "phase":
            ts = m.next_phase_ts(self.cursor_ts, fwd, gpu)
        elif what == "failure":
            ts = m.next_failure_ts(self.cursor_ts, fwd, gpu)
        else:
            ts = m.next_big_ts(self.cursor_ts, fwd, gpu)
        if ts is None:
            names = {"marker": "marker", "phase": "phase", "failure": "failed call", "big": "big allocation"}
            self.notify(f"no {'next' if fwd else 'previous'} {names[what]}", timeout=2)
            return
        self._set_cursor(ts)

    def action_cycle_holders(self) -> None:
        table = self._q("#holders", HoldersTable)
        table.cycle()
        table.show(self.cursor_state, self.other_state)

    def action_filter(self) -> None:
        if self.gpu == -1:
            return
        box = self._q("#filter", Input)
        box.display = True
        box.value = self.flt_text
        box.focus()

    def action_leave_filter(self) -> None:
        box = self._q("#filter", Input)
        if box.has_focus:
            box.display = bool(self.flt_text)
            self._q("#timeline").focus()

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        try:
            flt = parse_filter(event.value)
        except ValueError as error:
            self.notify(str(error), severity="error", timeout=4)
            return
        self.flt = flt
        self.flt_text = event.value.strip()
        event.input.display = bool(self.flt_text)
        self._q("#timeline").focus()
        self.refresh_all()

    def action_toggle_scale(self) -> None:
        self.scale_fit = not self.scale_fit
        self.refresh_all()

    def action_pause(self) -> None:
        if self.source.kind != "live":
            return
        self.paused = not self.paused
        if not self.paused:
            self._dirty = True
        self._update_status()

    def action_follow(self) -> None:
        if self.source.kind == "live":
            self.follow = True
            self.paused = False
            self._dirty = True

    def action_help(self) -> None:
        from memrec.tui.screens.help import HelpScreen

        self.push_screen(HelpScreen())

    @on(TimelineGraph.Clicked)
    def _clicked(self, message: TimelineGraph.Clicked) -> None:
        if message.graph.compact and message.graph.gpu != self.gpu:
            self.cursor_ts = message.ts
            self.action_show_gpu(message.graph.gpu)
            return
        self._set_cursor(message.ts)

    @on(TimelineGraph.Scrolled)
    def _scrolled(self, message: TimelineGraph.Scrolled) -> None:
        self.action_zoom(0.5 if message.direction < 0 else 2.0, around=message.ts)

    def on_resize(self, event: events.Resize) -> None:
        # event.size: this handler runs before the App's own, which sets self.size
        self.narrow = narrow = event.size.width < 100
        self.set_class(narrow, "narrow")
        self.set_class(event.size.height < 30, "short")
        try:
            self._q("Footer", Footer).compact = narrow
            holders = self._q("#holders", HoldersTable)
        except NoMatches:
            return
        if holders.narrow != narrow:
            holders.narrow = narrow
            holders.show(self.cursor_state, self.other_state)
        self.refresh_all()
