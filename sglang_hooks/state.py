"""What the SGLang hooks remember in a process, in one object with one lifecycle.

The hooks live in SGLang's processes, so their state is per process: :data:`STATE` is the only
instance, and every module of the package reads and writes its fields here instead of keeping
module globals of its own.

- **install**: :func:`memrec.sglang_hooks.bootstrap.install` puts its import hook in
  :attr:`HookState.finder`; :func:`memrec.sglang_hooks.plugin.register` sets
  :attr:`HookState.registered`. Both are process-wide and survive a fork: a forked child runs
  the parent's (already hooked) modules.
- **after a fork**: :meth:`HookState.after_fork` runs in the child (``os.register_at_fork``) and
  gives it what a new process has: fresh locks (a lock another thread held at the fork would never
  be released there), no warnings given yet, no markers counted, ranks, title and CUDA contexts
  read anew (the child may be another rank; contexts do not cross a fork). It only clears
  Python objects: nothing that could touch CUDA, allocate on a device, or block.
- **uninstall**: :meth:`HookState.uninstall` takes the finder out; hooks already applied stay
  (they are harmless without a daemon). :meth:`HookState.reset` also forgets everything else
  (tests only).

This module imports only the standard library's ``logging``, ``os``, ``sys`` and ``threading``: the
``.pth`` bootstrap loads it in every Python process that has ``MEMREC=1``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

log = logging.getLogger("memrec.sglang_hooks")


class HookState:
    """The hooks' state in this process (one instance: :data:`STATE`)."""

    def __init__(self) -> None:
        #: bootstrap: the import hook on ``sys.meta_path`` while installed, and the lock that makes
        #: install/uninstall atomic.
        self.finder: Any = None
        self.install_lock = threading.Lock()
        #: plugin: :func:`~memrec.sglang_hooks.plugin.register` has run.
        self.registered = False
        #: bootstrap: ``[version or None]`` and ``[targets line or None]`` once looked up.
        self.version: list = []
        self.line: list = []
        #: wrappers: ``memrec.client`` once imported (False when it cannot be).
        self.client: Any = None
        #: wrappers: each thread's stack of open spans (``tls.stack``).
        self.tls = threading.local()
        self._per_process()

    def _per_process(self) -> None:
        #: Keys of the warnings already logged in this process (:meth:`warn_once`).
        self.warned: set[str] = set()
        self.warned_lock = threading.Lock()
        #: ``gpu_memory_measured`` markers sent in this process (capped by wrappers.MEASURE_CAP).
        self.measure_count = 0
        #: ranks: this process's ranks once SGLang's groups exist; its SGLang title once seen;
        #: when /proc/self/cmdline was last read for one.
        self.rank_cache: dict | None = None
        self.title_cache: str | None = None
        self.title_read_at = -1.0
        #: device: the already-loaded driver, UUID per ordinal, device per context handle.
        self.driver: Any = None
        self.driver_lock = threading.Lock()
        self.uuid_cache: dict[int, str | None] = {}
        self.ctx_device: dict[int, int] = {}

    def warn_once(self, key: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
        """Log ``message`` the first time ``key`` is seen in this process."""
        with self.warned_lock:
            if key in self.warned:
                return
            self.warned.add(key)
        log.log(level, message, *args)

    def after_fork(self) -> None:
        """In a forked child: what a new process starts with (see the module's docstring)."""
        self.install_lock = threading.Lock()
        self._per_process()

    def uninstall(self) -> None:
        """Stop watching imports (hooks already applied stay: they are harmless without a daemon)."""
        with self.install_lock:
            if self.finder is not None:
                try:
                    sys.meta_path.remove(self.finder)
                except ValueError:
                    pass
                self.finder = None

    def reset(self) -> None:
        """Uninstall, and forget everything the hooks learnt or registered (tests only)."""
        self.uninstall()
        self._per_process()
        self.registered = False
        self.version.clear()
        self.line.clear()
        self.client = None
        self.tls.__dict__.pop("stack", None)


#: The one instance.
STATE = HookState()
os.register_at_fork(after_in_child=STATE.after_fork)
