"""PyTorch's allocator probes with real uprobes: the stub libc10_cuda.so (memrec/validation/stubdriver/c10_cuda_stub.S) has
pytorch:malloc/free USDT probes with PyTorch 2.11's argument forms behind semaphores; processes
running before the attach get events, two at once, and a build without probes says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from memrec.terms.events import Api
from memrec.terms.events import Kind

pytestmark = pytest.mark.bpf

WORKER = Path(__file__).with_name("torch_worker.py")


class Worker:
    """tests/bpf/torch_worker.py in a subprocess, one command at a time."""

    def __init__(self, stub_lib: Path, torch_lib: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKER), str(stub_lib), str(torch_lib)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.ask_line() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask_line(self):
        line = self.proc.stdout.readline()
        assert line, f"worker {self.proc.pid} died (exit {self.proc.poll()})"
        return json.loads(line)

    def ask(self, *words: object):
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        return self.ask_line()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


def drain_until(probes, pids: set[int], n: int, timeout: float = 10.0) -> np.ndarray:
    """Tensor events of ``pids`` until ``n`` came (or the timeout)."""
    got = []
    deadline = time.monotonic() + timeout
    total = 0
    while time.monotonic() < deadline:
        ev = probes.poll()
        ev = ev[np.isin(ev["pid"], list(pids)) & np.isin(ev["kind"], [int(Kind.TENSOR_ALLOC), int(Kind.TENSOR_FREE)])]
        got.append(ev)
        total += len(ev)
        if total >= n:
            break
        time.sleep(0.05)
    return np.concatenate(got) if got else np.zeros(0)


@pytest.fixture(scope="module")
def probes():
    """Host-wide probes with the tensor probes loaded (attached per test)."""
    from memrec.probes.cuda import CudaProbes

    p = CudaProbes(tensors=True).load()
    yield p
    p.close()


def test_processes_running_before_the_attach_get_exact_tensor_events(probes, stub_lib, torch_stub):
    a, b = Worker(stub_lib, torch_stub), Worker(stub_lib, torch_stub)
    try:
        assert a.ask("sem") == [0, 0]  # nothing raised the semaphores yet: the probes are off
        a.ask("malloc", 0x7000, 0, 512, 0)  # not seen: before the attach
        report = probes.attach_torch(torch_stub)
        assert report.problem == "" and sorted(report.attached) == ["free", "free", "malloc"]
        # The kernel raised each semaphore in the processes already running (free: two sites).
        assert a.ask("sem") == [1, 2] and b.ask("sem") == [1, 2]
        probes.poll()
        a.ask("malloc", 0x7F0000001000, 3, 123456789, 0xDEAD)
        b.ask("malloc", 0x7F0000002000, 255, 1 << 40, 0)  # -1@%dl: device 255 reads as -1 (signed byte)
        a.ask("free", 0x7F0000001000)
        b.ask("free2", 0x7F0000002000)
        ev = drain_until(probes, {a.pid, b.pid}, 4)
        rows = sorted((int(e["pid"]), int(e["kind"]), int(e["api"]), int(e["ptr"]), int(e["ordinal"]), int(e["size"]),
                       int(e["handle"])) for e in ev)
        TA, TF, M, F = int(Kind.TENSOR_ALLOC), int(Kind.TENSOR_FREE), int(Api.torch_malloc), int(Api.torch_free)
        assert rows == sorted([
            (a.pid, TA, M, 0x7F0000001000, 3, 123456789, 0xDEAD),
            (a.pid, TF, F, 0x7F0000001000, -1, 0, 0),
            (b.pid, TA, M, 0x7F0000002000, -1, 1 << 40, 0),
            (b.pid, TF, F, 0x7F0000002000, -1, 0, 0),
        ])
        # Many at once, from both processes: every one arrives, none twice.
        n = 5000
        a.ask("loop", 0x10000000, n, 1024)
        b.ask("loop", 0x20000000, n, 2048)
        ev = drain_until(probes, {a.pid, b.pid}, 4 * n)
        for w, base, size in ((a, 0x10000000, 1024), (b, 0x20000000, 2048)):
            mine = ev[ev["pid"] == w.pid]
            allocs = mine[mine["kind"] == int(Kind.TENSOR_ALLOC)]
            frees = mine[mine["kind"] == int(Kind.TENSOR_FREE)]
            assert sorted(allocs["ptr"].tolist()) == [base + i * size for i in range(n)]
            assert set(allocs["size"].tolist()) == {size}
            assert sorted(frees["ptr"].tolist()) == [base + i * size for i in range(n)]
        assert probes.attach_torch(torch_stub).already_attached
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("links", [True, False], ids=["multi-uprobe links", "perf events"])
def test_tensors_pid_puts_the_probes_in_the_named_process_only(stub_lib, tmp_path, monkeypatch, links):
    from memrec.probes import bpfsys
    from memrec.probes.cuda import CudaProbes
    from memrec.validation.stubdriver.build import build_torch_stub

    if links and not bpfsys.uprobe_multi_supported():
        pytest.skip(f"kernel {os.uname().release} has no multi-uprobe links (6.6)")
    monkeypatch.setattr(bpfsys, "uprobe_multi_supported", lambda release=None: links)
    # An inode of its own, under a name other daemons on this host (other tests' `--tensors`,
    # which probe every libc10_cuda* mapped) do not look for: nothing else raises its semaphores.
    lib = build_torch_stub(tmp_path).rename(tmp_path / "libpid_scoped_stub.so")
    named, other = Worker(stub_lib, lib), Worker(stub_lib, lib)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    p = CudaProbes(probe_cache=str(tmp_path), tensors=True).load()
    try:
        # WHEN the probes are attached for one running process (and one that has exited)
        report = p.attach_torch(lib, pids=(named.pid, gone.pid))
        assert report.problem == "" and report.pids == (named.pid,)
        # THEN only that process has its semaphores raised; the other skips the sites, no trap
        assert named.ask("sem") == [1, 2] and other.ask("sem") == [0, 0]
        n = 2000
        named.ask("loop", 0x10000000, n, 4096)
        other.ask("loop", 0x20000000, n, 4096)
        ev = drain_until(p, {named.pid, other.pid}, 2 * n)
        time.sleep(0.2)
        ev = np.concatenate([ev, drain_until(p, {named.pid, other.pid}, 1, timeout=0.2)])
        assert len(ev) == 2 * n and set(ev["pid"].tolist()) == {named.pid}
        # A process started after the attach maps the file and is not probed either
        late = Worker(stub_lib, lib)
        try:
            assert late.ask("sem") == [0, 0]
        finally:
            late.close()
    finally:
        p.close()
        sem_after = named.ask("sem")
        named.close()
        other.close()
    # AND once detached, the named process's semaphores are back to 0
    assert sem_after == [0, 0]


def test_daemon_tensors_pid_records_the_named_process_only(stub_lib, tmp_path):
    from memrec.validation.stubdriver.build import build_torch_stub
    from memrec.trace.reader import load_trace

    from test_daemon import DaemonProcess

    lib = build_torch_stub(tmp_path / "torch")  # libc10_cuda.so: the daemon finds it in /proc/PID/maps
    named, other = Worker(stub_lib, lib), Worker(stub_lib, lib)
    d = DaemonProcess(tmp_path, stub_lib, args=("--tensors-pid", str(named.pid)))
    try:
        d.wait_ready()
        assert named.ask("sem") == [1, 2]
        for w, base in ((named, 0x10000000), (other, 0x20000000)):
            w.ask("loop", base, 100, 4096)
        time.sleep(0.5)
        assert d.stop() == 0
    finally:
        named.close()
        other.close()
        d.kill()
    trace = load_trace(d.output)
    (entry,) = [t for t in trace.header["probes"]["torch"] if t["path"] == str(lib)]
    assert entry["pids"] == [named.pid] and entry["problem"] == ""
    assert trace.header["config"]["tensor_pids"] == [named.pid]
    ev = trace.events[np.isin(trace.events["kind"], [int(Kind.TENSOR_ALLOC), int(Kind.TENSOR_FREE)])]
    assert len(ev) == 200 and set(ev["pid"].tolist()) == {named.pid}


def test_tensors_pid_of_processes_all_gone_is_said(probes, tmp_path):
    from memrec.validation.stubdriver.build import build_torch_stub

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    report = probes.attach_torch(build_torch_stub(tmp_path), pids=(gone.pid,))
    assert report.attached == () and report.problem == f"none of the processes {gone.pid} runs any more"


def test_a_build_without_the_probes_is_said_and_not_attached(probes, plain_torch_stub):
    report = probes.attach_torch(plain_torch_stub)
    assert report.attached == ()
    assert "no pytorch:free/malloc USDT probe in this build" in report.problem


MAPPER = "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print('mapped', flush=True); sys.stdin.read()"


def test_daemon_says_in_the_trace_that_a_build_without_the_probes_gives_segments_only(stub_lib, plain_torch_stub,
                                                                                       tmp_path):
    from memrec.analysis.report.build import build_report
    from memrec.analysis.report.text import render_text
    from memrec.trace.reader import load_trace

    from test_daemon import DaemonProcess

    # GIVEN a process that maps a libc10_cuda.so without the USDT notes (a build without TORCH_SDT)
    proc = subprocess.Popen([sys.executable, "-c", MAPPER, str(plain_torch_stub)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    d = None
    try:
        assert proc.stdout.readline().strip() == "mapped"
        # WHEN the daemon records with --tensors
        d = DaemonProcess(tmp_path, stub_lib, args=("--tensors",))
        d.wait_ready()
        assert d.stop() == 0
    finally:
        proc.stdin.close()
        proc.wait(30)
        if d is not None:
            d.kill()
    # THEN the trace names the file, attaches nothing to it and says why, and the report says it
    trace = load_trace(d.output)
    (lib,) = [lib for lib in trace.header["probes"]["torch"] if lib["path"] == str(plain_torch_stub)]
    assert lib["attached"] == []
    assert lib["problem"] == ("no pytorch:free/malloc USDT probe in this build (PyTorch before 2.1, or built "
                              "without TORCH_SDT): tensor blocks unavailable, driver segments only")
    text = render_text(build_report(trace), width=300)
    assert f"!  {plain_torch_stub}: no pytorch:free/malloc USDT probe in this build" in text
    assert "no tensor events: driver segments only" in text


def test_the_program_without_tensors_is_the_driver_program_alone(stub_lib, torch_stub):
    # GIVEN the probes as the daemon loads them without --tensors
    from memrec.base.errors import ProbeError
    from memrec.probes.cuda import CudaProbes
    from memrec.probes.cuda import program_source

    assert "usdt_torch" not in program_source() and "usdt_torch" in program_source(tensors=True)
    p = CudaProbes().load()
    try:
        # THEN nothing of PyTorch's can be attached
        with pytest.raises(ProbeError, match="tensor probes are not loaded"):
            p.attach_torch(torch_stub)
    finally:
        p.close()


def test_daemon_tensors_finds_running_pytorch_and_reports_blocks(stub_lib, torch_stub, tmp_path):
    from memrec.analysis.report.build import build_report
    from memrec.analysis.report.text import render_text
    from memrec.trace.reader import load_trace

    from test_daemon import DaemonProcess

    early = Worker(stub_lib, torch_stub)  # maps libc10_cuda.so before the daemon starts
    d = DaemonProcess(tmp_path, stub_lib, args=("--tensors",))
    try:
        d.wait_ready()
        assert early.ask("sem") == [1, 2]  # found in /proc/PID/maps at start, semaphores raised
        seg = early.ask("segment", 4 << 20)
        for i in range(3):
            early.ask("malloc", seg + i * (1 << 20), 0, 1 << 20, 0)
        early.ask("free", seg + (1 << 20))
        assert early.ask("oom") == 0
        early.close()
        time.sleep(0.5)
        assert d.stop() == 0
    finally:
        early.close()
        d.kill()
    trace = load_trace(d.output)
    # (other processes on the host may map other libc10_cuda.so files: other tests' stubs)
    assert str(torch_stub) in [lib["path"] for lib in trace.header["probes"]["torch"]]
    report = build_report(trace)
    sec = report.tensors.to_json()
    assert sec["events"] == 4 and sec["unjoined_blocks"] == 0
    (row,) = [r for r in sec["rows"] if r["pid"] == early.pid]
    assert row["peak_allocated"] == 3 << 20 and row["peak_reserved"] == 4 << 20
    (failure,) = [f for f in sec["failures"] if f["pid"] == early.pid]
    # At the failed segment allocation: 2 blocks of 1 MiB alive in the 4 MiB segment, 2 MiB free
    # of which the largest stretch is 1 MiB (the freed middle block; the tail is 1 MiB too).
    assert failure["state"] == {"allocated": 2 << 20, "reserved": 4 << 20, "free": 2 << 20,
                                "largest_free": 1 << 20, "blocks": 2, "segments": 1}
    assert sorted(b["ptr"] for b in failure["largest"]) == [seg, seg + (2 << 20)]
    assert all(b["segment"] == seg for b in failure["largest"])
    text = render_text(report, width=120)
    assert "tensor blocks (PyTorch caching allocator)" in text and "failed segment allocation" in text


@pytest.mark.parametrize("links", [True, False], ids=["multi-uprobe links", "perf events"])
def test_both_ways_of_attaching_raise_the_semaphores_and_decode(stub_lib, torch_stub, tmp_path, monkeypatch, links):
    # GIVEN the tensor probes attached as multi-uprobe links (ref_ctr_offsets, cookies) or, as on
    # kernels before 6.6, as perf events (ref_ctr_offset in config bits 32-63, the cookie on a
    # BPF perf link)
    from memrec.probes import bpfsys
    from memrec.probes.cuda import CudaProbes

    if links and not bpfsys.uprobe_multi_supported():
        pytest.skip(f"kernel {os.uname().release} has no multi-uprobe links (6.6)")
    monkeypatch.setattr(bpfsys, "uprobe_multi_supported", lambda release=None: links)
    w = Worker(stub_lib, torch_stub)
    before = w.ask("sem")  # other probes of this session may hold them up already
    p = CudaProbes(probe_cache=str(tmp_path), tensors=True).load()
    try:
        assert p.attach_torch(torch_stub).problem == ""
        # THEN the running process's semaphores are raised (once per probe site: another
        # program's probe at the same site shares the kernel's uprobe and its count), and the
        # events read exactly
        assert w.ask("sem") == [1, 2]
        w.ask("malloc", 0x7F0000004000, 2, 4096, 0xBEEF)
        w.ask("free2", 0x7F0000004000)
        ev = drain_until(p, {w.pid}, 2)
        got = sorted((int(e["kind"]), int(e["ptr"]), int(e["ordinal"]), int(e["size"]), int(e["handle"])) for e in ev)
        assert got == [(int(Kind.TENSOR_ALLOC), 0x7F0000004000, 2, 4096, 0xBEEF),
                       (int(Kind.TENSOR_FREE), 0x7F0000004000, -1, 0, 0)]
    finally:
        p.close()
        sem_after = w.ask("sem")
        w.close()
    # AND detaching lowered them again
    assert sem_after == before


RECORDED = """
import ctypes, sys, time
from memrec.validation.stubdriver.driver import Driver, Facts
torch = ctypes.CDLL(sys.argv[2])  # as `import torch` maps libc10_cuda.so, before any context
torch.stub_torch_malloc.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64]
torch.stub_torch_free.argtypes = [ctypes.c_uint64]
drv = Driver(sys.argv[1], Facts())
drv.init()
drv.use_device(0)  # the context: the recorder looks for PyTorch now
deadline = time.monotonic() + 60  # a loaded host: the daemon reads every /proc/PID/maps first
while torch.stub_semaphore(0) == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
seg = drv.alloc(8 << 20)
for i in range(4):
    torch.stub_torch_malloc(seg + i * (1 << 20), 0, 1 << 20, 0)
torch.stub_torch_free(seg)
"""


def test_memrec_record_tensors_probes_the_commands_pytorch(stub_lib, tmp_path):
    from memrec.analysis.report.build import build_report
    from memrec.validation.stubdriver.build import build_torch_stub
    from memrec.trace.reader import load_trace

    # A copy of its own: the session's other probes on the shared stub would raise its semaphores
    # already, and the command would not wait for the recorder's.
    torch_stub = build_torch_stub(tmp_path / "own")

    script = tmp_path / "recorded.py"
    script.write_text(RECORDED)
    out = tmp_path / "rec.mrec"
    proc = subprocess.run([sys.executable, "-m", "memrec", "record", "--tensors", "--libcuda", str(stub_lib), "-o",
                           str(out), "--", sys.executable, str(script), str(stub_lib), str(torch_stub)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # THEN the child's install was probed at its first context and its blocks are in the trace
    sec = build_report(load_trace(out)).tensors.to_json()
    assert [lib["path"] for lib in sec["libraries"]] == [str(torch_stub)]
    assert sec["events"] == 5 and sec["unjoined_blocks"] == 0
    (row,) = sec["rows"]
    assert (row["peak_allocated"], row["peak_reserved"], row["last"]["allocated"]) == (4 << 20, 8 << 20, 3 << 20)
