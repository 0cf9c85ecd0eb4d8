"""What streams keeps its memory when the trace grows (issue 26: 100M events).

``memrec dump`` reads a trace chunk by chunk (:class:`memrec.trace.reader.TraceReader`) and lets
each go: measured at 10M and 30M events of ``bench/bench_100m.py``'s trace, 130 MiB either way.
Here the allocations the dump makes are traced (``tracemalloc``: numpy reports its buffers to it)
on a trace of N and of 4N events: the peak must not follow N. ``load_trace``, which keeps every
event's columns by design, is traced beside it on the same files as the control: its peak grows
with N, so the measurement sees what a proportional regression would add (a count of bytes
allocated, not a timing: the machine's load does not move it).
"""

from __future__ import annotations

import io
import tracemalloc
from pathlib import Path

import numpy as np

from memrec.terms.columns import empty_events
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.export.jsonl import dump_trace
from memrec.trace.reader import TraceReader
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter

CHUNK = 1 << 16  # the writer's own chunk
LIVE = 512


def write(path: Path, n: int) -> Path:
    """``n`` driver events on 4 GPUs, 8 processes: allocation ``a`` freed ``LIVE`` allocations
    later, written a chunk at a time as the daemon writes them."""
    with TraceWriter(path, {"host": "t"}) as w:
        for lo in range(0, n, CHUNK):
            w.write_events(chunk_events(lo, n))
    return path


def chunk_events(lo: int, n: int, kinds: tuple[Kind, Kind] = (Kind.ALLOC, Kind.FREE),
                 apis: tuple[Api, Api] = (Api.cuMemAlloc_v2, Api.cuMemFree_v2)) -> np.ndarray:
    """The chunk of :func:`write`'s events from ``lo`` (``kinds``, ``apis``: an allocation's and
    a free's; the first ``LIVE`` frees, which have nothing to free, are context events)."""
    idx = np.arange(lo, min(n, lo + CHUNK), dtype=np.int64)
    ev = empty_events(len(idx))
    alloc = idx % 2 == 0
    target = np.where(alloc, idx // 2, idx // 2 - LIVE)
    ok = alloc | (target >= 0)
    ev["ts"] = 10**12 + idx * 1000
    ev["pid"] = ev["tid"] = 100 + np.abs(target) % 8
    ev["kind"] = np.where(alloc, int(kinds[0]), np.where(ok, int(kinds[1]), int(Kind.CTX)))
    ev["api"] = np.where(alloc, int(apis[0]), int(apis[1]))
    ev["ptr"] = (1 << 40) + np.abs(target).astype(np.uint64) * 4096
    ev["size"] = np.where(alloc, (np.abs(target) * 2654435761 % 4096 + 1) * 512, 0)
    ev["gpu"] = np.where(alloc, np.abs(target) % 4, -1)
    return ev


def peak(fn) -> int:
    """The most bytes ``fn()`` had allocated at once (tracemalloc: Python objects and numpy buffers)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def dump(path: Path) -> None:
    with TraceReader(path) as reader:
        dump_trace(reader, _Null())


class _Null(io.TextIOBase):
    """An output that keeps nothing (the dump's lines are not the reader's memory)."""

    def write(self, text: str) -> int:
        return len(text)


def walk(path: Path) -> None:
    """Every record, as each streaming command gets them, let go at once."""
    with TraceReader(path) as reader:
        for _ in reader.entries():
            pass


def test_streaming_reads_keep_their_memory_when_the_events_grow(tmp_path):
    # GIVEN the same shape at N and 4N events (N past the reader's read-ahead of a few chunks)
    n = 2 * CHUNK
    small, large = write(tmp_path / "n.mrec", n), write(tmp_path / "4n.mrec", 4 * n)
    # WHEN the reader walks each, the dump writes each, and load_trace (the control) loads each
    walked = peak(lambda: walk(small)), peak(lambda: walk(large))
    dumped = peak(lambda: dump(small)), peak(lambda: dump(large))
    loaded = peak(lambda: load_trace(small)), peak(lambda: load_trace(large))
    # THEN the control sees the 3N more events' columns (the measurement works)
    assert loaded[1] - loaded[0] > 3 * n * 8, loaded
    # AND the streaming reads grow by less than 2 bytes per added event (measured: about 1.2; one
    # column of the events kept, the smallest proportional regression, is 4 - 8; the reader's
    # records kept are 20, the dump's lines 300): their peak is a few chunks'
    assert walked[1] - walked[0] < 3 * n * 2, walked
    assert dumped[1] - dumped[0] < 3 * n * 2, dumped
