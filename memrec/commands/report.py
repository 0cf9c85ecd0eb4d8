"""``memrec report``: per GPU, where the memory went, when, and who took it."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from memrec.base.collector import paused
from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.base.jsontext import dumps
from memrec.base.untrusted import clean_text


class ReportCommand:
    """Summarise a trace per GPU: peaks, processes, categories, phases, exits and failed calls.

    For each GPU: the traced peak and when, by category (driver allocations, VMM physical,
    IPC-mapped from peers, pinned host) and by process; net bytes per phase when the trace has
    markers; what each process still held when it exited; every failed call (out of memory and
    others) with who held what on that GPU at that instant; NVML beside it. A trace with stacks
    (memrec daemon --stacks) adds the allocation sites by phase: the lines of code that held
    the most, across ranks. The events are read from the file a record at a time: a trace of
    100M events is reported in about 100 MiB.

    examples:
      memrec report run.mrec
      memrec report run.mrec --gpu 3
      memrec report run.mrec -p 41234 --json
      memrec report run.mrec --all         # every row, every allocation site
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("trace", type=Path, help="the .mrec trace to read")
        parser.add_argument("-j", "--json", action="store_true", help="print the report as JSON")
        parser.add_argument("-g", "--gpu", type=int, metavar="N", help="only GPU N (NVML index; -1: host)")
        parser.add_argument("-p", "--pid", type=int, metavar="PID", help="only the memory of process PID")
        parser.add_argument("-a", "--all", action="store_true",
                            help="keep what the default view leaves out: zero rows, rows past a table's first 200, "
                            "runs of one phase folded into a row (past 200 phases), frees at process exit in the "
                            "by-phase tables, ranks and GPUs that repeat the first one, every allocation site of "
                            "each phase (not its first 5; with --json, not its first 50)")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        with paused():  # the report's rows make no cycles: no full collections over them
            return self._report(args)

    def _report(self, args: argparse.Namespace) -> int:
        from memrec.analysis.report.build import build_report
        from memrec.analysis.report.text import render_text
        from memrec.commands.common import reread
        from memrec.commands.common import scan_trace_for_command

        # the events stay in the file, read a record at a time (100M events in bounded memory)
        trace, events = scan_trace_for_command(args.trace, warn=False)  # warnings: in the report itself
        with reread(args.trace):
            report = build_report(trace, gpu=args.gpu, pid=args.pid, all_sites=args.all, events=events)
        known = events.gpu_ids.sorted()
        if args.gpu is not None and not report.gpus and report.host is None and args.gpu not in known:
            # (a GPU of the trace where -p's process held nothing is an empty selection, not a typo)
            raise MemrecCommandError(
                f"GPU {args.gpu} is not in this trace (GPUs: {', '.join(map(str, known)) or 'none'})",
                exit_code=ExitCode.USAGE,
            )
        if args.pid is not None and not report.processes:
            raise MemrecCommandError(f"process {args.pid} is not in this trace", exit_code=ExitCode.USAGE)
        if args.json:
            print(dumps(report.to_json(), indent=2))
        else:
            width = shutil.get_terminal_size((80, 24)).columns  # $COLUMNS, the terminal, else 80
            text = render_text(report, width=max(width, 40), show_all=args.all)
            print(clean_text(text, keep_newlines=True), end="")  # a client's text never drives the terminal
        return ExitCode.OK
