"""BPF tests: real uprobes on the stub CUDA driver (no GPU needed, root needed).

Every test here is skipped, with the reason, when the host cannot run BPF uprobes: not root,
bcc not importable, no uprobe support in the kernel, no kernel headers for bcc, tracefs not
mountable, or no C compiler for the stub driver.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

TRACEFS = Path("/sys/kernel/tracing")


def _mount_tracefs() -> str | None:
    """bcc finds tracepoints through tracefs; mount it when the host has not."""
    if (TRACEFS / "events").is_dir() or Path("/sys/kernel/debug/tracing/events").is_dir():
        return None
    proc = subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not (TRACEFS / "events").is_dir():
        return f"tracefs is not mounted at {TRACEFS} and mounting it failed: {proc.stderr.strip()}"
    return None


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "BPF tests attach uprobes: run them as root"
    try:
        import bcc  # noqa: F401
    except ImportError as exc:
        return f"bcc is not importable ({exc}): install python3-bpfcc"
    if not Path("/sys/bus/event_source/devices/uprobe").exists() and not (TRACEFS / "uprobe_events").exists():
        return "this kernel has no uprobe support (CONFIG_UPROBE_EVENTS)"
    headers = Path("/lib/modules") / platform.release() / "build"
    if not headers.exists():
        return f"no kernel headers for bcc at {headers} (see DESIGN.md: link Debian's linux-headers)"
    return _mount_tracefs()


@pytest.fixture(scope="session")
def bpf_host() -> None:
    """Skip the test when this host cannot run the probes."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def stub_lib(bpf_host, tmp_path_factory) -> Path:
    """The stub libcuda.so.1, built once per session into a folder of its own.

    Its own file (inode), because uprobes belong to an inode: another session's probes on a shared
    stub see this session's workloads, and bcc 0.26 (which older memrec attached with) places its
    uprobes with a garbage ref_ctr_offset, after which the kernel refuses any other probe at the
    same offset of that inode (EINVAL, "ref_ctr_offset mismatch" in dmesg).
    """
    from memrec.validation.stubdriver.build import StubBuildError
    from memrec.validation.stubdriver.build import build_stub

    try:
        return build_stub(tmp_path_factory.mktemp("stub"))
    except StubBuildError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def probes(stub_lib):
    """Host-wide probes attached to the stub; the ring is drained before each use."""
    from memrec.probes.cuda import CudaProbes

    p = CudaProbes().load()
    p.attach_library(stub_lib)
    yield p
    p.close()


@pytest.fixture(scope="session")
def tree_probes(stub_lib):
    """Follow-tree probes attached to the stub (only tracked process trees are recorded)."""
    from memrec.probes.cuda import CudaProbes

    p = CudaProbes(follow_tree=True).load()
    p.attach_library(stub_lib)
    yield p
    p.close()


def _build_torch_stub(folder: Path, with_probes: bool = True) -> Path:
    """A ``libc10_cuda.so`` in ``folder``: the stand-in with PyTorch's USDT probes
    (memrec/validation/stubdriver/c10_cuda_stub.S), or, without them, a plain library of the same name (a
    build without TORCH_SDT)."""
    from memrec.validation.stubdriver.build import StubBuildError
    from memrec.validation.stubdriver.build import build_torch_stub

    if with_probes:
        try:
            return build_torch_stub(folder)
        except StubBuildError as exc:
            pytest.skip(str(exc))
    out = folder / "libc10_cuda.so"
    src = folder / "plain.c"
    src.write_text("int stub_torch_nothing(void) { return 0; }\n")
    proc = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot build a plain libc10_cuda.so: {proc.stderr.strip()[:300]}")
    return out


@pytest.fixture(scope="session")
def torch_stub(bpf_host, tmp_path_factory) -> Path:
    """The stub libc10_cuda.so with PyTorch's allocator probes (its own inode per session)."""
    return _build_torch_stub(tmp_path_factory.mktemp("torch"))


@pytest.fixture(scope="session")
def plain_torch_stub(bpf_host, tmp_path_factory) -> Path:
    """A libc10_cuda.so without USDT probes (a PyTorch build without TORCH_SDT)."""
    return _build_torch_stub(tmp_path_factory.mktemp("torchplain"), with_probes=False)
