"""Keyframe columns: Zstandard now, zlib in older files; both restore, and a damaged one is refused."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from memrec.commands import main
from memrec.state import ALLOC_COLUMNS
from memrec.state import ALLOC_FIELDS
from memrec.state import LiveState
from memrec.state import alloc_rows
from memrec.trace import format as fmt
from memrec.trace.writer import TraceWriter
from memrec.terms.events import Kind
from tests.utils import GiB
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events


def held_state(n: int = 2000) -> LiveState:
    """``n`` live allocations of 3 processes on 2 GPUs (irregular pointers and sizes)."""
    rng = np.random.default_rng(3)
    state = LiveState()
    rows = [ev(Kind.ALLOC, pid=100 + i % 3, gpu=i % 2, ptr=(i + 1) << 24 | int(rng.integers(0, 1 << 12)) << 8,
               size=int(rng.integers(1, 64)) * MiB, ts=1000 + i) for i in range(n)]
    state.apply(events(*rows))
    return state


def as_zlib_columns(snap: dict) -> dict:
    """The same snapshot as memrec wrote it before the codec flag (version 2, zlib (level 1)
    columns, no ``z``, ``ptr`` as differences from the row before, ``ts`` as it is)."""
    from memrec.state.snapshot import alloc_arrays

    cols = alloc_arrays(snap["allocs"])
    order = np.lexsort((cols["ptr"], cols["pid"]))
    allocs = {"n": len(order)}
    for name, dt in ALLOC_COLUMNS.items():
        col = np.ascontiguousarray(cols[name][order], dtype=dt)
        if name == "ptr" and len(col):
            col[1:] = np.diff(col)
        allocs[name] = zlib.compress(col.tobytes(), 1)
    return {**snap, "v": 2, "allocs": allocs}


def trace_from(path, snap: dict):
    """A rotated file: its first keyframe holds everything, then one more allocation of 1 GiB."""
    with TraceWriter(path, fmt.make_header(host="h", boot_id="b")) as w:
        w.write_keyframe(5000, 0, snap)
        w.write_events(events(ev(Kind.ALLOC, pid=100, gpu=0, ptr=0x7_0000_0000_0000, size=GiB, ts=6000)))
    return path


def report(path, capsys) -> dict:
    assert main(["report", "--json", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_daemons_keyframe_columns_are_zstandard_and_restore_exactly():
    state = held_state()
    snap = state.snapshot()
    assert snap["allocs"]["z"] == "zstd" and all(snap["allocs"][k][:4] == b"\x28\xb5\x2f\xfd" for k in ALLOC_COLUMNS)
    assert snap["v"] == 3 and snap["allocs"]["form"] == "gaps"
    back = LiveState.from_snapshot(fmt.unpackb(fmt.packb(snap)))
    assert back.snapshot() == snap


def test_an_older_files_zlib_keyframe_reads_as_the_same_state(tmp_path, capsys):
    # GIVEN the same state in a keyframe of today (Zstandard columns) and of an older memrec (zlib)
    snap = held_state().snapshot()
    new = trace_from(tmp_path / "new.mrec", snap)
    old = trace_from(tmp_path / "old.mrec", as_zlib_columns(snap))
    # WHEN reported THEN both read alike, with what the keyframe held plus the later 1 GiB
    a, b = report(new, capsys), report(old, capsys)
    assert [g["final"] for g in a["gpus"]] == [g["final"] for g in b["gpus"]]
    rows = np.array(alloc_rows(snap)).reshape(-1, len(ALLOC_FIELDS))
    held0 = int(rows[rows[:, ALLOC_FIELDS.index("gpu")] == 0, ALLOC_FIELDS.index("size")].sum())
    assert a["gpus"][0]["final"]["bytes"] == held0 + GiB
    assert alloc_rows(as_zlib_columns(snap)) == alloc_rows(snap)


@pytest.mark.parametrize("damage", ["codec", "form", "count", "column"])
def test_a_damaged_keyframe_is_refused_not_inflated(damage):
    snap = held_state(200).snapshot()
    allocs = dict(snap["allocs"])
    if damage == "codec":
        allocs["z"] = "lz4"
    elif damage == "form":
        allocs["form"] = "deltas"  # a form this version does not know: refused, not misread
    elif damage == "count":
        allocs["n"] = 1 << 40  # a count its columns cannot hold: no 33 TB allocation
    else:
        allocs["size"] = allocs["size"][:-3]
    with pytest.raises(ValueError, match="malformed keyframe"):
        LiveState.from_snapshot({**snap, "allocs": allocs})
