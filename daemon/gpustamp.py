"""GPU stamping: which physical GPU each event and marker is on, from the process that made it.

The probes see a device ordinal (the calling thread's context's device); the trace holds the
physical GPU (NVML's index). The ordinal maps through the process's ``CUDA_VISIBLE_DEVICES``
(:func:`memrec.probes.procinfo.gpu_map`, read from /proc once per process), checked against the
GPUs NVML lists the process on where it can be. The live state fills in the rest (a free gets its
allocation's GPU...).

Why a module of its own: this is the daemon's only per-process bookkeeping (the processes seen,
whose ordinal maps are checked), and it is testable without the loop, the probes or a trace.

A pid names a process only together with its start time: a probed process's entry goes at its
PROC_EXIT, but a marker client that never used CUDA gets none, and a later process with its pid
must not inherit its command line, rank and GPU map (issue 23). So each entry keeps the start time
read with it; an entry no probe event confirmed is checked against ``/proc/PID/stat`` before it is
reused, and :meth:`GpuStamper.expire` drops those whose process is gone. At most
``MAX_UNPROBED`` such entries are kept (the oldest goes first).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any
from typing import Callable

import numpy as np

from memrec.base.untrusted import clean_text
from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo

log = logging.getLogger(__name__)

#: Kinds that are about a whole process, never one GPU (the one-GPU fallback skips them).
_PROCESS_KINDS = (int(Kind.PROC_EXIT), int(Kind.PROC_FORK))
#: Batches in which a new process's ordinal map is checked against NVML before giving up.
MAP_CHECK_TRIES = 20
#: Entries of processes no probe event has confirmed (marker clients) kept at once.
MAX_UNPROBED = 4096


def default_process_info(pid: int, gpus: list[GpuInfo], first_ts: int) -> ProcessInfo:
    """The process's /proc facts (memrec.probes.procinfo, imported only when a daemon runs)."""
    from memrec.probes.procinfo import process_info

    return process_info(pid, gpus, first_ts)


def default_start_time(pid: int) -> int | None:
    """The process's start time (memrec.probes.procinfo, imported only when a daemon runs)."""
    from memrec.probes.procinfo import read_start_time

    return read_start_time(pid)


def gpu_text(info: ProcessInfo) -> str:
    """How a process's device ordinals map to GPUs, for the log (never Python's None or [])."""
    cvd = "CUDA_VISIBLE_DEVICES unset" if info.cuda_visible_devices is None else (
        f"CUDA_VISIBLE_DEVICES={info.cuda_visible_devices}")
    if info.gpu_map:
        return f"{cvd} → GPUs {', '.join(map(str, info.gpu_map))}"
    if info.cuda_visible_devices is None:
        return f"{cvd}, no GPU list (no NVML): ordinal n is GPU n"
    return f"{cvd} → no GPU it can name"


class GpuStamper:
    """The processes seen and their ordinal → GPU maps; stamps events and markers with GPUs.

    Args:
        nvml: returns the NVML module (``process_gpus(indices)`` is asked, when it has one).
        process_info: ``(pid, gpus, first_ts) -> ProcessInfo`` (reads /proc).
        on_process: called with each new or corrected process (the daemon writes it to the trace).
        start_time: ``pid -> start time`` (None when gone): tells a reused pid from its old process.

    Attributes:
        gpus: the host's GPUs (NVML's list; empty without NVML: then ordinal n is GPU n).
        processes: pid → what is known of each live process, in the order they were seen.
    """

    def __init__(
        self,
        nvml: Callable[[], Any],
        process_info: Callable[[int, list[GpuInfo], int], ProcessInfo] | None = None,
        on_process: Callable[[ProcessInfo], None] = lambda _info: None,
        start_time: Callable[[int], int | None] | None = None,
    ) -> None:
        self._nvml = nvml
        self.process_info = process_info or default_process_info
        self.start_time = start_time or default_start_time
        self._on_process = on_process
        self.gpus: list[GpuInfo] = []
        self.processes: dict[int, ProcessInfo] = {}
        self._map_checked: set[int] = set()  # pids whose ordinal map NVML confirmed or corrected
        self._map_tries: dict[int, int] = {}
        self._started: dict[int, int | None] = {}  # pid -> start time read with its entry
        self._unprobed: dict[int, None] = {}  # pids no probe event confirmed, oldest first
        #: Entries dropped because their pid was reused or their process was gone.
        self.expired = 0
        self._nvml_listing: dict[int, set[int]] | None = None
        self._nvml_listing_failed = False

    def stamp(self, events: np.ndarray) -> None:
        """Fill the ``gpu`` column of a batch (every process in it read from /proc once)."""
        pids = events["pid"]
        self._nvml_listing = None
        for pid in np.unique(pids).tolist():
            rows = pids == pid
            if pid in self._unprobed:  # a marker client's entry: the same process, or a pid reused?
                self._check_reuse(pid)
                self._unprobed.pop(pid, None)
            info = self.process(pid, int(events["ts"][rows][0]))
            info = self._check_gpu_map(info, events["ordinal"][rows])
            self._stamp(events, rows, info)

    def forget_exited(self, events: np.ndarray) -> None:
        """Drop the processes that exited in this batch: a later process with the pid is a new one."""
        for pid in events["pid"][events["kind"] == int(Kind.PROC_EXIT)].tolist():
            self.forget(pid)

    def forget(self, pid: int) -> None:
        """Drop what is known of ``pid`` (gone): a later process with the pid is a new one."""
        self.processes.pop(pid, None)
        self._map_checked.discard(pid)
        self._map_tries.pop(pid, None)
        self._started.pop(pid, None)
        self._unprobed.pop(pid, None)

    def client(self, pid: int, first_ts: int) -> ProcessInfo:
        """The entry of a marker client's process, checked against its start time first (its pid
        may have been another client's, who never used CUDA and so got no PROC_EXIT)."""
        if pid in self.processes:
            self._check_reuse(pid)
        known = pid in self.processes
        info = self.process(pid, first_ts)
        if not known:
            self._unprobed[pid] = None
            while len(self._unprobed) > MAX_UNPROBED:
                self.forget(next(iter(self._unprobed)))
        return info

    def expire(self) -> int:
        """Drop the entries of marker clients whose process is gone or whose pid was reused; return
        how many (the loop calls it about once a second; entries of probed processes go at PROC_EXIT)."""
        before = self.expired
        for pid in list(self._unprobed):
            self._check_reuse(pid)
        return self.expired - before

    def _check_reuse(self, pid: int) -> None:
        """Forget ``pid``'s entry when its process is gone or another one has its pid now."""
        now = self.start_time(pid)
        if now is None or now != self._started.get(pid):
            self.expired += 1
            self.forget(pid)

    def marker(self, marker: Marker) -> Marker:
        """The client names its device ordinal; the trace holds the physical GPU."""
        if marker.gpu is None:
            return marker
        info = self.processes.get(marker.pid)
        if info is None:  # not read (over its uid's budget, or expired): keep the number the client gave
            return marker
        if self._identity(info):
            return marker
        if 0 <= marker.gpu < len(info.gpu_map):
            return dataclasses.replace(marker, gpu=info.gpu_map[marker.gpu])
        return marker  # unknown map: keep the number the client gave

    def process(self, pid: int, first_ts: int) -> ProcessInfo:
        """What is known of ``pid``; read from /proc (and logged, and passed on) the first time."""
        info = self.processes.get(pid)
        if info is None:
            self._started[pid] = self.start_time(pid)
            try:
                info = self.process_info(pid, self.gpus, first_ts)
            except Exception as error:  # /proc surprises must not cost the events
                log.warning("pid %d: cannot read /proc (%s)", pid, error)
                info = ProcessInfo(pid, None, [], None, None, [], first_ts)
            self.processes[pid] = info
            if not info.cmdline and info.exe is None:
                log.info("pid %d ended before /proc could be read: its CUDA_VISIBLE_DEVICES is unknown, "
                         "its ordinals are taken as the host's GPU numbers", pid)
            log.info("pid %d: %s (%s)", pid, clean_text(" ".join(info.cmdline), 200) or "?",
                     clean_text(gpu_text(info), 200))
            self._on_process(info)
        return info

    def _check_gpu_map(self, info: ProcessInfo, ordinals: np.ndarray) -> ProcessInfo:
        """Check a new process's ordinal → GPU map against the GPUs NVML lists it on.

        ``/proc/PID/environ`` shows the environment the process started with; a worker that sets
        CUDA_VISIBLE_DEVICES itself before CUDA starts would otherwise be put on the wrong GPU.
        Asked once per batch while some process is unchecked, at most MAP_CHECK_TRIES batches
        per process (NVML may not list processes of another PID namespace).
        """
        pid = info.pid
        if not self.gpus or pid in self._map_checked:
            return info
        seen = {int(o) for o in np.unique(ordinals).tolist() if o >= 0}
        if not seen:
            return info
        tries = self._map_tries[pid] = self._map_tries.get(pid, 0) + 1
        listed = self._nvml_process_gpus().get(pid)
        if not listed:
            if tries >= MAP_CHECK_TRIES:
                self._map_checked.add(pid)
            return info
        self._map_checked.add(pid)
        from memrec.probes.procinfo import checked_gpu_map

        corrected = checked_gpu_map(info.gpu_map, seen, listed)
        if corrected is None:
            return info
        log.warning(
            "pid %d: NVML lists it on GPU(s) %s, which CUDA_VISIBLE_DEVICES=%s from its start-up "
            "environment does not give (set later by the process?): ordinals now map to GPUs %s",
            pid, sorted(listed), info.cuda_visible_devices, corrected,
        )
        info = dataclasses.replace(info, gpu_map=corrected, gpu_map_source="nvml")
        self.processes[pid] = info
        self._on_process(info)
        return info

    def _nvml_process_gpus(self) -> dict[int, set[int]]:
        """pid → GPUs NVML lists it on, asked at most once per batch ({} without NVML)."""
        if self._nvml_listing is None:
            self._nvml_listing = {}
            query = getattr(self._nvml(), "process_gpus", None)
            if query is not None and not self._nvml_listing_failed:
                try:
                    self._nvml_listing = query([g.index for g in self.gpus])
                except Exception as error:  # NVML gone: keep the environ maps
                    log.info("cannot ask NVML for processes (%s): ordinal maps stay unchecked", error)
                    self._nvml_listing_failed = True
        return self._nvml_listing

    def _identity(self, info: ProcessInfo) -> bool:
        """No NVML and no CUDA_VISIBLE_DEVICES: ordinal n is GPU n (CUDA's and NVML's order)."""
        return not self.gpus and info.cuda_visible_devices is None

    def _stamp(self, events: np.ndarray, rows: np.ndarray, info: ProcessInfo) -> None:
        ordinal = events["ordinal"][rows].astype(np.int64)
        if self._identity(info):
            gpu = np.where(ordinal >= 0, ordinal, -1)
        else:
            gm = np.asarray(info.gpu_map, dtype=np.int64)
            gpu = np.full(len(ordinal), -1, dtype=np.int64)
            ok = (ordinal >= 0) & (ordinal < len(gm))
            gpu[ok] = gm[ordinal[ok]]
            if len(gm) == 1:
                kinds = events["kind"][rows]
                gpu[(ordinal == -1) & ~np.isin(kinds, _PROCESS_KINDS)] = gm[0]
        events["gpu"][rows] = gpu
