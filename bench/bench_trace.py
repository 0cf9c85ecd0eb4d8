"""Trace write and load throughput against a raw-numpy floor measured in the same run.

    python bench/bench_trace.py [--events 2000000] [--batch 50000] [--repeat 3] [--dir /tmp]

* write: ``TraceWriter.write_events`` in daemon-sized batches, a ``flush()`` after each batch
  (the daemon flushes at least every 200 ms), then ``close()`` (fsync). Floor: ``os.write`` of the
  same bytes in as many calls, then fsync.
* load: ``load_trace`` (every chunk decoded into the trace's columns; the EVENT_DTYPE rows are
  not built). Floor: read the same trace file's bytes, plus one flat copy of the same rows held
  in memory (``np.frombuffer(raw_rows, np.uint8).copy().view(EVENT_DTYPE)``: an owned array).
* stream: iterating ``TraceReader`` (one structured array per chunk), for the TUI/dump path.

Prints events/s for each, the ratio to its floor (1.0 = as fast as raw numpy; higher = slower),
and bytes per event. These events are uniformly random (pointers, sizes: about 13 bytes of
entropy an event), the worst case for the format's codec; ``bench/bench_format.py`` measures the
10M-event trace of ``bench/bench_tui.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.columns import empty_events
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.trace.reader import TraceReader
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter


def synthetic(n: int) -> np.ndarray:
    """``n`` plausible events: increasing ts, a few pids, 1% with IPC handle bytes."""
    rng = np.random.default_rng(0)
    ev = empty_events(n)
    ev["ts"] = 10**12 + np.cumsum(rng.integers(100, 5000, n, dtype=np.uint64))
    ev["pid"] = rng.integers(1000, 1008, n)
    ev["tid"] = ev["pid"] + rng.integers(0, 4, n)
    ev["kind"] = rng.choice([1, 2, 3, 4, 5, 6], n)
    ev["api"] = rng.choice([1, 8, 11, 12, 13, 14], n)
    ev["ordinal"] = rng.integers(0, 8, n)
    ev["gpu"] = ev["ordinal"]
    ev["ptr"] = rng.integers(1 << 40, 1 << 47, n, dtype=np.uint64)
    ev["size"] = rng.integers(512, 1 << 30, n, dtype=np.uint64)
    ipc = np.arange(0, n, 100)
    ev["flags"][ipc] = FLAG_IPC_BYTES
    ev["ipc"][ipc] = np.frombuffer(rng.bytes(64 * len(ipc)), dtype="V64")
    return ev


def best(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=2_000_000)
    parser.add_argument("--batch", type=int, default=50_000, help="events per write_events call and flush")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the best is kept")
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = parser.parse_args(argv)

    ev = synthetic(args.events)
    batches = [ev[i : i + args.batch] for i in range(0, len(ev), args.batch)]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        trace_path = os.path.join(tmp, "bench.mrec")
        raw_path = os.path.join(tmp, "bench.raw")

        def write_trace() -> None:
            with TraceWriter(trace_path, {"host": "bench"}) as writer:
                for batch in batches:
                    writer.write_events(batch)
                    writer.flush()

        def write_floor() -> None:
            # The same bytes the trace holds, in as many os.write calls as there are batches.
            fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for part in trace_parts:
                    os.write(fd, part)
                os.fsync(fd)
            finally:
                os.close(fd)

        def load() -> None:
            trace = load_trace(trace_path)
            assert len(trace.events) == len(ev)

        raw_rows = ev.tobytes()

        def load_floor() -> None:
            # The least any reader must do: read the trace's bytes (1 MiB reads, as the reader
            # does), and fill a new zeroed array with the rows (one flat copy of raw rows in memory).
            buf = bytearray(1 << 20)
            with open(trace_path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
            arr = np.zeros(len(ev), dtype=EVENT_DTYPE)
            arr.view(np.uint8)[:] = np.frombuffer(raw_rows, dtype=np.uint8)
            assert len(arr) == len(ev)

        def stream() -> None:
            n = 0
            with TraceReader(trace_path) as reader:
                for rec in reader:
                    if rec["type"] == "events":
                        n += len(rec["events"])
            assert n == len(ev)

        t_write = best(args.repeat, write_trace)
        with open(trace_path, "rb") as f:
            data = f.read()
        step = -(-len(data) // len(batches))
        trace_parts = [data[i : i + step] for i in range(0, len(data), step)]
        del data
        t_write_raw = best(args.repeat, write_floor)
        t_load = best(args.repeat, load)
        t_load_raw = best(args.repeat, load_floor)
        t_stream = best(args.repeat, stream)
        assert np.array_equal(load_trace(trace_path).events, ev)
        trace_size = os.path.getsize(trace_path)
        raw_size = len(raw_rows)

    n = len(ev)
    print(f"events: {n:,}  batch: {args.batch:,}  python {sys.version.split()[0]}  numpy {np.__version__}")
    print(f"{'':8} {'events/s':>14} {'floor events/s':>16} {'ratio':>7}")
    for name, t, floor in (
        ("write", t_write, t_write_raw),
        ("load", t_load, t_load_raw),
        ("stream", t_stream, t_load_raw),
    ):
        print(f"{name:8} {n / t:14,.0f} {n / floor:16,.0f} {t / floor:7.2f}")
    print(f"bytes/event: trace {trace_size / n:.1f}, raw rows {raw_size / n:.1f} ({EVENT_DTYPE.itemsize} B per row)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
