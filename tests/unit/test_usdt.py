"""USDT notes and argument specs (memrec.probes.usdt): what is read exactly, what is refused."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from memrec.probes.cuda import torch_sites
from memrec.probes.usdt import ARG_CONST
from memrec.probes.usdt import ARG_DEREF
from memrec.probes.usdt import ARG_REG
from memrec.probes.usdt import UsdtArg
from memrec.probes.usdt import UsdtError
from memrec.probes.usdt import parse_arg
from memrec.probes.usdt import parse_args
from memrec.probes.usdt import read_probes



def test_pytorch_211_argument_forms():
    # malloc "-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)": pointer, device, size, stream
    assert parse_arg("-8@%rax") == UsdtArg(ARG_REG, 80, 0, 8, True)
    assert parse_arg("-1@%dl") == UsdtArg(ARG_REG, 96, 0, 1, True)  # low byte of rdx
    assert parse_arg("-8@%r14") == UsdtArg(ARG_REG, 8, 0, 8, True)
    assert parse_arg("-8@-56(%rbp)") == UsdtArg(ARG_DEREF, 32, -56, 8, True)
    assert parse_arg("-8@%rdi") == UsdtArg(ARG_REG, 112, 0, 8, True)


def test_other_forms_a_compiler_may_choose():
    assert parse_arg("4@%r8d") == UsdtArg(ARG_REG, 72, 0, 4, False)
    assert parse_arg("8@(%rsp)") == UsdtArg(ARG_DEREF, 152, 0, 8, False)
    assert parse_arg("2@0x10(%rbx)") == UsdtArg(ARG_DEREF, 40, 16, 2, False)
    assert parse_arg("-4@$-3") == UsdtArg(ARG_CONST, 0, -3, 4, True)


@pytest.mark.parametrize("spec", ["8@foo(%rip)", "8@%rip", "1@%ah", "8@(%rax,%rbx,8)", "3@%rax", "8@x0", "%rax",
                                  "8@$x"])
def test_forms_not_read_exactly_are_refused(spec):
    with pytest.raises(UsdtError):
        parse_arg(spec)


def test_the_packed_spec_cuts_to_the_size():
    # shift = 64 - 8 * size: what torch.bpf.c uses to cut and sign-extend
    assert UsdtArg(ARG_REG, 96, 0, 1, True).pack()[-8:] == (56).to_bytes(4, "little") + (1).to_bytes(4, "little")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to assemble the stub libc10_cuda.so")
def test_notes_of_the_stub_library(tmp_path):
    # GIVEN the stub libc10_cuda.so the BPF tests probe
    from memrec.validation.stubdriver.build import build_torch_stub

    lib = build_torch_stub(tmp_path)
    fd = os.open(lib, os.O_RDONLY)
    try:
        probes = read_probes(fd)
        # the file offsets agree with the symbols' (a nop inside each function)
        data = os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)
    # THEN malloc and two free sites, each semaphore in .probes, every argument read
    assert [(p.provider, p.name) for p in probes] == [("pytorch", "malloc"), ("pytorch", "free"), ("pytorch", "free")]
    assert all(data[p.offset] == 0x90 for p in probes), "each probe offset is the note's nop"
    assert probes[1].semaphore == probes[2].semaphore != probes[0].semaphore
    sites, problem = torch_sites(probes)
    assert problem == "" and len(sites) == 3


def test_a_build_without_free_is_not_half_attached():
    from memrec.probes.usdt import UsdtProbe

    malloc = UsdtProbe("pytorch", "malloc", 0x1000, 0x2000, "-8@%rax -1@%dl -8@%r14", (
        parse_arg("-8@%rax"), parse_arg("-1@%dl"), parse_arg("-8@%r14")))
    sites, problem = torch_sites([malloc])
    assert sites == [] and "no pytorch:free USDT probe" in problem
    odd = UsdtProbe("pytorch", "free", 0x1100, 0x2002, "8@foo(%rip)", None, "argument '8@foo(%rip)': ...")
    sites, problem = torch_sites([malloc, odd])
    assert sites == [] and problem.startswith("pytorch:free: argument")


def _probe(name: str, spec: str, offset: int):
    from memrec.probes.usdt import UsdtProbe

    return UsdtProbe("pytorch", name, offset, 0x9000 + (name == "malloc") * 2, spec, parse_args(spec))


# The notes of PyPI's cp311 x86-64 wheels (readelf -n torch/lib/libc10_cuda.so, 2026-12-02;
# docs/probes.md has the whole table).
WHEEL_NOTES = {
    "2.1.2": [("free", "-8@%rdi"), ("malloc", "-8@%r14 -4@%edi -8@%r13 -4@$0")],
    "2.2.2": [("free", "-8@%rdi"), ("free", "-8@%rdi"), ("malloc", "-8@%rax -4@%edx -8@%rbx -8@-56(%rbp)")],
    "2.7.1": [("free", "-8@%rdi"), ("free", "-8@%rdi"), ("malloc", "-8@%rax -1@%sil -8@%rbx -8@-56(%rbp)")],
    "2.14.1": [("free", "-8@%rdi"), ("free", "-8@%rdi"), ("malloc", "-8@%rbp -1@%al -8@%r12 -8@56(%rsp)"),
               ("malloc", "-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)")],
}


@pytest.mark.parametrize("release", ["2.2.2", "2.7.1", "2.14.1"])
def test_the_released_wheels_argument_forms_are_attached(release):
    probes = [_probe(name, spec, 0x1000 * i) for i, (name, spec) in enumerate(WHEEL_NOTES[release])]
    sites, problem = torch_sites(probes)
    assert problem == "" and len(sites) == len(probes)


def test_pytorch_21_whose_malloc_fires_before_the_allocation_is_refused():
    # PyTorch 2.1.2's malloc probe gives the address of a local variable (its stream: the constant 0)
    probes = [_probe(name, spec, 0x1000 * i) for i, (name, spec) in enumerate(WHEEL_NOTES["2.1.2"])]
    sites, problem = torch_sites(probes)
    assert sites == []
    assert problem == ("pytorch:malloc fires before the allocation in this build (PyTorch 2.1: its pointer is not "
                       "the block's; from 2.2 on it is): tensor blocks unavailable, driver segments only")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to assemble the stub libc10_cuda.so")
def test_doctor_says_which_pytorch_installs_give_tensor_blocks(tmp_path):
    # GIVEN an install with the probes and one without (a plain library of the same name)
    from memrec.commands.doctor import check_torch
    from memrec.validation.stubdriver.build import build_torch_stub

    good = build_torch_stub(tmp_path / "good")
    plain = tmp_path / "plain" / "libc10_cuda.so"
    plain.parent.mkdir()
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(plain), "-x", "c", "-"], input="int f(void){return 0;}\n",
                   text=True, check=True)
    # THEN each is named with what it gives: a warning for the build without them
    ok = check_torch([str(good)])
    assert ok.status == "ok" and f"{good} (3 probe sites)" in ok.detail
    warn = check_torch([str(good), str(plain)])
    assert warn.status == "warn" and f"{plain}: no pytorch:free/malloc USDT probe in this build" in warn.detail
