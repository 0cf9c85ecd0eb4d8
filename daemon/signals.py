"""The daemon's signals as a queue its loop reads (supervisor's model).

Why: a Python signal handler runs between two bytecodes of whatever the loop is doing (a drain, a
write); acting there would interleave two writers of one trace. The handler only queues the
signal; the loop acts on it. A self-pipe given to ``signal.set_wakeup_fd`` wakes the loop's
``select`` at once, so a stop never waits for the next timer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import threading
from typing import Any
from typing import Callable

from memrec.base.errors import StopSignal

log = logging.getLogger(__name__)

#: The signals the daemon handles: stop (TERM, INT) and rotate the trace (HUP).
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP = (signal.SIGTERM, signal.SIGINT)
#: In record mode, stop signals go to the command; this many of one kind stop the daemon anyway.
FORCE_STOP_AFTER = 3


class SignalInbox:
    """Queued signals (each at most once until taken), what each asks for, and the handlers."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self._counts: dict[int, int] = {}
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd: int | None = None
        self._wake_r = self._wake_w = -1

    def queue(self, signum: int) -> None:
        """Queue ``signum`` unless it waits already (all a handler may do)."""
        if signum not in self.pending:
            self.pending.append(signum)

    def take(self, running: bool, passes_on: bool) -> tuple[str, int] | None:
        """The next queued signal and what it asks for (said in the log), or None when none waits.

        The answer is ``"stop"``, ``"pass on"`` (record mode, where ``passes_on``: TERM/INT go to
        the command, until the third of one kind), ``"rotate"`` (HUP) or ``"ignore"`` (anything
        while not ``running``, or a signal the daemon does not handle).
        """
        if not self.pending:
            return None
        signum = self.pending.pop(0)
        name = signal.Signals(signum).name
        if signum in STOP:
            count = self._counts[signum] = self._counts.get(signum, 0) + 1
            if not running:
                log.info("received %s: ignored, shutdown already in progress", name)
                return "ignore", signum
            if passes_on and count < FORCE_STOP_AFTER:
                log.info("received %s: passed on (recording continues until the command exits)", name)
                return "pass on", signum
            log.info("received %s: shutting down", name)
            return "stop", signum
        if signum == signal.SIGHUP:
            if not running:
                log.info("received SIGHUP: ignored, shutdown in progress")
                return "ignore", signum
            log.info("received SIGHUP: rotating the trace file")
            return "rotate", signum
        log.debug("received %s: ignored", name)
        return "ignore", signum

    def raise_until_installed(self) -> None:
        """Until :meth:`install`: a stop signal raises :class:`~memrec.base.errors.StopSignal`.

        The start (a BPF compile of seconds) then unwinds through its teardown; the default
        action would kill the process with its socket left behind. :meth:`restore` puts back the
        handlers found here. Only from the main thread, as :meth:`install`.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP:
            self._old_handlers[signum] = signal.signal(signum, _raise_stop)

    def install(self, selector: selectors.BaseSelector, handler: Callable[[int, Any], None]) -> None:
        """Install ``handler`` for :data:`HANDLED` and the self-pipe that wakes ``selector``.

        Only the main thread may install handlers; elsewhere (a daemon run by a test's thread)
        nothing is installed and the loop still sees signals queued by hand.
        """
        if threading.current_thread() is not threading.main_thread():
            log.debug("not in the main thread: signal handlers not installed")
            return
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        selector.register(self._wake_r, selectors.EVENT_READ, self._drain_wakeup)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for signum in HANDLED:
            old = signal.signal(signum, handler)
            self._old_handlers.setdefault(signum, old)  # not raise_until_installed's handler

    def _drain_wakeup(self, _mask: int) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 512):
                pass

    def restore(self) -> None:
        """Put back the handlers and the wakeup fd found at :meth:`install`; close the pipe."""
        for signum, handler in self._old_handlers.items():
            with contextlib.suppress(Exception):
                signal.signal(signum, handler)
        self._old_handlers.clear()
        if self._old_wakeup_fd is not None:
            with contextlib.suppress(Exception):
                signal.set_wakeup_fd(self._old_wakeup_fd)
            self._old_wakeup_fd = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1


def _raise_stop(signum: int, _frame: Any) -> None:
    raise StopSignal(signum)
