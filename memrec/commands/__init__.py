"""The ``memrec`` command line: one module per subcommand, one class per command.

Each command class is named ``<Name>Command`` (``install-service``: ``InstallServiceCommand`` in
``install_service.py``), listed in :data:`COMMANDS`; its help is the class docstring. Commands
raise :class:`MemrecCommandError` (the daemon and the probes their domain errors, mapped by
:func:`memrec.commands.common.exit_code`); only :func:`main` prints errors.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

from memrec import TYPE_CHECKING
from memrec._errors import ExitCode
from memrec._errors import MemrecCommandError
from memrec._errors import MemrecError
from memrec._errors import one_line

if TYPE_CHECKING:  # typing only for the checker: see memrec.TYPE_CHECKING
    from typing import Protocol

    class Command(Protocol):
        """What every subcommand provides.

        A command that never logs says so with a class attribute ``logs = False``: main() then
        leaves the logging module out (unless -v is given), which the quick commands need.
        """

        def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
            """Add the subcommand's arguments."""

        def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
            """Run the subcommand and return the exit code."""


#: The subcommands, in ``memrec --help`` order, with the one-line summary that lists each there (the
#: first line of its class's docstring; tests/unit/test_lazy_imports.py checks that they agree).
#: The summaries are written here as well so that a run imports the module of the one command it
#: runs: importing all fifteen to list them made `memrec --help` and `memrec mark` take 6× a bare
#: interpreter (docs/performance.md).
COMMANDS: dict[str, str] = {
    "daemon": "Record GPU memory events of every CUDA process on this host, until SIGINT/SIGTERM.",
    "record": "Record a command and every process it starts, then exit with the command's exit code.",
    "report": "Summarise a trace per GPU: peaks, processes, categories, phases, exits and failed calls.",
    "diff": "Compare two traces: a verdict first, then the KV budget per rank and the phases side by side.",
    "merge": "Merge the traces of several hosts of one job (multi-node TP/PP) into one trace.",
    "dump": "Print every record of a trace as one JSON object per line (for debugging).",
    "export": "Write a trace for Perfetto, PyTorch's memory_viz, or pandas/polars/DuckDB.",
    "plot": "Draw a trace as a picture for a bug report: one panel per GPU.",
    "tui": "Browse GPU memory over time: one tab per GPU, a timeline stacked by category, who held what.",
    "mark": "Send a phase marker to the running daemon (from a shell script or by hand).",
    "doctor": "Check this host: privileges, BPF, tracefs, bcc, kernel headers, libcuda, NVML.",
    "demo": "Record the bundled stub-driver workload with real probes, then print its report.",
    "selftest": "Make a scripted set of real CUDA driver calls and check the daemon recorded each exactly.",
    "install-service": "Install the systemd service (unit, socket group, shell completions); --enable starts it.",
    "completion": "Print a shell completion script for bash, zsh or fish.",
}


def load_command(name: str) -> Command:
    """The command ``name`` (``install-service`` → ``install_service.InstallServiceCommand``)."""
    module = importlib.import_module(f"memrec.commands.{name.replace('-', '_')}")
    return getattr(module, "".join(part.capitalize() for part in name.split("-")) + "Command")()


def get_argument_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with one subparser per command, each with its arguments.

    With ``only`` naming a command, that command's subparser alone (what a command line that runs it
    needs); with any other ``only``, the commands by name and summary alone (what `memrec --help` and
    a misspelt command's error show).
    """
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
    for name, summary in COMMANDS.items():
        if only in COMMANDS and name != only:
            continue
        if only is not None and only not in COMMANDS:
            sub.add_parser(name, help=summary)
            continue
        command = load_command(name)
        sub_parser = sub.add_parser(
            name,
            help=summary,
            description=(type(command).__doc__ or "").strip(),
            formatter_class=_DocstringFormatter,
            parents=[verbose],
        )
        command.prepare_parser(sub_parser)
        sub_parser.set_defaults(entrypoint=command.run, parser=sub_parser)
    return parser


def _command_in(argv: list[str]) -> str:
    """The subcommand a command line runs: its first word that is not an option (the options before
    a subcommand take no value); none when -h comes first (`memrec -h mark` lists every command)."""
    for word in argv:
        if word in ("-h", "--help"):
            return ""
        if not word.startswith("-"):
            return word
    return ""


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
    arg_values = get_argument_parser(only=_command_in(argv)).parse_args(argv)
    arg_values.verbose += arg_values.verbose_after
    if arg_values.verbose or getattr(arg_values.entrypoint.__self__, "logs", True):
        _configure_logging(arg_values.verbose)
    try:
        return int(arg_values.entrypoint(arg_values, arg_values.parser))
    except MemrecCommandError as error:  # a command's own error says its exit code
        print(f"memrec: error: {error}", file=sys.stderr)
        return error.exit_code
    except MemrecError as error:  # a domain's (daemon, sockets, probes, trace format): mapped in one place
        from memrec.commands.common import exit_code  # here: the quick commands never import it

        print(f"memrec: error: {error}", file=sys.stderr)
        return exit_code(error)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return ExitCode.OK
    except Exception as error:  # a bug: one line for the user, the traceback with -v
        if arg_values.verbose:
            import traceback  # only for a bug: see _configure_logging

            traceback.print_exc()
        print(f"memrec: internal error: {type(error).__name__}: {one_line(error)} "
              "(a bug in memrec: run again with -v for the traceback)", file=sys.stderr)
        return ExitCode.SOFTWARE
