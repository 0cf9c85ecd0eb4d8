"""NVML: the GPU list for trace headers and the sampler of device and per-process memory.

Every NVML call goes through :func:`nvml_query`, the one choke point (tests replace it): it
initialises NVML lazily under a lock, decodes bytes to str, and turns pynvml's exceptions into
:class:`NvmlUnavailable` (no NVML on this host: a one-line reason) or :class:`NvmlError` (one call
failed: a GPU lost, a function not supported...), so no other module needs pynvml.

Sampling costs, measured on an H200 host: ``nvmlDeviceGetMemoryInfo`` ≈ 6 µs, but
``nvmlDeviceGetComputeRunningProcesses`` may take milliseconds on some drivers and holds the
driver's lock, hence two rates (10 Hz device memory, 1 Hz per-process memory by default).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any
from typing import Callable

import numpy as np

from memrec.base.errors import MemrecError
from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.events import GpuInfo

log = logging.getLogger(__name__)

# NVML return codes (nvml.h; stable ABI).
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
#: nvmlMemory_v2 (version 2 of the struct, 40 bytes): ``NVML_STRUCT_VERSION(Memory, 2)``.
NVML_MEMORY_V2 = (2 << 24) | 40
#: The value NVML reports for "not available" in 64-bit fields.
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1
#: Errors of nvmlDeviceGetMemoryInfo v2 that mean "this driver has only v1".
_V2_UNSUPPORTED = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_ARGUMENT_VERSION_MISMATCH)


class NvmlUnavailable(MemrecError):
    """NVML cannot be used on this host (no library, no driver); ``str()`` is one line."""


class NvmlError(MemrecError):
    """One NVML call failed.

    Attributes:
        function: the NVML function called.
        code: NVML's return code (e.g. :data:`NVML_ERROR_GPU_IS_LOST`), or None.
    """

    def __init__(self, function: str, code: int | None, message: str) -> None:
        super().__init__(f"{function}: {message}")
        self.function = function
        self.code = code

    @property
    def gpu_lost(self) -> bool:
        return self.code == NVML_ERROR_GPU_IS_LOST


_init_lock = threading.Lock()
_pynvml: Any = None  # the module, once nvmlInit succeeded
_unavailable: str | None = None  # why NVML cannot be used (cached: no retry per call)
_told_unavailable = False


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _lazy_init() -> Any:
    """Import pynvml and call nvmlInit once (double-checked under a lock)."""
    global _pynvml, _unavailable
    if _pynvml is not None:
        return _pynvml
    with _init_lock:
        if _pynvml is not None:
            return _pynvml
        if _unavailable is not None:
            raise NvmlUnavailable(_unavailable)
        try:
            import pynvml
        except ImportError as error:
            _unavailable = f"the nvidia-ml-py package is not installed ({error})"
            raise NvmlUnavailable(_unavailable) from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            _unavailable = "libnvidia-ml.so.1 not found (no NVIDIA driver on this host)"
            raise NvmlUnavailable(_unavailable) from None
        except pynvml.NVMLError as error:
            _unavailable = f"nvmlInit failed: {_decode(str(error))}"
            raise NvmlUnavailable(_unavailable) from None
        except AttributeError as error:  # a broken or mismatched pynvml
            _unavailable = f"the pynvml module is broken ({error})"
            raise NvmlUnavailable(_unavailable) from None
        _pynvml = pynvml
        atexit.register(_shutdown)
        return pynvml


def _shutdown() -> None:
    global _pynvml
    with _init_lock:
        if _pynvml is not None:
            try:
                _pynvml.nvmlShutdown()
            except Exception:
                pass
            _pynvml = None


def nvml_query(name: str, *args: Any) -> Any:
    """Call the pynvml function ``name`` with ``args``: the one way memrec talks to NVML.

    Bytes results are decoded to str.

    Raises:
        NvmlUnavailable: NVML cannot be initialised on this host (said in one line).
        NvmlError: the call failed (``.code`` is NVML's return code; ``.gpu_lost`` for a lost GPU),
            or pynvml has no such function.
    """
    pynvml = _lazy_init()
    func = getattr(pynvml, name, None)
    if func is None:
        raise NvmlError(name, NVML_ERROR_FUNCTION_NOT_FOUND, "not provided by this pynvml")
    try:
        return _decode(func(*args))
    except pynvml.NVMLError as error:
        raise NvmlError(name, getattr(error, "value", None), _decode(str(error))) from None


def note_unavailable(error: NvmlUnavailable) -> None:
    """Say once per process that NVML is unavailable and what that means for the recording."""
    global _told_unavailable
    if not _told_unavailable:
        _told_unavailable = True
        log.warning("NVML unavailable: %s; recording without NVML samples or a GPU list", error)


def list_gpus() -> list[GpuInfo]:
    """The host's GPUs in NVML order (PCI bus order). Command line equivalent: ``nvidia-smi -L``.

    A GPU that cannot be queried is listed with ``uuid=None`` and its error as the name.

    Raises:
        NvmlUnavailable: no NVML on this host.
        NvmlError: the GPU count cannot be read.
    """
    out = []
    for index in range(int(nvml_query("nvmlDeviceGetCount"))):
        try:
            handle = nvml_query("nvmlDeviceGetHandleByIndex", index)
            uuid = nvml_query("nvmlDeviceGetUUID", handle)
            name = nvml_query("nvmlDeviceGetName", handle)
            total = int(nvml_query("nvmlDeviceGetMemoryInfo", handle).total)
        except NvmlError as error:
            log.warning("GPU %d: %s", index, error)
            out.append(GpuInfo(index=index, uuid=None, name=f"ERROR: {error}", total=0))
            continue
        try:
            bar1: int | None = int(nvml_query("nvmlDeviceGetBAR1MemoryInfo", handle).bar1Total)
        except NvmlError:
            bar1 = None
        out.append(GpuInfo(index=index, uuid=uuid, name=name, total=total, bar1_total=bar1,
                           resident_threads=resident_threads(handle)))
    return out


#: Compute capability -> (CUDA cores per SM, resident threads per SM), from NVIDIA's tuning guides.
SM_SHAPES = {(7, 0): (64, 2048), (7, 5): (64, 1024), (8, 0): (64, 2048), (8, 6): (128, 1536), (8, 7): (128, 2048),
             (8, 9): (128, 1536), (9, 0): (128, 2048), (10, 0): (128, 2048), (10, 3): (128, 2048),
             (12, 0): (128, 1536)}


def resident_threads(handle: Any) -> int | None:
    """SMs × resident threads per SM (what a raised stack limit costs per byte: the stack is placed
    for every thread that can be resident; docs/validation/families.md), None where unknown."""
    try:
        cores = int(nvml_query("nvmlDeviceGetNumGpuCores", handle))
        cc = tuple(int(x) for x in nvml_query("nvmlDeviceGetCudaComputeCapability", handle))
    except (NvmlError, AttributeError, TypeError, ValueError):
        return None
    shape = SM_SHAPES.get(cc)
    if shape is None or cores <= 0 or cores % shape[0]:
        return None
    return cores // shape[0] * shape[1]


def process_gpus(indices: list[int]) -> dict[int, set[int]]:
    """Which GPUs NVML lists each process on (pid → NVML indices), asked now.

    The daemon asks when a new process's first events arrive, to check the ordinal → GPU map it
    derived from ``/proc/PID/environ``: a process that sets CUDA_VISIBLE_DEVICES after it started
    (``os.environ[...] = ...`` before CUDA initialises) shows the old value there.

    Raises:
        NvmlUnavailable: no NVML on this host.
    """
    out: dict[int, set[int]] = {}
    for _, gpu, pid, _ in process_memory(indices, 0).tolist():
        out.setdefault(int(pid), set()).add(int(gpu))
    return out


def process_memory(indices: list[int], now: int) -> np.ndarray:
    """Every process NVML lists on the GPUs ``indices`` with its used memory, asked now.

    The daemon asks right before and after a context is bound and after device code or pool
    calls, so each step of a process's untraced band has a reading on both sides (the sampler's
    1 Hz would mix several steps into one). A GPU that cannot answer is left out (logged at debug).

    Returns:
        One :data:`~memrec.terms.columns.PROCMEM_DTYPE` row per (GPU, process), ``ts`` = ``now``.

    Raises:
        NvmlUnavailable: no NVML on this host.
    """
    rows: list[tuple] = []
    for index in indices:
        try:
            handle = nvml_query("nvmlDeviceGetHandleByIndex", index)
            procs = nvml_query("nvmlDeviceGetComputeRunningProcesses", handle)
        except NvmlError as error:
            log.debug("GPU %d: running processes unavailable (%s)", index, error)
            continue
        rows += _procmem_rows(now, index, procs)
    return np.array(rows, dtype=PROCMEM_DTYPE)


def _procmem_rows(now: int, gpu: int, procs: Any) -> list[tuple]:
    """PROCMEM rows of one GPU's process list; used is -1 when NVML cannot say."""
    rows = []
    for p in procs or ():
        used = getattr(p, "usedGpuMemory", None)
        if used is None or used == NVML_VALUE_NOT_AVAILABLE:
            used = -1
        rows.append((now, gpu, int(p.pid), int(used)))
    return rows


class NvmlSampler:
    """Samples every GPU's memory (``device_hz``) and per-process memory (``process_hz``).

    Runs on its own daemon thread and hands each tick's rows to ``sink(nvml_rows, procmem_rows)``
    (arrays of :data:`~memrec.terms.columns.NVML_DTYPE` and :data:`~memrec.terms.columns.PROCMEM_DTYPE`; either
    may be empty). The schedule does not drift: deadlines advance by whole periods from the start,
    and a tick that falls behind skips to the next deadline instead of bursting.

    A failing call is logged once (per GPU, function and error) and its values are -1; a lost GPU
    is logged once and skipped from then on; neither stops the thread. Without NVML the thread
    says so once (:func:`note_unavailable`) and ends.

    Args:
        sink: receives the rows (called on the sampler thread).
        device_hz: device-memory samples per second (0 disables them).
        process_hz: per-process samples per second (0 disables them).
        clock: CLOCK_MONOTONIC ns (the trace's clock); injectable for tests of :meth:`tick`.
    """

    def __init__(
        self,
        sink: Callable[[np.ndarray, np.ndarray], None],
        device_hz: float = 10.0,
        process_hz: float = 1.0,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if device_hz < 0 or process_hz < 0:
            raise ValueError("sampling rates must be >= 0")
        self.sink = sink
        self.clock = clock
        self.device_period = int(1e9 / device_hz) if device_hz else None
        self.process_period = int(1e9 / process_hz) if process_hz else None
        self._handles: list[tuple[int, Any]] | None = None
        self._lost: set[int] = set()
        self._memory_v1: set[int] = set()  # GPUs without nvmlDeviceGetMemoryInfo v2
        self._logged: set[tuple] = set()
        self._next_device: int | None = None
        self._next_process: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: False once NVML turned out to be unavailable (the thread has ended).
        self.available = True
        #: ticks of each kind done (tests and stats)
        self.device_ticks = 0
        self.process_ticks = 0

    # -- thread --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the sampling thread (no-op when both rates are 0)."""
        if self._thread is not None or (self.device_period is None and self.process_period is None):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="memrec-nvml", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and wait for it (a tick in progress finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                deadline = self.tick(self.clock())
            except Exception:  # never let a bug end the samples silently
                log.exception("NVML sampler tick failed")
                deadline = self.clock() + (self.device_period or self.process_period or 10**9)
            if deadline is None:
                return
            self._stop.wait(max(0, deadline - self.clock()) / 1e9)

    # -- one tick ------------------------------------------------------------------------------

    def tick(self, now: int) -> int | None:
        """Take the samples due at ``now``, hand them to the sink; return the next deadline.

        Returns None when sampling is over (NVML unavailable).
        """
        if self._handles is None and not self._open():
            return None if not self.available else now + (self.process_period or self.device_period or 10**9)
        if self._next_device is None:
            self._next_device = now if self.device_period else None
            self._next_process = now if self.process_period else None
        device_rows = np.zeros(0, NVML_DTYPE)
        process_rows = np.zeros(0, PROCMEM_DTYPE)
        if self._next_device is not None and now >= self._next_device:
            device_rows = self.sample_devices(now)
            self.device_ticks += 1
            self._next_device = _advance(self._next_device, self.device_period, now)
        if self._next_process is not None and now >= self._next_process:
            process_rows = self.sample_processes(now)
            self.process_ticks += 1
            self._next_process = _advance(self._next_process, self.process_period, now)
        if len(device_rows) or len(process_rows):
            self.sink(device_rows, process_rows)
        return min(t for t in (self._next_device, self._next_process) if t is not None)

    def _open(self) -> bool:
        try:
            count = int(nvml_query("nvmlDeviceGetCount"))
            handles = [(i, nvml_query("nvmlDeviceGetHandleByIndex", i)) for i in range(count)]
        except NvmlUnavailable as error:
            note_unavailable(error)
            self.available = False
            return False
        except NvmlError as error:
            self._log_once(("open", error.code), "NVML: cannot list GPUs (%s); retrying", error)
            return False
        self._handles = handles
        log.info("NVML sampler: %d GPU(s), device memory every %s, processes every %s", count,
                 _period_text(self.device_period), _period_text(self.process_period))
        return True

    def _log_once(self, key: tuple, message: str, *args: Any) -> None:
        if key not in self._logged and len(self._logged) < 1024:
            self._logged.add(key)
            log.warning(message, *args)

    def _call(self, gpu: int, name: str, *args: Any) -> Any:
        """One call for one GPU: None (logged once) when it fails; a lost GPU is skipped from now on."""
        try:
            return nvml_query(name, *args)
        except NvmlError as error:
            if error.gpu_lost:
                self._lost.add(gpu)
                log.warning("GPU %d is lost (%s): no more NVML samples from it", gpu, error)
            else:
                self._log_once((gpu, name, error.code), "GPU %d: %s (logged once)", gpu, error)
            return None

    def _memory(self, gpu: int, handle: Any) -> tuple[int, int, int, int] | None:
        """(used, reserved, free, total): v2 where the driver has it, else v1 (reserved -1)."""
        if gpu not in self._memory_v1:
            try:
                mem = nvml_query("nvmlDeviceGetMemoryInfo", handle, NVML_MEMORY_V2)
                return int(mem.used), int(mem.reserved), int(mem.free), int(mem.total)
            except NvmlError as error:
                if error.gpu_lost:
                    self._lost.add(gpu)
                    log.warning("GPU %d is lost (%s): no more NVML samples from it", gpu, error)
                    return None
                if error.code not in _V2_UNSUPPORTED:
                    self._log_once((gpu, "memory_v2", error.code), "GPU %d: %s (logged once)", gpu, error)
                    return None
                self._memory_v1.add(gpu)
                log.info("GPU %d: nvmlDeviceGetMemoryInfo v2 unsupported (%s); using v1", gpu, error)
        mem = self._call(gpu, "nvmlDeviceGetMemoryInfo", handle)
        if mem is None:
            return None
        return int(mem.used), -1, int(mem.free), int(mem.total)

    def sample_devices(self, now: int) -> np.ndarray:
        """One NVML_DTYPE row per GPU that answered."""
        rows = []
        for gpu, handle in self._handles or ():
            if gpu in self._lost:
                continue
            mem = self._memory(gpu, handle)
            if gpu in self._lost:
                continue
            bar1 = self._call(gpu, "nvmlDeviceGetBAR1MemoryInfo", handle)
            if mem is None and bar1 is None:
                continue
            used, reserved, free, total = mem if mem is not None else (-1, -1, -1, -1)
            bar1_used, bar1_total = (int(bar1.bar1Used), int(bar1.bar1Total)) if bar1 is not None else (-1, -1)
            rows.append((now, gpu, used, reserved, free, total, bar1_used, bar1_total))
        return np.array(rows, dtype=NVML_DTYPE)

    def sample_processes(self, now: int) -> np.ndarray:
        """One PROCMEM_DTYPE row per (GPU, process) NVML lists; used is -1 when NVML cannot say."""
        rows = []
        for gpu, handle in self._handles or ():
            if gpu in self._lost:
                continue
            procs = self._call(gpu, "nvmlDeviceGetComputeRunningProcesses", handle)
            rows += _procmem_rows(now, gpu, procs)
        return np.array(rows, dtype=PROCMEM_DTYPE)


def _advance(deadline: int, period: int | None, now: int) -> int | None:
    """The next deadline after ``now`` on the grid ``deadline + k * period`` (no drift, no burst)."""
    if period is None:
        return None
    deadline += period
    if deadline <= now:
        deadline += ((now - deadline) // period + 1) * period
    return deadline


def _period_text(period: int | None) -> str:
    return "never" if period is None else f"{period / 1e9:g} s"
