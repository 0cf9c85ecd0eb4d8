"""Live subscribers: each gets the trace's records as frames, the same bytes the file gets.

A new subscriber first gets a *sync*: the current file's header, the known processes and a
keyframe of the live state; after that every record the trace writer emits (:meth:`Fanout.publish`,
the writer's ``tee``). At a million live allocations a keyframe takes a quarter of a second to
build, too long for the daemon's loop: the loop takes the state cheaply (:meth:`Fanout.start_sync`)
and a thread builds the keyframe; meanwhile every record published is kept (bounded by
``max_queue_bytes``) and the subscriber gets it after its keyframe (:meth:`Fanout.collect`).
Subscribers that come while a sync is being built join that one.

Writes never block: each subscriber has a queue, written as far as its socket takes and continued
when the selector says it is writable. A queue over ``max_queue_bytes`` is emptied (the frame
being written is kept whole, so the stream is never cut) and the subscriber is marked for a
*resync*: from then on it gets nothing until the daemon's loop sends it a ``lost`` notice with
the number of records it missed (:meth:`Fanout.resync`; not those a sync it joins sends again),
then a sync like a new subscriber's. A subscriber that overflows
again right after a resync, or whose resync alone does not fit, is disconnected.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import selectors
import socket
from typing import Callable

from memrec.daemon.keyframes import Build
from memrec.trace.frames import encode_frame

log = logging.getLogger(__name__)


class Subscriber:
    """One live subscriber's socket and queue."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.queue: collections.deque[bytes] = collections.deque()
        #: per frame of ``queue``, the number of the published record it is (None: a sync's own frame)
        self.seqs: collections.deque[int | None] = collections.deque()
        self.offset = 0  # bytes of queue[0] already sent
        self.queued = 0  # bytes in the queue, minus offset
        self.needs_resync = False
        self.dropped = 0  # records not delivered (cumulative)
        self.dropped_unreported = 0  # not yet told in a lost notice
        #: the first published record it missed since its last resync (from it on it missed every one)
        self.first_dropped: int | None = None
        self.overflows = 0
        self.sent_since_resync = 0
        self.writing = False  # EVENT_WRITE registered
        self.syncing = True  # waits for its sync (gets no published record directly)
        self.notice: list[bytes] = []  # frames sent after the header of its sync (a lost notice)


class _Sync:
    """A sync being built: the frames before its keyframe (header, processes), the thread that
    builds the keyframe's record, every frame published since, and who waits for it."""

    def __init__(self, head: list[bytes], build: Build, start: int) -> None:
        self.head = [encode_frame(r) for r in head]
        self.build = build
        self.start = start  # the number of the first published record in ``tail``
        self.tail: list[bytes] = []
        self.tail_bytes = 0
        self.subs: list[Subscriber] = []


class Fanout:
    """All live subscribers of the daemon.

    Args:
        selector: the daemon's selector (callables as ``key.data``, called with the event mask).
        max_queue_bytes: the most bytes queued for one subscriber.
    """

    def __init__(self, selector: selectors.BaseSelector, max_queue_bytes: int = 64 << 20) -> None:
        self.selector = selector
        self.max_queue_bytes = max_queue_bytes
        self._subs: dict[int, Subscriber] = {}
        self._sync: _Sync | None = None
        #: records published so far (each one's number, from 0, is its place in this count)
        self.published = 0
        #: counters
        self.total_subscribers = 0
        self.disconnected_slow = 0
        self.dropped_records = 0

    def __len__(self) -> int:
        return len(self._subs)

    @property
    def subscribers(self) -> list[Subscriber]:
        return list(self._subs.values())

    @property
    def needs_resync(self) -> bool:
        """Whether some subscriber waits for :meth:`resync`."""
        return any(s.needs_resync for s in self._subs.values())

    @property
    def wants_sync(self) -> bool:
        """Whether a subscriber waits for a sync that is not being built: call :meth:`start_sync`."""
        return self._sync is None and any(s.syncing for s in self._subs.values())

    def add(self, sock: socket.socket) -> Subscriber:
        """Take over a connected socket; it gets its sync from the one being built, else from the
        next :meth:`start_sync`."""
        sock.setblocking(False)
        sub = Subscriber(sock)
        self._subs[sub.fd] = sub
        self.total_subscribers += 1
        self.selector.register(sock, selectors.EVENT_READ, lambda mask, fd=sub.fd: self._ready(fd, mask))
        if self._sync is not None:
            self._sync.subs.append(sub)
        return sub

    def start_sync(self, head: list[bytes], finish: Callable[[], bytes]) -> None:
        """Sync every subscriber that waits: ``head`` (header, processes: encoded records) and the
        keyframe record ``finish()`` builds in a thread, taken when every record before it was
        published; what is published until then follows it."""
        assert self._sync is None
        self._sync = _Sync(head, Build(finish), self.published)
        self._sync.subs = [s for s in self._subs.values() if s.syncing]
        self._sync.build.start()

    def collect(self, wait: bool = False) -> None:
        """Send the sync being built to its subscribers once it is done (``wait``: wait for it)."""
        sync = self._sync
        if sync is None or (sync.build.is_alive() and not wait):
            return
        sync.build.join()
        self._sync = None
        subs = [s for s in sync.subs if self._subs.get(s.fd) is s]
        if sync.build.error is not None:
            log.error("live subscribers: their keyframe failed (%s); %d disconnected",
                      type(sync.build.error).__name__, len(subs), exc_info=sync.build.error)
            for sub in subs:
                self._drop(sub)
            return
        keyframe = encode_frame(sync.build.snapshot)
        for sub in subs:
            frames = [*sync.head[:1], *sub.notice, *sync.head[1:], keyframe, *sync.tail]
            size = sum(map(len, frames))
            if sub.queued + size > self.max_queue_bytes:
                log.warning("live subscriber fd %d: its sync (%d bytes) exceeds the queue limit; disconnected",
                            sub.fd, size)
                self.disconnected_slow += 1
                self._drop(sub)
                continue
            sub.syncing = False
            sub.notice = []
            own = len(frames) - len(sync.tail)  # header, notice, processes, keyframe: then the tail's records
            for i, f in enumerate(frames):
                self._enqueue(sub, f, sync.start + i - own if i >= own else None)
            self._write(sub)

    def publish(self, record: bytes) -> None:
        """Send one encoded record (the bytes the file gets) to every subscriber."""
        if not self._subs:
            return
        seq = self.published
        self.published += 1
        data = encode_frame(record)
        sync = self._sync
        if sync is not None:
            sync.tail.append(data)
            sync.tail_bytes += len(data)
            if sync.tail_bytes > self.max_queue_bytes:
                self._abandon(sync)
        for sub in list(self._subs.values()):
            if sub.syncing:
                continue
            if sub.needs_resync or sub.queued + len(data) > self.max_queue_bytes:
                if not sub.needs_resync:
                    self._overflow(sub)
                sub.dropped += 1
                sub.dropped_unreported += 1
                self.dropped_records += 1
                if sub.first_dropped is None:
                    sub.first_dropped = seq
                continue
            self._enqueue(sub, data, seq)
            sub.sent_since_resync += 1
            self._write(sub)

    def resync(self, make_notice: Callable[[int], bytes]) -> None:
        """Resynchronise every subscriber that overflowed: it waits for a sync, which gets the
        ``lost`` notice ``make_notice(dropped)`` (an encoded record) after its header.

        One that joins a sync already being built gets that sync's tail: every record published
        since the sync began, so the records it missed from then on are not lost to it, and
        neither the notice nor the counts include them.
        """
        for sub in list(self._subs.values()):
            if not sub.needs_resync:
                continue
            if self._sync is not None and sub.first_dropped is not None:
                again = max(0, self.published - max(sub.first_dropped, self._sync.start))
                sub.dropped_unreported -= again
                sub.dropped -= again
                self.dropped_records -= again
            sub.notice = [encode_frame(make_notice(sub.dropped_unreported))]
            sub.needs_resync = False
            sub.dropped_unreported = 0
            sub.first_dropped = None
            sub.sent_since_resync = 0
            sub.syncing = True
            if self._sync is not None:
                self._sync.subs.append(sub)

    def close(self) -> None:
        """Try once more to write what is queued, then disconnect everybody."""
        for sub in list(self._subs.values()):
            self._write(sub)
            self._drop(sub)

    # -- internals ------------------------------------------------------------------------------

    def _abandon(self, sync: _Sync) -> None:
        """More was published while the sync was built than one subscriber may queue: its
        subscribers go (the thread ends on its own)."""
        self._sync = None
        subs = [s for s in sync.subs if self._subs.get(s.fd) is s]
        if subs:
            log.warning("live subscribers: %d bytes published while their keyframe was built; %d disconnected",
                        sync.tail_bytes, len(subs))
        self.disconnected_slow += len(subs)
        for sub in subs:
            self._drop(sub)

    def _overflow(self, sub: Subscriber) -> None:
        sub.overflows += 1
        if sub.overflows > 1 and sub.sent_since_resync == 0:
            log.warning("live subscriber fd %d overflowed right after a resync; disconnected", sub.fd)
            self.disconnected_slow += 1
            self._drop(sub)
            return
        # Keep the frame being written (the stream must not be cut), drop the rest.
        keep_head = sub.offset > 0
        dropped = len(sub.queue) - (1 if keep_head else 0)
        head = (sub.queue[0], sub.seqs[0]) if keep_head else None
        lost = [n for n in list(sub.seqs)[1 if keep_head else 0 :] if n is not None]
        sub.first_dropped = min(lost) if lost else None
        sub.queue.clear()
        sub.seqs.clear()
        sub.queued = 0
        if head is not None:
            sub.queue.append(head[0])
            sub.seqs.append(head[1])
            sub.queued = len(head[0]) - sub.offset
        else:
            sub.offset = 0
        sub.dropped += dropped
        sub.dropped_unreported += dropped
        self.dropped_records += dropped
        sub.needs_resync = True
        log.warning("live subscriber fd %d is too slow: %d queued records dropped, resync pending", sub.fd, dropped)

    def _enqueue(self, sub: Subscriber, data: bytes, seq: int | None = None) -> None:
        sub.queue.append(data)
        sub.seqs.append(seq)
        sub.queued += len(data)

    def _write(self, sub: Subscriber) -> None:
        while sub.queue:
            head = sub.queue[0]
            try:
                n = sub.sock.send(memoryview(head)[sub.offset :], socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(sub)
                return
            sub.offset += n
            sub.queued -= n
            if sub.offset == len(head):
                sub.queue.popleft()
                sub.seqs.popleft()
                sub.offset = 0
            else:
                break
        want = bool(sub.queue)
        if want != sub.writing and sub.fd in self._subs:
            sub.writing = want
            mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self.selector.modify(sub.sock, mask, lambda m, fd=sub.fd: self._ready(fd, m))

    def _ready(self, fd: int, mask: int) -> None:
        sub = self._subs.get(fd)
        if sub is None:
            return
        try:
            self._serve(sub, mask)
        except Exception as error:  # a bug met by one subscriber: that one goes, nobody else
            log.error("live subscriber fd %d: internal error (%s): disconnected", fd, type(error).__name__)
            log.debug("live subscriber: internal error", exc_info=True)
            self._drop(sub)

    def _serve(self, sub: Subscriber, mask: int) -> None:
        fd = sub.fd
        if mask & selectors.EVENT_READ:
            try:
                data = sub.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                data = b"-"
            except OSError:
                data = b""
            if not data:  # the subscriber went away
                log.info("live subscriber fd %d disconnected", fd)
                self._drop(sub)
                return
            # Anything a subscriber sends after subscribing is ignored.
        if mask & selectors.EVENT_WRITE:
            self._write(sub)

    def _drop(self, sub: Subscriber) -> None:
        if self._subs.pop(sub.fd, None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sub.sock)
        with contextlib.suppress(OSError):
            sub.sock.close()
