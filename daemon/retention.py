"""Bound the trace directory: keep the newest N trace files, delete older ones.

A service that records for months must not fill ``/var/lib/memrec``. ``--rotate-size`` bounds
each file; ``--keep N`` bounds their number, so the directory holds at most about
N × rotate-size bytes. Only regular files named like the daemon names them (``memrec-*.mrec``)
directly in the output directory are candidates; symbolic links, folders and other names are
never touched, and the file being written never is. Deletion goes through a descriptor of the
directory (``unlink(name, dir_fd=...)``), so a path swapped under the daemon is not followed.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

log = logging.getLogger(__name__)

#: Names the daemon gives the files of a trace directory (see ``Daemon._next_path``).
TRACE_NAME = re.compile(r"^memrec-[^/]+\.mrec$")
#: The part number of a rotated file (``<base>.<part>.mrec``; the first part has none).
_PART = re.compile(r"\.(\d+)\.mrec$")


def _age_key(mtime_ns: int, name: str) -> tuple[int, int]:
    """Newer files sort higher: by modification time, then by part number, since rotations a few
    milliseconds apart share a timestamp on file systems with coarse clocks."""
    m = _PART.search(name)
    return (mtime_ns, int(m.group(1)) if m else 0)


def prune(directory: Path, keep: int, current: Path | None = None) -> list[str]:
    """Delete all but the ``keep`` newest trace files in ``directory``; return the names deleted."""
    if keep < 1:
        return []
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        log.warning("cannot open %s to prune old traces: %s", directory, error.strerror or error)
        return []
    deleted = []
    try:
        found = []
        for name in os.listdir(dir_fd):
            if not TRACE_NAME.match(name) or (current is not None and name == current.name):
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((_age_key(st.st_mtime_ns, name), name))
        found.sort(reverse=True)
        # The file being written counts as one of the kept.
        for _, name in found[max(0, keep - (current is not None)):]:
            try:
                os.unlink(name, dir_fd=dir_fd)
                deleted.append(name)
            except OSError as error:
                log.warning("cannot delete old trace %s: %s", name, error.strerror or error)
    finally:
        os.close(dir_fd)
    if deleted:
        log.info("deleted %d old trace file(s) (--keep %d): %s", len(deleted), keep, ", ".join(deleted))
    return deleted
