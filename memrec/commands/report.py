"""``memrec report``: per GPU, where the memory went, when, and who took it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from memrec._errors import ExitCode
from memrec._errors import MemrecCommandError
from memrec._errors import TraceFormatError


class ReportCommand:
    """Summarise a trace per GPU: peaks, processes, categories, phases, exits and failed calls.

    For each GPU: the traced peak and when, by category (driver allocations, VMM physical,
    IPC-mapped from peers, pinned host) and by process; net bytes per phase when the trace has
    markers; what each process still held when it exited; every failed call (out of memory and
    others) with who held what on that GPU at that instant; NVML beside it.

    examples:
      memrec report run.mrec
      memrec report run.mrec --gpu 3
      memrec report run.mrec -p 41234 --json
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("trace", type=Path, help="the .mrec trace to read")
        parser.add_argument("-j", "--json", action="store_true", help="print the report as JSON")
        parser.add_argument("-g", "--gpu", type=int, metavar="N", help="only GPU N (NVML index; -1: host)")
        parser.add_argument("-p", "--pid", type=int, metavar="PID", help="only the memory of process PID")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        from memrec.analysis.report import build_report
        from memrec.analysis.report import render_text
        from memrec.trace.reader import load_trace

        path: Path = args.trace
        if not path.exists():
            raise MemrecCommandError(f"{path}: no such file", exit_code=ExitCode.NO_INPUT)
        if path.is_dir():
            raise MemrecCommandError(f"{path}: is a directory, not a trace", exit_code=ExitCode.NO_INPUT)
        if not os.access(path, os.R_OK):
            raise MemrecCommandError(f"{path}: not readable", exit_code=ExitCode.NO_INPUT)
        try:
            trace = load_trace(path)
        except TraceFormatError as error:
            message = str(error) if str(path) in str(error) else f"{path}: {error}"
            raise MemrecCommandError(message, exit_code=ExitCode.DATA) from error
        except OSError as error:
            raise MemrecCommandError(f"{path}: {error.strerror or error}", exit_code=ExitCode.NO_INPUT) from error

        report = build_report(trace, gpu=args.gpu, pid=args.pid)
        if args.gpu is not None and not report["gpus"] and report["host"] is None:
            known = sorted({gi.index for gi in trace.gpus})
            raise MemrecCommandError(
                f"GPU {args.gpu} is not in this trace (GPUs: {', '.join(map(str, known)) or 'none'})",
                exit_code=ExitCode.USAGE,
            )
        if args.pid is not None and not report["processes"]:
            raise MemrecCommandError(f"process {args.pid} is not in this trace", exit_code=ExitCode.USAGE)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(render_text(report), end="")
        return ExitCode.OK
