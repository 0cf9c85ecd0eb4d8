"""Bound the trace folder: keep the newest N trace files the daemon wrote, delete older ones.

A service that records for months must not fill ``/var/lib/memrec``. ``--rotate-size`` bounds
each file; ``--keep N`` bounds their number, so the folder holds at most about N × rotate-size
bytes of the daemon's traces.

Only files the daemon wrote are ever deleted, and only they hold a slot (issue 23): an operator's
own ``memrec-*.mrec`` copy, a planted file with a 2030 mtime, a link or a folder are never
touched. The daemon keeps a *ledger* in the folder, ``.memrec-written``: a line for each trace
file it created (name, device, inode), in the order they were created, across restarts, and one
more with its size when it closed. A file is a candidate only when it is still the very file the
ledger names (same name, device, inode and, once closed, size: an inode number freed by a deleted
file may be reused by a copy); age is the ledger's order, never a modification time a user can set. The ledger is
trusted only when it is a regular file owned by the daemon's user and writable by nobody else;
otherwise it is set aside (renamed, said in the log) and a new one started.

Everything goes through a descriptor of the folder opened with O_NOFOLLOW (``unlink(name,
dir_fd=...)``), so a path swapped under the daemon is not followed. A symbolic link given as the
folder is resolved once at start (:func:`memrec.daemon.tracefiles.resolve_folder`).
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from memrec.base.files import append_in
from memrec.base.files import create_in
from memrec.base.files import open_folder

log = logging.getLogger(__name__)

#: The ledger's name in the trace folder.
LEDGER = ".memrec-written"
#: The most bytes of a ledger read (about 10,000 entries): older entries beyond are forgotten.
MAX_LEDGER_BYTES = 1 << 20


def _trusted(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


Entry = tuple[str, int, int, int | None]  # name, device, inode, size once closed


def _read_ledger(dir_fd: int) -> list[Entry]:
    """The ledger's entries, oldest first, the last line of a name winning ([] when there is none;
    an untrusted one is set aside)."""
    try:
        fd = os.open(LEDGER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return []
    except OSError as error:  # a link (ELOOP) or worse: set aside
        _set_aside(dir_fd, error.strerror or str(error))
        return []
    try:
        st = os.fstat(fd)
        if not _trusted(st):
            _set_aside(dir_fd, f"owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}")
            return []
        size = st.st_size
        if size > MAX_LEDGER_BYTES:
            os.lseek(fd, size - MAX_LEDGER_BYTES, os.SEEK_SET)
        data = os.read(fd, MAX_LEDGER_BYTES)
    finally:
        os.close(fd)
    entries: dict[str, Entry] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        parts = line.split("\t")
        if len(parts) == 4 and all(p.isdigit() for p in parts[1:3]) and "/" not in parts[0] and (
                parts[3] == "-" or parts[3].isdigit()):
            name = parts[0]
            entries.setdefault(name, (name, int(parts[1]), int(parts[2]), None))  # its place: when created
            entries[name] = (name, int(parts[1]), int(parts[2]), None if parts[3] == "-" else int(parts[3]))
    return list(entries.values())


def _set_aside(dir_fd: int, why: str) -> None:
    aside = f"{LEDGER}.untrusted-{secrets.token_hex(4)}"
    try:
        os.rename(LEDGER, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        pass
    log.warning("trace folder ledger %s is not the daemon's (%s): set aside as %s; only files written from now "
                "on are pruned", LEDGER, why, aside)


def record(folder: Path, path: Path, closed: bool = False) -> None:
    """Note in ``folder``'s ledger a trace file the daemon just created there, or (``closed``) its
    size now that it is complete (appended; the ledger is created at the first file)."""
    try:
        dir_fd = open_folder(folder)
    except OSError as error:
        log.warning("cannot open %s to note %s in its ledger: %s", folder, path.name, error.strerror or error)
        return
    try:
        st = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
        line = f"{path.name}\t{st.st_dev}\t{st.st_ino}\t{st.st_size if closed else '-'}\n".encode()
        _read_ledger(dir_fd)  # sets an untrusted ledger aside before appending
        fd = append_in(dir_fd, LEDGER, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as error:
        log.warning("cannot note %s in the ledger of %s: %s (it will not be pruned)", path.name, folder,
                    error.strerror or error)
    finally:
        os.close(dir_fd)


def prune(directory: Path, keep: int, current: Path | None = None) -> list[str]:
    """Delete all but the ``keep`` newest trace files of the ledger in ``directory`` (the file
    being written, ``current``, is one of the kept); return the names deleted."""
    if keep < 1:
        return []
    try:
        dir_fd = open_folder(directory)
    except OSError as error:
        log.warning("cannot open %s to prune old traces: %s", directory, error.strerror or error)
        return []
    deleted: list[str] = []
    try:
        entries = _read_ledger(dir_fd)
        live = []  # ledger entries that are still the file the daemon wrote, oldest first
        for name, dev, ino, size in entries:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (dev, ino) and size in (None, st.st_size):
                live.append((name, dev, ino, size))
        others = [e for e in live if current is None or e[0] != current.name]
        doomed = others[: max(0, len(others) - (keep - (current is not None)))]
        for name, *_ in doomed:
            try:
                os.unlink(name, dir_fd=dir_fd)
                deleted.append(name)
            except OSError as error:
                log.warning("cannot delete old trace %s: %s", name, error.strerror or error)
        if len(live) - len(deleted) != len(entries):
            _rewrite(dir_fd, [e for e in live if e[0] not in deleted])
    finally:
        os.close(dir_fd)
    if deleted:
        log.info("deleted %d old trace file(s) (--keep %d): %s", len(deleted), keep, ", ".join(deleted))
    return deleted


def _rewrite(dir_fd: int, entries: list[Entry]) -> None:
    """Replace the ledger with ``entries`` (a new file renamed over it: never half written)."""
    tmp = f"{LEDGER}.new-{secrets.token_hex(4)}"
    try:
        fd, _ = create_in(dir_fd, tmp, 0o600)
        try:
            os.write(fd, "".join(f"{n}\t{d}\t{i}\t{'-' if z is None else z}\n" for n, d, i, z in entries).encode())
        finally:
            os.close(fd)
        os.rename(tmp, LEDGER, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as error:
        log.warning("cannot rewrite the trace folder ledger: %s", error.strerror or error)
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
