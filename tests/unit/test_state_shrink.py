"""The live state gives memory back (issue 26): a table whose rows mostly went compacts.

The daemon kept its peak RSS after every process had exited: the columns were only ever grown.
:meth:`memrec.state.allocs.KeyTable.shrink` compacts them between batches once at most a quarter
of the rows are live; here the table must still find, add and remove exactly what a table that
never shrank does, and its storage must come back down to its start after everything exited.
"""

from __future__ import annotations

import numpy as np

from memrec.terms.columns import empty_events
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.state import LiveState
from memrec.state.allocs import AllocTable


def _allocs(pids: np.ndarray, first: int) -> np.ndarray:
    ev = empty_events(len(pids))
    ev["ts"] = np.arange(first, first + len(pids))
    ev["pid"] = ev["tid"] = pids
    ev["kind"], ev["api"] = int(Kind.ALLOC), int(Api.cuMemAlloc_v2)
    ev["ptr"] = (1 << 40) + np.arange(first, first + len(pids), dtype=np.uint64) * 4096
    ev["size"] = 4096
    ev["gpu"] = pids % 2
    return ev


def test_a_table_that_shrinks_keeps_every_key(monkeypatch) -> None:
    rng = np.random.default_rng(3)
    table, plain = AllocTable(), AllocTable()
    monkeypatch.setattr(plain, "shrink", lambda: False)
    shrunk = 0
    keys: set[tuple[int, int]] = set()
    for round_ in range(12):
        grow = round_ % 3 != 2
        if grow:
            n = int(rng.integers(1, 20_000))
            pids = rng.integers(1, 9, n).astype(np.uint32)
            ptrs = rng.integers(0, 1 << 47, n).astype(np.uint64)
            fresh = {(int(p), int(q)) for p, q in zip(pids, ptrs)} - keys
            pids = np.array([k[0] for k in fresh], np.uint32)
            ptrs = np.array([k[1] for k in fresh], np.uint64)
            cols = (pids, ptrs, ptrs, np.zeros(len(pids), np.int16), ptrs, np.ones(len(pids), np.uint8))
            for t in (table, plain):
                t.insert(*cols[: len(t.names)])
            keys |= fresh
        else:  # most keys go: the table should compact
            gone = [k for k in keys if rng.random() < 0.9]
            for t in (table, plain):
                rows, where = t.lookup(np.array([k[0] for k in gone], np.uint32), np.array([k[1] for k in gone], np.uint64))
                t.remove(rows, where)
            keys -= set(gone)
        shrunk += table.shrink()
        assert table.count == plain.count == len(keys)
        probe = list(keys)[:500] + [(99, 12345)]
        pids = np.array([k[0] for k in probe], np.uint32)
        ptrs = np.array([k[1] for k in probe], np.uint64)
        a, _ = table.lookup(pids, ptrs)
        b, _ = plain.lookup(pids, ptrs)
        assert ((a >= 0) == (b >= 0)).all() and (a[:-1] >= 0).all() and a[-1] == -1
        assert (table.size[a[:-1]] == plain.size[b[:-1]]).all()
        assert sorted(zip(table.pid[table.rows_of()].tolist(), table.ptr[table.rows_of()].tolist())) == sorted(keys)
    assert shrunk >= 2
    assert table.nbytes() < plain.nbytes()


def test_the_state_comes_back_to_its_size_after_every_process_exited() -> None:
    state = LiveState()
    start = state.tables.allocs.nbytes()
    pids = (np.arange(200_000) % 16 + 1000).astype(np.uint32)
    state.apply(_allocs(pids, 1))
    assert state.tables.allocs.nbytes() > 20 * start
    exits = empty_events(16)
    exits["ts"] = 10**6 + np.arange(16)
    exits["pid"] = exits["tid"] = np.arange(1000, 1016)
    exits["kind"] = int(Kind.PROC_EXIT)
    state.apply(exits)
    assert state.owned_bytes() == 0 and len(state.tables.allocs) == 0
    assert state.tables.allocs.nbytes() <= 2 * start and state.capacity() <= 3 * 1024
    # and it works as before afterwards
    state.apply(_allocs(np.full(3, 7, np.uint32), 2 * 10**6))
    assert state.owned_bytes() == 3 * 4096
