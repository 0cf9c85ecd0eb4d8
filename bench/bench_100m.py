"""Whole-trace commands at 10M .. 100M events of the tensor issue's shape (issue 26's 100M goal).

    .venv/bin/python bench/bench_100m.py --events 10000000 30000000 [100000000]
        [--commands load report diff tui jsonl parquet ...] [--repeat 1] [--dir /tmp] [--keep]
    .venv/bin/python bench/bench_100m.py --write PATH --events N [--stacks 256]   # only write one trace
    .venv/bin/python bench/bench_100m.py --events 10000000 100000000 --commands report diff \
        --trace 10000000=/work/traces/t10m.mrec --trace 100000000=/work/traces/t100m.mrec  # traces written before

The trace (:func:`write_trace`, through the real :class:`~memrec.trace.writer.TraceWriter`, a
million events at a time from numpy, so 100M events take minutes and memory stays flat): 16
processes on 8 GPUs, each with a PyTorch caching allocator's life: a few driver segments
(``cuMemAlloc``: four 1 GiB segments, and four 8 - 64 MiB workspaces of which the oldest is
freed and another allocated every 64 bursts), and inside them
many small tensor blocks (``pytorch:malloc``/``free`` events, 512 B - 2 MiB, the allocator's
512-byte rounding) with short lives: a burst of 8 - 56 blocks allocated, then freed in reverse
order (a layer's activations), bursts of the 16 processes interleaved. A step marker (begin/end)
per process every 256 bursts, NVML at 10 Hz, a keyframe every 10 s of trace time (the daemon's
cadence for a small driver state) built by a real :class:`~memrec.state.LiveState` that applies
every event. 1M events a second of trace time. ``--stacks K`` (format 2.3, ``memrec daemon
--stacks``' shape): every allocation names one of K stacks (a layer's line, three frames under
the caller's; a block's stack by its place in its burst and its process, a segment's its own), so
the report has its allocation sites section.

Then every ``--commands`` on every size in a fresh process (wall, CPU, peak RSS); the ratios
quoted are to the smallest size in the same repeat (the floor), so a change of the host's load hits
both sides alike. Goals (issue 26): load ≤ 10 × the 10M load; report and diff ≤ 2 GB at 100M;
the TUI's first frame ≤ 1.5 × the 10M one; the exports stream (memory not in proportion to events).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memrec.terms.columns import NVML_DTYPE  # noqa: E402
from memrec.terms.columns import empty_events  # noqa: E402
from memrec.terms.events import Api  # noqa: E402
from memrec.terms.events import Kind  # noqa: E402
from memrec.terms.events import Marker  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
T0 = 10**12
NGPU = 8
PROCS = 16
PID0 = 4000
STEP_NS = 1000  # 1M events a second of trace time
CHUNK = 1 << 20
SEGMENT_EVERY = 64  # a driver segment swapped every 64 bursts of a process
STEP_BURSTS = 256  # a step marker pair every 256 bursts of a process
KEYFRAME_NS = 10 * 10**9

HEADER = {
    "host": "bench-100m",
    "gpus": [{"index": g, "uuid": f"GPU-bench-{g}", "name": "NVIDIA H200", "total": 140 * GiB, "bar1_total": 256 * GiB}
             for g in range(NGPU)],
    "probes": {"torch": ["libc10_cuda.so"]},
}

COMMANDS = ("load_trace", "load", "report", "diff", "dump", "tui", "tui_app", "parquet", "csv", "perfetto", "memory-viz", "dataset")

CHILD = r"""
import contextlib, io, json, os, resource, sys, threading, time
what, path, tmp, root = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
t = time.perf_counter()
first = None
extra = {}
if what == "load_trace":  # the reader alone: every record decoded into the trace's columns
    from memrec.trace.reader import load_trace
    trace = load_trace(path)
    # the read budget (memrec/trace/budget.py) must admit a genuine trace whole: every event, no warning
    extra = {"events_read": len(trace.event_columns["ts"]), "warnings": trace.warnings}
elif what == "load":
    import memrec
    rec = memrec.load(path, pandas=False)
    rec.events, rec.processes, rec.by_phase, rec.samples
elif what == "tui":  # the TUI's first frame waits for the file's start (ready), the rest of the scan and the replay after it
    from memrec.tui.sources import FileSource
    source = FileSource(path)
    seen = {}
    source.scan(ready=lambda: seen.setdefault("first", time.perf_counter() - t))
    first = seen["first"]
    extra = {"scan": time.perf_counter() - t}
    source.index()
elif what == "tui_app":  # the app, headless: start -> the first frame painted with the cursor's state (bench_tui.py's)
    import asyncio
    from memrec.tui.sources import FileSource  # before bench_tui, which puts this tree first on the path (--base)
    sys.path.insert(0, os.path.join(root, "bench"))
    from bench_tui import first_frame
    FileSource.answer = lambda self: None  # the report's answer, after the replay: another command's memory (report)
    first, _, _ = asyncio.run(first_frame(path, replay=False))  # the replay: the tui command's
    extra = {"app": True}
else:
    from memrec.commands import main
    out = os.path.join(tmp, "out")
    argv = {
        "report": ["report", path],
        "diff": ["diff", path, path],
        "dump": ["dump", path],
        "memory-viz": ["export", path, "--to", "memory-viz", "-o", out + ".pickle", "-f"],
        "dataset": ["export", path, "--to", "dataset", "-o", out, "-f"],
    }.get(what) or ["export", path, "--to", what, "-o", out + "." + what, "-f"]
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        rc = main(argv)
    assert rc == 0, (what, rc)
dt = time.perf_counter() - t
use = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"s": dt, "first": first, "cpu": use.ru_utime + use.ru_stime, "rss_mib": use.ru_maxrss / 1024, **extra}))
"""


class Generator:
    """The events of the trace, a chunk at a time (see the module docstring); the bursts' layout
    (sizes, which process) from a seeded generator, so a size's trace is the same every run."""

    def __init__(self, seed: int = 26, stacks: np.ndarray | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.stacks = stacks  # the stack ids the allocations name in turn (None: no stacks)
        self.burst = 0  # bursts made so far (all processes)
        self.pos = 0  # events made so far
        # each process's four 1 GiB segments (the blocks' home, kept), and a ring of four driver
        # allocations of its own (a library's workspace), the oldest swapped every SEGMENT_EVERY bursts
        self.seg_base = np.uint64(0x7F00_0000_0000)
        self.ring = [[self._segment(p, 4 + k) for k in range(4)] for p in range(PROCS)]
        self.next_seg = [4] * PROCS

    def _segment(self, p: int, k: int) -> int:
        return int(self.seg_base) + (p << 40) + (k << 30)

    def opening(self) -> np.ndarray:
        """Every process's segments and first four workspaces."""
        ev = empty_events(8 * PROCS)
        for p in range(PROCS):
            for k in range(4):
                self._driver(ev, 8 * p + k, p, Kind.ALLOC, self._segment(p, k), GiB)
                self._driver(ev, 8 * p + 4 + k, p, Kind.ALLOC, self.ring[p][k], (8 << k) * MiB)
        return self._stamp(ev)

    def _driver(self, ev: np.ndarray, i: int, p: int, kind: Kind, ptr: int, size: int) -> None:
        ev["pid"][i] = ev["tid"][i] = PID0 + p
        ev["kind"][i] = int(kind)
        ev["api"][i] = int(Api.cuMemAlloc_v2 if kind == Kind.ALLOC else Api.cuMemFree_v2)
        ev["ptr"][i] = ptr
        ev["size"][i] = size if kind == Kind.ALLOC else 0
        ev["gpu"][i] = p % NGPU if kind == Kind.ALLOC else -1
        if self.stacks is not None and kind == Kind.ALLOC:
            ev["stack"][i] = self.stacks[(ptr >> 30) % len(self.stacks)]

    def _stamp(self, ev: np.ndarray) -> np.ndarray:
        n = len(ev)
        jitter = self.rng.integers(0, STEP_NS // 2, n)
        ev["ts"] = T0 + (self.pos + np.arange(n, dtype=np.int64)) * STEP_NS + jitter
        self.pos += n
        return ev

    def chunk(self, want: int) -> tuple[np.ndarray, list[Marker]]:
        """About ``want`` events (whole bursts) and the markers among them."""
        k = self.rng.integers(4, 29, max(want // 32, 1)) * 2  # blocks per burst, 8 - 56
        ends = np.cumsum(2 * k)
        nb = int(np.searchsorted(ends, want, side="right")) or 1
        k = k[:nb]
        burst = self.burst + np.arange(nb)
        proc = burst % PROCS
        per = burst // PROCS  # the process's own burst number
        swap = per % SEGMENT_EVERY == SEGMENT_EVERY - 1  # the burst ends with a segment swap
        n_ev = int(2 * k.sum() + 2 * swap.sum())
        ev = empty_events(n_ev)
        # per burst: k allocations, k frees in reverse order, then (swap) a driver free + alloc
        width = 2 * k + 2 * swap
        start = np.cumsum(width) - width
        nblk = int(k.sum())
        bi = np.repeat(np.arange(nb), k)  # burst of each block
        j = np.arange(nblk) - np.repeat(np.cumsum(k) - k, k)  # block's index in its burst
        size = (self.rng.integers(0, 4096, nblk) ** 2 // 4096 + 1) * 512  # 512 B - 2 MiB, mostly small
        size = size.astype(np.uint64)
        off = np.cumsum(size) - size
        off -= np.repeat(off[np.cumsum(k) - k], k)  # offset inside the burst's segment
        seg_k = (per % 4)[bi].astype(np.uint64)
        base = (self.seg_base + (proc[bi].astype(np.uint64) << np.uint64(40)) + (seg_k << np.uint64(30)))
        ptr = base + off
        a_pos = start[bi] + j
        f_pos = start[bi] + 2 * k[bi] - 1 - j
        pid = (PID0 + proc[bi]).astype(np.uint32)
        for pos, kind, api in ((a_pos, Kind.TENSOR_ALLOC, Api.torch_malloc), (f_pos, Kind.TENSOR_FREE, Api.torch_free)):
            ev["pid"][pos] = pid
            ev["tid"][pos] = pid
            ev["kind"][pos] = int(kind)
            ev["api"][pos] = int(api)
            ev["ptr"][pos] = ptr
            ev["ordinal"][pos] = proc[bi] % NGPU
            ev["gpu"][pos] = proc[bi] % NGPU
            ev["handle"][pos] = 7  # the default stream
        ev["size"][a_pos] = size
        if self.stacks is not None:
            ev["stack"][a_pos] = self.stacks[(j + 3 * proc[bi]) % len(self.stacks)]
        for b in np.flatnonzero(swap).tolist():  # a segment swap: the oldest freed, a new one allocated
            p = int(proc[b])
            i = int(start[b] + 2 * k[b])
            old = self.ring[p].pop(0)
            new = self._segment(p, self.next_seg[p] % 1000 + 4)
            self.next_seg[p] += 1
            self.ring[p].append(new)
            self._driver(ev, i, p, Kind.FREE, old, 0)
            self._driver(ev, i + 1, p, Kind.ALLOC, new, (8 << (self.next_seg[p] % 4)) * MiB)
        ev = self._stamp(ev)
        markers = []
        for b in np.flatnonzero(per % STEP_BURSTS == 0).tolist():
            p = int(proc[b])
            ts = int(ev["ts"][start[b]])
            step = int(per[b]) // STEP_BURSTS
            if step:
                markers.append(Marker(ts - 1, PID0 + p, 0, PID0 + p, "step", "end", p % NGPU))
            markers.append(Marker(ts, PID0 + p, 0, PID0 + p, "step", "begin", p % NGPU))
        self.burst += nb
        return ev, markers


def write_trace(path: Path, n: int, stacks: int = 0) -> dict:
    """``n`` events (whole bursts: a few more) of the shape above, allocations naming one of
    ``stacks`` stacks (0: none); returns what it wrote."""
    from memrec.state import LiveState
    from memrec.trace.stacks import Frame
    from memrec.trace.writer import TraceWriter

    t = time.perf_counter()
    state = LiveState()
    markers = 0
    with TraceWriter(path, HEADER) as w:
        ids = np.array([w.intern_stack([Frame("/opt/venv/site-packages/torch/nn/modules/module.py", 1527, "_call_impl"),
                                        Frame(f"/app/model/layer{k % 40}.py", 10 + k, f"Block{k}.forward"),
                                        Frame("/app/serve.py", 88, "step"), Frame("/app/serve.py", 12, "main")])
                        for k in range(stacks)], dtype=np.int64) if stacks else None
        gen = Generator(stacks=ids)
        w.write_keyframe(T0, 0, state.snapshot())
        ev = gen.opening()
        next_kf = T0 + KEYFRAME_NS
        next_nvml = T0
        while True:
            state.apply(ev)
            w.write_events(ev)
            last = int(ev["ts"][-1])
            if last >= next_nvml:  # NVML at 10 Hz over the chunk's time
                ticks = np.arange(next_nvml, last + 1, 100_000_000, dtype=np.int64)
                nv = np.zeros(len(ticks) * NGPU, dtype=NVML_DTYPE)
                nv["ts"] = np.repeat(ticks, NGPU)
                nv["gpu"] = np.tile(np.arange(NGPU), len(ticks))
                nv["used"] = 20 * GiB
                nv["total"] = 140 * GiB
                nv["bar1_total"] = 256 * GiB
                w.write_nvml(nv)
                next_nvml = int(ticks[-1]) + 100_000_000
            if last >= next_kf:
                state.n_events = gen.pos
                state.last_ts = last
                w.write_keyframe(last, gen.pos, state.snapshot())
                next_kf += KEYFRAME_NS
            if gen.pos >= n:
                break
            ev, mk = gen.chunk(min(CHUNK, n - gen.pos))
            for m in mk:
                w.write_marker(m)
            markers += len(mk)
    return {"events": gen.pos, "markers": markers, "bytes": path.stat().st_size, "seconds": time.perf_counter() - t}


def run(what: str, path: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-100m-") as tmp:
        out = subprocess.run([sys.executable, "-c", CHILD, what, str(path), tmp, str(ROOT)], capture_output=True, text=True,
                             cwd=tmp)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1], "rc": out.returncode}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, nargs="+", default=[10_000_000, 30_000_000])
    ap.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=COMMANDS)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where the traces go (default: the temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the traces (reused when present)")
    ap.add_argument("--write", type=Path, help="only write one trace of --events[0] events here")
    ap.add_argument("--stacks", type=int, default=0, help="allocations name one of this many stacks (format 2.3)")
    ap.add_argument("--trace", action="append", default=[], metavar="N=PATH",
                    help="the trace of N events already written there (--write): read, never written or removed")
    args = ap.parse_args()
    if args.write:
        print(json.dumps(write_trace(args.write, args.events[0], args.stacks)))
        return 0
    tmp = Path(args.dir or tempfile.gettempdir())
    sizes = sorted(args.events)
    paths = {n: tmp / f"bench-100m-{n}{f'-stacks{args.stacks}' if args.stacks else ''}.mrec" for n in sizes}
    given = {int(n): Path(p) for n, p in (t.split("=", 1) for t in args.trace)}
    paths.update((n, p) for n, p in given.items() if n in paths)
    for n, path in paths.items():
        if not path.exists():
            w = write_trace(path, n, args.stacks)
            print(f"wrote {path}: {w['events']:,} events, {w['markers']:,} markers, {w['bytes'] / 1e6:.1f} MB "
                  f"({w['bytes'] / w['events']:.3f} B/event, {w['events'] / w['bytes']:.2f} rows a byte) in {w['seconds']:.0f} s")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    res: dict[tuple[str, int], list[dict]] = {(c, n): [] for c in args.commands for n in sizes}
    for _ in range(args.repeat):
        for c in args.commands:
            for n in sizes:
                r = run(c, paths[n])
                res[(c, n)].append(r)
                print(c, n, json.dumps(r), f"load {os.getloadavg()[0]:.1f}", flush=True)
    for c in args.commands:
        floor = [r for r in res[(c, sizes[0])] if "s" in r]
        if not floor:
            print(f"{c:>10}: failed at the floor")
            continue
        line = [f"{c:>10}: {sizes[0]:,}: {statistics.median(r['s'] for r in floor):.2f} s wall, "
                f"{statistics.median(r['cpu'] for r in floor):.2f} s CPU, {max(r['rss_mib'] for r in floor):.0f} MiB"
                + (f", first frame's wait {statistics.median(r['first'] for r in floor):.3f} s, whole scan "
                   f"{statistics.median(r['scan'] for r in floor):.2f} s" if "scan" in floor[0] else "")
                + (f", first frame {statistics.median(r['first'] for r in floor):.3f} s" if "app" in floor[0] else "")]
        for n in sizes[1:]:
            rs = res[(c, n)]
            if any("s" not in r for r in rs):
                line.append(f"{n:,}: failed: {rs[0].get('error')}")
                continue
            wall = statistics.median(r["s"] / f["s"] for r, f in zip(rs, floor))
            cpu = statistics.median(r["cpu"] / f["cpu"] for r, f in zip(rs, floor))
            text = (f"{n:,}: {statistics.median(r['s'] for r in rs):.2f} s (x{wall:.2f} wall, x{cpu:.2f} CPU), "
                    f"{max(r['rss_mib'] for r in rs):.0f} MiB (x{max(r['rss_mib'] for r in rs) / max(r['rss_mib'] for r in floor):.2f})")
            if rs[0]["first"] and "scan" in rs[0]:
                text += (f", first frame's wait {statistics.median(r['first'] for r in rs):.3f} s "
                         f"(x{statistics.median(r['first'] / f['first'] for r, f in zip(rs, floor)):.2f}), whole scan "
                         f"x{statistics.median(r['scan'] / f['scan'] for r, f in zip(rs, floor)):.2f}")
            if "app" in rs[0]:
                text += (f", first frame {statistics.median(r['first'] for r in rs):.3f} s "
                         f"(x{statistics.median(r['first'] / f['first'] for r, f in zip(rs, floor)):.2f})")
            line.append(text)
        print(" | ".join(line))
    for n, path in () if args.keep else paths.items():
        if n not in given:
            path.unlink()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
