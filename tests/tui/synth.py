"""A small scripted trace for the TUI tests and the docs' screenshots.

Two TP ranks on two GPUs start like an SGLang server: load weights, set up NCCL (VMM buffers and
an IPC exchange), then size the KV cache; rank 1's KV pool allocation fails (out of memory).
Markers give the phases; NVML samples run at 10 Hz; keyframes are real LiveState snapshots.
"""

from __future__ import annotations

import numpy as np

from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import empty_events
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.state import LiveState
from memrec.trace.model import Keyframe
from memrec.trace.model import Trace

GiB = 1 << 30
MiB = 1 << 20
T0 = 1_000_000_000_000  # CLOCK_MONOTONIC ns of the first event
SEC = 1_000_000_000
PIDS = (4101, 4102)
TOTAL = 140 * GiB


def header(n_gpus: int = 2) -> dict:
    return {
        "host": "h200-node",
        "gpus": [
            {"index": i, "uuid": f"GPU-5d1c{i}a7e-0b2f-4c1d-9e8a-00000000000{i}", "name": "NVIDIA H200", "total": TOTAL, "bar1_total": 256 * GiB}
            for i in range(n_gpus)
        ],
    }


class Script:
    """Appends events one by one (tests want exact, readable scenarios)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, ts: float, pid: int, kind: Kind, api: Api, gpu: int, ptr: int = 0, size: int = 0, handle: int = 0,
            result: int = 0, aux: int = 0, ipc: bytes | None = None) -> None:
        self.rows.append(dict(ts=T0 + int(ts * SEC), pid=pid, tid=pid, kind=int(kind), api=int(api), gpu=gpu, ptr=ptr,
                              size=size, handle=handle, result=result, aux=aux, ipc=ipc))

    def events(self) -> np.ndarray:
        self.rows.sort(key=lambda r: r["ts"])
        ev = empty_events(len(self.rows))
        for i, r in enumerate(self.rows):
            for k in ("ts", "pid", "tid", "kind", "api", "gpu", "ptr", "size", "handle", "result", "aux"):
                ev[k][i] = r[k]
            ev["ordinal"][i] = r["gpu"]
            if r["ipc"] is not None:
                ev["ipc"][i] = np.frombuffer(r["ipc"].ljust(64, b"\0"), dtype="V64")[0]
                ev["flags"][i] |= FLAG_IPC_BYTES
        return ev


def sglang_like(keyframe_every: float = 4.0, oom: bool = True, weights_gib: float = 60.0) -> Trace:
    """The scenario in the module docstring, over about 12 s."""
    s = Script()
    markers: list[Marker] = []

    def mark(ts: float, pid: int, gpu: int, name: str, phase: str, **values: object) -> None:
        markers.append(Marker(T0 + int(ts * SEC), pid, 0, pid, name, phase, gpu, dict(values)))

    for rank, pid in enumerate(PIDS):
        g = rank
        base = 0x7F00_0000_0000 + rank * 0x10_0000_0000
        off = rank * 0.05
        # context + a small driver allocation (cuBLAS workspace)
        s.add(0.2 + off, pid, Kind.CTX, Api.cuDevicePrimaryCtxRetain, g, handle=0xC0 + rank)
        s.add(0.3 + off, pid, Kind.ALLOC, Api.cuMemAlloc_v2, g, ptr=base, size=32 * MiB)
        # weights: 30 segments
        mark(0.5 + off, pid, g, "load_weights", "begin")
        seg = int(weights_gib * GiB / 30)
        for i in range(30):
            s.add(0.6 + off + i * 0.1, pid, Kind.ALLOC, Api.cuMemAlloc_v2, g, ptr=base + (i + 1) * 0x1_0000_0000, size=seg)
        mark(3.8 + off, pid, g, "load_weights", "end", weight_gib=weights_gib)
        # NCCL init: VMM buffers + an IPC exchange with the peer
        mark(4.0 + off, pid, g, "nccl_init", "begin")
        for i in range(4):
            h = 0x5500_0000 + rank * 0x100 + i
            va = base + 0x80_0000_0000 + i * 0x1000_0000
            s.add(4.1 + off + i * 0.05, pid, Kind.VMM_CREATE, Api.cuMemCreate, g, size=256 * MiB, handle=h, aux=1)
            s.add(4.12 + off + i * 0.05, pid, Kind.VMM_MAP, Api.cuMemMap, -1, ptr=va, size=256 * MiB, handle=h)
        ipc_ptr = base + 0x90_0000_0000
        s.add(4.4 + off, pid, Kind.ALLOC, Api.cuMemAlloc_v2, g, ptr=ipc_ptr, size=512 * MiB)
        s.add(4.45 + off, pid, Kind.IPC_EXPORT, Api.cuIpcGetMemHandle, g, ptr=ipc_ptr, ipc=bytes([rank + 1]) * 64)
        mark(5.0 + off, pid, g, "nccl_init", "end")
        # CUDA graphs workspace, freed and re-allocated
        mark(5.2 + off, pid, g, "cuda_graph", "begin")
        for i in range(6):
            p = base + 0xA0_0000_0000 + i * 0x1000_0000
            s.add(5.3 + off + i * 0.1, pid, Kind.ALLOC, Api.cuMemAlloc_v2, g, ptr=p, size=200 * MiB)
            if i % 2:
                s.add(5.35 + off + i * 0.1, pid, Kind.FREE, Api.cuMemFree_v2, -1, ptr=p)
        mark(6.2 + off, pid, g, "cuda_graph", "end")
        # KV cache sizing
        mark(6.5 + off, pid, g, "kv_cache", "begin", mem_fraction_static=0.88)
        kv = int((50 if rank == 0 else 90) * GiB)
        fail = oom and rank == 1
        s.add(7.0 + off, pid, Kind.ALLOC, Api.cuMemAlloc_v2, g, ptr=0 if fail else base + 0xB0_0000_0000, size=kv,
              result=2 if fail else 0)
        mark(7.2 + off, pid, g, "kv_cache", "end", rest_memory_gib=-3.2 if fail else 12.5)
    # each rank opens the other's IPC buffer
    for rank, pid in enumerate(PIDS):
        peer = 1 - rank
        s.add(4.6 + rank * 0.01, pid, Kind.IPC_OPEN, Api.cuIpcOpenMemHandle_v2, rank, ptr=0x7E00_0000_0000 + rank * 0x1000_0000,
              ipc=bytes([peer + 1]) * 64, aux=1)
    # rank 1 exits after the OOM (implicit free)
    if oom:
        s.add(9.0, PIDS[1], Kind.PROC_EXIT, Api.sched_process_exit, -1)
    events = s.events()

    # NVML at 10 Hz: traced owned + 600 MiB context + 1 GiB untraced slack, lagging 50 ms
    state = LiveState()
    nv = []
    ev_i = 0
    for tick in range(0, 121):
        t = T0 + tick * SEC // 10
        while ev_i < len(events) and events["ts"][ev_i] <= t - SEC // 20:
            state.apply(events[ev_i : ev_i + 1].copy())
            ev_i += 1
        for g in range(2):
            owned = state.owned_bytes(gpu=g)
            used = owned + (600 * MiB + GiB if owned or tick > 3 else 0)
            nv.append((t, g, used, 615 * MiB, TOTAL - used, TOTAL, 40 * MiB + owned // 64, 256 * GiB))
    nvml = np.array(nv, dtype=NVML_DTYPE)

    # keyframes: real snapshots, at event indices
    keyframes = []
    st = LiveState()
    last = 0
    next_kf = T0
    for i in range(len(events) + 1):
        if i == len(events) or events["ts"][i] >= next_kf:
            st.apply(events[last:i].copy())
            last = i
            ts = int(events["ts"][i - 1]) if i else T0
            keyframes.append(Keyframe(ts, i, st.snapshot()))
            next_kf += int(keyframe_every * SEC)
    processes = {
        pid: ProcessInfo(pid, 4000, ["python", "-m", "sglang.launch_server", "--tp", "2"], "/usr/bin/python3", str(r), [r], T0, {"tp": r})
        for r, pid in enumerate(PIDS)
    }
    return Trace(header=header(), events=events, nvml=nvml, markers=markers, processes=processes,
                 keyframes=keyframes, lost=0, trailer={"type": "trailer", "end_ts": T0 + 12 * SEC, "lost": 0})


def without_nvml(trace: Trace) -> Trace:
    """``trace`` as a host without NVML records it: no GPU list in the header, no samples (the
    GPUs are named only by the events, as in every stub-driver and ``memrec demo`` trace)."""
    header = {k: v for k, v in trace.header.items() if k != "gpus"} | {"gpus": []}
    return Trace(header=header, events=trace.events, markers=trace.markers, processes=trace.processes,
                 keyframes=trace.keyframes, lost=trace.lost, trailer=trace.trailer)


def write_trace(path, trace: Trace) -> None:
    """Write ``trace`` with the real writer (keyframes at their event indices)."""
    from memrec.trace.writer import TraceWriter

    with TraceWriter(path, trace.header) as w:
        for p in trace.processes.values():
            w.write_process(p)
        ev = trace.events
        kfs = sorted(trace.keyframes, key=lambda k: k.event_index)
        done = 0
        markers = sorted(trace.markers, key=lambda m: m.ts)
        mi = 0
        for k in kfs:
            w.write_events(ev[done : k.event_index])
            while mi < len(markers) and (k.event_index >= len(ev) or markers[mi].ts <= ev["ts"][k.event_index - 1 if k.event_index else 0]):
                w.write_marker(markers[mi])
                mi += 1
            done = k.event_index
            w.write_keyframe(k.ts, k.event_index, k.state)
        w.write_events(ev[done:])
        for m in markers[mi:]:
            w.write_marker(m)
        w.write_nvml(trace.nvml)
        if len(trace.procmem):
            w.write_procmem(trace.procmem)
