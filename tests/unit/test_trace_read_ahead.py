"""The fast paths of a scan (what the TUI's first frame waits for): reading a trace with its chunks
decoded in threads ahead of the scan (``TraceReader.items(threads=)``) gives what a plain scan
gives, the same items in the same order and the same warnings, damage included; the GPU list
gathered from the event columns skips columns that can hold no new index, and misses none."""

from __future__ import annotations

import threading

import msgpack
import numpy as np
import pytest

from memrec.trace import format as fmt
from memrec.trace.reader import TraceReader
from tests.unit.test_trace_format import HEADER
from tests.unit.test_trace_format import _damage
from tests.unit.test_trace_format import nvml_samples
from tests.unit.test_trace_format import synthetic_events


def _trace(tmp_path, cut: bool):
    """A trace of 40 events chunks and NVML samples with a damaged chunk, a non-map object and a
    record whose type is not a string among them; ``cut``: its last record cut short."""
    parts = [fmt.encode_record(fmt.finalize_header(HEADER))]
    for i in range(40):
        parts.append(fmt.encode_record({"type": "events", "events": synthetic_events(50 + i, start=1_000_000 + 10_000 * i)}))
        if i == 7:
            bad = msgpack.unpackb(fmt.encode_record({"type": "events", "events": synthetic_events(9)}))
            _damage(bad, lambda z: z[:-1])
            parts += [fmt.packb(bad), fmt.packb([1, 2, 3]), fmt.packb({"type": [1], "n": 3})]
        if i == 20:
            parts.append(fmt.encode_record({"type": "nvml", "samples": nvml_samples(30)}))
    parts.append(fmt.encode_record({"type": "trailer"}))
    data = b"".join(parts)
    path = tmp_path / "t.mrec"
    path.write_bytes(data[:-3] if cut else data)
    return path


def _read(path, mapped: bool, threads: int) -> tuple[list, list[str]]:
    with TraceReader(path) as reader:
        items = list(reader.items(mapped=mapped, threads=threads))
        return items, list(reader.warnings)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "streamed"])
@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut"])
def test_decoding_ahead_in_threads_reads_what_a_plain_scan_reads(tmp_path, mapped, cut):
    # GIVEN a trace with good and damaged records (and, once, a truncated tail)
    path = _trace(tmp_path, cut)
    # WHEN read plainly and with two decoding threads
    plain, plain_warnings = _read(path, mapped, 0)
    ahead, ahead_warnings = _read(path, mapped, 2)
    # THEN the items come in the same order with the same columns, and the warnings are the same
    assert [kind for kind, _ in ahead] == [kind for kind, _ in plain]
    assert sum(kind == "events" for kind, _ in plain) == 40
    for (kind, a), (_, b) in zip(ahead, plain):
        if kind in ("events", "nvml"):
            np.testing.assert_array_equal(a.to_array(), b.to_array())
    assert ahead_warnings == plain_warnings
    assert any("skipped 3 malformed record(s)" in w for w in plain_warnings)
    assert any("truncated tail" in w for w in plain_warnings) == cut


def test_a_scan_left_early_stops_its_decoding_threads(tmp_path):
    # GIVEN a trace read with two decoding threads
    path = _trace(tmp_path, cut=False)
    before = threading.active_count()
    with TraceReader(path) as reader:
        items = reader.items(mapped=True, threads=2)
        # WHEN the reader takes three items and leaves
        first = [next(items) for _ in range(3)]
        items.close()
    # THEN it got them, and no decoding thread is left running
    assert [kind for kind, _ in first] == ["events"] * 3
    assert not [t for t in threading.enumerate() if t.name.startswith("memrec-decode")]
    assert threading.active_count() == before


def test_gpu_ids_from_columns_find_every_new_index():
    # GIVEN the GPUs named so far: 0 to 3 (a column of them read before)
    from memrec.trace.model import GpuIds

    ids = GpuIds()
    ids.add_column(np.array([3, 0, 1, 2, -1], np.int16))
    # WHEN columns come whose indices are known, hidden inside a known range, outside it, far
    # off, or none at all (the host, -1)
    ids.add_column(np.array([2, 1, -1, 0], np.int16))
    ids.add_column(np.array([-1, -1], np.int16))
    ids.add_column(np.zeros(0, np.int16))
    ids.add_column(np.array([0, 3, 5, 1], np.int16))
    ids.add_column(np.array([0, 4, 200, 1], np.int16))
    # THEN each new index is there, and only those
    assert ids.sorted() == [0, 1, 2, 3, 4, 5, 200]


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "streamed"])
def test_a_file_replaced_after_the_open_is_not_read_in_its_place(tmp_path, mapped):
    # GIVEN a reader open on a trace (its header read), then another trace moved over its path
    path = _trace(tmp_path, cut=False)
    whole, _ = _read(path, mapped, 0)
    other = tmp_path / "other.mrec"
    other.write_bytes(fmt.encode_record(fmt.finalize_header(HEADER))
                      + fmt.encode_record({"type": "events", "events": synthetic_events(3)}))
    with TraceReader(path) as reader:
        other.replace(path)
        # WHEN the open reader reads the records
        items = list(reader.items(mapped=mapped))
    # THEN they are the records of the file it opened, whose header it gave, not the new file's
    assert [kind for kind, _ in items] == [kind for kind, _ in whole]
    assert sum(len(item.to_array()) for kind, item in items if kind == "events") == sum(
        len(item.to_array()) for kind, item in whole if kind == "events")
