"""Whether memrec is asked for in this process: the one switch every way into the hooks reads.

A leaf module (only ``os``), so that the package root, the import hook and the wrappers share it
without importing one another.
"""

from __future__ import annotations

import os


def is_active(environ: dict | None = None) -> bool:
    """Whether memrec is asked for in this process.

    ``MEMREC=1`` turns the hooks on and ``MEMREC=0`` off; with ``MEMREC`` unset (or empty), a
    non-empty ``MEMREC_SOCKET`` (set by ``memrec record``) turns them on.
    """
    env = os.environ if environ is None else environ
    flag = env.get("MEMREC")
    if flag:
        return flag == "1"
    return bool(env.get("MEMREC_SOCKET"))
