"""The report reads its replay a chunk at a time: the answer must not depend on where chunks end.

``memrec report`` attributes the journal and builds the per-GPU series as each chunk of events is
applied, without keeping the whole journal (docs/performance.md, "Report and the replay engine").
Here the real CLI runs on the recorded example traces (real allocations, frees, process exits,
failed calls, IPC, VMM, SGLang and plain markers, a keyframe) with chunks of a few events and with
the default size: the JSON must be the same, byte for byte. The loader keeps a column that holds
one value in every event as that value; a trace where columns change between and within
chunks must load to exactly the events written.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest

import memrec.engine.replay as replay
from memrec import commands
from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.columns import empty_events
from memrec.terms.events import Kind
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.mrec"))


def report_json(path: Path) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert commands.main(["report", "--json", str(path)]) == 0
    return out.getvalue()


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
@pytest.mark.parametrize("chunk", [1, 7])
def test_report_is_the_same_whatever_the_replay_chunk(path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = report_json(path)
    monkeypatch.setattr(replay, "APPLY_CHUNK", chunk)
    assert report_json(path) == whole


def test_examples_are_there() -> None:
    assert len(EXAMPLES) >= 5  # the parametrized test above must not pass on nothing


def test_a_column_that_changes_late_loads_as_written(tmp_path: Path) -> None:
    n = 5_000
    rows = empty_events(n)
    rows["ts"] = np.arange(n) * 1000 + 1
    rows["pid"] = 77
    rows["kind"] = int(Kind.ALLOC)
    rows["size"] = 1 << 20
    rows["ptr"] = np.arange(n) * (1 << 20) + (1 << 40)
    rows["ordinal"] = 3  # one value throughout, not zero
    rows["handle"][4_321] = 9  # one event inside a later chunk differs
    rows["aux"] = 2
    rows["aux"][1_000:] = 5  # differs from a chunk boundary on
    path = tmp_path / "t.mrec"
    with TraceWriter(path, {"anchor": {"monotonic_ns": 0, "wall_ns": 0}}, max_chunk_rows=1_000) as w:
        w.write_events(rows)
    trace = load_trace(path)
    cols = trace.event_columns
    for name in EVENT_DTYPE.names:
        if name != "ipc":
            assert np.array_equal(cols[name], rows[name]), name
    assert cols["ordinal"].strides == (0,) and not cols["ordinal"].flags.writeable  # one value: no memory
    assert cols["handle"].strides != (0,) and cols["aux"].strides != (0,)
    assert cols["gpu"].flags.writeable  # the replay fills it in
    assert np.array_equal(trace.events, rows)  # the rows built from them
