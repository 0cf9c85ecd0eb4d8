"""The daemon's configuration: one frozen dataclass, and small pure converters for its values.

Each converter takes a string (from the command line or, later, a file or the environment) and
returns the value or raises ValueError with a one-line reason, so each is testable alone.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from memrec.daemon.scheduling import DEFAULT as DEFAULT_SCHEDULING
from memrec.daemon.scheduling import parse as scheduling_policy
from memrec.terms.protocol import DEFAULT_SOCKET
from memrec.terms.units import parse_size as byte_size  # the one size parser (the TUI's filter reads sizes with it too)

DEFAULT_OUTPUT = "/var/lib/memrec/"
GiB = 1 << 30
#: 16 MiB of 4 KiB pages: 123,000 records, about 1.2 s at 100k events/s.
DEFAULT_RINGBUF_PAGES = 4096
#: The largest BPF ring buffer the kernel makes: a power of two under its 4 GiB bound.
RINGBUF_MAX_BYTES = 1 << 31
#: Where compiled probe programs are kept (memrec.probes.probecache.DEFAULT_DIR; not imported
#: from there: the configuration needs nothing of the probes).
DEFAULT_PROBE_CACHE = "/var/cache/memrec/probes"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
#: The probe's hard bound on Python frames (memrec.probes.pystacks.PY_FRAMES_MAX; not imported:
#: the configuration must not load the probes).
STACK_DEPTH_MAX = 32


def positive_float(text: str | float) -> float:
    """A finite number > 0.

    Raises:
        ValueError: not a number, not finite, or <= 0.
    """
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"must be a finite number > 0, got {text!r}")
    return value


#: The fastest NVML sampling a rate may ask for: an NVML query takes about a millisecond, so past
#: this the sampler would only spin (1e300 was accepted).
MAX_RATE = 1000.0


def rate(text: str | float) -> float:
    """Samples per second: a finite number from 0 (the sampling off) to :data:`MAX_RATE`.

    Raises:
        ValueError: not a number, not finite, negative or past MAX_RATE.
    """
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"must be a finite number >= 0, got {text!r}")
    if value > MAX_RATE:
        raise ValueError(f"at most {MAX_RATE:g} samples a second, got {text!r}")
    return value


def duration(text: str | float) -> float:
    """Seconds from ``"30"``, ``"30s"``, ``"500ms"``, ``"5m"``, ``"2h"``, ``"1d"`` (> 0).

    Raises:
        ValueError: not a positive duration.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return positive_float(text)
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"not a duration: {text!r} (examples: 30, 30s, 500ms, 5m, 2h)")
    value = float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "s").lower()]
    if value <= 0:
        raise ValueError(f"duration must be > 0, got {text!r}")
    return value


def octal_mode(text: str | int) -> int:
    """A permission mode: ``"660"`` / ``"0o660"`` → 0o660.

    Raises:
        ValueError: not an octal number in 0..0o7777.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        try:
            value = int(str(text).strip().removeprefix("0o"), 8)
        except ValueError:
            raise ValueError(f"not an octal mode: {text!r}") from None
    if not 0 <= value <= 0o7777:
        raise ValueError(f"mode out of range: {text!r}")
    return value


def probe_cache(text: str) -> str | None:
    """``--probe-cache``: a directory (made absolute), or None for ``off``."""
    if text.strip().lower() in ("off", "none", "no"):
        return None
    if not text.strip():
        raise ValueError("an empty probe cache directory (say off to turn the cache off)")
    return os.path.abspath(text)


def stack_depth(text: str | int) -> int:
    """The most Python frames a stack keeps: 1 to the probe's hard bound (32).

    Raises:
        ValueError: out of that range.
    """
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"not an integer: {text!r}") from None
    if not 1 <= value <= STACK_DEPTH_MAX:
        raise ValueError(f"the stack depth must be 1 to {STACK_DEPTH_MAX}, got {text!r}")
    return value


def ring_pages(text: str | int) -> int:
    """Ring-buffer size in pages: a power of two >= 1, of at most :data:`RINGBUF_MAX_BYTES`, so
    that a size the kernel refuses is a usage error, not "cannot compile the probe program".

    Raises:
        ValueError: not a power of two, or larger than the kernel takes.
    """
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"not an integer: {text!r}") from None
    if value < 1 or value & (value - 1):
        raise ValueError(f"ring buffer pages must be a power of two, got {text!r}")
    most = RINGBUF_MAX_BYTES // os.sysconf("SC_PAGE_SIZE")
    if value > most:
        raise ValueError(f"ring buffer pages must be at most {most} (2 GiB, the kernel's largest ring), got {text!r}")
    return value


@dataclass(frozen=True)
class DaemonConfig:
    """Everything the daemon needs to know; the command line builds one.

    Attributes:
        output: a trace file, or a directory (existing, or written with a trailing ``/``) in which
            each file gets a name with the host, the start time and the daemon's pid.
        socket_path: the marker/subscriber socket.
        socket_mode: the socket's permission bits (group members may send markers).
        socket_group: group name or gid to own the socket (None: the daemon's group). Its
            members may send markers.
        live_group: group name or gid whose members may also subscribe to the live view (every
            event and the command lines of every traced process); None: root only.
        libcuda_paths: libcuda files to probe besides those found in /proc/*/maps and the usual
            places.
        follow_tree: record only tracked pids and their descendants (``memrec record``).
        rotate_bytes: start a new file once this many bytes are written (0: never).
        flush_interval: the longest a record waits in the writer's buffer (seconds).
        keyframe_interval: the least seconds between two keyframes (full live state; skipped when no
            event came, or until the file grew by 4 × the last keyframe's bytes: daemon/keyframes.py).
        rescan_interval: seconds between two searches for newly mapped libcuda files.
        poll_interval: seconds between two drains of the ring buffer.
        nvml_device_hz / nvml_process_hz: NVML sample rates (0: off).
        ringbuf_pages: BPF ring buffer size in pages (power of two). The default 4096 (16 MiB)
            holds about 1.2 s of records at 100k events/s: a burst, or a daemon kept off the CPU.
        scheduling: the loop's CPU priority (:mod:`memrec.daemon.scheduling`): ``nice:N``,
            ``fifo:N``, ``rr:N`` or ``off``; default ``nice:-10``.
        untraced_probes: probe the code-loading and pool entry points that explain the untraced
            band (off only to measure their cost).
        tensors: also record PyTorch's tensor blocks (the ``pytorch:malloc``/``free`` USDT probes
            of every ``libc10_cuda.so`` processes map); off by default: each probe hit costs
            about a microsecond in the traced process (docs/performance.md).
        torch_paths: ``libc10_cuda.so`` files to probe besides those processes map (with tensors).
        stacks: also record the allocating thread's Python stack (and native return addresses)
            for every driver allocation and every tensor block of ``stack_min_bytes`` or more,
            read by the probe from the interpreter (CPython 3.10-3.13; :mod:`memrec.probes.pystacks`).
        stack_depth: the most Python frames kept per stack (1-32; the outer ones are cut).
        stack_min_bytes: tensor blocks below this get no stack (0: every block).
        tensor_pids: with tensors, only these processes get the probes (the kernel's per-process
            uprobe filter: every other process skips the sites at no cost); empty: every process.
        probe_cache: directory of compiled probe programs (a start on a known kernel then skips
            the compile); None: compile at every start.
        subscriber_queue_bytes: the most bytes queued for one live subscriber before it loses
            records (it then gets a ``lost`` notice and a fresh keyframe).
        output_is_dir: whether ``output`` is a directory of traces (None: a trailing ``/`` or an
            existing directory says so).
    """

    output: Path = DEFAULT_OUTPUT  # type: ignore[assignment]  (a str is converted)
    socket_path: Path = Path(DEFAULT_SOCKET)
    socket_mode: int = 0o660
    socket_group: str | int | None = None
    live_group: str | int | None = None
    libcuda_paths: tuple[str, ...] = ()
    follow_tree: bool = False
    rotate_bytes: int = GiB
    flush_interval: float = 0.2
    keyframe_interval: float = 10.0
    rescan_interval: float = 5.0
    poll_interval: float = 0.05
    nvml_device_hz: float = 10.0
    nvml_process_hz: float = 1.0
    ringbuf_pages: int = DEFAULT_RINGBUF_PAGES
    scheduling: str = DEFAULT_SCHEDULING
    untraced_probes: bool = True
    tensors: bool = False
    torch_paths: tuple[str, ...] = ()
    stacks: bool = False
    stack_depth: int = 32
    stack_min_bytes: int = 1 << 20
    tensor_pids: tuple[int, ...] = ()
    probe_cache: str | None = DEFAULT_PROBE_CACHE
    subscriber_queue_bytes: int = 64 << 20
    output_is_dir: bool | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        # A trailing "/" means a directory: Path() drops it, so decide now and remember.
        output = os.fspath(self.output)
        if self.output_is_dir is None:
            set_(self, "output_is_dir", output.endswith(os.sep) or os.path.isdir(output))
        set_(self, "output", Path(output))
        set_(self, "socket_path", Path(os.fspath(self.socket_path)))
        set_(self, "socket_mode", octal_mode(self.socket_mode))
        set_(self, "libcuda_paths", tuple(os.fspath(p) for p in self.libcuda_paths))
        set_(self, "torch_paths", tuple(os.fspath(p) for p in self.torch_paths))
        set_(self, "tensor_pids", tuple(sorted({int(p) for p in self.tensor_pids})))
        set_(self, "rotate_bytes", byte_size(self.rotate_bytes))
        set_(self, "subscriber_queue_bytes", byte_size(self.subscriber_queue_bytes))
        for name in ("flush_interval", "keyframe_interval", "rescan_interval", "poll_interval"):
            set_(self, name, positive_float(getattr(self, name)))
        for name in ("nvml_device_hz", "nvml_process_hz"):
            set_(self, name, rate(getattr(self, name)))
        set_(self, "ringbuf_pages", ring_pages(self.ringbuf_pages))
        set_(self, "stack_depth", stack_depth(self.stack_depth))
        set_(self, "stack_min_bytes", byte_size(self.stack_min_bytes))
        if self.probe_cache is not None:
            set_(self, "probe_cache", os.path.abspath(os.fspath(self.probe_cache)))
        set_(self, "scheduling", scheduling_policy(self.scheduling))

    def replace(self, **changes) -> DaemonConfig:
        """A copy with ``changes`` (validated the same way)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The configuration as the trace header records it (plain types only)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = os.fspath(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
        out["socket_mode"] = oct(self.socket_mode)
        return out
