"""Trace format v1: record encoding, writer, reader, damage handling, frames and the golden file."""

from __future__ import annotations

import importlib.util
import io
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pytest

from memrec.base.errors import TraceFormatError
from memrec.terms.columns import EVENT_DTYPE
from memrec.trace.clock import to_wall_ns
from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.columns import RAW_DTYPE
from memrec.terms.columns import empty_events
from memrec.export.jsonl import dump_trace
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import Api
from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace import codec
from memrec.trace import format as fmt
from memrec.trace.chunks import COLUMNAR_TYPE
from memrec.trace.chunks import MAX_RECORD_ROWS
from memrec.trace.frames import MAX_CLIENT_FRAME
from memrec.trace.frames import FrameDecoder
from memrec.trace.frames import FrameError
from memrec.trace.frames import encode_frame
from memrec.trace.frames import iter_frames
from memrec.trace.reader import TraceReader
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter
from tests.utils import v1_wire

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "golden_v2_3.mrec"  # what today's writer writes
GOLDEN_V2_2 = DATA / "golden_v2_2.mrec"  # what format 2.2 wrote (frozen: the reader must still read it)
GOLDEN_V2_1 = DATA / "golden_v2_1.mrec"  # what format 2.1 wrote (frozen: the reader must still read it)
GOLDEN_V2_0 = DATA / "golden_v2.mrec"  # what format 2.0 wrote (frozen: the reader must still read it)
GOLDEN_V1 = DATA / "golden_v1.mrec"  # what format 1 wrote (frozen: the reader must still read it)

HEADER = {
    "host": "test-host",
    "boot_id": "boot",
    "anchor": {"monotonic_ns": 1_000, "wall_ns": 5_000},
    "gpus": [GpuInfo(index=0, uuid="GPU-0", name="H200", total=100, bar1_total=None)],
    "probes": {"attached": ["cuMemAlloc_v2"], "missing": []},
    "config": {},
    "created_by": "test",
}


def make_golden_module():
    spec = importlib.util.spec_from_file_location("make_golden", DATA / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_events(n: int, *, start: int = 1_000_000, ipc_every: int = 7) -> np.ndarray:
    """``n`` events in time order with every field varied; every ``ipc_every``-th carries handle bytes."""
    rng = np.random.default_rng(n)
    ev = empty_events(n)
    ev["ts"] = start + np.arange(n, dtype=np.uint64) * 10
    ev["pid"] = rng.integers(1, 1 << 22, n)
    ev["tid"] = rng.integers(1, 1 << 22, n)
    ev["kind"] = rng.integers(1, 22, n)
    ev["api"] = rng.integers(0, 38, n)
    ev["result"] = rng.choice([0, 0, 0, 2, -1], n)
    ev["ordinal"] = rng.integers(-1, 8, n)
    ev["ptr"] = rng.integers(0, 1 << 63, n, dtype=np.uint64) * 2 + 1  # top bit used too
    ev["size"] = rng.integers(0, 1 << 40, n, dtype=np.uint64)
    ev["handle"] = rng.integers(0, 1 << 63, n, dtype=np.uint64)
    ev["aux"] = rng.integers(0, 1 << 32, n, dtype=np.uint64)
    ev["gpu"] = rng.integers(-1, 8, n)
    rows = np.arange(0, n, ipc_every)
    ev["flags"][rows] |= FLAG_IPC_BYTES
    ev["ipc"][rows] = [np.void(rng.bytes(64)) for _ in rows]
    return ev


def nvml_samples(n: int, start: int = 0) -> np.ndarray:
    s = np.zeros(n, dtype=NVML_DTYPE)
    s["ts"] = start + np.arange(n) * 100
    s["gpu"] = np.arange(n) % 8
    s["used"] = np.arange(n) * 1000
    s["reserved"] = 615
    s["free"] = -1
    s["total"] = 1 << 37
    s["bar1_used"] = np.arange(n)
    s["bar1_total"] = 1 << 38
    return s


def procmem_samples(n: int, start: int = 0) -> np.ndarray:
    s = np.zeros(n, dtype=PROCMEM_DTYPE)
    s["ts"] = start + np.arange(n) * 100
    s["gpu"] = np.arange(n) % 8
    s["pid"] = 1000 + np.arange(n)
    s["used"] = np.arange(n) << 20
    return s


MARKER = Marker(
    ts=5, pid=10, uid=1000, tid=11, name="load_weights", phase="begin", gpu=3, values={"a": 1.5, "b": [1, 2]}
)
PROCESS = ProcessInfo(
    pid=10,
    ppid=1,
    cmdline=["python", "x.py"],
    exe="/usr/bin/python3",
    cuda_visible_devices="2,3",
    gpu_map=[2, 3],
    first_ts=4,
    rank={"tp": 1},
)


def raw_objects(data: bytes) -> list[tuple[dict, int]]:
    """Every msgpack object of ``data`` with the offset where it ends (independent of the reader)."""
    up = msgpack.Unpacker(raw=False, strict_map_key=False)
    up.feed(data)
    out = []
    for obj in up:
        out.append((obj, up.tell()))
    return out


def write_trace(path, events=None, **kwargs) -> bytes:
    with TraceWriter(path, HEADER, **kwargs) as w:
        if events is not None:
            w.write_events(events)
    return pathlib.Path(path).read_bytes()


# ---------------------------------------------------------------------------------------------
# encode_record / decode_record


def recorded_like(n: int) -> np.ndarray:
    """``n`` events as the recorder writes them at a low rate: one process whose tid is mostly its
    pid, 2 MiB-aligned pointers and sizes, ordinal = gpu, and (from 2 rows) an IPC export and its
    open carrying the same handle bytes, which are mostly zero as a driver's are."""
    rng = np.random.default_rng(n)
    ev = empty_events(n)
    ev["ts"] = 10**12 + np.cumsum(rng.integers(1, 10**8, n)).astype(np.uint64)
    ev["pid"] = 775
    ev["tid"] = np.where(np.arange(n) % 3 == 2, 812, 775)
    ev["kind"] = rng.choice([Kind.ALLOC, Kind.FREE], n)
    ev["api"] = np.where(ev["kind"] == Kind.ALLOC, Api.cuMemAlloc_v2, Api.cuMemFree_v2)
    ev["ordinal"] = ev["gpu"] = rng.integers(-1, 2, n)
    ev["ptr"] = 0x7F0000000000 + (rng.integers(0, 1000, n).astype(np.uint64) << np.uint64(21))
    ev["size"] = rng.integers(1, 100, n).astype(np.uint64) << np.uint64(21)
    if n >= 2:
        handle = np.zeros(64, np.uint8)
        handle[[0, 1, 2, 8, 9, 20, 32, 37, 48, 50, 51]] = rng.integers(1, 256, 11)
        ev["kind"][[0, -1]] = [Kind.IPC_EXPORT, Kind.IPC_OPEN]
        ev["flags"][[0, -1]] = FLAG_IPC_BYTES
        ev["ipc"][[0, -1]] = np.void(handle.tobytes())
    return ev


@pytest.mark.parametrize("n", [1, 2, 3, 9, 256, 257, 5000])
def test_chunks_of_recorded_events_round_trip_in_few_bytes(n):
    # GIVEN events as the recorder writes them (aligned sizes, tid = pid, an IPC pair)
    ev = recorded_like(n)
    # WHEN written as one chunk and read back
    data = fmt.encode_record({"type": "events", "events": ev})
    wire = msgpack.unpackb(data, raw=False)
    # THEN every field comes back bit for bit, under the 2.1 chunk type
    assert wire["type"] == "e"
    np.testing.assert_array_equal(fmt.decode_record(wire)["events"], ev)
    # AND a chunk of a few rows is stored raw (its frame would cost more) and is small: the
    # envelope, checksum and directory are ~40 bytes, each event a few more, the handle ~24
    if n <= 3:
        assert set(wire) == {"type", "r"} and len(data) <= 40 + 16 * n + (24 if n >= 2 else 0)


def test_a_handle_repeated_in_a_chunk_is_stored_once():
    # GIVEN an IPC export and its open in one chunk, carrying the same 64 handle bytes, and the
    # same chunk with the open's bytes different
    ev = recorded_like(4)
    other = ev.copy()
    other["ipc"][-1] = np.void(bytes(range(1, 65)))
    # WHEN written
    same, different = (len(fmt.encode_record({"type": "events", "events": e})) for e in (ev, other))
    # THEN the repeated bytes cost one byte (which row they are), not their 64
    assert different - same >= 60
    wire = msgpack.unpackb(fmt.encode_record({"type": "events", "events": ev}), raw=False)
    assert fmt.decode_record(wire)["events"]["ipc"][-1] == ev["ipc"][0]


def test_every_damaged_byte_of_a_raw_chunk_is_found():
    # GIVEN a chunk of 3 events, stored raw with its CRC-32
    wire = msgpack.unpackb(fmt.encode_record({"type": "events", "events": recorded_like(3)}), raw=False)
    raw = wire["r"]
    for at in range(len(raw)):
        # WHEN any one byte of it is damaged
        bad = {**wire, "r": raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1 :]}
        # THEN the record is refused, never decoded into other events
        with pytest.raises(TraceFormatError, match="fails its checksum"):
            fmt.decode_record(bad)


@pytest.mark.parametrize("path", sorted((pathlib.Path(__file__).resolve().parents[2] / "examples").glob("*.mrec")),
                         ids=lambda p: p.stem)
def test_the_h200_examples_take_at_most_24_bytes_an_event_chunk_for_chunk(path):
    # GIVEN a format-1 recording from the H200 (chunks of 1-9 events: a flush every 200 ms)
    with TraceReader(path) as reader:
        chunks = [rec for rec in reader if rec["type"] == "events"]
    # WHEN each chunk is written as format 2.1 writes it
    size = sum(len(fmt.encode_record(rec)) for rec in chunks)
    n = sum(len(rec["events"]) for rec in chunks)
    # THEN the events records take at most 24 bytes an event (issue 11's goal), and read back
    assert n and size / n <= 24
    for rec in chunks:
        again = fmt.decode_record(msgpack.unpackb(fmt.encode_record(rec), raw=False))
        np.testing.assert_array_equal(again["events"], rec["events"])


@pytest.mark.parametrize("n", [0, 1, 2, 7, 100])
def test_events_record_round_trips_with_sparse_ipc(n):
    # GIVEN events where every 7th row carries 64 handle bytes
    ev = synthetic_events(n)
    # WHEN encoded and decoded
    data = fmt.encode_record({"type": "events", "events": ev})
    wire = msgpack.unpackb(data, raw=False)
    rec = fmt.decode_record(wire)
    # THEN every field comes back bit for bit
    assert rec["type"] == "events"
    assert rec["events"].dtype == EVENT_DTYPE
    np.testing.assert_array_equal(rec["events"], ev)
    # AND the record is one compressed payload whose ipc rows are only the flagged ones
    assert set(wire) in ({"type", "c"}, {"type", "r"})  # (its row count is in the payload)
    chunk = fmt.decode_columns(wire)
    flagged = np.flatnonzero(ev["flags"] & FLAG_IPC_BYTES)
    assert chunk.ipc_index.tolist() == flagged.tolist() and len(chunk.ipc) == len(flagged)


@pytest.mark.parametrize(
    "column,values",
    [
        ("ts", [0, 2**64 - 1, 5, 2**63]),  # deltas that wrap around
        ("ptr", [2**64 - 1] * 4),  # a constant at the top of the range
        ("gpu", [-(2**15), 2**15 - 1, -1, 0]),  # signed extremes
        ("result", [-(2**31), 2**31 - 1, 0, 2]),
        ("size", [10, 20, 30, 40]),  # constant delta: no bytes at all
    ],
)
def test_the_column_codec_round_trips_extreme_values(column, values):
    # GIVEN events whose column holds values at the edges of its dtype
    ev = synthetic_events(4)
    ev[column] = values
    # WHEN encoded and decoded
    rec = fmt.decode_record(fmt.unpackb(fmt.encode_record({"type": "events", "events": ev})))
    # THEN they come back exactly
    assert rec["events"][column].tolist() == ev[column].tolist()


def test_a_format_1_events_record_still_decodes():
    # GIVEN an events record as format 1 wrote it (raw columns, sparse ipc)
    ev = synthetic_events(50)
    wire = msgpack.unpackb(fmt.packb(v1_wire("events", ev)))
    # WHEN decoded THEN every field comes back
    np.testing.assert_array_equal(fmt.decode_record(wire)["events"], ev)


def test_ipc_bytes_of_unflagged_rows_are_not_stored():
    # GIVEN an event with handle bytes but without FLAG_IPC_BYTES
    ev = empty_events(1)
    ev["ipc"][0] = np.void(b"\xff" * 64)
    # WHEN it round-trips
    rec = fmt.decode_record(msgpack.unpackb(fmt.encode_record({"type": "events", "events": ev})))
    # THEN the bytes read back as zeros (the flag says whether they exist)
    assert rec["events"]["ipc"][0].tobytes() == b"\0" * 64


@pytest.mark.parametrize(
    "kind,key,rows",
    [
        ("nvml", "samples", nvml_samples(9)),
        ("procmem", "samples", procmem_samples(9)),
        ("nvml", "samples", nvml_samples(0)),
        ("procmem", "samples", procmem_samples(0)),
    ],
)
def test_sample_records_round_trip(kind, key, rows):
    # GIVEN NVML or per-process samples (possibly none)
    # WHEN encoded and decoded
    rec = fmt.decode_record(msgpack.unpackb(fmt.encode_record({"type": kind, key: rows}), raw=False))
    # THEN they come back equal with the right dtype
    assert rec[key].dtype == fmt.COLUMNAR[kind]
    np.testing.assert_array_equal(rec[key], rows)


@pytest.mark.parametrize(
    "rec",
    [
        fmt.marker_record(MARKER),
        fmt.process_record(PROCESS),
        fmt.lost_record(9, 12),
        fmt.keyframe_record(10, 4, {"allocs": [[1, 2, 3]], 7: {"int keys": True}}),
        {"type": "trailer", "counts": {"events": 3}, "lost": 0, "end_ts": 11},
        fmt.finalize_header(HEADER),
    ],
    ids=["marker", "process", "lost", "keyframe", "trailer", "header"],
)
def test_plain_records_round_trip(rec):
    # GIVEN a non-columnar record (a keyframe's state may use int keys)
    # WHEN encoded and decoded the way readers decode
    back = fmt.decode_record(fmt.unpackb(fmt.encode_record(rec)))
    # THEN it is equal
    assert back == rec


def test_marker_and_process_records_convert_back_to_dataclasses():
    # GIVEN marker and process records with an extra field from a newer writer
    marker = {**fmt.marker_record(MARKER), "new_field": 1}
    process = {**fmt.process_record(PROCESS), "new_field": 1}
    # WHEN converted back
    # THEN the dataclasses are equal and the extra field is ignored
    assert fmt.marker_from_record(fmt.unpackb(fmt.encode_record(marker))) == MARKER
    assert fmt.process_from_record(fmt.unpackb(fmt.encode_record(process))) == PROCESS


def test_encode_record_converts_numpy_scalars_and_rejects_unknown_objects():
    # GIVEN a marker whose values hold numpy scalars, and a record holding an arbitrary object
    rec = {"type": "marker", "ts": np.uint64(5), "values": {"x": np.float32(0.5), "y": np.arange(3)}}
    # WHEN encoded
    back = fmt.unpackb(fmt.encode_record(rec))
    # THEN numpy values become plain numbers and lists
    assert back == {"type": "marker", "ts": 5, "values": {"x": 0.5, "y": [0, 1, 2]}}
    with pytest.raises(TypeError, match="cannot encode"):
        fmt.encode_record({"type": "marker", "values": object()})


def test_rows_are_converted_by_field_name_and_a_missing_field_is_an_error():
    # GIVEN events with the fields in another order (and as another structured dtype)
    ev = synthetic_events(5)
    reordered = np.zeros(5, dtype=[(n, EVENT_DTYPE.fields[n][0]) for n in reversed(EVENT_DTYPE.names)])
    for name in EVENT_DTYPE.names:
        reordered[name] = ev[name]
    # WHEN encoded
    rec = fmt.decode_record(msgpack.unpackb(fmt.encode_record({"type": "events", "events": reordered})))
    # THEN fields are matched by name
    np.testing.assert_array_equal(rec["events"], ev)
    # AND raw records (no gpu column) are refused with the missing field named
    with pytest.raises(ValueError, match="gpu"):
        fmt.encode_record({"type": "events", "events": np.zeros(2, dtype=RAW_DTYPE)})


def test_format_1_columns_are_zero_copy_views_of_the_record_bytes():
    # GIVEN a decoded format-1 wire events record
    wire = msgpack.unpackb(fmt.packb(v1_wire("events", synthetic_events(10))))
    # WHEN its columns are decoded
    chunk = fmt.decode_columns(wire)
    # THEN each column is a view of the msgpack bytes, not a copy
    assert chunk.columns["ts"].base is wire["columns"]["ts"]
    assert chunk.n == 10


def test_a_newer_writers_columns_are_ignored_and_missing_ones_take_defaults():
    # GIVEN an events record with an extra column and without the gpu and ordinal columns
    ev = synthetic_events(4)
    wire = msgpack.unpackb(fmt.packb(v1_wire("events", ev)))
    del wire["columns"]["gpu"], wire["columns"]["ordinal"]
    wire["columns"]["stream"] = b"\1" * 32
    # WHEN decoded
    out = fmt.decode_record(wire)["events"]
    # THEN gpu and ordinal are -1 (unknown) and the rest is intact
    assert out["gpu"].tolist() == [-1] * 4 and out["ordinal"].tolist() == [-1] * 4
    np.testing.assert_array_equal(out["ptr"], ev["ptr"])


def test_the_headers_column_schema_is_used_to_decode():
    # GIVEN a (future) writer that declared gpu as a 4-byte column
    header = fmt.finalize_header(HEADER)
    header["columns"]["events"] = [[n, "<i4" if n == "gpu" else d] for n, d in header["columns"]["events"]]
    ev = synthetic_events(3)
    wire = msgpack.unpackb(fmt.packb(v1_wire("events", ev)))
    wire["columns"]["gpu"] = ev["gpu"].astype("<i4").tobytes()
    # WHEN decoded with that header's schema
    out = fmt.decode_record(wire, fmt.parse_schema(header))["events"]
    # THEN the gpu values are read with the declared width
    assert out["gpu"].tolist() == ev["gpu"].tolist()


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda w: w["columns"].__setitem__("ts", b"\0" * 7), "'ts' has 7 bytes"),
        (lambda w: w.__setitem__("n", -1), "bad 'n'"),
        (lambda w: w.__setitem__("ipc", b"\0" * 3), "ipc"),
        (lambda w: w.__setitem__("ipc_index", np.array([99], "<u4").tobytes()), "ipc"),
        (lambda w: w["columns"].__setitem__("pid", 5), "not binary"),
    ],
    ids=["short-column", "negative-n", "ipc-length", "ipc-index-range", "not-binary"],
)
def test_malformed_format_1_columnar_records_raise_trace_format_error(damage, match):
    # GIVEN a damaged format-1 events record
    ev = synthetic_events(7, ipc_every=3)
    wire = msgpack.unpackb(fmt.packb(v1_wire("events", ev)))
    damage(wire)
    # WHEN decoded THEN a TraceFormatError names the problem
    with pytest.raises(TraceFormatError, match=match):
        fmt.decode_record(wire)


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


def _key(wire: dict) -> str:
    """The key of a format-2 record's chunk bytes ("c": compressed, "r": raw, "z": 2.0)."""
    return next(key for key in ("c", "r", "z") if key in wire)


def _damage(wire: dict, change) -> None:
    wire[_key(wire)] = change(wire[_key(wire)])


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda w: w.__setitem__("n", 8), "holds 7 rows, the record says 8"),
        (lambda w: w.__setitem__("n", -1), "bad 'n'"),
        (lambda w: w.__setitem__("n", MAX_RECORD_ROWS + 1), "bad 'n'"),
        (lambda w: _damage(w, lambda z: 5), "not binary"),
        (lambda w: w.__setitem__("c" if _key(w) == "r" else "r", w.pop(_key(w))), "does not decompress|fails its checksum"),
        (lambda w: _damage(w, lambda z: z[:-6]), "does not decompress|fails its checksum"),
        (lambda w: _damage(w, lambda z: _flip(z, len(z) // 2)), "does not decompress|fails its checksum"),
    ],
    ids=["wrong-n", "negative-n", "huge-n", "not-binary", "swapped-key", "cut", "flipped-byte"],
)
def test_malformed_format_2_columnar_records_raise_trace_format_error(damage, match):
    # GIVEN a damaged format-2 events record
    ev = synthetic_events(7, ipc_every=3)
    wire = msgpack.unpackb(fmt.encode_record({"type": "events", "events": ev}))
    damage(wire)
    # WHEN decoded THEN a TraceFormatError names the problem
    with pytest.raises(TraceFormatError, match=match):
        fmt.decode_record(wire)


def test_a_keyframe_state_is_compressed_and_a_damaged_one_is_refused():
    # GIVEN a keyframe record
    rec = fmt.keyframe_record(10, 4, {"allocs": [[1, 2, 3]] * 1000})
    wire = fmt.unpackb(fmt.encode_record(rec))
    # THEN its state is stored compressed and reads back equal
    assert "state" not in wire and len(wire["state_z"]) < len(fmt.packb(rec["state"])) // 10
    assert fmt.decode_record(wire) == rec
    # AND a damaged state is a TraceFormatError
    wire["state_z"] = _flip(wire["state_z"], len(wire["state_z"]) // 2)
    with pytest.raises(TraceFormatError, match="malformed keyframe"):
        fmt.check_keyframe(wire)


def test_header_starts_with_magic_and_carries_clock_anchor_and_schema():
    # GIVEN a header built with the host's defaults
    header = fmt.make_header(gpus=[GpuInfo(0, "GPU-0", "H200", 10)], probes={"attached": []})
    data = fmt.encode_record(header)
    # THEN magic is the first key (so the file's first bytes identify it)
    assert list(header)[:4] == ["magic", "version", "minor", "type"]
    assert fmt.header_prefix_plausible(data)
    assert data[1 : 1 + len(fmt.packb("magic") + fmt.packb(fmt.MAGIC))] == fmt.packb("magic") + fmt.packb(fmt.MAGIC)
    # AND the clock is CLOCK_MONOTONIC with one anchor, the GPUs are dicts, the schema is there
    assert header["clock"] == "CLOCK_MONOTONIC"
    assert set(header["anchor"]) == {"monotonic_ns", "wall_ns"}
    assert header["gpus"][0]["uuid"] == "GPU-0"
    assert header["columns"]["events"][0] == ["ts", "<u8"]
    assert to_wall_ns(header, header["anchor"]["monotonic_ns"] + 7) == header["anchor"]["wall_ns"] + 7


# ---------------------------------------------------------------------------------------------
# writer → reader


def test_every_record_type_round_trips_through_a_file(tmp_path):
    # GIVEN a trace with every record type, events split over several chunks
    path = tmp_path / "t.mrec"
    ev = synthetic_events(1000)
    nv, pm = nvml_samples(30), procmem_samples(12)
    with TraceWriter(path, HEADER, max_chunk_rows=256) as w:
        w.write_process(PROCESS)
        w.write_events(ev[:300])
        w.write_marker(MARKER)
        w.write_nvml(nv[:10])
        w.write_keyframe(1_003_000, 300, {"k": [1]})
        w.write_events(ev[300:])
        w.write_nvml(nv[10:])
        w.write_procmem(pm)
        w.write_lost(4, 2)
        w.write_lost(8, 5)
        w.write_process(ProcessInfo(**{**PROCESS.__dict__, "rank": {"tp": 7}}))
    # WHEN loaded
    trace = load_trace(path)
    # THEN everything is back, in order, with no warnings
    assert trace.warnings == []
    np.testing.assert_array_equal(trace.events, ev)
    np.testing.assert_array_equal(trace.nvml, nv)
    np.testing.assert_array_equal(trace.procmem, pm)
    assert trace.markers == [MARKER]
    assert trace.processes == {10: ProcessInfo(**{**PROCESS.__dict__, "rank": {"tp": 7}})}
    assert [(k.ts, k.event_index, k.state) for k in trace.keyframes] == [(1_003_000, 300, {"k": [1]})]
    assert trace.lost == 5
    assert trace.header["host"] == "test-host" and trace.gpus == [HEADER["gpus"][0]]
    assert trace.trailer["counts"] == {
        "events": 1000, "nvml": 30, "procmem": 12, "marker": 1, "process": 2, "lost": 2, "keyframe": 1
    }
    assert trace.trailer["end_ts"] == int(ev["ts"][-1])
    assert sum(trace.trailer["event_kinds"].values()) == 1000


def test_chunks_are_bounded_and_a_keyframe_follows_the_events_it_covers(tmp_path):
    # GIVEN 150,000 events written in one call, then a keyframe
    path = tmp_path / "t.mrec"
    with TraceWriter(path, HEADER) as w:
        w.write_events(synthetic_events(150_000))
        w.write_keyframe(1, {"s": 1})
    # WHEN the raw records are listed
    objs = [obj for obj, _ in raw_objects(path.read_bytes())]
    # THEN no events chunk holds more than 65536 rows, and the keyframe comes after all of them
    sizes = [fmt.decode_columns(o).n for o in objs if o["type"] == "e"]
    assert sizes == [65536, 65536, 150_000 - 2 * 65536]
    kinds = [o["type"] for o in objs]
    assert kinds == ["header", "e", "e", "e", "keyframe", "trailer"]
    assert objs[4]["event_index"] == 150_000


def test_empty_writes_add_no_records_and_a_trace_without_events_loads(tmp_path):
    # GIVEN a writer that only gets empty arrays
    path = tmp_path / "t.mrec"
    with TraceWriter(path, HEADER) as w:
        w.write_events(empty_events(0))
        w.write_nvml(np.zeros(0, NVML_DTYPE))
        w.flush()
    # WHEN loaded
    trace = load_trace(path)
    # THEN there are just the header and trailer and empty arrays of the right dtype
    assert [o["type"] for o, _ in raw_objects(path.read_bytes())] == ["header", "trailer"]
    assert trace.events.dtype == EVENT_DTYPE and len(trace.events) == 0
    assert trace.warnings == []


def test_empty_chunks_written_by_another_writer_are_read(tmp_path):
    # GIVEN a file with empty events/nvml/procmem chunks between real ones
    ev = synthetic_events(5)
    parts = [fmt.encode_record(fmt.finalize_header(HEADER))]
    parts += [fmt.encode_record({"type": "events", "events": empty_events(0)})]
    parts += [fmt.encode_record({"type": "events", "events": ev})]
    parts += [fmt.encode_record({"type": k, "samples": np.zeros(0, fmt.COLUMNAR[k])}) for k in ("nvml", "procmem")]
    parts += [fmt.encode_record({"type": "trailer"})]
    path = tmp_path / "t.mrec"
    path.write_bytes(b"".join(parts))
    # WHEN loaded THEN the events are there and nothing is reported
    trace = load_trace(path)
    np.testing.assert_array_equal(trace.events, ev)
    assert trace.warnings == []


def test_writer_copies_rows_so_the_caller_may_reuse_its_buffer(tmp_path):
    # GIVEN events that the caller overwrites right after handing them over
    path = tmp_path / "t.mrec"
    ev = synthetic_events(10)
    expected = ev.copy()
    with TraceWriter(path, HEADER) as w:
        w.write_events(ev)
        ev["ts"] = 0
    # THEN the file has the values at the time of the call
    np.testing.assert_array_equal(load_trace(path).events, expected)


def test_writer_counts_bytes_and_refuses_writes_after_close(tmp_path):
    # GIVEN a writer after flush
    path = tmp_path / "t.mrec"
    w = TraceWriter(path, HEADER)
    w.write_events(synthetic_events(100))
    assert w.event_count == 100 and w.pending_rows == 100
    w.flush()
    # THEN bytes_written is the file's size and nothing is pending
    assert w.bytes_written == path.stat().st_size and w.pending_rows == 0
    w.close({"reason": "done"})
    w.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        w.write_events(synthetic_events(1))
    assert load_trace(path).trailer["reason"] == "done"


def test_short_writes_are_resumed_without_losing_or_repeating_bytes(tmp_path, monkeypatch):
    # GIVEN a kernel that writes at most 1000 bytes per writev call
    real_writev = os.writev
    calls = []

    def short_writev(fd, buffers):
        data = b"".join(bytes(b) for b in buffers)[:1000]
        calls.append(len(data))
        return real_writev(fd, [data])

    monkeypatch.setattr(os, "writev", short_writev)
    teed = []
    path = tmp_path / "t.mrec"
    ev = synthetic_events(500)
    # WHEN a trace is written
    with TraceWriter(path, HEADER, tee=teed.append, max_chunk_rows=100) as w:
        w.write_events(ev)
        w.write_marker(MARKER)
    # THEN the file is exactly the records, written over many calls
    assert len(calls) > 10
    assert path.read_bytes() == b"".join(teed)
    np.testing.assert_array_equal(load_trace(path).events, ev)


def test_a_header_that_cannot_be_encoded_creates_no_file(tmp_path):
    # GIVEN a header holding an object msgpack cannot encode
    path = tmp_path / "t.mrec"
    # WHEN a writer is created THEN TypeError, and no file is left behind
    with pytest.raises(TypeError, match="cannot encode"):
        TraceWriter(path, {**HEADER, "config": {"x": object()}})
    assert not path.exists()


def test_keyframe_two_argument_form_defaults_event_index_to_events_written(tmp_path):
    # GIVEN 5 events then a keyframe without an explicit event index
    path = tmp_path / "t.mrec"
    with TraceWriter(path, HEADER) as w:
        w.write_events(synthetic_events(5))
        w.write_keyframe(99, {"x": 1})
    # THEN the keyframe is valid after those 5 events
    assert load_trace(path).keyframes[0].event_index == 5


def test_tee_gets_exactly_the_bytes_of_the_file(tmp_path):
    # GIVEN a writer teeing every record to a list (a live subscriber)
    teed = []
    path = tmp_path / "t.mrec"
    with TraceWriter(path, HEADER, tee=teed.append, max_chunk_rows=4) as w:
        w.write_events(synthetic_events(10))
        w.write_marker(MARKER)
        w.flush()
        w.write_keyframe(7, {"a": 1})
    # THEN the concatenated records are the file, byte for byte
    assert b"".join(teed) == path.read_bytes()
    assert teed[0] == w.header_bytes


def test_exiting_the_writer_on_an_exception_leaves_a_readable_trace_without_trailer(tmp_path):
    # GIVEN a writer whose block raises
    path = tmp_path / "t.mrec"
    ev = synthetic_events(3)
    with pytest.raises(RuntimeError):
        with TraceWriter(path, HEADER) as w:
            w.write_events(ev)
            raise RuntimeError("boom")
    # WHEN loaded THEN the events are there and a warning says the trailer is missing
    trace = load_trace(path)
    np.testing.assert_array_equal(trace.events, ev)
    assert trace.trailer is None
    assert any("no trailer" in warning for warning in trace.warnings)


def test_reader_streams_records_in_file_order(tmp_path):
    # GIVEN a small trace
    path = tmp_path / "t.mrec"
    with TraceWriter(path, HEADER, max_chunk_rows=2) as w:
        w.write_marker(MARKER)
        w.write_events(synthetic_events(5))
    # WHEN iterated
    with TraceReader(path, read_size=16) as reader:
        kinds = [rec["type"] for rec in reader]
        again = [rec["type"] for rec in reader.raw_records()]
    # THEN the records come in file order, and a second pass sees the same (the wire's short
    # type for a chunk: "e")
    assert kinds == ["marker", "events", "events", "events", "trailer"]
    assert again == ["marker", "e", "e", "e", "trailer"]
    assert reader.trailer["type"] == "trailer" and reader.warnings == []


# ---------------------------------------------------------------------------------------------
# another process's view, crashes, truncation


WRITER_CHILD = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from memrec.terms.columns import empty_events
    from memrec.trace.writer import TraceWriter
    ev = empty_events(1000)
    ev["ts"] = np.arange(1000) + 1
    w = TraceWriter(sys.argv[1], {"host": "child", "anchor": {"monotonic_ns": 0, "wall_ns": 0}})
    w.write_events(ev[:600])
    w.flush()
    w.write_events(ev[600:])  # buffered, never flushed before the first step
    print("flushed", flush=True)
    step = sys.stdin.readline().strip()
    if step == "crash":
        os._exit(9)  # no flush, no trailer
    w.close()
    print("closed", flush=True)
    """
)


def start_writer_child(path):
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER_CHILD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "flushed"
    return child


def test_another_process_reads_the_trace_while_it_is_being_written(tmp_path):
    # GIVEN another process that flushed 600 events and still holds 400 in its buffer
    path = tmp_path / "live.mrec"
    child = start_writer_child(path)
    try:
        # WHEN this process loads the file
        during = load_trace(path)
        # THEN it sees the flushed events, and a warning that there is no trailer yet
        assert len(during.events) == 600
        assert during.trailer is None
        assert any("no trailer" in w for w in during.warnings)
        # WHEN the writer closes
        child.stdin.write("close\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "closed"
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    after = load_trace(path)
    # THEN everything is there and nothing is reported
    assert len(after.events) == 1000 and after.events["ts"].tolist() == list(range(1, 1001))
    assert after.warnings == [] and after.trailer["counts"]["events"] == 1000


def test_a_writer_that_crashes_leaves_everything_it_flushed(tmp_path):
    # GIVEN a writer process killed after one flush (no trailer, buffered events lost)
    path = tmp_path / "crash.mrec"
    child = start_writer_child(path)
    child.stdin.write("crash\n")
    child.stdin.close()
    assert child.wait(timeout=30) == 9
    # WHEN loaded
    trace = load_trace(path)
    # THEN the flushed events are there, with a warning and never an exception
    assert trace.events["ts"].tolist() == list(range(1, 601))
    assert any("no trailer" in w and "trace ends at ts 600" in w for w in trace.warnings)


def small_trace_bytes(tmp_path) -> bytes:
    path = tmp_path / "small.mrec"
    with TraceWriter(path, HEADER, max_chunk_rows=2) as w:
        w.write_process(PROCESS)
        w.write_events(synthetic_events(3, ipc_every=2))
        w.write_marker(MARKER)
        w.write_nvml(nvml_samples(2))
        w.write_keyframe(9, {"s": [1, 2]})
        w.write_procmem(procmem_samples(1))
        w.write_lost(10, 4)
    return path.read_bytes()


def test_a_trace_cut_at_every_byte_offset_reads_everything_before_the_cut(tmp_path):
    # GIVEN a small trace with every record type, and each record's end offset found independently
    data = small_trace_bytes(tmp_path)
    objs = raw_objects(data)
    header_end = objs[0][1]
    full = load_trace_bytes(tmp_path, data)
    cut_path = tmp_path / "cut.mrec"
    for cut in range(len(data) + 1):
        cut_path.write_bytes(data[:cut])
        # WHEN the trace cut after `cut` bytes is loaded
        trace = load_trace(cut_path)  # THEN it never raises
        complete = [obj for obj, end in objs[1:] if end <= cut]
        rows = {kind: sum(fmt.decode_columns(o).n for o in complete if COLUMNAR_TYPE.get(o["type"]) == kind)
                for kind in ("events", "nvml", "procmem")}
        n_events = rows["events"]
        # AND every record completed before the cut is there, and nothing else
        np.testing.assert_array_equal(trace.events, full.events[:n_events])
        assert len(trace.nvml) == rows["nvml"] and len(trace.procmem) == rows["procmem"]
        assert len(trace.markers) == sum(o["type"] == "marker" for o in complete)
        assert len(trace.processes) == sum(o["type"] == "process" for o in complete)
        assert len(trace.keyframes) == sum(o["type"] == "keyframe" for o in complete)
        assert trace.lost == (4 if any(o["type"] == "lost" for o in complete) else 0)
        # AND a cut anywhere but the end is reported
        if cut == len(data):
            assert trace.warnings == [] and trace.trailer is not None
        else:
            assert trace.warnings, cut
            assert trace.trailer is None
            truncated = [w for w in trace.warnings if w.startswith("truncated tail")]
            if cut < header_end:
                assert trace.header == {} and "inside its header" in trace.warnings[0]
            elif any(end == cut for _, end in objs):
                assert truncated == [] and "no trailer" in trace.warnings[-1]
            else:
                assert truncated and truncated[0].startswith(f"truncated tail after {len(complete)} records")


def load_trace_bytes(tmp_path, data: bytes, name: str = "t.mrec"):
    path = tmp_path / name
    path.write_bytes(data)
    return load_trace(path)


def test_corrupt_bytes_mid_file_keep_what_came_before(tmp_path):
    # GIVEN a trace whose second record after the header starts with a byte msgpack never uses (0xc1)
    data = small_trace_bytes(tmp_path)
    objs = raw_objects(data)
    start = objs[1][1]  # where the record after the process record starts
    damaged = data[:start] + b"\xc1" + data[start + 1 :]
    # WHEN loaded
    trace = load_trace_bytes(tmp_path, damaged)
    # THEN the records before the damage are kept and a warning gives its offset
    assert len(trace.processes) == 1
    assert any(f"corrupt trace after 1 records at byte {objs[1][1]}" in w for w in trace.warnings)


def test_random_byte_damage_never_raises_anything_but_trace_format_error(tmp_path):
    # GIVEN a small trace, and 400 copies each with a few random bytes overwritten
    data = small_trace_bytes(tmp_path)
    header_end = raw_objects(data)[0][1]
    rng = np.random.default_rng(7)
    path = tmp_path / "fuzz.mrec"
    for _ in range(400):
        damaged = bytearray(data)
        for pos in rng.integers(0, len(data), rng.integers(1, 4)):
            damaged[pos] = int(rng.integers(0, 256))
        path.write_bytes(bytes(damaged))
        # WHEN loaded and dumped
        try:
            trace = load_trace(path)
            with TraceReader(path) as reader:
                records = list(reader)
                dump_trace(reader, io.StringIO())
        except TraceFormatError:
            continue  # the header was hit: refusing the file is the right answer
        # THEN it never raises anything else, and damage after the header is reported or harmless
        assert isinstance(trace.events, np.ndarray) and len(records) <= 9
        if bytes(damaged[:header_end]) == data[:header_end] and bytes(damaged) != data:
            assert trace.warnings or len(trace.events) == 3


def test_a_malformed_record_is_skipped_and_the_rest_is_read(tmp_path):
    # GIVEN a trace with a malformed events record (short column) and a non-map object between good ones
    ev = synthetic_events(4)
    bad = msgpack.unpackb(fmt.encode_record({"type": "events", "events": ev}))
    _damage(bad, lambda z: z[:-1])
    parts = [
        fmt.encode_record(fmt.finalize_header(HEADER)),
        fmt.packb(bad),
        fmt.packb([1, 2, 3]),
        fmt.encode_record({"type": "events", "events": ev}),
        fmt.encode_record({"type": "trailer"}),
    ]
    # WHEN loaded
    trace = load_trace_bytes(tmp_path, b"".join(parts))
    # THEN the good events are read and the two bad records are reported once
    np.testing.assert_array_equal(trace.events, ev)
    malformed = [w for w in trace.warnings if "malformed" in w]
    assert len(malformed) == 1
    assert malformed[0].startswith("skipped 2 malformed record(s); first at byte ")
    assert re.search("malformed events record: column data (does not decompress|fails its checksum)", malformed[0])


# ---------------------------------------------------------------------------------------------
# identity and versions


@pytest.mark.parametrize(
    "data",
    [
        b"hello world, not a trace\n",
        b'{"json": true}',
        b"\x89PNG\r\n\x1a\n" + b"\0" * 100,
        msgpack.packb({"magic": "other-format", "version": 1}),
        msgpack.packb([fmt.MAGIC, 1]),
        msgpack.packb({"magic": fmt.MAGIC, "version": "one"}),
        b"\x81\xa5magic\xa5other",
        b"\xc1" * 10,
        b"\x81\x91\x01\x02",
        fmt.encode_record({**fmt.finalize_header(HEADER), "columns": {"events": [["ts", "|O8"]]}}),
        fmt.encode_record({**fmt.finalize_header(HEADER), "columns": {"events": [["ts", "<f8"]]}}),
        fmt.encode_record({**fmt.finalize_header(HEADER), "columns": {"events": [["ts", "bogus"]]}}),
    ],
    ids=["text", "json", "png", "other-magic", "array", "bad-version", "cut-other-magic", "invalid-msgpack",
         "unhashable-key", "object-column", "float-ts", "bogus-dtype"],
)
def test_a_file_that_is_not_a_trace_is_refused(tmp_path, data):
    # GIVEN a file that is not a memrec trace
    path = tmp_path / "x.mrec"
    path.write_bytes(data)
    # WHEN opened THEN TraceFormatError says so
    with pytest.raises(TraceFormatError, match="not a memrec trace|malformed column schema"):
        TraceReader(path)
    with pytest.raises(TraceFormatError, match="not a memrec trace|malformed column schema"):
        load_trace(path)


def test_an_empty_file_is_a_trace_cut_inside_its_header(tmp_path):
    # GIVEN an empty file (the recorder just created it)
    path = tmp_path / "x.mrec"
    path.write_bytes(b"")
    # WHEN loaded THEN it is an empty trace with a warning, not an error
    trace = load_trace(path)
    assert trace.header == {} and len(trace.events) == 0
    assert trace.warnings == ["trace ends inside its header (0 bytes): no records (still being created, or cut)"]


def test_a_newer_major_version_is_refused_naming_both_versions(tmp_path):
    # GIVEN a trace written by a future memrec with format 3.3
    header = {**fmt.finalize_header(HEADER), "version": 3, "minor": 3}
    path = tmp_path / "new.mrec"
    path.write_bytes(fmt.encode_record(header) + fmt.encode_record({"type": "trailer"}))
    # WHEN opened THEN the error names both versions
    with pytest.raises(TraceFormatError, match=rf"version 3\.3 is newer than this memrec reads \(format version 2\.{fmt.FORMAT_MINOR}\)"):
        TraceReader(path)


def test_a_newer_minor_versions_unknown_records_are_skipped_with_a_warning(tmp_path):
    # GIVEN a 2.4 trace with two records of a type this version does not know
    ev = synthetic_events(3)
    header = {**fmt.finalize_header(HEADER), "minor": 4, "new_header_field": {"x": 1}}
    parts = [
        fmt.encode_record(header),
        fmt.packb({"type": "gpu_clocks", "ts": 1, "mhz": [1980]}),
        fmt.encode_record({"type": "events", "events": ev}),
        fmt.packb({"type": "gpu_clocks", "ts": 2, "mhz": [1980]}),
        fmt.encode_record(fmt.marker_record(MARKER)),
        fmt.encode_record({"type": "trailer"}),
    ]
    # WHEN loaded
    trace = load_trace_bytes(tmp_path, b"".join(parts))
    # THEN the known records are read, and one warning names the unknown type and its count
    np.testing.assert_array_equal(trace.events, ev)
    assert trace.markers == [MARKER]
    assert trace.header["new_header_field"] == {"x": 1}
    assert [w for w in trace.warnings if "gpu_clocks" in w] == [
        "skipped 2 record(s) of unknown type 'gpu_clocks' (written by a newer memrec? this one reads format 2.x)"
    ]


# ---------------------------------------------------------------------------------------------
# frames (marker socket and live subscribers)


def test_frames_fed_one_byte_at_a_time_decode_to_the_same_records():
    # GIVEN framed records: a header, an events chunk, a marker
    ev = synthetic_events(20)
    stream = b"".join(
        encode_frame(r)
        for r in (fmt.finalize_header(HEADER), {"type": "events", "events": ev}, fmt.marker_record(MARKER))
    )
    # WHEN fed one byte at a time
    decoder = FrameDecoder(max_size=1 << 20)
    records = []
    for i in range(len(stream)):
        records += decoder.feed(stream[i : i + 1])
    # THEN the records come out whole and decoded, with nothing left over
    assert [r["type"] for r in records] == ["header", "events", "marker"]
    np.testing.assert_array_equal(records[1]["events"], ev)
    assert fmt.marker_from_record(records[2]) == MARKER
    assert decoder.pending == 0


def test_an_oversized_frame_is_refused_before_its_payload_arrives():
    # GIVEN a client decoder (64 KiB limit) and a length prefix of 64 KiB + 1
    decoder = FrameDecoder()
    good = encode_frame({"type": "mark", "name": "x"})
    # WHEN fed a good frame then only the bad prefix
    with pytest.raises(FrameError, match=f"{MAX_CLIENT_FRAME + 1} bytes is over the limit of {MAX_CLIENT_FRAME}") as info:
        decoder.feed(good + (MAX_CLIENT_FRAME + 1).to_bytes(4, "big"))
    # THEN the good frame before it is still handed over
    assert info.value.records == [{"type": "mark", "name": "x"}]
    with pytest.raises(FrameError, match="over the limit"):
        encode_frame(b"x" * 10, max_size=9)


@pytest.mark.parametrize("payload", [b"\xc1", b"\x93\x01\x02\x03", b"\x81\xa4type\x05", b"", b"\x01\x02"])
def test_a_frame_that_is_not_a_record_is_refused(payload):
    # GIVEN a frame whose payload is not one msgpack map with a string type
    # WHEN decoded THEN FrameError
    with pytest.raises(FrameError, match="bad frame"):
        FrameDecoder().feed(len(payload).to_bytes(4, "big") + payload)


def test_iter_frames_reads_a_subscriber_stream_teed_from_the_writer(tmp_path):
    # GIVEN a writer teeing framed records to a subscriber's stream
    stream = io.BytesIO()
    path = tmp_path / "t.mrec"
    ev = synthetic_events(300)
    with TraceWriter(path, HEADER, tee=lambda data: stream.write(encode_frame(data)), max_chunk_rows=128) as w:
        w.write_events(ev)
        w.write_marker(MARKER)
    stream.seek(0)
    # WHEN the subscriber reads it
    records = list(iter_frames(stream))
    # THEN it gets the same records the file holds
    with TraceReader(path) as reader:
        from_file = list(reader)
    assert [r["type"] for r in records] == ["header"] + [r["type"] for r in from_file]
    np.testing.assert_array_equal(np.concatenate([r["events"] for r in records if r["type"] == "events"]), ev)
    # AND a stream cut inside a frame is an error
    with pytest.raises(FrameError, match="ended inside a frame"):
        list(iter_frames(io.BytesIO(stream.getvalue()[:-3])))


def test_a_stream_header_of_a_newer_major_version_is_refused():
    # GIVEN a subscriber stream whose header is format 3
    frame = encode_frame({**fmt.finalize_header(HEADER), "version": 3})
    # WHEN decoded THEN FrameError names the version
    with pytest.raises(FrameError, match="version 3"):
        FrameDecoder(1 << 20).feed(frame)


# ---------------------------------------------------------------------------------------------
# golden file


def test_the_writer_still_produces_the_golden_bytes():
    # GIVEN the committed golden trace and the script that made it
    golden = make_golden_module()
    # WHEN the script runs with today's writer
    # THEN the bytes are identical (a difference is a format change: regenerate deliberately)
    assert (fmt.FORMAT_VERSION, fmt.FORMAT_MINOR) == (2, 3) and pathlib.Path(golden.GOLDEN).name == GOLDEN.name
    assert golden.golden_bytes() == GOLDEN.read_bytes()


#: The kinds format 2.2 added (issue 21's and the tensor probes'): the golden 2.2 trace has one of each.
KINDS_2_2 = [*range(Kind.ARRAY_CREATE, Kind.MULTICAST_UNBIND + 1), Kind.TENSOR_ALLOC, Kind.TENSOR_FREE]


@pytest.mark.parametrize("path,version,minor", [(GOLDEN, 2, 3), (GOLDEN_V2_2, 2, 2), (GOLDEN_V2_1, 2, 1),
                                                (GOLDEN_V2_0, 2, 0), (GOLDEN_V1, 1, 1)],
                         ids=["v2.3", "v2.2", "v2.1", "v2.0", "v1"])
def test_the_golden_trace_decodes_to_what_it_was_written_with(path, version, minor):
    # GIVEN the committed golden trace (format 2.3, and format 2.2's, 2.1's, 2.0's and 1's)
    golden = make_golden_module()
    # WHEN loaded
    trace = load_trace(path)
    # THEN its content is the recording make_golden.py describes (each minor's rows after the older ones')
    assert trace.warnings == []
    assert (trace.header["version"], trace.header["minor"]) == (version, minor) and trace.header["host"] == "golden-host"
    assert [g.name for g in trace.gpus] == ["NVIDIA H200", "NVIDIA H200"]
    kv = 2 * len(golden.KV_BLOCKS) if minor >= 3 else 0
    n = 11 + (len(KINDS_2_2) if minor >= 2 else 0) + kv
    assert len(trace.events) == n and (np.diff(trace.events["ts"].astype(np.int64)) > 0).all()
    assert sorted(set(trace.events["kind"][11:n - kv].tolist())) == (KINDS_2_2 if minor >= 2 else [])
    export = trace.events[trace.events["kind"] == Kind.IPC_EXPORT]
    opened = trace.events[trace.events["kind"] == Kind.IPC_OPEN]
    assert export["ipc"][0].tobytes() == opened["ipc"][0].tobytes() == bytes(range(64))
    oom = trace.events[trace.events["result"] == 2]
    assert oom["api"].tolist() == [Api.cuMemAlloc_v2] and oom["gpu"].tolist() == [1]
    assert trace.processes[4243].rank == {"tp": 1}
    assert [m.phase for m in trace.markers] == ["begin", "instant", "end"]
    assert trace.keyframes[0].event_index == 8 and trace.lost == 3
    assert len(trace.nvml) == 2 and len(trace.procmem) == 2
    assert trace.trailer["reason"] == "SIGTERM" and trace.trailer["counts"]["events"] == n
    # AND (2.3) the stacks the events name are the frames make_golden.py wrote; older files have none
    stacks = {int(i): trace.stack(int(i)) for i in trace.event_columns["stack"]}
    if minor < 3:
        assert stacks == {0: None} and len(trace.stacks) == 0
        return
    ev = trace.events
    assert trace.stack(int(ev["stack"][1])) == golden.LOAD_STACK and ev["kind"][1] == Kind.ALLOC
    assert trace.stack(int(oom["stack"][0])) == golden.OOM_STACK
    assert [trace.stack(int(i)) for i in ev["stack"][ev["kind"] == Kind.TENSOR_ALLOC]] == [golden.TENSOR_STACK]
    kv_allocs = ev[n - kv:][ev["kind"][n - kv:] == Kind.ALLOC]
    assert len(kv_allocs) == len(golden.KV_BLOCKS) >= 2 and {trace.stack(int(i)) for i in kv_allocs["stack"]} == {golden.KV_STACK}
    assert set(stacks.values()) == {None, golden.LOAD_STACK, golden.OOM_STACK, golden.TENSOR_STACK, golden.KV_STACK}
    assert trace.trailer["stacks"] == len(trace.stacks) == 4
    assert (ev["stack"] == 0).sum() == n - 3 - len(golden.KV_BLOCKS)
    # AND its second keyframe is the state after the KV cache's allocations, in state version 3
    assert [k.event_index for k in trace.keyframes] == [8, n - len(golden.KV_BLOCKS)]
    assert trace.keyframes[1].state["v"] == 3 and trace.keyframes[1].state["allocs"]["form"] == "gaps"


@pytest.mark.parametrize("path", [GOLDEN, GOLDEN_V2_2], ids=["v2.3", "v2.2"])
def test_the_golden_2_2_trace_holds_the_new_kinds_header_and_trailer_keys(path):
    # GIVEN the committed golden trace of format 2.2 (and 2.3, which holds 2.2's additions too)
    # WHEN loaded
    trace = load_trace(path)
    # THEN every kind 2.2 added is there once, with its api
    ev = trace.events[11:11 + len(KINDS_2_2)]
    assert ev["kind"].tolist() == [Kind.ARRAY_CREATE, Kind.CTX_LIMIT, Kind.CAPTURE_BEGIN, Kind.GRAPH_ALLOC,
                                   Kind.GRAPH_FREE, Kind.CAPTURE_END, Kind.GRAPH_EXEC, Kind.GRAPH_TRIM,
                                   Kind.MULTICAST_CREATE, Kind.MULTICAST_ADD, Kind.MULTICAST_BIND,
                                   Kind.MULTICAST_UNBIND, Kind.ARRAY_DESTROY, Kind.TENSOR_ALLOC, Kind.TENSOR_FREE]
    assert ev["api"][ev["kind"] == Kind.TENSOR_ALLOC].tolist() == [Api.torch_malloc]
    assert ev["size"][ev["kind"] == Kind.ARRAY_CREATE].tolist() == [64 * 2**20]
    # AND the header's 2.2 keys: each GPU's resident threads, the recording id, the torch list
    assert [g.resident_threads for g in trace.gpus] == [132 * 2048] * 2
    assert trace.header["recording_id"] == "0123456789abcdef"
    assert [t["path"].rsplit("/", 1)[1] for t in trace.header["probes"]["torch"]] == ["libc10_cuda.so"]
    # AND the trailer's daemon counts
    assert trace.trailer["markers_dropped"] == {"budget": 0, "open_phases": 1, "disk": 0}
    assert (trace.trailer["processes_expired"], trace.trailer["process_reads_refused"]) == (2, 0)
    assert trace.trailer["torch"] == trace.header["probes"]["torch"]


def test_the_golden_2_3_trace_holds_stacks_records_and_a_chunk_in_the_context_transform():
    # GIVEN the committed golden trace of format 2.3, read record by record (not by the reader)
    objects = [obj for obj, _end in raw_objects(GOLDEN.read_bytes())]
    header = objects[0]
    names = [name for name, _dtype in header["columns"]["events"] if name != "ipc"]
    # WHEN each events chunk's column forms are read from its directory
    chunks = [obj for obj in objects if obj["type"] == "e"]
    used = [dict(zip(names, codec.transforms(key, chunk[key], len(names), MAX_RECORD_ROWS)))
            for chunk in chunks for key in (codec.ZSTD, codec.RAW_PAYLOAD) if key in chunk]
    # THEN the file spans several chunks, and in one (the KV cache's run of one process) the writer
    # chose the context transform for the pointers
    assert len(used) == len(chunks) >= 3
    assert [form["ptr"] for form in used].count(codec.CONTEXT) >= 1
    # AND the stacks are defined in several records, each before the first chunk naming its ids
    assert [obj["k0"] for obj in objects if obj["type"] == "stacks"] == [1, 2, 3, 4]
    defined = named = 0
    for obj in objects:
        if obj["type"] == "stacks":
            defined = obj["k0"] + len(obj["k"]) - 1
        elif obj["type"] == "e":
            named = max(named, int(fmt.decode_record(obj)["events"]["stack"].max()))
            assert named <= defined
    assert named == defined == 4
    # AND the interpreters the daemon found are in the header and the trailer
    assert header["probes"]["interpreters"] == objects[-1]["stacks_read"]["interpreters"]


def test_the_spec_example_reads_the_golden_trace_with_only_msgpack_numpy_and_zstandard(tmp_path):
    # GIVEN the Python example from docs/format.md
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text()
    example = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert "import memrec" not in example and "from memrec" not in example
    script = tmp_path / "example.py"
    # (and prints two columns it decoded: the golden's pointers are context-coded in one chunk)
    script.write_text(example + '\nfor name in ("ptr", "stack"):\n    print(name, *(int(v) for c, _ in events for v in c[name]))\n')
    # WHEN it runs on the golden trace
    out = subprocess.run([sys.executable, str(script), str(GOLDEN)], capture_output=True, text=True, timeout=60)
    # THEN it finds the same events as memrec
    assert out.returncode == 0, out.stderr
    trace = load_trace(GOLDEN)
    assert f"{len(trace.events)} events" in out.stdout
    assert f"{int(trace.events['size'].sum())} bytes" in out.stdout
    printed = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in out.stdout.splitlines()[1:]}
    assert printed == {"ptr": trace.events["ptr"].tolist(), "stack": trace.events["stack"].tolist()}


def test_gpu_ids_come_from_the_header_the_events_and_the_samples():
    from memrec.trace.model import Trace

    # GIVEN a header without NVML's list, events on GPUs 3 and 0 and on the host (-1), a sample of GPU 5
    ev = empty_events(4)
    ev["gpu"] = [3, -1, 0, 3]
    nvml = np.zeros(1, dtype=NVML_DTYPE)
    nvml["gpu"] = 5
    bare = Trace(header={"gpus": []}, events=ev)
    # THEN the GPUs are those named, sorted, the host left out
    assert bare.gpu_ids() == [0, 3]
    assert Trace(header={"gpus": []}, events=ev, nvml=nvml).gpu_ids() == [0, 3, 5]
    # AND a header's list counts even for a GPU no event names
    listed = Trace(header={"gpus": [{"index": 1, "uuid": None, "name": "X", "total": 1}]}, events=ev)
    assert listed.gpu_ids() == [0, 1, 3]
    assert Trace(header={"gpus": []}).gpu_ids() == []


@pytest.mark.parametrize("claimed", [0, 5, 600, 10**9, "many"])
def test_load_sizes_its_columns_from_the_trailer_but_never_trusts_it(tmp_path, claimed):
    # GIVEN 600 events in chunks of 128, and a trailer whose count is right, low, high or junk
    ev = synthetic_events(600)
    path = tmp_path / "t.mrec"
    with TraceWriter(path, HEADER, max_chunk_rows=128) as w:
        w.write_events(ev)
        w.trailer = lambda extra=None, w=w: {"type": "trailer", "counts": {"events": claimed}, "lost": 0}
    # WHEN loaded
    with TraceReader(path) as reader:
        hint = reader.expected_events()
    trace = load_trace(path)
    # THEN the hint is the trailer's plausible count, and the events are exactly those written,
    # as contiguous columns until the rows are asked for (the columns are then views of them)
    assert hint == (claimed if claimed in (5, 600) else 0)
    assert trace.event_columns["ts"].flags.c_contiguous and trace.n_events == 600
    np.testing.assert_array_equal(trace.events, ev)
    np.testing.assert_array_equal(trace.event_columns["size"], ev["size"])
    assert trace.event_columns["size"].base is not None and not trace.event_columns["size"].flags.c_contiguous


def test_a_trace_with_no_timed_record_says_so_rather_than_ts_none(tmp_path):
    # GIVEN a header followed by bytes that are no record (a damaged copy)
    path = tmp_path / "t.mrec"
    path.write_bytes(fmt.packb(fmt.make_header(host="h", boot_id="b")) + b"\x01\x02\x03")
    # WHEN loaded THEN the warning says no time was read (it said "trace ends at ts None")
    warnings = load_trace(path).warnings
    assert any("no trailer" in w for w in warnings) and not any("None" in w for w in warnings), warnings
    assert any("no record with a time was read" in w for w in warnings)
