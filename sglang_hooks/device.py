"""The current GPU's numbers, read only where a CUDA context already exists: never create one.

Why this is its own module: a hook that makes a CUDA context causes the very failure memrec is
there to explain. ``torch.cuda.mem_get_info()`` (or ``current_device()``) creates the primary
context of the current device — device 0 before SGLang's ``set_device`` — and
``torch.cuda.is_initialized()`` is already true after a bare ``get_device_capability()``, which
SGLang 0.4.10 – 0.5.15 call at import time. A 500 MiB context per rank on GPU 0 lowers the
all-rank minimum every rank sizes its KV cache from.

So the device is asked of the driver itself, and only of a driver the process already loaded
(``dlopen(..., RTLD_NOLOAD)``: never loads or initialises it): ``cuCtxGetCurrent`` says whether
the calling thread has a current context, and only then ``cuCtxGetDevice`` and ``cuMemGetInfo``
read that context's device. None of these can create a context or allocate. Without a current
context the hooks record ranks and SGLang's own values, and no device numbers.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

from memrec.sglang_hooks.state import STATE

#: The driver's soname; a library loaded under another name is found by its soname too.
DRIVER_SONAME = "libcuda.so.1"


def loaded_driver() -> Any:
    """The CUDA driver this process has already loaded, or None. Never loads it."""
    if STATE.driver is not None:
        return STATE.driver
    mode = getattr(os, "RTLD_NOLOAD", 0)
    if not mode:  # not Linux: no way to ask without loading
        return None
    try:
        lib = ctypes.CDLL(DRIVER_SONAME, mode=mode | os.RTLD_LAZY)
    except OSError:
        return None
    with STATE.driver_lock:
        if STATE.driver is None:
            try:
                for name in ("cuCtxGetCurrent", "cuCtxGetDevice", "cuMemGetInfo_v2"):
                    getattr(lib, name).restype = ctypes.c_int
            except AttributeError:
                return None  # not a CUDA driver
            STATE.driver = lib
    return STATE.driver


def current_device(lib: Any) -> int | None:
    """The device ordinal of this thread's current context, or None when it has none."""
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        return None  # driver not initialised (CUDA_ERROR_NOT_INITIALIZED) or no current context
    known = STATE.ctx_device.get(ctx.value)
    if known is not None:
        return known
    device = ctypes.c_int(-1)
    if lib.cuCtxGetDevice(ctypes.byref(device)) != 0:
        return None
    # Context handle -> device ordinal: cuCtxGetDevice once per context, not once per marker. A
    # handle may be reused after cuCtxDestroy: the map stays small.
    if len(STATE.ctx_device) < 256:
        STATE.ctx_device[ctx.value] = device.value
    return device.value


def _uuid(lib: Any, ordinal: int) -> str | None:
    """``GPU-…`` of ``ordinal`` from the driver (``cuDeviceGetUuid``), else from torch's cached
    device properties (only once torch initialised CUDA: reading them creates nothing)."""
    if ordinal in STATE.uuid_cache:
        return STATE.uuid_cache[ordinal]
    uuid = None
    for name in ("cuDeviceGetUuid_v2", "cuDeviceGetUuid"):
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        raw = ctypes.create_string_buffer(16)
        fn.restype = ctypes.c_int
        if fn(raw, ctypes.c_int(ordinal)) == 0:
            h = raw.raw.hex()
            uuid = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        break
    if uuid is None:
        cuda = _initialised_torch_cuda()
        try:
            raw_uuid = getattr(cuda.get_device_properties(ordinal), "uuid", None) if cuda else None
        except Exception:
            raw_uuid = None
        if raw_uuid is not None:
            text = str(raw_uuid)
            uuid = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    STATE.uuid_cache[ordinal] = uuid
    return uuid


def _initialised_torch_cuda() -> Any:
    """``torch.cuda`` when torch is imported and has initialised CUDA; never imports torch."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    try:
        return cuda if cuda is not None and cuda.is_initialized() else None
    except Exception:
        return None


def device_values(out: dict) -> int | None:
    """Add the current context's device numbers to ``out``; return its ordinal (or None).

    ``cuda_device``, ``free_bytes``/``total_bytes`` (``cuMemGetInfo`` of that context),
    ``gpu_uuid``, and torch's own ``torch_reserved_bytes``/``torch_allocated_bytes`` for that
    device when torch is imported (host-side counters). Nothing when this thread has no current
    context: nothing is loaded, initialised, created or allocated, and nothing is collective.
    """
    lib = loaded_driver()
    if lib is None:
        return None
    try:
        ordinal = current_device(lib)
        if ordinal is None:
            return None
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
    except Exception:
        return None
    out["cuda_device"] = ordinal
    out["free_bytes"] = int(free.value)
    out["total_bytes"] = int(total.value)
    cuda = _initialised_torch_cuda()
    if cuda is not None:
        try:
            out["torch_reserved_bytes"] = int(cuda.memory_reserved(ordinal))
            out["torch_allocated_bytes"] = int(cuda.memory_allocated(ordinal))
        except Exception:
            pass
    uuid = _uuid(lib, ordinal)
    if uuid:
        out["gpu_uuid"] = uuid
    return ordinal
