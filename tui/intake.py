"""The TUI model's intake: what a trace says, as it arrives (a file read in chunks, or a live stream).

:class:`TraceIntake` is the record sink (:class:`memrec.trace.records.RecordSink`) the file scan and
the live stream both feed: events go to the :class:`~memrec.tui.store.EventStore` and the
landmarks, NVML samples to one :class:`NvmlSeries` per GPU, markers, processes and keyframes to
lists. It holds every field of the model, the replay's included, so that the replay
(:mod:`memrec.tui.replay`) and the cursor's queries (:mod:`memrec.tui.model`) build on one state;
it replays nothing itself.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from typing import Any

import numpy as np

from memrec.base.errors import TraceFormatError
from memrec.base.untrusted import clean_marker
from memrec.base.untrusted import clean_text
from memrec.terms.columns import NVML_DTYPE
from memrec.terms.events import CATEGORIES
from memrec.terms.events import GpuInfo
from memrec.terms.events import TENSOR_KINDS
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.engine.series import CategorySeries
from memrec.engine.series import Grow
from memrec.state import LiveState
from memrec.trace.chunks import DEFAULT_SCHEMA
from memrec.trace.format import gpus_from_header
from memrec.trace.format import parse_schema
from memrec.trace.model import GpuIds
from memrec.trace.stacks import StackTable
from memrec.subscriber import StreamStacks
from memrec.tui.navigation import Landmarks
from memrec.tui.store import EventStore
from memrec.tui.views import NCAT
from memrec.tui.views import PhaseIndex


def _marker_ts(marker: Marker) -> int:
    return marker.ts


#: How many of the latest markers :meth:`TraceIntake.add_marker` searches first for an early one.
_NEAR_END = 16


# ----------------------------------------------------------------------------------------------
# NVML samples


class NvmlSeries:
    def __init__(self) -> None:
        self.ts = Grow(np.uint64)
        self.used = Grow(np.int64)
        self.reserved = Grow(np.int64)
        self.total = Grow(np.int64)
        self.bar1_used = Grow(np.int64)
        self.bar1_total = Grow(np.int64)

    def append(self, s: np.ndarray) -> None:
        self.ts.extend(s["ts"])
        self.used.extend(s["used"])
        self.reserved.extend(s["reserved"])
        self.total.extend(s["total"])
        self.bar1_used.extend(s["bar1_used"])
        self.bar1_total.extend(s["bar1_total"])

    def samples(self, gpu: int) -> np.ndarray:
        """The samples as NVML_DTYPE rows of ``gpu`` (``free`` is not kept: -1)."""
        out = np.zeros(self.ts.n, NVML_DTYPE)
        out["gpu"], out["free"] = gpu, -1
        for name in ("ts", "used", "reserved", "total", "bar1_used", "bar1_total"):
            out[name] = getattr(self, name).a
        return out

    def at(self, ts: int) -> dict[str, int] | None:
        i = int(np.searchsorted(self.ts.a, np.uint64(max(ts, 0)), side="right")) - 1
        if i < 0:
            return None
        return {
            "ts": int(self.ts.a[i]),
            "used": int(self.used.a[i]),
            "reserved": int(self.reserved.a[i]),
            "total": int(self.total.a[i]),
            "bar1_used": int(self.bar1_used.a[i]),
            "bar1_total": int(self.bar1_total.a[i]),
        }


class TraceIntake:
    """What a trace says, as its records arrive (see the module docstring); :class:`TraceModel
    <memrec.tui.model.TraceModel>` adds the replay and the queries.

    Args:
        checkpoint_every: events between two snapshots the replay keeps (bounds a cursor move's
            replay); 0 keeps none.
        max_events: live mode: events (and series points) kept; older ones are dropped.
    """

    def __init__(self, checkpoint_every: int = 32768, max_events: int | None = None) -> None:
        self.lock = threading.RLock()
        self.header: dict = {}
        self.gpus: dict[int, GpuInfo] = {}
        self._gpu_ids = GpuIds()  # every GPU named so far (header, events, samples, keyframes)
        self.store = EventStore()
        self.nvml: dict[int, NvmlSeries] = {}
        self.markers: list[Marker] = []
        self._rank_cache: tuple[int, dict[int, str]] | None = None
        self.processes: dict[int, ProcessInfo] = {}
        self.keyframes: list[tuple[int, int, dict]] = []  # (event_index, ts, state)
        self.lost = 0
        self.stacks = StackTable()  # what the events' stack ids name (format 2.3)
        #: live: the stream's stacks, numbered across its files (a file's are its own: :attr:`stacks`)
        self._stream_stacks = StreamStacks()
        self.warnings: list[str] = []
        self.trailer: dict | None = None
        self.checkpoint_every = checkpoint_every
        self.max_events = max_events
        self.series: dict[int, CategorySeries] = {}
        # (seq, snapshot) taken by the replay, the snapshot marshalled: one bytes object instead of
        # flat lists of ~10^4 ints each, which every full GC pass would walk (300 checkpoints of a
        # 10M-event trace made each gen-2 collection ~110 ms, stalling whichever thread ran it)
        self._checkpoints: list[tuple[int, bytes]] = []
        self._live = LiveState(journal=True)
        self._since_checkpoint = 0
        self.frontier = 0  # events replayed (seq of the next to replay)
        self._kf_points: list[tuple[int, dict[int, np.ndarray]]] = []  # (ts, gpu -> bytes per cat)
        self.landmarks = Landmarks()  # failed calls and big allocations (the jumps' targets)
        #: PyTorch tensor-block events seen (``--tensors``): without any, the state at the cursor
        #: skips the blocks' replay, which reads every driver allocation from the first event
        #: (a seek ahead on a 2M-event trace of 1M live allocations: 16 of its 18 s).
        self.tensor_events = 0
        self._phase_cache: tuple[int, PhaseIndex] | None = None
        self.t_end_hint: int | None = None  # trailer's end_ts
        self._gpu_pids: dict[int, set[int]] = {}  # pids that ever held memory on a GPU
        self._pairs_seen = np.zeros(0, np.int64)  # the same, as gpu << 32 + pid, sorted
        self._gpu_res = Grow(np.int16)  # per replayed event: its GPU as the replay resolved it
        self._gpu_res_base = 0  # seq of _gpu_res[0]
        #: The untraced band split (memrec.analysis.untraced.reconcile.Reconciliation): a file source sets
        #: it once the replay is done (the same engine as ``memrec report``); None until then.
        self.reconciliation: Any = None
        self.untraced_note = "computed once the trace is replayed"
        self._schema = DEFAULT_SCHEMA  # a live stream's column schema (its header's)
        self._live_stream = False
        #: A file's per-process NVML samples: not drawn, kept for the untraced split.
        self.procmem: list[np.ndarray] = []
        #: The replay's journal rows, chunk by chunk, when kept for the untraced split
        #: (:meth:`memrec.tui.replay.ReplayedTrace.keep_journal`); None when not.
        self._journal: list[np.ndarray] | None = None
        self._initial: dict | None = None  # the state the replay started from, as counters
        self._skipped = 0  # malformed records a stream sent
        self._skipped_at = 0  # where the warning that counts them is

    # ------------------------------------------------------------------ ingest

    def set_header(self, header: dict) -> None:
        with self.lock:
            self.header = header
            self._gpu_ids.add_header(header)
            for info in gpus_from_header(header):
                self.gpus[info.index] = info

    def add_events(self, chunk: Any) -> None:
        """Add an events chunk (EVENT_DTYPE array or a column chunk) in trace order."""
        with self.lock:
            start = self.store.append(chunk)
            n = self.store.n - start
            if not n:
                return
            cols = (lambda name: chunk[name]) if isinstance(chunk, np.ndarray) else chunk.column
            self._gpu_ids.add_column(cols("gpu"))
            self.landmarks.add(cols, start)
            self.tensor_events += int(np.count_nonzero(np.isin(cols("kind"), TENSOR_KINDS)))

    def add_nvml(self, samples: np.ndarray) -> None:
        with self.lock:
            self._gpu_ids.add_column(samples["gpu"])
            for g in np.unique(samples["gpu"]).tolist():
                self.nvml.setdefault(int(g), NvmlSeries()).append(samples[samples["gpu"] == g])

    def add_marker(self, marker: Marker) -> None:
        marker = clean_marker(marker)  # a client's text must not drive the terminal
        with self.lock:
            markers = self.markers
            if not markers or marker.ts >= markers[-1].ts:  # a file's come in time order: no search
                markers.append(marker)
            else:  # a search by key, not a list of every marker's ts per marker (50,000 markers: minutes);
                # among the last few first (an end written after the begins that follow it)
                lo = max(len(markers) - _NEAR_END, 0)
                if markers[lo].ts > marker.ts:
                    lo = 0
                markers.insert(bisect.bisect_right(markers, marker.ts, lo, key=_marker_ts), marker)

    def add_process(self, process: ProcessInfo) -> None:
        process = dataclasses.replace(process, cmdline=[clean_text(a) for a in process.cmdline],
                                      exe=None if process.exe is None else clean_text(process.exe))
        with self.lock:
            self.processes[process.pid] = process

    def add_keyframe(self, event_index: int, ts: int, state: dict) -> None:
        """A keyframe of the trace: a checkpoint for :meth:`state_at`, and a coarse series point."""
        with self.lock:
            try:
                s = LiveState.from_snapshot(state)
            except ValueError as error:  # never kept: the cursor must not restore from it later
                self.warnings.append(f"keyframe at ts {ts} not usable: {error}")
                return
            self.keyframes.append((event_index, ts, state))
            if self.max_events and len(self.keyframes) > 64:
                del self.keyframes[:-64]
                del self._kf_points[:-64]
            totals = _totals_by_gpu(s)
            self._kf_points.append((ts, totals))
            # every GPU that held memory since the state began, not only those holding some now: a
            # live subscription to a daemon without NVML (no GPU list in its header) after its
            # workloads freed everything otherwise names no GPU, and the view stays blank
            named = {g: totals.get(g, np.zeros(NCAT, np.int64)) for g in s.peaks() if g >= 0} | totals
            if event_index == 0 and self.frontier == 0 and not self._checkpoints and self.store.n == 0:
                # the trace starts with a state (a rotated file, or a live subscription)
                s.n_events = 0
                s.journal = self._live.journal
                self._live = s
                for g, values in sorted(named.items()):
                    self._gpu_ids.add(g)
                    self.series.setdefault(g, CategorySeries()).set_initial(values, -1, ts)
            else:
                for g in named:
                    self._gpu_ids.add(g)

    def set_lost(self, total: int) -> None:
        self.lost = max(self.lost, int(total))

    # RecordSink (memrec.trace.records): the one dispatch that file scans and the live stream use

    def on_header(self, header: dict) -> None:
        if self._live_stream:  # a rotation's new file, or a resync: the stack ids that follow are its
            self._stream_stacks.new_file()
        self.set_header(header)
        try:
            self._schema = parse_schema(header)
        except TraceFormatError as error:
            self.warnings.append(f"stream header: {error}")

    def on_events(self, chunk: Any) -> None:
        stack = chunk.columns.get("stack") if self._live_stream and not isinstance(chunk, np.ndarray) else None
        if stack is not None:  # the file's stack ids as the stream's
            chunk = dataclasses.replace(chunk, columns={**chunk.columns, "stack": self._stream_stacks.ids(stack)})
        self.add_events(chunk)

    def on_nvml(self, chunk: Any) -> None:
        self.add_nvml(chunk.to_array())

    def on_procmem(self, chunk: Any) -> None:
        """Per-process samples are not drawn; a file's are kept for the untraced split."""
        if not self._live_stream:
            self.procmem.append(chunk.to_array())

    def on_marker(self, marker: Marker) -> None:
        self.add_marker(marker)

    def on_process(self, process: ProcessInfo) -> None:
        self.add_process(process)

    def on_keyframe(self, keyframe: Any) -> None:
        # a live stream's keyframes index the daemon's file: for the stream they hold at the
        # events received so far
        self.add_keyframe(self.store.n if self._live_stream else keyframe.event_index, keyframe.ts, keyframe.state)

    def on_lost(self, total: int) -> None:
        self.set_lost(total)

    def on_stacks(self, defs: Any) -> None:
        with self.lock:
            try:
                if self._live_stream:
                    self._stream_stacks.add(defs)
                    self.stacks = self._stream_stacks.table
                else:
                    self.stacks.add(defs)
            except TraceFormatError as error:
                self.warnings.append(f"stacks record skipped: {error}")

    def on_trailer(self, trailer: dict) -> None:
        self.trailer = trailer
        if isinstance(trailer.get("end_ts"), int):
            self.t_end_hint = trailer["end_ts"]
        if isinstance(trailer.get("lost"), int):
            self.set_lost(trailer["lost"])

    def add_record(self, rec: dict, live: bool = False) -> None:
        """Add one record as a live stream delivers it (wire form: ``FrameDecoder(decode=False)``).

        It is checked exactly as a file's records are (:func:`memrec.trace.records.check_record`);
        a malformed one is skipped and counted in ``warnings``, never raised into the app.
        ``live``: the record comes from a daemon's stream (see :meth:`on_keyframe`).
        """
        from memrec.trace.records import check_record
        from memrec.trace.records import deliver

        try:
            kind, item = check_record(rec, self._schema)
        except TraceFormatError as error:
            self._skipped += 1
            message = f"skipped {self._skipped} malformed record(s) from the stream; last: {error}"
            if self._skipped == 1:
                self._skipped_at = len(self.warnings)
                self.warnings.append(message)
            else:  # one line, kept up to date
                self.warnings[self._skipped_at] = message
            return
        self._live_stream = live
        deliver(kind, item, self)


def _totals_by_gpu(s: LiveState) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for g, pids in s.totals().items():
        v = out.setdefault(g, np.zeros(NCAT, np.int64))
        for cats in pids.values():
            for c, b in cats.items():
                v[CATEGORIES.index(c)] += b
    return out
