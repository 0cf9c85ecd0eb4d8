"""The mmap ring-buffer decoder, on synthetic buffers laid out like the kernel's mappings."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from memrec.terms.columns import RAW_DTYPE
from memrec.probes.ringbuf import BPF_RINGBUF_BUSY_BIT
from memrec.probes.ringbuf import BPF_RINGBUF_DISCARD_BIT
from memrec.probes.ringbuf import RingBufferReader
from memrec.probes.ringbuf import record_stride

PAGE = 4096


class FakeRing:
    """A producer writing records the way the kernel does: header, payload, data area twice."""

    def __init__(self, data_size: int = 2 * PAGE, record_size: int = RAW_DTYPE.itemsize) -> None:
        self.data_size = data_size
        self.consumer = bytearray(PAGE)
        self.producer = bytearray(PAGE + 2 * data_size)
        self.pos = 0
        self.record_size = record_size

    def _write(self, off: int, data: bytes) -> None:
        # The kernel maps the data pages twice: a write lands in both copies.
        for i, b in enumerate(data):
            o = (off + i) % self.data_size
            self.producer[PAGE + o] = b
            self.producer[PAGE + self.data_size + o] = b

    def push(self, payload: bytes, busy: bool = False, discard: bool = False) -> int:
        """Append one record; return its position."""
        hdr = len(payload) | (BPF_RINGBUF_BUSY_BIT if busy else 0) | (BPF_RINGBUF_DISCARD_BIT if discard else 0)
        at = self.pos
        self._write(at % self.data_size, struct.pack("<II", hdr, 0) + payload)
        self.pos += record_stride(len(payload))
        struct.pack_into("<Q", self.producer, 0, self.pos)
        return at

    def commit(self, at: int, length: int) -> None:
        self._write(at % self.data_size, struct.pack("<I", length))

    @property
    def consumer_pos(self) -> int:
        return struct.unpack_from("<Q", self.consumer, 0)[0]

    def reader(self) -> RingBufferReader:
        return RingBufferReader.over_buffers(self.consumer, self.producer, self.data_size, self.record_size, RAW_DTYPE, PAGE)


def event(i: int) -> bytes:
    rec = np.zeros(1, RAW_DTYPE)
    rec["ts"] = 1000 + i
    rec["pid"] = 42
    rec["ptr"] = 0x7F0000000000 + i
    rec["ipc"] = bytes([i % 251 + 1]) * 64
    return rec.tobytes()


def test_drains_committed_records_in_order_and_advances_the_consumer():
    ring = FakeRing()
    for i in range(5):
        ring.push(event(i))
    out = ring.reader().drain()
    assert out.dtype == RAW_DTYPE
    assert out["ts"].tolist() == [1000, 1001, 1002, 1003, 1004]
    assert bytes(out[3]["ipc"]) == bytes([4]) * 64
    assert ring.consumer_pos == ring.pos


def test_stops_at_the_first_busy_record_and_resumes_after_commit():
    ring = FakeRing()
    reader = ring.reader()
    ring.push(event(0))
    busy_at = ring.push(event(1), busy=True)
    ring.push(event(2))
    assert reader.drain()["ts"].tolist() == [1000]
    assert ring.consumer_pos == busy_at
    ring.commit(busy_at, RAW_DTYPE.itemsize)
    assert reader.drain()["ts"].tolist() == [1001, 1002]


def test_discarded_records_are_skipped():
    ring = FakeRing()
    ring.push(event(0))
    ring.push(event(1), discard=True)
    ring.push(event(2))
    out = ring.reader().drain()
    assert out["ts"].tolist() == [1000, 1002]
    assert ring.consumer_pos == ring.pos


def test_records_across_the_end_of_the_data_area_read_contiguously():
    ring = FakeRing()
    reader = ring.reader()
    stride = record_stride(RAW_DTYPE.itemsize)
    per_ring = ring.data_size // stride
    got: list[int] = []
    for i in range(3 * per_ring):  # wrap around three times, draining as we go
        ring.push(event(i))
        if i % 7 == 6:
            got += reader.drain()["ts"].tolist()
    got += reader.drain()["ts"].tolist()
    assert got == [1000 + i for i in range(3 * per_ring)]


def test_a_record_of_another_size_is_skipped_and_counted():
    ring = FakeRing()
    reader = ring.reader()
    ring.push(event(0))
    ring.push(b"x" * 20)  # not an event: stride 32, not 136
    ring.push(event(1))
    out = reader.drain()
    assert out["ts"].tolist() == [1000, 1001]
    assert reader.skipped == 1
    assert ring.consumer_pos == ring.pos


def test_max_records_leaves_the_rest_for_later():
    ring = FakeRing()
    reader = ring.reader()
    for i in range(10):
        ring.push(event(i))
    assert len(reader.drain(max_records=4)) == 4
    assert reader.drain()["ts"].tolist() == [1000 + i for i in range(4, 10)]


def test_empty_ring_gives_an_empty_array_and_close_is_idempotent():
    ring = FakeRing()
    reader = ring.reader()
    out = reader.drain()
    assert len(out) == 0 and out.dtype == RAW_DTYPE
    reader.close()
    reader.close()
    with pytest.raises(ValueError):
        reader.drain()


def test_sizes_are_validated():
    with pytest.raises(ValueError):
        RingBufferReader.over_buffers(bytearray(PAGE), bytearray(PAGE * 7), 3 * PAGE, 128, None, PAGE)
    with pytest.raises(ValueError):
        RingBufferReader.over_buffers(bytearray(PAGE), bytearray(PAGE * 3), PAGE, 8192, None, PAGE)
