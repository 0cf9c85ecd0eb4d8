"""The daemon's keyframes: none when nothing changed, and the periodic ones built off the loop.

A keyframe is the whole live state; at a million live allocations it is tens of MiB to sort and
compress. Built on the loop it stalled the drain for most of a second every interval (events
lost), and written when nothing happened it filled an idle host's disk. Here:

- a keyframe is skipped when the state applied no event since the last one of the same file;
- the periodic one is *taken* on the loop (:meth:`memrec.state.LiveState.snapshot_later`: plain
  copies of numpy columns) and *built* in a thread (numpy's sort and zlib release the interpreter
  lock); the loop writes it when done, valid after the events the file held when it was taken.
  The file's first keyframe and the last one at stop are written at once.
"""

from __future__ import annotations

import threading
from typing import Callable

from memrec.state import LiveState
from memrec.trace.writer import TraceWriter


class _Build(threading.Thread):
    """One keyframe being built."""

    def __init__(self, finish: Callable[[], dict]) -> None:
        super().__init__(name="memrec-keyframe", daemon=True)
        self._finish = finish
        self.snapshot: dict | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.snapshot = self._finish()
        except BaseException as error:  # handed to the loop, which raises it there
            self.error = error


class Keyframes:
    """Decides when the daemon writes a keyframe and builds the periodic ones in a thread."""

    def __init__(self) -> None:
        self._job: tuple[TraceWriter, int, int, int, _Build] | None = None  # writer, ts, index, n, build
        self._last: tuple[TraceWriter, int] | None = None  # (file, events applied) of the last keyframe
        #: Keyframes written and skipped (nothing changed) so far.
        self.written = 0
        self.skipped = 0

    def changed(self, writer: TraceWriter, state: LiveState) -> bool:
        """Whether ``state`` applied events since the last keyframe of ``writer``'s file."""
        last = self._last
        return last is None or last[0] is not writer or last[1] != state.n_events

    def start(self, writer: TraceWriter, state: LiveState, ts: int) -> bool:
        """Take a periodic keyframe at ``ts`` and build it in a thread; False when skipped
        (nothing changed, or the previous one is still being built)."""
        if self._job is not None:
            return False
        if not self.changed(writer, state):
            self.skipped += 1
            return False
        build = _Build(state.snapshot_later())
        self._job = (writer, ts, writer.event_count, state.n_events, build)
        build.start()
        return True

    def collect(self, writer: TraceWriter | None, wait: bool = False) -> bool:
        """Write the keyframe built in the thread once it is done (``wait``: wait for it); one
        taken for another file (rotated since) is dropped. Return whether one was written."""
        job = self._job
        if job is None:
            return False
        taken_for, ts, index, n, build = job
        if taken_for is not writer or writer is None or writer.closed:
            self._job = None  # the file it was taken for is closed: the thread ends on its own
            return False
        if not wait and build.is_alive():
            return False
        build.join()
        self._job = None
        if build.error is not None:
            raise build.error
        assert build.snapshot is not None
        writer.write_keyframe(ts, index, build.snapshot)
        self._last = (writer, n)
        self.written += 1
        return True

    def write_now(self, writer: TraceWriter, state: LiveState, ts: int, event_index: int | None = None) -> bool:
        """Write a keyframe at once (a file's first, or the last at stop) unless nothing changed
        since the last one of this file; one being built is written first."""
        self.collect(writer, wait=True)
        if not self.changed(writer, state):
            self.skipped += 1
            return False
        writer.write_keyframe(ts, event_index, state.snapshot())
        self._last = (writer, state.n_events)
        self.written += 1
        return True
