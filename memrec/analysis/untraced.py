"""The untraced band split into what it is: contexts, device code, pools, what came before.

NVML's per-process ``used`` minus the traced bytes (:mod:`memrec.analysis.reconcile`) is one number
that hides four things, measured on an H200 (docs/validation/untraced-explore.md):

- **context**: a context costs ~520 MiB at creation (cuDevicePrimaryCtxRetain, cuCtxCreate*), and
  ~90 MiB more at its first kernel launch (lazy loading's first step, also under EAGER): the NVML
  step over a context bind, and the step over the first kernel fetched into it, are the context's;
- **module code**: kernels reach the device when fetched into a context (cuLibraryGetKernel,
  cuKernelGetFunction, once per kernel) or loaded with a module (cuModuleLoad*); NCCL's kernels
  were +262 MiB. Steps over those calls (and unloads) are module code;
- **pools**: a stream-ordered pool keeps freed blocks up to its release threshold until a trim or
  its destruction. Modelled from the events: ``held`` grows by what cuMemFreeAsync frees into the
  pool (capped at the threshold, default 0: given back at the next sync), shrinks when an
  allocation reuses it, at cuMemPoolTrimTo (to ``minBytesToKeep``) and cuMemPoolDestroy. Steps
  over pool calls and stream-ordered allocations (the pool's own granularity) count here too;
- **before recording**: a process NVML lists whose context memrec never saw being bound (it was
  running before the recording, or before this file of a rotated recording): what it held at its
  first sample.

Everything else is **unexplained**: allocation rounding, NVML readings that lag a call, memory the
driver takes without any probed call. The split is an identity at every sample::

    NVML used = traced + pools + before recording + context + module code + unexplained

How a step is attributed: between two consecutive NVML readings of one process on one GPU, the
residual ``NVML used - traced - pool model`` changes by some bytes; the step goes to the strongest
category of that process's explaining calls in the interval (context > module code > pools), or,
when there is none, to the last such call if it ended at most :data:`SETTLE_NS` before the
interval began (a kernel fetched just before its first launch reaches the device a little later).
The daemon reads NVML right before and after each context bind and after code and pool calls
(:mod:`memrec.daemon.untraced`), so on a recording with those readings each interval holds one
kind of step.

Each step also gets the phase (markers) of its process open at the explaining call, or at the
reading when there is none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from dataclasses import field
from typing import Iterable

import numpy as np

from memrec.analysis.names import api_name
from memrec.events import FLAG_NAME
from memrec.events import MEMPOOL_ATTR_RELEASE_THRESHOLD
from memrec.events import STREAM_ORDERED_APIS
from memrec.events import Api
from memrec.events import Kind

#: The columns of the split, in the order the report shows them.
SPLIT = ("context", "module_code", "pools", "before_recording", "unexplained")
#: How long after an explaining call a step with no call of its own is still that call's.
SETTLE_NS = 2_500_000_000

_CONTEXT, _MODULE, _POOL = 3, 2, 1  # attribution strength
_CATEGORY = {_CONTEXT: "context", _MODULE: "module_code", _POOL: "pools"}
_BIND_AUX = (0, 1)  # CTX aux: retain, create (2 is cuCtxGetDevice)
_ASYNC_ALLOC = {int(a) for a in (Api.cuMemAllocAsync, Api.cuMemAllocAsync_ptsz)}
_STREAM = [int(a) for a in STREAM_ORDERED_APIS]
_K = {k: int(k) for k in Kind}


#: Events per step of :func:`_one_of`: a step's column and mask stay in the CPU's cache.
ONE_OF_STEP = 1 << 16


def _one_of(col: np.ndarray, values: Iterable[int]) -> np.ndarray:
    """``np.isin(col, values)`` for a few small ints over an event column: one bool per event and
    nothing wider (``np.isin``'s table method makes an int64 copy of the column: 80 MB at 10M).
    Every value is compared a cache-sized step at a time, not in a pass over the whole column
    each (3.5 - 8 × faster on 10M events, measured)."""
    values = list(values)
    out = np.zeros(len(col), dtype=bool)
    if not values:
        return out
    for lo in range(0, len(col), ONE_OF_STEP):
        part, mask = col[lo : lo + ONE_OF_STEP], out[lo : lo + ONE_OF_STEP]
        np.equal(part, values[0], out=mask)
        for v in values[1:]:
            mask |= part == v
    return out


@dataclass(frozen=True)
class Step:
    """One change of a process's residual between two NVML readings, and what it is put on."""

    ts: int  # the reading that showed it
    since: int | None  # the reading before (None: the first one)
    bytes: int
    category: str  # one of SPLIT
    cause: str | None  # the explaining call's API name
    cause_ts: int | None
    phase: int  # phase id (-1: none)
    context: int | None = None  # the context handle, for context steps
    library: str | None = None  # the library or module file of a code call (None: unknown)


@dataclass(frozen=True)
class ContextRecord:
    """A context a process bound on a GPU, and what NVML says it cost."""

    pid: int
    gpu: int
    handle: int
    api: str
    ts: int
    phase: int
    cost: int | None  # None: no NVML reading of the process on that GPU
    foreign: bool  # the process owns no traced memory on this GPU


@dataclass
class UntracedSplit:
    """One process on one GPU: the split at each of its NVML samples (arrays as the series')."""

    gpu: int
    pid: int
    ts: np.ndarray
    pools: np.ndarray  # pool model + pool steps
    context: np.ndarray
    module_code: np.ndarray
    before_recording: np.ndarray
    unexplained: np.ndarray
    steps: list[Step] = field(default_factory=list)

    def at(self, i: int) -> dict[str, int]:
        """The split at sample ``i`` (plain ints, keys :data:`SPLIT`)."""
        return {name: int(getattr(self, name)[i]) for name in SPLIT}


class Explainers:
    """Per process: the calls that explain steps, in time order (ts, gpu, strength, api, handle)."""

    def __init__(self, events: np.ndarray) -> None:
        kinds = events["kind"]
        ok = events["result"] == 0
        # A bind's entry (CTX_BEGIN) too: the context grows while the call runs (~100 ms on an
        # H200), so a reading taken then already holds part of it.
        ctx_bind = ((kinds == _K[Kind.CTX]) & _one_of(events["aux"], _BIND_AUX)) | (kinds == _K[Kind.CTX_BEGIN])
        code = _one_of(kinds, [_K[Kind.CODE_LOAD], _K[Kind.CODE_UNLOAD], _K[Kind.KERNEL_LOAD]])
        pool = _one_of(kinds, [_K[Kind.POOL], _K[Kind.POOL_DESTROY], _K[Kind.POOL_TRIM], _K[Kind.POOL_ATTR]])
        stream = _one_of(kinds, [_K[Kind.ALLOC], _K[Kind.FREE]]) & _one_of(events["api"], _STREAM)
        sel = np.nonzero(ok & (ctx_bind | code | pool | stream))[0]
        ev = events[sel]
        strength = np.where(ctx_bind[sel], _CONTEXT, np.where(code[sel], _MODULE, _POOL)).astype(np.int64)
        # The first kernel fetched into a new context is the context's (its lazy first-launch step).
        # Retaining a context already bound costs nothing and explains nothing (NCCL and others
        # retain the primary context again while they load their kernels).
        seen: dict[tuple[int, int], set[int]] = {}
        pending: dict[tuple[int, int], int] = {}
        handles = ev["handle"].astype(np.uint64).tolist()
        ctx_of = [0] * len(ev)
        keep = np.ones(len(ev), dtype=bool)
        begins: dict[tuple[int, int], int] = {}  # a bind's entry, kept if it makes a new context
        for i, (k, p, g) in enumerate(zip(ev["kind"].tolist(), ev["pid"].tolist(), ev["gpu"].tolist())):
            if k == _K[Kind.CTX_BEGIN]:
                keep[i] = False
                begins[(p, g)] = i
            elif k == _K[Kind.CTX]:
                begin = begins.pop((p, g), None)
                known = seen.setdefault((p, g), set())
                if handles[i] in known:
                    keep[i] = False
                    continue
                known.add(handles[i])
                pending[(p, g)] = handles[i]
                ctx_of[i] = handles[i]
                if begin is not None:
                    keep[begin] = True
                    ctx_of[begin] = handles[i]
            elif k == _K[Kind.KERNEL_LOAD] and (p, g) in pending:
                strength[i] = _CONTEXT
                ctx_of[i] = pending.pop((p, g))
        libraries = _library_names(ev)
        ev, strength = ev[keep], strength[keep]
        ctx_of = [c for c, k in zip(ctx_of, keep.tolist()) if k]
        self.libraries = [n for n, k in zip(libraries, keep.tolist()) if k]
        self.by_pid: dict[int, tuple[np.ndarray, ...]] = {}
        pids = ev["pid"]
        ctx_arr = np.asarray(ctx_of, dtype=np.uint64)
        for p in np.unique(pids).tolist():
            m = pids == p
            self.by_pid[p] = (
                ev["ts"][m].astype(np.int64), ev["gpu"][m].astype(np.int64), strength[m],
                ev["api"][m].astype(np.int64), ctx_arr[m], ev["kind"][m].astype(np.int64),
                np.asarray(self.libraries, dtype=object)[m] if len(ev) else np.zeros(0, dtype=object),
            )

    def of(self, pid: int, gpu: int) -> tuple[np.ndarray, ...]:
        """This process's explaining calls on ``gpu`` (and those whose GPU is unknown)."""
        cols = self.by_pid.get(pid)
        if cols is None:
            return tuple(np.zeros(0, np.int64) for _ in range(7))
        m = (cols[1] == gpu) | (cols[1] < 0)
        return tuple(c[m] for c in cols)


def _name(flags: int, ipc: bytes) -> str | None:
    if not flags & FLAG_NAME:
        return None
    return os.path.basename(ipc.split(b"\0", 1)[0].decode("utf-8", "replace")) or None


def _library_names(ev: np.ndarray) -> list[str | None]:
    """The library (or module) file each explaining call is about, where the trace names it.

    Loads carry the name (the file, or the mapped library an image lay in); a kernel fetch names
    its library by handle (cuLibraryGetKernel), a function fetch its kernel (cuKernelGetFunction).
    """
    names: dict[tuple[int, int], str | None] = {}
    kernel_lib: dict[tuple[int, int], int] = {}
    out: list[str | None] = []
    for kind, api, pid, handle, ptr, flags, ipc in zip(
        ev["kind"].tolist(), ev["api"].tolist(), ev["pid"].tolist(), ev["handle"].tolist(), ev["ptr"].tolist(),
        ev["flags"].tolist(), ev["ipc"],
    ):
        lib = None
        if kind == _K[Kind.CODE_LOAD]:
            lib = names[(pid, handle)] = _name(flags, bytes(ipc)) or ("(in memory)" if ptr else None)
        elif kind == _K[Kind.CODE_UNLOAD]:
            lib = names.get((pid, handle))
        elif api == int(Api.cuLibraryGetKernel):
            kernel_lib[(pid, handle)] = ptr
            lib = names.get((pid, ptr))
        elif api == int(Api.cuKernelGetFunction):
            lib = names.get((pid, kernel_lib.get((pid, ptr), 0)))
        out.append(lib)
    return out


def pool_held(events: np.ndarray) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """The pool model: (gpu, pid) -> (ts, bytes its pools keep after each change).

    Pools are keyed by handle; cuMemAllocAsync draws from the device's default pool, whose handle
    cuDeviceGetDefaultMemPool tells when it was called (else it is known by its device only).
    """
    kinds = events["kind"]
    apis = events["api"]
    rel = (events["result"] == 0) & (
        _one_of(kinds, [_K[Kind.POOL], _K[Kind.POOL_DESTROY], _K[Kind.POOL_TRIM], _K[Kind.POOL_ATTR], _K[Kind.PROC_EXIT]])
        | (_one_of(kinds, [_K[Kind.ALLOC], _K[Kind.FREE]]) & _one_of(apis, _STREAM))
    )
    ev = events[rel]
    pools: dict[tuple[int, object], list] = {}  # (pid, key) -> [gpu, held, threshold]
    alias: dict[tuple[int, int], object] = {}  # (pid, handle) -> key of a default pool
    live: dict[tuple[int, int], tuple[object, int]] = {}  # (pid, ptr) -> (pool key, size)
    totals: dict[tuple[int, int], int] = {}
    out: dict[tuple[int, int], tuple[list, list]] = {}

    def key_of(pid: int, handle: int) -> object:
        return alias.get((pid, handle), handle)

    def pool(pid: int, key: object, gpu: int) -> list:
        rec = pools.get((pid, key))
        if rec is None:
            rec = pools[(pid, key)] = [gpu, 0, 0]
        elif rec[0] < 0 <= gpu:
            rec[0] = gpu
        return rec

    def change(ts: int, pid: int, rec: list, held: int) -> None:
        delta = held - rec[1]
        rec[1] = held
        if delta and rec[0] >= 0:
            k = (rec[0], pid)
            totals[k] = totals.get(k, 0) + delta
            t, v = out.setdefault(k, ([], []))
            t.append(ts)
            v.append(totals[k])

    for ts, pid, kind, api, gpu, ptr, size, handle, aux in zip(
        ev["ts"].tolist(), ev["pid"].tolist(), ev["kind"].tolist(), apis[rel].tolist(), ev["gpu"].tolist(),
        ev["ptr"].tolist(), ev["size"].tolist(), ev["handle"].tolist(), ev["aux"].tolist(),
    ):
        if kind == _K[Kind.ALLOC]:
            key = ("default", gpu) if api in _ASYNC_ALLOC else key_of(pid, handle)
            rec = pool(pid, key, gpu)
            live[(pid, ptr)] = (key, size)
            change(ts, pid, rec, rec[1] - min(rec[1], size))
        elif kind == _K[Kind.FREE]:
            got = live.pop((pid, ptr), None)
            if got is not None and (pid, got[0]) in pools:
                rec = pools[(pid, got[0])]
                change(ts, pid, rec, min(rec[1] + got[1], rec[2]))
        elif kind == _K[Kind.POOL]:
            if api == int(Api.cuDeviceGetDefaultMemPool):
                alias[(pid, handle)] = ("default", gpu)
                pool(pid, ("default", gpu), gpu)
            else:
                pool(pid, handle, gpu)
        elif kind == _K[Kind.POOL_ATTR] and aux == MEMPOOL_ATTR_RELEASE_THRESHOLD:
            rec = pool(pid, key_of(pid, handle), -1)
            rec[2] = size
            change(ts, pid, rec, min(rec[1], size))
        elif kind == _K[Kind.POOL_TRIM]:
            rec = pool(pid, key_of(pid, handle), -1)
            change(ts, pid, rec, min(rec[1], size))
        elif kind == _K[Kind.POOL_DESTROY]:
            rec = pools.pop((pid, key_of(pid, handle)), None)
            if rec is not None:
                change(ts, pid, rec, 0)
        elif kind == _K[Kind.PROC_EXIT]:
            for (p, key) in [k for k in pools if k[0] == pid]:
                change(ts, pid, pools.pop((p, key)), 0)
    return {k: (np.asarray(t, dtype=np.int64), np.asarray(v, dtype=np.int64)) for k, (t, v) in out.items()}


def split_process(
    gpu: int, pid: int, ts: np.ndarray, nvml_used: np.ndarray, traced: np.ndarray,
    pools: tuple[np.ndarray, np.ndarray] | None, explainers: Explainers, phase_of,
) -> UntracedSplit:
    """Split one process's untraced band on one GPU at each of its samples (see the module doc).

    Args:
        phase_of: ``(pid, ts) -> phase id`` (-1 none).
    """
    n = len(ts)
    model = np.zeros(n, dtype=np.int64)
    if pools is not None and len(pools[0]):
        rows = np.searchsorted(pools[0], ts, side="right") - 1
        model = np.where(rows >= 0, pools[1][np.maximum(rows, 0)], 0)
    residual = nvml_used - traced - model
    e_ts, _e_gpu, e_str, e_api, e_ctx, e_kind, e_lib = explainers.of(pid, gpu)
    cum = {name: np.zeros(n, dtype=np.int64) for name in SPLIT}
    totals = dict.fromkeys(SPLIT, 0)
    steps: list[Step] = []
    binds = np.isin(e_kind, [_K[Kind.CTX], _K[Kind.CTX_BEGIN]])
    bound_before = bool(len(e_ts)) and bool((binds & (e_ts <= (ts[0] if n else 0))).any())
    for k in range(n):
        delta = int(residual[k] - (residual[k - 1] if k else 0))
        since = int(ts[k - 1]) if k else None
        if k == 0 and not bound_before:
            category, cause_i = "before_recording", None
        else:
            lo = int(np.searchsorted(e_ts, since, side="right")) if since is not None else 0
            hi = int(np.searchsorted(e_ts, ts[k], side="right"))
            category, cause_i = "unexplained", None
            if hi > lo:
                best = int(e_str[lo:hi].max())
                cause_i = lo + int(np.nonzero(e_str[lo:hi] == best)[0][-1])
                category = _CATEGORY[best]
            elif lo > 0 and since is not None and since - int(e_ts[lo - 1]) <= SETTLE_NS:
                cause_i = lo - 1
                category = _CATEGORY[int(e_str[cause_i])]
        totals[category] += delta
        for name in SPLIT:
            cum[name][k] = totals[name]
        if delta:
            cause_ts = int(e_ts[cause_i]) if cause_i is not None else None
            steps.append(Step(
                ts=int(ts[k]), since=since, bytes=delta, category=category,
                cause=Api(int(e_api[cause_i])).name if cause_i is not None and int(e_api[cause_i]) in Api._value2member_map_ else None,
                cause_ts=cause_ts, phase=phase_of(pid, cause_ts if cause_ts is not None else int(ts[k])),
                context=int(e_ctx[cause_i]) if cause_i is not None and category == "context" else None,
                library=e_lib[cause_i] if cause_i is not None else None,
            ))
    return UntracedSplit(
        gpu=gpu, pid=pid, ts=ts, pools=model + cum["pools"], context=cum["context"], module_code=cum["module_code"],
        before_recording=cum["before_recording"], unexplained=cum["unexplained"], steps=steps,
    )


def contexts(events: np.ndarray, splits: dict[tuple[int, int], UntracedSplit], owners: dict[int, set[int]],
             phase_of, until: dict[tuple[int, int], int | None]) -> list[ContextRecord]:
    """Every context bound (a new handle per process and GPU), with its cost and whether it is foreign.

    Args:
        owners: GPU -> pids that owned traced memory on it at some point.
        until: (gpu, pid) -> the last sample counted (steps after it, e.g. after exit, are not).
    """
    m = (events["kind"] == _K[Kind.CTX]) & _one_of(events["aux"], _BIND_AUX) & (events["result"] == 0)
    out: list[ContextRecord] = []
    seen: set[tuple[int, int, int]] = set()
    for ts, pid, gpu, handle, api in zip(
        events["ts"][m].tolist(), events["pid"][m].tolist(), events["gpu"][m].tolist(),
        events["handle"][m].astype(np.uint64).tolist(), events["api"][m].tolist(),
    ):
        if (pid, gpu, handle) in seen:
            continue
        seen.add((pid, gpu, handle))
        split = splits.get((gpu, pid))
        cost = None
        if split is not None:
            last = until.get((gpu, pid))
            cost = sum(s.bytes for s in split.steps
                       if s.category == "context" and s.context == handle and (last is None or s.ts <= last))
        out.append(ContextRecord(
            pid=pid, gpu=gpu, handle=handle, api=api_name(api), ts=ts, phase=phase_of(pid, ts), cost=cost,
            foreign=gpu >= 0 and pid not in owners.get(gpu, set()),
        ))
    return out
