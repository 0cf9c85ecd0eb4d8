"""The daemon's keyframes: none when nothing changed, and the periodic ones built off the loop.

A keyframe is the whole live state; at a million live allocations it is tens of MiB to sort and
compress. Built on the loop it stalled the drain for most of a second every interval (events
lost), and written when nothing happened it filled an idle host's disk. Here:

- a keyframe is skipped when the state applied no event since the last one of the same file;
- and a periodic one is skipped until the file has grown by ``(1 - share) / share`` times the
  last keyframe's size since it (``share``: the most of a file keyframes may take, 0.2 by
  default): at a million live allocations a keyframe is 2.5 MB, and one every 10 s made more than
  half of a busy host's file (issue 26). The time interval stays the most often one is taken;
  the bytes between two bound what a seek replays (about 4 × a keyframe's bytes of events);
- the periodic one is *taken* on the loop (:meth:`memrec.state.LiveState.snapshot_later`: plain
  copies of numpy columns) and *built* in a thread (numpy's sort and zlib release the interpreter
  lock); the loop writes it when done, valid after the events the file held when it was taken.
- a file's first keyframe must come before the file's events: it is taken on the loop like a
  periodic one, and the file's :class:`HoldingSink` holds every record after it (in memory,
  bounded by ``max_held`` bytes, past which the loop waits for the build) until the thread is
  done; then the keyframe is written, followed by the held records in their order. A crash in
  between leaves the header and the process records: a readable file with no event. The last
  keyframe at stop is written at once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any
from typing import Callable

from memrec.state import LiveState
from memrec.trace.writer import Sink
from memrec.trace.writer import TraceWriter

log = logging.getLogger(__name__)

#: The most bytes a file holds back while its first keyframe is built; past it the loop waits.
MAX_HELD_BYTES = 64 << 20
#: The most of a file the periodic keyframes may take (see :meth:`Keyframes.grown`).
SHARE = 0.2
#: Keyframes smaller than this (a few thousand live allocations) are taken on time alone.
MIN_BYTES = 64 << 10


class Build(threading.Thread):
    """One keyframe being built (``finish`` runs in the thread; its result is ``snapshot``)."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        super().__init__(name="memrec-keyframe", daemon=True)
        self._finish = finish
        self.snapshot: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.snapshot = self._finish()
        except BaseException as error:  # handed to the loop, which raises it there
            self.error = error


class HoldingSink:
    """The daemon's sink: hands each record to the file and to the live subscribers (``tee``),
    or holds it back (:meth:`hold`) while the file's first keyframe is built.

    The file's own sink is kept as ``sink``; the writer reads its state (``stalled``, ``dropped_*``,
    ``replaced``, ``path``) through this one.
    """

    def __init__(self, sink: Sink, tee: Callable[[bytes], None] | None = None) -> None:
        self.sink = sink
        self.tee = tee
        self.path = getattr(sink, "path", None)
        self.held: list[bytes] | None = None
        self.held_bytes = 0

    replaced = property(lambda self: getattr(self.sink, "replaced", False))
    stalled = property(lambda self: getattr(self.sink, "stalled", None))
    dropped_records = property(lambda self: getattr(self.sink, "dropped_records", 0))
    dropped_bytes = property(lambda self: getattr(self.sink, "dropped_bytes", 0))

    def write_record(self, data: bytes) -> None:
        if self.held is not None:
            self.held.append(data)
            self.held_bytes += len(data)
            return
        self.sink.write_record(data)
        if self.tee is not None:
            self.tee(data)

    def flush(self) -> None:
        self.sink.flush()

    def close(self) -> None:
        """Close the file; records still held are dropped, as a crash would (they would come
        before the keyframe that covers them)."""
        if self.held:
            log.warning("the trace closed before its first keyframe was built: %d records not written", len(self.held))
        self.held = None
        self.sink.close()

    def hold(self) -> None:
        """Hold every record from now on until :meth:`release`."""
        self.held = []
        self.held_bytes = 0

    def release(self) -> list[bytes]:
        """Stop holding; return the records held, in order, for :meth:`pass_on`."""
        held, self.held, self.held_bytes = self.held or [], None, 0
        return held

    def pass_on(self, records: list[bytes]) -> None:
        for data in records:
            self.write_record(data)


class Keyframes:
    """Decides when the daemon writes a keyframe; builds a file's first and the periodic ones in a thread."""

    def __init__(self, max_held: int = MAX_HELD_BYTES, share: float = SHARE) -> None:
        # writer, ts, index, n, build, and the sink holding the file's records (a first keyframe)
        self._job: tuple[TraceWriter, int, int, int, Build, HoldingSink | None] | None = None
        self.max_held = max_held
        self.share = share
        self._last: tuple[TraceWriter, int] | None = None  # (file, events applied) of the last keyframe
        #: Keyframes written and skipped (nothing changed, or the file not grown enough) so far.
        self.written = 0
        self.skipped = 0
        #: Times the loop waited for a first keyframe because the records held back passed ``max_held``.
        self.waited = 0

    @property
    def holding(self) -> bool:
        """Whether a file's first keyframe is being built (its records held back)."""
        return self._job is not None and self._job[5] is not None

    def changed(self, writer: TraceWriter, state: LiveState) -> bool:
        """Whether ``state`` applied events since the last keyframe of ``writer``'s file."""
        last = self._last
        return last is None or last[0] is not writer or last[1] != state.n_events

    def grown(self, writer: TraceWriter) -> bool:
        """Whether ``writer``'s file grew enough since its last keyframe for the next one to take
        at most :attr:`share` of it (the next one as large as the last)."""
        if self.share <= 0 or self.share >= 1 or writer.last_keyframe_size < MIN_BYTES:
            return True
        since = writer.bytes_written - writer.last_keyframe_end
        return since * self.share >= writer.last_keyframe_size * (1 - self.share)

    def start(self, writer: TraceWriter, state: LiveState, ts: int) -> bool:
        """Take a periodic keyframe at ``ts`` and build it in a thread; False when skipped
        (nothing changed, the file not grown enough since the last one, or the previous one is
        still being built)."""
        if self._job is not None:
            return False
        if not self.changed(writer, state) or not self.grown(writer):
            self.skipped += 1
            return False
        build = Build(state.snapshot_later())
        self._job = (writer, ts, writer.event_count, state.n_events, build, None)
        build.start()
        return True

    def start_first(self, writer: TraceWriter, holder: HoldingSink, state: LiveState, ts: int) -> None:
        """Take a new file's first keyframe at ``ts`` (the file holds no event yet) and build it in
        a thread; ``holder`` (the file's sink) holds every record after it until :meth:`collect`
        writes the keyframe. A periodic one still being built for the previous file is dropped."""
        assert writer.event_count == 0
        self._job = None
        build = Build(state.snapshot_later())
        holder.hold()
        self._job = (writer, ts, 0, state.n_events, build, holder)
        build.start()

    def collect(self, writer: TraceWriter | None, wait: bool = False) -> bool:
        """Write the keyframe built in the thread once it is done (``wait``: wait for it); one
        taken for another file (rotated since) is dropped. Return whether one was written."""
        job = self._job
        if job is None:
            return False
        taken_for, ts, index, n, build, holder = job
        if taken_for is not writer or writer is None or writer.closed:
            self._job = None  # the file it was taken for is closed: the thread ends on its own
            return False
        if not wait and build.is_alive():
            if holder is None or holder.held_bytes <= self.max_held:
                return False
            self.waited += 1
            log.warning("%d bytes held back behind the new file's first keyframe: waiting for it", holder.held_bytes)
        build.join()
        self._job = None
        if build.error is not None:
            raise build.error
        assert build.snapshot is not None
        if holder is None:
            writer.write_keyframe(ts, index, build.snapshot)
        else:
            writer.flush()  # its unfinished chunks join the held records
            held = holder.release()
            writer.write_keyframe(ts, index, build.snapshot)
            holder.pass_on(held)
        self._last = (writer, n)
        self.written += 1
        return True

    def write_now(self, writer: TraceWriter, state: LiveState, ts: int, event_index: int | None = None) -> bool:
        """Write a keyframe at once (the last at stop) unless nothing changed since the last one
        of this file; one being built is written first."""
        self.collect(writer, wait=True)
        if not self.changed(writer, state):
            self.skipped += 1
            return False
        writer.write_keyframe(ts, event_index, state.snapshot())
        self._last = (writer, state.n_events)
        self.written += 1
        return True
