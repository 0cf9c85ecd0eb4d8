"""Creating output files safely, even as root in a folder another user can write to.

``open(path, "w")`` follows a symbolic link at ``path`` and truncates whatever it points to: a
user who plants ``/tmp/x/out.mrec -> /etc/shadow`` makes a root recorder overwrite it. Every file
memrec writes is created by :func:`create_new`: ``O_CREAT | O_EXCL | O_NOFOLLOW``, so the kernel
refuses to follow a link or to reuse an existing file, atomically. Replacing an existing trace is a
separate, explicit step: the old *regular* file is unlinked (a link is never followed, and an
existing link or non-file is refused), then the new one is created exclusively; if somebody
slips a file or link in between, creation fails instead of writing through it.
"""

from __future__ import annotations

import errno
import os
import stat

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def refuse_unsafe(path: str | os.PathLike[str]) -> os.stat_result | None:
    """The ``lstat`` of an existing ``path`` that may be replaced, None when nothing is there.

    Raises:
        OSError: ``path`` is a symbolic link (ELOOP) or not a regular file (EEXIST), with a
            one-line ``strerror`` that says so.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "it is a symbolic link; memrec never writes through one", os.fspath(path))
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EEXIST, "it exists and is not a regular file", os.fspath(path))
    return st


def create_new(path: str | os.PathLike[str], mode: int = 0o666, *, replace: bool = False) -> tuple[int, bool]:
    """Create ``path`` for writing and return ``(fd, replaced)``; never follows a symbolic link.

    Args:
        path: the file to create.
        mode: permission bits (the umask applies).
        replace: an existing regular file is replaced (unlinked, then created anew); without it,
            an existing file is an error (FileExistsError).

    Raises:
        FileExistsError: ``path`` exists and ``replace`` is false, or it reappeared while being
            replaced.
        OSError: ``path`` is a symbolic link or not a regular file (see :func:`refuse_unsafe`),
            or the file cannot be created (ENOENT for a missing folder, EACCES...).
    """
    try:
        return os.open(path, _FLAGS, mode), False
    except FileExistsError:
        if not replace:
            raise
    except OSError as error:
        if error.errno == errno.ELOOP:  # O_NOFOLLOW met a link (only when O_EXCL did not say EEXIST)
            refuse_unsafe(path)
        raise
    refuse_unsafe(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, _FLAGS, mode), True


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_folder(path: str | os.PathLike[str], *names: str, mode: int = 0o755) -> int:
    """A descriptor of ``path``/``names[0]``/``names[1]``/..., creating the missing folders; never
    through a symbolic link at ``path`` itself or at any of ``names``.

    A tree of folders written by root (the daemon's dataset) may sit where a user can write: each
    level is made with ``mkdir(name, dir_fd=...)`` and opened with ``O_NOFOLLOW``, so a link
    planted at any level is refused (ELOOP or ENOTDIR) instead of followed. ``path`` is made with
    its parents when missing (its parents are the caller's choice).
    """
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(path, mode, exist_ok=True)
    fd = os.open(path, _DIR_FLAGS)
    try:
        for name in names:
            try:
                os.mkdir(name, mode, dir_fd=fd)
            except FileExistsError:
                pass
            sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_new_in(dir_fd: int, name: str, mode: int = 0o644) -> int:
    """Create ``name`` in the folder ``dir_fd`` for writing (``O_EXCL | O_NOFOLLOW``); its fd.

    Raises:
        FileExistsError: something (a file, a link) is already there.
    """
    return os.open(name, _FLAGS, mode, dir_fd=dir_fd)
