"""LiveState in the daemon: events per second, memory per live allocation, keyframe stalls.

    .venv/bin/python bench/bench_state.py [--events 1000000] [--batch 20000] [--live 1000000]
                                          [--repeat 3] [--baseline /path/to/old/memrec/state[.py]]

Every number comes with a floor measured in the same run (the machine is shared):

1. The daemon path without BPF: raw records (``RAW_DTYPE``, as the ring buffer hands them) in
   batches; the floor is decoding them (``with_gpu`` and the sort by ts the daemon does), the
   path is decode + ``LiveState.apply`` (and, for the share apply takes, + the trace writer). Two workloads: ``churn`` (a caching allocator's
   cuMemAlloc/cuMemFree from 8 processes, 1% VMM and pinned host calls, IPC exports at start)
   and ``mixed`` (20% VMM, 1.7% IPC export/open: the worst case for runs applied at once).
   Also with ``journal=True`` (the analysis' replay) and, for reference, every event one by one.
2. Memory per live allocation at ``--live`` allocations (tracemalloc, and RSS growth).
3. Where the apply's time goes (``breakdown``): the share of each part of LiveState.apply.
4. Keyframes at ``--live`` allocations: the time the loop spends (take + write) against building
   it in the thread, the bytes written, and the longest loop step while one is built (a loop
   ticking every 1 ms applying small batches, as the daemon's does).

``--baseline`` loads another ``memrec/state.py`` (e.g. ``git show main~1:memrec/state.py``) or
``memrec/state/`` package folder (e.g. of ``git worktree add /tmp/old main~1``) and runs the same
measures on it, in the same run (the ratio between the two is what to read on a shared machine).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from types import ModuleType

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memrec.terms.columns import RAW_DTYPE  # noqa: E402
from memrec.terms.columns import empty_events  # noqa: E402
from memrec.terms.columns import with_gpu  # noqa: E402
from memrec.daemon.keyframes import Keyframes  # noqa: E402
from memrec.terms.events import FLAG_IPC_BYTES  # noqa: E402
from memrec.terms.events import Kind  # noqa: E402
from memrec.state import LiveState  # noqa: E402
from memrec.trace.format import encode_record  # noqa: E402
from memrec.trace.format import keyframe_record  # noqa: E402
from memrec.trace.format import make_header  # noqa: E402
from memrec.trace.writer import CallbackSink  # noqa: E402
from memrec.trace.writer import FileSink  # noqa: E402
from memrec.trace.writer import TraceWriter  # noqa: E402

MiB = 2**20


def _rows_to_raw(rows: list[tuple]) -> np.ndarray:
    """(kind, pid, ordinal, ptr, size, handle, ipc bytes) rows as RAW_DTYPE records, ts ascending."""
    n = len(rows)
    out = np.zeros(n, RAW_DTYPE)
    out["ts"] = np.arange(1, n + 1, dtype=np.uint64) * 1000
    out["kind"] = [int(r[0]) for r in rows]
    out["pid"] = [r[1] for r in rows]
    out["tid"] = out["pid"]
    out["ordinal"] = [r[2] for r in rows]
    out["ptr"] = [r[3] for r in rows]
    out["size"] = [r[4] for r in rows]
    out["handle"] = [r[5] for r in rows]
    for i, r in enumerate(rows):
        if r[6] is not None:
            out["ipc"][i] = np.void(r[6])
            out["flags"][i] = FLAG_IPC_BYTES
    return out


def churn(n: int, seed: int = 1) -> np.ndarray:
    """A caching allocator's steady churn: 8 processes alloc/free (about 99%), a few VMM granules
    and pinned host buffers, 8 IPC exports at the start (as NCCL does)."""
    rng = random.Random(seed)
    rows: list[tuple] = []
    live: dict[int, list[int]] = {p: [] for p in range(8)}
    next_ptr = [0x7F0000000000 + (p << 36) for p in range(8)]
    for p in range(8):
        next_ptr[p] += 64 * MiB
        live[p].append(next_ptr[p])
        rows.append((Kind.ALLOC, 1000 + p, p, next_ptr[p], 64 * MiB, 0, None))
        rows.append((Kind.IPC_EXPORT, 1000 + p, p, next_ptr[p], 0, 0, rng.randbytes(64)))
    handle = 1
    while len(rows) < n:
        p = rng.randrange(8)
        r = rng.random()
        if r < 0.005:
            rows.append((Kind.VMM_CREATE, 1000 + p, p, 0, 2 * MiB, handle, None))
            rows.append((Kind.VMM_RELEASE, 1000 + p, p, 0, 0, handle, None))
            handle += 1
        elif r < 0.01:
            rows.append((Kind.HOST_ALLOC, 1000 + p, -1, 0x5000000000 + len(rows) * 4096, 2 * MiB, 0, None))
        elif r < 0.505 or len(live[p]) < 2:
            size = rng.choice((512, 4096, 2 * MiB, 20 * MiB))
            ptr = next_ptr[p]
            next_ptr[p] += size + 4096
            live[p].append(ptr)
            rows.append((Kind.ALLOC, 1000 + p, p, ptr, size, 0, None))
        else:
            ptr = live[p].pop(rng.randrange(1, len(live[p])))
            rows.append((Kind.FREE, 1000 + p, -1, ptr, 0, 0, None))
    return _rows_to_raw(rows[:n])


def mixed(n: int, seed: int = 1) -> np.ndarray:
    """The earlier synthetic 8-GPU host: 80% alloc/free, VMM granules, IPC export/open pairs, host buffers."""
    rng = random.Random(seed)
    rows: list[tuple] = []
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
            rows.append((Kind.IPC_OPEN, pid, p, 0x100000000 + len(rows) * 4096, 0, 0, exported[-1][1]))
        else:
            rows.append((Kind.HOST_ALLOC, pid, -1, 0x5000000000 + len(rows) * 4096, 2 * MiB, 0, None))
    return _rows_to_raw(rows[:n])


def decode(raw: np.ndarray) -> np.ndarray:
    """What the daemon does to a batch before the state sees it (GPU stamping aside)."""
    events = with_gpu(raw, -1)
    events["gpu"] = events["ordinal"]
    return events[np.argsort(events["ts"], kind="stable")]


def rate(raw: np.ndarray, batch: int, make, repeat: int) -> tuple[float, float, float]:
    """Median events per CPU second (this process's: the machine is shared) of the floor (decode),
    of decode + apply, and of decode + apply + the trace writer (to a sink that drops the bytes),
    over ``repeat`` runs."""
    floors, paths, writes = [], [], []
    batches = [raw[i : i + batch] for i in range(0, len(raw), batch)]
    header = make_header(host="bench", boot_id="bench", anchor={"monotonic_ns": 0, "wall_ns": 0}, gpus=[])
    for _ in range(repeat):
        state = make()
        writer = TraceWriter(CallbackSink(lambda data: None), header)
        t_dec = t_apply = t_write = 0.0
        for b in batches:
            t0 = time.process_time()
            ev = decode(b)
            t1 = time.process_time()
            state.apply(ev)
            t2 = time.process_time()
            writer.write_events(ev)
            t_write += time.process_time() - t2
            t_apply += t2 - t1
            t_dec += t1 - t0
        writer.close()
        floors.append(len(raw) / t_dec)
        paths.append(len(raw) / (t_dec + t_apply))
        writes.append(len(raw) / (t_dec + t_apply + t_write))
    return statistics.median(floors), statistics.median(paths), statistics.median(writes)


def live_state(cls: type, n: int, chunk: int = 50_000) -> object:
    """A state holding ``n`` live driver allocations of 8 processes on 8 GPUs (sizes from 512 B to
    20 MiB, pointers with random gaps, so that keyframes compress as real ones would), fed in chunks."""
    rng = np.random.default_rng(7)
    state = cls()
    ptr = np.full(8, 0x7F0000000000, np.uint64) + (np.arange(8, dtype=np.uint64) << np.uint64(40))
    ts = 0
    for start in range(0, n, chunk):
        m = min(n, start + chunk) - start
        ev = empty_events(m)
        p = rng.integers(0, 8, m)
        size = rng.choice(np.array([512, 4096, 65536, 2 * MiB, 20 * MiB], np.uint64), m)
        step = size + rng.integers(0, 64, m).astype(np.uint64) * 512
        for q in range(8):  # each process's pointers ascend with gaps
            sel = p == q
            ev["ptr"][sel] = ptr[q] + np.cumsum(step[sel]) - step[sel]
            ptr[q] += step[sel].sum()
        ev["kind"] = int(Kind.ALLOC)
        ev["ts"] = ts + np.cumsum(rng.integers(1, 5000, m)).astype(np.uint64)
        ts = int(ev["ts"][-1])
        ev["pid"] = 1000 + p
        ev["gpu"] = p
        ev["size"] = size
        ev["api"] = 1
        state.apply(ev)
    return state


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def memory(cls: type, n: int) -> tuple[float, float]:
    """Bytes per live allocation: traced by tracemalloc, and RSS growth (after a warm-up state,
    so that imports and the allocator's first arenas are not counted)."""
    live_state(cls, 100_000)
    gc.collect()
    rss0 = _rss()
    tracemalloc.start()
    state = live_state(cls, n)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rss = _rss() - rss0
    del state
    return traced / n, rss / n


def keyframes(n: int, path: Path) -> dict:
    """A keyframe at ``n`` live allocations: loop time, thread time, bytes, the longest loop step."""
    state = live_state(LiveState, n)
    out: dict = {}
    t0 = time.perf_counter()
    finish = state.snapshot_later()
    out["take_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    snap = finish()
    out["build_ms"] = (time.perf_counter() - t0) * 1e3
    out["bytes"] = len(encode_record(keyframe_record(1, 0, snap)))
    t0 = time.perf_counter()
    LiveState.from_snapshot(snap)
    out["restore_ms"] = (time.perf_counter() - t0) * 1e3
    # A loop ticking every 1 ms that applies small batches (an alloc and its free) and, at one
    # tick, takes a keyframe that a thread builds and the loop then writes: the longest step.
    tick = empty_events(2)
    tick["kind"] = [int(Kind.ALLOC), int(Kind.FREE)]
    tick["pid"] = 1000
    tick["ptr"] = 0x10
    tick["size"] = 4096
    header = make_header(host="bench", boot_id="bench", anchor={"monotonic_ns": 0, "wall_ns": 0}, gpus=[])
    for mode in ("none (the floor: the loop alone)", "thread", "on the loop"):
        with TraceWriter(FileSink(path), header) as writer:
            kf = Keyframes()
            steps: list[float] = []
            ts = 1 << 40
            end = time.perf_counter() + 5.0
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                ts += 1000
                tick["ts"] = [ts, ts + 1]
                state.apply(tick.copy())
                if len(steps) == 100:
                    if mode == "thread":
                        kf.start(writer, state, ts)
                    elif mode == "on the loop":
                        kf.write_now(writer, state, ts)
                if kf.collect(writer):
                    writer.flush()
                steps.append(time.perf_counter() - t0)
                if kf._job is None and len(steps) > 300:
                    break
                time.sleep(0.001)
            out[f"longest step, keyframe {mode} (ms)"] = max(steps) * 1e3
    path.unlink(missing_ok=True)
    return out


def breakdown(raw: np.ndarray, batch: int) -> tuple[float, dict[str, float]]:
    """CPU seconds of ``LiveState.apply`` over ``raw`` (decoded first, not counted) and the share
    of each part: the process clock read around each call of it (which adds a little to parts
    called per event: the planner's, the one-at-a-time path's)."""
    from memrec.state import live
    from memrec.state import plain

    parts = {"allocations and frees": (plain, "_allocs_and_frees"), "VMM runs": (plain, "apply_vmm"),
             "planner (exports, opens)": (live.Planner, "next_cut"), "planner set-up": (live.Planner, "__init__"),
             "one at a time (IPC, host, ...)": (live.LiveState, "_apply_events"),
             "counter changes": (plain, "apply_changes"), "runs in all": (plain, "apply_run")}
    spent = dict.fromkeys(parts, 0.0)
    real = {label: getattr(owner, name) for label, (owner, name) in parts.items()}

    def timed(label: str, f):
        def call(*args, **kwargs):
            t0 = time.process_time()
            try:
                return f(*args, **kwargs)
            finally:
                spent[label] += time.process_time() - t0
        return call

    batches = [decode(raw[i : i + batch]) for i in range(0, len(raw), batch)]
    for label, (owner, name) in parts.items():
        setattr(owner, name, timed(label, real[label]))
    try:
        state = LiveState()
        t0 = time.process_time()
        for b in batches:
            state.apply(b)
        total = time.process_time() - t0
    finally:
        for label, (owner, name) in parts.items():
            setattr(owner, name, real[label])
    return total, {label: t / total for label, t in spent.items()}


def load_baseline(path: str) -> ModuleType:
    """Another LiveState: a ``memrec/state.py`` file, or a ``memrec/state/`` package folder (copied
    as the package ``baseline_state``, its own imports rewritten; the rest of memrec is this one)."""
    if Path(path).is_dir():
        import re
        import tempfile

        where = Path(tempfile.mkdtemp(prefix="bench-state-")) / "baseline_state"
        where.mkdir()
        for src in Path(path).glob("*.py"):
            (where / src.name).write_text(re.sub(r"\bmemrec\.state\b", "baseline_state", src.read_text()))
        sys.path.insert(0, str(where.parent))
        return importlib.import_module("baseline_state")
    spec = importlib.util.spec_from_file_location("baseline_state", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--live", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", help="another memrec/state.py or memrec/state/ folder to measure the same way")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: rate,breakdown,memory,keyframes")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    with open("/proc/loadavg") as f:
        print(f"load average: {' '.join(f.read().split()[:3])}")
    impls: dict[str, type] = {"LiveState": LiveState}
    if args.baseline:
        impls["baseline"] = load_baseline(args.baseline).LiveState

    def one_by_one() -> LiveState:
        s = LiveState()
        s.vector_min_run = 1 << 62
        return s

    if "rate" not in skip:
        for name, gen in (("churn", churn), ("mixed", mixed)):
            raw = gen(args.events)
            kinds, counts = np.unique(raw["kind"], return_counts=True)
            mix = ", ".join(f"{Kind(k).name} {c / len(raw):.1%}" for k, c in zip(kinds, counts))
            print(f"\n{name}: {len(raw):,} events ({mix}), batches of {args.batch:,}, median of {args.repeat}")
            makers = {**impls, "LiveState journal=True": lambda: LiveState(journal=True),
                      "LiveState event by event": one_by_one}
            for label, make in makers.items():
                floor, path, written = rate(raw, args.batch, make, args.repeat)
                apply_rate = 1 / (1 / path - 1 / floor)
                print(f"  {label:26} floor (decode) {floor / 1e6:5.2f}M/s  decode+apply {path / 1e6:5.2f}M/s  "
                      f"apply alone {apply_rate / 1e6:5.2f}M/s  ({floor / path:.2f}x the floor's time)  "
                      f"+ writer {written / 1e6:5.2f}M/s (apply {(1 / path - 1 / floor) * written:.0%} of it)",
                      flush=True)
    if "breakdown" not in skip:
        for name, gen in (("churn", churn), ("mixed", mixed)):
            total, shares = breakdown(gen(args.events), args.batch)
            print(f"\nwhere {name}'s apply goes ({args.events / total / 1e6:.2f}M/s apply alone, one run)")
            for label, share in sorted(shares.items(), key=lambda kv: -kv[1]):
                print(f"  {label:32} {share:6.1%}")
    if "memory" not in skip:
        print(f"\nmemory at {args.live:,} live allocations (tracemalloc / RSS growth per allocation)")
        for label, cls in impls.items():
            traced, rss = memory(cls, args.live)
            print(f"  {label:26} {traced:6.1f} B traced  {rss:6.1f} B RSS")
    if "keyframes" not in skip:
        print(f"\nkeyframe at {args.live:,} live allocations")
        for k, v in keyframes(args.live, Path(f"/tmp/bench_state_{args.live}.mrec")).items():
            print(f"  {k:28} {v:,.1f}" if isinstance(v, float) else f"  {k:28} {v:,}")
        if "baseline" in impls:
            old = live_state(impls["baseline"], args.live)
            t0 = time.perf_counter()
            snap = old.snapshot()
            t1 = time.perf_counter()
            size = len(encode_record(keyframe_record(1, 0, snap)))
            print(f"  baseline snapshot on the loop {(t1 - t0) * 1e3:,.1f} ms, encode {(time.perf_counter() - t1) * 1e3:,.1f} ms, "
                  f"{size:,} bytes")


if __name__ == "__main__":
    main()
