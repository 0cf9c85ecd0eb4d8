"""Regenerate the golden trace ``golden_v2_3.mrec`` and its expected dump ``golden_v2_3.dump.jsonl``.

Run ``python tests/data/make_golden.py`` only when format v2 deliberately changes (a new minor):
the test suite checks that today's writer still produces these exact bytes and that today's
reader still decodes them to exactly this dump. Read the diff of the ``.jsonl`` before committing.
``golden_v1.mrec``, ``golden_v2.mrec``, ``golden_v2_1.mrec`` and ``golden_v2_2.mrec`` (and their
dumps) are what this script wrote with formats 1, 2.0, 2.1 and 2.2: they stay as they are, so that
the reader keeps reading them (their dumps are the same lines but for the header's version and
minor and the later minors' additions; 2.3's chunk size also moves some records among the
events, and its trace ends later). Format 2.2 added the rows, header keys and trailer keys
marked "2.2" below, format 2.3 those marked "2.3"; the older files lack them.
The exact bytes depend on the Zstandard library (pinned in constraints.txt).

The trace is small but holds every record type: two processes (TP0 exports a buffer over CUDA IPC,
TP1 opens it), driver allocations, a VMM create/map, a failed (out of memory) allocation, NVML
device and per-process samples, phase markers with SGLang's numbers, a lost-events count, a keyframe,
and the trailer; events span several chunks. Since 2.2 it also holds one event of every kind 30-42
(CUDA arrays, a context limit, graph capture and graph memory, multicast) and 45-46 (tensor
blocks), each GPU's ``resident_threads``, the header's ``recording_id`` and ``probes.torch`` list,
and the daemon's trailer keys (``markers_dropped``, ``processes_expired``, ...). Since 2.3 the
events name stacks (``stacks`` records, written before the first chunk that uses them: Python
frames, a native frame, an unavailable stack, one stack shared by many events) and the header
lists the interpreters found (``probes.interpreters``); TP0 then allocates and frees a KV cache
in blocks, enough rows of one process in one chunk that the writer stores the pointers in the
context transform; and a second keyframe holds that state as today's ``LiveState`` writes it
(state version 3). 2.2's chunks were 3 rows; 2.3's are 16, so that a chunk can hold that run.
"""

from __future__ import annotations

import io
import os
import sys

import numpy as np

from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.columns import empty_events
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import Api
from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.state import LiveState
from memrec.state import alloc_rows
from memrec.trace.stacks import Frame
from memrec.trace.stacks import Unavailable
from memrec.trace.writer import BytesSink
from memrec.trace.writer import TraceWriter

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden_v2_3.mrec")
GOLDEN_DUMP = os.path.join(HERE, "golden_v2_3.dump.jsonl")

GiB = 1 << 30
MiB = 1 << 20
T0 = 1_000_000_000_000  # CLOCK_MONOTONIC ns at the start of the recording
TP0, TP1 = 4242, 4243
IPC_HANDLE = bytes(range(64))
TORCH_LIB = {"path": "/opt/venv/lib/python3.11/site-packages/torch/lib/libc10_cuda.so",
             "attached": ["pytorch:malloc", "pytorch:free"], "problem": None}
INTERPRETER = {"path": "/usr/bin/python3.11", "version": "CPython 3.11", "problem": "", "processes": 2}

# 2.3: the stacks the events name, innermost frame first
SRT = "/opt/venv/lib/python3.11/site-packages/sglang/srt"
LOAD_STACK = (
    Frame(f"{SRT}/model_loader/loader.py", 381, "DefaultModelLoader.load_model"),
    Frame(f"{SRT}/model_executor/model_runner.py", 612, "ModelRunner.load_model"),
    Frame(f"{SRT}/managers/scheduler.py", 254, "Scheduler.__init__"),
)
OOM_STACK = Unavailable("the thread's memory could not be read")
TENSOR_STACK = (
    Frame(TORCH_LIB["path"], 0x4A2F0, "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc",
          native=True),
    Frame(f"{SRT}/layers/linear.py", 97, "UnquantizedLinearMethod.create_weights"),
)
KV_STACK = (
    Frame(f"{SRT}/mem_cache/memory_pool.py", 412, "MHATokenToKVPool._create_buffers"),
    Frame(f"{SRT}/model_executor/model_runner.py", 1210, "ModelRunner.init_memory_pool"),
)
#: 2.3: TP0's KV cache blocks (sizes in MiB), allocated one after the other, then freed
KV_BLOCKS = [2, 4, 2, 6, 2, 4, 8, 2, 4, 2, 6, 2, 2, 4, 8, 2]
KV_BASE = 0x7F50_0000_0000

HEADER = {
    "host": "golden-host",
    "boot_id": "00000000-0000-4000-8000-000000000000",
    "clock": "CLOCK_MONOTONIC",
    "anchor": {"monotonic_ns": T0, "wall_ns": 1_764_400_000_000_000_000},
    "gpus": [
        GpuInfo(index=i, uuid=f"GPU-{str(i) * 8}-0000-0000-0000-000000000000", name="NVIDIA H200",
                total=150 * GiB, bar1_total=256 * GiB, resident_threads=132 * 2048)  # 2.2: resident_threads
        for i in range(2)
    ],
    "probes": {
        "libraries": ["/usr/lib/x86_64-linux-gnu/libcuda.so.1"],
        "attached": ["cuMemAlloc_v2", "cuMemFree_v2"],
        "missing": ["cuMemAllocAsync_ptsz"],
        "torch": [TORCH_LIB],  # 2.2: the libc10_cuda.so files tried (memrec daemon --tensors)
        "interpreters": [INTERPRETER],  # 2.3: the Python interpreters found (memrec daemon --stacks)
    },
    "recording_id": "0123456789abcdef",  # 2.2: the dataset's trace_id
    "config": {"follow_tree": False, "nvml_device_hz": 10, "nvml_process_hz": 1},
    "created_by": "memrec golden",
}


def _events() -> np.ndarray:
    rows = [
        # ts offset, pid, tid, kind, api, result, ordinal, gpu, ptr, size, handle, aux
        (10, TP0, TP0, Kind.CTX, Api.cuDevicePrimaryCtxRetain, 0, 0, 0, 0, 0, 0x5500_0001, 0),
        (20, TP0, TP0, Kind.ALLOC, Api.cuMemAlloc_v2, 0, 0, 0, 0x7F12_0000_0000, 2 * GiB, 0, 0),
        (30, TP0, TP0, Kind.VA_RESERVE, Api.cuMemAddressReserve, 0, -1, -1, 0x7F20_0000_0000, 157 * GiB, 0, 0),
        (40, TP0, TP0, Kind.VMM_CREATE, Api.cuMemCreate, 0, 0, 0, 0, 20 * MiB, 0x6600_0001, 1),
        (50, TP0, TP0, Kind.VMM_MAP, Api.cuMemMap, 0, -1, 0, 0x7F20_0000_0000, 20 * MiB, 0x6600_0001, 0),
        (60, TP0, TP0 + 7, Kind.IPC_EXPORT, Api.cuIpcGetMemHandle, 0, 0, 0, 0x7F12_0000_0000, 0, 0, 0),
        (70, TP1, TP1, Kind.IPC_OPEN, Api.cuIpcOpenMemHandle_v2, 0, 0, 0, 0x7E00_0000_0000, 0, 0, 1),
        (80, TP1, TP1, Kind.ALLOC, Api.cuMemAlloc_v2, 2, 0, 1, 0, 140 * GiB, 0, 0),
        (90, TP1, TP1, Kind.ALLOC, Api.cuMemAllocPitch_v2, 999, 0, 1, 0, 4096, 0, 0),
        (100, TP0, TP0, Kind.FREE, Api.cuMemFree_v2, 0, 0, 0, 0x7F12_0000_0000, 0, 0, 0),
        (110, TP1, TP1, Kind.PROC_EXIT, Api.sched_process_exit, 0, -1, -1, 0, 0, 0, 0),
        # 2.2: one event of each new kind, all TP0's on GPU 0
        (111, TP0, TP0, Kind.ARRAY_CREATE, Api.cuArray3DCreate_v2, 0, 0, 0, 0, 64 * MiB, 0xA000_0001, 0),
        (112, TP0, TP0, Kind.CTX_LIMIT, Api.cuCtxSetLimit, 0, 0, 0, 0, 64 * 1024, 0, 0),  # CU_LIMIT_STACK_SIZE
        (113, TP0, TP0, Kind.CAPTURE_BEGIN, Api.cuStreamBeginCapture_v2, 0, 0, 0, 0, 0, 0x5700_0001, 0),
        (114, TP0, TP0, Kind.GRAPH_ALLOC, Api.cuMemAllocAsync, 0, 0, 0, 0x7F40_0000_0000, 32 * MiB, 0x5700_0001, 0),
        (115, TP0, TP0, Kind.GRAPH_FREE, Api.cuMemFreeAsync, 0, 0, 0, 0x7F40_0000_0000, 0, 0x5700_0001, 0),
        (116, TP0, TP0, Kind.CAPTURE_END, Api.cuStreamEndCapture, 0, 0, 0, 0x6700_0001, 0, 0x5700_0001, 0),
        (117, TP0, TP0, Kind.GRAPH_EXEC, Api.cuGraphInstantiateWithFlags, 0, 0, 0, 0x6700_0001, 0, 0x6800_0001, 0),
        (118, TP0, TP0, Kind.GRAPH_TRIM, Api.cuDeviceGraphMemTrim, 0, 0, 0, 0, 0, 0, 0),
        (119, TP0, TP0, Kind.MULTICAST_CREATE, Api.cuMulticastCreate, 0, -1, -1, 0, 2 * MiB, 0x6900_0001, 2),
        (120, TP0, TP0, Kind.MULTICAST_ADD, Api.cuMulticastAddDevice, 0, 0, 0, 0, 0, 0x6900_0001, 0),
        (121, TP0, TP0, Kind.MULTICAST_BIND, Api.cuMulticastBindMem, 0, 0, 0, 0, 2 * MiB, 0x6900_0001, 0x6600_0001),
        (122, TP0, TP0, Kind.MULTICAST_UNBIND, Api.cuMulticastUnbind, 0, 0, 0, 0, 2 * MiB, 0x6900_0001, 0),
        (123, TP0, TP0, Kind.ARRAY_DESTROY, Api.cuArrayDestroy, 0, 0, 0, 0, 0, 0xA000_0001, 0),
        (124, TP0, TP0, Kind.TENSOR_ALLOC, Api.torch_malloc, 0, 0, 0, 0x7F20_0000_0000, 3 * MiB, 0x5700_0002, 0),
        (125, TP0, TP0, Kind.TENSOR_FREE, Api.torch_free, 0, -1, -1, 0x7F20_0000_0000, 0, 0, 0),
    ]
    ev = empty_events(len(rows))
    for i, (dt, pid, tid, kind, api, result, ordinal, gpu, ptr, size, handle, aux) in enumerate(rows):
        ev[i] = (T0 + dt, pid, tid, kind, api, result, ordinal, 0, ptr, size, handle, aux, b"", gpu, 0)
    for i in (5, 6):  # the exporter's and the importer's handle bytes are equal
        ev["flags"][i] = FLAG_IPC_BYTES
        ev["ipc"][i] = IPC_HANDLE
    return ev


def _kv_events() -> np.ndarray:
    """2.3: TP0 allocates its KV cache blocks end to end, then frees them in the same order."""
    n = len(KV_BLOCKS)
    sizes = np.array(KV_BLOCKS, dtype=np.uint64) * np.uint64(MiB)
    ptrs = np.uint64(KV_BASE) + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
    ev = empty_events(2 * n)
    ev["ts"] = T0 + 200 + 2 * np.arange(2 * n, dtype=np.uint64)
    ev["pid"] = ev["tid"] = TP0
    ev["kind"] = [Kind.ALLOC] * n + [Kind.FREE] * n
    ev["api"] = [Api.cuMemAlloc_v2] * n + [Api.cuMemFree_v2] * n
    ev["ordinal"] = ev["gpu"] = 0
    ev["ptr"] = np.concatenate([ptrs, ptrs])
    ev["size"][:n] = sizes
    return ev


def _nvml(ts: int, used0: int) -> np.ndarray:
    s = np.zeros(2, dtype=NVML_DTYPE)
    s["ts"] = ts
    s["gpu"] = [0, 1]
    s["used"] = [used0, 615 * MiB]
    s["reserved"] = 615 * MiB
    s["total"] = 150 * GiB
    s["free"] = s["total"] - s["used"] - s["reserved"]
    s["bar1_used"] = [2 * MiB, -1]
    s["bar1_total"] = 256 * GiB
    return s


def _procmem(ts: int) -> np.ndarray:
    s = np.zeros(2, dtype=PROCMEM_DTYPE)
    s["ts"] = ts
    s["gpu"] = [0, 1]
    s["pid"] = [TP0, TP1]
    s["used"] = [2 * GiB + 20 * MiB, 500 * MiB]
    return s


def _process(pid: int, first_ts: int, rank: dict) -> ProcessInfo:
    return ProcessInfo(
        pid=pid,
        ppid=4000,
        cmdline=["python", "-m", "sglang.launch_server", "--tp", "2"],
        exe="/usr/bin/python3.11",
        cuda_visible_devices="0,1",
        gpu_map=[0, 1],
        first_ts=first_ts,
        rank=rank,
    )


def _marker(ts: int, pid: int, name: str, phase: str, gpu: int, values: dict) -> Marker:
    return Marker(ts=ts, pid=pid, uid=1000, tid=pid, name=name, phase=phase, gpu=gpu, values=values)


def write_golden(sink: object) -> TraceWriter:
    """Write the golden trace to ``sink`` (a path or a Sink) and return the closed writer."""
    ev = _events()
    kv = _kv_events()
    w = TraceWriter(sink, HEADER, max_chunk_rows=16)
    w.write_process(_process(TP0, T0 + 10, {"tp": 0}))
    w.write_marker(_marker(T0 + 15, TP0, "load_weights", "begin", 0, {"pre_model_load_memory": 139.5}))
    # 2.3: each stack is interned before the events that name it (its ``stacks`` record precedes them)
    ev["stack"][1] = w.intern_stack(LOAD_STACK)
    w.write_events(ev[:5])
    w.write_nvml(_nvml(T0 + 55, 2 * GiB + 20 * MiB + 615 * MiB))
    w.write_process(_process(TP1, T0 + 70, {}))
    ev["stack"][7] = w.intern_stack(OOM_STACK)
    w.write_events(ev[5:8])
    oom = "Not enough memory. Please try to increase --mem-fraction-static."
    w.write_marker(
        _marker(T0 + 85, TP1, "kv_cache", "instant", 1, {"error": oom, "rest_memory": -3.25, "mem_fraction_static": 0.88})
    )
    w.write_lost(T0 + 86, 3)
    # A later record for TP1 (its rank became known): readers keep the last one.
    w.write_process(_process(TP1, T0 + 70, {"tp": 1}))
    # The keyframe is the real live state after the first 8 events, as the daemon wrote it with
    # snapshot version 1 (allocations as one flat list): readers must keep reading it.
    state = LiveState()
    state.apply(ev[:8].copy())
    snap = state.snapshot()
    w.write_keyframe(T0 + 87, {**snap, "v": 1, "allocs": alloc_rows(snap)})
    w.write_events(ev[8:11])
    w.write_procmem(_procmem(T0 + 95))
    w.write_marker(_marker(T0 + 105, TP0, "load_weights", "end", 0, {"available_after_weights": 137.0}))
    ev["stack"][ev["kind"] == Kind.TENSOR_ALLOC] = w.intern_stack(TENSOR_STACK)
    w.write_events(ev[11:])
    # 2.3: the KV cache blocks share one stack; their allocations fill one chunk (the flush ends
    # the one before, as the daemon's do), in which the pointers are stored in context; the
    # keyframe after them is today's state (version 3: the blocks' pointers as gaps)
    w.flush()
    kv["stack"][kv["kind"] == Kind.ALLOC] = w.intern_stack(KV_STACK)
    half = len(KV_BLOCKS)
    w.write_events(kv[:half])
    state.apply(ev[8:].copy())
    state.apply(kv[:half].copy())
    w.write_keyframe(T0 + 199 + 2 * half, state.snapshot())
    w.write_events(kv[half:])
    # 2.2: the daemon's trailer keys (counts it keeps while recording) and the torch list again;
    # 2.3: what the daemon's --stacks read
    w.close({"end_ts": T0 + 270, "reason": "SIGTERM", "markers_dropped": {"budget": 0, "open_phases": 1, "disk": 0},
             "processes_expired": 2, "process_reads_refused": 0, "rotations_refused": 0, "torch": [TORCH_LIB],
             "stacks_read": {"interpreters": [INTERPRETER], "resolved": 3, "unavailable": 1, "lost": 0}})
    return w


def golden_bytes() -> bytes:
    sink = BytesSink()
    write_golden(sink)
    return sink.data


def golden_dump(path: str) -> str:
    from memrec.export.jsonl import dump_trace
    from memrec.trace.reader import TraceReader

    out = io.StringIO()
    with TraceReader(path) as reader:
        dump_trace(reader, out)
    return out.getvalue()


def main() -> int:
    with open(GOLDEN, "wb") as f:
        f.write(golden_bytes())
    with open(GOLDEN_DUMP, "w", encoding="utf-8") as f:
        f.write(golden_dump(GOLDEN))
    print(f"wrote {GOLDEN} and {GOLDEN_DUMP}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
