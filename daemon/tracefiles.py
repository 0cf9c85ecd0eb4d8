"""The daemon's trace files: what each part of a recording is called, and a watch on the disk.

A recording is one file, or several parts when it rotates (by size or SIGHUP). In a folder, each
name carries the host, the start time, the daemon's pid and a random token, so nobody can plant a
file (or a link) at a name known in advance; a named file ``run.mrec`` continues as
``run.1.mrec``, ``run.2.mrec``...
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from pathlib import Path

from memrec.daemon.config import DaemonConfig
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


class DiskWatch:
    """Says once when writes stall (a full disk) and once when they resume, with what was lost."""

    def __init__(self) -> None:
        self.full = False

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
