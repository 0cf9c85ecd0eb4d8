"""``memrec dump``: print every record of a trace as JSON lines (a debugging aid)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.base.errors import TraceFormatError
from memrec.commands.common import check_trace_path


class DumpCommand:
    """Print every record of a trace as one JSON object per line (for debugging).

    The header first, then each event, sample, marker, process, lost count and keyframe
    (summarised) in file order, then the trailer. Reader warnings (a truncated tail, no trailer)
    go to stderr. Output to a terminal is refused unless --force: pipe it to a file, jq or less.

    examples:
        memrec dump run.mrec > run.jsonl
        memrec dump run.mrec | jq 'select(.kind == "ALLOC")'
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("trace", metavar="TRACE", help="the trace file (.mrec)")
        parser.add_argument(
            "-f", "--force", action="store_true", help="write to the terminal even though the output is long"
        )

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        out = sys.stdout
        if out.isatty() and not args.force:
            raise MemrecCommandError(
                "refusing to print a whole trace to a terminal: redirect the output "
                f"(memrec dump {args.trace} > trace.jsonl, or | less) or pass --force",
                exit_code=ExitCode.USAGE,
            )
        check_trace_path(Path(args.trace))  # the same one-line errors as every other command's
        # Imported here: numpy and the reader are for reading traces, not for `memrec --help`.
        from memrec.base.heap import keep_freed_pages
        from memrec.export.jsonl import dump_trace
        from memrec.trace.reader import TraceReader

        try:
            reader = TraceReader(args.trace)
        except TraceFormatError as error:
            raise MemrecCommandError(str(error), exit_code=ExitCode.DATA) from None
        except OSError as error:
            raise MemrecCommandError(
                f"cannot open {args.trace}: {error.strerror or error}", exit_code=ExitCode.NO_INPUT
            ) from None
        with reader:
            if not reader.header:  # cut inside its header: no records (an empty {} is no dump), as report says
                raise MemrecCommandError(f"{args.trace}: {reader.warnings[0]}", exit_code=ExitCode.DATA)
            keep_freed_pages()  # each chunk's temporaries reuse the last one's pages (memrec/base/heap.py)
            dump_trace(reader, out)
            out.flush()
        for warning in reader.warnings:
            print(f"memrec: warning: {args.trace}: {warning}", file=sys.stderr)
        return ExitCode.OK
