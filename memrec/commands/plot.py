"""``memrec plot``: a picture of a trace, one panel per GPU, for a bug report."""

from __future__ import annotations

import argparse
from pathlib import Path

from memrec.base.errors import ExitCode
from memrec.base.files import remove_old
from memrec.base.errors import MemrecCommandError
from memrec.commands.common import check_not_an_input
from memrec.commands.common import check_output


class PlotCommand:
    """Draw a trace as a picture for a bug report: one panel per GPU.

    Above the panels, the three lines `memrec report` starts with. Per GPU the owned bytes stacked
    by category, NVML used and reserved, the GPU's capacity, the phases as named bands (past 100
    phases, only those wider than 1/100 of the panel are named), the
    report's window hatched and every failure it counts marked (failed calls, SGLang's KV sizing).

    With --diff, `memrec diff`'s verdict above, and a second trace drawn under each GPU's panel,
    the two aligned on SGLang's KV sizing (else the first marker they share), as `tui --diff`
    aligns them, so where they part is where they differ.
    The format follows the output's suffix (.png, .svg, .pdf); an existing picture is kept unless
    -f/--force, and a trace it reads is never replaced. Needs matplotlib
    (the plot extra, which scripts/setup installs; without it the error names the pip command).

    examples:
      memrec plot run.mrec -o timeline.png
      memrec plot base.mrec --diff custom_ar.mrec -o diff.png
      memrec plot -f run.mrec -o timeline.png          # replace timeline.png
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("trace", type=Path, help="the .mrec trace to draw")
        parser.add_argument("-o", "--output", required=True, type=Path, metavar="FILE",
                            help="the picture to write (.png, .svg or .pdf)")
        parser.add_argument("-f", "--force", action="store_true", help="replace the picture if it exists")
        parser.add_argument("--diff", type=Path, metavar="OTHER", help="a second trace to draw aligned under it")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        from memrec.api import Recording
        from memrec.commands.common import load_trace_for_command
        from memrec.export import plot

        suffix = args.output.suffix.lower()
        if suffix not in (".png", ".svg", ".pdf"):
            parser.error(f"-o {args.output}: the picture's name must end in .png, .svg or .pdf")
        check_not_an_input(args.output, [args.trace] + ([args.diff] if args.diff else []))
        check_output(args.output, args.force)  # first: it turns a folder that cannot be searched into one line
        if args.output.is_dir():
            raise MemrecCommandError(f"{args.output}: is a folder; give a file name", exit_code=ExitCode.CANT_CREATE)
        rec = Recording(load_trace_for_command(args.trace), pandas=False)
        try:
            if args.force:
                remove_old(args.output)  # the picture is created anew, never through a link (memrec.base.files)
            if args.diff is None:
                panels = plot.plot(rec, args.output)
                note = ""
            else:
                other = Recording(load_trace_for_command(args.diff), pandas=False)
                panels, marker = plot.plot_diff(rec, other, args.output, (args.trace.name, args.diff.name))
                note = f", aligned on {marker!r}" if marker else ", no common marker: aligned on the starts"
        except OSError as error:
            raise MemrecCommandError(f"{args.output}: {error.strerror or error}",
                                     exit_code=ExitCode.CANT_CREATE) from error
        print(f"{args.output}: {panels} panel{'' if panels == 1 else 's'}{note}")
        return ExitCode.OK
