"""Typed sections that serialise to the report's JSON, shared by the report's families (the
report's own sections in :mod:`memrec.analysis.report.model`, the SGLang section in
:mod:`memrec.analysis.sglang.model`).

Builders and renderers share these classes, not string keys: a renamed field fails in a type
checker and at import, not in one CLI test. :meth:`Section.to_json` gives the JSON: each field in
declaration order, under its own name, so that the JSON is the one the report always printed. A
field left at :data:`OMITTED` is not in the JSON at all (keys the report only has sometimes); a
field made with :func:`flatten` puts its section's keys into its parent's; one made with
:func:`hidden` is never in the JSON (what the builders and renderers share beyond it); one made
with :func:`renamed` goes under another name (a JSON key that is a Python keyword).
"""

from __future__ import annotations

from dataclasses import field
from dataclasses import fields
from typing import Any
from typing import ClassVar


class _Omitted:
    """The value of a field that is not in the JSON (not None: None is ``null``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "OMITTED"

    def __bool__(self) -> bool:
        return False


OMITTED: Any = _Omitted()


def flatten() -> Any:
    """A field whose section's keys go into the parent's JSON (absent when the field is None)."""
    return field(default=None, metadata={"flatten": True})


def hidden(default: Any = 0) -> Any:
    """A field the builders and renderers share that is not in the JSON (a sort key, say)."""
    return field(default=default, metadata={"json": False})


def renamed(name: str, default: Any = OMITTED) -> Any:
    """A field whose JSON key is ``name`` (``in``, which no Python field can be called)."""
    return field(default=default, metadata={"key": name})


class Section:
    """A dataclass that serialises to the report's JSON (see the module docstring)."""

    _plan: ClassVar[tuple[tuple[str, str, bool], ...]]

    @classmethod
    def _json_plan(cls) -> tuple[tuple[str, str, bool], ...]:
        """The fields in the JSON, their keys and which of them flatten (worked out once per class)."""
        plan = cls.__dict__.get("_plan")
        if plan is None:
            plan = tuple((f.name, f.metadata.get("key", f.name), bool(f.metadata.get("flatten")))
                         for f in fields(cls) if f.metadata.get("json", True))  # type: ignore[arg-type]
            cls._plan = plan
        return plan

    def to_json(self) -> dict:
        plan = self._json_plan()
        out: dict = {}
        for name, json_key, flat in plan:
            v = getattr(self, name)
            if flat:
                if v is not None:
                    out.update(v.to_json())
            elif type(v) in _SCALARS:  # most fields: no call (100,000 process rows)
                out[json_key] = v
            elif v is not OMITTED:
                out[json_key] = to_json(v)
        return out


def to_json(v: Any) -> Any:
    """``v`` as JSON-able values: anything with a ``to_json`` (sections, the answer) by it,
    containers copied."""
    if type(v) in _SCALARS:
        return v
    if isinstance(v, (list, tuple)):
        return [x if type(x) in _SCALARS else to_json(x) for x in v]
    if isinstance(v, dict):
        return {k: x if type(x) in _SCALARS else to_json(x) for k, x in v.items()}
    if isinstance(v, (str, int, float)):  # subclasses (a numpy scalar never reaches here: builders convert)
        return v
    return v.to_json()


_SCALARS = frozenset((int, float, str, bool, type(None)))
