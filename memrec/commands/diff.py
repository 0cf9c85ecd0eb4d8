"""``memrec diff``: two runs compared phase by phase, rank by rank and GPU by GPU."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from memrec.base.collector import paused
from memrec.base.errors import ExitCode
from memrec.base.jsontext import dumps
from memrec.base.untrusted import clean_text


class DiffCommand:
    """Compare two traces: a verdict first, then the KV budget per rank and the phases side by side.

    Processes are matched by rank (TP/PP/DP from the markers), not by pid; GPUs by index. The
    verdict says which run fails (SGLang's error, or a driver call out of memory) and with what error, how SGLang's KV budget moved on each rank
    (Δrest = Δavailable_after_weights − Δslack) and which phases' allocations between the memory
    baseline and the KV sizing made the difference. Then: the KV budget side by side, what each
    phase and rank allocated in those windows, the net bytes per phase × rank × GPU × category
    in each run with the delta, and failures present in one run only. A is the reference. Runs
    with stacks (memrec daemon --stacks) add the allocation sites whose held bytes changed.

    examples:
      memrec diff base.mrec custom-ar.mrec
      memrec diff base.mrec custom-ar.mrec --json
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("a", type=Path, metavar="A", help="the reference trace (.mrec)")
        parser.add_argument("b", type=Path, metavar="B", help="the trace to compare with it")
        parser.add_argument("-j", "--json", action="store_true", help="print the diff as one JSON document")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        from memrec.analysis.diff.build import diff_traces
        from memrec.analysis.diff.text import render_diff
        from memrec.commands.common import reread
        from memrec.commands.common import scan_trace_for_command

        with paused():  # the reports' rows make no cycles: no full collections over them
            # the events stay in the files, read a record at a time (100M events in bounded memory)
            (a, a_events), (b, b_events) = scan_trace_for_command(args.a), scan_trace_for_command(args.b)
            with reread(args.a, args.b):
                result = diff_traces(a, b, a_name=args.a.name, b_name=args.b.name, a_events=a_events,
                                     b_events=b_events)
            if args.json:
                print(dumps(result.to_json(), indent=2))
            else:
                width = shutil.get_terminal_size((80, 24)).columns  # $COLUMNS, the terminal, else 80
                text = render_diff(result, width=max(width, 40))
                print(clean_text(text, keep_newlines=True), end="")  # a client's text never drives the terminal
        return ExitCode.OK
