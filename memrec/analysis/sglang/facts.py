"""Facts around the KV budget that explain real SGLang startup failures, from one trace.

Each function reads the hooks' markers and the probes' events and returns typed rows
(:class:`~memrec.analysis.sections.Section`: the JSON of the SGLang section's summary) for the
SGLang section of ``memrec report`` and for ``memrec diff``'s verdict (the ``*_line`` functions
render one). SGLang's own marker values pass through as :func:`jsonable` values:

- :func:`torch_reserved_delta`: per phase, what PyTorch's caching allocator reserved (the
  rest of the driver bytes came from NCCL, the custom all-reduce, libraries, contexts);
- :func:`process_contexts`: every CUDA context per process and GPU, foreign ones flagged;
- :func:`custom_ar_facts`: what the custom all-reduce was (class, world size, NVLink, disabled,
  IPC-shared buffers);
- :func:`ooms_after_sizing`: CUDA out-of-memory after the KV sizing (the slack was too small);
- :func:`markers_dropped`: markers a process's client could not send.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from memrec.engine.phases import NO_PHASE
from memrec.engine.phases import Phases
from memrec.client import DROP_REASONS
from memrec.client import DROPPED_MARKER
from memrec.terms.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.terms.events import Kind
from memrec.analysis.sections import Section
from memrec.analysis.sglang.kv_budget import any_named
from memrec.analysis.text import scalar
from memrec.state.batch import Batch


def jsonable(v: Any) -> Any:
    """A marker's value as JSON: containers converted, numpy scalars as Python's, anything else
    that JSON has no type for as its text."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


@dataclass
class OomAfterSizing(Section):
    """A driver allocation that ran out of memory after its process's KV sizing, with the
    process's slack and fractions (None without a target budget)."""

    pid: int
    label: str
    ts: int
    size: int
    gpu: int | None
    phase: str
    slack_gib: float | None
    mem_fraction_static: float | None
    min_mem_fraction_static: float | None


@dataclass
class NcclVmm(Section):
    """The cuMem bytes one rank's dist_init took outside the custom all-reduce (NCCL's buffers)."""

    pid: int
    label: str
    gpu: int | None
    bytes: int


@dataclass
class ProcessContext(Section):
    """A CUDA context of a process on a GPU: the most NVML said it used there (None: not
    sampled), whether memrec saw it allocate there, its own GPU, and whether it is ``foreign``."""

    pid: int
    label: str
    gpu: int
    nvml_peak: int | None
    allocated: bool
    own_gpu: int | None
    foreign: bool


@dataclass
class CustomAllReduce(Section):
    """What the custom all-reduce was (the hooks' marker values, each list sorted and distinct)."""

    switched_off: list[bool]
    classes: list
    world_size: list
    full_nvlink: list
    disabled: list
    max_size: list
    ranks_built: int
    errors: list[str]
    shared_buffer_bytes: list[int]


@dataclass
class MarkersDropped(Section):
    """The markers one process's client dropped, in all and per reason (cumulative counts)."""

    pid: int
    label: str
    dropped: int
    reasons: dict[str, int]


def torch_reserved_delta(markers: list) -> dict[tuple[int, int, str], int]:
    """``(pid, begin ts, name)`` → the change in PyTorch's reserved bytes over that span, from the
    hooks' begin and end markers (both must carry ``torch_reserved_bytes`` of the same device).

    The driver bytes of a phase minus this is what came from outside PyTorch's caching
    allocator: NCCL, the custom all-reduce's cudaMalloc, cuBLAS/cuDNN workspaces, CUDA graphs'
    private memory outside the pool, contexts."""
    open_: dict[tuple[int, str], list] = {}
    out = {}
    for m in sorted(markers, key=lambda m: m.ts):
        if m.phase == "begin":
            open_.setdefault((m.pid, m.name), []).append(m)
        elif m.phase == "end" and open_.get((m.pid, m.name)):
            b = open_[(m.pid, m.name)].pop()
            x, y = b.values.get("torch_reserved_bytes"), m.values.get("torch_reserved_bytes")
            same = b.values.get("cuda_device") == m.values.get("cuda_device")
            if isinstance(x, int) and isinstance(y, int) and same:
                out[(m.pid, b.ts, m.name)] = y - x
    return out


def ooms_after_sizing(trace: Any, phases: Phases, times: dict, labels: dict[int, str],
                      budgets: list, events: Any = None) -> list[OomAfterSizing]:
    """Driver allocations that failed with CUDA_ERROR_OUT_OF_MEMORY in an SGLang process after
    its KV sizing: the pools fit, but what came after (graphs, workspaces, the first batches)
    did not fit in the slack (sgl-project/sglang#4330: "Not enough memory" at one fraction,
    CUDA OOM at the next). ``events``: the trace's (default ``trace.event_columns``)."""
    ev = Batch.of(trace.event_columns if events is None else events)  # columns: no 130-byte rows built
    if not len(ev) or not times:
        return []
    failed = ev[(ev["kind"] == int(Kind.ALLOC)) & (ev["result"] == CUDA_ERROR_OUT_OF_MEMORY)]
    slack = {b.pid: b for b in budgets if not b.draft}
    out = []
    for e in failed:
        pid, ts = int(e["pid"]), int(e["ts"])
        t = times.get(pid)
        if t is None or t.sizing_ts is None or ts < t.sizing_ts:
            continue
        b = slack.get(pid)
        ph = phases.phase_at(pid, ts)
        out.append(OomAfterSizing(
            pid=pid, label=labels.get(pid, ""), ts=ts, size=int(e["size"]),
            gpu=None if int(e["gpu"]) < 0 else int(e["gpu"]),
            phase=phases.phases[ph].path if ph >= 0 else NO_PHASE,
            slack_gib=jsonable(b.slack_gib) if b else None,
            mem_fraction_static=jsonable(b.mem_fraction_static) if b else None,
            min_mem_fraction_static=jsonable(b.min_mem_fraction_static) if b else None,
        ))
    return out


def oom_line(o: OomAfterSizing, human) -> str:
    who = o.label or f"pid {o.pid}"
    line = f"  CUDA out of memory after the KV sizing: {who} in {o.phase} asked for {human(o.size)}"
    if o.slack_gib is not None and o.mem_fraction_static is not None:
        line += (f"; the slack left for everything after the pools was {o.slack_gib:.2f} GiB "
                 f"(--mem-fraction-static {o.mem_fraction_static:.3f})")
        if o.min_mem_fraction_static is not None:
            line += (f": a smaller fraction leaves more, but it must stay above "
                     f"{o.min_mem_fraction_static:.4f} for the pools to fit")
    return line


def nccl_vmm(ranks: list[tuple[int, str, list[tuple[str, str, int | None, dict[str, int]]]]]) -> list[NcclVmm]:
    """Per rank, the cuMem (VMM) memory its ``dist_init`` phase took outside the custom
    all-reduce's own span: NCCL's buffers (NCCL allocates with cuMem when NCCL_CUMEM_ENABLE is on,
    the default since NCCL 2.19), before the memory baseline, so they lower the slack.

    ``ranks``: ``(pid, label, phases)``, each phase ``(kind, name, gpu, bytes by category)``."""
    out = []
    for pid, label, rows in ranks:
        for kind, name, gpu, by_category in rows:
            vmm = by_category.get("vmm", 0) if kind == "phase" and name == "dist_init" else 0
            if vmm > 0:
                out.append(NcclVmm(pid, label, gpu, jsonable(vmm)))
    return out


def nccl_line(rows: list[NcclVmm], human) -> str:
    who = ", ".join(f"{r.label or 'pid ' + str(r.pid)} {human(r.bytes)}" for r in rows)
    return f"  NCCL's buffers (cuMem VMM in dist_init, outside the custom all-reduce; before the baseline): {who}"


def process_contexts(trace: Any, pids: Iterable[int], gpus_of: dict[int, int],
                     labels: dict[int, str], events: Any = None) -> list[ProcessContext]:
    """Every CUDA context of the given processes, per GPU: where NVML listed the process (its
    per-process samples) or the probes saw a context bound (CTX events). ``nvml_peak`` is the
    most NVML said the process used there; ``allocated`` whether memrec saw it allocate there.
    A context on a GPU that is not the rank's own and holds no allocation of its own is
    ``foreign``: a context only (IPC, or a library touching another device), ~500 MiB of that
    GPU's memory that the process never computes with (sgl-project/sglang#1533, #4233).
    ``events``: the trace's (default ``trace.event_columns``)."""
    pids = set(pids)
    seen: dict[tuple[int, int], int | None] = {}  # (pid, GPU) -> the most NVML said it used there
    pm = trace.procmem
    for pid in pids:
        if len(pm):
            rows = pm[(pm["pid"] == pid) & (pm["used"] > 0)]
            for g in np.unique(rows["gpu"]):
                used = rows["used"][rows["gpu"] == g]
                seen[(pid, int(g))] = int(used.max())
    ev = Batch.of(trace.event_columns if events is None else events)  # columns: no 130-byte rows built
    if len(ev):
        mine = ev[np.isin(ev["pid"], list(pids)) & (ev["gpu"] >= 0)]
        ctx = mine[mine["kind"] == int(Kind.CTX)]
        for pid, g in {(int(a), int(b)) for a, b in zip(ctx["pid"], ctx["gpu"])}:
            seen.setdefault((pid, g), None)
        allocs = mine[np.isin(mine["kind"], [int(Kind.ALLOC), int(Kind.VMM_CREATE)]) & (mine["result"] == 0)]
        allocated = {(int(a), int(b)) for a, b in zip(allocs["pid"], allocs["gpu"])}
    else:
        allocated = set()
    out = []
    for (pid, g), peak in sorted(seen.items()):
        own = gpus_of.get(pid)
        out.append(ProcessContext(
            pid=pid, label=labels.get(pid, ""), gpu=g, nvml_peak=peak, allocated=(pid, g) in allocated,
            own_gpu=jsonable(own), foreign=own is not None and g != own and (pid, g) not in allocated,
        ))
    return out


def contexts_line(ctxs: list[ProcessContext], human) -> str | None:
    foreign = [c for c in ctxs if c.foreign]
    if not foreign:
        return None
    parts = []
    for c in foreign:
        cost = f"NVML {human(c.nvml_peak)}" if c.nvml_peak is not None else "NVML cost not sampled"
        parts.append(f"{c.label or 'pid ' + str(c.pid)} on GPU {c.gpu} ({cost})")
    return "  foreign CUDA contexts (a rank's context on a GPU it does not compute on): " + ", ".join(parts)


#: The names without which :func:`custom_ar_facts` finds nothing.
_CUSTOM_AR = frozenset({"dist_init", "custom_ar_init", "custom_ar_shared_buffer"})


def custom_ar_facts(markers: list) -> CustomAllReduce | None:
    """What the custom all-reduce was, from the hooks' markers: whether it was switched off
    (``--disable-custom-all-reduce``), which class each rank built, the world size, NVLink,
    whether SGLang disabled it itself (e.g. more than 2 PCIe-only GPUs), and the bytes of
    IPC-shared buffers each rank allocated (legacy ``create_shared_buffer``)."""
    if not any_named(markers, _CUSTOM_AR):  # (three passes over a step loop's 50,000 markers)
        return None
    switched_off = sorted({bool(m.values["disable_custom_all_reduce"]) for m in markers
                           if m.name == "dist_init" and "disable_custom_all_reduce" in m.values})
    inits = [m for m in markers if m.name == "custom_ar_init" and m.phase == "end"]
    buffers: dict[int, int] = {}
    for m in markers:
        size = m.values.get("size_in_bytes")
        if m.name == "custom_ar_shared_buffer" and isinstance(size, int) and not isinstance(size, bool):
            buffers[m.pid] = buffers.get(m.pid, 0) + size
    if not inits and not switched_off and not buffers:
        return None

    def values(key: str) -> list:
        return jsonable(sorted({m.values[key] for m in inits if m.values.get(key) is not None}, key=str))

    return CustomAllReduce(
        switched_off=switched_off,
        classes=values("custom_ar_class"),
        world_size=values("world_size"),
        full_nvlink=values("full_nvlink"),
        disabled=values("disabled"),
        max_size=values("max_size"),
        ranks_built=len({m.pid for m in inits}),
        errors=sorted({str(m.values["error"]) for m in inits if m.values.get("error")}),
        shared_buffer_bytes=sorted(set(buffers.values())),
    )


def custom_ar_line(c: CustomAllReduce, human) -> str:
    if c.switched_off == [True] and not c.classes:
        return "  custom all-reduce: off (--disable-custom-all-reduce): NCCL only"
    if not c.ranks_built:
        return "  custom all-reduce: not built (no custom_ar_init marker)"
    parts = [f"{'/'.join(c.classes) or 'built'} on {c.ranks_built} rank(s)"]
    for values, name in ((c.world_size, "world size"), (c.full_nvlink, "full_nvlink"), (c.disabled, "disabled")):
        if values:
            parts.append(f"{name} {'/'.join(scalar(v) for v in values)}")
    if c.disabled == [True]:
        parts.append("SGLang disabled it after building it (NCCL does the all-reduce)")
    if c.shared_buffer_bytes:
        parts.append("IPC-shared buffers " + "/".join(human(b) for b in c.shared_buffer_bytes) + " per rank")
    if c.errors:
        parts.append("failed: " + " | ".join(c.errors))
    return "  custom all-reduce: " + ", ".join(parts)


def markers_dropped(markers: list, labels: dict[int, str]) -> list[MarkersDropped]:
    """Per process, the markers its client dropped (the last ``markers_dropped`` report: the
    counts are cumulative), e.g. sent before the daemon was up or into a full socket."""
    last: dict[int, Any] = {}
    for m in markers:
        if m.name == DROPPED_MARKER and (m.pid not in last or m.ts >= last[m.pid].ts):
            last[m.pid] = m
    return [
        MarkersDropped(p, labels.get(p, ""), int(m.values.get("dropped") or 0),
                       {r: int(m.values.get(r) or 0) for r in DROP_REASONS})
        for p, m in sorted(last.items())
    ]


# ----------------------------------------------------------------------------------------- render
