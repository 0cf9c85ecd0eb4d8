"""Marker records read fast and the same (issue 26: a step loop's 50,000 markers).

A marker record of exactly the writer's shape, its values flat, is read without the depth walk
(:func:`memrec.trace.format.shallow_marker`); the memory-mapped walk unpacks a run of small records
with one unpacker. Here: every other shape still takes the general path (the same verdicts and
warnings as before), and the streamed, the mapped and the threaded reads give the same items and
warnings, a file cut anywhere in a run of markers included.
"""

from __future__ import annotations

import msgpack
import pytest

from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace import format as fmt
from memrec.trace.reader import TraceReader
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter
from tests.unit.test_trace_format import HEADER
from tests.unit.test_trace_format import synthetic_events

#: Nested far past MAX_DEPTH: a record holding it is skipped as "nested deeper than 32 levels".
DEEP: list = []
for _ in range(40):
    DEEP = [DEEP]


def _markers(n: int, t0: int = 2_000_000) -> list[Marker]:
    """Begin/end pairs with flat values, nested values (not the shallow shape), no GPU, instants."""
    out = []
    for k in range(n):
        values = {"step": k} if k % 7 == 0 else {"cfg": {"tp": [1, 2]}} if k % 11 == 0 else {}
        out.append(Marker(t0 + 10 * k, 100 + k % 3, 0, 100 + k % 3, f"step{k % 5}",
                          ("begin", "end", "instant")[k % 3], None if k % 4 == 0 else k % 2, values))
    return out


def _odd_records() -> list[dict]:
    """Marker records not of the writer's shape: an unknown field (deep: skipped; flat: ignored), a
    missing GPU, keys in another order, a field of the wrong type, a map key that is not a string."""
    base = fmt.marker_record(Marker(2_500_000, 7, 0, 7, "odd", "instant", 1, {}))
    return [
        {**base, "extra": DEEP},
        {**base, "extra": 1},
        {k: v for k, v in base.items() if k != "gpu"},
        dict(reversed(list(base.items()))),
        {**base, "pid": "seven"},
        {**base, "values": {1: 2}},
    ]


def _write(path, markers: list[Marker], big_process: bool = True) -> None:
    """Events chunks with runs of marker records between them, the odd records, and a process
    record past 64 KiB (the mapped walk's unpacker reads further for it) inside a run."""
    with TraceWriter(path, HEADER) as w:
        for i in range(0, len(markers), 400):
            w.write_events(synthetic_events(50, start=1_000_000 + 100 * i))
            w.flush()
            for m in markers[i : i + 400]:
                w.write_marker(m)
            if i == 800 and big_process:
                w.write_process(ProcessInfo(100, None, ["x" * 30] * 4_000, None, None, [], 1_000))
        w.flush()
        w.write_events(synthetic_events(10, start=9_000_000))
    data = path.read_bytes()
    trailer_at = data.rindex(b"\xa4type\xa7trailer") - 1
    odd = b"".join(msgpack.packb(r) for r in _odd_records())
    path.write_bytes(data[:trailer_at] + odd + data[trailer_at:])


def _read(path, mapped: bool, threads: int = 0) -> tuple[list, list[str]]:
    with TraceReader(path) as reader:
        items = [(k, v) for k, v in reader.items(mapped=mapped, threads=threads) if k in ("marker", "process")]
        return items, list(reader.warnings)


def test_every_read_gives_the_markers_written_and_the_odd_ones_their_verdicts(tmp_path):
    # GIVEN 1,600 markers of the writer's in runs between events chunks, and the odd records
    markers = _markers(1_600)
    path = tmp_path / "m.mrec"
    _write(path, markers)
    # WHEN it is streamed, mapped, and mapped with decoding threads
    reads = [_read(path, False), _read(path, True), _read(path, True, 2)]
    # THEN each gives the same items and warnings
    assert reads[1] == reads[0] and reads[2] == reads[0]
    items, warnings = reads[0]
    got = [v for k, v in items if k == "marker"]
    # the writer's markers as written, nested values included
    assert got[: len(markers)] == markers
    # the odd ones: the deep one and the one with a pid that is no integer skipped; the others read
    # as the general path reads them (an unknown flat field ignored, no GPU: None; a non-string
    # map key in values: refused)
    odd = Marker(2_500_000, 7, 0, 7, "odd", "instant", 1, {})
    assert got[len(markers) :] == [odd, Marker(2_500_000, 7, 0, 7, "odd", "instant", None, {}), odd]
    assert any("skipped 3 malformed record(s); first at byte" in w and "nested deeper than" in w for w in warnings)
    assert [len(v.cmdline) for k, v in items if k == "process"] == [4_000]


def test_a_writer_shaped_record_reads_as_the_general_path_reads_it():
    # GIVEN the writer's records of markers with and without values, nested ones among them
    for m in _markers(40):
        rec = msgpack.unpackb(fmt.encode_record(fmt.marker_record(m)))
        shallow = fmt.shallow_marker(rec)
        # THEN the fast path gives the marker when its values are flat, and nothing (the general
        # path then) when they nest; marker_from_record gives the same marker either way
        assert shallow == (m if not any(isinstance(v, dict) for v in m.values.values()) else None)
        assert fmt.marker_from_record(rec) == m
    # and of the odd ones only the one with its keys in another order is of the writer's shape
    odd = Marker(2_500_000, 7, 0, 7, "odd", "instant", 1, {})
    assert [fmt.shallow_marker(rec) for rec in _odd_records()] == [None, None, None, odd, None, None]


@pytest.mark.parametrize("cut", [0.35, 0.5, 0.62, 0.8, 0.97])
def test_a_file_cut_in_a_run_of_markers_reads_the_same_mapped_and_streamed(tmp_path, cut):
    # GIVEN the trace cut inside its runs of marker records (a crash, or a file still written)
    path = tmp_path / "m.mrec"
    _write(path, _markers(1_600))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    # WHEN it is read mapped and streamed
    streamed, mapped = _read(path, False), _read(path, True)
    # THEN the same records up to the cut, and the same warning of the truncated tail
    assert mapped == streamed
    assert any("truncated tail" in w for w in streamed[1])


def test_reading_the_writers_markers_walks_none_of_them_for_depth(tmp_path, monkeypatch):
    # GIVEN 1,600 marker records of the writer's shape, their values flat
    from memrec.trace import reader as reader_mod

    markers = [m for m in _markers(1_600) if not any(isinstance(v, dict) for v in m.values.values())]
    path = tmp_path / "m.mrec"
    with TraceWriter(path, HEADER) as w:
        w.write_events(synthetic_events(50))
        for m in markers:
            w.write_marker(m)
    walks = []
    real = reader_mod.too_deep
    monkeypatch.setattr(reader_mod, "too_deep", lambda obj, *a: walks.append(obj.get("type")) or real(obj, *a))
    # WHEN the trace is loaded
    trace = load_trace(path)
    # THEN every marker is read, and no marker record was walked for its depth
    assert trace.markers == markers
    assert "marker" not in walks
