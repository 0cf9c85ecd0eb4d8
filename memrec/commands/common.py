"""What several commands share: the exit code of every error, opening a trace with one-line errors,
checking an output path."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Callable
from typing import Iterator

from memrec.base.errors import DaemonError
from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.base.errors import MemrecError
from memrec.base.errors import OutputError
from memrec.base.errors import PrivilegeError
from memrec.base.errors import ProbeError
from memrec.base.errors import SocketError
from memrec.base.errors import TraceFormatError
from memrec.base.errors import UnavailableError

#: The exit code of each domain error (the first class in this order that the error is an instance of).
EXIT_CODES: tuple[tuple[type[MemrecError], int], ...] = (
    (TraceFormatError, ExitCode.DATA),
    (SocketError, ExitCode.CANT_CREATE),
    (OutputError, ExitCode.CANT_CREATE),
    (PrivilegeError, ExitCode.NO_PERM),
    (ProbeError, ExitCode.UNAVAILABLE),
    (UnavailableError, ExitCode.UNAVAILABLE),
    (DaemonError, ExitCode.ERROR),
)


def exit_code(error: MemrecError) -> int:
    """The exit code ``main()`` returns for ``error``: a command error's own, else by its domain."""
    if isinstance(error, MemrecCommandError):
        return error.exit_code
    for kind, code in EXIT_CODES:
        if isinstance(error, kind):
            return int(code)
    return int(ExitCode.ERROR)


def trace_error(path: Path | str, error: TraceFormatError | OSError) -> MemrecCommandError:
    """The one-line error for a trace that cannot be read: not a trace (DATA) or unreadable (NO_INPUT)."""
    if isinstance(error, OSError):
        return MemrecCommandError(f"{error.filename or path}: {error.strerror or error}", exit_code=ExitCode.NO_INPUT)
    message = str(error) if str(path) in str(error) else f"{path}: {error}"
    return MemrecCommandError(message, exit_code=exit_code(error))


def check_trace_path(path: Path) -> None:
    """Raise the one-line error for a trace path that is missing, a folder, not a regular file (a
    FIFO, a device) or unreadable (NO_INPUT), or an empty file (DATA: nothing a command could show)."""
    try:
        if not path.exists():
            raise MemrecCommandError(f"{path}: no such file", exit_code=ExitCode.NO_INPUT)
        if path.is_dir():
            raise MemrecCommandError(f"{path}: is a directory, not a trace", exit_code=ExitCode.NO_INPUT)
        if not path.is_file():  # a FIFO or a device: its size says nothing, and reading it may block
            raise MemrecCommandError(f"{path}: not a regular file", exit_code=ExitCode.NO_INPUT)
        if not os.access(path, os.R_OK):
            raise MemrecCommandError(f"{path}: not readable", exit_code=ExitCode.NO_INPUT)
        empty = path.stat().st_size == 0
        if empty and _reads_past_its_size(path):  # /proc/self/status, /sys files: size 0, yet text
            raise MemrecCommandError(f"{path}: not a regular file (a /proc or /sys file), not a trace",
                                     exit_code=ExitCode.NO_INPUT)
    except PermissionError as error:  # pathlib's exists() raises it inside a folder this user may not search
        raise MemrecCommandError(f"{path}: {error.strerror}", exit_code=ExitCode.NO_INPUT) from None
    if empty:
        from memrec.trace.reader import EMPTY_FILE

        raise MemrecCommandError(f"{path}: {EMPTY_FILE}", exit_code=ExitCode.DATA)


def _reads_past_its_size(path: Path) -> bool:
    """Whether a file whose size says 0 still reads (a kernel pseudo-file: its size means nothing)."""
    try:
        with open(path, "rb", buffering=0) as f:
            return bool(f.read(1))
    except OSError:
        return False


def load_trace_for_command(path: Path, *, warn: bool = True):
    """Load a whole trace, or raise the error a user should see.

    With ``warn``, the reader's warnings (a cut or damaged trace, no trailer) go to stderr as
    ``memrec: warning: PATH: ...``, as ``memrec dump`` writes them: a diff, an export, a plot or a
    merge of a damaged trace would otherwise look complete. ``memrec report`` shows them in its
    own output instead.

    Raises:
        MemrecCommandError: missing, a directory or unreadable (NO_INPUT); not a memrec trace or a
            newer format (DATA).
    """
    from memrec.trace.reader import load_trace

    return _checked_trace(path, load_trace, warn)


def scan_trace_for_command(path: Path, *, warn: bool = True):
    """Like :func:`load_trace_for_command`, but the events stay in the file: the trace without
    them and a :class:`memrec.engine.source.TraceEvents` that reads them a record at a time
    (``memrec report``: its memory does not follow the events).

    Raises:
        MemrecCommandError: as :func:`load_trace_for_command`.
    """
    from memrec.engine.source import scan_trace

    events = None

    def scan(p: Path):
        nonlocal events
        trace, events = scan_trace(p)
        return trace

    trace = _checked_trace(path, scan, warn)
    return trace, events


@contextlib.contextmanager
def reread(*paths: Path) -> Iterator[None]:
    """Around what reads the events of :func:`scan_trace_for_command`'s traces again: a file
    removed or replaced by something else since the first pass is the one-line error of a trace
    that cannot be read, not a traceback."""
    try:
        yield
    except (TraceFormatError, OSError) as error:
        named = getattr(error, "filename", None)
        raise trace_error(next((p for p in paths if str(p) == named), paths[0]), error) from error


def _checked_trace(path: Path, read, warn: bool):
    check_trace_path(path)
    try:
        trace = read(path)
    except (TraceFormatError, OSError) as error:
        raise trace_error(path, error) from error
    from memrec.trace.reader import nothing_read

    problem = nothing_read(trace, path)  # cut inside its header: nothing to report
    if problem is not None:
        raise MemrecCommandError(f"{path}: {problem}", exit_code=ExitCode.DATA)
    if warn:
        for warning in trace.warnings:
            print(f"memrec: warning: {path}: {warning}", file=sys.stderr)
    return trace


def check_not_an_input(out: Path, inputs: list[Path]) -> None:
    """Refuse an output that is one of the traces the command reads, by any name (a link, `-o
    x.png` for a trace named x.png), even with --force: -f replaces an earlier output, never the
    recording itself.

    Raises:
        MemrecCommandError: ``out`` is one of ``inputs`` (exit code USAGE).
    """
    for path in inputs:
        try:
            same = os.path.samefile(out, path)
        except OSError:  # either is missing: nothing to lose
            continue
        if same:
            raise MemrecCommandError(f"{out}: is a trace this command reads; give another name",
                                     exit_code=ExitCode.USAGE)


def arg_type(convert: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type=`` that keeps the converter's one-line reason in the usage error (a
    ValueError from the converter would otherwise escape argparse's own check as an internal error
    when it runs later, or read as argparse's bare "invalid value")."""

    def parse(text: str) -> object:
        try:
            return convert(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = convert.__name__
    return parse


def check_output(path: Path, force: bool) -> bool:
    """Check a command's output can be written at ``path``; return True when it replaces a file.

    The one rule of every command that writes a file (record, merge, export, plot): a missing
    folder is a typing mistake more often than a wish, so it is not created; an existing file is
    a recording or a picture someone may still want, so it is kept unless ``force``. An existing
    folder passes: `memrec record` writes a timestamped name inside it, as `memrec daemon` does,
    and a command that cannot use one says so itself.

    Raises:
        MemrecCommandError: the folder is missing or this user may not look into it, or the file
            exists and ``force`` is false (exit code CANT_CREATE).
    """
    try:
        if path.is_dir():
            return False
        folder = path.parent
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "no such folder"
            raise MemrecCommandError(f"cannot write {path}: {folder}: {what}", exit_code=ExitCode.CANT_CREATE)
        exists = path.exists() or path.is_symlink()
    except PermissionError as error:  # pathlib's is_dir()/exists() raise it for a folder it may not search
        raise MemrecCommandError(f"cannot write {path}: {error.strerror}", exit_code=ExitCode.CANT_CREATE) from None
    if exists:
        if not force:
            raise MemrecCommandError(
                f"{path} exists: use -f/--force to replace it, or another -o", exit_code=ExitCode.CANT_CREATE
            )
        return True
    return False
