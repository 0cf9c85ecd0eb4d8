"""The cyclic garbage collector paused while a whole-trace command builds its answer.

A report of a busy host builds hundreds of thousands of small objects that never form cycles
(a row per process and GPU, a phase per marker pair); each full collection walks all of them, and
the allocations themselves trigger the collections: at 100,000 processes six full collections
took a sixth of ``memrec report``'s CPU time (issue 26). Reference counting frees everything as
usual while paused; whatever cycles there are are collected once, at the end.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Run the block without cyclic collections (the collector's state is restored after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
