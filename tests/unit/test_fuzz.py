"""Fuzzing, bounded for CI: damaged traces and hostile socket frames (issue 15).

Every reading command and the TUI's loading path must read a damaged file (with warnings) or
refuse it with exit code 65 and one line; no traceback, whatever the bytes. The daemon must keep
serving whatever a client sends. A longer coverage-guided run of the same checks:
``tests/fuzz/run_atheris.py`` (see docs/reliability.md).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
import tempfile
import time

import msgpack
import pytest
from hypothesis import HealthCheck
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from memrec.terms import protocol
from memrec.client import MarkerClient
from memrec.trace.reader import load_trace

from tests.fuzz import harness
from tests.unit.test_daemon_unit import make_daemon
from tests.unit.test_daemon_unit import pump

#: The golden trace in format 2.3 (what memrec writes: stacks records, a context-coded chunk, a
#: keyframe of state version 3), 2.2, 2.1, 2.0 and 1 (what it still reads).
GOLDENS = [os.path.join(os.path.dirname(__file__), "..", "data", f"golden_v{v}.mrec") for v in ("2_3", "2_2", "2_1", 2, 1)]
SEEDS = {path: harness.golden_records(path) for path in GOLDENS}
FUZZ = settings(max_examples=int(os.environ.get("MEMREC_FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=list(HealthCheck), derandomize="MEMREC_FUZZ_RANDOM" not in os.environ)

# Values that broke a reader once: edges of every integer width, escapes, deep nesting, wrong types.
EDGE_INTS = st.sampled_from([0, -1, 1, 2**15, 2**31 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)])
SCALARS = st.one_of(
    st.none(), st.booleans(), EDGE_INTS, st.integers(-(2**63), 2**64 - 1), st.floats(),
    st.text(max_size=20), st.just("\x1b]0;pwned\x07\x1b[2J"), st.binary(max_size=40),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.one_of(st.text(max_size=8), EDGE_INTS), inner, max_size=4)),
                      max_leaves=12)
DEEP = st.integers(40, 1000).map(lambda n: [[]] if n < 0 else _nest(n))


def _nest(n: int) -> list:
    out: list = []
    for _ in range(n):
        out = [out]
    return out


def _edit(records: list[dict]) -> st.SearchStrategy:
    """One edit of ``records``: a value replaced or deleted anywhere, or a made-up record added."""
    paths = [(i, p) for i, r in enumerate(records) for p in harness.key_paths(r)]
    return st.one_of(
        st.tuples(st.sampled_from(paths), st.one_of(VALUES, DEEP, st.just(harness.DELETE))).map(lambda t: (t[0][0], t[0][1], t[1])),
        st.tuples(st.just(len(records)), st.just([]),
                  st.dictionaries(st.sampled_from(["type", "n", "columns", "z", "ts", "state", "state_z", "name", "pid", "total"]),
                                  st.one_of(VALUES, st.sampled_from(["events", "nvml", "procmem", "marker", "keyframe", "lost", "trailer", "process"])),
                                  max_size=6)),
    )


EDITS = {path: _edit(records) for path, (_, records) in SEEDS.items()}


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as d:
        yield d


@pytest.mark.parametrize("golden", GOLDENS, ids=["v2.3", "v2.2", "v2.1", "v2.0", "v1"])
@FUZZ
@given(data=st.data())
def test_structurally_damaged_traces_never_crash_a_command_or_the_tui(golden, data, workdir):
    edits = data.draw(st.lists(EDITS[golden], min_size=1, max_size=4))
    header, records = SEEDS[golden]
    harness.check_trace_bytes(harness.edited_trace(header, records, edits), workdir)


@pytest.mark.parametrize("golden", GOLDENS, ids=["v2.3", "v2.2", "v2.1", "v2.0", "v1"])
@FUZZ
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 8))
def test_byte_damaged_traces_never_crash_a_command_or_the_tui(golden, seed, n, workdir):
    with open(golden, "rb") as f:
        data = f.read()
    harness.check_trace_bytes(harness.mutate(data, random.Random(seed), n), workdir)


def _chunk_payload(n: int, processes: int = 0) -> bytes:
    """The 2.1 payload of a chunk of ``n`` events (without its checksum), every form in use;
    with ``processes``, each process's pointers ascending from the end of its last block, so
    that 2.3's context columns are used too."""
    import numpy as np

    from memrec.terms.columns import EVENT_DTYPE
    from memrec.trace import codec
    from memrec.trace.chunks import EVENTS
    from memrec.trace.chunks import context

    rng = np.random.default_rng(n)
    ev = np.zeros(n, EVENT_DTYPE)
    for name in EVENT_DTYPE.names:
        if name != "ipc":
            ev[name] = rng.integers(0, 1000, n)
    ev["tid"] = ev["pid"]
    ev["size"] = ev["size"].astype(np.uint64) << np.uint64(21)
    if processes:
        ev["pid"] = rng.integers(0, processes, n)
        ev["kind"] = 1 + ev["pid"] % 2
        for p in range(processes):
            mine = ev["pid"] == p
            ev["ptr"][mine] = (p << 40) + np.cumsum(ev["size"][mine]) - ev["size"][mine]
        ev["gpu"] = ev["pid"] % 3
    index = np.arange(0, n, 2).astype("<u4")
    names = [name for name in EVENT_DTYPE.names if name != "ipc"]
    key, data = codec.encode_payload([np.ascontiguousarray(ev[name]) for name in names],
                                     index, b"".join(bytes([i % 3]) * 64 for i in range(len(index))),
                                     context(EVENTS, names))
    return data[:-4] if key == codec.RAW_PAYLOAD else codec.decompress(data, 1 << 24)


PAYLOADS = [_chunk_payload(n) for n in (1, 3, 9, 40, 300)] + [_chunk_payload(n, 5) for n in (9, 40, 300)]


@FUZZ
@given(which=st.integers(0, len(PAYLOADS) - 1), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4))
def test_a_damaged_payload_under_a_valid_checksum_is_refused_or_read(which, seed, n):
    # GIVEN a 2.1 chunk's payload (2.3's context columns in some) damaged and then given a
    # matching CRC-32 (a checksum catches
    # random damage; this checks the decoder behind it)
    import zlib

    from memrec.base.errors import TraceFormatError
    from memrec.terms.columns import EVENT_DTYPE
    from memrec.trace import codec

    payload = harness.mutate(PAYLOADS[which], random.Random(seed), n)
    data = payload + zlib.crc32(payload).to_bytes(4, "little")
    dtypes = [EVENT_DTYPE.fields[name][0] for name in EVENT_DTYPE.names if name != "ipc"]
    # WHEN decoded THEN it is read or refused with a TraceFormatError, nothing else
    try:
        codec.decode_payload(codec.RAW_PAYLOAD, data, None, dtypes, sparse=True, max_rows=65536)
    except TraceFormatError:
        pass


# ------------------------------------------------------------------------------ the socket

FRAME = st.one_of(
    st.binary(max_size=300),  # anything at all
    VALUES.map(lambda v: protocol.frame(msgpack.packb(v, use_bin_type=True))),
    st.dictionaries(st.sampled_from(["type", "name", "phase", "ts", "tid", "gpu", "values"]),
                    st.one_of(VALUES, DEEP, st.sampled_from(["mark", "ping", "subscribe", "begin", "end", "instant"])),
                    max_size=7).map(lambda m: protocol.frame(msgpack.packb(m, use_bin_type=True))),
)


@pytest.fixture(scope="module")
def daemon():
    import shutil

    d = tempfile.mkdtemp(prefix="mrf", dir="/tmp")
    daemon = make_daemon(__import__("pathlib").Path(d))
    daemon.start()
    yield daemon
    daemon.stop()
    shutil.rmtree(d, ignore_errors=True)


DEEP_FRAME = protocol.frame(b"\x81\xa4type" + b"\x91" * 1000 + b"\xc0")  # the frame that killed the daemon


@FUZZ
@given(frames=st.lists(FRAME, min_size=1, max_size=5))
@example(frames=[DEEP_FRAME])
def test_any_bytes_on_the_socket_leave_the_daemon_serving(frames, daemon):
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(daemon.config.socket_path))
    for data in frames:
        try:
            s.sendall(data)
        except OSError:  # the daemon closed the connection after a bad frame
            break
    pump(daemon, 0.005)
    s.close()
    before = daemon.markers_recorded
    assert MarkerClient(daemon.config.socket_path).mark("alive")
    deadline = time.monotonic() + 5
    while daemon.markers_recorded == before and time.monotonic() < deadline:  # a busy host: wait
        pump(daemon, 0.005)
    assert daemon.mood.value == "running"
    assert daemon.markers_recorded >= before + 1


def test_the_fuzzed_daemon_still_writes_a_readable_trace(daemon):
    # runs after the socket fuzzing above (same module-scoped daemon)
    daemon.writer.flush()
    trace = load_trace(daemon.files[0])
    assert any(m.name == "alive" for m in trace.markers)


# ------------------------------------------------------------------------------ found by the long run

CRASHES = sorted((Path(__file__).parent.parent / "data" / "fuzz").glob("*.mrec"))


@pytest.mark.parametrize("path", CRASHES, ids=[p.stem for p in CRASHES])
def test_inputs_the_long_fuzz_run_found_stay_fixed(path, workdir):
    """Each file here once failed the check (tests/fuzz/run_atheris.py found it); see its name."""
    harness.check_trace_bytes(path.read_bytes(), workdir)


# ------------------------------------------------------------------------------ bombs, damaged (issue 23)

def _bomb_seeds() -> dict[str, bytes]:
    from tests.fuzz import bombs

    return {"keyframe-zeros": bombs.keyframe_bomb(2, 64 << 20), "keyframe-empty-lists": bombs.keyframe_bomb(1, 16 << 20, True),
            "rows": bombs.rows_bomb(6)}


BOMB_SEEDS = _bomb_seeds()


@pytest.mark.parametrize("name", list(BOMB_SEEDS))
@pytest.mark.parametrize("seed", range(3))
def test_byte_damaged_bombs_never_crash_a_command_or_the_tui(name, seed, workdir):
    # (bench/reliability.py fuzz runs many more, with the golden traces too)
    harness.check_trace_bytes(harness.mutate(BOMB_SEEDS[name], random.Random(seed), 1 + seed), workdir)
