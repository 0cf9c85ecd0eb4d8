"""What a :class:`memrec.state.LiveState` holds, asked: totals, peaks, holdings, holders, exits.

A mixin of LiveState, apart from how events change the state (:mod:`memrec.state.live`).
Driver allocations are ranked with numpy (:meth:`Queries._top_driver`): at a million live
ones, no Python object per allocation for an OOM snapshot or an exit.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator

import numpy as np

from memrec.terms.events import CATEGORIES
from memrec.terms.events import CATEGORY_INDEX
from memrec.terms.events import IPC_MAPPED
from memrec.state.fields import API_IPC_OPEN
from memrec.state.fields import HELD_FIELDS
from memrec.state.fields import LARGEST_FIELDS
from memrec.state.fields import FAILURE_FIELDS
from memrec.state.fields import O_EXPORTER
from memrec.state.fields import O_GPU
from memrec.state.fields import O_SIZE
from memrec.state.fields import O_TS
from memrec.state.fields import Holding
from memrec.state.snapshot import rows as table_rows
from memrec.state.tables import Tables


class Queries:
    """The read side of LiveState."""

    tables: Tables
    failures: deque[list]

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
                return sum(self.tables.gpu_owned.values())
            return self.tables.gpu_owned.get(gpu, 0)
        total = 0
        for (g, p, cat), b in self.tables.bytes.items():
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
            for (g, p, cat), b in self.tables.bytes.items()
            if cat == IPC_MAPPED and (gpu is None or g == gpu) and (pid is None or p == pid)
        )

    def totals(self) -> dict[int, dict[int, dict[str, int]]]:
        """Bytes by gpu → pid → category (ipc_mapped per importer), zero entries left out, sorted."""
        out: dict[int, dict[int, dict[str, int]]] = {}
        for (g, p, cat) in sorted(self.tables.bytes):
            b = self.tables.bytes[(g, p, cat)]
            if b:
                out.setdefault(g, {}).setdefault(p, {})[CATEGORIES[cat]] = b
        return out

    def counters(self) -> dict[tuple[int, int, int], int]:
        """Non-zero totals keyed (gpu, pid, category index): what a journal starts from."""
        return {k: v for k, v in sorted(self.tables.bytes.items()) if v}

    def peaks(self) -> dict[int, tuple[int, int]]:
        """The highest owned bytes seen on each GPU (host: -1) since the state began: gpu → (bytes, ts)."""
        return {g: (pk[0], pk[1]) for g, pk in sorted(self.tables.peaks.items())}

    def pids(self) -> list[int]:
        """Processes that hold or map anything now."""
        return sorted({p for (_, p, _), b in self.tables.bytes.items() if b})

    def holdings(self, gpu: int | None = None, pid: int | None = None) -> Iterator[Holding]:
        """Every live piece of memory (owned and mapped), optionally on one GPU or of one process."""
        al = self.tables.allocs
        sel = al.sorted_rows() if pid is None else al.rows_of(pid)
        if pid is not None:
            sel = sel[np.argsort(al.ptr[sel], kind="stable")]
        if gpu is not None:
            sel = sel[al.gpu[sel] == gpu]
        cols = (al.pid[sel].tolist(), al.gpu[sel].tolist(), al.size[sel].tolist(), al.ptr[sel].tolist(),
                al.ts[sel].tolist(), al.api[sel].tolist())
        for p, g, size, ptr, ts, api in zip(*cols):
            yield Holding(p, g, "driver", size, ptr, ts, api)
        yield from self.other_holdings(gpu, pid)

    def owned_columns(self, gpu: int | None = None, pid: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pid, ts, size) columns of every live piece of owned memory (:meth:`holdings` but
        ``ipc_mapped``), optionally on one GPU or of one process, in no particular order: what
        sums over a million allocations read, without a :class:`Holding` built for each."""
        al = self.tables.allocs
        rows = al.rows_of(pid)
        if gpu is not None:
            rows = rows[al.gpu[rows] == gpu]
        others = [h for h in self.other_holdings(gpu, pid) if h.category != CATEGORIES[IPC_MAPPED]]
        return tuple(np.concatenate((column[rows].astype(np.int64), np.array(extra, np.int64)))  # type: ignore[return-value]
                     for column, extra in ((al.pid, [h.pid for h in others]), (al.ts, [h.ts for h in others]),
                                           (al.size, [h.size for h in others])))

    def other_holdings(self, gpu: int | None = None, pid: int | None = None) -> Iterator[Holding]:
        """:meth:`holdings` but driver allocations."""
        pids = [pid] if pid is not None else None

        def select(table: dict) -> Iterator[tuple[int, dict]]:
            if pids is None:
                return iter(table.items())
            return ((p, table[p]) for p in pids if p in table)

        hs = self.tables.handles
        rows = hs.sorted_rows(pid)
        if gpu is not None:
            rows = rows[hs.gpu[rows] == gpu]
        cols = [getattr(hs, name)[rows].tolist() for name in ("pid", "gpu", "category", "size", "handle", "ts",
                                                               "api", "exporter")]
        for p, g, c, size, h, ts, api, exporter in zip(*cols):
            yield Holding(p, g, CATEGORIES[c], size, h, ts, api, exporter)
        for p, d in select(self.tables.opens):
            for ptr, o in d.items():
                if gpu is None or o[O_GPU] == gpu:
                    yield Holding(p, o[O_GPU], "ipc_mapped", o[O_SIZE], ptr, o[O_TS], API_IPC_OPEN, o[O_EXPORTER])
        if gpu is None or gpu == -1:
            for p, d in select(self.tables.host):
                for ptr, r in d.items():
                    yield Holding(p, -1, "host_pinned", r[0], ptr, r[1], r[2])

    def mappings(self, pid: int | None = None) -> Iterator[tuple[int, int, int, int]]:
        """Live VMM mappings as (pid, va, size, gpu of the mapped handle; -1 unknown), pids ascending."""
        ms, hs = self.tables.maps, self.tables.handles
        rows = ms.sorted_rows(pid)
        for p, va, size, h in zip(*(getattr(ms, name)[rows].tolist() for name in ("pid", "va", "size", "handle"))):
            row, _ = hs.find(p, self.tables.resolve_alias(p, h))
            yield p, va, size, int(hs.gpu[row]) if row >= 0 else -1

    def largest(self, gpu: int | None, n: int = 10, pid: int | None = None, mapped: bool = False) -> list[Holding]:
        """The ``n`` largest live owned allocations on ``gpu`` (with ``mapped``: ipc_mapped too)."""
        rows = self.tables.allocs.rows_of(pid)
        if gpu is not None:
            rows = rows[self.tables.allocs.gpu[rows] == gpu]
        items = self._top_driver(rows, n)
        items += (h for h in self.other_holdings(gpu, pid) if mapped or h.category != "ipc_mapped")
        return heapq.nsmallest(n, items, key=largest_key)

    def _top_driver(self, rows: np.ndarray, n: int) -> list[Holding]:
        """The ``n`` first driver allocations of ``rows`` by size, largest first (ties: gpu, pid,
        pointer: the order of ``largest_key`` and ``holder_key`` among allocations), with numpy."""
        al = self.tables.allocs
        top = rows[np.lexsort((al.ptr[rows], al.pid[rows], al.gpu[rows], -al.size[rows]))[:n]]
        return [Holding(int(al.pid[r]), int(al.gpu[r]), "driver", int(al.size[r]), int(al.ptr[r]), int(al.ts[r]),
                        int(al.api[r])) for r in top]

    def holders(self, gpu: int, n: int = 3) -> list[dict]:
        """Who holds what on ``gpu`` now (an OOM snapshot), biggest owner first.

        Each entry: ``{"pid", "owned", "mapped", "by_category": {category: bytes}, "largest": [
        Holding as dict, ...]}`` with the ``n`` largest live pieces (owned first, then mapped).
        """
        per: dict[int, dict] = {}
        for (g, p, cat), b in self.tables.bytes.items():
            if g != gpu or not b:
                continue
            e = per.setdefault(p, {"pid": p, "owned": 0, "mapped": 0, "by_category": {}})
            e["by_category"][CATEGORIES[cat]] = b
            e["mapped" if cat == IPC_MAPPED else "owned"] += b
        tops: dict[int, list[Holding]] = {p: [] for p in per}
        on_gpu = self.tables.allocs.rows_of()
        on_gpu = on_gpu[self.tables.allocs.gpu[on_gpu] == gpu]
        for p in per:
            tops[p] = self._top_driver(on_gpu[self.tables.allocs.pid[on_gpu] == p], n)
        for h in self.other_holdings(gpu=gpu):
            if h.pid in tops:
                tops[h.pid].append(h)
        out = []
        for p, e in per.items():
            e["by_category"] = {c: e["by_category"][c] for c in CATEGORIES if c in e["by_category"]}
            e["largest"] = [h._asdict() for h in heapq.nsmallest(n, tops[p], key=holder_key)]
            out.append(e)
        out.sort(key=lambda e: (-e["owned"], -e["mapped"], e["pid"]))
        return out

    def exit_records(self) -> list[dict]:
        """What each exited process still held when it exited (freed implicitly), in exit order.

        Each: ``{"pid", "ts", "owned", "mapped", "count", "held": [{"gpu", "category", "bytes",
        "count"}], "largest": [Holding as dict]}``.
        """
        out = []
        for pid, ts, held, largest in self.tables.exits:
            rows = [dict(zip(HELD_FIELDS, r)) for r in table_rows(held, len(HELD_FIELDS))]
            for r in rows:
                r["category"] = CATEGORIES[r["category"]]
            big = []
            for r in table_rows(largest, len(LARGEST_FIELDS)):
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
        got = {k: v for k, v in self.tables.bytes.items() if v}
        expect = {k: v for k, v in expect.items() if v}
        if got != expect:
            raise AssertionError(f"counters {got} != tables {expect}")
        owned: dict[int, int] = {}
        for (g, _, c), b in expect.items():
            if c != IPC_MAPPED:
                owned[g] = owned.get(g, 0) + b
        got_owned = {g: b for g, b in self.tables.gpu_owned.items() if b}
        if got_owned != owned:
            raise AssertionError(f"owned totals {got_owned} != tables {owned}")
        for table in (self.tables.allocs, self.tables.handles, self.tables.maps):
            table.check()


def largest_key(h: Holding) -> tuple:
    return (-h.size, h.gpu, h.pid, CATEGORY_INDEX[h.category], h.address)


def holder_key(h: Holding) -> tuple:
    return (h.category == "ipc_mapped", -h.size, CATEGORY_INDEX[h.category], h.address)
