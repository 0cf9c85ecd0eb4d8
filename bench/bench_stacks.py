"""Cost of --stacks per driver allocation, on the stub driver with real uprobes (root).

A CPython process (pyenv's 3.12, or PYTHON: e.g. 3.10, whose threads the probe matches by FS base)
calls cuMemAlloc_v2 N times from a Python stack 8 frames deep.
Rounds interleave three programs: none attached (the floor), the driver probes without stacks,
and with stacks (the process located, so the probe walks its frames). Prints the median time per
call of each and the ratios. Then the same for the wall time of the demo workload's start-up
stand-in (``python -m memrec.validation.stubdriver.workload basic vmm nccl_init``, this venv's CPython, located
before it starts; the children it starts are not located in time and get native stacks only).
Also, and less exposed to a loaded host's noise than wall times: the BPF programs' own run time
per hit of ``enter_cuMemAlloc_v2`` (the entry probe, where the stack is read) and
``return_cuMemAlloc_v2``, from the kernel's run-time statistics (on only while measuring).
Usage: python bench/bench_stacks.py [ROUNDS] [N] [PYTHON]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memrec.probes import bpfsys
from memrec.probes.cuda import CudaProbes
from memrec.probes.cuda import StackOptions
from memrec.probes.pystacks import locate
from memrec.validation.stubdriver.build import build_stub

LOOP = """
import ctypes, sys, time
lib = ctypes.CDLL(sys.argv[1]); n = int(sys.argv[2])
def alloc(k):
    if k: return alloc(k - 1)
    ptr = ctypes.c_uint64()
    t = time.perf_counter_ns()
    for _ in range(n):
        lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(4096))
    return time.perf_counter_ns() - t
print("ready", flush=True)
sys.stdin.readline()
print(alloc(8) / n, flush=True)
"""
PYTHON = "/root/.pyenv/versions/3.12.1/bin/python3.12"


def run(stub: Path, n: int, probes: CudaProbes | None, python: str = PYTHON) -> float:
    proc = subprocess.Popen([python, "-c", LOOP, str(stub), str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    if probes is not None and probes.stacks is not None:
        interp = locate(proc.pid)
        assert interp is not None and not interp.problem, interp
        probes.set_interpreter(interp)
    out, _ = proc.communicate("go\n")
    if probes is not None:
        probes.poll()
        probes.poll_stacks()
    return float(out)


WORKLOAD = ["-m", "memrec.validation.stubdriver.workload", "basic", "vmm", "nccl_init", "--wait"]


def run_workload(stub: Path, probes: CudaProbes | None) -> float:
    proc = subprocess.Popen([sys.executable, *WORKLOAD, "--lib", str(stub)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    time.sleep(1.0)  # imported, waiting on stdin
    if probes is not None and probes.stacks is not None:
        interp = locate(proc.pid)
        assert interp is not None and not interp.problem, interp
        probes.set_interpreter(interp)
    t = time.perf_counter_ns()
    proc.communicate("go\n")
    took = time.perf_counter_ns() - t
    assert proc.returncode == 0
    if probes is not None:
        probes.poll()
        probes.poll_stacks()
    return took


def kernel_ns(stub: Path, n: int, probes: CudaProbes, python: str) -> dict[str, float]:
    """ns per hit of the cuMemAlloc_v2 probes' BPF programs over one loop run."""
    names = ("enter_cuMemAlloc_v2", "return_cuMemAlloc_v2")
    probes.attach_library(stub)
    fd = bpfsys.enable_stats()
    try:
        before = {f: probes.run_stats(f) for f in names}
        run(stub, n, probes, python)
        after = {f: probes.run_stats(f) for f in names}
    finally:
        os.close(fd)
        probes.close()
        probes.load()
    return {f: (after[f][0] - before[f][0]) / max(1, after[f][1] - before[f][1]) for f in names}


def interleave(rounds: int, stub: Path, plain: CudaProbes, stacked: CudaProbes, fn) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"floor": [], "probes": [], "stacks": []}
    fn(None)  # warm
    for _ in range(rounds):
        times["floor"].append(fn(None))
        plain.attach_library(stub)
        times["probes"].append(fn(plain))
        plain.close()
        plain.load()
        stacked.attach_library(stub)
        times["stacks"].append(fn(stacked))
        stacked.close()
        stacked.load()
    return times


def show(what: str, unit: float, times: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{what}: {k:7s} median {v / unit:9.2f} (runs: {', '.join(f'{x / unit:.2f}' for x in times[k])})")
    print(f"{what}: stacks / probes = {med['stacks'] / med['probes']:.3f}; probes / floor = "
          f"{med['probes'] / med['floor']:.3f}; stacks / floor = {med['stacks'] / med['floor']:.3f}")


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    python = sys.argv[3] if len(sys.argv) > 3 else PYTHON
    stub = build_stub(Path(tempfile.mkdtemp()))
    plain = CudaProbes(ringbuf_pages=4096).load()
    stacked = CudaProbes(ringbuf_pages=4096, stacks=StackOptions(ring_pages=4096)).load()
    try:
        per_hit: dict[str, list[dict[str, float]]] = {"probes": [], "stacks": []}
        for _ in range(rounds):
            per_hit["probes"].append(kernel_ns(stub, n, plain, python))
            per_hit["stacks"].append(kernel_ns(stub, n, stacked, python))
        for label, runs in per_hit.items():
            for f in runs[0]:
                print(f"BPF ns per hit: {label:7s} {f:22s} median {statistics.median(r[f] for r in runs):8.0f} "
                      f"(runs: {', '.join(f'{r[f]:.0f}' for r in runs)})")
        loop = interleave(rounds, stub, plain, stacked, lambda probes: run(stub, n, probes, python))
        show("us per cuMemAlloc_v2", 1e3, loop)
        startup = interleave(rounds, stub, plain, stacked, lambda probes: run_workload(stub, probes))
        show("ms per workload start-up", 1e6, startup)
    finally:
        plain.close()
        stacked.close()


if __name__ == "__main__":
    main()
