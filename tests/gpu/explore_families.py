"""What CUDA arrays, context limits, graph memory and multicast objects cost on the device, by NVML.

Why this exists (issue 21): memrec attributes NVML's per-process steps to the calls that explain
them. Before the recorder claims a rule (an array's footprint from its descriptor, a stack limit's
cost at the next launch, the graph pool at the first launch), this script measures each on a real
GPU: NVML per-process ``used`` read right before and after every call (after a synchronize and a
short wait), through cuda-python's driver API as PyTorch and SGLang reach the driver.

    python3 tests/gpu/explore_families.py OUT_DIR [--only NAME ...]

prints one JSON line per call (``{"step": ..., "call": ..., "before": ..., "after": ...}``) and
writes them to ``OUT_DIR/families-explore.jsonl``. Every workload runs in its own process (its
NVML used starts from nothing). A research tool for the GPU host, not part of the recorder.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20

PTX_HEAD = ".version 8.0\n.target sm_90\n.address_size 64\n"
PTX_TINY = PTX_HEAD + ".visible .entry k() { ret; }\n"
# A kernel whose threads each need 64 KiB of local memory: the driver grows the stack on its own.
PTX_LOCAL = PTX_HEAD + """
.visible .entry big(.param .u64 out) {
  .local .align 4 .b8 buf[65536];
  .reg .b32 %r<4>; .reg .b64 %rd<6>;
  mov.u32 %r1, %tid.x;
  and.b32 %r2, %r1, 16383;
  mul.wide.u32 %rd1, %r2, 4;
  mov.u64 %rd2, buf;
  add.u64 %rd3, %rd2, %rd1;
  st.local.u32 [%rd3], %r1;
  ld.local.u32 %r3, [%rd2];
  ld.param.u64 %rd4, [out];
  cvta.to.global.u64 %rd5, %rd4;
  st.global.u32 [%rd5], %r3;
  ret;
}
"""
# A module with a 256 MiB __device__ array: its image is a few hundred bytes.
PTX_GLOBAL = PTX_HEAD + """
.global .align 8 .b8 gbuf[268435456];
.visible .entry g() {
  .reg .b64 %rd<2>; .reg .b32 %r<2>;
  mov.u32 %r1, %tid.x;
  mov.u64 %rd1, gbuf;
  st.global.u32 [%rd1], %r1;
  ret;
}
"""


def driver():
    from cuda.bindings import driver as cu

    return cu


def ok(result, what):
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"{what}: CUresult {int(err)}")
    return values[0] if len(values) == 1 else (values or None)


class Probe:
    """NVML per-process used of this process on GPU 0, and a log of bracketed calls."""

    def __init__(self, name):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.dev = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.name = name
        self.rows = []

    def used(self):
        for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.dev):
            if p.pid == os.getpid():
                return int(p.usedGpuMemory or 0)
        return 0

    def step(self, call, fn, wait=0.25, sync=True, **extra):
        """Call ``fn`` between two readings (``sync=False`` inside a stream capture: a context
        synchronisation there invalidates the capture, CUresult 901 in the 2026-12-01 run)."""
        cu = driver()
        before = self.used()
        t0 = time.monotonic()
        try:
            out = fn()
            err = None
        except Exception as e:  # noqa: BLE001 - a research log: record and go on
            out, err = None, str(e)
        took = time.monotonic() - t0
        if sync:
            try:
                cu.cuCtxSynchronize()
            except Exception:  # noqa: BLE001
                pass
        time.sleep(wait)
        after = self.used()
        row = dict(workload=self.name, call=call, before=before, after=after, step_mib=(after - before) / MiB,
                   took_ms=round(took * 1e3, 3), error=err, **extra)
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        return out


def context(p):
    cu = driver()
    p.step("cuInit", lambda: ok(cu.cuInit(0), "cuInit"))
    dev = ok(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = p.step("cuDevicePrimaryCtxRetain", lambda: ok(cu.cuDevicePrimaryCtxRetain(dev), "retain"))
    ok(cu.cuCtxSetCurrent(ctx), "set")
    A = cu.CUdevice_attribute
    attrs = {name: ok(cu.cuDeviceGetAttribute(getattr(A, name), dev), name) for name in (
        "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT", "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR",
        "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED", "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK")}
    limits = {}
    for name in ("CU_LIMIT_STACK_SIZE", "CU_LIMIT_MALLOC_HEAP_SIZE", "CU_LIMIT_PRINTF_FIFO_SIZE",
                 "CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT"):
        try:
            limits[name] = ok(cu.cuCtxGetLimit(getattr(cu.CUlimit, name)), name)
        except Exception as e:  # noqa: BLE001
            limits[name] = str(e)
    print(json.dumps(dict(workload=p.name, attrs=attrs, limits=limits)), flush=True)
    p.rows.append(dict(workload=p.name, attrs=attrs, limits=limits))
    return dev, ctx


def load(p, ptx, fn_name):
    cu = driver()
    mod = p.step(f"cuModuleLoadData({fn_name}, {len(ptx)} B)", lambda: ok(cu.cuModuleLoadData(ptx.encode() + b"\0"), "load"))
    f = p.step(f"cuModuleGetFunction({fn_name})", lambda: ok(cu.cuModuleGetFunction(mod, fn_name.encode()), "getfn"))
    return mod, f


def launch(p, f, what, params=0, threads=1, blocks=1):
    cu = driver()
    p.step(what, lambda: ok(cu.cuLaunchKernel(f, blocks, 1, 1, threads, 1, 1, 0, 0, params, 0), "launch"))


def limit(p, name, value):
    cu = driver()
    p.step(f"cuCtxSetLimit({name}, {value})", lambda: ok(cu.cuCtxSetLimit(getattr(cu.CUlimit, name), value), name),
           limit=name, value=value)
    got = ok(cu.cuCtxGetLimit(getattr(cu.CUlimit, name)), "get")
    p.rows.append(dict(workload=p.name, get_limit=name, value=int(got)))
    print(json.dumps(p.rows[-1]), flush=True)


# ---- workloads -----------------------------------------------------------------------------------

def w_arrays(p):
    cu = driver()
    context(p)
    F = cu.CUarray_format
    cases = [
        ("2d float 8192x8192x1", 8192, 8192, 0, F.CU_AD_FORMAT_FLOAT, 1, 0),
        ("2d u8 1000x1000x4", 1000, 1000, 0, F.CU_AD_FORMAT_UNSIGNED_INT8, 4, 0),
        ("2d half 4097x3x2", 4097, 3, 0, F.CU_AD_FORMAT_HALF, 2, 0),
        ("1d float 1M x1", 1 << 20, 0, 0, F.CU_AD_FORMAT_FLOAT, 1, 0),
        ("3d float 256^3 x1", 256, 256, 256, F.CU_AD_FORMAT_FLOAT, 1, 0),
        ("3d u16 300x200x100 x4", 300, 200, 100, F.CU_AD_FORMAT_UNSIGNED_INT16, 4, 0),
    ]
    made = []
    for name, w, h, d, fmt, ch, levels in cases:
        if d == 0:
            desc = cu.CUDA_ARRAY_DESCRIPTOR()
            desc.Width, desc.Height, desc.Format, desc.NumChannels = w, h, fmt, ch
            arr = p.step(f"cuArrayCreate({name})", lambda: ok(cu.cuArrayCreate(desc), "arr"),
                         w=w, h=h, d=d, fmt=int(fmt), ch=ch)
        else:
            desc = cu.CUDA_ARRAY3D_DESCRIPTOR()
            desc.Width, desc.Height, desc.Depth, desc.Format, desc.NumChannels, desc.Flags = w, h, d, fmt, ch, 0
            arr = p.step(f"cuArray3DCreate({name})", lambda: ok(cu.cuArray3DCreate(desc), "arr3"),
                         w=w, h=h, d=d, fmt=int(fmt), ch=ch)
        made.append((name, arr))
    mip = cu.CUDA_ARRAY3D_DESCRIPTOR()
    mip.Width, mip.Height, mip.Depth, mip.Format, mip.NumChannels, mip.Flags = 4096, 4096, 0, F.CU_AD_FORMAT_FLOAT, 1, 0
    mm = p.step("cuMipmappedArrayCreate(float 4096x4096 x1, 13 levels)",
                lambda: ok(cu.cuMipmappedArrayCreate(mip, 13), "mip"), w=4096, h=4096, d=0, ch=1, levels=13)
    mip2 = cu.CUDA_ARRAY3D_DESCRIPTOR()
    mip2.Width, mip2.Height, mip2.Depth, mip2.Format, mip2.NumChannels, mip2.Flags = 2048, 2048, 0, F.CU_AD_FORMAT_FLOAT, 4, 0
    mm2 = p.step("cuMipmappedArrayCreate(float 2048x2048 x4, 3 levels)",
                 lambda: ok(cu.cuMipmappedArrayCreate(mip2, 3), "mip"), w=2048, h=2048, d=0, ch=4, levels=3)
    for name, arr in made:
        p.step(f"cuArrayDestroy({name})", lambda arr=arr: ok(cu.cuArrayDestroy(arr), "destroy"))
    p.step("cuMipmappedArrayDestroy(13 levels)", lambda: ok(cu.cuMipmappedArrayDestroy(mm), "mdestroy"))
    p.step("cuMipmappedArrayDestroy(3 levels)", lambda: ok(cu.cuMipmappedArrayDestroy(mm2), "mdestroy"))


def w_limits(p):
    cu = driver()
    context(p)
    _, f = load(p, PTX_TINY, "k")
    launch(p, f, "first launch")
    limit(p, "CU_LIMIT_STACK_SIZE", 16384)
    launch(p, f, "launch after stack 16 KiB")
    launch(p, f, "second launch after stack 16 KiB")
    limit(p, "CU_LIMIT_STACK_SIZE", 4096)
    launch(p, f, "launch after stack 4 KiB")
    limit(p, "CU_LIMIT_STACK_SIZE", 32768)
    launch(p, f, "launch after stack 32 KiB")
    limit(p, "CU_LIMIT_MALLOC_HEAP_SIZE", 256 * MiB)
    launch(p, f, "launch after heap 256 MiB")
    load(p, PTX_TINY.replace("entry k", "entry k2"), "k2")
    limit(p, "CU_LIMIT_PRINTF_FIFO_SIZE", 64 * MiB)
    launch(p, f, "launch after printf 64 MiB")
    limit(p, "CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT", 65536)
    launch(p, f, "launch after pending launches 65536")


def w_limits_heap_first(p):
    """The heap and FIFO before any launch or module: when do they land?"""
    cu = driver()
    context(p)
    limit(p, "CU_LIMIT_MALLOC_HEAP_SIZE", 512 * MiB)
    limit(p, "CU_LIMIT_PRINTF_FIFO_SIZE", 128 * MiB)
    _, f = load(p, PTX_TINY, "k")
    launch(p, f, "first launch")


def w_local(p):
    """A kernel needing 64 KiB of local memory per thread: does the stack grow, and what shows it?"""
    cu = driver()
    context(p)
    out = ok(cu.cuMemAlloc(4096), "alloc")
    mod, f = load(p, PTX_LOCAL, "big")
    attr = ok(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f), "attr")
    print(json.dumps(dict(workload=p.name, local_size_bytes=int(attr))), flush=True)
    p.rows.append(dict(workload=p.name, local_size_bytes=int(attr)))
    stack0 = ok(cu.cuCtxGetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE), "get")
    params = ((int(out),), (ctypes.c_uint64,))
    launch(p, f, "launch big-local kernel", params=params, threads=256, blocks=132)
    stack1 = ok(cu.cuCtxGetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE), "get")
    p.rows.append(dict(workload=p.name, stack_before=int(stack0), stack_after=int(stack1)))
    print(json.dumps(p.rows[-1]), flush=True)
    launch(p, f, "second launch big-local kernel", params=params, threads=256, blocks=132)


def w_global(p):
    """A module with a 256 MiB __device__ array: module code far beyond its image's size?"""
    context(p)
    _, f = load(p, PTX_GLOBAL, "g")
    launch(p, f, "launch g")


def w_graph(p):
    cu = driver()
    dev, _ = context(p)
    stream = ok(cu.cuStreamCreate(0), "stream")
    A = cu.CUgraphMem_attribute

    def attr():
        return {n: int(ok(cu.cuDeviceGetGraphMemAttribute(dev, getattr(A, n)), n)) for n in (
            "CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT", "CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT")}

    p.step("cuStreamBeginCapture", lambda: ok(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL), "begin"),
           sync=False)
    ptr = p.step("cuMemAllocAsync(512 MiB) captured", lambda: ok(cu.cuMemAllocAsync(512 * MiB, stream), "alloc"), sync=False)
    p.step("cuMemFreeAsync captured", lambda: ok(cu.cuMemFreeAsync(ptr, stream), "free"), sync=False)
    graph = p.step("cuStreamEndCapture", lambda: ok(cu.cuStreamEndCapture(stream), "end"), sync=False)
    gexec = p.step("cuGraphInstantiate", lambda: ok(cu.cuGraphInstantiate(graph, 0), "inst"), attrs=attr())
    p.rows.append(dict(workload=p.name, after_instantiate=attr()))
    for i in range(3):
        p.step(f"cuGraphLaunch #{i + 1}", lambda: ok(cu.cuGraphLaunch(gexec, stream), "launch"))
        p.rows.append(dict(workload=p.name, launch=i + 1, graphmem=attr()))
        print(json.dumps(p.rows[-1]), flush=True)
    # A second graph with explicit memory nodes, uploaded before its first launch.
    g2 = ok(cu.cuGraphCreate(0), "create")
    params = cu.CUDA_MEM_ALLOC_NODE_PARAMS()
    params.poolProps.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    params.poolProps.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    params.poolProps.location.id = 0
    params.bytesize = 768 * MiB
    node = p.step("cuGraphAddMemAllocNode(768 MiB)", lambda: ok(cu.cuGraphAddMemAllocNode(g2, None, 0, params), "node"))
    p.step("cuGraphAddMemFreeNode", lambda: ok(cu.cuGraphAddMemFreeNode(g2, [node], 1, params.dptr), "free node"))
    g2exec = p.step("cuGraphInstantiate(2)", lambda: ok(cu.cuGraphInstantiate(g2, 0), "inst"))
    p.step("cuGraphUpload(2)", lambda: ok(cu.cuGraphUpload(g2exec, stream), "upload"))
    p.rows.append(dict(workload=p.name, after_upload=attr()))
    print(json.dumps(p.rows[-1]), flush=True)
    p.step("cuGraphLaunch(2)", lambda: ok(cu.cuGraphLaunch(g2exec, stream), "launch"))
    p.rows.append(dict(workload=p.name, after_launch2=attr()))
    print(json.dumps(p.rows[-1]), flush=True)
    p.step("cuDeviceGraphMemTrim (graphs alive)", lambda: ok(cu.cuDeviceGraphMemTrim(dev), "trim"))
    p.step("cuGraphExecDestroy", lambda: ok(cu.cuGraphExecDestroy(gexec), "d"))
    p.step("cuGraphExecDestroy(2)", lambda: ok(cu.cuGraphExecDestroy(g2exec), "d"))
    p.step("cuDeviceGraphMemTrim", lambda: ok(cu.cuDeviceGraphMemTrim(dev), "trim"))
    p.rows.append(dict(workload=p.name, after_trim=attr()))
    print(json.dumps(p.rows[-1]), flush=True)


def w_multicast(p):
    cu = driver()
    dev, _ = context(p)
    supported = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev), "mc")
    prop = cu.CUmulticastObjectProp()
    prop.numDevices = 1
    prop.handleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.size = 512 * MiB
    try:
        gran = ok(cu.cuMulticastGetGranularity(prop, cu.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED), "gran")
    except Exception as e:  # noqa: BLE001
        gran = str(e)
    p.rows.append(dict(workload=p.name, multicast_supported=int(supported), granularity=str(gran)))
    print(json.dumps(p.rows[-1]), flush=True)
    mc = p.step("cuMulticastCreate(512 MiB, 1 device)", lambda: ok(cu.cuMulticastCreate(prop), "create"))
    if mc is None:
        return
    p.step("cuMulticastAddDevice(0)", lambda: ok(cu.cuMulticastAddDevice(mc, dev), "add"))
    mprop = cu.CUmemAllocationProp()
    mprop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    mprop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    mprop.location.id = 0
    mprop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    h = p.step("cuMemCreate(512 MiB)", lambda: ok(cu.cuMemCreate(512 * MiB, mprop, 0), "memcreate"))
    p.step("cuMulticastBindMem", lambda: ok(cu.cuMulticastBindMem(mc, 0, h, 0, 512 * MiB, 0), "bind"))
    p.step("cuMulticastUnbind", lambda: ok(cu.cuMulticastUnbind(mc, dev, 0, 512 * MiB), "unbind"))
    p.step("cuMemRelease(mem)", lambda: ok(cu.cuMemRelease(h), "rel"))
    p.step("cuMemRelease(multicast)", lambda: ok(cu.cuMemRelease(mc), "rel mc"))


def w_fast(p):
    """Everything in fast succession right after the context and a module load (no waits)."""
    cu = driver()
    ok(cu.cuInit(0), "init")
    dev = ok(cu.cuDeviceGet(0), "dev")
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "retain")
    ok(cu.cuCtxSetCurrent(ctx), "set")
    mod = ok(cu.cuModuleLoadData(PTX_TINY.encode() + b"\0"), "load")
    f = ok(cu.cuModuleGetFunction(mod, b"k"), "fn")
    ok(cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, 16384), "limit")
    desc = cu.CUDA_ARRAY_DESCRIPTOR()
    desc.Width, desc.Height, desc.Format, desc.NumChannels = 8192, 8192, cu.CUarray_format.CU_AD_FORMAT_FLOAT, 1
    ok(cu.cuArrayCreate(desc), "arr")
    ok(cu.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0), "launch")
    ok(cu.cuCtxSynchronize(), "sync")
    time.sleep(0.5)
    p.rows.append(dict(workload=p.name, total=p.used()))
    print(json.dumps(p.rows[-1]), flush=True)


WORKLOADS = {name[2:]: fn for name, fn in globals().items() if name.startswith("w_")}


COUNT = (r"^cu(Array|Mipmapped|CtxSetLimit|CtxGetLimit|StreamBeginCapture|StreamEndCapture|GraphInstantiate|GraphUpload"
         r"|GraphLaunch|DeviceGraphMemTrim|GraphAddMem|GraphMem|Multicast|MemAllocAsync|MemFreeAsync|ModuleLoad"
         r"|StreamGetCaptureInfo|StreamIsCapturing|ThreadExchangeStreamCaptureMode|GraphExecDestroy|GraphDestroy"
         r"|LaunchKernel|MemCreate|MemRelease|ModuleGetFunction)")


def counting():
    """Count entries of the candidate driver symbols per process (BCC), to know what to probe."""
    import re

    from bcc import BPF

    lib = next(p for p in ("/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1") if os.path.exists(p))
    lib = os.path.realpath(lib)
    names = sorted({n.decode() for n, _ in BPF.get_user_functions_and_addresses(lib, ".*") if re.match(COUNT, n.decode())})
    text = "#include <uapi/linux/ptrace.h>\nstruct k { u32 pid; u32 sym; };\nBPF_HASH(c, struct k, u64, 65536);\n" + "".join(
        f"int e{i}(struct pt_regs *ctx) {{ struct k key = {{bpf_get_current_pid_tgid() >> 32, {i}}}; c.increment(key); return 0; }}\n"
        for i in range(len(names)))
    b = BPF(text=text)
    for i, n in enumerate(names):
        b.attach_uprobe(name=lib, sym=n, fn_name=f"e{i}")
    print(json.dumps(dict(library=lib, symbols=names)), flush=True)
    return b, names


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        name = sys.argv[2]
        p = Probe(name)
        WORKLOADS[name](p)
        return 0
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    only = sys.argv[2:] or list(WORKLOADS)
    os.makedirs(out, exist_ok=True)
    counter = None
    if only and only[0] == "--count":
        only = only[1:] or list(WORKLOADS)
        counter, names = counting()
    with open(os.path.join(out, "families-explore.jsonl"), "w") as log:
        for name in only:
            r = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True, timeout=120)
            log.write(r.stdout)
            sys.stdout.write(r.stdout)
            if counter is not None:
                hits = {names[k.sym]: v.value for k, v in counter["c"].items()}
                counter["c"].clear()
                msg = json.dumps(dict(workload=name, symbol_hits=dict(sorted(hits.items()))))
                log.write(msg + "\n")
                print(msg, flush=True)
            if r.returncode:
                msg = json.dumps(dict(workload=name, rc=r.returncode, stderr=r.stderr[-2000:]))
                log.write(msg + "\n")
                print(msg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
