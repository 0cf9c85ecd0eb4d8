"""NVML as the daemon starts it: the GPU list and the sampler thread, each failure a note in the header.

Why: NVML is optional (a host without the driver, a container without the library, a GPU that
refuses a query), and the daemon records without it. Each way it can fail becomes one note in
the trace header, said once, and no thread is started for nothing.
"""

from __future__ import annotations

import logging
from typing import Any
from typing import Callable

import numpy as np

from memrec.base.errors import MemrecError
from memrec.daemon.config import DaemonConfig
from memrec.terms.events import GpuInfo

log = logging.getLogger(__name__)


def default_nvml() -> Any:
    """memrec's NVML module (imported here: pynvml is needed only once a daemon starts)."""
    from memrec.probes import nvml

    return nvml


def list_gpus(nvml: Any, notes: list[str]) -> list[GpuInfo]:
    """The host's GPUs through NVML; [] (with a note why) without NVML."""
    try:
        gpus = list(nvml.list_gpus())
    except nvml.NvmlUnavailable as error:
        nvml.note_unavailable(error)
        notes.append(f"NVML unavailable: {error}; no GPU list, no NVML samples")
        return []
    except MemrecError as error:
        log.warning("cannot list GPUs through NVML: %s", error)
        notes.append(f"NVML GPU list failed: {error}")
        return []
    if not gpus:
        notes.append("NVML reports no GPUs")
    return gpus


def start_sampler(
    nvml: Any, config: DaemonConfig, sink: Callable[[np.ndarray, np.ndarray], None], clock: Callable[[], int],
    notes: list[str],
) -> Any:
    """Start the NVML sampler's thread (calls ``sink(device_rows, process_rows)``); None when off or without NVML."""
    if not (config.nvml_device_hz or config.nvml_process_hz):
        notes.append("NVML sampling off")
        return None
    if any(n.startswith("NVML unavailable") for n in notes):
        return None  # said once already; no thread for nothing
    sampler = nvml.NvmlSampler(sink, config.nvml_device_hz, config.nvml_process_hz, clock=clock)
    sampler.start()
    return sampler
