"""The SGLang stand-in on the real sequence: stock SGLang's custom all-reduce (a few MiB, before
the memory baseline) against the forced build of the original report (18 GiB after it)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import memrec_cmd

from memrec.analysis.diff.build import diff_traces
from memrec.analysis.report.build import build_report
from memrec.trace.reader import load_trace

pytestmark = pytest.mark.usefixtures("torch")


def _record(tmp_path, name: str, *flags: str):
    path = tmp_path / f"{name}.mrec"
    cmd = [sys.executable, "-m", "memrec.validation.gpu.sglang_standin", "--tp", "2", *flags]
    run = subprocess.run(memrec_cmd("record", "-o", str(path), "--", *cmd), capture_output=True, text=True, timeout=600)
    print(run.stdout[-2000:], run.stderr[-2000:])
    return load_trace(path), run.returncode


def test_stock_custom_all_reduce_is_built_before_the_baseline_and_costs_a_few_mib(tmp_path):
    # GIVEN the stand-in with stock SGLang's custom all-reduce, and without one
    stock, rc_stock = _record(tmp_path, "stock", "--stock-ar")
    base, rc_base = _record(tmp_path, "base")
    # WHEN reported and compared
    report = build_report(stock).to_json()["sglang"]
    d = diff_traces(base, stock, "base", "stock").to_json()
    print("\n".join(d["verdict"]["lines"]))
    # THEN both start; the custom all-reduce sits inside dist_init, before the baseline, a few MiB
    # per rank (two ~8 MiB IPC-shared buffers), and lowers the baseline by about that much
    assert rc_stock == 0 and rc_base == 0
    car = report["summary"]["custom_all_reduce"]
    assert car["ranks_built"] == 2 and car["shared_buffer_bytes"] == [16 * 2**20 + 4096]
    rows = [x for r in report["ranks"] for x in r["phases"] if x["name"] == "custom_ar_init"]
    assert rows and all(x["when"] == "before baseline" for x in rows)
    assert all(x["net"] < 64 * 2**20 for x in rows)
    (kv,) = [x for x in d["kv"] if x["label"] == "TP0"]
    assert -0.25 < kv["deltas"].get("pre_model_load_memory", 0.0) <= 0.0
