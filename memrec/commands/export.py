"""``memrec export``: a trace in the formats other tools open (Perfetto, PyTorch memory_viz, Parquet, CSV)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from memrec.base.errors import ExitCode
from memrec.base.files import make_folder
from memrec.base.files import remove_old
from memrec.base.errors import MemrecCommandError
from memrec.commands.common import check_not_an_input
from memrec.commands.common import check_output

FORMATS = ("perfetto", "memory-viz", "parquet", "csv", "dataset")


class ExportCommand:
    """Write a trace for Perfetto, PyTorch's memory_viz, or pandas/polars/DuckDB.

    --to perfetto     one .pftrace for ui.perfetto.dev: per GPU a counter track per category and
                      NVML used/reserved; per process its held bytes, its phases as slices,
                      failed calls as instants, IPC opens as flows from the exporter
    --to memory-viz   PyTorch's snapshot pickle, one per process (FILE, or FILE.<pid>.pickle
                      beside it when several processes used GPU memory; -p picks one) for
                      `python -m torch.cuda._memory_viz stats|segment_plot|trace_plot` and
                      pytorch.org/memory_viz: the segments held --at the failure (the default
                      when it is a lack of memory; else the peak), the peak, the end or a time
                      (seconds from the start), IPC-mapped memory included
    --to parquet|csv  a folder with one file per table: events, samples, process_samples,
                      markers, processes, by_phase (the tables of memrec.load)
    --to dataset      many traces into one Parquet dataset for `memrec sql`, Spark, Trino or
                      ClickHouse: partitioned by host and day, one file per trace part and table
                      (docs/format.md, "The dataset"). Exporting a trace again replaces its
                      files (no -f needed); other traces' files stay.

    An existing output is kept unless -f/--force (the trace itself never is replaced). Perfetto
    and Parquet need the export extra (perfetto, pyarrow), which scripts/setup installs; without
    it the error names the pip command for the environment memrec runs from.

    examples:
      memrec export run.mrec --to perfetto -o run.pftrace
      memrec export run.mrec --to memory-viz -o snapshot.pickle
      memrec export run.mrec --to memory-viz --at 7.74 -o snapshot.pickle   # at +7.74 s
      memrec export run.mrec --to parquet -o run-tables/
      memrec export -f run.mrec --to perfetto -o run.pftrace     # replace run.pftrace
      memrec export /var/lib/memrec/*.mrec --to dataset -o /data/memrec-dataset
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("traces", nargs="+", type=Path, metavar="TRACE",
                            help="the .mrec trace to read (several for --to dataset)")
        parser.add_argument("--to", required=True, choices=FORMATS, help="the format to write")
        parser.add_argument("-o", "--output", required=True, type=Path, metavar="PATH",
                            help="the file to write (a folder for parquet and csv)")
        parser.add_argument("-f", "--force", action="store_true",
                            help="replace the output if it exists (never the trace being exported)")
        parser.add_argument("-p", "--pid", type=int, metavar="PID", help="memory-viz: only process PID")
        parser.add_argument("--at", metavar="WHEN",
                            help="memory-viz: the snapshot's moment: failure (the report's), peak, end, or seconds "
                            "from the trace's start (default: the failure when it is a lack of memory, else the peak)")
        parser.add_argument("--max-entries", type=int, default=None, metavar="N",
                            help="memory-viz: keep the last N actions per process and GPU (default 100000; "
                            "memory_viz draws every one)")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        from memrec.api import Recording
        from memrec.commands.common import reread
        from memrec.commands.common import scan_trace_for_command

        if (args.pid is not None or args.max_entries is not None or args.at is not None) and args.to != "memory-viz":
            parser.error("-p/--pid, --at and --max-entries are only for --to memory-viz")
        if args.max_entries is not None and args.max_entries < 1:
            parser.error("--max-entries must be at least 1")
        if args.to == "dataset":
            return _write_dataset(args.traces, args.output)
        if len(args.traces) > 1:
            parser.error(f"--to {args.to} exports one trace (several only for --to dataset)")
        args.trace = args.traces[0]
        # the events stay in the file, read a record at a time in each pass (100M events in bounded memory)
        trace, events = scan_trace_for_command(args.trace)
        rec = Recording(trace, pandas=False, events=events)
        out: Path = args.output
        with reread(args.trace):  # (the trace read again in each pass: its errors are a trace's)
            try:
                written = self._write(rec, args.to, out, args)
            except OSError as error:
                if error.filename == os.fspath(args.trace):
                    raise
                raise MemrecCommandError(f"{error.filename or out}: {error.strerror or error}",
                                         exit_code=ExitCode.CANT_CREATE) from error
        if not written:
            who = f"process {args.pid} used no" if args.pid is not None else "no process used"
            raise MemrecCommandError(f"{args.trace}: {who} GPU memory in this trace: nothing to export",
                                     exit_code=ExitCode.DATA)
        for path in written:
            print(path)
        return ExitCode.OK

    @staticmethod
    def _write(rec, to: str, out: Path, args: argparse.Namespace) -> list[Path]:
        from memrec.export import require

        if to == "perfetto":
            from memrec.export.perfetto import write_perfetto

            require("perfetto.trace_builder.proto_builder", "export", "--to perfetto")  # before making the file
            _check_file(out, args)
            write_perfetto(rec, out)
            return [out]
        if to == "memory-viz":
            from memrec.analysis.report.build import trace_answer
            from memrec.export.memory_viz import MAX_ENTRIES
            from memrec.export.memory_viz import moment
            from memrec.export.memory_viz import write_memory_viz

            try:
                at = moment(rec, args.at, trace_answer(rec.trace, rec.trace_events, rec.phases))
            except ValueError as error:
                raise MemrecCommandError(f"{args.trace}: {error}", exit_code=ExitCode.USAGE) from error
            _check_file(out, args)
            # past what a deque's length holds, "the last N" is every one (N of 10^23 was a crash)
            max_entries = min(args.max_entries or MAX_ENTRIES, sys.maxsize)
            written, dropped = write_memory_viz(rec, out, args.pid, max_entries,
                                                check=lambda path: _check_file(path, args), at=at)
            if dropped:
                logging.warning("memory-viz: the first %d actions were left out (--max-entries)", dropped)
            return written
        from memrec.export import columnar

        if out.exists() and not out.is_dir():
            raise MemrecCommandError(f"{out}: exists and is not a folder (--to {to} writes one file per table)",
                                     exit_code=ExitCode.CANT_CREATE)
        check_output(out, args.force)  # its parent folder must exist, as for a file
        for path in columnar.table_files(out, to).values() if out.is_dir() else ():
            check_not_an_input(path, [args.trace])
            check_output(path, args.force)
        if to == "parquet":
            require("pyarrow.parquet", "export", "--to parquet")  # before making the folder
        make_folder(out)  # (never through a link another user planted as the folder)
        for path in columnar.table_files(out, to).values() if args.force else ():
            remove_old(path)
        return columnar.write_parquet(rec, out) if to == "parquet" else columnar.write_csv(rec, out)


def _write_dataset(traces: list[Path], out: Path) -> int:
    """Each trace into the dataset at ``out`` (made when missing; its parent must exist)."""
    from memrec.commands.common import reread
    from memrec.commands.common import scan_trace_for_command
    from memrec.export import require
    from memrec.export.dataset import check_manifest
    from memrec.export.dataset import write_trace

    require("pyarrow.parquet", "sql", "--to dataset")
    if out.exists() and not out.is_dir():
        raise MemrecCommandError(f"{out}: exists and is not a folder (--to dataset writes a folder of tables)",
                                 exit_code=ExitCode.CANT_CREATE)
    check_output(out, force=True)  # its parent folder must exist, as for a file
    check_manifest(out)
    for trace in traces:
        scanned, events = scan_trace_for_command(trace)  # the events read a record at a time
        with reread(trace):
            try:
                where, _ = write_trace(scanned, out, trace.name, events)
            except OSError as error:
                if error.filename == os.fspath(trace):
                    raise
                raise MemrecCommandError(f"{error.filename or out}: {error.strerror or error}",
                                         exit_code=ExitCode.CANT_CREATE) from error
        print(f"{trace}: {out}/<table>/host={where.host}/day={where.day}/{where.file_name}")
    return ExitCode.OK


def _check_file(out: Path, args: argparse.Namespace) -> None:
    """Refuse to write over the trace itself (even with --force), a folder, or a file without --force."""
    check_not_an_input(out, [args.trace])
    if out.is_dir():
        raise MemrecCommandError(f"{out}: is a folder; give a file name", exit_code=ExitCode.CANT_CREATE)
    if check_output(out, args.force):
        remove_old(out)  # the writer creates it anew, never through a link (memrec.base.files)
