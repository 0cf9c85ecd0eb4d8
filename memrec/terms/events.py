"""The event model every layer shares: kinds, driver APIs and the columns of an event.

This module must stay a stdlib-only leaf: the BPF program, the daemon, the trace format, the
analysis and the TUI all agree through it. The BPF side gets the numbers as ``-D`` flags built
from these tables (``bpf_defines()``), so there is one source of truth for every id.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from dataclasses import field
from typing import Iterable

from memrec.terms.cu_results import CU_RESULT_NAMES


class Kind(enum.IntEnum):
    """What an event did. Numbers are part of trace format v1: never renumber."""

    ALLOC = 1  # device memory allocated (cuMemAlloc*, pitch, managed, async, pool)
    FREE = 2  # device memory freed (cuMemFree*, async)
    VMM_CREATE = 3  # physical memory created (cuMemCreate): counted as owned
    VMM_RELEASE = 4  # physical handle released (memory goes once it is also unmapped)
    VMM_MAP = 5  # physical handle mapped at a VA (cuMemMap)
    VMM_UNMAP = 6  # VA range unmapped (cuMemUnmap)
    VA_RESERVE = 7  # VA reserved (cuMemAddressReserve): never counted as memory
    VA_FREE = 8  # VA released (cuMemAddressFree)
    IPC_EXPORT = 9  # cuIpcGetMemHandle: the exporter's pointer and the 64 handle bytes
    IPC_OPEN = 10  # cuIpcOpenMemHandle_v2: a peer's memory mapped here, not owned
    IPC_CLOSE = 11  # cuIpcCloseMemHandle
    SHARE_EXPORT = 12  # cuMemExportToShareableHandle
    SHARE_IMPORT = 13  # cuMemImportFromShareableHandle: a peer's physical handle, not owned
    VMM_RETAIN = 14  # cuMemRetainAllocationHandle
    HOST_ALLOC = 15  # pinned host memory (cuMemHostAlloc, cuMemAllocHost_v2)
    HOST_FREE = 16  # cuMemFreeHost
    HOST_REGISTER = 17  # cuMemHostRegister_v2
    HOST_UNREGISTER = 18  # cuMemHostUnregister
    CTX = 19  # a context bound to a device ordinal (retain, create, get-device)
    PROC_EXIT = 20  # a traced process exited: everything it held is freed implicitly
    PROC_FORK = 21  # a traced process forked (record mode follows the tree)
    # Format 1.1: what explains the memory NVML counts and allocations do not (the "untraced" band).
    CTX_BEGIN = 22  # entry of a context creation (primary retain, cuCtxCreate*): NVML is read now
    CODE_LOAD = 23  # device code loaded (cuLibraryLoad*, cuModuleLoad*): handle = library/module
    CODE_UNLOAD = 24  # cuLibraryUnload / cuModuleUnload: handle = library/module
    KERNEL_LOAD = 25  # one kernel fetched (cuLibraryGetKernel, cuKernelGetFunction): lazy loading's step
    POOL = 26  # a stream-ordered pool made or named (cuMemPoolCreate, cuDeviceGetDefaultMemPool)
    POOL_DESTROY = 27  # cuMemPoolDestroy: the pool's reserve goes back
    POOL_TRIM = 28  # cuMemPoolTrimTo: the pool keeps at most `size` bytes it does not hand out
    POOL_ATTR = 29  # cuMemPoolSetAttribute: aux = attribute, size = the value set
    # Format 2.2: device memory that no cuMemAlloc*/cuMemCreate call takes (issue 21).
    ARRAY_CREATE = 30  # a CUDA array (cuArrayCreate, cuArray3DCreate, cuMipmappedArrayCreate): handle, size
    ARRAY_DESTROY = 31  # cuArrayDestroy / cuMipmappedArrayDestroy: handle
    CTX_LIMIT = 32  # cuCtxSetLimit: aux = CUlimit, size = the value set
    CAPTURE_BEGIN = 33  # stream capture begins (cuStreamBeginCapture*): handle = stream
    CAPTURE_END = 34  # stream capture ends (cuStreamEndCapture*): handle = stream, ptr = the graph
    GRAPH_ALLOC = 35  # graph-owned memory: a captured cuMemAllocAsync or cuGraphAddMemAllocNode
    GRAPH_FREE = 36  # a captured cuMemFreeAsync or cuGraphAddMemFreeNode: ptr
    GRAPH_EXEC = 37  # cuGraphInstantiate* (ptr = graph, handle = exec) or cuGraphUpload (aux 1)
    GRAPH_TRIM = 38  # cuDeviceGraphMemTrim: the graph memory pool gives back what it does not use
    MULTICAST_CREATE = 39  # cuMulticastCreate: handle, size, aux = number of devices
    MULTICAST_ADD = 40  # cuMulticastAddDevice: handle, aux = device ordinal
    MULTICAST_BIND = 41  # cuMulticastBindMem / BindAddr: handle, size, ptr = offset, aux = memory handle or VA
    MULTICAST_UNBIND = 42  # cuMulticastUnbind: handle, size, aux = device ordinal
    # Format 2.2 too: tensor blocks inside the caching allocator's segments (PyTorch's USDT probes).
    TENSOR_ALLOC = 45  # a block handed out: ptr, size (as requested), ordinal = device, handle = stream
    TENSOR_FREE = 46  # a block given back to the cache: ptr (size and device come from its allocation)


class Api(enum.IntEnum):
    """Which entry point produced an event. Numbers are part of trace format v1."""

    NONE = 0
    cuMemAlloc_v2 = 1
    cuMemAllocPitch_v2 = 2
    cuMemAllocManaged = 3
    cuMemAllocAsync = 4
    cuMemAllocAsync_ptsz = 5
    cuMemAllocFromPoolAsync = 6
    cuMemAllocFromPoolAsync_ptsz = 7
    cuMemFree_v2 = 8
    cuMemFreeAsync = 9
    cuMemFreeAsync_ptsz = 10
    cuMemCreate = 11
    cuMemRelease = 12
    cuMemMap = 13
    cuMemUnmap = 14
    cuMemAddressReserve = 15
    cuMemAddressFree = 16
    cuIpcGetMemHandle = 17
    cuIpcOpenMemHandle_v2 = 18
    cuIpcCloseMemHandle = 19
    cuMemExportToShareableHandle = 20
    cuMemImportFromShareableHandle = 21
    cuMemRetainAllocationHandle = 22
    cuMemHostAlloc = 23
    cuMemAllocHost_v2 = 24
    cuMemFreeHost = 25
    cuMemHostRegister_v2 = 26
    cuMemHostUnregister = 27
    cuDevicePrimaryCtxRetain = 28
    cuCtxCreate_v2 = 29
    cuCtxCreate_v3 = 30
    cuCtxCreate_v4 = 31
    cuCtxSetCurrent = 32
    cuCtxPushCurrent_v2 = 33
    cuCtxPopCurrent_v2 = 34
    cuCtxDestroy_v2 = 35
    cuCtxGetCurrent = 36
    cuCtxGetDevice = 37
    cuLibraryLoadData = 38
    cuLibraryLoadFromFile = 39
    cuLibraryUnload = 40
    cuModuleLoad = 41
    cuModuleLoadData = 42
    cuModuleLoadDataEx = 43
    cuModuleLoadFatBinary = 44
    cuModuleUnload = 45
    cuLibraryGetKernel = 46
    cuKernelGetFunction = 47
    cuMemPoolCreate = 48
    cuMemPoolDestroy = 49
    cuMemPoolTrimTo = 50
    cuMemPoolSetAttribute = 51
    cuDeviceGetDefaultMemPool = 52
    cuArrayCreate_v2 = 70
    cuArray3DCreate_v2 = 71
    cuMipmappedArrayCreate = 72
    cuArrayDestroy = 73
    cuMipmappedArrayDestroy = 74
    cuCtxSetLimit = 75
    cuStreamBeginCapture_v2 = 76
    cuStreamBeginCapture_v2_ptsz = 77
    cuStreamEndCapture = 78
    cuStreamEndCapture_ptsz = 79
    cuGraphAddMemAllocNode = 80
    cuGraphAddMemFreeNode = 81
    cuGraphInstantiateWithFlags = 82
    cuGraphInstantiateWithParams = 83
    cuGraphInstantiateWithParams_ptsz = 84
    cuGraphUpload = 85
    cuGraphUpload_ptsz = 86
    cuDeviceGraphMemTrim = 87
    cuMulticastCreate = 88
    cuMulticastAddDevice = 89
    cuMulticastBindMem = 90
    cuMulticastBindAddr = 91
    cuMulticastUnbind = 92
    sched_process_exit = 60
    sched_process_fork = 61
    torch_malloc = 100  # USDT pytorch:malloc in libc10_cuda.so
    torch_free = 101  # USDT pytorch:free in libc10_cuda.so


#: The kind each driver symbol's event has (None: context bookkeeping, no memory event of its own
#: except Kind.CTX where a context is bound to a device).
API_KIND: dict[Api, Kind] = {
    Api.cuMemAlloc_v2: Kind.ALLOC,
    Api.cuMemAllocPitch_v2: Kind.ALLOC,
    Api.cuMemAllocManaged: Kind.ALLOC,
    Api.cuMemAllocAsync: Kind.ALLOC,
    Api.cuMemAllocAsync_ptsz: Kind.ALLOC,
    Api.cuMemAllocFromPoolAsync: Kind.ALLOC,
    Api.cuMemAllocFromPoolAsync_ptsz: Kind.ALLOC,
    Api.cuMemFree_v2: Kind.FREE,
    Api.cuMemFreeAsync: Kind.FREE,
    Api.cuMemFreeAsync_ptsz: Kind.FREE,
    Api.cuMemCreate: Kind.VMM_CREATE,
    Api.cuMemRelease: Kind.VMM_RELEASE,
    Api.cuMemMap: Kind.VMM_MAP,
    Api.cuMemUnmap: Kind.VMM_UNMAP,
    Api.cuMemAddressReserve: Kind.VA_RESERVE,
    Api.cuMemAddressFree: Kind.VA_FREE,
    Api.cuIpcGetMemHandle: Kind.IPC_EXPORT,
    Api.cuIpcOpenMemHandle_v2: Kind.IPC_OPEN,
    Api.cuIpcCloseMemHandle: Kind.IPC_CLOSE,
    Api.cuMemExportToShareableHandle: Kind.SHARE_EXPORT,
    Api.cuMemImportFromShareableHandle: Kind.SHARE_IMPORT,
    Api.cuMemRetainAllocationHandle: Kind.VMM_RETAIN,
    Api.cuMemHostAlloc: Kind.HOST_ALLOC,
    Api.cuMemAllocHost_v2: Kind.HOST_ALLOC,
    Api.cuMemFreeHost: Kind.HOST_FREE,
    Api.cuMemHostRegister_v2: Kind.HOST_REGISTER,
    Api.cuMemHostUnregister: Kind.HOST_UNREGISTER,
    Api.cuDevicePrimaryCtxRetain: Kind.CTX,
    Api.cuCtxCreate_v2: Kind.CTX,
    Api.cuCtxCreate_v3: Kind.CTX,
    Api.cuCtxCreate_v4: Kind.CTX,
    Api.cuCtxGetDevice: Kind.CTX,
    Api.cuLibraryLoadData: Kind.CODE_LOAD,
    Api.cuLibraryLoadFromFile: Kind.CODE_LOAD,
    Api.cuLibraryUnload: Kind.CODE_UNLOAD,
    Api.cuModuleLoad: Kind.CODE_LOAD,
    Api.cuModuleLoadData: Kind.CODE_LOAD,
    Api.cuModuleLoadDataEx: Kind.CODE_LOAD,
    Api.cuModuleLoadFatBinary: Kind.CODE_LOAD,
    Api.cuModuleUnload: Kind.CODE_UNLOAD,
    Api.cuLibraryGetKernel: Kind.KERNEL_LOAD,
    Api.cuKernelGetFunction: Kind.KERNEL_LOAD,
    Api.cuMemPoolCreate: Kind.POOL,
    Api.cuMemPoolDestroy: Kind.POOL_DESTROY,
    Api.cuMemPoolTrimTo: Kind.POOL_TRIM,
    Api.cuMemPoolSetAttribute: Kind.POOL_ATTR,
    Api.cuDeviceGetDefaultMemPool: Kind.POOL,
    Api.cuArrayCreate_v2: Kind.ARRAY_CREATE,
    Api.cuArray3DCreate_v2: Kind.ARRAY_CREATE,
    Api.cuMipmappedArrayCreate: Kind.ARRAY_CREATE,
    Api.cuArrayDestroy: Kind.ARRAY_DESTROY,
    Api.cuMipmappedArrayDestroy: Kind.ARRAY_DESTROY,
    Api.cuCtxSetLimit: Kind.CTX_LIMIT,
    Api.cuStreamBeginCapture_v2: Kind.CAPTURE_BEGIN,
    Api.cuStreamBeginCapture_v2_ptsz: Kind.CAPTURE_BEGIN,
    Api.cuStreamEndCapture: Kind.CAPTURE_END,
    Api.cuStreamEndCapture_ptsz: Kind.CAPTURE_END,
    Api.cuGraphAddMemAllocNode: Kind.GRAPH_ALLOC,
    Api.cuGraphAddMemFreeNode: Kind.GRAPH_FREE,
    Api.cuGraphInstantiateWithFlags: Kind.GRAPH_EXEC,
    Api.cuGraphInstantiateWithParams: Kind.GRAPH_EXEC,
    Api.cuGraphInstantiateWithParams_ptsz: Kind.GRAPH_EXEC,
    Api.cuGraphUpload: Kind.GRAPH_EXEC,
    Api.cuGraphUpload_ptsz: Kind.GRAPH_EXEC,
    Api.cuDeviceGraphMemTrim: Kind.GRAPH_TRIM,
    Api.cuMulticastCreate: Kind.MULTICAST_CREATE,
    Api.cuMulticastAddDevice: Kind.MULTICAST_ADD,
    Api.cuMulticastBindMem: Kind.MULTICAST_BIND,
    Api.cuMulticastBindAddr: Kind.MULTICAST_BIND,
    Api.cuMulticastUnbind: Kind.MULTICAST_UNBIND,
    Api.sched_process_exit: Kind.PROC_EXIT,
    Api.sched_process_fork: Kind.PROC_FORK,
    Api.torch_malloc: Kind.TENSOR_ALLOC,
    Api.torch_free: Kind.TENSOR_FREE,
}

#: The APIs that are USDT probes of PyTorch's caching allocator, not driver symbols.
TENSOR_APIS = (Api.torch_malloc, Api.torch_free)
#: The kinds of tensor-block events: the driver-level state skips them, memrec.analysis.report.tensors reads them.
TENSOR_KINDS = (Kind.TENSOR_ALLOC, Kind.TENSOR_FREE)

#: Driver symbols that only move the per-thread current context (no event is emitted).
CONTEXT_TRACKING_APIS = (
    Api.cuCtxSetCurrent,
    Api.cuCtxPushCurrent_v2,
    Api.cuCtxPopCurrent_v2,
    Api.cuCtxDestroy_v2,
    Api.cuCtxGetCurrent,
)

#: The entry points that load device code or keep stream-ordered pool memory: what the untraced
#: band is made of besides contexts (docs/validation/untraced-explore.md found them on an H200).
#: Each is called at start-up or once per module, kernel or pool, never per launch; the recorder
#: can leave them out (``--no-untraced-probes``) to measure what they cost.
UNTRACED_APIS = (
    Api.cuLibraryLoadData,
    Api.cuLibraryLoadFromFile,
    Api.cuLibraryUnload,
    Api.cuModuleLoad,
    Api.cuModuleLoadData,
    Api.cuModuleLoadDataEx,
    Api.cuModuleLoadFatBinary,
    Api.cuModuleUnload,
    Api.cuLibraryGetKernel,
    Api.cuKernelGetFunction,
    Api.cuMemPoolCreate,
    Api.cuMemPoolDestroy,
    Api.cuMemPoolTrimTo,
    Api.cuMemPoolSetAttribute,
    Api.cuDeviceGetDefaultMemPool,
    # Issue 21: arrays, context limits, graph memory and multicast objects. Each is called at
    # set-up or once per array, limit, capture, graph or object: never per launch (cuGraphLaunch
    # is not probed; the graph pool's step at the first launch is attributed by measurement).
    Api.cuArrayCreate_v2,
    Api.cuArray3DCreate_v2,
    Api.cuMipmappedArrayCreate,
    Api.cuArrayDestroy,
    Api.cuMipmappedArrayDestroy,
    Api.cuCtxSetLimit,
    Api.cuStreamBeginCapture_v2,
    Api.cuStreamBeginCapture_v2_ptsz,
    Api.cuStreamEndCapture,
    Api.cuStreamEndCapture_ptsz,
    Api.cuGraphAddMemAllocNode,
    Api.cuGraphAddMemFreeNode,
    Api.cuGraphInstantiateWithFlags,
    Api.cuGraphInstantiateWithParams,
    Api.cuGraphInstantiateWithParams_ptsz,
    Api.cuGraphUpload,
    Api.cuGraphUpload_ptsz,
    Api.cuDeviceGraphMemTrim,
    Api.cuMulticastCreate,
    Api.cuMulticastAddDevice,
    Api.cuMulticastBindMem,
    Api.cuMulticastBindAddr,
    Api.cuMulticastUnbind,
)

#: Stream-ordered allocations and frees: they take from and give back to a pool.
STREAM_ORDERED_APIS = (
    Api.cuMemAllocAsync,
    Api.cuMemAllocAsync_ptsz,
    Api.cuMemAllocFromPoolAsync,
    Api.cuMemAllocFromPoolAsync_ptsz,
    Api.cuMemFreeAsync,
    Api.cuMemFreeAsync_ptsz,
)

#: Kinds whose failures are not failed memory calls unless out of memory. On an H200 every library a
#: process loaded is unloaded at exit after the driver shut down (cuLibraryUnload returns
#: CUDA_ERROR_DEINITIALIZED: 3,420 of them with cuBLAS under EAGER), and NCCL asks for kernels with
#: no binary for the GPU (cuLibraryGetKernel: CUDA_ERROR_NO_BINARY_FOR_GPU): recorded, never
#: counted or shown as failed calls.
QUIET_FAILURE_KINDS = (
    Kind.CTX_BEGIN,
    Kind.CODE_LOAD,
    Kind.CODE_UNLOAD,
    Kind.KERNEL_LOAD,
    Kind.POOL,
    Kind.POOL_DESTROY,
    Kind.POOL_TRIM,
    Kind.POOL_ATTR,
    Kind.CTX_LIMIT,
    Kind.CAPTURE_BEGIN,
    Kind.CAPTURE_END,
    Kind.GRAPH_ALLOC,
    Kind.GRAPH_FREE,
    Kind.GRAPH_EXEC,
    Kind.GRAPH_TRIM,
    Kind.MULTICAST_CREATE,
    Kind.MULTICAST_ADD,
    Kind.MULTICAST_BIND,
    Kind.MULTICAST_UNBIND,
)

#: CUlimit values (cuda.h) cuCtxSetLimit is recorded with.
CU_LIMIT_NAMES = {0: "stack", 1: "printf_fifo", 2: "malloc_heap", 3: "dev_runtime_sync_depth",
                  4: "dev_runtime_pending_launches", 5: "max_l2_fetch_granularity", 6: "persisting_l2_cache"}
CU_LIMIT_STACK_SIZE, CU_LIMIT_PRINTF_FIFO_SIZE, CU_LIMIT_MALLOC_HEAP_SIZE = 0, 1, 2
CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT = 4

#: CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (cuda.h): bytes a pool keeps before releasing at a sync.
MEMPOOL_ATTR_RELEASE_THRESHOLD = 4


#: The device's allocation granule: VMM, graph pools and CUDA arrays take whole ones.
GRANULE = 2 << 20


def array_footprint(descriptor_bytes: int) -> int:
    """What a CUDA array takes on the device: its descriptor's bytes (format × channels × extent,
    every mip level) rounded up to the 2 MiB granule (docs/validation/families.md)."""
    return -(-descriptor_bytes // GRANULE) * GRANULE


def cu_result_name(result: int) -> str:
    """The CUresult's name as the driver's header spells it (``CUresult <n>`` for a newer code)."""
    return CU_RESULT_NAMES.get(result, f"CUresult {result}")


CUDA_ERROR_OUT_OF_MEMORY = 2

#: Event.flags bits.
FLAG_IPC_BYTES = 1 << 0  # the 64 handle bytes (IPC handle or fabric handle) were read
FLAG_NAME = 1 << 1  # the ipc column holds a NUL-terminated name (a file, a kernel), cut at 63 bytes
FLAG_STACK = 1 << 2  # raw records only: ipc[0:8] is the id of the record in the probes' stacks ring (--stacks)

#: The size of an IPC or fabric handle in bytes.
IPC_HANDLE_SIZE = 64

#: Columns of a raw event as the BPF program writes it (little-endian, packed, 128 bytes).
#: (name, numpy type string). The C struct in probes/cuda.bpf.c has the same fields in this order.
RAW_COLUMNS: tuple[tuple[str, str], ...] = (
    ("ts", "<u8"),  # CLOCK_MONOTONIC ns (bpf_ktime_get_ns), same clock as time.monotonic_ns()
    ("pid", "<u4"),  # tgid
    ("tid", "<u4"),
    ("kind", "<u2"),  # Kind
    ("api", "<u2"),  # Api
    ("result", "<i4"),  # CUresult (0 success, 2 out of memory); 0 for tracepoint events
    ("ordinal", "<i4"),  # the process's device ordinal (-1 unknown)
    ("flags", "<u4"),  # FLAG_* bits
    ("ptr", "<u8"),  # device pointer / VA / host pointer / child pid (fork)
    ("size", "<u8"),  # bytes
    ("handle", "<u8"),  # VMM handle / context
    ("aux", "<u8"),  # per kind: map offset, alloc flags, handle type, alignment, ctx subtype
    ("ipc", "V64"),  # 64 handle bytes when FLAG_IPC_BYTES is set, a name with FLAG_NAME, else zeros
)

#: Columns of an event in a trace: the raw columns plus the physical GPU the daemon resolved.
EVENT_COLUMNS: tuple[tuple[str, str], ...] = RAW_COLUMNS + (
    ("gpu", "<i2"),  # physical GPU (NVML index); -1 unknown or host memory
    ("stack", "<u4"),  # format 2.3: the allocating thread's stack (memrec.trace.stacks); 0 none
)

#: Device-memory categories used in accounting (report, TUI, analysis).
#: ``array``: CUDA arrays (format 2.2), sized from their descriptors.
CATEGORIES = ("driver", "vmm", "ipc_mapped", "host_pinned", "array")
#: Index of each category in :data:`CATEGORIES` (the journal, snapshots and series columns use these).
DRIVER, VMM, IPC_MAPPED, HOST_PINNED, ARRAY = range(len(CATEGORIES))
CATEGORY_INDEX = {name: i for i, name in enumerate(CATEGORIES)}
#: Categories that are memory a process owns, bottom first as the TUI stacks them (ipc_mapped is a
#: view of a peer's memory, counted by its exporter).
OWNED_CATEGORIES = (DRIVER, VMM, ARRAY, HOST_PINNED)
#: The same, by name (the analysis keys its tables by category name).
OWNED = tuple(CATEGORIES[i] for i in OWNED_CATEGORIES)
#: What the untraced band (NVML used - traced) splits into (memrec.analysis.untraced.split), in the order
#: every view shows it, with each column's heading.
UNTRACED_SPLIT = ("context", "module_code", "pools", "limits", "graph", "multicast", "before_recording", "unexplained")
UNTRACED_HEADINGS = {"context": "CONTEXT", "module_code": "MODULES", "pools": "POOLS", "limits": "LIMITS",
                     "graph": "GRAPH", "multicast": "MULTICAST", "before_recording": "BEFORE", "unexplained": "UNEXPLAINED"}


def bpf_defines() -> list[str]:
    """Return ``-D`` compiler flags naming every Kind and Api number for the BPF program."""
    flags = [f"-DKIND_{k.name}={int(k)}" for k in Kind]
    flags += [f"-DAPI_{a.name}={int(a)}" for a in Api]
    flags.append(f"-DFLAG_IPC_BYTES={FLAG_IPC_BYTES}")
    flags.append(f"-DFLAG_NAME={FLAG_NAME}")
    flags.append(f"-DFLAG_STACK={FLAG_STACK}")
    flags.append(f"-DMEMPOOL_ATTR_RELEASE_THRESHOLD={MEMPOOL_ATTR_RELEASE_THRESHOLD}")
    return flags


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML names it (index is NVML's, i.e. PCI bus order)."""

    index: int
    uuid: str | None
    name: str
    total: int  # bytes of device memory
    bar1_total: int | None = None
    #: SMs × threads per SM (format 2.2): what a stack limit raise costs per byte; None unknown.
    resident_threads: int | None = None


@dataclass(frozen=True)
class Marker:
    """A phase marker as recorded: the client's fields plus the peer's credentials."""

    ts: int
    pid: int
    uid: int
    tid: int
    name: str
    phase: str  # "begin" | "end" | "instant"
    gpu: int | None = None  # physical GPU the client named (NVML index), if any
    values: dict = field(default_factory=dict)




def checked_marker(ts: int, pid: int, uid: int, tid: int, name: str, phase: str, gpu: int | None,
                   values: dict) -> Marker:
    """``Marker(ts, pid, uid, tid, name, phase, gpu, values)`` for fields a reader has checked: the
    same object, made without the frozen dataclass's ``__init__`` (its eight
    ``object.__setattr__`` calls were a third of reading a step loop's marker record)."""
    m = _new(Marker)
    d = m.__dict__
    d["ts"] = ts
    d["pid"] = pid
    d["uid"] = uid
    d["tid"] = tid
    d["name"] = name
    d["phase"] = phase
    d["gpu"] = gpu
    d["values"] = values
    return m


_new = object.__new__

@dataclass
class MarkerColumns:
    """Markers as a list per field of :class:`Marker` (:func:`memrec.engine.phases.build_phases`
    pairs them with numpy, not a marker at a time)."""

    ts: list[int]
    pid: list[int]
    name: list[str]
    phase: list[str]
    gpu: list[int | None]
    values: list[dict]

    @classmethod
    def of(cls, markers: Iterable[Marker]) -> MarkerColumns:
        ms = markers if isinstance(markers, list) else list(markers)
        return cls(*(list(map(operator.attrgetter(f), ms)) for f in ("ts", "pid", "name", "phase", "gpu", "values")))

#: The most arguments a process's ``cmdline`` holds in a trace (the daemon keeps the first ones).
MAX_CMDLINE_ARGS = 1 << 16


@dataclass(frozen=True)
class ProcessInfo:
    """What the daemon learned about a process that touched the driver."""

    pid: int
    ppid: int | None
    cmdline: list[str]
    exe: str | None
    cuda_visible_devices: str | None
    gpu_map: list[int]  # device ordinal -> physical GPU index (empty: unknown)
    first_ts: int
    rank: dict = field(default_factory=dict)  # e.g. {"tp": 0} when a marker or env told us
    gpu_map_source: str = "environ"  # "environ" (/proc/PID/environ) or "nvml" (corrected by NVML)
