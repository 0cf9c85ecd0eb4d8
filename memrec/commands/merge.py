"""``memrec merge``: one trace from the traces of several hosts of one job."""

from __future__ import annotations

import argparse
from pathlib import Path

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError


class MergeCommand:
    """Merge the traces of several hosts of one job (multi-node TP/PP) into one trace.

    The hosts' clocks are joined on each trace's wall-clock anchor (the first host's clock is the
    reference); hosts are told apart by boot id and host name, GPUs become host:index (numbered
    host after host), and the pids of the second and later hosts get a base (10000000 × host
    number). The rotated parts of one host's recording join as that host; two recordings of one
    host are refused (compare them with memrec diff). The result reads like any trace: memrec
    report shows the hosts and the expected clock error first.

    examples:
      memrec merge node0.mrec node1.mrec -o job.mrec
      memrec report job.mrec
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("traces", type=Path, nargs="+", metavar="TRACE", help="the .mrec traces to join")
        parser.add_argument("-o", "--output", type=Path, required=True, metavar="PATH", help="the merged trace to write")
        parser.add_argument("-f", "--force", action="store_true", help="replace PATH if it exists")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        from memrec.commands.common import check_not_an_input
        from memrec.commands.common import check_output
        from memrec.commands.common import load_trace_for_command
        from memrec.engine.merge import MergeError
        from memrec.engine.merge import merge_traces

        out = args.output
        check_not_an_input(out, args.traces)
        check_output(out, args.force)
        traces = [(str(path), load_trace_for_command(path)) for path in args.traces]
        try:
            result = merge_traces(traces, out)
        except MergeError as error:
            raise MemrecCommandError(str(error), exit_code=ExitCode.DATA) from None
        except OSError as error:
            raise MemrecCommandError(f"cannot write {out}: {error.strerror or error}", exit_code=ExitCode.CANT_CREATE) from None
        err = result.clock_error_ns
        print(f"wrote {out}: {len(result.hosts)} host(s), {result.events:,} events; expected clock error "
              f"{f'±{err / 1e6:.3f} ms' if err is not None else 'unknown'} ({result.clock_error_why})")
        for h in result.hosts:
            print(f"  {h['host']}: {len(h['files'])} file(s), {h['events']:,} events, clock offset "
                  f"{h['offset_ns'] / 1e9:+.6f} s, pid base {h['pid_base']}")
        return ExitCode.OK
