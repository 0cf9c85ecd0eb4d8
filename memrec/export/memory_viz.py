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
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from memrec._files import create_file
from memrec.api import Recording
from memrec.analysis.names import api_name
from memrec.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.events import DRIVER
from memrec.events import Kind

#: Actions kept per process and device, the latest (``--max-entries``).
MAX_ENTRIES = 100_000
_FREE = int(Kind.FREE)

_SEGMENT = {
    int(Kind.ALLOC): ("segment_alloc", "alloc"),
    int(Kind.FREE): ("segment_free", "free_completed"),
    int(Kind.VMM_MAP): ("segment_map", "alloc"),
    int(Kind.VMM_UNMAP): ("segment_unmap", "free_completed"),
}


def snapshots(rec: Recording, max_entries: int = MAX_ENTRIES) -> tuple[dict[int, dict], int]:
    """One PyTorch memory snapshot per process that touched GPU memory: pid -> snapshot dict.

    Each device trace keeps its last ``max_entries`` actions (PyTorch's own history is a ring
    buffer too; memory_viz draws every entry, and a browser stalls on millions). Returns the
    snapshots and how many actions were left out.
    """
    ev = rec.timeline.events  # GPUs filled in by the replay (a free gets its allocation's GPU)
    nv = rec.trace.nvml
    nv = nv[np.argsort(nv["ts"], kind="stable")] if len(nv) else nv
    kinds = ev["kind"]
    oom_mask = (kinds == int(Kind.ALLOC)) & (ev["result"] == CUDA_ERROR_OUT_OF_MEMORY) & (ev["gpu"] >= 0)
    ok_mask = np.isin(kinds, list(_SEGMENT)) & (ev["gpu"] >= 0) & (ev["result"] == 0)
    sel = np.nonzero(ok_mask | oom_mask)[0]
    phase = rec.phases.assign(ev["pid"][sel].astype(np.int64), ev["ts"][sel].astype(np.int64))
    freed = _freed_bytes(rec)
    traces: dict[tuple[int, int], deque] = {}
    made = 0
    frames_of: dict[tuple[int, int, int], list] = {}  # one frames list per (pid, api, phase): pickled once
    cols = zip(sel.tolist(), ev["pid"][sel].tolist(), ev["gpu"][sel].tolist(), ev["kind"][sel].tolist(),
               ev["api"][sel].tolist(), ev["ts"][sel].tolist(), ev["ptr"][sel].tolist(), ev["size"][sel].tolist(),
               oom_mask[sel].tolist(), phase.tolist())
    for i, pid, gpu, kind, api, ts, addr, size, oom, ph in cols:
        frames = frames_of.get((pid, api, ph))
        if frames is None:
            call = f"{api_name(api)} ({rec.name_of(pid)})"
            frames = frames_of[(pid, api, ph)] = [{"filename": f"memrec:{rec.phases.label(ph)}", "line": 0,
                                                   "name": call}]
        out = traces.get((pid, gpu))
        if out is None:
            out = traces[(pid, gpu)] = deque(maxlen=max_entries)
        base = {"stream": 0, "time_us": ts // 1000, "frames": frames}
        if oom:
            free = _nvml_free_before(nv, gpu, ts)
            out.append({**base, "action": "oom", "addr": 0, "size": size, "device_free": free})
            made += 1
            continue
        if kind == _FREE:
            size = freed.get(i, 0)
            if not size:
                continue  # a free of memory from before the recording: no size to show
        segment_action, block_action = _SEGMENT[kind]
        if block_action == "free_completed":
            actions = ("free_requested", "free_completed", segment_action)
        else:
            actions = (segment_action, block_action)
        for action in actions:
            out.append({**base, "action": action, "addr": addr, "size": size})
        made += len(actions)
    snaps: dict[int, dict] = {}
    kept = 0
    for (pid, gpu), actions in sorted(traces.items()):
        snap = snaps.setdefault(pid, {"segments": [], "device_traces": [], "allocator_settings": {}})
        while len(snap["device_traces"]) <= gpu:
            snap["device_traces"].append([])
        snap["device_traces"][gpu] = list(actions)
        kept += len(actions)
    state = rec.timeline.state
    live = [(h.pid, h.address, h.size, h.gpu, False) for h in state.holdings() if h.category == "driver"]
    live += [(p, va, size, g, True) for p, va, size, g in state.mappings()]
    for pid, addr, size, gpu, vmm in live:
        if pid not in snaps or gpu < 0:
            continue
        snaps[pid]["segments"].append(
            {
                "device": gpu, "address": addr, "total_size": size, "allocated_size": size,
                "active_size": size, "requested_size": size, "stream": 0, "segment_type": "large",
                "segment_pool_id": (0, 0), "is_expandable": vmm, "frames": [],
                "blocks": [{"address": addr, "size": size, "requested_size": size,
                            "state": "active_allocated", "frames": []}],
            }
        )
    return snaps, made - kept


def _freed_bytes(rec: Recording) -> dict[int, int]:
    """Event index -> bytes a driver free released, from the replay's journal (a free names no size)."""
    j = rec.timeline.journal
    m = (j.category == DRIVER) & (j.delta < 0)
    return dict(zip(j.index[m].tolist(), (-j.delta[m]).tolist()))


def _nvml_free_before(nv: np.ndarray, gpu: int, ts: int) -> int:
    s = nv[(nv["gpu"] == gpu) & (nv["ts"] <= ts) & (nv["free"] >= 0)] if len(nv) else nv
    return int(s["free"][-1]) if len(s) else 0


def write_memory_viz(rec: Recording, path: Path, pid: int | None = None, max_entries: int = MAX_ENTRIES,
                     check: Callable[[Path], None] | None = None) -> tuple[list[Path], int]:
    """Write the snapshots: ``path`` itself for one process (or ``pid``), else ``<stem>.<pid><suffix>``
    beside it for each process. Returns the paths written (empty when no process used GPU memory)
    and how many early actions were left out (see :func:`snapshots`). ``check`` sees every path
    before the first is written (it raises to refuse one: the names depend on the trace's processes)."""
    snaps, dropped = snapshots(rec, max_entries)
    if pid is not None:
        snaps = {p: s for p, s in snaps.items() if p == pid}
    targets = {path if len(snaps) == 1 else path.with_name(f"{path.stem}.{p}{path.suffix or '.pickle'}"): snap
               for p, snap in sorted(snaps.items())}
    for target in targets if check else ():
        check(target)
    for target, snap in targets.items():
        with create_file(target) as f:
            pickle.dump(snap, f)
    return list(targets), dropped
