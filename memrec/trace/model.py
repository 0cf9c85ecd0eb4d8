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
        """The GPUs the header names."""
        return gpus_from_header(self.header)
