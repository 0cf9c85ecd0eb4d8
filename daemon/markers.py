"""The marker socket server: accepts clients, decodes their frames, stamps who sent them.

Every connection has its own :class:`~memrec.terms.protocol.FrameDecoder`; a marker is stamped with the
peer's pid and uid from ``SO_PEERCRED`` (taken by the kernel when the client connected), so a
client cannot speak for another process. A bad frame or message gets an ``error`` reply, the
connection is closed and counted; the server goes on serving everybody else.

The server registers its sockets in the daemon's selector with a callable as ``key.data``: the
daemon's loop calls ``key.data(mask)`` for each ready key.

No client can stop or starve the server (each defence has a test in tests/unit/test_hardening.py):

- anything that goes wrong while serving one client closes that client only;
- a frame not completed within ``frame_timeout`` seconds, and a connection silent for
  ``idle_timeout`` seconds, are closed (the memrec client reconnects on its next marker);
- one uid other than root holds at most ``per_uid`` connections, so one user cannot take every slot;
- when ``accept`` fails for lack of file descriptors, accepting pauses (backing off up to 2 s)
  instead of spinning on a listener that stays readable, and the failure is logged once per minute;
- subscribing to the live view is a right apart from sending markers (``may_subscribe``);
- one connection holds at most ``open_per_connection`` phases open (begun, not ended); a ``begin``
  beyond is dropped and counted (``on_drop``). The daemon's intake caps them per uid too, and
  budgets each uid's markers (daemon/intake.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import struct
import time
from typing import Callable

from memrec.terms import protocol
from memrec.base.untrusted import short_repr
from memrec.daemon.throttle import Throttle
from memrec.terms.events import Marker

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # pid, uid, gid
#: Bad frames logged at WARNING before the rest go to DEBUG (a broken client must not flood logs).
_LOUD_ERRORS = 20
_RECV = 65536
_CRED_SPACE = socket.CMSG_SPACE(_UCRED.size)
#: accept() errors that mean "no file descriptor or memory for now": pause accepting.
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_ACCEPT_BACKOFF = (0.05, 2.0)  # first and longest pause, seconds
#: Phases one connection may hold open (begun, not ended); root's connections too.
OPEN_PER_CONNECTION = 1024


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected ``sock`` (Linux SO_PEERCRED)."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(data)


def _recv_with_sender(sock: socket.socket) -> tuple[bytes, tuple[int, int] | None]:
    """Receive bytes and the (pid, uid) the kernel stamped them with (SO_PASSCRED is on).

    SO_PEERCRED names the process that *connected*; a child that inherited the connection and
    writes on it after a fork would be filed under its parent. With SO_PASSCRED the kernel
    attaches the writer's own credentials to what it wrote, and never hands bytes of two writers
    to one recvmsg.
    """
    data, ancdata, _flags, _addr = sock.recvmsg(_RECV, _CRED_SPACE)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _UCRED.size:
            pid, uid, _gid = _UCRED.unpack_from(payload)
            if pid > 0:
                return data, (pid, uid)
    return data, None


def root_only(_pid: int, uid: int, _gid: int) -> bool:
    """The default right to subscribe to the live view: root's processes only."""
    return uid == 0


def root_or_group(gid: int) -> Callable[[int, int, int], bool]:
    """A subscribe right for root and the members of group ``gid`` (primary or supplementary)."""

    def allowed(pid: int, uid: int, peer_gid: int) -> bool:
        return uid == 0 or peer_gid == gid or gid in _supplementary_groups(pid)

    return allowed


def _supplementary_groups(pid: int) -> set[int]:
    """The groups of a connected peer, from ``/proc/PID/status`` (empty when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:] if g.isdigit()}
    except OSError:
        pass
    return set()


class _Client:
    __slots__ = ("sock", "pid", "uid", "gid", "decoder", "last_active", "frame_started", "open_phases", "dropped")

    def __init__(self, sock: socket.socket, pid: int, uid: int, gid: int, now: float) -> None:
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.gid = gid
        self.decoder = protocol.FrameDecoder(protocol.MAX_CLIENT_FRAME)
        self.last_active = now
        self.frame_started: float | None = None  # when the frame now pending began to arrive
        self.open_phases = 0  # begins minus ends sent on this connection
        self.dropped: str | None = None  # why the last marker since the last ping was dropped


class MarkerServer:
    """Serves marker clients on a listening socket.

    Args:
        listener: a bound, listening, non-blocking Unix stream socket.
        selector: the daemon's selector; the server registers the listener and its clients.
        on_marker: gets each valid marker, stamped with the peer's pid and uid; returns why it
            dropped it (a reason string), or None when it took it. The next ``pong`` on the
            connection says ``dropped`` (`memrec mark` then tells its user).
        on_subscribe: takes over a connection that asked to subscribe (the server forgets it).
        on_connect: told ``(pid, uid)`` of each new peer at once (while it surely still runs).
        daemon_pid: the pid reported in ``pong``.
        max_clients: connections beyond this are accepted and closed at once.
        per_uid: the most connections one uid other than root may hold (default: a quarter of
            ``max_clients``).
        frame_timeout: seconds a started frame may take to arrive whole.
        idle_timeout: seconds a connection may stay silent before it is closed.
        may_subscribe: ``(pid, uid, gid) -> bool``: who may subscribe to the live view
            (default :func:`root_only`).
        open_per_connection: phases one connection may hold open; a ``begin`` beyond is dropped.
        on_drop: told ``(marker, reason)`` of each marker dropped here (the daemon counts them).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        listener: socket.socket,
        selector: selectors.BaseSelector,
        on_marker: Callable[[Marker], str | None],
        on_subscribe: Callable[[socket.socket], None] | None = None,
        on_connect: Callable[[int, int], None] | None = None,
        daemon_pid: int | None = None,
        max_clients: int = 1024,
        *,
        per_uid: int | None = None,
        frame_timeout: float = 10.0,
        idle_timeout: float = 600.0,
        may_subscribe: Callable[[int, int, int], bool] = root_only,
        open_per_connection: int = OPEN_PER_CONNECTION,
        on_drop: Callable[[Marker, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.listener = listener
        self.selector = selector
        self.on_marker = on_marker
        self.on_subscribe = on_subscribe
        self.on_connect = on_connect
        self.daemon_pid = os.getpid() if daemon_pid is None else daemon_pid
        self.max_clients = max_clients
        self.per_uid = per_uid if per_uid is not None else max(1, max_clients // 4)
        self.frame_timeout = frame_timeout
        self.idle_timeout = idle_timeout
        self.may_subscribe = may_subscribe
        self.open_per_connection = open_per_connection
        self.on_drop = on_drop
        self.clock = clock
        self._clients: dict[int, _Client] = {}
        self._per_uid: dict[int, int] = {}
        self.accepting = False
        self._paused_until: float | None = None  # accept() paused (out of fds) until then
        self._backoff = _ACCEPT_BACKOFF[0]
        self._accept_log = Throttle(log, 60.0, clock)
        self._bad_log = Throttle(log, 10.0, clock)
        #: counters, for the trailer and the tests
        self.connections = 0
        self.markers = 0
        self.errors = 0
        self.pings = 0
        self.refused = 0
        self.timed_out = 0
        self.accept_pauses = 0
        self.claims_refused = 0

    def start(self) -> None:
        """Start accepting connections."""
        if not self.accepting:
            self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
            self.accepting = True

    def stop_accepting(self) -> None:
        """Stop accepting new connections (connected clients are still served).

        Connections already waiting in the backlog are accepted first: their clients saw
        connect() succeed and may have sent markers already.
        """
        if self.accepting:
            if self._paused_until is None:
                self._accept(selectors.EVENT_READ)
            self._unregister_listener()
            self.accepting = False
            self._paused_until = None

    def close(self) -> None:
        """Stop accepting and close every client connection."""
        self.stop_accepting()
        for fd in list(self._clients):
            self._close(fd)

    @property
    def clients(self) -> int:
        """Marker clients connected now."""
        return len(self._clients)

    def stats(self) -> dict:
        return {
            "connections": self.connections,
            "markers": self.markers,
            "bad_frames": self.errors,
            "pings": self.pings,
            "refused": self.refused,
            "timed_out": self.timed_out,
            "accept_pauses": self.accept_pauses,
        }

    def sweep(self) -> None:
        """Close connections past their frame or idle timeout; resume a paused accept.

        The daemon calls it from its loop about once a second.
        """
        now = self.clock()
        if self._paused_until is not None and now >= self._paused_until and self.accepting:
            self._paused_until = None
            self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        for fd, client in list(self._clients.items()):
            if client.frame_started is not None and now - client.frame_started > self.frame_timeout:
                self.timed_out += 1
                self._bad(client, f"frame not completed within {self.frame_timeout:g} s")
            elif now - client.last_active > self.idle_timeout:
                self.timed_out += 1
                log.debug("marker socket: pid %d idle for %.0f s: connection closed", client.pid, now - client.last_active)
                self._close(fd)

    # -- selector callbacks ----------------------------------------------------------------------

    def _accept(self, _mask: int) -> None:
        for _ in range(64):  # bounded: let the loop serve everything else too
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                self._accept_failed(error)
                return
            self._backoff = _ACCEPT_BACKOFF[0]
            try:
                self._admit(sock)
            except Exception as error:  # one connection's surprise must not stop the others
                log.warning("marker socket: cannot take a connection: %s", short_repr(str(error), 200))
                with contextlib.suppress(OSError):
                    sock.close()

    def _accept_failed(self, error: OSError) -> None:
        """accept() failed: out of fds (pause, the listener would stay readable), or else say it."""
        if error.errno not in _OUT_OF_FDS:
            self._accept_log.log(logging.WARNING, "marker socket: accept failed: %s", error.strerror)
            return
        self.accept_pauses += 1
        self._accept_log.log(
            logging.WARNING,
            "marker socket: accept failed: %s (%d connected clients); pausing new connections",
            error.strerror, len(self._clients),
        )
        self._unregister_listener()
        self._paused_until = self.clock() + self._backoff
        self._backoff = min(self._backoff * 2, _ACCEPT_BACKOFF[1])

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            pid, uid, gid = peer_credentials(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        except OSError as error:
            log.warning("marker socket: no peer credentials (%s): connection closed", error.strerror)
            sock.close()
            return
        if len(self._clients) >= self.max_clients:
            self.refused += 1
            self._reply_and_close(sock, f"too many connections ({self.max_clients})")
            return
        if uid != 0 and self._per_uid.get(uid, 0) >= self.per_uid:
            self.refused += 1
            self._bad_log.log(logging.WARNING, "marker socket: uid %d holds %d connections already: refused",
                              uid, self.per_uid)
            self._reply_and_close(sock, f"too many connections from uid {uid} ({self.per_uid})")
            return
        self.connections += 1
        fd = sock.fileno()
        self._clients[fd] = _Client(sock, pid, uid, gid, self.clock())
        self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        self.selector.register(sock, selectors.EVENT_READ, lambda mask, fd=fd: self._readable(fd))
        if self.on_connect is not None:
            try:
                self.on_connect(pid, uid)
            except Exception:
                log.exception("marker socket: on_connect failed for pid %d", pid)

    def _readable(self, fd: int) -> None:
        client = self._clients.get(fd)
        if client is None:
            return
        try:
            self._serve(fd, client)
        except Exception as error:  # a bug met by one client's input: that client goes, nobody else
            self.errors += 1
            log.error("marker socket: internal error serving pid %d (%s): connection closed",
                      client.pid, type(error).__name__)
            log.debug("marker socket: internal error", exc_info=True)
            self._close(fd)

    def _serve(self, fd: int, client: _Client) -> None:
        try:
            data, sender = _recv_with_sender(client.sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(fd)
            return
        if not data:
            if client.decoder.pending:
                self._bad(client, f"connection closed inside a frame ({client.decoder.pending} bytes)", reply=False)
            self._close(fd)
            return
        now = self.clock()
        client.last_active = now
        try:
            messages = client.decoder.feed(data)
        except protocol.ProtocolError as error:
            self._bad(client, str(error))
            return
        if not client.decoder.pending:
            client.frame_started = None
        elif client.frame_started is None or messages:
            client.frame_started = now
        for message in messages:
            if not self._handle(client, message, sender):
                return

    def _about(self, pid: int, uid: int, named: int | None) -> int:
        """The pid a marker is stamped with: its writer's, or the one it names if it may speak for it.

        Root may name any process, others only their own (the owner of /proc/PID); a claim that
        fails (another user's process, or one already gone) is logged and the writer's pid kept.
        """
        if named is None or named == pid:
            return pid
        try:
            owner = os.stat(f"/proc/{named}").st_uid
        except OSError:
            self._claim_refused("marker from pid %d names pid %d, which does not exist: stamped with %d",
                                pid, named, pid)
            return pid
        if uid != 0 and owner != uid:
            self._claim_refused("marker from pid %d (uid %d) names pid %d of uid %d: not allowed, "
                                "stamped with %d", pid, uid, named, owner, pid)
            return pid
        return named

    def _claim_refused(self, message: str, *args: object) -> None:
        """Say a refused claim: the first ones each, then at most one line per 10 s (a client
        may repeat it as fast as it can write)."""
        self.claims_refused += 1
        if self.claims_refused <= _LOUD_ERRORS:
            log.warning(message, *args)
        else:
            self._bad_log.log(logging.WARNING, message, *args)

    def _handle(self, client: _Client, message: dict, sender: tuple[int, int] | None = None) -> bool:
        """Handle one message; False when the connection is gone (closed or handed over).

        ``sender``: (pid, uid) of the process that wrote the bytes completing the message, when
        the kernel says (a forked child writing on its parent's connection is itself, not its
        parent); else the connection's peer credentials.
        """
        pid, uid = sender or (client.pid, client.uid)
        problem = protocol.validate_message(message)
        if problem:
            self._bad(client, problem)
            return False
        kind = message["type"]
        if kind == "mark":
            self.markers += 1
            marker = Marker(
                ts=message["ts"],
                pid=self._about(pid, uid, message.get("pid")),
                uid=uid,
                tid=message["tid"],
                name=message["name"],
                phase=message["phase"],
                gpu=message.get("gpu"),
                values=dict(message.get("values") or {}),
            )
            if not self._phase_allowed(client, marker):
                client.dropped = "open_phases"
                return True
            try:
                client.dropped = self.on_marker(marker) or client.dropped
            except Exception:
                log.exception("marker from pid %d could not be recorded", pid)
            return True
        if kind == "ping":
            self.pings += 1
            try:
                pong = protocol.make_pong(self.daemon_pid)
                if client.dropped:  # a marker since the last ping was not taken: say so, and why
                    pong["dropped"], client.dropped = client.dropped, None
                client.sock.send(protocol.encode_frame(pong), socket.MSG_DONTWAIT)
            except OSError:
                self._close(client.sock.fileno())
                return False
            return True
        # subscribe: the connection leaves the marker server
        if self.on_subscribe is None:
            self._bad(client, "this socket does not serve subscribers")
            return False
        if not self.may_subscribe(client.pid, client.uid, client.gid):
            self.refused += 1
            self._bad(client, "the live view is for root (and the daemon's --live-group); markers are open to you")
            return False
        fd = client.sock.fileno()
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(client.sock)
        self._forget(fd)
        log.info("live subscriber connected (pid %d)", client.pid)
        self.on_subscribe(client.sock)
        return False

    # -- helpers ----------------------------------------------------------------------------------

    def _phase_allowed(self, client: _Client, marker: Marker) -> bool:
        """Count the connection's open phases; a ``begin`` over its cap is dropped (told to on_drop)."""
        if marker.phase == "begin":
            if client.open_phases >= self.open_per_connection:
                if self.on_drop is not None:
                    self.on_drop(marker, "open_phases")
                return False
            client.open_phases += 1
        elif marker.phase == "end" and client.open_phases:
            client.open_phases -= 1
        return True

    def _bad(self, client: _Client, reason: str, reply: bool = True) -> None:
        self.errors += 1
        if self.errors <= _LOUD_ERRORS:
            log.warning("marker socket: bad frame from pid %d: %s (connection closed)", client.pid, reason)
        else:
            self._bad_log.log(logging.WARNING, "marker socket: bad frame from pid %d: %s (connection closed)",
                              client.pid, reason)
        self._forget(client.sock.fileno())
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(client.sock)
        if reply:
            self._reply_and_close(client.sock, reason)
        else:
            client.sock.close()

    @staticmethod
    def _reply_and_close(sock: socket.socket, reason: str) -> None:
        with contextlib.suppress(OSError, protocol.ProtocolError):
            sock.send(protocol.encode_frame(protocol.make_error(reason[:1000])), socket.MSG_DONTWAIT)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    def _unregister_listener(self) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)

    def _forget(self, fd: int) -> _Client | None:
        """Drop a client from the books (its socket is closed by the caller)."""
        client = self._clients.pop(fd, None)
        if client is not None:
            left = self._per_uid.get(client.uid, 1) - 1
            if left > 0:
                self._per_uid[client.uid] = left
            else:
                self._per_uid.pop(client.uid, None)
        return client

    def _close(self, fd: int) -> None:
        client = self._forget(fd)
        if client is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(client.sock)
        client.sock.close()
