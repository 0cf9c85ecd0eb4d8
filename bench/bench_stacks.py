"""Cost of --stacks per driver allocation, on the stub driver with real uprobes (root).

A CPython 3.12 process (pyenv) calls cuMemAlloc_v2 N times from a Python stack 8 frames deep.
Rounds interleave three programs: none attached (the floor), the driver probes without stacks,
and with stacks (the process located, so the probe walks its frames). Prints the median time per
call of each and the ratios. Usage: python bench/bench_stacks.py [ROUNDS] [N]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from memrec.probes.cuda import CudaProbes
from memrec.probes.cuda import StackOptions
from memrec.probes.pystacks import locate
from memrec.stubdriver.build import build_stub

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
sys.stdin.readline()
print(alloc(8) / n, flush=True)
"""
PYTHON = "/root/.pyenv/versions/3.12.1/bin/python3.12"


def run(stub: Path, n: int, probes: CudaProbes | None) -> float:
    proc = subprocess.Popen([PYTHON, "-c", LOOP, str(stub), str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    if probes is not None and probes.stacks is not None:
        interp = locate(proc.pid)
        assert interp is not None and not interp.problem, interp
        probes.set_interpreter(interp)
    out, _ = proc.communicate("go\n")
    if probes is not None:
        probes.poll()
        probes.poll_stacks()
    return float(out)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    stub = build_stub(Path(tempfile.mkdtemp()))
    plain = CudaProbes(ringbuf_pages=4096).load()
    stacked = CudaProbes(ringbuf_pages=4096, stacks=StackOptions(ring_pages=4096)).load()
    times: dict[str, list[float]] = {"floor": [], "probes": [], "stacks": []}
    try:
        run(stub, n, None)  # warm
        for _ in range(rounds):
            times["floor"].append(run(stub, n, None))
            plain.attach_library(stub)
            times["probes"].append(run(stub, n, plain))
            plain.close()
            plain.load()
            stacked.attach_library(stub)
            times["stacks"].append(run(stub, n, stacked))
            stacked.close()
            stacked.load()
    finally:
        plain.close()
        stacked.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:7s} median {v / 1e3:7.2f} us per cuMemAlloc_v2 (runs: {', '.join(f'{x / 1e3:.2f}' for x in times[k])})")
    print(f"stacks / probes = {med['stacks'] / med['probes']:.3f}; probes / floor = {med['probes'] / med['floor']:.3f}; "
          f"stack walk = {(med['stacks'] - med['probes']) / 1e3:.2f} us per allocation")


if __name__ == "__main__":
    main()
