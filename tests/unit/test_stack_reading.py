"""Reading a stack from a live process: the daemon reads it when it polls it, not when its event
comes, so a process that exits right after allocating keeps its frames; a frame read after the
process exited says so; native frames are named from the whole symbol table at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from memrec.daemon.stacks import StackRecorder
from memrec.probes import pystacks
from memrec.probes.elfsyms import FunctionTable
from memrec.probes.elfsyms import function_offsets
from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.events import FLAG_STACK
from memrec.trace.stacks import Frame

needs_layout = pytest.mark.skipif(sys.version_info[:2] not in pystacks.LAYOUTS,
                                  reason=f"CPython {sys.version_info[0]}.{sys.version_info[1]} has no offset table")

PYENV = Path("/root/.pyenv/versions")
_CHILD = "import time\ndef where():\n    print(id(where.__code__), flush=True)\n    time.sleep(120)\nwhere()\n"


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    code = int(proc.stdout.readline())
    yield proc, code
    proc.kill()
    proc.wait()


def _record(pid: int, code: int, sid: int = 7) -> np.void:
    rec = np.zeros((), dtype=pystacks.STACK_DTYPE)
    rec["id"], rec["pid"], rec["status"], rec["npy"] = sid, pid, pystacks.STACK_OK, 1
    rec["code"][0] = code
    return rec[()]


class _Probes:
    """The BPF side's three calls (the real ones are exercised by tests/bpf/test_python_stacks.py)."""

    def __init__(self) -> None:
        self.pending: list[np.void] = []

    def set_interpreter(self, interp) -> None:
        pass

    def forget_interpreter(self, pid: int) -> None:
        pass

    def poll_stacks(self):
        out, self.pending = self.pending, []
        return out


class _Writer:
    def __init__(self) -> None:
        self.stacks: list = []

    def intern_stack(self, stack) -> int:
        self.stacks.append(stack)
        return len(self.stacks)


def _events(pid: int, sid: int) -> np.ndarray:
    ev = np.zeros(1, dtype=EVENT_DTYPE)
    ev["pid"], ev["flags"] = pid, FLAG_STACK
    ev["ipc"][0] = sid.to_bytes(8, "little") + bytes(56)
    return ev


@needs_layout
def test_a_frame_read_after_its_process_exited_says_so_instead_of_naming_memory(child):
    proc, code = child
    symboliser = pystacks.Symboliser()
    symboliser.set_interpreter(pystacks.locate(proc.pid))
    assert symboliser.stack(_record(proc.pid, code)) == (Frame("<string>", 2, "where"),)
    proc.kill()
    proc.wait()
    (frame,) = symboliser.stack(_record(proc.pid, code))
    assert frame.file == "<unreadable>" and "exited" in frame.function


@needs_layout
def test_a_stack_is_read_when_polled_so_its_frames_outlive_the_process(child):
    proc, code = child
    probes = _Probes()
    recorder = StackRecorder(probes, depth=8)
    recorder.discover([proc.pid])
    writer = _Writer()
    probes.pending.append(_record(proc.pid, code, sid=7))
    recorder.resolve(np.zeros(0, dtype=EVENT_DTYPE), writer)  # the stack came in a batch before its event
    proc.kill()
    proc.wait()
    recorder.resolve(_events(proc.pid, 7), writer)
    assert writer.stacks == [(Frame("<string>", 2, "where"),)]
    assert (recorder.resolved, recorder.unavailable) == (1, 0)


_CHILD_310 = """import sys, time
def w\u00f6(pause):
    frame = sys._getframe()
    print(id(frame.f_code), frame.f_lasti // 2, frame.f_lineno, flush=True)
    time.sleep(pause)
w\u00f6(120)
"""


def test_a_cpython_310_frame_is_named_from_its_f_lasti_and_pep626_table():
    """3.10: the probe records f_lasti (8 bytes read: f_lineno above it) where 3.11+ give an
    instruction pointer; the name is co_name, here not ASCII (a compact string past 3.10's wstr)."""
    found = sorted(PYENV.glob("3.10.*/bin/python3.10")) if PYENV.is_dir() else []
    if not found:
        pytest.skip("no pyenv CPython 3.10")
    proc = subprocess.Popen([str(found[-1]), "-c", _CHILD_310], stdout=subprocess.PIPE, text=True)
    try:
        code, lasti, line = map(int, proc.stdout.readline().split())
        interp = pystacks.locate(proc.pid)
        assert interp is not None and not interp.problem, interp
        symboliser = pystacks.Symboliser()
        symboliser.set_interpreter(interp)
        rec = _record(proc.pid, code)
        rec["instr"][0] = (line << 32) | lasti
        assert line == 4 and symboliser.stack(rec) == (Frame("<string>", 4, "w\u00f6"),)
        rec["instr"][0] = 0xFFFFFFFF  # -1: the frame has not started, its first line
        assert symboliser.stack(rec) == (Frame("<string>", 2, "w\u00f6"),)
    finally:
        proc.kill()
        proc.wait()


def test_the_function_table_names_every_function_symbol_as_the_symbol_walk_does():
    path = next(p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6") if os.path.exists(p))
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets, table = function_offsets(fd), FunctionTable(fd)
    finally:
        os.close(fd)
    assert len(offsets) > 1000
    at = {}
    for name, off in offsets.items():
        at.setdefault(off, set()).add(name)
    for off, names in at.items():
        label = table.name_at(off + 1)
        function, _, rest = label.rpartition("+")
        assert function in names and rest == "0x1", (off, names, label)
    assert table.name_at(min(at) - 1) == ""


@pytest.mark.parametrize("minor", sorted(pystacks.LAYOUTS), ids=lambda m: f"{m[0]}.{m[1]}")
def test_a_code_object_is_known_again_by_its_identity_not_its_reference_count(minor):
    o = pystacks.LAYOUTS[minor]
    size = o.co_linetable + 8
    assert max(o.co_filename, o.co_name, o.co_qualname, o.co_firstlineno + 4) <= size  # all in the header read
    head = bytes(range(256))[:size]
    recounted = (12345).to_bytes(8, "little") + head[8:]
    moved = bytearray(head)
    moved[o.co_qualname] ^= 0xFF  # another function's name: another code object at this address
    ident = pystacks._identity(o, head, 1)
    assert pystacks._identity(o, recounted, 1) == ident
    assert pystacks._identity(o, bytes(moved), 1) != ident
    assert pystacks._identity(o, head + recounted, 2) == ident * 2


@needs_layout
def test_a_stack_met_again_is_named_as_before_and_a_dead_process_is_not_answered_from_memory(child):
    proc, code = child
    symboliser = pystacks.Symboliser()
    symboliser.set_interpreter(pystacks.locate(proc.pid))
    first = symboliser.stack(_record(proc.pid, code))
    assert symboliser.stack(_record(proc.pid, code)) == first == (Frame("<string>", 2, "where"),)
    proc.kill()
    proc.wait()
    (frame,) = symboliser.stack(_record(proc.pid, code))
    assert frame.file == "<unreadable>"
