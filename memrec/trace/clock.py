"""How far this host's wall clock may be from true time, as the kernel's NTP state says.

A trace's timestamps are CLOCK_MONOTONIC; its header ties them to the wall clock once (the
anchor). Traces of several hosts are put on one timeline through those anchors
(:mod:`memrec.trace.merge`), so the error of the merged timeline is the error of the hosts' wall
clocks. The kernel knows an estimate: ``adjtimex(2)`` (read-only with ``modes = 0``, no privilege)
gives the NTP daemon's estimated error (``esterror``) and maximum error (``maxerror``), in µs,
and whether the clock is synchronized at all (``STA_UNSYNC``, or the ``TIME_ERROR`` state).
chrony and ntpd keep these up to date; systemd-timesyncd sets them coarsely.
"""

from __future__ import annotations

import ctypes

_STA_UNSYNC = 0x0040
_TIME_ERROR = 5


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
