"""The SGLang plugin (0.5.11+): entry point ``memrec`` of group ``sglang.srt.plugins``.

SGLang's ``load_plugins()`` runs first thing in every scheduler process (and in the launcher,
the detokenizer and the DP controller): it calls :func:`register`, then
``HookRegistry.apply_hooks()`` patches the registered targets. Packaging (pyproject.toml)::

    [project.entry-points."sglang.srt.plugins"]
    memrec = "memrec.sglang_hooks.plugin:register"

:func:`register` does nothing unless memrec is active (``MEMREC=1``, or ``MEMREC_SOCKET`` set and
``MEMREC`` unset). It registers nothing in processes that never hold model memory (the
launcher, the detokenizer, the DP controller), so that ``apply_hooks`` does not import the
model runner there; ``MEMREC_SGLANG_ALL_PROCESSES=1`` registers everywhere. SGLang's
``SGLANG_PLUGINS`` allowlist must name ``memrec`` when it is set.
"""

from __future__ import annotations

import logging
import os
import sys

from memrec.sglang_hooks import targets as _targets
from memrec.sglang_hooks import wrappers as _wrappers
from memrec.sglang_hooks.state import STATE

log = logging.getLogger("memrec.sglang_hooks")

#: SGLang functions that call ``load_plugins()`` in processes without model memory.
NON_MODEL_ENTRIES = frozenset(
    {
        "run_detokenizer_process",
        "run_data_parallel_controller_process",
        "run_multi_tokenizer_router_process",
        "run_detokenizer_router_process",
    }
)
#: The SGLang function that calls ``load_plugins()`` in a TP/PP worker.
SCHEDULER_ENTRY = "run_scheduler_process"


def _callers(depth: int = 40) -> set[str]:
    names = set()
    frame = sys._getframe(1)
    while frame is not None and depth > 0:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
        depth -= 1
    return names


def wanted_here() -> bool:
    """Whether this process may hold model memory (so the hooks are worth registering)."""
    if os.environ.get("MEMREC_SGLANG_ALL_PROCESSES") == "1":
        return True
    callers = _callers()
    if callers & NON_MODEL_ENTRIES:
        return False
    if SCHEDULER_ENTRY in callers:
        return True
    import multiprocessing

    # The launcher (no multiprocessing parent) only tokenizes; its workers are spawned children.
    return multiprocessing.parent_process() is not None


def register() -> None:
    """Register memrec's hooks with SGLang's ``HookRegistry`` (the entry point). Never raises."""
    try:
        if STATE.registered or not _wrappers.is_active():
            return
        STATE.registered = True
        if not wanted_here():
            log.debug("memrec: no SGLang hooks in this process (no model memory here)")
            return
        try:
            from sglang.srt.plugins.hook_registry import HookRegistry
            from sglang.srt.plugins.hook_registry import HookType
        except Exception as error:
            STATE.warn_once("no-registry", "memrec: SGLang's HookRegistry is not importable (%s)", error)
            return
        from memrec.sglang_hooks.bootstrap import sglang_version

        line = _targets.line_for_version(sglang_version())
        count = 0
        for spec in _targets.TARGETS[line]:
            found = _wrappers.resolve(spec)
            if found is None:
                _wrappers.report_missing(spec)
                continue
            if _wrappers.is_wrapped(found[2]):
                continue  # the .pth bootstrap hooked it already
            HookRegistry.register(spec.target, _wrappers.Hook(spec), HookType.AROUND)
            count += 1
        log.info("memrec: registered %d SGLang hooks (targets line %s)", count, line)
    except Exception as error:  # a plugin must never stop SGLang
        STATE.warn_once("plugin-error", "memrec: SGLang plugin failed: %s", error)
