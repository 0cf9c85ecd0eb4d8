"""How fast LiveState.apply() replays events.

    .venv/bin/python bench/bench_state.py [--events 1000000] [--batch 50000]

The synthetic workload looks like a PyTorch/SGLang host: 8 processes on 8 GPUs, the caching
allocator's cuMemAlloc/cuMemFree churn (about 80% of events), expandable-segment VMM granules
(create, map, unmap, release), a few IPC export/open pairs and pinned host buffers. It prints
events per second for the daemon's use (no journal) and the analysis' (journal on).
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from memrec.columns import empty_events
from memrec.events import FLAG_IPC_BYTES
from memrec.events import Kind
from memrec.state import LiveState

MiB = 2**20


def workload(n: int, seed: int = 1) -> np.ndarray:
    """``n`` events of a synthetic 8-GPU workload, in time order."""
    rng = random.Random(seed)
    rows: list[tuple] = []  # (kind, pid, gpu, ptr, size, handle, ipc)
    live: dict[int, list[int]] = {p: [] for p in range(8)}
    vmm: dict[int, list[tuple[int, int]]] = {p: [] for p in range(8)}
    next_ptr = [0x7F0000000000 + (p << 36) for p in range(8)]
    next_handle = 1
    exported: list[tuple[int, bytes]] = []
    while len(rows) < n:
        p = rng.randrange(8)
        pid = 1000 + p
        r = rng.random()
        if r < 0.42 or (r < 0.80 and not live[p]):
            size = rng.choice((512, 2 * MiB, 20 * MiB, rng.randrange(1, 64) * MiB))
            ptr = next_ptr[p]
            next_ptr[p] += size + 4096
            live[p].append(ptr)
            rows.append((Kind.ALLOC, pid, p, ptr, size, 0, None))
        elif r < 0.80:
            ptr = live[p].pop(rng.randrange(len(live[p])))
            rows.append((Kind.FREE, pid, -1, ptr, 0, 0, None))
        elif r < 0.90:
            h = next_handle
            next_handle += 1
            va = next_ptr[p]
            next_ptr[p] += 20 * MiB
            vmm[p].append((h, va))
            rows.append((Kind.VMM_CREATE, pid, p, 0, 20 * MiB, h, None))
            rows.append((Kind.VMM_MAP, pid, -1, va, 20 * MiB, h, None))
        elif r < 0.97 and vmm[p]:
            h, va = vmm[p].pop()
            rows.append((Kind.VMM_UNMAP, pid, -1, va, 20 * MiB, 0, None))
            rows.append((Kind.VMM_RELEASE, pid, -1, 0, 0, h, None))
        elif r < 0.985 and live[p]:
            hb = rng.randbytes(64)
            exported.append((pid, hb))
            rows.append((Kind.IPC_EXPORT, pid, p, live[p][-1], 0, 0, hb))
        elif r < 0.99 and exported:
            epid, hb = exported[-1]
            rows.append((Kind.IPC_OPEN, pid, p, 0x100000000 + len(rows) * 4096, 0, 0, hb))
        else:
            rows.append((Kind.HOST_ALLOC, pid, -1, 0x5000000000 + len(rows) * 4096, 2 * MiB, 0, None))
    rows = rows[:n]
    out = empty_events(n)
    out["ts"] = np.arange(1, n + 1, dtype=np.uint64) * 1000
    out["kind"] = [int(r[0]) for r in rows]
    out["pid"] = [r[1] for r in rows]
    out["tid"] = out["pid"]
    out["gpu"] = [r[2] for r in rows]
    out["ptr"] = [r[3] for r in rows]
    out["size"] = [r[4] for r in rows]
    out["handle"] = [r[5] for r in rows]
    for i, r in enumerate(rows):
        if r[6] is not None:
            out["ipc"][i] = np.void(r[6])
            out["flags"][i] = FLAG_IPC_BYTES
    return out


def measure(ev: np.ndarray, batch: int, journal: bool, repeat: int = 3) -> float:
    """Best events/s over ``repeat`` replays of ``ev`` in batches of ``batch``."""
    best = 0.0
    for _ in range(repeat):
        arr = ev.copy()
        state = LiveState(journal=journal)
        t0 = time.perf_counter()
        for start in range(0, len(arr), batch):
            state.apply(arr[start : start + batch])
        dt = time.perf_counter() - t0
        best = max(best, len(arr) / dt)
    return best


def floor(arr: np.ndarray, batch: int) -> float:
    """Events/s of the least a Python state machine does: per event, one dict insert or pop."""
    best = 0.0
    for _ in range(3):
        table: dict = {}
        t0 = time.perf_counter()
        for start in range(0, len(arr), batch):
            chunk = arr[start : start + batch]
            for kind, pid, ptr, size in zip(
                chunk["kind"].tolist(), chunk["pid"].tolist(), chunk["ptr"].tolist(), chunk["size"].tolist()
            ):
                if kind == Kind.FREE:
                    table.pop((pid, ptr), None)
                else:
                    table[(pid, ptr)] = size
        best = max(best, len(arr) / (time.perf_counter() - t0))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=50_000)
    args = parser.parse_args()
    ev = workload(args.events)
    kinds, counts = np.unique(ev["kind"], return_counts=True)
    mix = ", ".join(f"{Kind(k).name} {c / len(ev):.1%}" for k, c in zip(kinds, counts))
    print(f"{len(ev):,} events ({mix}), batches of {args.batch:,}")
    base = floor(ev, args.batch)
    print(f"floor (one dict operation per event): {base / 1e3:,.0f}k events/s")
    for journal in (False, True):
        rate = measure(ev, args.batch, journal)
        print(f"LiveState.apply journal={journal!s:5}: {rate / 1e3:,.0f}k events/s, {base / rate:.2f}x the floor's time")
    arr = ev.copy()
    state = LiveState()
    state.apply(arr)
    t0 = time.perf_counter()
    snap = state.snapshot()
    t1 = time.perf_counter()
    LiveState.from_snapshot(snap)
    t2 = time.perf_counter()
    print(
        f"snapshot of {len(snap['allocs']) // 6:,} live allocations: {(t1 - t0) * 1e3:.1f} ms, "
        f"restore {(t2 - t1) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
