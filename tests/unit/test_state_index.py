"""The hash index of the state's tables, and the key order the planner hands to a run.

:meth:`memrec.state.allocs.KeyTable.remove` empties removed slots that no probe passes (one
before an empty slot, and so on backwards): a key placed past such a slot would have to be
lost, and removed slots left behind would make the index rebuild as if they were used.
:meth:`memrec.state.planner.Planner.run_order` cuts a run's key order out of the batch's: it
must be the order :func:`memrec.state.allocs.by_key` finds for the run alone.
"""

from __future__ import annotations

import numpy as np

from memrec.state.allocs import AllocTable
from memrec.state.allocs import by_key
from memrec.state.allocs import key_hash
from memrec.state.fields import ALLOC
from memrec.state.fields import FREE
from memrec.state.fields import IPC_EXPORT
from memrec.state.batch import Batch
from memrec.state.planner import Planner
from memrec.state.tables import Tables
from memrec.terms.columns import empty_events


def _insert(table: AllocTable, pids: np.ndarray, ptrs: np.ndarray) -> None:
    n = len(pids)
    table.insert(pids, ptrs, np.full(n, 4096), np.zeros(n, np.int16), np.arange(n), np.ones(n, np.uint16))


def test_removing_every_key_leaves_no_removed_slot() -> None:
    table = AllocTable()
    rng = np.random.default_rng(3)
    pids = rng.integers(1, 4, 300).astype(np.uint32)
    ptrs = np.unique(rng.integers(1, 1 << 40, 300).astype(np.uint64))[:300]
    pids = pids[: len(ptrs)]
    _insert(table, pids, ptrs)
    rows, where = table.lookup(pids, ptrs)
    assert (rows >= 0).all()
    table.remove(rows, where)
    table.check()
    assert table.removed_slots == 0  # each removed chain ends at an empty slot


def test_keys_past_emptied_slots_are_still_found() -> None:
    """Collisions on purpose: every key of one home slot (a run of probes), then every other one
    removed; those left must be found and the removed ones not, through many rounds of churn."""
    table = AllocTable()
    rng = np.random.default_rng(5)
    live: dict[tuple[int, int], bool] = {}
    next_ptr = 1
    for _ in range(40):
        n = int(rng.integers(20, 200))
        pids = rng.integers(1, 3, n).astype(np.uint32)
        ptrs = np.arange(next_ptr, next_ptr + n, dtype=np.uint64)
        next_ptr += n
        _insert(table, pids, ptrs)
        live.update(dict.fromkeys(zip(pids.tolist(), ptrs.tolist()), True))
        keys = list(live)
        gone = [keys[i] for i in rng.permutation(len(keys))[: len(keys) // 2]]
        gp, gq = (np.array(c, dtype) for c, dtype in zip(zip(*gone), (np.uint32, np.uint64)))
        rows, where = table.lookup(gp, gq)
        assert (rows >= 0).all()
        table.remove(rows, where)
        for k in gone:
            del live[k]
        table.check()  # also: a removed slot is kept only where a probe may pass it
        lp, lq = (np.array(c, dtype) for c, dtype in zip(zip(*live), (np.uint32, np.uint64)))
        assert (table.lookup(lp, lq)[0] >= 0).all()
        assert (table.lookup(gp, gq)[0] == -1).all()


def test_a_runs_key_order_is_the_one_by_key_finds_alone() -> None:
    rng = np.random.default_rng(11)
    n = 5000
    ev = empty_events(n)
    kinds = rng.choice(np.array([ALLOC, FREE, IPC_EXPORT], np.uint16), n, p=[0.5, 0.45, 0.05])
    ev["kind"] = kinds
    ev["pid"] = rng.integers(1000, 1004, n)
    ev["ptr"] = rng.integers(0, 300, n).astype(np.uint64) * 4096  # keys repeat: groups of several events
    ev["result"][rng.random(n) < 0.02] = 2
    events = Batch.of(ev)
    ok = ev["result"] == 0
    plain_ok = ok & ((kinds == ALLOC) | (kinds == FREE))
    barriers = np.flatnonzero(ok & (kinds == IPC_EXPORT))
    plan = Planner(Tables(False, 10), events, plain_ok, barriers)
    for lo, hi in [(0, n), (0, 1), (17, 2500), (2500, n), (4999, n), (100, 100)]:
        pm = np.flatnonzero(plain_ok[lo:hi]) + lo
        pid, ptr = ev["pid"][pm], ev["ptr"][pm]
        order = plan.run_order(lo, hi)
        assert np.array_equal(by_key(pid, ptr, key_hash(pid, ptr), order), by_key(pid, ptr))
        assert np.array_equal(np.sort(order), np.arange(len(pm)))
