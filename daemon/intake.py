"""What reaches the daemon's loop besides the ring buffer: markers and NVML samples, queued in order.

Markers come from the socket (on the loop's thread), NVML samples from the sampler's thread; both
wait here until the loop writes them, markers after the events that happened before them. A
marker's timestamp is checked against the daemon's clock on arrival.

Markers come from users the daemon does not trust (any member of the socket's group), so what
they may cost root is bounded here, per uid (issue 23):

- :class:`Budget`: markers per second and bytes per second, with a burst. Over budget a marker is
  counted and dropped; driver events never pass through here and never are.
- :class:`OpenPhases`: phases begun and not ended, per uid. A ``begin`` beyond the cap is
  dropped and counted; entries of a process that is gone expire (:meth:`Intake.expire`).

Root (uid 0) is not budgeted: it may write the trace folder itself. Every drop is counted by
reason in :attr:`Intake.dropped`, which the trailer, the log and the metrics show.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Callable

import numpy as np

from memrec.base.untrusted import clean_text
from memrec.daemon.throttle import Throttle
from memrec.terms.events import Marker

log = logging.getLogger(__name__)

#: A marker's ts must lie within this many ns before its arrival on the daemon's clock; any other
#: value (a clock of another time namespace, a made-up 2^64 - 1) is replaced by the arrival time.
MARKER_TS_WINDOW = 60 * 10**9
#: Per uid other than root: sustained markers per second (SGLang sends a few per batch and rank).
MARKER_RATE = 2000
#: Per uid other than root: sustained marker bytes per second (name and values; a few hundred per
#: marker from SGLang). 256 KiB/s is 21 GiB a day at most: the trace folder's --keep outlives it.
MARKER_BYTES_RATE = 256 << 10
#: Seconds of budget a quiet uid may spend at once (a burst at start-up).
BURST_SECONDS = 4.0
#: Phases one uid other than root may hold open (begun, not ended) at once.
OPEN_PHASES_PER_UID = 1024
#: Bytes a marker costs besides its name and values (its record's fixed fields).
MARKER_OVERHEAD = 64
#: Why markers are dropped; the trailer's ``markers_dropped`` has one count for each.
DROP_REASONS = ("budget", "open_phases", "disk")


def marker_cost(marker: Marker) -> int:
    """About the bytes a marker takes in the trace (cheap: no encoding)."""
    cost = MARKER_OVERHEAD + len(marker.name)
    for key, value in marker.values.items():
        cost += len(key) + (len(value) if isinstance(value, str) else 9)
    return cost


class Budget:
    """A token bucket per uid for markers and their bytes (root unlimited).

    Args:
        clock: ns, monotonic.
        rate: markers per second per uid.
        bytes_rate: bytes per second per uid.
        burst: seconds of budget a quiet uid has saved up at most.
    """

    def __init__(self, clock: Callable[[], int], rate: float = MARKER_RATE,
                 bytes_rate: float = MARKER_BYTES_RATE, burst: float = BURST_SECONDS) -> None:
        self.clock = clock
        self.rate = rate
        self.bytes_rate = bytes_rate
        self.burst = burst
        self._buckets: dict[int, list[float]] = {}  # uid -> [markers left, bytes left, last ns]

    def admit(self, uid: int, nbytes: int, count: int = 1) -> bool:
        """Whether ``uid`` may have ``count`` more markers (0: other records) of ``nbytes`` written
        now (and spend them if so)."""
        if uid == 0:
            return True
        now = self.clock()
        bucket = self._buckets.get(uid)
        if bucket is None:
            bucket = self._buckets[uid] = [self.rate * self.burst, self.bytes_rate * self.burst, now]
        else:
            seconds = max(0, now - bucket[2]) / 1e9
            bucket[0] = min(self.rate * self.burst, bucket[0] + seconds * self.rate)
            bucket[1] = min(self.bytes_rate * self.burst, bucket[1] + seconds * self.bytes_rate)
            bucket[2] = now
        if bucket[0] < count or bucket[1] < nbytes:
            return False
        bucket[0] -= count
        bucket[1] -= nbytes
        return True

    def forget_full(self) -> None:
        """Drop the buckets that are full again (their uids are quiet): the set stays small."""
        now = self.clock()
        for uid, (_, _, last) in list(self._buckets.items()):
            if (now - last) / 1e9 >= self.burst:
                del self._buckets[uid]


class OpenPhases:
    """Phases begun and not yet ended, per uid other than root, capped (see the module docstring)."""

    def __init__(self, per_uid: int = OPEN_PHASES_PER_UID) -> None:
        self.per_uid = per_uid
        self._open: dict[int, dict[tuple[int, str], int]] = {}  # uid -> (pid, name) -> depth
        self._count: dict[int, int] = {}  # uid -> sum of depths

    def admit(self, marker: Marker) -> bool:
        """Whether ``marker`` may pass; a ``begin`` over the uid's cap may not."""
        uid = marker.uid
        if uid == 0 or marker.phase == "instant":
            return True
        key = (marker.pid, marker.name)
        held = self._open.setdefault(uid, {})
        if marker.phase == "begin":
            if self._count.get(uid, 0) >= self.per_uid:
                return False
            held[key] = held.get(key, 0) + 1
            self._count[uid] = self._count.get(uid, 0) + 1
        elif key in held:
            self._release(uid, key, 1)
        return True

    def open_count(self, uid: int) -> int:
        return self._count.get(uid, 0)

    def expire(self, alive: Callable[[int], bool]) -> int:
        """Forget the phases of processes that are gone; return how many were forgotten."""
        gone = 0
        for uid, held in list(self._open.items()):
            pids = {pid for pid, _ in held}
            dead = {pid for pid in pids if not alive(pid)}
            for key in [k for k in held if k[0] in dead]:
                gone += held[key]
                self._release(uid, key, held[key])
        return gone

    def _release(self, uid: int, key: tuple[int, str], depth: int) -> None:
        held = self._open[uid]
        held[key] -= depth
        if held[key] <= 0:
            del held[key]
        self._count[uid] -= depth
        if not held:
            del self._open[uid]
            del self._count[uid]


class Intake:
    """Markers and NVML samples waiting for the loop to write them.

    Args:
        clock: the daemon's clock (CLOCK_MONOTONIC ns, the probes' clock).
        budget: the per-uid marker budget (default :class:`Budget` with the module's numbers).
        open_phases: the per-uid cap on open phases.
    """

    def __init__(self, clock: Callable[[], int], budget: Budget | None = None,
                 open_phases: OpenPhases | None = None) -> None:
        self.clock = clock
        self.budget = budget or Budget(clock)
        self.open_phases = open_phases or OpenPhases()
        self.markers: list[Marker] = []
        self.samples: deque[tuple[np.ndarray, np.ndarray]] = deque()
        #: Markers whose ts was replaced by their arrival time (the trailer says how many).
        self.restamped = 0
        #: Markers dropped, by reason (DROP_REASONS): the trailer, the log and the metrics show them.
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        #: Why the last marker dropped was (a DROP_REASONS entry).
        self.last_drop: str | None = None
        #: Reads of a new marker client's /proc refused (its uid over budget): no process record.
        self.process_reads_refused = 0
        self._restamp_log = Throttle(log, 60.0)
        self._drop_log = Throttle(log, 10.0)

    def __bool__(self) -> bool:
        return bool(self.markers or self.samples)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def admit(self, uid: int, nbytes: int) -> bool:
        """Spend ``nbytes`` of ``uid``'s budget on something else the uid makes root write (the
        process record of a new marker client); False (and nothing spent) when over budget."""
        return self.budget.admit(uid, nbytes, count=0)

    def marker(self, marker: Marker) -> Marker | None:
        """Queue a marker and return it as queued; None when it was dropped (and counted).

        A marker over its uid's budget, or a ``begin`` over its uid's open phases, is dropped.
        Its ts is the client's only when the daemon's clock agrees: a client's CLOCK_MONOTONIC is
        the daemon's on one host, so an honest ts lies a little before the marker's arrival. Any
        other value (another time namespace's clock, a made-up 2^63) would stretch or break every
        report of the trace: the arrival time replaces it.
        """
        if not self.budget.admit(marker.uid, marker_cost(marker)):
            self.drop(marker, "budget")
            return None
        if not self.open_phases.admit(marker):
            self.drop(marker, "open_phases")
            return None
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

    def drop(self, marker: Marker, reason: str) -> None:
        """Count a dropped marker; say so at most once per 10 s, with the totals."""
        self.dropped[reason] += 1
        self.last_drop = reason
        why = {
            "budget": f"uid {marker.uid} is over its marker budget ({self.budget.rate:g} markers/s, "
                      f"{int(self.budget.bytes_rate) >> 10} KiB/s)",
            "open_phases": f"uid {marker.uid} holds {self.open_phases.open_count(marker.uid)} open phases "
                           f"(at most {self.open_phases.per_uid})",
            "disk": "the trace's disk is nearly full and driver events come first",
        }[reason]
        self._drop_log.log(logging.WARNING, "markers dropped: %s; %d dropped so far (%s)", why,
                           self.dropped_total, ", ".join(f"{k} {v}" for k, v in self.dropped.items() if v))

    def take_markers(self) -> list[Marker]:
        """The queued markers in ts order (the queue is left empty)."""
        markers, self.markers = self.markers, []
        return sorted(markers, key=lambda m: m.ts)

    def expire(self, alive: Callable[[int], bool]) -> None:
        """Forget what gone processes and quiet uids held (the loop calls it about once a second)."""
        self.open_phases.expire(alive)
        self.budget.forget_full()

    def sample(self, device_rows: np.ndarray, process_rows: np.ndarray) -> None:
        """Queue an NVML sample (called on the sampler's thread: a deque append is atomic)."""
        self.samples.append((device_rows, process_rows))
