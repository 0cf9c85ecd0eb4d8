"""JSON text that every parser reads: no NaN or infinity.

A marker's values come from its client, and ``memrec mark x a=nan`` or ``memrec.mark(...,
a=float("inf"))`` are taken (msgpack carries them, the trace keeps them). JSON has no such
numbers: Python writes ``NaN`` and ``Infinity``, which strict parsers refuse (JavaScript's
``JSON.parse``, Go's ``encoding/json``, ``jq`` 1.5). Every JSON output (``dump``, ``--json``, the
fleet's dataset, ``memrec.load``'s marker values) writes them as ``null``, as JavaScript's
``JSON.stringify`` does. The walk runs only for a document that holds one: the common one is
encoded once, as before.
"""

from __future__ import annotations

import json
import math
from typing import Any
from typing import Callable


def finite(obj: Any) -> Any:
    """``obj`` (dicts, lists and tuples of plain values) with every float that is not finite as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def strict(encode: Callable[[Any], str]) -> Callable[[Any], str]:
    """``encode`` (a JSONEncoder's, made with ``allow_nan=False``) that writes a document holding
    a NaN or an infinity with them as null instead of refusing it."""

    def encode_finite(obj: Any) -> str:
        try:
            return encode(obj)
        except ValueError:  # "Out of range float values are not JSON compliant"
            return encode(finite(obj))

    return encode_finite


def dumps(obj: Any, **options: Any) -> str:
    """``json.dumps(obj, **options)`` with NaN and infinities as null."""
    return strict(json.JSONEncoder(allow_nan=False, **options).encode)(obj)
