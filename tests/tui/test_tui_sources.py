"""FileSource: the zero-copy scan gives what the reader gives, and damage becomes warnings."""

from __future__ import annotations

from pathlib import Path

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


def test_format_1_events_are_views_of_the_file():
    # GIVEN a format-1 trace (raw columns in the file)
    src = FileSource(Path(__file__).resolve().parents[1] / "data" / "golden_v1.mrec")
    src.scan()
    chunk = src.model.store._chunks[0]
    # THEN the ts column is a numpy view onto the mapping, not a copy
    assert not chunk.columns["ts"].flags.owndata and isinstance(chunk.columns["ts"].base, memoryview)


def test_a_live_stream_and_the_file_get_the_same_records_and_skip_the_same_damage(trace_file):
    from memrec.trace.frames import FrameDecoder
    from memrec.trace.frames import MAX_SUBSCRIBER_FRAME
    from memrec.trace.frames import encode_frame
    from memrec.trace.reader import TraceReader
    from memrec.tui.model import TraceModel

    # GIVEN the file's records, as a daemon streams them, with one events chunk cut short and one
    # marker whose ts is out of range (the same damage in a copy of the file)
    with TraceReader(trace_file) as reader:
        records = [reader.header, *reader.raw_records()]
    chunk = next(i for i, r in enumerate(records) if r.get("type") in ("e", "events"))
    marker = next(i for i, r in enumerate(records) if r.get("type") == "marker")
    key = next(key for key in ("c", "r", "z") if key in records[chunk])
    records[chunk] = {**records[chunk], key: records[chunk][key][:-4]}
    records[marker] = {**records[marker], "ts": -1}
    from memrec.trace.format import packb

    damaged = trace_file.with_name("damaged.mrec")
    damaged.write_bytes(b"".join(packb(r) for r in records))
    # WHEN the live path (frames split, records in wire form) feeds a model, and the file is scanned
    live = TraceModel()
    for rec in FrameDecoder(MAX_SUBSCRIBER_FRAME, decode=False).feed(b"".join(encode_frame(packb(r)) for r in records)):
        live.add_record(rec)
    src = FileSource(damaged)
    src.scan()
    # THEN neither raises; both keep every other record and say they skipped two
    assert live.store.n == src.model.store.n > 0
    assert [m.ts for m in live.markers] == [m.ts for m in src.model.markers]
    assert len(live.keyframes) == len(src.model.keyframes)
    assert [w for w in live.warnings if "malformed" in w][0].startswith("skipped 2 malformed record(s) from the stream")
    assert any("skipped 2 malformed record(s)" in w for w in src.model.warnings)


def test_a_few_events_of_a_chunk_are_the_rows_of_the_whole_chunk(tmp_path):
    # GIVEN a file of 150,000 events in chunks as the writer cuts them, with every field varied,
    # ipc bytes every 7th event and no NVML
    from memrec.trace.writer import TraceWriter
    from tests.unit.test_trace_format import HEADER
    from tests.unit.test_trace_format import synthetic_events

    events = synthetic_events(150_000)
    path = tmp_path / "t.mrec"
    with TraceWriter(path, HEADER) as w:
        w.write_events(events)
    src = FileSource(path)
    src.scan()
    store = src.model.store
    starts = [start for _, start, _, _ in store.pieces(0, len(events))]
    assert len(starts) >= 2, starts
    edge = starts[1]
    # WHEN a few events are read (what the events table around the cursor asks for), inside
    # one chunk, up to a chunk's end, and across two
    for lo, hi in ((0, 5), (6, 4_100), (edge - 10, edge + 10), (edge - 4096, edge), (edge - 3, edge + 4_000),
                   (149_000, 150_000)):
        rows = store.slice(lo, hi)
        # THEN they are the rows the events were written as, ipc bytes included
        assert rows.dtype == events.dtype
        np.testing.assert_array_equal(rows, events[lo:hi])
    # AND a large slice (converted whole and kept for the next one) is the same
    np.testing.assert_array_equal(store.slice(100, 15_000), events[100:15_000])


def test_the_first_frame_waits_for_the_files_start_only(trace_file, trace):
    # GIVEN a trace of several event chunks, with a trailer (its end) in its last bytes
    import threading

    # WHEN it is scanned with a ``ready`` callback (the app's first frame), the scan held back
    # afterwards as while the first frame is painted (busy)
    src = FileSource(trace_file)
    released = threading.Event()
    src.busy = lambda: not released.is_set()
    seen = {}

    def ready():
        model = src.model
        seen.update(events=model.store.n, end=model.time_range()[1], chunks=len(model.store.pieces(0, model.store.n)))

    scan = threading.Thread(target=src.scan, kwargs={"ready": ready})
    scan.start()
    scan.join(0.5)
    # THEN the first frame came after the first events chunk, not the file: the time range
    # already reaches the trailer's end, and the scan waits while the app is busy
    assert seen["chunks"] == 1 and 0 < seen["events"] < len(trace.events)
    assert seen["end"] == trace.trailer["end_ts"]
    assert scan.is_alive() and src.model.store.n == seen["events"]
    released.set()
    scan.join(10)
    # AND the rest of the scan then reads every record, as a scan without a first frame does
    whole = FileSource(trace_file)
    whole.scan()
    assert src.model.store.n == whole.model.store.n == len(trace.events)
    assert src.model.time_range() == whole.model.time_range()
    assert len(src.model.markers) == len(whole.model.markers) and len(src.model.keyframes) == len(whole.model.keyframes)


def test_a_trace_without_trailer_has_a_first_frame_and_then_its_end(trace_file, tmp_path, trace):
    # GIVEN a trace cut before its trailer (a crash; a file still being written)
    data = trace_file.read_bytes()
    cut = tmp_path / "cut.mrec"
    cut.write_bytes(data[: int(len(data) * 0.9)])
    # WHEN it is scanned for the app
    src = FileSource(cut)
    ends = []
    src.scan(ready=lambda: ends.append(src.model.time_range()[1]))
    # THEN the first frame came (from the records read by then) and the whole scan knows more
    assert len(ends) == 1 and ends[0] < src.model.time_range()[1] <= trace.trailer["end_ts"]
    assert any("trailer" in w for w in src.model.warnings)
