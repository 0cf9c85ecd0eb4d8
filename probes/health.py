"""Host checks that need bcc or NVML, for ``memrec doctor`` (only probes/ may import them)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

_TRIVIAL_PROGRAM = "int memrec_doctor(void *ctx) { return 0; }"


@dataclass(frozen=True)
class Check:
    """One doctor line: what was checked, whether it passed, and what to do if not."""

    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    fix: str = ""


def check_bcc() -> Check:
    """Import bcc and compile and load a trivial program: proves bcc, clang, headers and bpf()."""
    try:
        import bcc
    except ImportError as error:
        from memrec.probes.loader import bcc_missing_hint

        return Check("bcc", "fail", f"cannot import bcc ({error})", bcc_missing_hint())
    version = getattr(bcc, "__version__", "?")
    said: list[str] = []
    try:
        with _bcc_output(said):
            program = bcc.BPF(text=_TRIVIAL_PROGRAM.encode())
            program.load_func(b"memrec_doctor", bcc.BPF.KPROBE)
            program.cleanup()
    except Exception as error:  # bcc raises bare Exception for compile and load failures
        why = f" (bcc said: {'; '.join(said[:_SAID_LINES])}{'; …' if len(said) > _SAID_LINES else ''})" if said else ""
        return Check(
            "bcc",
            "fail",
            f"bcc {version} imports but cannot compile or load a BPF program: {error}{why}",
            "see privileges and kernel headers above, and check that the kernel has CONFIG_BPF_SYSCALL",
        )
    return Check("bcc", "ok", f"bcc {version} compiled and loaded a BPF program")


#: How many lines of bcc's own output a failed check quotes (clang can print hundreds).
_SAID_LINES = 3


@contextlib.contextmanager
def _bcc_output(said: list[str]) -> Iterator[None]:
    """Collect what libbcc, clang and the modprobe bcc runs write to file descriptors 1 and 2
    themselves, into ``said`` (its non-empty lines): left there, it lands before doctor's report,
    inside ``doctor --json``'s JSON on a host without kernel headers."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile() as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            libc.fflush(None)  # C stdio's buffers (std::cout writes through them) before the fds go back
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(0)
            said.extend(line.strip() for line in sink.read().decode(errors="replace").splitlines() if line.strip())


def check_nvml() -> Check:
    """Ask NVML for the GPUs through the sampler's choke point."""
    from memrec.probes import nvml

    try:
        gpus = nvml.list_gpus()
    except nvml.NvmlUnavailable as error:
        # A `pip install memrec` without the extra lacks the binding, not the driver.
        missing = importlib.util.find_spec("pynvml") is None
        from memrec.base.extras import install_command

        return Check(
            "nvml",
            "warn",
            f"NVML unavailable: {error}",
            (f"{install_command('nvml', ('nvidia-ml-py',))} (scripts/setup installs it)" if missing
             else "on a GPU host install the NVIDIA driver (libnvidia-ml.so.1)")
            + "; without it the daemon records without NVML samples",
        )
    if not gpus:
        return Check("nvml", "warn", "NVML works but reports no GPUs", "check nvidia-smi")
    names = ", ".join(f"{g.index}: {g.name}" for g in gpus)
    return Check("nvml", "ok", f"{len(gpus)} GPU(s): {names}")


def _refused(path: str) -> bool:
    """Whether this user is refused ``path`` itself or a folder on the way to it."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC))
    except PermissionError:
        return True
    except OSError:
        pass
    return False


def check_probe_cache(directory: str, ringbuf_pages: int) -> Check:
    """Whether the daemon's next start (default options) finds its compiled program in ``directory``."""
    from memrec.probes import probecache
    from memrec.probes.cuda import program_cflags
    from memrec.probes.cuda import program_source

    cache = probecache.ProbeCache(directory)
    key = probecache.cache_key(program_source(), program_cflags(False, ringbuf_pages))
    if os.geteuid() != 0 and _refused(cache.path(key)):  # root's to read: nothing wrong with it said
        return Check("probe cache", "warn", f"uid {os.geteuid()} may not read the probe cache in {directory} "
                     "(root's alone)", "run memrec doctor as root to check it")
    if cache.problem:
        return Check("probe cache", "warn", f"{directory} is not used: {cache.problem}",
                     "make it a directory only root can write, or start the daemon with --probe-cache DIR; "
                     "until then every start compiles the probes (a few seconds)")
    try:
        found = cache.read(key) is not None
    except probecache.CacheError as error:
        return Check("probe cache", "warn", f"unusable: {error}", "the daemon's next start compiles and rewrites it")
    if found:
        return Check("probe cache", "ok", f"a compiled probe program for this kernel ({os.uname().release}) is in "
                     f"{directory}: the daemon starts without compiling")
    return Check("probe cache", "ok", f"no compiled probe program for this kernel ({os.uname().release}) in {directory} "
                 "yet: the daemon's next start compiles it (a few seconds) and keeps it there")
