"""``memrec sql`` on a fleet's dataset: 1,000 hosts × 1 day, each named query's time and memory.

    .venv/bin/python bench/bench_dataset.py [--hosts 1000] [--dir /var/tmp/memrec-fleet] [--reuse]

Makes the dataset first (unless ``--reuse`` finds it): each host's day is a trace written by the
real writer (tests/fleet.py: an SGLang server with 8 TP ranks, its start-up phases, a day of
activation churn, NVML samples each minute; every other host on SGLang 0.5.20, one in 50 fails
to allocate, one in 10 rotated into a second part), exported in-process by
``memrec.export.dataset.write_trace`` (the code ``memrec export --to dataset`` runs), two hosts at
a time.

Then, for each named query, ``memrec sql --query NAME DIR --format csv`` runs as a fresh process
(its wall time and peak RSS from ``wait4``), and so does the floor: a fresh Python that reads the
same tables' files whole with pyarrow alone (``pyarrow.dataset``, Hive partitions), no query. A
last row sums the events table (every event of the fleet) under a small DuckDB memory limit, to
show that memory follows the limit, not the data; its floor reads only the two columns summed
(all of them took 13 GiB). Two more count the distinct times and pointers of every event (a hash
of 32M values) under a 256MB and a 4GB limit: DuckDB spills to disk beyond its limit. CPU seconds are user + system of the process: on a loaded machine
they say more than the wall time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fleet import Host  # noqa: E402
from tests.fleet import write_host  # noqa: E402

MEMREC = [sys.executable, "-m", "memrec"]
#: name, parameters, the tables it reads (the floor reads these files whole), memory limit.
QUERIES = [
    ("fleet", [], ["traces"], "1GB"),
    ("failures", ["--set", "since=2025-11-01"], ["failures", "failure_holders", "processes"], "1GB"),
    ("holders", [], ["failures", "failure_holders", "processes"], "1GB"),
    ("peaks", [], ["processes"], "1GB"),
    ("phase-growth", ["--set", "old=0.5.20", "--set", "new=0.5.21"], ["phases"], "1GB"),
]
EVENTS_SQL = ("SELECT host, count(*) AS n, max(size) AS largest, sum(size) AS bytes FROM events "
              "GROUP BY host ORDER BY bytes DESC")
#: Needs memory in proportion to the data (a hash of 32M distinct times): DuckDB spills beyond its limit.
DISTINCT_SQL = "SELECT count(DISTINCT ptr) AS ptrs, count(DISTINCT ts) AS times FROM events"


def host_of(i: int, part: int = 0) -> Host:
    return Host(i, "0.5.20" if i % 2 else "0.5.21", tp=8, oom=i % 50 == 7, churn=2000, part=part)


def _export_host(args: tuple[int, str]) -> int:
    from memrec.export.dataset import write_trace
    from memrec.trace.reader import load_trace

    i, root = args
    parts = [host_of(i)] + ([host_of(i, 1)] if i % 10 == 3 else [])
    events = 0
    with tempfile.TemporaryDirectory() as tmp:
        for h in parts:
            path = write_host(Path(tmp) / f"{h.name}.{h.part}.mrec", h)
            trace = load_trace(path)
            events += trace.n_events
            write_trace(trace, Path(root), path.name)
    return events


def make(root: Path, hosts: int) -> tuple[float, int]:
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    t0 = time.monotonic()
    with multiprocessing.Pool(2) as pool:
        events = sum(pool.imap_unordered(_export_host, [(i, str(root)) for i in range(hosts)], chunksize=8))
    return time.monotonic() - t0, events


def measure(argv: list[str]) -> tuple[float, float, int, str]:
    """Wall and CPU seconds and peak RSS (bytes) of one fresh process; its output's row count."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
        err = proc.stderr.read().decode()
        proc.stderr.close()
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(argv)} failed: {err}")
        out.seek(0)
        lines = out.read().decode().count("\n")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, f"{lines - 1}"


def floor_argv(root: Path, tables: list[str], columns: list[str] | None = None) -> list[str]:
    """A fresh Python reading ``tables`` (their ``columns``; all when None) with pyarrow alone."""
    code = ("import json, sys, pyarrow.dataset as ds\n"
            "n = 0\n"
            "for t in sys.argv[3:]:\n"
            "    d = ds.dataset(sys.argv[1] + '/' + t, format='parquet', partitioning='hive')\n"
            "    n += d.to_table(columns=json.loads(sys.argv[2])).num_rows\n"
            "print(n)\n")
    return [sys.executable, "-c", code, str(root), json.dumps(columns), *tables]


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/memrec-fleet"))
    parser.add_argument("--reuse", action="store_true", help="use the dataset already in --dir")
    parser.add_argument("--keep", action="store_true", help="leave the dataset in --dir")
    args = parser.parse_args()
    root: Path = args.dir
    if not (args.reuse and root.exists()):
        print(f"making {args.hosts} hosts' day in {root} (load {load()})", flush=True)
        seconds, events = make(root, args.hosts)
        print(f"made in {seconds:.0f} s: {events:,} events", flush=True)
    files = sum(1 for _ in root.rglob("*.parquet"))
    size = sum(p.stat().st_size for p in root.rglob("*.parquet"))
    print(f"dataset: {files:,} files, {size / 2**20:.0f} MiB, load average {load()}")
    print()
    print("| query | memrec sql: wall | CPU | peak RSS | pyarrow reads the same files: wall | CPU | peak RSS "
          "| wall ratio | memory ratio | rows |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [(name, ["--query", name, *params], tables, None, limit) for name, params, tables, limit in QUERIES]
    # every event of the fleet: pyarrow reads the two columns the query sums (all of them: 13 GiB)
    rows.append(("events scan (--memory-limit 256MB)", ["-e", EVENTS_SQL], ["events"], ["host", "size"], "256MB"))
    for limit in ("256MB", "4GB"):
        rows.append((f"distinct times (--memory-limit {limit})", ["-e", DISTINCT_SQL], ["events"], ["ts", "ptr"], limit))
    for name, query, tables, columns, limit in rows:
        wall, cpu, rss, out = measure([*MEMREC, "sql", *query, str(root), "--format", "csv", "--memory-limit", limit])
        f_wall, f_cpu, f_rss, _ = measure(floor_argv(root, tables, columns))
        print(f"| {name} | {wall:.2f} s | {cpu:.2f} s | {rss / 2**20:.0f} MiB | {f_wall:.2f} s | {f_cpu:.2f} s | "
              f"{f_rss / 2**20:.0f} MiB | {wall / f_wall:.2f}× | {rss / f_rss:.2f}× | {out} |", flush=True)
    print(f"\nload average after: {load()}")
    if not args.keep and not args.reuse:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
