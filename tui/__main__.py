"""``python -m memrec.tui ARGS``: the same as ``memrec tui ARGS``."""

from __future__ import annotations

import argparse
import sys

from memrec._errors import MemrecCommandError
from memrec.commands.tui import TuiCommand


def main(argv: list[str] | None = None) -> int:
    command = TuiCommand()
    parser = argparse.ArgumentParser(prog="memrec tui", description=TuiCommand.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    command.prepare_parser(parser)
    args = parser.parse_args(argv)
    try:
        return command.run(args, parser)
    except MemrecCommandError as error:
        print(f"memrec: error: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
