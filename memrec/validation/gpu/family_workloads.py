"""Driver-API workloads for issue 21's families: ``python -m memrec.validation.gpu.family_workloads SCENARIO``.

Why it exists: memrec must put every NVML step of a process on the right family (arrays, context
limits, graph memory, multicast, module code, context) or call it unexplained. These workloads
make each family's calls through cuda-python (``cuda.bindings.driver``), as PyTorch and SGLang
reach ``libcuda.so.1``, each in isolation with pauses between blocks, and in fast succession right
after a context creation and a module load; ``tests/gpu/test_families_gpu.py`` records them with
the real daemon. Each prints one JSON line of what it did (``{"scenario", "pid", "multicast"}``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MiB = 1 << 20
PAUSE = 0.5
PTX = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k() { ret; }\n\0"


class Gpu:
    """A primary context on device 0, and the calls the scenarios make (each checked)."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.ok(cu.cuInit(0))
        self.dev = self.ok(cu.cuDeviceGet(0))
        self.ctx = self.ok(cu.cuDevicePrimaryCtxRetain(self.dev))
        self.ok(cu.cuCtxSetCurrent(self.ctx))
        self.stream = self.ok(cu.cuStreamCreate(0))
        self.fn = None

    @staticmethod
    def ok(result):
        err, *values = result
        if int(err) != 0:
            raise SystemExit(f"family_workloads: CUresult {int(err)}")
        return values[0] if len(values) == 1 else (values or None)

    def module(self) -> None:
        mod = self.ok(self.cu.cuModuleLoadData(PTX))
        self.fn = self.ok(self.cu.cuModuleGetFunction(mod, b"k"))

    def launch(self) -> None:
        self.ok(self.cu.cuLaunchKernel(self.fn, 1, 1, 1, 1, 1, 1, 0, self.stream, 0, 0))
        self.ok(self.cu.cuStreamSynchronize(self.stream))

    def limit(self, name: str, value: int) -> None:
        self.ok(self.cu.cuCtxSetLimit(getattr(self.cu.CUlimit, name), value))

    def array(self, w: int, h: int, fmt: str = "CU_AD_FORMAT_FLOAT", ch: int = 1):
        d = self.cu.CUDA_ARRAY_DESCRIPTOR()
        d.Width, d.Height, d.Format, d.NumChannels = w, h, getattr(self.cu.CUarray_format, fmt), ch
        return self.ok(self.cu.cuArrayCreate(d))

    def array3d(self, w: int, h: int, d_: int, levels: int = 0):
        d = self.cu.CUDA_ARRAY3D_DESCRIPTOR()
        d.Width, d.Height, d.Depth, d.Format, d.NumChannels, d.Flags = w, h, d_, self.cu.CUarray_format.CU_AD_FORMAT_FLOAT, 1, 0
        if levels:
            return self.ok(self.cu.cuMipmappedArrayCreate(d, levels))
        return self.ok(self.cu.cuArray3DCreate(d))

    def capture(self, work):
        """An executable graph of what ``work()`` does on the stream while it is captured."""
        cu = self.cu
        self.ok(cu.cuStreamBeginCapture(self.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        work()
        return self.ok(cu.cuGraphInstantiate(self.ok(cu.cuStreamEndCapture(self.stream)), 0))

    def captured_graph(self, size: int):
        """A graph that allocates ``size`` bytes stream-ordered and frees them."""
        cu = self.cu

        def work() -> None:
            self.ok(cu.cuMemFreeAsync(self.ok(cu.cuMemAllocAsync(size, self.stream)), self.stream))

        return self.capture(work)

    def node_graph(self, size: int):
        cu = self.cu
        g = self.ok(cu.cuGraphCreate(0))
        params = cu.CUDA_MEM_ALLOC_NODE_PARAMS()
        params.poolProps.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        params.poolProps.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        params.poolProps.location.id = 0
        params.bytesize = size
        node = self.ok(cu.cuGraphAddMemAllocNode(g, None, 0, params))
        self.ok(cu.cuGraphAddMemFreeNode(g, [node], 1, params.dptr))
        return self.ok(cu.cuGraphInstantiate(g, 0))

    def graph_launch(self, exec_) -> None:
        self.ok(self.cu.cuGraphLaunch(exec_, self.stream))
        self.ok(self.cu.cuStreamSynchronize(self.stream))

    def multicast(self, size: int) -> bool:
        """A multicast object of one device (NVLS), bound to as much device memory; False where
        the device has no multicast (one H200 without NVSwitch)."""
        cu = self.cu
        supported = self.ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, self.dev))
        prop = cu.CUmulticastObjectProp()
        prop.numDevices, prop.size = 1, size
        prop.handleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        err, mc = cu.cuMulticastCreate(prop)
        if int(err) != 0:
            return False
        self.ok(cu.cuMulticastAddDevice(mc, self.dev))
        mp = cu.CUmemAllocationProp()
        mp.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        mp.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        mp.location.id = 0
        mp.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        mem = self.ok(cu.cuMemCreate(size, mp, 0))
        self.ok(cu.cuMulticastBindMem(mc, 0, mem, 0, size, 0))
        time.sleep(PAUSE)
        self.ok(cu.cuMulticastUnbind(mc, self.dev, 0, size))
        self.ok(cu.cuMemRelease(mem))
        self.ok(cu.cuMemRelease(mc))
        return bool(supported)


def arrays(g: Gpu) -> None:
    made = [g.array(8192, 8192), g.array(1000, 1000, "CU_AD_FORMAT_UNSIGNED_INT8", 4)]
    time.sleep(PAUSE)
    made += [g.array3d(256, 256, 256), g.array3d(4096, 4096, 0, levels=13)]
    time.sleep(PAUSE)
    g.ok(g.cu.cuArrayDestroy(made[0]))
    g.ok(g.cu.cuArrayDestroy(made[1]))
    g.ok(g.cu.cuArrayDestroy(made[2]))
    g.ok(g.cu.cuMipmappedArrayDestroy(made[3]))


def limits(g: Gpu) -> None:
    g.module()
    g.launch()
    time.sleep(PAUSE)
    g.limit("CU_LIMIT_STACK_SIZE", 16384)
    time.sleep(PAUSE)
    g.launch()
    time.sleep(PAUSE)
    g.limit("CU_LIMIT_MALLOC_HEAP_SIZE", 256 * MiB)
    time.sleep(PAUSE)
    g.module()
    time.sleep(PAUSE)
    g.limit("CU_LIMIT_PRINTF_FIFO_SIZE", 64 * MiB)
    time.sleep(PAUSE)
    g.launch()


def graph(g: Gpu) -> None:
    e = g.captured_graph(512 * MiB)
    time.sleep(PAUSE)
    for _ in range(3):
        g.graph_launch(e)
    time.sleep(PAUSE)
    e2 = g.node_graph(768 * MiB)
    g.ok(g.cu.cuGraphUpload(e2, g.stream))
    g.ok(g.cu.cuStreamSynchronize(g.stream))
    time.sleep(PAUSE)
    g.ok(g.cu.cuGraphExecDestroy(e))
    g.ok(g.cu.cuGraphExecDestroy(e2))
    g.ok(g.cu.cuDeviceGraphMemTrim(g.dev))


def fast_module(g: Gpu) -> None:
    """The issue's case: right after a module load, a 16 KiB stack, an 8192² array and a launch."""
    g.module()
    g.launch()
    time.sleep(PAUSE)
    g.module()
    g.limit("CU_LIMIT_STACK_SIZE", 16384)
    g.array(8192, 8192)
    g.launch()


def fast_context(g: Gpu) -> None:
    """The same right after the context's creation (no pause at all)."""
    g.module()
    g.limit("CU_LIMIT_STACK_SIZE", 16384)
    g.array(8192, 8192)
    g.launch()


def mixed(g: Gpu) -> None:
    """Every family in one process, in quick blocks."""
    g.module()
    g.launch()
    a = g.array(4096, 4096)
    e = g.captured_graph(256 * MiB)
    time.sleep(PAUSE)
    g.limit("CU_LIMIT_STACK_SIZE", 8192)
    g.graph_launch(e)
    g.launch()
    time.sleep(PAUSE)
    g.limit("CU_LIMIT_MALLOC_HEAP_SIZE", 128 * MiB)
    g.module()
    g.array3d(512, 512, 64)
    time.sleep(PAUSE)
    g.ok(g.cu.cuArrayDestroy(a))
    g.ok(g.cu.cuGraphExecDestroy(e))
    g.ok(g.cu.cuDeviceGraphMemTrim(g.dev))


def graph_launches(g: Gpu) -> None:
    """5,000 launches of a one-kernel graph (SGLang launches one per decode step): the time per
    launch, to compare with and without the recorder (cuGraphLaunch is never probed)."""
    cu = g.cu
    g.module()
    e = g.capture(lambda: g.ok(cu.cuLaunchKernel(g.fn, 1, 1, 1, 1, 1, 1, 0, g.stream, 0, 0)))
    g.graph_launch(e)
    t = time.perf_counter()
    for _ in range(5000):
        g.ok(cu.cuGraphLaunch(e, g.stream))
    g.ok(cu.cuStreamSynchronize(g.stream))
    print(json.dumps({"graph_launch_us": (time.perf_counter() - t) / 5000 * 1e6}), flush=True)


def multicast(g: Gpu) -> None:
    print(json.dumps({"multicast": g.multicast(512 * MiB)}), flush=True)


SCENARIOS = {f.__name__: f for f in (arrays, limits, graph, fast_module, fast_context, mixed, multicast, graph_launches)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memrec.validation.gpu.family_workloads", description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    args = parser.parse_args(argv)
    g = Gpu()
    if args.scenario != "fast_context":
        time.sleep(PAUSE)  # the context's readings first
    SCENARIOS[args.scenario](g)
    time.sleep(PAUSE)  # the last readings before the exit
    print(json.dumps({"scenario": args.scenario, "pid": os.getpid()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
