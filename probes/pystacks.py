"""The Python (and native) stacks of allocations: where each process's interpreter lies, the
layout the BPF reader walks, and the frames a raw stack record stands for.

Why this split: the probe (``cuda.bpf.c``, ``--stacks``) can only follow pointers, so it records
per frame the code object and the instruction pointer; everything that needs parsing (the code
object's file and name strings, its line table) is done here, in the daemon, by reading the
process's memory (``/proc/PID/mem``). Nothing runs in the traced process.

What the probe needs per process (:class:`PyProc`, written into the ``py_procs`` map):
``_PyRuntime``'s address in that process (the symbol of the python executable or the libpython it
maps, plus where the file is mapped) and the offsets of the interpreter's structures for its
CPython version. The tables below were generated from the real interpreters' internal headers
(``offsetof`` over ``Py_BUILD_CORE`` headers of pyenv's 3.10.13, 3.11.7, 3.12.1 and 3.13.0 builds,
see ``tests/unit/test_pystacks.py`` which checks them against those interpreters); 3.13 and later
also publish them in ``_PyRuntime`` (``_Py_DebugOffsets``), which is read and preferred when present.

The probe matches a thread state by ``native_thread_id`` (3.11+). CPython 3.10 keeps only the
pthread id (``thread_id``, ``pthread_self()``), which on x86-64 is the thread's FS base: the probe
compares it with ``task_struct.thread.fsbase``, at an offset read from the running kernel's BTF
(:mod:`memrec.probes.btf`) and handed to the probe in the process's entry. Where that offset
cannot be known (no BTF, another architecture) 3.10 processes are said to be unreadable, and so
are 3.9 and older, rather than guessed at. 3.10 also walks other frames (``PyFrameObject``: the
probe records ``f_lasti``, an instruction index, where 3.11+ give an instruction pointer) and has
another line table format (PEP 626's, :func:`line_of_pep626`).

A frame that cannot be read (the process exited, the object is no longer a code object) becomes
an explicit ``<unreadable: reason>`` frame; a stack that cannot be read at all becomes
:class:`~memrec.trace.stacks.Unavailable` with the reason, never a wrong stack.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import logging
import os
import re
import struct
import time
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

import numpy as np

from memrec.probes.btf import VMLINUX
from memrec.probes.btf import task_fsbase_offset
from memrec.probes.elfsyms import ElfError
from memrec.probes.elfsyms import FunctionTable
from memrec.probes.elfsyms import read_bytes
from memrec.probes.elfsyms import symbol_offsets
from memrec.probes.libs import MapsEntry
from memrec.probes.libs import parse_maps
from memrec.trace.stacks import Frame
from memrec.trace.stacks import Stack
from memrec.trace.stacks import Unavailable

log = logging.getLogger(__name__)

#: The hard bound on Python frames a record holds (cuda.bpf.c PY_FRAMES_MAX; a power of two).
PY_FRAMES_MAX = 32
#: Frame slots a record holds: C-stack shim frames (3.12+, dropped here) take slots too.
PY_SLOTS = 64
#: The default bound (``--stack-depth``).
PY_FRAMES_DEFAULT = 32
#: Native return addresses a record holds (cuda.bpf.c NATIVE_FRAMES_MAX).
NATIVE_FRAMES_MAX = 16
#: Tensor blocks below this many bytes get no stack by default (``--stack-min-bytes``).
STACK_MIN_BYTES_DEFAULT = 1 << 20
_NONE = 0xFFFFFFFF

#: Status codes of a record (cuda.bpf.c STACK_*).
STACK_OK, STACK_NO_INTERPRETER, STACK_NO_THREAD, STACK_READ_FAILED = range(4)
STACK_TRUNCATED = 0x100

#: One record of the ``stacks`` ring (struct stack_rec in cuda.bpf.c).
STACK_DTYPE = np.dtype([
    ("id", "<u8"), ("pid", "<u4"), ("tid", "<u4"), ("status", "<u4"), ("npy", "<u2"), ("nnative", "<u2"),
    ("code", "<u8", (PY_SLOTS,)), ("instr", "<u8", (PY_SLOTS,)), ("native", "<u8", (NATIVE_FRAMES_MAX,)),
])
assert STACK_DTYPE.itemsize == 1176


@dataclass(frozen=True)
class Offsets:
    """Where the probe and the symboliser find things in one CPython version (bytes)."""

    interp_head: int  # _PyRuntimeState.interpreters.head
    threads_head: int  # PyInterpreterState.threads.head (3.10: .tstate_head)
    ts_next: int  # PyThreadState.next
    ts_tid: int  # PyThreadState.native_thread_id (3.10: .thread_id)
    ts_frame: int  # PyThreadState.cframe (3.11, 3.12) / .current_frame (3.13+) / .frame (3.10)
    cframe_frame: int  # _PyCFrame.current_frame; _NONE without a cframe (3.10, 3.13+)
    fr_previous: int  # _PyInterpreterFrame.previous (3.10: PyFrameObject.f_back)
    fr_code: int  # .f_code / .f_executable
    fr_instr: int  # .prev_instr / .instr_ptr (3.10: .f_lasti)
    fr_owner: int  # .owner; _NONE in 3.10
    owner_cstack: int  # FRAME_OWNED_BY_CSTACK (shim frames, skipped); _NONE before 3.12
    co_filename: int
    co_name: int
    co_qualname: int
    co_firstlineno: int
    co_linetable: int
    co_code_adaptive: int  # _NONE in 3.10 (its instructions are counted by index)
    ascii_size: int  # sizeof(PyASCIIObject): where a compact ASCII string's characters start
    compact_size: int  # sizeof(PyCompactUnicodeObject): the same for other compact strings
    #: 3.10: frames are PyFrameObjects (``fr_instr`` is ``f_lasti``, an int: the index of the
    #: instruction running), the line table is PEP 626's, code objects have no qualified name
    #: (``co_qualname`` is ``co_name``), and ``ts_tid`` is the pthread id (see the module's doc).
    frame_objects: bool = False


#: Checked against pyenv's 3.10.13, 3.11.7, 3.12.1 and 3.13.0 (tests/unit/test_pystacks.py).
LAYOUTS: dict[tuple[int, int], Offsets] = {
    (3, 10): Offsets(32, 8, 8, 176, 24, _NONE, 24, 32, 96, _NONE, _NONE, 104, 112, 112, 40, 120, _NONE, 48, 72,
                     frame_objects=True),
    (3, 11): Offsets(40, 16, 8, 160, 56, 8, 48, 32, 56, 69, _NONE, 112, 120, 128, 72, 136, 184, 48, 72),
    (3, 12): Offsets(40, 72, 8, 144, 56, 0, 8, 0, 56, 70, 3, 112, 120, 128, 68, 136, 192, 40, 56),
    (3, 13): Offsets(632, 7344, 8, 160, 72, _NONE, 8, 0, 56, 70, 3, 112, 120, 128, 68, 136, 200, 40, 56),
}
SUPPORTED = ", ".join(f"{a}.{b}" for a, b in sorted(LAYOUTS))

_INTERPRETER_NAMES = ("python", "libpython")
_SYMBOLS = frozenset({b"_PyRuntime", b"PyCode_Type", b"Py_Version"})
_DEBUG_COOKIE = b"xdebugpy"
_NAMED_VERSION = re.compile(r"python(\d)\.(\d+)")


@dataclass(frozen=True)
class Interpreter:
    """The CPython a process runs, as far as memrec can read it.

    Attributes:
        pid: the process.
        path: the mapped file holding ``_PyRuntime`` (the executable or libpython), as the
            process names it.
        version: (major, minor, micro); (major, minor) when only the file's name says which
            (before 3.11: no ``Py_Version``); None when nothing does.
        runtime: ``_PyRuntime``'s address in the process (0: not found).
        code_type: ``PyCode_Type``'s address (a frame's object is checked against it).
        offsets: the layout, or None when ``problem`` says why stacks cannot be read.
        problem: "" or why this interpreter gives no stacks ("CPython 3.9: memrec reads 3.10, ...").
        fsbase: where ``task_struct.thread.fsbase`` lies in the running kernel (3.10: the probe
            matches thread states by it); ``_NONE`` for 3.11+, matched by native thread id.
    """

    pid: int
    path: str
    version: tuple[int, ...] | None
    runtime: int
    code_type: int
    offsets: Offsets | None
    problem: str = ""
    fsbase: int = _NONE

    @property
    def label(self) -> str:
        """``CPython 3.12.1`` (``CPython 3.10`` when only the file's name says which)."""
        if self.version is None:
            return "CPython (before 3.11)"
        return "CPython " + ".".join(map(str, self.version))

    def pack(self) -> bytes:
        """The ``py_procs`` map value (struct py_proc)."""
        o = self.offsets
        assert o is not None and not self.problem
        return struct.pack("<Q12I", self.runtime, o.interp_head, o.threads_head, o.ts_next, o.ts_tid, o.ts_frame,
                           o.cframe_frame, o.fr_previous, o.fr_code, o.fr_instr, o.fr_owner, o.owner_cstack,
                           self.fsbase)


def _candidates(entries: list[MapsEntry]) -> list[MapsEntry]:
    """The first mapping of each file that could be the interpreter (python*, libpython*)."""
    seen: set[tuple[int, int]] = set()
    out = []
    for e in entries:
        name = os.path.basename(e.path)
        if name.startswith(_INTERPRETER_NAMES) and (e.dev, e.inode) not in seen:
            seen.add((e.dev, e.inode))
            out.append(e)
    return out


def _address(entries: list[MapsEntry], entry: MapsEntry, file_offset: int) -> int:
    """The address where ``file_offset`` of ``entry``'s file is mapped in the process (0: not mapped)."""
    for e in entries:
        if (e.dev, e.inode) == (entry.dev, entry.inode) and e.offset <= file_offset < e.offset + (e.end - e.start):
            return e.start + file_offset - e.offset
    return 0


def _version(fd: int, offsets: dict[str, int]) -> tuple[int, int, int] | None:
    """``Py_Version`` (3.11+: 0xMMmmuuxx in .rodata), or None."""
    if "Py_Version" not in offsets:
        return None
    (hexversion,) = struct.unpack("<I", read_bytes(fd, offsets["Py_Version"], 4))
    return hexversion >> 24, (hexversion >> 16) & 0xFF, (hexversion >> 8) & 0xFF


def _debug_offsets(mem: int, runtime: int, base: Offsets) -> Offsets | None:
    """The layout ``_Py_DebugOffsets`` at the start of ``_PyRuntime`` gives (3.13+), or None.

    The thread state, frame and code fields it publishes replace the table's; the string sizes
    and FRAME_OWNED_BY_CSTACK are not published and stay the table's.
    """
    try:
        head = os.pread(mem, 8 + 8 * 64, runtime)
    except OSError:
        return None
    if len(head) < 8 + 8 * 64 or head[:8] != _DEBUG_COOKIE:
        return None
    q = struct.unpack_from("<64Q", head, 8)
    # version, free_threaded, runtime_state{size, finalizing, interpreters_head},
    # interpreter_state{size, id, next, threads_head, gc, imports_modules, sysdict, builtins,
    # ceval_gil, gil_runtime_state, gil_runtime_state_enabled, gil_runtime_state_locked,
    # gil_runtime_state_holder}, thread_state{size, prev, next, interp, current_frame, thread_id,
    # native_thread_id, datastack_chunk, status}, interpreter_frame{size, previous, executable,
    # instr_ptr, localsplus, owner}, code_object{size, filename, name, qualname, linetable,
    # firstlineno, argcount, localsplusnames, localspluskinds, co_code_adaptive}
    rt, it, ts, fr, co = 2, 5, 18, 27, 33
    return Offsets(
        interp_head=q[rt + 2], threads_head=q[it + 3], ts_next=q[ts + 2], ts_tid=q[ts + 6],
        ts_frame=q[ts + 4], cframe_frame=_NONE, fr_previous=q[fr + 1], fr_code=q[fr + 2], fr_instr=q[fr + 3],
        fr_owner=q[fr + 5], owner_cstack=base.owner_cstack, co_filename=q[co + 1], co_name=q[co + 2],
        co_qualname=q[co + 3], co_firstlineno=q[co + 5], co_linetable=q[co + 4], co_code_adaptive=q[co + 9],
        ascii_size=base.ascii_size, compact_size=base.compact_size)


def _open_mapped(pid: int, entry: MapsEntry, proc: Path) -> int:
    """An fd on the file of ``entry`` as the process sees it (its own mount namespace)."""
    return os.open(proc / str(pid) / "map_files" / entry.range, os.O_RDONLY | os.O_CLOEXEC)


def locate(pid: int, proc: Path = Path("/proc")) -> Interpreter | None:
    """The CPython ``pid`` runs, or None when it maps no interpreter (not a Python process).

    Raises:
        OSError: the process is gone or its maps cannot be read.
    """
    entries = parse_maps((proc / str(pid) / "maps").read_text())
    for entry in _candidates(entries):
        try:
            fd = _open_mapped(pid, entry, proc)
        except OSError:
            continue
        try:
            offsets = symbol_offsets(fd, _SYMBOLS)
            if "_PyRuntime" not in offsets:
                continue
            version = _version(fd, offsets)
        except (ElfError, OSError) as error:
            log.debug("pid %d: cannot read %s: %s", pid, entry.path, error)
            continue
        finally:
            os.close(fd)
        return _interpreter(pid, entry, entries, offsets, version, proc)
    for entry in _candidates(entries):
        named = _NAMED_VERSION.search(os.path.basename(entry.path))
        if named:  # an interpreter too old to export _PyRuntime (3.6 and before)
            version = (int(named.group(1)), int(named.group(2)))
            return Interpreter(pid, entry.path, version, 0, 0, None,
                               f"CPython {version[0]}.{version[1]}: memrec reads the stacks of CPython {SUPPORTED}")
    return None


def _interpreter(pid: int, entry: MapsEntry, entries: list[MapsEntry], offsets: dict[str, int],
                 version: tuple[int, ...] | None, proc: Path) -> Interpreter:
    runtime = _address(entries, entry, offsets["_PyRuntime"])
    code_type = _address(entries, entry, offsets.get("PyCode_Type", -1))
    named = _NAMED_VERSION.search(os.path.basename(entry.path))
    if version is None and named:  # before 3.11 (no Py_Version): the file's name says which, not the micro
        version = (int(named.group(1)), int(named.group(2)))
    found = Interpreter(pid, entry.path, version, runtime, code_type, None)
    if version is None or version[:2] < min(LAYOUTS):
        return _with_problem(found, f"{found.label}: memrec reads the stacks of CPython {SUPPORTED}")
    table = LAYOUTS.get(version[:2]) or (LAYOUTS[max(LAYOUTS)] if version[:2] > max(LAYOUTS) else None)
    if table is None:
        return _with_problem(found, f"{found.label}: memrec reads the stacks of CPython {SUPPORTED}")
    if not runtime or not code_type:
        return _with_problem(found, f"{found.label}: _PyRuntime or PyCode_Type is not mapped")
    if table.frame_objects:
        fsbase = thread_pointer_offset()
        if isinstance(fsbase, str):
            return _with_problem(found, f"{found.label}: {fsbase}")
        return Interpreter(pid, entry.path, version, runtime, code_type, table, fsbase=fsbase)
    layout = table if version[:2] in LAYOUTS else None
    if version[:2] >= (3, 13):
        try:
            mem = os.open(proc / str(pid) / "mem", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            return _with_problem(found, f"{found.label}: cannot read its memory ({error.strerror})")
        try:
            layout = _debug_offsets(mem, runtime, table) or layout
        finally:
            os.close(mem)
    if layout is None:
        return _with_problem(found, f"{found.label}: no debug offsets and no table (memrec reads {SUPPORTED})")
    return Interpreter(pid, entry.path, version, runtime, code_type, layout)


#: The kernel's BTF that :func:`thread_pointer_offset` reads.
KERNEL_BTF = VMLINUX


def thread_pointer_offset() -> int | str:
    """Where the kernel keeps the calling thread's ``pthread_self()`` (``task_struct.thread.fsbase``:
    on x86-64, glibc's and musl's pthread id is the thread pointer, the FS base set at the thread's
    creation), or why a CPython 3.10 thread state cannot be matched to a thread (a string)."""
    machine = os.uname().machine
    if machine != "x86_64":
        return f"its thread states name threads by pthread id, which memrec matches on x86-64 only (this is {machine})"
    found = task_fsbase_offset(KERNEL_BTF)
    return found if isinstance(found, int) else f"its threads cannot be matched (pthread ids): {found}"


def _with_problem(found: Interpreter, problem: str) -> Interpreter:
    return Interpreter(found.pid, found.path, found.version, found.runtime, found.code_type, None, problem)


# ---- symbolising ---------------------------------------------------------------------------------


def _varint(table: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while i < len(table):
        byte = table[i]
        i += 1
        value |= (byte & 63) << shift
        shift += 6
        if not byte & 64:
            break
    return value, i


def _svarint(table: bytes, i: int) -> tuple[int, int]:
    value, i = _varint(table, i)
    return (-(value >> 1) if value & 1 else value >> 1), i


def line_of_pep626(table: bytes, firstlineno: int, index: int) -> int | None:
    """The source line of code unit ``index`` in a CPython 3.10 line table (``co_linetable``, PEP
    626: pairs of an unsigned byte, the bytes of code covered, and a signed byte, the line delta,
    -128 for no line; a pair covering no code still moves the line), or None when the instruction
    has no line. Mirrors CPython 3.10's ``PyCode_Addr2Line`` (``PyLineTable_NextAddressRange``)."""
    addr = index * 2  # the table counts bytes; an index counts 2-byte code units
    line = firstlineno
    start = 0
    for i in range(0, len(table) - 1, 2):
        end = start + table[i]
        delta = table[i + 1] - 256 if table[i + 1] > 127 else table[i + 1]
        if delta != -128:
            line += delta
        if start <= addr < end:
            return None if delta == -128 else line
        start = end
    return None


def line_of(table: bytes, firstlineno: int, index: int) -> int | None:
    """The source line of code unit ``index`` in a 3.11+ location table (``co_linetable``), or
    None when the instruction has no line. Mirrors CPython's ``_PyCode_CheckLineNumber``."""
    line = firstlineno
    addr = 0
    i = 0
    while i < len(table):
        first = table[i]
        i += 1
        code = (first >> 3) & 15
        length = (first & 7) + 1
        delta: int | None = 0
        if code == 15:  # no location
            delta = None
        elif code == 14:  # long form: line delta, end line, column, end column
            delta, i = _svarint(table, i)
            for _ in range(3):
                _, i = _varint(table, i)
        elif code == 13:  # no column
            delta, i = _svarint(table, i)
        elif code >= 10:  # one line form
            delta = code - 10
            i += 2
        else:  # short form
            i += 1
        if delta is not None:
            line += delta
        if addr <= index < addr + length:
            return None if delta is None else line
        addr += length
    return None


@dataclass(eq=False)
class _Code:
    ident: bytes  # the bytes that tell this code object from another at its address (_identity)
    file: str
    function: str
    firstlineno: int
    linetable: bytes
    pep626: bool  # a 3.10 line table (line_of_pep626), not a 3.11+ location table (line_of)
    #: code unit index -> line, as found: decoding the table walks it from the start, and a busy
    #: allocation site is met again and again (the daemon must keep up with the events).
    lines: dict[int, int | None] = field(default_factory=dict)

    def line(self, index: int) -> int:
        if index not in self.lines:
            decode = line_of_pep626 if self.pep626 else line_of
            self.lines[index] = decode(self.linetable, self.firstlineno, index) if index >= 0 else None
        found = self.lines[index]
        return found if found is not None else self.firstlineno


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                                   ctypes.c_ulong]
_IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])


def _read_many(pid: int, addrs: list[int], size: int) -> bytes | None:
    """The ``size`` bytes at each of ``addrs`` in ``pid``'s memory, in one system call (one
    ``pread`` per frame cost the daemon more than the events it had to keep up with); None when
    any of them cannot be read (the caller then reads them one by one, to say which and why)."""
    n = len(addrs)
    buf = ctypes.create_string_buffer(n * size)
    local = np.empty(n, _IOVEC)
    local["base"] = ctypes.addressof(buf) + np.arange(n, dtype=np.uint64) * size
    local["len"] = size
    remote = np.empty(n, _IOVEC)
    remote["base"] = addrs
    remote["len"] = size
    got = _libc.process_vm_readv(pid, local.ctypes.data, n, remote.ctypes.data, n, 0)
    return buf.raw if got == n * size else None


def _identity(o: Offsets, heads: bytes, count: int) -> bytes:
    """What tells a code object from another put at its address later, from ``count`` headers of
    ``o.co_linetable + 8`` bytes each: its type, first line and the file, name, qualified name and
    line table pointers. Not the whole header: the reference count changes with every frame that
    runs the code, and 3.11's warm-up counter while it is quickened."""
    rows = np.frombuffer(heads, np.uint8).reshape(count, o.co_linetable + 8)
    return rows[:, _identity_columns(o)].tobytes()


@functools.lru_cache(maxsize=16)
def _identity_columns(o: Offsets) -> np.ndarray:
    spans = [(8, 16), (o.co_firstlineno, o.co_firstlineno + 4)] + [
        (at, at + 8) for at in (o.co_filename, o.co_name, o.co_qualname, o.co_linetable)]
    return np.concatenate([np.arange(lo, hi) for lo, hi in spans])


class _Unreadable(Exception):
    """A frame's object cannot be read (why in the message)."""


class Symboliser:
    """Turns raw stack records into frames, per process, reading code objects from its memory.

    ``depth``: the most Python frames kept (the probe's ``PY_FRAMES``), innermost first.
    Code objects are cached per (pid, address) with their identity (:func:`_identity`), which is
    read again for every frame and compared: a code object freed and another put at the same address (different
    names, line numbers or table) is read afresh, never given the old one's name. Interpreters and
    reasons come from :meth:`set_interpreter` and :meth:`set_problem` (the daemon's discovery).
    """

    #: Processes whose memory fd is kept open at once (the oldest is closed first).
    MAX_OPEN = 64
    #: A native address outside every mapping known re-reads the process's maps at most this often
    #: (seconds): a walk without frame pointers ends on such an address in most stacks, and a CUDA
    #: process's maps run to thousands of lines.
    MAPS_REFRESH_S = 1.0

    def __init__(self, proc: Path = Path("/proc"), depth: int = PY_FRAMES_DEFAULT) -> None:
        self.proc = proc
        self.depth = depth
        self._interpreters: dict[int, Interpreter] = {}
        self._problems: dict[int, str] = {}
        self._mem: dict[int, int] = {}
        self._codes: dict[tuple[int, int], _Code] = {}
        #: pid -> (when read, the start of each file mapping in order, the mappings)
        self._maps: dict[int, tuple[float, list[int], list[MapsEntry]]] = {}
        #: pid -> a raw stack's code objects and instruction pointers -> (the code objects'
        #: identities then, its frames): a stack met again costs one read of the headers, compared
        self._stacks: dict[int, dict[bytes, tuple[bytes, tuple[Frame, ...]]]] = {}
        #: pid -> return address -> its frame (or None: outside every mapping), while the maps last
        self._natives: dict[int, dict[int, Frame | None]] = {}
        self._functions: dict[tuple[int, int], FunctionTable | None] = {}

    def set_interpreter(self, interp: Interpreter) -> None:
        self._interpreters[interp.pid] = interp
        self._problems.pop(interp.pid, None)

    def set_problem(self, pid: int, problem: str) -> None:
        """Why ``pid``'s Python stacks cannot be read ("" forgets it: not a Python process)."""
        self._interpreters.pop(pid, None)
        if problem:
            self._problems[pid] = problem
        else:
            self._problems.pop(pid, None)

    def forget(self, pid: int) -> None:
        """The process exited: drop what is cached of it."""
        self._interpreters.pop(pid, None)
        self._problems.pop(pid, None)
        self._maps.pop(pid, None)
        self._natives.pop(pid, None)
        self._stacks.pop(pid, None)
        fd = self._mem.pop(pid, None)
        if fd is not None:
            os.close(fd)
        for key in [k for k in self._codes if k[0] == pid]:
            del self._codes[key]

    def close(self) -> None:
        for pid in list(self._mem):
            self.forget(pid)

    # -- one record -------------------------------------------------------------------------------
    def stack(self, rec: np.void, native: bool = True) -> Stack:
        """The frames of one ``STACK_DTYPE`` record, innermost first (Python frames, then the
        native return addresses with ``native``), or Unavailable with the reason."""
        pid = int(rec["pid"])
        status = int(rec["status"])
        frames: list[Frame] = []
        reason = ""
        base = status & ~STACK_TRUNCATED
        if base == STACK_OK:
            interp = self._interpreters.get(pid)
            if interp is None or interp.offsets is None:
                reason = "interpreter forgotten before the stack was read"
            else:
                slots = int(rec["npy"])
                frames = self._python_seen(pid, interp, rec["code"][:slots], rec["instr"][:slots])
                if not frames:  # a thread state without a frame: C++ code that made one
                    reason = "the thread runs no Python code (its thread state has no frame)"
                if status & STACK_TRUNCATED or len(frames) > self.depth:
                    frames = frames[: self.depth]
                    frames.append(Frame("<truncated>", 0, f"more than {len(frames)} frames"))
        elif base == STACK_NO_INTERPRETER:
            if pid in self._problems:
                reason = self._problems[pid]
            elif pid in self._interpreters:
                reason = "interpreter located after this allocation"
            else:
                reason = ""  # not a Python process (as far as memrec knows): native frames only
        elif base == STACK_NO_THREAD:
            reason = "no Python thread state for this thread (a thread that never ran Python)"
        else:
            reason = "the interpreter's memory could not be read at the probe"
        if reason and not frames:
            if not native or not int(rec["nnative"]):
                return Unavailable(reason)
            frames.append(Frame("<python stack unavailable>", 0, reason))
        if native:
            frames += self._native(pid, rec["native"][: int(rec["nnative"])])
        return tuple(frames) if frames else Unavailable("no Python interpreter and no native frames")

    # -- Python frames ----------------------------------------------------------------------------
    def _fd(self, pid: int) -> int:
        fd = self._mem.get(pid)
        if fd is None:
            if len(self._mem) >= self.MAX_OPEN:
                oldest = next(iter(self._mem))
                os.close(self._mem.pop(oldest))
            fd = self._mem[pid] = os.open(self.proc / str(pid) / "mem", os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def _python_seen(self, pid: int, interp: Interpreter, codes: np.ndarray, instrs: np.ndarray) -> list[Frame]:
        """:meth:`_python`, answered from the stacks met before when every code object in it is
        still the one it was (:func:`_identity` unchanged, as :meth:`_code` checks per frame)."""
        o = interp.offsets
        assert o is not None
        if o.frame_objects:  # the probe read 8 bytes at f_lasti: f_lineno (not the place) is above it
            instrs = instrs & np.uint64(0xFFFFFFFF)
        key = codes.tobytes() + instrs.tobytes()
        real = [c for c in codes.tolist() if c > 1]
        heads = _read_many(pid, real, o.co_linetable + 8) if real else b""
        if heads:
            heads = _identity(o, heads, len(real))
        known = self._stacks.setdefault(pid, {})
        seen = known.get(key)
        if seen is not None and heads is not None and seen[0] == heads:
            return list(seen[1])
        frames = self._python(pid, interp, codes, instrs)
        if heads is not None and all(f.file != "<unreadable>" for f in frames):
            if len(known) >= 1 << 12:
                known.clear()
            known[key] = (heads, tuple(frames))
        return frames

    def _python(self, pid: int, interp: Interpreter, codes: np.ndarray, instrs: np.ndarray) -> list[Frame]:
        o = interp.offsets
        assert o is not None
        out = []
        for code, instr in zip(codes.tolist(), instrs.tolist()):
            if code == 0:  # a C-stack shim frame (3.12+): not the program's
                continue
            if code == 1:
                out.append(Frame("<unreadable>", 0, "the frame's fields could not be read at the probe"))
                continue
            try:
                obj = self._code(pid, interp, code)
                if o.frame_objects:  # f_lasti: the low 32 bits, a signed int (-1: not started)
                    index = (instr & 0xFFFFFFFF) - ((instr & 0x80000000) << 1)
                else:
                    index = (instr - code - o.co_code_adaptive) // 2
                out.append(Frame(obj.file, obj.line(index), obj.function))
            except _Unreadable as why:
                out.append(Frame("<unreadable>", 0, str(why)))
        return out

    def _read(self, pid: int, addr: int, size: int) -> bytes:
        try:
            data = os.pread(self._fd(pid), size, addr)
        except OSError as error:
            raise _Unreadable(f"memory at 0x{addr:x}: {error.strerror}") from None
        if not data and size:  # the kernel reads nothing once the address space is gone
            raise _Unreadable("the process exited before memrec read this frame")
        if len(data) != size:
            raise _Unreadable(f"memory at 0x{addr:x}: {len(data)} of {size} bytes readable")
        return data

    def _code(self, pid: int, interp: Interpreter, addr: int) -> _Code:
        o = interp.offsets
        assert o is not None
        head = self._read(pid, addr, o.co_linetable + 8)
        ident = _identity(o, head, 1)
        cached = self._codes.get((pid, addr))
        if cached is not None and cached.ident == ident:
            return cached
        (ob_type,) = struct.unpack_from("<Q", head, 8)
        if ob_type != interp.code_type:
            raise _Unreadable(f"object at 0x{addr:x} is not a code object")
        pointer = lambda off: struct.unpack_from("<Q", head, off)[0]  # noqa: E731
        (firstlineno,) = struct.unpack_from("<i", head, o.co_firstlineno)
        table = pointer(o.co_linetable)
        (size,) = struct.unpack("<q", self._read(pid, table + 16, 8))
        if not 0 <= size <= 1 << 20:
            raise _Unreadable(f"line table of {size} bytes")
        linetable = self._read(pid, table + 32, size)  # PyBytesObject.ob_sval
        got = _Code(ident, self._string(pid, o, pointer(o.co_filename)), self._string(pid, o, pointer(o.co_qualname)),
                    firstlineno, linetable, o.frame_objects)
        if len(self._codes) > 1 << 16:
            self._codes.clear()
        self._codes[(pid, addr)] = got
        return got

    def _string(self, pid: int, o: Offsets, addr: int) -> str:
        head = self._read(pid, addr, o.ascii_size)
        (length,) = struct.unpack_from("<q", head, 16)
        (state,) = struct.unpack_from("<I", head, 32)
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if not compact or kind not in (1, 2, 4) or not 0 <= length <= 4096:
            raise _Unreadable(f"string at 0x{addr:x} is not a compact string")
        if ascii_:
            return self._read(pid, addr + o.ascii_size, length).decode("ascii", "replace")
        data = self._read(pid, addr + o.compact_size, length * kind)
        return data.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind], "replace")

    # -- native frames ----------------------------------------------------------------------------
    def _native(self, pid: int, addrs: np.ndarray) -> list[Frame]:
        out = []
        known = self._natives.setdefault(pid, {})
        for addr in addrs.tolist():
            if addr in known:
                frame = known[addr]
            else:
                entry = self._mapping(pid, addr)
                frame = None
                if entry is not None and "x" in entry.perms:
                    offset = addr - entry.start + entry.offset
                    frame = Frame(entry.path, offset, self._symbol(pid, entry, offset), native=True)
                known = self._natives.setdefault(pid, {})  # (the maps were re-read: a fresh table)
                if len(known) < 1 << 16:
                    known[addr] = frame
            if frame is None:
                break  # without frame pointers the walk goes astray here: what follows is not code
            out.append(frame)
        return out

    def _mapping(self, pid: int, addr: int) -> MapsEntry | None:
        now = time.monotonic()
        cached = self._maps.get(pid)
        for fresh in (False, True):
            if cached is None or (fresh and now - cached[0] >= self.MAPS_REFRESH_S):
                try:
                    entries = sorted(parse_maps((self.proc / str(pid) / "maps").read_text()), key=lambda e: e.start)
                except OSError:
                    entries = []
                cached = self._maps[pid] = (now, [e.start for e in entries], entries)
                self._natives.pop(pid, None)  # return addresses are named afresh against these maps
            elif fresh:
                break
            at = bisect.bisect_right(cached[1], addr) - 1
            if at >= 0 and addr < cached[2][at].end:
                return cached[2][at]
        return None

    def _symbol(self, pid: int, entry: MapsEntry, offset: int) -> str:
        key = (entry.dev, entry.inode)
        if key not in self._functions:
            table = None
            with contextlib.suppress(OSError, ElfError):
                fd = _open_mapped(pid, entry, self.proc)
                try:
                    table = FunctionTable(fd)
                finally:
                    os.close(fd)
            self._functions[key] = table
        table = self._functions[key]
        return table.name_at(offset) if table is not None else ""
