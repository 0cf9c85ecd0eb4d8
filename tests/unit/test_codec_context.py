"""Trace format 2.3's context columns: a value predicted from the previous row of its own process.

The realistic mix (issue 26): many processes allocate at once, each process's pointers ascending
from the end of its last block, frees anywhere among its live blocks. Each test writes such
events with the real writer and reads them back with the real reader.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zlib

import msgpack
import numpy as np
import pytest

from memrec.base.errors import TraceFormatError
from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.events import Kind
from memrec.trace import codec
from memrec.trace import format as fmt
from memrec.trace.chunks import EVENTS
from memrec.trace.chunks import ChunkBuilder
from memrec.trace.chunks import context
from memrec.trace.chunks import decode_columns
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter

NAMES = [name for name in EVENT_DTYPE.names if name != "ipc"]
DTYPES = [EVENT_DTYPE.fields[name][0] for name in NAMES]
SIZES = np.array([512, 4096, 65536, 2 << 20, 20 << 20], np.uint64)


def busy_host(n: int, processes: int = 16, seed: int = 7) -> np.ndarray:
    """``n`` events of ``processes`` processes interleaved: allocations each right after the
    process's previous block (plus a gap), and every third event a free of one of its blocks."""
    rng = np.random.default_rng(seed)
    ev = np.zeros(n, EVENT_DTYPE)
    ev["ts"] = 10**12 + np.arange(n, dtype=np.uint64) * 25_000
    ev["pid"] = 1000 + rng.integers(0, processes, n)
    ev["tid"] = ev["pid"]
    ev["gpu"] = ev["pid"] % 8
    ev["ordinal"] = 0
    nxt = {p: 0x7F0000000000 + ((p - 1000) << 36) for p in range(1000, 1000 + processes)}
    held: dict[int, list[int]] = {p: [] for p in nxt}
    for i in range(n):
        p = int(ev["pid"][i])
        if i % 3 == 2 and held[p]:
            ev["kind"][i], ev["gpu"][i] = Kind.FREE, -1
            ev["ptr"][i] = held[p].pop(int(rng.integers(len(held[p]))))
            continue
        size = int(rng.choice(SIZES))
        ev["kind"][i], ev["size"][i], ev["ptr"][i] = Kind.ALLOC, size, nxt[p]
        held[p].append(nxt[p])
        nxt[p] += size + int(rng.integers(0, 64)) * 512
    return ev


def forms(wire: dict) -> dict[str, int]:
    """Each column's transform in one written chunk."""
    key = codec.ZSTD if codec.ZSTD in wire else codec.RAW_PAYLOAD
    return dict(zip(NAMES, codec.transforms(key, wire[key], len(NAMES), 65536)))


@pytest.mark.parametrize("n", [1, 2, 3, 17, 256, 257, 5000, 65536])
def test_a_busy_hosts_chunk_round_trips_exactly_with_its_pointers_in_context(n):
    # GIVEN a chunk of n events of 16 interleaved processes
    ev = busy_host(n)
    wire = ChunkBuilder(EVENTS, max_rows=n).append(ev)[0]
    # WHEN read back THEN every row is what was written
    np.testing.assert_array_equal(decode_columns(wire).to_array(), ev)
    # AND once the processes have rows enough, the pointers and GPUs are predicted per process
    # (with about one row each, a context column would cost more: the writer keeps the other form)
    if n >= 256:
        used = forms(wire)
        assert used["ptr"] == codec.CONTEXT and used["gpu"] == codec.CONTEXT


def test_context_columns_take_the_pointers_to_a_third_of_their_bytes():
    # GIVEN 65,536 events of 16 processes
    ev = busy_host(65536)
    columns = [np.ascontiguousarray(ev[name]) for name in NAMES]
    # WHEN encoded with and without the context transform
    _, with_context = codec.encode_payload(columns, context=context(EVENTS, NAMES))
    _, without = codec.encode_payload(columns)
    # THEN the chunk is less than half as large (measured: 2.9 against 6.9 bytes an event)
    assert len(with_context) < 0.5 * len(without)


def test_keys_spanning_more_than_a_radix_code_group_alike():
    # GIVEN keys whose spans multiply past 2^16 (pids far apart), and past it after factorising
    rng = np.random.default_rng(1)
    pid = rng.choice(np.array([1, 1 << 20, 1 << 40, 7], np.uint64), 5000)
    kind = rng.integers(0, 70000, 5000).astype(np.uint64)
    for keys in ([pid], [pid, kind]):
        grouped = codec.groups(keys)
        # THEN the rows come group after group in ascending key order, each group in row order
        ordered = np.stack([k[grouped.order] for k in keys], axis=1).tolist()
        assert ordered == sorted(ordered)
        assert [tuple(row) for row in np.stack(keys, axis=1)[grouped.order].tolist()] == [tuple(r) for r in ordered]
        assert grouped.starts.sum() == len({tuple(r) for r in ordered})
        for start, end in zip(grouped.heads, [*grouped.heads[1:], len(pid)]):
            assert (np.diff(grouped.order[start:end]) > 0).all()


def payload(ptr_entry: bytes, ptr_block: bytes, n: int = 3) -> bytes:
    """A hand-made 2.3 payload of three columns, pid (1, 2, 1), kind (1) and a ptr column, with its CRC-32."""
    body = bytes([n, 0, 0b111]) + bytes([0x81]) + bytes([0x00, 2]) + ptr_entry + bytes([1, 2, 1][:n]) + ptr_block
    return body + zlib.crc32(body).to_bytes(4, "little")


#: ptr as a context column on (pid, kind), no plus column, one byte per difference: groups
#: (1, 1) rows 0 and 2 and (2, 1) row 1, first values 100 and 500, then row 2 = 100 + 10.
GOOD_ENTRY = bytes([0xB1, 2, 0, 1, 0])
GOOD_BLOCK = bytes([200, 1, 232, 7, 20])


def decode(data: bytes, n: int = 3) -> list[np.ndarray]:
    return codec.decode_payload(codec.RAW_PAYLOAD, data, None, [np.dtype("<u4"), np.dtype("<u2"), np.dtype("<u8")],
                                sparse=False, max_rows=n)[1]


def test_a_hand_made_context_column_decodes_as_the_spec_says():
    pid, kind, ptr = decode(payload(GOOD_ENTRY, GOOD_BLOCK))
    assert pid.tolist() == [1, 2, 1] and kind.tolist() == [1, 1, 1] and ptr.tolist() == [100, 500, 110]


@pytest.mark.parametrize("entry,block,error", [
    (bytes([0xB1, 2, 0, 2, 0]), GOOD_BLOCK, "predicted from columns"),  # a key that is the column itself
    (bytes([0xB1, 1, 5, 0]), GOOD_BLOCK, "predicted from columns"),  # a key past it
    (bytes([0xB1, 0, 0]), GOOD_BLOCK, "predicted from columns"),  # no key
    (bytes([0xB1, 1, 0, 3]), GOOD_BLOCK, "predicted from columns"),  # plus: the column itself
    (bytes([0xB1, 1, 0, 9]), GOOD_BLOCK, "predicted from columns"),  # plus: no such column
    (GOOD_ENTRY, GOOD_BLOCK[:3], "ends inside"),  # the first values cut short
    (GOOD_ENTRY, GOOD_BLOCK[:4], "too few"),  # a difference missing
    (GOOD_ENTRY, GOOD_BLOCK + b"\x00", "past its"),  # a byte too many
])
def test_a_damaged_context_column_is_refused_with_a_clear_error(entry, block, error):
    with pytest.raises(TraceFormatError, match=error):
        decode(payload(entry, block))


def test_a_column_may_not_refer_to_a_context_column():
    # GIVEN a fourth column that is a reference to the context column, or predicted from it
    for fourth in (bytes([0xA1, 2]), bytes([0xB1, 1, 2, 0])):
        body = bytes([3, 0, 0b1111, 0x81, 0x00, 2]) + GOOD_ENTRY + fourth + bytes([1, 2, 1]) + GOOD_BLOCK + bytes([0, 0, 0])
        data = body + zlib.crc32(body).to_bytes(4, "little")
        # THEN refused: a context column is decoded after the others
        with pytest.raises(TraceFormatError, match="context column|predicted from"):
            codec.decode_payload(codec.RAW_PAYLOAD, data, None, [np.dtype("<u8")] * 4, sparse=False, max_rows=3)


def test_many_groups_cost_no_more_than_their_rows():
    # GIVEN a chunk of 65,536 rows each a group of its own (every pid distinct): every value a first one
    ev = busy_host(65536)
    ev["pid"] = np.arange(65536)
    wire = ChunkBuilder(EVENTS).append(ev)[0]
    # THEN it round-trips (the writer keeps whichever form is smaller)
    np.testing.assert_array_equal(decode_columns(wire).to_array(), ev)


def test_the_spec_example_reads_a_2_3_trace_with_context_columns(tmp_path):
    # GIVEN a 2.3 trace of a busy host: chunks of 3,000 rows and a flush's few rows
    ev = busy_host(6100)
    path = tmp_path / "busy.mrec"
    with TraceWriter(path, fmt.make_header(host="busy", boot_id="b"), max_chunk_rows=3000) as w:
        w.write_events(ev[:6000])
        w.flush()
        w.write_events(ev[6000:])
    with open(path, "rb") as f:
        assert next(msgpack.Unpacker(f, raw=False))["minor"] == 3
    # AND the docs' example, run on it
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text()
    example = tmp_path / "example.py"
    example.write_text(doc.split("```python\n", 1)[1].split("```", 1)[0])
    out = subprocess.run([sys.executable, str(example), str(path)], capture_output=True, text=True, timeout=120)
    # THEN it finds what memrec finds, pointers included
    assert out.returncode == 0, out.stderr
    trace = load_trace(path)
    assert trace.warnings == [] and len(trace.events) == 6100
    np.testing.assert_array_equal(trace.events, ev)
    assert f"{len(ev)} events, {int(ev['size'].sum())} bytes asked" in out.stdout


def test_a_context_column_of_no_rows_decodes_to_none():
    # GIVEN a chunk of 0 rows whose third column says context (keys: column 0, plus: column 0)
    body = bytes([0, 0, 0b100, 0xB0, 1, 0, 1])
    # THEN it decodes to empty columns (no scratch or group state from another chunk leaks in)
    cols = decode(body + zlib.crc32(body).to_bytes(4, "little"), n=0)
    assert [len(c) for c in cols] == [0, 0, 0]
