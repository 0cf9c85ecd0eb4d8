"""daemon/heap.py: the daemon gives its heap back once the host has gone quiet.

What batches free after the tables' last compaction stays in the process unless something trims
it (issue 26: "the daemon gives memory back"). :class:`QuietTrim` trims once per busy spell, at the
first sweep that saw no new event. The decision is checked with the trim counted; the effect in a
fresh interpreter (the heap is the whole process's), with a heap left fragmented on purpose so
that glibc's own trim of the heap top cannot return it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memrec.base import heap as base_heap
from memrec.daemon import heap


def test_it_trims_once_per_busy_spell_and_only_when_quiet(monkeypatch):
    trims = []
    monkeypatch.setattr(heap, "give_back", lambda: trims.append(1) or True)
    quiet = heap.QuietTrim()
    assert quiet.sweep(0) is False  # nothing recorded yet
    assert quiet.sweep(0) is False
    for recorded in (100, 250, 900):  # busy: new events at every sweep
        assert quiet.sweep(recorded) is False
    assert trims == []
    assert quiet.sweep(900) is True  # the first quiet sweep trims
    assert quiet.sweep(900) is False  # and not again while quiet
    assert quiet.sweep(900) is False
    assert len(trims) == 1
    assert quiet.sweep(950) is False  # a new spell
    assert quiet.sweep(950) is True
    assert len(trims) == 2


# Half a GiB of 64 KiB numpy arrays (on the heap: under the daemon's 1 MiB mmap threshold), every
# 16th kept: the freed pages lie between live ones. RSS after freeing, then after two quiet sweeps.
FRAGMENTED = """
import json, sys
import numpy as np
from memrec.daemon import heap
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
heap.settle()
quiet = heap.QuietTrim()
blocks = [np.ones(64 << 10, np.uint8) for _ in range(8192)]
quiet.sweep(len(blocks))
kept = blocks[::16]
del blocks
freed = rss()
if sys.argv[1] == "sweep":
    quiet.sweep(8192)
    quiet.sweep(8192)
print(json.dumps({"freed": freed, "after": rss(), "kept": len(kept)}))
"""


def fragmented(how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FRAGMENTED, how], capture_output=True, text=True, check=True,
                         timeout=60)
    return json.loads(out.stdout)


@pytest.mark.skipif(base_heap.libc() is None, reason="a C library without malloc_trim (musl, a static build)")
def test_the_quiet_sweep_gives_the_freed_heap_back():
    swept, left = fragmented("sweep"), fragmented("none")
    mib = 1 << 20
    # without the trim the freed 480 MiB stay in the process; the quiet sweep gives back most of them
    assert left["freed"] > 400 * mib and left["freed"] - left["after"] < 16 * mib, left
    assert swept["freed"] > 400 * mib and swept["freed"] - swept["after"] > 300 * mib, swept
