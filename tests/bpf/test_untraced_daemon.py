"""Every byte explained, on the stub: the real daemon and probes, NVML as the stub says it.

The stub driver charges what the H200 showed (docs/validation/untraced-explore.md): a context, the
lazy first-launch step at the first kernel, a few MiB per kernel or module, pool reserves kept
after asynchronous frees until a trim; and writes what NVML would list per process. The daemon
records three processes with its NVML readings around binds and code loads: one running before
the recording started, and two sharing GPU 0 while the recording runs (one of them also binds a
context on GPU 1 and allocates nothing there). The report must split each untraced band exactly.
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
from memrec.trace.reader import load_trace

from tests.bpf.stub_nvml import StubNvml
from tests.bpf.stub_nvml import stub_env
from tests.bpf.stub_nvml import wait_until

pytestmark = pytest.mark.bpf

MiB = 1 << 20
CTX = 300 * MiB  # the stub's defaults (cuda_stub.c)
FIRST_KERNEL = 90 * MiB
KERNEL = 2 * MiB


def workload(lib: Path, env: dict, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "memrec.validation.stubdriver.workload", "--lib", str(lib), *args]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def recording(stub_lib):
    """Record: an early process (before the daemon), then "code pool" and "foreign" side by side."""
    from memrec.daemon.config import DaemonConfig
    from memrec.daemon.server import Daemon

    work = Path(tempfile.mkdtemp(prefix="mru", dir="/tmp"))
    nvml_dir = work / "nvml"
    nvml_dir.mkdir()
    env = stub_env(nvml_dir)
    early = workload(stub_lib, env, "--hold", "code")
    assert early.stderr.readline().strip() == "ready"
    daemon = Daemon(
        DaemonConfig(output=work / "u.mrec", socket_path=work / "d.sock", libcuda_paths=(str(stub_lib),),
                     poll_interval=0.01, nvml_device_hz=0, nvml_process_hz=1, rotate_bytes=0),
        nvml=StubNvml(nvml_dir), install_signals=False,
    )
    daemon.start()
    procs = {}
    try:
        # each lingers: its last NVML readings (0.25 s after its last step) come before its exit, with
        # room for a loaded machine (0.6 s was once too short: a reading after the exit kept 16 MiB of pools)
        procs["code_pool"] = workload(stub_lib, env, "--linger", "1.5", "code", "pool")
        procs["foreign"] = workload(stub_lib, env, "--linger", "1.5", "foreign")
        t0 = time.monotonic()
        released = []

        def done() -> bool:
            if not released and time.monotonic() - t0 > 2.5:  # two 1 Hz samples of the early one
                early.stdin.write("go\n")
                early.stdin.flush()
                released.append(True)
            return bool(released) and all(p.poll() is not None for p in (early, *procs.values())) and (
                time.monotonic() - t0 > 4.0
            )

        daemon.run(until=done)
    finally:
        daemon.stop("test")
        for p in (early, *procs.values()):
            if p.poll() is None:
                p.kill()
            p.wait()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name}: {p.stderr.read()}"
    pids = {"early": early.pid, **{k: p.pid for k, p in procs.items()}}
    yield work / "u.mrec", pids
    shutil.rmtree(work, ignore_errors=True)


def split_of(rec, gpu: int, pid: int) -> dict:
    return next(r for r in rec.gpu_summary(gpu).processes if r.pid == pid).split


def test_code_and_pools_are_split_exactly(recording):
    # GIVEN a process that bound a context, fetched kernels, loaded and unloaded modules and used pools
    path, pids = recording
    rec = reconcile(load_trace(path))
    pid = pids["code_pool"]

    # THEN its band is the context (with its first kernel), one kernel still loaded, nothing else
    assert split_of(rec, 0, pid) == {
        "context": CTX + FIRST_KERNEL, "module_code": KERNEL, "pools": 0, "limits": 0, "graph": 0, "multicast": 0,
        "before_recording": 0, "unexplained": 0,
    }
    # AND while the pools kept freed blocks (64 MiB, 16 MiB of its own, then 128 MiB before the
    # last trim), the split said so, with nothing unexplained
    split = rec.splits[(0, pid)]
    kept = split.pools > 0
    assert split.pools.max() >= 64 * MiB
    assert (split.unexplained[kept] == 0).all()
    # AND the steps name the calls that explain them
    causes = {(s.category, s.cause) for s in split.steps}
    assert ("context", "cuDevicePrimaryCtxRetain") in causes
    assert ("context", "cuLibraryGetKernel") in causes, "the first kernel in a context is the context's"
    # (readings come at most every 200 ms during a burst of code calls: a step may span several)
    module_causes = {c for cat, c in causes if cat == "module_code"}
    assert module_causes and module_causes <= {"cuModuleLoad", "cuModuleLoadData", "cuModuleLoadDataEx",
                                                "cuModuleLoadFatBinary", "cuModuleUnload", "cuLibraryGetKernel",
                                                "cuKernelGetFunction", "cuLibraryLoadFromFile", "cuLibraryUnload"}
    # AND module code is told per library: the image handed to cuLibraryLoadData lay in the
    # driver's mapped file, which the daemon named
    row = next(r for r in rec.gpu_summary(0).to_json()["processes"] if r["pid"] == pid)
    # (a step whose interval holds calls about several libraries is "(several)": the readings around
    # a burst of code calls are 20 ms apart at most, and a call still running at one counts in it)
    libs = row["module_code_by_library"]
    assert sum(libs.values()) == KERNEL
    assert set(libs) <= {"libcuda.so.1", "(in memory)", "(several)"}
    (ctx,) = [c for c in rec.contexts if c.pid == pid]
    assert (ctx.gpu, ctx.cost, ctx.foreign) == (0, CTX + FIRST_KERNEL, False)


def test_a_foreign_context_is_flagged_and_costed(recording):
    # GIVEN a process sharing GPU 0 that also bound a context on GPU 1 and allocated nothing there
    path, pids = recording
    rec = reconcile(load_trace(path))
    pid = pids["foreign"]

    # THEN both contexts cost what NVML showed, the one on GPU 1 is foreign; nothing is unexplained
    costs = {(c.gpu, c.cost, c.foreign) for c in rec.contexts if c.pid == pid}
    assert costs == {(0, CTX, False), (1, CTX, True)}
    for gpu in (0, 1):
        assert split_of(rec, gpu, pid) == {
            "context": CTX, "module_code": 0, "pools": 0, "limits": 0, "graph": 0, "multicast": 0,
            "before_recording": 0, "unexplained": 0,
        }


def test_a_process_running_before_the_recording_is_held_before_recording(recording):
    # GIVEN a process that had its context and kernels before the daemon started
    path, pids = recording
    rec = reconcile(load_trace(path))

    # THEN what it held at its first sample is "before recording", not a context
    assert split_of(rec, 0, pids["early"]) == {
        "context": 0, "module_code": 0, "pools": 0, "limits": 0, "graph": 0, "multicast": 0, "before_recording": CTX + FIRST_KERNEL + KERNEL, "unexplained": 0,
    }


def test_the_daemon_read_nvml_around_each_step(recording):
    # GIVEN the trace: THEN there are far more per-process readings than the 1 Hz sampler's
    path, pids = recording
    pm = load_trace(path).procmem
    mine = pm[pm["pid"] == pids["code_pool"]]
    assert len(np.unique(mine["ts"])) >= 20


def test_report_shows_the_split_and_the_foreign_context(recording, capsys):
    # GIVEN the trace; WHEN `memrec report` renders it
    path, pids = recording
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out

    # THEN the split table and the contexts are there, the foreign one flagged
    assert "Untraced, split" in out and "UNEXPLAINED" in out
    foreign = [x for x in out.splitlines() if x.split()[1:2] == [str(pids["foreign"])] and "foreign" in x]
    assert foreign, "the foreign context is flagged"
    lines = out.splitlines()
    at = lines.index(next(x for x in lines if "Untraced, split" in x))
    row = next(x.split() for x in lines[at:] if x.split()[:1] == [str(pids["code_pool"])])
    # PID, UNTRACED, CONTEXT, MODULES, POOLS, BEFORE, UNEXPLAINED (value and unit each; the families'
    # columns only when some row has bytes there)
    assert row == [str(pids["code_pool"]), "392.0", "MiB", "390.0", "MiB", "2.0", "MiB", *["0", "B"] * 3]
    assert f"pid {pids['code_pool']} 100.0 %" in " ".join(out.split())  # (the line may wrap)
