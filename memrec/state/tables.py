"""LiveState's tables and counters as one object that every applier receives.

:class:`~memrec.state.live.LiveState` owns one :class:`Tables`; the appliers that change it —
event by event (:class:`memrec.state.vmm_ipc.VmmIpc`, ``LiveState._apply_events``), a run at
once (:func:`memrec.state.plain.apply_run`, :func:`memrec.state.vmm_run.apply_vmm`) and the
planner that cuts a batch into runs (:class:`memrec.state.planner.Planner`) — are handed it and
read and write its public attributes. They import this module, not ``live``: the state's
package has no import circle and no module reaches into another's privates. The primitives
every applier shares (a counter change, an anomaly, an export forgotten, the allocation holding
a pointer) are methods here, so each applier keeps the same accounting.
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import Any
from typing import Iterable

import numpy as np

from memrec.terms.events import IPC_MAPPED
from memrec.state.allocs import AllocTable
from memrec.state.allocs import HandleTable
from memrec.state.allocs import MapTable


class Tables:
    """The live state's data: the tables, the byte counters and the running counts.

    Args:
        journal: keep :attr:`journal`, one row per counter change.
        max_failures: how many recent failed calls :attr:`failures` keeps.
    """

    def __init__(self, journal: bool, max_failures: int) -> None:
        self.allocs = AllocTable()  # driver allocations (pid, ptr) -> size, gpu, ts, api
        self.handles = HandleTable()  # VMM handles (pid, handle) -> HANDLE_FIELDS
        self.maps = MapTable()  # VMM mappings (pid, va) -> size, handle, offset, ts
        self.aliases: dict[int, dict[int, int]] = {}  # pid -> retained handle -> handle
        self.exports: dict[bytes, list] = {}  # handle bytes -> [pid, ptr, gpu, size, ts]
        self.exported: dict[int, dict[int, list[bytes]]] = {}  # pid -> ptr -> handle bytes
        self.fabric: dict[bytes, list] = {}  # fabric handle bytes -> [pid, handle]
        self.opens: dict[int, dict[int, list]] = {}  # pid -> mapped ptr -> open record
        self.host: dict[int, dict[int, list]] = {}  # pid -> ptr -> [size, ts, api]
        self.bytes: dict[tuple[int, int, int], int] = {}  # (gpu, pid, category) -> bytes
        self.gpu_owned: dict[int, int] = {}  # gpu -> owned bytes (host pinned under -1)
        self.peaks: dict[int, list] = {}  # gpu -> [bytes, ts] of the owned peak
        self.exits: list[list] = []
        #: While a run applies at once: the per-event kinds' counter changes, applied with the
        #: run's (in event order) by :func:`memrec.state.plain.apply_changes`.
        self.log: list[tuple] | None = None
        #: IPC exports inside such a run whose allocation came earlier in it: event index ->
        #: (base, (size, gpu, ts, api)) as the allocation was then (see planner.Planner).
        self.alloc_hints: dict[int, tuple[int, tuple[int, int, int, int]]] = {}
        self.failures: deque[list] = deque(maxlen=max_failures)
        #: Failed calls seen in all (``failures`` keeps only the most recent).
        self.n_failures = 0
        #: Events that did not match the state (a free of an unknown pointer, ...), by what they were.
        self.anomalies: dict[str, int] = {}
        #: Events applied so far (the index of the next event).
        self.n_events = 0
        #: Timestamp of the last event applied.
        self.last_ts = 0
        #: With ``journal=True``: flat ``array('q')`` of rows ``JOURNAL_FIELDS``.
        self.journal: array | None = array("q") if journal else None
        #: Where a replay gathers the journal as columns (see ``LiveState.journal_sink``).
        self.journal_sink: Any = None

    def anomaly(self, what: str, count: int = 1) -> None:
        self.anomalies[what] = self.anomalies.get(what, 0) + count

    def change(self, index: int, ts: int, gpu: int, pid: int, cat: int, delta: int, *,
               peak: bool = True, keep_zero: bool = False) -> None:
        """Add ``delta`` bytes to (gpu, pid, category), keeping the owned totals and peaks.

        A change of 0 is dropped unless ``keep_zero`` (an allocation or free of 0 bytes still
        gets its journal row); ``peak=False`` (a free) leaves the peak alone. While a run is
        applied at once the change waits in :attr:`log`.
        """
        if delta == 0 and not keep_zero:
            return
        if self.log is not None:
            self.log.append((index, ts, gpu, pid, cat, delta, peak))
            return
        key = (gpu, pid, cat)
        v = self.bytes.get(key, 0) + delta
        if v:
            self.bytes[key] = v
        else:
            self.bytes.pop(key, None)
        if cat != IPC_MAPPED:
            tot = self.gpu_owned.get(gpu, 0) + delta
            self.gpu_owned[gpu] = tot
            pk = self.peaks.get(gpu)
            if not peak:
                pass
            elif pk is None:
                self.peaks[gpu] = [max(tot, 0), ts]
            elif tot > pk[0]:
                pk[0] = tot
                pk[1] = ts
        if self.journal is not None:
            self.journal.extend((index, ts, gpu, pid, cat, delta))

    def forget_exports(self, pids: Iterable[int], ptrs: Iterable[int]) -> None:
        """Each exporter ``pids[i]`` freed ``ptrs[i]``: those IPC handles can no longer be opened
        (a run's frees in one call: a call per free cost more than its work)."""
        exported, exports = self.exported, self.exports
        for pid, ptr in zip(pids, ptrs):
            ex = exported.get(pid)
            if ex is None or ptr not in ex:
                continue
            for hb in ex.pop(ptr):
                cur = exports.get(hb)
                if cur is not None and cur[0] == pid and cur[1] == ptr:
                    del exports[hb]
            if not ex:
                del exported[pid]

    def resolve_alias(self, pid: int, handle: int) -> int:
        """The handle a retained alias stands for (``handle`` itself when it is none)."""
        al = self.aliases.get(pid)
        if al:
            return al.get(handle, handle)
        return handle

    def alloc_at(self, pid: int, ptr: int, index: int) -> tuple[int, tuple[int, int, int, int] | None]:
        """The driver allocation at ``ptr`` or holding it (a block inside a cached segment; of
        overlapping ones, the one starting nearest below) for event ``index``: (base, (size,
        gpu, ts, api))."""
        hint = self.alloc_hints.get(index)
        if hint is not None:
            return hint
        al = self.allocs
        row, _ = al.find(pid, ptr)
        if row >= 0:
            return ptr, al.row(row)
        cand = al.rows_of(pid)
        if not (0 <= ptr < 1 << 64) or len(cand) == 0:
            return ptr, None
        base = al.ptr[cand]
        p = np.uint64(ptr)
        inside = (base <= p) & ((p - np.minimum(base, p)) < al.size[cand].astype(np.uint64))
        if not inside.any():
            return ptr, None
        hit = cand[inside][np.argmax(base[inside])]
        return int(al.ptr[hit]), al.row(hit)
