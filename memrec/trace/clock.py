"""A trace's clock: its CLOCK_MONOTONIC timestamps as wall-clock time, and how far this host's wall
clock may be from true time, as the kernel's NTP state says.

A trace's timestamps are CLOCK_MONOTONIC; its header ties them to the wall clock once (the
anchor: one simultaneous reading of both). :func:`wall_offset_ns` is the one place that turns the
anchor into monotonic -> wall: the merge joins hosts with it, the exports' ``wall_ns`` columns (to
join with DCGM or Prometheus samples, which carry wall-clock time) are made with it. Traces of several hosts are put on one timeline through those anchors
(:mod:`memrec.engine.merge`), so the error of the merged timeline is the error of the hosts' wall
clocks. The kernel knows an estimate: ``adjtimex(2)`` (read-only with ``modes = 0``, no privilege)
gives the NTP daemon's estimated error (``esterror``) and maximum error (``maxerror``), in µs,
and whether the clock is synchronized at all (``STA_UNSYNC``, or the ``TIME_ERROR`` state).
chrony and ntpd keep these up to date; systemd-timesyncd sets them coarsely.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

_STA_UNSYNC = 0x0040
_TIME_ERROR = 5


def wall_offset_ns(header: dict) -> int | None:
    """``wall_ns - monotonic_ns`` of the header's anchor (add it to a ``ts``), or None without one.

    The anchor is read once when recording starts: a wall clock stepped later (NTP) is not
    followed, so a wall time is as right as the host's clock was then (:func:`read_clock_sync`).
    """
    anchor = header.get("anchor")
    try:
        return int(anchor["wall_ns"]) - int(anchor["monotonic_ns"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None


def to_wall_ns(header: dict, ts: Any) -> Any:
    """A trace ``ts`` (CLOCK_MONOTONIC ns; an int or an int64 array) as wall-clock ns since the
    epoch, or None when the header has no anchor."""
    offset = wall_offset_ns(header)
    if offset is None:
        return None
    if isinstance(ts, np.ndarray):
        return ts.astype(np.int64) + np.int64(offset)
    return int(ts) + offset


class _Timex(ctypes.Structure):
    """The leading fields of ``struct timex`` (x86-64 and arm64 Linux), padded to its full size."""

    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("rest", ctypes.c_char * 256),
    ]


def read_clock_sync() -> dict | None:
    """``{"synchronized", "esterror_us", "maxerror_us"}`` from ``adjtimex``, or None if unreadable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        tx = _Timex()
        state = libc.adjtimex(ctypes.byref(tx))
    except (OSError, AttributeError):
        return None
    if state < 0:
        return None
    return {
        "synchronized": state != _TIME_ERROR and not tx.status & _STA_UNSYNC,
        "esterror_us": int(tx.esterror),
        "maxerror_us": int(tx.maxerror),
    }
