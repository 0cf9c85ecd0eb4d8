"""NVML for the stub driver: what ``MEMREC_STUB_NVML_DIR`` files say each process uses.

The stub writes, per process, the bytes NVML would list on each physical device (its contexts,
device code, allocations and pool reserves). This module offers the part of
:mod:`memrec.probes.nvml` the daemon uses, reading those files, so the real daemon with real
probes records a real trace whose NVML side is the stub's.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.events import GpuInfo
from memrec.probes.nvml import NvmlError  # noqa: F401 - part of the interface the daemon uses
from memrec.probes.nvml import NvmlUnavailable  # noqa: F401


def _alive(pid: int) -> bool:
    """Running (a zombie has no context left: NVML no longer lists it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class StubNvml:
    """The daemon's NVML module, over the stub's per-process files.

    Args:
        directory: the stub's ``MEMREC_STUB_NVML_DIR``.
        gpus: physical devices of the stub (``MEMREC_STUB_DEVICES``).
    """

    NvmlUnavailable = NvmlUnavailable
    NvmlError = NvmlError

    def __init__(self, directory: Path, gpus: int = 2) -> None:
        self.directory = Path(directory)
        self.count = gpus
        self.calls = 0

    def list_gpus(self) -> list[GpuInfo]:
        return [GpuInfo(index=i, uuid=f"GPU-stub-{i}", name="stub", total=80 << 30) for i in range(self.count)]

    def note_unavailable(self, error: Exception) -> None:
        raise AssertionError(f"the stub's NVML is always available ({error})")

    def _listing(self) -> list[tuple[int, int, int]]:
        rows = []
        for f in self.directory.iterdir():
            if not f.name.isdigit() or not _alive(int(f.name)):
                continue
            try:
                text = f.read_text()
            except OSError:
                continue
            for line in text.splitlines():
                gpu, used = line.split()
                rows.append((int(gpu), int(f.name), int(used)))
        return rows

    def process_gpus(self, indices: list[int]) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for gpu, pid, _ in self._listing():
            if gpu in indices:
                out.setdefault(pid, set()).add(gpu)
        return out

    def process_memory(self, indices: list[int], now: int) -> np.ndarray:
        self.calls += 1
        rows = [(now, g, p, u) for g, p, u in self._listing() if g in indices]
        return np.array(rows, dtype=PROCMEM_DTYPE)

    def NvmlSampler(self, sink: Any, device_hz: float, process_hz: float, clock: Any) -> _Sampler:  # noqa: N802
        return _Sampler(self, sink, process_hz, clock)


class _Sampler:
    """The 1 Hz per-process sampler (device samples are not simulated)."""

    def __init__(self, nvml: StubNvml, sink: Any, process_hz: float, clock: Any) -> None:
        self.nvml, self.sink, self.clock = nvml, sink, clock
        self.period = 1.0 / process_hz if process_hz else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.period is None:
            return
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = self.clock()
            self.sink(np.zeros(0, NVML_DTYPE), self.nvml.process_memory(list(range(self.nvml.count)), now))
            self._stop.wait(self.period)

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def stub_env(directory: Path, pace_us: int = 60_000) -> dict[str, str]:
    """The environment that makes the stub write its NVML files and take its time."""
    env = dict(os.environ)
    env.update(MEMREC_STUB_NVML_DIR=str(directory), MEMREC_STUB_PACE_US=str(pace_us))
    return env


def wait_until(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
