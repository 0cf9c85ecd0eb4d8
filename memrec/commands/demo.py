"""``memrec demo``: record the bundled stub-driver workload and report it (no GPU needed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError


class DemoCommand:
    """Record the bundled stub-driver workload with real probes, then print its report.

    The stub is a small C library built here that exports the CUDA driver's memory API with the
    driver's exact ABI, so the same uprobes a GPU host uses fire on it: processes that fork and
    exec, two devices, CUDA_VISIBLE_DEVICES remapping, IPC between processes, VMM, a failed
    allocation and a child that exits without freeing. No GPU is used or needed.
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-o", "--output", type=Path, default=Path("demo.mrec"),
                            help="trace to write (default demo.mrec; a folder: demo.mrec in it)")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        from memrec.analysis.report.build import build_report
        from memrec.analysis.report.text import render_text
        from memrec.commands.common import check_output
        from memrec.commands.record import record_tree
        from memrec.commands.record import require_root
        from memrec.validation.stubdriver.build import build_stub
        from memrec.trace.reader import load_trace

        if args.output.is_dir():  # the demo reports the file it wrote: one name, not record's timestamped one
            args.output = args.output / "demo.mrec"
        replacing = check_output(args.output, force=True)  # the demo's own file: made again each run
        require_root()
        stub = build_stub()
        say(f"recording the bundled stub-driver workload ({stub}), not a GPU")
        if replacing:
            say(f"replacing {args.output}")
        workload = [sys.executable, "-m", "memrec.validation.stubdriver.workload", "demo", "--lib", str(stub)]
        rc = record_tree(workload, args.output, libcuda_paths=(str(stub),), prog="memrec demo")
        if rc != 0:
            raise MemrecCommandError(f"the stub workload failed with exit code {rc}", exit_code=ExitCode.SOFTWARE)
        print(render_text(build_report(load_trace(args.output))))
        say(f"trace written to {args.output}; next: memrec tui {args.output}  (or memrec report, "
            f"memrec dump {args.output} | head)")
        return ExitCode.OK


def say(text: str) -> None:
    """One line of progress on stderr (the report itself goes to stdout)."""
    print(f"memrec demo: {text}", file=sys.stderr, flush=True)
