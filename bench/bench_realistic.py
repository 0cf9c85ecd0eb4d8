"""The daemon's path on a realistic mix: 16 processes holding 1M live allocations with churn.

    .venv/bin/python bench/bench_realistic.py [--live 1000000] [--churn 500000] [--repeat 3]
        [--path /tmp/realistic.mrec]

The events a busy host makes (issue 26): 16 processes on 8 GPUs allocate ``--live`` blocks
(512 B to 20 MiB, each process's pointers ascending with random gaps, as a caching allocator's
segments), then ``--churn`` pairs free a random live block of a process and allocate a new one,
then every process exits. They go through what the daemon does with each drained batch, in
simulated time at 40,000 events/s: ``LiveState.apply`` in batches of 2,000 (the ring drained every
50 ms), the trace writer flushed every 0.2 s, a periodic keyframe every 10 s built by the daemon's
own :class:`memrec.daemon.keyframes.Keyframes` (and the last one at stop), and after each batch
what ``record_events`` does when a table was compacted (``malloc_trim``).

Prints, per repeat, in this process:

* memory: RSS before the workload (after a warm-up state), at its peak (bytes per live allocation
  over the floor), after every process exited (as a ratio to the floor); with ``--no-shrink``
  the tables are never compacted (the code before issue 26), run in its own process beside;
* the file: bytes per event of the whole file, and the keyframes' share of it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memrec.columns import empty_events  # noqa: E402
from memrec.events import Api  # noqa: E402
from memrec.events import Kind  # noqa: E402

MiB = 1 << 20
PROCS = 16
STEP_NS = 25_000  # 40,000 events/s
BATCH = 2_000
SIZES = np.array([512, 4096, 65536, 2 * MiB, 20 * MiB], np.uint64)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def batches(live: int, churn: int, seed: int = 7):
    """The workload's events, ``BATCH`` at a time (build-up, churn, exits)."""
    rng = np.random.default_rng(seed)
    nxt = np.full(PROCS, 0x7F0000000000, np.uint64) + (np.arange(PROCS, dtype=np.uint64) << np.uint64(36))
    held: list[list[int]] = [[] for _ in range(PROCS)]  # each process's live pointers
    t = 10**12

    def allocs(p: np.ndarray) -> np.ndarray:
        m = len(p)
        ev = empty_events(m)
        size = rng.choice(SIZES, m)
        step = size + rng.integers(0, 64, m).astype(np.uint64) * 512
        for q in np.unique(p).tolist():
            sel = p == q
            ev["ptr"][sel] = nxt[q] + np.cumsum(step[sel]) - step[sel]
            nxt[q] += step[sel].sum()
            held[q].extend(ev["ptr"][sel].tolist())
        ev["kind"], ev["api"], ev["size"] = int(Kind.ALLOC), int(Api.cuMemAlloc_v2), size
        ev["pid"] = 1000 + p
        ev["gpu"] = p % 8
        return ev

    def stamp(ev: np.ndarray) -> np.ndarray:
        nonlocal t
        ev["ts"] = t + np.arange(len(ev), dtype=np.uint64) * STEP_NS
        ev["tid"] = ev["pid"]
        t += len(ev) * STEP_NS
        return ev

    done = 0
    while done < live:
        m = min(BATCH, live - done)
        yield stamp(allocs(rng.integers(0, PROCS, m)))
        done += m
    done = 0
    while done < churn:
        m = min(BATCH // 2, churn - done)
        p = rng.integers(0, PROCS, m)
        frees = empty_events(m)
        for i, q in enumerate(p.tolist()):
            h = held[q]
            k = int(rng.integers(len(h)))
            h[k], h[-1] = h[-1], h[k]
            frees["ptr"][i] = h.pop()
        frees["kind"], frees["api"], frees["pid"], frees["gpu"] = int(Kind.FREE), int(Api.cuMemFree_v2), 1000 + p, -1
        new = allocs(p)
        ev = np.empty(2 * m, dtype=new.dtype)
        ev[0::2], ev[1::2] = frees, new
        yield stamp(ev)
        done += m
    for q in range(PROCS):
        ev = empty_events(1)
        ev["kind"], ev["pid"] = int(Kind.PROC_EXIT), 1000 + q
        yield stamp(ev)


def run_once(live: int, churn: int, path: Path, shrink: bool) -> dict:
    from memrec.daemon.heap import give_back
    from memrec.daemon.keyframes import Keyframes
    from memrec.state import LiveState
    from memrec.state.allocs import KeyTable
    from memrec.trace.format import make_header
    from memrec.trace.writer import FileSink
    from memrec.trace.writer import TraceWriter

    if not shrink:
        KeyTable.shrink = lambda self: False
    warm = LiveState()  # a warm-up state: imports and the allocator's first arenas not counted
    for ev in batches(20_000, 10_000, seed=1):
        warm.apply(ev)
    del warm
    gc.collect()
    give_back()
    rss0 = _rss()
    header = make_header(host="bench", boot_id="bench", anchor={"monotonic_ns": 0, "wall_ns": 0}, gpus=[])
    state = LiveState()
    kf = Keyframes()
    peak = rss0
    kf_bytes = 0
    with TraceWriter(FileSink(path), header) as w:
        write_keyframe = w.write_keyframe

        def counted(*args, **kwargs):
            nonlocal kf_bytes
            before = w.bytes_written
            w.flush()
            between = w.bytes_written
            write_keyframe(*args, **kwargs)
            w.flush()
            kf_bytes += w.bytes_written - between
            del before

        w.write_keyframe = counted
        kf.write_now(w, state, 10**12)
        next_flush = next_kf = 0
        for ev in batches(live, churn):
            shrunk = state.shrunk
            state.apply(ev)
            if state.shrunk != shrunk:
                give_back()
            w.write_events(ev)
            now = int(ev["ts"][-1])
            if now >= next_flush:
                w.flush()
                next_flush = now + 200_000_000
            kf.collect(w)
            if now >= next_kf:
                kf.start(w, state, now)
                next_kf = now + 10_000_000_000
            peak = max(peak, _rss())
        kf.write_now(w, state, now)
        events = w.event_count
    gc.collect()
    after = _rss()
    size = path.stat().st_size
    return {"rss0_mib": rss0 / MiB, "peak_mib": peak / MiB, "after_mib": after / MiB,
            "per_live_b": (peak - rss0) / live, "after_ratio": after / rss0, "events": events,
            "b_per_event": size / events, "keyframe_share": kf_bytes / size, "keyframes": kf.written,
            "file_mb": size / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--live", type=int, default=1_000_000)
    ap.add_argument("--churn", type=int, default=500_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--path", type=Path, default=Path("/tmp/bench-realistic.mrec"))
    ap.add_argument("--child", choices=("shrink", "no-shrink"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_once(args.live, args.churn, args.path, args.child == "shrink")))
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    res: dict[str, list[dict]] = {"shrink": [], "no-shrink": []}
    for _ in range(args.repeat):
        for mode in res:  # each in a fresh process, alternating
            out = subprocess.run([sys.executable, __file__, "--live", str(args.live), "--churn", str(args.churn),
                                  "--path", str(args.path), "--child", mode], check=True, capture_output=True, text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            res[mode].append(r)
            print(mode, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    for mode, rs in res.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{mode:>9}: RSS before {med['rss0_mib']:.0f} MiB, peak {med['peak_mib']:.0f} MiB "
              f"({med['per_live_b']:.0f} B per live allocation), after every exit {med['after_mib']:.0f} MiB "
              f"(x{med['after_ratio']:.2f} the floor); file {med['b_per_event']:.2f} B/event, keyframes "
              f"{med['keyframe_share']:.0%} ({med['keyframes']:.0f} of them), {med['file_mb']:.1f} MB")
    args.path.unlink(missing_ok=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
