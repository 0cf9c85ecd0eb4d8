"""Jumps without Textual: where each key lands, what the status line names there, and where a
trace opens (its first failed call, else its highest peak)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import synth

from memrec.engine.replay import build_timeline
from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.terms.events import Kind
from memrec.trace.reader import load_trace
from memrec.tui.model import TraceModel
from memrec.tui.navigation import Landmarks
from memrec.tui.navigation import answer
from memrec.tui.navigation import jump
from memrec.terms.units import fmt_bytes

GiB = synth.GiB
SEC = synth.SEC
T0 = synth.T0


def test_jumps_land_on_the_next_or_previous_target(trace):
    # GIVEN the scripted run (rank 1's KV-cache allocation fails at 7.05 s)
    m = TraceModel.from_trace(trace)
    lm = m.landmarks
    # THEN failed calls, big allocations, phases and markers are found in both directions
    assert lm.next_failure(T0, True)[0] == T0 + int(7.05 * SEC)
    assert lm.next_failure(T0 + 8 * SEC, True) is None
    assert lm.next_failure(T0 + 8 * SEC, False)[0] == T0 + int(7.05 * SEC)
    assert lm.next_failure(T0, True, gpu=0) is None
    assert lm.next_big(T0, True, gpu=0)[0] == T0 + int(0.6 * SEC)
    assert lm.next_big(T0 + 6 * SEC, True, gpu=0, min_size=10 * GiB)[:3:2] == (T0 + 7 * SEC, 50 * GiB)
    assert jump(m, "phase", T0 + 1 * SEC, True, 1).ts == T0 + int(4.05 * SEC)
    assert jump(m, "marker", T0 + 1 * SEC, False, None).ts == T0 + int(0.55 * SEC)


def test_each_landing_names_what_is_there(trace):
    m = TraceModel.from_trace(trace)
    # WHEN each kind of jump is made from the start on GPU1
    texts = {what: jump(m, what, T0, True, 1).text for what in ("marker", "phase", "failure", "big")}
    # THEN the status line can say which marker, phase, rank, size and phase of the call it is
    assert texts["marker"] == "marker load_weights begin · tp0"
    assert texts["phase"] == "phase load_weights · tp1"
    assert texts["failure"] == "in kv_cache · tp1"
    assert texts["big"] == "2.00 GiB allocated in load_weights · tp1"
    # AND past the last one there is none
    assert jump(m, "failure", T0 + 8 * SEC, True, 1) is None


def test_a_trace_opens_at_its_first_failed_call(trace):
    # GIVEN the scripted run, whose only failed call is on GPU1
    m = TraceModel.from_trace(trace)
    # WHEN asked where the answer is, THEN it is that call, on GPU1
    a = answer(m)
    assert (a.ts, a.gpu) == (T0 + int(7.05 * SEC), 1)
    assert a.text == "in kv_cache · tp1" and a.failure


def test_without_a_failure_a_trace_opens_at_its_peak():
    # GIVEN a run without the failure: rank 1 (GPU1) reaches 60 + 90 GiB of weights and KV cache
    m = TraceModel.from_trace(synth.sglang_like(oom=False))
    # WHEN asked where the answer is, THEN it is the first instant of GPU1's peak
    a = answer(m)
    assert (a.ts, a.gpu) == (T0 + int(7.05 * SEC), 1)
    assert a.text.startswith("peak ") and a.text.endswith(" on GPU1")
    # AND an empty trace has none
    empty = TraceModel()
    empty.set_header(synth.header(1))
    assert answer(empty) is None


def test_the_opening_peak_is_the_reports_owned_peak_not_owned_plus_mapped():
    # GIVEN the H200 stand-in whose ranks map each other's 18 GiB buffers by IPC after the peak
    #   of what they own (owned + mapped would peak 36 GiB higher, at another time)
    path = Path(__file__).resolve().parents[2] / "examples" / "sglang-standin-ipc.mrec"
    trace = load_trace(path)
    m = TraceModel.from_trace(trace)
    while not m.indexed:
        m.index_step()
    # WHEN asked where the answer is
    a = answer(m)
    # THEN it is the report's "peak traced": the same bytes at the same instant on the same GPU
    peak_bytes, peak_ts, _ = build_timeline(trace.events).gpus[0].peak()
    assert (a.ts, a.gpu, a.text) == (peak_ts, 0, f"peak {fmt_bytes(peak_bytes)} on GPU0")


def test_diff_aligns_on_the_first_common_marker():
    # GIVEN two runs whose phases start 3 s apart from their first events (B waited longer)
    from dataclasses import replace

    a = synth.sglang_like()
    b = synth.sglang_like(oom=False)
    b = replace(b, markers=[replace(m, ts=m.ts + 3 * SEC) for m in b.markers])
    ma, mb = TraceModel.from_trace(a), TraceModel.from_trace(b)
    # WHEN aligned
    from memrec.tui.navigation import align

    al = align(ma, mb, ma.time_range()[0], mb.time_range()[0])
    # THEN B's time is A's plus 3 s, on the first marker both have
    assert al.shift == 3 * SEC and al.text == "aligned on load_weights begin"


def test_failures_are_counted_as_the_report_counts_them():
    # GIVEN a chunk with a cuModuleLoad that found no file (an expected failure the report leaves
    # out) and a cuMemAlloc out of memory (the live TUI said "2 failures", the report 1 failed call)
    rows = np.zeros(2, dtype=EVENT_DTYPE)
    rows["ts"] = [T0, T0 + SEC]
    rows["kind"] = [int(Kind.CODE_LOAD), int(Kind.ALLOC)]
    rows["result"] = [301, CUDA_ERROR_OUT_OF_MEMORY]
    rows["size"] = [0, 80 * GiB]
    lm = Landmarks()
    # WHEN the model indexes it (as the live source does, before any answer)
    lm.add(lambda name: rows[name], 0)
    # THEN only the out-of-memory call is a failure: counted, drawn and jumped to
    assert lm.count() == 1
    assert lm.failures(None, 0, T0 + 2 * SEC).tolist() == [T0 + SEC]
    assert lm.next_failure(0, True)[0] == T0 + SEC
