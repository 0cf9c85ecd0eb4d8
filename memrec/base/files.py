"""Creating output files safely, even as root in a folder another user can write to.

``open(path, "w")`` follows a symbolic link at ``path`` and truncates whatever it points to: a
user who plants ``/tmp/x/out.mrec -> /etc/shadow`` makes a root recorder overwrite it. Every file
memrec writes (traces, exports, pictures, merges) is created by :func:`create_new` (or
:func:`create_file`, its file object): ``O_CREAT | O_EXCL | O_NOFOLLOW``, so the kernel refuses to
follow a link or to reuse an existing file, atomically. Replacing an existing file is a separate,
explicit step: the old *regular* file is unlinked (a link is never followed, and an existing link
or non-file is refused), then the new one is created exclusively; if somebody slips a file or link
in between, creation fails instead of writing through it.

The folder is guarded too: a link planted *as the folder* (``-o /tmp/x/out/`` with ``out ->
/etc/cron.d``) would otherwise make root create a new file wherever the link points. The folder is
opened one component at a time (:func:`open_folder`), each relative to the one before and with
``O_NOFOLLOW``, and a symbolic link met on the way is followed only when it belongs to the caller
(its euid) or to root: the rule of the kernel's ``fs.protected_symlinks``, applied everywhere
rather than only in sticky folders. The file is then created relative to that folder's descriptor,
so swapping a component for a link after the check changes nothing. A test scans every module
for another way of writing a file (``tests/unit/test_outputs_guarded.py``).

One policy for every file and folder memrec writes, whoever runs it:

- the file itself is never a link: it is created ``O_EXCL | O_NOFOLLOW`` (:func:`create_new`,
  :func:`create_file`, :func:`create_in`); ``replace`` unlinks an existing *regular* file first
  and refuses a link or anything else there;
- every folder on the way is reached one component at a time (:func:`open_folder`, also when
  it makes the missing ones: ``create``, ``parents``, :func:`make_folder`). In the path the
  caller gave, a symbolic link is followed only when its owner is the caller or root, and
  refused (ELOOP) otherwise; the folders memrec names itself below it (the dataset's table,
  host and day folders: ``names``) are never links: a link there is refused, whoever owns it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import IO
from typing import Iterator

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Links followed while opening one folder, as the kernel's own limit (ELOOP past it).
_MAX_LINKS = 40


def _trusted_link_owner(uid: int) -> bool:
    """Whether a symbolic link owned by ``uid`` may steer where this process writes."""
    return uid in (0, os.geteuid())


def open_folder(path: str | os.PathLike[str], *names: str, create: bool = False, parents: bool = False,
                mode: int = 0o777) -> int:
    """A descriptor (``O_DIRECTORY``) of the folder ``path``/``names[0]``/``names[1]``/..., reached
    one component at a time by the one policy of the module docstring: in ``path`` a link is
    followed only when the caller or root owns it; ``names`` are never links. The caller closes it.

    Args:
        names: folders below ``path`` that memrec names itself (each one component).
        create: make each of ``names`` that is missing (``mkdir`` relative to the folder above,
            ``mode``, the umask applies).
        parents: make the missing components of ``path`` too.

    Raises:
        OSError: a component is missing (ENOENT) and not to be made, not a folder (ENOTDIR), a
            link owned by another user (ELOOP, with a one-line ``strerror`` that says so), or
            cannot be searched or made.
    """
    text = os.fspath(path) or "."
    for name in names:
        if not name or "/" in name or name in (".", ".."):
            raise OSError(errno.EINVAL, f"{name!r} is not one folder name", text)
    #: (name, whether to make it when missing, whether it is one of memrec's own: never a link)
    pending = [(part, parents, False) for part in text.split("/") if part not in ("", ".")]
    pending += [(name, create, True) for name in names]
    fd = os.open("/" if text.startswith("/") else ".", _DIR_FLAGS)
    links = 0
    try:
        while pending:
            name, make, own = pending.pop(0)
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not make:
                    raise OSError(errno.ENOENT, "No such file or directory", text) from None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, mode, dir_fd=fd)
                pending.insert(0, (name, False, own))  # open what is there now, by the same rule
                continue
            except OSError as error:
                if error.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(error.errno, error.strerror, text) from None
                st = os.lstat(name, dir_fd=fd)
                if not stat.S_ISLNK(st.st_mode):
                    raise OSError(errno.ENOTDIR, "a component of the path is not a folder", text) from None
                if own:
                    raise OSError(errno.ELOOP, f"{name!r} is a symbolic link; memrec never writes through one "
                                  "in a folder it names itself", text) from None
                if not _trusted_link_owner(st.st_uid):
                    raise OSError(errno.ELOOP, f"{name!r} is a symbolic link owned by uid {st.st_uid}, another user; "
                                  "memrec does not write through it", text) from None
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links", text) from None
                target = os.readlink(name, dir_fd=fd)
                pending[:0] = [(part, False, False) for part in target.split("/") if part not in ("", ".")]
                if target.startswith("/"):
                    nxt = os.open("/", _DIR_FLAGS)
                else:
                    continue
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def refuse_unsafe(path: str | os.PathLike[str], dir_fd: int | None = None) -> os.stat_result | None:
    """The ``lstat`` of an existing ``path`` that may be replaced, None when nothing is there.

    Raises:
        OSError: ``path`` is a symbolic link (ELOOP) or not a regular file (EEXIST), with a
            one-line ``strerror`` that says so.
    """
    try:
        st = os.lstat(path, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "it is a symbolic link; memrec never writes through one", os.fspath(path))
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EEXIST, "it exists and is not a regular file", os.fspath(path))
    return st


def create_new(path: str | os.PathLike[str], mode: int = 0o666, *, replace: bool = False) -> tuple[int, bool]:
    """Create ``path`` for writing and return ``(fd, replaced)``; never follows a symbolic link
    at ``path``, nor one on the way to it that another user owns.

    Args:
        path: the file to create.
        mode: permission bits (the umask applies).
        replace: an existing regular file is replaced (unlinked, then created anew); without it,
            an existing file is an error (FileExistsError).

    Raises:
        FileExistsError: ``path`` exists and ``replace`` is false, or it reappeared while being
            replaced.
        OSError: ``path`` is a symbolic link or not a regular file (see :func:`refuse_unsafe`),
            its folder cannot be reached safely (see :func:`open_folder`), or the file cannot be
            created (ENOENT for a missing folder, EACCES...).
    """
    text = os.fspath(path)
    folder, name = os.path.split(text)
    if not name:
        raise OSError(errno.EISDIR, "is a folder; give a file name", text)
    dir_fd = open_folder(folder)
    try:
        return create_in(dir_fd, name, mode, replace=replace, shown=text)
    finally:
        os.close(dir_fd)


def create_in(dir_fd: int, name: str, mode: int = 0o666, *, replace: bool = False,
              shown: str | None = None) -> tuple[int, bool]:
    """:func:`create_new` of ``name`` in the folder ``dir_fd`` (from :func:`open_folder`):
    ``(fd, replaced)``. ``shown``: the path errors name (default ``name``).

    Raises:
        FileExistsError: something (a file, a link) is there and ``replace`` is false.
        OSError: as :func:`create_new`.
    """
    text = name if shown is None else shown
    try:
        return os.open(name, _FLAGS, mode, dir_fd=dir_fd), False
    except FileExistsError:
        if not replace:
            raise FileExistsError(errno.EEXIST, "File exists", text) from None
    except OSError as error:
        if error.errno == errno.ELOOP:  # O_NOFOLLOW met a link (only when O_EXCL did not say EEXIST)
            refuse_unsafe(name, dir_fd)
        raise OSError(error.errno, error.strerror, text) from None
    try:
        refuse_unsafe(name, dir_fd)
    except OSError as error:
        raise OSError(error.errno, error.strerror, text) from None
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    try:
        return os.open(name, _FLAGS, mode, dir_fd=dir_fd), True
    except OSError as error:
        raise OSError(error.errno, error.strerror, text) from None


def append_in(dir_fd: int, name: str, mode: int = 0o666) -> int:
    """A descriptor that appends to the regular file ``name`` in ``dir_fd``, created exclusively
    when missing (a log, a ledger); never through a link (``O_NOFOLLOW``: ELOOP).

    Raises:
        OSError: ``name`` is a link (ELOOP) or not a regular file, or cannot be opened or created.
    """
    try:
        fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return create_in(dir_fd, name, mode)[0]
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device: O_NONBLOCK kept the open from hanging
        os.close(fd)
        raise OSError(errno.EEXIST, "it exists and is not a regular file", name)
    os.set_blocking(fd, True)
    return fd


def create_file(path: str | os.PathLike[str], *, text: bool = False, replace: bool = False) -> IO:
    """:func:`create_new` as an open file object (binary, or text with ``newline=""`` for csv):
    what an exporter, ``pickle.dump``, pyarrow or matplotlib's ``savefig`` writes into."""
    fd, _ = create_new(path, replace=replace)
    try:
        return os.fdopen(fd, "w", encoding="utf-8", newline="") if text else os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def create_output(path: str | os.PathLike[str], *, text: bool = False) -> Iterator[IO]:
    """:func:`create_file` for a command's output, removed again when the body fails (an error,
    a full disk, Ctrl-C): a table or a trace cut at an arbitrary row reads as a whole one, and
    the next run would need -f to replace it."""
    f = create_file(path, text=text)
    made = os.fstat(f.fileno())
    try:
        with f:
            yield f
    except BaseException:
        folder, name = os.path.split(os.fspath(path))
        with contextlib.suppress(OSError):
            dir_fd = open_folder(folder)
            try:
                remove_made(dir_fd, name, made)
            finally:
                os.close(dir_fd)
        raise


def remove_made(dir_fd: int, name: str, made: os.stat_result) -> None:
    """Remove ``name`` in ``dir_fd`` if it is still the file this process made (``made``: its
    ``fstat``), not whatever another user put there since; a link is never followed.

    Raises:
        OSError: it could not be looked at or removed.
    """
    now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if (now.st_dev, now.st_ino) == (made.st_dev, made.st_ino):
        os.unlink(name, dir_fd=dir_fd)


def make_folder(path: str | os.PathLike[str]) -> None:
    """Create the folder ``path`` if it is not there (its parent must be), reached as
    :func:`open_folder` reaches folders; an existing folder is checked the same way.

    Raises:
        OSError: as :func:`open_folder`, or ``path`` exists and is not a folder.
    """
    text = os.fspath(path)
    parent, name = os.path.split(text.rstrip("/") or "/")
    dir_fd = open_folder(parent)  # the caller's path: its links by the caller's rule, not "never"
    try:
        if name:
            try:
                os.mkdir(name, 0o777, dir_fd=dir_fd)
            except FileExistsError:
                pass
            except OSError as error:  # named by the caller's path, not the last name alone
                raise OSError(error.errno, error.strerror, text) from None
    finally:
        os.close(dir_fd)
    os.close(open_folder(text))


def remove_old(path: str | os.PathLike[str]) -> bool:
    """Remove the regular file at ``path`` that a ``--force`` output replaces; False when none is
    there. The writer then creates the new one exclusively (:func:`create_file`), so a link
    planted in between makes the write fail instead of going through it.

    Raises:
        OSError: ``path`` is a link or not a regular file (:func:`refuse_unsafe`), or its folder
            cannot be reached safely (:func:`open_folder`).
    """
    text = os.fspath(path)
    folder, name = os.path.split(text)
    dir_fd = open_folder(folder)
    try:
        try:
            if refuse_unsafe(name, dir_fd) is None:
                return False
        except OSError as error:
            raise OSError(error.errno, error.strerror, text) from None
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(dir_fd)
