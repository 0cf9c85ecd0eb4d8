"""Hand the C heap's free pages back to the system after the live state shrank.

numpy columns of a few MiB come from glibc's heap once its mmap threshold has risen (it does,
after the first such column is freed), and free heap pages stay in the process: the daemon kept
its peak RSS after every process had exited. ``malloc_trim(0)`` returns every free page of every
arena (glibc 2.8 and later), so the daemon calls it when a live-state table grew (× 1.5, its old
columns freed) or was compacted (:meth:`memrec.state.allocs.KeyTable.shrink`): rarely (a
logarithmic number of times), and only when there is memory to give, after each keyframe
(whose build freed a few dozen bytes per live allocation), and once the host goes quiet
(:class:`QuietTrim`). :func:`settle` keeps the large
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


class QuietTrim:
    """Trim the heap once after each busy spell, when the host has gone quiet.

    The tables' compaction and the keyframes trim when they free columns, but what the batches
    after the last such trim freed (decoded records, the planner's arrays: a few hundred kB each,
    from the heap) stays in the process: after every process of the realistic mix had exited, the
    daemon held 3 - 4 MiB more than before the workload (× 1.08 - 1.10 of its RSS then). The
    daemon's sweep (once a second) asks :meth:`sweep`, which trims when events were recorded since
    the last trim but none since the sweep before: once per busy spell, at a moment the loop has
    nothing else to do, and never on a host that records without a pause (the other trims serve it).
    """

    def __init__(self) -> None:
        self._seen = 0  # events recorded at the last sweep
        self._trimmed = 0  # events recorded at the last trim

    def sweep(self, recorded: int) -> bool:
        """Called about once a second with the events recorded so far; True when it trimmed."""
        quiet = recorded == self._seen
        self._seen = recorded
        if not quiet or recorded == self._trimmed:
            return False
        self._trimmed = recorded
        return give_back()
