"""The daemon as a process: real probes on the stub driver, a marker from ``memrec mark``,
SIGINT and SIGHUP, and the trace files it leaves (root; skipped with the reason otherwise)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from memrec.terms import protocol
from memrec.terms.events import Kind
from memrec.trace.reader import load_trace

pytestmark = pytest.mark.bpf

START_TIMEOUT = 120  # bcc compiles the program at start: tens of seconds on a slow VM
#: The daemon's unit allows 180 s to stop (TimeoutStopSec): detaching waits out RCU grace periods.
STOP_TIMEOUT = 180


@pytest.fixture
def workdir():
    d = Path(tempfile.mkdtemp(prefix="mrb", dir="/tmp"))  # short: sun_path holds 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


class DaemonProcess:
    """``memrec daemon`` in a subprocess on a private socket and output."""

    def __init__(self, workdir: Path, stub_lib: Path, output: str = "out.mrec", args: tuple[str, ...] = (),
                 prefix: tuple[str, ...] = ()) -> None:
        self.socket = workdir / "d.sock"
        self.output = workdir / output
        self.log_path = workdir / f"{Path(output).stem}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "memrec", "daemon", "-o", str(self.output), "--socket", str(self.socket),
             "--libcuda", str(stub_lib), "--rotate-size", "0", *args],
            stdout=self._log, stderr=subprocess.STDOUT, cwd="/",
        )

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def wait_ready(self) -> dict:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the daemon exited {self.proc.returncode} at start:\n{self.log()}")
            try:
                return protocol.ping(self.socket, timeout=1.0)
            except OSError:
                time.sleep(0.2)
        pytest.fail(f"the daemon did not answer within {START_TIMEOUT} s:\n{self.log()}")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGINT, then wait for the exit. The trace is complete within milliseconds; the exit waits
        for the probes' detach, which the kernel serialises host-wide (RCU grace periods under one
        mutex): on a host where other sessions attach and detach probes too it took 20-49 s."""
        self.signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the daemon did not exit within {timeout} s of SIGINT:\n{self.log()}")
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def daemon_factory(workdir, stub_lib):
    started: list[DaemonProcess] = []

    def start(**kwargs) -> DaemonProcess:
        d = DaemonProcess(workdir, stub_lib, **kwargs)
        started.append(d)
        d.wait_ready()
        return d

    yield start
    for d in started:
        d.kill()


def run_workload(stub_lib: Path, *scenarios: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "memrec.validation.stubdriver.workload", "--lib", str(stub_lib), "--facts", *scenarios],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def facts_of(facts: dict, api: str) -> list[dict]:
    return [c for c in facts["calls"] if c["api"] == api]


def wait_for_events(path: Path, pids: set[int], timeout: float = 10) -> None:
    """Until the file (flushed every 0.2 s) holds an exit event of every pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ev = load_trace(path).events
        except Exception:
            ev = None
        if ev is not None and pids <= set(ev["pid"][ev["kind"] == int(Kind.PROC_EXIT)].tolist()):
            return
        time.sleep(0.1)


#: A worker that stays alive until told: the daemon reads /proc when it first sees a pid, so
#: (unlike the workload's short-lived children) its CUDA_VISIBLE_DEVICES is certain to be read.
WORKER = """
import json, sys
from memrec.validation.stubdriver.driver import Driver, Facts
facts = Facts()
drv = Driver(sys.argv[1], facts)
drv.init()
for ordinal in (0, 1):
    drv.use_device(ordinal)
    drv.alloc(5 * 1024 * 1024 + ordinal)
print(json.dumps(facts.calls), flush=True)
sys.stdin.readline()
"""


def test_daemon_records_a_workload_and_a_marker_then_stops_cleanly(daemon_factory, stub_lib):
    # GIVEN a daemon probing the stub driver
    d = daemon_factory()
    # WHEN a workload runs, a worker with CUDA_VISIBLE_DEVICES=1,0 allocates on its ordinals 0 and 1,
    # and a shell script marks
    facts = run_workload(stub_lib, "basic")
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(stub_lib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES="1,0"),
    )
    worker_calls = json.loads(worker.stdout.readline())
    mark = subprocess.Popen(
        [sys.executable, "-m", "memrec", "mark", "after-workload", "--socket", str(d.socket), "--scope", "shell",
         "tokens=42", "ok=true"],
        stderr=subprocess.PIPE, text=True,
    )
    assert mark.wait(30) == 0, mark.stderr.read()
    time.sleep(0.5)  # the daemon sees the worker's first events (and reads its /proc) while it lives
    worker.stdin.write("\n")
    worker.stdin.close()
    assert worker.wait(30) == 0
    wait_for_events(d.output, {facts["pid"], worker.pid})
    # AND the daemon gets SIGINT
    rc = d.stop()
    # THEN it exits 0, removes its socket, and the file ends with a trailer
    log = d.log()
    assert rc == 0, log
    assert not d.socket.exists()
    trace = load_trace(d.output)
    assert trace.trailer is not None and trace.warnings == [], log
    assert trace.trailer["reason"] == "signal SIGINT"
    ev = trace.events
    # AND every allocation of the workload is there, with its size and result, on its GPU
    allocs = facts_of(facts, "cuMemAlloc_v2")
    assert len(allocs) >= 4
    for fact in allocs:
        rows = ev[(ev["pid"] == fact["pid"]) & (ev["api"] == 1) & (ev["size"] == fact["args"]["bytesize"])
                  & (ev["result"] == fact["result"])]
        assert len(rows) == 1, f"not recorded once: {fact}"
        if fact["result"] == 0:
            assert rows["gpu"][0] == fact["physical"] == 0
    # AND the worker's ordinal 0 is physical GPU 1 and its ordinal 1 is GPU 0, as its driver says
    for fact in worker_calls:
        if fact["api"] != "cuMemAlloc_v2":
            continue
        (row,) = ev[(ev["pid"] == worker.pid) & (ev["size"] == fact["args"]["bytesize"])]
        assert row["ordinal"] == fact["ordinal"] and row["gpu"] == fact["physical"] == 1 - fact["ordinal"]
    assert trace.processes[worker.pid].cuda_visible_devices == "1,0"
    assert trace.processes[worker.pid].gpu_map == [1, 0]
    # AND the process exits were recorded
    exits = set(ev["pid"][ev["kind"] == int(Kind.PROC_EXIT)].tolist())
    assert {facts["pid"], worker.pid} <= exits
    # AND the marker, about the program that ran `memrec mark` (this test: --scope shell), with its values
    (marker,) = [m for m in trace.markers if m.name == "after-workload"]
    assert marker.values == {"tokens": 42, "ok": True} and marker.uid == os.getuid()
    assert marker.pid == os.getpid() != mark.pid and marker.pid in trace.processes
    # AND the header says what was probed
    assert trace.header["probes"]["attached"] > 0
    assert str(stub_lib) in [lib["path"] for lib in trace.header["probes"]["libraries"]]


def sighup(d: DaemonProcess) -> Path:
    """SIGHUP the daemon (recording into ``out.mrec``) and wait for its second file: that file."""
    d.signal(signal.SIGHUP)
    second_file = d.output.with_name("out.1.mrec")
    deadline = time.monotonic() + 10
    while not second_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert second_file.exists(), d.log()
    return second_file


def workloads_around_sighup(d: DaemonProcess, stub_lib: Path) -> tuple[dict, dict, Path]:
    """A workload recorded, SIGHUP, another workload recorded in the second file: both workloads'
    facts and that file."""
    first = run_workload(stub_lib, "basic")
    wait_for_events(d.output, {first["pid"]})
    second_file = sighup(d)
    second = run_workload(stub_lib, "basic")
    wait_for_events(second_file, {second["pid"]})
    return first, second, second_file


def test_sighup_rotates_into_two_readable_files(daemon_factory, stub_lib):
    # GIVEN a daemon, and a first workload recorded
    d = daemon_factory()
    # WHEN SIGHUP comes, then a second workload runs
    first, second, second_file = workloads_around_sighup(d, stub_lib)
    assert d.stop() == 0, d.log()
    # THEN two files, each whole: header, keyframe at 0, trailer; each workload in its own file
    a, b = load_trace(d.output), load_trace(second_file)
    for t in (a, b):
        assert t.trailer is not None and t.warnings == [] and t.keyframes[0].event_index == 0
    assert a.trailer["reason"] == "rotate: SIGHUP" and a.trailer["next_file"] == str(second_file)
    assert b.header["previous"] == str(d.output)
    assert first["pid"] in set(a.events["pid"].tolist()) and first["pid"] not in set(b.events["pid"].tolist())
    assert second["pid"] in set(b.events["pid"].tolist()) and second["pid"] not in set(a.events["pid"].tolist())


def test_sigterm_leaves_a_complete_trace_while_the_probes_still_detach(daemon_factory, stub_lib):
    # GIVEN a daemon with a workload recorded (every probe on the stub attached)
    d = daemon_factory()
    facts = run_workload(stub_lib, "basic")
    wait_for_events(d.output, {facts["pid"]})
    # WHEN SIGTERM comes
    d.signal(signal.SIGTERM)
    complete_while_running = None
    while d.proc.poll() is None:
        with contextlib.suppress(Exception):  # the file is being written
            trace = load_trace(d.output)
            if trace.trailer is not None:
                complete_while_running = d.proc.poll() is None
                break
        time.sleep(0.01)
    assert d.proc.wait(STOP_TIMEOUT) == 0, d.log()
    # THEN the file was whole (trailer, no warnings) while the daemon was still detaching its probes
    assert complete_while_running, d.log()
    trace = load_trace(d.output)
    assert trace.trailer["reason"] == "signal SIGTERM" and trace.warnings == []
    assert facts["pid"] in set(trace.events["pid"].tolist())
    log = d.log()
    assert log.index("detaching the probes") < log.index("probes detached in")


def test_memrec_mark_without_daemon_fails_clearly(workdir):
    # GIVEN no daemon WHEN memrec mark is used THEN one line, exit code 69
    proc = subprocess.run(
        [sys.executable, "-m", "memrec", "mark", "x", "--socket", str(workdir / "none.sock")],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 69
    assert proc.stderr.strip().startswith("memrec: error: no memrec daemon")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_dataset_gets_each_closed_file_of_a_rotating_daemon(daemon_factory, stub_lib, workdir):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed (memrec[sql])")
    # GIVEN a daemon writing the dataset, and a workload recorded in each of two parts
    dataset = workdir / "ds"
    d = daemon_factory(args=("--dataset", str(dataset)))
    first, second, second_file = workloads_around_sighup(d, stub_lib)
    # WHEN it stops (the last file's export is waited for)
    assert d.stop() == 0, d.log()
    # THEN each file is one part of one recording in the dataset, with every event it holds
    traces = pq.ParquetDataset(dataset / "traces", partitioning="hive").read().to_pylist()
    assert sorted(t["part"] for t in traces) == [0, 1], d.log()
    assert len({t["trace_id"] for t in traces}) == 1
    by_part = {t["part"]: t for t in traces}
    for part, path in ((0, d.output), (1, second_file)):
        trace = load_trace(path)
        assert by_part[part]["events"] == trace.n_events and by_part[part]["complete"]
    events = pq.ParquetDataset(dataset / "events", partitioning="hive").read()
    assert first["pid"] in set(events["pid"].to_pylist()) and second["pid"] in set(events["pid"].to_pylist())
    assert "dataset: cannot export" not in d.log()
