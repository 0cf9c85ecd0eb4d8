"""Uprobes on the CUDA driver: load ``cuda.bpf.c``, attach it to libcuda files, drain events.

Why a class: the daemon owns exactly one of these for its lifetime, attaches it to
every libcuda inode it discovers (hosts with containers have several), polls it every ~50 ms and
must be able to tear it down cleanly even when half of the attachments are already gone.

The program comes from the compiled-program cache or is compiled by bcc, and is loaded and attached
by memrec's own loader (``probes/loader.py``, ``probes/probecache.py``). ``python -m
memrec.probes.cuda --ebpf [--follow-tree] [--tensors] [--stacks]`` prints the BPF program with its ``-D`` flags, which is
what bcc compiles.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.resources
import logging
import mmap
import os
import resource
import struct
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace
from pathlib import Path
from typing import Any
from typing import TypeVar

import numpy as np

from memrec.base.errors import ProbeError
from memrec.terms.columns import RAW_DTYPE
from memrec.terms.events import UNTRACED_APIS
from memrec.terms.events import TENSOR_APIS
from memrec.terms.events import Api
from memrec.terms.events import bpf_defines
from memrec.probes import bpfsys
from memrec.probes.elfsyms import ElfError
from memrec.probes.elfsyms import function_offsets
from memrec.probes.loader import LoadedProgram
from memrec.probes.loader import close_in_parallel
from memrec.probes.probecache import DEFAULT_DIR
from memrec.probes.probecache import obtain_program
from memrec.probes.pystacks import PY_FRAMES_DEFAULT
from memrec.probes.pystacks import PY_FRAMES_MAX
from memrec.probes.pystacks import STACK_DTYPE
from memrec.probes.pystacks import STACK_MIN_BYTES_DEFAULT
from memrec.probes.pystacks import Interpreter
from memrec.probes.ringbuf import RingBufferReader
from memrec.probes.usdt import ARG_CONST
from memrec.probes.usdt import UsdtProbe
from memrec.probes.usdt import read_probes

log = logging.getLogger(__name__)

PROGRAM = "cuda.bpf.c"
#: PyTorch's allocator probes, appended to PROGRAM (they share its ring and helpers).
TORCH_PROGRAM = "torch.bpf.c"
#: The probes of libc10_cuda.so read, by name, with the role torch.bpf.c gives each (TORCH_MALLOC,
#: TORCH_FREE) and the arguments it needs (malloc: pointer, device, size; the stream is extra).
TORCH_PROBES = {"malloc": (1, 3), "free": (2, 1)}
TORCH_PROVIDER = "pytorch"
#: How every reason a PyTorch install gives no tensor blocks ends (doctor, header, report, log).
SEGMENTS_ONLY = "tensor blocks unavailable, driver segments only"
#: Slots of torch.bpf.c's usdt_specs (USDT_SPECS): one per probe site attached.
USDT_SPECS = 256
#: The driver symbols probed, entry and return each (every Api except the tracepoints).
SYMBOLS: tuple[str, ...] = tuple(a.name for a in Api
                                  if a is not Api.NONE and not a.name.startswith("sched_") and a not in TENSOR_APIS)
#: The symbols that explain the untraced band (code loading, pools): left out with untraced=False.
UNTRACED_SYMBOLS: tuple[str, ...] = tuple(a.name for a in UNTRACED_APIS)
#: What every CUDA driver exports; a file without them is not the driver (nothing is attached to it).
DRIVER_API = ("cuInit", "cuMemAlloc_v2", "cuMemFree_v2")
_EXIT_FORMAT = "events/sched/sched_process_exit/format"
_TRACEFS_ROOTS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


@dataclass(frozen=True)
class TorchReport:
    """What :meth:`CudaProbes.attach_torch` did to one ``libc10_cuda.so``.

    Attributes:
        path, dev, inode: as :class:`AttachReport`.
        attached: the probe sites attached, e.g. ``("malloc", "free", "free")``.
        problem: why the file gives no tensor blocks (a build without the probes, an argument
            form memrec does not read, an attach error), else "".
        already_attached: this (dev, inode) was attached before; nothing was done.
        pids: the processes the sites were attached in (empty: every process).
    """

    path: str
    dev: int
    inode: int
    attached: tuple[str, ...] = ()
    problem: str = ""
    already_attached: bool = False
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AttachReport:
    """What :meth:`CudaProbes.attach_library` did to one library file.

    Attributes:
        path: the path the caller named.
        dev, inode: the file's identity (uprobes live on the inode, not the path).
        attached: symbols with both an entry and a return probe.
        missing: symbol -> why it is not probed (not exported by this driver version, or the
            attach error).
        already_attached: this (dev, inode) was attached before; nothing was done.
    """

    path: str
    dev: int
    inode: int
    attached: tuple[str, ...] = ()
    missing: dict[str, str] = field(default_factory=dict)
    already_attached: bool = False


def program_source(tensors: bool = False) -> str:
    """Return the BPF C program text: the driver probes, and with ``tensors`` PyTorch's allocator
    probes after them (so the program without them is exactly the one without ``--tensors``; it
    also needs ``bpf_get_attach_cookie``, kernel >= 5.15)."""
    files = importlib.resources.files("memrec.probes")
    text = files.joinpath(PROGRAM).read_text()
    return text + "\n" + files.joinpath(TORCH_PROGRAM).read_text() if tensors else text


def _tracefs_has_group_dead() -> bool:
    """Whether sched_process_exit carries ``group_dead`` (kernel >= 6.16): a better exit moment."""
    for root in _TRACEFS_ROOTS:
        try:
            return "group_dead" in Path(root, _EXIT_FORMAT).read_text()
        except OSError:
            continue
    return False


def _tracefs_root() -> str:
    """The mounted tracefs (tracepoint ids are read from it)."""
    return next((root for root in _TRACEFS_ROOTS if os.path.isdir(os.path.join(root, "events"))), _TRACEFS_ROOTS[0])


def wake_bytes(ringbuf_pages: int) -> int:
    """The ring fill (bytes) from which every submit wakes the reader: a quarter of the ring.

    Below it records wait for the reader's next poll (a wakeup per record would cost about half
    a probe hit); above it the reader is woken at once, so a burst is drained with three
    quarters of the ring still free, whatever the poll interval.
    """
    return ringbuf_pages * mmap.PAGESIZE // 4


@dataclass(frozen=True)
class StackOptions:
    """What ``--stacks`` asks of the probe: the Python frames kept (at most
    :data:`~memrec.probes.pystacks.PY_FRAMES_MAX`), the smallest tensor block given a stack, and
    the stacks ring's size in pages (a power of two; a record takes 1,184 bytes: the default
    16 MiB holds about 14,000)."""

    depth: int = PY_FRAMES_DEFAULT
    min_bytes: int = STACK_MIN_BYTES_DEFAULT
    ring_pages: int = 4096

    def cflags(self) -> list[str]:
        if not 1 <= self.depth <= PY_FRAMES_MAX:
            raise ValueError(f"the stack depth must be 1 to {PY_FRAMES_MAX}, not {self.depth}")
        if self.ring_pages < 1 or self.ring_pages & (self.ring_pages - 1):
            raise ValueError(f"the stacks ring's pages must be a power of two, not {self.ring_pages}")
        return ["-DSTACKS=1", f"-DPY_FRAMES={self.depth}", f"-DSTACK_MIN_BYTES={max(0, self.min_bytes)}ULL",
                f"-DSTACK_RING_PAGES={self.ring_pages}"]


def program_cflags(follow_tree: bool, ringbuf_pages: int, stacks: StackOptions | None = None) -> list[str]:
    """Return the ``-D`` flags the program is compiled with (without ``stacks``, exactly those of
    the program that records none)."""
    flags = bpf_defines() + [f"-DRINGBUF_PAGES={ringbuf_pages}", f"-DRINGBUF_WAKE_BYTES={wake_bytes(ringbuf_pages)}"]
    if follow_tree:
        flags.append("-DFOLLOW_TREE=1")
    if stacks is not None:
        flags += stacks.cflags()
    if _tracefs_has_group_dead():
        flags.append("-DHAVE_GROUP_DEAD=1")
    return flags


def _open_library(path: str, identity: tuple[int, int] | None,
                  reports: dict) -> tuple[int, os.stat_result, set[tuple[int, int]], Any]:
    """Open ``path`` once (the probes then land on exactly this inode, whatever the path becomes).

    Returns (fd, its stat, its identities: the stat's and ``identity`` as /proc/PID/maps gives
    it, which differ on overlayfs, and None); or, when an identity is in ``reports`` already,
    (-1, stat, identities, that report with ``already_attached=True``) and nothing left open.

    Raises:
        ProbeError: the file cannot be opened.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ProbeError(f"cannot open {path}: {exc}") from exc
    st = os.fstat(fd)
    keys = {(st.st_dev, st.st_ino)}
    if identity is not None:
        keys.add(tuple(identity))
    for key in keys:
        if key in reports:
            os.close(fd)
            return -1, st, keys, replace(reports[key], path=path, already_attached=True)
    return fd, st, keys, None


def torch_sites(found: list[UsdtProbe]) -> tuple[list[UsdtProbe], str]:
    """The pytorch:malloc and pytorch:free sites among a file's USDT probes, or why not all can be read."""
    mine = [p for p in found if p.provider == TORCH_PROVIDER and p.name in TORCH_PROBES]
    names = {p.name for p in mine}
    if names != set(TORCH_PROBES):
        lacking = "/".join(sorted(set(TORCH_PROBES) - names))
        return [], (f"no {TORCH_PROVIDER}:{lacking} USDT probe in this build (PyTorch before 2.1, or built without "
                    f"TORCH_SDT): {SEGMENTS_ONLY}")
    for probe in mine:
        if probe.args is None:
            return [], f"{TORCH_PROVIDER}:{probe.name}: {probe.error}; {SEGMENTS_ONLY}"
        need = TORCH_PROBES[probe.name][1]
        if len(probe.args) < need:
            return [], f"{TORCH_PROVIDER}:{probe.name} has {len(probe.args)} arguments, {need} are read; {SEGMENTS_ONLY}"
        # PyTorch 2.1 fires malloc before the allocation, with the address of a local variable
        # where later releases give the block's (checked in the 2.1.2 wheel's code: `lea
        # -0x48(%rbp),%r14` then the probe, then the call to malloc(&r, ...)); its stream argument
        # is the constant 0, which no later release has (they pass stream.id()). Recording it
        # would give blocks at stack addresses whose frees never come.
        if probe.name == "malloc" and len(probe.args) > 3 and probe.args[3].kind == ARG_CONST:
            return [], (f"{TORCH_PROVIDER}:malloc fires before the allocation in this build (PyTorch 2.1: its "
                        f"pointer is not the block's; from 2.2 on it is): {SEGMENTS_ONLY}")
    return mine, ""


def _attach_failure(exc: Exception) -> str:
    """Why a symbol is not probed. EINVAL at a valid offset is most often another program's uprobe
    at the same place with another ref_ctr_offset (bcc 0.26's Python attaches with a garbage one)."""
    if isinstance(exc, OSError) and exc.errno == errno.EINVAL:
        return f"attach failed: {exc} (another program's uprobe here? dmesg: ref_ctr_offset mismatch)"
    return f"attach failed: {exc}"


def _raise_fd_limit(need: int) -> None:
    """Every probe is an fd; lift the soft RLIMIT_NOFILE towards the hard one when it is short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = hard if hard == resource.RLIM_INFINITY else min(hard, max(need, soft))
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit to %d: %s", need, exc)


class CudaProbes:
    """The driver-API probes: one BPF program, attached to any number of libcuda files.

    Args:
        follow_tree: record only processes added with :meth:`track_pid` and their descendants
            (followed in the kernel at fork); otherwise every process on the host.
        ringbuf_pages: ring buffer size in pages (a power of two). 1024 pages = 4 MiB ≈ 30k
            events; the reader is woken when a quarter of it is filled (:func:`wake_bytes`).
        untraced: also probe the code-loading and pool entry points (:data:`UNTRACED_SYMBOLS`);
            False only to measure what they cost.
        probe_cache: the directory of compiled programs (:mod:`memrec.probes.probecache`), or
            None to compile at every start.
        tensors: also load PyTorch's allocator probes (:meth:`attach_torch`; ``--tensors``).
        stacks: also record the allocating thread's stacks (``--stacks``): :meth:`poll_stacks`,
            :meth:`set_interpreter`. None: the program records none (it is the same program as
            without the option).
    """

    def __init__(self, follow_tree: bool = False, ringbuf_pages: int = 1024, untraced: bool = True,
                 probe_cache: str | None = DEFAULT_DIR, tensors: bool = False,
                 stacks: StackOptions | None = None) -> None:
        if ringbuf_pages < 1 or ringbuf_pages & (ringbuf_pages - 1):
            raise ValueError(f"ringbuf_pages must be a power of two, not {ringbuf_pages}")
        self.follow_tree = follow_tree
        self.ringbuf_pages = ringbuf_pages
        self.tensors = tensors
        self.stacks = stacks
        self._stack_reader: RingBufferReader | None = None
        #: The driver symbols this instance probes.
        self.symbols = SYMBOLS if untraced else tuple(s for s in SYMBOLS if s not in UNTRACED_SYMBOLS)
        #: Where the compiled program is cached (None: compile at every start).
        self.probe_cache = probe_cache
        #: How the last load() got the program ("cache" or "compiled") and how long it took.
        self.loaded_from = ""
        self.load_seconds = 0.0
        self._prog: LoadedProgram | None = None
        self._reader: RingBufferReader | None = None
        self._reports: dict[tuple[int, int], AttachReport] = {}
        self._torch_reports: dict[tuple[int, int], TorchReport] = {}
        self._next_spec = 0  # the next free slot of usdt_specs
        self._lib_fds: list[int] = []
        self._uprobes: list[int] = []  # perf fds of the uprobes attached (closing one detaches it)
        self._cpus = bpfsys.possible_cpus()
        self._logged_missing: set[str] = set()

    # -- lifetime -------------------------------------------------------------------------------
    def load(self) -> CudaProbes:
        """Load the program (from the cache, else compiled), attach the tracepoints, map the ring.

        Raises:
            ProbeError: bcc is missing or the program does not compile/load (e.g. not root).
        """
        if self._prog is not None:
            return self
        started = time.monotonic()
        self._prog, self.loaded_from = obtain_program(program_source(self.tensors),
                                                      program_cflags(self.follow_tree, self.ringbuf_pages, self.stacks),
                                                      self.probe_cache)
        self.load_seconds = time.monotonic() - started
        if self.loaded_from == "cache":
            log.info("loaded the compiled probe program from the cache (%.0f ms)", self.load_seconds * 1e3)
        else:
            log.info("compiled the probe program (%.1f s)", self.load_seconds)
        try:
            self._prog.attach_tracepoints(_tracefs_root())
            ring = self._prog.maps["events"]
            self._reader = RingBufferReader(ring, self.ringbuf_pages * mmap.PAGESIZE, RAW_DTYPE.itemsize, RAW_DTYPE)
            if self.stacks is not None:
                self._stack_reader = RingBufferReader(self._prog.maps["stacks"], self.stacks.ring_pages * mmap.PAGESIZE,
                                                      STACK_DTYPE.itemsize, STACK_DTYPE)
        except (OSError, ValueError, KeyError, ProbeError) as exc:
            self.close()
            raise ProbeError(f"cannot start the probes: {exc}") from exc
        return self

    def close(self) -> None:
        """Detach every probe and release the program; tolerates partial failure (logged)."""
        for reader in (self._reader, self._stack_reader):
            if reader is not None:
                reader.close()
        self._reader = self._stack_reader = None
        for failure in close_in_parallel(self._uprobes):
            log.warning("%s", failure)
        self._uprobes.clear()
        prog, self._prog = self._prog, None
        if prog is not None:
            prog.close()
        for fd in self._lib_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lib_fds.clear()
        self._reports.clear()
        self._torch_reports.clear()
        self._next_spec = 0

    def __enter__(self) -> CudaProbes:
        return self.load()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require(self) -> LoadedProgram:
        if self._prog is None:
            raise ProbeError("probes are not loaded: call load() first")
        return self._prog

    # -- attaching ------------------------------------------------------------------------------
    def attach_library(self, path: str | os.PathLike[str], identity: tuple[int, int] | None = None) -> AttachReport:
        """Attach an entry and a return probe to every probed symbol ``path`` exports.

        The file is opened once and probed through ``/proc/self/fd/N``, so the probes land on
        exactly the inode that was checked, even if the path is replaced meanwhile. Probes are
        system-wide (pid -1): every process mapping this inode is seen, containers included.

        Args:
            path: a libcuda file (any path that reaches it, e.g. ``/proc/PID/root/...``).
            identity: (dev, inode) as ``/proc/PID/maps`` shows it, when known: on overlayfs it
                differs from what stat() on the path says, and both are remembered.

        Returns:
            The report; attaching a (dev, inode) a second time is a no-op that returns the first
            report with ``already_attached=True``.

        Raises:
            ProbeError: not loaded, or the file cannot be opened or read as ELF.
        """
        prog = self._require()
        path = os.fspath(path)
        fd, st, keys, earlier = _open_library(path, identity, self._reports)
        if earlier is not None:
            return earlier
        try:
            magic = os.pread(fd, 4, 0)
        except OSError as exc:
            magic = f"unreadable: {exc}".encode()
        if magic != b"\x7fELF":
            os.close(fd)
            raise ProbeError(f"{path} is not an ELF file ({magic!r})")
        try:
            exported = function_offsets(fd, b"cu")
        except (OSError, ElfError) as exc:
            os.close(fd)
            raise ProbeError(f"cannot read the symbols of {path}: {exc}") from exc
        lacking = [sym for sym in DRIVER_API if sym not in exported]
        if lacking:  # a file named libcuda.so* that is not the driver: nothing to probe there
            os.close(fd)
            raise ProbeError(f"{path} does not export the CUDA driver API (no {', '.join(lacking)})")
        self._lib_fds.append(fd)  # kept open: the probes hang on this inode
        probe_path = f"/proc/self/fd/{fd}"

        _raise_fd_limit(len(self._uprobes) + 2 * len(self.symbols) + 256)
        attached: list[str] = []
        missing: dict[str, str] = {}
        for sym in self.symbols:
            if sym not in exported:
                missing[sym] = "not exported by this driver"
                continue
            reason = self._attach_symbol(prog, probe_path, sym, exported[sym])
            if reason:
                missing[sym] = reason
            else:
                attached.append(sym)
        for sym, reason in missing.items():
            level = logging.INFO if sym not in self._logged_missing else logging.DEBUG
            self._logged_missing.add(sym)
            log.log(level, "%s: %s not probed: %s", path, sym, reason)
        report = AttachReport(path=path, dev=st.st_dev, inode=st.st_ino, attached=tuple(attached), missing=missing)
        for key in keys:
            self._reports[key] = report
        log.info("attached %d/%d driver symbols in %s", len(attached), len(self.symbols), path)
        return report

    def _attach_symbol(self, prog: LoadedProgram, probe_path: str, sym: str, offset: int) -> str | None:
        """Attach entry + return probes for ``sym``; return why not, or None on success."""
        # The return probe first: a call that enters once the entry probe is in place is then
        # surely seen returning. (Entry first left a window in which one call was entered,
        # never returned, and neither recorded nor counted as lost.)
        try:
            ret = prog.attach_uprobe(f"return_{sym}", probe_path, offset, retprobe=True)
        except (OSError, KeyError) as exc:
            return _attach_failure(exc)
        try:
            entry = prog.attach_uprobe(f"enter_{sym}", probe_path, offset, retprobe=False)
        except (OSError, KeyError) as exc:
            os.close(ret)  # never a return probe without its entry probe, nor the reverse
            return _attach_failure(exc)
        self._uprobes += [ret, entry]
        return None

    def attach_torch(self, path: str | os.PathLike[str], identity: tuple[int, int] | None = None,
                     pids: tuple[int, ...] = ()) -> TorchReport:
        """Attach the tensor-block probes to PyTorch's ``libc10_cuda.so`` at ``path``.

        Its ``pytorch:malloc`` and ``pytorch:free`` USDT probes are read from the file's notes
        (:mod:`memrec.probes.usdt`), each site's argument spec goes into ``usdt_specs`` and the
        site gets ``usdt_torch`` with the spec's slot as cookie and its semaphore as the uprobe's
        ``ref_ctr_offset``: the kernel raises the semaphore in every process that maps the file,
        those running now included, so nothing is relaunched and nothing is written into them.
        All sites or none: allocations without their frees would leave blocks alive forever.

        With ``pids``, each site is attached once per process named, with the kernel's filter:
        the breakpoints and raised semaphores are in those processes only (now, or when they map
        the file later), and every other process skips the sites as if nothing were attached.
        That is what limits the traps' cost to the processes asked about (a filter in the BPF
        program would not: the trap is taken before the program runs). A named process that is
        gone is left out.

        Returns:
            The report; ``problem`` says why nothing was attached (a build without the probes,
            an argument form memrec does not read, the kernel's refusal). A (dev, inode) attached
            before gives that report with ``already_attached=True``.

        Raises:
            ProbeError: not loaded, or the file cannot be opened or read as ELF.
        """
        prog = self._require()
        if not self.tensors:
            raise ProbeError("the tensor probes are not loaded: use CudaProbes(tensors=True)")
        path = os.fspath(path)
        fd, st, keys, earlier = _open_library(path, identity, self._torch_reports)
        if earlier is not None:
            return earlier
        try:
            found = read_probes(fd)
        except (OSError, ElfError) as exc:
            os.close(fd)
            raise ProbeError(f"cannot read the ELF notes of {path}: {exc}") from exc
        sites, problem = torch_sites(found)
        if not problem and self._next_spec + len(sites) > USDT_SPECS:
            problem = f"the {USDT_SPECS} probe-site slots are used up by other PyTorch installs"
        attached: list[int] = []
        present: list[int] = []  # the pids attached in
        if not problem:
            probe_path = f"/proc/self/fd/{fd}"
            try:
                slots = []
                for probe in sites:
                    slots.append(self._next_spec)
                    what = TORCH_PROBES[probe.name][0]
                    spec = b"".join(a.pack() for a in probe.args) + bytes(24 * (12 - len(probe.args)))
                    bpfsys.map_update(prog.maps["usdt_specs"], struct.pack("<I", slots[-1]),
                                      spec + struct.pack("<II", len(probe.args), what))
                    self._next_spec += 1
                for pid in pids or (0,):
                    links: list[int] = []
                    try:
                        for probe, slot in zip(sites, slots):
                            links.append(prog.attach_uprobe("usdt_torch", probe_path, probe.offset, False,
                                                            ref_ctr_offset=probe.semaphore, cookie=slot, pid=pid))
                    except ProcessLookupError:
                        if not pid:
                            raise
                        for link in links:  # the process is gone: nothing of it to trace
                            os.close(link)
                        continue
                    except OSError:
                        attached += links  # closed below with the others
                        raise
                    attached += links
                    present.append(pid)
            except (OSError, KeyError) as exc:
                problem = _attach_failure(exc)
                for link in attached:
                    os.close(link)
                attached = []
            if pids and not present and not problem:
                problem = f"none of the processes {', '.join(map(str, pids))} runs any more"
        if attached:
            self._lib_fds.append(fd)
            self._uprobes += attached
        else:
            os.close(fd)
        report = TorchReport(path=path, dev=st.st_dev, inode=st.st_ino,
                             attached=tuple(p.name for p in sites) if attached else (), problem=problem,
                             pids=tuple(present) if pids and attached else ())
        for key in keys:
            self._torch_reports[key] = report
        if problem:
            log.info("%s: no tensor blocks: %s", path, problem)
        else:
            log.info("attached PyTorch's allocator probes (%d sites) in %s%s", len(sites), path,
                     f" for processes {', '.join(map(str, present))}" if pids else "")
        return report

    def attached_torch(self) -> list[TorchReport]:
        """Reports of every distinct libc10_cuda.so tried, in attach order."""
        return _distinct(self._torch_reports.values())

    def attached_libraries(self) -> list[AttachReport]:
        """Reports of every distinct library attached, in attach order."""
        return _distinct(self._reports.values())

    def track_pid(self, pid: int) -> None:
        """Record ``pid`` and, from now on, every process it forks (follow-tree mode only).

        Raises:
            ProbeError: the probes were not created with ``follow_tree=True``.
        """
        prog = self._require()
        if not self.follow_tree:
            raise ProbeError("track_pid() needs CudaProbes(follow_tree=True)")
        bpfsys.map_update(prog.maps["tracked"], struct.pack("<I", pid), b"\x01")

    # -- reading --------------------------------------------------------------------------------
    def poll(self, max_records: int | None = None) -> np.ndarray:
        """Drain the ring buffer: every committed event so far, as an array of ``RAW_DTYPE``."""
        self._require()
        return self._reader.drain(max_records)

    def poll_stacks(self) -> np.ndarray:
        """Drain the stacks ring (``STACK_DTYPE`` records). Poll it after :meth:`poll`: a stack is
        committed before the event naming it is reserved, so every event polled has its stack here
        (or its stack was lost: :meth:`stacks_lost`)."""
        self._require()
        if self._stack_reader is None:
            return np.empty(0, STACK_DTYPE)
        return self._stack_reader.drain()

    def set_interpreter(self, interp: Interpreter) -> None:
        """Let the probe read the stacks of ``interp.pid`` (a supported interpreter)."""
        bpfsys.map_update(self._require().maps["py_procs"], struct.pack("<I", interp.pid), interp.pack())

    def forget_interpreter(self, pid: int) -> None:
        """The process exited: its entry goes (a new process with the same pid is located afresh)."""
        with contextlib.suppress(OSError):
            bpfsys.map_delete(self._require().maps["py_procs"], struct.pack("<I", pid))

    def run_stats(self, function: str) -> tuple[int, int]:
        """(run_time_ns, run_cnt) of one BPF function (e.g. ``enter_cuMemAlloc_v2``), counted while
        :func:`memrec.probes.bpfsys.enable_stats` is held (bench/bench_stacks.py)."""
        return bpfsys.prog_run_stats(self._require().functions[function])

    def stacks_lost(self) -> int:
        """Stacks dropped because the stacks ring was full (their events say so)."""
        if self.stacks is None:
            return 0
        values = bpfsys.map_lookup(self._require().maps["stacks_lost"], struct.pack("<I", 0), 8 * self._cpus)
        return sum(struct.unpack(f"<{self._cpus}Q", values)) if values else 0

    def fileno(self) -> int:
        """The ring buffer's map fd: readable when records wait (the daemon selects on it)."""
        return self._require().maps["events"]

    def lost(self) -> int:
        """Events dropped so far because the ring buffer was full (cumulative, all CPUs)."""
        values = bpfsys.map_lookup(self._require().maps["lost"], struct.pack("<I", 0), 8 * self._cpus)
        return sum(struct.unpack(f"<{self._cpus}Q", values)) if values else 0


R = TypeVar("R")


def _distinct(reports: Iterable[R]) -> list[R]:
    """One of each report, in first-seen order: a library is filed under several keys, each holding
    the same report object (compared by identity)."""
    seen: list[R] = []
    for report in reports:
        if all(report is not r for r in seen):
            seen.append(report)
    return seen


def main(argv: list[str] | None = None) -> int:
    """Print the program as bcc compiles it (``--ebpf``)."""
    parser = argparse.ArgumentParser(prog="python -m memrec.probes.cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--follow-tree", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ringbuf-pages", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--tensors", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stacks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.ebpf:
        parser.error("only --ebpf is supported")
    for flag in program_cflags(args.follow_tree, args.ringbuf_pages, StackOptions() if args.stacks else None):
        name, _, value = flag[2:].partition("=")
        print(f"#define {name} {value or 1}")
    print(program_source(args.tensors))
    return 0


if __name__ == "__main__":
    sys.exit(main())

