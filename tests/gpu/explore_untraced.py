"""Which driver entry points load device code or keep pool memory, and what NVML sees meanwhile.

Why this exists: the "untraced" band (NVML per-process used minus traced allocations) is the
context, loaded module code and stream-ordered pools. Before probing more driver symbols in the
recorder, this script finds out on a real GPU which exported symbols fire (and how often) while
PyTorch creates a context, loads cuBLAS, NCCL and Triton kernels, eagerly and under
``CUDA_MODULE_LOADING=LAZY``, and uses a ``cudaMallocAsync`` pool; and it samples NVML's
per-process ``used`` every few milliseconds so each step can be matched to the calls around it.

It is a research tool for the GPU host (root, BCC from the bundle), not part of the recorder:

    python3 tests/gpu/explore_untraced.py OUT_DIR

writes ``OUT_DIR/untraced-explore.json`` (raw calls and samples per workload) and prints a summary.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import time

LIBCUDA_CANDIDATES = ("/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1")
# Symbols worth counting: module/library/kernel loading, linking, pools, contexts, and the launch
# entry points only to compare counts (a probe there would never ship).
PATTERN = re.compile(
    r"^cu(Module|Library|Kernel|Func|Link|MemPool|DeviceGetDefaultMemPool|DeviceSetMemPool|DeviceGetMemPool"
    r"|DevicePrimaryCtx|CtxCreate|CtxDestroy|LaunchKernel|LaunchKernelEx|LaunchCooperativeKernel"
    r"|MemAllocAsync|MemFreeAsync|MemAllocFromPoolAsync|StreamSynchronize|CtxSynchronize|GetProcAddress)"
)

WORKLOADS = {
    "context": "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()",
    "matmul": (
        "import torch; a = torch.randn(1024, 1024, device='cuda'); torch.cuda.synchronize();"
        "import time; time.sleep(0.3); b = a @ a; torch.cuda.synchronize(); time.sleep(0.3);"
        "c = (a * 2).sum(); torch.cuda.synchronize()"
    ),
    "nccl": (
        "import os, time, torch, torch.distributed as dist;"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29533');"
        "torch.cuda.set_device(0); torch.zeros(1, device='cuda'); torch.cuda.synchronize(); time.sleep(0.3);"
        "dist.init_process_group('nccl', rank=0, world_size=1, device_id=torch.device('cuda', 0));"
        "t = torch.ones(1 << 20, device='cuda'); dist.all_reduce(t); torch.cuda.synchronize(); time.sleep(0.3);"
        "dist.destroy_process_group()"
    ),
    "triton": (
        "import torch, time, triton, triton.language as tl\n"
        "@triton.jit\n"
        "def k(x, n, B: tl.constexpr):\n"
        "    o = tl.program_id(0) * B + tl.arange(0, B); m = o < n\n"
        "    tl.store(x + o, tl.load(x + o, mask=m) + 1, mask=m)\n"
        "x = torch.zeros(4096, device='cuda'); torch.cuda.synchronize(); time.sleep(0.3)\n"
        "k[(4,)](x, 4096, B=1024); torch.cuda.synchronize()\n"
    ),
    "mallocasync": (
        "import torch, time; a = [torch.empty(64 << 20, dtype=torch.uint8, device='cuda') for _ in range(3)];"
        "torch.cuda.synchronize(); time.sleep(0.3); del a[1]; torch.cuda.synchronize(); time.sleep(0.3);"
        "torch.cuda.empty_cache(); torch.cuda.synchronize(); time.sleep(0.3)"
    ),
}
RUNS = [
    ("context", {}), ("context", {"CUDA_MODULE_LOADING": "EAGER"}),
    ("matmul", {}), ("matmul", {"CUDA_MODULE_LOADING": "EAGER"}),
    ("nccl", {"NCCL_CUMEM_ENABLE": "1"}), ("nccl", {"NCCL_CUMEM_ENABLE": "0"}),
    ("triton", {}),
    ("mallocasync", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
]

BPF_HEAD = r"""
#include <uapi/linux/ptrace.h>
struct ev { u64 ts; u32 pid; u32 sym; u64 ret; };
BPF_RINGBUF_OUTPUT(events, 256);
static int emit(struct pt_regs *ctx, u32 sym, u64 ret) {
    struct ev *e = events.ringbuf_reserve(sizeof(struct ev));
    if (!e) return 0;
    e->ts = bpf_ktime_get_ns(); e->pid = bpf_get_current_pid_tgid() >> 32; e->sym = sym; e->ret = ret;
    events.ringbuf_submit(e, 0);
    return 0;
}
"""


def main(out_dir: str) -> int:
    from bcc import BPF
    import pynvml

    lib = next((p for p in LIBCUDA_CANDIDATES if os.path.exists(p)), None)
    if lib is None:
        print("no libcuda.so.1 found", file=sys.stderr)
        return 2
    lib = os.path.realpath(lib)
    names = sorted({n.decode() for n, _ in BPF.get_user_functions_and_addresses(lib, ".*") if PATTERN.match(n.decode())})
    text = BPF_HEAD + "".join(
        f"int e{i}(struct pt_regs *ctx) {{ return emit(ctx, {i}, 0xffffffffffffffffULL); }}\n"
        f"int r{i}(struct pt_regs *ctx) {{ return emit(ctx, {i}, PT_REGS_RC(ctx)); }}\n"
        for i in range(len(names))
    )
    b = BPF(text=text)
    for i, n in enumerate(names):
        b.attach_uprobe(name=lib, sym=n, fn_name=f"e{i}")
        b.attach_uretprobe(name=lib, sym=n, fn_name=f"r{i}")
    print(f"probing {len(names)} symbols of {lib}", flush=True)

    calls: list[tuple[int, int, str, int]] = []

    def on_event(_ctx, data, _size):
        e = ctypes.cast(data, ctypes.POINTER(_Ev)).contents
        calls.append((e.ts, e.pid, names[e.sym], e.ret))

    b["events"].open_ring_buffer(on_event)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    results = {}
    for name, env in RUNS:
        calls.clear()
        samples: list[tuple[int, int, int]] = []
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                now = time.monotonic_ns()
                try:
                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        samples.append((now, p.pid, p.usedGpuMemory or 0))
                except pynvml.NVMLError:
                    pass
                time.sleep(0.002)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        # A file, not -c: Triton's @jit reads its function's source.
        script = os.path.join(out_dir, f"workload_{name}.py")
        with open(script, "w") as f:
            f.write(WORKLOADS[name] + "\nimport time; time.sleep(0.5)\n")
        proc = subprocess.Popen([sys.executable, script], env={**os.environ, **env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            b.ring_buffer_poll(20)
        b.ring_buffer_poll(50)
        stop.set()
        t.join()
        out = proc.stdout.read().decode(errors="replace")[-2000:]
        key = name + "".join(f" {k}={v}" for k, v in env.items())
        mine = [c for c in calls if c[1] == proc.pid]
        results[key] = {"rc": proc.returncode, "pid": proc.pid, "output": out,
                        "calls": mine, "samples": [s for s in samples if s[1] == proc.pid]}
        summarise(key, results[key])
    for name in WORKLOADS:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(out_dir, f"workload_{name}.py"))
    with open(os.path.join(out_dir, "untraced-explore.json"), "w") as f:
        json.dump({"symbols": names, "library": lib, "runs": results}, f)
    return 0


class _Ev(ctypes.Structure):
    _fields_ = [("ts", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("sym", ctypes.c_uint32), ("ret", ctypes.c_uint64)]


def summarise(key: str, run: dict) -> None:
    """Print per-symbol counts and each NVML step with the calls in flight or just before it."""
    print(f"\n=== {key}: rc {run['rc']}, {len(run['calls'])} probe hits, {len(run['samples'])} NVML samples")
    if run["rc"]:
        print(run["output"])
    counts: dict[str, int] = {}
    for _, _, sym, ret in run["calls"]:
        if ret == 0xFFFFFFFFFFFFFFFF:
            counts[sym] = counts.get(sym, 0) + 1
    for sym, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {n:7d}  {sym}")
    prev = None
    for ts, _, used in run["samples"]:
        if prev is not None and used != prev[1]:
            window = [c for c in run["calls"] if prev[0] - 5_000_000 <= c[0] <= ts and c[3] == 0xFFFFFFFFFFFFFFFF]
            near = sorted({c[2] for c in window})
            print(f"  NVML {prev[1] >> 20} -> {used >> 20} MiB at +{(ts - run['samples'][0][0]) / 1e6:.1f} ms;"
                  f" calls in the 5 ms before: {', '.join(near[:12]) or '-'}")
        prev = (ts, used)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
