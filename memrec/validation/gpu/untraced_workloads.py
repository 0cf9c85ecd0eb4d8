"""PyTorch workloads whose untraced band memrec must explain: one per row of issue 12's table.

Run as ``python -m memrec.validation.gpu.untraced_workloads SCENARIO [--facts OUT.json]``. Each scenario
makes the driver take memory that no allocation call accounts for (a context, device code,
a stream-ordered pool's reserve) and then idles long enough for NVML's per-process samples to
see the final state (the recorder samples every process at 1 Hz, and around each step). With
``--facts`` it writes the process ids and the time each step took (``timings``, seconds: the probe
cost comparison in bench/bench_untraced_probes.py reads them).

Scenarios:
    context      a context and one kernel (the lazy first-launch step)
    mallocasync  PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync: three 64 MiB blocks, one freed
                 (the pool keeps it)
    graph        CUDA graph capture on expandable segments, with cuBLAS
    nccl         NCCL with one rank (NCCL_CUMEM_ENABLE as the environment says): init, all-reduce
    held         allocate 34 MiB, print "ready", wait for a line on stdin, allocate 70 MiB more
                 (a process that was running before the recording started)
    shared       two child processes on GPU 0 at the same time (context + 100 MiB each)
    launches     the cost check: context, cuBLAS, then 2,000 small kernel launches
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from memrec.base.files import create_file

MiB = 2**20
#: Long enough for two 1 Hz NVML samples after the last step.
IDLE_S = 2.5


def _context(torch, timings: dict) -> None:
    t = time.monotonic()
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    timings["context"] = time.monotonic() - t
    del x


def run_context(timings: dict) -> None:
    import torch

    _context(torch, timings)


def run_mallocasync(timings: dict) -> None:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    import torch

    _context(torch, timings)
    blocks = [torch.empty(64 * MiB, dtype=torch.uint8, device="cuda") for _ in range(3)]
    torch.cuda.synchronize()
    time.sleep(0.5)
    del blocks[1]
    torch.cuda.synchronize()
    timings["blocks"] = [b.data_ptr() for b in blocks]


def run_graph(timings: dict) -> None:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    _context(torch, timings)
    a = torch.randn(1024, 1024, device="cuda")
    b = a @ a  # cuBLAS
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            b = a @ a
    torch.cuda.current_stream().wait_stream(s)
    t = time.monotonic()
    with torch.cuda.graph(g):
        b = a @ a + 1
    timings["capture"] = time.monotonic() - t
    g.replay()
    torch.cuda.synchronize()
    timings["result"] = float(b[0, 0])


def run_nccl(timings: dict) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29537")
    torch.cuda.set_device(0)
    _context(torch, timings)
    t = time.monotonic()
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    timings["nccl_init_allreduce"] = time.monotonic() - t
    time.sleep(IDLE_S)  # the steady state with NCCL up is what the test checks
    dist.destroy_process_group()


def run_held(timings: dict) -> None:
    import torch

    first = torch.empty(34 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.readline()
    second = torch.empty(70 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    timings["held"] = [first.data_ptr(), second.data_ptr()]


def run_shared(timings: dict) -> None:
    code = (
        "import torch, time; x = torch.empty(100 << 20, dtype=torch.uint8, device='cuda'); "
        f"torch.cuda.synchronize(); time.sleep({IDLE_S + 1})"
    )
    kids = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    timings["children"] = [k.pid for k in kids]
    for k in kids:
        k.wait()
    if any(k.returncode for k in kids):
        raise SystemExit(f"a child failed: {[k.returncode for k in kids]}")


def run_launches(timings: dict) -> None:
    import torch

    _context(torch, timings)
    a = torch.randn(256, 256, device="cuda")
    t = time.monotonic()
    b = a @ a
    torch.cuda.synchronize()
    timings["first_matmul"] = time.monotonic() - t
    t = time.monotonic()
    for _ in range(2000):
        b.add_(1)
    torch.cuda.synchronize()
    timings["launches_2000"] = time.monotonic() - t


SCENARIOS = {
    "context": run_context,
    "mallocasync": run_mallocasync,
    "graph": run_graph,
    "nccl": run_nccl,
    "held": run_held,
    "shared": run_shared,
    "launches": run_launches,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--facts", help="write the pids and timings here (JSON)")
    parser.add_argument("--idle", type=float, default=IDLE_S, help="seconds to idle at the end")
    args = parser.parse_args(argv)
    timings: dict = {}
    t = time.monotonic()
    SCENARIOS[args.scenario](timings)
    timings["total"] = time.monotonic() - t
    if args.facts:
        with create_file(args.facts, text=True, replace=True) as out:
            json.dump({"pid": os.getpid(), "scenario": args.scenario, "timings": timings}, out)
    time.sleep(args.idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
