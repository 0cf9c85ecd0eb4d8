"""Deadlines on a fixed grid, and the add-ons' periodic calls that the daemon's loop makes.

Why a grid: a timer that is late (a long drain, a busy host) fires once and keeps its phase,
rather than firing again at once for every period it missed.
"""

from __future__ import annotations

import logging
from typing import Callable

from memrec.base.errors import one_line

log = logging.getLogger(__name__)


def advance(deadline: int, period: int, now: int) -> int:
    """The next deadline after ``now`` on the grid ``deadline + k * period``."""
    deadline += period
    if deadline <= now:
        deadline += ((now - deadline) // period + 1) * period
    return deadline


class AddOnTimers:
    """``fn(now)`` every so often, from the loop's thread (the metrics' snapshot, systemd's watchdog)."""

    def __init__(self) -> None:
        self._timers: list[list] = []  # [period ns, due ns, fn]

    def every(self, period_ns: int, now: int, fn: Callable[[int], None]) -> None:
        """Call ``fn`` every ``period_ns``, first one period after ``now``."""
        period = max(1, period_ns)
        self._timers.append([period, now + period, fn])

    def due(self) -> int | None:
        """The earliest deadline (None without timers)."""
        return min((t[1] for t in self._timers), default=None)

    def run(self, now: int) -> None:
        """Call what is due; an add-on that fails is logged and never stops recording."""
        for timer in self._timers:
            if now >= timer[1]:
                timer[1] = advance(timer[1], timer[0], now)
                try:
                    timer[2](now)
                except Exception as error:
                    log.error("periodic %s failed: %s", getattr(timer[2], "__qualname__", timer[2]), one_line(error))
