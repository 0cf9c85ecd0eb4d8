"""The marker socket protocol, shared by the clients and the daemon.

A Unix stream socket carries *frames*: a 4-byte big-endian length, then exactly one msgpack map of
that many bytes. Frames from clients are at most :data:`MAX_CLIENT_FRAME` bytes; frames from the
daemon to a live subscriber carry whole trace records and may be larger (:data:`MAX_SERVER_FRAME`).

Client → daemon::

    {type: "mark", name: str (1..200 chars), phase: "begin" | "end" | "instant",
     ts: int (client CLOCK_MONOTONIC ns), tid: int, gpu: int | None (the client's CUDA device
     ordinal), values: {str: None | bool | int | float | str},
     pid: int (optional: the process the marker is about; see below)}
    {type: "ping"}                     → {type: "pong", version: int, pid: int}, and
                                         dropped: "budget" | "open_phases" when the daemon
                                         dropped a marker of this connection since its last
                                         ping (docs/operations.md)
    {type: "subscribe"}                → the trace header, a keyframe, then every record the
                                         trace file gets, each one frame (the same bytes)

Any malformed frame or message gets ``{type: "error", message: str}`` and the connection is closed.
The daemon stamps a marker with the peer's pid and uid from SO_PEERCRED. A client may name another
process in ``pid`` (``memrec mark`` names the shell that runs it, so a shell script's begin and end
pair up); the daemon takes it only from root or from the owner of that process, and otherwise
keeps the peer's pid: a client cannot speak for another user's process.

This module is stdlib + msgpack only: it is imported by every program that sends markers.
msgpack and socket are imported where used: `memrec mark` needs neither to build, check and
frame its marker (docs/performance.md).
"""

from __future__ import annotations

import os
import struct

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see memrec.TYPE_CHECKING)

if TYPE_CHECKING:  # typing only for the checker: `memrec mark` imports this (see memrec.TYPE_CHECKING)
    import socket
    from typing import Any

from memrec.base.untrusted import MAX_DEPTH
from memrec.base.untrusted import clean_text
from memrec.base.untrusted import short_repr
from memrec.base.untrusted import too_deep

#: The socket the daemon listens on, unless ``MEMREC_SOCKET`` names another.
DEFAULT_SOCKET = "/run/memrec/memrec.sock"
#: The environment variable that overrides :data:`DEFAULT_SOCKET` (set by ``memrec record``).
SOCKET_ENV = "MEMREC_SOCKET"
#: Version of this protocol, reported in ``pong``.
PROTOCOL_VERSION = 1
#: The largest frame (length prefix excluded) a client may send.
MAX_CLIENT_FRAME = 64 * 1024
#: The largest frame the daemon sends (one trace record: an events chunk or a keyframe).
MAX_SERVER_FRAME = 1 << 30  # = memrec.trace.frames.MAX_SUBSCRIBER_FRAME
#: Limits of a marker's fields.
MAX_NAME = 200
MAX_PID = 2**22  # Linux's pid_max limit
MAX_GPU = 2**15 - 1  # the largest device ordinal a marker may name (the event gpu column is <i2)
MAX_VALUES = 256
MAX_VALUE_KEY = 200
PHASES = ("begin", "end", "instant")
MESSAGE_TYPES = ("mark", "subscribe", "ping")

#: The length prefix of every frame: 4 bytes, big-endian.
LENGTH = struct.Struct(">I")
_INT_MIN = -(2**63)
_UINT_MAX = 2**64 - 1


class ProtocolError(ValueError):
    """A frame or a message breaks the protocol; ``str()`` is the one-line reason sent back."""


def socket_path(explicit: str | os.PathLike[str] | None = None) -> str:
    """Return the socket to use: ``explicit``, else ``$MEMREC_SOCKET``, else the default."""
    if explicit:
        return os.fspath(explicit)
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def pack(message: dict) -> bytes:
    """msgpack-encode one message (str as str, bytes as bin)."""
    import msgpack

    return msgpack.packb(message, use_bin_type=True)


def frame(payload: bytes) -> bytes:
    """Prefix already-encoded msgpack bytes (e.g. a trace record) with their length."""
    return LENGTH.pack(len(payload)) + payload


def encode_frame(message: dict, max_size: int = MAX_CLIENT_FRAME) -> bytes:
    """Encode ``message`` as one frame.

    Raises:
        ProtocolError: the encoded message is larger than ``max_size`` or cannot be encoded.
    """
    try:
        payload = pack(message)
    except (TypeError, ValueError, OverflowError) as error:
        raise ProtocolError(f"cannot encode message: {error}") from None
    if len(payload) > max_size:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds the limit of {max_size}")
    return frame(payload)


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole messages (dicts) back.

    The buffer never holds more than one frame plus its prefix: a prefix announcing a frame
    larger than ``max_size`` is an error as soon as it is seen.
    """

    def __init__(self, max_size: int = MAX_CLIENT_FRAME) -> None:
        self.max_size = max_size
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict]:
        """Add ``data`` and return every message now complete, in order.

        Raises:
            ProtocolError: an oversized frame, undecodable msgpack, trailing bytes inside a frame,
                or a frame that is not a map. The decoder must not be used after that.
        """
        self._buf += data
        out: list[dict] = []
        while len(self._buf) >= LENGTH.size:
            (size,) = LENGTH.unpack_from(self._buf)
            if size > self.max_size:
                raise self._too_large(size, out)
            end = LENGTH.size + size
            if len(self._buf) < end:
                break
            body = bytes(self._buf[LENGTH.size : end])
            del self._buf[:end]
            out.append(self._decode(body, out))
        return out

    def _too_large(self, size: int, done: list[dict]) -> Exception:
        """The error for a frame over ``max_size`` (``done``: messages completed before it)."""
        return ProtocolError(f"frame of {size} bytes exceeds the limit of {self.max_size}")

    def _decode(self, body: bytes, done: list[dict]) -> dict:
        """One frame's body as a message (subclasses decode trace records)."""
        return decode_payload(body)

    @property
    def pending(self) -> int:
        """Bytes received but not yet part of a whole frame."""
        return len(self._buf)


def decode_payload(body: bytes) -> dict:
    """Decode the msgpack body of one frame into a map.

    Raises:
        ProtocolError: not exactly one msgpack map.
    """
    import msgpack

    if not body:
        raise ProtocolError("empty frame")
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except msgpack.ExtraData:
        raise ProtocolError("frame holds more than one msgpack object") from None
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"frame is not valid msgpack ({type(error).__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"frame holds a {type(message).__name__}, not a map")
    if too_deep(message):
        raise ProtocolError(f"frame nests deeper than {MAX_DEPTH} levels")
    return message


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_scalar(value: Any) -> bool:
    """Whether ``value`` may be a marker value: None, bool, int (64-bit), float or str."""
    if value is None or isinstance(value, (bool, float, str)):
        return True
    return _is_int(value) and _INT_MIN <= value <= _UINT_MAX


def validate_mark(message: dict) -> str | None:
    """Check a ``mark`` message; return None when valid, else a one-line reason."""
    unknown = set(message) - {"type", "name", "phase", "ts", "tid", "gpu", "values", "pid"}
    if unknown:
        return f"mark: unknown field(s) {_names(unknown)}"
    name = message.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
        return f"mark: name must be a string of 1..{MAX_NAME} characters"
    if message.get("phase") not in PHASES:
        return f"mark: phase must be one of {', '.join(PHASES)}"
    ts = message.get("ts")
    if not _is_int(ts) or not 0 <= ts < 2**64:
        return "mark: ts must be a non-negative integer (CLOCK_MONOTONIC ns)"
    tid = message.get("tid")
    if not _is_int(tid) or not 0 <= tid < 2**32:
        return "mark: tid must be a non-negative integer"
    pid = message.get("pid")
    if pid is not None and (not _is_int(pid) or not 0 < pid <= MAX_PID):
        return f"mark: pid must be a process id (1..{MAX_PID}) or nil"
    gpu = message.get("gpu")
    if gpu is not None and (not _is_int(gpu) or not 0 <= gpu <= MAX_GPU):
        return f"mark: gpu must be a device ordinal (0..{MAX_GPU}) or nil"
    values = message.get("values", {})
    if not isinstance(values, dict):
        return "mark: values must be a map"
    if len(values) > MAX_VALUES:
        return f"mark: more than {MAX_VALUES} values"
    for key, value in values.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_VALUE_KEY:
            return f"mark: value keys must be strings of 1..{MAX_VALUE_KEY} characters"
        if _is_int(value) and not is_scalar(value):  # an int, but "is a int, not ... int" would puzzle
            return f"mark: value {short_repr(key, 40)} does not fit in 64 bits ({_INT_MIN}..{_UINT_MAX})"
        if not is_scalar(value):
            return f"mark: value {short_repr(key, 40)} is a {type(value).__name__}, not nil/bool/int/float/str"
    return None


def validate_message(message: dict) -> str | None:
    """Check any client message; return None when valid, else a one-line reason."""
    kind = message.get("type")
    if kind == "mark":
        return validate_mark(message)
    if kind in ("ping", "subscribe"):
        extra = set(message) - {"type"}
        if extra:
            return f"{kind}: unexpected field(s) {_names(extra)}"
        return None
    if kind is None:
        return "message has no type"
    return f"unknown message type {short_repr(kind, 60)} (expected one of {', '.join(MESSAGE_TYPES)})"


def _names(keys: set) -> str:
    """A client's unexpected keys, shown bounded (at most 8, each cut, escapes made visible)."""
    shown = sorted(clean_text(k, 40) if isinstance(k, str) else short_repr(k, 40) for k in list(keys)[:8])
    return ", ".join(shown) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")


def make_mark(
    name: str,
    phase: str,
    ts: int,
    tid: int,
    gpu: int | None = None,
    values: dict | None = None,
    pid: int | None = None,
) -> dict:
    """Build a ``mark`` message (``pid``: the process it is about, when not the sender)."""
    message = {
        "type": "mark",
        "name": name,
        "phase": phase,
        "ts": ts,
        "tid": tid,
        "gpu": gpu,
        "values": values or {},
    }
    if pid is not None:
        message["pid"] = pid
    return message


def make_pong(pid: int) -> dict:
    """The daemon's answer to ``ping``."""
    return {"type": "pong", "version": PROTOCOL_VERSION, "pid": pid}


def make_error(message: str) -> dict:
    """The daemon's answer to a bad frame (the connection is closed after it)."""
    return {"type": "error", "message": message}


def ping(path: str | os.PathLike[str] | None = None, timeout: float = 1.0) -> dict:
    """Ask the daemon at ``path`` for a ``pong`` (blocking, at most ``timeout`` per step).

    Raises:
        OSError: no daemon listens there (FileNotFoundError, ConnectionRefusedError, timeout).
        ProtocolError: the answer is not a pong.
    """
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(socket_path(path))
        sock.sendall(encode_frame({"type": "ping"}))
        return await_pong(sock)


def await_pong(sock: socket.socket, received: bytes | None = None) -> dict:
    """Read the daemon's answer to a ``ping`` sent on ``sock`` (within the socket's timeout);
    ``received``: what was already read from it.

    The daemon handles a connection's messages in order, so once the pong is here everything sent
    before the ping has been handled.

    Raises:
        OSError: the socket failed or timed out.
        ProtocolError: the daemon answered with an error (its message) or closed the connection.
    """
    decoder = FrameDecoder(MAX_SERVER_FRAME)
    data = sock.recv(4096) if received is None else received
    while True:
        if not data:
            raise ProtocolError("the daemon closed the connection without answering")
        for message in decoder.feed(data):
            if message.get("type") == "error":
                raise ProtocolError(str(message.get("message")))
            if message.get("type") != "pong":
                raise ProtocolError(f"expected pong, got {message.get('type')!r}: {message}")
            return message
        data = sock.recv(4096)
