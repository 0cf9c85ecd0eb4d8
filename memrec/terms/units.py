"""Sizes and durations as every command shows and reads them: ``memrec report``, ``memrec diff``
and the TUI write the same ``60.00 GiB``, so a number copied from one is found in the others, and
the daemon's options and the TUI's filter read sizes with the one parser below."""

from __future__ import annotations

import math

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
#: The largest size read: what a trace's int64 fields and numpy's comparisons hold (8 EiB), so a
#: mistyped size is a usage error, not a crash after the daemon attached its probes.
SIZE_MAX = (1 << 63) - 1


#: The driver's "no limit" as a size (a pool's release threshold set to UINT64_MAX), never a real size.
UNLIMITED = (1 << 64) - 1


def fmt_bytes(n: int | float | None, signed: bool = False) -> str:
    """Bytes with binary units: ``777 B``, ``12.0 KiB``, ``146.1 MiB`` (one decimal), ``60.00 GiB``,
    ``1.50 TiB`` (two decimals); ``-`` for None; ``unlimited`` for :data:`UNLIMITED` (it was
    ``16777216.00 TiB``). ``signed``: a delta, ``+`` before a positive value."""
    if n is None:
        return "-"
    n = int(n)
    if n == UNLIMITED:
        return "unlimited"
    sign = "-" if n < 0 else "+" if signed and n > 0 else ""
    a = abs(n)
    for unit, shift, digits in (("TiB", 40, 2), ("GiB", 30, 2), ("MiB", 20, 1), ("KiB", 10, 1)):
        if a >= 1 << shift:
            return f"{sign}{a / (1 << shift):.{digits}f} {unit}"
    return f"{sign}{a} B"


def parse_size(text: str | int) -> int:
    """``"512M"`` → 536870912. Units K, M, G, T, P are powers of 1024 (``MiB``/``MB``/``M`` alike),
    so what :func:`fmt_bytes` writes (``1.50 GiB``) reads back.

    Raises:
        ValueError: not a non-negative size, or one over :data:`SIZE_MAX` (8 EiB).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if not 0 <= text <= SIZE_MAX:
            raise ValueError(f"size must be 0 to 8 EiB, got {text}")
        return text
    match = _SIZE.match(str(text))
    if not match or (match.group(3) and match.group(3).lower() == "i"):
        raise ValueError(f"not a byte size: {text!r} (examples: 0, 4096, 512M, 1G, 1.5GiB)")
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if not value <= SIZE_MAX:  # also an infinity: 400 digits are more than a float holds
        raise ValueError(f"not a byte size: {text!r} is over 8 EiB")
    return int(value)


def fmt_at(ns: int | float, resolution: int | float) -> str:
    """A time since the trace's start (ns) as seconds with enough decimals that two times
    ``resolution`` ns apart read differently (at an 18 ms zoom ``7.7380s`` and ``7.7398s``, not
    ``7.74s`` twice); at least two decimals, as :func:`fmt_dur`."""
    if abs(ns) >= 60e9 and resolution >= 1e9:
        return fmt_dur(ns)
    decimals = min(max(2, math.ceil(-math.log10(max(resolution, 1) / 1e9))), 9)
    return f"{ns / 1e9:.{decimals}f}s"


def fmt_dur(ns: int | float) -> str:
    """A duration in nanoseconds: ``850ns``, ``12.3ms``, ``4.20s``, ``3m05s``, ``2h03m``."""
    ns = float(ns)
    neg = ns < 0
    ns = abs(ns)
    if ns < 1e3:
        s = f"{ns:.0f}ns"
    elif ns < 1e6:
        s = f"{ns / 1e3:.1f}us"
    elif ns < 1e9:
        s = f"{ns / 1e6:.1f}ms"
    elif ns < 60e9:
        s = f"{ns / 1e9:.2f}s"
    elif ns < 3600e9:
        m, sec = divmod(int(ns / 1e9), 60)
        s = f"{m}m{sec:02d}s"
    else:
        h, m = divmod(int(ns / 60e9), 60)
        s = f"{h}h{m:02d}m"
    return "-" + s if neg else s
