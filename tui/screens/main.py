"""The main screen: one tab per GPU (header, timeline, holders and events at the cursor) and an
all-GPUs overview. It holds the view (which GPU, the time range, the cursor, the filter) and the
keys; the app (:mod:`memrec.tui.app`) holds the source and the timers, and routes the source's
messages here. The keys that move the view (cursor, zoom, pan, jumps, filter) are
:mod:`memrec.tui.screens.view_keys`.

The timeline is redrawn in the UI thread from the model's downsampled series (cheap); the state at
the cursor is computed in a worker thread (nearest checkpoint + a short replay), so keys never wait
for it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from dataclasses import replace
from typing import Callable

from textual import events
from textual import on
from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.containers import Vertical
from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widgets import ContentSwitcher
from textual.widgets import Footer
from textual.widgets import Input
from textual.widgets import Static
from textual.widgets import Tab
from textual.widgets import Tabs
from textual.worker import get_current_worker

from memrec.analysis.diff.build import Verdict
from memrec.terms.events import OWNED_CATEGORIES
from memrec.tui import messages
from memrec.tui.filters import EventFilter
from memrec.tui.filters import parse_filter
from memrec.tui.model import TraceModel
from memrec.tui.navigation import Alignment
from memrec.tui.navigation import Landing
from memrec.tui.screens.keys import BINDINGS
from memrec.tui.screens.keys import LIVE_ACTIONS
from memrec.tui.screens.source_events import SourceEvents
from memrec.tui.screens.view_keys import ViewKeys
from memrec.tui.store import EventRows
from memrec.tui.views import CursorState
from memrec.tui.views import SeriesView
from memrec.tui.widgets.panels import EventsTable
from memrec.tui.widgets.panels import GpuHeader
from memrec.tui.widgets.panels import HoldersTable
from memrec.tui.widgets.panels import StatusLine
from memrec.tui.widgets.panels import StatusFacts
from memrec.tui.widgets.panels import fit_status
from memrec.tui.widgets.panels import header_text
from memrec.tui.widgets.panels import overview_label
from memrec.tui.widgets.timeline import CONSOLE_GLYPHS
from memrec.tui.widgets.timeline import TimelineGraph
from memrec.tui.widgets.timeline import TimelineOptions
from memrec.tui.widgets.timeline import glyphs_for
from memrec.terms.units import fmt_at

OVERVIEW = "overview"


@dataclass
class Link:
    """The live connection as the app knows it (the status line shows it)."""

    connected: bool = False
    note: str = ""
    last_data: float = 0.0


class MainScreen(ViewKeys, SourceEvents, Screen[None]):
    """The view of one trace (or of two, compared).

    Args:
        model: what to draw; ``other_model``: diff mode, the trace compared with it.
        title: the source's name for the status line.
        live: the source is a live stream (follow the newest events; pause; connection status).
        link: the live connection's state, kept current by the app.
        clock: seconds, monotonic (tests fix it); ``stale_after``: seconds without data before
            the status line warns.
    """

    BINDINGS = BINDINGS

    def __init__(self, model: TraceModel, other_model: TraceModel | None, title: str, *, live: bool, link: Link,
                 clock: Callable[[], float] = time.monotonic, stale_after: float = 3.0) -> None:
        super().__init__()
        self.model = model
        self.other_model = other_model
        self.source_title = title
        self.live = live
        self.link = link
        self.clock = clock
        self.stale_after = stale_after
        self.glyphs = glyphs_for(os.environ.get("TERM"))
        self.gpu: int = -1  # -1: the overview
        self.t0, self.t1 = model.time_range()
        self.cursor_ts = self.t1
        self.flt = EventFilter()
        self.flt_text = ""
        #: The y axis: False fits it to the data on screen, True shows the GPU's whole memory (key y).
        self.scale_full = False
        self.paused = False
        self.follow = live
        self.loaded = live
        self.indexed = False
        self.progress = ""
        self.cursor_state: CursorState | None = None
        self.other_state: CursorState | None = None
        self.events_rows: EventRows | None = None
        #: What the last jump (or the opening) landed on: the status line names it while the
        #: cursor stays there.
        self.landing: Landing | None = None
        #: Diff mode: how the other trace is lined up with this one (set once both are read).
        self.alignment = Alignment(0, "")
        #: Diff mode: what ``memrec diff`` says of the two runs (once the source has it).
        self.verdict: Verdict | None = None
        #: The cursor is where the trace opened (no key yet): the replay's end may move it to the peak.
        self._opening = not live
        self._dirty = False
        self._gpu_ids: list[int] = []
        self._gpu_chosen = False
        self._tab_ids_added: dict = {}
        self._state_key: tuple | None = None  # the latest cursor-state request
        #: The request the holders and events show the answer to (== the latest: they are current).
        self.answered_key: tuple | None = None
        #: Under 100 columns: the footer, the GPU header, the status line and the holders take
        #: their short forms, so that everything fits at 80x24 (docs/tui.md).
        self.narrow = False

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
            with VerticalScroll(id=OVERVIEW):
                yield Static(self._no_gpu_text(), id="ov-empty")
        yield StatusLine(id="status")
        yield Footer()

    def _no_gpu_text(self) -> str:
        """What the overview says before any GPU is known (a blank screen said nothing)."""
        if self.live:
            return ("No GPU memory recorded yet: the daemon is running, and each GPU appears here when "
                    "a process first allocates on it (the status line counts the events).")
        return "No GPU in what has been read of this trace (the status line says how far the reading is)."

    class Ready(Message):
        """The screen's widgets are mounted: the app starts the source (whose first messages
        would otherwise find tabs not yet mounted)."""

    def on_mount(self) -> None:
        self.set_class(self.glyphs is CONSOLE_GLYPHS, "console")
        self.set_class(self.other_model is not None, "diff")
        self.query_one("#filter", Input).display = False
        self.query_one("#timeline", TimelineGraph).set_producer(self._produce_main)
        self.query_one("#timeline").focus()
        self.refresh_all()
        self.post_message(self.Ready())

    def on_key(self) -> None:
        self._opening = False

    def on_mouse_down(self) -> None:
        self._opening = False

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Pause and follow exist only for a live stream."""
        return self.live if action in LIVE_ACTIONS else True

    def set_model(self, model: TraceModel) -> None:
        """A new stream (the daemon restarted): draw ``model`` from now on."""
        self.model = model
        self._state_key = None
        self._dirty = True

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
            tabs = self.query_one("#gpu-tabs", Tabs)
        except NoMatches:
            return False
        ids = self.model.gpu_ids()
        new = [g for g in ids if g not in self._gpu_ids]
        if new:
            self._gpu_ids = sorted(set(self._gpu_ids) | set(ids))
            overview = self.query_one(f"#{OVERVIEW}", VerticalScroll)
            self.query_one("#ov-empty", Static).display = False
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
        tabs = self.query_one("#gpu-tabs", Tabs)
        want = "tab-all" if self.gpu == -1 else f"tab-gpu{self.gpu}"
        exists = "all" in self._tab_ids_added if self.gpu == -1 else self.gpu in self._tab_ids_added
        if exists and tabs.active != want:
            tabs.active = want
        self.query_one("#switcher", ContentSwitcher).current = OVERVIEW if self.gpu == -1 else "gpu-view"

    @on(Tabs.TabActivated, "#gpu-tabs")
    def _tab_activated(self, event: Tabs.TabActivated) -> None:
        if not self.is_attached or not event.tab or event.tab.id != event.tabs.active:
            return  # a stale event
        tab_id = event.tab.id or ""
        gpu = -1 if tab_id == "tab-all" else int(tab_id.removeprefix("tab-gpu")) if tab_id.startswith("tab-gpu") else -1
        if self._opening and gpu != self.gpu:
            self._select_tab()  # Tabs activated its first tab by itself: the view opens where the answer is
            return
        if gpu != self.gpu:
            self.gpu = gpu
            self._select_tab()
            self.refresh_all()

    # ------------------------------------------------------------------ drawing

    @property
    def origin(self) -> int:
        return self.model.time_range()[0]

    def _scale(self, gpu: int, view: SeriesView) -> int:
        """Bytes at the top of the chart: fitted to what is on screen (a 20 MiB workload on a
        140 GiB GPU is not a flat line), or the GPU's total memory (key y)."""
        info = self.model.gpus.get(gpu)
        peak = view.peak()
        if view.other_total is not None:  # diff mode: the other run's line stays on the chart
            peak = max(peak, int(view.other_total.max(initial=0)))
        if not self.scale_full or info is None or not info.total:
            return max(peak, 1) * 21 // 20
        return max(info.total, peak)

    def _producer_for(self, gpu: int, compact: bool):
        def produce(width: int, height: int):
            view = self.model.viewport(gpu, self.t0, self.t1, width)
            if self.other_model is not None:
                view.other_total = self._other_owned(gpu, width)
            failures = self.model.landmarks.failures(gpu, self.t0, self.t1)
            if compact:
                opt = TimelineOptions(height, self._scale(gpu, view), self.cursor_ts, self.origin, None, 0, failures,
                                      axis=False, event_row=False, glyphs=self.glyphs)
            else:
                big = height >= 16
                opt = TimelineOptions(height, self._scale(gpu, view), self.cursor_ts, self.origin, self.model.bands(gpu),
                                      4 if big else 2, failures, glyphs=self.glyphs)
            return view, opt

        return produce

    def _produce_main(self, width: int, height: int):
        return self._producer_for(max(self.gpu, 0), compact=False)(width, height)

    def _other_owned(self, gpu: int, width: int):
        shift = self.alignment.shift
        return self.other_model.viewport(gpu, self.t0 + shift, self.t1 + shift, width).owned

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
                    self.query_one(f"#ov-graph{g}", TimelineGraph).redraw()
                    self._overview_label(g)
                except NoMatches:  # the overview is being rebuilt
                    pass
        else:
            self.query_one("#timeline", TimelineGraph).redraw()
            self._update_header()
        self._update_status()
        self._request_state()

    def _overview_label(self, g: int) -> None:
        owned = self.model.series_at(g, self.cursor_ts)
        text = overview_label(g, self.model.gpus.get(g), self.model.nvml_at(g, self.cursor_ts),
                              None if owned is None else int(owned[list(OWNED_CATEGORIES)].sum()))
        self.query_one(f"#ov-label{g}", Static).update(text)

    def _update_header(self) -> None:
        g = max(self.gpu, 0)
        st = self.cursor_state if self.cursor_state is not None and self.cursor_state.gpu == g else None
        owned = None
        if st is None:
            v = self.model.series_at(g, self.cursor_ts)
            owned = int(v[list(OWNED_CATEGORIES)].sum()) if v is not None else None
        nv = self.model.nvml_at(g, self.cursor_ts)
        text = header_text(self.model.gpus.get(g), g, fmt_at(self.cursor_ts - self.origin, self._resolution()), st, owned, nv,
                           self.other_state, wide=self.size.width >= 150, narrow=self.narrow, no_color=self.app.no_color,
                           glyphs=self.glyphs, aligned=self.alignment.text)
        self.query_one("#gpu-header", GpuHeader).update(text)

    def _resolution(self) -> int:
        """The time one column of the chart spans (ns): how precisely a time on screen is written."""
        return max((self.t1 - self.t0) // max(self.size.width - 12, 1), 1)

    def _update_status(self) -> None:
        try:
            status = self.query_one("#status", StatusLine)
        except NoMatches:
            return
        m = self.model
        g = self.glyphs
        parts = []
        if self.live:
            quiet = self.clock() - self.link.last_data
            if not self.link.connected:
                parts.append(f"[b red]{g.fail}[/] {self.link.note or 'connecting'}")
            elif quiet > self.stale_after and m.gpus:
                parts.append(f"[b yellow]{g.stale} no data for {quiet:.0f}s[/] (daemon stalled?)")
            elif quiet > self.stale_after:
                # a daemon without NVML sends nothing while no process calls the driver: silence
                # is the idle host, not a stall (a daemon that goes away closes the socket)
                parts.append(f"[b green]{g.live}[/] live, idle {quiet:.0f}s")
            else:
                parts.append(f"[b green]{g.live}[/] live")
            if self.paused or self.follow:
                parts.append("[reverse] PAUSED [/]" if self.paused else "following")
        landing = self.landing if self.landing is not None and self.landing.ts == self.cursor_ts else None
        here = m.landmarks.failure_text(self.cursor_ts, None if self.gpu == -1 else self.gpu)
        facts = StatusFacts(
            title=None if self.live else self.source_title, events=m.store.n, progress=self.progress,
            failure_here=here, failures=m.landmarks.count(), landing=landing,
            lost=m.lost if m.lost or self.live else None, warnings=len(m.warnings), span=self.t1 - self.t0,
        )
        status.update(fit_status(parts, facts, status.content_size.width or self.size.width, g))

    # ------------------------------------------------------------------ cursor state (worker)

    def _request_state(self) -> None:
        if self.gpu == -1 or not self.loaded:
            return
        seq = self.model.store.seq_at(self.cursor_ts)
        # what the state is of, and how far the model had got: the replay past the cursor, the
        # replay's end, the untraced band split (each makes the state at the same cursor richer)
        key = (id(self.model), self.gpu, seq, self.flt, self.model.frontier >= seq, self.model.store.n,
               self.indexed, self.model.reconciliation is not None)
        if key == self._state_key:
            return
        self._state_key = key
        self._compute_state(key, seq, self.gpu, self.cursor_ts, self.flt)

    @work(thread=True, exclusive=True, group="cursor")
    def _compute_state(self, key: tuple, seq: int, gpu: int, ts: int, flt: EventFilter) -> None:
        """The state at the cursor, posted twice for a trace with tensor blocks: first without
        them, then with them (their replay may start from the first event: minutes at 100M events
        ahead of the TUI's own replay; the rest of the panel does not wait for it)."""
        model = self.model
        blocks_later = bool(model.tensor_events)
        st = model.state_at(seq, gpu, ts, tensors=not blocks_later)
        ev = model.events_window(seq, flt, gpu, before=60, after=60)
        other = None
        if self.other_model is not None:
            om = self.other_model
            ots = ts + self.alignment.shift
            other = om.state_at(om.store.seq_at(ots), gpu, ots)
        self.post_message(messages.CursorStateReady(key, st, ev, other))
        if blocks_later and not get_current_worker().is_cancelled:
            st = replace(st, tensors=model.tensors_at(seq, gpu))
            self.post_message(messages.CursorStateReady(key, st, ev, other))

    def on_cursor_state_ready(self, message: messages.CursorStateReady) -> None:
        if message.key != self._state_key or not self.is_attached:
            return
        self.answered_key = message.key
        self.cursor_state = message.state
        self.other_state = message.other
        self.events_rows = message.events
        self.query_one("#holders", HoldersTable).show(message.state, message.other)
        self.query_one("#events", EventsTable).show(message.events, self.origin, self.model.pid_label, self.flt_text,
                                                    self._resolution())
        self._update_header()

    # ------------------------------------------------------------------ what the source says: SourceEvents

    def data_changed(self) -> None:
        """New records (live), or a connection change: redraw on the next tick."""
        self._dirty = True

    def tick(self) -> None:
        """Periodic (the app's timer): redraw after new data, at most every tick; the stale warning."""
        if not self.is_attached:
            return
        if self._sync_gpus():
            self._dirty = True
        if self.live:
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

    # ------------------------------------------------------------------ the view keys' @on handlers

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
        self.query_one("#timeline").focus()
        self.refresh_all()

    @on(TimelineGraph.Clicked)
    def _clicked(self, message: TimelineGraph.Clicked) -> None:
        self._opening = False
        if message.graph.compact and message.graph.gpu != self.gpu:
            self.cursor_ts = message.ts
            self.action_show_gpu(message.graph.gpu)
            return
        self._set_cursor(message.ts)

    @on(TimelineGraph.Scrolled)
    def _scrolled(self, message: TimelineGraph.Scrolled) -> None:
        self.action_zoom(0.5 if message.direction < 0 else 2.0, around=message.ts)

    def on_resize(self, event: events.Resize) -> None:
        self.narrow = narrow = event.size.width < 100
        self.set_class(narrow, "narrow")
        self.set_class(event.size.height < 30, "short")
        try:
            self.query_one(Footer).compact = narrow
            holders = self.query_one("#holders", HoldersTable)
        except NoMatches:
            return
        if holders.narrow != narrow:
            holders.narrow = narrow
            holders.show(self.cursor_state, self.other_state)
        self.refresh_all()
