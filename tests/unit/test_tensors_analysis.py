"""The report's tensors section (memrec.analysis.report.tensors) on hand-made events: blocks joined to
segments (a driver allocation, expandable segments' adjacent mappings), allocated vs reserved per
phase, fragmentation, and the blocks alive at a failed segment allocation."""

from __future__ import annotations

from memrec.analysis.report.tensors import tensor_section
from memrec.terms.columns import empty_events
from memrec.engine.phases import build_phases
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.terms.events import Marker

MiB = 1 << 20
PID = 42


def events(*rows):
    """(ts, kind, ptr, size[, result]) rows of pid PID on GPU 0."""
    ev = empty_events(len(rows))
    for i, row in enumerate(rows):
        ts, kind, ptr, size, *rest = row
        ev[i]["ts"], ev[i]["kind"], ev[i]["ptr"], ev[i]["size"] = ts, int(kind), ptr, size
        ev[i]["pid"], ev[i]["gpu"], ev[i]["ordinal"] = PID, 0, 0
        ev[i]["result"] = rest[0] if rest else 0
        ev[i]["api"] = int(Api.torch_malloc if kind == Kind.TENSOR_ALLOC else Api.NONE)
    return ev


def marker(ts, name, phase):
    return Marker(ts=ts, pid=PID, uid=0, tid=PID, name=name, phase=phase)


SEG = 0x7F0000000000
HEADER = {"probes": {"torch": [{"path": "/x/libc10_cuda.so", "attached": ["malloc", "free", "free"], "problem": ""}]}}


def test_phases_peaks_and_fragmentation_where_the_process_left_them():
    ev = events(
        (10, Kind.ALLOC, SEG, 20 * MiB),  # a caching-allocator segment
        (11, Kind.TENSOR_ALLOC, SEG, 4 * MiB),
        (12, Kind.TENSOR_ALLOC, SEG + 4 * MiB, 4 * MiB),
        (13, Kind.TENSOR_ALLOC, SEG + 8 * MiB, 1000),  # rounded to 1024 in the segment
        (14, Kind.TENSOR_FREE, SEG + 4 * MiB, 0),
        (30, Kind.TENSOR_ALLOC, SEG + 4 * MiB, 2 * MiB),  # in phase "step"
        (31, Kind.TENSOR_FREE, SEG, 0),
        (32, Kind.ALLOC, SEG + 64 * MiB, 2 * MiB),  # another driver allocation that never holds a block
    )
    phases = build_phases([marker(5, "load", "begin"), marker(20, "load", "end"), marker(25, "step", "begin"),
                           marker(40, "step", "end")])
    sec = tensor_section(ev, phases, 0, HEADER).to_json()
    assert sec["events"] == 6 and sec["unjoined_blocks"] == 0 and sec["libraries"] == HEADER["probes"]["torch"]
    load, step = sorted(sec["rows"], key=lambda r: r["phase"])
    assert (load["phase"], load["allocs"], load["frees"]) == ("load", 3, 1)
    assert load["peak_allocated"] == 8 * MiB + 1000 and load["peak_reserved"] == 20 * MiB
    # Left "load" with the blocks at 0 (4 MiB) and 8 MiB (1000 B): the free stretch 4-8 MiB is the largest.
    assert load["last"] == {"allocated": 4 * MiB + 1000, "reserved": 20 * MiB, "free": 16 * MiB - 1000,
                            "largest_free": 20 * MiB - (8 * MiB + 1024), "blocks": 2, "segments": 1}
    assert step["last"]["allocated"] == 2 * MiB + 1000 and step["last"]["reserved"] == 20 * MiB
    assert step["last"]["largest_free"] == 20 * MiB - (8 * MiB + 1024)
    assert step["last"]["blocks"] == 2


def test_expandable_segments_and_the_blocks_alive_at_a_failed_call():
    ev = events(
        (10, Kind.VMM_MAP, SEG, 20 * MiB),  # expandable segments: granules mapped side by side
        (11, Kind.VMM_MAP, SEG + 20 * MiB, 20 * MiB),
        (12, Kind.TENSOR_ALLOC, SEG, 30 * MiB),  # spans both mappings
        (13, Kind.TENSOR_ALLOC, SEG + 30 * MiB, 2 * MiB),
        (14, Kind.TENSOR_ALLOC, 0x1000, 512),  # in a segment from before the recording
        (20, Kind.VMM_CREATE, 0, 80 * MiB, 2),  # out of memory growing the segment
        (30, Kind.PROC_EXIT, 0, 0),
    )
    sec = tensor_section(ev, build_phases([]), 0, HEADER).to_json()
    assert sec["unjoined_blocks"] == 1
    (f,) = sec["failures"]
    assert f["size"] == 80 * MiB and f["pid"] == PID and f["gpu"] == 0
    assert f["state"] == {"allocated": 32 * MiB + 512, "reserved": 40 * MiB, "free": 8 * MiB - 512,
                          "largest_free": 8 * MiB, "blocks": 3, "segments": 1}
    assert [(b["ptr"], b["size"], b["segment"]) for b in f["largest"]] == [
        (SEG, 30 * MiB, SEG), (SEG + 30 * MiB, 2 * MiB, SEG + 20 * MiB), (0x1000, 512, None)]
    (row,) = sec["rows"]
    assert row["last"]["blocks"] == 3, "the snapshot at exit is taken before the exit drops the blocks"


def test_no_section_without_tensor_events_or_probed_installs():
    ev = events((10, Kind.ALLOC, SEG, MiB))
    assert tensor_section(ev, build_phases([]), 0, {"probes": {}}) is None
    without = {"probes": {"torch": [{"path": "/y/libc10_cuda.so", "attached": [], "problem": "no probes"}]}}
    assert tensor_section(ev, build_phases([]), 0, without).libraries[0].problem == "no probes"


def test_a_damaged_torch_list_is_shown_not_crashed_on(capsys, tmp_path):
    # GIVEN the golden 2.2 trace whose trailer's torch list is damaged (found by the fuzz test):
    # an entry without a path, one whose sites are not a list, one that is not a map
    from pathlib import Path

    import msgpack

    from memrec.commands import main
    from memrec.trace.format import packb

    golden = Path(__file__).resolve().parents[1] / "data" / "golden_v2_2.mrec"
    records = list(msgpack.Unpacker(golden.open("rb"), raw=False, strict_map_key=False))
    records[-1]["torch"] = [{"attached": ["pytorch:malloc"]}, {"path": "/z/libc10_cuda.so", "attached": 7, "problem": 3}, 5]
    path = tmp_path / "damaged.mrec"
    path.write_bytes(b"".join(packb(r) for r in records))
    # WHEN reported
    rc = main(["report", str(path)])
    # THEN the report is printed with what the entries hold
    out = capsys.readouterr().out
    assert rc == 0
    assert "probes: (no path) (1 sites)" in out and "probes: /z/libc10_cuda.so (0 sites)" in out


def test_the_section_is_the_same_a_chunk_of_rows_at_a_time(monkeypatch):
    # The selection goes a chunk of rows at a time (issue 26: 100M events in bounded memory):
    # chunks of 1 .. 3 rows, with a process whose tensor events come late (its segment first) and
    # a failed call, give the section of the whole.
    ev = events(
        (10, Kind.ALLOC, SEG, 20 * MiB),
        (11, Kind.TENSOR_ALLOC, SEG, 4 * MiB),
        (12, Kind.TENSOR_ALLOC, SEG + 4 * MiB, 4 * MiB),
        (14, Kind.TENSOR_FREE, SEG + 4 * MiB, 0),
        (20, Kind.ALLOC, 0, 80 * MiB, 2),
        (30, Kind.TENSOR_ALLOC, SEG + 4 * MiB, 2 * MiB),
        (31, Kind.TENSOR_FREE, SEG, 0),
        (40, Kind.PROC_EXIT, 0, 0),
    )
    ev["pid"][5:] = PID + 1  # a second process: its blocks in the first one's segment are unjoined
    phases = build_phases([marker(5, "load", "begin"), marker(13, "load", "end")])
    whole = tensor_section(ev, phases, 0, HEADER)
    assert whole.events == 5 and whole.failures and len(whole.rows) == 3
    for chunk in (1, 2, 3):
        monkeypatch.setattr("memrec.analysis.report.tensors.SELECT_CHUNK", chunk)
        assert tensor_section(ev, phases, 0, HEADER).to_json() == whole.to_json()
