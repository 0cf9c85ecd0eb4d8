"""Benchmark of the TUI on a large trace (run by hand, not by the tests).

    .venv/bin/python bench/bench_tui.py [--events 10000000] [--keep PATH] [--repeat 3]

1. Writes a synthetic trace with the real writer: ``--events`` driver events on 8 GPUs (each
   allocation freed ``--live`` allocations later, so that many are live at any time), NVML at
   10 Hz, phase markers, and a keyframe (a real LiveState snapshot) every ``--keyframe-every``
   events, as the daemon writes them.
2. Measures, each against a floor measured in the same run on the same machine:
   - first frame: headless app start → the state at the initial cursor shown and painted (the
     file is scanned, not replayed: keyframes); floors = the first frame of a 2,000-event trace
     (the app's own start) and reading the file's bytes once;
   - app start → replay done (no key pressed); floor = the model's scan and replay alone, in
     one thread without the app (``FileSource.scan`` + ``index``); each of ``--repeat`` runs
     with its own floors;
   - cursor move / zoom redraw: the synchronous part of a key press (timeline + header);
     state at the cursor after the replay (checkpoint + gap) in its worker; floor = one numpy
     pass over the events' timestamps;
   - live ingest: events/s a live model takes (decode-free: arrays), with its memory bounded;
     floor = LiveState.apply alone (the accounting every event needs anyway).

Budgets (issue 11): first frame <= 0.5 s, replay in the app <= 5 s, redraw <= 50 ms, live >= 100k events/s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memrec.terms.columns import NVML_DTYPE  # noqa: E402
from memrec.terms.columns import empty_events  # noqa: E402
from memrec.terms.events import Api  # noqa: E402
from memrec.terms.events import Kind  # noqa: E402
from memrec.terms.events import Marker  # noqa: E402
from memrec.state import LiveState  # noqa: E402

GiB = 1 << 30
T0 = 10**12
NGPU = 8
STEP_NS = 10_000  # 100k events/s of trace time


def make_events(lo: int, hi: int, live: int, seed: int = 0) -> np.ndarray:
    """Events [lo, hi) of the synthetic stream: even = alloc #i, odd = free of alloc #(i - live)."""
    n = hi - lo
    idx = np.arange(lo, hi, dtype=np.int64)
    ev = empty_events(n)
    ev["ts"] = T0 + idx * STEP_NS
    alloc = idx % 2 == 0
    a = idx // 2  # alloc number at this position
    target = np.where(alloc, a, a - live)
    valid = alloc | (target >= 0)
    rng = np.random.default_rng(seed + lo)
    pid = (1000 + target % NGPU).astype(np.uint32)
    ev["pid"] = pid
    ev["tid"] = pid
    ev["kind"] = np.where(alloc, int(Kind.ALLOC), np.where(valid, int(Kind.FREE), int(Kind.CTX)))
    ev["api"] = np.where(alloc, int(Api.cuMemAlloc_v2), int(Api.cuMemFree_v2))
    ev["ptr"] = (0x7F00_0000_0000 + (target % (1 << 24)).astype(np.uint64) * 0x20_0000).astype(np.uint64)
    sizes = ((target * 2654435761) % 4096 + 1).astype(np.uint64) * (1 << 20) // 8  # 128K..512M
    ev["size"] = np.where(alloc, sizes, 0)
    ev["gpu"] = np.where(alloc, (target % NGPU), -1)
    ev["ordinal"] = 0
    # a few failed allocations (out of memory)
    fail = alloc & (rng.random(n) < 1e-5)
    ev["result"][fail] = 2
    ev["ptr"][fail] = 0
    return ev


def keyframe_state(j: int, live: int) -> dict:
    """The LiveState after the first ``j`` events, built from the live allocations only."""
    n_alloc = (j + 1) // 2
    first = max(0, n_alloc - live)
    alive = []
    for a in range(first, n_alloc):
        pos = 2 * a
        alive.append(make_events(pos, pos + 1, live)[0])
    s = LiveState()
    if alive:
        arr = np.array(alive, dtype=alive[0].dtype)
        arr = arr[arr["result"] == 0]
        s.apply(arr)
    s.n_events = j
    s.last_ts = T0 + max(j - 1, 0) * STEP_NS
    return s.snapshot()


HEADER = {
    "host": "bench",
    "gpus": [{"index": g, "uuid": f"GPU-bench-{g}", "name": "NVIDIA H200", "total": 140 * GiB, "bar1_total": 256 * GiB}
             for g in range(NGPU)],
}


def write_body(w, n: int, keyframe_every: int, make, keyframe) -> None:
    """The events ``make(lo, hi)`` of positions [0, n), a keyframe ``keyframe(j)`` at the start and
    every ``keyframe_every`` events, and NVML at 10 Hz over their time (bench_scale.py's too)."""
    w.write_keyframe(T0, 0, keyframe(0))
    pos = 0
    while pos < n:
        hi = min(n, pos + keyframe_every)
        for lo in range(pos, hi, 1 << 20):
            w.write_events(make(lo, min(hi, lo + (1 << 20))))
        w.write_keyframe(T0 + (hi - 1) * STEP_NS, hi, keyframe(hi))
        pos = hi
    ticks = np.arange(0, n * STEP_NS, 100_000_000, dtype=np.int64)
    nv = np.zeros(len(ticks) * NGPU, dtype=NVML_DTYPE)
    nv["ts"] = np.repeat(T0 + ticks, NGPU)
    nv["gpu"] = np.tile(np.arange(NGPU), len(ticks))
    nv["used"] = 20 * GiB
    nv["reserved"] = 615 << 20
    nv["total"] = 140 * GiB
    nv["bar1_total"] = 256 * GiB
    w.write_nvml(nv)


def write_trace(path: Path, n: int, live: int, keyframe_every: int) -> None:
    from memrec.trace.writer import TraceWriter

    duration = n * STEP_NS
    with TraceWriter(path, HEADER) as w:
        write_body(w, n, keyframe_every, lambda lo, hi: make_events(lo, hi, live), lambda j: keyframe_state(j, live))
        for k in range(10):
            for g in range(NGPU):
                ts = T0 + duration * k // 10
                w.write_marker(Marker(ts, 1000 + g, 0, 1000 + g, f"phase{k}", "begin", g))
                w.write_marker(Marker(ts + duration // 12, 1000 + g, 0, 1000 + g, f"phase{k}", "end", g))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    best = float("inf")
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


async def first_frame(path: Path, keys: bool = False, replay: bool = True) -> tuple[float, float, object]:
    """Seconds from app start to the first frame with the cursor state (painted), and to the end
    of the replay. The bench waits on the app's own messages (``message_signal``), not by polling:
    ``Pilot.pause`` every 5 ms walked every widget and repainted the screen, and even a plain
    sleep loop wakes the UI thread, which takes the GIL from the scan: work the app never does.
    ``keys``: six key presses while the replay runs, each timed (the handler's synchronous part);
    each pauses the replay 0.5 s, as a key press does, so that run's replay time is not the app's.
    ``replay=False``: leave once the first frame is shown (the time to the end of the replay is then 0)."""
    from memrec.tui.app import MemrecApp
    from memrec.tui.sources import FileSource

    t0 = time.perf_counter()
    app = MemrecApp(FileSource(path))
    async with app.run_test(size=(160, 48)) as pilot:
        shown, indexed = asyncio.Event(), asyncio.Event()

        def seen(message: object) -> None:
            if app.main.cursor_state is not None:
                shown.set()
            if app.main.indexed:
                indexed.set()

        app.main.message_signal.subscribe(app, seen, immediate=True)  # the cursor's state arrives there
        app.message_signal.subscribe(app, seen, immediate=True)  # the source's messages there
        seen(None)
        await shown.wait()
        await pilot.pause(0)  # the messages handled and the screen painted
        first = time.perf_counter() - t0
        # redraws of the running app while the replay goes on: the handler's synchronous work
        # (timeline, header, status; the state at the cursor is then computed in a worker)
        redraw = []
        for action in (lambda: app.main.action_move(-1), lambda: app.main.action_move(-10), lambda: app.main.action_zoom(0.5),
                       lambda: app.main.action_zoom(2.0), lambda: app.main.action_move(1), app.main.action_fit)[: 6 if keys else 0]:
            app.on_key()  # what a key press does first: the replay pauses while the user interacts
            t = time.perf_counter()
            action()
            redraw.append(time.perf_counter() - t)
            await pilot.pause(0.05)
        if replay:
            await indexed.wait()
        full = time.perf_counter() - t0 if replay else 0.0
    # the app froze its heap (gc.freeze) for the one run a process makes: let the next run's
    # collector see this one's cycles again, or each run keeps the last one's model (1 GB)
    gc.unfreeze()
    gc.collect()
    return first, full, (app, redraw)


def model_alone(path: Path) -> None:
    """The file's scan and replay without the app, in this thread (the floor of the app's replay)."""
    from memrec.tui.sources import FileSource

    src = FileSource(path)
    src.scan()
    src.index()


def bench_redraw(model, width: int = 154) -> dict:
    """Synchronous redraw costs on an indexed model: viewport + render, and the cursor state."""
    from memrec.tui.widgets.timeline import TimelineOptions
    from memrec.tui.widgets.timeline import render_timeline

    lo, hi = model.time_range()
    rng = np.random.default_rng(1)
    draws, zooms, states = [], [], []
    for i in range(20):
        c = int(lo + rng.random() * (hi - lo))
        span = (hi - lo) >> (i % 12)
        t0 = max(lo, c - span // 2)

        def draw(t0=t0, span=span, c=c):
            v = model.viewport(0, t0, t0 + span, width)
            return render_timeline(v, TimelineOptions(28, 140 * GiB, c, lo, model.bands(0), 4, model.landmarks.failures(0, t0, t0 + span)))

        d, _ = timed(draw)
        (zooms if i % 2 else draws).append(d)
        seq = model.store.seq_at(c)
        s, _ = timed(lambda seq=seq: model.state_at(seq, 0))
        states.append(s)
    return {"draw": draws, "zoom": zooms, "state": states}


def bench_live(total: int, batch: int, live: int) -> dict:
    """A live model fed ``total`` events in batches (as the socket delivers them)."""
    from memrec.tui.model import TraceModel

    m = TraceModel(max_events=2_000_000)
    m.set_header({"gpus": [{"index": g, "uuid": None, "name": "g", "total": 140 * GiB} for g in range(NGPU)]})
    batches = [make_events(lo, lo + batch, live) for lo in range(0, total, batch)]
    rss = []
    t = time.perf_counter()
    for i, b in enumerate(batches):
        m.add_events(b)
        m.index_step(1 << 62)
        m.trim()
        if i % max(len(batches) // 4, 1) == 0:
            rss.append(rss_mib())
    dt = time.perf_counter() - t
    rss.append(rss_mib())
    return {"rate": total / dt, "rss": rss, "held": len(m.store), "series_points": sum(len(s) for s in m.series.values())}


async def live_socket(seconds: float, rate: int, live: int) -> dict:
    """The whole live path: a scripted daemon sends ``rate`` events/s over a Unix socket (frames
    encoded beforehand), the headless app receives, decodes, replays and draws them."""
    import socket
    import threading

    from memrec.state import LiveState as _LS
    from memrec.trace.format import finalize_header
    from memrec.trace.frames import encode_frame
    from memrec.tui.app import MemrecApp
    from memrec.tui.sources import LiveSource

    batch = rate // 10
    n_batches = int(seconds * 10)
    header = finalize_header({"gpus": [{"index": g, "uuid": None, "name": "g", "total": 140 * GiB} for g in range(NGPU)]})
    frames = [encode_frame(header), encode_frame({"type": "keyframe", "ts": T0, "event_index": 0, "state": _LS().snapshot()})]
    frames += [encode_frame({"type": "events", "events": make_events(i * batch, (i + 1) * batch, live)}) for i in range(n_batches)]
    d = tempfile.mkdtemp(prefix="mrb", dir="/tmp")
    path = os.path.join(d, "s.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen()
    sent = [0]

    def serve():
        conn, _ = lsock.accept()
        conn.recv(100)
        conn.sendall(frames[0] + frames[1])
        t0 = time.perf_counter()
        for i, f in enumerate(frames[2:]):
            delay = t0 + i * 0.1 - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            conn.sendall(f)
            sent[0] += batch
        time.sleep(1.0)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    app = MemrecApp(LiveSource(path, max_events=2_000_000))
    lags = []
    rss = []
    async with app.run_test(size=(160, 48)) as pilot:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds + 0.5:
            await pilot.pause(0.25)
            lags.append(sent[0] - app.model.store.n)
            rss.append(rss_mib())
        end = time.perf_counter() + 10
        while app.model.store.n < sent[0] and time.perf_counter() < end:
            await pilot.pause(0.05)
        drained = time.perf_counter() - t0
        got = app.model.store.n
    lsock.close()
    return {"sent": sent[0], "got": got, "lag_max": max(lags), "drained": drained, "rss": rss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--live", type=int, default=4000, help="allocations live at any time")
    ap.add_argument("--keyframe-every", type=int, default=1_000_000, help="events between keyframes (10 s at 100k/s)")
    ap.add_argument("--live-events", type=int, default=3_000_000, help="events fed to the live model")
    ap.add_argument("--live-seconds", type=float, default=10.0, help="seconds of 100k events/s over a socket")
    ap.add_argument("--keep", type=Path, help="write the trace here and keep it (reused when it exists)")
    ap.add_argument("--repeat", type=int, default=3, help="app runs (first frame, replay, key presses), each with its floors")
    args = ap.parse_args()

    tmp = None
    path = args.keep
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="memrec-bench-")
        path = Path(tmp.name) / "bench.mrec"
    if not path.exists():
        t, _ = timed(lambda: write_trace(path, args.events, args.live, args.keyframe_every))
        print(f"wrote {args.events:,} events to {path} ({path.stat().st_size / 2**20:.0f} MiB) in {t:.1f} s")

    # floors
    def read_all():
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass

    timed(read_all)  # warm the page cache: every measurement below reads from memory
    ts = np.arange(args.events, dtype=np.uint64)
    floor_pass, _ = timed(lambda: np.maximum.accumulate(ts), 3)
    sample = make_events(0, 200_000, args.live)
    floor_apply, _ = timed(lambda: LiveState().apply(sample.copy()), 2)
    floor_rate = len(sample) / floor_apply

    small = path.with_name(f"{path.stem}-2000{path.suffix}")  # the app's own start: a tiny trace
    if not small.exists():
        write_trace(small, 2000, min(args.live, 400), args.keyframe_every)
    # each repeat: the floors, the app without key presses (first frame, replay done), and with them
    runs = []
    key_redraw = []
    for _ in range(args.repeat):
        floor_io, _ = timed(read_all)
        floor_app = asyncio.run(first_frame(small))[0]
        floor_model, _ = timed(lambda: model_alone(path))
        first, full, (app, _) = asyncio.run(first_frame(path))
        _, _, (app, keyed) = asyncio.run(first_frame(path, keys=True))
        key_redraw += keyed
        runs.append((floor_io, floor_app, first, floor_model, full, os.getloadavg()[0]))
    model = app.model
    red = bench_redraw(model)
    lv = bench_live(args.live_events, 10_000, args.live)
    ls = asyncio.run(live_socket(args.live_seconds, 100_000, args.live))

    ms = lambda v: f"{v * 1e3:7.1f} ms"  # noqa: E731
    p = lambda xs: (statistics.median(xs), max(xs))  # noqa: E731
    print(f"\nfloors: one pass over ts {ms(floor_pass)}  LiveState.apply {floor_rate / 1e3:,.0f}k ev/s")
    print("run | read file | 2,000-event trace (app start) | first frame (goal 500 ms) | model alone: scan + replay "
          "| app start -> replay done (goal 5 s) | load")
    for i, (f_io, f_app, first, f_model, full, load) in enumerate(runs):
        print(f"{i + 1:3} | {ms(f_io)} | {ms(f_app)} | {ms(first)} (x{first / f_app:.1f}) | {f_model:6.2f} s | "
              f"{full:6.2f} s (x{full / f_model:.2f}, {args.events / full / 1e3:,.0f}k ev/s) | {load:.1f}")
    print(f"first frame median {ms(statistics.median(r[2] for r in runs))}, replay done median "
          f"{statistics.median(r[4] for r in runs):.2f} s")
    for name, xs in (("timeline redraw (cursor move)", red["draw"]), ("timeline redraw (zoom)", red["zoom"]),
                     ("key handler in the running app (replaying)", key_redraw)):
        med, worst = p(xs)
        print(f"{name:48} {ms(med)} median {ms(worst)} worst   budget 50 ms   x{med / floor_pass:.1f} of one ts pass")
    med, worst = p(red["state"])
    print(f"{'state at the cursor (worker: checkpoint+gap)':48} {ms(med)} median {ms(worst)} worst")
    print(f"live ingest  {lv['rate'] / 1e3:,.0f}k ev/s  (budget 100k)  x{lv['rate'] / floor_rate:.2f} of LiveState.apply alone; "
          f"RSS MiB {' '.join(f'{r:.0f}' for r in lv['rss'])}; held {lv['held']:,} events, "
          f"{lv['series_points']:,} series points")
    print(f"live over a socket at 100k ev/s for {args.live_seconds:.0f} s: received {ls['got']:,} of {ls['sent']:,} "
          f"events, largest backlog {ls['lag_max']:,} events, all in after {ls['drained']:.1f} s; "
          f"RSS MiB {ls['rss'][0]:.0f} -> {ls['rss'][len(ls['rss']) // 2]:.0f} -> {ls['rss'][-1]:.0f}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
