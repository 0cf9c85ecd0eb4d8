"""The TUI's data model: pure numpy + :class:`memrec.state.LiveState`, no Textual.

A :class:`TraceModel` holds what a trace (a file being read, or a live daemon stream) says, and
answers what the screen asks for. It is built in three layers, one module each:

- :mod:`memrec.tui.intake` (:class:`~memrec.tui.intake.TraceIntake`): the record sink the file
  scan and the live stream feed: a *time index* over the events (``seq`` = position in the trace,
  ``ts`` = CLOCK_MONOTONIC ns; chunks kept as read, zero-copy column views for a file), NVML
  samples, markers, processes, keyframes;
- :mod:`memrec.tui.replay` (:class:`~memrec.tui.replay.ReplayedTrace`): per-GPU *series* of bytes
  by category, built by replaying the events through the engine's journaling LiveState (in a
  worker thread for a file, so that the first frame never waits for it; until the replay reaches
  a time, the series there comes from the trace's keyframes, drawn dim), and the timeline's views
  of them: :meth:`~memrec.tui.replay.ReplayedTrace.viewport` (one column per cell, the stack at
  the column's peak, O(columns) through a block-max pyramid), the phase bands, the rank labels;
- this module: the queries at the cursor. :meth:`TraceModel.state_at`: who holds what at a
  ``seq`` (the nearest checkpoint, a file keyframe or a snapshot the replay took every
  ``checkpoint_every`` events, restored plus a replay of the gap, of the processes on the GPU
  shown where no event joins processes: never a replay from the start);
  :meth:`TraceModel.events_window`: the events around a ``seq`` that pass an
  :class:`~memrec.tui.filters.EventFilter`.

What the widgets receive (:class:`SeriesView`, :class:`CursorState`, :class:`PhaseSpan`) lives in
:mod:`memrec.tui.views`; the jumps' landmarks in :mod:`memrec.tui.navigation`, the events in an
:class:`~memrec.tui.store.EventStore`. Live mode bounds memory: ``trim`` drops the oldest event
chunks, checkpoints and series points beyond ``max_events``.
"""


from __future__ import annotations

import bisect
import dataclasses
import marshal
import threading
from typing import Any

import numpy as np

from memrec.terms.columns import EVENT_DTYPE
from memrec.engine.phases import held_by_phase
from memrec.engine.replay import advance
from memrec.engine.replay import advance_for_gpu
from memrec.state import LiveState
from memrec.state.tensors import Fragmentation
from memrec.state.tensors import TensorBlocks
from memrec.analysis.report.sites import ALLOCATION_OF
from memrec.analysis.report.sites import user_frame
from memrec.trace.stacks import Unavailable
from memrec.tui.filters import API_NAMES
from memrec.tui.filters import KIND_NAMES
from memrec.tui.filters import EventFilter
from memrec.tui.filters import event_mask
from memrec.tui.store import EventRows
from memrec.tui.replay import ReplayedTrace
from memrec.tui.views import NCAT
from memrec.tui.views import CursorState
from memrec.tui.views import LiveAlloc
from memrec.tui.views import PhaseIndex
from memrec.tui.views import PhaseSpan
from memrec.tui.views import SeriesView
from memrec.tui.views import StackView
from memrec.tui.views import diff_rows
from memrec.tui.views import phase_spans


class TraceModel(ReplayedTrace):
    """Everything the TUI shows about one trace (see the module docstring; the arguments are
    :class:`~memrec.tui.intake.TraceIntake`'s)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Tensor blocks replayed up to ``_blocks_seq`` events (moved on as the cursor goes
        #: forward, replayed again from the first event kept when it goes back).
        self._blocks = TensorBlocks()
        self._blocks_seq = 0
        self._blocks_lock = threading.Lock()

    @classmethod
    def from_trace(cls, trace: Any, index: bool = True, **kwargs: Any) -> TraceModel:
        """Build a model from a loaded :class:`memrec.trace.model.Trace` (tests, small traces)."""
        m = cls(**kwargs)
        m.set_header(trace.header)
        for p in trace.processes.values():
            m.add_process(p)
        for mk in trace.markers:
            m.add_marker(mk)
        kfs = sorted(trace.keyframes, key=lambda k: k.event_index)
        if kfs and kfs[0].event_index == 0:
            m.add_keyframe(0, kfs[0].ts, kfs[0].state)
            kfs = kfs[1:]
        if len(trace.nvml):
            m.add_nvml(trace.nvml)
        if len(trace.events):
            m.add_events(trace.events)
        for k in kfs:
            m.add_keyframe(k.event_index, k.ts, k.state)
        m.lost = trace.lost
        m.trailer = trace.trailer
        m.warnings.extend(trace.warnings)
        if index:
            while m.index_step(1 << 20):
                pass
        return m

    # ------------------------------------------------------------------ state at the cursor

    def _best_checkpoint(self, seq: int) -> tuple[int, dict | bytes | None]:
        """The latest checkpoint valid after ``seq + 1`` events or fewer: (events covered, snapshot,
        marshalled when the replay took it)."""
        best: tuple[int, dict | bytes | None] = (0, None)
        cps = self._checkpoints
        i = bisect.bisect_right([c[0] for c in cps], seq + 1) - 1
        if i >= 0:
            best = cps[i]
        elif cps and self.store.base:
            best = cps[0]  # live mode after trimming: the oldest state still known
        for ei, _ts, state in self.keyframes:
            if best[0] < ei <= seq + 1 and state.get("v") is not None:
                best = (ei, state)
        return best

    def live_state_at(self, seq: int, gpu: int | None = None) -> LiveState:
        """A LiveState after the events up to and including ``seq`` (nearest checkpoint + gap);
        with ``gpu``, exact as far as that GPU goes only (:func:`memrec.engine.replay.advance_for_gpu`:
        the gap's processes that never touch it may be left out)."""
        with self.lock:
            covered, snap = self._best_checkpoint(seq)
            if snap is None and covered > 0:
                covered = 0
            if snap is None and self._kf_points and self.keyframes and self.keyframes[0][0] == 0:
                snap = self.keyframes[0][2]
            pieces = self.store.pieces(covered, seq + 1) if seq + 1 > covered else []
        if isinstance(snap, bytes):
            snap = marshal.loads(snap)
        s = LiveState.from_snapshot(snap) if snap is not None else LiveState()
        # chunk by chunk, outside the lock, as columns (no 130-byte rows built: the first frame waits)
        if gpu is None:
            return advance(s, covered, (self.store.batch([piece]) for piece in pieces))
        return advance_for_gpu(s, covered, lambda: (self.store.batch([piece]) for piece in pieces), gpu)

    def state_at(self, seq: int, gpu: int, ts: int | None = None, n_largest: int = 50,
                 tensors: bool = True) -> CursorState:
        """Who holds what on ``gpu`` after event ``seq`` (see :class:`CursorState`). ``tensors=False``:
        without the tensor blocks (:meth:`tensors_at`, which may replay them from the first event)."""
        ts = self.store.ts_of(seq) if ts is None else ts
        s = self.live_state_at(seq, gpu)
        tot = s.totals().get(gpu, {})
        by_cat: dict[str, int] = {}
        procs = []
        for pid, cats in tot.items():
            for c, b in cats.items():
                by_cat[c] = by_cat.get(c, 0) + b
            owned = sum(b for c, b in cats.items() if c != "ipc_mapped")
            procs.append((pid, self.pid_label(pid), dict(cats), owned))
        procs.sort(key=lambda r: (-r[3], -sum(r[2].values()), r[0]))
        pix = self.phase_index()
        by_phase = [(r.phase, r.bytes, r.count) for r in held_by_phase(s, gpu, pix.phases)]
        largest = [
            LiveAlloc(
                h.pid,
                self.pid_label(h.pid),
                h.category,
                h.size,
                h.address,
                h.ts,
                max(ts - h.ts, 0),
                pix.phase_of(h.pid, h.ts),
                API_NAMES.get(h.api, str(h.api)),
            )
            for h in s.largest(gpu, n_largest, mapped=True)
        ]
        nv = self.nvml.get(gpu)
        contexts, untraced = self.untraced_at(gpu, ts)
        return CursorState(gpu, seq, ts, by_cat, procs, by_phase, largest, nv.at(ts) if nv else None,
                           contexts=contexts, untraced_split=untraced, untraced_note=self.untraced_note,
                           tensors=self.tensors_at(seq, gpu) if tensors else [])

    def stack_view(self, seq: int) -> StackView | None:
        """The stack of event ``seq`` (None: no such event), with the frame the report names its
        site (:func:`memrec.analysis.report.sites.user_frame`). A free's is the allocation it
        frees (:meth:`allocation_freed`): the stack that took the memory it gives back."""
        with self.lock:
            if not self.store.base <= seq < self.store.n:
                return None
            row = self.store.slice(seq, seq + 1)[0]
            stack = self.stacks.stack(int(row["stack"]))
        pair = ALLOCATION_OF.get(int(row["kind"]))
        if pair is not None:
            made = self.allocation_freed(seq, int(row["pid"]), *pair, int(row[pair[1]]))
            if made is not None:
                return dataclasses.replace(self.stack_view(made), free_seq=seq)  # type: ignore[arg-type]
        site = None if stack is None or isinstance(stack, Unavailable) else user_frame(stack)
        return StackView(seq, KIND_NAMES.get(int(row["kind"]), str(int(row["kind"]))), int(row["size"]), int(row["pid"]),
                         int(row["ts"]), stack, site, free_unmatched=pair is not None)

    #: Events read at a time while looking back for a free's allocation.
    _LOOK_BACK = 1 << 16

    def allocation_freed(self, seq: int, pid: int, kind: int, key: str, value: int) -> int | None:
        """The event that made what the free ``seq`` frees: the last ``kind`` event of ``pid``
        before it whose ``key`` column (the pointer, or the VMM handle) is ``value``; None when
        the events hold none (made before the recording, or before those a live view keeps).
        Read back a window of columns at a time: the weights freed at exit were allocated millions
        of events earlier."""
        hi = seq
        while True:
            with self.lock:
                lo = max(hi - self._LOOK_BACK, self.store.base)
                if hi <= lo:
                    return None
                hit = np.flatnonzero((self.store.column("kind", lo, hi) == kind) & (self.store.column("pid", lo, hi) == pid)
                                     & (self.store.column(key, lo, hi) == value))
            if len(hit):
                return lo + int(hit[-1])
            hi = lo

    def allocation_seq(self, pid: int, address: int, ts: int) -> int | None:
        """The event that made a live allocation (the largest holders' rows: pid, address, ts)."""
        with self.lock:
            seq = self.store.seq_at(ts)
            lo = max(seq - 64, self.store.base)
            if seq < lo:
                return None
            rows = self.store.slice(lo, seq + 1)
        hit = np.flatnonzero((rows["pid"] == pid) & (rows["ptr"] == address) & (rows["ts"] == ts))
        return lo + int(hit[-1]) if len(hit) else None

    def tensors_at(self, seq: int, gpu: int) -> list[tuple[str, Fragmentation]]:
        """Per process with PyTorch tensor blocks on ``gpu`` after event ``seq``: allocated,
        reserved and fragmentation (a trace recorded with ``--tensors``; else empty)."""
        if not self.tensor_events:
            return []
        with self._blocks_lock:
            with self.lock:
                if self._blocks_seq > seq + 1 or self._blocks_seq < self.store.base:
                    self._blocks, self._blocks_seq = TensorBlocks(), self.store.base
                pieces = self.store.pieces(self._blocks_seq, seq + 1)
            if pieces:
                self._blocks.apply(self.store.batch(pieces))
                self._blocks_seq = seq + 1
            blocks = self._blocks
            return [(self.pid_label(pid), blocks.fragmentation(pid, g)) for pid, g in sorted(blocks.totals) if g == gpu]

    def untraced_at(self, gpu: int, ts: int) -> tuple[list, list]:
        """The contexts bound on ``gpu`` up to ``ts`` with their cost, and each process's untraced
        split at its last NVML sample up to ``ts`` (empty until :attr:`reconciliation` is set)."""
        rec = self.reconciliation
        if rec is None:
            return [], []
        contexts = [(self.pid_label(c.pid), c.api, c.ts, c.cost, c.foreign)
                    for c in rec.contexts if c.gpu == gpu and c.ts <= ts]
        untraced = []
        for (g, pid), split in sorted(rec.splits.items()):
            if g != gpu:
                continue
            i = int(np.searchsorted(split.ts, ts, side="right")) - 1
            if i >= 0:
                untraced.append((self.pid_label(pid), split.at(i)))
        return contexts, untraced

    def nvml_at(self, gpu: int, ts: int) -> dict[str, int] | None:
        nv = self.nvml.get(gpu)
        return nv.at(ts) if nv else None

    def series_at(self, gpu: int, ts: int) -> np.ndarray | None:
        """Bytes per category on ``gpu`` at ``ts`` from the series (None beyond the replay)."""
        with self.lock:
            if ts >= self.frontier_ts():
                return None
            s = self.series.get(gpu)
            if s is None or not len(s):
                return np.zeros(NCAT, np.int64)
            v = s.at_time(ts)
            return v if v is not None else np.zeros(NCAT, np.int64)

    # ------------------------------------------------------------------ events around the cursor

    def events_window(
        self, seq: int, flt: EventFilter, gpu: int | None = None, before: int = 100, after: int = 100, max_scan: int = 2_000_000
    ) -> EventRows:
        """Up to ``before`` matching events at or before ``seq`` and ``after`` after it."""
        with self.lock:
            base, n = self.store.base, self.store.n
            seq = min(max(seq, base - 1), n - 1)
            pix = self.phase_index() if flt.phase or flt.text else None
            back: list[np.ndarray] = []
            back_seq: list[np.ndarray] = []
            got = 0
            hi = seq + 1
            scanned = 0
            step = 4096
            while got < before and hi > base and scanned < max_scan:
                lo = max(base, hi - step)
                rows = self._resolve_gpu(self.store.slice(lo, hi), lo)
                m = self._match(rows, flt, gpu, pix)
                idx = np.flatnonzero(m)
                back.append(rows[idx])
                back_seq.append(idx + lo)
                got += len(idx)
                scanned += hi - lo
                hi = lo
                step = min(step * 2, 1 << 18)
            fwd: list[np.ndarray] = []
            fwd_seq: list[np.ndarray] = []
            got_f = 0
            lo = seq + 1
            step = 4096
            scanned_f = 0
            while got_f < after and lo < n and scanned_f < max_scan:
                hi = min(n, lo + step)
                rows = self._resolve_gpu(self.store.slice(lo, hi), lo)
                m = self._match(rows, flt, gpu, pix)
                idx = np.flatnonzero(m)
                fwd.append(rows[idx])
                fwd_seq.append(idx + lo)
                got_f += len(idx)
                scanned_f += hi - lo
                lo = hi
                step = min(step * 2, 1 << 18)
        b_rows = np.concatenate(back[::-1]) if back else np.zeros(0, EVENT_DTYPE)
        b_seq = np.concatenate(back_seq[::-1]) if back_seq else np.zeros(0, np.int64)
        b_rows, b_seq = b_rows[-before:] if before else b_rows[:0], b_seq[-before:] if before else b_seq[:0]
        f_rows = np.concatenate(fwd)[:after] if fwd else np.zeros(0, EVENT_DTYPE)
        f_seq = np.concatenate(fwd_seq)[:after] if fwd_seq else np.zeros(0, np.int64)
        rows = np.concatenate([b_rows, f_rows])
        seqs = np.concatenate([b_seq, f_seq]).astype(np.int64)
        pix = self.phase_index()
        phases = pix.phases_of(rows["pid"], rows["ts"])
        return EventRows(rows, seqs, phases, len(b_rows) - 1, scanned < max_scan and scanned_f < max_scan)

    def _resolve_gpu(self, rows: np.ndarray, lo: int) -> np.ndarray:
        """``rows`` (events from seq ``lo``) with the GPU the replay resolved (frees, unmaps...)."""
        res = self._gpu_res
        start = lo - self._gpu_res_base
        n = min(len(rows), max(res.n - start, 0))
        if n <= 0 or not (rows["gpu"][:n] < 0).any():
            return rows
        if not rows.flags.writeable:
            rows = rows.copy()
        rows["gpu"][:n] = res.a[start : start + n]
        return rows

    def _match(self, rows: np.ndarray, flt: EventFilter, gpu: int | None, pix: PhaseIndex | None) -> np.ndarray:
        return event_mask(rows, flt, gpu, self._gpu_pids.get(gpu, ()), pix.phases_of if pix is not None else None,
                          self._pids_named)

    def _pids_named(self, text: str) -> list[int]:
        """Processes whose rank label or command line contains ``text`` (lower case)."""
        return [p for p in self.processes if text in self.pid_label(p).lower() or text in self.pid_command(p).lower()]


__all__ = [
    "CursorState",
    "LiveAlloc",
    "PhaseSpan",
    "SeriesView",
    "TraceModel",
    "diff_rows",
    "phase_spans",
]
