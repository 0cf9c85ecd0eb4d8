"""Snapshots in PyTorch's memory-snapshot format, for ``torch.cuda._memory_viz`` and pytorch.org/memory_viz.

PyTorch's format (``torch.cuda.memory._snapshot()``) describes one process: ``segments`` (what
the caching allocator holds from the driver at the snapshot, each with its ``blocks``) and
``device_traces`` (per device ordinal, the history of actions). memrec sees the driver, which is
exactly the allocator's segment level, so each process gets one snapshot:

- ``cuMemAlloc*`` / ``cuMemFree*`` are ``segment_alloc`` / ``segment_free`` (what ``cudaMalloc``
  / ``cudaFree`` of a segment are in PyTorch's own traces), each with an ``alloc`` /
  ``free_completed`` of the whole range so that the default "Active Memory Timeline" shows them;
- ``cuMemMap`` / ``cuMemUnmap`` (expandable segments and other VMM users) are ``segment_map`` /
  ``segment_unmap``, with ``alloc`` / ``free_completed`` likewise;
- a failed allocation with ``CUDA_ERROR_OUT_OF_MEMORY`` is an ``oom`` action (``device_free`` from
  the last NVML sample of that GPU before it, 0 when there is none);
- ``segments`` are the pieces still held at the end of the trace (one active block each).

The device index is the physical GPU (NVML index); ``time_us`` is the trace's clock in µs. The
one frame of each action names the driver call, the phase and the process (memrec has no Python
stacks): ``memrec:<phase>:cuMemAlloc_v2`` in memory_viz's stack panel.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from memrec.api import Recording
from memrec.analysis.names import api_name
from memrec.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.events import Kind
from memrec.state import DRIVER

_SEGMENT = {
    int(Kind.ALLOC): ("segment_alloc", "alloc"),
    int(Kind.FREE): ("segment_free", "free_completed"),
    int(Kind.VMM_MAP): ("segment_map", "alloc"),
    int(Kind.VMM_UNMAP): ("segment_unmap", "free_completed"),
}


def snapshots(rec: Recording) -> dict[int, dict]:
    """One PyTorch memory snapshot per process that touched GPU memory: pid -> snapshot dict."""
    ev = rec.timeline.events  # GPUs filled in by the replay (a free gets its allocation's GPU)
    labels = rec.events_array()["phase"]
    nv = rec.trace.nvml
    nv = nv[np.argsort(nv["ts"], kind="stable")] if len(nv) else nv
    out: dict[int, dict] = {}
    kinds = ev["kind"]
    relevant = np.isin(kinds, list(_SEGMENT)) & (ev["gpu"] >= 0)
    oom = (kinds == int(Kind.ALLOC)) & (ev["result"] == CUDA_ERROR_OUT_OF_MEMORY)
    freed = _freed_bytes(rec)
    for i in np.nonzero(relevant | oom)[0].tolist():
        e = ev[i]
        pid, gpu, kind = int(e["pid"]), int(e["gpu"]), int(e["kind"])
        snap = out.get(pid)
        if snap is None:
            snap = out[pid] = {"segments": [], "device_traces": [], "allocator_settings": {}}
        traces = snap["device_traces"]
        if gpu < 0:
            continue
        while len(traces) <= gpu:
            traces.append([])
        call = f"{api_name(int(e['api']))} ({rec.name_of(pid)})"
        frames = [{"filename": f"memrec:{labels[i]}", "line": 0, "name": call}]
        base = {"stream": 0, "time_us": int(e["ts"]) // 1000, "frames": frames}
        if oom[i]:
            free = _nvml_free_before(nv, gpu, int(e["ts"]))
            traces[gpu].append({**base, "action": "oom", "addr": 0, "size": int(e["size"]), "device_free": free})
            continue
        if int(e["result"]) != 0:
            continue
        addr = int(e["ptr"])
        size = int(e["size"])
        if kind == int(Kind.FREE):
            size = freed.get(i, 0)
            if not size:
                continue  # a free of memory from before the recording: no size to show
        segment_action, block_action = _SEGMENT[kind]
        if block_action == "free_completed":
            traces[gpu].append({**base, "action": "free_requested", "addr": addr, "size": size})
            traces[gpu].append({**base, "action": "free_completed", "addr": addr, "size": size})
            traces[gpu].append({**base, "action": segment_action, "addr": addr, "size": size})
        else:
            traces[gpu].append({**base, "action": segment_action, "addr": addr, "size": size})
            traces[gpu].append({**base, "action": block_action, "addr": addr, "size": size})
    state = rec.timeline.state
    live = [(h.pid, h.address, h.size, h.gpu, False) for h in state.holdings() if h.category == "driver"]
    live += [(p, va, size, g, True) for p, va, size, g in state.mappings()]
    for pid, addr, size, gpu, vmm in live:
        if pid not in out or gpu < 0:
            continue
        out[pid]["segments"].append(
            {
                "device": gpu, "address": addr, "total_size": size, "allocated_size": size,
                "active_size": size, "requested_size": size, "stream": 0, "segment_type": "large",
                "segment_pool_id": (0, 0), "is_expandable": vmm, "frames": [],
                "blocks": [{"address": addr, "size": size, "requested_size": size,
                            "state": "active_allocated", "frames": []}],
            }
        )
    return {p: s for p, s in out.items() if any(s["device_traces"]) or s["segments"]}


def _freed_bytes(rec: Recording) -> dict[int, int]:
    """Event index -> bytes a driver free released, from the replay's journal (a free names no size)."""
    j = rec.timeline.journal
    m = (j.category == DRIVER) & (j.delta < 0)
    return dict(zip(j.index[m].tolist(), (-j.delta[m]).tolist()))


def _nvml_free_before(nv: np.ndarray, gpu: int, ts: int) -> int:
    s = nv[(nv["gpu"] == gpu) & (nv["ts"] <= ts) & (nv["free"] >= 0)] if len(nv) else nv
    return int(s["free"][-1]) if len(s) else 0


def write_memory_viz(rec: Recording, path: Path, pid: int | None = None) -> list[Path]:
    """Write the snapshots: ``path`` itself for one process (or ``pid``), else ``<stem>.<pid><suffix>``
    beside it for each process. Returns the paths written (empty when no process used GPU memory)."""
    snaps = snapshots(rec)
    if pid is not None:
        snaps = {p: s for p, s in snaps.items() if p == pid}
    written = []
    for p, snap in sorted(snaps.items()):
        target = path if len(snaps) == 1 else path.with_name(f"{path.stem}.{p}{path.suffix or '.pickle'}")
        with open(target, "wb") as f:
            pickle.dump(snap, f)
        written.append(target)
    return written
