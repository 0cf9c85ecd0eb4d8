"""VMM handles and mappings, IPC exports and opens, shareable handles and pinned host memory.

One event at a time (:meth:`VmmIpc.apply_other`): the reference the runs applied at once
(:mod:`memrec.state.vmm_run` for VMM creates, maps, unmaps and releases) must equal, and the path
of the rare kinds (IPC, retains, shareable handles, host memory) and of events that break the
driver's rules. :class:`memrec.state.LiveState` mixes this in. The accounting rules are in
:mod:`memrec.state`'s docstring.
"""

from __future__ import annotations

import numpy as np

from memrec.terms.events import ARRAY
from memrec.terms.events import array_footprint
from memrec.terms.events import HOST_PINNED
from memrec.terms.events import IPC_MAPPED
from memrec.terms.events import VMM
from memrec.state.fields import ARRAY_CREATE
from memrec.state.fields import ARRAY_DESTROY
from memrec.state.fields import HOST_ALLOC
from memrec.state.fields import HOST_FREE
from memrec.state.fields import HOST_REGISTER
from memrec.state.fields import HOST_UNREGISTER
from memrec.state.fields import IPC_CLOSE
from memrec.state.fields import IPC_EXPORT
from memrec.state.fields import IPC_OPEN
from memrec.state.fields import LOCATION_DEVICE
from memrec.state.fields import O_GPU
from memrec.state.fields import O_REFS
from memrec.state.fields import O_SIZE
from memrec.state.fields import SHARE_EXPORT
from memrec.state.fields import SHARE_IMPORT
from memrec.state.fields import VMM_CREATE
from memrec.state.fields import VMM_MAP
from memrec.state.fields import VMM_RELEASE
from memrec.state.fields import VMM_RETAIN
from memrec.state.fields import VMM_UNMAP
from memrec.state.tables import Tables


class VmmIpc:
    """The per-event accounting of every kind but driver allocations and frees, on ``tables``
    (LiveState's :class:`~memrec.state.tables.Tables`, which it shares with the other appliers)."""

    def __init__(self, tables: Tables) -> None:
        self.t = tables

    def apply_other(
        self, kind: int, index: int, t: int, pid: int, g: int, ptr: int, size: int, handle: int, api: int,
        aux: int, hbytes: bytes | None,
    ) -> int | None:
        """Apply one successful event that is not ALLOC/FREE; return the GPU to fill in, if any."""
        if kind == VMM_CREATE:
            cat = VMM if aux in LOCATION_DEVICE else HOST_PINNED
            gg = g if cat == VMM else -1
            row, slot = self.t.handles.find(pid, handle)
            if row >= 0:
                self.t.anomaly("create_over_live")
                self._drop_handle(index, t, pid, row, slot)
            self.t.handles.add(pid, handle, size, gg, t, cat, 1, 0, 0, api)
            self.t.change(index, t, gg, pid, cat, size)
            return None
        if kind == VMM_MAP:
            return self._map(index, t, pid, ptr, size, self.t.resolve_alias(pid, handle), aux)
        if kind == VMM_UNMAP:
            ms = self.t.maps
            row, slot = ms.find(pid, ptr)
            if row >= 0 and int(ms.size[row]) >= size:
                targets = [ptr]
            else:
                end = ptr + max(size, 1)
                rows = ms.sorted_rows(pid)
                targets = [va for va, s in zip(ms.va[rows].tolist(), ms.size[rows].tolist()) if va < end and va + s > ptr]
            if not targets:
                self.t.anomaly("unmap_unknown")
                return None
            first_gpu = None
            for va in targets:
                gg = self._unmap_one(index, t, pid, *ms.find(pid, va))
                if first_gpu is None:
                    first_gpu = gg
            return first_gpu
        if kind == VMM_RELEASE:
            h = handle
            al = self.t.aliases.get(pid)
            if al and h in al:
                h = al.pop(h)
            row, slot = self.t.handles.find(pid, h)
            if row < 0:
                self.t.anomaly("release_unknown")
                return None
            return self._let_go(index, t, pid, row, slot, self.t.handles.refs)
        if kind == VMM_RETAIN:
            hs = self.t.handles
            row, _ = hs.find(pid, handle)
            if row < 0:
                # The handle returned is not one we know: alias it to the handle mapped at ptr.
                m = self._mapping_at(pid, ptr)
                if m >= 0:
                    mapped = int(self.t.maps.handle[m])
                    row, _ = hs.find(pid, mapped)
                if row < 0:
                    self.t.anomaly("retain_unknown")
                    return None
                self.t.aliases.setdefault(pid, {})[handle] = mapped
            hs.refs[row] += 1
            return int(hs.gpu[row])
        if kind == IPC_EXPORT:
            if hbytes is None:
                self.t.anomaly("export_without_bytes")
                return None
            base_ptr, rec = self.t.alloc_at(pid, ptr, index)
            if rec is None:
                self.t.anomaly("export_unknown_alloc")
                self.t.exports[hbytes] = [pid, ptr, g, 0, t]
                return None
            self.t.exports[hbytes] = [pid, base_ptr, rec[1], rec[0], t]
            lst = self.t.exported.setdefault(pid, {}).setdefault(base_ptr, [])
            if hbytes not in lst:
                lst.append(hbytes)
            return rec[1]
        if kind == IPC_OPEN:
            ex = self.t.exports.get(hbytes) if hbytes is not None else None
            if ex is None:
                self.t.anomaly("open_unknown_export")
                exporter, owner_gpu, osize, eptr = 0, -1, 0, 0
            else:
                exporter, eptr, owner_gpu, osize = ex[0], ex[1], ex[2], ex[3]
            os_ = self.t.opens.setdefault(pid, {})
            o = os_.get(ptr)
            if o is not None:
                o[O_REFS] += 1
                return None
            view_gpu = g if g >= 0 else owner_gpu
            os_[ptr] = [hbytes or b"", exporter, owner_gpu, osize, view_gpu, 1, t, eptr]
            self.t.change(index, t, view_gpu, pid, IPC_MAPPED, osize)
            return None
        if kind == IPC_CLOSE:
            os_ = self.t.opens.get(pid)
            o = os_.get(ptr) if os_ else None
            if o is None:
                self.t.anomaly("close_unknown")
                return None
            o[O_REFS] -= 1
            if o[O_REFS] <= 0:
                del os_[ptr]
                self.t.change(index, t, o[O_GPU], pid, IPC_MAPPED, -o[O_SIZE])
            return o[O_GPU]
        if kind == SHARE_EXPORT:
            row, _ = self.t.handles.find(pid, self.t.resolve_alias(pid, handle))
            if hbytes is not None:
                self.t.fabric[hbytes] = [pid, handle]
            return int(self.t.handles.gpu[row]) if row >= 0 else None
        if kind == SHARE_IMPORT:
            hs = self.t.handles
            exporter, isize, gg = 0, 0, g
            if hbytes is not None and hbytes in self.t.fabric:
                epid, eh = self.t.fabric[hbytes]
                exporter = epid
                erow, _ = hs.find(epid, eh)
                if erow >= 0:
                    isize = int(hs.size[erow])
                    if gg < 0:
                        gg = int(hs.gpu[erow])
            row, slot = hs.find(pid, handle)
            if row >= 0:
                self.t.anomaly("import_over_live")
                self._drop_handle(index, t, pid, row, slot)
            hs.add(pid, handle, isize, gg, t, IPC_MAPPED, 1, 0, exporter, api)
            self.t.change(index, t, gg, pid, IPC_MAPPED, isize)
            return None
        if kind == HOST_ALLOC or kind == HOST_REGISTER:
            d = self.t.host.setdefault(pid, {})
            old = d.get(ptr)
            if old is not None:
                self.t.anomaly("host_over_live")
                self.t.change(index, t, -1, pid, HOST_PINNED, -old[0])
            d[ptr] = [size, t, api]
            self.t.change(index, t, -1, pid, HOST_PINNED, size)
            return None
        if kind == HOST_FREE or kind == HOST_UNREGISTER:
            d = self.t.host.get(pid)
            rec = d.pop(ptr, None) if d else None
            if rec is None:
                self.t.anomaly("host_free_unknown")
                return None
            self.t.change(index, t, -1, pid, HOST_PINNED, -rec[0])
            return None
        if kind == ARRAY_CREATE:  # a CUDA array: kept in the handle table, category "array"
            row, slot = self.t.handles.find(pid, handle)
            if row >= 0:
                self.t.anomaly("array_over_live")
                self._drop_handle(index, t, pid, row, slot)
            size = array_footprint(size)
            self.t.handles.add(pid, handle, size, g, t, ARRAY, 1, 0, 0, api)
            self.t.change(index, t, g, pid, ARRAY, size)
            return None
        if kind == ARRAY_DESTROY:
            row, slot = self.t.handles.find(pid, handle)
            if row < 0 or int(self.t.handles.category[row]) != ARRAY:
                self.t.anomaly("array_destroy_unknown")
                return None
            gg = int(self.t.handles.gpu[row])
            self._drop_handle(index, t, pid, row, slot)
            return gg
        return None  # a process exit (LiveState's), VA reserve/free, CTX, fork, limits, graphs, multicast: nothing to count

    def _map(self, index: int, t: int, pid: int, va: int, size: int, h: int, offset: int) -> int | None:
        """cuMemMap of handle ``h`` at ``va``: the new mapping (over a live one: that one goes
        first) keeps the handle alive; returns the handle's GPU."""
        hs, ms = self.t.handles, self.t.maps
        row, _ = hs.find(pid, h)
        if row >= 0:  # the handle as the map found it (the unmap below may drop it)
            gpu, cat, old = int(hs.gpu[row]), int(hs.category[row]), int(hs.size[row])
        mrow, mslot = ms.find(pid, va)
        if mrow >= 0:
            self.t.anomaly("map_over_live")
            self._unmap_one(index, t, pid, mrow, mslot)
        ms.add(pid, va, size, h, offset, t)
        if row < 0:
            self.t.anomaly("map_unknown_handle")
            return None
        live = bool(hs.live[row])
        if live:
            hs.nmaps[row] += 1
        if cat == IPC_MAPPED and size > old:
            # A shareable import: its size is what is mapped of it.
            self.t.change(index, t, gpu, pid, IPC_MAPPED, size - old)
            if live:
                hs.size[row] = size
        return gpu

    def _mapping_at(self, pid: int, va: int) -> int:
        """The row of the mapping at ``va`` or holding it (of overlapping ones, the one starting
        nearest below), -1 when none."""
        ms = self.t.maps
        row, _ = ms.find(pid, va)
        if row >= 0:
            return row
        rows = ms.rows_of(pid)
        best, base = -1, -1
        for r, b, s in zip(rows.tolist(), ms.va[rows].tolist(), ms.size[rows].tolist()):
            if b <= va < b + s and b > base:
                best, base = r, b
        return best

    def _unmap_one(self, index: int, t: int, pid: int, row: int, slot: int) -> int | None:
        """Drop mapping ``row``; the handle it mapped goes too when released and mapped nowhere else."""
        ms, hs = self.t.maps, self.t.handles
        h = int(ms.handle[row])
        ms.drop(row, slot)
        hrow, hslot = hs.find(pid, h)
        if hrow < 0:
            return None
        return self._let_go(index, t, pid, hrow, hslot, hs.nmaps)

    def _let_go(self, index: int, t: int, pid: int, row: int, slot: int, count: np.ndarray) -> int:
        """Take one from handle ``row``'s ``count`` (its references or its mappings); the handle
        goes when it has neither left. Returns its GPU."""
        hs = self.t.handles
        count[row] -= 1
        gpu = int(hs.gpu[row])
        if hs.refs[row] <= 0 and hs.nmaps[row] <= 0:
            self._drop_handle(index, t, pid, row, slot)
        return gpu

    def _drop_handle(self, index: int, t: int, pid: int, row: int, slot: int) -> None:
        hs = self.t.handles
        size, gpu, cat = int(hs.size[row]), int(hs.gpu[row]), int(hs.category[row])
        hs.drop(row, slot)
        self.t.change(index, t, gpu, pid, cat, -size)
