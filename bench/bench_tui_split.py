"""Benchmark of the TUI's untraced split on a mid-size trace (run by hand, not by the tests).

    .venv/bin/python bench/bench_tui_split.py [--events 1000000] [--repeat 3] [--trace PATH]

The TUI splits the untraced band with ``memrec report``'s engine once its replay is done
(:meth:`memrec.tui.sources.FileSource.reconcile`). It used to read the file again and replay it a
second time (``reconcile(load_trace(path))``, which is still how ``memrec report`` gets it from a
file); it now reuses the model's events and the journal its own replay kept. This measures both
after the same scan and replay, against a floor measured in the same run: one numpy pass over the
events' timestamps. The trace is bench_tui.py's (8 GPUs, NVML at 10 Hz, markers, keyframes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_tui import timed  # noqa: E402
from bench_tui import write_trace  # noqa: E402
from memrec.analysis.untraced.reconcile import reconcile  # noqa: E402
from memrec.trace.reader import load_trace  # noqa: E402
from memrec.tui.sources import FileSource  # noqa: E402


def one_run(path: Path) -> dict[str, float]:
    """One scan + replay, then the split both ways (the replay timed with and without the journal)."""
    src = FileSource(path)
    src.scan()
    t = time.perf_counter()
    src.index()
    replay = time.perf_counter() - t
    t = time.perf_counter()
    assert src.reconcile(), src.model.untraced_note
    reuse = time.perf_counter() - t
    again, _ = timed(lambda: reconcile(load_trace(path)))
    return {"replay": replay, "reuse": reuse, "again": again}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--trace", type=Path, default=Path(tempfile.gettempdir()) / "memrec-bench-split.mrec",
                    help="the trace (written when it does not exist, and kept)")
    args = ap.parse_args()
    path = args.trace
    if not path.exists():
        write_trace(path, args.events, 4000, 1_000_000)
    ts = np.arange(args.events, dtype=np.uint64)
    runs = []
    for _ in range(args.repeat):
        floor, _ = timed(lambda: np.maximum.accumulate(ts), 3)
        runs.append(one_run(path) | {"floor": floor})
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"{args.events:,} events, {args.repeat} runs (median), load {os.getloadavg()[0]:.1f}")
    print(f"floor: one ts pass {med['floor'] * 1e3:.1f} ms; the TUI's replay (journal kept) {med['replay']:.2f} s")
    for name, key in (("split before (read + replay again)", "again"), ("split now (the model's replay)", "reuse")):
        print(f"{name:40} {med[key] * 1e3:8.1f} ms  x{med[key] / med['floor']:.0f} of the floor  "
              f"(runs: {' '.join(f'{r[key] * 1e3:.0f}' for r in runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
