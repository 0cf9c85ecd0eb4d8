"""The hook logic both ways in share: the SGLang plugin (0.5.11+) and the ``.pth`` bootstrap.

A :class:`Hook` is called as ``hook(original, *args, **kwargs)`` (SGLang's ``HookType.AROUND``
protocol); :func:`wrap_function` turns it into a plain wrapper for the bootstrap and
:func:`patch_target` installs that wrapper on a loaded module (keeping ``staticmethod`` /
``classmethod``, and rebinding stale ``from X import f`` names the way SGLang's
``_propagate_patch`` does).

Rules every hook keeps, whatever happens:

- the hooked function runs exactly once, with the same arguments; its return value is returned
  as is and its exception is re-raised as the same object (bare ``raise``);
- a hook never calls a collective (no ``distributed=True``, no ``torch.distributed``), never
  creates a CUDA context or allocates (device numbers are read only where the calling thread
  already has a current context: :mod:`memrec.sglang_hooks.device`), never imports torch, and
  never blocks (markers go through :func:`memrec.client.mark`, which drops rather than waits);
- anything that goes wrong inside a hook is logged once and that hook turns itself off;
- a target that is missing on this SGLang is logged once and stays off.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from typing import Any
from typing import Callable

from memrec.sglang_hooks import device as _device
from memrec.sglang_hooks import is_active as _is_active
from memrec.sglang_hooks import ranks as _ranks
from memrec.sglang_hooks.device import device_values
from memrec.sglang_hooks.ranks import ranks
from memrec.sglang_hooks.targets import GPU_MEMORY_MEASURED
from memrec.sglang_hooks.targets import MEMORY_BASELINE
from memrec.sglang_hooks.targets import HookSpec

log = logging.getLogger("memrec.sglang_hooks")

#: At most this many ``gpu_memory_measured`` markers per process (SGLang measures at startup;
#: a later caller that polls must not flood the daemon).
MEASURE_CAP = 4096
#: Error texts are cut to this many characters.
MAX_ERROR_TEXT = 1000
#: The attribute a memrec wrapper carries (the spec's key): tells both paths a target is done.
WRAPPED_ATTR = "__memrec_hook__"

_HOOK_FILES = frozenset({__file__, os.path.abspath(__file__)})
_warned: set[str] = set()
_warned_lock = threading.Lock()
_tls = threading.local()


def warn_once(key: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
    """Log ``message`` the first time ``key`` is seen in this process."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.log(level, message, *args)


# -- activation --------------------------------------------------------------------------------


#: Re-exported: whether memrec is asked for (``MEMREC`` / ``MEMREC_SOCKET``).
is_active = _is_active


# -- sending -----------------------------------------------------------------------------------

_client_module: Any = None


def _send(name: str, phase: str, gpu: int | None, values: dict) -> None:
    """Hand one marker to ``memrec.client.mark`` (looked up at each call: tests replace it)."""
    global _client_module
    if _client_module is None:
        try:
            from memrec import client as _c
        except Exception as error:  # memrec half-installed: hooks stay quiet
            warn_once("client-import", "memrec: cannot import memrec.client (%s); no SGLang markers", error)
            _client_module = False
            return
        _client_module = _c
    if _client_module is False:
        return
    _client_module.mark(name, phase=phase, gpu=gpu, **values)


# -- values ------------------------------------------------------------------------------------


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
        if code.co_filename not in _HOOK_FILES:
            frames.append(f"{_short_path(code.co_filename)}:{tb.tb_lineno} in {code.co_name}")
        tb = tb.tb_next
    if not frames:
        return
    out["error_at"] = frames[-1][:MAX_ERROR_TEXT]
    out["error_traceback"] = " ← ".join(reversed(frames[-MAX_ERROR_FRAMES:]))[:MAX_ERROR_TEXT]


def _caller(out: dict) -> None:
    """Name the function that called the hooked one (hook frames skipped)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename in _HOOK_FILES or filename.endswith("hook_registry.py"):
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


def _parallel_config(obj: Any, bound: dict, out: dict) -> None:
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


def _mem_fraction_static(obj: Any, out: dict) -> None:
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


# -- argument reading --------------------------------------------------------------------------


class _ArgReader:
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


# -- the hook ----------------------------------------------------------------------------------


class _Span:
    __slots__ = ("spec", "collected")

    def __init__(self, spec: HookSpec) -> None:
        self.spec = spec
        self.collected: dict = {}


def _stack() -> list:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


_measure_count = 0


class Hook:
    """One spec's hook, callable as ``hook(original, *args, **kwargs)``.

    Args:
        spec: the row of the targets table.
        send: where markers go (default: :func:`memrec.client.mark`); ``send(name, phase, gpu,
            values)``.
    """

    def __init__(self, spec: HookSpec, send: Callable[[str, str, int | None, dict], None] | None = None) -> None:
        self.spec = spec
        self.off = False
        self._send = send or _send
        self._reader: _ArgReader | None = None
        self._reader_for: Any = None
        self._is_method = "." in spec.qualname and not spec.static

    # The one entry point ----------------------------------------------------------------------

    def __call__(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        if self.off:
            return original(*args, **kwargs)
        token = self._enter(original, args, kwargs)
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            self._exit(token, args, None, exc)
            raise
        self._exit(token, args, result, None)
        return result

    # Internals (never raise) ------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        self.off = True
        warn_once(
            f"hook-error:{self.spec.key}",
            "memrec: SGLang hook on %s failed (%s: %s); it is off for this process",
            self.spec.target,
            type(error).__name__,
            error,
        )

    def _bound(self, original: Callable, args: tuple, kwargs: dict) -> dict:
        names = self.spec.param_names + (("server_args",) if "parallel_config" in self.spec.extras else ())
        if not names:
            return {}
        if self._reader is None or self._reader_for is not original:
            reader = _ArgReader(original, names)
            real_missing = [n for n in reader.missing if n in self.spec.param_names]
            if real_missing:
                warn_once(
                    f"params:{self.spec.key}",
                    "memrec: %s has no parameter(s) %s on this SGLang; not recorded",
                    self.spec.target,
                    ", ".join(real_missing),
                    level=logging.INFO,
                )
            self._reader, self._reader_for = reader, original
        return self._reader.read(args, kwargs)

    def _common(self, obj: Any, out: dict) -> int | None:
        out.update(ranks(obj))
        gpu = device_values(out)
        gpu_id = getattr(obj, "gpu_id", None) if obj is not None else None
        if isinstance(gpu_id, int) and not isinstance(gpu_id, bool):
            out.setdefault("gpu_id", gpu_id)
        return gpu

    def _enter(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        try:
            spec = self.spec
            obj = args[0] if self._is_method and args else None
            bound = self._bound(original, args, kwargs)
            begin: dict = {}
            for param, key in spec.params:
                if param in bound:
                    scalar_values(key, bound[param], begin)
            read_attrs(obj, spec.attrs_before, begin)
            if "parallel_config" in spec.extras:
                _parallel_config(obj, bound, begin)
            if "mem_fraction_static" in spec.extras and "mem_fraction_static" not in begin:
                _mem_fraction_static(obj, begin)
            if "class_name" in spec.extras and obj is not None:
                begin["custom_ar_class"] = type(obj).__name__
            if spec.hook == "around":
                values = dict(begin)
                gpu = self._common(obj, values)
                self._send(spec.marker, "begin", gpu, values)
                span = _Span(spec)
                _stack().append(span)
                return (span, begin, obj)
            if spec.hook == "before":
                values = dict(begin)
                gpu = self._common(obj, values)
                self._send(spec.marker, "instant", gpu, values)
                return None
            return (None, begin, obj)  # after
        except Exception as error:
            self._fail(error)
            return None

    def _exit(self, token: Any, args: tuple, result: Any, exc: BaseException | None) -> None:
        if token is None:
            return
        try:
            span, begin, obj = token
            if span is not None:
                stack = _stack()
                for i in range(len(stack) - 1, -1, -1):  # pop ours even if an inner one leaked
                    if stack[i] is span:
                        del stack[i:]
                        break
            self._finish(span, begin, obj, result, exc)
        except Exception as error:
            self._fail(error)

    def _finish(self, span: _Span | None, begin: dict, obj: Any, result: Any, exc: BaseException | None) -> None:
        global _measure_count
        spec = self.spec
        values: dict = dict(begin)  # end markers repeat the begin values: each is self-contained
        if exc is None:
            if spec.result is not None:
                scalar_values(spec.result, result, values)
            read_attrs(result, spec.result_attrs, values)
            read_attrs(obj, spec.attrs_after, values)
        else:
            values["error"] = error_text(exc)
            error_where(exc, values)
        if spec.marker == GPU_MEMORY_MEASURED:
            _caller(values)
            if exc is None:
                self._offer_measurement(values)
            _measure_count += 1
            if _measure_count > MEASURE_CAP:
                warn_once("measure-cap", "memrec: more than %d gpu_memory_measured markers; no more", MEASURE_CAP)
                return
        if spec.contribute:
            stack = _stack()
            if stack:
                stack[-1].collected.update(values)
        if span is not None:
            values.update(span.collected)
        if spec.marker is None:
            return
        gpu = self._common(obj, values)
        phase = "end" if spec.hook == "around" else "instant"
        self._send(spec.marker, phase, gpu, values)
        if spec.baseline_from and exc is None and values.get(spec.baseline_from) is not None:
            baseline = {spec.baseline_from: values[spec.baseline_from]}
            for key in ("gpu_id", "is_draft_worker"):
                if key in begin:
                    baseline[key] = begin[key]
            self._common(obj, baseline)
            self._send(MEMORY_BASELINE, "instant", gpu, baseline)

    @staticmethod
    def _offer_measurement(values: dict) -> None:
        """Give a measurement to the innermost open span that wants one (first one wins)."""
        stack = _stack()
        if not stack:
            return
        span = stack[-1]
        if not span.spec.capture_measurement or "available_gpu_memory" in span.collected:
            return
        if "result_gib" in values:
            span.collected["available_gpu_memory"] = values["result_gib"]
            span.collected["available_gpu_memory_distributed"] = bool(values.get("distributed"))


# -- installing --------------------------------------------------------------------------------


def is_wrapped(fn: Any) -> bool:
    """Whether ``fn`` (or anything it wraps) is a memrec wrapper."""
    seen = 0
    while fn is not None and seen < 32:
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        if getattr(fn, WRAPPED_ATTR, None):
            return True
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


def wrap_function(fn: Callable, hook: Hook) -> Callable:
    """A plain wrapper calling ``hook(fn, *args, **kwargs)``, marked as memrec's."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return hook(fn, *args, **kwargs)

    setattr(wrapper, WRAPPED_ATTR, hook.spec.key)
    return wrapper


def resolve(spec: HookSpec, module: Any = None) -> tuple[Any, str, Any] | None:
    """Find ``spec``'s target: ``(owner, attribute name, raw attribute)`` or None when missing.

    ``module`` is the loaded module (the bootstrap passes it); otherwise it is taken from
    ``sys.modules`` or imported. A method must be defined on the class the table names (not
    inherited), so that the table stays exact.
    """
    try:
        if module is None:
            module = sys.modules.get(spec.module)
            if module is None:
                import importlib

                module = importlib.import_module(spec.module)
        owner = module
        parts = spec.qualname.split(".")
        for part in parts[:-1]:
            owner = getattr(owner, part)
        name = parts[-1]
        if isinstance(owner, type):
            raw = owner.__dict__.get(name)
        else:
            raw = getattr(owner, name, None)
        if raw is None or not (callable(raw) or isinstance(raw, (staticmethod, classmethod))):
            return None
        return owner, name, raw
    except Exception:
        return None


def report_missing(spec: HookSpec) -> None:
    """Log, once, that a target is missing on this SGLang (the hook stays off). A target that
    only the later releases of its line have (``spec.since``) is expected to be missing: debug."""
    warn_once(
        f"missing:{spec.key}",
        "memrec: SGLang target %s not found on this version; hook %s stays off",
        spec.target,
        spec.marker or "(span values)",
        level=logging.DEBUG if spec.since else logging.INFO,
    )


def rebind_stale(original: Any, wrapped: Any, source: Any, prefixes: tuple[str, ...] = ("sglang",)) -> int:
    """Point stale ``from X import f`` bindings of ``original`` at ``wrapped``.

    Like SGLang's ``_propagate_patch``, but only in modules under ``prefixes`` (and
    ``__main__``): SGLang's own functions are only imported by SGLang, and this keeps the walk
    short in a process with thousands of modules.
    """
    count = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or mod is source:
            continue
        if not (name == "__main__" or name.startswith(prefixes)):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, value in items:
            if value is original:
                try:
                    setattr(mod, attr, wrapped)
                    count += 1
                except (AttributeError, TypeError):
                    pass
    return count


def patch_target(spec: HookSpec, module: Any = None, send: Callable | None = None) -> bool:
    """Wrap ``spec``'s target in place; True when it is (now or already) hooked.

    Keeps ``staticmethod``/``classmethod``; for a module-level function, also rebinds stale
    imported names. A missing target is logged once and left alone.
    """
    found = resolve(spec, module)
    if found is None:
        report_missing(spec)
        return False
    owner, name, raw = found
    if is_wrapped(raw):
        return True
    if isinstance(raw, staticmethod):
        fn, rewrap = raw.__func__, staticmethod
    elif isinstance(raw, classmethod):
        fn, rewrap = raw.__func__, classmethod
    else:
        fn, rewrap = raw, None
    wrapper = wrap_function(fn, Hook(spec, send))
    setattr(owner, name, rewrap(wrapper) if rewrap else wrapper)
    if not isinstance(owner, type):
        rebind_stale(fn, wrapper, owner)
    log.debug("memrec: hooked %s (%s → %s)", spec.target, spec.hook, spec.marker)
    return True


def reset_for_tests() -> None:
    """Forget caches and warnings (tests only)."""
    global _measure_count, _client_module
    _ranks.reset_for_tests()
    _measure_count = 0
    _client_module = None
    _device.reset_for_tests()
    with _warned_lock:
        _warned.clear()
    _tls.__dict__.pop("stack", None)
