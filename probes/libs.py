"""Find every libcuda file the host's processes use (or could use), one per (dev, inode).

Why per inode: uprobes live on an inode, not on a path. A host with containers may map several
different driver files (or the same file under different paths), and a process in another mount
namespace names a path that means nothing in ours. So: read ``/proc/*/maps``, keep each distinct
(dev, inode) whose file name starts with ``libcuda.so``, and give each a path that reaches that
very file from here: the plain path when it is the same file, else ``/proc/PID/root/<path>``,
else ``/proc/PID/map_files/<range>`` (also works when the file was deleted, e.g. replaced by a
driver upgrade). Then add the usual install paths, ``ldconfig -p`` and the caller's paths, so
probes are in place before the first CUDA process starts.

Only files that could be the real driver are returned (:func:`untrusted_reason`): root attaches
probes to what this finds, so a file any user can make (a ``libcuda.so`` in a home folder,
mapped by a user's process) must not count: it must be owned by root and writable by nobody else.
The probes themselves then refuse a file that does not export the driver's API.

Parsing is kept apart from /proc I/O so it can be tested without either.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Iterable
from collections.abc import Iterator
from dataclasses import dataclass

from memrec.base.untrusted import clean_text

log = logging.getLogger(__name__)

LIBCUDA_PREFIX = "libcuda.so"
#: PyTorch's CUDA allocator library, whose USDT probes give tensor blocks (any PyTorch install).
LIBC10_CUDA_PREFIX = "libc10_cuda.so"
USUAL_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib/wsl/lib/libcuda.so.1",
)
_DELETED = " (deleted)"
#: (dev, inode) of files refused already (each is said once per process, not at every rescan).
_REFUSED: set[tuple[int, int]] = set()


@dataclass(frozen=True)
class LibraryFile:
    """A library file to attach to: a path reachable from here and the inode it names."""

    path: str
    dev: int
    inode: int


@dataclass(frozen=True)
class MapsEntry:
    """One file-backed line of ``/proc/PID/maps``."""

    start: int
    end: int
    perms: str
    offset: int
    dev: int  # as os.stat().st_dev would give it
    inode: int
    path: str
    deleted: bool

    @property
    def range(self) -> str:
        """The name of this mapping in ``/proc/PID/map_files``."""
        return f"{self.start:x}-{self.end:x}"


# ---- pure parsing ---------------------------------------------------------------------------------


def parse_maps_line(line: str) -> MapsEntry | None:
    """Parse one maps line; None for anonymous or pseudo mappings (``[heap]``, ``[vdso]``...)."""
    parts = line.rstrip("\n").split(maxsplit=5)
    if len(parts) < 6:
        return None
    addr, perms, offset, dev, inode, path = parts
    if not path.startswith("/"):
        return None
    try:
        start_s, end_s = addr.split("-")
        major_s, minor_s = dev.split(":")
        ino = int(inode)
        entry = MapsEntry(
            start=int(start_s, 16),
            end=int(end_s, 16),
            perms=perms,
            offset=int(offset, 16),
            dev=os.makedev(int(major_s, 16), int(minor_s, 16)),
            inode=ino,
            path=path[: -len(_DELETED)] if path.endswith(_DELETED) else path,
            deleted=path.endswith(_DELETED),
        )
    except ValueError:
        return None
    return entry if ino != 0 else None


def parse_maps(text: str) -> list[MapsEntry]:
    """Parse a whole maps file, skipping what is not a file mapping."""
    return [e for e in map(parse_maps_line, text.splitlines()) if e is not None]


def is_libcuda(path: str) -> bool:
    """Whether a path names a CUDA driver library (``libcuda.so``, ``.so.1``, ``.so.580.x``)."""
    return os.path.basename(path).startswith(LIBCUDA_PREFIX)


def parse_ldconfig(text: str) -> list[str]:
    """Paths of libcuda in ``ldconfig -p`` output, in its order."""
    paths = []
    for line in text.splitlines():
        name, sep, path = line.strip().partition(" => ")
        if sep and is_libcuda(name.split(" ", 1)[0]) and path.startswith("/"):
            paths.append(path.strip())
    return paths


def libcuda_mappings(text: str, prefix: str = LIBCUDA_PREFIX) -> dict[tuple[int, int], MapsEntry]:
    """The distinct files whose name starts with ``prefix`` (libcuda by default) in one maps file,
    keyed by (dev, inode) (first mapping each)."""
    found: dict[tuple[int, int], MapsEntry] = {}
    if prefix not in text:  # most processes: skip parsing
        return found
    for entry in parse_maps(text):
        if os.path.basename(entry.path).startswith(prefix):
            found.setdefault((entry.dev, entry.inode), entry)
    return found


# ---- /proc I/O ----------------------------------------------------------------------------------


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _reachable_path(proc_root: str, pid: str, entry: MapsEntry) -> str | None:
    """A path from our mount namespace to the file a process mapped, or None."""
    key = (entry.dev, entry.inode)
    if not entry.deleted and _identity(entry.path) == key:
        return entry.path
    candidates = []
    if not entry.deleted:
        # The process's own view of its path (another mount namespace: a container). On overlayfs
        # stat() shows the overlay inode while maps shows the real one, so don't insist on a match.
        candidates.append(os.path.join(proc_root, pid, "root", entry.path.lstrip("/")))
    candidates.append(os.path.join(proc_root, pid, "map_files", entry.range))
    for path in candidates:
        if os.path.exists(path) and os.access(path, os.R_OK):
            return path
    return None


def _pids(proc_root: str) -> Iterator[str]:
    try:
        names = os.listdir(proc_root)
    except OSError as exc:
        log.warning("cannot list %s: %s", proc_root, exc)
        return
    yield from (n for n in names if n.isdigit())


def scan_processes(proc_root: str = "/proc", prefix: str = LIBCUDA_PREFIX) -> list[LibraryFile]:
    """Every distinct (dev, inode) of a file named ``prefix``* (libcuda by default) mapped by a
    process now, with a reachable path."""
    found: dict[tuple[int, int], LibraryFile] = {}
    unreachable: set[tuple[int, int]] = set()
    for pid in _pids(proc_root):
        try:
            with open(os.path.join(proc_root, pid, "maps")) as f:
                text = f.read()
        except OSError:
            continue  # gone, or a kernel thread we may not read: nothing to attach anyway
        for key, entry in libcuda_mappings(text, prefix).items():
            if key in found:
                continue
            path = _reachable_path(proc_root, pid, entry)
            if path is None:
                unreachable.add(key)
                continue
            found[key] = LibraryFile(path=path, dev=key[0], inode=key[1])
    for key in unreachable - found.keys():
        log.warning("a %s file (dev %d:%d inode %d) is mapped but not reachable from here",
                    prefix, os.major(key[0]), os.minor(key[0]), key[1])
    return list(found.values())


def ldconfig_paths() -> list[str]:
    """libcuda paths the dynamic linker cache knows (empty when ldconfig is missing or fails)."""
    ldconfig = shutil.which("ldconfig") or next((p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    if ldconfig is None:
        return []
    try:
        proc = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("ldconfig -p failed: %s", exc)
        return []
    return parse_ldconfig(proc.stdout)


def files_at(paths: Iterable[str]) -> list[LibraryFile]:
    """One LibraryFile per distinct existing file among ``paths`` (symlinks followed)."""
    out: dict[tuple[int, int], LibraryFile] = {}
    for path in paths:
        key = _identity(path)
        if key is not None and os.path.isfile(path):
            out.setdefault(key, LibraryFile(path=path, dev=key[0], inode=key[1]))
    return list(out.values())


def untrusted_reason(path: str, root_only: bool = True) -> str | None:
    """Why the file at ``path`` cannot be the host's driver, or None when it can.

    The driver is installed by root: a file owned by another user, or writable by group or
    others, is somebody's copy, and root does not attach probes to it. ``root_only=False`` (a
    ``libc10_cuda.so``: PyTorch is installed by any user, pip into a virtualenv) leaves the owner
    unchecked: a probe on a file fires only in the processes that map that file; a file that
    others than its owner may write is still refused (somebody could change it under the probes).
    """
    try:
        st = os.stat(path)
    except OSError as error:
        return f"cannot stat it ({error.strerror or error})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if root_only and st.st_uid != 0:
        return f"owned by uid {st.st_uid}, not root"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def trusted(libs: Iterable[LibraryFile], root_only: bool = True) -> list[LibraryFile]:
    """The files that may be probed (:func:`untrusted_reason`); each refused one is logged once."""
    out = []
    for lib in libs:
        reason = untrusted_reason(lib.path, root_only)
        if reason is None:
            out.append(lib)
        elif (lib.dev, lib.inode) not in _REFUSED:
            _REFUSED.add((lib.dev, lib.inode))
            log.warning("not probing %s: %s%s", clean_text(lib.path, 300), reason,
                        " (only root's driver files are probed)" if root_only else "")
    return out


def find_libcuda(
    extra_paths: Iterable[str] = (),
    *,
    proc_root: str = "/proc",
    usual_paths: Iterable[str] = USUAL_PATHS,
    use_ldconfig: bool = True,
) -> list[LibraryFile]:
    """Every distinct libcuda file to attach to: mapped ones first, then installed ones.

    Args:
        extra_paths: more files to consider (e.g. ``--lib`` on the command line, the stub driver).
        proc_root, usual_paths, use_ldconfig: where to look (tests point them elsewhere).

    Returns:
        One :class:`LibraryFile` per (dev, inode); a file both mapped and installed appears once,
        with the identity ``/proc/PID/maps`` gives it. Files :func:`untrusted_reason` refuses are
        left out (and logged once).
    """
    result: dict[tuple[int, int], LibraryFile] = {}
    for lib in scan_processes(proc_root):
        result.setdefault((lib.dev, lib.inode), lib)
    installed = list(usual_paths) + (ldconfig_paths() if use_ldconfig else []) + list(extra_paths)
    for lib in files_at(installed):
        result.setdefault((lib.dev, lib.inode), lib)
    return trusted(result.values())


def find_libc10_cuda(extra_paths: Iterable[str] = (), *, proc_root: str = "/proc") -> list[LibraryFile]:
    """Every distinct ``libc10_cuda.so`` that a process maps now, plus ``extra_paths``.

    PyTorch lives wherever pip put it, so there are no usual install paths to add: a process
    that imports torch later is found by the daemon's next rescan. Files
    :func:`untrusted_reason` refuses (owner not checked) are left out, and logged once.
    """
    result: dict[tuple[int, int], LibraryFile] = {}
    for lib in scan_processes(proc_root, LIBC10_CUDA_PREFIX):
        result.setdefault((lib.dev, lib.inode), lib)
    for lib in files_at(extra_paths):
        result.setdefault((lib.dev, lib.inode), lib)
    return trusted(result.values(), root_only=False)
