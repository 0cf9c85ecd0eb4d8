"""Thin stand-ins at the daemon's seams for unit tests (no BPF): probes and library discovery.

Everything else the daemon uses (sockets, /proc, the writer, the live state, NVML's code above
its choke point) is real in the tests that use these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from dataclasses import field

import numpy as np

from memrec.terms.columns import RAW_DTYPE
from memrec.terms.events import API_KIND
from memrec.terms.events import Api
from memrec.terms.events import Kind


@dataclass(frozen=True)
class FakeReport:
    path: str
    dev: int
    inode: int
    attached: tuple[str, ...] = ("cuMemAlloc_v2", "cuMemFree_v2")
    missing: dict = field(default_factory=lambda: {"cuMemAllocAsync_ptsz": "not exported by this driver"})
    already_attached: bool = False


@dataclass(frozen=True)
class FakeLibrary:
    path: str
    dev: int
    inode: int


class FakeProbes:
    """CudaProbes' interface over a queue of raw records the test pushes."""

    instances: list[FakeProbes] = []

    def __init__(self, follow_tree: bool = False, ringbuf_pages: int = 1024, tensors: bool = False) -> None:
        self.follow_tree = follow_tree
        self.ringbuf_pages = ringbuf_pages
        self.loaded = False
        self.closed = False
        self.attached: list[str] = []
        self.tracked: list[int] = []
        self.queue: list[np.ndarray] = []
        self.lost_total = 0
        self.polls = 0
        FakeProbes.instances.append(self)

    def load(self) -> FakeProbes:
        self.loaded = True
        return self

    def attach_library(self, path, identity=None) -> FakeReport:
        assert self.loaded and not self.closed
        self.attached.append(os.fspath(path))
        dev, inode = identity or (0, 0)
        return FakeReport(os.fspath(path), dev, inode)

    def attach_torch(self, path, identity=None, pids=()):
        """As CudaProbes.attach_torch on a libc10_cuda.so with PyTorch's three probe sites (in the
        processes ``pids`` only, when named)."""
        from memrec.probes.cuda import TorchReport

        assert self.loaded and not self.closed
        dev, inode = identity or (0, 0)
        return TorchReport(os.fspath(path), dev, inode, attached=("malloc", "free", "free"))

    def attached_libraries(self) -> list[FakeReport]:
        return [FakeReport(p, 0, 0) for p in self.attached]

    def track_pid(self, pid: int) -> None:
        self.tracked.append(pid)

    def push(self, *rows: np.ndarray) -> None:
        self.queue.append(np.concatenate(rows) if rows else np.zeros(0, RAW_DTYPE))

    def poll(self) -> np.ndarray:
        assert not self.closed, "poll() after close()"
        self.polls += 1
        if not self.queue:
            return np.zeros(0, RAW_DTYPE)
        out = np.concatenate(self.queue)
        self.queue.clear()
        return out

    def lost(self) -> int:
        return self.lost_total

    def close(self) -> None:
        self.closed = True


def raw(kind: Kind, *, api: Api | None = None, **fields) -> np.ndarray:
    """One RAW_DTYPE record (ordinal -1 unless given)."""
    row = np.zeros(1, RAW_DTYPE)
    row["kind"] = int(kind)
    row["api"] = int(api if api is not None else next(a for a, k in API_KIND.items() if k == kind))
    row["ordinal"] = -1
    for key, value in fields.items():
        row[key] = value
    return row
