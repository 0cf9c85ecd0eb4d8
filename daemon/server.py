"""The memrec daemon: one event loop from the probes to the trace and the live subscribers.

::

    d = Daemon(config)
    d.start()            # bind the socket, load the probes, attach every libcuda, open the trace
    d.track_pid(pid)     # record mode only: follow this process tree
    d.run(until=...)     # the loop; returns on SIGTERM/SIGINT or when until() is true
    d.stop()             # phased shutdown (idempotent)

One ``selectors`` loop serves the marker socket (markers, pings, subscribers), the ring buffer's
fd (the program's wakeups) and a self-pipe that signals write to; timers drain the ring buffer
(``poll_interval``), flush the writer (``flush_interval``), write keyframes (``keyframe_interval``)
and look for newly mapped libcuda files (``rescan_interval``). This module holds the loop and the
order of things; its neighbours each own one concern: ``feed`` (the probes), ``gpustamp`` (each
event's physical GPU), ``intake`` (markers and NVML samples), ``nvmlsetup``, ``tracefiles``,
``signals`` (handlers only queue; :meth:`Daemon.handle_signal` acts from the loop), ``timers``.

Shutdown is phased (:meth:`Daemon._teardown`): the trace is complete, and the socket gone,
before the probes' slow detach starts.

At about 600 lines this is the one module past the ~500 mark on purpose: what is left is the
loop and the order of start, rotation and shutdown, which are read and changed together.
"""
from __future__ import annotations

import enum
import errno
import logging
import os
import selectors
import signal
import socket
import time
from pathlib import Path
from typing import Any
from typing import Callable

import numpy as np

from memrec.base.files import open_folder
from memrec.base.version import __version__
from memrec.base.errors import OutputError
from memrec.terms.columns import with_gpu
from memrec.daemon import retention
from memrec.daemon.config import DaemonConfig
from memrec.daemon.fanout import Fanout
from memrec.daemon.feed import ProbeFeed
from memrec.daemon.gpustamp import GpuStamper
from memrec.daemon.heap import QuietTrim
from memrec.daemon.heap import give_back
from memrec.daemon.heap import settle
from memrec.daemon.intake import Intake
from memrec.daemon.keyframes import HoldingSink
from memrec.daemon.keyframes import Keyframes
from memrec.daemon.libraries import Libraries
from memrec.daemon.libraries import TorchLibraries
from memrec.state.tensors import TensorBlocks
from memrec.daemon.markers import MarkerServer
from memrec.daemon.markers import root_only
from memrec.daemon.markers import root_or_group
from memrec.daemon.nvmlsetup import default_nvml
from memrec.daemon.nvmlsetup import list_gpus
from memrec.daemon.nvmlsetup import start_sampler
from memrec.daemon.scheduling import Priority
from memrec.daemon.signals import SignalInbox
from memrec.daemon.sockets import BoundSocket
from memrec.daemon.sockets import bind_unix_socket
from memrec.daemon.sockets import group_id
from memrec.daemon.stacks import StackRecorder
from memrec.daemon.timers import AddOnTimers
from memrec.daemon.timers import advance
from memrec.daemon.tracefiles import DiskWatch
from memrec.daemon.tracefiles import Rotation
from memrec.daemon.tracefiles import TraceNames
from memrec.daemon.tracefiles import create_sink
from memrec.daemon.tracefiles import resolve_folder
from memrec.daemon.untraced import UntracedReadings
from memrec.daemon.untraced import name_images
from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.state import LiveState
from memrec.trace.format import encode_record
from memrec.trace.format import keyframe_record
from memrec.trace.format import lost_record
from memrec.trace.format import make_header
from memrec.trace.format import process_record
from memrec.trace.writer import FileSink
from memrec.trace.writer import TraceWriter

log = logging.getLogger(__name__)

#: The most ring-buffer polls of the final drain.
_FINAL_DRAIN_POLLS = 64
#: How often idle and half-sent marker connections, and gone marker clients, are looked for (ns).
_SWEEP_NS = 10**9
#: Budget bytes a new marker client's process entry costs its uid (its record: a capped command
#: line, memrec.probes.procinfo.MAX_CMDLINE_BYTES, and the rest).
PROCESS_COST = 4096 + 512
_CTX = int(Kind.CTX)


class Mood(enum.Enum):
    """The daemon's state (supervisor's "mood")."""

    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Daemon:
    """The recorder: probes → GPU stamping → live state → trace file and live subscribers.

    Args:
        config: what to record where.
        probes_factory: builds the probes (``CudaProbes(follow_tree=, ringbuf_pages=)``).
        nvml: provides ``list_gpus()`` and ``NvmlSampler`` (default :mod:`memrec.probes.nvml`);
            None for the default.
        clock: CLOCK_MONOTONIC ns, the probes' clock (timers and record timestamps).
        find_libraries: ``(extra_paths) -> [LibraryFile(path, dev, inode)]``.
        find_torch: the same for ``libc10_cuda.so`` files (with ``config.tensors``).
        process_info: ``(pid, gpus, first_ts) -> ProcessInfo`` (reads /proc).
        stop_signal_handler: record mode: SIGINT/SIGTERM are passed to it (from the loop, not
            the signal handler) instead of stopping the daemon; the third signal of one kind
            stops the daemon anyway.
        install_signals: install the signal handlers in :meth:`start` (only from the main thread).
    """

    def __init__(
        self,
        config: DaemonConfig,
        probes_factory: Callable[..., Any] | None = None,
        nvml: Any = None,
        clock: Callable[[], int] = time.monotonic_ns,
        *,
        find_libraries: Callable[[tuple[str, ...]], list] | None = None,
        find_torch: Callable[[tuple[str, ...]], list] | None = None,
        process_info: Callable[[int, list[GpuInfo], int], ProcessInfo] | None = None,
        stop_signal_handler: Callable[[int], None] | None = None,
        install_signals: bool = True,
    ) -> None:
        self.config = config
        self.feed = ProbeFeed(probes_factory, config)
        self._nvml = nvml
        self.clock = clock
        self.libraries = Libraries(find_libraries, config.libcuda_paths)
        #: PyTorch installs tried for tensor blocks (None: ``config.tensors`` is off).
        self.torch = TorchLibraries(find_torch, config.torch_paths, config.tensor_pids) if config.tensors else None
        #: With --stacks: the interpreters located and the stacks resolved (made once the probes load).
        self.stacks: StackRecorder | None = None
        #: The live tensor blocks, kept only for the metrics (set by them, with ``config.tensors``):
        #: a Python step per tensor event, which a daemon without metrics does not pay.
        self.blocks: TensorBlocks | None = None
        self.stamper = GpuStamper(self._nvml_module, process_info, self._write_process)
        self.stop_signal_handler = stop_signal_handler
        self._install_signals = install_signals

        self.mood = Mood.CREATED
        self.stop_reason: str | None = None
        self.gpus: list[GpuInfo] = []
        self.notes: list[str] = []
        self.state = LiveState()
        self.keyframes = Keyframes()
        self.files: list[Path] = []  # every trace file written, in order
        self.writer: TraceWriter | None = None
        self.selector: selectors.BaseSelector | None = None
        self.bound: BoundSocket | None = None
        self.markers: MarkerServer | None = None
        self.fanout: Fanout | None = None
        self.sampler: Any = None
        self.readings: UntracedReadings | None = None
        self.priority = Priority(config.scheduling)

        self.signals = SignalInbox()
        self.intake = Intake(clock)
        self._part = 0
        self._skipped = 0  # next part numbers found taken (a planted link): skipped
        self.rotation = Rotation(config.rotate_bytes)
        self.events_recorded = 0
        self.markers_recorded = 0
        self._quiet_trim = QuietTrim()
        self._next: dict[str, int] = {}
        self.disk = DiskWatch(clock)
        self._timers = AddOnTimers()
        #: Called from the loop with each marker as it arrives (device ordinal as the client sent it).
        self.marker_listeners: list[Callable[[Marker], None]] = []
        #: Called on the NVML sampler's thread with each batch of device rows (NVML_DTYPE).
        self.sample_listeners: list[Callable[[np.ndarray], None]] = []
        #: Called from the loop with each trace file once it is closed (rotation, stop): must return at once.
        self.closed_listeners: list[Callable[[Path], None]] = []

    # ================================================================== lifecycle

    def start(self) -> None:
        """Bind the socket, load the probes, attach libcuda, open the trace, start NVML.

        Raises:
            SocketError: the socket is in use or cannot be created.
            ProbeLoadError: the BPF program cannot be loaded.
            OutputError: the trace cannot be written.
        """
        if self.mood is not Mood.CREATED:
            raise RuntimeError(f"Daemon.start() called in mood {self.mood.value}")
        cfg = self.config
        if cfg.output_is_dir and cfg.output.is_symlink():
            cfg = self.config = cfg.replace(output=resolve_folder(cfg.output), output_is_dir=True)
        self.names = TraceNames(cfg)
        self.selector = selectors.DefaultSelector()
        settle()  # large buffers as maps of their own: freed, they go back to the system
        try:
            if self._install_signals:  # a stop while starting unwinds the start (below)
                self.signals.raise_until_installed()
            # Before the compile (a start on a busy host is quicker) and before any thread starts.
            log.info("scheduling: %s", self.priority.apply())
            # The socket first: a second daemon fails here, before the slow BPF compile.
            self.bound = bind_unix_socket(cfg.socket_path, cfg.socket_mode, cfg.socket_group)
            self.feed.load()
            if cfg.stacks:
                self.stacks = StackRecorder(self.probes, cfg.stack_depth)
            for path in cfg.libcuda_paths:
                if not os.path.exists(path):
                    log.warning("--libcuda %s: no such file", path)
            self.scan_libraries()
            if self.torch is not None and not self.torch.tried:
                log.info("--tensors: no libc10_cuda.so mapped yet: PyTorch's allocator probes attach when a "
                         "process maps one (at its first context, or the next rescan)")
            if not self.libraries.attached:
                log.warning(
                    "no libcuda.so.1 found yet: probes will attach when a process maps one "
                    "(rescan every %g s); name one with --libcuda PATH", cfg.rescan_interval
                )
            self.gpus = self.stamper.gpus = list_gpus(self._nvml_module(), self.notes)
            self.fanout = Fanout(self.selector, cfg.subscriber_queue_bytes)
            self.markers = MarkerServer(
                self.bound.sock, self.selector, self._on_marker, self._on_subscribe, on_connect=self._on_connect,
                may_subscribe=root_only if cfg.live_group is None else root_or_group(group_id(cfg.live_group)),
                on_drop=self.intake.drop,
            )
            self._open_writer(self.names.path(0), reason="start")
            self.sampler = start_sampler(self._nvml_module(), cfg, self._nvml_sink, self.clock, self.notes)
            self.readings = UntracedReadings(
                self._nvml_module(), [g.index for g in self.gpus], self._write_readings, self.clock
            )
            self.feed.watch(self.selector, self.drain)
            if self._install_signals:
                self.signals.install(self.selector, self.queue_signal)
            self.markers.start()
        except BaseException:
            self._teardown(failed=True)
            raise
        now = self.clock()
        self._next = {
            "poll": now,
            "flush": now + int(cfg.flush_interval * 1e9),
            "keyframe": now + int(cfg.keyframe_interval * 1e9),
            "rescan": now + int(cfg.rescan_interval * 1e9),
            "sweep": now + _SWEEP_NS,
        }
        self.mood = Mood.RUNNING
        log.info(
            "recording to %s; markers on %s; %d GPU(s); %d libcuda file(s) probed; probe program %s",
            self.files[-1], cfg.socket_path, len(self.gpus), len(self.libraries.attached), self.feed.origin(),
        )

    @property
    def probes(self) -> Any:
        """The probes (CudaProbes or a stand-in); an add-on may wrap them (the metrics' meter)."""
        return self.feed.probes

    @probes.setter
    def probes(self, probes: Any) -> None:
        self.feed.probes = probes

    def track_pid(self, pid: int) -> None:
        """Record mode: follow ``pid`` and its descendants (the probes filter in the kernel)."""
        self.probes.track_pid(pid)

    def run(self, until: Callable[[], bool] | None = None) -> str:
        """Serve until a stop signal (or ``until()`` returns true); return why it returned.

        The daemon keeps running after ``run`` returns because of ``until``: call :meth:`stop`.
        """
        if self.mood is Mood.STOPPING:  # a stop signal came before the loop ran
            return self.stop_reason or "stopped"
        if self.mood is not Mood.RUNNING:
            raise RuntimeError(f"Daemon.run() called in mood {self.mood.value}")
        assert self.selector is not None
        poll_ns = int(self.config.poll_interval * 1e9)
        while True:
            self.handle_signal()
            if self.mood is not Mood.RUNNING:
                return self.stop_reason or "stopped"
            if until is not None and until():
                return "until"
            now = self.clock()
            due = min(self._next.values(), default=now)
            addon = self._timers.due()
            if addon is not None:
                due = min(due, addon)
            timeout = min(max(0, due - now), poll_ns) / 1e9
            for key, mask in self.selector.select(timeout):
                key.data(mask)
            self.tick(self.clock())

    def stop(self, reason: str | None = None) -> None:
        """Phased shutdown; safe to call more than once and after a failed :meth:`start`.

        ``reason`` goes into the trailer (default: the stop signal, else "stop").
        """
        if self.mood in (Mood.STOPPED, Mood.CREATED):
            return
        if reason and not self.stop_reason:
            self.stop_reason = reason
        self.mood = Mood.STOPPING
        reason = self.stop_reason or "stop"
        log.info("shutting down (%s)", reason)
        self._teardown(failed=False)

    def _teardown(self, failed: bool) -> None:
        steps: list[tuple[str, Callable[[], None]]] = []
        if self.markers is not None:
            steps.append(("stop accepting", self.markers.stop_accepting))
            if not failed:
                steps.append(("read last markers", self._read_last_markers))
        if self.sampler is not None:
            steps.append(("stop NVML", self.sampler.stop))
        if self.probes is not None and not failed:
            steps.append(("final drain", self._final_drain))
        if self.writer is not None and not failed:
            steps.append(("write pending", self._write_pending))
        if self.probes is not None:
            steps.append(("stop reading probes", self.feed.stop_reading))
        if self.writer is not None:
            if failed:
                steps.append(("close trace", lambda: self.writer.abort()))
            else:
                steps.append(("final keyframe", self._write_keyframe))
                steps.append(("trailer", lambda: self.writer.close(self._trailer(self.stop_reason or "stop"))))
                steps.append(("say how it ended", lambda: self.disk.closed(self.writer, self.intake.dropped_total)))
                steps.append(("note its size", lambda: self._noted_closed(self.writer)))
                steps.append(("closed listeners", lambda: self._closed(self.writer.path)))
        if self.fanout is not None:
            steps.append(("subscribers", self.fanout.close))
        if self.markers is not None:
            steps.append(("marker clients", self.markers.close))
        if self.bound is not None:
            steps.append(("remove socket", self.bound.close))
        if self.probes is not None:
            # Last: detaching costs ~0.1 s per probe in the kernel; the trace is complete (trailer
            # written and fsynced) and the socket free before it starts.
            steps.append(("detach probes", self.feed.detach))
        steps.append(("signals", self.signals.restore))
        steps.append(("scheduling", self.priority.restore))
        if self.selector is not None:
            steps.append(("selector", self.selector.close))
        for name, step in steps:
            try:
                step()
            except Exception as error:
                log.error("shutdown step %r failed: %s", name, error)
        self.mood = Mood.STOPPED
        if not failed and self.files:
            log.info("wrote %s", ", ".join(map(str, self.files)))

    # ================================================================== signals

    def queue_signal(self, signum: int, _frame: Any = None) -> None:
        """The signal handler: queue ``signum`` (once) and nothing else."""
        self.signals.queue(signum)

    def handle_signal(self) -> None:
        """Act on the queued signals (called from the loop, never from a handler)."""
        while taken := self.signals.take(self.mood is Mood.RUNNING, self.stop_signal_handler is not None):
            action, signum = taken
            if action == "pass on":
                self.stop_signal_handler(signum)
            elif action == "stop":
                self.stop_reason = f"signal {signal.Signals(signum).name}"
                self.mood = Mood.STOPPING
            elif action == "rotate":
                self.rotate("SIGHUP")

    # ================================================================== loop work

    def tick(self, now: int) -> None:
        """Do the timed work due at ``now`` (the loop calls it after every select)."""
        nxt = self._next
        cfg = self.config
        if now >= nxt["poll"]:
            self.drain()
            nxt["poll"] = advance(nxt["poll"], int(cfg.poll_interval * 1e9), now)
        if self.intake:
            self._write_pending()
        if self.readings is not None:
            self.readings.tick(now)
        if self.keyframes.collect(self.writer):
            nxt["flush"] = now  # a keyframe is worth showing at once
            give_back()  # its build's buffers
        if now >= nxt["keyframe"]:
            assert self.writer is not None
            self.keyframes.start(self.writer, self.state, now)  # built in a thread, written by collect
            nxt["keyframe"] = advance(nxt["keyframe"], int(cfg.keyframe_interval * 1e9), now)
        if now >= nxt["flush"]:
            assert self.writer is not None
            self.writer.flush()
            self.disk.check(self.writer)
            nxt["flush"] = advance(nxt["flush"], int(cfg.flush_interval * 1e9), now)
        if now >= nxt["rescan"]:
            self.scan_libraries()
            nxt["rescan"] = advance(nxt["rescan"], int(cfg.rescan_interval * 1e9), now)
        if now >= nxt["sweep"]:
            self._sweep()
            nxt["sweep"] = advance(nxt["sweep"], _SWEEP_NS, now)
        if self.fanout is not None:
            self._serve_subscribers()
        if self.writer is not None and self.rotation.due(self.writer, self.keyframes.holding, now):
            self.rotate("size")
        self._timers.run(now)

    def every(self, seconds: float, fn: Callable[[int], None]) -> None:
        """Call ``fn(now)`` from the loop every ``seconds`` (the metrics' snapshot, systemd's watchdog).

        The loop's thread owns the live state, so this is where an add-on may read it.
        """
        self._timers.every(int(seconds * 1e9), self.clock(), fn)

    def drain(self) -> int:
        """Poll the ring buffer once, record what it held; return the number of events."""
        raw = self.feed.read()
        if raw is None:
            return 0
        if len(raw):
            self.record_events(raw)
        lost = self.feed.new_lost()
        if lost is not None:
            assert self.writer is not None
            self.writer.write_lost(self.clock(), lost)
        return len(raw)

    def record_events(self, raw: np.ndarray) -> np.ndarray:
        """Stamp GPUs on raw probe records, apply them to the live state, write them."""
        events = with_gpu(raw, -1)
        if len(events) > 1:
            events = events[np.argsort(events["ts"], kind="stable")]
        self.stamper.stamp(events)
        name_images(events)
        capacity = self.state.capacity()
        self.state.apply(events)
        if self.state.capacity() != capacity:  # a table grew or was compacted: its old columns are free
            give_back()
        if self.blocks is not None:
            self.blocks.apply(events)
        if self.torch is not None and np.any(events["kind"] == _CTX):
            # A process bound a context: its first tensors come next. A PyTorch install not
            # probed yet is looked for now rather than at the next rescan (seconds later).
            self.torch.scan(self.probes)
        assert self.writer is not None
        if self.stacks is not None:
            self.stacks.resolve(events, self.writer)
        self.writer.write_events(events)
        self.events_recorded += len(events)
        if self.readings is not None:
            self.readings.after_batch(events)
        self.stamper.forget_exited(events)
        return events

    # ------------------------------------------------------------------ markers and NVML

    def _on_connect(self, pid: int, uid: int) -> None:
        """Read a marker client's /proc now, while it surely runs (a shell's `memrec mark` is brief);
        a new entry costs its uid's marker budget (its record goes into the trace)."""
        self._client_process(pid, uid, self.clock())

    def _client_process(self, pid: int, uid: int, ts: int) -> None:
        if pid in self.stamper.processes or self.intake.admit(uid, PROCESS_COST):
            self.stamper.client(pid, ts)
        else:  # over budget: its markers are filed under the bare pid (counted in the trailer)
            self.intake.process_reads_refused += 1

    def _on_marker(self, marker: Marker) -> str | None:
        """Queue a marker (budgeted and its ts checked: :meth:`Intake.marker`) and read its process's
        /proc; return why it was dropped (None: taken)."""
        queued = self.intake.marker(marker)
        if queued is None:
            return self.intake.last_drop
        if queued.pid not in self.stamper.processes:  # named by `memrec mark` (its shell): read it now
            self._client_process(queued.pid, queued.uid, queued.ts)
        for listener in self.marker_listeners:
            listener(queued)
        return None

    def _sweep(self) -> None:
        """About once a second: close stale connections; forget gone marker clients and their phases;
        give the heap back once the host has gone quiet."""
        if self.markers is not None:
            self.markers.sweep()
        self.stamper.expire()
        self.intake.expire(lambda pid: self.stamper.start_time(pid) is not None)
        self._quiet_trim.sweep(self.events_recorded)

    def _nvml_sink(self, device_rows: np.ndarray, process_rows: np.ndarray) -> None:
        """Called on the sampler's thread: only queue (the loop writes)."""
        self.intake.sample(device_rows, process_rows)
        for listener in self.sample_listeners:
            listener(device_rows)

    def _write_pending(self) -> None:
        """Write queued markers (after the events that happened before them) and NVML samples."""
        writer = self.writer
        assert writer is not None
        if self.intake.markers:
            self.drain()  # events older than the markers go first
            for marker in self.intake.take_markers():
                if not self.disk.markers_allowed(writer):  # a nearly full disk is kept for events
                    self.intake.drop(marker, "disk")
                    continue
                writer.write_marker(self.stamper.marker(marker))
                self.markers_recorded += 1
        while self.intake.samples:
            device_rows, process_rows = self.intake.samples.popleft()
            if len(device_rows):
                writer.write_nvml(device_rows)
            if len(process_rows):
                writer.write_procmem(process_rows)

    def _write_process(self, info: ProcessInfo) -> None:
        """A new process, or a corrected GPU map: into the trace (the stamper calls this)."""
        if self.writer is not None and not self.writer.closed:
            self.writer.write_process(info)

    def _write_readings(self, rows: np.ndarray) -> None:
        """NVML readings around context binds and code loads (daemon/untraced.py)."""
        if self.writer is not None and not self.writer.closed:
            self.writer.write_procmem(rows)

    def _read_last_markers(self) -> None:
        """At shutdown: serve the marker clients once more, so markers already sent are kept."""
        assert self.selector is not None
        for _ in range(8):
            ready = self.selector.select(0)
            if not ready:
                return
            for key, mask in ready:
                key.data(mask)

    def _final_drain(self) -> None:
        for _ in range(_FINAL_DRAIN_POLLS):
            if not self.drain():
                break

    # ------------------------------------------------------------------ subscribers

    def _serve_subscribers(self) -> None:
        """Send the syncs built in the thread; start one for the subscribers that wait (new or
        resynced), unless a new file's first keyframe is still held back: a sync taken then
        would be followed by that older keyframe."""
        assert self.fanout is not None and self.writer is not None
        if self.fanout.needs_resync:
            self.fanout.resync(self._lost_notice)
        self.fanout.collect()
        if self.fanout.wants_sync and not self.keyframes.holding:
            self.writer.flush()  # every event in the state has gone out to the subscribers
            head = [self.writer.header_bytes]
            head += [encode_record(process_record(p)) for p in self.stamper.processes.values()]
            stacks = self.writer.stack_definitions()  # the stacks the file defined so far (--stacks)
            if stacks is not None:
                head.append(encode_record(stacks))
            ts, finish = self.clock(), self.state.snapshot_later()
            self.fanout.start_sync(head, lambda: encode_record(keyframe_record(ts, 0, finish())))

    def _lost_notice(self, dropped: int) -> bytes:
        notice = lost_record(self.clock(), self.feed.lost)
        notice["subscriber_dropped"] = dropped
        return encode_record(notice)

    def _on_subscribe(self, sock: socket.socket) -> None:
        assert self.fanout is not None
        self.fanout.add(sock)

    # ------------------------------------------------------------------ files

    def _header(self, reason: str) -> dict:
        probes = {**self.libraries.header(), "follow_tree": self.config.follow_tree}
        if self.torch is not None:
            probes["torch"] = self.torch.header()
        if self.stacks is not None:
            probes["interpreters"] = self.stacks.interpreters()
        return make_header(
            gpus=self.gpus,
            probes=probes,
            config=self.config.to_dict(),
            daemon={"pid": os.getpid(), "version": __version__, "part": self._part, "opened_by": reason},
            recording_id=self.names.recording_id,
            notes=list(self.notes),
            previous=os.fspath(self.files[-1]) if self.files else None,
        )

    def _open_writer(self, path: Path, reason: str, sink: FileSink | None = None) -> None:
        """Start a trace file (``sink``: already created) with the header and processes; its first
        keyframe is built in a thread and written before the file's events (:class:`HoldingSink`)."""
        try:
            if sink is None:
                os.close(open_folder(path.parent, parents=True))  # (memrec.base.files' one link policy)
                sink = create_sink(path)
            holder = HoldingSink(sink, self.fanout.publish if self.fanout is not None else None)
            self.writer = TraceWriter(holder, self._header(reason))
        except OSError as error:
            raise OutputError(f"cannot write the trace {path}: {error.strerror or error}") from None
        if sink.replaced and not self.config.follow_tree:  # memrec record and demo said so before the probes loaded
            log.warning("replaced the existing file %s", path)
        self.files.append(path)
        self.rotation.opened()
        if self.config.output_is_dir:
            retention.record(path.parent, path)  # --keep deletes only files in this ledger
        for info in self.stamper.processes.values():
            self.writer.write_process(info)
        if self.feed.lost:
            self.writer.write_lost(self.clock(), self.feed.lost)
        self.writer.flush()
        self.keyframes.start_first(self.writer, holder, self.state, self.clock())  # written by tick()

    def rotate(self, reason: str) -> Path:
        """Close the current file with a trailer; open the next with a header and a keyframe.

        The next file is created first: when it cannot be (a full disk, a bad folder), recording
        goes on in the current one and the error is logged.
        """
        assert self.writer is not None
        self._write_pending()
        path = self.names.path(self._part + 1 + self._skipped)
        try:
            sink = create_sink(path)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.EEXIST):  # a planted link or file: the next try skips it
                self._skipped += 1
            self.rotation.failed(reason, path, error, self.writer.path, self.clock())
            return Path(self.writer.path or path)
        self._part += 1 + self._skipped
        self._skipped = 0
        self.rotation.done()
        old = self.writer
        self.keyframes.collect(old, wait=self.keyframes.holding)  # its own first keyframe, if still held
        old.close(self._trailer(f"rotate: {reason}", next_file=os.fspath(path)))
        self._noted_closed(old)
        self._closed(old.path)
        self._open_writer(path, reason=f"rotate: {reason}", sink=sink)
        log.info("rotated (%s): %s → %s", reason, old.path, path)
        return path

    def _noted_closed(self, writer: TraceWriter) -> None:
        """A file of a trace folder is complete: its size goes into the folder's ledger."""
        if self.config.output_is_dir and writer.path:
            path = Path(writer.path)
            retention.record(path.parent, path, closed=True)

    def _closed(self, path: str | None) -> None:
        for listener in self.closed_listeners if path else ():
            try:
                listener(Path(path))
            except Exception as error:  # an add-on's failure never stops recording
                log.error("after closing %s: %s", path, error)

    def _trailer(self, reason: str, **extra: Any) -> dict:
        out = {
            "reason": reason,
            "part": self._part,
            "markers": self.markers.stats() if self.markers is not None else {},
            "subscribers": {
                "total": self.fanout.total_subscribers if self.fanout else 0,
                "dropped_records": self.fanout.dropped_records if self.fanout else 0,
                "disconnected_slow": self.fanout.disconnected_slow if self.fanout else 0,
            },
            "state": {"anomalies": dict(self.state.anomalies), "failures": self.state.n_failures},
            "markers_restamped": self.intake.restamped,
            "markers_dropped": dict(self.intake.dropped),
            "processes_expired": self.stamper.expired,
            "process_reads_refused": self.intake.process_reads_refused,
            "rotations_refused": self.rotation.refused_total,
            **({"torch": self.torch.header()} if self.torch is not None else {}),
            **({"stacks_read": self._stacks_summary()} if self.stacks is not None else {}),
            "lost": self.feed.lost,
        }
        if self.writer is not None and self.writer.dropped[0]:
            records, nbytes = self.writer.dropped
            out["disk_full"] = {"dropped_records": records, "dropped_bytes": nbytes}
        out.update(extra)
        return out

    def _write_keyframe(self) -> None:
        assert self.writer is not None
        self.keyframes.write_now(self.writer, self.state, self.clock())

    # ------------------------------------------------------------------ probes, GPUs, NVML

    def scan_libraries(self) -> int:
        """Attach the probes to every libcuda file not attached yet (and, with ``--tensors``, to
        every libc10_cuda.so); return how many driver files were new."""
        new = self.libraries.scan(self.probes)
        if self.torch is not None:
            self.torch.scan(self.probes)
        if self.stacks is not None:
            self.stacks.discover()
        return new

    def _stacks_summary(self) -> dict:
        assert self.stacks is not None
        return {"interpreters": self.stacks.interpreters(), "resolved": self.stacks.resolved,
                "unavailable": self.stacks.unavailable, "lost": int(self.probes.stacks_lost())}

    def _nvml_module(self) -> Any:
        if self._nvml is None:
            self._nvml = default_nvml()
        return self._nvml

    # ------------------------------------------------------------------ status

    def stats(self) -> dict:
        """Counters for logs and tests."""
        return {
            "mood": self.mood.value,
            "events": self.events_recorded,
            "markers": self.markers_recorded,
            "markers_dropped": dict(self.intake.dropped),
            "lost": self.feed.lost,
            "files": [os.fspath(p) for p in self.files],
            "processes": len(self.stamper.processes),
            "libraries": len(self.libraries.attached),
            "subscribers": len(self.fanout) if self.fanout is not None else 0,
            "marker_server": self.markers.stats() if self.markers is not None else {},
            "keyframes": {"written": self.keyframes.written, "skipped": self.keyframes.skipped,
                          "waited": self.keyframes.waited},
        }
