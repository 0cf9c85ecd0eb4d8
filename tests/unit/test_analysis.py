"""Timeline, phases and the report, on a small SGLang-like trace built by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

import memrec.engine.phases as phases_module
from memrec.engine.phases import NO_PHASE
from memrec.engine.phases import PhaseUsage
from memrec.engine.phases import attribute
from memrec.engine.phases import build_phases
from memrec.analysis.report.build import build_report
from memrec.analysis.text import human
from memrec.analysis.report.text import render_text
from memrec.engine.replay import build_timeline
from memrec.engine.replay import state_at
from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.state import LiveState
from memrec.state import alloc_rows
from memrec.trace.model import Keyframe
from memrec.trace.model import Trace
from tests.utils import GiB
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events
from tests.utils import handle_bytes


def ms(x: float) -> int:
    return int(x * 1_000_000)


def mark(t, pid, name, phase, **values):
    return Marker(ts=ms(t), pid=pid, uid=0, tid=pid, name=name, phase=phase, values=values)


def sglang_events() -> np.ndarray:
    """tp0 (pid 100, GPU 0) loads weights, exports a buffer to tp1 (pid 200, GPU 1), OOMs sizing
    its KV cache, then allocates a smaller one; tp1 exits holding its memory."""
    return events(
        ev(Kind.ALLOC, pid=100, ptr=0x1000, size=GiB, gpu=0, ts=ms(15)),
        ev(Kind.ALLOC, pid=100, ptr=0x20000000, size=10 * GiB, gpu=0, ts=ms(25)),
        ev(Kind.ALLOC, pid=200, ptr=0xA000, size=10 * GiB, gpu=1, ts=ms(30)),
        ev(Kind.VMM_CREATE, pid=100, size=2 * GiB, handle=0x11, gpu=0, ts=ms(35)),
        ev(Kind.VMM_MAP, pid=100, ptr=0x7000000000, size=2 * GiB, handle=0x11, ts=ms(36)),
        ev(Kind.FREE, pid=100, ptr=0x1000, ts=ms(42)),
        ev(Kind.IPC_EXPORT, pid=100, ptr=0x20000000, gpu=0, ipc=handle_bytes(1), ts=ms(55)),
        ev(Kind.IPC_OPEN, pid=200, ptr=0xB0000, gpu=1, ipc=handle_bytes(1), ts=ms(56)),
        ev(Kind.ALLOC, pid=100, ptr=0, size=20 * GiB, gpu=0, result=2, tid=101, ts=ms(65)),
        ev(Kind.ALLOC, pid=100, ptr=0x3000, size=5 * GiB, gpu=0, ts=ms(66)),
        ev(Kind.HOST_ALLOC, pid=200, ptr=0x5000, size=GiB, ts=ms(70)),
        ev(Kind.PROC_EXIT, pid=200, ts=ms(80)),
    )


def sglang_markers() -> list[Marker]:
    return [
        mark(10, 100, "load_model", "begin"),
        mark(20, 100, "load_weights", "begin"),
        mark(40, 100, "load_weights", "end", weights_gb=10.0),
        mark(45, 100, "available", "instant", available=70 * GiB),
        mark(50, 100, "load_model", "end"),
        mark(60, 100, "init_kv", "begin", mem_fraction_static=0.9),
    ]


def sglang_trace() -> Trace:
    nvml = np.zeros(3, dtype=NVML_DTYPE)
    nvml["gpu"] = 0
    nvml["ts"] = [ms(10), ms(67), ms(90)]
    nvml["used"] = [GiB, 18 * GiB, 17 * GiB + 512 * MiB]
    nvml["reserved"] = [600 * MiB, 600 * MiB, 615 * MiB]
    nvml["total"] = 140 * GiB
    nvml["free"] = -1
    nvml["bar1_used"] = -1
    nvml["bar1_total"] = -1
    procmem = np.zeros(2, dtype=PROCMEM_DTYPE)
    procmem["ts"] = [ms(20), ms(90)]
    procmem["gpu"] = 0
    procmem["pid"] = 100
    procmem["used"] = [GiB, 17 * GiB + 256 * MiB]
    return Trace(
        header={
            "host": "h200",
            "anchor": {"monotonic_ns": ms(5), "wall_ns": 0},
            "gpus": [
                {"index": 0, "uuid": "GPU-0000", "name": "NVIDIA H200", "total": 140 * GiB},
                {"index": 1, "uuid": "GPU-1111", "name": "NVIDIA H200", "total": 140 * GiB},
            ],
        },
        events=sglang_events(),
        nvml=nvml,
        procmem=procmem,
        markers=sglang_markers(),
        processes={
            100: ProcessInfo(100, 1, ["/usr/bin/python3", "-m", "sglang.launch_server"], None, "0", [0], ms(1), {"tp": 0}),
            200: ProcessInfo(200, 1, ["/usr/bin/python3", "-m", "sglang.launch_server"], None, "1", [1], ms(1), {"tp": 1}),
        },
        lost=3,
        trailer={"type": "trailer", "end_ts": ms(100)},
        warnings=["truncated tail: 12 bytes skipped"],
    )


# ------------------------------------------------------------------------------------------ timeline


def test_timeline_steps_per_gpu_by_category_and_pid():
    # GIVEN the SGLang-like events
    # WHEN replayed into a timeline
    tl = build_timeline(sglang_events())
    g0, g1 = tl.gpus[0], tl.gpus[1]
    # THEN GPU 0 steps once per event that changed it (the failed call changes nothing)
    assert g0.ts.tolist() == [ms(15), ms(15), ms(25), ms(35), ms(42), ms(66)]
    assert g0.total().tolist() == [0, GiB, 11 * GiB, 13 * GiB, 12 * GiB, 17 * GiB]
    assert g0.by_category()["vmm"].tolist() == [0, 0, 0, 2 * GiB, 2 * GiB, 2 * GiB]
    assert g0.peak() == (17 * GiB, ms(66), 5)
    # AND GPU 1's mapped view is kept apart from its owned total; the exit is one step
    assert g1.ts.tolist() == [ms(15), ms(30), ms(56), ms(80)]
    assert g1.total().tolist() == [0, 10 * GiB, 10 * GiB, 0]
    assert g1.by_category()["ipc_mapped"].tolist() == [0, 0, 10 * GiB, 0]
    assert g1.by_pid(categories=None)[200].tolist() == [0, 10 * GiB, 20 * GiB, 0]
    # AND the host series holds the pinned memory
    assert tl.gpus[-1].total().tolist() == [0, GiB, 0]
    # AND lookups by time see every event at or before it
    assert g0.at(ms(41)) == 13 * GiB and g0.at(ms(42)) == 12 * GiB and g0.at(0) == 0


def test_timeline_continued_from_a_keyframe_matches_the_full_replay():
    # GIVEN a keyframe taken after the first 5 events
    arr = sglang_events()
    first = LiveState()
    first.apply(arr[:5])
    snap = first.snapshot()
    # WHEN the rest is replayed from the restored keyframe
    rest = build_timeline(arr[5:].copy(), state=LiveState.from_snapshot(snap, journal=True))
    full = build_timeline(sglang_events())
    # THEN the series agree from there on, and the initial row is the keyframe's state
    assert rest.gpus[0].total().tolist() == [13 * GiB, 12 * GiB, 17 * GiB]
    assert rest.gpus[0].total()[-1] == full.gpus[0].total()[-1]
    assert rest.state.snapshot() == full.state.snapshot()


def test_state_at_uses_the_latest_keyframe():
    # GIVEN a keyframe after 5 events whose state was altered (so using it is visible)
    arr = sglang_events()
    s = LiveState()
    s.apply(arr[:5])
    snap = s.snapshot()
    snap["allocs"] = alloc_rows(snap)  # as rows (ALLOC_FIELDS, stride 6): a keyframe may hold either
    snap["allocs"][8] += 1  # one byte more on the 10 GiB allocation
    # WHEN the state after 7 events is asked for
    got = state_at(arr, 7, [Keyframe(ts=ms(36), event_index=5, state=snap)])
    # THEN it starts from the keyframe and replays the rest
    assert got.owned_bytes(gpu=0) == 12 * GiB + 1
    assert state_at(arr, 7).owned_bytes(gpu=0) == 12 * GiB


def test_state_at_skips_a_keyframe_of_another_format():
    # GIVEN a keyframe whose state is not a LiveState snapshot
    arr = sglang_events()
    kf = Keyframe(ts=ms(36), event_index=5, state={"allocations": [[100, 0, 0x1000, 1]]})
    # WHEN the state after 7 events is asked for
    got = state_at(arr, 7, [kf])
    # THEN it is replayed from the start instead
    assert got.owned_bytes(gpu=0) == 12 * GiB and got.n_events == 7


def test_timeline_stops_see_the_state_before_each_stop():
    # GIVEN a stop at the failed call (index 8)
    seen = {}
    # WHEN replayed with stops
    build_timeline(sglang_events(), stops=[8, 9], at_stop=lambda i, st, _changes: seen.update({i: st.owned_bytes(gpu=0)}))
    # THEN each callback saw the state just before its event
    assert seen == {8: 12 * GiB, 9: 12 * GiB}


# -------------------------------------------------------------------------------------------- phases


def test_phases_nest_and_unclosed_ones_end_at_trace_end():
    # GIVEN the markers of tp0
    ph = build_phases(sglang_markers(), end_ts=ms(100))
    # THEN three phases nest as recorded
    assert [(p.path, p.depth, p.parent, p.start, p.end, p.closed) for p in ph.phases] == [
        ("load_model", 0, -1, ms(10), ms(50), True),
        ("load_model/load_weights", 1, 0, ms(20), ms(40), True),
        ("init_kv", 0, -1, ms(60), ms(100), False),
    ]
    # AND end-marker values are merged in; instants know their phase
    assert ph.phases[1].values == {"weights_gb": 10.0}
    assert [(i.name, i.phase) for i in ph.instants] == [("available", 0)]
    assert ph.warnings == []


def test_an_end_closes_its_own_begin_and_a_phase_begun_inside_goes_on_one_level_up():
    # GIVEN A ⊃ B where A ends first, then an end without a begin
    ph = build_phases(
        [mark(1, 7, "A", "begin"), mark(2, 7, "B", "begin"), mark(3, 7, "A", "end"), mark(4, 7, "C", "end")],
        end_ts=ms(10),
    )
    # THEN A closes alone; B goes on as "B" until the trace's end (a second piece), both problems warned
    assert [(p.name, p.path, p.start, p.end, p.closed, p.resumes) for p in ph.phases] == [
        ("A", "A", ms(1), ms(3), True, -1), ("B", "A/B", ms(2), ms(3), False, -1), ("B", "B", ms(3), ms(10), False, 1)]
    assert len(ph.warnings) == 2 and "'B' goes on as 'B'" in ph.warnings[0] and "without a begin" in ph.warnings[1]


def test_issue_16_overlapping_unclosed_markers_give_one_answer_at_every_time():
    # GIVEN the issue's case on one process: A-begin t=10, B-begin t=20, A-end t=30, B never closed
    ph = build_phases([mark(10, 1, "A", "begin"), mark(20, 1, "B", "begin"), mark(30, 1, "A", "end")], end_ts=ms(50))
    # THEN both are open at 25 ("A/B"), B alone at 40 ("B"), nothing before 10
    assert ph.label_at(1, ms(25)) == "A/B"
    assert ph.label_at(1, ms(40)) == "B"
    assert ph.label_at(1, ms(5)) == NO_PHASE
    assert ph.label_at(1, ms(15)) == "A"


def test_phase_of_an_event_is_the_innermost_open_one_of_its_own_process():
    # GIVEN phases of pid 1, one ending where the next begins
    ph = build_phases(
        [mark(1, 1, "X", "begin"), mark(2, 1, "Y", "begin"), mark(3, 1, "Y", "end"), mark(5, 1, "X", "end"),
         mark(5, 1, "Z", "begin")],
        end_ts=ms(9),
    )
    pids = np.array([1, 1, 1, 1, 1, 1, 2])
    ts = np.array([ms(0.5), ms(1), ms(2.5), ms(3), ms(5), ms(9), ms(2.5)])
    # THEN begins are inclusive, ends exclusive, and another process is in no phase
    assert ph.assign(pids, ts).tolist() == [-1, 0, 1, 0, 2, 2, -1]
    assert ph.label(-1) == NO_PHASE and ph.label(1) == "X/Y"


def test_bytes_are_attributed_to_the_phase_of_the_process_that_made_them():
    # GIVEN the replay's journal and tp0's phases
    tl = build_timeline(sglang_events())
    ph = build_phases(sglang_markers(), end_ts=ms(100))
    # WHEN attributed
    usage = attribute(ph, tl.journal)
    # THEN tp0's allocations land in its phases and tp1 (no markers) in (no phase), exit included
    assert usage == [
        PhaseUsage(phase=-1, pid=200, gpu=-1, category="host_pinned", allocated=GiB, freed=GiB),
        PhaseUsage(phase=0, pid=100, gpu=0, category="driver", allocated=GiB, freed=GiB),
        PhaseUsage(phase=1, pid=100, gpu=0, category="driver", allocated=10 * GiB, freed=0),
        PhaseUsage(phase=1, pid=100, gpu=0, category="vmm", allocated=2 * GiB, freed=0),
        PhaseUsage(phase=2, pid=100, gpu=0, category="driver", allocated=5 * GiB, freed=0),
        PhaseUsage(phase=-1, pid=200, gpu=1, category="driver", allocated=10 * GiB, freed=10 * GiB),
        PhaseUsage(phase=-1, pid=200, gpu=1, category="ipc_mapped", allocated=10 * GiB, freed=10 * GiB),
    ]


def test_attribution_a_few_rows_at_a_time_gives_the_same_usage(monkeypatch):
    # GIVEN the same journal and phases, attributed whole
    tl = build_timeline(sglang_events())
    ph = build_phases(sglang_markers(), end_ts=ms(100))
    whole = attribute(ph, tl.journal)
    # WHEN attributed two rows at a time (groups split across chunks, merged after)
    monkeypatch.setattr(phases_module, "ATTRIBUTE_CHUNK", 2)
    # THEN the usage is the same, in the same order
    assert attribute(ph, tl.journal) == whole


# -------------------------------------------------------------------------------------------- report


def test_report_numbers_are_exact():
    # GIVEN the SGLang-like trace
    # WHEN reported
    r = build_report(sglang_trace()).to_json()
    # THEN the trace summary flags lost events and reader warnings
    tr = r["trace"]
    assert (tr["start_ts"], tr["end_ts"], tr["events"], tr["failed_calls"], tr["lost"]) == (ms(5), ms(100), 12, 1, 3)
    assert tr["warnings"] == ["truncated tail: 12 bytes skipped"] and tr["complete"] is True
    g0, g1 = r["gpus"]
    # AND GPU 0's peak is the 17 GiB after the KV cache, all tp0's, at 66 ms
    assert (g0["gpu"], g0["name"], g0["uuid"], g0["total"]) == (0, "NVIDIA H200", "GPU-0000", 140 * GiB)
    # (what was held at the peak, by the phase that allocated it, adds up to the peak)
    assert sum(x["bytes"] for x in g0["peak"].pop("by_phase")) == 17 * GiB
    assert g0["peak"] == {
        "bytes": 17 * GiB, "ts": ms(66), "t_s": 0.061,
        "by_category": {"driver": 15 * GiB, "vmm": 2 * GiB}, "by_pid": [{"pid": 100, "bytes": 17 * GiB}],
    }
    assert g0["final"]["bytes"] == 17 * GiB
    assert [(c["category"], c["peak"], c["final"]) for c in g0["categories"]] == [
        ("driver", 15 * GiB, 15 * GiB), ("vmm", 2 * GiB, 2 * GiB),
    ]
    (p,) = g0["processes"]
    assert (p["pid"], p["rank"], p["peak"], p["final"], p["nvml_used"]) == (100, "tp0", 17 * GiB, 17 * GiB, 17 * GiB + 256 * MiB)
    # AND phases on GPU 0 carry net bytes per category
    assert [(x["path"], x["by_category"], x["net"]) for x in g0["phases"]] == [
        ("load_model", {"driver": 0}, 0),
        ("load_model/load_weights", {"driver": 10 * GiB, "vmm": 2 * GiB}, 12 * GiB),
        ("init_kv", {"driver": 5 * GiB}, 5 * GiB),
    ]
    # AND the OOM shows who held what on GPU 0 at that instant
    (f,) = g0["failures"]
    assert (f["pid"], f["tid"], f["api"], f["size"], f["result_name"], f["gpu"], f["gpu_inferred"]) == (
        100, 101, "cuMemAlloc_v2", 20 * GiB, "CUDA_ERROR_OUT_OF_MEMORY", 0, False,
    )
    assert f["owned_on_gpu"] == 12 * GiB and f["mapped_on_gpu"] == 0
    assert [(h["pid"], h["owned"], h["by_category"]) for h in f["holders"]] == [
        (100, 12 * GiB, {"driver": 10 * GiB, "vmm": 2 * GiB}),
    ]
    assert [(x["size"], x["category"], x["api"]) for x in f["largest"]] == [
        (10 * GiB, "driver", "cuMemAlloc_v2"), (2 * GiB, "vmm", "cuMemCreate"),
    ]
    # AND NVML sits beside it, with what the probes did not see
    assert g0["nvml"] == {
        "samples": 3, "total": 140 * GiB, "last_ts": ms(90), "last_t_s": 0.085,
        "last_used": 17 * GiB + 512 * MiB, "last_reserved": 615 * MiB,
        "peak_used": 18 * GiB, "peak_used_ts": ms(67), "peak_used_t_s": 0.062, "peak_reserved": 615 * MiB,
        "traced_at_last": 17 * GiB, "untraced_at_last": 512 * MiB,
    }
    # AND GPU 1: tp1's own memory and its mapped view of tp0's buffer, both held at exit
    assert (g1["peak"]["bytes"], g1["final"]["bytes"]) == (10 * GiB, 0)
    (p1,) = g1["processes"]
    assert (p1["peak"], p1["mapped_peak"], p1["held_at_exit"], p1["exit_ts"]) == (10 * GiB, 10 * GiB, 10 * GiB, ms(80))
    (held,) = g1["held_at_exit"]
    assert (held["pid"], held["owned"], held["mapped"], held["count"]) == (200, 10 * GiB, 10 * GiB, 2)
    assert held["by_category"] == {"driver": 10 * GiB, "ipc_mapped": 10 * GiB}
    assert g1["nvml"] is None and g1["failures"] == []
    # AND the host section holds the pinned memory
    assert r["host"]["peak"]["bytes"] == GiB and r["host"]["held_at_exit"][0]["owned"] == GiB
    # AND the whole report survives JSON unchanged
    assert json.loads(json.dumps(r)) == r


def test_report_text_has_the_expected_lines():
    # GIVEN the report of the SGLang-like trace
    text = render_text(build_report(sglang_trace()), width=1000, show_all=True)
    lines = text.splitlines()
    # THEN the warnings come first and each GPU has its header, peak, NVML and tables
    assert lines[4] == "memrec report"
    assert "  !! LOST EVENTS: 3 events were dropped while recording; the numbers below miss them" in lines[4:9]
    assert "  !! reader warning: truncated tail: 12 bytes skipped" in lines[4:10]
    assert "GPU 0  NVIDIA H200  GPU-0000  140.00 GiB total" in lines
    assert "  peak traced   17.00 GiB at +0.061s    final traced   17.00 GiB" in lines
    assert "  NVML used     last 17.50 GiB, peak 18.00 GiB at +0.062s; reserved last 615.0 MiB, peak 615.0 MiB" in lines
    assert "  driver    15.00 GiB  +0.061s  15.00 GiB  cuMemAlloc*" in lines
    assert any(line.split()[:5] == ["100", "tp0", "17.00", "GiB", "+0.061s"] for line in lines)
    assert "    +0.060s  100  0    cuMemAlloc_v2  20.00 GiB  CUDA_ERROR_OUT_OF_MEMORY" in lines
    assert "          pid 100 tp0 python3 -m sglang.launch_server: 12.00 GiB owned (driver 10.00 GiB, vmm 2.00 GiB)" in lines
    assert "            largest: 10.00 GiB driver 0x20000000; 2.00 GiB vmm handle 0x11" in lines
    assert any(line.split()[:2] == ["100", "load_model/load_weights"] for line in lines)
    assert "  held at exit (freed implicitly when the process exited)" in lines
    assert any("10.00 GiB ipc_mapped 0xb0000 from pid 100" in line for line in lines)
    assert any(line.split()[:3] == ["200", "init_kv", "(unclosed)"] for line in lines) is False
    assert any(line.split()[:3] == ["100", "init_kv", "(unclosed)"] for line in lines)
    # AND the text is deterministic
    assert render_text(build_report(sglang_trace()), width=1000, show_all=True) == text


def test_report_filters_by_gpu_and_by_pid():
    # WHEN only GPU 1 is asked for
    r = build_report(sglang_trace(), gpu=1).to_json()
    # THEN only its section is there
    assert [g["gpu"] for g in r["gpus"]] == [1] and r["host"] is None
    # WHEN only pid 200 is asked for
    r = build_report(sglang_trace(), pid=200).to_json()
    # THEN GPU 0 (where it held nothing) is left out, and its host memory stays
    assert [g["gpu"] for g in r["gpus"]] == [1]
    assert [p["pid"] for p in r["processes"]] == [200]
    assert r["host"]["processes"][0]["pid"] == 200 and r["phases"] == []
    # WHEN pid 100 is asked for
    r = build_report(sglang_trace(), pid=100).to_json()
    # THEN its peak on GPU 0 is its own series
    assert [g["gpu"] for g in r["gpus"]] == [0] and r["gpus"][0]["peak"]["bytes"] == 17 * GiB


def test_failed_call_without_a_gpu_gets_its_process_gpu_or_is_listed_apart():
    # GIVEN failed allocs with no GPU: one of a process seen on GPU 1, one of an unknown process
    trace = Trace(
        header={},
        events=events(
            ev(Kind.ALLOC, pid=1, ptr=0x1000, size=MiB, gpu=1),
            ev(Kind.ALLOC, pid=1, size=GiB, result=2),
            ev(Kind.ALLOC, pid=9, size=GiB, result=2),
        ),
    )
    # WHEN reported
    report = build_report(trace)
    r = report.to_json()
    # THEN the first is on GPU 1 (inferred) with holders, the second listed apart
    (f,) = r["gpus"][0]["failures"]
    assert (f["gpu"], f["gpu_inferred"], f["owned_on_gpu"]) == (1, True, MiB)
    assert [x["pid"] for x in r["failures_unknown_gpu"]] == [9]
    assert "holders" not in r["failures_unknown_gpu"][0]
    text = render_text(report, width=1000, show_all=True)
    assert "failed calls on an unknown GPU" in text and "(GPU n? = the call named no GPU" in text


def test_each_failure_sees_the_state_at_its_own_instant():
    # GIVEN two OOMs on GPU 0 with an allocation between them, and a third right after the second
    trace = Trace(
        header={},
        events=events(
            ev(Kind.ALLOC, pid=1, ptr=0x1000, size=GiB, gpu=0),
            ev(Kind.ALLOC, pid=1, size=8 * GiB, gpu=0, result=2),
            ev(Kind.ALLOC, pid=2, ptr=0x1000, size=2 * GiB, gpu=0),
            ev(Kind.ALLOC, pid=1, size=8 * GiB, gpu=0, result=2),
            ev(Kind.ALLOC, pid=1, size=4 * GiB, gpu=0, result=2),
        ),
    )
    # WHEN reported
    fs = build_report(trace).to_json()["gpus"][0]["failures"]
    # THEN each failed call has the holders of its own instant
    assert [f["owned_on_gpu"] for f in fs] == [GiB, 3 * GiB, 3 * GiB]
    assert [[h["pid"] for h in f["holders"]] for f in fs] == [[1], [2, 1], [2, 1]]


def test_a_rotated_file_starts_from_its_keyframe_at_event_0():
    # GIVEN a previous file's state: pid 1 holds 2 GiB, pid 5 exited, a free was unmatched
    before = LiveState()
    before.apply(
        events(
            ev(Kind.ALLOC, pid=1, ptr=0x1000, size=2 * GiB, gpu=0),
            ev(Kind.ALLOC, pid=5, ptr=0x1000, size=GiB, gpu=0),
            ev(Kind.PROC_EXIT, pid=5),
            ev(Kind.FREE, pid=1, ptr=0x9999),
        )
    )
    # AND a new file that starts with that keyframe and frees pid 1's memory
    trace = Trace(
        header={},
        events=events(ev(Kind.ALLOC, pid=1, ptr=0x2000, size=GiB, gpu=0, ts=10_000), ev(Kind.FREE, pid=1, ptr=0x1000)),
        keyframes=[Keyframe(ts=9_000, event_index=0, state=before.snapshot())],
    )
    # WHEN reported
    r = build_report(trace).to_json()
    g0 = r["gpus"][0]
    # THEN the file's series start from the inherited 2 GiB, nothing is an anomaly of this file,
    # and the earlier exit is not this file's
    assert (g0["peak"]["bytes"], g0["final"]["bytes"]) == (3 * GiB, GiB)
    assert r["trace"]["anomalies"] == {} and g0["held_at_exit"] == []
    assert [p["pid"] for p in r["processes"]] == [1]


def test_a_foreign_keyframe_at_event_0_is_ignored_with_a_warning():
    # GIVEN a keyframe at event 0 that is not a LiveState snapshot
    trace = Trace(header={}, events=events(ev(Kind.ALLOC, pid=1, ptr=0x2000, size=GiB, gpu=0)),
                  keyframes=[Keyframe(ts=0, event_index=0, state={"allocations": []})])
    # WHEN reported
    r = build_report(trace).to_json()
    # THEN the replay starts empty and says so
    assert r["gpus"][0]["final"]["bytes"] == GiB
    assert any("keyframe at the start" in w for w in r["trace"]["warnings"])


def test_report_of_an_empty_trace():
    # GIVEN a trace with nothing in it
    r = build_report(Trace(header={}))
    # THEN the report is empty but renders
    assert r.gpus == [] and r.trace.events == 0
    assert "\n\nmemrec report\n" in render_text(r, width=1000, show_all=True)


def test_anomalies_are_reported():
    # GIVEN a free of memory from before the recording
    r = build_report(Trace(header={}, events=events(ev(Kind.FREE, pid=1, ptr=0x10))))
    # THEN it is noted
    assert r.trace.anomalies == {"free_unknown": 1}
    assert "free_unknown 1" in render_text(r, width=1000, show_all=True)


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536 * 1024, "1.5 MiB"), (GiB, "1.00 GiB"),
     (-3 * GiB // 2, "-1.50 GiB"), (None, "-"), (2**41, "2.00 TiB")],
)
def test_human_sizes(n, text):
    assert human(n) == text


def test_seconds_of_many_times_are_the_floats_seconds_gives_each():
    # the report's phase times (a step loop's 25,000 phases) are worked out with numpy: the same
    # floats as round(ns / 1e9, 6), ties (ns ending in 500), -0.0 and times past 13 days included
    import numpy as np

    from memrec.analysis.text import seconds
    from memrec.analysis.text import seconds_of

    rng = np.random.default_rng(3)
    ns = np.concatenate([rng.integers(-10**12, 10**15, 20_000), rng.integers(-10**6, 10**6, 20_000),
                         rng.integers(-10**9, 10**13, 20_000) // 1000 * 1000 + 500,
                         np.array([0, -1, -400, -500, -501, 500, 7_812_500, 2**50, -(2**50), 2**50 + 500, 2**62])])
    assert [repr(x) for x in seconds_of(ns)] == [repr(seconds(x)) for x in ns.tolist()]
