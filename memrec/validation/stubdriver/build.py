"""Build the stub CUDA driver (``libcuda.so.1``) from the C source packaged next to this module.

Why a build step at all: the stub must be a real ELF shared object so that uprobes attach to it
exactly as they attach to NVIDIA's ``libcuda.so.1``. It is compiled on first use with the
system's C compiler and cached by the hash of its source and flags, so every test session and
the no-GPU demo reuse one inode (uprobes are per inode) until the source changes.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.base.files import create_file

log = logging.getLogger(__name__)

SOURCE_NAME = "cuda_stub.c"
LIBRARY_NAME = "libcuda.so.1"
#: Flags that give a shared object shaped like the driver: soname libcuda.so.1, symbols exported.
CFLAGS = ("-O1", "-g", "-fPIC", "-shared", "-Wall", "-Wl,-soname,libcuda.so.1")
LDLIBS = ("-lpthread",)


class StubBuildError(MemrecCommandError):
    """The stub driver could not be built (no compiler, or the compiler failed)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args, exit_code=ExitCode.UNAVAILABLE)


def stub_source() -> bytes:
    """Return the packaged C source of the stub driver."""
    return importlib.resources.files("memrec.validation.stubdriver").joinpath(SOURCE_NAME).read_bytes()


def source_hash(source: bytes | None = None) -> str:
    """Return the cache key of a build: a hash of the source and the compiler flags."""
    digest = hashlib.sha256(source if source is not None else stub_source())
    digest.update("\0".join(CFLAGS + LDLIBS).encode())
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    """Pick where cached builds live: the system cache as root, else the user's cache.

    Falls back to a per-user temp directory when neither is writable (read-only home, CI).
    """
    candidates: list[Path] = []
    if os.geteuid() == 0:
        candidates.append(Path("/var/cache/memrec/stub"))
    xdg = os.environ.get("XDG_CACHE_HOME")
    candidates.append(Path(xdg) / "memrec" / "stub" if xdg else Path.home() / ".cache" / "memrec" / "stub")
    for candidate in candidates:
        try:
            candidate.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.debug("cache dir %s not usable: %s", candidate, exc)
            continue
        if os.access(candidate, os.W_OK):
            return candidate
    fallback = Path(tempfile.gettempdir()) / f"memrec-stub-{os.geteuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def find_compiler() -> str:
    """Return the C compiler to use ($CC, then cc, gcc, clang).

    Raises:
        StubBuildError: when none is installed.
    """
    names = [os.environ["CC"]] if os.environ.get("CC") else []
    names += ["cc", "gcc", "clang"]
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise StubBuildError(
        "cannot build the stub CUDA driver: no C compiler found (tried "
        + ", ".join(names)
        + "); install one, e.g. `apt-get install gcc`, or set CC"
    )


def build_stub(dest_dir: str | os.PathLike[str] | None = None) -> Path:
    """Compile the stub driver if needed and return the path of its ``libcuda.so.1``.

    Args:
        dest_dir: put the library at ``dest_dir/libcuda.so.1`` (rebuilt when the source changes).
            By default it goes to ``<cache>/<source hash>/libcuda.so.1``, so a changed source never
            replaces a file other processes may have mapped or probes may be attached to.

    Raises:
        StubBuildError: no C compiler, or the compilation failed (the message has its stderr).
    """
    source = stub_source()
    key = source_hash(source)
    if dest_dir is not None:
        out_dir = Path(dest_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
    else:
        out_dir = default_cache_dir() / key
    target = out_dir / LIBRARY_NAME
    stamp = out_dir / f".{LIBRARY_NAME}.sha"
    if target.is_file() and _read(stamp) == key:
        return target

    compiler = find_compiler()
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build into private temp names and rename into place: concurrent builders (parallel test
    # sessions) never see a half-written library.
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        src_path = Path(tmp) / SOURCE_NAME
        with create_file(src_path) as out:  # (in a private folder of its own)
            out.write(source)
        tmp_lib = Path(tmp) / LIBRARY_NAME
        cmd = [compiler, *CFLAGS, "-o", str(tmp_lib), str(src_path), *LDLIBS]
        log.debug("building stub driver: %s", " ".join(cmd))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StubBuildError(f"cannot build the stub CUDA driver with {compiler}: {exc}") from exc
        if proc.returncode != 0:
            raise StubBuildError(
                f"building the stub CUDA driver failed ({compiler} exit {proc.returncode}):\n{proc.stderr.strip()}"
            )
        os.replace(tmp_lib, target)
        tmp_stamp = Path(tmp) / "stamp"
        with create_file(tmp_stamp) as out:
            out.write(key.encode())
        os.replace(tmp_stamp, stamp)
    log.info("built stub CUDA driver %s", target)
    return target


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


#: The stand-in for PyTorch's libc10_cuda.so: USDT probes pytorch:malloc/free with PyTorch 2.11's
#: argument forms behind semaphores (the tests and bench/bench_tensor_probes.py probe it).
TORCH_SOURCE_NAME = "c10_cuda_stub.S"
TORCH_LIBRARY_NAME = "libc10_cuda.so"


def build_torch_stub(dest_dir: str | os.PathLike[str], nop5: bool = False) -> Path:
    """Assemble the stub ``libc10_cuda.so`` into ``dest_dir`` and return its path.

    Args:
        nop5: probe sites of 5-byte nops (what a kernel from 6.18 can optimize) instead of the
            1-byte nops PyTorch's build has.

    Raises:
        StubBuildError: no C compiler, or the assembly failed.
    """
    compiler = find_compiler()
    out = Path(dest_dir) / TORCH_LIBRARY_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        src = Path(tmp) / TORCH_SOURCE_NAME
        with create_file(src) as f:  # (in a private folder of its own)
            f.write(importlib.resources.files("memrec.validation.stubdriver").joinpath(TORCH_SOURCE_NAME).read_bytes())
        tmp_lib = Path(tmp) / TORCH_LIBRARY_NAME
        cmd = [compiler, "-shared", "-fPIC", *(["-DNOP5"] if nop5 else []), "-o", str(tmp_lib), str(src)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StubBuildError(f"cannot build the stub libc10_cuda.so with {compiler}: {exc}") from exc
        if proc.returncode != 0:
            raise StubBuildError(f"building the stub libc10_cuda.so failed ({compiler} exit {proc.returncode}):\n"
                                 f"{proc.stderr.strip()}")
        os.replace(tmp_lib, out)
    return out
