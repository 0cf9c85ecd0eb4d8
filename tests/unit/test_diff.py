"""``memrec diff``: two runs compared by rank, phase and GPU, with a verdict on top.

Inputs: the real H200 stand-in traces in ``examples/`` (see tests/unit/test_sglang_report.py)
and hand-built runs from :func:`tests.unit.test_sglang_report.sglang_run` (TP0 on GPU 0, TP1 on
GPU 1, dyadic numbers: every expected value is exact).
"""

from __future__ import annotations

import json

import pytest

from memrec import commands
from memrec.base.errors import ExitCode
from memrec.analysis.diff.build import diff_traces
from memrec.analysis.diff.model import Diff
from memrec.analysis.diff.text import render_diff
from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.trace import format as fmt
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter
from tests.unit.test_sglang_report import AVAIL_BASE
from tests.unit.test_sglang_report import AVAIL_IPC
from tests.unit.test_sglang_report import BASE
from tests.unit.test_sglang_report import IPC
from tests.unit.test_sglang_report import NOT_ENOUGH
from tests.unit.test_sglang_report import PRE
from tests.unit.test_sglang_report import sglang_run
from tests.utils import GiB
from tests.utils import ev
from tests.utils import events
from tests.utils import MiB


EXPANDABLE = BASE.parent / "torch-expandable.mrec"


def examples_diff() -> Diff:
    return diff_traces(load_trace(BASE), load_trace(IPC), BASE.name, IPC.name)


def write(trace, path):
    """Write a hand-built Trace with the real writer."""
    header = fmt.make_header(host="h", boot_id="b", anchor=trace.header["anchor"],
                             gpus=[GpuInfo(**g) for g in trace.header["gpus"]])
    w = TraceWriter(path, header)
    for info in trace.processes.values():
        w.write_process(info)
    for m in trace.markers:
        w.write_marker(m)
    w.write_events(trace.events)
    w.close()
    return path


# ------------------------------------------------------------------------------- the real traces


def test_examples_verdict_answers_why_the_ipc_run_fails():
    # GIVEN the stand-in without and with 18 GiB per rank exchanged by IPC after the baseline
    d = examples_diff().to_json()
    v = d["verdict"]
    # THEN the verdict names the failing run and SGLang's error, the KV budget's move split into
    # its two parts, the phase that made the difference and the fraction that would have worked
    assert v["headline"] == (
        f"sglang-standin-ipc.mrec fails where sglang-standin-base.mrec works: KV sizing failed on TP0, TP1 ({NOT_ENOUGH})"
    )
    assert v["lines"] == [
        ("KV budget: rest 32.85 GiB → -3.15 GiB on every rank (Δrest -36.00 GiB = Δavailable_after_weights -36.00 GiB"
        " − Δslack +0.00 GiB); tokens 215,317 → -20,613"),
        ("between the memory baseline and the KV sizing, custom_ar_init took 36.00 GiB on GPU 0 in sglang-standin-ipc.mrec;"
        " it does not run in sglang-standin-base.mrec (TP0 +18.00 GiB, TP1 +18.00 GiB; driver +36.00 GiB; 36.00 GiB more"
        " of peers' memory mapped by IPC, not owned)"),
        "  all traced changes between the memory baseline and the KV sizing on GPU 0: +36.00 GiB owned",
        "sglang-standin-ipc.mrec needs --mem-fraction-static > 0.6228 on every rank to size a KV cache (it ran with 0.600)",
        "custom all-reduce: sglang-standin-base.mrec: none; sglang-standin-ipc.mrec: built on 2 rank(s)",
    ]
    assert (d["a"]["failed"], d["b"]["failed"]) == (False, True)


def test_examples_kv_side_by_side_is_exact():
    d = examples_diff().to_json()
    # THEN ranks are matched by rank (the pids differ: 966/967 vs 1054/1055)
    assert [(x["label"], x["before"]["pid"], x["after"]["pid"]) for x in d["kv"]] == [("TP0", 966, 1054), ("TP1", 967, 1055)]
    x = d["kv"][0]
    rest_a, rest_b = AVAIL_BASE - PRE * (1 - 0.6), AVAIL_IPC - PRE * (1 - 0.6)
    assert (x["before"]["rest_gib"], x["after"]["rest_gib"]) == (rest_a, rest_b)
    assert (x["before"]["tokens"], x["after"]["tokens"]) == (215317, -20613)
    # AND Δrest = Δavailable − Δslack, exactly (the baseline did not move)
    dl = x["deltas"]
    assert (dl["pre_model_load_memory"], dl["available_gpu_memory"], dl["slack_gib"]) == (0.0, -36.0, 0.0)
    assert dl["rest_gib"] == rest_b - rest_a == dl["available_gpu_memory"] - dl["slack_gib"]
    assert dl["tokens"] == -235930


def test_examples_phase_rows_and_failures():
    d = examples_diff().to_json()
    rows = {(r["phase"], r["rank"], r["gpu"], r["category"]): (r["a"], r["b"], r["delta"]) for r in d["phases"]}
    # THEN per phase × rank × GPU × category: bytes in each run ('None': the phase did not run)
    assert rows[("dist_init", "TP0", 0, "driver")] == (256 * MiB, 256 * MiB, 0)
    assert rows[("load_weights", "TP1", 0, "driver")] == (25 * GiB, 25 * GiB, 0)
    assert rows[("custom_ar_init", "TP0", 0, "driver")] == (None, 18 * GiB, 18 * GiB)
    assert rows[("custom_ar_init", "TP1", 0, "ipc_mapped")] == (None, 18 * GiB, 18 * GiB)
    pool = 35_278_290_944  # 215317 × 160 KiB rounded up to 2 MiB by PyTorch
    assert rows[("kv_pool", "TP0", 0, "driver")] == (pool, None, -pool)
    assert rows[("cuda_graph_capture", "TP1", 0, "driver")] == (192 * MiB, None, -192 * MiB)
    # AND the phases come in startup order
    order = list(dict.fromkeys(r["phase"] for r in d["phases"]))
    assert order == ["dist_init", "load_weights", "custom_ar_init", "kv_pool", "cuda_graph_capture", "(no phase)"]
    # AND the failures are SGLang's error on both ranks, in the IPC run only
    assert [(f["in"], f["rank"], f["phase"], f["error"]) for f in d["failures"]] == [
        ("b", "TP0", "kv_budget", NOT_ENOUGH), ("b", "TP1", "kv_budget", NOT_ENOUGH),
    ]
    # AND the window table on GPU 0 holds both ranks' allocations in both runs
    (w,) = d["windows"]["between"]
    assert [(r["phase"], r["rank"], r["a_owned"], r["b_owned"], r["delta_mapped"]) for r in w["rows"]] == [
        ("load_weights", "TP0", 25 * GiB, 25 * GiB, 0), ("load_weights", "TP1", 25 * GiB, 25 * GiB, 0),
        ("custom_ar_init", "TP0", None, 18 * GiB, 18 * GiB), ("custom_ar_init", "TP1", None, 18 * GiB, 18 * GiB),
    ]
    assert (w["a_owned"], w["b_owned"]) == (50 * GiB, 86 * GiB)
    assert json.loads(json.dumps(d)) == d


def test_examples_reversed_says_the_other_run_works():
    d = diff_traces(load_trace(IPC), load_trace(BASE), "ipc", "base").to_json()
    assert d["verdict"]["headline"] == f"base works where ipc fails: ipc's KV sizing failed on TP0, TP1 ({NOT_ENOUGH})"
    assert d["verdict"]["lines"][0].startswith("KV budget: rest -3.15 GiB → 32.85 GiB on every rank (Δrest +36.00 GiB")
    assert [f["in"] for f in d["failures"]] == ["a", "a"]


def test_examples_text_starts_with_the_verdict():
    text = render_diff(examples_diff())
    lines = text.splitlines()
    assert lines[0] == "memrec diff  A = sglang-standin-base.mrec  B = sglang-standin-ipc.mrec"
    assert lines[2].startswith("verdict: sglang-standin-ipc.mrec fails where sglang-standin-base.mrec works")
    assert "  TP0   B    138.09      52.09     0.600  55.24   -3.15   -20,613        0.6228  " + NOT_ENOUGH in lines
    assert "        Δ     +0.00     -36.00    +0.000  +0.00  -36.00  -235,930       +0.2607" in lines
    assert "  custom_ar_init      TP0     0  ipc_mapped (not owned)          -   18.00 GiB  +18.00 GiB" in lines
    assert text == render_diff(examples_diff())


def test_cli_text_fits_the_terminal_width(monkeypatch, capsys):
    # GIVEN an 80-column terminal (or output to a pipe, where memrec assumes 80)
    monkeypatch.setenv("COLUMNS", "80")
    # WHEN diffing the example runs on the command line
    assert commands.main(["diff", str(BASE), str(IPC)]) == ExitCode.OK
    text = capsys.readouterr().out
    lines = text.splitlines()
    # THEN the verdict, the KV budget and the failures fit in 80 columns (sentences and SGLang's
    # error wrap; nothing is cut), and the verdict still comes first
    # (the phases table of numbers is left as it is: it has no free-text column to wrap)
    phases, failures = lines.index(next(x for x in lines if x.startswith("phases ("))), lines.index("failures")
    assert [x for x in lines[:phases] + lines[failures:] if len(x) > 80] == []
    assert lines[2].startswith("verdict: sglang-standin-ipc.mrec fails")
    assert NOT_ENOUGH in " ".join(x.strip() for x in lines[failures:])


# -------------------------------------------------------------------------- hand-built traces


def test_lazy_all_reduce_on_two_gpus_with_an_oom_only_in_b():
    # GIVEN A: a clean start; B: 32 GiB per rank after the weights, and one failed 64 GiB allocation
    d = diff_traces(sglang_run(), sglang_run(pid0=500, lazy_ar_gib=32, oom=True), "a", "b").to_json()
    # THEN the verdict merges the two GPUs' identical change into one line and names the OOM
    assert d["verdict"]["headline"] == f"b fails where a works: KV sizing failed on TP0, TP1 ({NOT_ENOUGH})"
    assert d["verdict"]["lines"] == [
        ("KV budget: rest 29.12 GiB → -2.88 GiB on every rank (Δrest -32.00 GiB = Δavailable_after_weights -32.00 GiB"
        " − Δslack +0.00 GiB); tokens 29,824 → -2,944"),
        ("between the memory baseline and the KV sizing, custom_ar_init took 32.00 GiB on each of GPUs 0, 1 in b;"
        " it does not run in a (driver +32.00 GiB; 32.00 GiB more of peers' memory mapped by IPC, not owned)"),
        "  all traced changes between the memory baseline and the KV sizing on each of GPUs 0, 1: +32.00 GiB owned",
        "b needs --mem-fraction-static > 0.9114 on every rank to size a KV cache (it ran with 0.875)",
        "custom all-reduce: a: none; b: built on 2 rank(s)",
        "1 failed driver call only in b (cuMemAlloc_v2 CUDA_ERROR_OUT_OF_MEMORY)",
    ]
    # AND the KV numbers are exact: rest 39 − 9.875 = 29.125 → 7 − 9.875 = −2.875
    x = d["kv"][1]
    assert (x["label"], x["before"]["rest_gib"], x["after"]["rest_gib"], x["deltas"]["rest_gib"]) == ("TP1", 29.125, -2.875, -32.0)
    assert (x["before"]["tokens"], x["after"]["tokens"]) == (29824, -2944)
    # AND the failures: SGLang's error on both ranks and the failed call, B only
    assert [(f["in"], f["kind"], f["rank"]) for f in d["failures"]] == [
        ("b", "sglang_error", "TP0"), ("b", "sglang_error", "TP1"), ("b", "driver_call", "TP0"),
    ]
    assert (d["failures"][2]["api"], d["failures"][2]["result"], d["failures"][2]["bytes"]) == (
        "cuMemAlloc_v2", "CUDA_ERROR_OUT_OF_MEMORY", 64 * GiB,
    )
    # AND the pool's bytes are per GPU and rank; memory freed at exit is in no phase row
    rows = {(r["phase"], r["rank"], r["gpu"], r["category"]): (r["a"], r["b"]) for r in d["phases"]}
    assert rows[("kv_pool", "TP1", 1, "driver")] == (29824 * MiB, None)
    assert not any(r["phase"] == "(no phase)" for r in d["phases"])


def test_memory_taken_before_the_baseline_moves_pre_and_the_slack():
    # GIVEN B takes 32 GiB per rank inside dist_init, before the baseline
    d = diff_traces(sglang_run(), sglang_run(pid0=500, early_ar_gib=32), "a", "b").to_json()
    # THEN both work; pre drops by 32 GiB, the slack by 4 (32 × 0.125), rest by 28 = 32 − 4
    x = d["kv"][0]
    assert {k: x["deltas"][k] for k in ("pre_model_load_memory", "available_gpu_memory", "slack_gib", "rest_gib")} == {
        "pre_model_load_memory": -32.0, "available_gpu_memory": -32.0, "slack_gib": -4.0, "rest_gib": -28.0,
    }
    assert d["verdict"]["headline"] == "both runs work"
    assert d["verdict"]["lines"] == [
        ("KV budget: rest 29.12 GiB → 1.12 GiB on every rank (Δrest -28.00 GiB = Δavailable_after_weights -32.00 GiB"
        " − Δslack -4.00 GiB); tokens 29,824 → 1,152"),
        "  pre_model_load_memory 79.00 → 47.00 GiB (-32.00 GiB): memory taken before the baseline changed",
        ("before the memory baseline, custom_ar_init took 32.00 GiB on each of GPUs 0, 1 in b; it does not run in a"
        " (driver +32.00 GiB)"),
        "  all traced changes before the memory baseline on each of GPUs 0, 1: +32.00 GiB owned",
        "custom all-reduce: a: none; b: built on 2 rank(s)",
    ]
    assert [(r["phase"], r["a_owned"], r["b_owned"]) for r in d["windows"]["before"][0]["rows"]] == [
        ("dist_init", GiB, GiB), ("dist_init/custom_ar_init", None, 32 * GiB),
    ]


def test_a_foreign_context_in_one_run_only_is_in_the_verdict():
    # GIVEN B's TP0 also holds a context on GPU 1 (no allocation there), NVML: 518 MiB
    import numpy as np

    from memrec.terms.columns import PROCMEM_DTYPE

    b_trace = sglang_run(pid0=500)
    b_trace.events = np.sort(np.concatenate([b_trace.events, events(ev(Kind.CTX, pid=500, gpu=1, ts=1_500_000))]),
                             order="ts")
    b_trace.procmem = np.array([(20_000_000, 1, 500, 518 * MiB)], dtype=PROCMEM_DTYPE)
    # WHEN diffed  THEN the verdict names it, with its NVML cost
    d = diff_traces(sglang_run(), b_trace, "a", "b").to_json()
    assert "foreign CUDA contexts: a: none; b: TP0 on GPU 1 (NVML 518.0 MiB)" in d["verdict"]["lines"]


def test_same_run_twice_has_no_change():
    d = diff_traces(sglang_run(), sglang_run(pid0=700), "a", "b").to_json()
    assert d["verdict"] == {"headline": "both runs work", "lines": [("KV budget: rest 29.12 GiB → 29.12 GiB on every rank "
                            "(Δrest +0.00 GiB = Δavailable_after_weights +0.00 GiB − Δslack +0.00 GiB); tokens 29,824 → 29,824")]}
    assert all(r["delta"] == 0 for r in d["phases"]) and d["failures"] == []


def test_a_rank_present_in_one_run_only():
    # GIVEN B without TP1's markers and memory
    b = sglang_run(pid0=500)
    b.markers = [m for m in b.markers if m.pid != 501]
    b.events = b.events[b.events["pid"] != 501]
    d = diff_traces(sglang_run(), b, "a", "b").to_json()
    # THEN TP1's budget is only in A, and its phases have no B side
    assert [(x["label"], x["before"] is not None, x["after"] is not None) for x in d["kv"]] == [
        ("TP0", True, True), ("TP1", True, False),
    ]
    assert d["kv"][1]["explanation"] == ["only in the first run"]
    assert {(r["phase"], r["b"]) for r in d["phases"] if r["rank"] == "TP1"} == {
        ("dist_init", None), ("load_weights", None), ("kv_pool", None),
    }


# ------------------------------------------------------------------------------------------- CLI


@pytest.fixture
def main(monkeypatch):
    # A wide terminal: these tests read whole lines; test_cli_text_fits_the_terminal_width wraps them.
    monkeypatch.setenv("COLUMNS", "1000")
    return commands.main


def test_cli_text_and_json(main, tmp_path, capsys):
    # GIVEN two runs written by the real writer
    a = write(sglang_run(), tmp_path / "a.mrec")
    b = write(sglang_run(pid0=500, lazy_ar_gib=32), tmp_path / "b.mrec")
    # WHEN diffed as text
    rc = main(["diff", str(a), str(b)])
    out, err = capsys.readouterr()
    # THEN exit 0, the verdict first, nothing on stderr
    assert rc == ExitCode.OK and err == ""
    assert out.splitlines()[2] == f"verdict: b.mrec fails where a.mrec works: KV sizing failed on TP0, TP1 ({NOT_ENOUGH})"
    # WHEN diffed as JSON  THEN it is one document with the same verdict
    rc = main(["diff", str(a), str(b), "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == ExitCode.OK and d["memrec_diff"] == 1 and d["verdict"]["headline"].startswith("b.mrec fails")
    assert list(d)[:4] == ["memrec_diff", "a", "b", "verdict"]
    assert d["kv"][0]["after"]["rest_gib"] == -2.875


def test_a_run_whose_driver_ran_out_of_memory_is_a_failed_run(main, tmp_path, capsys):
    # GIVEN two runs whose KV sizing works in both, and B's TP0 got CUDA_ERROR_OUT_OF_MEMORY
    # from a 64 GiB cuMemAlloc_v2 (SGLang reported nothing)
    a = write(sglang_run(), tmp_path / "a.mrec")
    b = write(sglang_run(pid0=500, oom=True), tmp_path / "b.mrec")
    oom = "cuMemAlloc_v2 ran out of GPU memory on TP0 (GPU 0): 1 failed call for 64.00 GiB (CUDA_ERROR_OUT_OF_MEMORY)"
    # WHEN diffed as text  THEN the verdict says B fails, and with what
    assert main(["diff", str(a), str(b)]) == ExitCode.OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == f"verdict: b.mrec fails where a.mrec works: {oom}"
    # AND no --mem-fraction-static advice: the KV sizing did not fail
    assert not any("mem-fraction-static" in line for line in lines)
    # WHEN diffed as JSON  THEN B is failed, with its count of out-of-memory calls
    assert main(["diff", str(a), str(b), "--json"]) == ExitCode.OK
    d = json.loads(capsys.readouterr().out)
    assert (d["a"]["failed"], d["a"]["driver_ooms"], d["b"]["failed"], d["b"]["driver_ooms"]) == (False, 0, True, 1)
    assert d["verdict"]["headline"] == f"b.mrec fails where a.mrec works: {oom}"
    # AND reversed, A is the failed one
    assert main(["diff", str(b), str(a), "--json"]) == ExitCode.OK
    assert json.loads(capsys.readouterr().out)["verdict"]["headline"] == f"a.mrec works where b.mrec fails: b.mrec's {oom}"


def test_a_failed_call_that_is_not_out_of_memory_fails_no_run(main, capsys):
    # GIVEN PyTorch's expandable segments: one cuMemCreate fails with CUDA_ERROR_NOT_PERMITTED
    # during graph capture (expected; not an out-of-memory)
    assert main(["diff", str(EXPANDABLE), str(EXPANDABLE), "--json"]) == ExitCode.OK
    d = json.loads(capsys.readouterr().out)
    # THEN both runs work
    assert any(f["result"] == "CUDA_ERROR_NOT_PERMITTED" for f in d["failures"])
    assert (d["a"]["failed"], d["b"]["failed"], d["verdict"]["headline"]) == (False, False, "both runs work")


def test_cli_examples(main, capsys):
    assert main(["diff", str(BASE), str(IPC)]) == ExitCode.OK
    assert "custom_ar_init took 36.00 GiB on GPU 0" in capsys.readouterr().out


def test_cli_missing_file_is_no_input(main, tmp_path, capsys):
    a = write(sglang_run(), tmp_path / "a.mrec")
    rc = main(["diff", str(a), str(tmp_path / "nope.mrec")])
    assert rc == ExitCode.NO_INPUT == 66
    assert capsys.readouterr().err == f"memrec: error: {tmp_path / 'nope.mrec'}: no such file\n"
    assert main(["diff", str(tmp_path), str(a)]) == ExitCode.NO_INPUT


def test_cli_not_a_trace_is_a_data_error(main, tmp_path, capsys):
    a = write(sglang_run(), tmp_path / "a.mrec")
    bad = tmp_path / "notes.txt"
    bad.write_bytes(b"this is not a memrec trace\n" * 10)
    rc = main(["diff", str(bad), str(a)])
    err = capsys.readouterr().err
    assert rc == ExitCode.DATA == 65
    assert err.startswith("memrec: error: ") and len(err.splitlines()) == 1


def test_the_worked_example_in_the_docs_is_this_output():
    # GIVEN docs/sglang.md's worked example  THEN its diff block is what memrec diff prints today
    docs = (BASE.parents[1] / "docs" / "sglang.md").read_text()
    assert render_diff(examples_diff()) in docs


def test_a_driver_oom_outside_any_rank_is_named_by_its_gpu_alone(main, tmp_path, capsys):
    # GIVEN two runs of a program that sends no SGLang markers (no ranks), B's cuMemAlloc_v2 of
    # 64 GiB on GPU 0 out of memory
    a, b = sglang_run(), sglang_run(pid0=500, oom=True)
    a.markers, b.markers = [], []
    a, b = write(a, tmp_path / "a.mrec"), write(b, tmp_path / "b.mrec")
    # WHEN diffed
    assert main(["diff", str(a), str(b)]) == ExitCode.OK
    # THEN the verdict names the GPU, without a "(no rank)" placeholder before it
    assert capsys.readouterr().out.splitlines()[2] == (
        "verdict: b.mrec fails where a.mrec works: cuMemAlloc_v2 ran out of GPU memory on GPU 0: "
        "1 failed call for 64.00 GiB (CUDA_ERROR_OUT_OF_MEMORY)")


def test_one_kind_of_failed_driver_call_is_named_without_an_ellipsis(main, tmp_path, capsys):
    # GIVEN B's one failed cuMemAlloc_v2, in B only
    a = write(sglang_run(), tmp_path / "a.mrec")
    b = write(sglang_run(pid0=500, oom=True), tmp_path / "b.mrec")
    # WHEN diffed
    assert main(["diff", str(a), str(b)]) == ExitCode.OK
    # THEN the verdict's line names it whole: no "…" hinting at others
    lines = capsys.readouterr().out.splitlines()
    assert "  1 failed driver call only in b.mrec (cuMemAlloc_v2 CUDA_ERROR_OUT_OF_MEMORY)" in lines


def test_tensor_blocks_compared_by_phase_rank_and_gpu(tmp_path):
    # GIVEN two --tensors runs of one process: B holds 2 MiB more in blocks at its peak
    from tests.utils import write_tensor_trace

    a = write_tensor_trace(tmp_path / "a.mrec", [(0, 4 * MiB), (4 * MiB, 2 * MiB)])
    b = write_tensor_trace(tmp_path / "b.mrec", [(0, 4 * MiB), (4 * MiB, 4 * MiB), (4 * MiB, -1)], pid=8)
    # WHEN diffed
    diff = diff_traces(load_trace(a), load_trace(b), "a", "b")
    d = diff.to_json()
    # THEN one row: same phase and rank (no rank), peak allocated 6 vs 8 MiB, reserved 20 MiB in both
    (row,) = d["tensors"]
    assert (row["phase"], row["rank"], row["gpu"]) == ("(no phase)", "(no rank)", 0)
    assert (row["a_allocated"], row["b_allocated"], row["delta_allocated"]) == (6 * MiB, 8 * MiB, 2 * MiB)
    assert (row["a_reserved"], row["b_reserved"], row["delta_reserved"]) == (20 * MiB, 20 * MiB, 0)
    assert "tensor blocks (peak allocated and reserved" in render_diff(diff)


def test_two_different_workloads_are_called_not_comparable(main, capsys):
    # GIVEN a PyTorch IPC test's trace and an SGLang server's (the stand-in), both recorded on an H200
    torch_ipc, sglang_ipc = BASE.parent / "torch-ipc.mrec", IPC
    # WHEN diffed
    assert main(["diff", str(torch_ipc), str(sglang_ipc)]) == ExitCode.OK
    lines = capsys.readouterr().out.splitlines()
    # THEN the verdict says they are two workloads, and why, instead of "fails where ... works"
    assert lines[2] == "verdict: not comparable: these look like two different workloads"
    assert lines[3].startswith("  different commands (torch-ipc.mrec: python -m memrec.gpu.torch_workloads ipc;")
    assert "fails where" not in "\n".join(lines) and "does not run in" not in "\n".join(lines)
    # AND each run's own outcome is still there
    assert "  torch-ipc.mrec works" in lines
    assert any(line.startswith("  sglang-standin-ipc.mrec fails: KV sizing failed on TP0, TP1") for line in lines)
    # AND in JSON, the reasons are data
    assert main(["diff", str(torch_ipc), str(sglang_ipc), "--json"]) == ExitCode.OK
    d = json.loads(capsys.readouterr().out)
    assert d["related"]["related"] is False and d["related"]["reasons"][0].startswith("different commands")


def test_two_runs_of_one_workload_with_a_flag_changed_are_compared(main, capsys):
    # GIVEN the stand-in with and without --ipc: one command, one set of phases, a flag apart
    assert main(["diff", str(BASE), str(IPC), "--json"]) == ExitCode.OK
    d = json.loads(capsys.readouterr().out)
    # THEN the diff is made and its verdict explains one by the other
    assert d["related"] == {"related": True, "reasons": [], "notes": []}
    assert d["verdict"]["headline"].startswith(f"{IPC.name} fails where {BASE.name} works")


def test_no_phase_in_common_is_unrelated():
    from memrec.analysis.diff.related import Identity
    from memrec.analysis.diff.related import command_identity
    from memrec.analysis.diff.related import relate

    # the program and what it runs, not its flags; python3.12 is python; spawn children are no command
    assert command_identity(["/usr/bin/python3.12", "-m", "sglang.launch_server", "--tp", "8"]) == (
        "python -m sglang.launch_server")
    assert command_identity(["python3", "/home/me/train.py", "--lr", "1"]) == "python train.py"
    assert command_identity(["python3", "-c", "from multiprocessing.spawn import spawn_main"]) is None
    a = Identity(frozenset(), frozenset(), frozenset({"load", "train"}), frozenset({"NVIDIA H200"}))
    b = Identity(frozenset(), frozenset(), frozenset({"prefill"}), frozenset({"NVIDIA A100"}))
    rel = relate(a, b, "a", "b")
    assert not rel.related and rel.reasons == ["no phase in common (a: load, train; b: prefill)"]
    # different GPUs alone: related (the same workload on two GPU types), and said
    same = relate(a, Identity(frozenset(), frozenset(), frozenset({"load"}), frozenset({"NVIDIA A100"})), "a", "b")
    assert same.related and same.notes == ["the runs used different GPUs (a: NVIDIA H200; b: NVIDIA A100)"]


def test_phases_of_one_run_only_are_placed_after_their_predecessor_in_linear_time():
    import time

    from memrec.analysis.diff.build import _merge_order

    # GIVEN A's phases and B's, some B's only (one before all of A's, one after a B-only one)
    # THEN A's order, each B-only phase right after the phase before it in B
    assert _merge_order(["load", "kv", "graph"], ["warm", "load", "extra", "more", "graph"]) == \
        ["warm", "load", "extra", "more", "kv", "graph"]
    assert _merge_order([], ["x", "y"]) == ["x", "y"] and _merge_order(["x"], []) == ["x"]
    # AND 50,000 phases in each run, none shared, merge in well under a second (list membership
    # and insertion made it quadratic: 7 s for 20,000 phases, minutes for these)
    a = [f"a{i}" for i in range(50_000)]
    b = [f"b{i}" for i in range(50_000)]
    start = time.perf_counter()
    order = _merge_order(a, a[:25_000] + b)
    assert time.perf_counter() - start < 5
    assert order == a[:25_000] + b + a[25_000:]
