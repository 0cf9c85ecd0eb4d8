"""The argparse parser of the whole ``memrec`` command line.

Apart from :mod:`memrec.commands` so that the quick commands need not import argparse (it costs
about a bare interpreter's start-up, docs/performance.md): ``memrec --help`` is rendered from
:data:`memrec.commands.COMMANDS` and the documented forms of ``memrec mark`` are parsed by hand;
everything else, and every error and ``--help`` of a command, comes from here.
"""

from __future__ import annotations

import argparse
import textwrap

from memrec.commands.table import COMMANDS
from memrec.commands.table import DESCRIPTION
from memrec.commands.table import OPTIONS
from memrec.commands.table import load_command


def get_argument_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with one subparser per command, each with its arguments.

    With ``only`` naming a command, that command's subparser alone (what a command line that runs it
    needs); with any other ``only``, the commands by name and summary alone (what `memrec --help` and
    a misspelt command's error show).
    """
    parser = argparse.ArgumentParser(
        prog="memrec",
        description=DESCRIPTION,
    )
    parser.add_argument("--version", action=_VersionAction, help=OPTIONS["--version"])
    parser.add_argument("-v", "--verbose", action="count", default=0, help=OPTIONS["-v, --verbose"])
    # -v also after the subcommand (`memrec report -v x`): counted apart, added up in main().
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", dest="verbose_after", action="count", default=0,
                         help=OPTIONS["-v, --verbose"])
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


#: How a line that is a command to copy starts (with the indentation taken off).
_EXAMPLE_STARTS = ("memrec ", "$ ", "sudo memrec ")


class _DocstringFormatter(argparse.RawDescriptionHelpFormatter):
    """A command's docstring as its help, fitted to the terminal (80 columns when piped).

    The docstrings keep their layout (examples, the --to table) but are written ~100 columns wide:
    a run of lines at the paragraph's indent is reflowed as one paragraph, and the summary line wraps
    with its continuation 4 columns further in. Nothing is cut. An example (a line indented deeper
    than the paragraphs, or one starting with ``memrec ``/``$ ``) is never wrapped, even past the
    width: a command line broken across lines no longer pastes into a shell.
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
            elif lead > 4 or line.lstrip().startswith(_EXAMPLE_STARTS):  # an example: copied as it is
                flush()
                hang = 0
                out.append(indent + line.rstrip())
            else:  # the summary: wrapped alone, continued 4 columns further in
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


