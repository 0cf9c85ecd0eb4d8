"""The memrec TUI's app: it holds the data source and the timers, and routes the source's messages
to the :class:`~memrec.tui.screens.main.MainScreen`, which holds the view (one tab per GPU, the
all-GPUs overview, the keys).

The app takes its data source as an argument (a :class:`~memrec.tui.sources.Source`; tests pass
their own). Sources fill a :class:`~memrec.tui.model.TraceModel` from their own thread and post
messages; nothing else crosses between that thread and the UI.
"""

from __future__ import annotations

import gc
import time
from typing import Callable

from textual.app import App
from textual.screen import Screen

from memrec.tui import messages
from memrec.tui.model import TraceModel
from memrec.tui.screens.main import Link
from memrec.tui.screens.main import MainScreen
from memrec.tui.sources import Source


#: Seconds from the app's start that a file's replay waits for the first frame at most.
OPENING_HOLD = 3.0


class MemrecApp(App[None]):
    """memrec's TUI.

    Args:
        source: a FileSource, LiveSource or DiffSource (any :class:`~memrec.tui.sources.Source`).
        clock: seconds, monotonic (tests fix it); used for the stale-connection warning.
        stale_after: seconds without data from the daemon before the status line warns.
        refresh_interval: seconds between redraws while live data arrives.
    """

    CSS_PATH = "app.tcss"
    TITLE = "memrec"
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, source: Source, *, clock: Callable[[], float] = time.monotonic, stale_after: float = 3.0,
                 refresh_interval: float = 0.1) -> None:
        super().__init__()
        self.source = source
        self.clock = clock
        self.refresh_interval = refresh_interval
        self.link = Link(last_data=clock())
        self.main = MainScreen(source.model, source.other_model, source.title, live=source.live, link=self.link,
                               clock=clock, stale_after=stale_after)
        self._interacting_until = 0.0
        #: Until the first frame (the state at the cursor) is shown, or this time, a file's
        #: replay waits: it would share the GIL and the CPUs with the cursor's worker and the paint.
        self._opening_until = time.monotonic() + OPENING_HOLD
        self.sub_title = source.title
        source.busy = self._busy
        source.begin()  # a file is read while Textual starts; the first frame waits for it

    @property
    def model(self) -> TraceModel:
        """The model the view draws (the source's; a live source's changes on a daemon restart)."""
        return self.source.model

    def get_default_screen(self) -> Screen:
        return self.main

    def on_main_screen_ready(self, message: MainScreen.Ready) -> None:
        self.set_interval(self.refresh_interval, self.main.tick)
        self.source.start(self.post_message)

    def _busy(self) -> bool:
        """Whether a file's replay should wait (called from its thread): the user presses keys,
        or the first frame is not shown yet."""
        now = time.monotonic()
        return now < self._interacting_until or (now < self._opening_until and self.main.answered_key is None)

    def on_key(self) -> None:
        self._interacting_until = time.monotonic() + 0.5

    def on_mouse_down(self) -> None:
        self._interacting_until = time.monotonic() + 0.5

    def on_unmount(self) -> None:
        self.source.stop()

    # ------------------------------------------------------------------ the source's messages

    def on_load_progress(self, message: messages.LoadProgress) -> None:
        self.main.source_progress(message)

    def on_loaded(self, message: messages.Loaded) -> None:
        self.main.source_loaded()
        self._freeze_heap()
        # the overview asks for no state at the cursor: nothing to wait for
        self._opening_until = min(self._opening_until, time.monotonic() + 0.5) if self.main.gpu != -1 else 0.0

    def on_scanned(self, message: messages.Scanned) -> None:
        self._freeze_heap()
        self.main.source_scanned()

    def on_indexed(self, message: messages.Indexed) -> None:
        self._freeze_heap()
        self.main.source_indexed()

    def on_answered(self, message: messages.Answered) -> None:
        self.main.source_answered(message)

    def _freeze_heap(self) -> None:
        """A file's model is built once and kept: move what is alive now out of the cyclic GC's
        reach (``gc.freeze``), so that a full collection, run by whichever thread allocates, walks
        only what came after (on a 10M-event trace one took 45-100 ms, stalling a key press).
        Not in live mode, whose model is trimmed and rebuilt: frozen cycles would never be freed."""
        if not self.source.live:
            gc.freeze()

    def on_source_failed(self, message: messages.SourceFailed) -> None:
        self.main.source_failed(message.error)

    def on_connected(self, message: messages.Connected) -> None:
        if self.model.store.n or self.model.header:
            # the daemon restarted (or we reconnected): its stream starts over with a header
            self.source.model = self.source.new_model()
            self.main.set_model(self.source.model)
        self.link.connected = True
        self.link.note = ""
        self.link.last_data = self.clock()
        self.main.data_changed()

    def on_disconnected(self, message: messages.Disconnected) -> None:
        self.link.connected = False
        self.link.note = f"{message.reason}; retrying in {message.retry_in:.1f}s"
        self.main.tick()

    def on_records_received(self, message: messages.RecordsReceived) -> None:
        m = self.model
        for rec in message.records:
            m.add_record(rec, live=True)
        m.index_step(1 << 62)
        m.trim()
        self.link.last_data = self.clock()
        self.main.data_changed()
