"""numpy views of the event columns declared in :mod:`memrec.terms.events`."""

from __future__ import annotations

import numpy as np

from memrec.terms.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.terms.events import EVENT_COLUMNS
from memrec.terms.events import QUIET_FAILURE_KINDS
from memrec.terms.events import RAW_COLUMNS

#: One raw record as the BPF program writes it (payload of a ring-buffer record, 128 bytes).
RAW_DTYPE = np.dtype(list(RAW_COLUMNS))
#: One event as the daemon, the trace and the analysis hold it.
EVENT_DTYPE = np.dtype(list(EVENT_COLUMNS))

assert RAW_DTYPE.itemsize == 128, "RAW_COLUMNS must match struct event in probes/cuda.bpf.c"


def with_gpu(raw: np.ndarray, gpu: np.ndarray | int = -1) -> np.ndarray:
    """Return raw records as events, with the physical GPU column set to ``gpu`` (and no stack)."""
    out = np.empty(len(raw), dtype=EVENT_DTYPE)
    for name in RAW_DTYPE.names:
        out[name] = raw[name]
    out["gpu"] = gpu
    out["stack"] = 0
    return out


def empty_events(n: int = 0) -> np.ndarray:
    """Return a zeroed event array of length ``n`` (ordinal and gpu set to -1)."""
    out = np.zeros(n, dtype=EVENT_DTYPE)
    out["ordinal"] = -1
    out["gpu"] = -1
    return out

#: One NVML device-memory sample (10 Hz by default). -1 where NVML gave no value.
NVML_DTYPE = np.dtype(
    [
        ("ts", "<u8"),
        ("gpu", "<i2"),
        ("used", "<i8"),
        ("reserved", "<i8"),
        ("free", "<i8"),
        ("total", "<i8"),
        ("bar1_used", "<i8"),
        ("bar1_total", "<i8"),
    ]
)

#: One NVML per-process sample (1 Hz by default): a process's used memory on one GPU.
PROCMEM_DTYPE = np.dtype([("ts", "<u8"), ("gpu", "<i2"), ("pid", "<u4"), ("used", "<i8")])


_QUIET = np.array([int(k) for k in QUIET_FAILURE_KINDS], dtype=np.uint16)


def failed_calls(events: np.ndarray) -> np.ndarray:
    """Mask of the events that are failed calls as reports count them: a CUresult other than
    success, except the expected failures of code and pool calls (QUIET_FAILURE_KINDS) that are
    not out of memory."""
    failed = events["result"] != 0
    quiet = np.isin(events["kind"], _QUIET) & (events["result"] != CUDA_ERROR_OUT_OF_MEMORY)
    return failed & ~quiet
