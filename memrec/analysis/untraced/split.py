"""The untraced band split into what it is, attributed only where a measurement shows it.

NVML's per-process ``used`` minus the traced bytes (:mod:`memrec.analysis.untraced.reconcile`; CUDA arrays
are traced, sized from their descriptors) is one number that hides several things, measured on an
H200 (docs/validation/untraced-explore.md, docs/validation/families.md):

- **context**: ~520 MiB at creation (cuDevicePrimaryCtxRetain, cuCtxCreate*), and PyTorch's
  first kernel fetched into it (+92 MiB at its first launch on the H200; a cuda-python module's
  first launch added nothing) when a reading brackets that fetch;
- **module code**: kernels reach the device when fetched into a context (cuLibraryGetKernel,
  cuKernelGetFunction) or loaded with a module (cuModuleLoad*). A module's code cannot exceed what
  its image could place on the device: at most :data:`MODULE_FACTOR` × the image's bytes (read from
  its fatbin, ELF or PTX header by the probe) + :data:`GRANULE` per load; an image of unknown size
  bounds nothing;
- **pools**: a stream-ordered pool keeps freed blocks up to its release threshold until a trim or
  its destruction (the pool model of :func:`pool_held`, plus steps over pool calls);
- **limits**: a stack limit costs (new - old) × the GPU's resident threads (SMs × threads per
  SM; old starts at the default 1 KiB): inside cuCtxSetLimit once the context has launched, else
  at its next launch. The malloc heap, the printf FIFO and the pending-launch count showed no step
  on the H200 (kernels that use neither): recorded, never given a step;
- **graph**: graph-owned memory (allocations captured into a graph, graph memory nodes) reaches the
  device at instantiate, upload or the first launch of the executable graph, up to the graph's
  footprint (its allocations rounded up to :data:`GRANULE`, + one granule), and leaves at
  cuDeviceGraphMemTrim (even with the graphs alive, on the H200);
- **multicast**: steps over multicast object calls (cuMulticastCreate/AddDevice/Bind*/Unbind);
- **before recording**: what a process NVML lists held at its first sample when memrec never saw
  its context being bound.

Everything else is **unexplained**. The split is an identity at every sample::

    NVML used = traced + pools + context + module code + limits + graph + multicast
                + before recording + unexplained

How a step is attributed (no time window: only calls inside the interval and bounds the calls
give). Between two consecutive NVML readings of one process on one GPU, the residual ``NVML used -
traced - pool model`` changes by ``S`` bytes. Two kinds of evidence can explain it:

- *bracketed calls*: explaining calls made between the two readings (the daemon reads NVML right
  before and after each context bind, and after code, pool, limit, graph and multicast calls:
  :mod:`memrec.daemon.untraced`). The strongest category among them (context > module code >
  graph > multicast > limits > pools) takes the step, module code only up to its bound;
- *pending costs*: what a call made earlier promised the device and has not placed yet: a raised
  stack limit, an instantiated graph's pool. Each has a range of bytes (narrow where a rule gives
  the number: the stack with the GPU's resident threads; loose where only a ceiling is known: a
  graph's footprint, a stack on a GPU whose thread count is unknown).

A positive step takes the narrow pending costs that fit (the largest set whose sum leaves a
remainder of at least ``-tolerance``); the remainder goes to the bracketed category if its bound
allows it, else to the one loose pending cost whose range holds it. Two loose costs that could
both hold it, or none, leave it **unexplained**, whatever happened nearby. A negative step goes
to the strongest bracketed category, or stays unexplained.

Two rules keep a family from another's bytes when a reading and the calls race:

- a reading is stamped before NVML answers, and a process that runs on meanwhile shows calls
  stamped after it (the H200's ``fast_context``: the reading after the bind held the stack and the
  array, 4.62 GiB). The sign is measured: the next interval's residual falls by bytes the probes
  traced in it, and no bracketed family holds that much to give back. Reading ``k``'s step is then
  held unexplained, and at reading ``k + 1`` the two intervals are attributed as one step;
- a negative step goes to a bracketed family only as far as that family holds bytes (never below
  zero; for the pools, the pool model's bytes count too); the rest of it is unexplained.

A context bind brackets every interval it spans (its entry to its return): under
``CUDA_MODULE_LOADING=EAGER`` the retain loads every module inside it, over several readings.

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
from memrec.terms.events import CU_LIMIT_STACK_SIZE
from memrec.terms.events import FLAG_NAME
from memrec.terms.events import GRANULE
from memrec.terms.events import MEMPOOL_ATTR_RELEASE_THRESHOLD
from memrec.terms.events import STREAM_ORDERED_APIS
from memrec.terms.events import UNTRACED_HEADINGS
from memrec.terms.events import UNTRACED_SPLIT
from memrec.terms.events import Api
from memrec.terms.events import Kind

#: The columns of the split, in the order the report shows them, and their headings.
SPLIT = UNTRACED_SPLIT
SPLIT_HEADINGS = UNTRACED_HEADINGS
#: The columns that explain memory by measurement (the rest of the band is unexplained).
EXPLAINED = tuple(c for c in SPLIT if c != "unexplained")
MiB = 1 << 20
#: A module's code on the device is at most this many times its image's bytes (+ a granule per load).
MODULE_FACTOR = 4
#: The stack per thread a context places at its first launch before any cuCtxSetLimit (the
#: driver's default, 1 KiB): a raise to ``v`` then costs ``(v - 1 KiB) x resident threads``.
DEFAULT_STACK = 1024
#: Without the GPU's resident-thread count, a stack raise is bounded by these thread counts.
THREADS_MIN, THREADS_MAX = 1 << 14, 1 << 19
#: The library of a module-code step whose interval holds calls about several libraries.
SEVERAL = "(several)"
#: The share of NVML used that must be traced or explained before the report names causes.
EXPLAINED_SHARE_MIN = 0.98


def tolerance(step: int) -> int:
    """How far a step may be from a rule's number and still be that rule's: a granule, or 1 %."""
    return max(GRANULE, abs(step) // 100)


_CONTEXT, _MODULE, _GRAPH, _MULTICAST, _LIMITS, _POOL = 6, 5, 4, 3, 2, 1  # bracket strength
_CATEGORY = {_CONTEXT: "context", _MODULE: "module_code", _GRAPH: "graph", _MULTICAST: "multicast",
             _LIMITS: "limits", _POOL: "pools"}
_BIND_AUX = (0, 1)  # CTX aux: retain, create (2 is cuCtxGetDevice)
_ASYNC_ALLOC = {int(a) for a in (Api.cuMemAllocAsync, Api.cuMemAllocAsync_ptsz)}
_STREAM = [int(a) for a in STREAM_ORDERED_APIS]
_K = {k: int(k) for k in Kind}
#: Driver entry points by number: a step's cause by name (None for a number this memrec does not know).
_API_NAMES = {int(a): a.name for a in Api}
_CODE_KINDS = [_K[Kind.CODE_LOAD], _K[Kind.CODE_UNLOAD], _K[Kind.KERNEL_LOAD]]
_POOL_KINDS = [_K[Kind.POOL], _K[Kind.POOL_DESTROY], _K[Kind.POOL_TRIM], _K[Kind.POOL_ATTR]]
_GRAPH_KINDS = [_K[Kind.GRAPH_EXEC], _K[Kind.GRAPH_TRIM]]
_MULTICAST_KINDS = [_K[Kind.MULTICAST_CREATE], _K[Kind.MULTICAST_ADD], _K[Kind.MULTICAST_BIND],
                    _K[Kind.MULTICAST_UNBIND]]
#: Kinds whose events carry their call's entry time in aux (probes/cuda.bpf.c), and the longest
#: call believed (a larger gap is a damaged or older trace's aux).
_ENTRY_TIMED = [_K[Kind.CODE_LOAD], _K[Kind.CODE_UNLOAD], _K[Kind.KERNEL_LOAD], _K[Kind.POOL_DESTROY],
                _K[Kind.POOL_TRIM], _K[Kind.ARRAY_DESTROY], _K[Kind.GRAPH_TRIM]]
MAX_CALL_NS = 10_000_000_000
#: Kinds that make a pending cost (read by :class:`Pending`).
_PENDING_KINDS = [_K[Kind.CTX_LIMIT], _K[Kind.CAPTURE_BEGIN], _K[Kind.CAPTURE_END], _K[Kind.GRAPH_ALLOC],
                  _K[Kind.GRAPH_EXEC], _K[Kind.GRAPH_TRIM]]


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
    limits: np.ndarray | None = None
    graph: np.ndarray | None = None
    multicast: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in ("limits", "graph", "multicast"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(len(self.ts), dtype=np.int64))

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
        code = _one_of(kinds, _CODE_KINDS)
        pool = _one_of(kinds, _POOL_KINDS)
        stream = _one_of(kinds, [_K[Kind.ALLOC], _K[Kind.FREE]]) & _one_of(events["api"], _STREAM)
        graph = _one_of(kinds, _GRAPH_KINDS)
        multicast = _one_of(kinds, _MULTICAST_KINDS)
        limit = kinds == _K[Kind.CTX_LIMIT]
        sel = np.nonzero(ok & (ctx_bind | code | pool | stream | graph | multicast | limit))[0]
        ev = events[sel]
        strength = np.select(
            [ctx_bind[sel], code[sel], graph[sel], multicast[sel], limit[sel]],
            [_CONTEXT, _MODULE, _GRAPH, _MULTICAST, _LIMITS], _POOL).astype(np.int64)
        # The first kernel fetched into a new context is the context's (its lazy first-launch step).
        # Retaining a context already bound costs nothing and explains nothing (NCCL and others
        # retain the primary context again while they load their kernels).
        seen: dict[tuple[int, int], set[int]] = {}
        pending: dict[tuple[int, int], int] = {}
        handles = ev["handle"].astype(np.uint64).tolist()
        ctx_of = [0] * len(ev)
        began = [0] * len(ev)  # a new context's bind: when it began (its CTX_BEGIN's ts)
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
                    began[i] = int(ev["ts"][begin])
            elif k == _K[Kind.KERNEL_LOAD] and (p, g) in pending:
                strength[i] = _CONTEXT
                ctx_of[i] = pending.pop((p, g))
        libraries = _library_names(ev)
        ev, strength = ev[keep], strength[keep]
        ctx_of = [c for c, k in zip(ctx_of, keep.tolist()) if k]
        began64 = np.asarray(began, dtype=np.int64)[keep]
        self.libraries = [n for n, k in zip(libraries, keep.tolist()) if k]
        self.by_pid: dict[int, tuple[np.ndarray, ...]] = {}
        # every process's rows from one stable sort by pid (a mask per process was
        # O(processes × calls): a host of many short processes each binding a context)
        # When each call began: the probes put the entry time of code, unload and trim calls in
        # aux (a reading taken while such a call ran already shows part of its step); else its ts.
        ts64, aux64 = ev["ts"].astype(np.int64), ev["aux"].astype(np.int64)
        timed = _one_of(ev["kind"], _ENTRY_TIMED) & (aux64 > 0) & (aux64 <= ts64) & (ts64 - aux64 < MAX_CALL_NS)
        start = np.where(timed, aux64, ts64)
        # A bind runs across readings too: under CUDA_MODULE_LOADING=EAGER the retain loads every
        # module inside it (1.2 GiB over ~0.8 s on an H200), so each interval it spans is its step.
        bind_timed = (began64 > 0) & (began64 <= ts64) & (ts64 - began64 < MAX_CALL_NS)
        start = np.where(bind_timed, began64, start)
        order = np.argsort(ev["pid"], kind="stable")
        pids = ev["pid"][order]
        cols = (ts64, ev["gpu"].astype(np.int64), strength, ev["api"].astype(np.int64),
                np.asarray(ctx_of, dtype=np.uint64), ev["kind"].astype(np.int64),
                np.asarray(self.libraries, dtype=object) if len(ev) else np.zeros(0, dtype=object),
                ev["size"].astype(np.int64), start)
        cols = tuple(c[order] for c in cols)
        cuts = np.flatnonzero(pids[1:] != pids[:-1]) + 1
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(pids)]):
            if hi > lo:
                self.by_pid[int(pids[lo])] = tuple(c[lo:hi] for c in cols)
        self.pending = _pending_events(events)

    def of(self, pid: int, gpu: int) -> tuple[np.ndarray, ...]:
        """This process's explaining calls on ``gpu`` (and those whose GPU is unknown)."""
        cols = self.by_pid.get(pid)
        if cols is None:
            return tuple(np.zeros(0, np.int64) for _ in range(9))
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


def _pending_events(events: np.ndarray) -> dict[int, np.ndarray]:
    """Per process, the successful calls that make or settle pending costs (limits, graphs)."""
    m = (events["result"] == 0) & _one_of(events["kind"], _PENDING_KINDS)
    ev = events[m]
    return {p: ev[ev["pid"] == p] for p in np.unique(ev["pid"]).tolist()}


@dataclass
class _Cost:
    """A cost a call promised the device and has not placed yet (or not all of it).

    ``context``: for the stack, the limit that is placed once the cost lands."""

    category: str
    lo: int
    hi: int
    narrow: bool  # a rule gives the number (lo..hi within a tolerance); else only a ceiling
    api: int
    ts: int
    key: tuple  # what the cost is of: ("stack",), ("graph", exec)
    context: int | None = None

    @property
    def expected(self) -> int:
        return (self.lo + self.hi) // 2


class _Costs:
    """The pending costs of one process on one GPU, kept in time order as its calls come."""

    def __init__(self, rows: np.ndarray | None, threads: int | None) -> None:
        self.rows = rows if rows is not None else np.zeros(0, dtype=[("ts", "<u8")])
        self.next = 0
        self.threads = threads
        self.open: dict[tuple, _Cost] = {}
        self.placed = DEFAULT_STACK  # the stack per thread on the device
        self.captures: dict[int, int] = {}  # stream -> bytes captured so far
        self.footprint: dict[int, int] = {}  # graph -> graph-owned bytes
        self.execs: dict[int, int] = {}  # exec -> its graph's footprint

    def advance(self, until: int) -> None:
        """Take in the calls made up to ``until``."""
        r = self.rows
        while self.next < len(r) and int(r["ts"][self.next]) <= until:
            self._take(r[self.next])
            self.next += 1

    def _take(self, e) -> None:
        kind, api, ts, size, handle, aux, ptr = (int(e["kind"]), int(e["api"]), int(e["ts"]), int(e["size"]),
                                                 int(e["handle"]), int(e["aux"]), int(e["ptr"]))
        if kind == _K[Kind.CTX_LIMIT]:
            self._limit(aux, size, api, ts)
        elif kind == _K[Kind.CAPTURE_BEGIN]:
            self.captures[handle] = 0
        elif kind == _K[Kind.GRAPH_ALLOC]:
            grain = -(-size // GRANULE) * GRANULE
            if handle in self.captures:
                self.captures[handle] += grain
            elif api == int(Api.cuGraphAddMemAllocNode):
                self.footprint[handle] = self.footprint.get(handle, 0) + grain
            elif len(self.captures) == 1:  # from a pool (handle = the pool) on the one stream captured
                stream = next(iter(self.captures))
                self.captures[stream] += grain
        elif kind == _K[Kind.CAPTURE_END]:
            got = self.captures.pop(handle, 0)
            if ptr:
                self.footprint[ptr] = self.footprint.get(ptr, 0) + got
        elif kind == _K[Kind.GRAPH_EXEC] and aux == 0:  # instantiated: ptr = graph, handle = exec
            need = self.footprint.get(ptr, 0)
            if need:
                self.execs[handle] = need
                self.open[("graph", handle)] = _Cost("graph", 0, need + GRANULE, False, api, ts, ("graph", handle))
        elif kind == _K[Kind.GRAPH_TRIM]:  # the pool is given back: every graph may grow it again
            for ex, need in self.execs.items():
                self.open[("graph", ex)] = _Cost("graph", 0, need + GRANULE, False, api, ts, ("graph", ex))

    def _limit(self, limit: int, value: int, api: int, ts: int) -> None:
        """A stack limit: (new - placed) x resident threads, at the call once the context has
        launched, else at its next launch (the H200: 16 KiB +3,960 MiB, back to 4 KiB -3,168 MiB,
        32 KiB +7,392 MiB, each inside cuCtxSetLimit). The heap, the printf FIFO and the pending
        launch count showed no step at all on the H200 (kernels using neither malloc nor printf):
        recorded, never given a step."""
        if limit != CU_LIMIT_STACK_SIZE:
            return
        old = self.placed
        self.open.pop(("stack",), None)
        if value <= old:  # the driver shrinks the stack at the call (a bracketed negative step)
            self.placed = value
            return
        if self.threads:
            n = (value - old) * self.threads
            cost = _Cost("limits", n, n, True, api, ts, ("stack",))
        else:
            cost = _Cost("limits", (value - old) * THREADS_MIN, value * THREADS_MAX, False, api, ts, ("stack",))
        cost.context = value  # the value placed once it lands
        self.open[("stack",)] = cost

    def settle(self, cost: _Cost, placed: int) -> None:
        """``placed`` bytes of ``cost`` reached the device."""
        if cost.key[0] == "stack":
            self.placed = cost.context
            self.open.pop(cost.key, None)
        elif cost.key[0] == "graph":
            cost.hi -= placed
            if cost.hi < GRANULE:
                self.open.pop(cost.key, None)
        else:
            self.open.pop(cost.key, None)


def _explain(step: int, costs: _Costs, bracket: tuple[str, float] | None) -> list[tuple[str, int, _Cost | None]] | None:
    """How a positive step splits into (category, bytes, pending cost or None for the bracket);
    None: no unique explanation (the step stays unexplained).

    Narrow pending costs first (the largest set that fits), then the remainder to the bracketed
    category within its bound, else to the one loose category whose pending costs can hold it.
    """
    tol = tolerance(step)
    narrow = [c for c in costs.open.values() if c.narrow]
    loose: dict[str, list[_Cost]] = {}
    for c in costs.open.values():
        if not c.narrow:
            loose.setdefault(c.category, []).append(c)
    best: list | None = None
    best_n = -1
    ambiguous = False
    narrow = narrow[:8]
    for mask in range(1 << len(narrow)):
        chosen = [c for i, c in enumerate(narrow) if mask >> i & 1]
        if sum(c.lo for c in chosen) > step + tol:
            continue
        rest = step - sum(c.expected for c in chosen)
        parts: list[tuple[str, int, _Cost | None]] = [(c.category, c.expected, c) for c in chosen]
        low, high = sum(c.lo for c in chosen), sum(c.hi for c in chosen)
        if chosen and low - tol <= step <= high + tol:
            # The rules' ranges hold the step: each takes its low end and a share of the rest.
            spare, width = min(max(step - low, 0), high - low), high - low
            parts = [(c.category, c.lo + (spare * (c.hi - c.lo) // width if width else 0), c) for c in chosen]
        elif rest > 0 and bracket is not None and rest <= bracket[1] + tol:
            parts.append((bracket[0], rest, None))
        else:
            fits = [cat for cat, cs in loose.items() if sum(c.hi for c in cs) + tol >= rest >= min(c.lo for c in cs) - tol
                    and rest > 0]
            if len(fits) != 1:
                continue
            parts.append((fits[0], rest, None))
            for c in loose[fits[0]]:  # name the pending cost(s) of that category it settles
                parts[-1] = (fits[0], rest, c)
                break
        if len(chosen) > best_n:
            best, best_n, ambiguous = parts, len(chosen), False
        elif len(chosen) == best_n:
            ambiguous = True
    return None if ambiguous else best


def split_process(
    gpu: int, pid: int, ts: np.ndarray, nvml_used: np.ndarray, traced: np.ndarray,
    pools: tuple[np.ndarray, np.ndarray] | None, explainers: Explainers, phase_of, threads: int | None = None,
) -> UntracedSplit:
    """Split one process's untraced band on one GPU at each of its samples (see the module doc).

    Args:
        phase_of: ``(pid, ts) -> phase id`` (-1 none).
        threads: the GPU's resident threads (SMs × threads per SM), for the stack limit's cost;
            None: unknown (a stack raise is then only bounded).
    """
    n = len(ts)
    model = np.zeros(n, dtype=np.int64)
    if pools is not None and len(pools[0]):
        rows = np.searchsorted(pools[0], ts, side="right") - 1
        model = np.where(rows >= 0, pools[1][np.maximum(rows, 0)], 0)
    rows_p = explainers.pending.get(pid)
    if rows_p is not None:
        rows_p = rows_p[(rows_p["gpu"] == gpu) | (rows_p["gpu"] < 0)]
    sp = _Splitter(pid, ts, model, nvml_used - traced - model, traced, explainers.of(pid, gpu), phase_of,
                   _Costs(rows_p, threads))
    cum = {name: np.zeros(n, dtype=np.int64) for name in SPLIT}
    binds = np.isin(sp.e_kind, [_K[Kind.CTX], _K[Kind.CTX_BEGIN]])
    bound_before = bool(len(sp.e_ts)) and bool((binds & (sp.e_ts <= (ts[0] if n else 0))).any())
    for k in range(n):
        delta = int(sp.residual[k] - (sp.residual[k - 1] if k else 0))
        since = int(ts[k - 1]) if k else None
        sp.costs.advance(int(ts[k]))
        if k == 0 and not bound_before:
            sp.record(k, since, delta, "before_recording", None, None)
        else:
            sp.sample(k, since, delta)
        for name in SPLIT:
            cum[name][k] = sp.totals[name]
    return UntracedSplit(
        gpu=gpu, pid=pid, ts=ts, pools=model + cum["pools"], context=cum["context"], module_code=cum["module_code"],
        before_recording=cum["before_recording"], unexplained=cum["unexplained"], steps=sp.steps,
        limits=cum["limits"], graph=cum["graph"], multicast=cum["multicast"],
    )


class _Splitter:
    """:func:`split_process`'s walk over one process's samples on one GPU: the pools' model, the
    residual (NVML used − traced − that model), the explaining calls (``e_*`` columns), the running totals
    per family, the steps so far, the module code used so far, and a step held back."""

    def __init__(self, pid: int, ts: np.ndarray, model: np.ndarray, residual: np.ndarray, traced: np.ndarray,
                 explaining: tuple, phase_of, costs: _Costs) -> None:
        self.pid, self.ts, self.model, self.residual, self.traced = pid, ts, model, residual, traced
        self.phase_of, self.costs = phase_of, costs
        (self.e_ts, _e_gpu, self.e_str, self.e_api, self.e_ctx, self.e_kind, self.e_lib, self.e_size,
         self.e_start) = explaining
        self.longest = int((self.e_ts - self.e_start).max()) if len(self.e_ts) else 0
        self.totals = dict.fromkeys(SPLIT, 0)
        self.steps: list[Step] = []
        # Module code's bound up to each call: the loads so far, those of unknown size, their budget.
        loads = self.e_kind == _K[Kind.CODE_LOAD]
        self.n_loads = np.cumsum(loads)
        self.n_unknown = np.cumsum(loads & (self.e_size <= 0))
        self.budget_sum = np.cumsum(np.where(loads & (self.e_size > 0), MODULE_FACTOR * self.e_size + GRANULE, 0))
        self.module_used = 0
        self.held_back, self.held_since = 0, None  # a step held unexplained (ran_ahead) and where it began

    def record(self, k: int, since: int | None, nbytes: int, category: str, cause_i: int | None,
               cost: _Cost | None, several: bool = False) -> None:
        self.totals[category] += nbytes
        if not nbytes:
            return
        if cost is not None and cause_i is None:
            api, cause_ts, ctx, lib = cost.api, cost.ts, None, None
        elif cause_i is not None:
            api, cause_ts = int(self.e_api[cause_i]), int(self.e_ts[cause_i])
            ctx = int(self.e_ctx[cause_i]) if category == "context" else None
            lib = SEVERAL if several else self.e_lib[cause_i]
        else:
            api = cause_ts = ctx = lib = None
        self.steps.append(Step(
            ts=int(self.ts[k]), since=since, bytes=nbytes, category=category,
            cause=_API_NAMES.get(api) if api is not None else None,
            cause_ts=cause_ts, phase=self.phase_of(self.pid, cause_ts if cause_ts is not None else int(self.ts[k])),
            context=ctx, library=lib,
        ))

    def bracket_of(self, since: int | None, until: int,
                   delta: int) -> tuple[tuple[str, float] | None, int | None, bool]:
        """The strongest explaining call in (since, until] (and those still running at ``until``):
        ((category, bound) or None, its index, whether several libraries' code calls share it)."""
        e_ts, e_str = self.e_ts, self.e_str
        lo = int(np.searchsorted(e_ts, since, side="right")) if since is not None else 0
        hi = int(np.searchsorted(e_ts, until, side="right"))
        # (Those that returned come last: of equal strength, the cause named is one of them.)
        idx = np.arange(lo, hi)
        if self.longest:
            more = np.arange(hi, int(np.searchsorted(e_ts, until + self.longest, side="right")))
            idx = np.concatenate((more[self.e_start[more] <= until], idx))
        if not len(idx):
            return None, None, False
        window = e_str[idx]
        pick = window if delta < 0 else np.where(window == _LIMITS, 0, window)
        best = int(pick.max())
        if best <= 0:
            return None, None, False
        cause_i = int(idx[np.nonzero(pick == best)[0][-1]])
        category = _CATEGORY[best]
        bound = float("inf")
        several = False
        if category == "module_code":
            last = int(idx.max())  # no load seen by then, or one of unknown size: no bound
            known = int(self.n_loads[last]) and not int(self.n_unknown[last])
            bound = float(self.budget_sum[last] - self.module_used) if known else float("inf")
            # several libraries' calls in one interval: name none
            several = len({self.e_lib[i] for i in idx.tolist() if int(e_str[i]) == _MODULE}) > 1
        elif category == "graph":
            bound = float(sum(c.hi for c in self.costs.open.values() if c.category == "graph"))
        return (category, bound), cause_i, several

    def ran_ahead(self, k: int, delta: int, bracket: tuple[str, float] | None) -> bool:
        """Whether reading ``k`` already showed bytes of calls stamped after it (NVML is read
        after the reading's stamp, while the process runs on): the next interval's residual falls
        by bytes the probes traced in it, with no bracketed family holding that much to give back.
        The two intervals are then one step (reading ``k``'s step is held unexplained until then)."""
        if delta <= 0 or k + 1 >= len(self.ts):
            return False
        drop = int(self.residual[k + 1] - self.residual[k])
        if drop >= 0 or int(self.traced[k + 1] - self.traced[k]) < -drop - tolerance(drop):
            return False
        nb, _, _ = self.bracket_of(int(self.ts[k]), int(self.ts[k + 1]), drop)
        if nb is None or nb[0] == "pools":
            return nb is None
        held = self.totals[nb[0]] + (delta if bracket is not None and bracket[0] == nb[0] else 0)
        return held + drop < -tolerance(drop)

    def sample(self, k: int, since: int | None, delta: int) -> None:
        """Sample ``k``: its change of the residual, and a step held back before it, split."""
        start = since
        if self.held_back:
            self.record(k, since, -self.held_back, "unexplained", None, None)
            delta += self.held_back
            start, self.held_back = self.held_since, 0
        if not delta:
            return
        bracket, cause_i, several = self.bracket_of(start, int(self.ts[k]), delta)
        if self.ran_ahead(k, delta, bracket):
            self.record(k, since, delta, "unexplained", None, None)
            self.held_back, self.held_since = delta, start
        elif delta < 0:
            # A family gives back only what it holds (the pools: the pool model's bytes and
            # the steps put on them); a drop past that is not its, and stays unexplained.
            give = 0  # no bracketed family: all of it unexplained
            if bracket is not None:
                held = self.totals[bracket[0]] + (int(self.model[k]) if bracket[0] == "pools" else 0)
                give = delta if held + delta >= -tolerance(delta) else -max(held, 0)
            if give:
                self.record(k, start, give, bracket[0], cause_i, None, several)  # type: ignore[index]
                if bracket[0] == "module_code":  # type: ignore[index]
                    self.module_used += give
            self.record(k, start, delta - give, "unexplained", None, None)
        else:
            self.take(k, start, delta, bracket, cause_i, several)

    def take(self, k: int, start: int | None, delta: int, bracket: tuple[str, float] | None, cause_i: int | None,
             several: bool) -> None:
        """A rise of the residual: to the families that explain it, up to their bounds, the rest unexplained."""
        parts = _explain(delta, self.costs, bracket)
        if parts is None:
            self.record(k, start, delta, "unexplained", None, None)
            return
        left = delta
        for category, nbytes, cost in parts:
            nbytes = min(nbytes, left) if nbytes > 0 else nbytes
            self.record(k, start, nbytes, category, cause_i if cost is None else None, cost, several)
            left -= nbytes
            if cost is not None:
                self.costs.settle(cost, nbytes)
            if cost is None and category == "module_code":
                self.module_used += nbytes
        self.record(k, start, left, "unexplained", None, None)


def explained_share(nvml_used: int, traced: int, split: dict[str, int]) -> float | None:
    """The share of NVML used that is traced or explained by measurement (None: nothing used)."""
    if nvml_used <= 0:
        return None
    explained = traced + sum(split.get(name, 0) for name in EXPLAINED)
    return max(0.0, min(1.0, explained / nvml_used))


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
