"""The values the SGLang hooks put in a marker: scalars from SGLang's objects, arguments, results
and errors, read without calling anything that could allocate, initialise CUDA or block.

Split from :mod:`memrec.sglang_hooks.wrappers` (the hook and its installing) along that seam:
everything here is a pure read of Python objects, frames and tracebacks.
"""

from __future__ import annotations

import os
import sys
from typing import Any
from typing import Callable

#: Error texts are cut to this many characters.
MAX_ERROR_TEXT = 1000
#: The hooks' own source files: their frames are skipped when naming the caller or where an
#: error was raised (a frame's file name is the path as imported: relative or absolute).
_HERE = os.path.dirname(__file__)
HOOK_FILES = frozenset(
    path for name in ("wrappers.py", "values.py")
    for path in (os.path.join(_HERE, name), os.path.abspath(os.path.join(_HERE, name)))
)


def scalar_values(key: str, value: Any, out: dict) -> None:
    """Store ``value`` under ``key`` as protocol scalars (dicts are flattened as ``key.sub``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        out[key] = value
        return
    if isinstance(value, dict):
        for sub, item in list(value.items())[:32]:
            if isinstance(item, dict):  # one level only
                item = str(item)
            scalar_values(f"{key}.{sub}", item, out)
        return
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        try:
            got = item()
        except Exception:
            got = None
        if isinstance(got, (bool, int, float)):
            out[key] = got
            return
    try:
        out[key] = str(value)[:200]
    except Exception:
        out[key] = f"<{type(value).__name__}>"


def error_text(exc: BaseException) -> str:
    """``"Type: message"``, cut to :data:`MAX_ERROR_TEXT`."""
    try:
        return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT]
    except Exception:
        return type(exc).__name__


#: At most this many frames (innermost first) in ``error_traceback``.
MAX_ERROR_FRAMES = 12


def _short_path(path: str) -> str:
    """``…/site-packages/sglang/srt/x.py`` → ``sglang/srt/x.py`` (else the path as is)."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    return path


def error_where(exc: BaseException, out: dict) -> None:
    """Add where ``exc`` was raised: ``error_at`` (``file:line in function``, the raising frame)
    and ``error_traceback`` (innermost first, the hook's own frames left out). Reads no source
    file: only the traceback's code objects and line numbers."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename not in HOOK_FILES:
            frames.append(f"{_short_path(code.co_filename)}:{tb.tb_lineno} in {code.co_name}")
        tb = tb.tb_next
    if not frames:
        return
    out["error_at"] = frames[-1][:MAX_ERROR_TEXT]
    out["error_traceback"] = " ← ".join(reversed(frames[-MAX_ERROR_FRAMES:]))[:MAX_ERROR_TEXT]


def caller(out: dict) -> None:
    """Name the function that called the hooked one (hook frames skipped)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename in HOOK_FILES or filename.endswith("hook_registry.py"):
            frame = frame.f_back
            continue
        break
    if frame is None:
        return
    # The hook runs after the hooked function returned: the first frame outside the hook
    # machinery is its caller.
    out["caller"] = qualname_of(frame)
    out["caller_module"] = frame.f_globals.get("__name__", "?")


def qualname_of(frame: Any) -> str:
    """The qualified name of ``frame``'s function: ``co_qualname`` (3.11+); on 3.10, looked up
    through its ``self``/``cls`` (the class that defines it, behind any wrappers), else the
    bare name."""
    code = frame.f_code
    name = getattr(code, "co_qualname", None)
    if name:
        return name
    first = code.co_varnames[0] if code.co_argcount else None
    owner = frame.f_locals.get(first) if first in ("self", "cls") else None
    cls = owner if isinstance(owner, type) else type(owner) if owner is not None else None
    for klass in getattr(cls, "__mro__", ()):
        fn = klass.__dict__.get(code.co_name)
        for _ in range(8):
            fn = getattr(fn, "__func__", fn)
            if fn is None or getattr(fn, "__code__", None) is code:
                break
            fn = getattr(fn, "__wrapped__", None)
        if fn is not None:
            return getattr(fn, "__qualname__", f"{klass.__name__}.{code.co_name}")
    return code.co_name


def parallel_config(obj: Any, bound: dict, out: dict) -> None:
    ctx = sys.modules.get("sglang.srt.runtime_context")
    if ctx is not None:  # 0.5.16+: the published runtime context
        try:
            parallel = ctx.get_parallel()
            for key in ("tp_size", "pp_size", "dp_size"):
                try:
                    scalar_values(key, getattr(parallel, key), out)
                except Exception:
                    pass
        except Exception:
            pass
        try:
            out["mem_fraction_static"] = float(ctx.get_schedule().mem_fraction_static)
        except Exception:
            pass
        try:
            out["disable_custom_all_reduce"] = bool(ctx.get_exec().comm.disable_custom_all_reduce)
        except Exception:
            pass
    server_args = bound.get("server_args") or getattr(obj, "server_args", None)
    if server_args is not None:
        for key in ("tp_size", "pp_size", "dp_size", "mem_fraction_static", "disable_custom_all_reduce"):
            if key in out:
                continue
            try:
                value = getattr(server_args, key)
            except Exception:
                continue
            scalar_values(key, value, out)


def mem_fraction_static(obj: Any, out: dict) -> None:
    value = getattr(obj, "mem_fraction_static", None) if obj is not None else None
    if value is None:
        ctx = sys.modules.get("sglang.srt.runtime_context")
        if ctx is not None:
            try:
                value = ctx.get_schedule().mem_fraction_static
            except Exception:
                value = None
    if value is None:
        server_args = getattr(obj, "server_args", None)
        value = getattr(server_args, "mem_fraction_static", None) if server_args is not None else None
    if value is not None:
        scalar_values("mem_fraction_static", value, out)


def read_attrs(source: Any, pairs: tuple[tuple[str, str], ...], out: dict) -> None:
    """Store ``source.attr`` under ``key`` for each ``(attr, key)``; a dotted attribute
    (``ps.tp_rank``) is read through the objects it names; a missing one is skipped."""
    for attr, key in pairs:
        try:
            value = source
            for part in attr.split("."):
                value = getattr(value, part)
        except Exception:
            continue
        scalar_values(key, value, out)


# -- arguments ---------------------------------------------------------------------------------


class ArgReader:
    """Reads named parameters from ``(args, kwargs)`` without ``inspect.Signature.bind``."""

    __slots__ = ("names", "positions", "defaults", "missing")

    def __init__(self, fn: Callable, names: tuple[str, ...]) -> None:
        import inspect

        self.names = names
        self.positions: dict[str, int] = {}
        self.defaults: dict[str, Any] = {}
        self.missing: tuple[str, ...] = ()
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            self.missing = names
            return
        index = {p.name: i for i, p in enumerate(params)}
        missing = []
        for name in names:
            if name not in index:
                missing.append(name)
                continue
            param = params[index[name]]
            if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                self.positions[name] = index[name]
            if param.default is not param.empty:
                self.defaults[name] = param.default
        self.missing = tuple(missing)

    def read(self, args: tuple, kwargs: dict) -> dict:
        out = {}
        for name in self.names:
            if name in kwargs:
                out[name] = kwargs[name]
                continue
            pos = self.positions.get(name)
            if pos is not None and pos < len(args):
                out[name] = args[pos]
            elif name in self.defaults:
                out[name] = self.defaults[name]
        return out
