"""Every ``memrec export`` reads the events from the file a record at a time, and its memory does
not follow the events (issue 26: 100M events in bounded memory).

The command scans the trace (everything but the events), then reads the events again in replay
passes (:meth:`memrec.api.Recording.replayed`, the report's pass), each record used and let
go. Its allocations are traced (``tracemalloc``: numpy reports its buffers) on a trace of the
tensor shape (``test_report_memory``'s) of N and of 4N events; the same export of the loaded
trace (what the command did before: ``load_trace``, the control) must grow.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from memrec import commands
from memrec.api import Recording
from memrec.base.errors import ExitCode
from memrec.commands import common
from memrec.engine import replay
from memrec.engine import source
from memrec.export import columnar
from memrec.export import dataset
from memrec.export import memory_viz
from memrec.trace.reader import load_trace
from tests.unit.test_report_memory import write_tensors
from tests.unit.test_scale_memory import CHUNK
from tests.unit.test_scale_memory import peak

ROOT = Path(__file__).resolve().parents[2]
SGLANG_IPC = ROOT / "examples" / "sglang-standin-ipc.mrec"  # two TP ranks, IPC, markers, NVML
FORMATS = ("parquet", "csv", "dataset", "memory-viz", "perfetto")
NEEDS = {"parquet": "pyarrow", "dataset": "pyarrow", "perfetto": "perfetto"}


def recording(path: Path) -> Recording:
    """A Recording of the loaded trace with everything the exports share already built."""
    rec = Recording(load_trace(path), pandas=False)
    rec.timeline, rec.phases, rec.ipc_opens, rec.ranks  # noqa: B018 - cached properties, built now
    return rec


def export(path: Path, to: str, out: Path) -> None:
    out.mkdir(exist_ok=True)
    target = out / {"perfetto": "x.pftrace", "memory-viz": "x.pickle"}.get(to, to)
    assert commands.main(["export", str(path), "--to", to, "-o", str(target), "-f"]) == 0


def loading(monkeypatch) -> None:
    """The control: the command given the loaded trace (every event's columns), as before."""
    monkeypatch.setattr(common, "scan_trace_for_command", lambda path, warn=True: (load_trace(path), None))


@pytest.mark.parametrize("to", FORMATS)
def test_each_export_keeps_its_memory_when_the_events_grow(tmp_path, monkeypatch, capsys, to):
    if to in NEEDS:
        pytest.importorskip(NEEDS[to])
    # GIVEN the same shape at N and 4N events, and the replay's chunk and the tables' slices of
    # the file's records' size (so that both sizes are past them)
    monkeypatch.setattr(replay, "APPLY_CHUNK", CHUNK)
    monkeypatch.setattr(columnar, "SLICE_ROWS", CHUNK)
    monkeypatch.setattr(dataset, "EVENT_ROWS", CHUNK)
    n = 2 * CHUNK
    small, large = write_tensors(tmp_path / "n.mrec", n), write_tensors(tmp_path / "4n.mrec", 4 * n)
    export(small, to, tmp_path / "warm")  # modules imported, caches filled: not measured
    # WHEN the command exports each from the file
    from_file = peak(lambda: export(large, to, tmp_path / "large")) - peak(lambda: export(small, to, tmp_path / "small"))
    # THEN it grows by less than 2 bytes per added event (a column of the events kept, the
    # smallest proportional regression, is 4 - 8)
    assert from_file < 3 * n * 2, from_file
    if to == "parquet":  # AND loaded (the control), it holds the 3N more events: the measurement sees them
        loading(monkeypatch)
        whole = peak(lambda: export(large, to, tmp_path / "large")) - peak(lambda: export(small, to, tmp_path / "small"))
        assert whole > 3 * n * 16, whole


def files(folder: Path) -> dict[str, bytes]:
    return {os.fspath(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("to", FORMATS)
def test_each_export_from_the_file_is_that_of_the_loaded_trace(tmp_path, monkeypatch, capsys, to):
    if to in NEEDS:
        pytest.importorskip(NEEDS[to])
    # GIVEN traces of several records: tensor blocks in driver segments with markers; IPC, phases, NVML
    tensors = write_tensors(tmp_path / "t.mrec", 3 * CHUNK + 123)
    for path in (tensors, SGLANG_IPC):
        # WHEN each is exported from the file, and from the loaded trace
        export(path, to, tmp_path / "file")
        with monkeypatch.context() as m:
            loading(m)
            export(path, to, tmp_path / "loaded")
        # THEN the files are the same, byte for byte
        assert files(tmp_path / "file") == files(tmp_path / "loaded")


@pytest.mark.parametrize("to", ["parquet", "memory-viz", "perfetto"])
@pytest.mark.parametrize("change", ["cut", "another trace"])
def test_a_trace_changed_after_its_first_pass_is_a_one_line_error(tmp_path, monkeypatch, capsys, to, change):
    if to in NEEDS:
        pytest.importorskip(NEEDS[to])
    # GIVEN a trace cut in place, or moved over by another trace, after the first pass (the scan)
    path = write_tensors(tmp_path / "t.mrec", CHUNK + 5)
    other = write_tensors(tmp_path / "other.mrec", CHUNK + 900)
    real = source.scan_trace

    def scan_then_change(p, **kw):
        out = real(p, **kw)
        if change == "cut":
            os.truncate(p, os.path.getsize(p) * 2 // 3)
        else:
            os.rename(other, p)
        return out

    monkeypatch.setattr(source, "scan_trace", scan_then_change)
    # WHEN it is exported
    target = tmp_path / "out"
    rc = commands.main(["export", str(path), "--to", to, "-o", str(target)])
    err = capsys.readouterr().err
    # THEN it says so in one line with the exit code of a trace that cannot be read
    assert rc == ExitCode.DATA, err
    assert err.count("\n") == 1 and "changed while it was read" in err and "Traceback" not in err


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
