"""What reaches the daemon's loop besides the ring buffer: markers and NVML samples, queued in order.

Markers come from the socket (on the loop's thread), NVML samples from the sampler's thread; both
wait here until the loop writes them, markers after the events that happened before them. A
marker's timestamp is checked against the daemon's clock on arrival.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Callable

import numpy as np

from memrec._untrusted import clean_text
from memrec.daemon.throttle import Throttle
from memrec.events import Marker

log = logging.getLogger(__name__)

#: A marker's ts must lie within this many ns before its arrival on the daemon's clock; any other
#: value (a clock of another time namespace, a made-up 2^64 - 1) is replaced by the arrival time.
MARKER_TS_WINDOW = 60 * 10**9


class Intake:
    """Markers and NVML samples waiting for the loop to write them.

    Args:
        clock: the daemon's clock (CLOCK_MONOTONIC ns, the probes' clock).
    """

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.markers: list[Marker] = []
        self.samples: deque[tuple[np.ndarray, np.ndarray]] = deque()
        #: Markers whose ts was replaced by their arrival time (the trailer says how many).
        self.restamped = 0
        self._restamp_log = Throttle(log, 60.0)

    def __bool__(self) -> bool:
        return bool(self.markers or self.samples)

    def marker(self, marker: Marker) -> Marker:
        """Queue a marker; its ts is the client's only when the daemon's clock agrees.

        A client's CLOCK_MONOTONIC is the daemon's on one host, so an honest ts lies a little
        before the marker's arrival. Any other value (another time namespace's clock, a made-up
        2^63) would stretch or break every report of the trace: the arrival time replaces it.
        Returns the marker as queued.
        """
        now = self.clock()
        if not now - MARKER_TS_WINDOW <= marker.ts <= now:
            self.restamped += 1
            self._restamp_log.log(
                logging.WARNING, "marker %r from pid %d: its ts %d is not within the last %d s of this "
                "host's clock (%d); stamped with its arrival time", clean_text(marker.name, 60), marker.pid,
                marker.ts, MARKER_TS_WINDOW // 10**9, now,
            )
            marker = dataclasses.replace(marker, ts=now)
        self.markers.append(marker)
        return marker

    def take_markers(self) -> list[Marker]:
        """The queued markers in ts order (the queue is left empty)."""
        markers, self.markers = self.markers, []
        return sorted(markers, key=lambda m: m.ts)

    def sample(self, device_rows: np.ndarray, process_rows: np.ndarray) -> None:
        """Queue an NVML sample (called on the sampler's thread: a deque append is atomic)."""
        self.samples.append((device_rows, process_rows))
