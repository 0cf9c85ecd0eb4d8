"""The symboliser's parts against the real interpreters: the line table decoder against CPython's
own ``co_lines``, the offset tables against ``offsetof`` over pyenv's internal headers, and
:func:`locate` on live processes of each pyenv CPython (supported, and said to be unsupported)."""

from __future__ import annotations

import dis
import os
import shutil
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


@pytest.mark.skipif(os.geteuid() != 0, reason="reads /proc/PID/map_files (root)")
@pytest.mark.parametrize("python", _pythons(), ids=lambda p: p.name)
def test_locate_finds_each_interpreter_or_says_why_not(python):
    proc = subprocess.Popen([str(python), "-c", "import sys; print('up', flush=True); sys.stdin.readline()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        interp = pystacks.locate(proc.pid)
    finally:
        proc.communicate("\n")
    minor = tuple(int(x) for x in python.name.removeprefix("python").split("."))
    assert interp is not None and interp.version[:2] == minor
    if minor in pystacks.LAYOUTS:
        assert not interp.problem and interp.runtime and interp.code_type and len(interp.pack()) == 56
    else:
        assert interp.offsets is None and f"CPython {minor[0]}.{minor[1]}" in interp.problem
