"""A CUDA-driver workload for the stub driver: ``python -m memrec.validation.stubdriver.workload SCENARIO...``.

Why it exists: the probe tests and the no-GPU quick start need processes that call the driver
API the way real programs do (contexts per thread, VMM, IPC across processes, a child with
``CUDA_VISIBLE_DEVICES``, a process that exits without freeing). The program drives the stub
through ctypes, whose libffi calls follow the SysV ABI, so the 64-byte ``CUipcMemHandle`` really is
passed by value on the stack, as from C.

With ``--facts`` it prints one JSON object on stdout: every driver call it made (pid, tid, api,
arguments, outputs, result, the ordinal current on the calling thread and the physical device
behind it) and every process it started, so a test can predict the exact events the probes
must record. ``-v`` logs one line per call on stderr. Exit status 0 means every call returned
what the scenario expected.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from memrec.base.errors import MemrecError
from memrec.validation.stubdriver.driver import CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
from memrec.validation.stubdriver.driver import CU_MEM_ATTACH_GLOBAL
from memrec.validation.stubdriver.driver import CU_MEMHOSTALLOC_PORTABLE
from memrec.validation.stubdriver.driver import CU_MEMHOSTREGISTER_PORTABLE
from memrec.validation.stubdriver.driver import CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
from memrec.validation.stubdriver.driver import CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES
from memrec.validation.stubdriver.driver import CU_AD_FORMAT_FLOAT
from memrec.validation.stubdriver.driver import CU_LIMIT_MALLOC_HEAP_SIZE
from memrec.validation.stubdriver.driver import CU_LIMIT_STACK_SIZE
from memrec.validation.stubdriver.driver import CUDA_ERROR_FILE_NOT_FOUND
from memrec.validation.stubdriver.driver import CUDA_ERROR_NOT_SUPPORTED
from memrec.validation.stubdriver.driver import CUDA_ERROR_OUT_OF_MEMORY
from memrec.validation.stubdriver.driver import GRANULE
from memrec.validation.stubdriver.driver import IMAGE
from memrec.validation.stubdriver.driver import POOL
from memrec.validation.stubdriver.driver import PTX_MODULE
from memrec.validation.stubdriver.driver import POOL_PTSZ
from memrec.validation.stubdriver.driver import STREAM
from memrec.validation.stubdriver.driver import STREAM_PTSZ
from memrec.validation.stubdriver.driver import Driver
from memrec.validation.stubdriver.driver import Facts
from memrec.validation.stubdriver.driver import MiB
from memrec.validation.stubdriver.driver import WorkloadError

# ---- scenarios ------------------------------------------------------------------------------------


def scenario_basic(drv: Driver, ctx: RunContext) -> None:
    """Device 0: distinctive allocation sizes, pitch, managed, async and pool variants, pinned host
    memory, and one allocation over the device's capacity that fails with OUT_OF_MEMORY."""
    drv.use_device(0)
    sizes = (4 * MiB + 512, 123_456_768, 777)
    ptrs = [drv.alloc(s) for s in sizes]
    pitch_ptr, _ = drv.alloc_pitch(width=1000, height=300, elem=4)
    managed = drv.alloc_managed(65_536 + 8, CU_MEM_ATTACH_GLOBAL)
    a1 = drv.alloc_async("cuMemAllocAsync", 3 * MiB + 3, STREAM)
    a2 = drv.alloc_async("cuMemAllocAsync_ptsz", 5 * MiB + 5, STREAM_PTSZ)
    p1 = drv.alloc_from_pool("cuMemAllocFromPoolAsync", 7 * MiB + 7, POOL, STREAM)
    p2 = drv.alloc_from_pool("cuMemAllocFromPoolAsync_ptsz", 9 * MiB + 9, POOL_PTSZ, STREAM_PTSZ)
    capacity = drv.total_mem(0)
    drv.alloc(capacity + 1, expect=CUDA_ERROR_OUT_OF_MEMORY)
    assert drv.ctx_get_device() == 0
    h1 = drv.host_alloc(8192 + 16, CU_MEMHOSTALLOC_PORTABLE)
    h2 = drv.alloc_host(12_288 + 32)
    buf = ctypes.create_string_buffer(16_384)
    drv.host_register(ctypes.addressof(buf), 16_384, CU_MEMHOSTREGISTER_PORTABLE)
    drv.host_unregister(ctypes.addressof(buf))
    drv.free_host(h1)
    drv.free_host(h2)
    drv.free_async("cuMemFreeAsync", a1, STREAM)
    drv.free_async("cuMemFreeAsync_ptsz", a2, STREAM_PTSZ)
    drv.free_async("cuMemFreeAsync", p1, STREAM)
    drv.free_async("cuMemFreeAsync_ptsz", p2, STREAM_PTSZ)
    for p in (*ptrs, pitch_ptr, managed):
        drv.free(p)


def scenario_vmm(drv: Driver, ctx: RunContext) -> None:
    """Reserve VA, create physical memory on device 1 while device 0 is current, map it, share it
    (retain, POSIX fd and fabric export/import), then undo everything; plus a cuMemCreate that
    fails with OUT_OF_MEMORY."""
    drv.use_device(0)
    va_size = 64 * MiB
    va = drv.address_reserve(va_size, GRANULE, 0)
    size = 32 * MiB
    handle = drv.mem_create(size, device=1)
    drv.mem_map(va, size, 0, handle)
    drv.mem_map(va + size, 16 * MiB, 16 * MiB, handle)
    retained = drv.retain_allocation_handle(va + 4096)
    if retained != handle:
        raise WorkloadError(f"cuMemRetainAllocationHandle gave {retained:#x}, expected {handle:#x}")
    drv.mem_release(retained)
    fd = drv.export_fd(handle)
    imported = drv.import_fd(fd)
    os.close(fd)
    drv.mem_release(imported)
    fabric = drv.export_fabric(handle)
    imported_fabric = drv.import_fabric(fabric)
    drv.mem_release(imported_fabric)
    drv.mem_unmap(va + size, 16 * MiB)
    drv.mem_unmap(va, size)
    drv.mem_release(handle)
    drv.address_free(va, va_size)
    too_big = (drv.total_mem(1) // GRANULE + 1) * GRANULE
    drv.mem_create(too_big, device=1, expect=CUDA_ERROR_OUT_OF_MEMORY)


def scenario_ipc(drv: Driver, ctx: RunContext) -> None:
    """The parent exports an allocation; a forked child opens and closes the handle; an exec'd
    importer in another process gets the handle bytes over a pipe and opens it on device 1."""
    drv.use_device(0)
    ptr = drv.alloc(6 * MiB + 64)
    blob = drv.ipc_get_handle(ptr)

    # A forked child: no exec, the library stays loaded (fine for the stub, unlike the real driver).
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        status = 0
        child = Facts()
        try:
            drv.facts = child
            drv._local = threading.local()
            drv.use_device(0)
            mapped = drv.ipc_open(blob, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            drv.ipc_close(mapped)
        except WorkloadError as exc:
            print(f"workload: forked ipc child: {exc}", file=sys.stderr)
            status = 1
        with os.fdopen(wfd, "w") as out:
            json.dump({"calls": child.calls, "processes": []}, out)
        os._exit(status)
    os.close(wfd)
    with os.fdopen(rfd) as inp:
        data = inp.read()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise WorkloadError(f"forked ipc child failed (status {status})")
    drv.facts.merge(json.loads(data))
    drv.facts.processes.append({"pid": pid, "ppid": os.getpid(), "role": "ipc-fork", "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})

    ctx.run_child("_ipc_import", stdin=blob.hex() + "\n", role="ipc-importer")
    drv.free(ptr)


def scenario_ipc_import(drv: Driver, ctx: RunContext) -> None:
    """(internal) Read a handle from stdin, open it on device 1 (flags 0, where the forked child
    passes 1: the probes must read Flags from the right register either way), close it."""
    blob = bytes.fromhex(sys.stdin.readline().strip())
    drv.use_device(1)
    mapped = drv.ipc_open(blob, 0)
    drv.ipc_close(mapped)


def scenario_multi(drv: Driver, ctx: RunContext) -> None:
    """Two devices in one process through set-current, push/pop and created contexts, a thread with
    its own current context, and a child whose CUDA_VISIBLE_DEVICES=1 makes ordinal 0 physical 1."""
    c0 = drv.primary_ctx_retain(0)
    c1 = drv.primary_ctx_retain(1)
    drv.ctx_set_current(c0)
    a = drv.alloc(1 * MiB + 1)
    drv.ctx_set_current(c1)
    b = drv.alloc(1 * MiB + 2)
    drv.ctx_push(c0)
    c = drv.alloc(1 * MiB + 3)
    drv.ctx_pop()
    d = drv.alloc(1 * MiB + 4)
    if drv.ctx_get_current() != c1:
        raise WorkloadError("cuCtxGetCurrent does not return the context set last")
    created = []
    for version, dev in ((2, 0), (3, 1), (4, 0)):
        cx = drv.ctx_create(version, dev)
        p = drv.alloc(2 * MiB + version)
        drv.free(p)
        created.append(cx)
        drv.ctx_destroy(cx)
    e = drv.alloc(1 * MiB + 5)

    errors: list[BaseException] = []

    def worker() -> None:
        try:
            drv.ctx_set_current(c0)
            t = drv.alloc(1 * MiB + 6)
            drv.free(t)
        except WorkloadError as exc:
            errors.append(exc)

    th = threading.Thread(target=worker, name="multi-worker")
    th.start()
    th.join()
    if errors:
        raise errors[0]
    for p in (a, b, c, d, e):
        drv.free(p)
    ctx.run_child("_visible_child", env={"CUDA_VISIBLE_DEVICES": "1"}, role="visible-devices-1")


def scenario_visible_child(drv: Driver, ctx: RunContext) -> None:
    """(internal) Run with CUDA_VISIBLE_DEVICES=1: ordinal 0 is physical device 1."""
    if drv.device_count() != 1:
        raise WorkloadError("expected exactly one visible device")
    drv.use_device(0)
    p = drv.alloc(3 * MiB + 11)
    drv.free(p)


def scenario_leak(drv: Driver, ctx: RunContext) -> None:
    """A child allocates on device 1 and exits without freeing (the driver frees at exit)."""
    ctx.run_child("_leak_child", role="leaker")


def scenario_leak_child(drv: Driver, ctx: RunContext) -> None:
    """(internal) Allocate and exit without freeing."""
    drv.use_device(1)
    for size in (10 * MiB + 1, 20 * MiB + 2, 30 * MiB + 3):
        drv.alloc(size)


def scenario_code(drv: Driver, ctx: RunContext) -> None:
    """Device code, as PyTorch and NCCL load it: a library loaded before any context (nothing on
    the device yet), kernels fetched once a context is current (the first one is the context's lazy
    first-launch step), a library from a file, every cuModuleLoad* flavour, unloads, and a module
    file that does not exist (CUDA_ERROR_FILE_NOT_FOUND)."""
    image = ctypes.create_string_buffer(IMAGE, len(IMAGE))
    # As PyTorch and NCCL do: the image lies in a mapped library (here the driver's own file).
    lib = drv.library_load_data(ctypes.cast(drv.lib.cuInit, ctypes.c_void_p).value)
    drv.use_device(0)
    first = drv.library_get_kernel(lib, "memrec_first_kernel")
    drv.kernel_get_function(first)
    second = drv.library_get_kernel(lib, "_Z13memrec_kernelPfS_i_a_name_longer_than_the_sixty_three_bytes_kept")
    drv.kernel_get_function(second)
    from_file = drv.library_load_file(ctx.lib)
    third = drv.library_get_kernel(from_file, "memrec_file_kernel")
    drv.kernel_get_function(third)
    modules = [drv.module_load("cuModuleLoad", ctx.lib)]
    modules += [drv.module_load(api, image) for api in ("cuModuleLoadData", "cuModuleLoadDataEx", "cuModuleLoadFatBinary")]
    drv.module_load("cuModuleLoad", "/nonexistent/memrec.cubin", expect=CUDA_ERROR_FILE_NOT_FOUND)
    for m in modules:
        drv.module_unload(m)
    drv.library_unload(from_file)


def scenario_pool(drv: Driver, ctx: RunContext) -> None:
    """Stream-ordered pools as PyTorch's cudaMallocAsync backend and NCCL use them: the default pool
    told to keep everything (release threshold UINT64_MAX), three blocks, one freed (the pool keeps
    it), a trim that gives it back; a pool of its own created, used, kept, destroyed."""
    drv.use_device(0)
    default = drv.default_mem_pool(0)
    drv.pool_set_attribute(default, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 2**64 - 1)
    drv.pool_set_attribute(default, CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, 1)
    blocks = [drv.alloc_async("cuMemAllocAsync", 64 * MiB, STREAM) for _ in range(3)]
    drv.free_async("cuMemFreeAsync", blocks[1], STREAM)
    drv.pool_trim(default, 0)
    own = drv.pool_create(0, 1 << 30)
    p = drv.alloc_from_pool("cuMemAllocFromPoolAsync", 32 * MiB, own, STREAM)
    drv.free_async("cuMemFreeAsync", p, STREAM)  # threshold 0: given back at once
    drv.pool_set_attribute(own, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 16 * MiB)
    p = drv.alloc_from_pool("cuMemAllocFromPoolAsync", 32 * MiB, own, STREAM)
    drv.free_async("cuMemFreeAsync", p, STREAM)  # kept: 16 MiB of it
    drv.pool_destroy(own)
    for b in (blocks[0], blocks[2]):
        drv.free_async("cuMemFreeAsync", b, STREAM)
    drv.pool_trim(default, 0)


def scenario_families(drv: Driver, ctx: RunContext) -> None:
    """Issue 21's device memory that no allocation call takes, on device 0, as measured on an H200:
    the issue's case first (a one-line PTX module, then at once a 16 KiB stack limit, an 8192 x 8192
    float array and a launch), then arrays (3D, mipmapped) and their destroys, the malloc heap (it
    lands at the next module load), a 512 MiB stream-ordered allocation captured into a graph and
    freed in it, instantiated and launched, a graph with a 768 MiB memory node uploaded, the graph
    pool trimmed, and a multicast object (refused unless MEMREC_STUB_MULTICAST=1). Between blocks
    it waits MEMREC_FAMILIES_PAUSE seconds (default 0.3) so a recorder's NVML readings separate them."""
    pause = float(os.environ.get("MEMREC_FAMILIES_PAUSE", "0.3"))
    drv.use_device(0)
    drv.launch()  # the context's first launch
    time.sleep(pause)
    image = ctypes.create_string_buffer(PTX_MODULE, len(PTX_MODULE))
    drv.module_load("cuModuleLoadData", image)
    drv.ctx_set_limit(CU_LIMIT_STACK_SIZE, 16384)
    big = drv.array_create(8192, 8192, CU_AD_FORMAT_FLOAT, 1)
    drv.launch()
    time.sleep(pause)
    cube = drv.array3d_create("cuArray3DCreate_v2", 256, 256, 256, CU_AD_FORMAT_FLOAT, 1)
    mip = drv.array3d_create("cuMipmappedArrayCreate", 4096, 4096, 0, CU_AD_FORMAT_FLOAT, 1, levels=13)
    time.sleep(pause)
    drv.array_destroy("cuArrayDestroy", cube)
    drv.array_destroy("cuMipmappedArrayDestroy", mip)
    drv.array_destroy("cuArrayDestroy", big)
    time.sleep(pause)
    drv.ctx_set_limit(CU_LIMIT_MALLOC_HEAP_SIZE, 256 * MiB)
    time.sleep(pause)
    drv.module_load("cuModuleLoadData", image)
    time.sleep(pause)
    drv.begin_capture(STREAM)
    p = drv.alloc_async("cuMemAllocAsync", 512 * MiB, STREAM)
    drv.free_async("cuMemFreeAsync", p, STREAM)
    graph = drv.end_capture(STREAM)
    exec_ = drv.graph_instantiate(graph)
    time.sleep(pause)
    for _ in range(3):
        drv.graph_launch(exec_, STREAM)
    time.sleep(pause)
    nodes = drv.graph_create()
    q = drv.graph_mem_alloc_node(nodes, 768 * MiB, 0)
    drv.graph_mem_free_node(nodes, q)
    drv.graph_upload(drv.graph_instantiate(nodes), STREAM)
    time.sleep(pause)
    drv.graph_mem_trim(0)
    time.sleep(pause)
    if os.environ.get("MEMREC_STUB_MULTICAST") == "1":
        mc = drv.multicast_create(512 * MiB, 1)
        drv.multicast_add_device(mc, 0)
        mem = drv.mem_create(512 * MiB, 0)
        drv.multicast_bind_mem(mc, mem, 512 * MiB)
        drv.multicast_unbind(mc, 0, 512 * MiB)
        drv.mem_release(mem)
    else:
        drv.multicast_create(512 * MiB, 1, expect=CUDA_ERROR_NOT_SUPPORTED)


def scenario_nccl_init(drv: Driver, ctx: RunContext) -> None:
    """What NCCL's init does to the driver, as counted on an H200 (docs/validation/
    untraced-explore.md): a library loaded, 243 kernels fetched into the context (cuLibraryGetKernel
    and cuKernelGetFunction each), a pool of its own made and destroyed; the library unloaded."""
    drv.use_device(0)
    lib = drv.library_load_data(ctypes.cast(drv.lib.cuInit, ctypes.c_void_p).value)
    for i in range(243):
        drv.kernel_get_function(drv.library_get_kernel(lib, f"ncclDevKernel_{i}"))
    drv.pool_destroy(drv.pool_create(0, 1 << 30))
    drv.library_unload(lib)


def scenario_foreign(drv: Driver, ctx: RunContext) -> None:
    """A context on device 1 where the process allocates nothing (what careless tooling and IPC
    do: a "foreign context"), beside its work on device 0."""
    drv.use_device(0)
    p = drv.alloc(8 * MiB)
    c1 = drv.primary_ctx_retain(1)
    drv.ctx_push(c1)
    drv.ctx_pop()
    drv.free(p)


SCENARIOS: dict[str, Callable[[Driver, RunContext], None]] = {
    "basic": scenario_basic,
    "vmm": scenario_vmm,
    "ipc": scenario_ipc,
    "multi": scenario_multi,
    "leak": scenario_leak,
    "code": scenario_code,
    "pool": scenario_pool,
    "foreign": scenario_foreign,
    "families": scenario_families,
    "nccl_init": scenario_nccl_init,
}
DEMO = ("basic", "vmm", "ipc", "multi", "leak", "code", "pool", "foreign")
INTERNAL: dict[str, Callable[[Driver, RunContext], None]] = {
    "_ipc_import": scenario_ipc_import,
    "_visible_child": scenario_visible_child,
    "_leak_child": scenario_leak_child,
}


@dataclass
class RunContext:
    """How a scenario starts child processes: the same program, same library, facts collected."""

    lib: str
    verbose: bool
    facts: Facts

    def run_child(self, scenario: str, *, role: str, stdin: str | None = None, env: dict | None = None) -> None:
        cmd = [sys.executable, "-m", "memrec.validation.stubdriver.workload", "--lib", self.lib, "--facts", scenario]
        if self.verbose:
            cmd.insert(-1, "-v")
        child_env = dict(os.environ)
        child_env.update(env or {})
        proc = subprocess.run(cmd, input=stdin or "", capture_output=True, text=True, env=child_env, timeout=60, check=False)
        if proc.stderr:
            sys.stderr.write(proc.stderr)
        if proc.returncode != 0:
            raise WorkloadError(f"child scenario {scenario} exited {proc.returncode}")
        child = json.loads(proc.stdout)
        self.facts.merge(child)
        self.facts.processes.append(
            {"pid": child["pid"], "ppid": os.getpid(), "role": role,
             "cuda_visible_devices": child_env.get("CUDA_VISIBLE_DEVICES")}
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m memrec.validation.stubdriver.workload",
        description="Drive the stub CUDA driver through the scenarios memrec's probes are tested with.",
        epilog="scenarios: " + ", ".join(SCENARIOS) + ", demo (all of them in sequence)",
    )
    parser.add_argument("scenarios", nargs="+", metavar="SCENARIO")
    parser.add_argument("--lib", help="the stub libcuda.so.1 (default: $MEMREC_STUB_LIB, else build it)")
    parser.add_argument("--facts", action="store_true", help="print the calls made as JSON on stdout")
    parser.add_argument("--wait", action="store_true", help="read one line from stdin before starting")
    parser.add_argument("--linger", type=float, default=0.0, metavar="S",
                        help="sleep S seconds after the scenarios (a recorder's last NVML reading of the final state)")
    parser.add_argument("--hold", action="store_true",
                        help="after the scenarios, print 'ready' and read one line from stdin before exiting")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every driver call on stderr")
    args = parser.parse_args(argv)
    known = set(SCENARIOS) | set(INTERNAL) | {"demo"}
    for name in args.scenarios:
        if name not in known:
            parser.error(f"unknown scenario {name!r} (choose from {', '.join(sorted(set(SCENARIOS) | {'demo'}))})")
    return args


def resolve_lib(arg: str | None) -> str:
    if arg:
        return arg
    env = os.environ.get("MEMREC_STUB_LIB")
    if env:
        return env
    from memrec.validation.stubdriver.build import build_stub  # only when no library was named

    return str(build_stub())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        lib = resolve_lib(args.lib)
    except (MemrecError, OSError) as exc:
        print(f"workload: error: {exc}", file=sys.stderr)
        return 1
    names: list[str] = []
    for name in args.scenarios:
        names.extend(DEMO if name == "demo" else (name,))
    if args.wait:
        sys.stdin.readline()
    facts = Facts()
    try:
        drv = Driver(lib, facts, verbose=args.verbose)
    except OSError as exc:
        print(f"workload: error: cannot load {lib}: {exc}", file=sys.stderr)
        return 1
    run = RunContext(lib=lib, verbose=args.verbose, facts=facts)
    try:
        drv.init()
        for name in names:
            fn = SCENARIOS.get(name) or INTERNAL[name]
            fn(drv, run)
    except (WorkloadError, subprocess.SubprocessError, json.JSONDecodeError) as exc:
        print(f"workload: error: {exc}", file=sys.stderr)
        return 1
    if args.linger > 0:
        time.sleep(args.linger)
    if args.hold:
        print("ready", file=sys.stderr, flush=True)
        sys.stdin.readline()
    if args.facts:
        json.dump({"pid": os.getpid(), "scenarios": names, "lib": lib, "calls": facts.calls, "processes": facts.processes}, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
