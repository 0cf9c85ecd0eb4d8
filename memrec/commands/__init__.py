"""The ``memrec`` command line: one module per subcommand, one class per command.

Each command class is named ``<Name>Command``; the subcommand is the lower-cased name and its help
is the class docstring. Commands raise :class:`MemrecCommandError` (the daemon and the probes
their domain errors, mapped by :func:`memrec.commands.common.exit_code`); only :func:`main` prints errors.
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
import traceback
from typing import Protocol

from memrec._errors import ExitCode
from memrec._errors import MemrecError
from memrec._errors import one_line
from memrec.commands.common import exit_code


class Command(Protocol):
    """What every subcommand provides."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        """Add the subcommand's arguments."""

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        """Run the subcommand and return the exit code."""


def _commands() -> list[Command]:
    # Imported here so that `memrec dump` never pays for what `memrec daemon` imports.
    from memrec.commands import completion
    from memrec.commands import daemon
    from memrec.commands import demo
    from memrec.commands import diff
    from memrec.commands import doctor
    from memrec.commands import dump
    from memrec.commands import export
    from memrec.commands import install_service
    from memrec.commands import mark
    from memrec.commands import merge
    from memrec.commands import plot
    from memrec.commands import record
    from memrec.commands import report
    from memrec.commands import selftest
    from memrec.commands import tui

    return [
        daemon.DaemonCommand(),
        record.RecordCommand(),
        report.ReportCommand(),
        diff.DiffCommand(),
        merge.MergeCommand(),
        dump.DumpCommand(),
        export.ExportCommand(),
        plot.PlotCommand(),
        tui.TuiCommand(),
        mark.MarkCommand(),
        doctor.DoctorCommand(),
        demo.DemoCommand(),
        selftest.SelftestCommand(),
        install_service.InstallServiceCommand(),
        completion.CompletionCommand(),
    ]


def get_argument_parser() -> argparse.ArgumentParser:
    """Build the parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="memrec",
        description="Record and explain GPU memory: every driver allocation, mapping and IPC "
        "open on the host, NVML beside it, phase markers from the application.",
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version, trace format and BPF program, then exit")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    # -v also after the subcommand (`memrec report -v x`): counted apart, added up in main().
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", dest="verbose_after", action="count", default=0,
                         help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _commands():
        name = type(command).__name__
        assert name.endswith("Command"), name
        doc = (type(command).__doc__ or "").strip()
        sub_parser = sub.add_parser(
            _command_name(name[: -len("Command")]),
            help=doc.splitlines()[0] if doc else None,
            description=doc,
            formatter_class=_DocstringFormatter,
            parents=[verbose],
        )
        command.prepare_parser(sub_parser)
        sub_parser.set_defaults(entrypoint=command.run, parser=sub_parser)
    return parser


class _DocstringFormatter(argparse.RawDescriptionHelpFormatter):
    """A command's docstring as its help, fitted to the terminal (80 columns when piped).

    The docstrings keep their layout (examples, the --to table) but are written ~100 columns wide:
    a run of lines at the paragraph's indent is reflowed as one paragraph, and any other line too
    wide wraps with its continuation 4 columns further in. Nothing is cut.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        head, hang, words = "", 0, []  # the block being reflowed: its first line's prefix, its indent

        def flush() -> None:
            if words:
                out.extend(textwrap.wrap(" ".join(words), width, initial_indent=indent + head,
                                         subsequent_indent=indent + " " * hang, break_long_words=False,
                                         break_on_hyphens=False))
                words.clear()

        for line in text.splitlines():
            lead = len(line) - len(line.lstrip(" "))
            if not line.strip():
                flush()
                out.append("")
            elif words and lead == hang and hang >= 4:  # the block goes on
                words.append(line.strip())
            elif lead == 4:  # a paragraph, or a row of a two-column table continued under its second cell
                flush()
                gap = line.find("  ", lead)
                hang = gap + len(line[gap:]) - len(line[gap:].lstrip(" ")) if gap > 0 else lead
                head, words[:] = line[:hang], [line[hang:].strip()]
            else:  # the summary, an example: wrapped alone, continued 4 columns further in
                flush()
                hang = 0
                out.extend(textwrap.wrap(line.strip(), width, initial_indent=indent + " " * lead,
                                         subsequent_indent=indent + " " * (lead + 4), break_long_words=False,
                                         break_on_hyphens=False))
        flush()
        return "\n".join(out)


class _VersionAction(argparse.Action):
    """``--version``: worked out only when asked (it reads the trace format and hashes the BPF source)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from memrec.build_info import version_text

        print(version_text())
        parser.exit()


def _command_name(class_stem: str) -> str:
    """``InstallService`` → ``install-service``."""
    return "".join("-" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(class_stem))


def _logging_level(verbosity: int) -> int:
    return {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)


def main(args: list[str] | None = None) -> int:
    """Run the memrec command line and return its exit code."""
    parser = get_argument_parser()
    arg_values = parser.parse_args(args)
    arg_values.verbose += arg_values.verbose_after
    logging.basicConfig(
        level=_logging_level(arg_values.verbose),
        format="memrec: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(arg_values.entrypoint(arg_values, arg_values.parser))
    except MemrecError as error:
        print(f"memrec: error: {error}", file=sys.stderr)
        return exit_code(error)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return ExitCode.OK
    except Exception as error:  # a bug: one line for the user, the traceback with -v
        if arg_values.verbose:
            traceback.print_exc()
        print(f"memrec: internal error: {type(error).__name__}: {one_line(error)} "
              "(a bug in memrec: run again with -v for the traceback)", file=sys.stderr)
        return ExitCode.SOFTWARE
