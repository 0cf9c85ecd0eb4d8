"""``memrec mark``: send one phase marker from a shell script."""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time

from memrec import protocol
from memrec._errors import ExitCode
from memrec._errors import MemrecCommandError

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
        values[key.strip()] = parse_value(value)
    return values


def send_marker(path: str, message: dict, timeout: float = TIMEOUT) -> None:
    """Connect, send the marker and a ping, and wait for the pong.

    The pong means the daemon has taken the marker, while this process (and the shell that runs
    it, which the marker may name) still runs for the daemon to check.

    Raises:
        MemrecCommandError: no daemon answers at ``path`` (exit code UNAVAILABLE).
    """
    data = protocol.encode_frame(message) + protocol.encode_frame({"type": "ping"})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.sendall(data)
            protocol.await_pong(sock)
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
        except (TimeoutError, socket.timeout):
            raise MemrecCommandError(
                f"the memrec daemon on {path} did not take the marker within {timeout:g} s",
                exit_code=ExitCode.UNAVAILABLE,
            ) from None
        except OSError as error:
            raise MemrecCommandError(
                f"cannot send the marker to {path}: {error.strerror or error}", exit_code=ExitCode.UNAVAILABLE
            ) from None
        except protocol.ProtocolError as error:
            raise MemrecCommandError(f"the memrec daemon on {path} refused the marker: {error}",
                                     exit_code=ExitCode.UNAVAILABLE) from None


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


def invoking_process() -> int:
    """The process a shell's `memrec mark` speaks for: its parent, past sudo and the like.

    Every `memrec mark` is a new short-lived process; stamping its markers with the shell (or the
    program) that runs it makes a script's ``--phase begin`` and ``--phase end`` one phase.
    """
    pid = os.getpid()
    try:
        for _ in range(8):
            pid, comm = _parent(pid)
            if comm not in _WRAPPERS or pid <= 1:
                return pid
    except (OSError, ValueError, IndexError):
        return os.getppid()
    return pid


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


class _UsageParser(argparse.ArgumentParser):
    """Parses what follows NAME; reports errors as MemrecCommandError (exit code USAGE)."""

    def error(self, message: str):  # type: ignore[override]
        raise MemrecCommandError(message, exit_code=ExitCode.USAGE)


def _add_options(parser: argparse.ArgumentParser, default: object = None) -> None:
    parser.add_argument("--phase", choices=protocol.PHASES, default=default if default is not None else "instant",
                        help="begin, end or instant (default)")
    parser.add_argument("--gpu", type=int, metavar="N", default=default, help="CUDA device ordinal the marker is about")
    parser.add_argument("--socket", metavar="PATH", default=default,
                        help=f"daemon socket (default: $MEMREC_SOCKET or {protocol.DEFAULT_SOCKET})")
    parser.add_argument("--pid", type=int, metavar="PID", default=default,
                        help="the process the marker is about (default: the shell or program running memrec mark)")


class MarkCommand:
    """Send a phase marker to the running daemon (from a shell script or by hand).

    Unlike memrec.mark() in a program, this reports failure: exit code 69 when no daemon listens.
    The marker is about the shell (or program) that runs memrec mark, so a script's begin and end
    pair into one phase; --pid names another process of yours (for instance a server started
    in the background, whose memory the phase then covers). Values are int, float, true/false
    or text.

    examples:
        memrec mark load_weights --phase begin --gpu 0
        python load.py
        memrec mark load_weights --phase end
        memrec mark kv_cache_sized tokens=524288 fraction=0.88 ok=true
        memrec mark warmup --phase begin --pid "$SERVER_PID"
    """

    #: Nothing here logs: main() leaves logging out of this quick command (see memrec.commands).
    logs = False

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        _add_options(parser)
        parser.add_argument("name", help=f"what is happening (1..{protocol.MAX_NAME} characters)")
        # Options may follow NAME and mix with the values: argparse alone cannot do that with two
        # positionals, so everything after NAME is parsed again in run().
        values = parser.add_argument("values", nargs=argparse.REMAINDER, metavar="KEY=VALUE",
                                     help="values to record, and any of the options above")
        values.required = False  # argparse counts a REMAINDER as required: `memrec mark` named it missing

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        ts = time.monotonic_ns()
        rest = _UsageParser(prog=f"{parser.prog} NAME", add_help=False)
        _add_options(rest, default=argparse.SUPPRESS)
        rest.add_argument("values", nargs="*")
        # -v after NAME too, as after any subcommand (mark has nothing more to log)
        rest.add_argument("-v", "--verbose", action="count", default=0)
        extra = rest.parse_intermixed_args(args.values)
        for key in ("phase", "gpu", "socket", "pid"):
            if hasattr(extra, key):
                setattr(args, key, getattr(extra, key))
        values = parse_values(extra.values)
        pid = check_pid(args.pid) if args.pid is not None else invoking_process()
        message = protocol.make_mark(args.name, args.phase, ts, threading.get_native_id(), args.gpu, values, pid)
        problem = protocol.validate_mark(message)
        if problem:
            raise MemrecCommandError(problem.removeprefix("mark: "), exit_code=ExitCode.USAGE)
        try:
            protocol.encode_frame(message)
        except protocol.ProtocolError as error:
            raise MemrecCommandError(str(error), exit_code=ExitCode.USAGE) from None
        send_marker(protocol.socket_path(args.socket), message)
        return ExitCode.OK
