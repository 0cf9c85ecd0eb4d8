#!/usr/bin/env python3
"""bench_busy_host: does the daemon record every call while the traced processes keep every CPU busy?

Usage (root, bcc importable):

    sudo .venv/bin/python bench/bench_busy_host.py --runs 5
    sudo .venv/bin/python bench/bench_busy_host.py --runs 3 --config old --config new

A real ``memrec daemon`` (BPF uprobes on a private copy of the stub driver) records ``--procs``
processes started at once, each a C loop of ``--pairs`` ``cuMemAlloc_v2`` + ``cuMemFree_v2`` with
no pause (bench_probe_overhead's loop: no Python in the traced process), so they are CPU-bound and
outnumber the cores. Per run it prints the calls made, the calls recorded (alloc and free events
of those pids in the trace), the lost count the trace carries, the burst's length and rate, and
how long the daemon's threads waited for a CPU during the burst (``run_delay`` in
/proc/PID/task/*/schedstat), which is what starves the drain.

Configurations (``--config``, repeatable; rounds interleave them):

  new   the daemon's defaults (its own priority, nice -10; a 16 MiB ring; BPF-side wakeup at a
        quarter full)
  old   ``--scheduling off --ringbuf-pages 1024``: the defaults before (nice 0, a 4 MiB ring); the
        BPF-side wakeup stays (it is compiled in)
  fifo  ``--scheduling fifo:10``
  base  another memrec's defaults: the daemon runs with ``--baseline-python`` (e.g. the main
        branch's ``/work/main/.venv/bin/python``: a 4 MiB ring, nice 0, no BPF-side wakeup)

The lost count is the daemon's (every process on the host): other processes that use a stub
driver while this runs add to it, and the line says how many of their events were recorded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_probe_overhead import build_loop
from reliability import Daemon

CONFIGS = {
    "new": (),
    "old": ("--scheduling", "off", "--ringbuf-pages", "1024"),
    "fifo": ("--scheduling", "fifo:10"),
    "base": (),
}


def run_delay_ns(pid: int) -> int:
    """Nanoseconds the threads of ``pid`` have waited runnable for a CPU, in all (schedstat)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total


def one_run(config: str, lib: Path, loop: Path, procs: int, pairs: int, python: str) -> dict:
    from memrec.terms.events import Kind
    from memrec.trace.reader import load_trace

    workdir = Path(tempfile.mkdtemp(prefix="mrbusy", dir="/tmp"))
    try:
        # The baseline runs from its own folder: `-m memrec` must not find this checkout's package.
        base = config == "base"
        daemon = Daemon(workdir, lib, *CONFIGS[config], python=python if base else sys.executable, cwd=workdir if base else None)
        time.sleep(0.5)  # the daemon's first keyframe and rescan settle
        wait0 = run_delay_ns(daemon.proc.pid)
        t0 = time.monotonic()
        workers = [subprocess.Popen([str(loop), str(lib), str(pairs)], stdout=subprocess.DEVNULL) for _ in range(procs)]
        failed = sum(w.wait() != 0 for w in workers)
        burst_s = time.monotonic() - t0
        wait_s = (run_delay_ns(daemon.proc.pid) - wait0) / 1e9
        time.sleep(0.5)
        t_stop = time.monotonic()
        daemon.stop()
        stop_s = time.monotonic() - t_stop
        trace = load_trace(daemon.output)
        ev = trace.events
        ours = np.isin(ev["pid"], [w.pid for w in workers])
        calls = ours & np.isin(ev["kind"], [int(Kind.ALLOC), int(Kind.FREE)])
        made = 2 * pairs * (procs - failed)
        return {
            "config": config, "made": made, "recorded": int(calls.sum()), "lost": int(trace.lost),
            "others": int((~ours).sum()),
            "burst_s": burst_s, "rate": made / burst_s, "daemon_wait_s": wait_s, "stop_s": stop_s,
            "failed": failed,
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--procs", type=int, default=16, help="busy processes at once (default 16)")
    parser.add_argument("--pairs", type=int, default=20_000, help="alloc/free pairs per process (default 20000)")
    parser.add_argument("--config", action="append", choices=sorted(CONFIGS), help="default: new")
    parser.add_argument("--baseline-python", default="/work/main/.venv/bin/python",
                        help="the interpreter (with its memrec) of the 'base' configuration")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_busy_host: needs root (BPF)", file=sys.stderr)
        return 1
    from memrec.validation.stubdriver.build import build_stub

    configs = args.config or ["new"]
    results: dict[str, list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_stub(Path(tmp) / "stub")  # a private inode: no other session's probes on it
        loop = build_loop(Path(tmp))
        print(f"{args.procs} processes x {args.pairs} alloc/free pairs, {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.1f} at the start", flush=True)
        for run in range(args.runs):
            for config in configs:
                r = one_run(config, lib, loop, args.procs, args.pairs, args.baseline_python)
                results[config].append(r)
                verdict = "ALL RECORDED" if r["recorded"] == r["made"] and not r["lost"] else (
                    f"missing {r['made'] - r['recorded']:,} ({100 * (r['made'] - r['recorded']) / r['made']:.1f} %)")
                print(f"run {run + 1} {config:>4}: made {r['made']:,}, recorded {r['recorded']:,}, lost {r['lost']:,} "
                      f"-> {verdict}; burst {r['burst_s']:.1f} s ({r['rate'] / 1e3:.0f}k calls/s), daemon waited "
                      f"{r['daemon_wait_s']:.2f} s for a CPU, stop {r['stop_s']:.1f} s, other processes' events "
                      f"{r['others']:,}, load {os.getloadavg()[0]:.1f}", flush=True)
    for config, rs in results.items():
        exact = sum(r["recorded"] == r["made"] and not r["lost"] for r in rs)
        print(f"{config}: recorded = made and lost = 0 in {exact} of {len(rs)} runs; median burst "
              f"{statistics.median(r['rate'] for r in rs) / 1e3:.0f}k calls/s; daemon's wait for a CPU median "
              f"{statistics.median(r['daemon_wait_s'] for r in rs):.2f} s of a median "
              f"{statistics.median(r['burst_s'] for r in rs):.1f} s burst")
    return 0


if __name__ == "__main__":
    sys.exit(main())
