"""The daemon's own CPU priority: its loop must get a CPU when the traced processes keep them busy.

Why: the probes run in the traced processes, and every one of their driver calls puts a record in
the ring buffer; on a host whose CPUs those processes keep busy, a daemon at the default priority
waited 4-5 s of a 6 s run for a CPU and the ring overflowed (15.8 % of the events lost with 16
busy processes on 2 cores). Draining costs the daemon a few percent of one core, so a higher
priority takes little from the work it records (docs/performance.md measures both).

A policy is ``"nice:N"`` (the default ``nice:-10``), ``"fifo:N"`` or ``"rr:N"`` (real time,
priority 1-99, for the loop's thread only, never inherited by child processes), or ``"off"``.
:meth:`Priority.apply` never fails: where the policy is not permitted (no CAP_SYS_NICE, a container, an
RLIMIT_RTPRIO of 0) it falls back to ``nice:-10``, then to the priority the daemon has, and says so
in the log.
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

DEFAULT = "nice:-10"
_POLICY = re.compile(r"^\s*(off|nice|fifo|rr)\s*(?::\s*([+-]?\d+))?\s*$", re.IGNORECASE)


def parse(text: str) -> str:
    """The policy in its normal form: ``"nice:-10"``, ``"fifo:10"``, ``"rr:1"`` or ``"off"``.

    Raises:
        ValueError: not a policy, or its number out of range (nice -20..19, fifo/rr 1..99).
    """
    match = _POLICY.match(str(text))
    if not match:
        raise ValueError(f"not a scheduling policy: {text!r} (examples: nice:-10, fifo:10, rr:10, off)")
    kind, number = match.group(1).lower(), match.group(2)
    if kind == "off":
        if number is not None:
            raise ValueError(f"'off' takes no number: {text!r}")
        return "off"
    if number is None:
        raise ValueError(f"{kind} needs a number: {kind}:N (e.g. nice:-10, fifo:10)")
    value = int(number)
    low, high = (-20, 19) if kind == "nice" else (1, 99)
    if not low <= value <= high:
        raise ValueError(f"{kind} priority must be in {low}..{high}, got {value}")
    return f"{kind}:{value}"


class Priority:
    """The loop thread's scheduling, raised by :meth:`apply` and given back by :meth:`restore`.

    Restoring matters where the daemon runs inside another program (``memrec record``, tests):
    that thread goes on, and whatever it starts later must not inherit the daemon's nice value.
    """

    def __init__(self, policy: str) -> None:
        self.policy = parse(policy)
        self._saved: tuple[int, int, int] | None = None  # (policy, rt priority, nice) before apply

    def apply(self) -> str:
        """Give the calling thread (the daemon's loop) the policy; return what it got, for the log.

        Call it before the daemon starts its threads: the NVML sampler inherits a nice value (it
        is brief work too). A real-time policy is set with SCHED_RESET_ON_FORK, so no process the
        daemon starts inherits it.
        """
        if self.policy == "off":
            return "unchanged (scheduling off)"
        self._saved = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority, os.getpriority(os.PRIO_PROCESS, 0))
        kind, _, number = self.policy.partition(":")
        value = int(number)
        if kind in ("fifo", "rr"):
            base = os.SCHED_FIFO if kind == "fifo" else os.SCHED_RR
            try:
                os.sched_setscheduler(0, base | os.SCHED_RESET_ON_FORK, os.sched_param(value))
                return f"SCHED_{kind.upper()} priority {value} for the loop"
            except OSError as error:
                log.warning("cannot run the loop at SCHED_%s %d (%s): trying %s", kind.upper(), value,
                            error.strerror or error, DEFAULT)
                kind, value = "nice", int(DEFAULT.partition(":")[2])
        try:
            os.setpriority(os.PRIO_PROCESS, 0, value)  # Linux: the calling thread (and threads it starts)
        except OSError as error:
            now = os.getpriority(os.PRIO_PROCESS, 0)
            log.warning("cannot set nice %d (%s): the daemon runs at nice %d and may lose events when the "
                        "traced processes keep every CPU busy", value, error.strerror or error, now)
            return f"nice {now} (nice {value} not permitted)"
        return f"nice {value}"

    def restore(self) -> None:
        """Give the thread back the policy and nice value it had before :meth:`apply` (idempotent)."""
        saved, self._saved = self._saved, None
        if saved is None:
            return
        policy, rt_priority, nice = saved
        try:
            os.sched_setscheduler(0, policy, os.sched_param(rt_priority))
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except OSError as error:  # lowering one's own priority is always allowed; log the surprise
            log.warning("cannot restore the thread's scheduling: %s", error.strerror or error)
