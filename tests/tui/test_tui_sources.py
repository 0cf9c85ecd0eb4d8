"""FileSource: the zero-copy scan gives what the reader gives, and damage becomes warnings."""

from __future__ import annotations

import numpy as np
import pytest

from memrec.trace import mapped
from memrec.tui.sources import FileSource


def scanned(path, monkeypatch=None, fallback=False):
    if fallback:
        def refuse(*a, **k):
            raise mapped.Unsupported("test")
            yield  # pragma: no cover

        monkeypatch.setattr(mapped, "objects", refuse)
    src = FileSource(path)
    src.scan()
    src.index()
    return src.model


def test_mapped_scan_equals_the_reader(trace_file, monkeypatch, trace):
    # GIVEN the same file scanned by mmap and by the reader
    a = scanned(trace_file)
    b = scanned(trace_file, monkeypatch, fallback=True)
    # THEN both hold the same events, markers, keyframes, NVML samples and series
    assert a.store.n == b.store.n == len(trace.events)
    assert np.array_equal(a.store.slice(0, a.store.n), b.store.slice(0, b.store.n))
    assert [m.ts for m in a.markers] == [m.ts for m in b.markers]
    assert len(a.keyframes) == len(b.keyframes) == len(trace.keyframes)
    assert a.time_range() == b.time_range()
    for g in (0, 1):
        assert np.array_equal(a.series[g].total.a, b.series[g].total.a)
    assert a.warnings == [] and b.warnings == []


@pytest.mark.parametrize("cut", [0.3, 0.7, 0.99])
def test_truncated_file_is_read_up_to_the_cut(trace_file, tmp_path, cut):
    # GIVEN a trace cut inside a record (a crash, or a file still being written)
    data = trace_file.read_bytes()
    cut_file = tmp_path / "cut.mrec"
    cut_file.write_bytes(data[: int(len(data) * cut)])
    # WHEN it is scanned
    model = scanned(cut_file)
    # THEN the records before the cut are there, and a warning says what happened
    assert any("truncated" in w for w in model.warnings)
    assert any("trailer" in w for w in model.warnings)
    if model.store.n:
        st = model.state_at(model.store.n - 1, 0)
        assert st.owned >= 0


def test_events_are_views_of_the_file(trace_file):
    src = FileSource(trace_file)
    src.scan()
    chunk = src.model.store._chunks[0]
    # the ts column is a numpy view onto the mapping, not a copy
    assert not chunk.columns["ts"].flags.owndata

