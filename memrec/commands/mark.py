"""``memrec mark``: send one phase marker from a shell script.

A quick command (within 2× a bare interpreter's start, docs/performance.md: scripts run it between
the phases they time). Its documented forms are parsed by hand (:func:`quick_args`; argparse for
anything else, errors and --help included), the marker is encoded and the daemon's pong read
without msgpack (:func:`pack`, :func:`is_pong`; msgpack for anything else), and the socket is
``_socket``'s: argparse, msgpack and socket (enum, selectors) each cost more than half a bare
start. tests/unit/test_quick_commands.py holds each to what it stands in for.
"""

from __future__ import annotations

import _socket  # socket.py adds enums and selectors, none of which a connect and a send need
import os
import struct
import time
from _thread import get_native_id  # threading.get_native_id, without threading's start-up
from types import SimpleNamespace

from memrec.terms import protocol
from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see memrec.TYPE_CHECKING)

if TYPE_CHECKING:
    import argparse

#: Seconds the connect, the send and the daemon's confirmation may each take.
TIMEOUT = 2.0


def parse_value(text: str) -> bool | int | float | str:
    """A marker value from the command line: true/false, an int, a float, else the string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text, 10)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def utf8_text(text: str, what: str) -> str:
    """``text`` from argv, checked to be UTF-8 (the wire's strings are).

    Raises:
        MemrecCommandError: it holds bytes that are not UTF-8 (exit code USAGE), shown escaped.
    """
    try:
        text.encode()
    except UnicodeEncodeError:
        shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise MemrecCommandError(f"{what} '{shown}' is not valid UTF-8", exit_code=ExitCode.USAGE) from None
    return text


def parse_values(items: list[str]) -> dict:
    """``["tokens=1024", "ok=true"]`` → ``{"tokens": 1024, "ok": True}``.

    Raises:
        MemrecCommandError: an item is not KEY=VALUE (exit code USAGE).
    """
    values: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.strip():
            raise MemrecCommandError(f"bad value {item!r}: expected KEY=VALUE", exit_code=ExitCode.USAGE)
        values[utf8_text(key.strip(), "the value name")] = parse_value(utf8_text(value, "the value"))
    return values


def send_marker(path: str, frame: bytes, timeout: float = TIMEOUT) -> None:
    """Connect, send the marker's ``frame`` and a ping, and wait for the pong.

    The pong means the daemon has taken the marker, while this process (and the shell that runs
    it, which the marker may name) still runs for the daemon to check.

    Raises:
        MemrecCommandError: no daemon answers at ``path`` (exit code UNAVAILABLE); or the marker
            was sent but the daemon did not confirm it in time (TEMPFAIL: a daemon stopped with
            SIGSTOP, or overloaded, still records it when it resumes; sending it again would
            record it twice).
    """
    sent = False
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(frame + _PING)
        sent = True
        answer = sock.recv(4096)
        if not is_pong(answer):  # not the usual pong in one piece: decoded in full, as anyone's
            dropped = protocol.await_pong(sock, answer).get("dropped")
            if dropped:
                raise MemrecCommandError(
                    f"the memrec daemon on {path} dropped the marker: {_DROPPED.get(dropped, 'see its log')}",
                    exit_code=ExitCode.TEMPFAIL,
                )
    except FileNotFoundError:
        raise MemrecCommandError(
            f"no memrec daemon: {path} does not exist (start one with memrec daemon, or set --socket / MEMREC_SOCKET)",
            exit_code=ExitCode.UNAVAILABLE,
        ) from None
    except ConnectionRefusedError:
        raise MemrecCommandError(
            f"no memrec daemon listening on {path} (a stale socket?)", exit_code=ExitCode.UNAVAILABLE
        ) from None
    except PermissionError:
        raise MemrecCommandError(
            f"permission denied on {path}: join the socket's group or run as root",
            exit_code=ExitCode.UNAVAILABLE,
        ) from None
    except TimeoutError:
        if sent:
            raise MemrecCommandError(
                f"the memrec daemon on {path} did not confirm the marker within {timeout:g} s (stopped or "
                "overloaded?): it was sent and is recorded if the daemon resumes; do not send it again",
                exit_code=ExitCode.TEMPFAIL,
            ) from None
        raise MemrecCommandError(
            f"the memrec daemon on {path} did not take the marker within {timeout:g} s (nothing was sent)",
            exit_code=ExitCode.UNAVAILABLE,
        ) from None
    except OSError as error:
        raise MemrecCommandError(
            f"cannot send the marker to {path}: {error.strerror or error}", exit_code=ExitCode.UNAVAILABLE
        ) from None
    except protocol.ProtocolError as error:
        raise MemrecCommandError(f"the memrec daemon on {path} refused the marker: {error}",
                                 exit_code=ExitCode.UNAVAILABLE) from None
    finally:
        sock.close()


def pack(message: dict) -> bytes | None:
    """``protocol.pack(message)`` for a marker (str keys; None, bool, int, float, str and maps of
    them), byte for byte, without importing msgpack; None for anything else (msgpack then)."""
    out: list[bytes] = []
    return b"".join(out) if _pack(message, out) else None


def _pack(value: object, out: list[bytes]) -> bool:
    """Append ``value`` as msgpack-python's Packer(use_bin_type=True) writes it (the smallest form
    of each int and length, float64); False for a value of another type."""
    kind = type(value)
    if value is None or kind is bool:
        out.append(b"\xc0" if value is None else b"\xc3" if value else b"\xc2")
    elif kind is int:
        if 0 <= value < 0x80 or -32 <= value < 0:
            out.append((value & 0xFF).to_bytes(1, "big"))
        else:
            for low, high, size, tag in _INTS:
                if low <= value <= high:
                    out.append(tag + value.to_bytes(size, "big", signed=low < 0))
                    break
            else:
                return False
    elif kind is float:
        out.append(b"\xcb" + _FLOAT.pack(value))
    elif kind is str:
        try:
            data = value.encode()
        except UnicodeEncodeError:  # a lone surrogate from argv: msgpack's own error then
            return False
        n = len(data)
        out.append((0xA0 | n).to_bytes(1, "big") if n < 32 else _length(n, b"\xd9", b"\xda", b"\xdb"))
        out.append(data)
    elif kind is dict:
        n = len(value)
        out.append((0x80 | n).to_bytes(1, "big") if n < 16 else _length(n, None, b"\xde", b"\xdf"))
        return all(_pack(key, out) and _pack(item, out) for key, item in value.items())
    else:
        return False
    return True


#: msgpack's int forms past the one-byte ones: (lowest, highest, bytes, tag), in the order it tries them.
_INTS = ((0, 0xFF, 1, b"\xcc"), (0, 0xFFFF, 2, b"\xcd"), (0, 0xFFFFFFFF, 4, b"\xce"), (0, 2**64 - 1, 8, b"\xcf"),
         (-(2**7), -1, 1, b"\xd0"), (-(2**15), -1, 2, b"\xd1"), (-(2**31), -1, 4, b"\xd2"), (-(2**63), -1, 8, b"\xd3"))
_FLOAT = struct.Struct(">d")


def _length(n: int, tag8: bytes | None, tag16: bytes, tag32: bytes) -> bytes:
    """A str's or a map's length past its one-byte form."""
    if tag8 is not None and n <= 0xFF:
        return tag8 + n.to_bytes(1, "big")
    return tag16 + n.to_bytes(2, "big") if n <= 0xFFFF else tag32 + n.to_bytes(4, "big")


#: The ping frame that follows every marker (its pong says the marker was taken).
_PING = protocol.frame(pack({"type": "ping"}))
#: How the daemon's pong ({type: pong, version, pid}) begins, after its length.
_PONG = b"\x83\xa4type\xa4pong\xa7version"


def is_pong(data: bytes) -> bool:
    """Whether ``data`` is exactly one frame holding a pong as the daemon writes it (version and
    pid unsigned ints); anything else is for :func:`memrec.terms.protocol.await_pong` to decode."""
    if data[4 : 4 + len(_PONG)] != _PONG:
        return False
    end = _skip_uint(data, 4 + len(_PONG))
    if end < 0 or data[end : end + 4] != b"\xa3pid":
        return False
    return _skip_uint(data, end + 4) == len(data) == 4 + int.from_bytes(data[:4], "big")


#: The size of a msgpack unsigned int after its tag byte.
_UINT_SIZES = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def _skip_uint(data: bytes, at: int) -> int:
    """Where the msgpack unsigned int at ``at`` ends, or -1 where there is none."""
    if at >= len(data):
        return -1
    if data[at] < 0x80:
        return at + 1
    size = _UINT_SIZES.get(data[at])
    return -1 if size is None or at + 1 + size > len(data) else at + 1 + size


#: What a pong's ``dropped`` means (daemon/intake.py DROP_REASONS; markers kept off a nearly
#: full disk are dropped after the pong, when the loop writes them).
_DROPPED = {
    "budget": "your user is over its marker budget (daemon/intake.py; a flood?); try again later",
    "open_phases": "your user or connection holds too many open phases (begin without end)",
}


#: Programs that run a command as their child: the shell that runs them is the one meant.
_WRAPPERS = frozenset({"sudo", "doas", "su", "runuser", "env", "nice", "timeout", "setpriv"})


def _read_proc(path: str) -> str:
    # open() rather than pathlib: pathlib costs this quick command milliseconds of its start-up
    # where nothing else imports it (an installed memrec; docs/performance.md).
    with open(path, errors="replace") as f:
        return f.read()


def _parent(pid: int) -> tuple[int, str]:
    """(parent pid, parent's command name) of ``pid``, from /proc."""
    stat = _read_proc(f"/proc/{pid}/stat")
    ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # the name in () may hold spaces
    return ppid, _read_proc(f"/proc/{ppid}/comm").strip()


#: ``--scope``: what a marker of `memrec mark` speaks for (see :func:`scope_process`).
SCOPES = ("session", "shell")


def invoking_process() -> int:
    """The shell (or program) that runs `memrec mark`: its parent, past sudo and the like."""
    pid = os.getpid()
    try:
        for _ in range(8):
            pid, comm = _parent(pid)
            if comm not in _WRAPPERS or pid <= 1:
                return pid
    except (OSError, ValueError, IndexError):
        return os.getppid()
    return pid


def scope_process(scope: str) -> int:
    """The process a marker of `memrec mark` is stamped with, so that a begin and its end pair.

    Phases pair per process (docs/report.md, "Phases"), and every `memrec mark` is a new process,
    so its marker names one that outlives it. ``shell``: the shell that runs it
    (:func:`invoking_process`). That shell is not the same one for both markers when a Makefile
    runs each line in a shell of its own, or when ``bash -c '...; memrec mark X --phase end'``
    execs its last command (the end's parent is then bash's parent). ``session`` (the default):
    the leader of that shell's session (a login shell, a tmux pane's shell, an ssh session, a
    service's main process), the same for every shell of one terminal, Makefile or script; the
    shell itself when the leader is init, is gone, or is another user's.
    """
    shell = invoking_process()
    if scope == "shell":
        return shell
    try:
        # Our own session, unless a wrapper (sudo) stands between: it may have made one of its own.
        # Not the shell's: an exec'd end's "shell" is bash's parent, perhaps of another session.
        leader = os.getsid(0) if os.getppid() == shell else os.getsid(shell)
        owner = os.stat(f"/proc/{leader}").st_uid
    except OSError:
        return shell
    if leader <= 1 or (os.geteuid() != 0 and owner != os.geteuid()):
        return shell
    return leader


def check_pid(pid: int) -> int:
    """``--pid``: a process that exists and that this user may speak for.

    Raises:
        MemrecCommandError: no such process, or another user's (exit code USAGE).
    """
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        raise MemrecCommandError(f"--pid {pid}: no such process", exit_code=ExitCode.USAGE) from None
    if os.geteuid() != 0 and owner != os.geteuid():
        raise MemrecCommandError(f"--pid {pid}: the process belongs to another user", exit_code=ExitCode.USAGE)
    return pid


def read_after_name(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Parse what follows NAME in ``args.values`` (options and values mixed) into ``args``.

    A usage error there is reported by ``parser`` (mark's usage, ``memrec mark: error: ...``, exit
    code USAGE), as the same mistake before NAME is: where an option stands changes nothing.
    """
    import argparse  # here: the forms quick_args reads never need it

    class UsageParser(argparse.ArgumentParser):
        def error(self, message: str):  # type: ignore[override]
            parser.error(message)

    rest = UsageParser(prog=parser.prog, add_help=False)
    _add_options(rest, default=argparse.SUPPRESS)
    rest.add_argument("values", nargs="*")
    # -v after NAME too, as after any subcommand (mark has nothing more to log)
    rest.add_argument("-v", "--verbose", action="count", default=0)
    extra = rest.parse_intermixed_args(args.values)
    for key in ("phase", "gpu", "socket", "pid", "scope"):
        if hasattr(extra, key):
            setattr(args, key, getattr(extra, key))
    args.values = extra.values


def _add_options(parser: argparse.ArgumentParser, default: object = None) -> None:
    parser.add_argument("--phase", choices=protocol.PHASES, default=default if default is not None else "instant",
                        help="begin, end or instant (default)")
    parser.add_argument("--gpu", type=int, metavar="N", default=default, help="CUDA device ordinal the marker is about")
    parser.add_argument("--socket", metavar="PATH", default=default,
                        help=f"daemon socket (default: $MEMREC_SOCKET or {protocol.DEFAULT_SOCKET})")
    parser.add_argument("--pid", type=int, metavar="PID", default=default,
                        help="the process the marker is about (default: see --scope)")
    parser.add_argument("--scope", choices=SCOPES, default=default if default is not None else "session",
                        help="without --pid, the marker is about the session of the shell running memrec mark "
                             "(session, the default: begin and end pair across the lines of a script or a "
                             "Makefile) or that shell alone (shell: keeps concurrent scripts of one terminal apart)")


class MarkCommand:
    """Send a phase marker to the running daemon (from a shell script or by hand).

    Unlike memrec.mark() in a program, this reports failure: exit code 69 when no daemon listens,
    75 when the marker was sent but the daemon did not confirm it within 2 s (stopped or
    overloaded: it is recorded if the daemon resumes; do not send it again) or when the daemon
    dropped it (over your user's marker budget or open phases).
    The marker is about the session of the shell that runs memrec mark (its leader: a login
    shell, a tmux pane, an ssh session), so a begin and an end pair into one phase from two lines
    of a script, two lines of a Makefile (a shell each), or `bash -c '...'` whose last command is
    the end; --scope shell makes it about that shell alone (two scripts in one terminal marking
    phases of one name at once), and --pid names another process of yours (for instance a server
    started in the background, whose memory the phase then covers). Values are int, float,
    true/false or text.
    With -- CMD [ARGS...], mark runs CMD and makes its run the phase NAME (a begin before CMD
    starts, an end when it exits, both about CMD's process; the processes CMD starts are not in
    it: use memrec.phase in them) and exits with CMD's exit status (128+N for a signal N); Ctrl-C
    goes to CMD. Without a daemon it says so and runs CMD all the same.

    examples:
        memrec mark load_weights --phase begin --gpu 0
        python load.py
        memrec mark load_weights --phase end
        memrec mark load_weights gpu_mem=0.88 -- python load.py
        memrec mark kv_cache_sized tokens=524288 fraction=0.88 ok=true
        memrec mark warmup --phase begin --pid "$SERVER_PID"
    """

    #: Nothing here logs: main() leaves logging out of this quick command (see memrec.commands).
    logs = False

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        import argparse  # here: see quick_args

        _add_options(parser)
        parser.add_argument("name", help=f"what is happening (1..{protocol.MAX_NAME} characters)")
        # Options may follow NAME and mix with the values: argparse alone cannot do that with two
        # positionals, so everything after NAME is parsed again in run().
        values = parser.add_argument("values", nargs=argparse.REMAINDER, metavar="KEY=VALUE",
                                     help="values to record, any of the options above, then -- CMD [ARGS...] "
                                         "to run CMD as the phase")
        values.required = False  # argparse counts a REMAINDER as required: `memrec mark` named it missing

    @staticmethod
    def quick_args(words: list[str]) -> SimpleNamespace | None:
        """The documented forms of ``memrec mark`` read without argparse; None for argparse to read.

        NAME, KEY=VALUE words and ``--phase P``, ``--gpu N``, ``--socket PATH``, ``--pid PID``,
        ``--scope S`` (or ``--option=value``) in any order, the last of an option winning, as argparse reads
        them. Anything else is argparse's, so that its errors and exit codes stay the same: -v,
        -h, an abbreviated option, any other word starting with ``-``, a phase not in PHASES, a
        number that is not plain ASCII digits, a missing NAME.
        """
        if "--" in words:  # NAME ... -- CMD: the words before are mark's, argparse's where not quick
            split = words.index("--")
            args = MarkCommand.quick_args(words[:split]) or _parsed(words[:split])
            args.to_run = list(words[split + 1 :])
            return args
        options = {"phase": "instant", "gpu": None, "socket": None, "pid": None, "scope": "session"}
        words = list(words)
        positional: list[str] = []
        while words:
            word = words.pop(0)
            if not word.startswith("-"):
                positional.append(word)
                continue
            option, equals, value = word.partition("=")
            key = option[2:]
            if option not in _QUICK_OPTIONS:
                return None
            if not equals:
                if not words or words[0].startswith("-"):
                    return None
                value = words.pop(0)
            if not _QUICK_OPTIONS[option](value):
                return None
            options[key] = value if key in ("phase", "socket", "scope") else int(value)
        if not positional:
            return None
        return SimpleNamespace(name=positional[0], values=positional[1:], **options)

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser | None) -> int:
        ts = time.monotonic_ns()
        if parser is not None:  # argparse's: what follows NAME is still to read
            read_after_name(args, parser)
        if args.gpu is not None and not 0 <= args.gpu <= protocol.MAX_GPU:  # named as typed, not as the wire's "gpu"
            raise MemrecCommandError(f"--gpu {args.gpu}: not a CUDA device ordinal (0..{protocol.MAX_GPU})",
                                     exit_code=ExitCode.USAGE)
        utf8_text(args.name, "the marker name")
        values = parse_values(args.values)
        command = getattr(args, "to_run", None)  # not "command": argparse names the subcommand so
        if command is not None:
            return run_as_phase(args, values, command)
        pid = check_pid(args.pid) if args.pid is not None else scope_process(args.scope)
        send_marker(protocol.socket_path(args.socket), marker_frame(args, values, args.phase, ts, get_native_id(), pid))
        return ExitCode.OK


def marker_frame(args: argparse.Namespace, values: dict, phase: str, ts: int, tid: int, pid: int) -> bytes:
    """The frame of one marker of ``args.name`` (``args.gpu``) about ``pid``.

    Raises:
        MemrecCommandError: the marker breaks the protocol's limits (exit code USAGE).
    """
    message = protocol.make_mark(args.name, phase, ts, tid, args.gpu, values, pid)
    problem = protocol.validate_mark(message)
    if problem:
        raise MemrecCommandError(problem.removeprefix("mark: "), exit_code=ExitCode.USAGE)
    payload = pack(message)
    if payload is None:  # msgpack's own encoding, or its error
        try:
            payload = protocol.pack(message)
        except (TypeError, ValueError, OverflowError) as error:
            raise MemrecCommandError(f"cannot encode the marker: {error}", exit_code=ExitCode.USAGE) from None
    if len(payload) > protocol.MAX_CLIENT_FRAME:  # in the user's words, not the wire's ("frame of N bytes")
        raise MemrecCommandError(f"the marker is {len(payload):,} bytes; at most {protocol.MAX_CLIENT_FRAME:,}",
                                 exit_code=ExitCode.USAGE)
    return protocol.frame(payload)


def run_as_phase(args: argparse.Namespace, values: dict, command: list[str]) -> int:
    """``memrec mark NAME -- CMD``: run CMD as a child whose run is the phase NAME; its exit status.

    Phases are per process (docs/report.md), so the markers are stamped with the child's pid, which
    the daemon accepts as ours while /proc/PID exists: the begin is sent after the fork and before
    the child execs CMD (it waits on a pipe for it), the end once the child has exited but before it
    is reaped (a zombie keeps its /proc entry). A marker that cannot be sent is said on stderr and
    CMD runs all the same: a phase is never worth not running the command. Ctrl-C reaches CMD (the
    terminal's whole foreground group) while this waits for it.
    """
    if args.phase != "instant" or args.pid is not None:
        given = "--pid" if args.pid is not None else f"--phase {args.phase}"
        raise MemrecCommandError(f"{given} with a command: the command's run is the phase (its begin and end "
                                 "are sent for you)", exit_code=ExitCode.USAGE)
    if not command:
        raise MemrecCommandError("nothing after --: name the command to run as the phase", exit_code=ExitCode.USAGE)
    path = protocol.socket_path(args.socket)
    marker_frame(args, values, "begin", 0, protocol.MAX_PID, protocol.MAX_PID)  # its limits, before CMD runs
    go_read, go_write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: waits for the begin, then becomes CMD
        try:
            os.close(go_write)
            if os.read(go_read, 1) != b"g":  # memrec mark died before the begin: nothing to run
                os._exit(ExitCode.SOFTWARE)
            os.close(go_read)
            os.execvp(command[0], command)
        except OSError as error:
            os.write(2, f"memrec: error: cannot run {command[0]}: {error.strerror}\n".encode(errors="replace"))
            os._exit(127 if isinstance(error, FileNotFoundError) else 126)
        except BaseException:  # a Ctrl-C before the exec: the child must never return into memrec
            os._exit(130)
    import signal  # here: the plain forms of this quick command never need it

    os.close(go_read)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child takes Ctrl-C; this waits for it
    try:
        begun = _send_phase(path, marker_frame(args, values, "begin", time.monotonic_ns(), child, child))
        os.write(go_write, b"g")
        os.close(go_write)
        os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped: /proc/PID still there
        if begun:  # no end for a begin that was not taken (no daemon: said once)
            _send_phase(path, marker_frame(args, values, "end", time.monotonic_ns(), child, child))
        _, status = os.waitpid(child, 0)
    finally:
        signal.signal(signal.SIGINT, previous)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _send_phase(path: str, frame: bytes) -> bool:
    """Send one of a wrapped command's markers; whether it was taken (a failure is one line on
    stderr, and the command runs on)."""
    try:
        send_marker(path, frame)
    except MemrecCommandError as error:
        os.write(2, f"memrec: warning: {error}; the command runs without its phase\n".encode(errors="replace"))
        return False
    return True


def _parsed(words: list[str]) -> argparse.Namespace:
    """``memrec mark WORDS`` read by argparse (its usage errors and --help exit), what follows NAME
    included: argparse would take a ``--`` right after NAME as its own and drop it."""
    from memrec.commands.parser import get_argument_parser

    args = get_argument_parser(only="mark").parse_args(["mark", *words])
    read_after_name(args, args.parser)
    return args


def _digits(text: str) -> bool:
    """A number quick_args reads as argparse's int() would (longer ones, which int() may refuse,
    are argparse's)."""
    return text.isascii() and text.isdigit() and len(text) <= 18


#: The options quick_args reads, each with the check its value must pass there.
_QUICK_OPTIONS = {"--phase": protocol.PHASES.__contains__, "--gpu": _digits, "--socket": lambda text: True,
                  "--pid": _digits, "--scope": SCOPES.__contains__}
