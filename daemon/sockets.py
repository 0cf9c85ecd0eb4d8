"""Binding the daemon's Unix socket safely (supervisor's model).

- bind to a temporary name next to the final one, set its mode and group, listen, then hard-link
  it into place, so the socket never appears with the wrong permissions or before it accepts;
- if the name is taken, connect to it: a live owner is a clear error (another daemon runs), a
  refused connection means a stale socket left by a crash, which is removed (only if it *is* a
  socket) before trying again;
- on close, unlink the path only if it is still the socket this process created.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import socket
import stat
from pathlib import Path

from memrec.base.errors import SocketError
from memrec.base.files import open_folder

log = logging.getLogger(__name__)


def socket_in_use(path: str | os.PathLike[str], timeout: float = 0.5) -> bool:
    """Whether a live process accepts connections on the Unix socket ``path``.

    A full backlog or a slow owner count as live; a refused connection or no such file do not.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except (BlockingIOError, TimeoutError, socket.timeout):
            return True
        except OSError as error:
            return error.errno in (errno.EAGAIN, errno.EACCES, errno.EPERM)
        return True


def group_id(group: str | int) -> int:
    """The gid of a group name or number (SocketError when no such group)."""
    if isinstance(group, int):
        return group
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise SocketError(f"no such group {group!r} for the socket") from None


class BoundSocket:
    """A listening Unix socket and the path this process owns for it."""

    def __init__(self, sock: socket.socket, path: Path, ident: tuple[int, int], created_dir: Path | None) -> None:
        self.sock = sock
        self.path = path
        self._ident = ident  # (st_dev, st_ino) of the socket file we created
        self._created_dir = created_dir

    def fileno(self) -> int:
        return self.sock.fileno()

    def owns_path(self) -> bool:
        """Whether ``path`` is still the socket file this process created."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._ident

    def close(self) -> None:
        """Close the socket and remove its path (and a directory we made, if left empty)."""
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.owns_path():
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        if self._created_dir is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._created_dir)  # only succeeds when empty
            self._created_dir = None


def bind_unix_socket(
    path: str | os.PathLike[str],
    mode: int = 0o660,
    group: str | int | None = None,
    backlog: int = 64,
) -> BoundSocket:
    """Create, bind and listen on a Unix stream socket at ``path`` (non-blocking, close-on-exec).

    Raises:
        SocketError: another live process listens at ``path``, ``path`` exists and is not a
            socket, or the directory, mode or group cannot be set (the message says which).
    """
    path = Path(os.fspath(path))
    if len(os.fsencode(path)) >= 100:  # sun_path is 108 bytes; the temp name adds a suffix
        raise SocketError(f"socket path too long for a Unix socket: {path}")
    created_dir = None
    if not path.parent.exists():
        try:
            os.close(open_folder(path.parent, parents=True, mode=0o755))  # (memrec.base.files' one link policy)
        except OSError as error:
            raise SocketError(f"cannot create {path.parent}: {error.strerror}") from None
        created_dir = path.parent
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(tmp).st_mode):
            os.unlink(tmp)  # our own pid's leftover (pid reuse after a crash)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        try:
            sock.bind(os.fspath(tmp))
        except OSError as error:
            raise SocketError(f"cannot bind {tmp}: {error.strerror}") from None
        try:
            os.chmod(tmp, mode)
            if group is not None:
                os.chown(tmp, -1, group_id(group))
        except PermissionError:
            raise SocketError(
                f"cannot set the group of {path} to {group!r}: only root or a member of that group may (EPERM)"
            ) from None
        except OSError as error:
            raise SocketError(f"cannot set mode/group of {path}: {error.strerror}") from None
        sock.listen(backlog)
        for _attempt in range(2):
            try:
                os.link(tmp, path)
                break
            except FileExistsError:
                if socket_in_use(path):
                    raise SocketError(
                        f"another process (a memrec daemon?) is listening on {path}; stop it or use --socket"
                    ) from None
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue  # it just went away: try again
                if not stat.S_ISSOCK(st.st_mode):
                    raise SocketError(f"{path} exists and is not a socket; refusing to remove it") from None
                log.info("removing stale socket %s (nobody listens on it)", path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            except OSError as error:
                raise SocketError(f"cannot create {path}: {error.strerror}") from None
        else:
            raise SocketError(f"cannot create {path}: it keeps reappearing")
        st = os.lstat(path)
        return BoundSocket(sock, path, (st.st_dev, st.st_ino), created_dir)
    except BaseException:
        sock.close()
        if created_dir is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
                os.rmdir(created_dir)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
