"""Sizes as every command shows them: ``memrec report``, ``memrec diff`` and the TUI read the same
``60.00 GiB``, so a number copied from one is found in the others."""

from __future__ import annotations


def fmt_bytes(n: int | float | None, signed: bool = False) -> str:
    """Bytes with binary units: ``777 B``, ``12.0 KiB``, ``146.1 MiB`` (one decimal), ``60.00 GiB``,
    ``1.50 TiB`` (two decimals); ``-`` for None. ``signed``: a delta, ``+`` before a positive value."""
    if n is None:
        return "-"
    n = int(n)
    sign = "-" if n < 0 else "+" if signed and n > 0 else ""
    a = abs(n)
    for unit, shift, digits in (("TiB", 40, 2), ("GiB", 30, 2), ("MiB", 20, 1), ("KiB", 10, 1)):
        if a >= 1 << shift:
            return f"{sign}{a / (1 << shift):.{digits}f} {unit}"
    return f"{sign}{a} B"
