"""Fixed-width text shared by the report, its SGLang section and the diff: byte counts and tables."""

from __future__ import annotations


def table(headers: list[str], rows: list[list[str]], right: set[int], indent: str = "  ") -> list[str]:
    """Lines of a table: columns as wide as their widest cell; ``right``: right-aligned columns."""
    widths = [len(h) for h in headers]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]

    def line(cells: list[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(out)).rstrip()

    return [line(headers)] + [line(r) for r in rows]


def human(n: int | None) -> str:
    """Bytes as B, KiB, MiB (one decimal) or GiB, TiB (two decimals); ``-`` for None."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    a = abs(n)
    if a < 1024:
        return f"{sign}{a} B"
    for unit, shift, digits in (("TiB", 40, 2), ("GiB", 30, 2), ("MiB", 20, 1), ("KiB", 10, 1)):
        if a >= 1 << shift:
            return f"{sign}{a / (1 << shift):.{digits}f} {unit}"
    raise AssertionError("unreachable")
