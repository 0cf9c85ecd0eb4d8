"""The ``memrec`` command line: one module per subcommand, one class per command.

Each command class is named ``<Name>Command`` (``install-service``: ``InstallServiceCommand`` in
``install_service.py``), listed in :data:`COMMANDS`; its help is the class docstring. Commands
raise :class:`MemrecCommandError` (the daemon and the probes their domain errors, mapped by
:func:`memrec.commands.common.exit_code`); only :func:`main` prints errors.

The quick commands, ``memrec --help`` and ``memrec mark``, run without argparse (importing it costs
about a bare interpreter's start-up; docs/performance.md): the top-level help is rendered here by
argparse's layout rules (:func:`help_text`), and a command may parse its documented forms by hand
(``quick_args``). Everything else, and every error, goes through the argparse parser of
:mod:`memrec.commands.parser`; tests/unit/test_quick_commands.py holds the two to the same output.
"""

from __future__ import annotations

import errno
import os
import sys

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.base.errors import MemrecError
from memrec.base.errors import StopSignal
from memrec.base.errors import one_line
from memrec.commands.table import COMMANDS
from memrec.commands.table import DESCRIPTION
from memrec.commands.table import OPTIONS
from memrec.commands.table import load_command

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see memrec.TYPE_CHECKING)

if TYPE_CHECKING:  # typing only for the checker: see memrec.TYPE_CHECKING
    import argparse
    from typing import Callable
    from typing import Protocol

    class Command(Protocol):
        """What every subcommand provides.

        A command that never logs says so with a class attribute ``logs = False``: main() then
        leaves the logging module out (unless -v is given), which the quick commands need. A quick
        command also has ``quick_args(words)``: the words after its name parsed without argparse,
        as the ``args`` that ``run`` takes (``parser`` None then), or None for argparse to parse.
        """

        def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
            """Add the subcommand's arguments."""

        def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser | None) -> int:
            """Run the subcommand and return the exit code."""


def _command_in(argv: list[str]) -> str:
    """The subcommand a command line runs: its first word that is not an option (the options before
    a subcommand take no value); none when -h comes first (`memrec -h mark` lists every command)."""
    for word in argv:
        if word in ("-h", "--help"):
            return ""
        if not word.startswith("-"):
            return word
    return ""


def terminal_columns() -> int:
    """The columns argparse formats help for: $COLUMNS, else the terminal's, else 80 (as
    ``shutil.get_terminal_size``, which would import shutil and its compression modules)."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns > 0:
        return columns
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):
        return 80


def help_text(columns: int) -> str | None:
    """``memrec --help`` as argparse writes it at ``columns``, or None where this would differ.

    argparse's layout for this one parser: the usage line, the description filled to the width,
    then each command (indented 4) and each option (indented 2) with its help wrapped in a column 2
    past the longest of them (at most 24). None (argparse then renders it) when the usage line does
    not fit, or textwrap would cut a word longer than its column. tests/unit/test_quick_commands.py
    compares the two at every width.
    """
    width = columns - 2  # argparse's HelpFormatter leaves 2 columns
    usage = "usage: memrec " + " ".join(f"[{flags.split(',')[0]}]" for flags in OPTIONS) + " COMMAND ..."
    column = min(2 + max(len("COMMAND"), *map(len, COMMANDS), *map(len, OPTIONS)) + 2, 24, max(width - 20, 4))
    description = _wrap(DESCRIPTION, max(width, 11))
    if len(usage) > width or description is None:
        return None
    lines = [usage, "", *description, "", "positional arguments:", "  COMMAND"]
    for indent, entries, title in ((4, COMMANDS, None), (2, OPTIONS, "options:")):
        if title:
            lines += ["", title]
        for name, summary in entries.items():
            wrapped = _wrap(summary, max(width - column, 11))
            if wrapped is None:
                return None
            if len(name) <= column - indent - 2:
                lines.append(f"{' ' * indent}{name.ljust(column - indent - 2)}  {wrapped[0]}")
            else:
                lines += [" " * indent + name, " " * column + wrapped[0]]
            lines += [" " * column + line for line in wrapped[1:]]
    return "\n".join(lines) + "\n"


def _wrap(text: str, width: int) -> list[str] | None:
    """``textwrap.wrap(text, width)`` (textwrap imports re), or None where it would cut a word
    longer than ``width`` or split an em-dash.

    textwrap's pieces: the words, each split after a hyphen between letters ("stub-" "driver"),
    and the spaces between them; a line takes pieces while they fit.
    """
    for space in "\t\n\r\x0b\x0c":  # argparse and textwrap split at ASCII whitespace alone
        text = text.replace(space, " ")
    pieces: list[str] = []
    for word in filter(None, text.split(" ")):
        if "--" in word[1:]:  # an em-dash: textwrap's own rule
            return None
        if pieces:
            pieces.append(" ")
        start = 0
        for at in range(1, len(word) - 2):
            if word[at] == "-" and _hyphen_breaks(word, at):
                pieces.append(word[start : at + 1])
                start = at + 1
        pieces.append(word[start:])
    if any(len(piece) > width for piece in pieces):
        return None
    pieces.reverse()
    lines: list[str] = []
    while pieces:  # textwrap's loop: a blank piece is dropped where a line begins (but the first) or ends
        if lines and not pieces[-1].strip():
            pieces.pop()
        line: list[str] = []
        size = 0
        while pieces and size + len(pieces[-1]) <= width:
            size += len(pieces[-1])
            line.append(pieces.pop())
        if line and not line[-1].strip():
            line.pop()
        if line:
            lines.append("".join(line))
    return lines


def _hyphen_breaks(word: str, at: int) -> bool:
    """Whether textwrap breaks ``word`` after its hyphen at ``at``: two letters (or letter, hyphen,
    letter) before it, a letter, an optional hyphen and a letter after it."""
    def letter(i: int) -> bool:
        return 0 <= i < len(word) and (word[i] == "_" or (word[i].isalnum() and not word[i].isdecimal()))

    before = (letter(at - 2) and letter(at - 1)) or (letter(at - 3) and word[at - 2] == "-" and letter(at - 1))
    after = letter(at + 1) and (letter(at + 2) or (word[at + 2 : at + 3] == "-" and letter(at + 3)))
    return before and after


def _configure_logging(verbosity: int) -> None:
    """Log to stderr as ``memrec: LEVEL: message``; -v for info, -vv for debug."""
    # Imported here: logging (with traceback) costs milliseconds of `memrec mark`'s start-up, which
    # logs nothing, and --help exits before this (docs/performance.md).
    import logging

    logging.basicConfig(
        level={0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG),
        format="memrec: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )


def main(args: list[str] | None = None) -> int:
    """Run the memrec command line and return its exit code."""
    argv = sys.argv[1:] if args is None else args
    if argv in ([], ["-h"], ["--help"]):
        text = help_text(terminal_columns())
        if text is not None:  # what argparse prints, and how it ends, without argparse
            if argv:  # written as any command's output: one that cannot be written is an error
                try:
                    sys.stdout.write(text)
                    sys.stdout.flush()
                except OSError as error:
                    raise SystemExit(_output_error(error, 0)) from None
                raise SystemExit(ExitCode.OK)
            usage = text.split("\n", 1)[0]
            _write(sys.stderr, f"{usage}\nmemrec: error: the following arguments are required: COMMAND\n")
            raise SystemExit(ExitCode.USAGE)
    verbose = 0
    try:  # the parsing too: an option's type that raises, or --version's print, is handled below
        run, verbose = _quick(argv) or _parse(argv)
        code = int(run())
        sys.stdout.flush()  # a full disk under `> file` is this command's error, not the exit's
        return code
    except MemrecCommandError as error:  # a command's own error says its exit code
        print(f"memrec: error: {error}", file=sys.stderr)
        return error.exit_code
    except MemrecError as error:  # a domain's (daemon, sockets, probes, trace format): mapped in one place
        from memrec.commands.common import exit_code  # here: the quick commands never import it

        print(f"memrec: error: {error}", file=sys.stderr)
        return exit_code(error)
    except StopSignal as stop:
        print(f"memrec: stopped by signal {stop.signum} while starting", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return ExitCode.OK
    except OSError as error:
        return _output_error(error, verbose)
    except Exception as error:
        return _internal_error(error, verbose)


#: The errors only a write gives: with no file name, standard output could not be written.
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _output_error(error: OSError, verbose: int) -> int:
    """Standard output that cannot be written: one line and CANT_CREATE; any other OSError a bug."""
    if error.filename is not None or error.errno not in _WRITE_ERRNOS:
        return _internal_error(error, verbose)
    # only a write fails so, and every file a command writes names its path (create_file):
    # this is standard output (`> /dev/full`, a full disk, a quota)
    print(f"memrec: error: cannot write the output: {error.strerror}", file=sys.stderr)
    return ExitCode.CANT_CREATE


def _internal_error(error: Exception, verbose: int) -> int:
    """A bug: one line for the user, the traceback with -v."""
    if verbose:
        import traceback  # only for a bug: see _configure_logging

        traceback.print_exc()
    print(f"memrec: internal error: {type(error).__name__}: {one_line(error)} "
          "(a bug in memrec: run again with -v for the traceback)", file=sys.stderr)
    return ExitCode.SOFTWARE


def _write(stream, text: str) -> None:
    """Write as argparse writes help and usage errors: nowhere to write them is no error."""
    try:
        stream.write(text)
    except (AttributeError, OSError):
        pass


def _quick(argv: list[str]) -> tuple[Callable[[], int], int] | None:
    """The run of a command line that its command parses by hand (``quick_args``), with no -v;
    None for argparse to parse."""
    if not argv or argv[0] not in COMMANDS:
        return None
    command = load_command(argv[0])
    quick_args = getattr(command, "quick_args", None)
    args = quick_args(argv[1:]) if quick_args else None
    return None if args is None else ((lambda: command.run(args, None)), 0)


def _parse(argv: list[str]) -> tuple[Callable[[], int], int]:
    """The run of a command line parsed by argparse (which exits on a usage error or --help), and
    its verbosity; logging configured unless the command never logs."""
    from memrec.commands.parser import get_argument_parser

    parser = get_argument_parser(only=_command_in(argv))
    arg_values, unknown = parser.parse_known_args(argv)
    if unknown:  # after the command: its usage and prog (argparse's parse_args named memrec's)
        before = argv.index(unknown[0]) < argv.index(arg_values.command)
        (parser if before else arg_values.parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    arg_values.verbose += arg_values.verbose_after
    if arg_values.verbose or getattr(arg_values.entrypoint.__self__, "logs", True):
        _configure_logging(arg_values.verbose)
    return (lambda: arg_values.entrypoint(arg_values, arg_values.parser)), arg_values.verbose
