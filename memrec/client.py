"""Phase markers from inside a program: :func:`mark` and :func:`phase`.

They never block and never raise into the host program:

- one lazily connected, non-blocking Unix stream socket per process (a forked child opens its
  own: the pid is checked on every call);
- no daemon means a no-op returning False, and a new connection is tried at most once a second;
- a full socket (EAGAIN) drops the marker and counts it;
- a marker from a signal handler that interrupted this thread inside the client (a mark, a flush)
  is dropped as ``busy`` at once, never made to wait for the lock its own thread holds; another
  thread's send is waited for at most :data:`LOCK_WAIT`;
- dropped markers are not silently lost: the counts, by reason, travel to the daemon as one
  ``markers_dropped`` marker (:data:`DROPPED_MARKER`) ahead of the next marker that gets through
  (and at exit), so the trace says how many of this process's markers it is missing and why;
- a frame is never cut in the stream: when the kernel takes only part of one, the remainder is
  kept (at most :data:`PENDING_CAP` bytes) and written before anything else; a connection that
  cannot take its remainder is dropped;
- a connection the daemon closed (it closes idle ones) is noticed before the next marker, which
  goes out on a new one.

Timestamps are ``time.monotonic_ns()``, the clock of ``bpf_ktime_get_ns`` and of the probes.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import socket
import threading
import time
from typing import Any
from typing import Callable

from memrec.terms import protocol

log = logging.getLogger(__name__)

#: The most bytes of unsent frames kept for a connection that accepted part of a frame.
PENDING_CAP = 2 * protocol.MAX_CLIENT_FRAME
#: Seconds between two attempts to reach a daemon that was not there.
RECONNECT_INTERVAL = 1.0
#: The longest a marker waits for another thread's send (which takes microseconds) before it is dropped.
LOCK_WAIT = 0.01
_MAX_ERROR_TEXT = 1000
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0) | getattr(socket, "MSG_DONTWAIT", 0)
_RETRY_LATER = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR, errno.ENOBUFS)

#: The marker that reports this process's dropped markers (cumulative counts, by reason).
DROPPED_MARKER = "markers_dropped"
#: Why a marker was dropped (the value keys of :data:`DROPPED_MARKER`, each a count).
DROP_REASONS = ("no_daemon", "socket_full", "connection_lost", "busy", "invalid")


def _scalar(value: Any) -> Any:
    """Turn a value into something the protocol carries (numpy/torch scalars, paths, ...)."""
    if protocol.is_scalar(value):
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except Exception:
            pass
        else:
            if protocol.is_scalar(value):
                return value
    try:
        return str(value)[:_MAX_ERROR_TEXT]
    except Exception:
        return f"<{type(value).__name__}>"


class MarkerClient:
    """One process's connection to the daemon's marker socket.

    Args:
        path: the socket; None resolves ``$MEMREC_SOCKET`` or the default at each connect.
        clock: the timestamp clock (CLOCK_MONOTONIC ns).
        reconnect_interval: seconds between two connect attempts while no daemon answers.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        reconnect_interval: float = RECONNECT_INTERVAL,
    ) -> None:
        self.path = path
        self.clock = clock
        self.reconnect_interval = reconnect_interval
        self._reset()

    def _reset(self) -> None:
        """Forget the connection (at creation and in a forked child, whose socket is the parent's)."""
        self._lock = threading.RLock()  # (see _locked: its owner is known; re-entry is refused there)
        #: threads inside _locked() from before they try the lock until after they release it
        self._inside: set[int] = set()
        self._pid = os.getpid()
        self._sock: socket.socket | None = None
        self._pending = bytearray()
        self._last_attempt: float | None = None
        #: markers handed to the kernel (whole, or started with the rest pending)
        self.sent = 0
        #: markers dropped: no daemon, full socket, broken connection, bad arguments
        self.dropped = 0
        #: the same, by reason (:data:`DROP_REASONS`)
        self.drops = dict.fromkeys(DROP_REASONS, 0)
        #: how many of the drops the daemon has been told about
        self.dropped_reported = 0
        self._first_drop_ts: int | None = None
        self._last_drop_ts: int | None = None

    # -- public --------------------------------------------------------------------------------

    def mark(self, name: str, phase: str = "instant", gpu: int | None = None, **values: Any) -> bool:
        """Send one marker; return True when it was handed to the daemon's socket.

        Never raises and never blocks (see the module docstring).
        """
        try:
            return self._mark(name, phase, gpu, values)
        except Exception as error:  # never into the host program
            self._drop("invalid")
            log.debug("memrec marker %r dropped: %s", name, error)
            return False

    def flush(self) -> bool:
        """Try to write a pending frame remainder and any unreported drops (one connect attempt
        when there are drops to report); True when nothing is left pending."""
        try:
            if os.getpid() != self._pid:
                self._after_fork()
            return self._locked(self._flush, False)
        except Exception:
            return False

    def close(self) -> None:
        """Close the connection (a later mark() reconnects)."""
        with contextlib.suppress(Exception):
            if os.getpid() != self._pid:
                self._after_fork()
            self._locked(self._close, None)

    @property
    def connected(self) -> bool:
        """Whether this process holds a connection now."""
        return self._sock is not None and os.getpid() == self._pid

    # -- internals -----------------------------------------------------------------------------

    def _locked(self, action: Callable[[], Any], busy: Any) -> Any:
        """``action()`` under the lock; ``busy`` when this thread is inside already or another
        thread keeps the lock for :data:`LOCK_WAIT`.

        A signal handler runs on the thread it interrupts, so a mark from a handler that
        interrupted a mark (or a flush) must not wait for the lock: its own thread holds it and
        cannot release it before the handler returns, and the wait is interruptible, so the next
        signal's handler re-enters and waits again, without end. The thread is marked inside
        before it tries the lock and until after it released it: there is no instant at which a
        handler finds the lock held by its own thread and the thread not marked inside.
        """
        me = threading.get_ident()
        if me in self._inside:  # re-entered (a signal handler interrupted this thread inside)
            return busy
        try:
            self._inside.add(me)
            if not self._lock.acquire(timeout=LOCK_WAIT):  # another thread holds it for microseconds
                return busy
            return action()
        finally:
            # Released by its owner whatever came after the acquire: action()'s return, or an
            # exception a signal handler raised at any instant after it (a KeyboardInterrupt
            # between the acquire and a try would keep it held, and drop every later mark as
            # busy). The lock is an RLock because it knows its owner: the release of a caller
            # that did not get it (busy) is refused, not carried out.
            with contextlib.suppress(RuntimeError):
                self._lock.release()
            self._inside.discard(me)

    def _flush(self) -> bool:
        """flush() under the lock (one connect attempt when there are drops to report)."""
        if self.dropped > self.dropped_reported:
            self._last_attempt = None
            self._send(b"", count=False)
        if self._sock is None:
            return not self._pending
        self._flush_pending()
        return not self._pending

    def _close(self) -> None:
        """close() under the lock (the next mark connects at once)."""
        self._disconnect()
        self._last_attempt = None

    def _after_fork(self) -> None:
        old = self._sock
        self._reset()
        if old is not None:
            # The parent keeps its own reference: closing ours does not shut its stream down.
            with contextlib.suppress(OSError):
                old.close()

    def _mark(self, name: str, phase: str, gpu: int | None, values: dict) -> bool:
        ts = self.clock()
        tid = threading.get_native_id()
        if os.getpid() != self._pid:
            self._after_fork()
        message = protocol.make_mark(
            str(name)[: protocol.MAX_NAME],
            phase,
            int(ts),
            tid,
            None if gpu is None else int(gpu),
            {str(k)[: protocol.MAX_VALUE_KEY]: _scalar(v) for k, v in values.items()},
        )
        problem = protocol.validate_mark(message)
        if problem:
            self._drop("invalid")
            log.debug("memrec marker dropped: %s", problem)
            return False
        data = protocol.encode_frame(message)  # ProtocolError (too large) → dropped by mark()
        sent = self._locked(lambda: self._send(data), None)
        if sent is None:
            self._drop("busy")
            return False
        return sent

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self.drops[reason] += 1
        ts = self.clock()
        if self._first_drop_ts is None:
            self._first_drop_ts = ts
        self._last_drop_ts = ts

    def _drop_report(self) -> tuple[bytes, int]:
        """The :data:`DROPPED_MARKER` frame when drops are not reported yet, else nothing, and the
        count it reports (a signal handler may drop one more before the frame is sent: that one
        is left for the next report)."""
        dropped, drops = self.dropped, dict(self.drops)  # one snapshot (no signal check between)
        if dropped <= self.dropped_reported:
            return b"", self.dropped_reported
        values = {"dropped": dropped, "since_last_report": dropped - self.dropped_reported,
                  "first_drop_ts": self._first_drop_ts, "last_drop_ts": self._last_drop_ts, **drops}
        message = protocol.make_mark(DROPPED_MARKER, "instant", int(self.clock()), threading.get_native_id(), None, values)
        return protocol.encode_frame(message), dropped

    def _send(self, data: bytes, count: bool = True) -> bool:
        """Send ``data`` (one frame; ``count=False``: only the drop report) after the drop report."""
        if self._sock is not None and self._peer_closed():
            # The daemon closed an idle connection (or restarted): reconnect now, lose nothing.
            self._disconnect()
            self._last_attempt = None
        if self._sock is None and not self._connect():
            if count:
                self._drop("no_daemon")
            return False
        if self._pending:
            self._flush_pending()
            if self._sock is None:  # the connection broke while flushing
                if count:
                    self._drop("connection_lost")
                return False
        report, reported = self._drop_report()
        if self._pending:
            if len(self._pending) + len(report) + len(data) > PENDING_CAP:
                if count:
                    self._drop("socket_full")
                return False
            self._pending += report + data
            self.dropped_reported = reported
            self.sent += count
            return True
        frames = report + data
        try:
            n = self._sock.send(frames, _SEND_FLAGS)
        except OSError as error:
            lost = error.errno not in _RETRY_LATER
            if lost:
                self._disconnect()
            if count:
                self._drop("connection_lost" if lost else "socket_full")
            return False
        if n < len(frames):
            self._pending += frames[n:]
        self.dropped_reported = reported
        self.sent += count
        return True

    def _peer_closed(self) -> bool:
        """Whether the daemon has closed this connection (it never writes to a marker client
        except an error just before closing)."""
        assert self._sock is not None
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) is not None
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def _flush_pending(self) -> None:
        assert self._sock is not None
        try:
            n = self._sock.send(self._pending, _SEND_FLAGS)
        except OSError as error:
            if error.errno not in _RETRY_LATER:
                self._disconnect()
            return
        del self._pending[:n]

    def _connect(self) -> bool:
        now = time.monotonic()
        if self._last_attempt is not None and now - self._last_attempt < self.reconnect_interval:
            return False
        self._last_attempt = now
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.connect(protocol.socket_path(self.path))
        except OSError:
            sock.close()
            return False
        self._sock = sock
        self._pending.clear()
        return True

    def _disconnect(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None
        self._pending.clear()


class Phase(contextlib.ContextDecorator):
    """``with memrec.phase(name):`` (or ``@memrec.phase(name)``): begin and end markers.

    The end marker carries an ``error`` value (``"Type: message"``) when the body raised; the
    exception always propagates unchanged.
    """

    def __init__(self, client: MarkerClient | None, name: str, gpu: int | None = None, **values: Any) -> None:
        self._client = client
        self.name = name
        self.gpu = gpu
        self.values = values

    def _target(self) -> MarkerClient:
        return self._client if self._client is not None else _default_client()

    def __enter__(self) -> Phase:
        self._target().mark(self.name, "begin", self.gpu, **self.values)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self._target().mark(self.name, "end", self.gpu)
        else:
            try:
                text = f"{exc_type.__name__}: {exc}"[:_MAX_ERROR_TEXT]
            except Exception:
                text = exc_type.__name__
            self._target().mark(self.name, "end", self.gpu, error=text)
        return False  # re-raise


_client: MarkerClient | None = None
_client_lock = threading.Lock()


def _default_client() -> MarkerClient:
    global _client
    if _client is None:
        with _client_lock:
            if _client is None:
                _client = MarkerClient()
    return _client


def mark(name: str, phase: str = "instant", gpu: int | None = None, **values: Any) -> bool:
    """Send a phase marker to the memrec daemon; return True when it was sent.

    Args:
        name: what is happening (1..200 characters).
        phase: ``"begin"``, ``"end"`` or ``"instant"``.
        gpu: the CUDA device ordinal this marker is about, as this process numbers devices (the
            daemon maps it to the physical GPU through the process's CUDA_VISIBLE_DEVICES).
        **values: numbers, strings, booleans or None to record with the marker.

    Never raises and never blocks: without a daemon it does nothing and returns False.
    """
    try:
        return _default_client().mark(name, phase, gpu, **values)
    except Exception:
        return False


def phase(name: str, gpu: int | None = None, **values: Any) -> Phase:
    """``with memrec.phase("load_weights", gpu=0):`` marks the block's begin and end."""
    return Phase(None, name, gpu, **values)


def stats() -> dict:
    """Counts of this process's markers: ``sent``, ``dropped`` (and ``drops`` by reason,
    ``dropped_reported``: how many of them the daemon was told about)."""
    client = _default_client()
    return {"sent": client.sent, "dropped": client.dropped, "drops": dict(client.drops),
            "dropped_reported": client.dropped_reported, "connected": client.connected}


def _at_exit() -> None:
    if _client is not None:
        _client.flush()


atexit.register(_at_exit)
