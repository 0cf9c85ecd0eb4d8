"""The TUI's seek before its replay got there: the state at a cursor far ahead of the replay.

    .venv/bin/python bench/bench_seek.py TRACE [TRACE ...] [--seeks 8] [--repeat 3]

For each trace, in a fresh process per repeat: the file source's scan (the first frame's wait),
then ``--seeks`` cursors spread evenly over the events, each answered with
:meth:`memrec.tui.model.TraceModel.state_at` before any replay (what a jump ahead of the replay
costs: the nearest keyframe restored, the gap replayed). Prints the scan, each seek's time and the
farthest (slowest) one, and as the floor in the same process one ``LiveState.apply`` of the
trace's first million events (the engine's pace on this host at this moment): the ratio of the
worst seek to that floor is the figure to compare across runs of a loaded host.

Traces: ``bench/bench_realistic.py --child now --path A`` (keyframes by bytes written) and
``--child before --path B`` (a keyframe every 10 s) write the realistic 1M-live mix both ways.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time
from memrec.tui.sources import FileSource
from memrec.state import LiveState
path, seeks = sys.argv[1], int(sys.argv[2])
source = FileSource(path)
t = time.perf_counter()
source.scan()
scan = time.perf_counter() - t
model = source.model
n = model.store.n
times = []
for k in range(1, seeks + 1):
    seq = n * k // (seeks + 1)
    t = time.perf_counter()
    model.state_at(seq, 0)
    times.append(time.perf_counter() - t)
first = model.store.pieces(0, min(n, 1_000_000))
t = time.perf_counter()
LiveState().apply(model.store.batch(first))
floor = time.perf_counter() - t
print(json.dumps({"events": n, "keyframes": len(model.keyframes), "scan": scan, "seeks": times, "floor": floor}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--seeks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    res: dict[Path, list[dict]] = {p: [] for p in args.traces}
    for _ in range(args.repeat):
        for p in args.traces:  # interleaved: a change of the host's load hits every trace alike
            out = subprocess.run([sys.executable, "-c", CHILD, str(p), str(args.seeks)], check=True,
                                 capture_output=True, text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            res[p].append(r)
            print(p.name, json.dumps({k: [round(x, 3) for x in v] if isinstance(v, list) else
                                      round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    for p, rs in res.items():
        worst = [max(r["seeks"]) for r in rs]
        print(f"{p.name}: {rs[0]['events']:,} events, {rs[0]['keyframes']} keyframes; scan "
              f"{statistics.median(r['scan'] for r in rs):.2f} s; worst seek {statistics.median(worst):.2f} s "
              f"({min(worst):.2f} - {max(worst):.2f}), x{statistics.median(w / r['floor'] for w, r in zip(worst, rs)):.1f} "
              f"the floor (1M events applied, {statistics.median(r['floor'] for r in rs):.2f} s); "
              f"median seek {statistics.median(statistics.median(r['seeks']) for r in rs):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
