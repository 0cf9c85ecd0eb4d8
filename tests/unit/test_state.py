"""LiveState: owned vs mapped accounting, VMM lifetimes, IPC, exits, gpu fill-in, keyframes."""

from __future__ import annotations

import zlib

import msgpack
import numpy as np
import pytest

from memrec.terms.columns import RAW_DTYPE
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.state import LiveState
from memrec.state import alloc_rows
from tests.utils import GiB
from tests.utils import KiB
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events
from tests.utils import handle_bytes


def applied(*rows, journal: bool = False) -> tuple[LiveState, np.ndarray]:
    arr = events(*rows)
    state = LiveState(journal=journal)
    state.apply(arr)
    state.check()
    return state, arr


# ------------------------------------------------------------------------------- driver allocations


def test_alloc_and_free_across_pids_and_gpus():
    # GIVEN two processes allocating on two GPUs, one free
    state, _ = applied(
        ev(Kind.ALLOC, pid=10, ptr=0x1000, size=3 * MiB, gpu=0),
        ev(Kind.ALLOC, pid=10, ptr=0x9000, size=5 * MiB, gpu=1),
        ev(Kind.ALLOC, pid=20, ptr=0x1000, size=7 * MiB, gpu=0),  # same ptr, other process
        ev(Kind.FREE, pid=10, ptr=0x1000),
    )
    # THEN each (gpu, pid) holds exactly what it allocated and did not free
    assert state.totals() == {0: {20: {"driver": 7 * MiB}}, 1: {10: {"driver": 5 * MiB}}}
    assert state.owned_bytes(gpu=0) == 7 * MiB
    assert state.owned_bytes(gpu=1, pid=10, category="driver") == 5 * MiB
    assert state.owned_bytes() == 12 * MiB
    assert state.owned_bytes(pid=10) == 5 * MiB
    assert state.pids() == [10, 20]
    # AND the peak of GPU 0 was both processes at once
    assert state.peaks()[0] == (10 * MiB, 3000)


def test_free_of_unknown_pointer_changes_nothing_and_is_counted():
    # GIVEN a free of memory allocated before the recording
    state, arr = applied(
        ev(Kind.ALLOC, pid=1, ptr=0x1000, size=MiB, gpu=0),
        ev(Kind.FREE, pid=1, ptr=0x2000),
        ev(Kind.FREE, pid=2, ptr=0x1000),  # another process's pointer value
    )
    # THEN the live allocation is intact and the unmatched frees are noted
    assert state.owned_bytes(gpu=0) == MiB
    assert state.anomalies == {"free_unknown": 2}
    assert arr["gpu"].tolist() == [0, -1, -1]


def test_gpu_is_filled_in_where_the_state_knows_it():
    # GIVEN events whose gpu the daemon could not resolve (-1)
    state, arr = applied(
        ev(Kind.ALLOC, pid=1, ptr=0x1000, size=MiB, gpu=3),
        ev(Kind.VMM_CREATE, pid=1, size=2 * MiB, handle=7, gpu=5),
        ev(Kind.VMM_MAP, pid=1, ptr=0x50000, size=2 * MiB, handle=7),
        ev(Kind.IPC_EXPORT, pid=1, ptr=0x1000, ipc=handle_bytes(1)),
        ev(Kind.IPC_OPEN, pid=2, ptr=0x7000, ipc=handle_bytes(1), gpu=4),
        ev(Kind.HOST_ALLOC, pid=1, ptr=0x8000, size=KiB),
        ev(Kind.IPC_CLOSE, pid=2, ptr=0x7000),
        ev(Kind.VMM_UNMAP, pid=1, ptr=0x50000, size=2 * MiB),
        ev(Kind.VMM_RELEASE, pid=1, handle=7),
        ev(Kind.FREE, pid=1, ptr=0x1000),
        ev(Kind.HOST_FREE, pid=1, ptr=0x8000),
        ev(Kind.FREE, pid=1, ptr=0xDEAD),  # unknown: stays -1
    )
    # THEN free/map/unmap/release/close/export get the GPU of what they refer to; host stays -1
    assert arr["gpu"].tolist() == [3, 5, 5, 3, 4, -1, 4, 5, 5, 3, -1, -1]


def test_a_given_gpu_is_never_overwritten():
    # GIVEN a free whose gpu the daemon did set
    _, arr = applied(ev(Kind.ALLOC, pid=1, ptr=0x1000, size=MiB, gpu=3), ev(Kind.FREE, pid=1, ptr=0x1000, gpu=6))
    # THEN it is left as it was
    assert arr["gpu"].tolist() == [3, 6]


def test_read_only_events_are_applied_without_fill_in():
    # GIVEN a read-only event array
    arr = events(ev(Kind.ALLOC, pid=1, ptr=0x1000, size=MiB, gpu=3), ev(Kind.FREE, pid=1, ptr=0x1000))
    arr.flags.writeable = False
    state = LiveState()
    # WHEN applied
    state.apply(arr)
    # THEN the accounting is right and nothing was written
    assert state.owned_bytes() == 0 and arr["gpu"].tolist() == [3, -1]


def test_apply_rejects_raw_records():
    # GIVEN raw BPF records (no gpu column)
    # THEN apply refuses them
    with pytest.raises(TypeError, match="EVENT_DTYPE"):
        LiveState().apply(np.zeros(1, dtype=RAW_DTYPE))


def test_batches_and_one_array_give_the_same_state():
    # GIVEN the scenario applied in one go and event by event
    whole = LiveState()
    whole.apply(scenario())
    piecewise = LiveState()
    arr = scenario()
    for i in range(len(arr)):
        piecewise.apply(arr[i : i + 1])
    # THEN the states are equal
    assert piecewise.snapshot() == whole.snapshot()


# ---------------------------------------------------------------------------------------------- VMM


def test_vmm_released_before_unmap_stays_until_unmapped():
    # GIVEN a physical handle mapped, then released while still mapped
    rows = [
        ev(Kind.VMM_CREATE, pid=1, size=20 * MiB, handle=0xA, gpu=2, aux=1),
        ev(Kind.VMM_MAP, pid=1, ptr=0x7000000, size=20 * MiB, handle=0xA),
        ev(Kind.VMM_RELEASE, pid=1, handle=0xA),
    ]
    state, _ = applied(*rows)
    # THEN the memory is still owned (the mapping keeps it)
    assert state.totals() == {2: {1: {"vmm": 20 * MiB}}}
    # WHEN it is unmapped
    state.apply(events(ev(Kind.VMM_UNMAP, pid=1, ptr=0x7000000, size=20 * MiB, ts=10_000)))
    # THEN it is gone
    assert state.owned_bytes() == 0 and state.totals() == {}
    state.check()


def test_vmm_unmapped_before_release_stays_until_released():
    # GIVEN a handle mapped and unmapped but not released
    state, _ = applied(
        ev(Kind.VMM_CREATE, pid=1, size=20 * MiB, handle=0xA, gpu=2),
        ev(Kind.VMM_MAP, pid=1, ptr=0x7000000, size=20 * MiB, handle=0xA),
        ev(Kind.VMM_UNMAP, pid=1, ptr=0x7000000, size=20 * MiB),
    )
    # THEN the physical memory is still owned
    assert state.owned_bytes(gpu=2, category="vmm") == 20 * MiB
    # WHEN released
    state.apply(events(ev(Kind.VMM_RELEASE, pid=1, handle=0xA, ts=10_000)))
    # THEN it is gone
    assert state.owned_bytes(gpu=2) == 0


def test_vmm_created_is_owned_before_any_map_and_va_reserve_is_never_counted():
    # GIVEN a reserved VA range and a created, unmapped handle
    state, _ = applied(
        ev(Kind.VA_RESERVE, pid=1, ptr=0x7000000, size=157 * GiB),
        ev(Kind.VMM_CREATE, pid=1, size=2 * MiB, handle=0xB, gpu=0),
    )
    # THEN only the physical memory counts
    assert state.owned_bytes() == 2 * MiB


def test_one_unmap_over_several_mappings_unmaps_them_all():
    # GIVEN two granules mapped back to back and released
    state, arr = applied(
        ev(Kind.VMM_CREATE, pid=1, size=2 * MiB, handle=1, gpu=0),
        ev(Kind.VMM_CREATE, pid=1, size=2 * MiB, handle=2, gpu=0),
        ev(Kind.VMM_MAP, pid=1, ptr=0x10000000, size=2 * MiB, handle=1),
        ev(Kind.VMM_MAP, pid=1, ptr=0x10200000, size=2 * MiB, handle=2),
        ev(Kind.VMM_RELEASE, pid=1, handle=1),
        ev(Kind.VMM_RELEASE, pid=1, handle=2),
        ev(Kind.VMM_UNMAP, pid=1, ptr=0x10000000, size=4 * MiB),
    )
    # THEN one unmap of the whole range frees both
    assert state.owned_bytes() == 0
    assert arr["gpu"][-1] == 0


def test_retained_handle_needs_one_more_release():
    # GIVEN a handle retained through its mapping (cuMemRetainAllocationHandle)
    state, _ = applied(
        ev(Kind.VMM_CREATE, pid=1, size=2 * MiB, handle=1, gpu=0),
        ev(Kind.VMM_MAP, pid=1, ptr=0x10000000, size=2 * MiB, handle=1),
        ev(Kind.VMM_RETAIN, pid=1, ptr=0x10000000, handle=1),
        ev(Kind.VMM_UNMAP, pid=1, ptr=0x10000000, size=2 * MiB),
        ev(Kind.VMM_RELEASE, pid=1, handle=1),
    )
    # THEN one reference is left
    assert state.owned_bytes() == 2 * MiB
    # WHEN the retained reference is released
    state.apply(events(ev(Kind.VMM_RELEASE, pid=1, handle=1, ts=10_000)))
    # THEN the memory goes
    assert state.owned_bytes() == 0


def test_vmm_created_on_the_host_is_pinned_host_memory():
    # GIVEN cuMemCreate with a host location (CU_MEM_LOCATION_TYPE_HOST = 2)
    state, _ = applied(ev(Kind.VMM_CREATE, pid=1, size=4 * MiB, handle=1, gpu=0, aux=2))
    # THEN it is host_pinned, on the host
    assert state.totals() == {-1: {1: {"host_pinned": 4 * MiB}}}


# ---------------------------------------------------------------------------------------------- IPC


def ipc_rows():
    return [
        ev(Kind.ALLOC, pid=100, ptr=0x1000000, size=64 * MiB, gpu=0),
        ev(Kind.IPC_EXPORT, pid=100, ptr=0x1000000, gpu=0, ipc=handle_bytes(7)),
        ev(Kind.IPC_OPEN, pid=200, ptr=0x9000000, gpu=1, ipc=handle_bytes(7)),
    ]


def test_ipc_open_is_owned_once_at_the_exporter_and_mapped_in_the_importer_view():
    # GIVEN pid 100 exports a 64 MiB buffer on GPU 0 and pid 200 (on GPU 1) opens it
    state, _ = applied(*ipc_rows())
    # THEN GPU 0 owns it once, GPU 1 owns nothing, and pid 200 has it mapped
    assert state.owned_bytes(gpu=0) == 64 * MiB
    assert state.owned_bytes(gpu=1) == 0
    assert state.owned_bytes() == 64 * MiB
    assert state.mapped_bytes(gpu=1, pid=200) == 64 * MiB
    assert state.totals() == {0: {100: {"driver": 64 * MiB}}, 1: {200: {"ipc_mapped": 64 * MiB}}}
    # AND the holding says where it came from
    (h,) = state.largest(1, mapped=True)
    assert (h.pid, h.category, h.size, h.peer, h.address) == (200, "ipc_mapped", 64 * MiB, 100, 0x9000000)
    assert state.largest(1) == []  # not owned


def test_ipc_close_ends_the_mapped_view_and_a_second_open_is_counted_once():
    # GIVEN the same handle opened twice by the importer, then closed twice
    rows = ipc_rows() + [ev(Kind.IPC_OPEN, pid=200, ptr=0x9000000, gpu=1, ipc=handle_bytes(7))]
    state, _ = applied(*rows)
    assert state.mapped_bytes() == 64 * MiB
    state.apply(events(ev(Kind.IPC_CLOSE, pid=200, ptr=0x9000000, ts=10_000)))
    assert state.mapped_bytes() == 64 * MiB
    # WHEN closed the second time
    state.apply(events(ev(Kind.IPC_CLOSE, pid=200, ptr=0x9000000, ts=11_000)))
    # THEN the view is gone and the exporter's memory is untouched
    assert state.mapped_bytes() == 0 and state.owned_bytes(gpu=0) == 64 * MiB


def test_ipc_export_of_an_interior_pointer_maps_the_whole_allocation():
    # GIVEN an export of a block inside a cached segment
    state, _ = applied(
        ev(Kind.ALLOC, pid=100, ptr=0x1000000, size=64 * MiB, gpu=0),
        ev(Kind.IPC_EXPORT, pid=100, ptr=0x1000000 + 8 * MiB, gpu=0, ipc=handle_bytes(1)),
        ev(Kind.IPC_OPEN, pid=200, ptr=0x9000000, gpu=1, ipc=handle_bytes(1)),
    )
    # THEN the importer maps the segment's size
    assert state.mapped_bytes(pid=200) == 64 * MiB


def test_ipc_open_of_an_unknown_handle_is_noted_with_no_size():
    # GIVEN an open of a handle exported before the recording
    state, _ = applied(ev(Kind.IPC_OPEN, pid=200, ptr=0x9000000, gpu=1, ipc=handle_bytes(9)))
    # THEN it maps 0 known bytes and is counted as an anomaly
    assert state.mapped_bytes() == 0
    assert state.anomalies == {"open_unknown_export": 1}


def test_ipc_open_without_importer_gpu_is_shown_under_the_owner_gpu():
    # GIVEN an importer whose device could not be resolved
    rows = ipc_rows()[:2] + [ev(Kind.IPC_OPEN, pid=200, ptr=0x9000000, ipc=handle_bytes(7))]
    state, _ = applied(*rows)
    # THEN its view is kept under the owner's GPU, still not owned
    assert state.totals()[0] == {100: {"driver": 64 * MiB}, 200: {"ipc_mapped": 64 * MiB}}
    assert state.owned_bytes(gpu=0) == 64 * MiB


def test_exporter_free_forgets_the_export():
    # GIVEN the exporter frees the buffer after exporting it
    rows = ipc_rows()[:2] + [
        ev(Kind.FREE, pid=100, ptr=0x1000000),
        ev(Kind.IPC_OPEN, pid=200, ptr=0x9000000, gpu=1, ipc=handle_bytes(7)),
    ]
    state, _ = applied(*rows)
    # THEN a later open cannot be joined
    assert state.mapped_bytes() == 0 and state.anomalies == {"open_unknown_export": 1}
    assert state.snapshot()["exports"] == []


def test_shareable_import_is_mapped_not_owned_with_size_from_the_map():
    # GIVEN pid 200 imports a peer's physical handle by fd and maps it
    state, arr = applied(
        ev(Kind.VMM_CREATE, pid=100, size=32 * MiB, handle=5, gpu=0),
        ev(Kind.SHARE_EXPORT, pid=100, ptr=42, handle=5, aux=1),
        ev(Kind.SHARE_IMPORT, pid=200, ptr=17, handle=9, aux=1, gpu=1),
    )
    # THEN before the map its size is unknown (0)
    assert state.mapped_bytes() == 0
    # WHEN mapped
    state.apply(events(ev(Kind.VMM_MAP, pid=200, ptr=0x5000000, size=32 * MiB, handle=9, ts=10_000)))
    # THEN it is mapped in the importer's view, never owned
    assert state.totals() == {0: {100: {"vmm": 32 * MiB}}, 1: {200: {"ipc_mapped": 32 * MiB}}}
    assert state.owned_bytes() == 32 * MiB
    assert arr["gpu"][1] == 0  # the export got its handle's GPU
    # WHEN unmapped and released
    state.apply(
        events(
            ev(Kind.VMM_UNMAP, pid=200, ptr=0x5000000, size=32 * MiB, ts=11_000),
            ev(Kind.VMM_RELEASE, pid=200, handle=9, ts=12_000),
        )
    )
    # THEN the view is gone
    assert state.mapped_bytes() == 0 and state.owned_bytes() == 32 * MiB
    state.check()


def test_fabric_import_joins_the_exporter_size_and_gpu():
    # GIVEN a fabric handle exported and imported (its bytes join the two)
    state, _ = applied(
        ev(Kind.VMM_CREATE, pid=100, size=32 * MiB, handle=5, gpu=3),
        ev(Kind.SHARE_EXPORT, pid=100, handle=5, aux=8, ipc=handle_bytes(3)),
        ev(Kind.SHARE_IMPORT, pid=200, handle=9, aux=8, ipc=handle_bytes(3)),
    )
    # THEN the import is mapped at once with the exporter's size, under the owner's GPU
    assert state.totals()[3] == {100: {"vmm": 32 * MiB}, 200: {"ipc_mapped": 32 * MiB}}
    (h,) = [h for h in state.holdings(pid=200)]
    assert h.peer == 100


# -------------------------------------------------------------------------------------- pinned host


def test_pinned_host_alloc_and_register_are_host_memory():
    # GIVEN pinned host memory allocated and registered, one of each undone
    state, arr = applied(
        ev(Kind.HOST_ALLOC, pid=1, ptr=0x1000, size=2 * MiB, gpu=-1),
        ev(Kind.HOST_REGISTER, pid=1, ptr=0x900000, size=8 * MiB),
        ev(Kind.HOST_ALLOC, pid=2, ptr=0x1000, size=MiB),
        ev(Kind.HOST_UNREGISTER, pid=1, ptr=0x900000),
        ev(Kind.HOST_FREE, pid=2, ptr=0x1000),
    )
    # THEN the host (-1) holds what is still pinned, under host_pinned
    assert state.totals() == {-1: {1: {"host_pinned": 2 * MiB}}}
    assert state.owned_bytes(gpu=-1, category="host_pinned") == 2 * MiB
    assert state.owned_bytes(gpu=0) == 0
    assert (arr["gpu"] == -1).all()


def test_owned_bytes_refuses_the_mapped_category():
    # THEN asking for owned ipc_mapped bytes is an error, not a silent 0
    with pytest.raises(ValueError, match="mapped, not owned"):
        LiveState().owned_bytes(category="ipc_mapped")
    with pytest.raises(ValueError, match="unknown category"):
        LiveState().owned_bytes(category="weights")


# -------------------------------------------------------------------------------- failures and OOM


def test_failed_alloc_changes_nothing_and_is_kept():
    # GIVEN a successful alloc, an OOM and a failed free
    state, _ = applied(
        ev(Kind.ALLOC, pid=1, ptr=0x1000, size=GiB, gpu=0),
        ev(Kind.ALLOC, pid=1, ptr=0, size=80 * GiB, gpu=0, result=2, tid=11),
        ev(Kind.FREE, pid=1, ptr=0x1000, result=1),
    )
    # THEN the state holds only the success and both failures are kept in order
    assert state.owned_bytes(gpu=0) == GiB
    assert state.n_failures == 2
    assert state.failure_records() == [
        dict(index=1, ts=2000, pid=1, tid=11, kind=int(Kind.ALLOC), api=int(Api.cuMemAlloc_v2), result=2, gpu=0,
             size=80 * GiB, ptr=0),
        dict(index=2, ts=3000, pid=1, tid=0, kind=int(Kind.FREE), api=int(Api.cuMemFree_v2), result=1, gpu=-1,
             size=0, ptr=0x1000),
    ]


def test_failures_kept_are_bounded_but_all_counted():
    # GIVEN more failed calls than the state keeps
    state = LiveState(max_failures=3)
    state.apply(events(*[ev(Kind.ALLOC, pid=1, size=GiB, result=2) for _ in range(5)]))
    # THEN the last 3 are kept and 5 counted
    assert state.n_failures == 5 and [f["index"] for f in state.failure_records()] == [2, 3, 4]


def test_holders_at_an_oom_are_exact():
    # GIVEN three processes on GPU 0 (one only maps a peer's buffer) when pid 1's alloc fails
    state, _ = applied(
        ev(Kind.ALLOC, pid=1, ptr=0x1000, size=10 * GiB, gpu=0),
        ev(Kind.ALLOC, pid=1, ptr=0x2000, size=GiB, gpu=0),
        ev(Kind.ALLOC, pid=1, ptr=0x3000, size=2 * GiB, gpu=0),
        ev(Kind.ALLOC, pid=1, ptr=0x4000, size=MiB, gpu=0),
        ev(Kind.VMM_CREATE, pid=2, size=20 * GiB, handle=0x33, gpu=0),
        ev(Kind.ALLOC, pid=3, ptr=0x1000, size=4 * GiB, gpu=1),
        ev(Kind.IPC_EXPORT, pid=3, ptr=0x1000, gpu=1, ipc=handle_bytes(2)),
        ev(Kind.IPC_OPEN, pid=4, ptr=0x8000, gpu=0, ipc=handle_bytes(2)),
        ev(Kind.ALLOC, pid=1, ptr=0, size=50 * GiB, gpu=0, result=2),
    )
    # WHEN asked who holds what on GPU 0
    holders = state.holders(0, n=2)
    # THEN the biggest owner comes first, with its two largest pieces; the mapper last
    assert holders == [
        {"pid": 2, "owned": 20 * GiB, "mapped": 0, "by_category": {"vmm": 20 * GiB},
         "largest": [dict(pid=2, gpu=0, category="vmm", size=20 * GiB, address=0x33, ts=5000,
                          api=int(Api.cuMemCreate), peer=0)]},
        {"pid": 1, "owned": 13 * GiB + MiB, "mapped": 0, "by_category": {"driver": 13 * GiB + MiB},
         "largest": [dict(pid=1, gpu=0, category="driver", size=10 * GiB, address=0x1000, ts=1000,
                          api=int(Api.cuMemAlloc_v2), peer=0),
                     dict(pid=1, gpu=0, category="driver", size=2 * GiB, address=0x3000, ts=3000,
                          api=int(Api.cuMemAlloc_v2), peer=0)]},
        {"pid": 4, "owned": 0, "mapped": 4 * GiB, "by_category": {"ipc_mapped": 4 * GiB},
         "largest": [dict(pid=4, gpu=0, category="ipc_mapped", size=4 * GiB, address=0x8000, ts=8000,
                          api=int(Api.cuIpcOpenMemHandle_v2), peer=3)]},
    ]
    assert [(h.pid, h.size) for h in state.largest(0, 3)] == [(2, 20 * GiB), (1, 10 * GiB), (1, 2 * GiB)]


# ---------------------------------------------------------------------------------------- exits


def test_process_exit_frees_everything_it_held_and_records_it():
    # GIVEN pid 1 holding driver, vmm, mapped and pinned memory, and pid 2 holding its own
    rows = [
        ev(Kind.ALLOC, pid=1, ptr=0x1000, size=3 * MiB, gpu=0),
        ev(Kind.ALLOC, pid=1, ptr=0x9000, size=5 * MiB, gpu=1),
        ev(Kind.VMM_CREATE, pid=1, size=2 * MiB, handle=4, gpu=0),
        ev(Kind.VMM_MAP, pid=1, ptr=0x40000000, size=2 * MiB, handle=4),
        ev(Kind.HOST_ALLOC, pid=1, ptr=0x70000, size=MiB),
        ev(Kind.ALLOC, pid=2, ptr=0x1000, size=7 * MiB, gpu=0),
        ev(Kind.IPC_EXPORT, pid=2, ptr=0x1000, gpu=0, ipc=handle_bytes(1)),
        ev(Kind.IPC_OPEN, pid=1, ptr=0x5000, gpu=1, ipc=handle_bytes(1)),
        ev(Kind.PROC_EXIT, api=Api.sched_process_exit, pid=1),
    ]
    state, _ = applied(*rows, journal=True)
    # THEN only pid 2's memory is left
    assert state.totals() == {0: {2: {"driver": 7 * MiB}}}
    # AND the exit record says what pid 1 still held
    (rec,) = state.exit_records()
    assert rec["pid"] == 1 and rec["ts"] == 9000
    assert rec["owned"] == 11 * MiB and rec["mapped"] == 7 * MiB and rec["count"] == 5
    assert rec["held"] == [
        {"gpu": -1, "category": "host_pinned", "bytes": MiB, "count": 1},
        {"gpu": 0, "category": "driver", "bytes": 3 * MiB, "count": 1},
        {"gpu": 0, "category": "vmm", "bytes": 2 * MiB, "count": 1},
        {"gpu": 1, "category": "driver", "bytes": 5 * MiB, "count": 1},
        {"gpu": 1, "category": "ipc_mapped", "bytes": 7 * MiB, "count": 1},
    ]
    assert [(h["category"], h["size"]) for h in rec["largest"]][:2] == [("ipc_mapped", 7 * MiB), ("driver", 5 * MiB)]
    # AND the journal records the implicit frees against the exit event
    j = np.frombuffer(state.journal, dtype=np.int64).reshape(-1, 6)
    exit_rows = j[j[:, 0] == 8]
    assert sorted(exit_rows[:, 5].tolist()) == sorted([-MiB, -3 * MiB, -2 * MiB, -5 * MiB, -7 * MiB])


def test_exporter_exit_forgets_its_exports_and_pid_reuse_starts_clean():
    # GIVEN an exporter that exits, and a new process reusing its pid
    state, _ = applied(
        ev(Kind.ALLOC, pid=100, ptr=0x1000, size=MiB, gpu=0),
        ev(Kind.IPC_EXPORT, pid=100, ptr=0x1000, gpu=0, ipc=handle_bytes(1)),
        ev(Kind.PROC_EXIT, pid=100),
        ev(Kind.FREE, pid=100, ptr=0x1000),  # the new process's free of a pointer it never had
    )
    # THEN nothing is left, the export is gone and the stale free is an anomaly
    assert state.totals() == {} and state.snapshot()["exports"] == []
    assert state.anomalies == {"free_unknown": 1}


# ------------------------------------------------------------------------------------- keyframes


def scenario() -> np.ndarray:
    """Every kind of event the state handles, across 3 processes and 2 GPUs (25 events)."""
    return events(
        ev(Kind.CTX, pid=1, handle=0xC0, gpu=0),
        ev(Kind.ALLOC, pid=1, ptr=0x1000, size=3 * MiB, gpu=0),
        ev(Kind.ALLOC, pid=2, ptr=0x1000, size=5 * MiB, gpu=1),
        ev(Kind.VA_RESERVE, pid=1, ptr=0x40000000, size=GiB),
        ev(Kind.VMM_CREATE, pid=1, size=20 * MiB, handle=0xA, gpu=0),
        ev(Kind.VMM_MAP, pid=1, ptr=0x40000000, size=20 * MiB, handle=0xA),
        ev(Kind.VMM_RETAIN, pid=1, ptr=0x40000000, handle=0xA),
        ev(Kind.IPC_EXPORT, pid=2, ptr=0x1000, gpu=1, ipc=handle_bytes(1)),
        ev(Kind.IPC_OPEN, pid=1, ptr=0x90000000, gpu=0, ipc=handle_bytes(1)),
        ev(Kind.VMM_CREATE, pid=2, size=8 * MiB, handle=0xB, gpu=1),
        ev(Kind.SHARE_EXPORT, pid=2, handle=0xB, aux=8, ipc=handle_bytes(2)),
        ev(Kind.SHARE_IMPORT, pid=3, handle=0xF, aux=8, ipc=handle_bytes(2)),
        ev(Kind.VMM_MAP, pid=3, ptr=0x60000000, size=8 * MiB, handle=0xF),
        ev(Kind.HOST_ALLOC, pid=3, ptr=0x7000, size=MiB),
        ev(Kind.ALLOC, pid=3, size=GiB, gpu=1, result=2),
        ev(Kind.VMM_RELEASE, pid=1, handle=0xA),
        ev(Kind.FREE, pid=9, ptr=0x1234),
        ev(Kind.VMM_UNMAP, pid=1, ptr=0x40000000, size=20 * MiB),
        ev(Kind.ALLOC, pid=1, ptr=0x2000, size=7 * MiB, gpu=0),
        ev(Kind.PROC_EXIT, pid=3),
        ev(Kind.IPC_CLOSE, pid=1, ptr=0x90000000),
        ev(Kind.VMM_RELEASE, pid=1, handle=0xA),
        ev(Kind.FREE, pid=1, ptr=0x1000),
        ev(Kind.HOST_REGISTER, pid=2, ptr=0x8000, size=2 * MiB),
        ev(Kind.PROC_EXIT, pid=2),
    )


@pytest.mark.parametrize("split", range(0, 26))
def test_snapshot_mid_stream_then_the_rest_equals_applying_everything(split):
    # GIVEN the scenario applied whole
    whole = LiveState()
    whole.apply(scenario())
    # WHEN applied up to `split`, snapshotted through msgpack, restored, and applied the rest
    arr = scenario()
    first = LiveState()
    first.apply(arr[:split])
    wire = msgpack.packb(first.snapshot(), use_bin_type=True)
    restored = LiveState.from_snapshot(msgpack.unpackb(wire, raw=False))
    restored.check()
    restored.apply(arr[split:])
    # THEN the states are identical, queries included
    assert restored.snapshot() == whole.snapshot()
    assert restored.totals() == whole.totals()
    assert restored.exit_records() == whole.exit_records()
    assert restored.peaks() == whole.peaks()
    restored.check()


def test_snapshot_round_trip_is_exact_and_plain():
    # GIVEN a state mid-scenario with something in every table
    arr = scenario()
    state = LiveState()
    state.apply(arr[:14])
    snap = state.snapshot()
    # THEN it has only plain types, and restoring it gives the same snapshot
    def plain(v):
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        if isinstance(v, list):
            return all(plain(x) for x in v)
        return type(v) in (int, bytes, str)

    assert plain(snap)
    assert all(snap[k] for k in ("allocs", "handles", "maps", "exports", "fabric", "opens", "host"))
    assert LiveState.from_snapshot(snap).snapshot() == snap
    assert LiveState.from_snapshot(snap).holders(0) == state.holders(0)


def test_snapshot_of_another_version_is_refused():
    snap = LiveState().snapshot()
    snap["v"] = 99
    with pytest.raises(ValueError, match="version"):
        LiveState.from_snapshot(snap)


def test_a_version_1_keyframe_still_restores():
    # GIVEN a keyframe as version 1 wrote it: the driver allocations as one flat list of rows
    state = LiveState()
    state.apply(scenario()[:14])
    v1 = {**state.snapshot(), "v": 1, "allocs": alloc_rows(state.snapshot())}
    assert v1["allocs"] and all(isinstance(x, int) for x in v1["allocs"])
    # WHEN it is restored (through msgpack, as from an old trace)
    wire = msgpack.unpackb(msgpack.packb(v1, use_bin_type=True), raw=False)
    restored = LiveState.from_snapshot(wire)
    # THEN it is the same state
    restored.check()
    assert restored.snapshot() == state.snapshot()


@pytest.mark.parametrize("damage", ["not zlib", "short", "count", "missing", "negative size"])
def test_a_damaged_allocation_column_is_one_clear_error(damage):
    # GIVEN a keyframe whose compressed allocation columns were damaged
    state = LiveState()
    state.apply(events(ev(Kind.ALLOC, pid=1, ptr=0x1000, size=MiB, gpu=0),
                       ev(Kind.ALLOC, pid=1, ptr=0x9000, size=MiB, gpu=0)))
    snap = state.snapshot()
    allocs = dict(snap["allocs"])
    if damage == "not zlib":
        allocs["size"] = b"\x00" * 16
    elif damage == "short":
        allocs["size"] = zlib.compress(np.array([MiB], "<i8").tobytes())
    elif damage == "count":
        allocs["n"] = 1 << 30
    elif damage == "missing":
        del allocs["ts"]
    else:
        allocs["size"] = zlib.compress(np.array([MiB, -1], "<i8").tobytes())
    # WHEN it is restored THEN one ValueError says it is malformed
    with pytest.raises(ValueError, match="malformed keyframe"):
        LiveState.from_snapshot({**snap, "allocs": allocs})


def test_counters_match_the_tables_after_every_event():
    # GIVEN the scenario applied one event at a time
    state = LiveState(journal=True)
    arr = scenario()
    for i in range(len(arr)):
        state.apply(arr[i : i + 1])
        # THEN counters and tables agree at every step
        state.check()
    # AND the journal sums to the final totals
    j = np.frombuffer(state.journal, dtype=np.int64).reshape(-1, 6)
    assert int(j[:, 5].sum()) == state.owned_bytes() + state.mapped_bytes()
