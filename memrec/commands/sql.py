"""``memrec sql``: SQL over a fleet's dataset (or traces given directly), DuckDB in-process."""

from __future__ import annotations

import argparse
import csv
import datetime
import decimal
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any
from typing import Iterator

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.base.jsontext import dumps
from memrec.base.untrusted import clean_text

FORMATS = ("table", "csv", "jsonl")


class SqlCommand:
    """Query a dataset of many hosts' recordings with SQL (DuckDB, in-process).

    INPUT is a dataset folder (`memrec export --to dataset`, `memrec daemon --dataset`) or .mrec
    traces, which are put in a temporary dataset first. Each table is a view: traces, gpus,
    processes, events, stacks, markers, phases, samples, process_samples, failures,
    failure_holders (docs/format.md, "The dataset"; a dataset of layout 1, written before the
    stacks, is read too: its events have no stack). Named queries answer the usual questions and
    run unchanged on Spark (--print-sql gives their text):

      fleet         per day: hosts, parts, events, failed calls, lost, top peak
      failures      every failed allocation and the process that held the most
      holders       who held what at each failed allocation
      peaks         the peak of each job and rank
      phase-growth  which phase grew between two SGLang releases (--set old=...
                    --set new=...)
      sites         which lines of code took the most memory (traces recorded
                    with --stacks; --set level=tensor for PyTorch's blocks)

    Every named query takes --set since=YYYY-MM-DD. DuckDB holds at most --memory-limit and
    spills to a temporary folder beyond it.

    examples:
      memrec sql --query failures /data/memrec-dataset
      memrec sql --query failures --set since=2026-11-24 /data/memrec-dataset
      memrec sql --query phase-growth --set old=0.5.20 --set new=0.5.21 /data/memrec-dataset
      memrec sql -e "SELECT host, count(*) FROM failures GROUP BY host" /data/memrec-dataset
      memrec sql -e "SELECT s.file, s.line, SUM(e.size) AS bytes FROM events e JOIN stacks s USING (trace_id, part, stack) WHERE s.site AND e.kind = 'ALLOC' AND e.result = 0 GROUP BY ALL ORDER BY bytes DESC" /data/memrec-dataset
      memrec sql --query peaks --format csv run1.mrec run2.mrec > peaks.csv
      memrec sql --query peaks --print-sql           # the SQL, for Spark or Trino
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("inputs", nargs="*", type=Path, metavar="INPUT",
                            help="dataset folders or .mrec traces")
        what = parser.add_mutually_exclusive_group()
        what.add_argument("-q", "--query", metavar="NAME", help="a named query (--list shows them)")
        what.add_argument("-e", "--sql", metavar="SQL", help="any SQL over the tables' views")
        what.add_argument("--list", action="store_true", help="list the named queries and their parameters")
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="params",
                            help="a named query's parameter (repeatable)")
        parser.add_argument("--print-sql", action="store_true", help="print the named query's SQL and exit")
        parser.add_argument("--format", choices=FORMATS, default="table",
                            help="table (default), csv, or jsonl (one JSON object a row)")
        parser.add_argument("--limit", type=int, metavar="N",
                            help="at most N rows (default: 100 for table, all for csv and jsonl)")
        parser.add_argument("--memory-limit", default="1GB", metavar="SIZE",
                            help="DuckDB's memory limit (default 1GB; e.g. 512MB, 4GB)")
        parser.add_argument("--threads", type=int, metavar="N", help="DuckDB's threads (default: one a core)")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        from memrec.export import sql

        if args.list:
            print(_listing(sql.NAMED))
            return ExitCode.OK
        if not args.query and not args.sql:
            parser.error("give --query NAME, --sql SQL or --list")
        if args.params and not args.query:
            parser.error("--set is for --query")
        if args.limit is not None and args.limit < 0:
            parser.error("--limit must be 0 or more")
        if args.threads is not None and args.threads < 1:
            parser.error("--threads must be at least 1")
        params = {}
        for item in args.params:
            key, eq, value = item.partition("=")
            if not eq or not key:
                parser.error(f"--set {item!r}: give KEY=VALUE")
            params[key] = value
        text = sql.render(args.query, params) if args.query else args.sql
        if args.print_sql:
            print(text)
            return ExitCode.OK
        if not args.inputs:
            parser.error("give a dataset folder or traces to query")
        limit = args.limit if args.limit is not None else (100 if args.format == "table" else None)
        with _datasets(args.inputs) as roots, sql.DuckDB(roots, args.memory_limit, args.threads) as db:
            names, rows = db.query(text)
            _print(names, rows, args.format, limit)
        return ExitCode.OK


def _listing(named: dict) -> str:
    lines = []
    for name, q in named.items():
        lines.append(f"{name:<14} {q.help}")
        for key, p in q.params.items():
            default = "required" if p.default is None else f"default {p.default}"
            lines.append(f"{'':<16}--set {key}=...  {p.help} ({default})")
    return "\n".join(lines)


class _datasets:
    """The dataset folders to query: the folders given, and one temporary dataset of the traces
    given (removed at the end)."""

    def __init__(self, inputs: list[Path]) -> None:
        self.inputs = inputs
        self.tmp: str | None = None

    def __enter__(self) -> list[Path]:
        from memrec.commands.common import reread
        from memrec.commands.common import scan_trace_for_command
        from memrec.export.dataset import MANIFEST
        from memrec.export.dataset import check_manifest
        from memrec.export.dataset import write_trace

        roots, traces = [], []
        for path in self.inputs:
            if path.is_dir():
                if not (path / MANIFEST).is_file():
                    raise MemrecCommandError(f"{path}: not a memrec dataset (no {MANIFEST}; "
                                             "memrec export --to dataset writes one)", exit_code=ExitCode.DATA)
                check_manifest(path, write=False)  # a layout of this memrec's or an older one
                roots.append(path)
            else:
                traces.append(path)
        if traces:
            self.tmp = tempfile.mkdtemp(prefix="memrec-sql-dataset-")
            try:
                for path in traces:
                    trace, events = scan_trace_for_command(path)  # the events read a record at a time
                    with reread(path):
                        write_trace(trace, Path(self.tmp), path.name, events)
            except BaseException:
                self.__exit__()
                raise
            roots.append(Path(self.tmp))
        return roots

    def __exit__(self, *exc: object) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def _cell(value: Any) -> Any:
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):  # DuckDB sums integers as 128-bit: Arrow decimals
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, float):
        return round(value, 6)
    return value


def _print(names: list[str], rows: Iterator[tuple], fmt: str, limit: int | None) -> None:
    out = sys.stdout
    shown = []
    more = False
    writer = csv.writer(out) if fmt == "csv" else None
    if writer is not None:
        writer.writerow(names)
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            more = True
            break
        row = tuple(_cell(v) for v in row)
        if writer is not None:
            writer.writerow(["" if v is None else v for v in row])
        elif fmt == "jsonl":
            out.write(dumps(dict(zip(names, row)), default=str) + "\n")
        else:
            shown.append(["" if v is None else clean_text(str(v)) for v in row])  # escapes, never raw
    if fmt == "table":
        widths = [max([len(n)] + [len(r[k]) for r in shown]) for k, n in enumerate(names)]
        print("  ".join(n.ljust(w) for n, w in zip(names, widths)).rstrip())
        for r in shown:
            print("  ".join(v.rjust(w) if _numeric(v) else v.ljust(w) for v, w in zip(r, widths)).rstrip())
        note = f"{len(shown)} row{'s' if len(shown) != 1 else ''}"
        print(f"({note}; more not shown: --limit)" if more else f"({note})", file=sys.stderr)
    elif more:
        print(f"memrec: only the first {limit} rows (--limit)", file=sys.stderr)


def _numeric(text: str) -> bool:
    return text.lstrip("-").replace(".", "", 1).isdigit()
