"""The marker socket server: accepts clients, decodes their frames, stamps who sent them.

Every connection has its own :class:`~memrec.protocol.FrameDecoder`; a marker is stamped with the
peer's pid and uid from ``SO_PEERCRED`` (taken by the kernel when the client connected), so a
client cannot speak for another process. A bad frame or message gets an ``error`` reply, the
connection is closed and counted; the server goes on serving everybody else.

The server registers its sockets in the daemon's selector with a callable as ``key.data``: the
daemon's loop calls ``key.data(mask)`` for each ready key.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import struct
from typing import Callable

from memrec import protocol
from memrec.events import Marker

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # pid, uid, gid
#: Bad frames logged at WARNING before the rest go to DEBUG (a broken client must not flood logs).
_LOUD_ERRORS = 20
_RECV = 65536


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected ``sock`` (Linux SO_PEERCRED)."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(data)


class _Client:
    __slots__ = ("sock", "pid", "uid", "decoder")

    def __init__(self, sock: socket.socket, pid: int, uid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.decoder = protocol.FrameDecoder(protocol.MAX_CLIENT_FRAME)


class MarkerServer:
    """Serves marker clients on a listening socket.

    Args:
        listener: a bound, listening, non-blocking Unix stream socket.
        selector: the daemon's selector; the server registers the listener and its clients.
        on_marker: gets each valid marker, stamped with the peer's pid and uid.
        on_subscribe: takes over a connection that asked to subscribe (the server forgets it).
        on_connect: told ``(pid, uid)`` of each new peer at once (while it surely still runs).
        daemon_pid: the pid reported in ``pong``.
        max_clients: connections beyond this are accepted and closed at once.
    """

    def __init__(
        self,
        listener: socket.socket,
        selector: selectors.BaseSelector,
        on_marker: Callable[[Marker], None],
        on_subscribe: Callable[[socket.socket], None] | None = None,
        on_connect: Callable[[int, int], None] | None = None,
        daemon_pid: int | None = None,
        max_clients: int = 1024,
    ) -> None:
        self.listener = listener
        self.selector = selector
        self.on_marker = on_marker
        self.on_subscribe = on_subscribe
        self.on_connect = on_connect
        self.daemon_pid = os.getpid() if daemon_pid is None else daemon_pid
        self.max_clients = max_clients
        self._clients: dict[int, _Client] = {}
        self.accepting = False
        #: counters, for the trailer and the tests
        self.connections = 0
        self.markers = 0
        self.errors = 0
        self.pings = 0
        self.refused = 0

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
            self._accept(selectors.EVENT_READ)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.listener)
            self.accepting = False

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
        }

    # -- selector callbacks ----------------------------------------------------------------------

    def _accept(self, _mask: int) -> None:
        for _ in range(64):  # bounded: let the loop serve everything else too
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # EMFILE and friends: log, keep serving
                log.warning("marker socket: accept failed: %s", error.strerror)
                return
            sock.setblocking(False)
            try:
                pid, uid, _gid = peer_credentials(sock)
            except OSError as error:
                log.warning("marker socket: no peer credentials (%s): connection closed", error.strerror)
                sock.close()
                continue
            if len(self._clients) >= self.max_clients:
                self.refused += 1
                self._reply_and_close(sock, f"too many connections ({self.max_clients})")
                continue
            self.connections += 1
            client = _Client(sock, pid, uid)
            self._clients[sock.fileno()] = client
            fd = sock.fileno()
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
            data = client.sock.recv(_RECV)
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
        try:
            messages = client.decoder.feed(data)
        except protocol.ProtocolError as error:
            self._bad(client, str(error))
            return
        for message in messages:
            if not self._handle(client, message):
                return

    def _about(self, client: _Client, pid: int | None) -> int:
        """The pid a marker is stamped with: the peer's, or the one it names if it may speak for it.

        Root may name any process, others only their own (the owner of /proc/PID); a claim that
        fails (another user's process, or one already gone) is logged and the peer's pid kept.
        """
        if pid is None or pid == client.pid:
            return client.pid
        try:
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            log.warning("marker from pid %d names pid %d, which does not exist: stamped with %d",
                        client.pid, pid, client.pid)
            return client.pid
        if client.uid != 0 and owner != client.uid:
            log.warning("marker from pid %d (uid %d) names pid %d of uid %d: not allowed, stamped with %d",
                        client.pid, client.uid, pid, owner, client.pid)
            return client.pid
        return pid

    def _handle(self, client: _Client, message: dict) -> bool:
        """Handle one message; False when the connection is gone (closed or handed over)."""
        problem = protocol.validate_message(message)
        if problem:
            self._bad(client, problem)
            return False
        kind = message["type"]
        if kind == "mark":
            self.markers += 1
            marker = Marker(
                ts=message["ts"],
                pid=self._about(client, message.get("pid")),
                uid=client.uid,
                tid=message["tid"],
                name=message["name"],
                phase=message["phase"],
                gpu=message.get("gpu"),
                values=dict(message.get("values") or {}),
            )
            try:
                self.on_marker(marker)
            except Exception:
                log.exception("marker from pid %d could not be recorded", client.pid)
            return True
        if kind == "ping":
            self.pings += 1
            try:
                client.sock.send(protocol.encode_frame(protocol.make_pong(self.daemon_pid)), socket.MSG_DONTWAIT)
            except OSError:
                self._close(client.sock.fileno())
                return False
            return True
        # subscribe: the connection leaves the marker server
        if self.on_subscribe is None:
            self._bad(client, "this socket does not serve subscribers")
            return False
        fd = client.sock.fileno()
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(client.sock)
        del self._clients[fd]
        log.info("live subscriber connected (pid %d)", client.pid)
        self.on_subscribe(client.sock)
        return False

    # -- helpers ----------------------------------------------------------------------------------

    def _bad(self, client: _Client, reason: str, reply: bool = True) -> None:
        self.errors += 1
        level = logging.WARNING if self.errors <= _LOUD_ERRORS else logging.DEBUG
        log.log(level, "marker socket: bad frame from pid %d: %s (connection closed)", client.pid, reason)
        fd = client.sock.fileno()
        self._clients.pop(fd, None)
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

    def _close(self, fd: int) -> None:
        client = self._clients.pop(fd, None)
        if client is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(client.sock)
        client.sock.close()
