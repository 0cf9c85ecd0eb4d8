"""Rate-limited warnings: a problem that repeats is said once per interval, with a count.

A hostile or broken client (or a full disk, or a flooded ring buffer) can make the same thing go
wrong thousands of times a second; logging each one fills the disk with the log (19.5 M "accept
failed" lines were seen in 4 minutes). :class:`Throttle` says the first occurrence at once and
then at most one line per ``interval`` seconds, telling how many were not said in between.
"""

from __future__ import annotations

import logging
import time
from typing import Callable


class Throttle:
    """Log one message per ``interval`` seconds at most; count the rest.

    Args:
        logger: where the lines go.
        interval: the fewest seconds between two lines.
        clock: seconds (monotonic); tests pass their own.
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._last: float | None = None
        self.suppressed = 0
        self.total = 0

    def log(self, level: int, message: str, *args: object) -> bool:
        """Log ``message % args`` unless a line went out less than ``interval`` ago; True if logged."""
        self.total += 1
        now = self.clock()
        if self._last is not None and now - self._last < self.interval:
            self.suppressed += 1
            return False
        if self.suppressed:
            message += " (and %d more like it in the last %.0f s)"
            args = (*args, self.suppressed, now - self._last)
        self.logger.log(level, message, *args)
        self._last = now
        self.suppressed = 0
        return True
