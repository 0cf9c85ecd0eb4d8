"""Live subscribers: each gets the trace's records as frames, the same bytes the file gets.

A new subscriber first gets a *sync*: the current file's header, a keyframe of the live state and
the known processes (the daemon builds it, :meth:`Fanout.add`); after that every record the trace
writer emits (:meth:`Fanout.publish`, the writer's ``tee``).

Writes never block: each subscriber has a queue, written as far as its socket takes and continued
when the selector says it is writable. A queue over ``max_queue_bytes`` is emptied (the frame
being written is kept whole, so the stream is never cut) and the subscriber is marked for a
*resync*: from then on it gets nothing until the daemon's loop sends it a ``lost`` notice with
the number of records it missed, the header and a fresh keyframe. A subscriber that overflows
again right after a resync, or whose resync alone does not fit, is disconnected.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import selectors
import socket
from typing import Callable

from memrec.trace.frames import encode_frame

log = logging.getLogger(__name__)


class Subscriber:
    """One live subscriber's socket and queue."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.queue: collections.deque[bytes] = collections.deque()
        self.offset = 0  # bytes of queue[0] already sent
        self.queued = 0  # bytes in the queue, minus offset
        self.needs_resync = False
        self.dropped = 0  # records not delivered (cumulative)
        self.dropped_unreported = 0  # not yet told in a lost notice
        self.overflows = 0
        self.sent_since_resync = 0
        self.writing = False  # EVENT_WRITE registered


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

    def add(self, sock: socket.socket, sync: list[bytes]) -> Subscriber:
        """Take over a connected socket and queue its ``sync`` records (encoded record bytes)."""
        sock.setblocking(False)
        sub = Subscriber(sock)
        self._subs[sub.fd] = sub
        self.total_subscribers += 1
        self.selector.register(sock, selectors.EVENT_READ, lambda mask, fd=sub.fd: self._ready(fd, mask))
        frames = [encode_frame(r) for r in sync]
        if sum(map(len, frames)) > self.max_queue_bytes:
            log.warning("live subscriber: its first sync (%d bytes) exceeds the queue limit; disconnected",
                        sum(map(len, frames)))
            self._drop(sub)
            return sub
        for f in frames:
            self._enqueue(sub, f)
        self._write(sub)
        return sub

    def publish(self, record: bytes) -> None:
        """Send one encoded record (the bytes the file gets) to every subscriber."""
        if not self._subs:
            return
        data = encode_frame(record)
        for sub in list(self._subs.values()):
            if sub.needs_resync:
                sub.dropped += 1
                sub.dropped_unreported += 1
                self.dropped_records += 1
                continue
            if sub.queued + len(data) > self.max_queue_bytes:
                self._overflow(sub)
                sub.dropped += 1
                sub.dropped_unreported += 1
                self.dropped_records += 1
                continue
            self._enqueue(sub, data)
            sub.sent_since_resync += 1
            self._write(sub)

    def resync(self, make_sync: Callable[[int], list[bytes]]) -> None:
        """Resynchronise every subscriber that overflowed.

        ``make_sync(dropped)`` returns the records to send (a lost notice counting ``dropped``
        records, the header, a keyframe...); the daemon flushes its writer first, so the keyframe
        covers every record the subscriber will get after it.
        """
        for sub in list(self._subs.values()):
            if not sub.needs_resync:
                continue
            frames = [encode_frame(r) for r in make_sync(sub.dropped_unreported)]
            if sub.queued + sum(map(len, frames)) > self.max_queue_bytes:
                log.warning("live subscriber fd %d cannot keep up even after a resync; disconnected", sub.fd)
                self.disconnected_slow += 1
                self._drop(sub)
                continue
            sub.needs_resync = False
            sub.dropped_unreported = 0
            sub.sent_since_resync = 0
            for f in frames:
                self._enqueue(sub, f)
            self._write(sub)

    def close(self) -> None:
        """Try once more to write what is queued, then disconnect everybody."""
        for sub in list(self._subs.values()):
            self._write(sub)
            self._drop(sub)

    # -- internals ------------------------------------------------------------------------------

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
        head = sub.queue[0] if keep_head else None
        sub.queue.clear()
        sub.queued = 0
        if head is not None:
            sub.queue.append(head)
            sub.queued = len(head) - sub.offset
        else:
            sub.offset = 0
        sub.dropped += dropped
        sub.dropped_unreported += dropped
        self.dropped_records += dropped
        sub.needs_resync = True
        log.warning("live subscriber fd %d is too slow: %d queued records dropped, resync pending", sub.fd, dropped)

    def _enqueue(self, sub: Subscriber, data: bytes) -> None:
        sub.queue.append(data)
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
