"""The daemon's trace files: what each part of a recording is called, when it rotates, and a
watch on the disk.

A recording is one file, or several parts when it rotates (by size or SIGHUP). In a folder, each
name carries the host, the start time, the daemon's pid and a random token (the recording's trace
id), so nobody can plant a file (or a link) at a name known in advance; a named file ``run.mrec``
continues as ``run.1.mrec``, ``run.2.mrec``... A name found taken (a planted link or file) is
skipped: the next part takes the number after it.

Policy (docs/operations.md, "Rotation and retention"), the same for rotation and ``--keep``:

- a file rotates by size when what was written *after its opening* (header, process table, first
  keyframe) reaches ``--rotate-size``: an opening larger than the size cannot make every new file
  rotate at once;
- a rotation that cannot create the next file backs off (1 s, doubling to 60 s), says so once
  with a count, and says when rotation works again;
- a symbolic link as the output folder is resolved once at start (and said); rotation and
  retention then both work in the folder it named (:func:`resolve_folder`);
- markers stop (dropped and counted) while the trace's file system has less than
  :func:`marker_floor` free: the space left is for driver events and the trailer.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Callable

from memrec.base.errors import OutputError
from memrec.daemon.config import DaemonConfig
from memrec.daemon.throttle import Throttle
from memrec.trace.writer import MAX_HELD_BYTES
from memrec.trace.writer import FileSink
from memrec.trace.writer import TraceWriter

log = logging.getLogger(__name__)


def create_sink(path: Path) -> FileSink:
    """A new trace file: never through a symbolic link; an existing regular file is replaced."""
    return FileSink(path, replace=True)


class TraceNames:
    """The path of each part of one recording (fixed when the recording starts)."""

    def __init__(self, config: DaemonConfig) -> None:
        self._config = config
        #: The same in the header of every part (the dataset's trace id: memrec.export.dataset).
        self.recording_id = secrets.token_hex(8)
        self._base = f"memrec-{socket.gethostname()}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(4)}"

    def path(self, part: int) -> Path:
        """Part 0 is the recording's first file."""
        cfg = self._config
        if cfg.output_is_dir:
            return cfg.output / (f"{self._base}.mrec" if part == 0 else f"{self._base}.{part}.mrec")
        if part == 0:
            return cfg.output
        suffix = cfg.output.suffix or ""
        stem = cfg.output.name[: -len(suffix)] if suffix else cfg.output.name
        return cfg.output.with_name(f"{stem}.{part}{suffix}")


#: Seconds a refused rotation waits before the next try: first and longest.
ROTATE_BACKOFF = (1.0, 60.0)
#: Free bytes below which markers stop; a small file system keeps an eighth of its size instead.
MARKER_FLOOR = 256 << 20
#: Seconds between two looks at the trace's file system's free space.
FREE_CHECK_NS = 10**9


def resolve_folder(folder: Path) -> Path:
    """The folder a trace folder path names: a symbolic link is followed once, here, and said.

    Rotation and retention then both work in the real folder, by its name; nothing later follows
    the link again (retention opens the folder with O_NOFOLLOW). Only a link of root's or the
    daemon's own user is followed: another user's could send root's files anywhere.

    Raises:
        OutputError: the link belongs to another user.
    """
    if not folder.is_symlink():
        return folder
    owner = os.lstat(folder).st_uid
    if owner not in (0, os.geteuid()):
        raise OutputError(f"the output folder {folder} is a symbolic link of uid {owner}: memrec never follows "
                          "a link another user controls; name the folder itself")
    real = Path(os.path.realpath(folder))
    log.warning("the output folder %s is a symbolic link to %s: the traces are written, rotated and pruned there",
                folder, real)
    return real


def marker_floor(fs_bytes: int) -> int:
    """Free bytes kept for driver events and trailers: markers stop below this."""
    return min(MARKER_FLOOR, fs_bytes // 8)


class Rotation:
    """When the current file is due to rotate by size, and the back-off of a refused rotation.

    Args:
        rotate_bytes: the size a file's records after its opening may reach (0: never by size).
    """

    def __init__(self, rotate_bytes: int) -> None:
        self.rotate_bytes = rotate_bytes
        self._base: int | None = None  # bytes_written when the file's opening was complete
        self._retry_ns = 0
        self._backoff = ROTATE_BACKOFF[0]
        self.refused = 0  # rotations refused since the last that worked
        self.refused_total = 0
        self._log = Throttle(log, 60.0)

    def opened(self) -> None:
        """A new file: its opening (header, processes, first keyframe) is not counted."""
        self._base = None

    def due(self, writer: TraceWriter, opening: bool, now: int) -> bool:
        """Whether ``writer``'s file should rotate by size now; ``opening``: its first keyframe is
        still being built (then never)."""
        if not self.rotate_bytes or opening:
            return False
        if self._base is None:
            self._base = writer.bytes_written
        return (writer.bytes_written - self._base >= self.rotate_bytes and writer.stalled is None
                and now >= self._retry_ns)

    def failed(self, reason: str, path: Path, error: OSError, current: str | None, now: int) -> None:
        """A rotation could not create ``path``: wait before the next try; log once per minute."""
        self.refused += 1
        self.refused_total += 1
        self._retry_ns = now + int(self._backoff * 1e9)
        self._log.log(logging.ERROR, "cannot rotate (%s) to %s: %s; recording goes on in %s, next try in %g s "
                      "(%d refused so far)", reason, path, error.strerror or error, current, self._backoff,
                      self.refused)
        self._backoff = min(self._backoff * 2, ROTATE_BACKOFF[1])

    def done(self) -> None:
        """A rotation worked: say so when some were refused before; the back-off starts over."""
        if self.refused:
            log.warning("rotation works again after %d refused attempt(s)", self.refused)
        self.refused = 0
        self._retry_ns = 0
        self._backoff = ROTATE_BACKOFF[0]


class DiskWatch:
    """Says once when writes stall (a full disk) and once when they resume, with what was lost;
    keeps markers off a nearly full disk (:meth:`markers_allowed`)."""

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.full = False
        self.clock = clock
        self._low = False
        self._next_check = 0
        self._checked_bytes = 0  # the writer's bytes_written at the last look
        self._recheck_bytes = 0  # look again once this many more bytes were written
        self._free = 1 << 62  # free bytes at the last look, less what the writer held then
        self._floor = 0
        self._path: str | None = None  # the file looked at (a rotation starts over)

    def check(self, writer: TraceWriter | None) -> None:
        """Look at the writer's state (the loop calls this after each flush)."""
        if writer is None:
            return
        stalled = writer.stalled
        if stalled is not None and not self.full:
            self.full = True
            log.error(
                "cannot write %s: %s. Recording goes on: the live state is kept, up to %d MiB of records "
                "are held and written when space returns, later ones are dropped and counted",
                writer.path, stalled.strerror or stalled, MAX_HELD_BYTES >> 20,
            )
        elif stalled is None and self.full:
            self.full = False
            records, nbytes = writer.dropped
            log.warning("%s takes writes again; %d record(s) (%d bytes) were dropped while the disk was full",
                        writer.path, records, nbytes)

    def markers_allowed(self, writer: TraceWriter) -> bool:
        """Whether a marker may be written now: not while writes stall, nor while the file system
        has less than :func:`marker_floor` free.

        The free space is looked at once a second and after each quarter of the floor written;
        in between, every byte the writer takes counts against it, and so do the bytes it holds
        that are not in the file yet (its buffer, a held first keyframe): a flood read in one
        loop iteration must not run past the floor."""
        if writer.stalled is not None:
            return False
        now = self.clock()
        written = writer.bytes_written
        if writer.path and (now >= self._next_check or written - self._checked_bytes >= self._recheck_bytes
                            or writer.path != self._path):
            self._next_check = now + FREE_CHECK_NS
            self._checked_bytes = written
            self._path = writer.path
            try:
                st = os.statvfs(os.path.dirname(os.path.abspath(writer.path)))
                on_disk = os.stat(writer.path).st_size
            except OSError:
                return not self._low
            self._floor = marker_floor(st.f_blocks * st.f_frsize)
            self._recheck_bytes = max(64 << 10, self._floor // 4)
            self._free = st.f_bfree * st.f_frsize - max(0, written - on_disk)
        low = self._free - (written - self._checked_bytes) < self._floor
        if low != self._low:
            self._low = low
            log.log(logging.WARNING if low else logging.INFO,
                    "%s: %s", writer.path, "the disk is nearly full: markers are dropped (counted) so that "
                    "driver events keep the space left" if low else "disk space is back: markers are written again")
        return not low

    def closed(self, writer: TraceWriter, markers_dropped: int) -> None:
        """After the last file closed: say truly whether it ends with its trailer."""
        records, nbytes = writer.dropped
        if writer.stalled is not None:
            log.error("%s ends WITHOUT its trailer: the disk stayed full (%s); %d record(s) (%d bytes) never reached "
                      "it, %d marker(s) were dropped; it reads up to its last whole record", writer.path,
                      writer.stalled.strerror or writer.stalled, records, nbytes, markers_dropped)
        elif records or markers_dropped:
            log.warning("%s is complete; its trailer counts %d record(s) (%d bytes) dropped while the disk was "
                        "full and %d marker(s) dropped", writer.path, records, nbytes, markers_dropped)
