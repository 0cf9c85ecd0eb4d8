"""``memrec tui``: the terminal UI (replay a trace, follow the daemon, compare two traces)."""

from __future__ import annotations

import argparse
import sys
from contextlib import suppress
from pathlib import Path

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.base.errors import TraceFormatError
from memrec.commands.common import check_trace_path
from memrec.commands.common import trace_error


class TuiCommand:
    """Browse GPU memory over time: one tab per GPU, a timeline stacked by category, who held what.

    At the cursor: who held what on that GPU; beside it, the events around that instant.
    A trace opens on the answer `memrec report` prints first: its window, the cursor on its
    failure, its first line and cause in the status line (o/O: every failure it counts). With
    --diff, the status line is `memrec diff`'s verdict and the view opens where the failing
    run failed, the runs aligned on SGLang's KV sizing (else their first common marker).

      memrec tui run.mrec                   replay a trace
      memrec tui --live [SOCKET]            follow the running daemon
      memrec tui base.mrec --diff other.mrec   compare two traces

    Press ? inside for the keys.
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("trace", nargs="?", metavar="TRACE", help="a .mrec trace file")
        parser.add_argument(
            "--live",
            nargs="?",
            const="",
            default=None,
            metavar="SOCKET",
            help="follow the daemon (socket: $MEMREC_SOCKET or /run/memrec/memrec.sock)",
        )
        parser.add_argument("--diff", metavar="OTHER", help="compare TRACE with this trace")
        parser.add_argument(
            "--live-events",
            type=int,
            default=2_000_000,
            metavar="N",
            help="live: events kept in memory for the view (older ones are dropped; default 2000000)",
        )

    def make_source(self, args: argparse.Namespace):
        """Build and open the data source; raise MemrecCommandError with the right exit code."""
        try:
            from memrec.tui.sources import DiffSource
            from memrec.tui.sources import FileSource
            from memrec.tui.sources import LiveSource
        except ImportError as error:  # textual is an optional dependency
            from memrec.base.extras import install_command

            raise MemrecCommandError(
                f"the TUI needs textual ({error.name} missing): {install_command('tui', ('textual',))}",
                exit_code=ExitCode.UNAVAILABLE,
            ) from None
        if args.live is not None:
            if args.trace or args.diff:
                raise MemrecCommandError("--live takes no trace file (and no --diff)", exit_code=ExitCode.USAGE)
            source = LiveSource(args.live or None, max_events=args.live_events)
            try:
                source.open()
            except (OSError, ValueError) as error:
                reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
                raise MemrecCommandError(
                    f"no memrec daemon at {source.path} ({reason}); start one with `memrec daemon`",
                    exit_code=ExitCode.UNAVAILABLE,
                ) from None
            return source
        if not args.trace:
            raise MemrecCommandError("give a trace file, or --live to follow the daemon", exit_code=ExitCode.USAGE)
        paths = [args.trace] + ([args.diff] if args.diff else [])
        for path in paths:
            check_trace_path(Path(path))
        source = DiffSource(args.trace, args.diff) if args.diff else FileSource(args.trace)
        try:
            source.open()
        except (TraceFormatError, OSError) as error:
            raise trace_error(" / ".join(paths), error) from None
        for path, model in zip(paths, (source.model, getattr(source, "other_model", None))):
            if not model.header:  # cut inside its header: nothing to show
                raise MemrecCommandError(f"{path}: the file ends inside its header: nothing to show", exit_code=ExitCode.DATA)
        return source

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        source = self.make_source(args)
        try:
            if not on_a_terminal():
                raise MemrecCommandError(
                    "memrec tui needs a terminal (its keys come from stdin, its screen goes to stderr); "
                    "for text use memrec report",
                    exit_code=ExitCode.USAGE,
                )
            source.begin()  # a file is read while the app's modules are imported
            from memrec.tui.app import MemrecApp

            app = MemrecApp(source)
            with suppress(KeyboardInterrupt):
                app.run()
        finally:
            source.stop()
        if app.return_code:  # textual printed an unhandled error's traceback and returned 1: a bug
            raise MemrecCommandError(
                "the TUI stopped on an internal error (a bug in memrec: the traceback is above)",
                exit_code=ExitCode.SOFTWARE,
            )
        return ExitCode.OK


def on_a_terminal() -> bool:
    """Whether the app can run: textual reads keys from stdin and draws on the original stderr, and
    with either redirected it would wait forever for keys or paint escape codes into a file."""
    return sys.stdin.isatty() and sys.__stderr__ is not None and sys.__stderr__.isatty()
