"""Step series of bytes over time, built from the replay's journal with numpy only.

Two shapes of one thing, both read from :class:`~memrec.engine.journal.Journal` rows:

- :class:`GpuSeries`: the whole trace on one GPU, per (pid, category), for ``memrec report``,
  ``memrec diff``, ``memrec.load`` and the exports. It keeps the journal's changes (sparse), not a
  dense (changes × keys) matrix: a series summed over any selection of keys is one masked
  ``cumsum``, so memory is linear in the changes whatever the number of processes.
  :class:`SeriesBuilder` builds every GPU's from the journal a chunk at a time as a replay goes.
- :class:`CategorySeries`: one GPU's bytes per category, appended chunk by chunk as a replay
  goes (the TUI's file replay and live stream), with a block-max pyramid so that downsampling a
  time range to screen columns is O(columns).

Owned totals leave ``ipc_mapped`` out (mapped, not owned); GPU -1 is the host (pinned memory)
and device memory of unknown GPU.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import numpy as np

from memrec.engine.group import factorize
from memrec.engine.journal import Journal
from memrec.terms.events import CATEGORIES
from memrec.terms.events import OWNED

NCAT = len(CATEGORIES)
#: Block size of the max pyramid used to downsample a CategorySeries.
BLOCK = 512
#: Series a GpuSeries keeps computed (each is one int64 per row): the report asks for a few
#: selections several times; more would hold memory in proportion to the trace for nothing.
CACHED = 6


@dataclass
class GpuSeries:
    """Bytes held on one GPU after each event that changed them (a step function of time).

    Row ``i`` is the state right after event ``event_index[i]`` (at ``ts[i]``); row 0 is the
    state before the first change (at the trace's start, ``event_index`` = first - 1). ``keys``
    are the (pid, category) pairs that held or mapped anything here, ascending.
    """

    gpu: int
    ts: np.ndarray
    event_index: np.ndarray
    keys: list[tuple[int, str]]
    key_of_change: np.ndarray = field(repr=False)  # per journal change: index into keys
    delta: np.ndarray = field(repr=False)  # per change: signed bytes
    last_change: np.ndarray = field(repr=False)  # per row >= 1: the row's last change
    initial: np.ndarray = field(repr=False)  # per key: bytes at row 0
    _cache: dict = field(default_factory=dict, repr=False)
    _derived: dict = field(default_factory=dict, repr=False)  # pids, per_pid: small, kept

    def _selected(self, pid: int | None, categories: tuple[str, ...] | None) -> np.ndarray:
        return np.array(
            [(pid is None or p == pid) and (categories is None or c in categories) for p, c in self.keys], dtype=bool
        )

    def series(self, pid: int | None = None, categories: tuple[str, ...] | None = OWNED) -> np.ndarray:
        """Bytes over time summed over the selected keys (default: every pid, owned categories)."""
        sel = self._selected(pid, categories)
        ck = sel.tobytes()  # selections of the same keys (every pid = the only pid) share one series
        hit = self._cache.get(ck)
        if hit is not None:
            return hit
        out = np.zeros(len(self.ts), dtype=np.int64)
        if sel.any():
            out[0] = int(self.initial[sel].sum())
            if len(self.delta):
                d = self.delta if sel.all() else np.where(sel[self.key_of_change], self.delta, 0)
                out[1:] = out[0] + np.cumsum(d)[self.last_change]
        if len(self._cache) >= CACHED:
            del self._cache[next(iter(self._cache))]
        self._cache[ck] = out
        return out

    def total(self, pid: int | None = None) -> np.ndarray:
        """Owned bytes over time (ipc_mapped left out), of every process or of ``pid``."""
        return self.series(pid, OWNED)

    def by_category(self, pid: int | None = None) -> dict[str, np.ndarray]:
        """One series per category present (ipc_mapped included: it is the importers' view)."""
        present = {c for p, c in self.keys if pid is None or p == pid}
        return {c: self.series(pid, (c,)) for c in CATEGORIES if c in present}

    def by_pid(self, categories: tuple[str, ...] | None = OWNED) -> dict[int, np.ndarray]:
        """One series per process (owned categories by default), pids ascending."""
        return {p: self.series(p, categories) for p in self.pids()}

    def pids(self) -> list[int]:
        """Processes that held or mapped anything on this GPU (ascending; a new list each call)."""
        hit = self._derived.get("pids")
        if hit is None:
            hit = self._derived["pids"] = sorted({p for p, _ in self.keys})
        return list(hit)

    def index_at(self, ts: int) -> int:
        """Row holding the state at time ``ts`` (after every event at or before it); 0 before any."""
        return max(int(np.searchsorted(self.ts, ts, side="right")) - 1, 0)

    def at(self, ts: int, pid: int | None = None, categories: tuple[str, ...] | None = OWNED) -> int:
        """Bytes held at ``ts`` (owned by default)."""
        return int(self.series(pid, categories)[self.index_at(ts)])

    def peak(self, pid: int | None = None, categories: tuple[str, ...] | None = OWNED) -> tuple[int, int, int]:
        """(bytes, ts, row) of the highest point; the first one when it is reached several times."""
        s = self.series(pid, categories)
        i = int(np.argmax(s)) if len(s) else 0
        return int(s[i]), int(self.ts[i]), i

    def per_pid(self, categories: tuple[str, ...] = OWNED) -> PidSteps:
        """Every process's bytes of ``categories`` over time at once, each as its own change points
        (:class:`PidSteps`): O(changes + processes), where a :meth:`series` per process is
        O(rows) each, O(processes × events) in all (a host of 100,000 short processes)."""
        hit = self._derived.get(categories)
        if hit is None:
            hit = self._derived[categories] = PidSteps.build(self, categories)
        return hit

    def held_at(self, i: int) -> np.ndarray:
        """What every key of :attr:`keys` held at row ``i`` (one pass over the changes before it)."""
        held = self.initial.copy()
        if i > 0 and len(self.delta):
            upto = int(self.last_change[i - 1]) + 1
            np.add.at(held, self.key_of_change[:upto], self.delta[:upto])
        return held

    def row(self, i: int) -> dict[tuple[int, str], int]:
        """What every (pid, category) held at row ``i`` (zeros left out)."""
        return {k: int(v) for k, v in zip(self.keys, self.held_at(i).tolist()) if v}


@dataclass
class PidSteps:
    """Each process's bytes on one GPU (a selection of categories) as a step function of the
    GPU's rows: per process its initial, final, highest and lowest value and the first row
    reaching the highest (row 0 when it never rose above its initial value), built in
    O(changes + processes) and kept (a few arrays of one value per process); each process's own
    change points (:meth:`steps`, :meth:`at_rows`) are sorted out on first use only, so that a
    report that asks for none holds no per-change memory beside the series."""

    series: GpuSeries = field(repr=False)
    categories: tuple[str, ...] | None
    pids: np.ndarray
    initial: np.ndarray
    final: np.ndarray
    peak: np.ndarray
    low: np.ndarray
    peak_row: np.ndarray
    _keys: tuple[np.ndarray, np.ndarray] = field(repr=False)  # per key: selected, its process's position
    _points: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, s: GpuSeries, categories: tuple[str, ...] | None) -> PidSteps:
        key_pid = np.array([p for p, _ in s.keys], dtype=np.int64)
        key_sel = np.array([categories is None or c in categories for _, c in s.keys], dtype=bool)
        pids, key_pidx = np.unique(key_pid, return_inverse=True)
        npid = len(pids)
        initial = np.zeros(npid, dtype=np.int64)
        np.add.at(initial, key_pidx[key_sel], s.initial[key_sel])
        if npid == 1:  # one process (a GPU per process): its series is the GPU's, which the report has
            dense = s.series(None, categories)
            row = int(np.argmax(dense))
            final, peak, low, peak_row = (np.array([v], dtype=np.int64) for v in (dense[-1], dense[row], dense.min(), row))
            return cls(s, categories, pids, initial, final, peak, low, peak_row, (key_sel, key_pidx))
        who, rows, values = _change_points(s, key_sel, key_pidx, initial)
        offsets = _offsets(who, npid)
        final = initial.copy()
        ends = offsets[1:][offsets[1:] > offsets[:-1]] - 1
        final[who[ends]] = values[ends]
        peak, low = initial.copy(), initial.copy()
        np.maximum.at(peak, who, values)
        np.minimum.at(low, who, values)
        peak_row = np.zeros(npid, dtype=np.int64)
        hit = np.flatnonzero((values == peak[who]) & (values > initial[who]))
        if len(hit):
            owners, firsts = np.unique(who[hit], return_index=True)
            peak_row[owners] = rows[hit[firsts]]
        return cls(s, categories, pids, initial, final, peak, low, peak_row, (key_sel, key_pidx))

    def index(self, pid: int) -> int | None:
        """Position of ``pid`` in :attr:`pids` (None when it held nothing here)."""
        i = int(np.searchsorted(self.pids, pid))
        return i if i < len(self.pids) and self.pids[i] == pid else None

    def at_row(self, row: int) -> np.ndarray:
        """What every process held at ``row`` (one pass over the changes before it)."""
        key_sel, key_pidx = self._keys
        out = np.zeros(len(self.pids), dtype=np.int64)
        np.add.at(out, key_pidx[key_sel], self.series.held_at(row)[key_sel])
        return out

    def steps(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Process ``pids[i]``'s change points (rows, values), its initial value at row 0 first."""
        if self._points is None:
            key_sel, key_pidx = self._keys
            who, rows, values = _change_points(self.series, key_sel, key_pidx, self.initial)
            self._points = (_offsets(who, len(self.pids)), rows, values)
        offsets, rows, values = self._points
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        return np.append(0, rows[lo:hi]), np.append(self.initial[i], values[lo:hi])

    def at_rows(self, i: int, rows: np.ndarray) -> np.ndarray:
        """What process ``pids[i]`` held at each of ``rows`` (O(its changes + len(rows)))."""
        r, v = self.steps(i)
        return v[np.maximum(np.searchsorted(r, rows, side="right") - 1, 0)]


def _change_points(s: GpuSeries, key_sel: np.ndarray, key_pidx: np.ndarray, initial: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every process's change points of the selected keys, by process then in time order: (its
    position, the row, what it held from that row on). One stable sort of the changes by process
    and one segmented cumsum; several changes of one process in one event (an exit) are one row."""
    change = np.flatnonzero(key_sel[s.key_of_change]) if len(key_sel) else np.zeros(0, dtype=np.int64)
    who = key_pidx[s.key_of_change[change]]
    if len(initial) > 1:  # (numpy's stable sort of 8- or 16-bit values is a radix sort: O(changes))
        narrow = np.uint8 if len(initial) <= 1 << 8 else np.uint16 if len(initial) <= 1 << 16 else who.dtype
        order = np.argsort(who.astype(narrow, copy=False), kind="stable")
        change, who = change[order], who[order]
        del order
    delta = s.delta[change]
    rows = np.searchsorted(s.last_change, change, side="left") + 1  # the row each change shows in
    del change
    values = np.cumsum(delta)
    first = np.ones(len(who), dtype=bool)
    first[1:] = who[1:] != who[:-1]
    starts = np.flatnonzero(first)
    before = values[starts] - delta[starts]  # the cumsum before each process's first change
    del delta, first
    values -= np.repeat(before, np.diff(np.append(starts, len(who))))
    values += initial[who]
    last = np.ones(len(who), dtype=bool)
    last[:-1] = (who[1:] != who[:-1]) | (rows[1:] != rows[:-1])
    return who[last], rows[last], values[last]


def _offsets(who: np.ndarray, n: int) -> np.ndarray:
    """Where each of ``n`` processes' points start in ``who`` (sorted), and the end."""
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(who, minlength=n), out=offsets[1:])
    return offsets


# ------------------------------------------------------------------------------ chunk by chunk


class Grow:
    """A growable 1-D numpy array (capacity doubling), ``.a`` is the live view.

    The buffer past ``n`` is never read, so it is ``np.empty``: ``np.zeros`` made every doubling
    fault in fresh zeroed pages, and growing the TUI's per-category series to 10M points took
    4.7 × as long (1.12 s against 0.24 s for 8 GPUs × 7 arrays, measured side by side).
    """

    def __init__(self, dtype: Any, capacity: int = 1024) -> None:
        self._buf = np.empty(capacity, dtype=dtype)
        self.n = 0

    @property
    def a(self) -> np.ndarray:
        return self._buf[: self.n]

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def extend(self, values: np.ndarray, expect: int = 0) -> None:
        """Append ``values``; ``expect``: the length it is expected to reach (that capacity at
        once, no copies as it grows; doubling past it)."""
        m = len(values)
        if self.n + m > len(self._buf):
            self._grow(expect if expect >= self.n + m else max(len(self._buf) * 2, self.n + m))
        self._buf[self.n : self.n + m] = values
        self.n += m

    def reserve(self, capacity: int) -> None:
        """Make room for at least ``capacity`` values (a no-op when there is; else at least
        double): a replay that can tell how long a series will get skips the doublings, each a
        copy into fresh pages (growing 8 × 7 series of 2048-value pieces to 1.25M values each by
        doubling took 0.3 – 1.4 s; reserved at once, 0.05 – 0.2 s, measured side by side)."""
        if capacity > len(self._buf):
            self._grow(max(capacity, 2 * len(self._buf)))

    def _grow(self, capacity: int) -> None:
        new = self._alloc(capacity)
        new[: self.n] = self._buf[: self.n]
        self._buf = new

    def _alloc(self, capacity: int) -> np.ndarray:
        return np.empty(capacity, dtype=self._buf.dtype)

    def drop_front(self, k: int) -> None:
        if k <= 0:
            return
        k = min(k, self.n)
        self._buf = self._buf[k : self.n].copy() if self.n - k else np.empty(16, dtype=self._buf.dtype)
        self.n -= k


def gpu_series(g: int, j: Journal, initial: dict, start: int, first_index: int) -> GpuSeries:
    """GPU ``g``'s series from the journal rows on it and the state the replay started from
    (``initial``: (gpu, pid, category index) -> bytes)."""
    builder = SeriesBuilder(initial, start, first_index, only=g)
    builder.add(j)
    return builder.series([g])[g]


class _Mapped(Grow):
    """A :class:`Grow` whose buffers are anonymous memory maps of their own, not the heap: the
    outgrown buffers of eight GPUs' series, freed while the others live, stayed in glibc's heap
    as free memory (RSS 260 MB more at 10M events, measured); a map goes back to the system when
    let go, and capacity not written costs nothing."""

    def __init__(self, dtype: Any, first: int | None = None) -> None:
        super().__init__(dtype, 0)
        if first is not None:
            self.extend(np.array([first], dtype=dtype))

    def _alloc(self, capacity: int) -> np.ndarray:
        capacity = max(capacity, 1 << 14)
        return np.frombuffer(mmap.mmap(-1, capacity * self._buf.itemsize), dtype=self._buf.dtype)


class _Gpu:
    """One GPU's series as it grows: per change its key and delta, per row its ts, event and
    last change."""

    def __init__(self, start: int, first_index: int) -> None:
        self.key = _Mapped(np.int32)  # per change: the order its (pid, category) code was first seen
        self.delta = _Mapped(np.int64)
        self.ts = _Mapped(np.int64, start)
        self.index = _Mapped(np.int64, first_index - 1)
        self.last = _Mapped(np.int32)  # per row >= 1: its last change (int64 past 2**31 changes)
        self.codes: dict[int, int] = {}  # (pid, category) code -> first-seen order


class SeriesBuilder:
    """Every GPU's :class:`GpuSeries`, built from the journal a chunk of rows at a time, in replay
    order: a replay hands each chunk's changes over as it goes and need not keep the journal
    (35 B a change) beside the series (32 B a change).

    Args:
        initial: the state the replay started from, (gpu, pid, category index) -> bytes.
        start: the time of each series' initial row; ``first_index``: the first event replayed.
        only: build this GPU's series only.
    """

    def __init__(self, initial: dict, start: int, first_index: int, only: int | None = None) -> None:
        self._initial = initial
        self._start = start
        self._first = first_index
        self._only = only
        self._gpus: dict[int, _Gpu] = {}

    def gpus(self) -> list[int]:
        """The GPUs with changes or an initial holding, ascending."""
        return sorted(set(self._gpus) | {g for g, _, _ in self._initial})

    def add(self, j: Journal, share: float = 1.0) -> None:
        """Append journal rows that follow the ones added before (whole events: a chunk never
        splits the changes of one event). ``share``: the part of the replay done with these rows
        (each GPU's arrays are sized from it once, not grown by doubling)."""
        if not len(j):
            return
        if self._only is not None:
            parts = [(self._only, np.flatnonzero(j.gpu == self._only))]
        else:  # every GPU's positions from one stable sort of the (int16) GPU column
            order = np.argsort(j.gpu, kind="stable")
            gs = j.gpu[order]
            cuts = [0, *(np.flatnonzero(gs[1:] != gs[:-1]) + 1).tolist(), len(gs)]
            parts = [(int(gs[lo]), order[lo:hi]) for lo, hi in zip(cuts, cuts[1:])]
        for g, m in parts:
            if len(m):
                self._add(g, j, m, share)

    def _add(self, g: int, j: Journal, m: np.ndarray, share: float) -> None:
        acc = self._gpus.get(g)
        if acc is None:
            acc = self._gpus[g] = _Gpu(self._start, self._first)
        code = j.pid[m] * NCAT + j.category[m]  # (pid, category) as one int: sorts like the pair
        lo, hi = int(code.min()), int(code.max())
        if lo == hi:  # one (pid, category) in this part (a process per GPU): nothing to group
            key = np.full(len(m), acc.codes.setdefault(lo, len(acc.codes)), dtype=np.int32)
        else:
            codes, uniq = factorize(code)
            seen = [acc.codes.setdefault(c, len(acc.codes)) for c in uniq.tolist()]
            key = np.asarray(seen, dtype=np.int32)[codes]
        changes = acc.delta.n
        expect = int((changes + len(m)) / max(share, 1e-9) * 1.1) + 1  # this pace to the end, and a tenth
        acc.key.extend(key, expect)
        acc.delta.extend(j.delta[m], expect)
        if changes + len(m) >= 1 << 31 and acc.last.a.dtype == np.int32:
            wide = _Mapped(np.int64)
            wide.extend(acc.last.a)
            acc.last = wide
        index = j.index[m]
        # One row per event: several changes from one event (a process exit) collapse to the last.
        differs = index[1:] != index[:-1]
        if differs.all():  # a change per event: every change is a row
            acc.ts.extend(j.ts[m], expect)
            acc.index.extend(index, expect)
            acc.last.extend(np.arange(changes, changes + len(m)), expect)
            return
        last = np.ones(len(index), dtype=bool)
        last[:-1] = differs
        rows = np.flatnonzero(last)
        acc.ts.extend(j.ts[m[rows]], expect)
        acc.index.extend(index[rows], expect)
        acc.last.extend(rows + changes, expect)

    def series(self, gpus: list[int] | None = None) -> dict[int, GpuSeries]:
        """The series of ``gpus`` (default: :meth:`gpus`); once: they take the builder's arrays."""
        return {g: self._series(g) for g in (self.gpus() if gpus is None else gpus)}

    def _series(self, g: int) -> GpuSeries:
        acc = self._gpus.pop(g, None) or _Gpu(self._start, self._first)
        init = [(p * NCAT + c, b) for (gg, p, c), b in self._initial.items() if gg == g]
        seen = list(acc.codes)  # codes in first-seen order
        uniq = sorted(set(seen) | {k for k, _ in init})
        position = {k: i for i, k in enumerate(uniq)}
        initial_row = np.zeros(len(uniq), dtype=np.int64)
        for k, b in init:
            initial_row[position[k]] += b
        # keys ascending by code: first-seen order -> sorted position, one small table
        to_sorted = np.array([position[k] for k in seen], dtype=np.int32)
        keys = acc.key.a
        return GpuSeries(
            gpu=g,
            ts=acc.ts.a,
            event_index=acc.index.a,
            keys=[(k // NCAT, CATEGORIES[k % NCAT]) for k in uniq],
            key_of_change=np.take(to_sorted, keys, out=keys) if len(to_sorted) else keys,
            delta=acc.delta.a,
            last_change=acc.last.a,
            initial=initial_row,
        )


class CategorySeries:
    """Step series of one GPU's bytes per category, one point per journal change, appended as
    the replay goes; ``total`` (owned + mapped) is what a stacked view peaks on."""

    def __init__(self) -> None:
        self.seq = Grow(np.int64)
        self.ts = Grow(np.uint64)
        # per category: its bytes at each point, or None while it has never changed (then it is
        # ``_last[c]`` at every point: most GPUs see one or two categories, and a 10M-event
        # replay wrote 240 MB of such constants)
        self.cum: list[Grow | None] = [None] * NCAT
        self.total = Grow(np.int64)
        self._last = np.zeros(NCAT, dtype=np.int64)
        self._bmax = Grow(np.int64)
        self._barg = Grow(np.int64)
        self.offset = 0  # points dropped from the front (live trimming)

    def __len__(self) -> int:
        return self.seq.n

    def reserve(self, points: int) -> None:
        """Make room for ``points`` points in every column (see :meth:`Grow.reserve`)."""
        for g in self._columns():
            g.reserve(points)

    def _columns(self) -> list[Grow]:
        return [self.seq, self.ts, self.total, *(g for g in self.cum if g is not None)]

    def column(self, c: int) -> np.ndarray:
        """Bytes of category ``c`` at every point (a read-only view)."""
        g = self.cum[c]
        return g.a if g is not None else np.broadcast_to(self._last[c], (len(self),))

    def append(self, seq: np.ndarray, ts: np.ndarray, cat: np.ndarray, delta: np.ndarray) -> None:
        """Add journal changes (event index, ts, category index, signed bytes) in replay order."""
        n = len(seq)
        if not n:
            return
        present = np.bincount(cat, minlength=NCAT) if cat.min() >= 0 else np.ones(NCAT, dtype=np.int64)
        tot = np.full(n, int(self._last.sum()), dtype=np.int64)
        for c in range(NCAT):
            g = self.cum[c]
            if present[c] == len(cat):  # the chunk changes one category only: no mask
                step = np.cumsum(delta)
            elif present[c]:
                step = np.cumsum(np.where(cat == c, delta, 0))
            elif g is None:  # still constant
                continue
            else:  # unchanged in this chunk: a constant run
                g.extend(np.full(n, self._last[c], dtype=np.int64))
                continue
            if g is None:
                if not step.any():
                    continue
                g = self.cum[c] = Grow(np.int64, max(self.seq.capacity, len(self) + n))
                g.extend(np.full(len(self), self._last[c], dtype=np.int64))
            tot += step
            g.extend(step + self._last[c])
            self._last[c] = g.a[-1]
        self.total.extend(tot)
        self.seq.extend(seq)
        self.ts.extend(ts)

    def set_initial(self, values: np.ndarray, seq: int, ts: int) -> None:
        """Start from a known state (a keyframe the trace began with)."""
        self.append(
            np.full(NCAT, seq, np.int64), np.full(NCAT, ts, np.uint64), np.arange(NCAT, dtype=np.int8), values.astype(np.int64)
        )

    def blocks(self) -> None:
        """Bring the block-max pyramid up to date (the replay does it, so redraws never do)."""
        full = self.total.n // BLOCK
        have = self._bmax.n
        if full > have:
            part = self.total.a[have * BLOCK : full * BLOCK].reshape(-1, BLOCK)
            arg = part.argmax(axis=1)
            self._bmax.extend(part[np.arange(len(part)), arg])
            self._barg.extend(arg + (np.arange(len(part)) + have) * BLOCK)

    def argmax(self, lo: int, hi: int) -> int:
        """Index of the largest ``total`` in [lo, hi) (hi > lo)."""
        tot = self.total.a
        if hi - lo <= 4 * BLOCK:
            return lo + int(np.argmax(tot[lo:hi]))
        self.blocks()
        b0 = -(-lo // BLOCK)
        b1 = hi // BLOCK
        cands = []
        if lo < b0 * BLOCK:
            cands.append(lo + int(np.argmax(tot[lo : b0 * BLOCK])))
        if b1 > b0:
            bm = self._bmax.a[b0:b1]
            cands.append(int(self._barg.a[b0 + int(np.argmax(bm))]))
        if b1 * BLOCK < hi:
            cands.append(b1 * BLOCK + int(np.argmax(tot[b1 * BLOCK : hi])))
        return max(cands, key=lambda i: tot[i])

    def values_at(self, i: int) -> np.ndarray:
        """Bytes per category at point ``i``."""
        return np.array([self._last[c] if g is None else g.a[i] for c, g in enumerate(self.cum)], dtype=np.int64)

    def at_time(self, ts: int) -> np.ndarray | None:
        """Bytes per category after every change at or before ``ts`` (None before the first)."""
        i = int(np.searchsorted(self.ts.a, np.uint64(max(ts, 0)), side="right")) - 1
        return self.values_at(i) if i >= 0 else None

    def drop_before_seq(self, seq: int) -> None:
        """Drop points before ``seq``, keeping the last one before it as the start value."""
        k = int(np.searchsorted(self.seq.a, seq, side="left")) - 1
        if k <= 0:
            return
        for g in self._columns():
            g.drop_front(k)
        self._bmax = Grow(np.int64)
        self._barg = Grow(np.int64)
        self.offset += k
