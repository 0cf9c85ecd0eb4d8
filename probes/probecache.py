"""A cache of the compiled probe program, so that a start on a known kernel skips the compile.

Why this is careful: root writes it and root loads what it reads into the kernel, so the
directory must be one no other user can change. :func:`cache_dir_problem` refuses a directory
(or a parent) that is a symlink, not owned by root, or writable by group or others (a root-owned
sticky parent such as /tmp is allowed: others cannot replace what root puts in it). Files are
written to a temporary name with O_NOFOLLOW, fsynced and renamed; read with a size bound and a
checksum. A file that fails any check is ignored with a warning: the program is compiled and the
file rewritten.

The key is the sha256 of everything the compiled program depends on: the source, the ``-D``
flags, the kernel (``uname -r``, ``uname -v``), bcc's version, memrec's version and this file
format's version.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import re
import stat
from pathlib import Path

import msgpack

from memrec.base.errors import ProbeError
from memrec.base.files import create_in
from memrec.base.files import open_folder
from memrec.probes.loader import LoadedProgram
from memrec.probes.loader import Program
from memrec.probes.loader import compile_program

log = logging.getLogger(__name__)

#: Where the daemon keeps compiled programs unless told otherwise (``--probe-cache``).
DEFAULT_DIR = "/var/cache/memrec/probes"
#: The loader's cache format: bump when :class:`Program` or the file layout changes.
FORMAT = 1
MAGIC = b"MRPROBE1"
#: A compiled program is ~0.5 MiB; a file larger than this is not one.
MAX_BYTES = 16 << 20


class CacheError(Exception):
    """A cache file that cannot be used (the message says why, in one line)."""


def bcc_version() -> str:
    """bcc's version, read from its version.py without importing bcc (a warm start never does)."""
    spec = importlib.util.find_spec("bcc")
    if spec is None or not spec.submodule_search_locations:
        return "none"
    for where in spec.submodule_search_locations:
        with contextlib.suppress(OSError):
            m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", Path(where, "version.py").read_text())
            if m:
                return m.group(1)
    return "unknown"


def cache_key(source: str, cflags: list[str]) -> str:
    """The hex sha256 naming the compiled program for this source, flags, kernel and tools."""
    from memrec.base.version import __version__

    uname = os.uname()
    parts = [f"format {FORMAT}", source, "\0".join(cflags), uname.release, uname.version, uname.machine,
             bcc_version(), __version__]
    return hashlib.sha256("\n\x1e".join(parts).encode()).hexdigest()


def cache_dir_problem(path: str) -> str | None:
    """Why root must not use ``path`` as the cache directory, or None (it need not exist yet).

    Every existing component from / down must be a real directory (no symlink), owned by root,
    and not group- or world-writable, except a root-owned parent with the sticky bit (/tmp).
    """
    path = os.path.abspath(path)
    parts = Path(path).parts
    for i in range(1, len(parts) + 1):
        here = os.path.join(*parts[:i])
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"{here}: {exc.strerror}"
        if stat.S_ISLNK(st.st_mode):
            return f"{here} is a symlink"
        if not stat.S_ISDIR(st.st_mode):
            return f"{here} is not a directory"
        if st.st_uid != 0:
            return f"{here} is not owned by root"
        last = i == len(parts)
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and (last or not st.st_mode & stat.S_ISVTX):
            return f"{here} is writable by group or others"
    return None


def encode(key: str, program: Program) -> bytes:
    """The file's bytes: magic, sha256 of the payload, msgpack payload (with the key inside)."""
    payload = msgpack.packb({"key": key, "program": program.as_dict()}, use_bin_type=True)
    return MAGIC + hashlib.sha256(payload).digest() + payload


def decode(key: str, data: bytes) -> Program:
    """Inverse of :func:`encode`; raises :class:`CacheError` saying what is wrong."""
    if len(data) > MAX_BYTES:
        raise CacheError(f"larger than {MAX_BYTES} bytes")
    head = len(MAGIC) + 32
    if len(data) < head or not data.startswith(MAGIC):
        raise CacheError("not a memrec probe cache file (or truncated)")
    payload = data[head:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC):head]:
        raise CacheError("checksum mismatch (truncated or corrupt)")
    try:
        d = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if d["key"] != key:
            raise CacheError("written for another key")
        return Program.from_dict(d["program"])
    except CacheError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed content is one kind of failure
        raise CacheError(f"malformed content ({type(exc).__name__})") from exc


class ProbeCache:
    """One cache directory (or none: ``directory=None`` reads nothing and writes nothing).

    Args:
        directory: where the files live; refused (with ``problem`` set) when unsafe.
    """

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self.problem = cache_dir_problem(directory) if directory else None

    @property
    def usable(self) -> bool:
        return bool(self.directory) and self.problem is None

    def path(self, key: str) -> str:
        return os.path.join(self.directory or "", f"{key}.mrprobe")

    def read(self, key: str) -> Program | None:
        """The cached program for ``key``; None when there is none.

        Raises:
            CacheError: a file is there but cannot be used (unreadable, corrupt, too large).
        """
        if not self.usable:
            return None
        try:
            fd = os.open(self.path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CacheError(f"cannot open {self.path(key)}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
                raise CacheError(f"{self.path(key)} is not a regular file owned by root")
            data = os.read(fd, MAX_BYTES + 1)
        except OSError as exc:
            raise CacheError(f"cannot read {self.path(key)}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        try:
            return decode(key, data)
        except CacheError as exc:
            raise CacheError(f"{self.path(key)}: {exc}") from exc

    def write(self, key: str, program: Program) -> None:
        """Store ``program`` under ``key`` (temp file, fsync, rename). Raises OSError."""
        if not self.usable:
            return
        dir_fd = open_folder(self.directory, parents=True, mode=0o700)  # the missing folders: root's only
        try:
            problem = cache_dir_problem(self.directory)  # again: it may have been created just now
            if problem:
                raise OSError(f"not writing the probe cache: {problem}")
            data = encode(key, program)
            name = os.path.basename(self.path(key))
            tmp = f"{name}.{os.getpid()}.tmp"
            fd, _ = create_in(dir_fd, tmp, 0o600)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:  # a failed write or rename leaves no temporary file behind
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

def _cached(cache: ProbeCache, key: str) -> LoadedProgram | None:
    """The cached program for ``key`` loaded into the kernel, or None (with a warning if one was
    there but unusable: unreadable, corrupt, or refused by this kernel's verifier)."""
    try:
        program = cache.read(key)
        return None if program is None else LoadedProgram(program)
    except (CacheError, ProbeError) as exc:
        log.warning("not using the cached probe program (%s): compiling it", exc)
        return None


def obtain_program(source: str, cflags: list[str], directory: str | None) -> tuple[LoadedProgram, str]:
    """The probe program loaded into the kernel, and whether it came from the "cache" or was "compiled".

    Compiled programs are stored in ``directory`` (None: no cache). Whatever is wrong with the
    cache costs one warning and a compile, never the start.

    Raises:
        ProbeError: the program cannot be compiled, or the kernel refuses the fresh compile.
    """
    cache = ProbeCache(directory)
    if cache.problem:
        log.warning("not using the probe cache: %s (compiling the probe program)", cache.problem)
    key = cache_key(source, cflags)
    loaded = _cached(cache, key)
    if loaded is not None:
        return loaded, "cache"
    program = compile_program(source, cflags)
    loaded = LoadedProgram(program)
    try:
        cache.write(key, program)
    except OSError as exc:
        log.warning("cannot write the probe cache: %s", exc)
    return loaded, "compiled"
