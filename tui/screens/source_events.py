"""What the main screen does when its source speaks (routed by the app): a file read, replayed,
answered, or failed.

Kept apart from :mod:`memrec.tui.screens.main` (layout and drawing) and
:mod:`memrec.tui.screens.view_keys` (the keys): these handlers set where the view opens. Until a key
is pressed (``_opening``), the view follows the best answer known: the model's own landmarks once
the file is read and replayed, then the trace's answer (:mod:`memrec.analysis.report.answer`, the one
``memrec report`` prints first) when the source has it: its window, its failure at the cursor, its
headline and cause in the status line; in diff mode ``memrec diff``'s verdict.
:class:`SourceEvents` is a mixin of :class:`~memrec.tui.screens.main.MainScreen`.
"""

from __future__ import annotations

from memrec.tui import messages
from memrec.tui.navigation import align
from memrec.tui.navigation import opening


class SourceEvents:
    """The source's messages (see the module docstring); the screen supplies the view's fields,
    ``refresh_all`` and ``_update_status``."""

    def source_progress(self, message: messages.LoadProgress) -> None:
        if message.phase == "scan":
            self.progress = f"reading… {message.done:,} records"
        else:
            self.progress = f"replaying {100 * message.done / max(message.total, 1):.0f}%"
        if message.phase == "index":
            self._dirty = True
        else:
            self._update_status()

    def source_loaded(self) -> None:
        """The file's start is read: show all of it (the trailer's time range), at the answer (the
        first failed call, else the peak of what the keyframes and the replay so far know)."""
        self.loaded = True
        if self.other_model is not None:
            self.alignment = align(self.model, self.other_model, self.model.time_range()[0], self.other_model.time_range()[0])
        self._show_all()

    def source_scanned(self) -> None:
        """The whole file is read (the first frame came from its start): a trace without a
        trailer now knows its end, and the answer so far its failures and markers."""
        if self._opening:
            self._show_all()
        else:
            self.refresh_all()

    def _show_all(self) -> None:
        """The whole time range on screen, the cursor at the answer (or the end)."""
        self.t0, self.t1 = self.model.time_range()
        self.t1 += max((self.t1 - self.t0) // 100, 1)
        self.cursor_ts = self.t1 - 1
        self._open_at_answer()
        self.refresh_all()

    def source_indexed(self) -> None:
        """The replay is done: the series (and so the peak) are exact."""
        self.indexed = True
        self.progress = ""
        self._open_at_answer()
        self.refresh_all()

    def source_answered(self, message: messages.Answered) -> None:
        """The trace's answer (after the replay): from now on the failures are its, and the view
        (unless the user has moved it) opens on its window."""
        self.model.landmarks.set_answer(message.answer)
        if message.other is not None and self.other_model is not None:
            self.other_model.landmarks.set_answer(message.other)
        self.verdict = message.verdict
        self._open_at_answer()
        self.refresh_all()

    def _open_at_answer(self) -> None:
        if not self._opening:
            return
        where = opening(self.model, self.other_model, self.verdict, self.alignment)
        if where is None:
            self.cursor_ts = self.model.time_range()[1]
            return
        if where.gpu is not None and where.gpu in self.model.gpu_ids():
            self.gpu = where.gpu  # the next redraw selects its tab (there may be no tabs yet)
            self._gpu_chosen = True
        if where.window is not None:
            self.t0, self.t1 = where.window.padded()
        self.cursor_ts = where.ts
        self.landing = where

    def source_failed(self, error: str) -> None:
        self.progress = f"[b red]{error}[/]"
        self._update_status()

