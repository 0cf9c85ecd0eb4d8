"""Subscribing to a running daemon: the same records the trace file gets, as they are written.

The stream is not one file: it starts with a sync (the file's header, processes, the stacks the
file defined so far, a keyframe), then every record the file gets, and, when the daemon rotates
(SIGHUP, ``--rotate-size``) or resynchronises a subscriber that fell behind, a new header and what
follows it. Each file numbers its stacks from 1, so a stack id means nothing without the header
it came after: :class:`StreamStacks` numbers them once for the whole stream.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np

from memrec.terms import protocol
from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.trace.frames import MAX_SUBSCRIBER_FRAME
from memrec.trace.frames import FrameDecoder
from memrec.trace.stacks import MAX_IDS
from memrec.trace.stacks import StackDefs
from memrec.trace.stacks import StackInterner
from memrec.trace.stacks import StackTable
from memrec.trace.stacks import check_stacks_record


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


#: The stream id of a stack the current file names without having defined it (its record was
#: lost or damaged): never defined, so it resolves to no stack rather than another's.
UNDEFINED = MAX_IDS


class StreamStacks:
    """The stacks of a live stream, numbered once across its files.

    Call :meth:`new_file` at each header the stream sends, :meth:`add` with each ``stacks``
    record, and :meth:`ids` on each events chunk's ``stack`` column: it gives the stream's ids,
    which :attr:`table` resolves. Without this, a rotated file's stack 1 would resolve to the
    first file's stack 1 (a wrong stack, shown as the allocation's), and its definitions would be
    refused as ids defined again. A resync's header and its record of every stack the file holds
    map to the ids the stream gave them already (stacks are matched by their frames).
    """

    def __init__(self) -> None:
        self.table = StackTable()  # the stream's ids: what views resolve
        self._ids = StackInterner()  # the stream's id of each stack
        self._file = StackTable()  # the current file's own definitions
        self._map = np.zeros(1, np.uint32)  # the current file's id -> the stream's (0: no stack)

    def new_file(self) -> None:
        """A header: the stack ids that follow are a new file's (a rotation) or, after a resync,
        the file's ids defined again from the start."""
        self._file = StackTable()
        self._map = np.zeros(1, np.uint32)

    def add(self, defs: StackDefs) -> None:
        """One ``stacks`` record of the current file (checked: :func:`check_stacks_record`).

        Raises:
            TraceFormatError: it names what the file has not defined, or defines an id again
                (the record is skipped whole, as a file's reader skips it).
        """
        self._file.add(defs)
        first, n = defs.k0, len(defs.stacks)
        if first + n > len(self._map):
            grown = np.full(first + n, UNDEFINED, np.uint32)
            grown[:len(self._map)] = self._map
            self._map = grown
        for number in range(first, first + n):
            stack = self._file.stack(number)
            if stack is not None:
                try:
                    self._map[number] = self._ids.intern(stack)
                except ValueError:  # past MAX_IDS stacks in one stream: the rest resolve to none
                    self._map[number] = UNDEFINED
        record = self._ids.take_record()
        if record is not None:
            self.table.add(check_stacks_record(record))

    def ids(self, column: np.ndarray) -> np.ndarray:
        """The stream's ids of a ``stack`` column of the current file (0 stays 0: no stack)."""
        column = np.asarray(column)
        if not column.any():
            return column
        inside = column < len(self._map)
        out = np.full(len(column), UNDEFINED, np.uint32)
        out[inside] = self._map[column[inside].astype(np.intp)]
        return out
