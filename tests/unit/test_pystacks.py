"""The symboliser's parts against the real interpreters: the line table decoders against CPython's
own ``co_lines`` (3.11+ in this interpreter, 3.10's in pyenv's 3.10), the offset tables against
``offsetof`` over pyenv's internal headers, and :func:`locate` on live processes of each pyenv
CPython (supported, and said to be unsupported)."""

from __future__ import annotations

import dis
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from memrec.probes import pystacks

PYENV = Path("/root/.pyenv/versions")
OFFSETS_C = Path(__file__).with_name("pystacks_offsets.c")


def _codes(code):
    yield code
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            yield from _codes(const)


@pytest.mark.skipif(sys.version_info[:2] not in pystacks.LAYOUTS, reason="this interpreter's table format")
def test_line_of_agrees_with_cpython_for_every_instruction_of_a_real_module():
    source = Path(dis.__file__).read_text()
    for code in _codes(compile(source, dis.__file__, "exec")):
        for start, end, line in code.co_lines():
            for offset in range(start, end, 2):
                assert pystacks.line_of(code.co_linetable, code.co_firstlineno, offset // 2) == line, (
                    code.co_qualname, offset)


#: Run by pyenv's CPython 3.10: each code object of real modules with its line table, first line,
#: code size and its own answer (``co_lines``: (start, end, line or None) in bytes of code).
_DUMP_310 = """
import json, sys
def codes(c):
    yield c
    for k in c.co_consts:
        if hasattr(k, "co_code"):
            yield from codes(k)
out = []
for name in ("dis", "typing", "asyncio.base_events", "argparse", "inspect", "email._header_value_parser"):
    path = __import__(name, fromlist=["_"]).__file__
    for c in codes(compile(open(path).read(), path, "exec")):
        out.append([c.co_linetable.hex(), c.co_firstlineno, len(c.co_code), list(c.co_lines())])
print(json.dumps(out))
"""


def test_line_of_pep626_agrees_with_cpython_310_for_every_instruction_of_real_modules():
    found = sorted(PYENV.glob("3.10.*/bin/python3.10"))
    if not found:
        pytest.skip("no pyenv CPython 3.10")
    codes = json.loads(subprocess.run([str(found[-1]), "-c", _DUMP_310], check=True, capture_output=True,
                                      text=True).stdout)
    assert len(codes) > 900
    checked = nolines = zero_length = 0
    for table, firstlineno, size, truth in codes:
        pairs = bytes.fromhex(table)
        zero_length += any(pairs[i] == 0 and pairs[i + 1] not in (0, 128) for i in range(0, len(pairs), 2))
        want = {}
        for start, end, line in truth:
            want.update((offset, line) for offset in range(start, end, 2))
        for offset in range(0, size, 2):
            assert pystacks.line_of_pep626(bytes.fromhex(table), firstlineno, offset // 2) == want.get(offset), (
                firstlineno, offset)
            checked += 1
            nolines += want.get(offset) is None
    # instructions without a line were met too, and entries that cover no code but move the line
    assert checked > 40_000 and nolines and zero_length


def _pythons() -> list[Path]:
    return sorted(PYENV.glob("3.*/bin/python3.*[0-9]")) if PYENV.is_dir() else []


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")
@pytest.mark.parametrize("minor", sorted(pystacks.LAYOUTS))
def test_the_tables_are_the_interpreters_own_offsets(minor, tmp_path):
    name = f"{minor[0]}.{minor[1]}"
    found = sorted(PYENV.glob(f"{name}.*/include/python{name}"))
    if not found:
        pytest.skip(f"no pyenv CPython {name} headers")
    exe = tmp_path / "offsets"
    subprocess.run(["gcc", "-w", f"-I{found[-1]}", f"-I{found[-1]}/internal", str(OFFSETS_C), "-o", str(exe)],
                   check=True)
    got = dict(line.rsplit(" ", 1) for line in subprocess.run([str(exe)], check=True, capture_output=True,
                                                                 text=True).stdout.splitlines()[1:])
    o = pystacks.LAYOUTS[minor]
    if minor == (3, 10):  # PyFrameObject frames, the pthread id, no qualified name
        want = {
            "_PyRuntimeState.interpreters.head": o.interp_head, "PyInterpreterState.tstate_head": o.threads_head,
            "PyThreadState.next": o.ts_next, "PyThreadState.thread_id": o.ts_tid, "PyThreadState.frame": o.ts_frame,
            "PyFrameObject.f_back": o.fr_previous, "PyFrameObject.f_code": o.fr_code,
            "PyFrameObject.f_lasti": o.fr_instr, "PyCodeObject.co_filename": o.co_filename,
            "PyCodeObject.co_name": o.co_name, "PyCodeObject.co_firstlineno": o.co_firstlineno,
            "PyCodeObject.co_linetable": o.co_linetable, "PyASCIIObject": o.ascii_size,
            "PyCompactUnicodeObject": o.compact_size, "PyBytesObject.ob_sval": 32, "PyVarObject.ob_size": 16,
            "PyASCIIObject.state": 32, "PyASCIIObject.length": 16,
        }
        assert {k: int(got[k]) for k in want} == want
        assert o.frame_objects and o.co_qualname == o.co_name
        assert (o.cframe_frame, o.fr_owner, o.owner_cstack, o.co_code_adaptive) == (pystacks._NONE,) * 4
        return
    assert not o.frame_objects
    frame = "current_frame" if minor >= (3, 13) else "cframe"
    want = {
        "_PyRuntimeState.interpreters.head": o.interp_head, "PyInterpreterState.threads.head": o.threads_head,
        "PyThreadState.next": o.ts_next, "PyThreadState.native_thread_id": o.ts_tid,
        f"PyThreadState.{frame}": o.ts_frame, "_PyInterpreterFrame.previous": o.fr_previous,
        "_PyInterpreterFrame.f_executable" if minor >= (3, 13) else "_PyInterpreterFrame.f_code": o.fr_code,
        "_PyInterpreterFrame.instr_ptr" if minor >= (3, 13) else "_PyInterpreterFrame.prev_instr": o.fr_instr,
        "_PyInterpreterFrame.owner": o.fr_owner, "PyCodeObject.co_filename": o.co_filename,
        "PyCodeObject.co_qualname": o.co_qualname, "PyCodeObject.co_firstlineno": o.co_firstlineno,
        "PyCodeObject.co_linetable": o.co_linetable, "PyCodeObject.co_code_adaptive": o.co_code_adaptive,
        "PyASCIIObject": o.ascii_size, "PyCompactUnicodeObject": o.compact_size,
    }
    if minor < (3, 13):
        want["_PyCFrame.current_frame"] = o.cframe_frame
    assert {k: int(got[k]) for k in want} == want


def _locate_running(python: Path) -> pystacks.Interpreter | None:
    """:func:`pystacks.locate` on a live process of ``python`` (it waits on stdin meanwhile)."""
    proc = subprocess.Popen([str(python), "-c", "import sys; print('up', flush=True); sys.stdin.readline()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        return pystacks.locate(proc.pid)
    finally:
        proc.communicate("\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="reads /proc/PID/map_files (root)")
@pytest.mark.parametrize("python", _pythons(), ids=lambda p: p.name)
def test_locate_finds_each_interpreter_or_says_why_not(python):
    interp = _locate_running(python)
    minor = tuple(int(x) for x in python.name.removeprefix("python").split("."))
    assert interp is not None and interp.version[:2] == minor
    if minor in pystacks.LAYOUTS:
        assert not interp.problem and interp.runtime and interp.code_type and len(interp.pack()) == 56
        if minor == (3, 10):  # no Py_Version: the file's name says 3.10, not which 3.10
            assert interp.version == (3, 10) and interp.label == "CPython 3.10"
            assert interp.fsbase == pystacks.thread_pointer_offset() and interp.fsbase != pystacks._NONE
            assert struct.unpack_from("<I", interp.pack(), 52) == (interp.fsbase,)
        else:
            assert interp.fsbase == pystacks._NONE and interp.label == f"CPython {'.'.join(map(str, interp.version))}"
    else:
        assert interp.offsets is None and f"CPython {minor[0]}.{minor[1]}" in interp.problem


@pytest.mark.skipif(os.geteuid() != 0, reason="reads /proc/PID/map_files (root)")
def test_a_310_process_without_kernel_btf_is_said_unreadable_not_guessed(tmp_path, monkeypatch):
    found = sorted(PYENV.glob("3.10.*/bin/python3.10"))
    if not found:
        pytest.skip("no pyenv CPython 3.10")
    monkeypatch.setattr(pystacks, "KERNEL_BTF", tmp_path / "vmlinux")  # absent
    interp = _locate_running(found[-1])
    assert interp is not None and interp.offsets is None
    assert interp.problem == (f"CPython 3.10: its threads cannot be matched (pthread ids): no kernel BTF "
                              f"({tmp_path / 'vmlinux'}: No such file or directory)")
