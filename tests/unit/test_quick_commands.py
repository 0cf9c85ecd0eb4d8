"""The quick commands say exactly what argparse and msgpack would have.

`memrec --help` is rendered without argparse (:func:`memrec.commands.help_text`), the documented
forms of `memrec mark` are parsed by hand (``MarkCommand.quick_args``), and its marker is encoded
and the daemon's pong recognised without msgpack (``mark.pack``, ``mark.is_pong``): each is held
here to what it stands in for, on the real parser and the real msgpack, so the two cannot drift.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import threading

import msgpack
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from memrec import commands
from memrec.terms import protocol
from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.commands import mark
from memrec.commands.mark import MarkCommand
from memrec.commands.parser import get_argument_parser


# ------------------------------------------------------------------ memrec --help


def argparse_help(monkeypatch, columns: int) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    return get_argument_parser(only="").format_help()


def test_help_is_argparse_s_at_every_width(monkeypatch):
    # GIVEN every terminal width from 1 to 300 columns
    for columns in range(1, 301):
        # WHEN the help is rendered without argparse THEN it is argparse's, or left to argparse
        text = commands.help_text(columns)
        if text is not None:
            assert text == argparse_help(monkeypatch, columns), columns
        # AND only where argparse's usage line wraps (under 49 columns) is it left to argparse
        assert (text is None) == (columns < 49), columns


def test_help_lists_every_command_summary_and_global_option():
    # GIVEN the help at 80 columns (a pipe) WHEN it is read as words
    words = " ".join(commands.help_text(80).split())
    # THEN it has the usage line, every command with its summary, every global option with its help
    assert words.startswith("usage: memrec [-h] [--version] [-v] COMMAND ... " + commands.DESCRIPTION)
    for name, summary in [*commands.COMMANDS.items(), *commands.OPTIONS.items()]:
        assert f"{name} {summary}" in words, name
    parser_options = {", ".join(a.option_strings) for a in get_argument_parser(only="")._actions if a.option_strings}
    assert parser_options == set(commands.OPTIONS)


@settings(max_examples=2000, deadline=None)
@given(st.text(alphabet="abZé_1٣-( .:/\t\u00a0", max_size=60), st.integers(1, 30))
def test_the_help_s_wrapping_is_textwrap_s(text, width):
    # GIVEN any text argparse would wrap (its runs of ASCII whitespace made one space)
    text = re.sub(r"\s+", " ", text, flags=re.ASCII).strip()
    # WHEN it is wrapped without textwrap
    lines = commands._wrap(text, width)
    # THEN the lines are textwrap's, or left to textwrap (a word cut, an em-dash)
    if lines is not None:
        assert lines == textwrap.wrap(text, width)
    else:
        assert "--" in text or max(map(len, text.split(" "))) > width


@pytest.mark.parametrize("argv", [["--help"], ["-h"]])
@pytest.mark.parametrize("columns", [20, 47, 48, 49, 62, 80, 81, 132, 250])
def test_main_help_is_argparse_s(monkeypatch, capsys, argv, columns):
    # GIVEN a terminal width (narrow ones are argparse's to render)  WHEN `memrec --help` runs
    expected = argparse_help(monkeypatch, columns)
    with pytest.raises(SystemExit) as done:
        commands.main(argv)
    # THEN it prints argparse's help and ends as argparse does
    assert done.value.code == 0
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("columns", [20, 48, 49, 80, 200])
def test_memrec_alone_says_what_argparse_says(monkeypatch, capsys, columns):
    # GIVEN what argparse says to `memrec` with no command, at this width
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as expected:
        get_argument_parser(only="").parse_args([])
    said = capsys.readouterr()
    # WHEN memrec runs with no arguments  THEN it says the same, with the same exit code
    with pytest.raises(SystemExit) as done:
        commands.main([])
    assert (done.value.code, capsys.readouterr()) == (expected.value.code, said)
    assert said.err.endswith("memrec: error: the following arguments are required: COMMAND\n")


def test_help_in_a_terminal_uses_its_width():
    # GIVEN a pseudo-terminal of 100 columns and no $COLUMNS
    import pty
    import termios
    import struct
    import fcntl

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    # WHEN `memrec --help` writes to it
    proc = subprocess.run([sys.executable, "-m", "memrec", "--help"], stdout=follower, stderr=subprocess.PIPE,
                          env=env, timeout=60)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    # THEN it is laid out for 100 columns, as argparse would
    assert proc.returncode == 0, proc.stderr
    assert out.decode().replace("\r\n", "\n") == commands.help_text(100)


# ------------------------------------------------------------------ memrec mark's arguments


def argparse_mark(words: list[str]) -> tuple | None:
    """What argparse makes of `memrec mark WORDS`: the fields run() sends, or None on an error."""
    parser = get_argument_parser(only="mark")
    try:
        args = parser.parse_args(["mark", *words])
        mark.read_after_name(args, args.parser)
    except (SystemExit, MemrecCommandError):
        return None
    if args.verbose or args.verbose_after:
        return None
    return fields(args)


def fields(args) -> tuple:
    return args.name, args.phase, args.gpu, args.socket, args.pid, args.scope, list(args.values)


DOCUMENTED = [
    ["load_weights", "--phase", "begin", "--gpu", "0"],
    ["load_weights", "--phase", "end"],
    ["kv_cache_sized", "tokens=524288", "fraction=0.88", "ok=true"],
    ["warmup", "--phase", "begin", "--pid", "1234"],
    ["bench", "x=1", "--socket", "/run/memrec/memrec.sock"],
    ["--socket=/tmp/s", "--phase=end", "--gpu=3", "step", "n=1", "--pid=7"],
    ["--phase", "begin", "x", "--phase", "end"],  # the last one wins
    ["build", "--phase", "begin", "--scope", "shell"],
    ["build", "--scope=session", "--phase=end"],
    [""],  # an empty NAME: refused by the marker's check, as after argparse
]


@pytest.mark.parametrize("words", DOCUMENTED)
def test_documented_forms_are_read_without_argparse_as_argparse_reads_them(words):
    # GIVEN a documented form of `memrec mark`  WHEN both parsers read it
    quick = MarkCommand.quick_args(words)
    # THEN the hand parser reads it, and makes of it what argparse makes
    assert quick is not None
    assert fields(quick) == argparse_mark(words)


#: Words a `memrec mark` command line is made of: the documented ones, and what argparse reads
#: in its own ways (abbreviations, -v, --help, --, negative and non-ASCII numbers, odd spacing).
WORDS = st.sampled_from([
    "x", "load", "a=1", "ok=true", "f=0.5", "s=text", "=v", "k=", "x y", "", "-", "--", "-1", "-v", "-vv",
    "--verbose", "-h", "--help", "--phase", "--ph", "begin", "end", "instant", "bogus", "--phase=begin",
    "--phase=", "--gpu", "--gpu=1", "--gpu=-1", "0", "07", "1_0", " 1", "+1", "\u0663", "2", "--socket",
    "--socket=", "--socket=/s", "/tmp/s", "--pid", "--pid=1", "--pi", "--pid=x", "-x", "--bogus",
    "--socket=-x", "tokens=-3", "9" * 19, "9" * 5000, "--scope", "--scope=shell", "session", "shell", "--sc",
])


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(WORDS, max_size=7))
def test_the_hand_parser_agrees_with_argparse_or_leaves_it_to_argparse(words):
    # GIVEN any command line after `memrec mark` (before a `--`: what follows is the command to run)
    if "--" in words:
        words = words[: words.index("--")]
    # WHEN the hand parser reads it
    quick = MarkCommand.quick_args(words)
    # THEN it either leaves it to argparse, or reads exactly what argparse reads (which accepts it)
    if quick is not None:
        assert fields(quick) == argparse_mark(words)


@pytest.mark.parametrize("words", [["--ph", "begin", "x"], ["x", "-v"], ["x", "--help"], ["x", "--gpu", "-1"],
                                   ["x", "--phase", "bogus"], ["--gpu", "1"], [], ["x", "--pid"]])
def test_what_the_hand_parser_leaves_is_argparse_s(words, capsys, tmp_path):
    # GIVEN a command line only argparse reads  WHEN memrec mark runs it (no daemon there)
    quick = MarkCommand.quick_args(words)
    try:
        rc = commands.main(["mark", *words, "--socket", str(tmp_path / "none.sock")] if "--help" not in words
                           else ["mark", *words])
    except SystemExit as done:
        rc = done.code
    # THEN argparse read it: its help, its usage error, or the run's own error
    assert quick is None
    assert rc in (ExitCode.OK, ExitCode.USAGE, ExitCode.UNAVAILABLE)


# ------------------------------------------------------------------ the marker's bytes


SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, -32, -33, -128, -129, -(2**15),
                     -(2**15) - 1, -(2**31), -(2**31) - 1, -(2**63)]),
    st.floats(allow_nan=False), st.text(max_size=300),
    st.sampled_from(["x" * 31, "x" * 32, "x" * 255, "x" * 256, "x" * 65535, "x" * 65536, "\udcff"]),
)


@settings(max_examples=400, deadline=None)
@given(name=st.text(min_size=1, max_size=200), phase=st.sampled_from(protocol.PHASES),
       ts=st.integers(0, 2**64 - 1), tid=st.integers(0, 2**32 - 1), gpu=st.none() | st.integers(0, 2**15 - 1),
       values=st.dictionaries(st.text(min_size=1, max_size=200), SCALARS, max_size=20),
       pid=st.none() | st.integers(1, protocol.MAX_PID))
def test_the_marker_is_packed_byte_for_byte_as_msgpack_packs_it(name, phase, ts, tid, gpu, values, pid):
    # GIVEN any marker `memrec mark` may send
    message = protocol.make_mark(name, phase, ts, tid, gpu, values, pid)
    # WHEN it is packed without msgpack
    packed = mark.pack(message)
    try:
        expected = msgpack.packb(message, use_bin_type=True)
    except ValueError:  # a lone surrogate (argv's undecodable bytes): msgpack's error stands
        assert packed is None
        return
    # THEN the bytes are msgpack's own, and the daemon's decoder reads the marker back
    assert packed == expected
    (decoded,) = protocol.FrameDecoder(protocol.MAX_SERVER_FRAME).feed(protocol.frame(packed))
    assert decoded == message and protocol.validate_message(decoded) is None


def test_what_it_cannot_pack_is_left_to_msgpack():
    assert mark.pack({"type": "mark", "values": {"b": b"bytes"}}) is None
    assert mark.pack({"type": "mark", "values": {"big": 2**64}}) is None
    assert mark.pack({"type": "mark", "values": {"x": [1]}}) is None
    assert mark._PING == protocol.encode_frame({"type": "ping"})


@pytest.mark.parametrize("text", ["nan", "-nan", "inf", "-inf", "1e308", "-0.0"])
def test_special_floats_from_the_command_line_pack_as_msgpack_packs_them(text):
    message = {"type": "mark", "values": {"v": mark.parse_value(text)}}
    assert mark.pack(message) == msgpack.packb(message, use_bin_type=True)


@pytest.mark.parametrize("pid", [1, 127, 128, 255, 256, 65535, 65536, protocol.MAX_PID, 2**32, 2**40])
def test_the_daemon_s_pong_is_recognised_and_nothing_else(pid):
    # GIVEN the daemon's pong as it sends it
    pong = protocol.encode_frame(protocol.make_pong(pid))
    # THEN it is a pong; cut, extended, or any other answer is left to the full decoder
    assert mark.is_pong(pong)
    for other in (pong[:-1], pong + b"\x00", pong[:4], b"", protocol.encode_frame(protocol.make_error("no")),
                  protocol.encode_frame({"type": "pong", "version": 1}),
                  protocol.encode_frame({"type": "pong", "version": -1, "pid": pid}),
                  protocol.frame(pong[4:] + b"\xc0")):
        assert not mark.is_pong(other), other


# ------------------------------------------------------------------ memrec mark against a socket


@pytest.fixture
def answering(tmp_path):
    """A socket that answers each connection with the bytes of ``answering.reply`` (in pieces of
    ``answering.piece`` bytes), recording what it was sent."""

    class Server:
        path = str(tmp_path / "memrec.sock")
        reply = b""
        piece = 4096
        received: list[dict] = []

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(Server.path)
    server.listen(4)

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                decoder = protocol.FrameDecoder()
                while not any(m.get("type") == "ping" for m in Server.received):
                    data = conn.recv(65536)
                    if not data:
                        break
                    Server.received.extend(decoder.feed(data))
                for at in range(0, len(Server.reply), Server.piece):
                    conn.sendall(Server.reply[at : at + Server.piece])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield Server
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    thread.join(5)


@pytest.mark.parametrize("piece", [4096, 3, 1], ids=["whole", "in-pieces", "byte-by-byte"])
def test_mark_sends_its_marker_and_takes_the_pong_however_it_arrives(answering, capsys, piece):
    # GIVEN a daemon's socket whose pong comes whole, or cut into pieces
    answering.reply, answering.piece = protocol.encode_frame(protocol.make_pong(4242)), piece
    # WHEN memrec mark sends a marker with values
    rc = commands.main(["mark", "step", "--phase", "begin", "--gpu", "1", "n=3", "f=0.5", "ok=true",
                        "--socket", answering.path])
    # THEN it succeeded silently, and the daemon got the marker (then the ping)
    assert rc == 0 and capsys.readouterr() == ("", "")
    marker, ping = answering.received
    assert ping == {"type": "ping"}
    assert {k: marker[k] for k in ("type", "name", "phase", "gpu", "values")} == {
        "type": "mark", "name": "step", "phase": "begin", "gpu": 1, "values": {"n": 3, "f": 0.5, "ok": True}}
    assert marker["pid"] > 0 and marker["tid"] == threading.get_native_id()


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (protocol.encode_frame(protocol.make_error("mark: name too long")), "refused the marker: mark: name too long"),
        (b"", "refused the marker: the daemon closed the connection without answering"),
        (protocol.encode_frame({"type": "subscribe"}), "refused the marker: expected pong, got 'subscribe'"),
    ],
    ids=["error", "closed", "not-a-pong"],
)
def test_mark_reports_a_daemon_that_does_not_take_the_marker(answering, capsys, reply, error):
    # GIVEN a socket that answers with an error, nothing, or something else
    answering.reply = reply
    # WHEN memrec mark sends to it  THEN one line says so, exit 69
    assert commands.main(["mark", "x", "--socket", answering.path]) == ExitCode.UNAVAILABLE
    err = capsys.readouterr().err
    assert err.startswith(f"memrec: error: the memrec daemon on {answering.path} ") and error in err
    assert err.count("\n") == 1


def test_mark_on_a_stale_socket_says_so(tmp_path, capsys):
    # GIVEN a socket file nobody listens on (a daemon that died)
    path = tmp_path / "memrec.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))
    # WHEN memrec mark sends to it  THEN one line says so, exit 69
    assert commands.main(["mark", "x", "--socket", str(path)]) == ExitCode.UNAVAILABLE
    assert capsys.readouterr().err == f"memrec: error: no memrec daemon listening on {path} (a stale socket?)\n"


@pytest.mark.parametrize("values", [[f"k{i}={'v' * 300}" for i in range(256)], [f"k={'v' * 100_000}"]])
def test_a_marker_too_large_is_said_in_the_user_s_words(capsys, tmp_path, values):
    # GIVEN values that make the marker larger than a client frame may be (many, or one of 100 KB)
    # WHEN memrec mark is run with them  THEN one line with its size and the limit, exit 2 (it was
    # the protocol's "frame of 100078 bytes exceeds the limit of 65536")
    assert commands.main(["mark", "x", *values, "--socket", str(tmp_path / "s")]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert re.fullmatch(r"memrec: error: the marker is \d{2,3},\d{3} bytes; at most 65,536\n", err), err
