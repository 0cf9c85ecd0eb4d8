"""The probes as the daemon's loop sees them: load, wake the loop, read batches, count the lost, detach.

Why a module of its own: the probes are the daemon's one slow and failure-prone neighbour (a
compile that takes seconds, a kernel that refuses, a detach that waits out RCU grace periods),
and the loop must treat every failure the same way: log it, keep the trace. Here those rules sit
in one place, apart from what the loop does with the records.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import time
from typing import Any
from typing import Callable

import numpy as np

from memrec.base.errors import ProbeLoadError
from memrec.base.errors import one_line
from memrec.daemon.config import DEFAULT_PROBE_CACHE
from memrec.daemon.config import DaemonConfig
from memrec.daemon.throttle import Throttle

log = logging.getLogger(__name__)


def default_probes_factory(**kwargs: Any) -> Any:
    """memrec's CudaProbes (imported here: bcc is needed only once a daemon starts)."""
    from memrec.probes.cuda import CudaProbes

    return CudaProbes(**kwargs)


class ProbeFeed:
    """The daemon's probes and what reading them has seen (the lost total, poll failures).

    Args:
        factory: builds the probes (``factory(follow_tree=, ringbuf_pages=[, untraced=])``).
        config: the daemon's configuration.
    """

    def __init__(self, factory: Callable[..., Any] | None, config: DaemonConfig) -> None:
        self._factory = factory or default_probes_factory
        self._config = config
        #: The probes (CudaProbes or a stand-in); an add-on may wrap them (the metrics' meter).
        self.probes: Any = None
        #: Events the probes dropped so far (ring buffer full), as last read.
        self.lost = 0
        self.closed = False
        self._selector: selectors.BaseSelector | None = None
        self._ring_fd: int | None = None
        self._poll_errors = 0
        self._loss_log = Throttle(log, 5.0)

    def load(self) -> None:
        """Build and load the probes.

        Raises:
            ProbeLoadError: they cannot be compiled or loaded (the reason in one line).
        """
        log.info("loading the BPF probes (compiling them, when not cached, takes a few seconds)")
        try:
            kwargs = {"follow_tree": self._config.follow_tree, "ringbuf_pages": self._config.ringbuf_pages}
            if not self._config.untraced_probes:
                kwargs["untraced"] = False
            if self._config.tensors:
                kwargs["tensors"] = True
            if self._config.stacks:
                from memrec.probes.cuda import StackOptions

                kwargs["stacks"] = StackOptions(self._config.stack_depth, self._config.stack_min_bytes)
            if self._config.probe_cache != DEFAULT_PROBE_CACHE:
                kwargs["probe_cache"] = self._config.probe_cache
            self.probes = self._factory(**kwargs)
            self.probes.load()
        except ProbeLoadError:
            raise
        except Exception as error:  # bcc raises bare Exception for compile and load failures
            raise ProbeLoadError(f"cannot load the BPF probes: {one_line(error)}") from error

    def origin(self) -> str:
        """Where the probe program came from, for the start line: "from the cache (48 ms)", "compiled (2.1 s)"."""
        source, seconds = getattr(self.probes, "loaded_from", ""), getattr(self.probes, "load_seconds", 0.0)
        if source == "cache":
            return f"from the cache ({seconds * 1e3:.0f} ms)"
        return f"compiled ({seconds:.1f} s)" if source else "loaded"

    def watch(self, selector: selectors.BaseSelector, on_ready: Callable[[], object]) -> None:
        """Call ``on_ready`` from the loop when the probes wake it (if they offer a pollable fd).

        Records are submitted without wakeups (cheap) until the ring is a quarter full; then,
        and for the first, rare events of a process (context creation, so the daemon reads its
        /proc while it surely still runs), the program wakes the reader. The loop's timer drains
        the rest.
        """
        fileno = getattr(self.probes, "fileno", None)
        if not callable(fileno):
            return
        try:
            fd = int(fileno())
            selector.register(fd, selectors.EVENT_READ, lambda _mask: on_ready())
        except (OSError, ValueError, TypeError) as error:
            log.debug("ring buffer fd not pollable (%s): draining on the timer only", error)
            return
        self._selector, self._ring_fd = selector, fd

    def read(self) -> np.ndarray | None:
        """The records waiting in the ring; None once closed or when the poll failed (logged)."""
        if self.probes is None or self.closed:
            return None
        try:
            return self.probes.poll()
        except Exception as error:
            self._poll_errors += 1
            if self._poll_errors <= 3:
                log.error("ring buffer poll failed: %s", one_line(error))
            return None

    def new_lost(self) -> int | None:
        """The probes' lost total when it changed since the last call (a warning, rate-limited), else None."""
        lost = int(self.probes.lost())
        if lost == self.lost:
            return None
        if lost > self.lost:
            self._loss_log.log(logging.WARNING, "%d events lost so far (ring buffer full: raise --ringbuf-pages?)", lost)
        self.lost = lost
        return lost

    def stop_reading(self) -> None:
        """Read no more events: what the probes see from here on is after the trailer."""
        if self._ring_fd is not None and self._selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._ring_fd)
        self._ring_fd = None
        self.closed = True

    def detach(self) -> None:
        """Detach every probe (slow: the kernel waits out RCU grace periods per probe)."""
        self.stop_reading()
        log.info("detaching the probes (the trace file is closed)")
        started = time.monotonic()
        self.probes.close()
        log.info("probes detached in %.1f s", time.monotonic() - started)
