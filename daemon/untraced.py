"""NVML per-process readings at the moments that explain the untraced band.

Why this exists: NVML's per-process ``used`` minus what the probes traced is the "untraced" band
(contexts, device code, pool reserves). Its steps can only be told apart if NVML is read on both
sides of each one; the sampler's 1 Hz would put a context, NCCL's kernels and a pool trim into one
step. So the daemon reads NVML for the GPUs concerned:

- right before a context is bound (``CTX_BEGIN``, submitted at the entry of the retain/create
  with a forced wakeup: the call takes ~100 ms on an H200, the reader wakes within a few) and right
  after (``CTX``): the difference is the context's cost;
- right after a call that sets a context limit, instantiates, uploads or trims graphs, makes or
  destroys a CUDA array, or changes a multicast object (``CTX_LIMIT``, ``GRAPH_EXEC``,
  ``GRAPH_TRIM``, ``ARRAY_*``, ``MULTICAST_*``: rare calls, each read at once): what such a call
  promises the device lands later (the stack at the next launch, the graph pool at the first
  launch), and the reading separates it from what came before;
- after a batch that loaded device code or changed a pool (``CODE_LOAD``, ``CODE_UNLOAD``,
  ``POOL*``), at most once per ``min_interval`` per GPU (PyTorch under
  ``CUDA_MODULE_LOADING=EAGER`` loads thousands of libraries at start-up); after kernel fetches
  (``KERNEL_LOAD``) at most once per ``fetch_interval`` (NCCL fetches ~250 kernels in its init,
  and each reading takes the driver's lock: every 20 ms cost NCCL's init +20 % on an H200, so
  200 ms), except the first kernel fetched after a context bind (read at once: the context's
  step); and after
  stream-ordered allocations and frees at most once per ``stream_interval`` (PyTorch's
  ``cudaMallocAsync`` backend allocates every tensor that way);
- once more ``settle`` after any of those (a lazily loaded kernel reaches the device at its first
  launch, just after the fetch that the probes saw).

The readings are ordinary ``procmem`` rows in the trace; :mod:`memrec.analysis.untraced.split` does the
attribution. :func:`name_images` also names the library file an in-memory image came from
(``cuLibraryLoadData`` is handed a pointer into ``libnccl.so.2``'s or ``libcublasLt.so``'s mapped
fatbin), so module code can be told per library.
"""

from __future__ import annotations

import bisect
import logging
import os
from typing import Any
from typing import Callable

import numpy as np

from memrec.terms.events import FLAG_NAME
from memrec.terms.events import IPC_HANDLE_SIZE
from memrec.terms.events import STREAM_ORDERED_APIS
from memrec.terms.events import Kind
from memrec.probes.libs import parse_maps

log = logging.getLogger(__name__)

#: Kinds after which NVML is read (a bind and the rare calls of issue 21: always; the others:
#: rate-limited).
_BIND = (int(Kind.CTX_BEGIN), int(Kind.CTX))
_RARE = tuple(int(k) for k in (Kind.CTX_LIMIT, Kind.GRAPH_EXEC, Kind.GRAPH_TRIM, Kind.ARRAY_CREATE,
                               Kind.ARRAY_DESTROY, Kind.MULTICAST_CREATE, Kind.MULTICAST_ADD, Kind.MULTICAST_BIND,
                               Kind.MULTICAST_UNBIND))
_STEPS = tuple(int(k) for k in (Kind.CODE_LOAD, Kind.CODE_UNLOAD, Kind.KERNEL_LOAD, Kind.POOL,
                                Kind.POOL_DESTROY, Kind.POOL_TRIM, Kind.POOL_ATTR))
_STREAM = [int(a) for a in STREAM_ORDERED_APIS]
#: CTX events with this aux are cuCtxGetDevice, not a bind.
_CTX_GET_DEVICE = 2


class UntracedReadings:
    """Reads NVML per-process memory around context binds, code loads and pool changes.

    Args:
        nvml: the daemon's NVML module (``process_memory(indices, now)``); readings are off when it
            has none or NVML is unavailable.
        gpus: the NVML indices of the host's GPUs (an event whose GPU is unknown reads them all).
        write: receives the rows (the trace writer's ``write_procmem``).
        clock: CLOCK_MONOTONIC ns, the trace's clock.
        min_interval: seconds between two readings of one GPU after code loads or pool calls.
        fetch_interval: the same after kernel fetches only (NCCL fetches ~250 kernels in its init;
            a reading every 20 ms cost it +20 % on an H200: each takes the driver's lock).
        stream_interval: the same after stream-ordered allocations and frees only (with the
            ``cudaMallocAsync`` backend every tensor is one: at most this often per GPU, like the
            device sampler's 10 Hz, whatever the allocation rate).
        settle: seconds after a step when NVML is read once more.
    """

    def __init__(
        self,
        nvml: Any,
        gpus: list[int],
        write: Callable[[np.ndarray], None],
        clock: Callable[[], int],
        min_interval: float = 0.02,
        fetch_interval: float = 0.2,
        stream_interval: float = 0.1,
        settle: float = 0.25,
    ) -> None:
        self._query = getattr(nvml, "process_memory", None)
        self._unavailable = getattr(nvml, "NvmlUnavailable", ())
        self.gpus = list(gpus)
        self.write = write
        self.clock = clock
        self.min_interval = int(min_interval * 1e9)
        self.fetch_interval = int(fetch_interval * 1e9)
        self.stream_interval = int(stream_interval * 1e9)
        self.settle = int(settle * 1e9)
        self._last: dict[int, int] = {}
        self._deferred: dict[int, int] = {}  # GPU -> when a rate-limited reading is taken
        self._settle: dict[int, int] = {}  # GPU -> when to read once more after a step
        self._fresh: set[tuple[int, int]] = set()  # (pid, gpu) that bound a context, no kernel fetched yet
        self.readings = 0  # NVML calls made (stats and tests)

    @property
    def enabled(self) -> bool:
        return self._query is not None and bool(self.gpus)

    def after_batch(self, events: np.ndarray) -> None:
        """Read NVML for the GPUs a batch of stamped events bound a context on or loaded code into."""
        if not self.enabled or not len(events):
            return
        kinds = events["kind"]
        ok = events["result"] == 0
        bind = (np.isin(kinds, _BIND) & ~((kinds == int(Kind.CTX)) & (events["aux"] == _CTX_GET_DEVICE))) \
            | (np.isin(kinds, _RARE) & ok)
        code = np.isin(kinds, _STEPS) & ok
        stream = np.isin(events["api"], _STREAM) & ok
        if not (bind.any() or code.any() or stream.any()):
            return
        now = self.clock()
        forced = self._gpus_of(events["gpu"][bind])
        forced |= self._first_kernels(events, bind, kinds, ok)
        fetch = code & (kinds == int(Kind.KERNEL_LOAD))
        coded = self._gpus_of(events["gpu"][code & ~fetch])
        fetched = self._gpus_of(events["gpu"][fetch])
        streamed = self._gpus_of(events["gpu"][stream])
        wanted = set(forced)
        for g in (coded | fetched | streamed) - forced:
            interval = (self.min_interval if g in coded else self.fetch_interval if g in fetched
                        else self.stream_interval)
            ready = self._last.get(g, now - interval) + interval
            if now >= ready:
                wanted.add(g)
            else:  # too soon after the last one: taken at the end of the interval, never skipped
                self._deferred[g] = min(self._deferred.get(g, ready), ready)
        for g in forced | coded | fetched | streamed:
            self._settle[g] = now + self.settle
        self._read(wanted, now)

    def _first_kernels(self, events: np.ndarray, bind: np.ndarray, kinds: np.ndarray, ok: np.ndarray) -> set[int]:
        """GPUs where a process fetched its first kernel since it bound a context: read at once
        (that step is the context's, PyTorch's +92 MiB on an H200; the fetches after it are module
        code, and a reading rate-limited past them would give them to the context)."""
        bound = bind & (kinds == int(Kind.CTX)) & ok
        for p, g in zip(events["pid"][bound].tolist(), events["gpu"][bound].tolist()):
            self._fresh.add((p, g))
        if len(self._fresh) > 4096:  # processes that bound contexts and never fetched a kernel
            self._fresh.clear()
        if not self._fresh:
            return set()
        fetch = (kinds == int(Kind.KERNEL_LOAD)) & ok
        out: set[int] = set()
        for p, g in zip(events["pid"][fetch].tolist(), events["gpu"][fetch].tolist()):
            if (p, g) in self._fresh:
                self._fresh.discard((p, g))
                out |= self._gpus_of(np.asarray([g]))
        return out

    def tick(self, now: int) -> None:
        """Take the deferred and follow-up readings that are due (the daemon's loop calls this)."""
        due: set[int] = set()
        for table in (self._deferred, self._settle):
            for g in [g for g, t in table.items() if now >= t]:
                del table[g]
                due.add(g)
        self._read(due, now)

    def _gpus_of(self, gpus: np.ndarray) -> set[int]:
        if not len(gpus):
            return set()
        found = {int(g) for g in np.unique(gpus).tolist()}
        if -1 in found:  # not resolved (a library loaded before any context): every GPU
            return set(self.gpus)
        return found & set(self.gpus)

    def _read(self, gpus: set[int], now: int) -> None:
        if not gpus:
            return
        try:
            rows = self._query(sorted(gpus), now)
        except self._unavailable as error:
            log.info("NVML unavailable (%s): no readings around contexts and code loads", error)
            self._query = None
            return
        self.readings += 1
        for g in gpus:
            self._last[g] = now
            self._deferred.pop(g, None)
        if len(rows):
            self.write(rows)


def _read_maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def name_images(events: np.ndarray, read_maps: Callable[[int], str] = _read_maps) -> int:
    """Name, in place, the mapped file each unnamed in-memory code image lies in; return how many.

    Reads ``/proc/PID/maps`` once per process of the batch that loaded code (at start-up, or once
    per module): the process surely still runs, its events having just been drained. An image in
    anonymous memory (a JIT's cubin) stays unnamed.
    """
    m = ((events["kind"] == int(Kind.CODE_LOAD)) & (events["ptr"] != 0) & (events["result"] == 0)
         & ((events["flags"] & FLAG_NAME) == 0))
    if not m.any() or not events.flags.writeable:
        return 0
    named = 0
    rows = np.nonzero(m)[0]
    for pid in np.unique(events["pid"][rows]).tolist():
        try:
            entries = sorted(parse_maps(read_maps(pid)), key=lambda e: e.start)
        except OSError:
            continue
        starts = [e.start for e in entries]
        for i in rows[events["pid"][rows] == pid].tolist():
            ptr = int(events["ptr"][i])
            k = bisect.bisect_right(starts, ptr) - 1
            if k < 0 or ptr >= entries[k].end:
                continue
            name = os.path.basename(entries[k].path).encode()[: IPC_HANDLE_SIZE - 1]
            events["ipc"][i] = np.void(name.ljust(IPC_HANDLE_SIZE, b"\0"))
            events["flags"][i] |= FLAG_NAME
            named += 1
    return named
