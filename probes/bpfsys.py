"""The few ``bpf()`` and ``perf_event_open()`` calls memrec's loader needs, through libc ``syscall``.

Why raw syscalls and not libbcc: a warm start must not pay for loading libbcc (LLVM linked in,
a few hundred ms) when it only creates maps, loads already compiled programs and attaches them.
Every call here is a kernel ABI that has been stable since 4.17 (uprobes through the ``uprobe``
perf PMU); each returns an fd or raises :class:`OSError` with the kernel's errno.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import struct
from pathlib import Path

_NR = {"x86_64": (321, 298), "aarch64": (280, 241)}  # (bpf, perf_event_open)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# bpf() commands and types used here (include/uapi/linux/bpf.h).
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, PROG_LOAD, OBJ_GET_INFO_BY_FD, LINK_CREATE = 0, 1, 2, 5, 15, 28
MAP_DELETE_ELEM = 3
ENABLE_STATS = 32
PROG_TYPE_KPROBE, PROG_TYPE_TRACEPOINT = 2, 5
#: expected_attach_type / link attach type of multi-uprobe links (kernel >= 6.6).
TRACE_UPROBE_MULTI = 48
_UPROBE_MULTI_RETURN = 1
_ATTR_SIZE = 128
_PERF_TYPE_TRACEPOINT = 2
_PERF_FLAG_FD_CLOEXEC = 8
_PERF_EVENT_IOC_ENABLE = 0x2400
_PERF_EVENT_IOC_SET_BPF = 0x40042408
#: The link attach type of a BPF program on a perf event (BPF_PERF_EVENT), for a cookie.
_PERF_EVENT_LINK = 41
_PERF_ATTR_SIZE = 120
_UPROBE_PMU = Path("/sys/bus/event_source/devices/uprobe")
#: The verifier's log for a program it refuses (the reason is at its end).
_LOG_SIZE = 1 << 20


def _numbers() -> tuple[int, int]:
    try:
        return _NR[platform.machine()]
    except KeyError:
        raise OSError(errno.ENOSYS, f"no bpf() syscall number known for {platform.machine()}") from None


def _call(nr: int, *args) -> int:
    ret = _libc.syscall(ctypes.c_long(nr), *args)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


def bpf(cmd: int, attr: ctypes.Array) -> int:
    """``bpf(cmd, attr, sizeof attr)``: the result, or OSError with the kernel's errno."""
    return _call(_numbers()[0], ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))


def _attr() -> ctypes.Array:
    return ctypes.create_string_buffer(_ATTR_SIZE)


def _addr(buf) -> int:
    return ctypes.addressof(buf)


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, flags: int, name: str) -> int:
    """Create a map; return its fd."""
    attr = _attr()
    struct.pack_into("<7I", attr, 0, map_type, key_size, value_size, max_entries, flags, 0, 0)
    struct.pack_into("16s", attr, 28, name.encode()[:15])
    return bpf(MAP_CREATE, attr)


def map_info(fd: int) -> dict:
    """The kernel's description of map ``fd`` (type, sizes, entries, flags, name)."""
    info = ctypes.create_string_buffer(88)
    attr = _attr()
    struct.pack_into("<IIQ", attr, 0, fd, ctypes.sizeof(info), _addr(info))
    bpf(OBJ_GET_INFO_BY_FD, attr)
    kind, _id, key, value, entries, flags = struct.unpack_from("<6I", info, 0)
    name = struct.unpack_from("16s", info, 24)[0].split(b"\0", 1)[0].decode()
    return {"type": kind, "key_size": key, "value_size": value, "max_entries": entries, "flags": flags, "name": name}


def prog_run_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of program ``fd``: counted only while statistics are enabled
    (:func:`enable_stats`)."""
    info = ctypes.create_string_buffer(208)
    attr = _attr()
    struct.pack_into("<IIQ", attr, 0, fd, ctypes.sizeof(info), _addr(info))
    bpf(OBJ_GET_INFO_BY_FD, attr)
    return struct.unpack_from("<QQ", info, 192)


def enable_stats() -> int:
    """Turn on BPF run-time statistics while the returned fd is open (BPF_ENABLE_STATS: only
    for as long as a measurement needs them, unlike the kernel.bpf_stats_enabled sysctl)."""
    attr = _attr()
    struct.pack_into("<I", attr, 0, 0)  # BPF_STATS_RUN_TIME
    return bpf(ENABLE_STATS, attr)


def map_update(fd: int, key: bytes, value: bytes, flags: int = 0) -> None:
    """Set ``key`` to ``value`` in map ``fd`` (BPF_ANY unless ``flags`` says otherwise)."""
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value, len(value))
    attr = _attr()
    struct.pack_into("<IIQQQ", attr, 0, fd, 0, _addr(k), _addr(v), flags)
    bpf(MAP_UPDATE_ELEM, attr)


def map_delete(fd: int, key: bytes) -> None:
    """Remove ``key`` from map ``fd`` (FileNotFoundError when it is not there)."""
    k = ctypes.create_string_buffer(key, len(key))
    attr = _attr()
    struct.pack_into("<IIQ", attr, 0, fd, 0, _addr(k))
    bpf(MAP_DELETE_ELEM, attr)


def map_lookup(fd: int, key: bytes, value_size: int) -> bytes | None:
    """The value at ``key`` (``value_size`` bytes; per-CPU maps: one 8-aligned slot per possible CPU)."""
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value_size)
    attr = _attr()
    struct.pack_into("<IIQQ", attr, 0, fd, 0, _addr(k), _addr(v))
    try:
        bpf(MAP_LOOKUP_ELEM, attr)
    except FileNotFoundError:
        return None
    return v.raw


def prog_load(prog_type: int, insns: bytes, license: str, kern_version: int, name: str,
              expected_attach_type: int = 0) -> int:
    """Load a program; return its fd.

    Raises:
        OSError: the kernel refused it; for a verifier refusal the message ends with the last
            lines of the verifier's log (the program is loaded again with the log on, so the
            usual, accepted path pays nothing for it).
    """
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license.encode())
    attr = _attr()

    def load(log: ctypes.Array | None) -> int:
        struct.pack_into("<IIQQIIQI", attr, 0, prog_type, len(insns) // 8, _addr(code), _addr(lic),
                         1 if log is not None else 0, ctypes.sizeof(log) if log is not None else 0,
                         _addr(log) if log is not None else 0, kern_version)
        struct.pack_into("16s", attr, 48, name.encode()[:15])
        struct.pack_into("<I", attr, 68, expected_attach_type)
        return bpf(PROG_LOAD, attr)

    try:
        return load(None)
    except OSError as first:
        if first.errno not in (errno.EACCES, errno.EINVAL, errno.E2BIG):
            raise
        log = ctypes.create_string_buffer(_LOG_SIZE)
        try:
            return load(log)
        except OSError as exc:
            tail = " | ".join(log.value.decode(errors="replace").strip().splitlines()[-4:])
            raise OSError(exc.errno, f"{exc.strerror}; verifier: {tail}") from None


def possible_cpus(text: str | None = None) -> int:
    """How many CPUs the kernel may ever have (per-CPU maps hold one value for each)."""
    if text is None:
        text = Path("/sys/devices/system/cpu/possible").read_text()
    n = 0
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        n = max(n, int(hi or lo) + 1)
    return n


def _perf_open(kind: int, config: int, config1: int = 0, config2: int = 0, pid: int = 0) -> int:
    """perf_event_open for every process (``pid`` 0: pid -1 on CPU 0, as a tracepoint or a
    system-wide uprobe is opened) or for one process (any CPU)."""
    attr = ctypes.create_string_buffer(_PERF_ATTR_SIZE)
    struct.pack_into("<IIQQ", attr, 0, kind, _PERF_ATTR_SIZE, config, 1)  # sample_period 1
    struct.pack_into("<I", attr, 48, 1)  # wakeup_events
    struct.pack_into("<QQ", attr, 56, config1, config2)
    nr = _numbers()[1]
    target, cpu = (pid, -1) if pid > 0 else (-1, 0)
    return _call(nr, ctypes.byref(attr), ctypes.c_int(target), ctypes.c_int(cpu), ctypes.c_int(-1),
                 ctypes.c_ulong(_PERF_FLAG_FD_CLOEXEC))


def _enable(perf_fd: int, prog_fd: int) -> int:
    try:
        fcntl.ioctl(perf_fd, _PERF_EVENT_IOC_SET_BPF, prog_fd)
        fcntl.ioctl(perf_fd, _PERF_EVENT_IOC_ENABLE, 0)
    except OSError:
        os.close(perf_fd)
        raise
    return perf_fd


def _pmu_config(pmu: Path, field: str) -> int:
    """The config bit a PMU format file names (``config:0`` for the uprobe PMU's ``retprobe``)."""
    spec = (pmu / "format" / field).read_text().strip()
    return 1 << int(spec.partition(":")[2].partition("-")[0])


def attach_uprobe(prog_fd: int, path: str, offset: int, retprobe: bool, ref_ctr_offset: int = 0,
                  cookie: int = 0, pid: int = 0) -> int:
    """Run ``prog_fd`` at ``offset`` of the file ``path`` (in every process, or only in process
    ``pid``); return the perf fd.

    Closing the fd detaches the probe. ``path`` is resolved once, here, by the kernel.
    ``ref_ctr_offset`` (a USDT semaphore's file offset, config bits 32-63) has the kernel raise
    that counter in every process mapping the file while the probe is in place. A ``cookie``
    (what ``bpf_get_attach_cookie`` returns) needs a BPF perf link (kernel >= 5.15); the fd
    returned is then the link's, which holds the perf event. With ``pid`` the kernel installs the
    breakpoint, and raises the semaphore, only in that process's memory: no other process traps.
    """
    kind = int((_UPROBE_PMU / "type").read_text())
    config = (_pmu_config(_UPROBE_PMU, "retprobe") if retprobe else 0) | (ref_ctr_offset << 32)
    raw = ctypes.create_string_buffer(os.fsencode(path))
    perf_fd = _perf_open(kind, config, _addr(raw), offset, pid)
    if not cookie:
        return _enable(perf_fd, prog_fd)
    try:
        attr = _attr()
        struct.pack_into("<IIIIQ", attr, 0, prog_fd, perf_fd, _PERF_EVENT_LINK, 0, cookie)
        link = bpf(LINK_CREATE, attr)
        try:
            fcntl.ioctl(perf_fd, _PERF_EVENT_IOC_ENABLE, 0)
        except OSError:
            os.close(link)
            raise
        return link
    finally:
        os.close(perf_fd)  # the link holds the event


def uprobe_multi_supported(release: str | None = None) -> bool:
    """Whether the kernel has multi-uprobe links (6.6 and later), from ``uname -r``."""
    release = release or os.uname().release
    try:
        major, minor = (int(x) for x in release.split("-", 1)[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 6)


def attach_uprobe_link(prog_fd: int, path: str, offset: int, retprobe: bool, ref_ctr_offset: int = 0,
                       cookie: int = 0, pid: int = 0) -> int:
    """Like :func:`attach_uprobe`, as a multi-uprobe link (``prog_fd`` loaded for
    :data:`TRACE_UPROBE_MULTI`); return the link fd (close it to detach).

    Why: closing a link does not wait out RCU grace periods under the kernel's event_mutex as
    closing a perf event does, so 104 links close from threads in ~0.3 s where perf events took ~10 s.
    """
    raw = ctypes.create_string_buffer(os.fsencode(path))
    offsets = (ctypes.c_uint64 * 1)(offset)
    ref_ctrs = (ctypes.c_uint64 * 1)(ref_ctr_offset)
    cookies = (ctypes.c_uint64 * 1)(cookie)
    attr = _attr()
    struct.pack_into("<IIII", attr, 0, prog_fd, 0, TRACE_UPROBE_MULTI, 0)
    struct.pack_into("<QQQQIII", attr, 16, _addr(raw), _addr(offsets), _addr(ref_ctrs) if ref_ctr_offset else 0,
                     _addr(cookies) if cookie else 0, 1, _UPROBE_MULTI_RETURN if retprobe else 0, max(pid, 0))
    return bpf(LINK_CREATE, attr)


def attach_tracepoint(prog_fd: int, tracefs: str, category: str, name: str) -> int:
    """Run ``prog_fd`` at the tracepoint ``category:name``; return the perf fd (close to detach)."""
    tp_id = int(Path(tracefs, "events", category, name, "id").read_text())
    return _enable(_perf_open(_PERF_TYPE_TRACEPOINT, tp_id), prog_fd)
