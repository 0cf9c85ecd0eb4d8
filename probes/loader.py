"""memrec's own BPF loader: a compiled program as data, its maps created, its functions loaded.

Why not let bcc load it: bcc can only compile from source (~2 s of clang/LLVM at every start,
more on a busy host) and has no cache. So bcc is used for one thing, compiling
(:func:`compile_program`), and the result, a :class:`Program` (instructions, license, map specs)
is plain data that ``probecache`` keeps on disk. Loading a Program (:class:`LoadedProgram`) is
the same code after a cold compile and on a warm start, so every start exercises one path.

bcc bakes the fds of the maps it created into the instructions (``ld_imm64`` with
``BPF_PSEUDO_MAP_FD``/``MAP_VALUE``); :func:`relocate` replaces them with the fds of the maps
created here, by name.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field

from memrec.base.errors import ProbeError
from memrec.probes import bpfsys

log = logging.getLogger(__name__)

#: What bcc calls the functions that TRACEPOINT_PROBE(category, name) defines.
TRACEPOINT_PREFIX = "tracepoint__"
_LD_IMM64 = 0x18
_PSEUDO_MAP_FD, _PSEUDO_MAP_VALUE = 1, 2
#: Threads that detach probes at close. Each close waits out an RCU grace period (~0.05-0.1 s idle,
#: ~0.4 s on a loaded VM); links wait in parallel, perf events under a kernel-wide mutex (there,
#: with 178 probes under load, 32 threads took a daemon's stop from 74 s to 19 s).
DETACH_THREADS = 32


class RelocationError(ProbeError):
    """An instruction refers to a map fd the program does not declare."""


@dataclass(frozen=True)
class MapSpec:
    """One map as the kernel describes it (``BPF_OBJ_GET_INFO_BY_FD``)."""

    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int


@dataclass(frozen=True)
class Program:
    """A compiled BPF program, independent of any process's fds.

    Attributes:
        license, kern_version: what the program was compiled with.
        maps: the maps it uses, by bcc's table name.
        functions: name -> (program type, instructions as compiled).
        fds: the map fd baked into the instructions -> map name (for :func:`relocate`).
    """

    license: str
    kern_version: int
    maps: dict[str, MapSpec]
    functions: dict[str, tuple[int, bytes]]
    fds: dict[int, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        """Plain data for msgpack."""
        return {
            "license": self.license,
            "kern_version": self.kern_version,
            "maps": {n: [m.type, m.key_size, m.value_size, m.max_entries, m.flags] for n, m in self.maps.items()},
            "functions": {n: [t, insns] for n, (t, insns) in self.functions.items()},
            "fds": {str(fd): n for fd, n in self.fds.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> Program:
        """Inverse of :meth:`as_dict`. Raises KeyError/TypeError/ValueError on a malformed dict."""
        maps = {str(n): MapSpec(str(n), *(int(x) for x in spec)) for n, spec in d["maps"].items()}
        functions = {str(n): (int(t), bytes(insns)) for n, (t, insns) in d["functions"].items()}
        fds = {int(fd): str(n) for fd, n in d["fds"].items()}
        if any(len(insns) % 8 or not insns for _t, insns in functions.values()) or not set(fds.values()) <= set(maps):
            raise ValueError("malformed program")
        return cls(str(d["license"]), int(d["kern_version"]), maps, functions, fds)


def relocate(insns: bytes, fds: dict[int, str], maps: dict[str, int]) -> bytes:
    """``insns`` with every map fd baked in by the compiler replaced by the map's fd here.

    Args:
        fds: the compiled-in fd -> map name.
        maps: map name -> fd of the map created in this process.

    Raises:
        RelocationError: an instruction names an fd that ``fds`` does not know.
    """
    out = bytearray(insns)
    for at in range(0, len(out) - 15, 8):
        op, regs, _off, imm = struct.unpack_from("<BBhi", out, at)
        if op != _LD_IMM64 or (regs >> 4) not in (_PSEUDO_MAP_FD, _PSEUDO_MAP_VALUE):
            continue
        name = fds.get(imm)
        if name is None or name not in maps:
            raise RelocationError(f"instruction {at // 8} refers to map fd {imm}, which the program does not declare")
        struct.pack_into("<i", out, at + 4, maps[name])
    return bytes(out)


#: Where the distributions' packages put bcc (python3-bpfcc on Debian/Ubuntu, python3-bcc on RHEL).
SYSTEM_BCC_GLOBS = ("/usr/lib/python3/dist-packages/bcc", "/usr/lib/python3*/site-packages/bcc",
                    "/usr/lib64/python3*/site-packages/bcc")


def bcc_missing_hint() -> str:
    """What to do when bcc does not import. After `pip install memrec` into a virtualenv the
    system's bcc is usually there but out of this Python's reach: installing it again changes
    nothing, linking it in does."""
    import glob

    found = next((hit for pattern in SYSTEM_BCC_GLOBS for hit in sorted(glob.glob(pattern))), None)
    if found is None:
        return "install python3-bpfcc (Debian, Ubuntu) or python3-bcc (RHEL, Fedora), then run scripts/setup"
    return (f"the system's bcc is installed ({found}) but {sys.executable} does not reach it: run scripts/setup, "
            "or link it into this virtualenv (docs/operations.md, 1. Install)")


def _table_functions(lib):
    """libbcc's table functions with their C prototypes. bcc's Python binding declares none of the
    three, and ctypes' default (every argument and the result a C ``int``) cut the module pointer
    and the name's pointer to 32 bits: a segmentation fault whenever libbcc's heap lay above 2 GiB
    (seen once in a CI run). Own prototypes, so bcc's shared ``lib`` object stays as bcc made it."""
    import ctypes

    module, index = ctypes.c_void_p, ctypes.c_size_t
    return (ctypes.CFUNCTYPE(ctypes.c_size_t, module)(("bpf_num_tables", lib)),
            ctypes.CFUNCTYPE(ctypes.c_char_p, module, index)(("bpf_table_name", lib)),
            ctypes.CFUNCTYPE(ctypes.c_int, module, index)(("bpf_table_fd_id", lib)))


def compile_program(source: str, cflags: list[str]) -> Program:
    """Compile the C ``source`` with bcc and take the program out of it; bcc's objects are released.

    Raises:
        ProbeError: bcc is missing or the program does not compile.
    """
    try:
        from bcc import BPF
        from bcc.libbcc import lib
    except ImportError as exc:
        raise ProbeError(f"bcc is not importable ({exc}): {bcc_missing_hint()}") from exc
    import ctypes

    try:
        # bcc reports compile errors on stderr and raises a bare Exception.
        bpf = BPF(text=source.encode(), cflags=cflags)
    except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception
        raise ProbeError(f"cannot compile the probe program: {exc}") from exc
    try:
        module = ctypes.c_void_p(bpf.module)
        num_tables, table_name, table_fd = _table_functions(lib)
        maps: dict[str, MapSpec] = {}
        fds: dict[int, str] = {}
        for i in range(num_tables(module)):
            name = table_name(module, i).decode()
            fd = table_fd(module, i)
            info = bpfsys.map_info(fd)
            maps[name] = MapSpec(name, info["type"], info["key_size"], info["value_size"], info["max_entries"], info["flags"])
            fds[fd] = name
        functions = {}
        for i in range(lib.bpf_num_functions(module)):
            name = lib.bpf_function_name(module, i).decode()
            kind = bpfsys.PROG_TYPE_TRACEPOINT if name.startswith(TRACEPOINT_PREFIX) else bpfsys.PROG_TYPE_KPROBE
            functions[name] = (kind, bytes(bpf.dump_func(name.encode())))
        return Program(lib.bpf_module_license(module).decode(), int(lib.bpf_module_kern_version(module)), maps, functions, fds)
    finally:
        bpf.cleanup()


class LoadedProgram:
    """A :class:`Program` in the kernel: its maps created and every function loaded.

    Raises (constructor):
        ProbeError: a map or function is refused (for a function, with the verifier's last words).
    """

    def __init__(self, program: Program, links: bool | None = None) -> None:
        self.program = program
        #: Uprobes as multi-uprobe links (kernel >= 6.6: quick to detach), else perf events.
        self.links = bpfsys.uprobe_multi_supported() if links is None else links
        #: map name -> fd
        self.maps: dict[str, int] = {}
        #: function name -> program fd
        self.functions: dict[str, int] = {}
        self._tracepoints: list[int] = []
        self._linked = False  # a link was attached: links work here
        try:
            for name, spec in program.maps.items():
                self.maps[name] = bpfsys.map_create(spec.type, spec.key_size, spec.value_size, spec.max_entries,
                                                    spec.flags, name)
            self._load(list(program.functions))
        except OSError as exc:
            self.close()
            what = "function" if self.maps.keys() == program.maps.keys() else "map"
            raise ProbeError(f"the kernel refused a {what} of the probe program: {exc}") from exc
        except RelocationError:
            self.close()
            raise

    def _load(self, names: list[str]) -> None:
        """Load the functions ``names`` (relocated; uprobe functions for links when ``self.links``)."""
        for name in names:
            kind, insns = self.program.functions[name]
            code = relocate(insns, self.program.fds, self.maps)
            attach_type = bpfsys.TRACE_UPROBE_MULTI if self.links and kind == bpfsys.PROG_TYPE_KPROBE else 0
            self.functions[name] = bpfsys.prog_load(kind, code, self.program.license, self.program.kern_version,
                                                    name, attach_type)

    def _without_links(self, why: OSError) -> None:
        """The kernel refused the first link: load the uprobe functions again for perf events."""
        log.warning("multi-uprobe links refused (%s): attaching the uprobes as perf events (slower to detach)", why)
        self.links = False
        names = [n for n, (kind, _) in self.program.functions.items() if kind == bpfsys.PROG_TYPE_KPROBE]
        for name in names:
            os.close(self.functions.pop(name))
        self._load(names)

    def attach_tracepoints(self, tracefs: str) -> None:
        """Attach every ``tracepoint__CATEGORY__NAME`` function to its tracepoint."""
        for name, fd in self.functions.items():
            if name.startswith(TRACEPOINT_PREFIX):
                category, _, event = name[len(TRACEPOINT_PREFIX):].partition("__")
                try:
                    self._tracepoints.append(bpfsys.attach_tracepoint(fd, tracefs, category, event))
                except OSError as exc:
                    raise ProbeError(f"cannot attach {category}:{event}: {exc}") from exc

    def attach_uprobe(self, function: str, path: str, offset: int, retprobe: bool, ref_ctr_offset: int = 0,
                      cookie: int = 0, pid: int = 0) -> int:
        """Attach ``function`` at ``offset`` of ``path``; return the link or perf fd (close it to detach).

        ``ref_ctr_offset``: a USDT semaphore the kernel raises while the probe is in place;
        ``cookie``: what the program's ``bpf_get_attach_cookie`` returns; ``pid``: only in that
        process (0: in every process).

        Raises:
            OSError: the kernel refused (a refused first link switches to perf events, logged).
        """
        if self.links:
            try:
                fd = bpfsys.attach_uprobe_link(self.functions[function], path, offset, retprobe, ref_ctr_offset, cookie,
                                               pid)
            except OSError as exc:
                # Not EINVAL: that is also what a probe already at this offset with another
                # ref_ctr_offset gets (bcc 0.26's Python passes garbage there), links or not.
                if self._linked or exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                self._without_links(exc)
            else:
                self._linked = True
                return fd
        return bpfsys.attach_uprobe(self.functions[function], path, offset, retprobe, ref_ctr_offset, cookie, pid)

    def close(self) -> None:
        """Detach the tracepoints, release the functions and maps (uprobes are the caller's)."""
        for fd in [*self._tracepoints, *self.functions.values(), *self.maps.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._tracepoints.clear()
        self.functions.clear()
        self.maps.clear()


def close_in_parallel(perf_fds: list[int], threads: int = DETACH_THREADS) -> list[str]:
    """Close (detach) the probes' link or perf fds from ``threads`` threads; return one line per failure.

    Why threads: each close sleeps in the kernel for an RCU grace period. Multi-uprobe links
    (kernel >= 6.6) wait in parallel: 104 close in ~0.3 s from 32 threads (~5.5 s one by one).
    Perf events (older kernels) take event_mutex around the wait, so threads gain only ~10 % there
    (~10 s for 104); the daemon writes its trailer before it gets here either way.
    """
    if not perf_fds:
        return []

    def close(fd: int) -> str | None:
        try:
            os.close(fd)  # releases the GIL for the kernel's wait
        except OSError as exc:
            return f"cannot detach a uprobe (fd {fd}): {exc}"
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(perf_fds))), thread_name_prefix="detach") as pool:
        return [why for why in pool.map(close, perf_fds) if why]


#: ``r0 = 0; exit``: a program that does nothing.
NOOP_INSNS = bytes.fromhex("b700000000000000" "9500000000000000")


class NoopProbes:
    """A do-nothing program at the entry (and return) of ``symbols`` in the file ``path``: what a
    probe costs with nothing in it, the benches' floor. Attached like the real probes (links on
    kernel >= 6.6, else perf events; ``links`` forces one).

    Raises:
        ProbeError / OSError: a symbol is missing or the kernel refuses.
    """

    def __init__(self, path: str, symbols: list[str], with_return: bool = True, links: bool | None = None) -> None:
        from memrec.probes.elfsyms import function_offsets

        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            offsets = function_offsets(fd)
        finally:
            os.close(fd)
        missing = [s for s in symbols if s not in offsets]
        if missing:
            raise ProbeError(f"{path} does not export {', '.join(missing)}")
        self._prog = LoadedProgram(Program("GPL", 0, {}, {"noop": (bpfsys.PROG_TYPE_KPROBE, NOOP_INSNS)}), links=links)
        #: The probes' link or perf fds.
        self.fds: list[int] = []
        try:
            for sym in symbols:
                for retprobe in (True, False) if with_return else (False,):
                    self.fds.append(self._prog.attach_uprobe("noop", path, offsets[sym], retprobe))
        except OSError:
            self.close()
            raise

    def close(self, threads: int = DETACH_THREADS) -> None:
        """Detach them all (from ``threads`` threads; 1: one after the other) and free the program."""
        if threads <= 1:
            for fd in self.fds:
                os.close(fd)
        else:
            close_in_parallel(self.fds, threads)
        self.fds = []
        self._prog.close()
