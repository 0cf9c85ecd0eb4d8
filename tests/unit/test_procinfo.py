"""/proc reading and the device ordinal → physical GPU map."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from memrec.terms.events import GpuInfo
from memrec.probes import procinfo
from memrec.probes.procinfo import gpu_map

UUIDS = [
    "GPU-1a2b3c4d-0000-1111-2222-333344445555",
    "GPU-1a2bffff-0000-1111-2222-333344445555",
    "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff",
    "GPU-55555555-aaaa-bbbb-cccc-ddddeeeeffff",
]
GPUS = [GpuInfo(index=i, uuid=u, name="NVIDIA H200", total=141 << 30) for i, u in enumerate(UUIDS)]


@pytest.mark.parametrize(
    "cvd, expected",
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("2", [2]),
        ("3,1", [3, 1]),
        (" 1 , 2 ", [1, 2]),
        ("0,7,1", [0]),  # 7 does not exist: CUDA stops there
        ("1,-1,2", [1]),  # -1 hides the rest
        ("-1", []),
        ("1,1,2", [1]),  # a repeated device ends the list
        ("1,abc,2", [1]),
        ("GPU-9f8e", [2]),  # a unique UUID prefix
        ("GPU-9F8E7D6C-AAAA-BBBB-CCCC-DDDDEEEEFFFF", [2]),
        ("GPU-1a2b,0", []),  # ambiguous prefix: invalid
        ("GPU-1a2b3,2,GPU-5555", [0, 2, 3]),
        ("2,GPU-deadbeef", [2]),  # unknown UUID
        ("1,", [1]),
    ],
)
def test_gpu_map_follows_cuda(cvd, expected):
    # GIVEN four GPUs WHEN a process has this CUDA_VISIBLE_DEVICES THEN ordinals map like CUDA's
    assert gpu_map(cvd, GPUS) == expected


def test_mig_entries_are_unsupported_and_logged(caplog):
    # GIVEN a MIG device in the list
    with caplog.at_level(logging.WARNING, logger="memrec.probes.procinfo"):
        result = gpu_map("1,MIG-4f0a3d2e-1111-2222-3333-444455556666,2", GPUS)
    # THEN the list ends at it, and the log says MIG is not supported
    assert result == [1]
    assert "MIG devices are not supported" in caplog.text


@pytest.mark.parametrize(
    "cvd, expected",
    [
        (None, []),  # unknown: nobody can say how many GPUs there are
        ("5,3", [5, 3]),  # integers are taken as physical indices
        ("5,GPU-1a2b", [5]),  # UUIDs cannot be resolved without NVML
        ("2,2", [2]),
    ],
)
def test_gpu_map_without_nvml(cvd, expected):
    assert gpu_map(cvd, []) == expected


def test_read_a_live_process():
    # GIVEN a child with a known argv and environment
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="3,1", CUDA_DEVICE_ORDER="PCI_BUS_ID", RANK="2", SECRET="x")
    code = "import sys; print('up', flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code, "arg with space"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        assert child.stdout.readline() == b"up\n"  # exec is complete (argv is set up)
        # WHEN /proc is read
        read = procinfo.read_proc(child.pid)
        info = procinfo.process_info(child.pid, GPUS, first_ts=123)
    finally:
        child.stdin.close()
        child.wait()
    # THEN argv, exe, parent and the CUDA variables are there, and nothing else of the environment
    assert read.cmdline == [sys.executable, "-c", code, "arg with space"]
    assert read.exe == os.path.realpath(sys.executable)
    assert read.ppid == os.getpid()
    assert read.cuda_visible_devices == "3,1" and read.cuda_device_order == "PCI_BUS_ID"
    assert "SECRET" not in read.env
    assert info.gpu_map == [3, 1] and info.first_ts == 123 and info.rank == {"rank": 2}


def test_a_gone_process_gives_what_it_can():
    # GIVEN a process that has exited and been reaped
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    # WHEN it is read THEN nothing raises and every field is empty
    read = procinfo.read_proc(child.pid)
    assert read == procinfo.ProcRead(pid=child.pid)
    info = procinfo.process_info(child.pid, GPUS, first_ts=1)
    assert info.cmdline == [] and info.exe is None and info.cuda_visible_devices is None
    assert info.gpu_map == [0, 1, 2, 3]  # unset: every GPU, as CUDA would have seen


def test_ppid_with_odd_comm(tmp_path):
    # GIVEN a stat line whose comm holds spaces and parentheses
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text("42 (a) b (c)) S 17 42 42 0 -1 4194560 0 0\n")
    # THEN the ppid is found after the last ')'
    assert procinfo.read_ppid(42, tmp_path) == 17


def test_zombie_or_kernel_thread_cmdline(tmp_path):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cmdline").write_bytes(b"")
    assert procinfo.read_cmdline(7, tmp_path) == []


def test_checked_gpu_map_corrects_only_contradicted_maps():
    from memrec.probes.procinfo import checked_gpu_map

    # ordinal 0 mapped to GPU 0 by the start-up environment, but NVML lists the process on GPU 1
    assert checked_gpu_map([0, 1], {0}, {1}) == [1]
    # consistent maps stay (None), including a remapped worker NVML agrees with
    assert checked_gpu_map([1, 0], {0, 1}, {0, 1}) is None
    assert checked_gpu_map([3], {0}, {3}) is None
    # nothing to go on, or more ordinals used than GPUs listed: no correction
    assert checked_gpu_map([0, 1], {0}, set()) is None
    assert checked_gpu_map([0, 1], set(), {1}) is None
    assert checked_gpu_map([0, 1], {0, 1}, {1}) is None
    # two ordinals on GPUs 2 and 3 while the environ map said 0 and 1: bus order
    assert checked_gpu_map([0, 1, 2, 3], {0, 1}, {2, 3}) == [2, 3]
