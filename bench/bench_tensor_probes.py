#!/usr/bin/env python3
"""bench_tensor_probes: what a PyTorch allocator probe hit costs, against the floors, and whether
the kernel's optimized uprobe path (5-byte nop sites, kernel >= 6.18 on x86-64) is cheaper.

Usage (root, bcc importable): python bench/bench_tensor_probes.py [--pairs N] [--repeat R]

A small C program (compiled here) dlopens the stub libc10_cuda.so (memrec/validation/stubdriver/
c10_cuda_stub.S: pytorch:malloc/free USDT probes with PyTorch 2.11's argument forms behind
semaphores) and times N malloc + free probe pairs with CLOCK_MONOTONIC, so no Python sits in the
measured loop. The same loop runs, interleaved, in one session, under:

  baseline      no probes (the semaphores are 0: the sites are skipped, as in PyTorch)
  noop          a no-op BPF program at the sites, semaphores raised (the uprobe floor)
  memrec        memrec's probes (``memrec daemon --tensors``), drained every 50 ms by a thread
  noop-nop5     the no-op program, on a stub whose sites are 5-byte nops
  memrec-nop5   memrec's probes on that stub
  memrec-other  memrec's probes scoped to another process (``--tensors-pid``): what a process
                outside the scope pays

PyTorch's own sites are 1-byte nops (``static_tracepoint_elfx86.h``), which always trap; the
nop5 rows say what a build with 5-byte nop sites would cost on this kernel.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_probe_overhead import build_loop  # noqa: E402 (a sibling script, not a package)
from bench_probe_overhead import print_runs  # noqa: E402

LOOP_C = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef void (*malloc_t)(unsigned long long, int, unsigned long, unsigned long long);
typedef void (*free_t)(unsigned long long);
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    long n = atol(argv[2]);
    malloc_t m = (malloc_t)dlsym(h, "stub_torch_malloc");
    free_t f = (free_t)dlsym(h, "stub_torch_free");
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        unsigned long long p = 0x7f0000000000ULL + ((unsigned long long)(i & 1023) << 12);
        m(p, 0, 256, 0);
        f(p);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    printf("%.1f\n", ns / n);
    return 0;
}
"""

NAMES = ("baseline", "noop", "memrec", "noop-nop5", "memrec-nop5", "memrec-other")


def run_loop(exe: Path, lib: Path, pairs: int) -> float:
    """ns per malloc + free pair."""
    proc = subprocess.run([str(exe), str(lib), str(pairs)], capture_output=True, text=True, check=True)
    return float(proc.stdout.strip())


class NoopSites:
    """A no-op BPF program at every pytorch probe site of ``lib``, semaphores raised."""

    def __init__(self, lib: Path) -> None:
        from memrec.probes import bpfsys
        from memrec.probes.loader import NOOP_INSNS
        from memrec.probes.loader import LoadedProgram
        from memrec.probes.loader import Program
        from memrec.probes.usdt import read_probes

        fd = os.open(lib, os.O_RDONLY)
        try:
            sites = [p for p in read_probes(fd) if p.provider == "pytorch"]
        finally:
            os.close(fd)
        self.prog = LoadedProgram(Program("GPL", 0, {}, {"noop": (bpfsys.PROG_TYPE_KPROBE, NOOP_INSNS)}))
        self.fds = [self.prog.attach_uprobe("noop", str(lib), p.offset, False, ref_ctr_offset=p.semaphore)
                    for p in sites]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.prog.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=50_000, help="malloc/free pairs per run (default 50000)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; each runs every configuration once (default 5)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_tensor_probes: needs root (BPF)", file=sys.stderr)
        return 1

    import numpy as np

    from memrec.terms.events import Kind
    from memrec.probes.cuda import CudaProbes
    from memrec.validation.stubdriver.build import build_torch_stub

    results: dict[str, list[float]] = {n: [] for n in NAMES}
    with tempfile.TemporaryDirectory() as tmp:
        # One private copy per configuration (uprobes are per inode): all stay attached and the
        # rounds interleave them, so a shared host's drifting load is spread over all five.
        libs = {n: build_torch_stub(Path(tmp) / n, nop5=n.endswith("nop5")) for n in NAMES}
        exe = build_loop(Path(tmp), LOOP_C)
        noops = [NoopSites(libs["noop"]), NoopSites(libs["noop-nop5"])]
        probes = CudaProbes(ringbuf_pages=4096, tensors=True).load()
        idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        for n in ("memrec", "memrec-nop5", "memrec-other"):
            report = probes.attach_torch(libs[n], pids=(idle.pid,) if n == "memrec-other" else ())
            assert not report.problem, report.problem
        stop = threading.Event()
        counted = [0]

        def tensor_events() -> int:
            ev = probes.poll()
            return int(np.isin(ev["kind"], (int(Kind.TENSOR_ALLOC), int(Kind.TENSOR_FREE))).sum())

        def drain() -> None:
            while not stop.is_set():
                counted[0] += tensor_events()
                time.sleep(0.05)

        th = threading.Thread(target=drain)
        th.start()
        try:
            for n in NAMES:
                run_loop(exe, libs[n], 1000)  # warm up: page in, first hits (nop5: the rewrite)
            for _ in range(args.repeat):
                for n in NAMES:
                    results[n].append(run_loop(exe, libs[n], args.pairs))
        finally:
            stop.set()
            th.join()
        idle.stdin.close()
        idle.wait()
        counted[0] += tensor_events()
        lost = probes.lost()
        probes.close()
        for noop in noops:
            noop.close()

    print(f"{args.pairs} pytorch:malloc + pytorch:free pairs per run, {args.repeat} interleaved rounds; ns per pair:")
    med = print_runs(results, "over baseline, per hit", per=2)
    print("ratios (medians):")
    print(f"  memrec / noop (1-byte nop sites, PyTorch's)   {med['memrec'] / med['noop']:6.2f}x")
    print(f"  memrec-nop5 / memrec (5-byte nop sites)       {med['memrec-nop5'] / med['memrec']:6.2f}x")
    print(f"  noop-nop5 / noop                              {med['noop-nop5'] / med['noop']:6.2f}x")
    print(f"  memrec-other / baseline (outside --tensors-pid) {med['memrec-other'] / med['baseline']:6.2f}x")
    expected = 2 * (1000 + args.pairs * args.repeat) * 2
    print(f"tensor events recorded {counted[0]} (expected {expected}), lost {lost}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
