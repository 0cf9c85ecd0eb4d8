"""Trace format 2 on the 10M-event trace: size, load and ``memrec dump``, against floors of the same run.

    .venv/bin/python bench/bench_format.py [--events 10000000] [--repeat 3] [--keep PATH]

* size: bytes per event of the whole file (keyframes, NVML and markers included) written by
  ``bench/bench_tui.py``'s generator (8 GPUs, each allocation freed 4,000 events later, a keyframe
  every 1M events: the trace the issue's goals name); the same for ``bench/bench_trace.py``'s
  uniformly random events (its pointers and sizes are random bits: ~13 bytes of entropy per
  event, a floor no codec passes); and the events records of the H200 traces in ``examples/``
  (format 1 files) re-encoded as format 2 chunk for chunk.
* load: ``load_trace`` in a fresh interpreter each time, as a command runs it (columns;
  ``Trace.events`` not built), and its peak memory (``ru_maxrss``). Floor: read the file's bytes
  and decompress every columnar record's Zstandard frame into one new buffer: the least any reader
  of this file must do.
* dump: ``memrec dump`` (its command's ``run``, in a fresh interpreter as for load) to
  ``/dev/null``. Floor: the load floor plus making as
  many bytes as the dump prints (one copy each).

Each is timed ``--repeat`` times, wall and CPU (the machine is shared: CPU time is the steadier);
the ratio is best against best.
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trace import synthetic  # noqa: E402
from bench_tui import write_trace  # noqa: E402

from memrec.trace.format import packb  # noqa: E402
from memrec.trace.reader import TraceReader  # noqa: E402
from memrec.trace.writer import BytesSink  # noqa: E402
from memrec.trace.writer import TraceWriter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def timed(repeat: int, fn) -> tuple[list[float], list[float]]:
    wall, cpu = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return wall, cpu


def load_floor(path: Path) -> None:
    """Read the file and decompress each columnar record's frame into one new buffer (as big as
    every frame's content: the pages a loader must fill, faulted in as a loader's are). Chunks
    stored raw (key "r", a few rows each) are left out: there is nothing to decompress."""
    dctx = zstandard.ZstdDecompressor()
    frames = []
    up = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 30)
    with open(path, "rb") as f:
        while data := f.read(1 << 24):
            up.feed(data)
            for obj in up:
                z = obj.get("c", obj.get("z")) if isinstance(obj, dict) else None
                if z is not None:
                    frames.append(z)
    total = sum(zstandard.frame_content_size(z) for z in frames)
    out = np.empty(total, np.uint8)
    at = 0
    for z in frames:
        part = np.frombuffer(dctx.decompress(z), np.uint8)
        out[at : at + len(part)] = part
        at += len(part)


_CHILD = """
import resource, sys, time
from memrec.trace.reader import load_trace
w, c = time.perf_counter(), time.process_time()
t = load_trace(sys.argv[1])
print(time.perf_counter() - w, time.process_time() - c, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def load_in_fresh_process(path: Path) -> tuple[float, float, float]:
    """(wall s, cpu s, max RSS MiB) of one ``load_trace`` in a new interpreter (as a command runs)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True)
    wall, cpu, rss = (float(x) for x in out.stdout.split())
    return wall, cpu, rss


_DUMP_CHILD = """
import argparse, sys, time
from memrec.commands.dump import DumpCommand
if sys.argv[2] == "defaults":  # the dump as before memrec/base/heap.py: glibc's own heap policy
    import memrec.base.heap
    memrec.base.heap.keep_freed_pages = lambda: False
w, c = time.perf_counter(), time.process_time()
DumpCommand().run(argparse.Namespace(trace=sys.argv[1], force=True), None)
print(time.perf_counter() - w, time.process_time() - c, file=sys.stderr)
"""


def dump_in_fresh_process(path: Path, heap: str = "kept") -> tuple[float, float]:
    """(wall s, cpu s) of ``memrec dump``'s run in a new interpreter, its output to /dev/null;
    ``heap="defaults"``: without :func:`memrec.base.heap.keep_freed_pages` (the dump before it)."""
    out = subprocess.run([sys.executable, "-c", _DUMP_CHILD, str(path), heap], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, check=True)
    wall, cpu = (float(x) for x in out.stderr.split()[-2:])
    return wall, cpu


def reencoded(path: str) -> tuple[int, float, float, int, int]:
    """A format-1 file written again as format 2, record for record (chunks as recorded: a flush
    after each): (events, events-record bytes per event v1, v2, whole file bytes v1, v2)."""
    sink = BytesSink()
    with TraceReader(path) as reader:
        writer = TraceWriter(sink, dict(reader.header))
        v1 = v2 = n = 0
        for raw, rec in zip(reader.raw_records(), reader.records()):
            kind = rec["type"]
            if kind == "trailer":
                continue
            before = len(sink.records)
            writer.write_record(rec)
            writer.flush()
            if kind == "events":
                v1 += len(packb(raw))
                v2 += sum(len(r) for r in sink.records[before:])
                n += len(rec["events"])
        writer.close(reader.trailer)
    return n, v1 / max(n, 1), v2 / max(n, 1), os.path.getsize(path), len(sink.data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="write the trace here and keep it (reused when it exists)")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="memrec-bench-")
    path = args.keep or Path(tmp.name) / "bench.mrec"
    if not path.exists():
        write_trace(path, args.events, 4000, 1_000_000)
    n = args.events
    size = path.stat().st_size
    print(f"load average {os.getloadavg()[0]:.1f}; python {sys.version.split()[0]}, numpy {np.__version__}, "
          f"zstandard {zstandard.__version__}")
    print(f"size: {n:,} events, {size / 2**20:.1f} MiB: {size / n:.2f} B/event (whole file)")

    random_path = Path(tmp.name) / "random.mrec"
    with TraceWriter(random_path, {"host": "bench"}) as w:
        w.write_events(synthetic(1_000_000))
    print(f"size: bench_trace.py's random events: {random_path.stat().st_size / 1e6:.2f} B/event")
    for example in sorted(glob.glob(str(ROOT / "examples" / "*.mrec"))):
        count, v1, v2, f1, f2 = reencoded(example)
        print(f"size: {Path(example).name}: {count} events: events records {v1:.1f} B/event (v1) -> {v2:.1f} (v2); "
              f"whole file {f1:,} -> {f2:,} bytes")

    with open(path, "rb") as f:  # warm the page cache
        while f.read(1 << 24):
            pass
    runs = [load_in_fresh_process(path) for _ in range(args.repeat)]
    lw, lc = [r[0] for r in runs], [r[1] for r in runs]
    fw, fc = timed(args.repeat, lambda: load_floor(path))
    print(f"load (a fresh process each): wall {' '.join(f'{t:.2f}' for t in lw)} s (median {statistics.median(lw):.2f}), "
          f"cpu {' '.join(f'{t:.2f}' for t in lc)} s; floor wall {min(fw):.2f} s cpu {min(fc):.2f} s; "
          f"ratio {min(lw) / min(fw):.2f} (cpu {min(lc) / min(fc):.2f})")
    print(f"load: peak RSS {max(r[2] for r in runs):.0f} MiB ({n * 66 / 2**20:.0f} MiB of columns)")
    dumps = [(dump_in_fresh_process(path), dump_in_fresh_process(path, "defaults")) for _ in range(args.repeat)]
    dw, dc = [d[0][0] for d in dumps], [d[0][1] for d in dumps]
    bw, bc = [d[1][0] for d in dumps], [d[1][1] for d in dumps]
    out_bytes = 226 * n  # about 226 bytes a line on this trace
    blob = np.ones(1 << 24, np.uint8)

    def dump_floor() -> None:
        # decode the columns, and make the output's bytes once (one copy each)
        load_floor(path)
        with open(os.devnull, "wb") as null:
            for _ in range(out_bytes // len(blob)):
                null.write(blob.tobytes())

    gw, gc = timed(args.repeat, dump_floor)
    print(f"dump: {n / min(dw) / 1e6:.2f} M events/s wall (best of {' '.join(f'{t:.1f}' for t in dw)} s), "
          f"{n / min(dc) / 1e6:.2f} M events/s cpu; floor {n / min(gw) / 1e6:.2f} M/s wall, "
          f"{n / min(gc) / 1e6:.2f} M/s cpu; ratio {min(dw) / min(gw):.2f} (cpu {min(dc) / min(gc):.2f})")
    print(f"dump with glibc's heap defaults (before keep_freed_pages), interleaved: {n / min(bw) / 1e6:.2f} M events/s "
          f"wall, {n / min(bc) / 1e6:.2f} M events/s cpu (cpu {' '.join(f'{t:.2f}' for t in bc)} s against "
          f"{' '.join(f'{t:.2f}' for t in dc)} s); ratio {min(bw) / min(gw):.2f} (cpu {min(bc) / min(gc):.2f})")
    print(f"max rss of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
