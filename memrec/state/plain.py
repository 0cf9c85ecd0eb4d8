"""Driver allocations and frees of a run of events, applied at once with numpy.

cuMemAlloc and cuMemFree are nearly every event on a busy host. :func:`apply_run` applies a
piece of a batch (no process exit inside, and IPC exports and opens only where
:class:`memrec.state.planner.Planner` lets them join: :meth:`LiveState.apply` cuts there) with
the result the event-by-event path (:meth:`LiveState._apply_events`) gives:

- the run's allocations and frees are grouped by (pid, ptr), each key's events in order
  (:func:`memrec.state.allocs.by_key`); whether a key is live before an event follows from the
  event before it (an allocation leaves it live, a free leaves it gone) or, for a key's first
  event, from the table. That gives every anomaly (an allocation over a live one, a free of an
  unknown pointer), every matched free's size and GPU (the fill-in), and the table's end state
  (the last allocation of a key);
- the run's VMM creates, maps, unmaps and releases go at once too
  (:func:`memrec.state.vmm_run.apply_vmm`), unless it declines them;
- the other kinds of the run (IPC, host, retains, shareable handles, declined VMM events) go
  event by event with their counter changes held back, and :func:`apply_changes` applies all
  changes in event order: the counters summed per key, each GPU's owned total a running sum
  whose peak is its first maximum, the journal rows stacked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Callable

import numpy as np

from memrec.terms.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.terms.events import DRIVER
from memrec.terms.events import IPC_MAPPED
from memrec.state.allocs import by_key
from memrec.state.allocs import key_hash
from memrec.state.allocs import radix_order
from memrec.state.fields import ALLOC
from memrec.state.fields import FREE
from memrec.state.fields import JOINABLE_KINDS
from memrec.state.fields import MAX_SIZE
from memrec.state.fields import MAX_TS
from memrec.state.fields import OTHER_KINDS
from memrec.state.fields import QUIET_KINDS
from memrec.state.fields import SHARE_IMPORT
from memrec.state.fields import VMM_RUN_MASK
from memrec.state.fields import VMM_SERIAL_KINDS
from memrec.state.fields import kind_mask
from memrec.state.vmm_run import apply_vmm

if TYPE_CHECKING:
    from memrec.state.allocs import AllocTable
    from memrec.state.batch import Batch
    from memrec.state.tables import Tables

_QUIET = kind_mask(tuple(QUIET_KINDS))
#: Kind -> whether a successful one goes event by event inside a run (unless apply_vmm takes it).
_PER_EVENT = kind_mask(OTHER_KINDS + JOINABLE_KINDS)
#: Kinds that keep the VMM events of their process in a run event by event (they read or alias
#: handles); a shareable import (it reads a peer's handle) keeps all of the run's.
_VMM_SERIAL = kind_mask(VMM_SERIAL_KINDS)


def apply_run(tables: Tables, each: Callable[[Batch, np.ndarray, list], None], events: Batch, lo: int, hi: int,
              fill: list, key_order: Callable[[int, int], np.ndarray | None] | None = None) -> None:
    """Apply ``events[lo:hi]`` (no exit among them; exports and opens that may join) at once to
    ``tables``; ``each(events, idx, fill)`` applies the events that go one by one (the state's
    event-by-event path, whose changes wait in ``tables.log`` meanwhile); ``key_order(lo, hi)``
    gives the run's allocations and frees in the radix order of their key hashes when the
    caller has it (:meth:`memrec.state.planner.Planner.run_order`)."""
    seg = events[lo:hi]
    kinds = seg["kind"]
    ok = seg["result"] == 0
    base = tables.n_events + lo
    _failures(tables, seg, ok, base)
    per_event = ok & _PER_EVENT[kinds]
    vmm = ok & VMM_RUN_MASK[kinds]
    vmm_changes = None
    if vmm.any() and not np.any(ok & (kinds == SHARE_IMPORT)):  # an import reads a peer's handle
        serial_at = ok & _VMM_SERIAL[kinds]
        serial = np.unique(seg["pid"][serial_at]).astype(np.int64) if serial_at.any() else np.zeros(0, np.int64)
        vmm_changes, declined = apply_vmm(tables, events, np.flatnonzero(vmm) + lo, fill, serial)
        per_event &= ~vmm
        per_event[declined - lo] = True
    tables.log = []
    try:
        each(events, np.flatnonzero(per_event) + lo, fill)
        pm = np.flatnonzero(ok & ((kinds == ALLOC) | (kinds == FREE)))
        cols = {name: seg[name][pm] for name in ("kind", "pid", "ptr", "size", "gpu", "ts", "api")}
        order = key_order(lo, hi) if key_order is not None else None
        changes = _allocs_and_frees(tables, cols, pm + lo, base - lo, fill, order)
        log = tables.log
    finally:
        tables.log = None
    more = [vmm_changes] if vmm_changes is not None and len(vmm_changes[0]) else []
    if log:
        cols = list(zip(*log))
        more.append([np.asarray(c, np.int64) for c in cols[:6]] + [np.asarray(cols[6], bool)])
    if more:
        changes = [np.concatenate(parts) for parts in zip(changes, *more)]
        order = np.argsort(changes[0], kind="stable")
        changes = [c[order] for c in changes]
    apply_changes(tables, *changes)


def _failures(tables: Tables, seg: Batch, ok: np.ndarray, base: int) -> None:
    """Count the failed calls (but expected failures of code and pool calls) and keep the latest."""
    bad = np.flatnonzero(~ok)
    if len(bad) == 0:
        return
    loud = ~_QUIET[seg["kind"][bad]] | (seg["result"][bad] == CUDA_ERROR_OUT_OF_MEMORY)
    bad = bad[loud]
    tables.n_failures += len(bad)
    keep = tables.failures.maxlen
    if keep == 0 or len(bad) == 0:
        return
    if keep is not None:
        bad = bad[-keep:]
    f = seg[bad]
    cols = ((bad + base).tolist(), np.minimum(f["ts"], MAX_TS).tolist(), f["pid"].tolist(), f["tid"].tolist(),
            f["kind"].tolist(), f["api"].tolist(), f["result"].tolist(), f["gpu"].tolist(),
            np.minimum(f["size"], MAX_SIZE).tolist(), f["ptr"].tolist())
    tables.failures.extend(list(row) for row in zip(*cols))


def _allocs_and_frees(tables: Tables, ev: dict[str, np.ndarray], where: np.ndarray, base: int,
                      fill: list, top: np.ndarray | None = None) -> list[np.ndarray]:
    """Apply successful ALLOC/FREE events (columns ``ev``, at batch positions ``where``) to the
    table (``top``: their radix order by key hash, when known; see :func:`by_key`).

    Returns their counter changes in event order: index, ts, gpu, pid, category, delta, peak.
    """
    m = len(where)
    table = tables.allocs
    hashes = key_hash(ev["pid"], ev["ptr"])
    order = by_key(ev["pid"], ev["ptr"], hashes, top)
    hashes = hashes[order]
    pid = ev["pid"][order]
    ptr = ev["ptr"][order]
    is_alloc = ev["kind"][order] == ALLOC
    size = np.minimum(ev["size"][order], MAX_SIZE).astype(np.int64)
    gpu = ev["gpu"][order]
    ts = np.minimum(ev["ts"][order], MAX_TS).astype(np.int64)
    head = np.ones(m, bool)
    head[1:] = (pid[1:] != pid[:-1]) | (ptr[1:] != ptr[:-1])
    heads = np.flatnonzero(head)
    rows, slots = table.lookup(pid[heads], ptr[heads], hashes[heads])
    found = rows >= 0
    # What each event meets: the key's previous event (live after an allocation) or the table.
    live_before = np.zeros(m, bool)
    live_before[1:] = is_alloc[:-1]
    prev_size = np.zeros(m, np.int64)
    prev_size[1:] = size[:-1]
    prev_gpu = np.zeros(m, np.int16)
    prev_gpu[1:] = gpu[:-1]
    live_before[heads] = found
    r = np.maximum(rows, 0)
    prev_size[heads] = np.where(found, table.size[r], 0)
    prev_gpu[heads] = np.where(found, table.gpu[r], 0)

    over = is_alloc & live_before
    freed = ~is_alloc & live_before
    n_over = int(np.count_nonzero(over))
    n_unknown = int(np.count_nonzero(~is_alloc & ~live_before))
    if n_over:
        tables.anomaly("alloc_over_live", n_over)
    if n_unknown:
        tables.anomaly("free_unknown", n_unknown)
    gfill = freed & (gpu < 0) & (prev_gpu >= 0)
    if gfill.any():
        fill.append((where[order][gfill], prev_gpu[gfill]))

    # The table's end state: found keys leave, each key's last allocation (if last) comes in.
    table.remove(rows[found], slots[found])
    tails = np.concatenate((heads[1:] - 1, [m - 1])) if m else heads
    last = tails[is_alloc[tails]]
    table.insert(pid[last], ptr[last], size[last], gpu[last], ts[last], ev["api"][order[last]], hashes=hashes[last])
    exported = np.sort(exported_keys(tables)) if tables.exported and freed.any() else ()
    if len(exported):
        hits = np.flatnonzero(freed)
        h = hashes[hits]
        hits = hits[exported[np.minimum(np.searchsorted(exported, h), len(exported) - 1)] == h]
        tables.forget_exports(pid[hits].tolist(), ptr[hits].tolist())

    # Changes, in event order: an overwritten allocation leaves first (when not empty), then the
    # new one comes (or the freed one leaves).
    def unsort(x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        out[order] = x
        return out

    if n_over == 0:  # one change at most per event (nearly always)
        one = np.flatnonzero(unsort(is_alloc | freed))
        return [
            where[one] + base,
            np.minimum(ev["ts"][one], MAX_TS).astype(np.int64),
            unsort(np.where(is_alloc, gpu, prev_gpu))[one].astype(np.int64),
            ev["pid"][one].astype(np.int64),
            np.full(len(one), DRIVER, np.int64),
            unsort(np.where(is_alloc, size, -prev_size))[one],
            ev["kind"][one] == ALLOC,
        ]
    valid = np.empty(2 * m, bool)
    valid[0::2] = unsort(over & (prev_size != 0))
    valid[1::2] = unsort(is_alloc | freed)
    gpus = np.empty(2 * m, np.int64)
    gpus[0::2] = unsort(prev_gpu)
    gpus[1::2] = unsort(np.where(is_alloc, gpu, prev_gpu))
    delta = np.empty(2 * m, np.int64)
    delta[0::2] = unsort(-prev_size)
    delta[1::2] = unsort(np.where(is_alloc, size, -prev_size))
    peak = np.ones(2 * m, bool)
    peak[1::2] = ev["kind"] == ALLOC
    two = np.repeat(np.arange(m), 2)[valid]
    return [
        where[two] + base,
        np.minimum(ev["ts"][two], MAX_TS).astype(np.int64),
        gpus[valid],
        ev["pid"][two].astype(np.int64),
        np.full(len(two), DRIVER, np.int64),
        delta[valid],
        peak[valid],
    ]


def apply_changes(tables: Tables, index: np.ndarray, ts: np.ndarray, gpu: np.ndarray, pid: np.ndarray,
                  cat: np.ndarray, delta: np.ndarray, peak: np.ndarray) -> None:
    """Apply counter changes (in event order) as :meth:`Tables.change` would one by one."""
    if len(index) == 0:
        return
    if tables.journal is not None and tables.journal_sink is not None:
        tables.journal_sink.take(tables)  # the rows journaled before these, first
        tables.journal_sink.add(index, ts, gpu, pid, cat, delta)  # a replay's columns: straight in
    elif tables.journal is not None:
        tables.journal.frombytes(np.column_stack((index, ts, gpu, pid, cat, delta)).astype(np.int64).tobytes())
    counts = tables.bytes
    # The changes grouped by (gpu, pid, category), in the order of that key.
    gcode = (gpu + 32768).astype(np.uint16)
    order = radix_order(cat.astype(np.uint8), (pid & 0xFFFF).astype(np.uint16), (pid >> 16).astype(np.uint16), gcode)
    key = (((gpu + 32768) << 34) | (pid << 2) | cat)[order]
    starts = np.flatnonzero(np.append(True, key[1:] != key[:-1]))
    for k, s in zip(key[starts].tolist(), np.add.reduceat(delta[order], starts).tolist()):
        kk = ((k >> 34) - 32768, (k >> 2) & 0xFFFFFFFF, k & 3)
        v = counts.get(kk, 0) + s
        if v:
            counts[kk] = v
        else:
            counts.pop(kk, None)
    # Each GPU's owned total, a running sum in event order (the changes grouped by GPU).
    own = np.flatnonzero(cat != IPC_MAPPED)
    if len(own) == 0:
        return
    own = own[radix_order(gcode[own])]  # by GPU, in event order
    og, od = gpu[own], delta[own]
    head = np.ones(len(own), bool)
    head[1:] = og[1:] != og[:-1]
    starts = np.flatnonzero(head)
    group = np.cumsum(head) - 1
    gpus = og[starts].tolist()
    owned = tables.gpu_owned
    cs = np.cumsum(od)
    run = cs - (cs[starts] - od[starts])[group] + np.array([owned.get(g, 0) for g in gpus], np.int64)[group]
    for g, total in zip(gpus, run[np.append(starts[1:] - 1, len(own) - 1)].tolist()):
        owned[g] = total
    # Peaks: of the changes that may raise one, each GPU's first and its first highest.
    touch = np.flatnonzero(peak[own])
    if len(touch) == 0:
        return
    tg, tv = group[touch], run[touch]
    new = np.append(True, tg[1:] != tg[:-1])
    first = np.flatnonzero(new)
    best = np.flatnonzero(tv == np.maximum.reduceat(tv, first)[np.cumsum(new) - 1])
    best = best[np.append(True, tg[best][1:] != tg[best][:-1])]
    tts = ts[own][touch]
    peaks = tables.peaks
    for k, v0, t0, v, t in zip(tg[first].tolist(), tv[first].tolist(), tts[first].tolist(), tv[best].tolist(),
                               tts[best].tolist()):
        pk = peaks.get(gpus[k])
        if pk is None:
            pk = peaks[gpus[k]] = [max(v0, 0), t0]
        if v > pk[0]:
            pk[0] = v
            pk[1] = t


def group_sums(groups: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Exact int64 sums of ``values`` (below 2^52 in size) by group number, through float
    bincount: each 26-bit half sums below 2^53 for up to 2^26 values."""
    values = values.astype(np.int64, copy=False)
    hi = np.bincount(groups, weights=values >> 26, minlength=n).astype(np.int64)
    lo = np.bincount(groups, weights=values & ((1 << 26) - 1), minlength=n).astype(np.int64)
    return (hi << 26) + lo


def exported_keys(tables: Tables) -> np.ndarray:
    """Key hashes of the allocations with IPC exports (a hash match is then checked exactly),
    read out of each process's dict at once."""
    parts = [key_hash(np.full(len(d), p, np.uint32), np.fromiter(d, np.uint64, len(d)))
             for p, d in tables.exported.items()]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


def last_of_keys(pids: np.ndarray, ptrs: np.ndarray) -> np.ndarray:
    """Positions of the last row of each distinct (pid, ptr)."""
    n = len(pids)
    order = np.lexsort((np.arange(n), ptrs, pids))
    sp, sq = pids[order], ptrs[order]
    tail = np.ones(n, bool)
    tail[:-1] = (sp[1:] != sp[:-1]) | (sq[1:] != sq[:-1])
    return order[tail]


def alloc_totals(table: AllocTable) -> dict[tuple[int, int, int], int]:
    """Driver bytes by (gpu, pid, DRIVER) of the live allocations."""
    rows = table.rows_of()
    if len(rows) == 0:
        return {}
    key = ((table.gpu[rows].astype(np.int64) + 32768) << 32) | table.pid[rows].astype(np.int64)
    order = np.argsort(key, kind="stable")
    sk = key[order]
    starts = np.flatnonzero(np.concatenate(([True], sk[1:] != sk[:-1])))
    sums = np.add.reduceat(table.size[rows][order], starts)
    return {((k >> 32) - 32768, k & 0xFFFFFFFF, DRIVER): s for k, s in zip(sk[starts].tolist(), sums.tolist())}
