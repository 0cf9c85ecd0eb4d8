"""PyTorch segment actions matched against recorded events: exact, tiled, and missing."""

from __future__ import annotations

from memrec.validation.crosscheck import crosscheck_segments
from memrec.terms.events import Kind
from tests.utils import ev
from tests.utils import events

MiB = 2**20



def test_segment_alloc_and_free_match_exactly():
    # GIVEN a 2 MiB segment alloc and its free recorded for pid 5
    recorded = events(
        ev(pid=5, kind=Kind.ALLOC, ptr=0x10000, size=2 * MiB),
        ev(pid=5, kind=Kind.FREE, ptr=0x10000),
    )
    actions = [
        dict(action="segment_alloc", addr=0x10000, size=2 * MiB),
        dict(action="segment_free", addr=0x10000, size=2 * MiB),
    ]
    # WHEN cross-checked
    check = crosscheck_segments(actions, 5, recorded)
    # THEN both match
    assert (check.matched, check.total, check.ok) == (2, 2, True)


def test_size_mismatch_other_pid_and_failed_call_do_not_match():
    # GIVEN allocs with the wrong size, in another pid, and a failed one
    recorded = events(
        ev(pid=5, kind=Kind.ALLOC, ptr=0x10000, size=MiB),
        ev(pid=6, kind=Kind.ALLOC, ptr=0x10000, size=2 * MiB),
        ev(pid=5, kind=Kind.ALLOC, ptr=0x10000, size=2 * MiB, result=2),
    )
    # WHEN the 2 MiB segment of pid 5 is checked
    check = crosscheck_segments([dict(action="segment_alloc", addr=0x10000, size=2 * MiB)], 5, recorded)
    # THEN it is missing
    assert (check.matched, check.ok) == (0, False)
    assert check.missing == [dict(action="segment_alloc", addr=0x10000, size=2 * MiB)]


def test_segment_map_is_tiled_by_granule_maps():
    # GIVEN three 20 MiB maps, contiguous, recorded out of order
    base = 0x7F0000000000
    recorded = events(
        ev(pid=5, kind=Kind.VMM_MAP, ptr=base + 20 * MiB, size=20 * MiB),
        ev(pid=5, kind=Kind.VMM_MAP, ptr=base, size=20 * MiB),
        ev(pid=5, kind=Kind.VMM_MAP, ptr=base + 40 * MiB, size=20 * MiB),
    )
    # WHEN PyTorch says it mapped 60 MiB at base, then 20 MiB more that nobody mapped
    check = crosscheck_segments(
        [dict(action="segment_map", addr=base, size=60 * MiB), dict(action="segment_map", addr=base + 60 * MiB, size=20 * MiB)],
        5,
        recorded,
    )
    # THEN the first is tiled exactly and the second is missing
    assert (check.matched, check.total) == (1, 2)


def test_gap_in_tiling_is_not_a_match():
    # GIVEN maps at base and base+40 MiB only
    base = 0x7F0000000000
    recorded = events(
        ev(pid=5, kind=Kind.VMM_UNMAP, ptr=base, size=20 * MiB),
        ev(pid=5, kind=Kind.VMM_UNMAP, ptr=base + 40 * MiB, size=20 * MiB),
    )
    # WHEN a 60 MiB unmap is checked
    check = crosscheck_segments([dict(action="segment_unmap", addr=base, size=60 * MiB)], 5, recorded)
    # THEN it does not match
    assert check.matched == 0
