"""Whole-trace commands on traces shaped like a busy host: many processes, many markers.

    .venv/bin/python bench/bench_scale.py [--events 1000000] [--processes 8 100000]
        [--markers 0 50000] [--commands report diff ...] [--repeat 3] [--dir /tmp] [--keep]
        [--beside /tmp/base-tree]

Writes, with the real writer, one synthetic trace per shape: ``--events`` driver events on 8 GPUs
(each allocation freed 4,000 allocations later), spread over ``P`` processes (allocation ``a``
belongs to process ``a mod P``: with 100,000 processes each makes a handful of allocations, as a CI
farm's or a worker pool's short CUDA processes do), ``M`` phase markers (begin/end pairs of the
processes, spread over the trace), NVML at 10 Hz and a keyframe every 1M events. Then runs every
command of ``--commands`` on every shape in a fresh process (wall time and peak RSS), the shapes
interleaved within each repeat.

The floor of each command is the same command on the first shape (8 processes, no markers) in
the same repeat: the figure quoted is the median of the per-repeat ratios, so a change of the
host's load hits both sides alike; of wall time and of the child's CPU time (user + system: on a
loaded 2-core host the steadier of the two). Issue 26's goals: 100,000 processes ≤ 3 × the floor and
≤ 1 GB; 50,000 markers ≤ 1.5 ×.

``--beside DIR``: every run is made a second time with another tree's memrec (``DIR`` on
``PYTHONPATH``: ``git archive main | tar -x -C DIR``, with ``memrec/tui`` linked to ``../tui``), right
after this tree's, so that a change is compared with its base in the same minutes; each code's
ratios are to its own floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memrec.terms.columns import empty_events  # noqa: E402
from memrec.terms.events import Api  # noqa: E402
from memrec.terms.events import Kind  # noqa: E402
from memrec.terms.events import Marker  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from bench_tui import HEADER  # noqa: E402
from bench_tui import NGPU  # noqa: E402
from bench_tui import STEP_NS  # noqa: E402
from bench_tui import T0  # noqa: E402
from bench_tui import write_body  # noqa: E402

LIVE = 4000
PID0 = 100_000

COMMANDS = ("load", "report", "diff", "dump", "perfetto", "parquet", "csv", "memory-viz", "plot", "tui")

CHILD = r"""
import contextlib, io, json, os, resource, sys, time
what, path, tmp = sys.argv[1], sys.argv[2], sys.argv[3]
t = time.perf_counter()
if what == "load":
    import memrec
    rec = memrec.load(path, pandas=False)
    rec.events, rec.processes, rec.by_phase, rec.samples
elif what == "tui":  # the TUI's model: the scan (first frame's wait) and the replay
    from memrec.tui.sources import FileSource
    source = FileSource(path)
    source.scan()
    source.index()
else:
    from memrec.commands import main
    argv = {
        "report": ["report", path],
        "diff": ["diff", path, path],
        "dump": ["dump", path],
        "plot": ["plot", path, "-o", os.path.join(tmp, "plot.svg"), "-f"],
        "memory-viz": ["export", path, "--to", "memory-viz", "-o", os.path.join(tmp, "viz.pickle"), "-f"],
    }.get(what) or ["export", path, "--to", what, "-o", os.path.join(tmp, "out." + what), "-f"]
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        rc = main(argv)
    assert rc == 0, (what, rc)
dt = time.perf_counter() - t
use = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"s": dt, "cpu": use.ru_utime + use.ru_stime, "rss_mib": use.ru_maxrss / 1024}))
"""


def make_events(lo: int, hi: int, processes: int, live: int = LIVE) -> np.ndarray:
    """Events [lo, hi): even = allocation #i, odd = free of allocation #(i - live); allocation
    ``a`` belongs to process ``PID0 + a mod processes`` and GPU ``a mod 8``."""
    n = hi - lo
    idx = np.arange(lo, hi, dtype=np.int64)
    ev = empty_events(n)
    ev["ts"] = T0 + idx * STEP_NS
    alloc = idx % 2 == 0
    a = idx // 2
    target = np.where(alloc, a, a - live)
    valid = alloc | (target >= 0)
    pid = (PID0 + target % processes).astype(np.uint32)
    ev["pid"] = pid
    ev["tid"] = pid
    ev["kind"] = np.where(alloc, int(Kind.ALLOC), np.where(valid, int(Kind.FREE), int(Kind.CTX)))
    ev["api"] = np.where(alloc, int(Api.cuMemAlloc_v2), int(Api.cuMemFree_v2))
    ev["ptr"] = (0x7F00_0000_0000 + (target % (1 << 24)).astype(np.uint64) * 0x20_0000).astype(np.uint64)
    ev["size"] = np.where(alloc, ((target * 2654435761) % 4096 + 1).astype(np.uint64) << 7, 0)
    ev["gpu"] = np.where(alloc, target % NGPU, -1)
    return ev


def keyframe(j: int, processes: int) -> dict:
    """The LiveState after the first ``j`` events (its live allocations applied)."""
    from memrec.state import LiveState

    n_alloc = (j + 1) // 2
    first = max(0, n_alloc - LIVE)
    s = LiveState()
    if n_alloc > first:
        ev = make_events(2 * first, 2 * n_alloc, processes)
        s.apply(ev[ev["kind"] == int(Kind.ALLOC)])
    s.n_events = j
    s.last_ts = T0 + max(j - 1, 0) * STEP_NS
    return s.snapshot()


def write_trace(path: Path, n: int, processes: int, markers: int, keyframe_every: int = 1_000_000) -> None:
    from memrec.trace.writer import TraceWriter

    duration = n * STEP_NS
    with TraceWriter(path, HEADER) as w:
        write_body(w, n, keyframe_every, lambda lo, hi: make_events(lo, hi, processes), lambda j: keyframe(j, processes))
        # begin/end pairs spread over the trace, the processes in turn, each process's phases one
        # after the other (a step loop's), half of the time between two of its own
        pairs = markers // 2
        every = duration // max(pairs, 1)
        for k in range(pairs):
            ts = T0 + every * k
            pid = PID0 + k % processes
            name = f"step{k % 100}"
            w.write_marker(Marker(ts, pid, 0, pid, name, "begin", k % NGPU))
            w.write_marker(Marker(ts + every * min(processes, pairs) // 2, pid, 0, pid, name, "end", k % NGPU))


def run(what: str, path: Path, tree: str | None = None) -> dict:
    """``what`` on ``path`` in a fresh process (with ``tree``'s memrec, when given); its outputs in a
    folder removed after it (the memory-viz export writes a file per process: 100,000 of them)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if tree is not None:
        env["PYTHONPATH"] = tree
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        out = subprocess.run([sys.executable, "-c", CHILD, what, str(path), tmp], check=True, capture_output=True,
                             text=True, cwd=tmp, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--processes", type=int, nargs="+", default=[8, 100_000])
    ap.add_argument("--markers", type=int, nargs="+", default=[0, 50_000])
    ap.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=COMMANDS)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the traces go (default: the temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the traces (reused when present)")
    ap.add_argument("--beside", default=None, help="another tree (a base) whose memrec runs each command too")
    args = ap.parse_args()
    tmp = Path(args.dir or tempfile.gettempdir())
    # shapes: the floor (fewest processes, no markers), each process count, each marker count
    p0, m0 = min(args.processes), min(args.markers)
    shapes = [(p0, m0)] + [(p, m0) for p in args.processes if p != p0] + [(p0, m) for m in args.markers if m != m0]
    paths = {s: tmp / f"bench-scale-{args.events}-p{s[0]}-m{s[1]}.mrec" for s in shapes}
    for (p, m), path in paths.items():
        if not path.exists():
            write_trace(path, args.events, p, m)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.events:,} events")
    trees = {"": None} if args.beside is None else {"this tree: ": None, f"{args.beside}: ": args.beside}
    res = {(t, c, s): [] for t in trees for c in args.commands for s in shapes}
    for _ in range(args.repeat):
        for c in args.commands:
            for s in shapes:
                for t, tree in trees.items():
                    res[(t, c, s)].append(run(c, paths[s], tree))
    for t in trees:
        for c in args.commands:
            floor = res[(t, c, shapes[0])]
            line = [f"{t}{c:>10}: floor {statistics.median(r['s'] for r in floor):.2f} s wall, "
                    f"{statistics.median(r['cpu'] for r in floor):.2f} s CPU, {max(r['rss_mib'] for r in floor):.0f} MiB"]
            for s in shapes[1:]:
                rs = res[(t, c, s)]
                wall = statistics.median(r["s"] / f["s"] for r, f in zip(rs, floor))
                cpu = statistics.median(r["cpu"] / f["cpu"] for r, f in zip(rs, floor))
                each = " ".join(f"{r['cpu'] / f['cpu']:.2f}" for r, f in zip(rs, floor))  # every repeat's, the bad ones too
                line.append(f"{s[0]:,} processes, {s[1]:,} markers: {statistics.median(r['s'] for r in rs):.2f} s "
                            f"(x{wall:.2f} wall, x{cpu:.2f} CPU; each repeat x{each}), {max(r['rss_mib'] for r in rs):.0f} MiB")
            print(" | ".join(line))
    if not args.keep:
        for path in paths.values():
            path.unlink()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
