"""The TUI model's replay and the views over it: per-GPU series of bytes by category.

:class:`ReplayedTrace` replays the events through the engine's journaling
:class:`memrec.state.LiveState` (:meth:`~ReplayedTrace.index_step`, in a worker thread for a file so
that the first frame never waits for it) into one :class:`memrec.engine.series.CategorySeries` per
GPU, keeps checkpoints for the cursor, and answers what the timeline draws: the time range, the
downsampled :meth:`~ReplayedTrace.viewport`, the phase bands and the rank labels. Live mode bounds
memory with :meth:`~ReplayedTrace.trim`.
"""

from __future__ import annotations

import marshal
from dataclasses import dataclass

import numpy as np

from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.engine.group import distinct
from memrec.engine.journal import Journal
from memrec.engine.journal import take_rows
from memrec.engine.phases import build_phases
from memrec.engine.replay import Timeline
from memrec.engine.series import CategorySeries
from memrec.engine.series import gpu_series
from memrec.terms.ranks import process_label
from memrec.terms.ranks import rank_labels
from memrec.state import JOURNAL_FIELDS
from memrec.tui.intake import TraceIntake
from memrec.tui.views import NCAT
from memrec.tui.views import PhaseIndex
from memrec.tui.views import PhaseSpan
from memrec.tui.views import SeriesView


@dataclass
class TraceView:
    """What :func:`memrec.analysis.untraced.reconcile.reconcile` reads of a trace, from the model."""

    header: dict
    trailer: dict | None
    markers: list
    events: np.ndarray
    nvml: np.ndarray
    procmem: np.ndarray


class ReplayedTrace(TraceIntake):
    """A trace's intake plus its replay into series, and the timeline's views of them."""

    # ------------------------------------------------------------------ replay

    @property
    def indexed(self) -> bool:
        return self.frontier >= self.store.n

    def index_step(self, budget: int = 65536) -> int:
        """Replay up to ``budget`` more events into the series; return how many were replayed."""
        lo = self.frontier
        with self.lock:
            hi = min(self.store.n, lo + budget)
            if hi <= lo:
                return 0
            pieces = self.store.pieces(lo, hi)
        events = self.store.batch(pieces)  # columns: no rows built for the replay
        done = 0
        while done < len(events):
            step = len(events) - done
            if self.checkpoint_every:
                step = min(step, self.checkpoint_every - self._since_checkpoint)
            part = events[done : done + step]
            self._live.apply(part)
            with self.lock:
                self._gpu_res.reserve(self.store.n - self._gpu_res_base)
                self._gpu_res.extend(part["gpu"])
            done += step
            self._since_checkpoint += step
            self._commit_journal(self.store.n / (lo + done))
            if self.checkpoint_every and self._since_checkpoint >= self.checkpoint_every:
                snap = self._live.snapshot()
                try:
                    snap = marshal.dumps(snap)
                except ValueError:  # an int or str subclass got in: keep the dict
                    pass
                with self.lock:
                    self._checkpoints.append((self._live.n_events, snap))
                self._since_checkpoint = 0
            with self.lock:
                self.frontier = lo + done
        return done

    def _commit_journal(self, growth: float) -> None:
        """Append the journal's new changes to the GPUs' series. ``growth``: the trace's events
        over those replayed so far, to project how long each series gets and reserve its room
        once (doubling it copied every point into fresh pages again and again)."""
        rows = take_rows(self._live)
        if not len(rows):
            return
        if self._journal is not None:
            self._journal.append(rows)
        with self.lock:
            gpus = rows[:, 2]
            pairs = rows[:, 2] * (1 << 32) + rows[:, 3]
            # (GPU, pid) pairs known after the first chunks: only new ones are sorted in; looked
            # up by a search of the sorted ones (np.isin and union1d hashed every pair seen at every
            # chunk: 6 of 11 s of the model at 100,000 processes)
            seen = self._pairs_seen
            if len(seen):
                at = np.minimum(np.searchsorted(seen, pairs), len(seen) - 1)
                new = pairs[seen[at] != pairs]
            else:
                new = pairs
            if len(new):
                new = np.unique(new)
                self._pairs_seen = np.sort(np.concatenate([seen, new]))
                for pair in new.tolist():
                    self._gpu_pids.setdefault(pair >> 32, set()).add(pair & 0xFFFFFFFF)
            named = distinct(gpus)
            for g in named:
                # a GPU's rows as positions, then 1-D gathers (a boolean mask over the 6-wide rows was slower)
                sel = np.flatnonzero(gpus == g) if len(named) > 1 else slice(None)
                self._gpu_ids.add(g)
                series = self.series.setdefault(g, CategorySeries())
                seq = rows[sel, 0]
                held = len(series) + len(seq)
                if held * growth > series.seq.capacity:
                    # headroom, as a projection moves; at most 8 × what it holds, so that a burst
                    # early in a trace does not reserve for the whole of it
                    series.reserve(int(min(held * growth * 1.25, 8 * held)) + 1024)
                series.append(seq, rows[sel, 1].astype(np.uint64), rows[sel, 4].astype(np.int8), rows[sel, 5])
                series.blocks()  # keep the max pyramid current: redraws never build it

    def keep_journal(self) -> None:
        """Keep the replay's journal from the first event on, for :meth:`replayed` (a file source
        asks before its replay; the journal costs about 48 bytes per change)."""
        with self.lock:
            if self.frontier == 0 and self._journal is None:
                self._journal, self._initial = [], self._live.counters()

    def replayed(self) -> tuple[TraceView, Timeline] | None:
        """The trace as :func:`memrec.analysis.untraced.reconcile.reconcile` reads it, and the replay this
        model did as the engine's :class:`~memrec.engine.replay.Timeline` (built from the journal
        kept since the first event: :meth:`keep_journal`), so that the untraced split needs neither a
        second read nor a second replay. None when there is no such journal (not asked for, or
        the replay is not done, or live). The journal is handed over: a second call gives None.
        """
        with self.lock:
            if self._journal is None or self._initial is None or not self.indexed or self.store.base:
                return None
            rows, initial, self._journal, self._initial = self._journal, self._initial, None, None
            n = self.store.n
            events = self.store.materialize(self.store.pieces(0, n))
            if not events.flags.owndata:  # a view of the store's own events: they stay as read
                events = events.copy()
            events["gpu"] = self._gpu_res.a[:n]  # as the replay resolved them (frees, unmaps...)
            nvml = np.concatenate([nv.samples(g) for g, nv in sorted(self.nvml.items())] or [np.zeros(0, NVML_DTYPE)])
            view = TraceView(self.header, self.trailer, list(self.markers), events, nvml,
                             np.concatenate(self.procmem) if self.procmem else np.zeros(0, PROCMEM_DTYPE))
        journal = Journal(*np.ascontiguousarray(np.concatenate(rows).T)) if rows else \
            Journal(*np.zeros((len(JOURNAL_FIELDS), 0), np.int64))
        start = int(events["ts"][0]) if n else 0
        gpus = sorted({int(g) for g in np.unique(journal.gpu)} | {g for g, _, _ in initial})
        series = {g: gpu_series(g, journal, initial, start, 0) for g in gpus}
        return view, Timeline(gpus=series, journal=journal, state=self._live, start=start, events=events)

    def trim(self) -> None:
        """Live mode: keep at most ``max_events`` events (and what depends on them)."""
        if not self.max_events:
            return
        with self.lock:
            if len(self.store) <= self.max_events:
                return
            want = min(self.store.n - self.max_events // 2, self.frontier)
            cps = [c[0] for c in self._checkpoints if c[0] <= want]
            if not cps:
                return  # no checkpoint to restart from yet: keep everything
            self.store.drop_before(cps[-1])
            cut = self.store.base
            self._gpu_res.drop_front(cut - self._gpu_res_base)
            self._gpu_res_base = cut
            self._checkpoints = [c for c in self._checkpoints if c[0] >= cps[-1]]
            self.keyframes = [k for k in self.keyframes if k[0] >= cut]
            for s in self.series.values():
                s.drop_before_seq(cut)
            self.landmarks.drop_before_seq(cut)
            t_cut = self.store.first_ts() or 0
            for nv in self.nvml.values():
                k = int(np.searchsorted(nv.ts.a, np.uint64(t_cut))) - 1
                for g in (nv.ts, nv.used, nv.reserved, nv.total, nv.bar1_used, nv.bar1_total):
                    g.drop_front(k)
            self._kf_points = [p for p in self._kf_points if p[0] >= t_cut]

    # ------------------------------------------------------------------ time range

    def time_range(self) -> tuple[int, int]:
        """(first ts, last ts) over events, NVML samples and markers (0, 1 when empty). The
        recording's start (the header's monotonic anchor) counts as a first ts, as in
        :func:`memrec.engine.replay.trace_bounds`: times on screen are the report's."""
        lo, hi = [], []
        anchor = (self.header or {}).get("anchor")
        if isinstance(anchor, dict) and isinstance(anchor.get("monotonic_ns"), int):
            lo.append(anchor["monotonic_ns"])
        f, l = self.store.first_ts(), self.store.last_ts()
        if f is not None:
            lo.append(f)
            hi.append(l)
        for nv in self.nvml.values():
            if nv.ts.n:
                lo.append(int(nv.ts.a[0]))
                hi.append(int(nv.ts.a[-1]))
        if self.markers:
            lo.append(self.markers[0].ts)
            hi.append(self.markers[-1].ts)
        for _, ts, _ in self.keyframes:
            lo.append(ts)
            hi.append(ts)
        if self.t_end_hint:
            hi.append(self.t_end_hint)
        if not lo:
            return (0, 1)
        a, b = min(lo), max(hi, default=0)
        return (a, max(b, a + 1))

    def gpu_ids(self) -> list[int]:
        """Every GPU named so far: it grows while a file is read and a live stream goes on (a
        trace without NVML names its GPUs only in its events), so the view asks again after each
        change (see :class:`memrec.trace.model.GpuIds`)."""
        with self.lock:
            return self._gpu_ids.sorted()

    def frontier_ts(self) -> int:
        """Time up to which the series are exact (the replay's frontier)."""
        if self.frontier >= self.store.n:
            return self.time_range()[1] + 1
        return self.store.ts_of(self.frontier) if self.frontier > self.store.base else -1

    # ------------------------------------------------------------------ viewport

    def viewport(self, gpu: int, t0: int, t1: int, width: int) -> SeriesView:
        """The series of ``gpu`` over [t0, t1) in ``width`` columns (see the module docstring)."""
        width = max(int(width), 1)
        t1 = max(t1, t0 + 1)
        edges = t0 + (np.arange(width + 1, dtype=np.float64) * ((t1 - t0) / width))
        edges_u = np.maximum(edges, 0).astype(np.uint64)
        cats = np.zeros((NCAT, width), dtype=np.int64)
        nv_used = np.full(width, -1, dtype=np.int64)
        coarse = np.zeros(width, dtype=bool)
        with self.lock:
            lo_t, hi_t = self.time_range()
            has = (edges[1:] > lo_t) & (edges[:-1] <= hi_t)
            ftime = self.frontier_ts()
            s = self.series.get(gpu)
            if s is not None and len(s):
                pos = np.searchsorted(s.ts.a, edges_u, side="left")
                for k in range(width):
                    a, b = int(pos[k]), int(pos[k + 1])
                    lo = max(a - 1, 0)
                    if b <= lo:
                        if a == 0:
                            continue
                        i = a - 1
                    else:
                        i = s.argmax(lo, b) if b - lo > 1 else lo
                    cats[:, k] = s.values_at(i)
            # beyond the replay's frontier: keyframes (coarse)
            if ftime <= hi_t and self._kf_points:
                kts = np.array([p[0] for p in self._kf_points], dtype=np.float64)
                ks = np.flatnonzero(edges[1:] > ftime)
                js = (np.searchsorted(kts, edges[ks + 1], side="right") - 1).tolist()
                zero = np.zeros(NCAT, np.int64)
                for k, j in zip(ks.tolist(), js):
                    if j >= 0:
                        cats[:, k] = self._kf_points[j][1].get(gpu, zero)
                coarse[ks] = True
            elif ftime <= hi_t:
                coarse[edges[1:] > ftime] = True
            nv = self.nvml.get(gpu)
            if nv is not None and nv.ts.n:
                pos = np.searchsorted(nv.ts.a, edges_u, side="left")
                used = nv.used.a
                for k in range(width):
                    a, b = int(pos[k]), int(pos[k + 1])
                    if b > a:
                        nv_used[k] = int(used[a:b].max())
                    elif a > 0 and has[k]:
                        nv_used[k] = int(used[a - 1])
        cats[:, ~has] = 0
        return SeriesView(t0, t1, width, cats, nv_used, coarse, has)

    # ------------------------------------------------------------------ phases, labels

    def phase_index(self) -> PhaseIndex:
        with self.lock:
            n = len(self.markers)
            if self._phase_cache is None or self._phase_cache[0] != n:
                self._phase_cache = (n, PhaseIndex(build_phases(self.markers)))
            return self._phase_cache[1]

    def pid_label(self, pid: int) -> str:
        """``TP0`` from the process's markers (as ``memrec report`` names ranks), else its
        ProcessInfo rank, else the pid."""
        label = self._rank_labels().get(pid)
        if label:
            return label
        p = self.processes.get(pid)
        return (process_label(p.rank) if p is not None else "") or str(pid)

    def _rank_labels(self) -> dict[int, str]:
        with self.lock:
            n = len(self.markers)
            if self._rank_cache is None or self._rank_cache[0] != n:
                self._rank_cache = (n, rank_labels(self.markers))
            return self._rank_cache[1]

    def pid_command(self, pid: int) -> str:
        p = self.processes.get(pid)
        if p is None or not p.cmdline:
            return ""
        return " ".join(p.cmdline)

    def gpu_pids(self, gpu: int) -> list[int]:
        """Processes seen on ``gpu`` (holding memory there, or told so by a marker or their map)."""
        pids: set[int] = set()
        for p in self.processes.values():
            if gpu in (p.gpu_map or []):
                pids.add(p.pid)
        for m in self.markers:
            if m.gpu == gpu:
                pids.add(m.pid)
        pids |= self._gpu_pids.get(gpu, set())
        return sorted(pids)

    def bands(self, gpu: int) -> list[tuple[str, list[PhaseSpan]]]:
        """Phase spans per rank for ``gpu``'s processes: [(label, spans)], at most one row per pid."""
        spans = self.phase_index().spans
        pids = set(self.gpu_pids(gpu))
        if not pids:
            pids = {s.pid for s in spans}
        rows: dict[int, list[PhaseSpan]] = {}
        for s in spans:
            if s.pid in pids or s.gpu == gpu:
                rows.setdefault(s.pid, []).append(s)
        return [(self.pid_label(pid), rows[pid]) for pid in sorted(rows, key=lambda p: (self.pid_label(p), p))]
