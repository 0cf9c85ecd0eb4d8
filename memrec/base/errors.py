"""memrec's errors: the commands' own (with an exit code) and the domains' (without one).

Only ``main()`` prints them. The daemon, its sockets and the probes raise domain errors that say
what went wrong, not how a command should end; :func:`memrec.commands.common.exit_code` is the one
place that turns them into exit codes. A command raises :class:`MemrecCommandError` with the exit
code it means.
"""

from __future__ import annotations


class ExitCode:
    """Exit codes of the ``memrec`` command (sysexits-style where one fits).

    Plain ints rather than an ``enum.IntEnum``: importing enum costs `memrec mark` and `memrec
    --help` about a third of a bare interpreter's start-up (docs/performance.md).
    """

    OK = 0
    ERROR = 1  # a check failed or the run found a problem (doctor, selftest)
    USAGE = 2  # bad arguments
    DATA = 65  # bad input file (not a trace, wrong version, corrupt)
    NO_INPUT = 66  # input file missing or unreadable
    UNAVAILABLE = 69  # a needed service is missing (no daemon, no BPF, no NVML)
    SOFTWARE = 70  # internal error
    CANT_CREATE = 73  # cannot write the output
    TEMPFAIL = 75  # sent but not confirmed: the daemon did not answer in time (stopped, overloaded)
    NO_PERM = 77  # needs root or CAP_BPF+CAP_PERFMON


class MemrecError(Exception):
    """Base of every error memrec raises on purpose."""


class MemrecCommandError(MemrecError):
    """An error a command reports to the user as one line, with the exit code to return."""

    def __init__(self, *args: object, exit_code: int = ExitCode.ERROR) -> None:
        super().__init__(*args)
        self.exit_code = int(exit_code)


class StopSignal(KeyboardInterrupt):
    """SIGTERM or SIGINT while the daemon (or ``memrec record``) was still starting.

    Raised from the signal handler so that the start unwinds through its teardown (its socket
    removed, the probes detached, a recorded command's suspended child killed) instead of the
    process dying with them in place; a KeyboardInterrupt, so that no ``except Exception`` on the
    way catches it. ``main()`` exits with 128 + the signal's number, as the signal's death would.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = int(signum)


class TraceFormatError(MemrecError):
    """A file is not a memrec trace, or is of a version this memrec cannot read."""


class DaemonError(MemrecError):
    """The daemon cannot start or go on; the message is the reason in one line."""


class SocketError(DaemonError):
    """A socket the daemon serves on cannot be set up (in use, not a socket, permissions, an address)."""


class OutputError(DaemonError):
    """The daemon cannot create or write its trace."""


class PrivilegeError(DaemonError):
    """The daemon cannot get or give up a privilege it was asked to (capabilities)."""


class UnavailableError(MemrecError):
    """Something the daemon needs is not installed (an optional package)."""


class ProbeError(MemrecError):
    """The probes cannot be loaded or used (no bcc, no BPF, a compile failure, a file that is not
    the driver)."""


class ProbeLoadError(ProbeError):
    """The BPF program cannot be compiled or loaded; the message is the reason in one line."""


def one_line(error: BaseException) -> str:
    """An exception as one line of at most 500 characters (bcc puts a compiler's complaint on
    several lines: the first and the last are kept)."""
    text = str(error).strip() or type(error).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1:
        return f"{lines[0]} ... {lines[-1]}"[:500]
    return lines[0][:500] if lines else type(error).__name__
