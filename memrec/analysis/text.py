"""Fixed-width text shared by the report, its SGLang section and the diff: byte counts and tables."""

from __future__ import annotations

import re
import textwrap

import numpy as np

from memrec.base.untrusted import clean_text
from memrec.terms.units import fmt_bytes as human  # noqa: F401 (the one size format, re-exported for the report's modules)


def table(
    headers: list[str],
    rows: list[list[str]],
    right: set[int],
    indent: str = "  ",
    width: int | None = None,
    drop: tuple[int, ...] = (),
    wrap: bool = False,
) -> list[str]:
    """Lines of a table: columns as wide as their widest cell; ``right``: right-aligned columns.

    With ``width``: the columns in ``drop`` are left out, in that order, while the table is wider;
    then, with ``wrap``, the last column (free text) wraps onto continuation lines under itself.
    Cells are never cut.
    """
    # a cell as it will be shown: a client's escapes printed as text are wider than the raw cell
    # (a row whose text is all printable, nearly every row, is kept as it is: one C-speed test)
    rows = [r if "".join(r).isprintable() else [clean_text(cell, keep_newlines=True) for cell in r] for r in rows]
    keep = list(range(len(headers)))

    def widths_of(cols: list[int]) -> list[int]:
        return [max(len(headers[c]), max((len(r[c]) for r in rows), default=0)) for c in cols]

    widths = widths_of(keep)
    total = len(indent) + sum(widths) + 2 * (len(keep) - 1)
    if width is not None:
        for c in drop:
            if total <= width:
                break
            keep.remove(c)
            widths = widths_of(keep)
            total = len(indent) + sum(widths) + 2 * (len(keep) - 1)

    def line(cells: list[str], ws: list[int]) -> str:
        out = [just(c, w) for just, c, w in zip(justify, cells, ws)]
        return (indent + "  ".join(out)).rstrip()

    justify = [str.rjust if k in right else str.ljust for k in keep]
    room = None  # the last column's room when it wraps beside the others
    below = None  # its room when it goes on lines of its own, under the row
    if width is not None and wrap and total > width:
        room = width - (total - widths[-1])
        longest_word = max((len(w) for r in rows for w in r[keep[-1]].split()), default=0)
        if room >= max(20, longest_word):
            widths[-1] = min(widths[-1], room)
        else:
            room = None
            below = width - len(indent) - 4
            widths[-1] = len(headers[keep[-1]])
    out = [line([headers[c] for c in keep], widths)]
    for r in rows:
        cells = [r[c] for c in keep]
        limit = room if room is not None else below
        if limit is None or len(cells[-1]) <= (room if room is not None else widths[-1]):
            out.append(line(cells, widths))
            continue
        pieces = textwrap.wrap(cells[-1], limit, break_long_words=False, break_on_hyphens=False) or [""]
        if room is not None:
            out.append(line(cells[:-1] + [pieces[0]], widths))
            out.extend(line([""] * (len(cells) - 1) + [p], widths) for p in pieces[1:])
        else:
            out.append(line(cells[:-1] + [""], widths))
            out.extend(indent + "    " + p for p in pieces)
    return out


#: Where an equation may break: before a relation, or before a top-level minus (see _equation).
_RELATION = re.compile(r" (?=[=≤≥] )| (?=− )")


def _equation(text: str, width: int) -> list[str] | None:
    """A too-long equation (``rest = a − b × (1 − f) = ...``) broken before its relations and its
    minus signs outside parentheses, each continuation aligned under the first relation (a minus
    two columns further in), so no term is split; None when ``text`` is no equation or a piece
    is still too wide."""
    first = re.search(r" [=≤≥] ", text)
    if first is None or first.start() > width * 3 // 5:  # prose that mentions an equation wraps as prose
        return None
    col = first.start() + 1
    pieces: list[str] = []
    start = 0
    for m in _RELATION.finditer(text, first.end()):
        if text[: m.start()].count("(") != text[: m.start()].count(")"):
            continue  # inside parentheses: (1 − f) stays whole
        pieces.append(text[start : m.start()])
        start = m.end()
    pieces.append(text[start:])
    out = [pieces[0]]
    for piece in pieces[1:]:
        indent = col if piece[0] in "=≤≥" else col + 2
        if len(out[-1]) + 1 + len(piece) <= width:
            out[-1] += " " + piece
        else:
            out.append(" " * indent + piece)
    return out if all(len(line) <= width for line in out) else None


def fit_lines(lines: list[str], width: int) -> list[str]:
    """Every line at most ``width`` wide: an equation breaks before its ``=`` and ``−`` signs
    (:func:`_equation`); other lines wrap at spaces, continued 4 columns further in (a word longer
    than the room stays whole rather than being cut)."""
    out = []
    for text in lines:
        if len(text) <= width:
            out.append(text)
            continue
        if set(text) <= {"=", "-"}:  # a title's underline
            out.append(text[:width])
            continue
        equation = _equation(text, width)
        if equation is not None:
            out.extend(equation)
            continue
        lead = len(text) - len(text.lstrip(" "))
        out.extend(
            textwrap.wrap(text.lstrip(" "), width, initial_indent=" " * lead,
                          subsequent_indent=" " * min(lead + 4, width // 2), break_long_words=False,
                          break_on_hyphens=False)
        )
    return out


def count(n: int, word: str) -> str:
    """``1 process``, ``2 processes``, ``1,024 events``: a count with its noun in the right number."""
    plural = word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")
    return f"{n:,} {word if n == 1 else plural}"


def seconds(ns: int) -> float:
    """Nanoseconds as seconds, rounded to the microsecond (the JSON's ``*_s`` fields)."""
    return round(ns / 1e9, 6)


#: Up to this many ns (13 days) a time's double is within 1.3e-10 s of the exact value, less than
#: the 1 ns between the exact value and a rounding tie: :func:`seconds_of` can round the integer.
_EXACT_NS = 1 << 50


def seconds_of(ns: np.ndarray) -> list[float]:
    """:func:`seconds` of each of ``ns`` (integers), the same floats, worked out with numpy (a
    step loop's 25,000 phases made 50,000 ``round`` calls).

    ``round(ns / 1e9, 6)`` is the double nearest the decimal rounding of ``ns / 1e9`` to the
    microsecond: ``k / 1e6`` for the nearest whole ``k`` µs. Away from a tie (``ns`` ending in
    500) the double's rounding is the exact value's; ties, and times past :data:`_EXACT_NS`, are
    left to :func:`seconds`.
    """
    ns = np.asarray(ns, dtype=np.int64)
    whole, rem = np.divmod(ns, 1000)
    k = whole + (rem > 500)
    out = (k / 1e6).tolist()
    for i in np.flatnonzero(k == 0).tolist():  # -0.0 where the time is negative, as round() gives
        out[i] = seconds(int(ns[i]))
    for i in np.flatnonzero((rem == 500) | (np.abs(ns) >= _EXACT_NS)).tolist():
        out[i] = seconds(int(ns[i]))
    return out


def signed_human(n: int) -> str:
    """A signed byte delta: ``+18.00 GiB``, ``-2.0 MiB``, ``0 B``."""
    return ("+" if n > 0 else "") + human(n)


def scalar(value: object) -> str:
    """A marker's or a fact's value as the trace and the JSON spell it: ``true``, ``false`` and
    ``null`` rather than Python's ``True``/``False``/``None``; anything else as str() has it."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)
