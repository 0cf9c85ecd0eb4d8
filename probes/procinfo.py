"""What ``/proc/PID`` says about a process, and its device ordinal → physical GPU map.

Processes may be gone by the time we look (short-lived children, a worker that crashed): every
reader returns what could be read and None/empty for the rest, never raises for a vanished pid.

``/proc/PID/environ`` is the environment the process was *started* with: a program that sets
``os.environ["CUDA_VISIBLE_DEVICES"]`` after it started (Ray does) is not seen here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from memrec.terms.events import MAX_CMDLINE_ARGS
from memrec.terms.events import GpuInfo
from memrec.terms.events import ProcessInfo

log = logging.getLogger(__name__)

PROC = Path("/proc")
#: Environment variables worth reading (the rest of the environment is never kept).
ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "RANK", "LOCAL_RANK", "WORLD_SIZE")
#: Bytes of a command line kept: any user's process may carry a 1 MB argv, and the daemon keeps
#: and writes the command line of every process it meets (a marker client's too).
MAX_CMDLINE_BYTES = 4096


@dataclass(frozen=True)
class ProcRead:
    """What could be read of one process (None or empty where it could not)."""

    pid: int
    ppid: int | None = None
    cmdline: list[str] = field(default_factory=list)
    exe: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def cuda_visible_devices(self) -> str | None:
        return self.env.get("CUDA_VISIBLE_DEVICES")

    @property
    def cuda_device_order(self) -> str | None:
        return self.env.get("CUDA_DEVICE_ORDER")

    @property
    def rank(self) -> dict:
        """``{"rank": n, "local_rank": n, "world_size": n}`` as far as the environment says."""
        out = {}
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            value = self.env.get(key, "")
            if value.strip().lstrip("-").isdigit():
                out[key.lower()] = int(value)
        return out


def read_cmdline(pid: int, proc: Path = PROC) -> list[str]:
    """The process's argv ([] when gone, a kernel thread, or a zombie), at most the first
    MAX_CMDLINE_ARGS arguments (a process record with more would be skipped by every reader) and
    MAX_CMDLINE_BYTES bytes (the last argument kept is cut, ending in "...")."""
    try:
        with open(proc / str(pid) / "cmdline", "rb") as f:
            data = f.read(MAX_CMDLINE_BYTES + 1)
    except OSError:
        return []
    cut = len(data) > MAX_CMDLINE_BYTES
    parts = data[:MAX_CMDLINE_BYTES].split(b"\0")
    if cut:
        parts[-1] += b"..."
    else:
        parts = parts[:-1]
    return [part.decode("utf-8", "replace") for part in parts[:MAX_CMDLINE_ARGS]]


def read_exe(pid: int, proc: Path = PROC) -> str | None:
    """The executable's path (None when gone or not readable)."""
    try:
        return os.readlink(proc / str(pid) / "exe")
    except OSError:
        return None


def _stat_field(pid: int, number: int, proc: Path) -> int | None:
    """Field ``number`` (1-based, as proc(5) counts them, >= 3) of ``/proc/PID/stat`` (None when gone)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[number - 3])
    except (IndexError, ValueError):
        return None


def read_ppid(pid: int, proc: Path = PROC) -> int | None:
    """The parent pid from ``/proc/PID/stat`` (None when gone)."""
    return _stat_field(pid, 4, proc)


def read_start_time(pid: int, proc: Path = PROC) -> int | None:
    """When the process started, in clock ticks after boot (``/proc/PID/stat`` field 22; None when
    gone): a pid and its start time name one process, a pid alone may be reused."""
    return _stat_field(pid, 22, proc)


def read_environ(pid: int, keys: tuple[str, ...] = ENV_KEYS, proc: Path = PROC) -> dict[str, str]:
    """The values of ``keys`` in the process's initial environment ({} when gone or unreadable)."""
    try:
        data = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    wanted = {k.encode() for k in keys}
    out = {}
    for entry in data.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key in wanted:
            out[key.decode()] = value.decode("utf-8", "replace")
    return out


def read_proc(pid: int, proc: Path = PROC) -> ProcRead:
    """Everything :mod:`procinfo` reads about ``pid``, as far as it can be read."""
    return ProcRead(
        pid=pid,
        ppid=read_ppid(pid, proc),
        cmdline=read_cmdline(pid, proc),
        exe=read_exe(pid, proc),
        env=read_environ(pid, ENV_KEYS, proc),
    )


def _match_uuid(entry: str, gpus: list[GpuInfo]) -> int | None:
    """The index of the one GPU whose UUID starts with ``entry`` (CUDA accepts unique prefixes)."""
    prefix = entry.lower()
    hits = [g.index for g in gpus if g.uuid and g.uuid.lower().startswith(prefix)]
    return hits[0] if len(hits) == 1 else None


def gpu_map(cuda_visible_devices: str | None, gpus: list[GpuInfo]) -> list[int]:
    """Map a process's device ordinals to physical GPUs (NVML indices), as CUDA numbers them.

    Args:
        cuda_visible_devices: the process's ``CUDA_VISIBLE_DEVICES`` (None when unset).
        gpus: the host's GPUs from NVML (may be empty when NVML is unavailable).

    Returns:
        ``result[ordinal]`` is the physical GPU of that ordinal. Unset: every GPU in order.
        Set but empty: no GPU (CUDA hides them all). Entries are indices or ``GPU-<uuid prefix>``;
        the first invalid, unknown, ambiguous or repeated entry ends the list, as in CUDA
        (``-1`` hides everything). ``MIG-...`` entries are not supported (logged; they end the
        list). Without NVML GPUs, integer entries are taken as physical indices and UUIDs cannot
        be resolved.
    """
    if cuda_visible_devices is None:
        return [g.index for g in gpus]
    known = {g.index for g in gpus}
    out: list[int] = []
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        if not entry:
            break
        index: int | None
        if entry.isascii() and entry.isdigit():
            index = int(entry)
            if gpus and index not in known:
                index = None
        elif entry.upper().startswith("MIG-"):
            log.warning("CUDA_VISIBLE_DEVICES entry %s: MIG devices are not supported; ordinals from it on are unmapped", entry)
            break
        elif entry.upper().startswith("GPU-"):
            index = _match_uuid(entry, gpus)
            if index is None and not gpus:
                log.info("CUDA_VISIBLE_DEVICES entry %s: no NVML GPU list to resolve a UUID", entry)
        else:
            index = None  # "-1", garbage: CUDA stops here
        if index is None or index in out:
            break
        out.append(index)
    return out


def checked_gpu_map(gpu_map: list[int], ordinals: set[int], nvml_gpus: set[int]) -> list[int] | None:
    """Check an ordinal → GPU map against the GPUs NVML lists the process on; None if it holds.

    ``/proc/PID/environ`` holds the environment a process started with; one that sets
    CUDA_VISIBLE_DEVICES itself before CUDA initialises (spawned workers often do) maps its
    ordinals differently. When the GPUs the map gives for the ordinals the process used are not
    all among the GPUs NVML lists it on, the ordinals are taken to number NVML's GPUs in bus
    order (CUDA's order on hosts of one GPU model), which is returned.
    """
    if not nvml_gpus or not ordinals:
        return None
    mapped = {gpu_map[o] for o in ordinals if 0 <= o < len(gpu_map)}
    if len(mapped) == len(ordinals) and mapped <= nvml_gpus:
        return None
    candidate = sorted(nvml_gpus)
    if max(ordinals) >= len(candidate):
        return None
    return candidate


def process_info(pid: int, gpus: list[GpuInfo], first_ts: int, proc: Path = PROC) -> ProcessInfo:
    """A :class:`~memrec.terms.events.ProcessInfo` for ``pid`` with its ordinal → GPU map."""
    read = read_proc(pid, proc)
    order = read.cuda_device_order
    if order != "PCI_BUS_ID" and len({g.name for g in gpus}) > 1:
        log.info(
            "pid %d: CUDA_DEVICE_ORDER=%s on a host with mixed GPU models: CUDA may number devices "
            "fastest-first, unlike NVML's bus order; the ordinal map may be wrong",
            pid,
            order or "FASTEST_FIRST (default)",
        )
    return ProcessInfo(
        pid=pid,
        ppid=read.ppid,
        cmdline=read.cmdline,
        exe=read.exe,
        cuda_visible_devices=read.cuda_visible_devices,
        gpu_map=gpu_map(read.cuda_visible_devices, gpus),
        first_ts=first_ts,
        rank=read.rank,
    )
