"""Handling values that come from someone else: marker clients, other users' processes, files.

Three dangers, one place each:

- **terminal escapes**: a marker name, a marker value or another user's command line printed raw
  can retitle, clear or reprogram the reader's terminal (``ESC]0;...BEL``, ``ESC[2J``).
  :func:`clean_text` makes any string safe to print: every control character (C0, DEL, C1) and
  every Unicode format character (bidi overrides) is shown as a visible escape instead.
- **unbounded repr**: ``repr()`` of a 1000-deep nested list raises RecursionError, and of a huge
  map takes the memory of the map. :func:`short_repr` describes any value in at most ``limit``
  characters without recursing.
- **deep nesting**: msgpack decodes objects nested up to 1024 levels, deeper than Python's own
  recursion limit; json, ``==``, ``repr`` and copies then fail. :func:`too_deep` tells without
  recursing, so decoders can refuse such input before anything walks it.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see memrec.TYPE_CHECKING)

if TYPE_CHECKING:  # typing only for the checker: `memrec mark` imports this (see memrec.TYPE_CHECKING)
    from typing import Any

#: Nesting that every memrec record and message stays far below (a keyframe is about 5 deep).
MAX_DEPTH = 32

_CONTAINERS = (list, tuple, dict)
_CONTAINER_TYPES = frozenset(_CONTAINERS)


#: What a terminal acts on: C0 controls, DEL, C1 controls (ESC, CSI, OSC...), and the Unicode
#: format characters that reorder or hide text (bidi overrides and isolates, zero-width marks).
_UNSAFE = [*range(0x20), *range(0x7F, 0xA0), 0x061C, 0x180E, *range(0x200B, 0x2010), *range(0x202A, 0x202F),
           *range(0x2060, 0x2070), 0xFEFF]
_ESCAPED = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNSAFE}
_ESCAPED_KEEP_LINES = {c: v for c, v in _ESCAPED.items() if c not in (0x0A, 0x09)}


def clean_text(value: Any, limit: int | None = None, *, keep_newlines: bool = False) -> str:
    """``value`` as text that is safe to print on a terminal, at most ``limit`` characters.

    Control and format characters become visible escapes (``\\x1b``); ``\\n`` and ``\\t`` too,
    unless ``keep_newlines``. A value that is not a string is shown with :func:`short_repr`.
    """
    if not isinstance(value, str):
        value = short_repr(value, limit or 200)
    if limit is not None and len(value) > limit:
        value = value[: max(limit - 1, 0)] + "…"
    if value.isprintable():  # none of _UNSAFE is (a test checks it): most text, without a copy
        return value
    return value.translate(_ESCAPED_KEEP_LINES if keep_newlines else _ESCAPED)


def short_repr(value: Any, limit: int = 80) -> str:
    """A description of ``value`` of at most ``limit`` characters, whatever its size or depth.

    Scalars are shown with ``repr`` (strings cut first); containers by type and size, with their
    first scalar items when they hold any (never walked further).
    """
    if isinstance(value, str):
        text = repr(value[: limit + 1])
    elif isinstance(value, (bytes, bytearray, memoryview)):
        text = f"<{len(value)} bytes>"
    elif value is None or isinstance(value, (bool, int, float)):
        text = repr(value)
    elif isinstance(value, _CONTAINERS):
        kind = type(value).__name__
        items = list(value.items())[:4] if isinstance(value, dict) else list(value[:4])
        shown = []
        for item in items:
            parts = item if isinstance(value, dict) else (item,)
            if any(isinstance(p, _CONTAINERS) for p in parts):
                shown.append("…")
                break
            shown.append(": ".join(short_repr(p, 20) for p in parts))
        text = f"<{kind} of {len(value)}: {', '.join(shown)}>" if shown else f"<{kind} of {len(value)}>"
    else:
        text = f"<{type(value).__name__}>"
    if len(text) > limit:
        text = text[: max(limit - 1, 0)] + "…"
    return clean_text(text)


def too_deep(value: Any, max_depth: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests lists/maps more than ``max_depth`` levels (checked without recursion).

    Flat lists of scalars (a keyframe's tables) are passed over at C speed: only the types of
    their items are collected; a map's keys are looked at only when one is a container (a
    record's are strings: every marker and process record of a file comes through here).
    """
    if not isinstance(value, _CONTAINERS):
        return False
    stack = [(value, 1)]
    while stack:
        obj, depth = stack.pop()
        if depth > max_depth:
            return True
        if isinstance(obj, dict):
            children = obj.values()
            if not _CONTAINER_TYPES.isdisjoint(map(type, obj)):
                children = [*obj, *children]
        else:
            children = obj
        if _CONTAINER_TYPES.isdisjoint(map(type, children)):
            continue
        # an empty one goes no deeper: looked at only when it is itself one level too many
        stack.extend((c, depth + 1) for c in children if type(c) in _CONTAINER_TYPES and (c or depth >= max_depth))
    return False


def clean_marker(marker: Any) -> Any:
    """A :class:`~memrec.terms.events.Marker` with its name and text values made safe to print."""
    name = clean_text(marker.name)
    if name == marker.name and marker.values == {}:  # most markers: nothing to make safe, none copied
        return marker
    # Imported here (after the common case: an import statement a marker was a tenth of the TUI's
    # intake of one): dataclasses (with inspect and ast) costs milliseconds of `memrec mark`'s
    # start-up, which reaches this module through the protocol and never calls this.
    import dataclasses

    values = {clean_text(k): clean_text(v) if isinstance(v, str) else v for k, v in (marker.values or {}).items()}
    return dataclasses.replace(marker, name=name, values=values)
