"""GPU tests: real driver calls on an NVIDIA GPU, recorded by real probes.

They run on a GPU host as root with bcc importable (on the project's GPU host, after
``source .gpu/use-bcc-bundle.sh``); anywhere else each test is skipped with the reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from memrec.base.errors import MemrecCommandError
from memrec.subscriber import wait_for_daemon


def _skip_reason() -> str | None:
    if not (Path("/dev/nvidiactl").exists() or Path("/dev/nvidia0").exists()):
        return "no NVIDIA GPU on this host (/dev/nvidiactl missing)"
    if os.geteuid() != 0:
        return "GPU tests load BPF probes: run as root"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc is not importable (see shared/gpu/ for carrying it to a GPU host)"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return "cuda-python (cuda.bindings.driver) is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _skip_reason()
    if reason is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


def cuda_alloc_source(size: int) -> str:
    """Python source that allocates ``size`` bytes on GPU 0 with the driver API (cuda-python),
    leaving ``cu`` and ``ptr`` defined for what follows."""
    return f"""
from cuda.bindings import driver as cu
assert cu.cuInit(0)[0] == 0
err, dev = cu.cuDeviceGet(0)
err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
assert cu.cuCtxSetCurrent(ctx)[0] == 0
err, ptr = cu.cuMemAlloc({size})
assert err == 0, err
"""


def memrec_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "memrec", *args]


@pytest.fixture
def daemon(tmp_path):
    """A real `memrec daemon` on a temporary socket and output directory."""
    sock = tmp_path / "memrec.sock"
    out = tmp_path / "traces"
    proc = subprocess.Popen(memrec_cmd("-v", "daemon", "-o", str(out), "--socket", str(sock)))
    try:
        wait_for_daemon(str(sock), timeout=120)
    except MemrecCommandError as error:
        proc.kill()
        pytest.fail(f"daemon did not start (rc={proc.poll()}): {error}")
    yield sock, out
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0


@pytest.fixture
def torch():
    """PyTorch with CUDA (the GPU host's own); the skip reason names what is missing."""
    return pytest.importorskip("torch")


@pytest.fixture
def two_gpus(torch):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two or more GPUs (this host has {torch.cuda.device_count()})")
