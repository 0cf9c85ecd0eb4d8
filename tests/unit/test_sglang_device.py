"""The SGLang hooks never create a CUDA context: device numbers only from a context that exists.

Each case runs in a fresh Python process (a loaded driver cannot be unloaded from pytest's own),
with the stub driver (memrec/validation/stubdriver, soname libcuda.so.1) standing in for libcuda and a fake
torch whose CUDA functions record being called. Every hook entry point of every targets line is
called, as SGLang calls them, through :mod:`memrec.sglang_hooks.selfcheck`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from memrec.validation.stubdriver.build import StubBuildError
from memrec.validation.stubdriver.build import build_stub

GiB = 1 << 30

# The child's preamble: a fake torch in the state SGLang 0.4.10 - 0.5.15 leave it in at import
# (is_initialized() true after get_device_capability(), no context), every hook called once.
_PRELUDE = r'''
import ctypes, json, os, sys, types
from memrec.sglang_hooks import selfcheck
from memrec.sglang_hooks.state import STATE

calls = []
class Props:
    uuid = "5d8f3c1e-0000-1111-2222-333344445555"
class Cuda:
    @staticmethod
    def is_initialized(): return True
    @staticmethod
    def current_device(): calls.append("current_device"); return 0
    @staticmethod
    def mem_get_info(*a): calls.append("mem_get_info"); return (1, 2)
    @staticmethod
    def memory_reserved(d): calls.append(("memory_reserved", d)); return 2 << 30
    @staticmethod
    def memory_allocated(d): calls.append(("memory_allocated", d)); return 1 << 30
    @staticmethod
    def get_device_properties(d): calls.append(("props", d)); return Props()
    @staticmethod
    def set_device(d): calls.append("set_device")
class Untouchable:  # torch.distributed: a hook must never call a collective
    def __getattr__(self, name): calls.append("distributed." + name); raise AttributeError(name)
torch = types.ModuleType("torch"); torch.cuda = Cuda; torch.distributed = Untouchable()
sys.modules["torch"] = torch

def libcuda_mapped():
    with open("/proc/self/maps") as f:
        return any("libcuda" in line for line in f)

def run_hooks():
    sent = []
    n = selfcheck.run_every_hook(lambda name, phase, gpu, values: sent.append((name, gpu, values)))
    STATE.reset()
    return n, sent

def device_keys(sent):
    return sorted({k for _, _, v in sent for k in v if k in ("cuda_device", "free_bytes", "total_bytes",
                   "gpu_uuid", "torch_reserved_bytes", "torch_allocated_bytes")})
'''


@pytest.fixture(scope="module")
def stub() -> str:
    try:
        return str(build_stub())
    except StubBuildError as error:
        pytest.skip(f"no stub driver: {error}")


def _child(body: str, *args: str) -> dict:
    code = _PRELUDE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_a_loaded_driver_the_hooks_load_nothing_and_ask_torch_nothing():
    # GIVEN a process whose torch says CUDA is initialised, with no driver loaded
    # WHEN every hook entry point runs
    out = _child(
        """
        n, sent = run_hooks()
        print(json.dumps({"n": n, "markers": len(sent), "keys": device_keys(sent), "calls": calls,
                          "gpus": sorted({str(g) for _, g, _ in sent}), "mapped": libcuda_mapped()}))
        """
    )
    # THEN every hook sent its markers, without device numbers, no GPU named, libcuda still not
    # loaded, and none of torch's CUDA functions was called
    assert out["n"] > 40 and out["markers"] >= out["n"] - 10
    assert out["keys"] == [] and out["gpus"] == ["None"]
    assert out["mapped"] is False
    assert out["calls"] == []


def test_an_initialised_driver_without_a_context_gets_none_made(stub):
    # GIVEN the driver loaded and initialised (as after get_device_capability), no context
    # WHEN every hook entry point runs
    out = _child(
        """
        lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)
        assert lib.cuInit(0) == 0
        n, sent = run_hooks()
        ctx = ctypes.c_void_p()
        rc = lib.cuCtxGetCurrent(ctypes.byref(ctx))
        print(json.dumps({"n": n, "keys": device_keys(sent), "calls": calls, "rc": rc, "ctx": ctx.value}))
        """,
        stub,
    )
    # THEN there is still no current context, the markers carry no device numbers, and torch
    # was not asked for a device (current_device/mem_get_info would have made a context)
    assert out["n"] > 40
    assert (out["rc"], out["ctx"]) == (0, None)
    assert out["keys"] == [] and out["calls"] == []


def test_the_current_contexts_device_is_read_from_the_driver(stub):
    # GIVEN a context on device 1 current on this thread (as after SGLang's set_device), and
    # 3 GiB allocated there
    out = _child(
        """
        lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)
        assert lib.cuInit(0) == 0
        ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
        assert lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, 1) == 0
        assert lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(3 << 30)) == 0
        n, sent = run_hooks()
        values = [v for name, g, v in sent if "cuda_device" in v]
        print(json.dumps({"n": n, "gpus": sorted({g for _, g, _ in sent}), "first": values[0],
                          "all": len(values) == len(sent), "calls": calls}))
        """,
        stub,
    )
    # THEN every marker names device 1 with the driver's free/total of that device, torch's
    # counters for device 1 and the UUID (from torch's cached properties: the stub has no
    # cuDeviceGetUuid), and torch was never asked for the current device or free memory
    first = out["first"]
    assert out["all"] and out["gpus"] == [1]
    assert first["cuda_device"] == 1
    assert (first["total_bytes"], first["free_bytes"]) == (80 * GiB, 77 * GiB)
    assert (first["torch_reserved_bytes"], first["torch_allocated_bytes"]) == (2 * GiB, GiB)
    assert first["gpu_uuid"] == "GPU-5d8f3c1e-0000-1111-2222-333344445555"
    assert "current_device" not in out["calls"] and "mem_get_info" not in out["calls"]
    assert ["memory_reserved", 1] in out["calls"]


def test_a_context_current_on_another_thread_is_not_borrowed(stub):
    # GIVEN a context current on another thread only
    out = _child(
        """
        import threading
        lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)
        assert lib.cuInit(0) == 0
        def make():
            ctx = ctypes.c_void_p()
            assert lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
        t = threading.Thread(target=make); t.start(); t.join()
        n, sent = run_hooks()
        print(json.dumps({"keys": device_keys(sent), "calls": calls}))
        """,
        stub,
    )
    # THEN this thread's hooks read no device numbers (and make no context of their own)
    assert out["keys"] == [] and out["calls"] == []


def test_selfcheck_command_says_no_context_was_created(stub):
    # GIVEN the stub driver loaded and initialised, no context
    code = textwrap.dedent(
        """
        import ctypes, os, sys
        lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)
        assert lib.cuInit(0) == 0
        from memrec.sglang_hooks import selfcheck
        sys.exit(selfcheck.main(["--no-torch"]))
        """
    )
    # WHEN the self-check runs every hook
    proc = subprocess.run([sys.executable, "-c", code, stub], capture_output=True, text=True, timeout=60)
    # THEN it reports the hooks it called and no context, and exits 0
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["hooks_called"] > 40 and report["context_created"] is False
    assert report["before"] == report["after"] == {"libcuda_loaded": True, "current_device": None}
