"""The selftest's fact matching: exact fields, one event per fact, GPU placement, exits."""

from __future__ import annotations

from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import Api
from memrec.terms.events import Kind
from tests.utils import ev
from tests.utils import events
from memrec.validation.selftest import check_exits
from memrec.validation.selftest import check_facts

HANDLE = bytes(range(64))



def test_every_fact_recorded_exactly_passes():
    # GIVEN an alloc, a free and an IPC export recorded on GPU 3
    recorded = events(
        ev(pid=10, kind=Kind.ALLOC, api=Api.cuMemAlloc_v2, size=123, ptr=0x1000, gpu=3),
        ev(pid=10, kind=Kind.FREE, api=Api.cuMemFree_v2, ptr=0x1000, gpu=3),
        ev(pid=10, kind=Kind.IPC_EXPORT, api=Api.cuIpcGetMemHandle, ptr=0x2000, gpu=3, ipc=HANDLE),
    )
    facts = [
        dict(call="cuMemAlloc_v2", pid=10, size=123, ptr=0x1000, result=0),
        dict(call="cuMemFree_v2", pid=10, ptr=0x1000, result=0),
        dict(call="cuIpcGetMemHandle", pid=10, ptr=0x2000, ipc=HANDLE.hex(), result=0),
    ]
    # WHEN they are checked
    results = check_facts(facts, recorded, expected_gpu=3)
    # THEN all pass
    assert [r.passed for r in results] == [True, True, True]


def test_wrong_size_wrong_gpu_and_reused_event_fail():
    # GIVEN one recorded alloc of 123 bytes on GPU 1
    recorded = events(ev(pid=10, kind=Kind.ALLOC, api=Api.cuMemAlloc_v2, size=123, ptr=0x1000, gpu=1))
    facts = [
        dict(call="cuMemAlloc_v2", pid=10, size=124, ptr=0x1000, result=0),  # size differs
        dict(call="cuMemAlloc_v2", pid=10, size=123, ptr=0x1000, result=0),  # on GPU 1, not 0
        dict(call="cuMemAlloc_v2", pid=10, size=123, ptr=0x1000, result=0),  # event already used
    ]
    # WHEN checked against GPU 0
    results = check_facts(facts, recorded, expected_gpu=0)
    # THEN each fails for its own reason
    assert [r.passed for r in results] == [False, False, False]
    assert results[0].detail == "not recorded"
    assert "GPU 1" in results[1].detail
    assert results[2].detail == "not recorded"


def test_ipc_bytes_must_be_present_and_equal():
    # GIVEN an IPC open whose handle bytes were not read
    recorded = events(ev(pid=11, kind=Kind.IPC_OPEN, api=Api.cuIpcOpenMemHandle_v2, ptr=0x9000, ipc=HANDLE))
    recorded["flags"][0] = 0
    fact = dict(call="cuIpcOpenMemHandle_v2", pid=11, ptr=0x9000, ipc=HANDLE.hex(), result=0)
    # WHEN / THEN it does not match without the flag, and matches with it
    assert not check_facts([fact], recorded, None)[0].passed
    recorded["flags"][0] = FLAG_IPC_BYTES
    assert check_facts([fact], recorded, None)[0].passed


def test_failed_allocation_matches_on_result():
    # GIVEN an out-of-memory alloc recorded with result 2
    recorded = events(ev(pid=10, kind=Kind.ALLOC, api=Api.cuMemAlloc_v2, size=1 << 40, result=2, gpu=0))
    ok = dict(call="cuMemAlloc_v2", pid=10, size=1 << 40, ptr=0, result=2)
    wrong = dict(call="cuMemAlloc_v2", pid=10, size=1 << 40, ptr=0, result=0)
    # WHEN / THEN the result is part of the match
    assert check_facts([ok], recorded, 0)[0].passed
    assert not check_facts([wrong], recorded, 0)[0].passed


def test_exits_checked_per_pid():
    # GIVEN an exit recorded for pid 10 only
    recorded = events(ev(pid=10, kind=Kind.PROC_EXIT, api=Api.sched_process_exit))
    # WHEN checking pids 10 and 11
    results = check_exits({10, 11}, recorded)
    # THEN 10 passes and 11 fails
    assert [(r.name, r.passed) for r in results] == [("process exit pid=10", True), ("process exit pid=11", False)]
