"""The memrec daemon: one event loop from the probes to the trace and the live subscribers.

::

    d = Daemon(config)
    d.start()            # bind the socket, load the probes, attach every libcuda, open the trace
    d.track_pid(pid)     # record mode only: follow this process tree
    d.run(until=...)     # the loop; returns on SIGTERM/SIGINT or when until() is true
    d.stop()             # phased shutdown (idempotent)

One ``selectors`` loop serves the marker socket (markers, pings, subscribers) and a self-pipe
that signals write to; timers drain the ring buffer (``poll_interval``), flush the writer
(``flush_interval``), write keyframes (``keyframe_interval``) and look for newly mapped libcuda
files (``rescan_interval``). NVML samples come from the sampler's thread through a queue.

Each event gets its physical GPU here: the process's device ordinal through its
``CUDA_VISIBLE_DEVICES`` (:func:`memrec.probes.procinfo.gpu_map`); the live state fills in the
rest (a free gets its allocation's GPU...).

Signal handlers only queue the signal (supervisor's model); :meth:`Daemon.handle_signal` acts on
it from the loop: TERM/INT stop (or, in record mode, go to ``stop_signal_handler``), HUP rotates
the trace file. Shutdown is phased: stop accepting, stop NVML, final drain, final keyframe and trailer,
fsync, disconnect subscribers, remove the socket, and only then detach the probes (the slow part:
the trace is complete before it starts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import secrets
import selectors
import signal
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any
from typing import Callable

import numpy as np

from memrec import __version__
from memrec._errors import ExitCode
from memrec._errors import MemrecCommandError
from memrec._errors import MemrecError
from memrec._errors import one_line
from memrec._untrusted import clean_text
from memrec.columns import with_gpu
from memrec.daemon.config import DaemonConfig
from memrec.daemon.fanout import Fanout
from memrec.daemon.keyframes import Keyframes
from memrec.daemon.libraries import Libraries
from memrec.daemon.markers import MarkerServer
from memrec.daemon.markers import root_only
from memrec.daemon.markers import root_or_group
from memrec.daemon.sockets import BoundSocket
from memrec.daemon.sockets import bind_unix_socket
from memrec.daemon.sockets import group_id
from memrec.daemon.throttle import Throttle
from memrec.daemon.untraced import UntracedReadings
from memrec.daemon.untraced import name_images
from memrec.events import GpuInfo
from memrec.events import Kind
from memrec.events import Marker
from memrec.events import ProcessInfo
from memrec.state import LiveState
from memrec.trace.format import encode_record
from memrec.trace.format import keyframe_record
from memrec.trace.format import lost_record
from memrec.trace.format import make_header
from memrec.trace.format import process_record
from memrec.trace.writer import MAX_HELD_BYTES
from memrec.trace.writer import FileSink
from memrec.trace.writer import TraceWriter

log = logging.getLogger(__name__)

#: Kinds that are about a whole process, never one GPU (the one-GPU fallback skips them).
_PROCESS_KINDS = (int(Kind.PROC_EXIT), int(Kind.PROC_FORK))
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: In record mode, stop signals go to the command; this many of one kind stop the daemon anyway.
_FORCE_STOP_AFTER = 3
#: The most ring-buffer polls of the final drain.
_FINAL_DRAIN_POLLS = 64
#: A marker's ts must lie within this many ns before its arrival on the daemon's clock; any other
#: value (a clock of another time namespace, a made-up 2^64 - 1) is replaced by the arrival time.
MARKER_TS_WINDOW = 60 * 10**9
#: How often idle and half-sent marker connections are looked for (ns).
_SWEEP_NS = 10**9


class Mood(enum.Enum):
    """The daemon's state (supervisor's "mood")."""

    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class ProbeLoadError(MemrecCommandError):
    """The BPF probes cannot be compiled or loaded; the message is the reason in one line."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=ExitCode.UNAVAILABLE)


def _gpu_text(info: ProcessInfo) -> str:
    """How a process's device ordinals map to GPUs, for the log (never Python's None or [])."""
    cvd = "CUDA_VISIBLE_DEVICES unset" if info.cuda_visible_devices is None else (
        f"CUDA_VISIBLE_DEVICES={info.cuda_visible_devices}")
    if info.gpu_map:
        return f"{cvd} → GPUs {', '.join(map(str, info.gpu_map))}"
    if info.cuda_visible_devices is None:
        return f"{cvd}, no GPU list (no NVML): ordinal n is GPU n"
    return f"{cvd} → no GPU it can name"


#: Batches in which a new process's ordinal map is checked against NVML before giving up.
_MAP_CHECK_TRIES = 20


def _default_probes_factory(**kwargs: Any) -> Any:
    from memrec.probes.cuda import CudaProbes

    return CudaProbes(**kwargs)


def _default_nvml() -> Any:
    from memrec.probes import nvml

    return nvml


def _default_process_info(pid: int, gpus: list[GpuInfo], first_ts: int) -> ProcessInfo:
    from memrec.probes.procinfo import process_info

    return process_info(pid, gpus, first_ts)


def _create_sink(path: Path) -> FileSink:
    """A new trace file: never through a symbolic link; an existing regular file is replaced."""
    return FileSink(path, replace=True)


class Daemon:
    """The recorder: probes → GPU stamping → live state → trace file and live subscribers.

    Args:
        config: what to record where.
        probes_factory: builds the probes (``CudaProbes(follow_tree=, ringbuf_pages=)``).
        nvml: provides ``list_gpus()`` and ``NvmlSampler`` (default :mod:`memrec.probes.nvml`);
            None for the default.
        clock: CLOCK_MONOTONIC ns, the probes' clock (timers and record timestamps).
        find_libraries: ``(extra_paths) -> [LibraryFile(path, dev, inode)]``.
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
        process_info: Callable[[int, list[GpuInfo], int], ProcessInfo] | None = None,
        stop_signal_handler: Callable[[int], None] | None = None,
        install_signals: bool = True,
    ) -> None:
        self.config = config
        self._probes_factory = probes_factory or _default_probes_factory
        self._nvml = nvml
        self.clock = clock
        self.libraries = Libraries(find_libraries, config.libcuda_paths)
        self._process_info = process_info or _default_process_info
        self.stop_signal_handler = stop_signal_handler
        self._install_signals = install_signals

        self.mood = Mood.CREATED
        self.stop_reason: str | None = None
        self.probes: Any = None
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

        self._signals: list[int] = []
        self._signal_counts: dict[int, int] = {}
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd: int | None = None
        self._wake_r = self._wake_w = -1
        self._procs: dict[int, ProcessInfo] = {}
        self._map_checked: set[int] = set()  # pids whose ordinal map NVML confirmed or corrected
        self._map_tries: dict[int, int] = {}
        self._nvml_listing: dict[int, set[int]] | None = None
        self._nvml_listing_failed = False
        self._pending_markers: list[Marker] = []
        self._nvml_queue: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._lost = 0
        self._part = 0
        self._start_stamp = ""
        self._poll_errors = 0
        self._probes_closed = False
        self._ring_fd: int | None = None
        self.events_recorded = 0
        self.markers_recorded = 0
        self.markers_restamped = 0
        self._next: dict[str, int] = {}
        self._loss_log = Throttle(log, 5.0)
        self._disk_full = False
        self._restamp_log = Throttle(log, 60.0)
        self._timers: list[list] = []  # [period ns, due ns, fn] from every()
        #: Called from the loop with each marker as it arrives (device ordinal as the client sent it).
        self.marker_listeners: list[Callable[[Marker], None]] = []
        #: Called on the NVML sampler's thread with each batch of device rows (NVML_DTYPE).
        self.sample_listeners: list[Callable[[np.ndarray], None]] = []

    # ================================================================== lifecycle

    def start(self) -> None:
        """Bind the socket, load the probes, attach libcuda, open the trace, start NVML.

        Raises:
            SocketError: the socket is in use or cannot be created (exit code CANT_CREATE).
            ProbeLoadError: the BPF program cannot be loaded (exit code UNAVAILABLE).
            MemrecCommandError: the output cannot be written (exit code CANT_CREATE).
        """
        if self.mood is not Mood.CREATED:
            raise RuntimeError(f"Daemon.start() called in mood {self.mood.value}")
        cfg = self.config
        self._start_stamp = time.strftime("%Y%m%d-%H%M%S")
        self._name_token = secrets.token_hex(4)
        self.selector = selectors.DefaultSelector()
        try:
            # The socket first: a second daemon fails here, before the slow BPF compile.
            self.bound = bind_unix_socket(cfg.socket_path, cfg.socket_mode, cfg.socket_group)
            self._load_probes()
            for path in cfg.libcuda_paths:
                if not os.path.exists(path):
                    log.warning("--libcuda %s: no such file", path)
            self.scan_libraries()
            if not self.libraries.attached:
                log.warning(
                    "no libcuda.so.1 found yet: probes will attach when a process maps one "
                    "(rescan every %g s); name one with --libcuda PATH", cfg.rescan_interval
                )
            self.gpus = self._list_gpus()
            self.fanout = Fanout(self.selector, cfg.subscriber_queue_bytes)
            self.markers = MarkerServer(
                self.bound.sock, self.selector, self._on_marker, self._on_subscribe, on_connect=self._on_connect,
                may_subscribe=root_only if cfg.live_group is None else root_or_group(group_id(cfg.live_group)),
            )
            self._open_writer(self._next_path(), reason="start")
            self._start_sampler()
            self.readings = UntracedReadings(
                self._nvml_module(), [g.index for g in self.gpus], self._write_readings, self.clock
            )
            self._watch_ring_buffer()
            self._setup_signals()
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
            "recording to %s; markers on %s; %d GPU(s); %d libcuda file(s) probed",
            self.files[-1], cfg.socket_path, len(self.gpus), len(self.libraries.attached),
        )

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
            if self._timers:
                due = min(due, min(t[1] for t in self._timers))
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
            steps.append(("stop reading probes", self._stop_reading_probes))
        if self.writer is not None:
            if failed:
                steps.append(("close trace", lambda: self.writer.abort()))
            else:
                steps.append(("final keyframe", self._write_keyframe))
                steps.append(("trailer", lambda: self.writer.close(self._trailer(self.stop_reason or "stop"))))
        if self.fanout is not None:
            steps.append(("subscribers", self.fanout.close))
        if self.markers is not None:
            steps.append(("marker clients", self.markers.close))
        if self.bound is not None:
            steps.append(("remove socket", self.bound.close))
        if self.probes is not None:
            # Last: detaching costs ~0.1 s per probe in the kernel; the trace is complete (trailer
            # written and fsynced) and the socket free before it starts.
            steps.append(("detach probes", self._detach_probes))
        steps.append(("signals", self._restore_signals))
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
        if signum not in self._signals:
            self._signals.append(signum)

    def handle_signal(self) -> None:
        """Act on the queued signals (called from the loop, never from a handler)."""
        while self._signals:
            signum = self._signals.pop(0)
            name = signal.Signals(signum).name
            if signum in _STOP_SIGNALS:
                count = self._signal_counts[signum] = self._signal_counts.get(signum, 0) + 1
                if self.mood is not Mood.RUNNING:
                    log.info("received %s: ignored, shutdown already in progress", name)
                elif self.stop_signal_handler is not None and count < _FORCE_STOP_AFTER:
                    log.info("received %s: passed on (recording continues until the command exits)", name)
                    self.stop_signal_handler(signum)
                else:
                    log.info("received %s: shutting down", name)
                    self.stop_reason = f"signal {name}"
                    self.mood = Mood.STOPPING
            elif signum == signal.SIGHUP:
                if self.mood is not Mood.RUNNING:
                    log.info("received SIGHUP: ignored, shutdown in progress")
                else:
                    log.info("received SIGHUP: rotating the trace file")
                    self.rotate("SIGHUP")
            else:
                log.debug("received %s: ignored", name)

    def _setup_signals(self) -> None:
        if not self._install_signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.debug("not in the main thread: signal handlers not installed")
            return
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.selector is not None
        self.selector.register(self._wake_r, selectors.EVENT_READ, self._drain_wakeup)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for signum in (*_STOP_SIGNALS, signal.SIGHUP):
            self._old_handlers[signum] = signal.signal(signum, self.queue_signal)

    def _drain_wakeup(self, _mask: int) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 512):
                pass

    def _restore_signals(self) -> None:
        for signum, handler in self._old_handlers.items():
            with contextlib.suppress(Exception):
                signal.signal(signum, handler)
        self._old_handlers.clear()
        if self._old_wakeup_fd is not None:
            with contextlib.suppress(Exception):
                signal.set_wakeup_fd(self._old_wakeup_fd)
            self._old_wakeup_fd = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1

    # ================================================================== loop work

    def tick(self, now: int) -> None:
        """Do the timed work due at ``now`` (the loop calls it after every select)."""
        nxt = self._next
        cfg = self.config
        if now >= nxt["poll"]:
            self.drain()
            nxt["poll"] = _advance(nxt["poll"], int(cfg.poll_interval * 1e9), now)
        if self._pending_markers or self._nvml_queue:
            self._write_pending()
        if self.readings is not None:
            self.readings.tick(now)
        if self.keyframes.collect(self.writer):
            nxt["flush"] = now  # a keyframe is worth showing at once
        if now >= nxt["keyframe"]:
            assert self.writer is not None
            self.keyframes.start(self.writer, self.state, now)  # built in a thread, written by collect
            nxt["keyframe"] = _advance(nxt["keyframe"], int(cfg.keyframe_interval * 1e9), now)
        if now >= nxt["flush"]:
            assert self.writer is not None
            self.writer.flush()
            self._watch_disk()
            nxt["flush"] = _advance(nxt["flush"], int(cfg.flush_interval * 1e9), now)
        if now >= nxt["rescan"]:
            self.scan_libraries()
            nxt["rescan"] = _advance(nxt["rescan"], int(cfg.rescan_interval * 1e9), now)
        if now >= nxt["sweep"]:
            if self.markers is not None:
                self.markers.sweep()
            nxt["sweep"] = _advance(nxt["sweep"], _SWEEP_NS, now)
        if self.fanout is not None and self.fanout.needs_resync:
            assert self.writer is not None
            self.writer.flush()
            self.fanout.resync(self._resync_records)
        if (cfg.rotate_bytes and self.writer is not None and self.writer.bytes_written >= cfg.rotate_bytes
                and self.writer.stalled is None):
            self.rotate("size")
        for timer in self._timers:
            if now >= timer[1]:
                timer[1] = _advance(timer[1], timer[0], now)
                try:
                    timer[2](now)
                except Exception as error:  # an add-on (metrics, watchdog) never stops recording
                    log.error("periodic %s failed: %s", getattr(timer[2], "__qualname__", timer[2]), one_line(error))

    def every(self, seconds: float, fn: Callable[[int], None]) -> None:
        """Call ``fn(now)`` from the loop every ``seconds`` (the metrics' snapshot, systemd's watchdog).

        The loop's thread owns the live state, so this is where an add-on may read it.
        """
        period = max(1, int(seconds * 1e9))
        self._timers.append([period, self.clock() + period, fn])

    def _watch_ring_buffer(self) -> None:
        """Drain at once when the probes wake us (if they offer a pollable fd), not only on the timer.

        Records are submitted without wakeups (cheap); a probe program that forces a wakeup for
        the first, rare events of a process (context creation) lets the daemon read that
        process's /proc while it surely still runs.
        """
        fileno = getattr(self.probes, "fileno", None)
        if not callable(fileno):
            return
        try:
            fd = int(fileno())
            assert self.selector is not None
            self.selector.register(fd, selectors.EVENT_READ, lambda _mask: self.drain())
        except (OSError, ValueError, TypeError) as error:
            log.debug("ring buffer fd not pollable (%s): draining on the timer only", error)
            return
        self._ring_fd = fd

    def _stop_reading_probes(self) -> None:
        """Read no more events: what the probes see from here on is after the trailer."""
        if self._ring_fd is not None and self.selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self._ring_fd)
            self._ring_fd = None
        self._probes_closed = True

    def _detach_probes(self) -> None:
        self._stop_reading_probes()
        log.info("detaching the probes (the trace is already complete)")
        started = time.monotonic()
        self.probes.close()
        log.info("probes detached in %.1f s", time.monotonic() - started)

    def drain(self) -> int:
        """Poll the ring buffer once, record what it held; return the number of events."""
        if self.probes is None or self._probes_closed:
            return 0
        try:
            raw = self.probes.poll()
        except Exception as error:
            self._poll_errors += 1
            if self._poll_errors <= 3:
                log.error("ring buffer poll failed: %s", one_line(error))
            return 0
        n = len(raw)
        if n:
            self.record_events(raw)
        lost = int(self.probes.lost())
        if lost != self._lost:
            if lost > self._lost:
                self._loss_log.log(logging.WARNING, "%d events lost so far (ring buffer full: raise --ringbuf-pages?)", lost)
            self._lost = lost
            assert self.writer is not None
            self.writer.write_lost(self.clock(), lost)
        return n

    def record_events(self, raw: np.ndarray) -> np.ndarray:
        """Stamp GPUs on raw probe records, apply them to the live state, write them."""
        events = with_gpu(raw, -1)
        if len(events) > 1:
            events = events[np.argsort(events["ts"], kind="stable")]
        pids = events["pid"]
        self._nvml_listing = None
        for pid in np.unique(pids).tolist():
            rows = pids == pid
            info = self._process(pid, int(events["ts"][rows][0]))
            info = self._check_gpu_map(info, events["ordinal"][rows])
            self._stamp(events, rows, info)
        name_images(events)
        self.state.apply(events)
        assert self.writer is not None
        self.writer.write_events(events)
        self.events_recorded += len(events)
        if self.readings is not None:
            self.readings.after_batch(events)
        for pid in events["pid"][events["kind"] == int(Kind.PROC_EXIT)].tolist():
            self._procs.pop(pid, None)  # a later process with this pid is a new one
            self._map_checked.discard(pid)
            self._map_tries.pop(pid, None)
        return events

    def _check_gpu_map(self, info: ProcessInfo, ordinals: np.ndarray) -> ProcessInfo:
        """Check a new process's ordinal → GPU map against the GPUs NVML lists it on.

        ``/proc/PID/environ`` shows the environment the process started with; a worker that sets
        CUDA_VISIBLE_DEVICES itself before CUDA starts would otherwise be put on the wrong GPU.
        Asked once per batch while some process is unchecked, at most _MAP_CHECK_TRIES batches
        per process (NVML may not list processes of another PID namespace).
        """
        pid = info.pid
        if not self.gpus or pid in self._map_checked:
            return info
        seen = {int(o) for o in np.unique(ordinals).tolist() if o >= 0}
        if not seen:
            return info
        tries = self._map_tries[pid] = self._map_tries.get(pid, 0) + 1
        listed = self._nvml_process_gpus().get(pid)
        if not listed:
            if tries >= _MAP_CHECK_TRIES:
                self._map_checked.add(pid)
            return info
        self._map_checked.add(pid)
        from memrec.probes.procinfo import checked_gpu_map

        corrected = checked_gpu_map(info.gpu_map, seen, listed)
        if corrected is None:
            return info
        log.warning(
            "pid %d: NVML lists it on GPU(s) %s, which CUDA_VISIBLE_DEVICES=%s from its start-up "
            "environment does not give (set later by the process?): ordinals now map to GPUs %s",
            pid, sorted(listed), info.cuda_visible_devices, corrected,
        )
        info = dataclasses.replace(info, gpu_map=corrected, gpu_map_source="nvml")
        self._procs[pid] = info
        if self.writer is not None and not self.writer.closed:
            self.writer.write_process(info)
        return info

    def _nvml_process_gpus(self) -> dict[int, set[int]]:
        """pid → GPUs NVML lists it on, asked at most once per batch ({} without NVML)."""
        if self._nvml_listing is None:
            self._nvml_listing = {}
            query = getattr(self._nvml_module(), "process_gpus", None)
            if query is not None and not self._nvml_listing_failed:
                try:
                    self._nvml_listing = query([g.index for g in self.gpus])
                except Exception as error:  # NVML gone: keep the environ maps
                    log.info("cannot ask NVML for processes (%s): ordinal maps stay unchecked", error)
                    self._nvml_listing_failed = True
        return self._nvml_listing

    def _identity(self, info: ProcessInfo) -> bool:
        """No NVML and no CUDA_VISIBLE_DEVICES: ordinal n is GPU n (CUDA's and NVML's order)."""
        return not self.gpus and info.cuda_visible_devices is None

    def _stamp(self, events: np.ndarray, rows: np.ndarray, info: ProcessInfo) -> None:
        ordinal = events["ordinal"][rows].astype(np.int64)
        if self._identity(info):
            gpu = np.where(ordinal >= 0, ordinal, -1)
        else:
            gm = np.asarray(info.gpu_map, dtype=np.int64)
            gpu = np.full(len(ordinal), -1, dtype=np.int64)
            ok = (ordinal >= 0) & (ordinal < len(gm))
            gpu[ok] = gm[ordinal[ok]]
            if len(gm) == 1:
                kinds = events["kind"][rows]
                gpu[(ordinal == -1) & ~np.isin(kinds, _PROCESS_KINDS)] = gm[0]
        events["gpu"][rows] = gpu

    def _process(self, pid: int, first_ts: int) -> ProcessInfo:
        info = self._procs.get(pid)
        if info is None:
            try:
                info = self._process_info(pid, self.gpus, first_ts)
            except Exception as error:  # /proc surprises must not cost the events
                log.warning("pid %d: cannot read /proc (%s)", pid, error)
                info = ProcessInfo(pid, None, [], None, None, [], first_ts)
            self._procs[pid] = info
            if not info.cmdline and info.exe is None:
                log.info("pid %d ended before /proc could be read: its CUDA_VISIBLE_DEVICES is unknown, "
                         "its ordinals are taken as the host's GPU numbers", pid)
            log.info("pid %d: %s (%s)", pid, clean_text(" ".join(info.cmdline), 200) or "?",
                     clean_text(_gpu_text(info), 200))
            if self.writer is not None and not self.writer.closed:
                self.writer.write_process(info)
        return info

    # ------------------------------------------------------------------ markers and NVML

    def _on_connect(self, pid: int, _uid: int) -> None:
        """Read a marker client's /proc now, while it surely runs (a shell's `memrec mark` is brief)."""
        self._process(pid, self.clock())

    def _on_marker(self, marker: Marker) -> None:
        """Queue a marker; its ts is the client's only when the daemon's clock agrees.

        A client's CLOCK_MONOTONIC is the daemon's on one host, so an honest ts lies a little
        before the marker's arrival. Any other value (another time namespace's clock, a made-up
        2^63) would stretch or break every report of the trace: the arrival time replaces it.
        """
        now = self.clock()
        if not now - MARKER_TS_WINDOW <= marker.ts <= now:
            self.markers_restamped += 1
            self._restamp_log.log(
                logging.WARNING, "marker %r from pid %d: its ts %d is not within the last %d s of this "
                "host's clock (%d); stamped with its arrival time", clean_text(marker.name, 60), marker.pid,
                marker.ts, MARKER_TS_WINDOW // 10**9, now,
            )
            marker = dataclasses.replace(marker, ts=now)
        if marker.pid not in self._procs:  # a process named by `memrec mark` (its shell): read it now
            self._process(marker.pid, marker.ts)
        self._pending_markers.append(marker)
        for listener in self.marker_listeners:
            listener(marker)

    def _physical_gpu(self, marker: Marker) -> Marker:
        """The client names its device ordinal; the trace holds the physical GPU."""
        if marker.gpu is None:
            return marker
        info = self._process(marker.pid, marker.ts)
        if self._identity(info):
            return marker
        if 0 <= marker.gpu < len(info.gpu_map):
            return dataclasses.replace(marker, gpu=info.gpu_map[marker.gpu])
        return marker  # unknown map: keep the number the client gave

    def _nvml_sink(self, device_rows: np.ndarray, process_rows: np.ndarray) -> None:
        """Called on the sampler's thread: only queue (the loop writes)."""
        self._nvml_queue.append((device_rows, process_rows))
        for listener in self.sample_listeners:
            listener(device_rows)

    def _write_pending(self) -> None:
        """Write queued markers (after the events that happened before them) and NVML samples."""
        writer = self.writer
        assert writer is not None
        if self._pending_markers:
            self.drain()  # events older than the markers go first
            markers, self._pending_markers = self._pending_markers, []
            for marker in sorted(markers, key=lambda m: m.ts):
                writer.write_marker(self._physical_gpu(marker))
                self.markers_recorded += 1
        while self._nvml_queue:
            device_rows, process_rows = self._nvml_queue.popleft()
            if len(device_rows):
                writer.write_nvml(device_rows)
            if len(process_rows):
                writer.write_procmem(process_rows)

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

    def _sync_records(self, flush: bool = True) -> list[bytes]:
        """What a subscriber needs to stand alone: header, known processes, a keyframe."""
        assert self.writer is not None
        if flush:
            self.writer.flush()  # every event in the state has gone out to existing subscribers
        out = [self.writer.header_bytes]
        out += [encode_record(process_record(p)) for p in self._procs.values()]
        out.append(encode_record(keyframe_record(self.clock(), 0, self.state.snapshot())))
        return out

    def _resync_records(self, dropped: int) -> list[bytes]:
        notice = lost_record(self.clock(), self._lost)
        notice["subscriber_dropped"] = dropped
        sync = self._sync_records(flush=False)  # tick() flushed: no tee from inside the fanout
        return [sync[0], encode_record(notice), *sync[1:]]

    def _on_subscribe(self, sock: socket.socket) -> None:
        assert self.fanout is not None
        self.fanout.add(sock, self._sync_records())

    # ------------------------------------------------------------------ files

    def _next_path(self, part: int | None = None) -> Path:
        cfg = self.config
        part = self._part if part is None else part
        if cfg.output_is_dir:
            # A random part: nobody can plant a file (or link) at a name known in advance.
            base = f"memrec-{socket.gethostname()}-{self._start_stamp}-{os.getpid()}-{self._name_token}"
            return cfg.output / (f"{base}.mrec" if part == 0 else f"{base}.{part}.mrec")
        if part == 0:
            return cfg.output
        suffix = cfg.output.suffix or ""
        stem = cfg.output.name[: -len(suffix)] if suffix else cfg.output.name
        return cfg.output.with_name(f"{stem}.{part}{suffix}")

    def _header(self, reason: str) -> dict:
        probes = {**self.libraries.header(), "follow_tree": self.config.follow_tree}
        return make_header(
            gpus=self.gpus,
            probes=probes,
            config=self.config.to_dict(),
            daemon={"pid": os.getpid(), "version": __version__, "part": self._part, "opened_by": reason},
            notes=list(self.notes),
            previous=os.fspath(self.files[-1]) if self.files else None,
        )

    def _open_writer(self, path: Path, reason: str, sink: FileSink | None = None) -> None:
        """Start a trace file (``sink``: already created) with the header, processes and a keyframe."""
        try:
            if sink is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                sink = _create_sink(path)
            tee = self.fanout.publish if self.fanout is not None else None
            self.writer = TraceWriter(sink, self._header(reason), tee=tee)
        except OSError as error:
            raise MemrecCommandError(
                f"cannot write the trace {path}: {error.strerror or error}", exit_code=ExitCode.CANT_CREATE
            ) from None
        if sink.replaced:
            log.warning("replaced the existing file %s", path)
        self.files.append(path)
        for info in self._procs.values():
            self.writer.write_process(info)
        if self._lost:
            self.writer.write_lost(self.clock(), self._lost)
        self.keyframes.write_now(self.writer, self.state, self.clock(), 0)
        self.writer.flush()

    def rotate(self, reason: str) -> Path:
        """Close the current file with a trailer; open the next with a header and a keyframe.

        The next file is created first: when it cannot be (a full disk, a bad folder), recording
        goes on in the current one and the error is logged.
        """
        assert self.writer is not None
        self._write_pending()
        path = self._next_path(self._part + 1)
        try:
            sink = _create_sink(path)
        except OSError as error:
            log.error("cannot rotate (%s) to %s: %s; recording goes on in %s", reason, path,
                      error.strerror or error, self.writer.path)
            return Path(self.writer.path or path)
        self._part += 1
        old = self.writer
        old.close(self._trailer(f"rotate: {reason}", next_file=os.fspath(path)))
        self._open_writer(path, reason=f"rotate: {reason}", sink=sink)
        log.info("rotated (%s): %s → %s", reason, old.path, path)
        return path

    def _watch_disk(self) -> None:
        """Say once when writes stall (a full disk) and once when they resume, with what was lost."""
        writer = self.writer
        if writer is None:
            return
        stalled = writer.stalled
        if stalled is not None and not self._disk_full:
            self._disk_full = True
            log.error(
                "cannot write %s: %s. Recording goes on: the live state is kept, up to %d MiB of records "
                "are held and written when space returns, later ones are dropped and counted",
                writer.path, stalled.strerror or stalled, MAX_HELD_BYTES >> 20,
            )
        elif stalled is None and self._disk_full:
            self._disk_full = False
            records, nbytes = writer.dropped
            log.warning("%s takes writes again; %d record(s) (%d bytes) were dropped while the disk was full",
                        writer.path, records, nbytes)

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
            "markers_restamped": self.markers_restamped,
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

    def _load_probes(self) -> None:
        log.info("compiling and loading the BPF probes (a few seconds)")
        try:
            kwargs = {"follow_tree": self.config.follow_tree, "ringbuf_pages": self.config.ringbuf_pages}
            if not self.config.untraced_probes:
                kwargs["untraced"] = False
            self.probes = self._probes_factory(**kwargs)
            self.probes.load()
        except MemrecCommandError:
            raise
        except Exception as error:  # bcc raises bare Exception for compile and load failures
            raise ProbeLoadError(f"cannot load the BPF probes: {one_line(error)}") from error

    def scan_libraries(self) -> int:
        """Attach the probes to every libcuda file not attached yet; return how many were new."""
        return self.libraries.scan(self.probes)

    def _nvml_module(self) -> Any:
        if self._nvml is None:
            self._nvml = _default_nvml()
        return self._nvml

    def _list_gpus(self) -> list[GpuInfo]:
        nvml = self._nvml_module()
        try:
            gpus = list(nvml.list_gpus())
        except nvml.NvmlUnavailable as error:
            nvml.note_unavailable(error)
            self.notes.append(f"NVML unavailable: {error}; no GPU list, no NVML samples")
            return []
        except MemrecError as error:
            log.warning("cannot list GPUs through NVML: %s", error)
            self.notes.append(f"NVML GPU list failed: {error}")
            return []
        if not gpus:
            self.notes.append("NVML reports no GPUs")
        return gpus

    def _start_sampler(self) -> None:
        cfg = self.config
        if not (cfg.nvml_device_hz or cfg.nvml_process_hz):
            self.notes.append("NVML sampling off")
            return
        nvml = self._nvml_module()
        if any(n.startswith("NVML unavailable") for n in self.notes):
            return  # said once already; no thread for nothing
        self.sampler = nvml.NvmlSampler(self._nvml_sink, cfg.nvml_device_hz, cfg.nvml_process_hz, clock=self.clock)
        self.sampler.start()

    # ------------------------------------------------------------------ status

    def stats(self) -> dict:
        """Counters for logs and tests."""
        return {
            "mood": self.mood.value,
            "events": self.events_recorded,
            "markers": self.markers_recorded,
            "lost": self._lost,
            "files": [os.fspath(p) for p in self.files],
            "processes": len(self._procs),
            "libraries": len(self.libraries.attached),
            "subscribers": len(self.fanout) if self.fanout is not None else 0,
            "marker_server": self.markers.stats() if self.markers is not None else {},
        }


def _advance(deadline: int, period: int, now: int) -> int:
    """The next deadline after ``now`` on the grid ``deadline + k * period``."""
    deadline += period
    if deadline <= now:
        deadline += ((now - deadline) // period + 1) * period
    return deadline
