"""memrec/base/heap.py: a streaming command keeps its freed pages for the next chunk.

``memrec dump`` frees a chunk's temporaries (tens of MiB, live at once) and asks for as much at the
next chunk. With glibc's defaults the freed heap top is trimmed and faulted in again, page by page,
every chunk; a page fault costs more on a loaded machine, which is how the dump's rate slipped
under load (docs/performance.md, "At a load of 2"). Each case runs in a fresh interpreter: the
policy is the whole process's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memrec.base import heap

# Four 16 MiB temporaries live at once, filled, freed: six chunks' worth; the page faults of each.
CHUNKS = """
import json, resource, sys
import numpy as np
from memrec.base import heap
took = heap.keep_freed_pages() if sys.argv[1] == "kept" else None
faults = []
for _ in range(6):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    parts = [np.empty(16 << 20, np.uint8) for _ in range(4)]
    for a in parts:
        a.fill(1)
    del parts, a
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"took": took, "faults": faults}))
"""


def chunks(policy: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHUNKS, policy], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


@pytest.mark.skipif(heap.libc() is None, reason="a C library without mallopt (musl, a static build)")
def test_the_next_chunk_reuses_the_last_ones_pages():
    kept, defaults = chunks("kept"), chunks("defaults")
    assert kept["took"] is True
    # the first chunk faults its 64 MiB in either way (4 KiB pages: about 16,000; fewer with huge pages)
    assert kept["faults"][0] > 0 and defaults["faults"][0] > 0
    # then: the defaults fault about as much again every chunk, the kept heap (nearly) nothing
    assert min(defaults["faults"][1:]) > defaults["faults"][0] / 2, defaults
    assert max(kept["faults"][1:]) < defaults["faults"][0] / 20, kept


def test_without_a_c_library_the_policy_is_left_alone(monkeypatch):
    monkeypatch.setattr(heap, "_libc", False)
    assert heap.libc() is None
    assert heap.keep_freed_pages() is False
