"""The live memory state: who holds what, on which GPU, right now.

One :class:`LiveState` is kept by the daemon (keyframes, live view) and rebuilt by the analysis
(replay). :meth:`LiveState.apply` takes event arrays (``EVENT_DTYPE``) in time order and keeps:

- driver allocations ``(pid, ptr)`` (``cuMemAlloc*``): category ``driver``, owned;
- VMM physical handles ``(pid, handle)`` (``cuMemCreate``): category ``vmm``, owned from creation
  until the handle is released *and* no longer mapped (a handle created with a host location is
  ``host_pinned``); ``cuMemRetainAllocationHandle`` adds a reference that a release takes back;
- VMM mappings ``(pid, va)`` (``cuMemMap``): never counted themselves, they keep a handle alive;
- IPC exports (64 handle bytes → exporter pid, pointer, GPU, and the size of the exporter's
  allocation) and IPC opens ``(pid, mapped ptr)``: *mapped, not owned*. An open is counted once as
  ``ipc_mapped`` in the importer's view (under the importer's GPU, or the owner's GPU when the
  importer's is unknown) and never in any device's owned total: the bytes are owned by the exporter;
- shareable imports (``cuMemImportFromShareableHandle``): a peer's physical handle, mapped, not
  owned (``ipc_mapped``); its size is learned from the first ``cuMemMap`` of it, or from the
  exporter's handle when fabric handle bytes join the two;
- pinned host memory ``(pid, ptr)`` (``cuMemHostAlloc``, ``cuMemAllocHost``, ``cuMemHostRegister``):
  category ``host_pinned``, GPU -1.

Failed calls (``result != 0``) change nothing; the most recent ones are kept (``failures``) with a
running count for OOM analysis. ``PROC_EXIT`` frees everything the process held (the driver does
this implicitly) and records what that was (:meth:`LiveState.exit_records`).

``apply`` also fills in ``events["gpu"]`` where it is -1 and the state knows it: a free gets its
allocation's GPU, a map/unmap/release/retain its handle's GPU, an IPC close its open's GPU, an IPC
export its allocation's GPU. Host events stay -1 (host memory).

GPU -1 in the tables means "host, or a GPU nobody could tell": host pinned memory always, device
memory only when the daemon could not resolve the device.

Known limits: when an exporter frees (or exits) while importers still have its memory open, the
bytes leave the exporter's owned total at once although the driver keeps them until the last
importer closes; ``cuMemUnmap`` over several mappings is handled, partial unmaps of one mapping
drop the whole mapping.

The package: :mod:`memrec.state.live` (this class: batches, snapshots),
:mod:`memrec.state.tables` (the tables and counters, one object every applier below receives),
:mod:`memrec.state.plain` (a run of a batch at once, numpy: driver allocations and frees, and
the counter changes), :mod:`memrec.state.vmm_run` (a run's VMM creates, maps, unmaps and
releases at once), :mod:`memrec.state.planner` (where IPC exports and opens may join a run),
:mod:`memrec.state.allocs` (the columnar tables: allocations, VMM handles and mappings),
:mod:`memrec.state.vmm_ipc` (every kind one event at a time: the reference, and the rare kinds),
:mod:`memrec.state.queries` (totals, holdings, holders, exits), :mod:`memrec.state.snapshot`
(keyframe tables).
"""

from __future__ import annotations

import heapq
from typing import Any
from typing import Callable

import numpy as np

from memrec.base.untrusted import clean_text
from memrec.terms.events import CATEGORY_INDEX
from memrec.terms.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.terms.events import DRIVER
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import IPC_MAPPED
from memrec.state import plain
from memrec.state.batch import Batch
from memrec.state.fields import ALIAS_FIELDS
from memrec.state.fields import ALLOC
from memrec.state.fields import BARRIER_MASK
from memrec.state.fields import TENSOR_MASK
from memrec.state.fields import EXIT_LARGEST
from memrec.state.fields import EXPORT_FIELDS
from memrec.state.fields import FABRIC_FIELDS
from memrec.state.fields import FAILURE_FIELDS
from memrec.state.fields import FREE
from memrec.state.fields import HANDLE_BYTES_MASK
from memrec.state.fields import HANDLE_FIELDS
from memrec.state.fields import HELD_FIELDS
from memrec.state.fields import HOST_FIELDS
from memrec.state.fields import LARGEST_FIELDS
from memrec.state.fields import MAP_FIELDS
from memrec.state.fields import MAX_FAILURES
from memrec.state.fields import MAX_SIZE
from memrec.state.fields import MAX_TS
from memrec.state.fields import O_BYTES
from memrec.state.fields import OPEN_FIELDS
from memrec.state.fields import PROC_EXIT
from memrec.state.fields import PEAK_FIELDS
from memrec.state.fields import QUIET_KINDS
from memrec.state.fields import READ_VERSIONS
from memrec.state.fields import SNAPSHOT_VERSION
from memrec.state.fields import VMM_RUN_MASK
from memrec.state.snapshot import alloc_arrays
from memrec.state.tables import Tables
from memrec.state.snapshot import capture_allocs
from memrec.state.snapshot import encode_allocs
from memrec.state.snapshot import check_table
from memrec.state.snapshot import flat
from memrec.state.snapshot import flat_keyed
from memrec.state.snapshot import flat_nested
from memrec.state.snapshot import rows as table_rows
from memrec.state.planner import Planner
from memrec.state.queries import Queries
from memrec.state.queries import largest_key
from memrec.state.vmm_ipc import VmmIpc

#: A run of at least this many driver allocations and frees and VMM creates, maps, unmaps and
#: releases (between events that cut a batch) is applied at once with numpy; a shorter one
#: event by event, where numpy's fixed cost per call would be more than the Python steps it saves.
VECTOR_MIN_RUN = 24


class LiveState(Queries):
    """The live memory state built from events (see :mod:`memrec.state` for the accounting).

    Args:
        journal: keep :attr:`journal`, one row per counter change (what :mod:`memrec.analysis`
            turns into time series); off in the daemon.
        max_failures: how many recent failed calls to keep.
    """

    #: Runs shorter than this go event by event (tests set it to 0 or to a huge number to
    #: compare the two paths).
    vector_min_run = VECTOR_MIN_RUN

    def __init__(self, journal: bool = False, max_failures: int = MAX_FAILURES) -> None:
        #: The tables and counters, handed to every applier (:mod:`memrec.state.tables`).
        self.tables = Tables(journal, max_failures)
        #: The per-event accounting of every kind but driver allocations and frees.
        self.vmm = VmmIpc(self.tables)

    def _counter(name: str, doc: str) -> property:  # noqa: N805 (a class-body helper)
        """A public attribute of LiveState kept in :attr:`tables` (the appliers write it there)."""
        return property(lambda self: getattr(self.tables, name),
                        lambda self, value: setattr(self.tables, name, value), doc=doc)

    failures = _counter("failures", "The most recent failed calls (a deque of FAILURE_FIELDS rows).")
    n_failures = _counter("n_failures", "Failed calls seen in all (``failures`` keeps only the most recent).")
    anomalies = _counter("anomalies", "Events that did not match the state (a free of an unknown pointer, "
                         "...), by what they were. Usually the trace started after the memory was allocated.")
    n_events = _counter("n_events", "Events applied so far (the index of the next event).")
    last_ts = _counter("last_ts", "Timestamp of the last event applied.")
    journal = _counter("journal", "With ``journal=True``: flat ``array('q')`` of rows ``JOURNAL_FIELDS`` "
                       "(event index, ts, gpu, pid, category index, signed bytes), one per change of a "
                       "(gpu, pid, category) total.")
    journal_sink = _counter("journal_sink", "Where a replay gathers the journal as columns "
                            "(``memrec.engine.journal.JournalBuffer``: ``take(state)`` moves :attr:`journal`'s "
                            "rows in, ``add(*columns)`` appends a batch's changes without building rows); "
                            "None: every change goes to :attr:`journal`.")
    del _counter

    # ------------------------------------------------------------------ apply

    def apply(self, events: np.ndarray | Batch | Any) -> None:
        """Apply events (in time order) and fill in their ``gpu`` where known.

        ``events``: ``EVENT_DTYPE`` rows, or columns (``memrec.trace.model.EventColumns``, a dict
        of columns, a :class:`~memrec.state.batch.Batch`): read in place, no rows built. The
        fill-in writes into the caller's ``gpu`` column in place; a read-only one is left untouched.

        The batch is applied in pieces: a process exit, and an IPC export or open whose outcome
        the allocations and frees before it in the piece could change
        (:class:`memrec.state.planner.Planner`), ends one. A piece with at least
        :attr:`vector_min_run` driver allocations, frees and VMM creates, maps, unmaps and
        releases is applied at once (:func:`memrec.state.plain.apply_run`), others event by
        event; the result is the same either way.
        """
        events = Batch.of(events)
        n = len(events)
        if n == 0:
            return
        kinds = events["kind"]
        ok = events["result"] == 0
        plain_ok = ok & ((kinds == ALLOC) | (kinds == FREE))
        n_vec = np.concatenate(([0], np.cumsum(plain_ok | (ok & VMM_RUN_MASK[kinds]))))
        fill: list[tuple[np.ndarray, np.ndarray]] = []

        def piece(lo: int, hi: int) -> None:
            if hi <= lo:
                return
            if int(n_vec[hi]) - int(n_vec[lo]) >= max(self.vector_min_run, 1):
                plain.apply_run(self.tables, self._apply_events, events, lo, hi, fill,
                                plan.run_order if plan is not None else None)
            else:  # tensor blocks are not driver memory: memrec.analysis.report.tensors reads them
                idx = np.arange(lo, hi)
                self._apply_events(events, idx[~TENSOR_MASK[kinds[lo:hi]]], fill)

        lo = 0
        plan: Planner | None = None  # the batch's, when it has barriers: the runs share its key order
        self.tables.alloc_hints.clear()
        barriers = np.flatnonzero(ok & BARRIER_MASK[kinds])
        if int(n_vec[-1]) < max(self.vector_min_run, 1):
            barriers = barriers[:0]  # no piece goes at once: one piece, event by event, no planning
        if len(barriers):
            plan = Planner(self.tables, events, plain_ok, barriers)
            k = 0
            while (k := plan.next_cut(lo, k)) < len(barriers):
                b = int(barriers[k])
                piece(lo, b)
                self._apply_events(events, np.arange(b, b + 1), fill)
                lo, k = b + 1, k + 1
                plan.restart()
        piece(lo, n)
        self.tables.alloc_hints.clear()
        for table in (self.tables.allocs, self.tables.handles, self.tables.maps):  # no row is held between batches
            table.shrink()
        self.n_events += n
        self.last_ts = int(min(events["ts"][-1], MAX_TS))
        if fill and events.writeable:
            idx = np.concatenate([f[0] for f in fill])
            if len(idx):
                events["gpu"][idx] = np.concatenate([f[1] for f in fill])

    def _apply_events(self, events: Batch, idx: np.ndarray, fill: list) -> None:
        """Apply ``events[idx]`` one by one (any kind): the reference for every path."""
        if len(idx) == 0:
            return
        # The columns read, gathered from the batch (a sub-Batch would gather every column).
        col = events.columns
        kind_col = col["kind"][idx]
        # A damaged file can hold any u64: keep ts and sizes where the int64 journal and the
        # analysis can hold them (no driver gives 4 PiB, no clock reads 2^63 ns).
        cols = [kind_col.tolist(), col["result"][idx].tolist(), (idx + self.n_events).tolist(),
                np.minimum(col["ts"][idx], MAX_TS).tolist(), col["pid"][idx].tolist(), col["gpu"][idx].tolist(),
                col["ptr"][idx].tolist(), np.minimum(col["size"][idx], MAX_SIZE).tolist(), col["api"][idx].tolist()]
        if np.all((kind_col == ALLOC) | (kind_col == FREE)):
            cols += [cols[0]] * 3  # no other kind: handle, aux and handle bytes are not read
        else:
            carry = HANDLE_BYTES_MASK[kind_col] & ((col["flags"][idx] & FLAG_IPC_BYTES) != 0)
            cols += [col["handle"][idx].tolist(), col["aux"][idx].tolist(), events.ipc_bytes_at(idx, carry)]
        tables = self.tables
        allocs, change, apply_other = tables.allocs, tables.change, self.vmm.apply_other
        fill_idx: list[int] = []
        fill_gpu: list[int] = []
        for i, (kind, result, index, t, pid, gpu, ptr, size, api, handle, aux, hb) in enumerate(zip(*cols)):
            if result != 0:
                if kind in QUIET_KINDS and result != CUDA_ERROR_OUT_OF_MEMORY:
                    continue  # an expected failure of a code or pool call (events.QUIET_FAILURE_KINDS)
                self.n_failures += 1
                tid = int(col["tid"][idx[i]])
                self.failures.append([index, t, pid, tid, kind, api, result, gpu, size, ptr])
                continue
            if kind == ALLOC:
                row, slot = allocs.find(pid, ptr)
                if row >= 0:  # a free we did not see: drop the old one first
                    tables.anomaly("alloc_over_live")
                    old_size, old_gpu = int(allocs.size[row]), int(allocs.gpu[row])
                    allocs.drop(row, slot)
                    change(index, t, old_gpu, pid, DRIVER, -old_size)
                allocs.add(pid, ptr, size, gpu, t, api)
                change(index, t, gpu, pid, DRIVER, size, keep_zero=True)
            elif kind == FREE:
                row, slot = allocs.find(pid, ptr)
                if row < 0:
                    tables.anomaly("free_unknown")
                    continue
                size, g = int(allocs.size[row]), int(allocs.gpu[row])
                allocs.drop(row, slot)
                if gpu < 0 and g >= 0:
                    fill_idx.append(i)
                    fill_gpu.append(g)
                change(index, t, g, pid, DRIVER, -size, peak=False, keep_zero=True)
                if tables.exported:
                    tables.forget_exports((pid,), (ptr,))
            elif kind == PROC_EXIT:
                self._exit(index, t, pid)
            else:
                g = apply_other(kind, index, t, pid, gpu, ptr, size, handle, api, aux, hb)
                if g is not None and g >= 0 and gpu < 0:
                    fill_idx.append(i)
                    fill_gpu.append(g)
        if fill_idx:
            fill.append((idx[fill_idx], np.asarray(fill_gpu, np.int16)))

    def _exit(self, index: int, t: int, pid: int) -> None:
        """Free everything ``pid`` held, as the driver does when a process exits, and record it."""
        al = self.tables.allocs
        rows = al.rows_of(pid)
        held: dict[tuple[int, int], list[int]] = {}
        gpus, inverse = np.unique(al.gpu[rows], return_inverse=True)
        sums = plain.group_sums(inverse, al.size[rows], len(gpus))
        for g, b, n in zip(gpus.tolist(), sums.tolist(), np.bincount(inverse, minlength=len(gpus)).tolist()):
            held[(g, DRIVER)] = [b, n]
        holdings = self._top_driver(rows, EXIT_LARGEST)
        others = list(self.other_holdings(pid=pid))
        holdings += others
        for h in others:
            row = held.setdefault((h.gpu, CATEGORY_INDEX[h.category]), [0, 0])
            row[0] += h.size
            row[1] += 1
        largest = heapq.nsmallest(EXIT_LARGEST, holdings, key=largest_key)
        self.tables.exits.append(
            [
                pid,
                t,
                flat([[gg, c, b, n] for (gg, c), (b, n) in sorted(held.items())]),
                flat([[h.gpu, CATEGORY_INDEX[h.category], h.size, h.address, h.ts, h.api, h.peer] for h in largest]),
            ]
        )
        for key in sorted(k for k in self.tables.bytes if k[1] == pid):
            self.tables.change(index, t, key[0], pid, key[2], -self.tables.bytes[key])
        for columns in (self.tables.allocs, self.tables.handles, self.tables.maps):
            columns.drop_pid(pid)
        for table in (self.tables.aliases, self.tables.opens, self.tables.host):
            table.pop(pid, None)
        for ptr_bytes in self.tables.exported.pop(pid, {}).values():
            for hb in ptr_bytes:
                self.tables.exports.pop(hb, None)
        for hb in [hb for hb, ex in self.tables.exports.items() if ex[0] == pid]:
            del self.tables.exports[hb]
        for fb in [fb for fb, f in self.tables.fabric.items() if f[0] == pid]:
            del self.tables.fabric[fb]

    def capacity(self) -> int:
        """Rows the tables have room for: when it changes (a table grew or was compacted), the
        heap has pages to hand back (the daemon then calls ``malloc_trim``)."""
        return sum(len(t.live) for t in (self.tables.allocs, self.tables.handles, self.tables.maps))

    # --------------------------------------------------------------- snapshot

    def snapshot(self) -> dict:
        """The state as a keyframe: a dict of plain ints, bytes, str keys and flat lists.

        Every table is one flat list of rows (``*_FIELDS`` give the order), sorted, so that equal
        states give equal snapshots; the driver allocations are compressed columns
        (:func:`memrec.state.snapshot.encode_allocs`). :meth:`from_snapshot` restores it exactly.
        """
        return self.snapshot_later()()

    def snapshot_later(self) -> Callable[[], dict]:
        """Take the state now, cheaply (copies of the allocation columns, the small tables as
        lists); the function returned builds :meth:`snapshot`'s dict from that, in any thread,
        once (it lets go of each column as it encodes it)."""
        out = {
            "v": SNAPSHOT_VERSION,
            "n": self.n_events,
            "ts": self.last_ts,
            "allocs": None,
            "handles": self.tables.handles.flat(),
            "maps": self.tables.maps.flat(),
            "aliases": flat_nested(self.tables.aliases),
            "exports": flat_keyed(self.tables.exports),
            "fabric": flat_keyed(self.tables.fabric),
            "opens": flat_nested(self.tables.opens),
            "host": flat_nested(self.tables.host),
            "peaks": flat([[g, pk[0], pk[1]] for g, pk in sorted(self.tables.peaks.items())]),
            "exits": [[e[0], e[1], list(e[2]), list(e[3])] for e in self.tables.exits],
            "failures": flat([list(f) for f in self.failures]),
            "n_failures": self.n_failures,
            "max_failures": self.failures.maxlen,
            "anomalies": dict(sorted(self.anomalies.items())),
        }
        cols = capture_allocs(self.tables.allocs)

        def finish() -> dict:
            return {**out, "allocs": encode_allocs(cols)}

        return finish

    @classmethod
    def from_snapshot(cls, d: dict, journal: bool = False) -> LiveState:
        """Restore a state from :meth:`snapshot`'s dict (also after a msgpack round trip), of
        this version or version 1.

        Raises:
            ValueError: the snapshot is of another version or malformed.
        """
        if not isinstance(d, dict) or d.get("v") not in READ_VERSIONS:
            version = d.get("v") if isinstance(d, dict) else None
            raise ValueError(f"keyframe version {version!r} is not one of {', '.join(map(str, READ_VERSIONS))}")
        try:
            return cls._restore(d, journal)
        except (KeyError, TypeError, IndexError, AttributeError, OverflowError, ValueError) as error:
            # A damaged file: whatever broke, the caller gets the one documented error.
            raise ValueError(f"malformed keyframe ({type(error).__name__}: {clean_text(str(error), 100)})") from None

    @classmethod
    def _restore(cls, d: dict, journal: bool) -> LiveState:
        tables = {"handles": HANDLE_FIELDS, "maps": MAP_FIELDS, "aliases": ALIAS_FIELDS,
                  "exports": EXPORT_FIELDS, "fabric": FABRIC_FIELDS, "opens": OPEN_FIELDS, "host": HOST_FIELDS,
                  "peaks": PEAK_FIELDS, "failures": FAILURE_FIELDS}
        for name, fields in tables.items():
            check_table(d[name], name, fields)
        cols = alloc_arrays(d["allocs"])
        for e in d["exits"]:
            check_table(e[:2], "exits", ("pid", "ts"))
            check_table(e[2], "exits", HELD_FIELDS)
            check_table(e[3], "exits", LARGEST_FIELDS, none_ok=True)
        check_table([d["n"], d["ts"], d["n_failures"], d.get("max_failures", MAX_FAILURES)], "counts", ("n",))
        s = cls(journal=journal, max_failures=d.get("max_failures", MAX_FAILURES))
        s.n_events = d["n"]
        s.last_ts = d["ts"]
        # A repeated (pid, ptr) in a damaged keyframe: the last row wins, as a dict would have it.
        last = plain.last_of_keys(cols["pid"], cols["ptr"])
        s.tables.allocs.insert(*(cols[name][last] for name in ("pid", "ptr", "size", "gpu", "ts", "api")))
        for p, h, *r in table_rows(d["handles"], len(HANDLE_FIELDS)):
            s.tables.handles.set(p, h, *r)
        for p, va, *m in table_rows(d["maps"], len(MAP_FIELDS)):
            s.tables.maps.set(p, va, *m)
        for p, a, h in table_rows(d["aliases"], len(ALIAS_FIELDS)):
            s.tables.aliases.setdefault(p, {})[a] = h
        for hb, *ex in table_rows(d["exports"], len(EXPORT_FIELDS)):
            hb = bytes(hb)
            s.tables.exports[hb] = ex
            if s.tables.allocs.find(ex[0], ex[1])[0] >= 0:
                s.tables.exported.setdefault(ex[0], {}).setdefault(ex[1], []).append(hb)
        for fb, *f in table_rows(d["fabric"], len(FABRIC_FIELDS)):
            s.tables.fabric[bytes(fb)] = f
        for p, ptr, *o in table_rows(d["opens"], len(OPEN_FIELDS)):
            o[O_BYTES] = bytes(o[O_BYTES])
            s.tables.opens.setdefault(p, {})[ptr] = o
        for p, ptr, *r in table_rows(d["host"], len(HOST_FIELDS)):
            s.tables.host.setdefault(p, {})[ptr] = r
        for g, b, ts in table_rows(d["peaks"], len(PEAK_FIELDS)):
            s.tables.peaks[g] = [b, ts]
        s.tables.exits = [[e[0], e[1], list(e[2]), list(e[3])] for e in d["exits"]]
        for f in table_rows(d["failures"], len(FAILURE_FIELDS)):
            s.failures.append(f)
        s.n_failures = d["n_failures"]
        s.anomalies = dict(d["anomalies"])
        # The counters follow from the tables (the driver allocations summed with numpy).
        for (g, p, c), b in plain.alloc_totals(s.tables.allocs).items():
            s.tables.bytes[(g, p, c)] = b
        for h in s.other_holdings():
            key = (h.gpu, h.pid, CATEGORY_INDEX[h.category])
            s.tables.bytes[key] = s.tables.bytes.get(key, 0) + h.size
        s.tables.bytes = {k: v for k, v in s.tables.bytes.items() if v}
        for (g, _, c), b in s.tables.bytes.items():
            if c != IPC_MAPPED:
                s.tables.gpu_owned[g] = s.tables.gpu_owned.get(g, 0) + b
        return s
