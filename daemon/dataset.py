"""``memrec daemon --dataset DIR``: each closed trace file goes into the fleet's dataset.

The daemon's loop only hands the closed file's path to :meth:`DatasetShipper.submit` (a queue
append). A worker thread runs ``memrec export FILE --to dataset -o DIR`` as a child process at a
lower CPU priority, one file at a time: the export replays the whole trace (seconds and hundreds
of MB for a 1 GiB file), which in the daemon's own interpreter would hold its GIL and stall
recording. A failed export is logged with the child's last line and counted; recording goes on,
and the file stays on disk for ``memrec export`` by hand (exporting it again is harmless).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

log = logging.getLogger(__name__)

#: How much lower the export runs than the daemon (nice increment).
NICE = 10
#: At stop, how long to wait for the last files' exports before leaving them to be done by hand.
STOP_WAIT_S = 120.0


class DatasetShipper:
    """Exports closed trace files into a dataset folder, off the daemon's loop (see the module doc)."""

    def __init__(self, dataset: Path, command: list[str] | None = None) -> None:
        self.dataset = dataset
        #: The export command before its arguments (tests put a failing one here).
        self.command = command or [sys.executable, "-m", "memrec", "export"]
        self.exported = 0
        self.failed = 0
        self._queue: deque[Path] = deque()
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="memrec-dataset", daemon=True)
        self._thread.start()

    def submit(self, path: Path) -> None:
        """Queue a closed trace file (called from the daemon's loop: returns at once)."""
        with self._wake:
            self._queue.append(path)
            self._wake.notify()

    @property
    def pending(self) -> int:
        with self._wake:
            return len(self._queue)

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if not self._queue:
                    return
                path = self._queue[0]
            self._export(path)
            with self._wake:
                self._queue.popleft()
                self._wake.notify_all()

    def _export(self, path: Path) -> None:
        argv = [*self.command, os.fspath(path), "--to", "dataset", "-o", os.fspath(self.dataset)]
        started = time.monotonic()
        try:
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, close_fds=True)
            try:
                os.setpriority(os.PRIO_PROCESS, child.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICE))
            except OSError:
                pass  # it has exited already, or the priority cannot change: it runs as it is
            _, err = child.communicate()
            code = child.returncode
        except OSError as error:
            code, err = None, str(error).encode()
        if code == 0:
            self.exported += 1
            log.info("dataset: %s exported into %s in %.1f s", path, self.dataset, time.monotonic() - started)
            return
        self.failed += 1
        lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
        log.error("dataset: cannot export %s into %s (exit %s): %s; recording goes on (export it by hand: "
                  "memrec export %s --to dataset -o %s)", path, self.dataset, code, lines[-1] if lines else "no message",
                  path, self.dataset)

    def close(self, wait: float = STOP_WAIT_S) -> None:
        """Finish the queued exports (at most ``wait`` seconds), then stop the thread."""
        deadline = time.monotonic() + wait
        with self._wake:
            self._closing = True
            self._wake.notify_all()
            while self._queue and time.monotonic() < deadline:
                self._wake.wait(max(0.0, deadline - time.monotonic()))
            left = list(self._queue)
        if left:
            log.warning("dataset: %d trace file(s) not exported at stop (export them by hand with memrec export "
                        "--to dataset -o %s): %s", len(left), self.dataset, ", ".join(map(os.fspath, left)))
        else:
            self._thread.join(timeout=1.0)
