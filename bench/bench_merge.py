"""How fast ``memrec merge`` joins the traces of several hosts.

    .venv/bin/python bench/bench_merge.py [--hosts 2] [--events 500000]

Each host's trace holds ``--events`` events of bench_state's synthetic 8-GPU workload, with its
own boot id, clock and anchor. The merge loads every trace, renumbers pids and GPUs, sorts the
events on the shared clock and replays them once through the live state (for the keyframes), so
its floor is the live state's replay of all events; both are printed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench_state import workload

from memrec.terms.events import GpuInfo
from memrec.state import LiveState
from memrec.trace import format as fmt
from memrec.engine.merge import merge_traces
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter

S = 10**9


def write_host(path: Path, index: int, n: int) -> None:
    ev = workload(n, seed=index + 1)
    ev["ts"] += index * 1000 * S  # each host's monotonic clock reads differently
    header = fmt.make_header(
        host=f"node-{index}", boot_id=f"boot-{index}",
        anchor={"monotonic_ns": int(ev["ts"][0]), "wall_ns": 1_764_000_000 * S + index * S // 3},
        gpus=[GpuInfo(g, f"GPU-{index}-{g}", "NVIDIA H200", 140 << 30) for g in range(8)],
    )
    with TraceWriter(path, header) as w:
        for lo in range(0, len(ev), 50_000):
            w.write_events(ev[lo : lo + 50_000])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--events", type=int, default=500_000, help="events per host")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"h{i}.mrec" for i in range(args.hosts)]
        for i, path in enumerate(paths):
            write_host(path, i, args.events)
        traces = [(str(p), load_trace(p)) for p in paths]
        total = sum(len(t.events) for _, t in traces)
        t0 = time.perf_counter()
        merge_traces(traces, Path(tmp) / "job.mrec")
        merge_s = time.perf_counter() - t0
        floor = LiveState()
        t0 = time.perf_counter()
        for _, t in traces:
            floor.apply(t.events.copy())
        floor_s = time.perf_counter() - t0
    print(f"{args.hosts} hosts, {total:,} events: merge {total / merge_s / 1e3:,.0f} k events/s ({merge_s:.2f} s); "
          f"live-state replay alone {total / floor_s / 1e3:,.0f} k events/s; ratio {merge_s / floor_s:.2f}")


if __name__ == "__main__":
    main()
