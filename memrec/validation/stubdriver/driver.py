"""The stub driver behind ctypes, one method per driver call, recording a fact per call.

Why a module of its own: the workload's scenarios (:mod:`memrec.validation.stubdriver.workload`) and tests
that drive the stub from a small script of their own share it. The ctypes structures and
signatures follow cuda.h exactly (``/usr/local/cuda/include/cuda.h``), so the probes read every
argument where the real driver has it; libffi's calls follow the SysV ABI, so the 64-byte
``CUipcMemHandle`` really is passed by value on the stack, as from C.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_HANDLE_TYPE_FABRIC = 8
CU_MEM_ATTACH_GLOBAL = 1
CU_MEMHOSTALLOC_PORTABLE = 1
CU_MEMHOSTREGISTER_PORTABLE = 1
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1
CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4
CUDA_ERROR_FILE_NOT_FOUND = 301
#: A stand-in for a fatbin: the stub only needs the address to be readable.
IMAGE = b"\x50\xed\x55\xba" + bytes(60)

MiB = 1 << 20
GRANULE = 2 * MiB

#: Fake stream and pool values: the stub never dereferences them, the probes record them.
STREAM = 0x5A5A00
STREAM_PTSZ = 0x5A5A01
POOL = 0x900100
POOL_PTSZ = 0x900101


class CUipcMemHandle(ctypes.Structure):
    """cuda.h: ``typedef struct { char reserved[64]; } CUipcMemHandle`` (passed by value)."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    """cuda.h layout: location.type at +8, location.id at +12, 32 bytes in all."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class CUmemPoolProps(ctypes.Structure):
    """cuda.h layout: the head of CUmemAllocationProp (location.id at +12), maxSize at +24, 88 bytes."""

    _fields_ = [
        ("allocType", ctypes.c_int),
        ("handleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32SecurityAttributes", ctypes.c_void_p),
        ("maxSize", ctypes.c_size_t),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 54),
    ]


class CUDA_ARRAY_DESCRIPTOR(ctypes.Structure):  # noqa: N801 - cuda.h's name
    _fields_ = [("Width", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Format", ctypes.c_int),
                ("NumChannels", ctypes.c_uint)]


class CUDA_ARRAY3D_DESCRIPTOR(ctypes.Structure):  # noqa: N801
    _fields_ = [("Width", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t),
                ("Format", ctypes.c_int), ("NumChannels", ctypes.c_uint), ("Flags", ctypes.c_uint)]


class CUDA_MEM_ALLOC_NODE_PARAMS(ctypes.Structure):  # noqa: N801
    """cuda.h layout: bytesize at +104, dptr (written by the driver) at +112."""

    _fields_ = [("poolProps", CUmemPoolProps), ("accessDescs", ctypes.c_void_p), ("accessDescCount", ctypes.c_size_t),
                ("bytesize", ctypes.c_size_t), ("dptr", ctypes.c_uint64)]


class CUmulticastObjectProp(ctypes.Structure):
    _fields_ = [("numDevices", ctypes.c_uint), ("size", ctypes.c_size_t), ("handleTypes", ctypes.c_uint64),
                ("flags", ctypes.c_uint64)]


#: CUarray_format values (cuda.h).
CU_AD_FORMAT_UNSIGNED_INT8, CU_AD_FORMAT_HALF, CU_AD_FORMAT_FLOAT = 0x01, 0x10, 0x20
#: CUlimit values (cuda.h).
CU_LIMIT_STACK_SIZE, CU_LIMIT_PRINTF_FIFO_SIZE, CU_LIMIT_MALLOC_HEAP_SIZE = 0, 1, 2
CUDA_ERROR_NOT_SUPPORTED = 801
#: A one-line PTX module (what the H200 showed costs nothing on the device).
PTX_MODULE = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k() { ret; }\n\0"

assert CUDA_MEM_ALLOC_NODE_PARAMS.bytesize.offset == 104 and CUDA_MEM_ALLOC_NODE_PARAMS.dptr.offset == 112
assert CUDA_ARRAY3D_DESCRIPTOR.Format.offset == 24 and CUmulticastObjectProp.size.offset == 8
assert ctypes.sizeof(CUmemPoolProps) == 88
assert CUmemPoolProps.maxSize.offset == 24
assert ctypes.sizeof(CUipcMemHandle) == 64
assert ctypes.sizeof(CUmemAllocationProp) == 32
assert CUmemAllocationProp.location.offset == 8

_u64 = ctypes.c_uint64
_pu64 = ctypes.POINTER(ctypes.c_uint64)
_vp = ctypes.c_void_p
_pvp = ctypes.POINTER(ctypes.c_void_p)
_sz = ctypes.c_size_t
_psz = ctypes.POINTER(ctypes.c_size_t)
_uint = ctypes.c_uint
_int = ctypes.c_int
_pint = ctypes.POINTER(ctypes.c_int)

#: ctypes signatures, as in cuda.h.
SIGNATURES: dict[str, list] = {
    "cuInit": [_uint],
    "cuDeviceGetCount": [_pint],
    "cuDeviceGet": [_pint, _int],
    "cuDeviceTotalMem_v2": [_psz, _int],
    "cuDevicePrimaryCtxRetain": [_pvp, _int],
    "cuCtxCreate_v2": [_pvp, _uint, _int],
    "cuCtxCreate_v3": [_pvp, _vp, _int, _uint, _int],
    "cuCtxCreate_v4": [_pvp, _vp, _uint, _int],
    "cuCtxDestroy_v2": [_vp],
    "cuCtxSetCurrent": [_vp],
    "cuCtxGetCurrent": [_pvp],
    "cuCtxPushCurrent_v2": [_vp],
    "cuCtxPopCurrent_v2": [_pvp],
    "cuCtxGetDevice": [_pint],
    "cuMemAlloc_v2": [_pu64, _sz],
    "cuMemAllocPitch_v2": [_pu64, _psz, _sz, _sz, _uint],
    "cuMemAllocManaged": [_pu64, _sz, _uint],
    "cuMemAllocAsync": [_pu64, _sz, _vp],
    "cuMemAllocAsync_ptsz": [_pu64, _sz, _vp],
    "cuMemAllocFromPoolAsync": [_pu64, _sz, _vp, _vp],
    "cuMemAllocFromPoolAsync_ptsz": [_pu64, _sz, _vp, _vp],
    "cuMemFree_v2": [_u64],
    "cuMemFreeAsync": [_u64, _vp],
    "cuMemFreeAsync_ptsz": [_u64, _vp],
    "cuMemCreate": [_pu64, _sz, ctypes.POINTER(CUmemAllocationProp), ctypes.c_ulonglong],
    "cuMemRelease": [_u64],
    "cuMemMap": [_u64, _sz, _sz, _u64, ctypes.c_ulonglong],
    "cuMemUnmap": [_u64, _sz],
    "cuMemAddressReserve": [_pu64, _sz, _sz, _u64, ctypes.c_ulonglong],
    "cuMemAddressFree": [_u64, _sz],
    "cuMemRetainAllocationHandle": [_pu64, _vp],
    "cuMemExportToShareableHandle": [_vp, _u64, _int, ctypes.c_ulonglong],
    "cuMemImportFromShareableHandle": [_pu64, _vp, _int],
    "cuIpcGetMemHandle": [ctypes.POINTER(CUipcMemHandle), _u64],
    "cuIpcOpenMemHandle_v2": [_pu64, CUipcMemHandle, _uint],
    "cuIpcCloseMemHandle": [_u64],
    "cuMemHostAlloc": [_pvp, _sz, _uint],
    "cuMemAllocHost_v2": [_pvp, _sz],
    "cuMemFreeHost": [_vp],
    "cuMemHostRegister_v2": [_vp, _sz, _uint],
    "cuMemHostUnregister": [_vp],
    "cuLibraryLoadData": [_pvp, _vp, _vp, _vp, _uint, _vp, _vp, _uint],
    "cuLibraryLoadFromFile": [_pvp, ctypes.c_char_p, _vp, _vp, _uint, _vp, _vp, _uint],
    "cuLibraryUnload": [_vp],
    "cuModuleLoad": [_pvp, ctypes.c_char_p],
    "cuModuleLoadData": [_pvp, _vp],
    "cuModuleLoadDataEx": [_pvp, _vp, _uint, _vp, _vp],
    "cuModuleLoadFatBinary": [_pvp, _vp],
    "cuModuleUnload": [_vp],
    "cuLibraryGetKernel": [_pvp, _vp, ctypes.c_char_p],
    "cuKernelGetFunction": [_pvp, _vp],
    "cuMemPoolCreate": [_pvp, _vp],
    "cuMemPoolDestroy": [_vp],
    "cuMemPoolTrimTo": [_vp, _sz],
    "cuMemPoolSetAttribute": [_vp, _int, _vp],
    "cuDeviceGetDefaultMemPool": [_pvp, _int],
    "cuArrayCreate_v2": [_pvp, ctypes.POINTER(CUDA_ARRAY_DESCRIPTOR)],
    "cuArray3DCreate_v2": [_pvp, ctypes.POINTER(CUDA_ARRAY3D_DESCRIPTOR)],
    "cuMipmappedArrayCreate": [_pvp, ctypes.POINTER(CUDA_ARRAY3D_DESCRIPTOR), _uint],
    "cuArrayDestroy": [_vp],
    "cuMipmappedArrayDestroy": [_vp],
    "cuCtxSetLimit": [_int, _sz],
    "cuLaunchKernel": [_vp, _uint, _uint, _uint, _uint, _uint, _uint, _uint, _vp, _vp, _vp],
    "cuStreamBeginCapture_v2": [_vp, _int],
    "cuStreamEndCapture": [_vp, _pvp],
    "cuGraphCreate": [_pvp, _uint],
    "cuGraphAddMemAllocNode": [_pvp, _vp, _vp, _sz, ctypes.POINTER(CUDA_MEM_ALLOC_NODE_PARAMS)],
    "cuGraphAddMemFreeNode": [_pvp, _vp, _vp, _sz, _u64],
    "cuGraphInstantiateWithFlags": [_pvp, _vp, ctypes.c_ulonglong],
    "cuGraphUpload": [_vp, _vp],
    "cuGraphLaunch": [_vp, _vp],
    "cuDeviceGraphMemTrim": [_int],
    "cuMulticastCreate": [_pu64, ctypes.POINTER(CUmulticastObjectProp)],
    "cuMulticastAddDevice": [_u64, _int],
    "cuMulticastBindMem": [_u64, _sz, _u64, _sz, _sz, ctypes.c_ulonglong],
    "cuMulticastUnbind": [_u64, _int, _sz, _sz],
    "memrec_stub_physical_device": [_int],
}


class WorkloadError(Exception):
    """A driver call returned something the scenario did not expect."""


@dataclass
class Facts:
    """What this process (and the processes it started) did, for tests to compare with events."""

    calls: list[dict] = field(default_factory=list)
    processes: list[dict] = field(default_factory=list)

    def merge(self, other: dict) -> None:
        self.calls.extend(other.get("calls", []))
        self.processes.extend(other.get("processes", []))


class Driver:
    """The stub driver behind ctypes, recording a fact per call.

    The current context is mirrored per thread (a stack, as the driver keeps it) so each fact
    carries the ordinal the probes must resolve, without asking the driver (which would add
    probe hits of its own).
    """

    def __init__(self, lib_path: str, facts: Facts, verbose: bool = False) -> None:
        self.lib = ctypes.CDLL(lib_path)
        for name, argtypes in SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self.facts = facts
        self.verbose = verbose
        self._local = threading.local()
        self._ctx_ordinal: dict[int, int] = {}

    # -- bookkeeping ---------------------------------------------------------------------------
    def _stack(self) -> list[int]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def current_ordinal(self) -> int:
        stack = self._stack()
        return self._ctx_ordinal.get(stack[-1], -1) if stack else -1

    def current_ctx(self) -> int:
        stack = self._stack()
        return stack[-1] if stack else 0

    def physical(self, ordinal: int) -> int:
        return self.lib.memrec_stub_physical_device(ordinal) if ordinal >= 0 else -1

    def call(self, api: str, args: dict, out_fn: Callable[[], dict] | None, *cargs, expect: int = CUDA_SUCCESS) -> tuple[int, dict]:
        """Call ``api`` with ``cargs``; record a fact with ``args`` and ``out_fn()`` on success."""
        ordinal = self.current_ordinal()
        ctx = self.current_ctx()
        rc = getattr(self.lib, api)(*cargs)
        out = out_fn() if (out_fn and rc == CUDA_SUCCESS) else {}
        fact = {
            "pid": os.getpid(),
            "tid": threading.get_native_id(),
            "api": api,
            "result": rc,
            "args": args,
            "out": out,
            "ordinal": ordinal,
            "physical": self.physical(ordinal),
            "ctx": ctx,
        }
        self.facts.calls.append(fact)
        if self.verbose:
            print(f"[{fact['pid']}/{fact['tid']}] {api}({_fmt(args)}) = {rc} {_fmt(out)} ordinal={ordinal}", file=sys.stderr)
        if rc != expect:
            raise WorkloadError(f"{api}({_fmt(args)}) returned {rc}, expected {expect}")
        return rc, out

    # -- driver calls (one method per API used) --------------------------------------------------
    def init(self) -> None:
        # Not probed: cuInit, cuDeviceGet and friends are not memory events.
        rc = self.lib.cuInit(0)
        if rc != CUDA_SUCCESS:
            raise WorkloadError(f"cuInit returned {rc}")

    def device_count(self) -> int:
        n = ctypes.c_int()
        if self.lib.cuDeviceGetCount(ctypes.byref(n)) != CUDA_SUCCESS:
            raise WorkloadError("cuDeviceGetCount failed")
        return n.value

    def total_mem(self, dev: int) -> int:
        n = ctypes.c_size_t()
        if self.lib.cuDeviceTotalMem_v2(ctypes.byref(n), dev) != CUDA_SUCCESS:
            raise WorkloadError("cuDeviceTotalMem_v2 failed")
        return n.value

    def primary_ctx_retain(self, dev: int) -> int:
        p = ctypes.c_void_p()
        _, out = self.call("cuDevicePrimaryCtxRetain", {"dev": dev}, lambda: {"ctx": p.value}, ctypes.byref(p), dev)
        self._ctx_ordinal[out["ctx"]] = dev
        return out["ctx"]

    def ctx_create(self, version: int, dev: int, flags: int = 0) -> int:
        p = ctypes.c_void_p()
        api = f"cuCtxCreate_v{version}"
        args = {"dev": dev, "flags": flags}
        if version == 2:
            cargs = (ctypes.byref(p), flags, dev)
        elif version == 3:
            cargs = (ctypes.byref(p), None, 0, flags, dev)
        else:
            cargs = (ctypes.byref(p), None, flags, dev)
        _, out = self.call(api, args, lambda: {"ctx": p.value}, *cargs)
        self._ctx_ordinal[out["ctx"]] = dev
        self._stack().append(out["ctx"])
        return out["ctx"]

    def ctx_destroy(self, ctx: int) -> None:
        self.call("cuCtxDestroy_v2", {"ctx": ctx}, None, ctx)
        stack = self._stack()
        if stack and stack[-1] == ctx:
            stack.pop()

    def ctx_set_current(self, ctx: int) -> None:
        self.call("cuCtxSetCurrent", {"ctx": ctx}, None, ctx)
        stack = self._stack()
        if stack:
            stack[-1] = ctx
        else:
            stack.append(ctx)

    def ctx_push(self, ctx: int) -> None:
        self.call("cuCtxPushCurrent_v2", {"ctx": ctx}, None, ctx)
        self._stack().append(ctx)

    def ctx_pop(self) -> int:
        p = ctypes.c_void_p()
        _, out = self.call("cuCtxPopCurrent_v2", {}, lambda: {"ctx": p.value}, ctypes.byref(p))
        self._stack().pop()
        return out["ctx"]

    def ctx_get_current(self) -> int:
        p = ctypes.c_void_p()
        _, out = self.call("cuCtxGetCurrent", {}, lambda: {"ctx": p.value or 0}, ctypes.byref(p))
        return out["ctx"]

    def ctx_get_device(self) -> int:
        d = ctypes.c_int()
        _, out = self.call("cuCtxGetDevice", {}, lambda: {"device": d.value}, ctypes.byref(d))
        return out["device"]

    def alloc(self, size: int, expect: int = CUDA_SUCCESS) -> int:
        p = ctypes.c_uint64(0)
        self.call("cuMemAlloc_v2", {"bytesize": size}, lambda: {"dptr": p.value}, ctypes.byref(p), size, expect=expect)
        return p.value

    def alloc_pitch(self, width: int, height: int, elem: int) -> tuple[int, int]:
        p = ctypes.c_uint64(0)
        pitch = ctypes.c_size_t(0)
        args = {"width": width, "height": height, "elem": elem}
        _, out = self.call(
            "cuMemAllocPitch_v2", args, lambda: {"dptr": p.value, "pitch": pitch.value},
            ctypes.byref(p), ctypes.byref(pitch), width, height, elem,
        )
        return out["dptr"], out["pitch"]

    def alloc_managed(self, size: int, flags: int) -> int:
        p = ctypes.c_uint64(0)
        self.call("cuMemAllocManaged", {"bytesize": size, "flags": flags}, lambda: {"dptr": p.value}, ctypes.byref(p), size, flags)
        return p.value

    def alloc_async(self, api: str, size: int, stream: int) -> int:
        p = ctypes.c_uint64(0)
        self.call(api, {"bytesize": size, "stream": stream}, lambda: {"dptr": p.value}, ctypes.byref(p), size, stream)
        return p.value

    def alloc_from_pool(self, api: str, size: int, pool: int, stream: int) -> int:
        p = ctypes.c_uint64(0)
        args = {"bytesize": size, "pool": pool, "stream": stream}
        self.call(api, args, lambda: {"dptr": p.value}, ctypes.byref(p), size, pool, stream)
        return p.value

    def free(self, ptr: int) -> None:
        self.call("cuMemFree_v2", {"dptr": ptr}, None, ptr)

    def free_async(self, api: str, ptr: int, stream: int) -> None:
        self.call(api, {"dptr": ptr, "stream": stream}, None, ptr, stream)

    def host_alloc(self, size: int, flags: int) -> int:
        p = ctypes.c_void_p()
        _, out = self.call("cuMemHostAlloc", {"bytesize": size, "flags": flags}, lambda: {"p": p.value}, ctypes.byref(p), size, flags)
        return out["p"]

    def alloc_host(self, size: int) -> int:
        p = ctypes.c_void_p()
        _, out = self.call("cuMemAllocHost_v2", {"bytesize": size}, lambda: {"p": p.value}, ctypes.byref(p), size)
        return out["p"]

    def free_host(self, ptr: int) -> None:
        self.call("cuMemFreeHost", {"p": ptr}, None, ptr)

    def host_register(self, ptr: int, size: int, flags: int) -> None:
        self.call("cuMemHostRegister_v2", {"p": ptr, "bytesize": size, "flags": flags}, None, ptr, size, flags)

    def host_unregister(self, ptr: int) -> None:
        self.call("cuMemHostUnregister", {"p": ptr}, None, ptr)

    def address_reserve(self, size: int, alignment: int, addr: int) -> int:
        p = ctypes.c_uint64(0)
        args = {"size": size, "alignment": alignment, "addr": addr}
        _, out = self.call("cuMemAddressReserve", args, lambda: {"ptr": p.value}, ctypes.byref(p), size, alignment, addr, 0)
        return out["ptr"]

    def address_free(self, ptr: int, size: int) -> None:
        self.call("cuMemAddressFree", {"ptr": ptr, "size": size}, None, ptr, size)

    def mem_create(self, size: int, device: int, expect: int = CUDA_SUCCESS) -> int:
        prop = CUmemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        h = ctypes.c_uint64(0)
        args = {"size": size, "location_type": CU_MEM_LOCATION_TYPE_DEVICE, "location_id": device}
        self.call("cuMemCreate", args, lambda: {"handle": h.value}, ctypes.byref(h), size, ctypes.byref(prop), 0, expect=expect)
        return h.value

    def mem_release(self, handle: int) -> None:
        self.call("cuMemRelease", {"handle": handle}, None, handle)

    def mem_map(self, ptr: int, size: int, offset: int, handle: int) -> None:
        args = {"ptr": ptr, "size": size, "offset": offset, "handle": handle}
        self.call("cuMemMap", args, None, ptr, size, offset, handle, 0)

    def mem_unmap(self, ptr: int, size: int) -> None:
        self.call("cuMemUnmap", {"ptr": ptr, "size": size}, None, ptr, size)

    def retain_allocation_handle(self, addr: int) -> int:
        h = ctypes.c_uint64(0)
        _, out = self.call("cuMemRetainAllocationHandle", {"addr": addr}, lambda: {"handle": h.value}, ctypes.byref(h), addr)
        return out["handle"]

    def export_fd(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        args = {"handle": handle, "type": CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR}
        _, out = self.call("cuMemExportToShareableHandle", args, lambda: {"fd": fd.value},
                           ctypes.byref(fd), handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        return out["fd"]

    def export_fabric(self, handle: int) -> bytes:
        buf = (ctypes.c_char * 64)()
        args = {"handle": handle, "type": CU_MEM_HANDLE_TYPE_FABRIC}
        _, out = self.call("cuMemExportToShareableHandle", args, lambda: {"fabric": bytes(buf).hex()},
                           ctypes.byref(buf), handle, CU_MEM_HANDLE_TYPE_FABRIC, 0)
        return bytes.fromhex(out["fabric"])

    def import_fd(self, fd: int) -> int:
        h = ctypes.c_uint64(0)
        args = {"fd": fd, "type": CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR}
        _, out = self.call("cuMemImportFromShareableHandle", args, lambda: {"handle": h.value},
                           ctypes.byref(h), fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return out["handle"]

    def import_fabric(self, blob: bytes) -> int:
        h = ctypes.c_uint64(0)
        buf = (ctypes.c_char * 64).from_buffer_copy(blob)
        args = {"fabric": blob.hex(), "type": CU_MEM_HANDLE_TYPE_FABRIC}
        _, out = self.call("cuMemImportFromShareableHandle", args, lambda: {"handle": h.value},
                           ctypes.byref(h), ctypes.addressof(buf), CU_MEM_HANDLE_TYPE_FABRIC)
        return out["handle"]

    def ipc_get_handle(self, ptr: int) -> bytes:
        handle = CUipcMemHandle()
        _, out = self.call("cuIpcGetMemHandle", {"dptr": ptr}, lambda: {"handle": bytes(handle).hex()},
                           ctypes.byref(handle), ptr)
        return bytes.fromhex(out["handle"])

    def ipc_open(self, blob: bytes, flags: int) -> int:
        handle = CUipcMemHandle.from_buffer_copy(blob)
        p = ctypes.c_uint64(0)
        args = {"handle": blob.hex(), "flags": flags}
        _, out = self.call("cuIpcOpenMemHandle_v2", args, lambda: {"dptr": p.value}, ctypes.byref(p), handle, flags)
        return out["dptr"]

    def ipc_close(self, ptr: int) -> None:
        self.call("cuIpcCloseMemHandle", {"dptr": ptr}, None, ptr)

    def library_load_data(self, addr: int) -> int:
        """cuLibraryLoadData of the image at ``addr`` (real programs pass a pointer into a mapped
        library's fatbin section)."""
        p = ctypes.c_void_p()
        _, out = self.call("cuLibraryLoadData", {"code": addr}, lambda: {"library": p.value},
                           ctypes.byref(p), addr, None, None, 0, None, None, 0)
        return out["library"]

    def library_load_file(self, path: str) -> int:
        p = ctypes.c_void_p()
        _, out = self.call("cuLibraryLoadFromFile", {"file": path}, lambda: {"library": p.value},
                           ctypes.byref(p), path.encode(), None, None, 0, None, None, 0)
        return out["library"]

    def library_unload(self, library: int) -> None:
        self.call("cuLibraryUnload", {"handle": library}, None, library)

    def module_load(self, api: str, source: str | ctypes.Array, expect: int = CUDA_SUCCESS) -> int:
        """cuModuleLoad (a file name) or cuModuleLoadData/DataEx/FatBinary (an image in memory)."""
        p = ctypes.c_void_p()
        if api == "cuModuleLoad":
            args, cargs = {"file": source}, (source.encode(),)
        else:
            addr = ctypes.addressof(source)
            args, cargs = {"code": addr}, (addr, 0, None, None) if api == "cuModuleLoadDataEx" else (addr,)
        _, out = self.call(api, args, lambda: {"module": p.value}, ctypes.byref(p), *cargs, expect=expect)
        return out.get("module", 0)

    def module_unload(self, module: int) -> None:
        self.call("cuModuleUnload", {"handle": module}, None, module)

    def library_get_kernel(self, library: int, name: str) -> int:
        p = ctypes.c_void_p()
        _, out = self.call("cuLibraryGetKernel", {"library": library, "name": name}, lambda: {"kernel": p.value},
                           ctypes.byref(p), library, name.encode())
        return out["kernel"]

    def kernel_get_function(self, kernel: int) -> int:
        p = ctypes.c_void_p()
        _, out = self.call("cuKernelGetFunction", {"kernel": kernel}, lambda: {"function": p.value}, ctypes.byref(p), kernel)
        return out["function"]

    def default_mem_pool(self, dev: int) -> int:
        p = ctypes.c_void_p()
        _, out = self.call("cuDeviceGetDefaultMemPool", {"dev": dev}, lambda: {"pool": p.value}, ctypes.byref(p), dev)
        return out["pool"]

    def pool_create(self, dev: int, max_size: int) -> int:
        props = CUmemPoolProps()
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = dev
        props.maxSize = max_size
        p = ctypes.c_void_p()
        args = {"location_type": CU_MEM_LOCATION_TYPE_DEVICE, "location_id": dev, "max_size": max_size}
        _, out = self.call("cuMemPoolCreate", args, lambda: {"pool": p.value}, ctypes.byref(p), ctypes.byref(props))
        return out["pool"]

    def pool_destroy(self, pool: int) -> None:
        self.call("cuMemPoolDestroy", {"handle": pool}, None, pool)

    def pool_trim(self, pool: int, keep: int) -> None:
        self.call("cuMemPoolTrimTo", {"handle": pool, "keep": keep}, None, pool, keep)

    def pool_set_attribute(self, pool: int, attr: int, value: int) -> None:
        """A cuuint64_t value from the release threshold on, an int before it (cuda.h)."""
        box = ctypes.c_uint64(value) if attr >= CU_MEMPOOL_ATTR_RELEASE_THRESHOLD else ctypes.c_int(value)
        self.call("cuMemPoolSetAttribute", {"handle": pool, "attr": attr, "value": value}, None,
                  pool, attr, ctypes.byref(box))

    # -- issue 21: arrays, limits, graphs, multicast -----------------------------------------------
    def array_create(self, width: int, height: int, fmt: int, channels: int) -> int:
        d = CUDA_ARRAY_DESCRIPTOR(width, height, fmt, channels)
        p = ctypes.c_void_p()
        _, out = self.call("cuArrayCreate_v2", {"width": width, "height": height, "format": fmt, "channels": channels},
                           lambda: {"array": p.value}, ctypes.byref(p), ctypes.byref(d))
        return out["array"]

    def array3d_create(self, api: str, width: int, height: int, depth: int, fmt: int, channels: int,
                       levels: int = 1) -> int:
        """cuArray3DCreate_v2, or cuMipmappedArrayCreate with ``levels``."""
        d = CUDA_ARRAY3D_DESCRIPTOR(width, height, depth, fmt, channels, 0)
        p = ctypes.c_void_p()
        args = {"width": width, "height": height, "depth": depth, "format": fmt, "channels": channels, "levels": levels}
        cargs = (ctypes.byref(p), ctypes.byref(d)) + ((levels,) if api == "cuMipmappedArrayCreate" else ())
        _, out = self.call(api, args, lambda: {"array": p.value}, *cargs)
        return out["array"]

    def array_destroy(self, api: str, array: int) -> None:
        self.call(api, {"handle": array}, None, array)

    def ctx_set_limit(self, limit: int, value: int) -> None:
        self.call("cuCtxSetLimit", {"limit": limit, "value": value}, None, limit, value)

    def launch(self) -> None:
        """cuLaunchKernel: never probed (no fact), but it places what limits promised."""
        rc = self.lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        if rc != CUDA_SUCCESS:
            raise WorkloadError(f"cuLaunchKernel returned {rc}")

    def begin_capture(self, stream: int) -> None:
        self.call("cuStreamBeginCapture_v2", {"stream": stream, "mode": 0}, None, stream, 0)

    def end_capture(self, stream: int) -> int:
        g = ctypes.c_void_p()
        _, out = self.call("cuStreamEndCapture", {"stream": stream}, lambda: {"graph": g.value}, stream, ctypes.byref(g))
        return out["graph"]

    def graph_create(self) -> int:
        """cuGraphCreate: not probed (a graph holds nothing until its nodes say so)."""
        g = ctypes.c_void_p()
        if self.lib.cuGraphCreate(ctypes.byref(g), 0) != CUDA_SUCCESS:
            raise WorkloadError("cuGraphCreate failed")
        return g.value

    def graph_mem_alloc_node(self, graph: int, size: int, dev: int) -> int:
        params = CUDA_MEM_ALLOC_NODE_PARAMS()
        params.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED
        params.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        params.poolProps.location.id = dev
        params.bytesize = size
        node = ctypes.c_void_p()
        _, out = self.call("cuGraphAddMemAllocNode", {"graph": graph, "size": size, "dev": dev},
                           lambda: {"ptr": params.dptr}, ctypes.byref(node), graph, None, 0, ctypes.byref(params))
        return out["ptr"]

    def graph_mem_free_node(self, graph: int, ptr: int) -> None:
        node = ctypes.c_void_p()
        self.call("cuGraphAddMemFreeNode", {"graph": graph, "ptr": ptr}, None, ctypes.byref(node), graph, None, 0, ptr)

    def graph_instantiate(self, graph: int) -> int:
        e = ctypes.c_void_p()
        _, out = self.call("cuGraphInstantiateWithFlags", {"graph": graph}, lambda: {"exec": e.value},
                           ctypes.byref(e), graph, 0)
        return out["exec"]

    def graph_upload(self, exec_: int, stream: int) -> None:
        self.call("cuGraphUpload", {"exec": exec_, "stream": stream}, None, exec_, stream)

    def graph_launch(self, exec_: int, stream: int) -> None:
        """cuGraphLaunch: never probed (SGLang launches a graph per decode step)."""
        if self.lib.cuGraphLaunch(exec_, stream) != CUDA_SUCCESS:
            raise WorkloadError("cuGraphLaunch failed")

    def graph_mem_trim(self, dev: int) -> None:
        self.call("cuDeviceGraphMemTrim", {"dev": dev}, None, dev)

    def multicast_create(self, size: int, devices: int, expect: int = CUDA_SUCCESS) -> int:
        prop = CUmulticastObjectProp(devices, size, 1, 0)
        h = ctypes.c_uint64()
        _, out = self.call("cuMulticastCreate", {"size": size, "devices": devices}, lambda: {"handle": h.value},
                           ctypes.byref(h), ctypes.byref(prop), expect=expect)
        return out.get("handle", 0)

    def multicast_add_device(self, mc: int, dev: int) -> None:
        self.call("cuMulticastAddDevice", {"handle": mc, "dev": dev}, None, mc, dev)

    def multicast_bind_mem(self, mc: int, mem: int, size: int) -> None:
        self.call("cuMulticastBindMem", {"handle": mc, "mem": mem, "size": size}, None, mc, 0, mem, 0, size, 0)

    def multicast_unbind(self, mc: int, dev: int, size: int) -> None:
        self.call("cuMulticastUnbind", {"handle": mc, "dev": dev, "size": size}, None, mc, dev, 0, size)

    def use_device(self, dev: int) -> int:
        """Retain ``dev``'s primary context and make it current (what cudart does on first use)."""
        ctx = self.primary_ctx_retain(dev)
        self.ctx_set_current(ctx)
        return ctx


def _fmt(d: dict) -> str:
    return ", ".join(f"{k}={hex(v) if isinstance(v, int) and v > 4096 else v}" for k, v in d.items())
