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

What a marker carries is read by :mod:`memrec.sglang_hooks.values`; what the hooks remember in a
process (warnings given, open spans, the client) is in :data:`memrec.sglang_hooks.state.STATE`.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any
from typing import Callable

from memrec.sglang_hooks.active import is_active as _is_active
from memrec.sglang_hooks.device import device_values
from memrec.sglang_hooks.ranks import ranks
from memrec.sglang_hooks.state import STATE
from memrec.sglang_hooks.targets import GPU_MEMORY_MEASURED
from memrec.sglang_hooks.targets import MEMORY_BASELINE
from memrec.sglang_hooks.targets import HookSpec
from memrec.sglang_hooks.values import ArgReader
from memrec.sglang_hooks.values import caller
from memrec.sglang_hooks.values import error_text
from memrec.sglang_hooks.values import error_where
from memrec.sglang_hooks.values import mem_fraction_static
from memrec.sglang_hooks.values import parallel_config
from memrec.sglang_hooks.values import read_attrs
from memrec.sglang_hooks.values import scalar_values

log = logging.getLogger("memrec.sglang_hooks")

#: At most this many ``gpu_memory_measured`` markers per process (SGLang measures at startup;
#: a later caller that polls must not flood the daemon).
MEASURE_CAP = 4096
#: The attribute a memrec wrapper carries (the spec's key): tells both paths a target is done.
WRAPPED_ATTR = "__memrec_hook__"

#: Log a message the first time its key is seen in this process.
warn_once = STATE.warn_once


# -- activation --------------------------------------------------------------------------------


#: Re-exported: whether memrec is asked for (``MEMREC`` / ``MEMREC_SOCKET``).
is_active = _is_active


# -- sending -----------------------------------------------------------------------------------


def _send(name: str, phase: str, gpu: int | None, values: dict) -> None:
    """Hand one marker to ``memrec.client.mark`` (looked up at each call: tests replace it)."""
    if STATE.client is None:
        try:
            from memrec import client as _c
        except Exception as error:  # memrec half-installed: hooks stay quiet
            warn_once("client-import", "memrec: cannot import memrec.client (%s); no SGLang markers", error)
            STATE.client = False
            return
        STATE.client = _c
    if STATE.client is False:
        return
    STATE.client.mark(name, phase=phase, gpu=gpu, **values)


# -- the hook ----------------------------------------------------------------------------------


class _Span:
    __slots__ = ("spec", "collected")

    def __init__(self, spec: HookSpec) -> None:
        self.spec = spec
        self.collected: dict = {}


def _stack() -> list:
    stack = getattr(STATE.tls, "stack", None)
    if stack is None:
        stack = STATE.tls.stack = []
    return stack


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
        self._reader: ArgReader | None = None
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
            reader = ArgReader(original, names)
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
        if STATE.version and STATE.version[0]:  # looked up once by the bootstrap or the plugin
            out.setdefault("sglang_version", STATE.version[0])  # a fleet compares releases by it
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
                parallel_config(obj, bound, begin)
            if "mem_fraction_static" in spec.extras and "mem_fraction_static" not in begin:
                mem_fraction_static(obj, begin)
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
            caller(values)
            if exc is None:
                self._offer_measurement(values)
            STATE.measure_count += 1
            if STATE.measure_count > MEASURE_CAP:
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
