"""glibc's heap, tuned for what a process does with it: the C library's handle, and the policy of
a command that streams a trace chunk by chunk.

A chunk's temporaries (``memrec dump``: its columns, their text, the lines: tens of MiB for
65,536 events) are freed and asked for again at the next chunk. With glibc's defaults each of
them is a memory map of its own, or heap top that is trimmed when freed, so the next chunk faults
the same pages in again, one by one, each zeroed by the kernel: 117,000 page faults for the dump
of 10M events. A fault costs more on a loaded machine (the zeroing competes for memory bandwidth),
which made the dump's rate slip under load more than its floor's (docs/performance.md, "At a load
of 2"). :func:`keep_freed_pages` keeps them in the process instead. The daemon (``daemon/heap.py``)
wants the opposite, its memory back after a peak, through the same handle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
#: A streaming command's allocations below this come from the heap (glibc's own upper bound for
#: the threshold on 64-bit: 32 MiB), whatever size they are freed at.
KEEP_MMAP_THRESHOLD = 32 << 20
#: ... and free heap top is given back only past this.
KEEP_TRIM_THRESHOLD = 128 << 20

_libc: ctypes.CDLL | bool | None = None


def libc() -> ctypes.CDLL | None:
    """The C library with ``mallopt`` and ``malloc_trim``; None where it has neither (musl, a
    static build): then the heap keeps the C library's own policy."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.malloc_trim.argtypes = [ctypes.c_size_t]
            lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            _libc = lib
        except (OSError, AttributeError):
            log.debug("no malloc_trim/mallopt in this C library: the heap keeps its own policy")
            _libc = False
    return _libc or None


def keep_freed_pages() -> bool:
    """Keep freed memory in the process for the next chunk (a command that streams, for its
    whole run): allocations under :data:`KEEP_MMAP_THRESHOLD` from the heap, its free top given
    back past :data:`KEEP_TRIM_THRESHOLD`. The peak is the same (a chunk's temporaries are
    reused, not added to); True when the C library took both settings."""
    lib = libc()
    return (lib is not None and bool(lib.mallopt(M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD))
            and bool(lib.mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)))
