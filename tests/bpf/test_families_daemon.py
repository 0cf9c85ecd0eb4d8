"""Issue 21 on the stub: arrays, context limits, graph memory and multicast, with real uprobes.

The stub driver places what the H200 showed for each family (memrec/validation/stubdriver/cuda_stub.c):
arrays at creation, a raised stack at the next cuLaunchKernel, the malloc heap at the next module
load, a captured graph's pool at its first cuGraphLaunch; launches are never probed. The real
daemon records the ``families`` scenario with its NVML readings (the stub's per-process files
stand in for NVML), and the analysis must put every step on its own family, never on module code.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from memrec.analysis.untraced.reconcile import reconcile
from memrec.commands import main
from memrec.terms.events import Kind
from memrec.validation.stubdriver.driver import PTX_MODULE
from memrec.trace.reader import load_trace

from tests.bpf.stub_nvml import StubNvml
from tests.bpf.stub_nvml import stub_env

pytestmark = pytest.mark.bpf

MiB = 1 << 20
GiB = 1 << 30
CTX = 300 * MiB  # the stub's default
THREADS = 132 * 2048
STACK = (16384 - 1024) * THREADS  # a 16 KiB stack over the default 1 KiB, at the next launch
ARRAY = 256 * MiB  # 8192 x 8192 x 1 float


class _GpuThreads(StubNvml):
    """The stub's NVML, naming the H200's resident threads (SMs x threads per SM)."""

    def list_gpus(self):
        from dataclasses import replace

        return [replace(g, resident_threads=THREADS) for g in super().list_gpus()]


def record(stub_lib: Path, env_extra: dict, nvml_cls=_GpuThreads) -> tuple[Path, int, Path]:
    from memrec.daemon.config import DaemonConfig
    from memrec.daemon.server import Daemon

    work = Path(tempfile.mkdtemp(prefix="mrf", dir="/tmp"))
    nvml_dir = work / "nvml"
    nvml_dir.mkdir()
    env = stub_env(nvml_dir, pace_us=20_000)
    env.update(env_extra)
    daemon = Daemon(
        DaemonConfig(output=work / "f.mrec", socket_path=work / "d.sock", libcuda_paths=(str(stub_lib),),
                     poll_interval=0.01, nvml_device_hz=0, nvml_process_hz=1, rotate_bytes=0),
        nvml=nvml_cls(nvml_dir), install_signals=False,
    )
    daemon.start()
    cmd = [sys.executable, "-m", "memrec.validation.stubdriver.workload", "--lib", str(stub_lib), "--linger", "0.6", "families"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    try:
        daemon.run(until=lambda: proc.poll() is not None and time.monotonic() - t0 > 1.0)
    finally:
        daemon.stop("test")
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == 0, proc.stderr.read()
    return work / "f.mrec", proc.pid, work


@pytest.fixture(scope="module")
def families(stub_lib):
    path, pid, work = record(stub_lib, {})
    yield path, pid
    shutil.rmtree(work, ignore_errors=True)


def steps_of(rec, pid: int) -> list:
    return rec.splits[(0, pid)].steps


def test_every_family_is_recorded_by_real_uprobes(families):
    path, pid = families
    ev = load_trace(path).events
    mine = ev[ev["pid"] == pid]
    kinds = {Kind(k).name for k in np.unique(mine["kind"]).tolist()}
    assert {"ARRAY_CREATE", "ARRAY_DESTROY", "CTX_LIMIT", "CAPTURE_BEGIN", "CAPTURE_END", "GRAPH_ALLOC", "GRAPH_FREE",
            "GRAPH_EXEC", "GRAPH_TRIM", "MULTICAST_CREATE"} <= kinds
    arrays = mine[mine["kind"] == int(Kind.ARRAY_CREATE)]
    # the descriptor's bytes: 8192 x 8192 floats, 256^3 floats, 13 mip levels of 4096^2 floats
    mip = sum((4096 >> i) ** 2 * 4 for i in range(13))
    assert sorted(arrays["size"].tolist()) == sorted([ARRAY, 64 * MiB, mip])
    limits = mine[mine["kind"] == int(Kind.CTX_LIMIT)]
    assert [(int(a), int(s)) for a, s in zip(limits["aux"], limits["size"])] == [(0, 16384), (2, 256 * MiB)]
    captured = mine[mine["kind"] == int(Kind.GRAPH_ALLOC)]
    assert sorted(captured["size"].tolist()) == [512 * MiB, 768 * MiB]
    # the captured allocation is no live allocation, and the multicast object was refused
    assert not ((mine["kind"] == int(Kind.ALLOC)) & (mine["size"] == 512 * MiB)).any()
    mc = mine[mine["kind"] == int(Kind.MULTICAST_CREATE)]
    assert mc["result"].tolist() == [801] and mc["size"].tolist() == [512 * MiB]
    # the one-line PTX module's size came from its text (with its NUL)
    loads = mine[mine["kind"] == int(Kind.CODE_LOAD)]
    assert set(loads["size"].tolist()) == {len(PTX_MODULE)}


def test_module_load_right_before_stack_and_array_is_not_module_code(families):
    # GIVEN the case: a one-line PTX module, at once a 16 KiB stack, an 8192^2 array and a launch
    path, pid = families
    rec = reconcile(load_trace(path))
    steps = steps_of(rec, pid)
    # THEN no byte of it is module code (the PTX module places nothing)
    assert sum(s.bytes for s in steps if s.category == "module_code") == 0
    # AND the stack is the limits' (the heap placed nothing), named by cuCtxSetLimit
    limits = [s for s in steps if s.category == "limits"]
    assert sum(s.bytes for s in limits) == STACK
    assert {s.cause for s in limits} == {"cuCtxSetLimit"}
    # AND the context is its bind
    assert sum(s.bytes for s in steps if s.category == "context") == CTX


def test_graph_memory_is_graph_and_nothing_is_unexplained(families):
    path, pid = families
    rec = reconcile(load_trace(path))
    steps = steps_of(rec, pid)
    graph = [s.bytes for s in steps if s.category == "graph"]
    # the first launch 512 MiB, the second graph's upload 256 MiB more (the pool: the largest), trim -768 MiB
    assert sum(b for b in graph if b > 0) == 768 * MiB
    assert -768 * MiB in graph
    row = next(r for r in rec.gpu_summary(0).to_json()["processes"] if r["pid"] == pid)
    assert all(s.category != "unexplained" for s in steps), [(s.bytes, s.cause) for s in steps]
    assert row["explained_share"] == 1.0


def test_report_shows_the_families_and_no_unexplained_answer_line(families, capsys):
    path, pid = families
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = lines.index(next(x for x in lines if "Untraced, split" in x))
    head = next(x.split() for x in lines[at:] if x.split()[:1] == ["PID"])
    # the families' columns with bytes at the end (the stack), none without (graph trimmed, no multicast)
    assert "LIMITS" in head and "GRAPH" not in head and "MULTICAST" not in head, " ".join(head)
    assert f"NVML used traced or explained by measurement: pid {pid} 100.0 %" in " ".join(out.split())
    assert "is unexplained" not in out


def test_with_multicast_the_object_is_traced_with_size_and_device(stub_lib):
    path, pid, work = record(stub_lib, {"MEMREC_STUB_MULTICAST": "1"})
    try:
        ev = load_trace(path).events
        mine = ev[(ev["pid"] == pid) & (ev["result"] == 0)]
        create = mine[mine["kind"] == int(Kind.MULTICAST_CREATE)]
        assert create["size"].tolist() == [512 * MiB] and create["aux"].tolist() == [1]
        add = mine[mine["kind"] == int(Kind.MULTICAST_ADD)]
        assert add["aux"].tolist() == [0] and add["handle"].tolist() == create["handle"].tolist()
        bind = mine[mine["kind"] == int(Kind.MULTICAST_BIND)]
        assert bind["size"].tolist() == [512 * MiB]
        assert len(mine[mine["kind"] == int(Kind.MULTICAST_UNBIND)]) == 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
