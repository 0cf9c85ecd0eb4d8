"""Fixed-width text tables shared by the report, its SGLang section and the diff."""

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


def count(n: int, word: str) -> str:
    """``1 process``, ``2 processes``, ``1,024 events``: a count with its noun in the right number."""
    plural = word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")
    return f"{n:,} {word if n == 1 else plural}"
