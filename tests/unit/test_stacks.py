"""Stacks in a trace (format 2.3): interning through the real writer, reading back, rotation parts,
merge, damaged and hostile ``stacks`` records, and traces without stacks unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.trace import format as fmt
from memrec.trace.format import packb
from memrec.engine.merge import merge_traces
from memrec.trace.reader import TraceReader
from memrec.trace.reader import load_trace
from memrec.trace.stacks import MAX_DEPTH
from memrec.trace.stacks import MAX_ENTRIES
from memrec.trace.stacks import STACKS
from memrec.trace.stacks import Frame
from memrec.trace.stacks import Unavailable
from memrec.trace.writer import TraceWriter
from tests.utils import GiB
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events

DATA = Path(__file__).resolve().parents[1] / "data"
WALL = 1_764_000_000 * 10**9

INIT = (Frame("/srv/sglang/custom_all_reduce.py", 123, "CustomAllreduce.__init__"),
        Frame("/srv/sglang/parallel_state.py", 310, "init_model_parallel_group"),
        Frame("/usr/lib/libc10_cuda.so", 0x1f2e0, "c10::cuda::CUDACachingAllocator::malloc", native=True))
LOAD = (Frame("/srv/sglang/model_runner.py", 88, "ModelRunner.load_model"),)
NO_PY = Unavailable("python 3.9: interpreter layout unknown")


def header(host: str = "h", boot: str = "boot-a", mono: int = 100 * 10**9, daemon: dict | None = None) -> dict:
    extra = {"daemon": daemon} if daemon else {}
    return fmt.make_header(host=host, boot_id=boot, anchor={"monotonic_ns": mono, "wall_ns": WALL},
                           gpus=[GpuInfo(0, "GPU-0", "NVIDIA H200", 140 * GiB)], **extra)


def write_with_stacks(path: Path, *, mono: int = 100 * 10**9, host: str = "h", boot: str = "boot-a",
                      stacks=(INIT, LOAD, NO_PY, INIT), daemon: dict | None = None) -> Path:
    """Allocations each with a stack (interned through the writer as the daemon does), then one without."""
    with TraceWriter(path, header(host, boot, mono, daemon)) as w:
        rows = []
        for i, stack in enumerate(stacks):
            sid = w.intern_stack(stack)
            rows.append(ev(Kind.ALLOC, ts=mono + (i + 1) * 10**6, pid=7, gpu=0, ptr=0x1000 * (i + 1), size=(i + 1) * MiB,
                           stack=sid))
        rows.append(ev(Kind.ALLOC, ts=mono + 10**8, pid=7, gpu=0, ptr=0x99000, size=MiB))
        w.write_events(events(*rows))
    return path


def stacks_of(trace) -> list:
    return [trace.stack(int(s)) for s in trace.event_columns["stack"]]


def test_stacks_round_trip_through_the_writer_and_reader(tmp_path):
    # GIVEN a trace whose allocations carry stacks: frames (Python and native), an unavailable one,
    # a repeated one, and an allocation with none
    trace = load_trace(write_with_stacks(tmp_path / "t.mrec"))
    # THEN each event's stack reads back as written; the unavailable one keeps its reason; none is None
    assert stacks_of(trace) == [INIT, LOAD, NO_PY, INIT, None]
    assert trace.warnings == []
    # AND a repeated stack has one id, defined once in the file
    ids = trace.event_columns["stack"].tolist()
    assert ids[0] == ids[3] != 0 and ids[4] == 0 and len(set(ids)) == 4
    assert len(trace.stacks) == 3 and trace.header["minor"] == 3 and trace.trailer["stacks"] == 3


def test_definitions_come_once_and_before_the_events_that_name_them(tmp_path):
    path = tmp_path / "t.mrec"
    with TraceWriter(path, header()) as w:
        first = w.intern_stack(INIT)
        w.write_events(events(ev(Kind.ALLOC, ts=10**9, pid=7, size=MiB, stack=first)))
        w.flush()
        # the same stack again, by frames and by the caller's own key, costs no new definition
        assert w.intern_stack(list(INIT)) == first == w.intern_stack(INIT, key=("bpf", 5)) == w.intern_stack((), key=("bpf", 5))
        second = w.intern_stack(LOAD)
        w.write_events(events(ev(Kind.ALLOC, ts=2 * 10**9, pid=7, size=MiB, stack=second)))
    types = [rec["type"] for rec in TraceReader(path).raw_records()]
    assert types == [STACKS, "e", STACKS, "e", "trailer"]
    raw = [rec for rec in TraceReader(path).raw_records() if rec["type"] == STACKS]
    # the second record defines only what is new: LOAD's two strings, its frame, its stack
    assert raw[1]["s0"] == len(raw[0]["s"]) and len(raw[1]["s"]) == 2 and raw[1]["f0"] == 3 and raw[1]["k0"] == 2


def test_every_rotated_part_reads_on_its_own(tmp_path):
    # GIVEN two parts of one recording, each written by its own writer as the daemon rotates
    # (the second part names INIT again, and first a stack the first part never had)
    daemon = {"pid": 4242, "version": "x", "part": 0, "opened_by": "t"}
    a = write_with_stacks(tmp_path / "a.mrec", stacks=(INIT, NO_PY), daemon=daemon)
    b = write_with_stacks(tmp_path / "b.mrec", mono=200 * 10**9, stacks=(LOAD, INIT), daemon={**daemon, "part": 1})
    # THEN each part alone resolves every stack its events name
    assert stacks_of(load_trace(a)) == [INIT, NO_PY, None]
    assert stacks_of(load_trace(b)) == [LOAD, INIT, None]
    # AND merging the parts keeps every event's stack, numbered once in the merged file
    out = tmp_path / "m.mrec"
    merge_traces([(str(p), load_trace(p)) for p in (a, b)], out)
    merged = load_trace(out)
    assert stacks_of(merged) == [INIT, NO_PY, None, LOAD, INIT, None]
    assert len(merged.stacks) == 3 and merged.warnings == []


def test_merge_of_two_hosts_remaps_colliding_stack_ids(tmp_path):
    # GIVEN two hosts whose files both number their first stack 1, for different stacks
    a = write_with_stacks(tmp_path / "a.mrec", host="node-a", boot="ba", stacks=(INIT,))
    b = write_with_stacks(tmp_path / "b.mrec", host="node-b", boot="bb", stacks=(LOAD, INIT))
    out = tmp_path / "m.mrec"
    merge_traces([(str(p), load_trace(p)) for p in (a, b)], out)
    merged = load_trace(out)
    by_pid: dict[int, list] = {}
    for pid, sid in zip(merged.event_columns["pid"].tolist(), merged.event_columns["stack"].tolist()):
        by_pid.setdefault(pid, []).append(merged.stack(sid))
    assert by_pid == {7: [INIT, None], 10_000_007: [LOAD, INIT, None]}


def write_raw(path: Path, *records: dict, sid: int = 1) -> Path:
    """A trace whose stacks records are written as given (damaged or hostile), then one event naming ``sid``."""
    with TraceWriter(path, header()) as w:
        for rec in records:
            w._emit(packb(rec))  # as a broken or hostile writer would: no checks
        w.write_events(events(ev(Kind.ALLOC, ts=200 * 10**9, pid=7, size=MiB, stack=sid)))
    return path


GOOD = {"type": STACKS, "s0": 0, "s": ["f.py", "g"], "f0": 0, "f": [0, 1, 1, 0], "k0": 1, "k": [[0]]}


@pytest.mark.parametrize("bad, why", [
    ({"type": STACKS, "s0": 0, "s": ["f.py"], "f0": 0, "f": [0, 1, 5, 0], "k0": 1, "k": [[0]]}, "string that is not defined"),
    ({"type": STACKS, "s0": 0, "s": ["f.py"], "f0": 0, "f": [0, 1, 0, 0], "k0": 1, "k": [[3]]}, "frame that is not defined"),
    ({"type": STACKS, "k0": 1, "k": [[1]]}, "frame that is not defined"),  # a stack naming itself: no cycle possible
    ({"type": STACKS, "k0": 1, "k": [7]}, "string that is not defined"),
    ({"type": STACKS, "s0": 0, "s": ["x"], "k0": 1, "k": [[0] * (MAX_DEPTH + 1)]}, f"at most {MAX_DEPTH}"),
    ({"type": STACKS, "s0": 0, "s": ["x"] * (MAX_ENTRIES + 1)}, f"at most {MAX_ENTRIES}"),
    ({"type": STACKS, "s0": 0, "s": "not a list"}, "s is not a list"),
    ({"type": STACKS, "s0": 0, "s": ["x" * 5000]}, "past 4096"),
    ({"type": STACKS, "f0": 0, "f": [0, 1, 0]}, "4 integers a frame"),
    ({"type": STACKS, "s0": -1, "s": ["x"]}, "s0 is not"),
    ({"type": STACKS, "s0": 2**40, "s": ["x"]}, "s0 is not"),
])
def test_a_damaged_or_hostile_stacks_record_is_skipped_with_a_warning(tmp_path, bad, why):
    # GIVEN a trace with one bad stacks record and an event naming stack 1
    trace = load_trace(write_raw(tmp_path / "t.mrec", bad))
    # THEN the record is skipped with a warning saying why, the event is kept and names no stack
    assert any(why in w for w in trace.warnings), trace.warnings
    assert trace.n_events == 1 and trace.stack(1) is None and len(trace.stacks) == 0


def test_a_record_that_defines_ids_again_is_skipped_and_the_first_definition_kept(tmp_path):
    again = {**GOOD, "s": ["other.py", "h"]}
    trace = load_trace(write_raw(tmp_path / "t.mrec", GOOD, again))
    assert trace.stack(1) == (Frame("f.py", 1, "g"),)
    assert any("defines a string id again" in w for w in trace.warnings)


def test_a_damaged_record_costs_only_what_names_it(tmp_path):
    # GIVEN a good record, a damaged one, then a good one naming only the first's ids
    later = {"type": STACKS, "k0": 3, "k": [[0, 0]]}
    trace = load_trace(write_raw(tmp_path / "t.mrec", GOOD, {"type": STACKS, "k0": 2, "k": [[9]]}, later, sid=3))
    assert trace.stack(1) == (Frame("f.py", 1, "g"),) and trace.stack(2) is None
    assert trace.stack(3) == (Frame("f.py", 1, "g"),) * 2


def test_stack_records_draw_from_the_read_budget(tmp_path, monkeypatch):
    # GIVEN many stack records in a small file (entries are charged as rows)
    recs = [{"type": STACKS, "s0": i * 1000, "s": ["a"] * 1000} for i in range(300)]
    path = write_raw(tmp_path / "t.mrec", *recs)
    # WHEN the budget allows 100,000 rows (the 300,000 strings need more)
    monkeypatch.setenv("MEMREC_READ_BUDGET", str(100_000 / (4 * path.stat().st_size)))
    trace = load_trace(path)
    # THEN the read stops there, with what came before kept
    assert any("stopped reading" in w and "more rows" in w for w in trace.warnings), trace.warnings


def test_the_writer_refuses_what_readers_would_skip(tmp_path):
    with TraceWriter(tmp_path / "t.mrec", header()) as w:
        with pytest.raises(ValueError, match="at most 512"):
            w.intern_stack([INIT[0]] * (MAX_DEPTH + 1))
        with pytest.raises(ValueError, match="at most 4096"):
            w.intern_stack([Frame("x" * 5000, 1, "f")])
        with pytest.raises(TypeError):
            w.intern_stack(["not a frame"])  # type: ignore[list-item]
        for _ in range(2):  # a frame whose second name is refused, twice: never kept half-defined
            with pytest.raises(ValueError, match="at most 4096"):
                w.intern_stack([Frame("ok.py", 1, "f" * 5000)])
        assert w.intern_stack(LOAD) == 1  # nothing half-defined was kept
        assert w.intern_stack([Frame("ok.py", 1, "g"), Frame("ok.py", 2, "f")]) == 2
    trace = load_trace(tmp_path / "t.mrec")
    assert trace.warnings == [] and trace.stack(2) == (Frame("ok.py", 1, "g"), Frame("ok.py", 2, "f"))


def test_a_live_subscriber_gets_the_definitions_so_far_in_one_record(tmp_path):
    from memrec.trace.records import TraceBuilder
    from memrec.trace.records import check_record
    from memrec.trace.records import deliver

    with TraceWriter(tmp_path / "t.mrec", header()) as w:
        ids = [w.intern_stack(s) for s in (INIT, NO_PY, LOAD)]
        w.flush()
        whole = w.stack_definitions()
    builder = TraceBuilder(header())
    deliver(*check_record(fmt.unpackb(packb(whole))), builder)
    trace = builder.finish()
    assert [trace.stack(i) for i in ids] == [INIT, NO_PY, LOAD]


@pytest.mark.parametrize("name", ["golden_v2_2.mrec", "golden_v2_1.mrec", "golden_v2.mrec", "golden_v1.mrec"])
def test_old_traces_read_with_no_stacks(name):
    trace = load_trace(DATA / name)
    assert len(trace.stacks) == 0 and not trace.event_columns["stack"].any()


def chunk_bytes(rows: np.ndarray, with_stack: bool) -> int:
    """The bytes the codec stores ``rows`` in, with or without the stack column in the schema."""
    from memrec.trace import codec

    names = [n for n in rows.dtype.names if n != "ipc" and (with_stack or n != "stack")]
    return len(codec.encode_payload([rows[n] for n in names])[1])


def alloc_rows(n: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return events(*(ev(Kind.ALLOC if i % 2 == 0 else Kind.FREE, pid=7, tid=7 + i % 3, gpu=0, ptr=int(p), size=int(s))
                    for i, (p, s) in enumerate(zip(rng.integers(1, 2**40, n), rng.integers(1, 2**30, n)))))


@pytest.mark.parametrize("n", [3, 200, 20_000])
def test_a_trace_without_stacks_costs_no_bytes_per_event(n):
    # GIVEN events without stacks, in a chunk of a few rows (a 200 ms flush) and in large ones
    rows = alloc_rows(n)
    # THEN the stack column costs no byte in a chunk: all zero, it is one clear bit of the present map
    assert chunk_bytes(rows, with_stack=True) == chunk_bytes(rows, with_stack=False)


def test_stacks_cost_a_byte_or_two_an_event():
    # GIVEN 20,000 events naming 300 distinct stacks at random (the worst order for the codec)
    rows = alloc_rows(20_000)
    rows["stack"] = np.random.default_rng(2).integers(1, 301, len(rows))
    extra = (chunk_bytes(rows, True) - chunk_bytes(rows, False)) / len(rows)
    # THEN the column costs 1-2 bytes an event (docs/format.md gives the measured figure)
    assert 0.5 < extra < 2, extra
