"""Hand the C heap's free pages back to the system after the live state shrank.

numpy columns of a few MiB come from glibc's heap once its mmap threshold has risen (it does,
after the first such column is freed), and free heap pages stay in the process: the daemon kept
its peak RSS after every process had exited. ``malloc_trim(0)`` returns every free page of every
arena (glibc 2.8 and later), so the daemon calls it when a live-state table grew (× 1.5, its old
columns freed) or was compacted (:meth:`memrec.state.allocs.KeyTable.shrink`): rarely (a
logarithmic number of times), and only when there is memory to give.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_trim = None


def give_back() -> bool:
    """``malloc_trim(0)``; False where the C library has none (musl, a static build)."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            _trim.argtypes = [ctypes.c_size_t]
            _trim.restype = ctypes.c_int
        except (OSError, AttributeError):
            log.debug("no malloc_trim in this C library: freed heap pages stay with the daemon")
            _trim = False
    return bool(_trim) and bool(_trim(0))
