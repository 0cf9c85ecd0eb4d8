"""Give up the capabilities the daemon no longer needs once its probes are attached.

Loading the BPF program, binding the marker socket, chowning it to its group and raising limits
need root's powers; recording afterwards needs only these (:data:`KEEP`):

- ``CAP_BPF``, ``CAP_PERFMON``: attach the probes to a libcuda first mapped later (rescans);
- ``CAP_SYS_PTRACE``: read ``/proc/PID/environ`` and ``maps`` of other users' processes
  (their ``CUDA_VISIBLE_DEVICES`` and libraries);
- ``CAP_DAC_READ_SEARCH``: reach a libcuda below a folder root cannot search otherwise;
- ``CAP_SYS_RESOURCE``: raise the open-files limit when many probes attach.

Capabilities belong to threads, not processes: :func:`drop_capabilities` changes the calling
thread's bounding, ambient, effective, permitted and inheritable sets, so the daemon calls it on
its main thread and on each thread it started before (the NVML sampler), and starts the metrics
server's thread afterwards (threads inherit their creator's sets).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

CAP_DAC_READ_SEARCH = 2
CAP_SYS_PTRACE = 19
CAP_SYS_RESOURCE = 24
CAP_PERFMON = 38
CAP_BPF = 39
#: What the daemon keeps after attaching.
KEEP = frozenset({CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, CAP_SYS_RESOURCE, CAP_PERFMON, CAP_BPF})

_CAP_SETPCAP = 8
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class CapabilityError(OSError):
    """The kernel refused to change a capability set."""


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 40


def drop_capabilities(keep: frozenset[int] = KEEP) -> None:
    """Reduce the calling thread to ``keep`` (those of them it has): bounding set first (needs
    CAP_SETPCAP), then the ambient, effective, permitted and inheritable sets.

    Raises:
        CapabilityError: a prctl/capset call failed (errno and the step in the message).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    # Without CAP_SETPCAP (a daemon given only CAP_BPF + CAP_PERFMON) the bounding set cannot
    # shrink; the permitted set below still bounds what the process can ever have again.
    can_bound = bool(thread_capabilities().get("CapEff", 0) & (1 << _CAP_SETPCAP))
    for cap in range(_last_cap() + 1) if can_bound else ():
        if cap not in keep and libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            if errno != 22:  # EINVAL: a capability this kernel does not know
                raise CapabilityError(errno, f"cannot drop capability {cap} from the bounding set")
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL on old kernels: none to clear
    mask = 0
    for cap in keep:
        mask |= 1 << cap
    mask &= thread_capabilities().get("CapPrm", mask)  # a set can shrink, never grow
    header = _Header(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_Data * 2)()
    for i in range(2):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = data[i].permitted = word
        data[i].inheritable = 0
    if libc.capset(ctypes.byref(header), data) != 0:
        errno = ctypes.get_errno()
        raise CapabilityError(errno, "cannot reduce the capability sets (capset)")


def thread_capabilities(pid: int | str = "thread-self") -> dict[str, int]:
    """CapEff/CapPrm/CapBnd/CapInh/CapAmb of a task as masks (from /proc/PID/status)."""
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.startswith("Cap"):
                out[key] = int(value.strip(), 16)
    return out


def threads_keeping_more(keep: frozenset[int] = KEEP) -> list[str]:
    """Threads of this process whose effective set still has more than ``keep`` ("tid (comm)").

    A thread that a library started before the drop (OpenBLAS's workers, started when numpy is
    imported, unless ``OPENBLAS_NUM_THREADS=1``) keeps what it had.
    """
    mask = 0
    for cap in keep:
        mask |= 1 << cap
    out = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            eff = thread_capabilities(f"self/task/{tid}").get("CapEff", 0)
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                comm = f.read().strip()
        except OSError:
            continue  # the thread ended
        if eff & ~mask:
            out.append(f"{tid} ({comm})")
    return out
