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
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from typing import Any
from typing import Iterator
from typing import NamedTuple

import numpy as np

from memrec._untrusted import clean_text
from memrec._untrusted import short_repr
from memrec.events import CATEGORIES
from memrec.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.events import QUIET_FAILURE_KINDS
from memrec.events import Api
from memrec.events import FLAG_IPC_BYTES
from memrec.events import Kind

from memrec.events import CATEGORY_INDEX  # noqa: F401  (re-exported: callers read it here)
from memrec.events import DRIVER
from memrec.events import HOST_PINNED
from memrec.events import IPC_MAPPED
from memrec.events import VMM

#: Snapshot format version (a keyframe's ``"v"``).
SNAPSHOT_VERSION = 1

#: Field order of each table in a snapshot: every table is one flat list of rows of this stride.
ALLOC_FIELDS = ("pid", "ptr", "size", "gpu", "ts", "api")
HANDLE_FIELDS = ("pid", "handle", "size", "gpu", "ts", "category", "refs", "nmaps", "exporter", "api")
MAP_FIELDS = ("pid", "va", "size", "handle", "offset", "ts")
ALIAS_FIELDS = ("pid", "alias", "handle")
EXPORT_FIELDS = ("handle_bytes", "pid", "ptr", "gpu", "size", "ts")
FABRIC_FIELDS = ("fabric_bytes", "pid", "handle")
OPEN_FIELDS = ("pid", "ptr", "handle_bytes", "exporter", "owner_gpu", "size", "gpu", "refs", "ts", "exporter_ptr")
HOST_FIELDS = ("pid", "ptr", "size", "ts", "api")
FAILURE_FIELDS = ("index", "ts", "pid", "tid", "kind", "api", "result", "gpu", "size", "ptr")
PEAK_FIELDS = ("gpu", "bytes", "ts")
#: An exit record: [pid, ts, held rows (HELD_FIELDS, flat), largest rows (LARGEST_FIELDS, flat)].
HELD_FIELDS = ("gpu", "category", "bytes", "count")
LARGEST_FIELDS = ("gpu", "category", "size", "address", "ts", "api", "peer")

#: Journal columns (one row per change of a counter): see :attr:`LiveState.journal`.
JOURNAL_FIELDS = ("index", "ts", "gpu", "pid", "category", "delta")

#: How many recent failed calls the state keeps, and how many largest allocations an exit record keeps.
MAX_FAILURES = 256
#: The largest size and ts the accounting takes (larger ones can only come from a damaged file).
_MAX_SIZE = np.uint64(1 << 52)
_MAX_TS = np.uint64((1 << 63) - 1)
EXIT_LARGEST = 5

# Kind numbers as plain ints for the hot loop.
_ALLOC = int(Kind.ALLOC)
_FREE = int(Kind.FREE)
_VMM_CREATE = int(Kind.VMM_CREATE)
_VMM_RELEASE = int(Kind.VMM_RELEASE)
_VMM_MAP = int(Kind.VMM_MAP)
_VMM_UNMAP = int(Kind.VMM_UNMAP)
_IPC_EXPORT = int(Kind.IPC_EXPORT)
_IPC_OPEN = int(Kind.IPC_OPEN)
_IPC_CLOSE = int(Kind.IPC_CLOSE)
_SHARE_EXPORT = int(Kind.SHARE_EXPORT)
_SHARE_IMPORT = int(Kind.SHARE_IMPORT)
_VMM_RETAIN = int(Kind.VMM_RETAIN)
_HOST_ALLOC = int(Kind.HOST_ALLOC)
_HOST_FREE = int(Kind.HOST_FREE)
_HOST_REGISTER = int(Kind.HOST_REGISTER)
_HOST_UNREGISTER = int(Kind.HOST_UNREGISTER)
_PROC_EXIT = int(Kind.PROC_EXIT)
_QUIET_KINDS = frozenset(int(k) for k in QUIET_FAILURE_KINDS)
#: Kinds whose ``ipc`` column may carry handle bytes (IPC handle or fabric handle).
_HANDLE_BYTES_KINDS = frozenset((_IPC_EXPORT, _IPC_OPEN, _SHARE_EXPORT, _SHARE_IMPORT))
_API_IPC_OPEN = int(Api.cuIpcOpenMemHandle_v2)

#: CUmemLocationType of a cuMemCreate: 0 (not read) and 1 are device memory, others are host.
_LOCATION_DEVICE = (0, 1)

# Handle record slots: [size, gpu, ts, category, refs, nmaps, exporter, api]
_H_SIZE, _H_GPU, _H_TS, _H_CAT, _H_REFS, _H_NMAPS, _H_EXPORTER, _H_API = range(8)
# Open record slots: [handle_bytes, exporter, owner_gpu, size, gpu, refs, ts, exporter_ptr]
_O_BYTES, _O_EXPORTER, _O_OWNER_GPU, _O_SIZE, _O_GPU, _O_REFS, _O_TS, _O_EPTR = range(8)

_REQUIRED_COLUMNS = ("ts", "pid", "tid", "kind", "api", "result", "flags", "ptr", "size", "handle", "aux", "ipc", "gpu")


class Holding(NamedTuple):
    """One live piece of memory a process holds (or, for ipc_mapped, has mapped)."""

    pid: int
    gpu: int
    category: str
    size: int
    address: int  # device or host pointer; the VMM handle for category "vmm" (or a host-located handle)
    ts: int  # when it was allocated, created or opened
    api: int  # memrec.events.Api of the call that made it
    peer: int = 0  # ipc_mapped: the exporter's pid (0 unknown)


def _flat(rows: list[list]) -> list:
    out: list = []
    for row in rows:
        out.extend(row)
    return out


def _flat_nested(table: dict[int, dict]) -> list:
    """pid -> key -> row (a list, or one value) as one flat list [pid, key, *row, ...], sorted."""
    out: list = []
    ext = out.extend
    app = out.append
    for p in sorted(table):
        d = table[p]
        for k in sorted(d):
            ext((p, k))
            r = d[k]
            if isinstance(r, list):
                ext(r)
            else:
                app(r)
    return out


def _flat_keyed(table: dict) -> list:
    """key -> row as one flat list [key, *row, ...], sorted by key."""
    out: list = []
    for k in sorted(table):
        out.append(k)
        out.extend(table[k])
    return out


def _check_table(flat: Any, name: str, fields: tuple[str, ...], *, none_ok: bool = False) -> None:
    """Raise TypeError unless ``flat`` is a snapshot table of rows ``fields`` whose every value
    can be what its field is: bytes for handle bytes, an int16 for a GPU, a category index for a
    category, a 64-bit int for the rest (None too with ``none_ok``). Checked before use: a damaged
    keyframe must fail here, not later in a view or a numpy column.

    Tables of plain ints (nearly all) are checked with numpy in one pass; others item by item.
    """
    if not isinstance(flat, list):
        raise TypeError(f"{name} is not a list")
    stride = len(fields)
    if not any(f.endswith("_bytes") for f in fields) and len(flat) % stride == 0:
        try:
            arr = np.asarray(flat)
        except (ValueError, OverflowError):
            arr = None
        if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu":
            rows = arr.reshape(-1, stride)
            for i, field in enumerate(fields):
                col = rows[:, i]
                if "gpu" in field and len(col) and (col.min() < -(2**15) or col.max() >= 2**15):
                    raise TypeError(f"{name}: a {field} is out of range")
                if field == "category" and len(col) and (col.min() < 0 or col.max() >= len(CATEGORIES)):
                    raise TypeError(f"{name}: a category is out of range")
            return
    for i, v in enumerate(flat):
        field = fields[i % stride]
        if field.endswith("_bytes"):
            ok = isinstance(v, bytes)
        elif not isinstance(v, int) or isinstance(v, bool):
            ok = none_ok and v is None
        elif "gpu" in field:
            ok = -(2**15) <= v < 2**15
        elif field == "category":
            ok = 0 <= v < len(CATEGORIES)
        else:
            ok = -(2**63) <= v < 2**64
        if not ok:
            raise TypeError(f"{name}[{i}] ({field}) cannot be {short_repr(v, 40)}")


def _rows(flat: list, stride: int) -> Iterator[list]:
    if len(flat) % stride:
        raise ValueError(f"snapshot table length {len(flat)} is not a multiple of {stride}")
    for i in range(0, len(flat), stride):
        yield flat[i : i + stride]


class LiveState:
    """The live memory state built from events (see the module docstring for the accounting).

    Args:
        journal: keep :attr:`journal`, one row per counter change (what :mod:`memrec.analysis`
            turns into time series); off in the daemon.
        max_failures: how many recent failed calls to keep.
    """

    def __init__(self, journal: bool = False, max_failures: int = MAX_FAILURES) -> None:
        self._allocs: dict[int, dict[int, list]] = {}  # pid -> ptr -> [size, gpu, ts, api]
        self._handles: dict[int, dict[int, list]] = {}  # pid -> handle -> handle record
        self._maps: dict[int, dict[int, list]] = {}  # pid -> va -> [size, handle, offset, ts]
        self._aliases: dict[int, dict[int, int]] = {}  # pid -> retained handle -> handle
        self._exports: dict[bytes, list] = {}  # handle bytes -> [pid, ptr, gpu, size, ts]
        self._exported: dict[int, dict[int, list[bytes]]] = {}  # pid -> ptr -> handle bytes
        self._fabric: dict[bytes, list] = {}  # fabric handle bytes -> [pid, handle]
        self._opens: dict[int, dict[int, list]] = {}  # pid -> mapped ptr -> open record
        self._host: dict[int, dict[int, list]] = {}  # pid -> ptr -> [size, ts, api]
        self._bytes: dict[tuple[int, int, int], int] = {}  # (gpu, pid, category) -> bytes
        self._gpu_owned: dict[int, int] = {}  # gpu -> owned bytes (host pinned under -1)
        self._peaks: dict[int, list] = {}  # gpu -> [bytes, ts] of the owned peak
        self._exits: list[list] = []
        self.failures: deque[list] = deque(maxlen=max_failures)
        #: Failed calls seen in all (``failures`` keeps only the most recent).
        self.n_failures = 0
        #: Events that did not match the state (a free of an unknown pointer, ...), by what they were.
        #: Usually the trace started after the memory was allocated.
        self.anomalies: dict[str, int] = {}
        #: Events applied so far (the index of the next event).
        self.n_events = 0
        #: Timestamp of the last event applied.
        self.last_ts = 0
        #: With ``journal=True``: flat ``array('q')`` of rows ``JOURNAL_FIELDS`` (event index, ts,
        #: gpu, pid, category index, signed bytes), one per change of a (gpu, pid, category) total.
        self.journal: array | None = array("q") if journal else None

    # ------------------------------------------------------------------ apply

    def apply(self, events: np.ndarray) -> None:
        """Apply events (``EVENT_DTYPE``, in time order) and fill in their ``gpu`` where known.

        The fill-in writes into ``events["gpu"]`` in place; a read-only array is left untouched.
        """
        names = events.dtype.names or ()
        missing = [c for c in _REQUIRED_COLUMNS if c not in names]
        if missing:
            raise TypeError(f"events lack the columns {missing}: expected EVENT_DTYPE")
        n = len(events)
        if n == 0:
            return
        kinds = events["kind"].tolist()
        # A damaged file can hold any u64: keep ts and sizes where the int64 journal and the
        # analysis can hold them (no driver gives 4 PiB, no clock reads 2^63 ns).
        tss = np.minimum(events["ts"], _MAX_TS).tolist()
        pids = events["pid"].tolist()
        results = events["result"].tolist()
        gpus = events["gpu"].tolist()
        ptrs = events["ptr"].tolist()
        sizes = np.minimum(events["size"], _MAX_SIZE).tolist()
        apis = events["api"].tolist()
        handles = events["handle"].tolist()
        auxs = flags = ipcs = None  # decoded on the first event that is not an alloc or a free

        allocs = self._allocs
        counts = self._bytes
        owned = self._gpu_owned
        peaks = self._peaks
        exported = self._exported
        jr = self.journal
        jext = jr.extend if jr is not None else None
        fill_idx: list[int] = []
        fill_gpu: list[int] = []
        base = self.n_events

        for i in range(n):
            kind = kinds[i]
            if results[i] != 0:
                if kind in _QUIET_KINDS and results[i] != CUDA_ERROR_OUT_OF_MEMORY:
                    continue  # an expected failure of a code or pool call (events.QUIET_FAILURE_KINDS)
                self.n_failures += 1
                tid = int(events["tid"][i])
                self.failures.append([base + i, tss[i], pids[i], tid, kind, apis[i], results[i], gpus[i], sizes[i], ptrs[i]])
                continue
            if kind == _ALLOC:
                pid = pids[i]
                ptr = ptrs[i]
                size = sizes[i]
                g = gpus[i]
                t = tss[i]
                d = allocs.get(pid)
                if d is None:
                    d = allocs[pid] = {}
                old = d.get(ptr)
                if old is not None:  # a free we did not see: drop the old one first
                    self._anomaly("alloc_over_live")
                    self._change(base + i, t, old[1], pid, DRIVER, -old[0])
                d[ptr] = [size, g, t, apis[i]]
                key = (g, pid, DRIVER)
                counts[key] = counts.get(key, 0) + size
                tot = owned.get(g, 0) + size
                owned[g] = tot
                pk = peaks.get(g)
                if pk is None:
                    peaks[g] = [tot, t]
                elif tot > pk[0]:
                    pk[0] = tot
                    pk[1] = t
                if jext is not None:
                    jext((base + i, t, g, pid, DRIVER, size))
            elif kind == _FREE:
                pid = pids[i]
                d = allocs.get(pid)
                rec = d.pop(ptrs[i], None) if d is not None else None
                if rec is None:
                    self._anomaly("free_unknown")
                    continue
                size = rec[0]
                g = rec[1]
                if gpus[i] < 0 and g >= 0:
                    fill_idx.append(i)
                    fill_gpu.append(g)
                key = (g, pid, DRIVER)
                counts[key] = counts.get(key, 0) - size  # a restored state drops zero counters
                owned[g] = owned.get(g, 0) - size
                if jext is not None:
                    jext((base + i, tss[i], g, pid, DRIVER, -size))
                if exported:
                    self._forget_exports(pid, ptrs[i])
            else:
                if auxs is None:
                    auxs = events["aux"].tolist()
                    flags = events["flags"].tolist()
                    ipcs = events["ipc"]
                hbytes = None
                if kind in _HANDLE_BYTES_KINDS and flags[i] & FLAG_IPC_BYTES:
                    hbytes = ipcs[i].tobytes()
                g = self._apply_other(
                    kind, base + i, tss[i], pids[i], gpus[i], ptrs[i], sizes[i], handles[i], apis[i], auxs[i], hbytes
                )
                if g is not None and g >= 0 and gpus[i] < 0:
                    fill_idx.append(i)
                    fill_gpu.append(g)

        self.n_events = base + n
        self.last_ts = tss[-1]
        if fill_idx and events.flags.writeable:
            events["gpu"][np.asarray(fill_idx, dtype=np.intp)] = fill_gpu

    def _forget_exports(self, pid: int, ptr: int) -> None:
        """The exporter freed ``ptr``: its IPC handles can no longer be opened."""
        ex = self._exported.get(pid)
        if ex is None or ptr not in ex:
            return
        for hb in ex.pop(ptr):
            cur = self._exports.get(hb)
            if cur is not None and cur[0] == pid and cur[1] == ptr:
                del self._exports[hb]
        if not ex:
            del self._exported[pid]

    def _anomaly(self, what: str) -> None:
        self.anomalies[what] = self.anomalies.get(what, 0) + 1

    def _change(self, index: int, ts: int, gpu: int, pid: int, cat: int, delta: int) -> None:
        """Add ``delta`` bytes to (gpu, pid, category), keeping the owned totals and peaks."""
        if delta == 0:
            return
        key = (gpu, pid, cat)
        v = self._bytes.get(key, 0) + delta
        if v:
            self._bytes[key] = v
        else:
            self._bytes.pop(key, None)
        if cat != IPC_MAPPED:
            tot = self._gpu_owned.get(gpu, 0) + delta
            self._gpu_owned[gpu] = tot
            pk = self._peaks.get(gpu)
            if pk is None:
                self._peaks[gpu] = [max(tot, 0), ts]
            elif tot > pk[0]:
                pk[0] = tot
                pk[1] = ts
        if self.journal is not None:
            self.journal.extend((index, ts, gpu, pid, cat, delta))

    def _apply_other(
        self, kind: int, index: int, t: int, pid: int, g: int, ptr: int, size: int, handle: int, api: int,
        aux: int, hbytes: bytes | None,
    ) -> int | None:
        """Apply one successful event that is not ALLOC/FREE; return the GPU to fill in, if any."""
        if kind == _VMM_CREATE:
            cat = VMM if aux in _LOCATION_DEVICE else HOST_PINNED
            gg = g if cat == VMM else -1
            hs = self._handles.setdefault(pid, {})
            old = hs.get(handle)
            if old is not None:
                self._anomaly("create_over_live")
                self._drop_handle(index, t, pid, handle, old)
            hs[handle] = [size, gg, t, cat, 1, 0, 0, api]
            self._change(index, t, gg, pid, cat, size)
            return None
        if kind == _VMM_MAP:
            h = self._resolve_alias(pid, handle)
            rec = self._handles.get(pid, {}).get(h)
            ms = self._maps.setdefault(pid, {})
            if ptr in ms:
                self._anomaly("map_over_live")
                self._unmap_one(index, t, pid, ptr)
            ms[ptr] = [size, h, aux, t]
            if rec is None:
                self._anomaly("map_unknown_handle")
                return None
            rec[_H_NMAPS] += 1
            if rec[_H_CAT] == IPC_MAPPED and size > rec[_H_SIZE]:
                # A shareable import: its size is what is mapped of it.
                self._change(index, t, rec[_H_GPU], pid, IPC_MAPPED, size - rec[_H_SIZE])
                rec[_H_SIZE] = size
            return rec[_H_GPU]
        if kind == _VMM_UNMAP:
            ms = self._maps.get(pid)
            if not ms:
                self._anomaly("unmap_unknown")
                return None
            if ptr in ms and ms[ptr][0] >= size:
                targets = [ptr]
            else:
                end = ptr + max(size, 1)
                targets = sorted(va for va, m in ms.items() if va < end and va + m[0] > ptr)
            if not targets:
                self._anomaly("unmap_unknown")
                return None
            first_gpu = None
            for va in targets:
                gg = self._unmap_one(index, t, pid, va)
                if first_gpu is None:
                    first_gpu = gg
            return first_gpu
        if kind == _VMM_RELEASE:
            h = handle
            al = self._aliases.get(pid)
            if al and h in al:
                h = al.pop(h)
            rec = self._handles.get(pid, {}).get(h)
            if rec is None:
                self._anomaly("release_unknown")
                return None
            rec[_H_REFS] -= 1
            gg = rec[_H_GPU]
            if rec[_H_REFS] <= 0 and rec[_H_NMAPS] <= 0:
                self._drop_handle(index, t, pid, h, rec)
            return gg
        if kind == _VMM_RETAIN:
            hs = self._handles.get(pid, {})
            rec = hs.get(handle)
            if rec is None:
                # The handle returned is not one we know: alias it to the handle mapped at ptr.
                m = self._mapping_at(pid, ptr)
                rec = hs.get(m[1]) if m is not None else None
                if rec is None:
                    self._anomaly("retain_unknown")
                    return None
                self._aliases.setdefault(pid, {})[handle] = m[1]
            rec[_H_REFS] += 1
            return rec[_H_GPU]
        if kind == _IPC_EXPORT:
            if hbytes is None:
                self._anomaly("export_without_bytes")
                return None
            base_ptr, rec = self._alloc_at(pid, ptr)
            if rec is None:
                self._anomaly("export_unknown_alloc")
                self._exports[hbytes] = [pid, ptr, g, 0, t]
                return None
            self._exports[hbytes] = [pid, base_ptr, rec[1], rec[0], t]
            lst = self._exported.setdefault(pid, {}).setdefault(base_ptr, [])
            if hbytes not in lst:
                lst.append(hbytes)
            return rec[1]
        if kind == _IPC_OPEN:
            ex = self._exports.get(hbytes) if hbytes is not None else None
            if ex is None:
                self._anomaly("open_unknown_export")
                exporter, owner_gpu, osize, eptr = 0, -1, 0, 0
            else:
                exporter, eptr, owner_gpu, osize = ex[0], ex[1], ex[2], ex[3]
            os_ = self._opens.setdefault(pid, {})
            o = os_.get(ptr)
            if o is not None:
                o[_O_REFS] += 1
                return None
            view_gpu = g if g >= 0 else owner_gpu
            os_[ptr] = [hbytes or b"", exporter, owner_gpu, osize, view_gpu, 1, t, eptr]
            self._change(index, t, view_gpu, pid, IPC_MAPPED, osize)
            return None
        if kind == _IPC_CLOSE:
            os_ = self._opens.get(pid)
            o = os_.get(ptr) if os_ else None
            if o is None:
                self._anomaly("close_unknown")
                return None
            o[_O_REFS] -= 1
            if o[_O_REFS] <= 0:
                del os_[ptr]
                self._change(index, t, o[_O_GPU], pid, IPC_MAPPED, -o[_O_SIZE])
            return o[_O_GPU]
        if kind == _SHARE_EXPORT:
            rec = self._handles.get(pid, {}).get(self._resolve_alias(pid, handle))
            if hbytes is not None:
                self._fabric[hbytes] = [pid, handle]
            return rec[_H_GPU] if rec is not None else None
        if kind == _SHARE_IMPORT:
            exporter, isize, gg = 0, 0, g
            if hbytes is not None and hbytes in self._fabric:
                epid, eh = self._fabric[hbytes]
                erec = self._handles.get(epid, {}).get(eh)
                exporter = epid
                if erec is not None:
                    isize = erec[_H_SIZE]
                    if gg < 0:
                        gg = erec[_H_GPU]
            hs = self._handles.setdefault(pid, {})
            old = hs.get(handle)
            if old is not None:
                self._anomaly("import_over_live")
                self._drop_handle(index, t, pid, handle, old)
            hs[handle] = [isize, gg, t, IPC_MAPPED, 1, 0, exporter, api]
            self._change(index, t, gg, pid, IPC_MAPPED, isize)
            return None
        if kind == _HOST_ALLOC or kind == _HOST_REGISTER:
            d = self._host.setdefault(pid, {})
            old = d.get(ptr)
            if old is not None:
                self._anomaly("host_over_live")
                self._change(index, t, -1, pid, HOST_PINNED, -old[0])
            d[ptr] = [size, t, api]
            self._change(index, t, -1, pid, HOST_PINNED, size)
            return None
        if kind == _HOST_FREE or kind == _HOST_UNREGISTER:
            d = self._host.get(pid)
            rec = d.pop(ptr, None) if d else None
            if rec is None:
                self._anomaly("host_free_unknown")
                return None
            self._change(index, t, -1, pid, HOST_PINNED, -rec[0])
            return None
        if kind == _PROC_EXIT:
            self._exit(index, t, pid)
            return None
        return None  # VA reserve/free, CTX, fork: nothing to count

    def _resolve_alias(self, pid: int, handle: int) -> int:
        al = self._aliases.get(pid)
        if al:
            return al.get(handle, handle)
        return handle

    def _mapping_at(self, pid: int, va: int) -> list | None:
        ms = self._maps.get(pid)
        if not ms:
            return None
        m = ms.get(va)
        if m is not None:
            return m
        for base, m in ms.items():
            if base <= va < base + m[0]:
                return m
        return None

    def _alloc_at(self, pid: int, ptr: int) -> tuple[int, list | None]:
        d = self._allocs.get(pid)
        if not d:
            return ptr, None
        rec = d.get(ptr)
        if rec is not None:
            return ptr, rec
        for base, rec in d.items():  # an interior pointer (a block inside a cached segment)
            if base <= ptr < base + rec[0]:
                return base, rec
        return ptr, None

    def _unmap_one(self, index: int, t: int, pid: int, va: int) -> int | None:
        m = self._maps[pid].pop(va)
        hs = self._handles.get(pid)
        rec = hs.get(m[1]) if hs else None
        if rec is None:
            return None
        rec[_H_NMAPS] -= 1
        if rec[_H_REFS] <= 0 and rec[_H_NMAPS] <= 0:
            self._drop_handle(index, t, pid, m[1], rec)
        return rec[_H_GPU]

    def _drop_handle(self, index: int, t: int, pid: int, handle: int, rec: list) -> None:
        del self._handles[pid][handle]
        self._change(index, t, rec[_H_GPU], pid, rec[_H_CAT], -rec[_H_SIZE])

    def _exit(self, index: int, t: int, pid: int) -> None:
        """Free everything ``pid`` held, as the driver does when a process exits, and record it."""
        holdings = list(self.holdings(pid=pid))
        held: dict[tuple[int, int], list[int]] = {}
        for h in holdings:
            row = held.setdefault((h.gpu, CATEGORY_INDEX[h.category]), [0, 0])
            row[0] += h.size
            row[1] += 1
        largest = heapq.nsmallest(EXIT_LARGEST, holdings, key=_largest_key)
        self._exits.append(
            [
                pid,
                t,
                _flat([[gg, c, b, n] for (gg, c), (b, n) in sorted(held.items())]),
                _flat([[h.gpu, CATEGORY_INDEX[h.category], h.size, h.address, h.ts, h.api, h.peer] for h in largest]),
            ]
        )
        for key in sorted(k for k in self._bytes if k[1] == pid):
            self._change(index, t, key[0], pid, key[2], -self._bytes[key])
        for table in (self._allocs, self._handles, self._maps, self._aliases, self._opens, self._host):
            table.pop(pid, None)
        for ptr_bytes in self._exported.pop(pid, {}).values():
            for hb in ptr_bytes:
                self._exports.pop(hb, None)
        for hb in [hb for hb, ex in self._exports.items() if ex[0] == pid]:
            del self._exports[hb]
        for fb in [fb for fb, f in self._fabric.items() if f[0] == pid]:
            del self._fabric[fb]

    # ---------------------------------------------------------------- queries

    def owned_bytes(self, gpu: int | None = None, pid: int | None = None, category: str | None = None) -> int:
        """Bytes owned (driver, vmm, host_pinned), optionally for one GPU, process and category.

        ``gpu=None`` sums every GPU *and* the host (-1). ipc_mapped memory is not owned: asking
        for it raises ValueError (use :meth:`mapped_bytes`).
        """
        if category is not None:
            c = CATEGORY_INDEX.get(category)
            if c is None:
                raise ValueError(f"unknown category {category!r} (one of {', '.join(CATEGORIES)})")
            if c == IPC_MAPPED:
                raise ValueError("ipc_mapped is mapped, not owned: use mapped_bytes()")
        if pid is None and category is None:
            if gpu is None:
                return sum(self._gpu_owned.values())
            return self._gpu_owned.get(gpu, 0)
        total = 0
        for (g, p, cat), b in self._bytes.items():
            if cat == IPC_MAPPED:
                continue
            if gpu is not None and g != gpu or pid is not None and p != pid:
                continue
            if category is None or CATEGORIES[cat] == category:
                total += b
        return total

    def mapped_bytes(self, gpu: int | None = None, pid: int | None = None) -> int:
        """Bytes of peers' memory mapped here (IPC opens, shareable imports), in the importers' view."""
        return sum(
            b
            for (g, p, cat), b in self._bytes.items()
            if cat == IPC_MAPPED and (gpu is None or g == gpu) and (pid is None or p == pid)
        )

    def totals(self) -> dict[int, dict[int, dict[str, int]]]:
        """Bytes by gpu → pid → category (ipc_mapped per importer), zero entries left out, sorted."""
        out: dict[int, dict[int, dict[str, int]]] = {}
        for (g, p, cat) in sorted(self._bytes):
            b = self._bytes[(g, p, cat)]
            if b:
                out.setdefault(g, {}).setdefault(p, {})[CATEGORIES[cat]] = b
        return out

    def counters(self) -> dict[tuple[int, int, int], int]:
        """Non-zero totals keyed (gpu, pid, category index): what a journal starts from."""
        return {k: v for k, v in sorted(self._bytes.items()) if v}

    def peaks(self) -> dict[int, tuple[int, int]]:
        """The highest owned bytes seen on each GPU (host: -1) since the state began: gpu → (bytes, ts)."""
        return {g: (pk[0], pk[1]) for g, pk in sorted(self._peaks.items())}

    def pids(self) -> list[int]:
        """Processes that hold or map anything now."""
        return sorted({p for (_, p, _), b in self._bytes.items() if b})

    def holdings(self, gpu: int | None = None, pid: int | None = None) -> Iterator[Holding]:
        """Every live piece of memory (owned and mapped), optionally on one GPU or of one process."""
        pids = [pid] if pid is not None else None

        def select(table: dict) -> Iterator[tuple[int, dict]]:
            if pids is None:
                return iter(table.items())
            return ((p, table[p]) for p in pids if p in table)

        for p, d in select(self._allocs):
            for ptr, r in d.items():
                if gpu is None or r[1] == gpu:
                    yield Holding(p, r[1], "driver", r[0], ptr, r[2], r[3])
        for p, d in select(self._handles):
            for h, r in d.items():
                if gpu is None or r[_H_GPU] == gpu:
                    cat = CATEGORIES[r[_H_CAT]]
                    yield Holding(p, r[_H_GPU], cat, r[_H_SIZE], h, r[_H_TS], r[_H_API], r[_H_EXPORTER])
        for p, d in select(self._opens):
            for ptr, o in d.items():
                if gpu is None or o[_O_GPU] == gpu:
                    yield Holding(p, o[_O_GPU], "ipc_mapped", o[_O_SIZE], ptr, o[_O_TS], _API_IPC_OPEN, o[_O_EXPORTER])
        if gpu is None or gpu == -1:
            for p, d in select(self._host):
                for ptr, r in d.items():
                    yield Holding(p, -1, "host_pinned", r[0], ptr, r[1], r[2])

    def mappings(self, pid: int | None = None) -> Iterator[tuple[int, int, int, int]]:
        """Live VMM mappings as (pid, va, size, gpu of the mapped handle; -1 unknown), pids ascending."""
        for p in sorted(self._maps) if pid is None else [pid]:
            hs = self._handles.get(p) or {}
            for va, m in sorted(self._maps.get(p, {}).items()):
                rec = hs.get(self._resolve_alias(p, m[1]))
                yield p, va, m[0], rec[_H_GPU] if rec is not None else -1

    def largest(self, gpu: int | None, n: int = 10, pid: int | None = None, mapped: bool = False) -> list[Holding]:
        """The ``n`` largest live owned allocations on ``gpu`` (with ``mapped``: ipc_mapped too)."""
        items = (h for h in self.holdings(gpu=gpu, pid=pid) if mapped or h.category != "ipc_mapped")
        return heapq.nsmallest(n, items, key=_largest_key)

    def holders(self, gpu: int, n: int = 3) -> list[dict]:
        """Who holds what on ``gpu`` now (an OOM snapshot), biggest owner first.

        Each entry: ``{"pid", "owned", "mapped", "by_category": {category: bytes}, "largest": [
        Holding as dict, ...]}`` with the ``n`` largest live pieces (owned first, then mapped).
        """
        per: dict[int, dict] = {}
        for (g, p, cat), b in self._bytes.items():
            if g != gpu or not b:
                continue
            e = per.setdefault(p, {"pid": p, "owned": 0, "mapped": 0, "by_category": {}})
            e["by_category"][CATEGORIES[cat]] = b
            e["mapped" if cat == IPC_MAPPED else "owned"] += b
        tops: dict[int, list[Holding]] = {p: [] for p in per}
        for h in self.holdings(gpu=gpu):
            if h.pid in tops:
                tops[h.pid].append(h)
        out = []
        for p, e in per.items():
            e["by_category"] = {c: e["by_category"][c] for c in CATEGORIES if c in e["by_category"]}
            e["largest"] = [h._asdict() for h in heapq.nsmallest(n, tops[p], key=_holder_key)]
            out.append(e)
        out.sort(key=lambda e: (-e["owned"], -e["mapped"], e["pid"]))
        return out

    def exit_records(self) -> list[dict]:
        """What each exited process still held when it exited (freed implicitly), in exit order.

        Each: ``{"pid", "ts", "owned", "mapped", "count", "held": [{"gpu", "category", "bytes",
        "count"}], "largest": [Holding as dict]}``.
        """
        out = []
        for pid, ts, held, largest in self._exits:
            rows = [dict(zip(HELD_FIELDS, r)) for r in _rows(held, len(HELD_FIELDS))]
            for r in rows:
                r["category"] = CATEGORIES[r["category"]]
            big = []
            for r in _rows(largest, len(LARGEST_FIELDS)):
                gg, c, size, address, hts, api, peer = r
                big.append(Holding(pid, gg, CATEGORIES[c], size, address, hts, api, peer)._asdict())
            out.append(
                {
                    "pid": pid,
                    "ts": ts,
                    "owned": sum(r["bytes"] for r in rows if r["category"] != "ipc_mapped"),
                    "mapped": sum(r["bytes"] for r in rows if r["category"] == "ipc_mapped"),
                    "count": sum(r["count"] for r in rows),
                    "held": rows,
                    "largest": big,
                }
            )
        return out

    def failure_records(self) -> list[dict]:
        """The most recent failed calls (``FAILURE_FIELDS`` as dicts), oldest first."""
        return [dict(zip(FAILURE_FIELDS, f)) for f in self.failures]

    def check(self) -> None:
        """Recompute every counter from the tables and raise AssertionError on a difference (tests)."""
        expect: dict[tuple[int, int, int], int] = {}
        for h in self.holdings():
            key = (h.gpu, h.pid, CATEGORY_INDEX[h.category])
            expect[key] = expect.get(key, 0) + h.size
        got = {k: v for k, v in self._bytes.items() if v}
        expect = {k: v for k, v in expect.items() if v}
        if got != expect:
            raise AssertionError(f"counters {got} != tables {expect}")
        owned: dict[int, int] = {}
        for (g, _, c), b in expect.items():
            if c != IPC_MAPPED:
                owned[g] = owned.get(g, 0) + b
        got_owned = {g: b for g, b in self._gpu_owned.items() if b}
        if got_owned != owned:
            raise AssertionError(f"owned totals {got_owned} != tables {owned}")

    # --------------------------------------------------------------- snapshot

    def snapshot(self) -> dict:
        """The state as a keyframe: a dict of plain ints, bytes, str keys and flat lists.

        Every table is one flat list of rows (``*_FIELDS`` give the order), sorted, so that equal
        states give equal snapshots. :meth:`from_snapshot` restores it exactly.
        """
        return {
            "v": SNAPSHOT_VERSION,
            "n": self.n_events,
            "ts": self.last_ts,
            "allocs": _flat_nested(self._allocs),
            "handles": _flat_nested(self._handles),
            "maps": _flat_nested(self._maps),
            "aliases": _flat_nested(self._aliases),
            "exports": _flat_keyed(self._exports),
            "fabric": _flat_keyed(self._fabric),
            "opens": _flat_nested(self._opens),
            "host": _flat_nested(self._host),
            "peaks": _flat([[g, pk[0], pk[1]] for g, pk in sorted(self._peaks.items())]),
            "exits": [[e[0], e[1], list(e[2]), list(e[3])] for e in self._exits],
            "failures": _flat([list(f) for f in self.failures]),
            "n_failures": self.n_failures,
            "max_failures": self.failures.maxlen,
            "anomalies": dict(sorted(self.anomalies.items())),
        }

    @classmethod
    def from_snapshot(cls, d: dict, journal: bool = False) -> LiveState:
        """Restore a state from :meth:`snapshot`'s dict (also after a msgpack round trip).

        Raises:
            ValueError: the snapshot is of another version or malformed.
        """
        if not isinstance(d, dict) or d.get("v") != SNAPSHOT_VERSION:
            version = d.get("v") if isinstance(d, dict) else None
            raise ValueError(f"keyframe version {version!r} is not {SNAPSHOT_VERSION}")
        try:
            return cls._restore(d, journal)
        except (KeyError, TypeError, IndexError, AttributeError, OverflowError, ValueError) as error:
            # A damaged file: whatever broke, the caller gets the one documented error.
            raise ValueError(f"malformed keyframe ({type(error).__name__}: {clean_text(str(error), 100)})") from None

    @classmethod
    def _restore(cls, d: dict, journal: bool) -> LiveState:
        tables = {"allocs": ALLOC_FIELDS, "handles": HANDLE_FIELDS, "maps": MAP_FIELDS, "aliases": ALIAS_FIELDS,
                  "exports": EXPORT_FIELDS, "fabric": FABRIC_FIELDS, "opens": OPEN_FIELDS, "host": HOST_FIELDS,
                  "peaks": PEAK_FIELDS, "failures": FAILURE_FIELDS}
        for name, fields in tables.items():
            _check_table(d[name], name, fields)
        for e in d["exits"]:
            _check_table(e[:2], "exits", ("pid", "ts"))
            _check_table(e[2], "exits", HELD_FIELDS)
            _check_table(e[3], "exits", LARGEST_FIELDS, none_ok=True)
        _check_table([d["n"], d["ts"], d["n_failures"], d.get("max_failures", MAX_FAILURES)], "counts", ("n",))
        s = cls(journal=journal, max_failures=d.get("max_failures", MAX_FAILURES))
        s.n_events = d["n"]
        s.last_ts = d["ts"]
        for p, ptr, *r in _rows(d["allocs"], len(ALLOC_FIELDS)):
            s._allocs.setdefault(p, {})[ptr] = r
        for p, h, *r in _rows(d["handles"], len(HANDLE_FIELDS)):
            s._handles.setdefault(p, {})[h] = r
        for p, va, *m in _rows(d["maps"], len(MAP_FIELDS)):
            s._maps.setdefault(p, {})[va] = m
        for p, a, h in _rows(d["aliases"], len(ALIAS_FIELDS)):
            s._aliases.setdefault(p, {})[a] = h
        for hb, *ex in _rows(d["exports"], len(EXPORT_FIELDS)):
            hb = bytes(hb)
            s._exports[hb] = ex
            if ex[0] in s._allocs and ex[1] in s._allocs[ex[0]]:
                s._exported.setdefault(ex[0], {}).setdefault(ex[1], []).append(hb)
        for fb, *f in _rows(d["fabric"], len(FABRIC_FIELDS)):
            s._fabric[bytes(fb)] = f
        for p, ptr, *o in _rows(d["opens"], len(OPEN_FIELDS)):
            o[_O_BYTES] = bytes(o[_O_BYTES])
            s._opens.setdefault(p, {})[ptr] = o
        for p, ptr, *r in _rows(d["host"], len(HOST_FIELDS)):
            s._host.setdefault(p, {})[ptr] = r
        for g, b, ts in _rows(d["peaks"], len(PEAK_FIELDS)):
            s._peaks[g] = [b, ts]
        s._exits = [[e[0], e[1], list(e[2]), list(e[3])] for e in d["exits"]]
        for f in _rows(d["failures"], len(FAILURE_FIELDS)):
            s.failures.append(f)
        s.n_failures = d["n_failures"]
        s.anomalies = dict(d["anomalies"])
        # The counters follow from the tables.
        for h in s.holdings():
            key = (h.gpu, h.pid, CATEGORY_INDEX[h.category])
            s._bytes[key] = s._bytes.get(key, 0) + h.size
        s._bytes = {k: v for k, v in s._bytes.items() if v}
        for (g, _, c), b in s._bytes.items():
            if c != IPC_MAPPED:
                s._gpu_owned[g] = s._gpu_owned.get(g, 0) + b
        return s


def _largest_key(h: Holding) -> tuple:
    return (-h.size, h.gpu, h.pid, CATEGORY_INDEX[h.category], h.address)


def _holder_key(h: Holding) -> tuple:
    return (h.category == "ipc_mapped", -h.size, CATEGORY_INDEX[h.category], h.address)
