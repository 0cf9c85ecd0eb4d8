"""``python -m memrec.tui ARGS``: the same as ``memrec tui ARGS``.

It goes through :func:`memrec.commands.main`, so both entry points parse alike and end alike:
one line on stderr and the exit code of :func:`memrec.commands.common.exit_code` for every
error, the command's own and the domains' (daemon, sockets, probes, trace format).
"""

from __future__ import annotations

import sys

from memrec.commands import main as memrec_main


def main(argv: list[str] | None = None) -> int:
    return memrec_main(["tui", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
