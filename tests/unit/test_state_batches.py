"""LiveState.apply: a run of allocations and frees, and of VMM creates, maps, unmaps and
releases, applied at once (numpy) gives exactly what the event-by-event path gives: tables,
counters, peaks, anomalies, failures, exits, journal rows and the GPU filled into the events, for
any sequence and any split into batches."""

from __future__ import annotations

import msgpack
import numpy as np
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from memrec.terms.events import CATEGORIES
from memrec.terms.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.terms.events import Kind
from memrec.state import LiveState
from memrec.state.batch import Batch
from memrec.trace.model import EventColumns
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events
from tests.utils import handle_bytes

PIDS = (7, 8, 9)
PTRS = (0x1000, 0x2000, 0x3000, 0x1800)  # 0x1800 lies inside a 0x1000 allocation of 4 KiB or more
SIZES = (0, 512, 4096, MiB)
GPUS = (-1, 0, 1)

_plain = st.builds(
    lambda kind, pid, ptr, size, gpu: ev(kind, pid=pid, ptr=ptr, size=size if kind == Kind.ALLOC else 0, gpu=gpu),
    st.sampled_from((Kind.ALLOC, Kind.FREE)), st.sampled_from(PIDS), st.sampled_from(PTRS),
    st.sampled_from(SIZES), st.sampled_from(GPUS),
)
_failed = st.builds(
    lambda kind, pid, result: ev(kind, pid=pid, ptr=0x1000, size=MiB, result=result),
    st.sampled_from((Kind.ALLOC, Kind.FREE, Kind.VMM_CREATE, Kind.CODE_LOAD)), st.sampled_from(PIDS),
    st.sampled_from((CUDA_ERROR_OUT_OF_MEMORY, 1)),
)
_rare = st.one_of(
    st.builds(lambda pid: ev(Kind.PROC_EXIT, pid=pid), st.sampled_from(PIDS)),
    st.builds(lambda pid, h, gpu: ev(Kind.VMM_CREATE, pid=pid, handle=h, size=2 * MiB, gpu=gpu),
              st.sampled_from(PIDS), st.integers(1, 3), st.sampled_from(GPUS)),
    st.builds(lambda pid, h, va: ev(Kind.VMM_MAP, pid=pid, handle=h, ptr=va, size=2 * MiB),
              st.sampled_from(PIDS), st.integers(1, 3), st.sampled_from((0x90000, 0xA0000))),
    st.builds(lambda pid, va: ev(Kind.VMM_UNMAP, pid=pid, ptr=va, size=2 * MiB),
              st.sampled_from(PIDS), st.sampled_from((0x90000, 0xA0000))),
    st.builds(lambda pid, h: ev(Kind.VMM_RELEASE, pid=pid, handle=h), st.sampled_from(PIDS), st.integers(1, 3)),
    st.builds(lambda pid, ptr, n: ev(Kind.IPC_EXPORT, pid=pid, ptr=ptr, ipc=handle_bytes(n)),
              st.sampled_from(PIDS), st.sampled_from(PTRS), st.integers(1, 2)),
    st.builds(lambda pid, n, gpu: ev(Kind.IPC_OPEN, pid=pid, ptr=0x5000 + n, ipc=handle_bytes(n), gpu=gpu),
              st.sampled_from(PIDS), st.integers(1, 2), st.sampled_from(GPUS)),
    st.builds(lambda pid, n: ev(Kind.IPC_CLOSE, pid=pid, ptr=0x5000 + n), st.sampled_from(PIDS), st.integers(1, 2)),
    st.builds(lambda kind, pid: ev(kind, pid=pid, ptr=0x8000, size=4096),
              st.sampled_from((Kind.HOST_ALLOC, Kind.HOST_FREE)), st.sampled_from(PIDS)),
)
#: Mostly allocations and frees of a few keys (reuse, double frees, unknown frees), some failures
#: and rare kinds that cut or join the runs.
_event = st.one_of(_plain, _plain, _plain, _plain, _failed, _rare)


@st.composite
def _ipc_story(draw) -> list:
    """An allocation exported (at its base or inside it) and opened by a peer, with frees and
    reallocations of it before or after the export and the open, in any order."""
    pid, peer = draw(st.permutations(PIDS))[:2]
    ptr, n = draw(st.sampled_from(PTRS[:3])), draw(st.integers(1, 2))
    steps = [
        ev(Kind.ALLOC, pid=pid, ptr=ptr, size=draw(st.sampled_from(SIZES[1:])), gpu=draw(st.sampled_from(GPUS))),
        ev(Kind.IPC_EXPORT, pid=pid, ptr=ptr + draw(st.sampled_from((0, 0x100))), ipc=handle_bytes(n)),
        ev(Kind.FREE, pid=pid, ptr=ptr),
        ev(Kind.IPC_OPEN, pid=peer, ptr=0x5000 + n, ipc=handle_bytes(n), gpu=draw(st.sampled_from(GPUS))),
        ev(Kind.ALLOC, pid=pid, ptr=ptr, size=4096, gpu=0),
        ev(Kind.IPC_EXPORT, pid=pid, ptr=ptr, ipc=handle_bytes(n)),
    ]
    return draw(st.permutations(steps))[: draw(st.integers(2, len(steps)))]


#: Events one by one and IPC stories, flattened.
_events = st.lists(st.one_of(_event.map(lambda e: [e]), _ipc_story()), min_size=4, max_size=60).map(
    lambda parts: [e for part in parts for e in part]
)


VAS = (0x40000000, 0x40400000, 0x40800000)  # 4 MiB apart: mappings of up to 4 MiB never overlap


@st.composite
def _vmm_story(draw) -> list:
    """A physical handle's life: created (on a GPU, or host-located), mapped at one or two
    addresses, released and unmapped in any order the driver allows; or, shuffled or cut short,
    in an order it does not (unknown handles and mappings, double maps, releases while mapped)."""
    pid, h, gpu = draw(st.sampled_from(PIDS)), draw(st.integers(1, 4)), draw(st.sampled_from(GPUS))
    size = draw(st.sampled_from((0, 2 * MiB, 4 * MiB)))
    vas = draw(st.lists(st.sampled_from(VAS), min_size=0, max_size=2, unique=True))
    fill = draw(st.sampled_from((-1, -1, gpu)))  # maps, unmaps and releases usually come without a GPU
    create = ev(Kind.VMM_CREATE, pid=pid, handle=h, size=size, gpu=gpu, aux=draw(st.sampled_from((0, 1, 1, 2))))
    maps = [ev(Kind.VMM_MAP, pid=pid, handle=h, ptr=va, size=size, aux=0, gpu=fill) for va in vas]
    unmaps = [ev(Kind.VMM_UNMAP, pid=pid, ptr=va, size=draw(st.sampled_from((size, size, 0, 8 * MiB))), gpu=fill)
              for va in vas]
    release = ev(Kind.VMM_RELEASE, pid=pid, handle=h, gpu=fill)
    # A legal order: the create first, each map before its unmap, the release anywhere after it.
    seq, seen = [create], set()
    for token in draw(st.permutations([-1, *range(len(vas)), *range(len(vas))])):
        if token < 0:
            seq.append(release)
        else:
            seq.append(unmaps[token] if token in seen else maps[token])
            seen.add(token)
    how = draw(st.sampled_from(("legal", "legal", "legal", "shuffled", "cut")))
    if how == "shuffled":
        seq = draw(st.permutations(seq))
    elif how == "cut":
        seq = seq[draw(st.integers(0, len(seq) - 1)):]
    return seq


_vmm_rare = st.one_of(
    st.builds(lambda pid, h, va: ev(Kind.VMM_RETAIN, pid=pid, handle=h, ptr=va),
              st.sampled_from(PIDS), st.integers(1, 6), st.sampled_from(VAS + (VAS[0] + 4096,))),
    st.builds(lambda pid, h, n: ev(Kind.SHARE_EXPORT, pid=pid, handle=h, ipc=handle_bytes(100 + n)),
              st.sampled_from(PIDS), st.integers(1, 4), st.integers(1, 2)),
    st.builds(lambda pid, h, n, gpu: ev(Kind.SHARE_IMPORT, pid=pid, handle=h, ipc=handle_bytes(100 + n), gpu=gpu),
              st.sampled_from(PIDS), st.integers(1, 4), st.integers(1, 2), st.sampled_from(GPUS)),
    st.builds(lambda kind, pid, n: ev(kind, pid=pid, ptr=0x8000 + n * 4096, size=4096),
              st.sampled_from((Kind.HOST_ALLOC, Kind.HOST_FREE, Kind.HOST_REGISTER, Kind.HOST_UNREGISTER)),
              st.sampled_from(PIDS), st.integers(0, 1)),
    st.builds(lambda pid, n: ev(Kind.IPC_CLOSE, pid=pid, ptr=0x5000 + n), st.sampled_from(PIDS), st.integers(1, 2)),
)


@st.composite
def _interleaved(draw) -> list:
    """VMM stories, IPC stories and single events, interleaved (each story keeps its order)."""
    parts = draw(st.lists(
        st.one_of(_vmm_story(), _vmm_story(), _vmm_story(), _ipc_story(), _event.map(lambda e: [e]),
                  _vmm_rare.map(lambda e: [e])),
        min_size=1, max_size=14))
    queues = [list(p) for p in parts if p]
    owners = [i for i, q in enumerate(queues) for _ in q]
    out = []
    for i in draw(st.permutations(owners)):
        out.append(queues[i].pop(0))
    return out


def _run(rows: list, cuts: list[int], vector_min_run: int, max_failures: int,
         columns: bool = False) -> tuple[LiveState, np.ndarray]:
    """Apply ``rows`` batch by batch; ``columns``: as a loaded trace's contiguous columns (its
    sparse ipc bytes included), sliced as the replay slices them, not as EVENT_DTYPE rows."""
    arr = events(*rows)
    feed: object = arr
    if columns:
        view = EventColumns.from_array(arr)
        feed = Batch.of(EventColumns(view.n, {k: c.copy() for k, c in view.columns.items()}, view.ipc_index, view.ipc.copy()))
    state = LiveState(journal=True, max_failures=max_failures)
    state.vector_min_run = vector_min_run
    bounds = sorted({0, len(arr), *(c % (len(arr) + 1) for c in cuts)})
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        state.apply(feed[lo:hi])
    state.check()
    if columns:  # the GPU filled into the columns, read back as rows
        arr = arr.copy()
        arr["gpu"] = feed["gpu"]
    return state, arr


def _observed(state: LiveState) -> dict:
    return {
        "snapshot": state.snapshot(),
        "journal": state.journal.tolist(),
        "counters": state.counters(),
        "totals": state.totals(),
        "peaks": state.peaks(),
        "owned": {g: state.owned_bytes(gpu=g) for g in (-1, 0, 1)},
        "anomalies": state.anomalies,
        "failures": state.failure_records(),
        "n_failures": state.n_failures,
        "exits": state.exit_records(),
        "holdings": sorted(state.holdings()),
        "n": (state.n_events, state.last_ts),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=_events, cuts=st.lists(st.integers(0, 120), max_size=5),
       max_failures=st.sampled_from((0, 3, 256)))
def test_runs_at_once_equal_event_by_event(rows, cuts, max_failures):
    # GIVEN any sequence of events, split into batches the same way
    # WHEN it is applied with every run at once and with every event one by one
    fast, fast_arr = _run(rows, cuts, 0, max_failures)
    slow, slow_arr = _run(rows, cuts, 10**9, max_failures)
    # THEN everything the state shows, and the GPU filled into the events, is the same
    assert _observed(fast) == _observed(slow)
    assert fast_arr["gpu"].tolist() == slow_arr["gpu"].tolist()
    # AND the same events given as columns (a loaded trace's) give the same state and GPUs
    cols, cols_arr = _run(rows, cuts, 0, max_failures, columns=True)
    assert _observed(cols) == _observed(slow)
    assert cols_arr["gpu"].tolist() == slow_arr["gpu"].tolist()
    # AND a keyframe of it restores the same state, through msgpack
    wire = msgpack.unpackb(msgpack.packb(fast.snapshot(), use_bin_type=True), raw=False)
    again = LiveState.from_snapshot(wire, journal=True)
    again.check()
    assert again.snapshot() == slow.snapshot()


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=_interleaved(), cuts=st.lists(st.integers(0, 120), max_size=4), at_once=st.sampled_from((0, 0, 3)))
def test_vmm_and_ipc_runs_at_once_equal_event_by_event(rows, cuts, at_once):
    # GIVEN VMM handles created, mapped, released and unmapped by several processes on several
    # GPUs (handles reused after release, orders the driver allows and orders it does not),
    # interleaved with IPC exports and opens, retains, shareable handles, host memory,
    # allocations, failures and exits, split into batches
    # WHEN applied with runs at once and with every event one by one
    fast, fast_arr = _run(rows, cuts, at_once, 256)
    slow, slow_arr = _run(rows, cuts, 10**9, 256)
    # THEN everything the state shows, and the GPU filled into the events, is the same
    assert _observed(fast) == _observed(slow)
    assert fast_arr["gpu"].tolist() == slow_arr["gpu"].tolist()
    assert list(fast.mappings()) == list(slow.mappings())
    # AND a keyframe of it restores the same state
    wire = msgpack.unpackb(msgpack.packb(fast.snapshot(), use_bin_type=True), raw=False)
    again = LiveState.from_snapshot(wire, journal=True)
    again.check()
    assert again.snapshot() == slow.snapshot()


def test_vmm_stories_are_applied_at_once(monkeypatch):
    # GIVEN 300 handles of 3 processes on 2 GPUs, each created, mapped, released and unmapped
    # (in the two orders allocators use), handles reused, among allocations
    import memrec.state.plain as plain

    taken, declined = [], []
    real = plain.apply_vmm

    def spy(*args):
        changes, rest = real(*args)
        taken.append(changes is not None)
        declined.extend(args[1]["pid"][rest].tolist())  # the pids of the events it declined
        return changes, rest

    monkeypatch.setattr(plain, "apply_vmm", spy)
    rng = np.random.default_rng(3)
    rows, live = [], []
    for i in range(300):
        pid, h, va = 7 + i % 3, 1 + i % 40, 0x40000000 + (i % 60) * 0x400000
        if any(x[:2] == (pid, h) or x[::2] == (pid, va) for x in live):
            continue
        live.append((pid, h, va))
        rows += [ev(Kind.VMM_CREATE, pid=pid, handle=h, size=2 * MiB, gpu=i % 2),
                 ev(Kind.VMM_MAP, pid=pid, handle=h, ptr=va, size=2 * MiB),
                 ev(Kind.ALLOC, pid=pid, ptr=0x1000 * (i + 1), size=512, gpu=0)]
        if len(live) > 20:
            pid, h, va = live.pop(int(rng.integers(0, len(live))))
            pair = [ev(Kind.VMM_RELEASE, pid=pid, handle=h), ev(Kind.VMM_UNMAP, pid=pid, ptr=va, size=2 * MiB)]
            rows += pair if rng.random() < 0.5 else pair[::-1]
    # AND a process whose mappings predate the trace unmaps and releases them now and then
    late = [i for i in range(0, len(rows), 50)]
    for n, i in enumerate(reversed(late)):
        rows[i:i] = [ev(Kind.VMM_UNMAP, pid=99, ptr=0x90000000 + n * 0x200000, size=2 * MiB),
                     ev(Kind.VMM_RELEASE, pid=99, handle=1000 + n)]
    cuts = list(range(0, len(rows), 500))
    # WHEN applied with runs at once and event by event
    fast, fast_arr = _run(rows, cuts, 0, 256)
    slow, slow_arr = _run(rows, cuts, 10**9, 256)
    # THEN every run's VMM events were applied at once but that process's (event by event),
    # with the same result
    assert taken and all(taken)
    assert set(declined) == {99}
    assert _observed(fast) == _observed(slow)
    assert fast_arr["gpu"].tolist() == slow_arr["gpu"].tolist()
    assert fast.anomalies == {"unmap_unknown": len(late), "release_unknown": len(late)}
    assert len(list(fast.mappings())) == 20


def _filler(n: int, pid: int = 50) -> list:
    """Allocations that make a batch a run applied at once."""
    return [ev(Kind.ALLOC, pid=pid, ptr=0x10000 + 0x1000 * i, size=512, gpu=0) for i in range(n)]


def _both(batches: list[list]) -> LiveState:
    """Apply ``batches`` at once and event by event; assert they agree; return the first."""
    rows = [e for b in batches for e in b]
    cuts = list(np.cumsum([len(b) for b in batches]))
    fast, fast_arr = _run(rows, cuts, 0, 256)
    slow, slow_arr = _run(rows, cuts, 10**9, 256)
    assert _observed(fast) == _observed(slow)
    assert fast_arr["gpu"].tolist() == slow_arr["gpu"].tolist()
    return fast


def test_an_import_sees_the_exporters_handle_as_it_was_then():
    # GIVEN a handle created and shared (fabric) by one process, then a batch where a peer
    # imports it and the exporter releases it after that
    share = [ev(Kind.VMM_CREATE, pid=7, handle=1, size=4 * MiB, gpu=1),
             ev(Kind.SHARE_EXPORT, pid=7, handle=1, ipc=handle_bytes(200))]
    later = [*_filler(30), ev(Kind.SHARE_IMPORT, pid=8, handle=5, ipc=handle_bytes(200)),
             ev(Kind.VMM_RELEASE, pid=7, handle=1), *_filler(30, pid=51)]
    # WHEN applied at once and event by event THEN both agree: the peer maps the 4 MiB on GPU 1
    state = _both([share, later])
    assert state.mapped_bytes(gpu=1, pid=8) == 4 * MiB
    assert state.owned_bytes(pid=7) == 0


def test_a_release_through_a_retained_alias_releases_the_mapped_handle():
    # GIVEN a handle mapped, retained under another number (an alias), and later a handle
    # created under that number and the alias released
    first = [ev(Kind.VMM_CREATE, pid=7, handle=1, size=2 * MiB, gpu=0),
             ev(Kind.VMM_MAP, pid=7, handle=1, ptr=VAS[0], size=2 * MiB),
             ev(Kind.VMM_RETAIN, pid=7, handle=9, ptr=VAS[0])]
    later = [*_filler(30), ev(Kind.VMM_CREATE, pid=7, handle=9, size=MiB, gpu=0),
             ev(Kind.VMM_RELEASE, pid=7, handle=9), ev(Kind.VMM_RELEASE, pid=7, handle=1),
             ev(Kind.VMM_UNMAP, pid=7, ptr=VAS[0], size=2 * MiB)]
    # WHEN applied at once and event by event THEN both agree: the alias's release took the
    # retained reference, the handle went with its unmap, the new handle 9 is still held
    state = _both([first, later])
    assert state.owned_bytes(pid=7) == MiB and not state.anomalies


def test_mapping_an_imported_handle_learns_its_size():
    # GIVEN a handle imported from an unknown peer (size unknown), mapped in a later batch
    first = [ev(Kind.SHARE_IMPORT, pid=8, handle=5, gpu=1, ipc=handle_bytes(201))]
    later = [*_filler(30), ev(Kind.VMM_MAP, pid=8, handle=5, ptr=VAS[1], size=8 * MiB)]
    # WHEN applied at once and event by event THEN both agree: the mapping gave its size
    state = _both([first, later])
    assert state.mapped_bytes(gpu=1, pid=8) == 8 * MiB


def test_a_long_run_with_reuse_and_double_frees_is_exact():
    # GIVEN 20,000 allocations and frees over 300 keys of 3 processes (reuse, double frees,
    # unknown frees, frees that fill in the GPU), in batches of 4,096
    rng = np.random.default_rng(5)
    n = 20_000
    kinds = rng.choice([int(Kind.ALLOC), int(Kind.FREE)], n)
    rows = [
        ev(Kind(k), pid=int(rng.integers(1, 4)), ptr=int(rng.integers(0, 100)) * 4096,
           size=int(rng.integers(1, 1 << 20)) if k == Kind.ALLOC else 0, gpu=int(rng.integers(-1, 4)))
        for k in kinds
    ]
    cuts = list(range(0, n, 4096))
    # WHEN applied at once and event by event
    fast, fast_arr = _run(rows, cuts, 0, 256)
    slow, slow_arr = _run(rows, cuts, 10**9, 256)
    # THEN both agree exactly, and the table grew and rehashed on the way
    assert _observed(fast) == _observed(slow)
    assert fast_arr["gpu"].tolist() == slow_arr["gpu"].tolist()
    assert fast.anomalies["free_unknown"] > 0 and fast.anomalies["alloc_over_live"] > 0


def test_keys_whose_hashes_collide_still_pair_exactly(monkeypatch):
    # GIVEN a hash that sends every (pid, ptr) to the same value (so the grouping sorts, the
    # planner's key index and the tables' hash index see one key), and events with allocations,
    # frees, exports and opens
    import memrec.state.allocs as allocs
    import memrec.state.plain as plain
    import memrec.state.planner as planner

    for module in (allocs, plain, planner):
        monkeypatch.setattr(module, "key_hash", lambda pids, ptrs: np.zeros(len(pids), np.uint64))
    for module in (allocs, planner):
        monkeypatch.setattr(module, "key_hash1", lambda pid, ptr: 0)
    rng = np.random.default_rng(9)
    rows = []
    for i in range(3000):
        pid, ptr = int(rng.integers(1, 4)), int(rng.integers(0, 40)) * 4096
        r = rng.random()
        if r < 0.5:
            rows.append(ev(Kind.ALLOC, pid=pid, ptr=ptr, size=int(rng.integers(1, 1 << 20)), gpu=int(rng.integers(-1, 3))))
        elif r < 0.97:
            rows.append(ev(Kind.FREE, pid=pid, ptr=ptr))
        elif r < 0.985:
            rows.append(ev(Kind.IPC_EXPORT, pid=pid, ptr=ptr, ipc=handle_bytes(i % 5)))
        else:
            rows.append(ev(Kind.IPC_OPEN, pid=pid, ptr=0x5000 + i, ipc=handle_bytes(i % 5)))
    # WHEN applied at once and event by event THEN both agree exactly
    fast, fast_arr = _run(rows, list(range(0, 3000, 700)), 0, 256)
    slow, slow_arr = _run(rows, list(range(0, 3000, 700)), 10**9, 256)
    assert _observed(fast) == _observed(slow)
    assert fast_arr["gpu"].tolist() == slow_arr["gpu"].tolist()


def test_columns_carry_each_events_own_ipc_bytes():
    # GIVEN two exports of different sizes and an open of the first, as a loaded trace's
    # columns (the ipc bytes sparse), with plain allocations around them
    arr = events(
        *[ev(Kind.ALLOC, pid=9, ptr=0x100 + i, size=1, gpu=0) for i in range(40)],
        ev(Kind.ALLOC, pid=1, ptr=0x1000, size=4 * MiB, gpu=0),
        ev(Kind.ALLOC, pid=1, ptr=0x2000, size=8 * MiB, gpu=0),
        ev(Kind.IPC_EXPORT, pid=1, ptr=0x1000, ipc=handle_bytes(1)),
        ev(Kind.IPC_EXPORT, pid=1, ptr=0x2000, ipc=handle_bytes(2)),
        *[ev(Kind.FREE, pid=9, ptr=0x100 + i) for i in range(40)],
        ev(Kind.IPC_OPEN, pid=2, ptr=0x9000, gpu=1, ipc=handle_bytes(1)),
    )
    view = EventColumns.from_array(arr)
    cols = EventColumns(view.n, {k: c.copy() for k, c in view.columns.items()}, view.ipc_index, view.ipc.copy())
    # WHEN applied in two pieces, as columns
    state = LiveState()
    batch = Batch.of(cols)
    state.apply(batch[:43])
    state.apply(batch[43:])
    # THEN the importer maps the first export's 4 MiB (its own handle's), not the last one's
    assert state.counters()[(1, 2, CATEGORIES.index("ipc_mapped"))] == 4 * MiB


def test_exports_and_opens_of_the_runs_allocations_join_without_a_look_each(monkeypatch):
    # GIVEN a batch (and a second one without a free) where 4 processes allocate, export what they
    # allocated, and a peer opens each export, among frees of other allocations
    import memrec.state.planner as planner

    asked = []
    real = planner.Planner.joins

    def spy(self, lo, b):
        asked.append(int(self.kinds[b]))
        return real(self, lo, b)

    monkeypatch.setattr(planner.Planner, "joins", spy)
    batches = []
    for frees in (True, False):
        rows = []
        for i in range(200):
            pid, ptr, hb = 7 + i % 4, (0x100000 if frees else 0x900000) + 0x1000 * i, bytes([i, frees]) * 32
            rows += [ev(Kind.ALLOC, pid=pid, ptr=ptr, size=4096, gpu=i % 2),
                     ev(Kind.IPC_EXPORT, pid=pid, ptr=ptr, ipc=hb),
                     ev(Kind.IPC_OPEN, pid=20, ptr=0x5000000 + 0x1000 * i + (frees << 30), ipc=hb)]
            if frees and i % 2:  # the allocation before, exported and opened, freed
                rows.append(ev(Kind.FREE, pid=7 + (i - 1) % 4, ptr=ptr - 0x1000))
        batches.append(rows)
    # WHEN applied at once (and event by event, the same result)
    state = _both(batches)
    # THEN no export or open needed a look of its own: all joined the one run of their batch
    assert len(state.tables.exports) == 400 - 100
    assert sum(len(o) for o in state.tables.opens.values()) == 400
    assert state.anomalies == {}
    assert asked == []
