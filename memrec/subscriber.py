"""Subscribing to a running daemon: the same records the trace file gets, as they are written."""

from __future__ import annotations

import socket
from collections.abc import Iterator

from memrec.terms import protocol
from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.trace.frames import MAX_SUBSCRIBER_FRAME
from memrec.trace.frames import FrameDecoder


def subscribe(path: str | None = None, timeout: float = 5.0) -> socket.socket:
    """Connect to the daemon's socket and ask for the live stream.

    Raises:
        MemrecCommandError: no daemon listens there (exit code UNAVAILABLE).
    """
    where = protocol.socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(where)
        sock.sendall(protocol.encode_frame({"type": "subscribe"}))
    except OSError as error:
        sock.close()
        raise MemrecCommandError(
            f"no memrec daemon at {where} ({error.strerror or error}): start one with memrec daemon",
            exit_code=ExitCode.UNAVAILABLE,
        ) from None
    return sock


def records(sock: socket.socket, chunk: int = 1 << 20) -> Iterator[dict]:
    """Yield decoded records from a subscribed socket until the daemon closes it.

    A read timeout (the socket's) ends the iteration quietly, so callers can poll.
    """
    decoder = FrameDecoder(MAX_SUBSCRIBER_FRAME)
    while True:
        try:
            data = sock.recv(chunk)
        except TimeoutError:
            return
        if not data:
            return
        yield from decoder.feed(data)


def wait_for_daemon(path: str | None = None, timeout: float = 60.0) -> dict:
    """Wait until a daemon answers on ``path`` (its probes are attached by then); return its pong.

    The socket file appears before the BPF program is compiled; only the event loop answers a
    ping, so a pong means every probe is in place.

    Raises:
        MemrecCommandError: no answer within ``timeout`` (exit code UNAVAILABLE).
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            return protocol.ping(path, timeout=1.0)
        except (OSError, protocol.ProtocolError) as error:
            if time.monotonic() > deadline:
                raise MemrecCommandError(
                    f"no memrec daemon answered at {protocol.socket_path(path)} within {timeout:g} s ({error})",
                    exit_code=ExitCode.UNAVAILABLE,
                ) from None
            time.sleep(0.1)
