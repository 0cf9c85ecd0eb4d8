"""NVML through its one choke point: GPU list, sampler rows, rates, lost GPUs, no NVML at all.

Only ``memrec.probes.nvml.nvml_query`` is replaced (by :class:`FakeNvml`); everything above it
(list_gpus, NvmlSampler, the daemon's use of them) is the real code.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.probes import nvml
from memrec.probes.nvml import NvmlError
from memrec.probes.nvml import NvmlSampler
from memrec.probes.nvml import NvmlUnavailable

GiB = 1 << 30
MiB = 1 << 20


class FakeNvml:
    """Stands in for nvml_query: GPUs with memory, BAR1 and processes; failures on demand."""

    def __init__(self, n_gpus: int = 2, v2: bool = True) -> None:
        self.gpus = [
            {
                "uuid": f"GPU-{i:08x}-0000-0000-0000-000000000000",
                "name": "NVIDIA H200",
                "total": 141 * GiB,
                "used": (i + 1) * GiB,
                "reserved": 615 * MiB,
                "bar1_total": 256 * GiB,
                "bar1_used": (i + 1) * MiB,
                "procs": [(1000 + i, (i + 1) * GiB), (2000, None)],
            }
            for i in range(n_gpus)
        ]
        self.v2 = v2
        self.lost: set[int] = set()
        self.failing: dict[str, int] = {}  # function name -> NVML error code
        self.calls: list[tuple] = []
        self.unavailable: str | None = None

    def __call__(self, name: str, *args):
        self.calls.append((name, *args))
        if self.unavailable:
            raise NvmlUnavailable(self.unavailable)
        if name in self.failing:
            raise NvmlError(name, self.failing[name], "Not Supported")
        if name == "nvmlDeviceGetCount":
            return len(self.gpus)
        if name == "nvmlDeviceGetHandleByIndex":
            return ("handle", args[0])
        index = args[0][1]
        if index in self.lost:
            raise NvmlError(name, nvml.NVML_ERROR_GPU_IS_LOST, "GPU is lost")
        g = self.gpus[index]
        if name == "nvmlDeviceGetUUID":
            return g["uuid"]
        if name == "nvmlDeviceGetName":
            return g["name"]
        if name == "nvmlDeviceGetMemoryInfo":
            free = g["total"] - g["used"] - g["reserved"]
            if len(args) > 1:
                assert args[1] == nvml.NVML_MEMORY_V2
                if not self.v2:
                    raise NvmlError(name, nvml.NVML_ERROR_FUNCTION_NOT_FOUND, "Function Not Found")
                return SimpleNamespace(total=g["total"], used=g["used"], reserved=g["reserved"], free=free)
            return SimpleNamespace(total=g["total"], used=g["used"] + g["reserved"], free=free)
        if name == "nvmlDeviceGetBAR1MemoryInfo":
            return SimpleNamespace(bar1Total=g["bar1_total"], bar1Used=g["bar1_used"], bar1Free=0)
        if name == "nvmlDeviceGetComputeRunningProcesses":
            return [SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in g["procs"]]
        if name == "nvmlDeviceGetNumGpuCores":  # an H200: 132 SMs of 128 cores
            return 132 * 128
        if name == "nvmlDeviceGetCudaComputeCapability":
            return (9, 0)
        raise AssertionError(f"unexpected NVML call {name}")

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)


@pytest.fixture
def fake(monkeypatch):
    f = FakeNvml()
    monkeypatch.setattr(nvml, "nvml_query", f)
    return f


class Sink:
    def __init__(self) -> None:
        self.device: list[np.ndarray] = []
        self.process: list[np.ndarray] = []
        self.lock = threading.Lock()

    def __call__(self, device_rows: np.ndarray, process_rows: np.ndarray) -> None:
        assert device_rows.dtype == NVML_DTYPE and process_rows.dtype == PROCMEM_DTYPE
        with self.lock:
            if len(device_rows):
                self.device.append(device_rows)
            if len(process_rows):
                self.process.append(process_rows)

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        with self.lock:
            d = np.concatenate(self.device) if self.device else np.zeros(0, NVML_DTYPE)
            p = np.concatenate(self.process) if self.process else np.zeros(0, PROCMEM_DTYPE)
        return d, p


def _nvml_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_nvml_library_present(), reason="this host has NVML: the no-NVML path cannot be seen here")
def test_real_choke_point_without_nvml_says_why_in_one_line():
    # GIVEN this host (no libnvidia-ml.so.1) WHEN NVML is asked anything through the real choke point
    with pytest.raises(NvmlUnavailable) as info:
        nvml.nvml_query("nvmlDeviceGetCount")
    # THEN the reason is one line naming the library
    assert "libnvidia-ml.so.1" in str(info.value) and "\n" not in str(info.value)
    # AND list_gpus says the same (the result is cached: no retry per call)
    with pytest.raises(NvmlUnavailable, match="libnvidia-ml"):
        nvml.list_gpus()


def test_list_gpus(fake):
    # GIVEN two GPUs, the second without BAR1 information
    fake.failing["nvmlDeviceGetBAR1MemoryInfo"] = nvml.NVML_ERROR_NOT_SUPPORTED
    # WHEN they are listed
    gpus = nvml.list_gpus()
    # THEN index, UUID, name and total come from NVML; BAR1 is None when NVML cannot say
    assert [(g.index, g.uuid, g.name, g.total, g.bar1_total) for g in gpus] == [
        (0, "GPU-00000000-0000-0000-0000-000000000000", "NVIDIA H200", 141 * GiB, None),
        (1, "GPU-00000001-0000-0000-0000-000000000000", "NVIDIA H200", 141 * GiB, None),
    ]


def test_list_gpus_names_the_resident_threads_where_nvml_tells_them(fake):
    # GIVEN H200s (132 SMs, compute capability 9.0: 2,048 threads an SM), then one that cannot say
    assert [g.resident_threads for g in nvml.list_gpus()] == [132 * 2048, 132 * 2048]
    fake.failing["nvmlDeviceGetNumGpuCores"] = nvml.NVML_ERROR_NOT_SUPPORTED
    # THEN unknown is None (a stack limit is then only bounded)
    assert [g.resident_threads for g in nvml.list_gpus()] == [None, None]


def test_list_gpus_with_a_lost_gpu(fake):
    # GIVEN GPU 1 is lost
    fake.lost.add(1)
    gpus = nvml.list_gpus()
    # THEN it is listed, without a UUID, its error as the name
    assert gpus[0].uuid is not None
    assert gpus[1].uuid is None and "lost" in gpus[1].name and gpus[1].total == 0


def test_sampler_rows(fake):
    # GIVEN a sampler over two GPUs
    sink = Sink()
    s = NvmlSampler(sink, device_hz=10, process_hz=1, clock=lambda: 0)
    # WHEN the first tick runs
    s.tick(5_000)
    d, p = sink.rows()
    # THEN one device row per GPU with v2's used/reserved apart, and BAR1
    g = fake.gpus
    assert d.tolist() == [
        (5_000, i, g[i]["used"], g[i]["reserved"], g[i]["total"] - g[i]["used"] - g[i]["reserved"],
         g[i]["total"], g[i]["bar1_used"], g[i]["bar1_total"])
        for i in range(2)
    ]
    # AND one procmem row per (GPU, process); NVML's "not available" becomes -1
    assert p.tolist() == [(5_000, 0, 1000, 1 * GiB), (5_000, 0, 2000, -1), (5_000, 1, 1001, 2 * GiB), (5_000, 1, 2000, -1)]


def test_memory_v1_fallback_logged_once(fake, caplog):
    # GIVEN a driver without nvmlDeviceGetMemoryInfo v2
    fake.v2 = False
    sink = Sink()
    s = NvmlSampler(sink, device_hz=10, process_hz=0)
    with caplog.at_level(logging.INFO, logger="memrec.probes.nvml"):
        for t in range(5):
            s.tick(t * 100_000_000)
    d, _ = sink.rows()
    # THEN rows come from v1 (used includes reserved; reserved unknown) and v2 is tried once per GPU
    assert len(d) == 10
    assert (d["reserved"] == -1).all()
    assert d["used"][0] == fake.gpus[0]["used"] + fake.gpus[0]["reserved"]
    v2_calls = [c for c in fake.calls if c[0] == "nvmlDeviceGetMemoryInfo" and len(c) == 3]
    assert len(v2_calls) == 2
    assert caplog.text.count("v2 unsupported") == 2


def test_a_failing_call_is_logged_once_and_its_values_are_minus_one(fake, caplog):
    # GIVEN BAR1 information fails on every call
    fake.failing["nvmlDeviceGetBAR1MemoryInfo"] = 999
    sink = Sink()
    s = NvmlSampler(sink, device_hz=10, process_hz=0)
    with caplog.at_level(logging.WARNING, logger="memrec.probes.nvml"):
        for t in range(10):
            s.tick(t * 100_000_000)
    d, _ = sink.rows()
    # THEN memory rows still come, with -1 for BAR1, and each GPU's failure is logged once
    assert len(d) == 20 and (d["bar1_total"] == -1).all() and (d["used"] > 0).all()
    assert caplog.text.count("nvmlDeviceGetBAR1MemoryInfo") == 2


def test_gpu_lost_mid_run(fake, caplog):
    # GIVEN a sampler running on two GPUs
    sink = Sink()
    s = NvmlSampler(sink, device_hz=10, process_hz=10)
    s.tick(0)
    # WHEN GPU 1 falls off the bus
    fake.lost.add(1)
    with caplog.at_level(logging.WARNING, logger="memrec.probes.nvml"):
        for t in range(1, 6):
            s.tick(t * 100_000_000)
    d, p = sink.rows()
    # THEN GPU 0 keeps its samples, GPU 1 has none after the loss, and it is said once
    assert d["gpu"].tolist() == [0, 1] + [0] * 5
    assert set(p["gpu"][p["ts"] > 0].tolist()) == {0}
    assert caplog.text.count("no more NVML samples") == 1
    # AND the lost GPU is not asked again
    calls_after = [c for c in fake.calls if len(c) > 1 and isinstance(c[1], tuple) and c[1][1] == 1]
    assert len(calls_after) <= 6  # the tick-0 calls (3) + the one call that found it lost


def test_gpu_lost_does_not_end_the_thread(fake):
    # GIVEN a running sampler thread, at a high rate
    sink = Sink()
    s = NvmlSampler(sink, device_hz=200, process_hz=50)
    s.start()
    try:
        time.sleep(0.1)
        # WHEN GPU 0 is lost and a call starts failing
        fake.lost.add(0)
        fake.failing["nvmlDeviceGetComputeRunningProcesses"] = 999
        time.sleep(0.1)
        before = len(sink.rows()[0])
        time.sleep(0.1)
        # THEN the thread lives and keeps sampling GPU 1
        assert s._thread.is_alive()
        d, _ = sink.rows()
        assert len(d) > before
        assert d["gpu"][-1] == 1
    finally:
        s.stop()
    assert s._thread is None


def test_rates_are_respected_without_drift(fake):
    # GIVEN an injected clock and the default rates (10 Hz device, 1 Hz processes)
    sink = Sink()
    s = NvmlSampler(sink, device_hz=10, process_hz=1)
    # WHEN ten seconds pass, the loop waking at each deadline it is given, each wake a bit late
    now = 1_000_000_000
    end = now + 10_000_000_000
    while now < end:
        deadline = s.tick(now)
        now = deadline + 3_000_000  # 3 ms late every time
    # THEN 100 device ticks and 10 process ticks happened, on a 100 ms grid (lateness never adds up)
    assert s.device_ticks == 100 and s.process_ticks == 10
    d, p = sink.rows()
    offsets = (d["ts"].astype(np.int64) - 1_000_000_000) % 100_000_000
    assert offsets.max() <= 3_000_000
    assert len(np.unique(p["ts"])) == 10


def test_a_stall_skips_ticks_instead_of_bursting(fake):
    # GIVEN a sampler at 10 Hz
    sink = Sink()
    s = NvmlSampler(sink, device_hz=10, process_hz=0)
    assert s.tick(0) == 100_000_000
    # WHEN the thread stalls for 350 ms
    deadline = s.tick(450_000_000)
    # THEN one tick runs, and the next deadline is the next grid point (not four catch-up ticks)
    assert s.device_ticks == 2 and deadline == 500_000_000


def test_without_nvml_the_sampler_says_so_once_and_ends(fake, caplog, monkeypatch):
    # GIVEN NVML is unavailable
    monkeypatch.setattr(nvml, "_told_unavailable", False)
    fake.unavailable = "libnvidia-ml.so.1 not found (no NVIDIA driver on this host)"
    sink = Sink()
    s1 = NvmlSampler(sink)
    s2 = NvmlSampler(sink)
    with caplog.at_level(logging.WARNING, logger="memrec.probes.nvml"):
        # WHEN two samplers run
        assert s1.tick(0) is None
        s2.start()
        s2._thread.join(2)
    # THEN they end, produce nothing, and the host is told once
    assert not s2._thread.is_alive() and not s1.available and not s2.available
    assert sink.rows()[0].size == 0
    assert caplog.text.count("NVML unavailable") == 1
    s2.stop()


# ------------------------------------------------------------------------------ in the daemon


@pytest.fixture
def short_dir():
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="mrn", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _daemon(short_dir):
    from memrec.daemon.config import DaemonConfig
    from memrec.daemon.server import Daemon
    from tests.unit.daemon_fakes import FakeProbes

    config = DaemonConfig(
        output=short_dir / "t.mrec", socket_path=short_dir / "s.sock", nvml_device_hz=50, nvml_process_hz=20,
        poll_interval=0.01, flush_interval=0.05,
    )
    return Daemon(config, probes_factory=FakeProbes, find_libraries=lambda e: [], install_signals=False)


def _run(daemon, seconds):
    end = time.monotonic() + seconds
    daemon.run(until=lambda: time.monotonic() >= end)


def test_daemon_without_nvml_runs_without_samples_and_says_so_once(fake, short_dir, caplog, monkeypatch):
    # GIVEN no NVML library on the host (LibraryNotFound at the choke point)
    from memrec.trace.reader import load_trace

    monkeypatch.setattr(nvml, "_told_unavailable", False)
    fake.unavailable = "libnvidia-ml.so.1 not found (no NVIDIA driver on this host)"
    d = _daemon(short_dir)
    # WHEN the daemon runs
    with caplog.at_level(logging.INFO):
        d.start()
        try:
            _run(d, 0.2)
        finally:
            d.stop()
    # THEN it recorded a valid trace without samples, and said so once, in its header too
    trace = load_trace(d.files[0])
    assert trace.trailer is not None and len(trace.nvml) == 0 and len(trace.procmem) == 0
    assert trace.header["gpus"] == []
    assert any("NVML unavailable" in n for n in trace.header["notes"])
    assert caplog.text.count("NVML unavailable") == 1


def test_daemon_records_nvml_samples_and_gpus(fake, short_dir):
    # GIVEN two GPUs behind NVML
    from memrec.trace.reader import load_trace

    d = _daemon(short_dir)
    d.start()
    try:
        _run(d, 0.3)
    finally:
        d.stop()
    trace = load_trace(d.files[0])
    # THEN the header lists them and the trace holds device and process samples of both
    assert [g["uuid"] for g in trace.header["gpus"]] == [g["uuid"] for g in fake.gpus]
    assert set(trace.nvml["gpu"].tolist()) == {0, 1} and len(trace.nvml) >= 10
    assert set(trace.procmem["pid"].tolist()) == {1000, 1001, 2000}
    assert (np.diff(trace.nvml["ts"].astype(np.int64)) >= 0).all()


def test_daemon_corrects_a_gpu_map_that_nvml_contradicts(fake, short_dir):
    # GIVEN a worker started without CUDA_VISIBLE_DEVICES that set it to "1" itself before CUDA
    # started (/proc/PID/environ still shows no variable), and NVML lists it on GPU 1 only
    import subprocess
    import sys

    from memrec.terms.events import Kind
    from memrec.trace.reader import load_trace
    from tests.unit.daemon_fakes import FakeProbes
    from tests.unit.daemon_fakes import raw

    env = {k: v for k, v in __import__("os").environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    worker = subprocess.Popen([sys.executable, "-c", "import sys; print(1, flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    worker.stdout.readline()
    fake.gpus[0]["procs"] = []
    fake.gpus[1]["procs"] = [(worker.pid, 3 * GiB)]
    d = _daemon(short_dir)
    d.start()
    try:
        t = time.monotonic_ns()
        FakeProbes.instances[-1].push(raw(Kind.ALLOC, ts=t, pid=worker.pid, tid=worker.pid, ordinal=0, ptr=0x1000, size=MiB))
        _run(d, 0.1)
    finally:
        d.stop()
        worker.stdin.close()
        worker.wait()
    trace = load_trace(d.files[0])
    # THEN its ordinal 0 is GPU 1, and its process record says the map came from NVML
    assert trace.events["gpu"].tolist() == [1]
    info = trace.processes[worker.pid]
    assert info.gpu_map == [1] and info.gpu_map_source == "nvml"


def test_daemon_keeps_a_gpu_map_that_nvml_confirms(fake, short_dir):
    # GIVEN a process whose environ map (all GPUs) agrees with NVML (it is listed on GPUs 0 and 1)
    import os

    from memrec.terms.events import Kind
    from memrec.trace.reader import load_trace
    from tests.unit.daemon_fakes import FakeProbes
    from tests.unit.daemon_fakes import raw

    me = os.getpid()
    fake.gpus[0]["procs"] = [(me, GiB)]
    fake.gpus[1]["procs"] = [(me, GiB)]
    d = _daemon(short_dir)
    d.start()
    try:
        t = time.monotonic_ns()
        FakeProbes.instances[-1].push(
            raw(Kind.ALLOC, ts=t, pid=me, tid=me, ordinal=1, ptr=0x1000, size=MiB),
            raw(Kind.ALLOC, ts=t + 1, pid=me, tid=me, ordinal=0, ptr=0x2000, size=MiB),
        )
        _run(d, 0.1)
    finally:
        d.stop()
    trace = load_trace(d.files[0])
    # THEN nothing changes (CUDA_VISIBLE_DEVICES of this test process permitting)
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        assert trace.events["gpu"].tolist() == [1, 0]
        assert trace.processes[me].gpu_map_source == "environ"
