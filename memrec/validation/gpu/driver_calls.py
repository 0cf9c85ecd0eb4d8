"""A scripted set of real driver calls of distinctive sizes, for ``memrec selftest``.

Run as ``python -m memrec.validation.gpu.driver_calls [--device N]``. Every call is made through cuda-python
(``cuda.bindings.driver``), so it reaches ``libcuda.so.1`` exactly as PyTorch and SGLang do. The
script prints one JSON object per call on stdout (the *facts*): what it called, with which
arguments, what the driver returned and in which process, so the selftest can check that the
daemon recorded exactly that. The IPC importer runs as a second process (``--import HEX``), since
CUDA refuses to open an IPC handle in the process that exported it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# Distinctive sizes: odd enough that a match by size alone is no coincidence.
ALLOC_SIZES = (7 * 2**20 + 4096 + 123, 33 * 2**20 + 777, 1 * 2**20 + 1)
HOST_SIZE = 3 * 2**20 + 4095
IPC_SIZE = 5 * 2**20 + 12345
VMM_GRANULES = 3


def driver_api():
    """cuda-python's driver module (raises ImportError without cuda-python)."""
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6
        from cuda import cuda as driver
    return driver


def _code(err) -> int:
    return int(getattr(err, "value", err))


def _check(result, what: str):
    """cuda-python returns (CUresult, *values); fail loudly on anything but success."""
    err, *values = result
    if _code(err) != 0:
        raise SystemExit(f"driver_calls: {what} failed with CUresult {_code(err)}")
    return values[0] if len(values) == 1 else values


def _handle_bytes(handle) -> bytes:
    reserved = handle.reserved
    return bytes(reserved) if not isinstance(reserved, bytes) else reserved


def _emit(**fact) -> None:
    fact["pid"] = os.getpid()
    print(json.dumps(fact), flush=True)


def _context(cu, ordinal: int):
    _check(cu.cuInit(0), "cuInit")
    dev = _check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return dev, ctx


def run_exporter(ordinal: int) -> None:
    cu = driver_api()
    dev, _ = _context(cu, ordinal)
    total = _check(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem")
    _emit(call="context", ordinal=ordinal, total=int(total))

    for size in ALLOC_SIZES:
        ptr = _check(cu.cuMemAlloc(size), "cuMemAlloc")
        _emit(call="cuMemAlloc_v2", size=size, ptr=int(ptr), result=0)
        _check(cu.cuMemFree(ptr), "cuMemFree")
        _emit(call="cuMemFree_v2", ptr=int(ptr), result=0)

    # A deliberate out-of-memory request: twice the device's memory.
    err, _ = cu.cuMemAlloc(2 * int(total))
    _emit(call="cuMemAlloc_v2", size=2 * int(total), ptr=0, result=_code(err))

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    granularity = _check(
        cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        ),
        "cuMemGetAllocationGranularity",
    )
    size = VMM_GRANULES * int(granularity)
    handle = _check(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
    _emit(call="cuMemCreate", size=size, handle=int(handle), result=0)
    va = _check(cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
    _emit(call="cuMemAddressReserve", size=size, ptr=int(va), result=0)
    _check(cu.cuMemMap(va, size, 0, handle, 0), "cuMemMap")
    _emit(call="cuMemMap", size=size, ptr=int(va), handle=int(handle), result=0)
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = ordinal
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _check(cu.cuMemSetAccess(va, size, [access], 1), "cuMemSetAccess")
    _check(cu.cuMemUnmap(va, size), "cuMemUnmap")
    _emit(call="cuMemUnmap", size=size, ptr=int(va), result=0)
    _check(cu.cuMemRelease(handle), "cuMemRelease")
    _emit(call="cuMemRelease", handle=int(handle), result=0)
    _check(cu.cuMemAddressFree(va, size), "cuMemAddressFree")
    _emit(call="cuMemAddressFree", size=size, ptr=int(va), result=0)

    host = _check(cu.cuMemHostAlloc(HOST_SIZE, 0), "cuMemHostAlloc")
    _emit(call="cuMemHostAlloc", size=HOST_SIZE, ptr=int(host), result=0)
    _check(cu.cuMemFreeHost(host), "cuMemFreeHost")
    _emit(call="cuMemFreeHost", ptr=int(host), result=0)

    ptr = _check(cu.cuMemAlloc(IPC_SIZE), "cuMemAlloc")
    _emit(call="cuMemAlloc_v2", size=IPC_SIZE, ptr=int(ptr), result=0)
    ipc = _check(cu.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
    raw = _handle_bytes(ipc)
    _emit(call="cuIpcGetMemHandle", ptr=int(ptr), ipc=raw.hex(), result=0)
    # The importer prints its own facts to our stdout.
    subprocess.run(
        [sys.executable, "-m", "memrec.validation.gpu.driver_calls", "--device", str(ordinal), "--import", raw.hex()],
        check=True,
    )
    _check(cu.cuMemFree(ptr), "cuMemFree")
    _emit(call="cuMemFree_v2", ptr=int(ptr), result=0)


def run_importer(ordinal: int, handle_hex: str) -> None:
    cu = driver_api()
    _context(cu, ordinal)
    handle = cu.CUipcMemHandle()
    handle.reserved = bytes.fromhex(handle_hex)
    flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    ptr = _check(cu.cuIpcOpenMemHandle(handle, flags), "cuIpcOpenMemHandle")
    _emit(call="cuIpcOpenMemHandle_v2", ptr=int(ptr), ipc=handle_hex, result=0)
    _check(cu.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")
    _emit(call="cuIpcCloseMemHandle", ptr=int(ptr), result=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0, help="device ordinal (this process's view)")
    parser.add_argument("--import", dest="import_hex", help="open this IPC handle (importer role)")
    args = parser.parse_args(argv)
    if args.import_hex:
        run_importer(args.device, args.import_hex)
    else:
        run_exporter(args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
