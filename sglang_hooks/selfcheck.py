"""Every hook entry point on stand-ins shaped like SGLang's targets, to prove the hooks cost nothing.

Why it ships in the package: the promise "the hooks observe; they never allocate, initialise or
block" is only worth something where it can be checked — in SGLang's own environment, with its
torch and its driver. ``python -m memrec.sglang_hooks.selfcheck`` imports torch, calls
``torch.cuda.get_device_capability()`` (what SGLang 0.4.10 – 0.5.15 do at import time, which
makes ``torch.cuda.is_initialized()`` true without a context), then calls every hook of every
targets line the way SGLang would, and prints one JSON line: how many hooks ran, and whether
the process had a current CUDA context, or libcuda loaded, before and after. The unit tests and
the GPU test (``tests/gpu/test_sglang_no_context.py``) build their stand-ins here too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from typing import Any
from typing import Callable

from memrec.sglang_hooks import device as _device
from memrec.sglang_hooks import wrappers as _wrappers
from memrec.sglang_hooks.targets import TARGETS
from memrec.sglang_hooks.targets import HookSpec

_counter = [0]


def standin(spec: HookSpec, result: Any = None) -> tuple[types.ModuleType, Any]:
    """A module holding a function/class named and shaped as ``spec``'s target.

    Parameters are the ones the table says the hook reads; attributes read before the call are
    class attributes, those read after are set by the call; it returns ``result``.
    """
    _counter[0] += 1
    module = types.ModuleType(f"sglang_memrec_standin_{_counter[0]}")
    params = "".join(f", {p}=None" for p in spec.param_names)
    parts = spec.qualname.split(".")
    namespace: dict = {"RESULT": result, "NS": types.SimpleNamespace}
    if len(parts) == 1:
        src = f"def {parts[0]}({params.lstrip(', ')}):\n    return RESULT\n"
    else:
        cls, meth = parts
        lines = [f"class {cls}:"]
        for head in dict.fromkeys(a.split(".")[0] for a, _ in spec.attrs_before):
            dotted = {a.split(".", 1)[1]: f"before:{a}" for a, _ in spec.attrs_before if a.startswith(head + ".")}
            lines.append(f"    {head} = NS(**{dotted!r})" if dotted else f"    {head} = 'before:{head}'")
        if spec.static:
            lines += ["    @staticmethod", f"    def {meth}({params.lstrip(', ')}):", "        return RESULT"]
        else:
            lines += [f"    def {meth}(self{params}):"]
            lines += [f"        self.{a} = 'after:{a}'" for a, _ in spec.attrs_after]
            lines += ["        return RESULT"]
        src = "\n".join(lines) + "\n"
    exec(compile(src, f"<standin {spec.target}>", "exec"), namespace)
    for key, value in namespace.items():
        if key not in ("RESULT", "NS", "__builtins__"):
            setattr(module, key, value)
    return module, namespace[parts[0]]


def call_standin(spec: HookSpec, obj: Any, kwargs: dict) -> Any:
    """Call the stand-in as SGLang calls the target; a method returns ``(result, self)``."""
    parts = spec.qualname.split(".")
    if len(parts) == 1:
        return obj(**kwargs)
    cls, meth = obj, parts[1]
    if spec.static:
        return getattr(cls, meth)(**kwargs)
    instance = object.__new__(cls)
    return getattr(cls, meth)(instance, **kwargs), instance


def run_every_hook(send: Callable[[str, str, int | None, dict], None] | None = None) -> int:
    """Hook a stand-in of every target of every line and call it once; the number of calls."""
    calls = 0
    for specs in TARGETS.values():
        for spec in specs:
            module, _ = standin(spec, 1.0 if spec.result else None)
            _wrappers.patch_target(spec, module, send)
            obj = getattr(module, spec.qualname.split(".")[0])
            call_standin(spec, obj, {p: 1 for p in spec.param_names})
            calls += 1
    return calls


def driver_state() -> dict:
    """Whether libcuda is loaded here and the device of this thread's current context (if any)."""
    lib = _device.loaded_driver()
    return {"libcuda_loaded": lib is not None, "current_device": _device.current_device(lib) if lib else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m memrec.sglang_hooks.selfcheck",
        description="Call every SGLang hook on stand-ins and say whether a CUDA context appeared.",
    )
    parser.add_argument("--no-torch", action="store_true", help="do not import torch first")
    args = parser.parse_args(argv)
    capability = None
    if not args.no_torch:
        try:
            import torch

            capability = list(torch.cuda.get_device_capability())
        except Exception as error:  # no torch / no GPU: the check still runs
            capability = f"{type(error).__name__}: {error}"
    before = driver_state()
    sent: list = []
    calls = run_every_hook(lambda name, phase, gpu, values: sent.append(gpu))
    after = driver_state()
    ok = before["current_device"] == after["current_device"]
    print(json.dumps({"pid": os.getpid(), "capability": capability, "hooks_called": calls, "markers": len(sent),
                      "before": before, "after": after, "context_created": not ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
