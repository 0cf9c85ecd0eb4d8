"""Prometheus metrics from the daemon's live state (``memrec daemon --metrics-addr HOST:PORT``).

Operators already scrape dcgm-exporter on GPU hosts; these metrics carry the same labels (``gpu``,
``UUID``, ``Hostname``, ``device``, ``modelName``) so a dashboard joins the two on them. Nothing
here collects across hosts: Prometheus does that.

Threads: the live state belongs to the daemon's loop. Once a second (and at every drain, for the
phase peaks) the loop builds a :class:`Snapshot` of plain values and swaps it in; a scrape, on the
HTTP server's thread, only reads the latest snapshot. NVML rows arrive on the sampler's thread and
are kept the same way (one reference assignment).

Label cardinality is bounded: per GPU the ``TOP_PROCESSES`` largest processes get their own series
and the rest are summed into ``pid="other"``; the ``MAX_PHASES`` most recently begun phase names
are kept; failed-call results beyond ``MAX_RESULTS`` distinct codes count as ``result="other"``.
"""

from __future__ import annotations

import dataclasses
import http.server
import logging
import socket
import socketserver
import threading
from collections import OrderedDict
from typing import Any
from typing import Callable
from typing import Iterator

import numpy as np

from memrec.base.errors import SocketError
from memrec.base.errors import UnavailableError
from memrec.terms.columns import RAW_DTYPE
from memrec.terms.events import CATEGORIES
from memrec.terms.events import CU_RESULT_NAMES
from memrec.terms.events import GpuInfo
from memrec.terms.events import Marker
from memrec.state import IPC_MAPPED
from memrec.state.tensors import TensorBlocks

log = logging.getLogger(__name__)

#: Processes per GPU with a series of their own; the rest are summed as pid="other".
TOP_PROCESSES = 10
#: Phase names kept for the phase-peak gauge (the one begun longest ago is dropped first).
MAX_PHASES = 32
#: (pid, name) pairs of open phases the phase-peak gauge follows (the oldest is forgotten first).
MAX_OPEN = 4096
#: Distinct CUresult codes counted by name; later ones count as "other".
MAX_RESULTS = 16
#: Seconds between two snapshots of the live state.
SNAPSHOT_INTERVAL = 1.0
#: Bytes of one ring-buffer record: the kernel's 8-byte header + the payload, 8-aligned.
RECORD_BYTES = (8 + RAW_DTYPE.itemsize + 7) // 8 * 8
PAGE = 4096
#: Seconds a scrape connection may sit idle before the server drops it.
SCRAPE_TIMEOUT = 10


class _Server(http.server.ThreadingHTTPServer):
    """The scrape endpoint; binds without HTTPServer's reverse lookup of its own address."""

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class _Server6(_Server):
    address_family = socket.AF_INET6


def result_name(result: int) -> str:
    return CU_RESULT_NAMES.get(result, f"CUresult {result}")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What one scrape shows: plain values, built on the loop's thread."""

    gpus: dict[int, GpuInfo]
    traced: dict[tuple[int, str], int]  # (gpu, category) -> bytes
    processes: dict[tuple[int, str, str], int]  # (gpu, pid or "other", comm) -> owned bytes
    phase_peaks: dict[tuple[int, str], int]  # (gpu, phase) -> bytes
    nvml: dict[int, dict[str, int]]  # gpu -> used/reserved/free/total/bar1_used/bar1_total
    failed: dict[str, int]  # result name -> calls
    events: int
    markers: int
    lost: int
    ring_fill: float
    drain_lag: float
    processes_seen: int
    libraries: int
    keyframes: dict[str, int]  # written / skipped / waited (daemon.keyframes.Keyframes)
    #: reason -> markers dropped (daemon/intake.py DROP_REASONS)
    markers_dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    #: (gpu, pid, comm) -> (allocated, reserved, blocks) of PyTorch's tensor blocks (--tensors)
    tensors: dict[tuple[int, int, str], tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    #: PyTorch installs probed for tensor blocks, and those without usable probes (--tensors)
    torch_libraries: tuple[int, int] = (0, 0)


class DrainMeter:
    """Counts what each ring-buffer poll returned: failed calls by result, fill and lag.

    ``ring_fill`` and ``drain_lag`` are the highest since the last :meth:`take`: the fill of the
    ring when it was drained (records × record size / ring size) and the age of the oldest
    record then (how late a reader sees an event).
    """

    def __init__(self, ring_bytes: int, clock: Callable[[], int]) -> None:
        self.ring_bytes = ring_bytes
        self.clock = clock
        self.failed: dict[str, int] = {}
        self._fill = 0.0
        self._lag = 0.0

    def batch(self, raw: np.ndarray) -> None:
        n = len(raw)
        if not n:
            return
        now = self.clock()
        self._fill = max(self._fill, min(1.0, n * RECORD_BYTES / self.ring_bytes))
        self._lag = max(self._lag, max(0, now - int(raw["ts"].min())) / 1e9)
        results = raw["result"]
        bad = results[results != 0]
        if len(bad):
            codes, counts = np.unique(bad, return_counts=True)
            for code, count in zip(codes.tolist(), counts.tolist()):
                name = result_name(code)
                if name not in self.failed and len(self.failed) >= MAX_RESULTS:
                    name = "other"
                self.failed[name] = self.failed.get(name, 0) + count

    def take(self) -> tuple[float, float]:
        """(fill, lag) since the last call, then start over."""
        out = (self._fill, self._lag)
        self._fill = self._lag = 0.0
        return out


class _MeteredProbes:
    """The daemon's probes, with every poll shown to a :class:`DrainMeter` first."""

    def __init__(self, inner: Any, meter: DrainMeter) -> None:
        self._inner = inner
        self._meter = meter

    def poll(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raw = self._inner.poll(*args, **kwargs)
        self._meter.batch(raw)
        return raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class PhasePeaks:
    """Per phase name and GPU, the highest owned bytes seen while a phase of that name was open.

    Phases are opened and closed by markers (begin/end, matched per pid and name); the peak is
    sampled at every drain, so a peak shorter than the drain interval can be missed (the trace
    holds every event; this is a gauge).

    Bounded whatever clients send (issue 23: 3 M open phases made each sample take 1.7 s): at most
    ``max_open`` (pid, name) pairs are held open (the one begun longest ago is forgotten first), and
    a sample walks only the ``max_phases`` names with a peak, never the open set.
    """

    def __init__(self, max_phases: int = MAX_PHASES, max_open: int = MAX_OPEN) -> None:
        self.max_phases = max_phases
        self.max_open = max_open
        self.open: OrderedDict[tuple[int, str], int] = OrderedDict()  # (pid, name) -> nesting depth
        self._open_names: dict[str, int] = {}  # name -> open (pid, name) pairs
        self.peaks: OrderedDict[str, dict[int, int]] = OrderedDict()
        #: Open pairs forgotten to stay within max_open.
        self.forgotten = 0

    def marker(self, marker: Marker) -> None:
        key = (marker.pid, marker.name)
        if marker.phase == "begin":
            if key not in self.open:
                if len(self.open) >= self.max_open:
                    self._close(*self.open.popitem(last=False))
                    self.forgotten += 1
                self._open_names[marker.name] = self._open_names.get(marker.name, 0) + 1
            self.open[key] = self.open.get(key, 0) + 1
            self.peaks.setdefault(marker.name, {})
            self.peaks.move_to_end(marker.name)
            while len(self.peaks) > self.max_phases:
                self.peaks.popitem(last=False)
        elif marker.phase == "end" and key in self.open:
            self.open[key] -= 1
            if not self.open[key]:
                self._close(key, 0)
                del self.open[key]

    def _close(self, key: tuple[int, str], _depth: int) -> None:
        name = key[1]
        left = self._open_names.get(name, 1) - 1
        if left > 0:
            self._open_names[name] = left
        else:
            self._open_names.pop(name, None)

    def sample(self, owned: dict[int, int]) -> None:
        """``owned``: gpu → owned bytes now."""
        for name, peaks in self.peaks.items():
            if name not in self._open_names:
                continue
            for gpu, b in owned.items():
                if b > peaks.get(gpu, 0):
                    peaks[gpu] = b

    def values(self) -> dict[tuple[int, str], int]:
        return {(gpu, name): b for name, by_gpu in self.peaks.items() for gpu, b in by_gpu.items()}


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def top_processes(counters: dict[tuple[int, int, int], int], n: int, comm: Callable[[int], str]) -> dict:
    """Owned bytes per (gpu, pid): the ``n`` largest per GPU, the rest summed as pid "other"."""
    per_gpu: dict[int, dict[int, int]] = {}
    for (g, p, c), b in counters.items():
        if c != IPC_MAPPED and b:
            per_gpu.setdefault(g, {})
            per_gpu[g][p] = per_gpu[g].get(p, 0) + b
    out: dict[tuple[int, str, str], int] = {}
    for g, by_pid in per_gpu.items():
        ranked = sorted(by_pid.items(), key=lambda kv: (-kv[1], kv[0]))
        for p, b in ranked[:n]:
            out[(g, str(p), comm(p))] = b
        rest = sum(b for _, b in ranked[n:])
        if rest:
            out[(g, "other", "")] = rest
    return out


class DaemonMetrics:
    """Builds snapshots from a running :class:`~memrec.daemon.server.Daemon` and serves them.

    ::

        m = DaemonMetrics(("127.0.0.1", 9862))
        m.listen()          # before the slow start: a taken port fails at once
        daemon.start()
        m.attach(daemon)    # meters the probes, listens to markers and NVML, snapshots every second
        m.serve()           # after the daemon dropped its capabilities: the thread inherits them
    """

    def __init__(self, addr: tuple[str, int], top_n: int = TOP_PROCESSES, hostname: str | None = None) -> None:
        self.addr = addr
        self.top_n = top_n
        self.hostname = hostname or socket.gethostname()
        self.snapshot: Snapshot | None = None
        self.phases = PhasePeaks()
        self.meter: DrainMeter | None = None
        self._nvml_rows: np.ndarray | None = None
        self._daemon: Any = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._comm: dict[int, str] = {}

    # -- serving ----------------------------------------------------------------------------------

    def listen(self) -> None:
        """Bind the HTTP server's socket (serving starts with :meth:`serve`).

        Raises:
            UnavailableError: prometheus-client is not installed.
            SocketError: the address cannot be bound.
        """
        try:
            from prometheus_client import CONTENT_TYPE_LATEST
            from prometheus_client import generate_latest
            from prometheus_client.registry import CollectorRegistry
        except ImportError:
            from memrec.base.extras import install_command

            raise UnavailableError(
                f"--metrics-addr needs prometheus-client: {install_command('metrics', ('prometheus-client',))}"
            ) from None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = SCRAPE_TIMEOUT

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served here")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass  # one line per scrape would drown the daemon's log

        host, port = self.addr
        server_class = _Server6 if ":" in host else _Server
        try:
            self._server = server_class((host or "0.0.0.0", port), Handler)
        except OSError as error:
            raise SocketError(f"cannot serve metrics on {host}:{port}: {error.strerror or error}") from None

    def serve(self) -> None:
        """Answer scrapes on a thread of its own (it inherits the caller's capabilities)."""
        assert self._server is not None
        self._thread = threading.Thread(target=self._server.serve_forever, name="memrec-metrics", daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        log.info("metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        if self._server is None:
            return
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
        self._server.server_close()
        self._server = None

    # -- the daemon's side (loop thread) ----------------------------------------------------------

    def attach(self, daemon: Any) -> None:
        """Meter the probes' polls and take snapshots from the daemon's loop."""
        self._daemon = daemon
        if daemon.config.tensors:
            daemon.blocks = TensorBlocks()
        self.meter = DrainMeter(daemon.config.ringbuf_pages * PAGE, daemon.clock)
        daemon.probes = _MeteredProbes(daemon.probes, self.meter)
        daemon.marker_listeners.append(self.phases.marker)
        daemon.sample_listeners.append(self._on_nvml)
        daemon.every(daemon.config.poll_interval, self._sample_phases)
        daemon.every(SNAPSHOT_INTERVAL, self.take_snapshot)
        self.take_snapshot(daemon.clock())

    def _on_nvml(self, rows: np.ndarray) -> None:
        if len(rows):
            self._nvml_rows = rows  # one assignment: safe from the sampler's thread

    def _owned(self) -> dict[int, int]:
        state = self._daemon.state
        return {g: state.owned_bytes(gpu=g) for g in {g for (g, _, c) in state.counters() if c != IPC_MAPPED}}

    def _sample_phases(self, _now: int) -> None:
        if self.phases.open:
            self.phases.sample(self._owned())

    def _process_name(self, pid: int) -> str:
        name = self._comm.get(pid)
        if name is None:
            if len(self._comm) > 4 * self.top_n * 16:
                self._comm.clear()
            name = self._comm[pid] = _comm(pid)
        return name

    def take_snapshot(self, _now: int) -> None:
        d = self._daemon
        counters = d.state.counters()
        traced: dict[tuple[int, str], int] = {}
        for (g, _p, c), b in counters.items():
            traced[(g, CATEGORIES[c])] = traced.get((g, CATEGORIES[c]), 0) + b
        nvml: dict[int, dict[str, int]] = {}
        rows = self._nvml_rows
        if rows is not None:
            for row in rows:
                nvml[int(row["gpu"])] = {k: int(row[k]) for k in rows.dtype.names if k not in ("ts", "gpu")}
        stats = d.stats()
        fill, lag = self.meter.take() if self.meter else (0.0, 0.0)
        self.snapshot = Snapshot(
            gpus={g.index: g for g in d.gpus},
            traced=traced,
            processes=top_processes(counters, self.top_n, self._process_name),
            phase_peaks=self.phases.values(),
            nvml=nvml,
            failed=dict(self.meter.failed) if self.meter else {},
            events=int(stats["events"]),
            markers=int(stats["markers"]),
            markers_dropped=dict(stats.get("markers_dropped", {})),
            lost=int(stats["lost"]),
            ring_fill=fill,
            drain_lag=lag,
            processes_seen=int(stats["processes"]),
            libraries=int(stats["libraries"]),
            keyframes=dict(stats["keyframes"]),
            **self._tensors(),
        )

    def _tensors(self) -> dict:
        """The Snapshot's tensor fields (none without --tensors)."""
        d = self._daemon
        if d.blocks is None:
            return {}
        tensors = {(g, pid, self._process_name(pid)): (alloc, resv, n)
                   for (pid, g), (alloc, resv, n) in d.blocks.totals.items()}
        tried = d.torch.header() if d.torch is not None else []
        return {"tensors": tensors,
                "torch_libraries": (sum(1 for t in tried if not t["problem"]), sum(1 for t in tried if t["problem"]))}

    # -- the scrape's side (HTTP thread) ----------------------------------------------------------

    def collect(self) -> Iterator[Any]:
        """prometheus-client's collector protocol: the families of the latest snapshot."""
        from prometheus_client.core import CounterMetricFamily
        from prometheus_client.core import GaugeMetricFamily

        from memrec.build_info import version_fields

        info = GaugeMetricFamily("memrec_info", "memrec build: version, trace format, BPF program",
                                 labels=["Hostname", *version_fields()])
        info.add_metric([self.hostname, *version_fields().values()], 1)
        yield info
        snap = self.snapshot
        if snap is None:
            return
        gpu_labels = ["gpu", "UUID", "Hostname", "device", "modelName"]

        def labels(g: int) -> list[str]:
            info = snap.gpus.get(g)
            return [
                str(g) if g >= 0 else "host", (info.uuid or "") if info else "", self.hostname,
                f"nvidia{g}" if g >= 0 else "", info.name if info else "",
            ]

        def gauge(name: str, doc: str, extra: list[str] = ()) -> GaugeMetricFamily:  # type: ignore[assignment]
            return GaugeMetricFamily(name, doc, labels=[*gpu_labels, *extra])

        fam = gauge("memrec_traced_bytes", "bytes the probes see held, by GPU and category "
                    "(ipc_mapped: peers' memory mapped here, not owned)", ["category"])
        for (g, cat), b in sorted(snap.traced.items()):
            fam.add_metric([*labels(g), cat], b)
        yield fam
        owned: dict[int, int] = {}
        for (g, cat), b in snap.traced.items():
            if cat != "ipc_mapped":
                owned[g] = owned.get(g, 0) + b
        fam = gauge("memrec_process_traced_bytes", f"owned bytes of the {self.top_n} largest processes per GPU; "
                    "the rest summed as pid=\"other\"", ["pid", "process"])
        for (g, pid, comm), b in sorted(snap.processes.items()):
            fam.add_metric([*labels(g), pid, comm], b)
        yield fam
        for field, doc in (("used", "NVML used bytes"), ("reserved", "NVML reserved bytes (driver, not usable)"),
                           ("free", "NVML free bytes"), ("total", "NVML total bytes"),
                           ("bar1_used", "NVML BAR1 used bytes"), ("bar1_total", "NVML BAR1 total bytes")):
            fam = gauge(f"memrec_nvml_{field}_bytes", doc)
            for g, values in sorted(snap.nvml.items()):
                if values.get(field, -1) >= 0:
                    fam.add_metric(labels(g), values[field])
            yield fam
        fam = gauge("memrec_untraced_bytes", "NVML used minus traced owned bytes: contexts, code, "
                    "memory taken before the probes attached")
        for g, values in sorted(snap.nvml.items()):
            if values.get("used", -1) >= 0:
                fam.add_metric(labels(g), values["used"] - owned.get(g, 0))
        yield fam
        fam = gauge("memrec_phase_peak_bytes", "the highest owned bytes on the GPU while a phase of this "
                    "name was open (sampled at each drain)", ["phase"])
        for (g, phase), b in sorted(snap.phase_peaks.items()):
            fam.add_metric([*labels(g), phase], b)
        yield fam
        for i, (name, doc) in enumerate((
                ("memrec_tensor_allocated_bytes", "bytes in PyTorch's live tensor blocks, per process (--tensors)"),
                ("memrec_tensor_reserved_bytes", "bytes of PyTorch's caching-allocator segments that held a block, "
                 "per process (--tensors)"),
                ("memrec_tensor_blocks", "PyTorch's live tensor blocks, per process (--tensors)"))):
            fam = gauge(name, doc, ["pid", "process"])
            for (g, pid, comm), values in sorted(snap.tensors.items()):
                fam.add_metric([*labels(g), str(pid), comm], values[i])
            yield fam
        fam = GaugeMetricFamily("memrec_torch_libraries", "libc10_cuda.so files tried for tensor blocks (--tensors), "
                                "by whether their USDT probes are attached", labels=["Hostname", "probes"])
        for label, n in zip(("attached", "unavailable"), snap.torch_libraries):
            fam.add_metric([self.hostname, label], n)
        yield fam
        fam = CounterMetricFamily("memrec_failed_calls", "driver calls that returned an error, by CUresult",
                                  labels=["Hostname", "result"])
        for name, n in sorted(snap.failed.items()):
            fam.add_metric([self.hostname, name], n)
        yield fam
        fam = CounterMetricFamily("memrec_markers_dropped", "markers dropped: over their uid's budget (budget), "
                                  "over the open-phase caps (open_phases), or kept off a nearly full disk (disk)",
                                  labels=["Hostname", "reason"])
        for reason, n in sorted(snap.markers_dropped.items()):
            fam.add_metric([self.hostname, reason], n)
        yield fam
        for kind, name, doc, value in (
            (CounterMetricFamily, "memrec_events", "events recorded", snap.events),
            (CounterMetricFamily, "memrec_markers", "phase markers recorded", snap.markers),
            (CounterMetricFamily, "memrec_lost_events", "events dropped because the ring buffer was full", snap.lost),
            (CounterMetricFamily, "memrec_keyframes_written", "keyframes written (the live state, for seeking)",
             snap.keyframes["written"]),
            (CounterMetricFamily, "memrec_keyframes_skipped", "keyframes not taken: nothing changed since the last",
             snap.keyframes["skipped"]),
            (CounterMetricFamily, "memrec_keyframes_waited", "times the loop waited for a new file's first keyframe "
             "(the records held behind it passed their limit)", snap.keyframes["waited"]),
            (GaugeMetricFamily, "memrec_ring_fill_ratio",
             "the fullest the BPF ring buffer was at a drain in the last second", snap.ring_fill),
            (GaugeMetricFamily, "memrec_drain_lag_seconds", "the oldest record's age at a drain in the last second",
             snap.drain_lag),
            (GaugeMetricFamily, "memrec_processes", "processes the daemon knows now", snap.processes_seen),
            (GaugeMetricFamily, "memrec_probed_libraries", "libcuda files the probes are attached to", snap.libraries),
        ):
            fam = kind(name, doc, labels=["Hostname"])
            fam.add_metric([self.hostname], value)
            yield fam
