"""Every byte explained on a real GPU: the untraced band of each workload of issue 12's table, split.

Each workload (memrec.validation.gpu.untraced_workloads) is recorded by a real daemon; for every process NVML
listed, the band NVML used − traced must come out as context | module code | pools | before
recording with at most max(2 % of the process's NVML used, 16 MiB) left unexplained at its last
sample. Each test prints the split, the contexts and the largest steps, for docs/validation/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import memrec_cmd

from memrec.analysis.untraced.reconcile import reconcile
from memrec.subscriber import wait_for_daemon
from memrec.analysis.text import human
from memrec.terms.events import Kind
from memrec.trace.reader import load_trace

pytestmark = pytest.mark.usefixtures("torch")

MiB = 2**20


def _workload(scenario: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "memrec.validation.gpu.untraced_workloads", scenario, *args]


def _record(tmp_path, scenario: str, env: dict | None = None, name: str | None = None):
    trace_path = tmp_path / f"{name or scenario}.mrec"
    run = subprocess.run(memrec_cmd("record", "-o", str(trace_path), "--", *_workload(scenario)),
                         env={**os.environ, **(env or {})}, timeout=600)
    assert run.returncode == 0
    return trace_path


def _check(trace_path, pids: set[int] | None = None, unbracketed: int = 0) -> list[dict]:
    """Print and check the split of every process (of ``pids``) NVML listed on each GPU."""
    trace = load_trace(trace_path)
    rec = reconcile(trace)
    checked = []
    for g in rec.gpus():
        summary = rec.gpu_summary(g).to_json()
        for row in summary["processes"]:
            # This test process itself: earlier GPU tests of the session (the metrics test's real
            # allocation) leave it a context NVML lists in every later recording, bound before that
            # recording began, so it is rightly "before recording" and not this workload's.
            if row["pid"] == os.getpid() or pids is not None and row["pid"] not in pids or not row.get("split"):
                continue
            sp = row["split"]
            limit = max(0.02 * row["nvml_used_last"], 16 * MiB)
            print(f"{trace_path.name} GPU {g} pid {row['pid']}: NVML {human(row['nvml_used_last'])} = traced "
                  f"{human(row['traced_last'])} + " + " + ".join(f"{k} {human(v)}" for k, v in sp.items())
                  + f"  (limit {human(int(limit))}, max |unexplained| {human(row['unexplained_max_abs'])})")
            for st in row.get("steps", []):
                print(f"    step {human(st['bytes']):>11} {st['category']:<16} {st['cause'] or '-'} ({st['phase']})")
            checked.append({"gpu": g, "pid": row["pid"], "limit": limit, **row})
        for c in summary["contexts"]:
            print(f"  context pid {c['pid']} GPU {c['gpu']} {c['api']}: {human(c['cost'])}"
                  + ("  FOREIGN" if c["foreign"] else ""))
    assert checked, "NVML listed no recorded process"
    for row in checked:
        assert abs(row["split"]["unexplained"]) <= row["limit"] + unbracketed, \
            f"pid {row['pid']} GPU {row['gpu']}: too much unexplained"
    if unbracketed:  # the unexplained steps allowed for are those no code call brackets
        code = np.isin(trace.events["kind"], [int(Kind.CODE_LOAD), int(Kind.KERNEL_LOAD)])
        for row in checked:
            for st in rec.splits[(row["gpu"], row["pid"])].steps:
                if st.category == "unexplained" and st.bytes > row["limit"] and st.since is not None:
                    inside = code & (trace.events["pid"] == row["pid"]) & (trace.events["ts"] > st.since) \
                        & (trace.events["ts"] <= st.ts)
                    assert not inside.any(), f"a code call brackets an unexplained step of {human(st.bytes)}"
    return checked


def test_context_alone(tmp_path):
    rows = _check(_record(tmp_path, "context"))
    assert rows[0]["split"]["context"] >= 400 * MiB, "the context (518-552 MiB on an H200) is the context's"


def test_context_under_eager_module_loading(tmp_path):
    _check(_record(tmp_path, "context", {"CUDA_MODULE_LOADING": "EAGER"}, name="context-eager"))


def test_malloc_async_pool_keeps_the_freed_block(tmp_path):
    rows = _check(_record(tmp_path, "mallocasync"))
    assert rows[0]["split"]["pools"] >= 64 * MiB, "the freed 64 MiB block is held by the pool"


def test_graph_capture_with_cublas_on_expandable_segments(tmp_path):
    _check(_record(tmp_path, "graph"))


@pytest.mark.parametrize("cumem", ["1", "0"])
def test_nccl_one_rank(tmp_path, cumem):
    # NCCL's kernels reach the device at their first launch (never probed), after the reading that
    # follows its last fetch: on the H200 a +70 MiB step 12-17 ms after the last code call, in an
    # interval holding only allocations (runs/2026-12-01-truth2). No call brackets it, so it stays
    # unexplained (the issue: no guess called an answer); the test allows that step, and only it.
    rows = _check(_record(tmp_path, "nccl", {"NCCL_CUMEM_ENABLE": cumem}, name=f"nccl-cumem{cumem}"),
                  unbracketed=80 * MiB)
    assert rows[0]["split"]["module_code"] >= 64 * MiB, "NCCL's kernels (+262 MiB on an H200) are module code"


def test_process_running_before_the_daemon(tmp_path):
    # GIVEN a process with 34 MiB allocated and its context made before any daemon runs
    proc = subprocess.Popen(_workload("held"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    sock, out = tmp_path / "d.sock", tmp_path / "trace.mrec"
    daemon = subprocess.Popen(memrec_cmd("daemon", "-o", str(out), "--socket", str(sock), "--rotate-size", "0"))
    try:
        wait_for_daemon(str(sock), timeout=120)  # answers once the probes are attached
        time.sleep(2.5)  # at least two 1 Hz samples of the process
        # WHEN it allocates 70 MiB more while recorded, idles and exits
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        daemon.send_signal(2)
        assert daemon.wait(timeout=60) == 0
    # THEN what it held at its first sample is "before recording", and the rest is explained
    rows = _check(out, {proc.pid})
    assert rows[0]["split"]["before_recording"] >= 400 * MiB + 34 * MiB
    assert rows[0]["split"]["context"] == 0


def test_two_processes_sharing_the_gpu(tmp_path):
    facts = tmp_path / "shared.json"
    trace_path = tmp_path / "shared.mrec"
    run = subprocess.run(memrec_cmd("record", "-o", str(trace_path), "--", *_workload("shared", "--facts", str(facts))),
                         timeout=600)
    assert run.returncode == 0
    children = set(json.loads(facts.read_text())["timings"]["children"])
    rows = _check(trace_path, children)
    assert {r["pid"] for r in rows} == children
