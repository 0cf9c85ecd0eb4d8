"""Reading a trace with its chunks decoded in threads ahead of the scan (``TraceReader.items(threads=)``,
what the TUI's file scan uses) gives what a plain scan gives: the same items in the same order,
the same warnings, damage included."""

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
