"""NVML vs traced: per-process and per-device reconciliation, and its report section."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memrec.analysis.untraced import reconcile as reconcile_mod
from memrec.analysis.untraced.reconcile import reconcile
from memrec.analysis.report.build import build_report
from memrec.analysis.report.text import render_text
from memrec.engine.replay import build_timeline
from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.events import Kind
from memrec.terms.events import ProcessInfo
from memrec.state import LiveState
from memrec.trace.model import Keyframe
from memrec.trace.model import Trace
from tests.utils import GiB
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events
from tests.utils import handle_bytes


def procmem(*rows: tuple[int, int, int, int]) -> np.ndarray:
    """PROCMEM_DTYPE rows of (ts, gpu, pid, used)."""
    return np.array(list(rows), dtype=PROCMEM_DTYPE)


def nvml(*rows: tuple[int, int, int, int]) -> np.ndarray:
    """NVML_DTYPE rows of (ts, gpu, used, reserved); free/total/bar1 unknown (-1)."""
    return np.array([(ts, g, used, reserved, -1, -1, -1, -1) for ts, g, used, reserved in rows], dtype=NVML_DTYPE)


def two_gpu_events() -> np.ndarray:
    """pid 1 on GPUs 0 and 1, pid 2 (driver + VMM) on GPU 0, pid 3 maps pid 1's GPU 1 buffer and
    owns 1 GiB there, pid 4 holds 64 MiB on GPU 0 briefly and exits."""
    return events(
        ev(Kind.ALLOC, pid=1, ptr=0x1000, size=GiB, gpu=0, ts=1000),
        ev(Kind.ALLOC, pid=2, ptr=0x1000, size=512 * MiB, gpu=0, ts=2000),
        ev(Kind.ALLOC, pid=1, ptr=0x9000, size=4 * GiB, gpu=1, ts=2500),
        ev(Kind.ALLOC, pid=1, ptr=0x2000, size=2 * GiB, gpu=0, ts=3000),
        ev(Kind.IPC_EXPORT, pid=1, ptr=0x9000, gpu=1, ipc=handle_bytes(1), ts=3500),
        ev(Kind.IPC_OPEN, pid=3, ptr=0xB000, gpu=1, ipc=handle_bytes(1), ts=3600),
        ev(Kind.ALLOC, pid=3, ptr=0x1000, size=GiB, gpu=1, ts=3700),
        ev(Kind.VMM_CREATE, pid=2, size=256 * MiB, handle=0x11, gpu=0, ts=4000),
        ev(Kind.VMM_MAP, pid=2, ptr=0x7000000000, size=256 * MiB, handle=0x11, ts=4100),
        ev(Kind.ALLOC, pid=4, ptr=0x1000, size=64 * MiB, gpu=0, ts=4200),
        ev(Kind.PROC_EXIT, pid=4, ts=4300),
        ev(Kind.FREE, pid=1, ptr=0x1000, ts=5000),
    )


def two_gpu_trace() -> Trace:
    return Trace(
        header={
            "gpus": [
                {"index": 0, "uuid": "GPU-0", "name": "NVIDIA H200", "total": 140 * GiB},
                {"index": 1, "uuid": "GPU-1", "name": "NVIDIA H200", "total": 140 * GiB},
            ],
        },
        events=two_gpu_events(),
        # Deliberately not in (gpu, pid, ts) order: the reader gives file order.
        procmem=procmem(
            (6000, 0, 1, 2 * GiB + 310 * MiB),
            (500, 0, 1, 300 * MiB),  # before any event
            (1000, 0, 1, GiB + 300 * MiB),  # exactly on pid 1's first allocation
            (2999, 0, 1, GiB + 300 * MiB),  # between events
            (3000, 0, 1, 3 * GiB + 302 * MiB),  # exactly on the second
            (5000, 0, 1, 2 * GiB + 302 * MiB),  # exactly on the free
            (7000, 0, 1, -1),  # NVML gave no value
            (2000, 0, 2, 712 * MiB),
            (4050, 0, 2, 712 * MiB),  # the VMM handle is counted at create; NVML shows less
            (1000, 0, 9, 400 * MiB),  # never recorded by memrec
            (2000, 0, 9, 420 * MiB),
            (2500, 1, 1, 4 * GiB + 500 * MiB),
            (3650, 1, 3, 300 * MiB),  # pid 3 maps 4 GiB of pid 1's: not its own
            (3700, 1, 3, GiB + 300 * MiB),
        ),
        nvml=nvml(
            (999, 0, GiB, -1),
            (4100, 0, 5 * GiB, -1),
            (5000, 0, 4 * GiB, -1),
            (5100, 0, -1, -1),  # memory info failed (BAR1 answered)
        ),
        processes={1: ProcessInfo(1, 0, ["python3", "serve.py"], None, "0,1", [0, 1], 0, {"tp": 0})},
    )


# ------------------------------------------------------------------------------------- reconcile


def test_traced_bytes_at_each_process_sample_between_and_on_event_timestamps():
    # GIVEN pid 1's samples on GPU 0 before, between and exactly on its events
    # WHEN reconciled
    rec = reconcile(two_gpu_trace())
    s = rec.process(0, 1)
    # THEN each sample sees every event at or before its ts; the value-less sample is left out
    assert s.ts.tolist() == [500, 1000, 2999, 3000, 5000, 6000]
    assert s.traced.tolist() == [0, GiB, GiB, 3 * GiB, 2 * GiB, 2 * GiB]
    assert s.nvml_used.tolist() == [300 * MiB, GiB + 300 * MiB, GiB + 300 * MiB, 3 * GiB + 302 * MiB,
                                    2 * GiB + 302 * MiB, 2 * GiB + 310 * MiB]
    assert s.untraced.tolist() == [300 * MiB, 300 * MiB, 300 * MiB, 302 * MiB, 302 * MiB, 310 * MiB]
    assert (s.unavailable, s.recorded) == (1, True)
    # AND the vectorised lookup agrees with the timeline's scalar one
    tl = build_timeline(two_gpu_events())
    assert s.traced.tolist() == [tl.gpus[0].at(t, pid=1) for t in s.ts.tolist()]


def test_several_pids_and_gpus_each_get_their_own_owned_bytes():
    # GIVEN pids 1, 2, 9 on GPU 0 and pids 1, 3 on GPU 1
    rec = reconcile(two_gpu_trace())
    # THEN every (gpu, pid) NVML listed has a series
    assert sorted(rec.processes) == [(0, 1), (0, 2), (0, 9), (1, 1), (1, 3)]
    assert rec.gpus() == [0, 1]
    # AND pid 1 on GPU 1 is its 4 GiB there, not its GPU 0 memory
    assert rec.process(1, 1).traced.tolist() == [4 * GiB]
    assert rec.process(1, 1).untraced.tolist() == [500 * MiB]
    # AND pid 3's mapped view of pid 1's buffer is not its own: only its 1 GiB counts
    assert rec.process(1, 3).traced.tolist() == [0, GiB]
    assert rec.process(1, 3).untraced.tolist() == [300 * MiB, 300 * MiB]
    # AND pid 2's driver + VMM bytes count from the create on
    assert rec.process(0, 2).traced.tolist() == [512 * MiB, 768 * MiB]


def test_a_process_nvml_lists_but_memrec_never_recorded_is_all_untraced():
    # GIVEN pid 9: NVML samples, no events
    s = reconcile(two_gpu_trace()).process(0, 9)
    # THEN all of its memory is untraced, and it is marked as not recorded
    assert s.traced.tolist() == [0, 0]
    assert s.untraced.tolist() == [400 * MiB, 420 * MiB]
    assert s.recorded is False


def test_negative_untraced_is_kept_and_flagged():
    # GIVEN pid 2's second sample: traced 768 MiB, NVML 712 MiB
    s = reconcile(two_gpu_trace()).process(0, 2)
    # THEN the difference stays negative (not clipped) and is flagged
    assert s.untraced.tolist() == [200 * MiB, -56 * MiB]
    assert s.negative.tolist() == [False, True]


def test_device_samples_beside_the_gpu_traced_total():
    # GIVEN NVML device samples of GPU 0 (v1: reserved unknown), one without a value
    rec = reconcile(two_gpu_trace())
    d = rec.devices[0]
    # THEN each is beside the owned total of every process at that instant (pid 4 gone at 5000)
    assert d.ts.tolist() == [999, 4100, 5000]
    assert d.traced.tolist() == [0, 3 * GiB + 768 * MiB, 2 * GiB + 768 * MiB]
    assert d.untraced.tolist() == [GiB, GiB + 256 * MiB, GiB + 256 * MiB]
    assert d.reserved.tolist() == [-1, -1, -1] and d.unavailable == 1
    # AND GPU 1 had no device samples
    assert 1 not in rec.devices


def test_summary_numbers_are_exact():
    # GIVEN the reconciliation
    summary = reconcile(two_gpu_trace()).summary()
    # THEN it is keyed by GPU (JSON keys) and survives JSON unchanged
    assert list(summary) == ["0", "1"]
    assert json.loads(json.dumps(summary)) == summary
    g0 = summary["0"]
    p1, p2, p9 = g0["processes"]
    # AND pid 1's row: last values, min, lower median (300 MiB of 300,300,300,302,302,310), max
    want = {
        "pid": 1, "recorded": True, "samples": 6, "unavailable": 1, "after_exit_samples": 0, "exit_ts": None,
        "last_ts": 6000, "nvml_used_last": 2 * GiB + 310 * MiB, "traced_last": 2 * GiB, "untraced_last": 310 * MiB,
        "untraced_min": 300 * MiB, "untraced_median": 300 * MiB, "untraced_max": 310 * MiB, "untraced_max_ts": 6000,
        "negative_samples": 0,
    }
    assert {k: p1[k] for k in want} == want
    # AND its untraced band split: no context bound while recording, so its first sample is what it
    # held before; the 10 MiB that came later with allocations only are unexplained
    assert p1["split"] == {"context": 0, "module_code": 0, "pools": 0, "limits": 0, "graph": 0, "multicast": 0, "before_recording": 300 * MiB,
                           "unexplained": 10 * MiB}
    assert (p2["untraced_last"], p2["untraced_min"], p2["untraced_median"], p2["untraced_max"],
            p2["negative_samples"]) == (-56 * MiB, -56 * MiB, -56 * MiB, 200 * MiB, 1)
    assert (p9["pid"], p9["recorded"], p9["traced_last"], p9["untraced_last"]) == (9, False, 0, 420 * MiB)
    # AND the device row, reserved unknown
    want = {
        "samples": 3, "unavailable": 1, "last_ts": 5000, "used_last": 4 * GiB, "reserved_last": None,
        "traced_last": 2 * GiB + 768 * MiB, "untraced_last": GiB + 256 * MiB, "untraced_min": GiB,
        "untraced_max": GiB + 256 * MiB, "untraced_max_ts": 4100, "negative_samples": 0,
    }
    assert {k: g0["device"][k] for k in want} == want
    # AND pid 4 held memory on GPU 0 but was never in NVML's process samples
    assert g0["unsampled_pids"] == [4]
    assert summary["1"]["device"] is None and summary["1"]["unsampled_pids"] == []


def test_samples_after_a_process_exit_are_kept_but_left_out_of_the_summary():
    # GIVEN pid 5 holding 1 GiB until it exits at 3000, and NVML still listing it with its memory
    # after that (the driver tears the context down later)
    trace = Trace(
        header={},
        events=events(
            ev(Kind.ALLOC, pid=5, ptr=0x1000, size=GiB, gpu=0, ts=1000),
            ev(Kind.PROC_EXIT, pid=5, ts=3000),
        ),
        procmem=procmem(
            (2000, 0, 5, GiB + 600 * MiB), (3000, 0, 5, GiB + 600 * MiB), (3100, 0, 5, GiB + 600 * MiB),
        ),
    )
    # WHEN reconciled
    rec = reconcile(trace)
    s = rec.process(0, 5)
    # THEN the arrays hold every sample, the ones at or after the exit masked out as not live
    assert s.untraced.tolist() == [600 * MiB, GiB + 600 * MiB, GiB + 600 * MiB]
    assert (s.exit_ts, s.live.tolist()) == (3000, [True, False, False])
    # AND the summary is over the live sample alone, the others counted
    (row,) = rec.gpu_summary(0).to_json()["processes"]
    assert (row["samples"], row["after_exit_samples"], row["exit_ts"]) == (1, 2, 3000)
    assert (row["untraced_last"], row["untraced_max"], row["last_ts"]) == (600 * MiB, 600 * MiB, 2000)
    # AND a process seen only after its exit has no numbers, and the text says why
    only_after = Trace(header={}, events=trace.events, procmem=procmem((3100, 0, 5, GiB)))
    (row,) = reconcile(only_after).gpu_summary(0).to_json()["processes"]
    assert (row["samples"], row["after_exit_samples"], row["untraced_last"], row["untraced_max"]) == (0, 1, None, None)
    assert "1 sample after its exit left out (the driver frees later)" in render_text(build_report(only_after), width=1000, show_all=True)


def test_a_given_timeline_is_used_without_another_replay(monkeypatch):
    # GIVEN the report's own replay
    trace = two_gpu_trace()
    tl = build_timeline(trace.events)
    # WHEN reconciled with it, replaying being forbidden
    monkeypatch.setattr(reconcile_mod, "build_timeline", lambda *a, **k: pytest.fail("replayed again"))
    rec = reconcile(trace, tl)
    # THEN the numbers are those of its own replay
    monkeypatch.undo()
    assert rec.summary() == reconcile(trace).summary()


def test_a_rotated_file_is_reconciled_from_its_keyframe():
    # GIVEN a file starting with a keyframe where pid 1 holds 2 GiB on GPU 0, freed at 10 000
    before = LiveState()
    before.apply(events(ev(Kind.ALLOC, pid=1, ptr=0x1000, size=2 * GiB, gpu=0)))
    trace = Trace(
        header={},
        events=events(ev(Kind.FREE, pid=1, ptr=0x1000, ts=10_000)),
        keyframes=[Keyframe(ts=9_000, event_index=0, state=before.snapshot())],
        procmem=procmem((9_500, 0, 1, 2 * GiB + 300 * MiB), (10_000, 0, 1, 300 * MiB)),
    )
    # WHEN reconciled without a timeline
    s = reconcile(trace).process(0, 1)
    # THEN the inherited 2 GiB is traced before the free
    assert s.traced.tolist() == [2 * GiB, 0] and s.untraced.tolist() == [300 * MiB, 300 * MiB]


def test_a_trace_without_nvml_samples_has_nothing_to_reconcile():
    rec = reconcile(Trace(header={}, events=two_gpu_events()))
    assert rec.gpus() == [] and rec.summary() == {}


# ---------------------------------------------------------------------------------------- report


def test_report_json_has_the_reconciliation_section():
    # GIVEN the two-GPU trace
    # WHEN reported
    r = build_report(two_gpu_trace()).to_json()
    g0, g1 = r["gpus"]
    # THEN each GPU with NVML samples has the summary, with times since the trace start
    rc = g0["reconciliation"]
    assert [p["pid"] for p in rc["processes"]] == [1, 2, 9]
    assert r["trace"]["start_ts"] == 500
    p1 = rc["processes"][0]
    assert (p1["untraced_last"], p1["last_ts"], p1["last_t_s"]) == (310 * MiB, 6000, round((6000 - 500) / 1e9, 6))
    assert (p1["exit_ts"], p1["exit_t_s"]) == (None, None)
    assert (rc["device"]["untraced_last"], rc["device"]["reserved_last"]) == (GiB + 256 * MiB, None)
    assert rc["device"]["untraced_max_t_s"] == round((4100 - 500) / 1e9, 6)
    assert rc["unsampled_pids"] == [4]
    assert [p["pid"] for p in g1["reconciliation"]["processes"]] == [1, 3]
    assert g1["reconciliation"]["device"] is None
    # AND the host section has none; the report survives JSON unchanged
    assert r["host"] is None or r["host"]["reconciliation"] is None
    assert json.loads(json.dumps(r)) == r


def test_report_text_has_the_nvml_vs_traced_table():
    # GIVEN the two-GPU trace's report
    text = render_text(build_report(two_gpu_trace()), width=1000, show_all=True)
    lines = text.splitlines()
    # THEN each GPU has the table: per process, then the GPU with its reserve
    at = lines.index(
        "  NVML vs traced (at each NVML sample; untraced = NVML - traced, split below)"
    )
    assert lines[at + 1:at + 6] == [
        "  PID  RANK  NVML USED     TRACED   UNTRACED     UNTRACED MIN..MAX  SAMPLES",
        "    1  tp0    2.30 GiB   2.00 GiB  310.0 MiB  300.0 MiB..310.0 MiB        6  1 sample without a value",
        "    2        712.0 MiB  768.0 MiB  -56.0 MiB  -56.0 MiB..200.0 MiB        2  "
        "! traced > NVML in 1 of 2 samples",
        "    9        420.0 MiB        0 B  420.0 MiB  400.0 MiB..420.0 MiB        2  not recorded by memrec",
        "  GPU         4.00 GiB   2.75 GiB   1.25 GiB    1.00 GiB..1.25 GiB        3  "
        "reserved unknown (NVML v1: used includes it)",
    ]
    assert lines[at + 6] == (
        "    traced here but never in NVML's process samples: pid 4 (gone between samples, or another PID namespace)"
    )
    assert text.count("  NVML vs traced (") == 2


def test_report_pid_filter_keeps_the_gpu_line():
    # WHEN reported for pid 2
    r = build_report(two_gpu_trace(), pid=2).to_json()
    # THEN only its row is there, and the GPU-wide line stays
    (g0,) = r["gpus"]
    assert [p["pid"] for p in g0["reconciliation"]["processes"]] == [2]
    assert g0["reconciliation"]["device"]["traced_last"] == 2 * GiB + 768 * MiB
    assert g0["reconciliation"]["unsampled_pids"] == []


def test_a_gpu_seen_only_in_per_process_samples_gets_a_section():
    # GIVEN NVML per-process samples of GPU 3 and nothing else about it
    trace = Trace(header={}, procmem=procmem((100, 3, 42, 500 * MiB)))
    # WHEN reported
    (g3,) = build_report(trace).to_json()["gpus"]
    # THEN its section reconciles the process as all untraced
    assert g3["gpu"] == 3 and g3["reconciliation"]["processes"][0]["untraced_last"] == 500 * MiB
    assert "   42        500.0 MiB     0 B  500.0 MiB  500.0 MiB..500.0 MiB        1  not recorded by memrec" in (
        render_text(build_report(trace), width=1000, show_all=True).splitlines()
    )
