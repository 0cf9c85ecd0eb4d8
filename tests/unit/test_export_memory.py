"""The exports write the events a slice at a time (issue 26: 100M events), and a slice is what
they hold of them beyond the replay they share.

Every export reads :class:`memrec.api.Recording` (the loaded trace and its replay, which keep
every event's columns by design: ``tests/unit/test_scale_memory.py`` has the reader's part). What
an export builds *from* it must not follow the events: ``memory-viz`` turned every event's fields
into Python lists at once (tens of GB at 100M events), the dataset built its events table whole
(132-byte rows, then Arrow's copy). Here the Recording is built first, and only the export's own
allocations are traced (``tracemalloc``: numpy reports its buffers) on a trace of N and of 4N
events; the same export with one slice of every event is the control that must grow.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from memrec.api import Recording
from memrec.export import dataset
from memrec.export import memory_viz
from memrec.trace.reader import load_trace
from tests.unit.test_scale_memory import CHUNK
from tests.unit.test_scale_memory import peak
from tests.unit.test_scale_memory import write

ROOT = Path(__file__).resolve().parents[2]
SGLANG_IPC = ROOT / "examples" / "sglang-standin-ipc.mrec"  # two TP ranks, IPC, markers, NVML
#: Slices of the tests' own size, and one slice of every event (the control: main's export before).
SLICE, WHOLE = CHUNK // 2, 1 << 40


def recording(path: Path) -> Recording:
    """A Recording with everything the exports share already built (not the export's memory)."""
    rec = Recording(load_trace(path), pandas=False)
    rec.timeline, rec.phases, rec.ipc_opens, rec.ranks  # noqa: B018 - cached properties, built now
    return rec


def viz(rec: Recording) -> None:
    memory_viz.snapshots(rec, max_entries=64)  # the actions kept are bounded by --max-entries


def events_table(builder: dataset._Builder, tmp: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    with open(tmp / "events.parquet", "wb") as f:
        dataset._write_parquet(pq, dataset._arrow_parts(dataset.require("pyarrow", "sql", "t"), builder, "events"), f)


def grows(monkeypatch, slice_rows: int, small: Recording, large: Recording, fn) -> int:
    """How many more bytes ``fn`` had allocated at once on ``large`` than on ``small``."""
    monkeypatch.setattr(memory_viz, "SLICE_ROWS", slice_rows)
    monkeypatch.setattr(dataset, "EVENT_ROWS", slice_rows)
    return peak(lambda: fn(large)) - peak(lambda: fn(small))


def test_the_exports_own_memory_does_not_grow_with_the_events(tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    # GIVEN the same shape at N and 4N events, each loaded and replayed (what every export shares)
    n = 2 * CHUNK
    paths = write(tmp_path / "n.mrec", n), write(tmp_path / "4n.mrec", 4 * n)
    small, large = recording(paths[0]), recording(paths[1])
    builders = {r: dataset._Builder(r.trace, "t") for r in (small, large)}
    for b, r in zip(builders.values(), (small, large)):
        b.rec = r  # its own Recording's replay, already built

    def table(rec: Recording) -> None:
        events_table(builders[rec], tmp_path)

    viz(small), table(small)  # their modules imported (pyarrow's and pandas' own memory), not measured
    # WHEN memory-viz and the dataset's events table are built, in slices and (the control) whole
    sliced = grows(monkeypatch, SLICE, small, large, viz), grows(monkeypatch, SLICE, small, large, table)
    whole = grows(monkeypatch, WHOLE, small, large, viz), grows(monkeypatch, WHOLE, small, large, table)
    # THEN whole, the export holds the 3N more events (the measurement sees them: 50 - 300 bytes
    # an event here) ...
    assert min(whole) > 3 * n * 16, whole
    # ... and a slice at a time it grows by less than 2 bytes per added event (a column of the
    # events kept, the smallest proportional regression, is 4 - 8)
    assert max(sliced) < 3 * n * 2, sliced


def test_memory_viz_in_slices_is_the_whole(tmp_path, monkeypatch):
    # GIVEN a trace with IPC, phases and driver frees, and one with tensor blocks
    from tests.utils import MiB
    from tests.utils import write_tensor_trace

    tensors = write_tensor_trace(tmp_path / "t.mrec", [(0, 4 * MiB), (4 * MiB, MiB), (0, -1), (8 * MiB, 2 * MiB)])
    for path in (SGLANG_IPC, tensors):
        rec = recording(path)
        whole = pickle.dumps(memory_viz.snapshots(rec))
        # WHEN the events are looked at 2 at a time
        monkeypatch.setattr(memory_viz, "SLICE_ROWS", 2)
        sliced = pickle.dumps(memory_viz.snapshots(rec))
        monkeypatch.undo()
        # THEN the snapshots are the same, byte for byte
        assert len(rec.timeline.events) > 4 and sliced == whole


def test_dataset_events_in_row_groups_read_back_as_the_whole(tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    trace = load_trace(SGLANG_IPC)
    dataset.write_trace(trace, tmp_path / "whole")
    # GIVEN the events table built 7 rows at a time
    monkeypatch.setattr(dataset, "EVENT_ROWS", 7)
    # WHEN the trace is exported again
    _, files = dataset.write_trace(trace, tmp_path / "sliced")
    # THEN every table reads back the same, the events in row groups of 7
    n = len(trace.event_columns["ts"])
    for path in files:
        twin = tmp_path / "whole" / path.relative_to(tmp_path / "sliced")
        assert pq.read_table(path).equals(pq.read_table(twin)), path
    events = next(p for p in files if p.parts[-4] == "events")
    assert n > 14 and pq.ParquetFile(events).num_row_groups == -(-n // 7)
    assert np.array_equal(pq.read_table(events).column("ts").to_numpy(), trace.event_columns["ts"].astype(np.int64))
