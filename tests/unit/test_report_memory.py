"""``memrec report`` and ``memrec diff`` read the events from the file a record at a time, and
their memory does not follow the events (issue 26: 100M events in <= 2 GB).

The trace is the tensor issue's shape (``bench/bench_100m.py``'s, smaller): a few driver
segments per process and many short-lived tensor blocks inside them. What the report keeps is
the live state, the series' change points (a change per driver event: few here), the tensor
blocks alive and the rows its sections read after the pass (not the blocks'). The allocations
are traced (``tracemalloc``: numpy reports its buffers) on a trace of N and of 4N events; the
same report from a loaded trace (``load_trace``: every event's columns, what the command did
before) is the control that must grow (a count of bytes, not a timing).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from memrec import commands
from memrec.base.errors import ExitCode
from memrec.engine import source

from memrec.analysis.diff import build as diff_build
from memrec.analysis.diff.build import diff_traces
from memrec.analysis.report.build import build_report
from memrec.engine import replay
from memrec.engine.source import TraceEvents
from memrec.engine.source import scan_trace
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter
from tests.unit.test_scale_memory import CHUNK
from tests.unit.test_scale_memory import chunk_events
from tests.unit.test_scale_memory import peak

PROCS = 8
SEGMENT = 1 << 30


def write_tensors(path: Path, n: int) -> Path:
    """``n`` events: each of 8 processes (4 GPUs) allocates a 1 GiB driver segment, then tensor
    blocks, each freed ``LIVE`` allocations later (``test_scale_memory``'s shape); a driver
    workspace is allocated and freed once a chunk, and a step marker begins every chunk."""
    with TraceWriter(path, {"host": "t"}) as w:
        for lo in range(0, n, CHUNK):
            ev = chunk_events(lo, n, (Kind.TENSOR_ALLOC, Kind.TENSOR_FREE), (Api.torch_malloc, Api.torch_free))
            # the first events: every process's segment; the last two: a workspace allocated, freed
            if lo == 0:
                ev["kind"][:PROCS] = int(Kind.ALLOC)
                ev["api"][:PROCS] = int(Api.cuMemAlloc_v2)
                ev["ptr"][:PROCS] = np.arange(PROCS, dtype=np.uint64) << np.uint64(40)
                ev["size"][:PROCS] = SEGMENT
                ev["pid"][:PROCS] = ev["tid"][:PROCS] = 100 + np.arange(PROCS)
                ev["gpu"][:PROCS] = np.arange(PROCS) % 4
            ev["kind"][-2:] = (int(Kind.ALLOC), int(Kind.FREE))
            ev["api"][-2:] = (int(Api.cuMemAlloc_v2), int(Api.cuMemFree_v2))
            ev["ptr"][-2:] = 1 << 50
            ev["size"][-2:] = (1 << 20, 0)
            w.write_marker(Marker(int(ev["ts"][0]), 100, 0, 100, f"step{lo // CHUNK}", "begin", 0))
            w.write_events(ev)
    return path


def streamed(path: Path) -> None:
    trace, events = scan_trace(path)
    build_report(trace, events=events)


def loaded(path: Path) -> None:
    build_report(load_trace(path))


def test_the_report_from_the_file_keeps_its_memory_when_the_events_grow(tmp_path, monkeypatch):
    # GIVEN the same shape at N and 4N events, and the replay's chunk (its journal's buffer: a
    # chunk's worth, 1M events) of the file's records' size, so that both sizes are past it
    monkeypatch.setattr(replay, "APPLY_CHUNK", CHUNK)
    n = 2 * CHUNK
    small, large = write_tensors(tmp_path / "n.mrec", n), write_tensors(tmp_path / "4n.mrec", 4 * n)
    streamed(small)  # modules imported, caches filled: not measured
    # WHEN the report is built from the file, and (the control) from the loaded trace
    from_file = peak(lambda: streamed(large)) - peak(lambda: streamed(small))
    whole = peak(lambda: loaded(large)) - peak(lambda: loaded(small))
    # THEN loaded, it holds the 3N more events (the measurement sees them: ~50 bytes an event) ...
    assert whole > 3 * n * 16, whole
    # ... and from the file it grows by less than 2 bytes per added event (a column of the
    # events kept, the smallest proportional regression, is 4 - 8)
    assert from_file < 3 * n * 2, from_file


def test_the_diff_from_the_files_keeps_its_memory_when_the_events_grow(tmp_path, monkeypatch):
    # (the diff keeps its journal whole: a chunk's room at first, then as it grows)
    monkeypatch.setattr(replay, "APPLY_CHUNK", CHUNK)
    monkeypatch.setattr(diff_build, "APPLY_CHUNK", CHUNK)
    n = 2 * CHUNK
    small, large = write_tensors(tmp_path / "n.mrec", n), write_tensors(tmp_path / "4n.mrec", 4 * n)

    def diff(path: Path) -> None:
        (a, a_events), (b, b_events) = scan_trace(path), scan_trace(path)
        diff_traces(a, b, a_events=a_events, b_events=b_events)

    diff(small)
    assert peak(lambda: diff(large)) - peak(lambda: diff(small)) < 3 * n * 2


def test_the_report_and_diff_from_the_file_are_those_of_the_loaded_trace(tmp_path):
    # GIVEN a trace of several records, with tensor blocks, driver segments, markers
    path = write_tensors(tmp_path / "t.mrec", 3 * CHUNK + 123)
    # WHEN the report and diff are built from the file and from the loaded trace
    trace, events = scan_trace(path)
    from_file = build_report(trace, events=events).to_json()
    a, a_events = scan_trace(path)
    diff_file = diff_traces(a, trace, a_events=a_events, b_events=TraceEvents(events.source, events.census)).to_json()
    # THEN they are the same
    assert from_file == build_report(load_trace(path)).to_json()
    assert diff_file == diff_traces(load_trace(path), load_trace(path)).to_json()
    assert from_file["trace"]["events"] == 3 * CHUNK + 123


@pytest.mark.parametrize("command", ["report", "diff"])
@pytest.mark.parametrize("change, code", [("removed", ExitCode.NO_INPUT), ("replaced", ExitCode.DATA),
                                          ("another trace", ExitCode.DATA), ("cut", ExitCode.DATA),
                                          ("rewritten", ExitCode.DATA)])
def test_a_trace_changed_after_its_first_pass_is_a_one_line_error(tmp_path, monkeypatch, capsys, command, change,
                                                                 code):
    # GIVEN a trace that is removed, or replaced by a file that is not a trace, between the
    # first pass (scan_trace) and the second (the replay reads the events again)
    path = write_tensors(tmp_path / "t.mrec", CHUNK + 5)
    real = source.scan_trace

    other = write_tensors(tmp_path / "other.mrec", CHUNK + 900)  # a valid trace, longer

    def scan_then_change(p, **kw):
        out = real(p, **kw)
        if os.fspath(p) != str(path):  # diff's other trace stays as it is
            return out
        if change == "cut":  # in place: the same inode, shorter
            os.truncate(p, os.path.getsize(p) * 2 // 3)
        elif change == "rewritten":  # in place: the same inode, another trace's bytes (cp over it)
            with open(p, "r+b") as f:
                f.write(Path(other).read_bytes())
        else:
            os.unlink(p)
            if change == "replaced":
                Path(p).write_bytes(b"not a trace at all" * 100)
            elif change == "another trace":  # mv over it: a new inode
                os.rename(other, p)
        return out

    monkeypatch.setattr(source, "scan_trace", scan_then_change)
    # WHEN the command reads it
    argv = [command, str(path)] + ([str(write_tensors(tmp_path / "b.mrec", 10))] if command == "diff" else [])
    rc = commands.main(argv)
    err = capsys.readouterr().err
    # THEN it says so in one line with the exit code of a trace that cannot be read
    assert rc == code, err
    assert err.count("\n") == 1 and str(path) in err and "Traceback" not in err
    if change in ("another trace", "cut", "rewritten"):  # a valid trace's bytes: not another's report
        assert "changed while it was read" in err
