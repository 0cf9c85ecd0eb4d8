"""What several commands share: opening a trace with one-line errors and the right exit codes."""

from __future__ import annotations

import os
from pathlib import Path

from memrec._errors import ExitCode
from memrec._errors import MemrecCommandError
from memrec._errors import TraceFormatError


def check_trace_path(path: Path) -> None:
    """Raise the one-line error for a trace path that is missing, a folder or unreadable (NO_INPUT),
    or an empty file (DATA: nothing a command could show)."""
    if not path.exists():
        raise MemrecCommandError(f"{path}: no such file", exit_code=ExitCode.NO_INPUT)
    if path.is_dir():
        raise MemrecCommandError(f"{path}: is a directory, not a trace", exit_code=ExitCode.NO_INPUT)
    if not os.access(path, os.R_OK):
        raise MemrecCommandError(f"{path}: not readable", exit_code=ExitCode.NO_INPUT)
    if path.stat().st_size == 0:
        raise MemrecCommandError(f"{path}: empty file, not a memrec trace (yet?)", exit_code=ExitCode.DATA)


def load_trace_for_command(path: Path):
    """Load a whole trace, or raise the error a user should see.

    Raises:
        MemrecCommandError: missing, a directory or unreadable (NO_INPUT); not a memrec trace or a
            newer format (DATA).
    """
    from memrec.trace.reader import load_trace

    check_trace_path(path)
    try:
        trace = load_trace(path)
    except TraceFormatError as error:
        message = str(error) if str(path) in str(error) else f"{path}: {error}"
        raise MemrecCommandError(message, exit_code=ExitCode.DATA) from error
    except OSError as error:
        raise MemrecCommandError(f"{path}: {error.strerror or error}", exit_code=ExitCode.NO_INPUT) from error
    if not trace.header:  # cut inside its header: nothing to report
        raise MemrecCommandError(f"{path}: {trace.warnings[0]}", exit_code=ExitCode.DATA)
    return trace
