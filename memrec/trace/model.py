"""A whole trace in memory, as the analysis, the report and the TUI consume it."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

import numpy as np

from memrec.columns import EVENT_DTYPE
from memrec.columns import NVML_DTYPE
from memrec.columns import PROCMEM_DTYPE
from memrec.events import GpuInfo
from memrec.events import Marker
from memrec.events import ProcessInfo
from memrec.trace.format import gpus_from_header


@dataclass
class Keyframe:
    """The full live state at ``ts``, valid after the first ``event_index`` events."""

    ts: int
    event_index: int
    state: dict


@dataclass
class Trace:
    """Everything one ``.mrec`` file (or a live session so far) holds, decoded."""

    header: dict
    events: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=EVENT_DTYPE))
    nvml: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=NVML_DTYPE))
    procmem: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=PROCMEM_DTYPE))
    markers: list[Marker] = field(default_factory=list)
    processes: dict[int, ProcessInfo] = field(default_factory=dict)
    keyframes: list[Keyframe] = field(default_factory=list)
    lost: int = 0
    trailer: dict | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> list[GpuInfo]:
        """The GPUs the header names (NVML's list: empty on a host without NVML); entries a
        damaged file made unusable are left out."""
        return gpus_from_header(self.header)

    def gpu_ids(self) -> list[int]:
        """Every GPU the trace names: the header's and those its events and NVML samples name."""
        ids = GpuIds()
        ids.add_header(self.header)
        ids.add_column(self.events["gpu"])
        ids.add_column(self.nvml["gpu"])
        return ids.sorted()


class GpuIds:
    """The GPUs a trace names, gathered as it is read: the one place that says which GPUs a
    trace has, for every command that lists or filters GPUs (report, TUI).

    The header's list comes from NVML, so a trace recorded without it (no NVIDIA driver, the stub
    driver, ``memrec demo``) lists none there; its GPUs are known only from what its events and
    samples name. -1 (the host, or a GPU not resolved) is not a GPU.
    """

    def __init__(self) -> None:
        self._ids: set[int] = set()

    def add_header(self, header: dict) -> None:
        for g in gpus_from_header(header):
            if g.index >= 0:
                self._ids.add(g.index)

    def add_column(self, column: np.ndarray) -> None:
        """A ``gpu`` column of events or NVML samples (any length; counted, not sorted)."""
        column = np.asarray(column)
        named = column[column >= 0]
        if len(named):
            self._ids.update(np.flatnonzero(np.bincount(named.astype(np.intp))).tolist())

    def add(self, index: int) -> None:
        if index >= 0:
            self._ids.add(int(index))

    def __contains__(self, index: object) -> bool:
        return index in self._ids

    def sorted(self) -> list[int]:
        return sorted(self._ids)
