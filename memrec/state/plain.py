"""Driver allocations and frees of a run of events, applied at once with numpy.

cuMemAlloc and cuMemFree are nearly every event on a busy host. :func:`apply_run` applies a
piece of a batch (no process exit inside, and IPC exports and opens only where :class:`Planner`
lets them join: :meth:`LiveState.apply` cuts there) with the result the event-by-event path
(:meth:`LiveState._apply_events`) gives:

- the run's allocations and frees are grouped by (pid, ptr), each key's events in order
  (:func:`by_key`); whether a key is live before an event follows from the event before it (an allocation
  leaves it live, a free leaves it gone) or, for a key's first event, from the table. That gives
  every anomaly (an allocation over a live one, a free of an unknown pointer), every matched
  free's size and GPU (the fill-in), and the table's end state (the last allocation of a key);
- the other kinds of the run (VMM, host, IPC) go event by event with their counter
  changes held back, and :func:`apply_changes` applies all changes in event order: the counters
  summed per key, each GPU's owned total a running sum whose peak is its first maximum, the
  journal rows stacked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from memrec.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.events import DRIVER
from memrec.events import FLAG_IPC_BYTES
from memrec.events import IPC_MAPPED
from memrec.state.allocs import by_key
from memrec.state.allocs import key_hash
from memrec.state.allocs import key_hash1
from memrec.state.fields import ALLOC
from memrec.state.fields import FREE
from memrec.state.fields import IPC_EXPORT
from memrec.state.fields import IPC_OPEN
from memrec.state.fields import JOINABLE_KINDS
from memrec.state.fields import MAX_SIZE
from memrec.state.fields import MAX_TS
from memrec.state.fields import OTHER_KINDS
from memrec.state.fields import PROC_EXIT
from memrec.state.fields import QUIET_KINDS
from memrec.state.fields import VMM_RUN_MASK
from memrec.state.fields import kind_mask
from memrec.state.fields import VMM_SERIAL_KINDS
from memrec.state.vmm_run import apply_vmm

if TYPE_CHECKING:
    from memrec.state.allocs import AllocTable
    from memrec.state.batch import Batch
    from memrec.state.live import LiveState

_QUIET = kind_mask(tuple(QUIET_KINDS))
#: Kind -> whether a successful one goes event by event inside a run (unless apply_vmm takes it).
_PER_EVENT = kind_mask(OTHER_KINDS + JOINABLE_KINDS)
#: Kinds that keep a run's VMM events event by event (they read or alias handles).
_VMM_SERIAL = kind_mask(VMM_SERIAL_KINDS)


def apply_run(state: LiveState, events: Batch, lo: int, hi: int, fill: list) -> None:
    """Apply ``events[lo:hi]`` (no exit among them; exports and opens that may join) at once."""
    seg = events[lo:hi]
    kinds = seg["kind"]
    ok = seg["result"] == 0
    base = state.n_events + lo
    _failures(state, seg, ok, base)
    per_event = ok & _PER_EVENT[kinds]
    vmm = ok & VMM_RUN_MASK[kinds]
    vmm_changes = None
    if vmm.any() and not np.any(ok & _VMM_SERIAL[kinds]):
        vmm_changes = apply_vmm(state, events, np.flatnonzero(vmm) + lo, fill)
        if vmm_changes is not None:
            per_event &= ~vmm
    state._log = []
    try:
        state._apply_events(events, np.flatnonzero(per_event) + lo, fill)
        pm = np.flatnonzero(ok & ((kinds == ALLOC) | (kinds == FREE)))
        cols = {name: seg[name][pm] for name in ("kind", "pid", "ptr", "size", "gpu", "ts", "api")}
        changes = _allocs_and_frees(state, cols, pm + lo, base - lo, fill)
        log = state._log
    finally:
        state._log = None
    more = [vmm_changes] if vmm_changes is not None and len(vmm_changes[0]) else []
    if log:
        cols = list(zip(*log))
        more.append([np.asarray(c, np.int64) for c in cols[:6]] + [np.asarray(cols[6], bool)])
    if more:
        changes = [np.concatenate(parts) for parts in zip(changes, *more)]
        order = np.argsort(changes[0], kind="stable")
        changes = [c[order] for c in changes]
    apply_changes(state, *changes)


class Planner:
    """Whether an IPC export or open can join the run being gathered, for one batch.

    In a run the other kinds go first, event by event, and the allocations and frees after, at
    once. An export reads the allocation at its pointer: it joins when the run has no earlier
    event on that (pid, ptr) and the table has it, or the run's earlier events on it are
    allocations only (the last one's row is handed over as a hint; a free between would forget
    the export), or the run has no earlier event of that process at all (the interior look-up
    sees the table as it was). An open reads the export of its handle: it joins unless the run
    frees that export's allocation before it. A process exit never joins.
    """

    def __init__(self, state: LiveState, events: Batch, plain_ok: np.ndarray) -> None:
        self.state = state
        self.events = events
        self.kinds = events["kind"]
        self.pids = events["pid"]
        self.ptrs = events["ptr"]
        self.keys = key_hash(self.pids, self.ptrs)
        # The batch's successful allocations and frees as (top bits of the key hash, position)
        # in one sorted uint64 each: a key's events are a range, in event order.
        self.plain = np.flatnonzero(plain_ok)
        self.shift = np.uint64(max(20, len(self.kinds).bit_length()))
        self.low = (1 << int(self.shift)) - 1
        pos = self.plain.astype(np.uint64)
        self.by_key = np.sort((self.keys[self.plain] >> self.shift << self.shift) | pos)
        self.key_pos = (self.by_key & np.uint64(self.low)).astype(np.int64)
        self._of_pid: dict[int, np.ndarray] = {}
        self.joined: dict[bytes, int] = {}  # handle bytes -> key hash of the allocation, of exports joined
        self._exports: dict[int, tuple] | None = None  # see _export_facts
        self._open_bytes: dict[int, bytes | None] | None = None  # position -> an open's handle bytes

    def restart(self) -> None:
        """A new run begins."""
        self.joined.clear()

    def joins(self, lo: int, b: int) -> bool:
        """Whether event ``b`` (an export, open or exit) joins the run that began at ``lo``."""
        kind = int(self.kinds[b])
        if kind == PROC_EXIT:
            return False
        if kind == IPC_EXPORT:
            return self._export_joins(lo, b)
        return self._open_joins(lo, b)

    def _on_key(self, key: int, lo: int, b: int) -> np.ndarray:
        """Positions in [lo, b) of allocations and frees whose key hash has ``key``'s top bits
        (its key's events, and any of another key that shares them)."""
        top = (key >> int(self.shift)) << int(self.shift)
        i0, i1 = np.searchsorted(self.by_key, np.array([top | lo, top | b], np.uint64)).tolist()
        return self.key_pos[i0:i1]

    def _pid_has_events(self, pid: int, lo: int, b: int) -> bool:
        pos = self._of_pid.get(pid)
        if pos is None:
            pos = self._of_pid[pid] = self.plain[self.pids[self.plain] == pid]
        i = np.searchsorted(pos, lo)
        return bool(i < len(pos) and pos[i] < b)

    def _export_facts(self) -> dict[int, tuple]:
        """For each successful export of the batch (by position), found with numpy at once: its
        pid, ptr and key hash, the position of the last allocation or free of its (pid, ptr)
        before it and of the last such free (-1: none), of the last allocation or free of its
        process (-1: none), the hint that last event gives, and its handle bytes (None: none).
        None instead where another key shares its hash's top bits (then
        :meth:`_export_joins_slowly` looks item by item)."""
        ev = self.events
        at = np.flatnonzero((self.kinds == IPC_EXPORT) & (ev["result"] == 0))
        if len(self.plain):
            prev, prev_free, shared, pid_prev = self._export_arrays(at)
        else:
            prev = prev_free = pid_prev = np.full(len(at), -1)
            shared = np.zeros(len(at), bool)
        j = np.maximum(prev, 0)
        hints = zip(np.minimum(ev["size"][j], MAX_SIZE).tolist(), ev["gpu"][j].tolist(),
                    np.minimum(ev["ts"][j], MAX_TS).tolist(), ev["api"][j].tolist())
        hb = bytes_at(ev, at, (ev["flags"][at] & FLAG_IPC_BYTES) != 0)
        cols = (at.tolist(), self.pids[at].tolist(), self.ptrs[at].tolist(), self.keys[at].tolist(), prev.tolist(),
                prev_free.tolist(), pid_prev.tolist(), shared.tolist(), hints, hb)
        return {b: None if sh else (pid, ptr, key, pv, pf, pl, hint, h)
                for b, pid, ptr, key, pv, pf, pl, sh, hint, h in zip(*cols)}

    def _export_arrays(self, at: np.ndarray) -> tuple[np.ndarray, ...]:
        """:meth:`_export_facts`' searches, for a batch with allocations or frees."""
        shift, low = self.shift, np.uint64(self.low)
        comp, sp = self.by_key, self.key_pos
        top = (self.keys[at] >> shift) << shift
        g0 = np.searchsorted(comp, top)
        g1 = np.searchsorted(comp, top | low, "right")
        last = np.searchsorted(comp, top | at.astype(np.uint64)) - 1
        here = last >= g0  # the key has events before the export
        last = np.maximum(last, 0)
        prev = np.where(here, sp[last], -1)
        free_at = np.maximum.accumulate(np.where(self.kinds[sp] == FREE, np.arange(len(sp)), -1))[last]
        prev_free = np.where(here & (free_at >= g0), sp[np.maximum(free_at, 0)], -1)
        # Whether a group holds another key than the export's: those go item by item.
        kp, kq = self.pids[sp], self.ptrs[sp]
        other = np.zeros(len(sp), bool)
        other[1:] = ((comp[1:] >> shift) == (comp[:-1] >> shift)) & ((kp[1:] != kp[:-1]) | (kq[1:] != kq[:-1]))
        mixed = np.cumsum(other)
        f = np.minimum(g0, len(sp) - 1)
        shared = (g1 > g0) & ((mixed[np.maximum(g1 - 1, 0)] > mixed[f]) | (kp[f] != self.pids[at]) | (kq[f] != self.ptrs[at]))
        # The last allocation or free of the export's process before it.
        pid_at = self.pids[at].astype(np.uint64)
        by_pid = np.sort((self.pids[self.plain].astype(np.uint64) << shift) | self.plain.astype(np.uint64))
        j = np.maximum(np.searchsorted(by_pid, (pid_at << shift) | at.astype(np.uint64)) - 1, 0)
        mine = (by_pid[j] >> shift) == pid_at
        mine &= by_pid[j] < ((pid_at << shift) | at.astype(np.uint64))
        pid_prev = np.where(mine, (by_pid[j] & low).astype(np.int64), -1)
        return prev, prev_free, shared, pid_prev

    def _export_joins(self, lo: int, b: int) -> bool:
        if self._exports is None:
            self._exports = self._export_facts()
        facts = self._exports[b]
        if facts is None:
            return self._export_joins_slowly(lo, b)
        state = self.state
        pid, ptr, key, prev, prev_free, pid_prev, hint, hb = facts
        index = state.n_events + b
        if prev >= lo:
            if prev_free >= lo:
                return False  # the free forgets exports made before it only: keep it in order
            state._alloc_hints[index] = (ptr, hint)
        elif state._allocs.find(pid, ptr)[0] < 0:
            if pid_prev >= lo:
                return False
            key = self._interior_key(pid, ptr, key, index)
        if hb is not None:
            self.joined[hb] = key
        return True

    def _export_joins_slowly(self, lo: int, b: int) -> bool:
        """:meth:`_export_joins` for an export whose key hash another key shares."""
        state = self.state
        pid, ptr, key = int(self.pids[b]), int(self.ptrs[b]), int(self.keys[b])
        same = self._on_key(key, lo, b)
        same = same[(self.pids[same] == pid) & (self.ptrs[same] == ptr)]
        index = state.n_events + b
        if len(same):
            if np.any(self.kinds[same] == FREE):
                return False
            state._alloc_hints[index] = (ptr, self._hint(int(same[-1])))
        elif state._allocs.find(pid, ptr)[0] < 0:
            if self._pid_has_events(pid, lo, b):
                return False
            key = self._interior_key(pid, ptr, key, index)
        if int(self.events["flags"][b]) & FLAG_IPC_BYTES:
            self.joined[self.events.ipc_bytes(b)] = key
        return True

    def _hint(self, j: int) -> tuple[int, int, int, int]:
        """The allocation event ``j`` makes, as the table would hold it: (size, gpu, ts, api)."""
        ev = self.events
        return int(min(ev["size"][j], MAX_SIZE)), int(ev["gpu"][j]), int(min(ev["ts"][j], MAX_TS)), int(ev["api"][j])

    def _interior_key(self, pid: int, ptr: int, key: int, index: int) -> int:
        """The key hash of the allocation holding ``ptr`` (``key`` when none does)."""
        base, found = self.state._alloc_at(pid, ptr, index)
        if found is None:
            return key
        return key_hash1(pid, base)

    def _open_joins(self, lo: int, b: int) -> bool:
        state = self.state
        if not int(self.events["flags"][b]) & FLAG_IPC_BYTES:
            return True  # it reads no export
        if self._open_bytes is None:
            at = np.flatnonzero(self.kinds == IPC_OPEN)
            self._open_bytes = dict(zip(at.tolist(), bytes_at(self.events, at, np.ones(len(at), bool))))
        hb = self._open_bytes[b]
        key = self.joined.get(hb)
        if key is None:
            ex = state._exports.get(hb)
            if ex is None or not (0 <= ex[0] < 1 << 32 and 0 <= ex[1] < 1 << 64):
                return True
            key = key_hash1(ex[0], ex[1])
        return not np.any(self.kinds[self._on_key(key, lo, b)] == FREE)


def bytes_at(events: Batch, at: np.ndarray, flagged: np.ndarray) -> list[bytes | None]:
    """:meth:`Batch.ipc_bytes` of the events ``at`` that are ``flagged`` (None for the others),
    with one search."""
    index = events.ipc_index
    j = np.minimum(np.searchsorted(index, at), max(len(index) - 1, 0))
    hit = (index[j] == at) if len(index) else np.zeros(len(at), bool)
    out: list[bytes | None] = [None] * len(at)
    zero = bytes(events.ipc.dtype.itemsize)
    for i, k, h in zip(np.flatnonzero(flagged).tolist(), j[flagged].tolist(), hit[flagged].tolist()):
        out[i] = events.ipc[k].tobytes() if h else zero
    return out


def _failures(state: LiveState, seg: Batch, ok: np.ndarray, base: int) -> None:
    """Count the failed calls (but expected failures of code and pool calls) and keep the latest."""
    bad = np.flatnonzero(~ok)
    if len(bad) == 0:
        return
    loud = ~_QUIET[seg["kind"][bad]] | (seg["result"][bad] == CUDA_ERROR_OUT_OF_MEMORY)
    bad = bad[loud]
    state.n_failures += len(bad)
    keep = state.failures.maxlen
    if keep == 0 or len(bad) == 0:
        return
    if keep is not None:
        bad = bad[-keep:]
    f = seg[bad]
    cols = ((bad + base).tolist(), np.minimum(f["ts"], MAX_TS).tolist(), f["pid"].tolist(), f["tid"].tolist(),
            f["kind"].tolist(), f["api"].tolist(), f["result"].tolist(), f["gpu"].tolist(),
            np.minimum(f["size"], MAX_SIZE).tolist(), f["ptr"].tolist())
    state.failures.extend(list(row) for row in zip(*cols))


def _allocs_and_frees(state: LiveState, ev: dict[str, np.ndarray], where: np.ndarray, base: int,
                      fill: list) -> list[np.ndarray]:
    """Apply successful ALLOC/FREE events (columns ``ev``, at batch positions ``where``) to the table.

    Returns their counter changes in event order: index, ts, gpu, pid, category, delta, peak.
    """
    m = len(where)
    table = state._allocs
    order = by_key(ev["pid"], ev["ptr"])
    pid = ev["pid"][order]
    ptr = ev["ptr"][order]
    is_alloc = ev["kind"][order] == ALLOC
    size = np.minimum(ev["size"][order], MAX_SIZE).astype(np.int64)
    gpu = ev["gpu"][order]
    ts = np.minimum(ev["ts"][order], MAX_TS).astype(np.int64)
    head = np.ones(m, bool)
    head[1:] = (pid[1:] != pid[:-1]) | (ptr[1:] != ptr[:-1])
    heads = np.flatnonzero(head)
    rows, slots = table.lookup(pid[heads], ptr[heads])
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
        state._anomaly("alloc_over_live", n_over)
    if n_unknown:
        state._anomaly("free_unknown", n_unknown)
    gfill = freed & (gpu < 0) & (prev_gpu >= 0)
    if gfill.any():
        fill.append((where[order][gfill], prev_gpu[gfill]))

    # The table's end state: found keys leave, each key's last allocation (if last) comes in.
    table.remove(rows[found], slots[found])
    tails = np.concatenate((heads[1:] - 1, [m - 1])) if m else heads
    last = tails[is_alloc[tails]]
    table.insert(pid[last], ptr[last], size[last], gpu[last], ts[last], ev["api"][order][last])
    exported = np.sort(exported_keys(state)) if state._exported and freed.any() else ()
    if len(exported):
        hits = np.flatnonzero(freed)
        h = key_hash(pid[hits], ptr[hits])
        hits = hits[exported[np.minimum(np.searchsorted(exported, h), len(exported) - 1)] == h]
        for p, q in zip(pid[hits].tolist(), ptr[hits].tolist()):
            state._forget_exports(p, q)

    # Changes, two slots per event in event order: an overwritten allocation leaves first (when
    # not empty), then the new one comes (or the freed one leaves).
    def unsort(x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        out[order] = x
        return out

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


def apply_changes(state: LiveState, index: np.ndarray, ts: np.ndarray, gpu: np.ndarray, pid: np.ndarray,
                  cat: np.ndarray, delta: np.ndarray, peak: np.ndarray) -> None:
    """Apply counter changes (in event order) as :meth:`LiveState._change` would one by one."""
    if len(index) == 0:
        return
    if state.journal is not None and state.journal_sink is not None:
        state.journal_sink.take(state)  # the rows journaled before these, first
        state.journal_sink.add(index, ts, gpu, pid, cat, delta)  # a replay's columns: straight in
    elif state.journal is not None:
        state.journal.frombytes(np.column_stack((index, ts, gpu, pid, cat, delta)).astype(np.int64).tobytes())
    counts = state._bytes
    key = ((gpu + 32768) << 34) | (pid << 2) | cat
    order = np.argsort(key)
    key = key[order]
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
    own = (np.sort(((gpu[own] + 32768) << 40) | own) & ((1 << 40) - 1))  # by GPU, in event order
    og, od = gpu[own], delta[own]
    head = np.ones(len(own), bool)
    head[1:] = og[1:] != og[:-1]
    starts = np.flatnonzero(head)
    group = np.cumsum(head) - 1
    gpus = og[starts].tolist()
    owned = state._gpu_owned
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
    peaks = state._peaks
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


def exported_keys(state: LiveState) -> np.ndarray:
    """Key hashes of the allocations with IPC exports (a hash match is then checked exactly)."""
    pairs = [(p, q) for p, d in state._exported.items() for q in d]
    return key_hash(np.array([p for p, _ in pairs], np.uint32), np.array([q for _, q in pairs], np.uint64))


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
