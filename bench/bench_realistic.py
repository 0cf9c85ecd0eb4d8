"""The daemon's path on a realistic mix: 16 processes holding 1M live allocations with churn.

    .venv/bin/python bench/bench_realistic.py [--live 1000000] [--churn 500000] [--repeat 3]
        [--path /tmp/realistic.mrec]

The events a busy host makes (issue 26): 16 processes on 8 GPUs allocate ``--live`` blocks
(512 B to 20 MiB, each process's pointers ascending with random gaps, as a caching allocator's
segments), then ``--churn`` pairs free a random live block of a process and allocate a new one,
then every process exits. They go through what the daemon does with each drained batch, in
simulated time at 40,000 events/s: ``LiveState.apply`` in batches of 2,000 (the ring drained every
50 ms), the trace writer flushed every 0.2 s, a periodic keyframe every 10 s built by the daemon's
own :class:`memrec.daemon.keyframes.Keyframes` (and the last one at stop), and what the daemon
does for its memory: ``mallopt`` at start, ``malloc_trim`` after a batch that grew or compacted a
table and after a keyframe, and once the host goes quiet (the sweep's
:class:`memrec.daemon.heap.QuietTrim`) (:mod:`memrec.daemon.heap`).

Prints per repeat, each configuration in a fresh process, alternating: ``now`` (this code) and
``before`` (tables never compacted, no ``malloc_trim``, a keyframe every 10 s whatever its size:
the code before issue 26, in the same run):

* memory: RSS before the workload (after a warm-up state written to a file with a keyframe: a
  daemon that has run; the floor), bytes per live allocation
  once the build-up is done (1M live) and at the peak (keyframes being built), and RSS after
  every process exited (the daemon recording on, two quiet sweeps later) as a ratio to the floor,
  and after the stop's last keyframe;
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

from memrec.terms.columns import empty_events  # noqa: E402
from memrec.terms.events import Api  # noqa: E402
from memrec.terms.events import Kind  # noqa: E402

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
    # each process's live pointers (numpy, so that the generator's own memory stays small
    # beside the state's: 8 B a pointer, let go at the exits)
    held = [np.zeros(1 << 16, np.uint64) for _ in range(PROCS)]
    count = [0] * PROCS
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
            new = ev["ptr"][sel]
            if count[q] + len(new) > len(held[q]):
                held[q] = np.concatenate((held[q][: count[q]], np.zeros(max(len(held[q]), len(new)), np.uint64)))
            held[q][count[q] : count[q] + len(new)] = new
            count[q] += len(new)
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
            h, last = held[q], count[q] - 1
            k = int(rng.integers(count[q]))
            frees["ptr"][i] = h[k]
            h[k] = h[last]
            count[q] = last
        frees["kind"], frees["api"], frees["pid"], frees["gpu"] = int(Kind.FREE), int(Api.cuMemFree_v2), 1000 + p, -1
        new = allocs(p)
        ev = np.empty(2 * m, dtype=new.dtype)
        ev[0::2], ev[1::2] = frees, new
        yield stamp(ev)
        done += m
    held.clear()
    for q in range(PROCS):
        ev = empty_events(1)
        ev["kind"], ev["pid"] = int(Kind.PROC_EXIT), 1000 + q
        yield stamp(ev)


def run_once(live: int, churn: int, path: Path, now: bool) -> dict:
    from memrec.daemon.heap import QuietTrim
    from memrec.daemon.heap import give_back
    from memrec.daemon.heap import settle
    from memrec.daemon.keyframes import Keyframes
    from memrec.state import LiveState
    from memrec.state.allocs import KeyTable
    from memrec.trace.format import make_header
    from memrec.trace.writer import FileSink
    from memrec.trace.writer import TraceWriter

    if now:
        settle()  # what Daemon.start does
    else:  # the code before issue 26: tables never compacted, no trim, a keyframe every 10 s
        KeyTable.shrink = lambda self: False
    # The floor: a daemon that has run before the workload: a warm-up state written to a file
    # with a keyframe (imports, the allocator's first arenas, the writer's Zstandard context)
    header = make_header(host="bench", boot_id="bench", anchor={"monotonic_ns": 0, "wall_ns": 0}, gpus=[])
    warm = LiveState()
    with TraceWriter(FileSink(path), header) as w:
        for ev in batches(20_000, 10_000, seed=1):
            warm.apply(ev)
            w.write_events(ev)
        Keyframes().write_now(w, warm, 1)
    del warm, w
    gc.collect()
    give_back()
    rss0 = _rss()
    state = LiveState()
    kf = Keyframes() if now else Keyframes(share=0)
    quiet = QuietTrim()
    peak = held = rss0
    with TraceWriter(FileSink(path), header) as w:
        kf.write_now(w, state, 10**12)
        next_flush = next_kf = next_sweep = 0
        for ev in batches(live, churn):
            capacity = state.capacity()  # what Daemon.record_events does
            state.apply(ev)
            if now and state.capacity() != capacity:
                give_back()
            w.write_events(ev)
            t = int(ev["ts"][-1])
            if t >= next_flush:
                w.flush()
                next_flush = t + 200_000_000
            if kf.collect(w) and now:  # what Daemon.tick does after a keyframe
                give_back()
            if t >= next_kf:
                kf.start(w, state, t)
                next_kf = t + 10_000_000_000
            if t >= next_sweep and now:  # what Daemon._sweep does
                quiet.sweep(state.n_events)
                next_sweep = t + 1_000_000_000
            rss = _rss()
            peak = max(peak, rss)
            if state.n_events == live:  # the build-up done: what the state holds at 1M live
                held = rss
        if now:  # every process has exited: the host is quiet for the next two sweeps
            quiet.sweep(state.n_events)
            quiet.sweep(state.n_events)
        gc.collect()
        idle = _rss()  # the daemon recording on, every process gone
        kf.write_now(w, state, t)
        events = w.event_count
        kf_bytes = w.keyframe_bytes
    gc.collect()
    after = _rss()
    size = path.stat().st_size
    return {"rss0_mib": rss0 / MiB, "peak_mib": peak / MiB, "idle_mib": idle / MiB, "idle_ratio": idle / rss0, "after_mib": after / MiB,
            "held_b": (held - rss0) / live, "per_live_b": (peak - rss0) / live, "after_ratio": after / rss0, "events": events,
            "b_per_event": size / events, "keyframe_share": kf_bytes / size, "keyframes": kf.written,
            "file_mb": size / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--live", type=int, default=1_000_000)
    ap.add_argument("--churn", type=int, default=500_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--path", type=Path, default=Path("/tmp/bench-realistic.mrec"))
    ap.add_argument("--child", choices=("now", "before"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_once(args.live, args.churn, args.path, args.child == "now")))
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    res: dict[str, list[dict]] = {"now": [], "before": []}
    for _ in range(args.repeat):
        for mode in res:  # each in a fresh process, alternating
            out = subprocess.run([sys.executable, __file__, "--live", str(args.live), "--churn", str(args.churn),
                                  "--path", str(args.path), "--child", mode], check=True, capture_output=True, text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            res[mode].append(r)
            print(mode, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    for mode, rs in res.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{mode:>6}: RSS before {med['rss0_mib']:.0f} MiB, at 1M live {med['held_b']:.0f} B per live allocation, "
              f"peak {med['peak_mib']:.0f} MiB ({med['per_live_b']:.0f} B per live allocation), after every exit {med['idle_mib']:.0f} MiB "
              f"(x{med['idle_ratio']:.2f} the floor; after the stop's keyframe x{med['after_ratio']:.2f}); file {med['b_per_event']:.2f} B/event, keyframes "
              f"{med['keyframe_share']:.0%} ({med['keyframes']:.0f} of them), {med['file_mb']:.1f} MB")
    args.path.unlink(missing_ok=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
