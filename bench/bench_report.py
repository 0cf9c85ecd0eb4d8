"""``memrec report`` on the synthetic trace of bench_tui.py, against floors measured in the same run.

    python bench/bench_report.py [--events 1000000 10000000] [--repeat 3] [--dir /tmp]

For each size, in fresh processes (so peak memory is each one's own), the sizes interleaved
within each repeat:

* ``load``: ``load_trace`` alone (the format's part);
* ``apply``: ``LiveState(journal=True).apply`` over the loaded event columns alone, a chunk at a
  time with the journal gathered into columns, as the replay does (the live state's part: every
  replay needs it);
* ``numpy pass``: one ``np.cumsum`` over the events' timestamps (a floor for "numpy speed");
* ``report``: ``memrec report`` end to end (``main(["report", path])``), wall time, CPU time and
  peak RSS; its CPU time as a multiple of ``load`` + ``apply``'s (the part every replay needs: on
  a loaded machine wall time measures the queue for a core, CPU time the work);
* ``tui``: the TUI model's replay of the file (``FileSource.index`` after its scan, no app).
* ``against`` (with ``--against DIR``): ``memrec report`` from another source tree (say main),
  run right after this one's in every repeat, and the ratio of the two per repeat.

``after the journal`` = the report's own time outside ``LiveState.apply`` and ``load_trace``,
timed inside the report's process: what the replay engine and the report add (series, phases,
attribution, reconciliation, text). Prints per-size medians of ``--repeat`` runs,
each as a ratio to the numpy pass, and the growth from the smallest to the largest size.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import contextlib, io, json, resource, sys, time
import numpy as np
if sys.argv[4:] == ["other"]:  # --against's tree, not the one an editable install points at
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, sys.argv[1])
what, path = sys.argv[2], sys.argv[3]
t, c = time.perf_counter(), time.process_time()
spent = {"apply": 0.0, "load": 0.0}
if what == "report":
    import memrec.trace.reader as reader
    from memrec.commands import main
    from memrec.state import LiveState

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
        return wrapper

    LiveState.apply = timed("apply", LiveState.apply)
    reader.load_trace = timed("load", reader.load_trace)
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["report", path])
    assert rc == 0, rc
elif what == "tui":  # the TUI's model replay (FileSource.index) after its scan, without the app
    from memrec.tui.sources import FileSource
    source = FileSource(path)
    source.scan()
    t, c = time.perf_counter(), time.process_time()
    source.index()
else:
    from memrec.trace.reader import load_trace
    trace = load_trace(path)
    if what != "load":
        from memrec.engine.journal import JournalBuffer
        from memrec.engine.replay import APPLY_CHUNK
        from memrec.state import LiveState
        from memrec.state.batch import Batch
        ev = trace.event_columns  # what the report replays: the columns, no rows built
        t, c = time.perf_counter(), time.process_time()
        if what == "apply":  # as the replay applies: a chunk at a time, journal into columns
            ev, state, sink = Batch.of(ev), LiveState(journal=True), JournalBuffer(len(ev) + len(ev) // 8)
            state.journal_sink = sink
            for lo in range(0, len(ev), APPLY_CHUNK):
                state.apply(ev[lo : lo + APPLY_CHUNK])
                sink.take(state)
        else:
            np.cumsum(ev["ts"].astype(np.int64))
dt, cpu = time.perf_counter() - t, time.process_time() - c
print(json.dumps({"s": dt, "cpu": cpu, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **spent}))
"""


def run(what: str, path: Path, other: Path | None = None) -> dict:
    argv = [sys.executable, "-c", CHILD, str(other or ROOT), what, str(path), *(["other"] if other else [])]
    out = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the traces go (default: the temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the traces (reused when present)")
    ap.add_argument("--against", type=Path, default=None, metavar="DIR",
                    help="another source tree (e.g. `git archive main | tar -x -C DIR`): its report runs beside "
                         "this one's in every repeat, and the ratio of the two is printed (the same load for both)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_tui import write_trace

    tmp = Path(args.dir or tempfile.gettempdir())
    rows = []
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    paths = {n: tmp / f"bench-report-{n}.mrec" for n in args.events}
    for n, path in paths.items():
        if not path.exists():
            write_trace(path, n, 4000, 1_000_000)
    kinds = ("pass", "load", "apply", "report", "tui") + (("against",) if args.against else ())
    res = {n: {k: [] for k in kinds} for n in args.events}
    for _ in range(args.repeat):  # sizes interleaved: a change of the host's load hits every size
        for n, path in paths.items():
            for k in res[n]:
                res[n][k].append(run("report", path, args.against) if k == "against" else run(k, path))
    for n in args.events:
        r_n = res[n]
        med = {k: statistics.median(r["s"] for r in v) for k, v in r_n.items()}
        rss = max(r["rss_mib"] for r in r_n["report"])
        rss_load = max(r["rss_mib"] for r in r_n["load"])
        rss_apply = max(r["rss_mib"] for r in r_n["apply"])
        # in the report's own process: the time outside LiveState.apply and load_trace
        engine = statistics.median(r["s"] - r["apply"] - r["load"] for r in r_n["report"])
        in_apply = statistics.median(r["apply"] / r["s"] for r in r_n["report"])
        rows.append((n, med, rss, engine))
        print(f"{n:>11,} events  numpy pass {med['pass']:.3f} s | load {med['load']:.2f} s | apply {med['apply']:.2f} s | "
              f"report {med['report']:.2f} s ({min(r['s'] for r in r_n['report']):.2f}-{max(r['s'] for r in r_n['report']):.2f}), "
              f"peak {rss:.0f} MiB (load alone {rss_load:.0f}, load + apply {rss_apply:.0f}) | in the report: apply {in_apply:.0%} of it, after the journal {engine:.2f} s = x{engine / med['pass']:.0f} numpy passes | "
              f"TUI model replay {med['tui']:.2f} s ({min(r['s'] for r in r_n['tui']):.2f}-{max(r['s'] for r in r_n['tui']):.2f})")
        cpu = {k: statistics.median(r["cpu"] for r in v) for k, v in r_n.items()}
        print(f"{'':>11}         CPU: report {cpu['report']:.2f} s = x{cpu['report'] / (cpu['load'] + cpu['apply']):.2f} "
              f"load + apply ({cpu['load']:.2f} + {cpu['apply']:.2f} s); TUI model replay {cpu['tui']:.2f} s")
        if args.against:
            ratios = [a["s"] / b["s"] for a, b in zip(r_n["report"], r_n["against"])]
            print(f"{'':>11}         against {args.against}: report {med['against']:.2f} s, "
                  f"peak {max(r['rss_mib'] for r in r_n['against']):.0f} MiB; this / that per repeat "
                  f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})")
    if not args.keep:
        for path in paths.values():
            path.unlink()
    if len(rows) > 1:
        (n0, m0, _, e0), (n1, m1, _, e1) = rows[0], rows[-1]
        print(f"growth {n0:,} -> {n1:,} (x{n1 / n0:.0f} events): report x{m1['report'] / m0['report']:.1f}, "
              f"apply x{m1['apply'] / m0['apply']:.1f}, load x{m1['load'] / m0['load']:.1f}, after apply x{e1 / e0:.1f}, "
              f"TUI model replay x{m1['tui'] / m0['tui']:.1f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
