"""A CUDA-driver workload for the stub driver: ``python -m memrec.stubdriver.workload SCENARIO...``.

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
from dataclasses import field

from memrec._errors import MemrecError

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

    def use_device(self, dev: int) -> int:
        """Retain ``dev``'s primary context and make it current (what cudart does on first use)."""
        ctx = self.primary_ctx_retain(dev)
        self.ctx_set_current(ctx)
        return ctx


def _fmt(d: dict) -> str:
    return ", ".join(f"{k}={hex(v) if isinstance(v, int) and v > 4096 else v}" for k, v in d.items())


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
        cmd = [sys.executable, "-m", "memrec.stubdriver.workload", "--lib", self.lib, "--facts", scenario]
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
        prog="python -m memrec.stubdriver.workload",
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
    from memrec.stubdriver.build import build_stub  # only when no library was named

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
