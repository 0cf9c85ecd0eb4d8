"""The marker socket protocol: framing, decoding, message validation."""

from __future__ import annotations

import struct

import msgpack
import pytest

from memrec.terms import protocol
from memrec.terms.protocol import FrameDecoder
from memrec.terms.protocol import ProtocolError


def _mark(**over):
    msg = protocol.make_mark("load_weights", "begin", ts=123, tid=7, gpu=0, values={"bytes": 1 << 40, "ok": True})
    msg.update(over)
    return msg


def test_frame_round_trip_in_pieces():
    # GIVEN three messages framed back to back
    msgs = [_mark(), {"type": "ping"}, _mark(phase="end", values={})]
    data = b"".join(protocol.encode_frame(m) for m in msgs)
    # WHEN they arrive one byte at a time
    decoder = FrameDecoder()
    out = []
    for i in range(len(data)):
        out += decoder.feed(data[i : i + 1])
    # THEN each comes out whole, in order, and nothing is left over
    assert out == msgs
    assert decoder.pending == 0


def test_frame_prefix_is_big_endian_length():
    # GIVEN a message
    frame = protocol.encode_frame({"type": "ping"})
    # THEN the first 4 bytes are the big-endian length of the msgpack body
    (size,) = struct.unpack(">I", frame[:4])
    assert size == len(frame) - 4
    assert msgpack.unpackb(frame[4:]) == {"type": "ping"}


def test_oversized_frame_is_refused_before_its_body_arrives():
    # GIVEN a length prefix over 64 KiB
    decoder = FrameDecoder()
    # WHEN only the prefix is fed
    # THEN the decoder refuses it at once, naming the size
    with pytest.raises(ProtocolError, match="65537 bytes exceeds"):
        decoder.feed(struct.pack(">I", protocol.MAX_CLIENT_FRAME + 1))


def test_encode_refuses_a_message_over_the_client_limit():
    # GIVEN a marker whose values make it larger than 64 KiB
    msg = _mark(values={f"k{i}": "x" * 190 for i in range(400)})
    # WHEN it is encoded THEN it is refused
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        protocol.encode_frame(msg)


@pytest.mark.parametrize(
    "body, reason",
    [
        (msgpack.packb([1, 2]), "not a map"),
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb({"type": "ping"}) + b"\x01", "more than one"),
        (b"", "empty frame"),
    ],
    ids=["array", "reserved-byte", "trailing-data", "empty"],
)
def test_bad_payloads_are_protocol_errors(body, reason):
    # GIVEN a frame whose body is not exactly one msgpack map
    # WHEN it is decoded THEN the error says why
    with pytest.raises(ProtocolError, match=reason):
        FrameDecoder().feed(struct.pack(">I", len(body)) + body)


def test_valid_messages_pass():
    assert protocol.validate_message(_mark()) is None
    assert protocol.validate_message(_mark(gpu=None, phase="instant")) is None
    assert protocol.validate_message({"type": "ping"}) is None
    assert protocol.validate_message({"type": "subscribe"}) is None


@pytest.mark.parametrize(
    "over, reason",
    [
        ({"name": ""}, "name must be"),
        ({"name": "x" * 201}, "name must be"),
        ({"name": 5}, "name must be"),
        ({"phase": "middle"}, "phase must be"),
        ({"ts": -1}, "ts must be"),
        ({"ts": 1.5}, "ts must be"),
        ({"ts": True}, "ts must be"),
        ({"tid": "7"}, "tid must be"),
        ({"gpu": -1}, "gpu must be"),
        ({"gpu": "0"}, "gpu must be"),
        ({"values": [1]}, "values must be a map"),
        ({"values": {"a": [1, 2]}}, "not nil/bool/int/float/str"),
        ({"values": {"a": {"b": 1}}}, "not nil/bool/int/float/str"),
        ({"values": {"a": 2**64}}, "value 'a' does not fit in 64 bits"),
        ({"values": {"a": -2**63 - 1}}, "value 'a' does not fit in 64 bits"),
        ({"values": {1: 2}}, "value keys"),
        ({"pid": 0}, "pid must be a process id"),
        ({"pid": "7"}, "pid must be a process id"),
        ({"shell": 1}, "unknown field"),
    ],
)
def test_invalid_marks_say_why(over, reason):
    # GIVEN a mark with one bad field WHEN validated THEN the reason names the field
    problem = protocol.validate_message(_mark(**over))
    assert problem is not None and reason in problem


def test_unknown_and_missing_types():
    assert "unknown message type 'shout'" in protocol.validate_message({"type": "shout"})
    assert protocol.validate_message({"name": "x"}) == "message has no type"
    assert "unexpected field" in protocol.validate_message({"type": "ping", "x": 1})


def test_socket_path_precedence(monkeypatch):
    # GIVEN no environment override THEN the default
    monkeypatch.delenv(protocol.SOCKET_ENV, raising=False)
    assert protocol.socket_path() == "/run/memrec/memrec.sock"
    # GIVEN MEMREC_SOCKET THEN it wins over the default, and an explicit path over both
    monkeypatch.setenv(protocol.SOCKET_ENV, "/tmp/x.sock")
    assert protocol.socket_path() == "/tmp/x.sock"
    assert protocol.socket_path("/tmp/y.sock") == "/tmp/y.sock"


def test_replies():
    assert protocol.make_pong(42) == {"type": "pong", "version": protocol.PROTOCOL_VERSION, "pid": 42}
    assert protocol.make_error("bad") == {"type": "error", "message": "bad"}


def test_frames_agree_with_the_trace_frame_module():
    # GIVEN the trace package's framing (what live subscribers decode with)
    from memrec.trace import frames

    # THEN each side decodes the other's frames (the trace decoder is the protocol's, plus records)
    msg = _mark()
    assert frames.FrameDecoder(decode=False).feed(protocol.encode_frame(msg)) == [msg]
    assert FrameDecoder().feed(frames.encode_frame(msgpack.packb(msg))) == [msg]
