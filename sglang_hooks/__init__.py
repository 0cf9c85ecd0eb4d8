"""In-process SGLang hooks: phase markers carrying SGLang's own memory numbers, from every worker.

Two ways in, both switched on only when memrec is asked for (``MEMREC=1``, or ``MEMREC_SOCKET``
set and ``MEMREC`` unset):

- SGLang 0.5.11+: the plugin :func:`memrec.sglang_hooks.plugin.register` (entry point
  ``memrec`` of group ``sglang.srt.plugins``);
- SGLang 0.4.10 – 0.5.10: a ``.pth`` file (:func:`install_pth`) whose line starts the import
  hook of :mod:`memrec.sglang_hooks.bootstrap` in every spawned worker.

Both apply the table of :mod:`memrec.sglang_hooks.targets` through the same wrappers
(:mod:`memrec.sglang_hooks.wrappers`). ``docs/sglang.md`` has the markers and their values.

This package's ``__init__`` imports only :mod:`memrec.sglang_hooks.active` (the switch): the
``.pth`` line and SGLang's plugin loader pay only for what they use.
"""

from __future__ import annotations

import os
from pathlib import Path

from memrec.sglang_hooks.active import is_active


def install_pth(site_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write ``memrec_sglang.pth`` into ``site_dir`` (default: this Python's site-packages).

    Raises:
        OSError: the directory is missing or not writable.
    """
    from memrec.sglang_hooks.bootstrap import install_pth as _install_pth

    return _install_pth(site_dir)


def uninstall_pth(site_dir: str | os.PathLike[str] | None = None) -> bool:
    """Remove ``memrec_sglang.pth`` from ``site_dir``; True when there was one."""
    from memrec.sglang_hooks.bootstrap import uninstall_pth as _uninstall_pth

    return _uninstall_pth(site_dir)


#: Short alias of :func:`uninstall_pth`.
uninstall = uninstall_pth

__all__ = ["install_pth", "is_active", "uninstall", "uninstall_pth"]
