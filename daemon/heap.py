"""Hand the C heap's free pages back to the system after the live state shrank.

numpy columns of a few MiB come from glibc's heap once its mmap threshold has risen (it does,
after the first such column is freed), and free heap pages stay in the process: the daemon kept
its peak RSS after every process had exited. ``malloc_trim(0)`` returns every free page of every
arena (glibc 2.8 and later), so the daemon calls it when a live-state table grew (× 1.5, its old
columns freed) or was compacted (:meth:`memrec.state.allocs.KeyTable.shrink`): rarely (a
logarithmic number of times), and only when there is memory to give, and after each keyframe
(whose build freed a few dozen bytes per live allocation). :func:`settle` keeps the large
buffers out of the heap in the first place. (A command that streams a trace wants the opposite:
:func:`memrec.base.heap.keep_freed_pages`.)
"""

from __future__ import annotations

from memrec.base.heap import M_MMAP_THRESHOLD
from memrec.base.heap import libc

#: Allocations from this size on are memory maps of their own (returned to the system when
#: freed), whatever glibc's dynamic threshold would have risen to (up to 32 MiB).
MMAP_THRESHOLD = 1 << 20


def settle() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (once, at the daemon's start): the
    live state's columns and a keyframe's buffers (MiBs each at a million live allocations) are
    then maps that go back to the system when freed, not heap that fragments; batches (a few
    hundred kB) stay on the heap."""
    lib = libc()
    return lib is not None and bool(lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def give_back() -> bool:
    """``malloc_trim(0)``; False where the C library has none (musl, a static build)."""
    lib = libc()
    return lib is not None and bool(lib.malloc_trim(0))
