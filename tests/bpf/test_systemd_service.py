"""The daemon as systemd runs it: started from contrib/systemd/memrec.service's command line with
a real notify socket, scraped by a real Prometheus server, killed and restarted by the unit's
restart policy (root and the stub driver; skipped with the reason otherwise).

systemd is not PID 1 on the hosts these tests run on, so ``unit_runner`` plays its part, from the
unit file (see that module for exactly what it does and does not emulate).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from memrec.daemon.caps import KEEP
from memrec.trace.reader import load_trace
from tests.bpf.test_daemon import workdir  # noqa: F401 (a fixture)
from tests.bpf.unit_runner import UnitRunner

pytestmark = pytest.mark.bpf

UNIT = Path(__file__).resolve().parents[2] / "contrib" / "systemd" / "memrec.service"
START_TIMEOUT = 120  # bcc compiles the program at start

#: Holds device memory on two ordinals until told to exit; prints the driver calls it made.
WORKER = """
import json, sys
from memrec.validation.stubdriver.workload import Driver, Facts
facts = Facts()
drv = Driver(sys.argv[1], facts)
drv.init()
for ordinal, size in ((0, 7 << 20), (1, (3 << 20) + 4096)):
    drv.use_device(ordinal)
    drv.alloc(size)
print(json.dumps(facts.calls), flush=True)
sys.stdin.readline()
"""


#: Maps the driver, then at each line takes 5 MiB more on ordinal 0; exits at the end of input.
LATE_WORKER = """
import sys
from memrec.validation.stubdriver.workload import Driver, Facts
drv = Driver(sys.argv[1], Facts())
drv.init()
print("mapped", flush=True)
for _ in sys.stdin:
    drv.use_device(0)
    drv.alloc(5 << 20)
    print("allocated", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A private Prometheus server: its own config, data folder and loopback port."""

    def __init__(self, workdir: Path, target: str) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.skip("no prometheus binary (Debian/Ubuntu: apt-get install prometheus)")
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: memrec\n    static_configs:\n      - targets: ['{target}']\n"
        )
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1)
                return
            except OSError:
                time.sleep(0.2)
        pytest.fail(f"prometheus not ready in 60 s:\n{self.log_path.read_text()}")

    def query(self, expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_value(self, expr: str, want: float, timeout: float = 30) -> list[dict]:
        """Until ``expr`` gives one series with value ``want``; fail with what it gave last."""
        deadline = time.monotonic() + timeout
        got: list[dict] = []
        while time.monotonic() < deadline:
            got = self.query(expr)
            if len(got) == 1 and float(got[0]["value"][1]) == want:
                return got
            time.sleep(0.5)
        pytest.fail(f"prometheus: {expr} gave {got}, want {want}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def capability_mask(pid: int) -> dict[str, int]:
    """CapEff of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                out[tid] = int(line.split()[1], 16)
    return out


def test_unit_command_line_notifies_is_scraped_and_restarts_on_failure(workdir, stub_lib):
    pytest.importorskip("prometheus_client", reason="the unit serves metrics: pip install 'memrec[metrics]'")
    # GIVEN the unit's own command line, with this test's paths, a notify socket and a free metrics port
    metrics_port = free_port()
    traces = workdir / "traces"
    runner = UnitRunner(UNIT, workdir, [
        "-o", f"{traces}/", "--socket", str(workdir / "d.sock"), "--socket-group", "root",
        "--libcuda", str(stub_lib), "--metrics-addr", f"127.0.0.1:{metrics_port}",
    ])
    prometheus = Prometheus(workdir, f"127.0.0.1:{metrics_port}")
    worker = None
    try:
        first = runner.start()
        # WHEN it has attached its probes THEN it says READY, with its pid, and its watchdog pings come
        ready = runner.wait_for("READY", START_TIMEOUT)
        assert ready["READY"] == "1" and ready["MAINPID"] == str(first.pid)
        assert "recording to" in ready["STATUS"]
        runner.wait_for("WATCHDOG", runner.watchdog_usec / 1e6)
        # AND every thread kept only the capabilities recording needs (--drop-capabilities in the unit)
        keep = sum(1 << c for c in KEEP)
        assert all(eff & ~keep == 0 for eff in capability_mask(first.pid).values()), capability_mask(first.pid)

        # WHEN a process holds known device memory
        worker = subprocess.Popen([sys.executable, "-c", WORKER, str(stub_lib)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        calls = json.loads(worker.stdout.readline())
        held: dict[int, int] = {}
        for c in calls:
            if c["api"] == "cuMemAlloc_v2" and c["result"] == 0:
                held[c["ordinal"]] = held.get(c["ordinal"], 0) + c["args"]["bytesize"]
        assert held == {0: 7 << 20, 1: (3 << 20) + 4096}
        # THEN Prometheus, scraping the daemon, answers with those bytes per GPU, under dcgm-exporter's labels
        for gpu, size in held.items():
            got = prometheus.wait_value(f'memrec_traced_bytes{{job="memrec",category="driver",gpu="{gpu}"}}', size)
            assert got[0]["metric"]["Hostname"] == socket.gethostname()
            assert got[0]["metric"]["device"] == f"nvidia{gpu}"
        # (without NVML the UUID and modelName labels are empty, which Prometheus stores as absent)
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert 'memrec_traced_bytes{Hostname="' in exposition and 'UUID=""' in exposition
        prometheus.wait_value(f'sum(memrec_process_traced_bytes{{pid="{worker.pid}"}})', sum(held.values()))

        # WHEN the daemon dies by a signal that is a failure (SIGKILL, as an OOM killer would)
        first.send_signal(signal.SIGKILL)
        # THEN the restart policy (Restart=on-failure) starts it again, and it is READY again
        # (a killed process with many uprobes takes long to exit on a loaded VM: tens of seconds seen)
        assert runner.supervise(timeout=runner.stop_timeout), f"Restart={runner.restart} did not restart after SIGKILL"
        second = runner.proc
        ready = runner.wait_for("READY", START_TIMEOUT)
        assert ready["MAINPID"] == str(second.pid) != str(first.pid)
        prometheus.wait_value('up{job="memrec"}', 1)
        # (memory taken before a daemon started is not in its live state: the worker may go)
        worker.stdin.write("\n")
        worker.stdin.flush()
        assert worker.wait(30) == 0

        # WHEN, after the restart, a process maps a libcuda the daemon has not seen (another file)
        lib2 = workdir / "lib2" / "libcuda.so.1"
        lib2.parent.mkdir()
        shutil.copy(stub_lib, lib2)
        libraries = float(prometheus.query('memrec_probed_libraries{job="memrec"}')[0]["value"][1])
        late = subprocess.Popen([sys.executable, "-c", LATE_WORKER, str(lib2)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert late.stdout.readline().strip() == "mapped"
            # THEN the daemon, with its reduced capabilities, attaches to it at its next rescan...
            deadline = time.monotonic() + 30
            while float(prometheus.query('memrec_probed_libraries{job="memrec"}')[0]["value"][1]) <= libraries:
                assert time.monotonic() < deadline, f"no new libcuda attached in 30 s:\n{runner.log()}"
                time.sleep(0.5)
            # ... and records what the process does from then on (another library may have been the
            # new one: then the first allocations are missed and the next ones seen)
            seen = 0.0
            for _ in range(6):
                late.stdin.write("\n")
                late.stdin.flush()
                assert late.stdout.readline().strip() == "allocated"
                got = prometheus.query(f'sum(memrec_process_traced_bytes{{pid="{late.pid}"}})')
                deadline = time.monotonic() + 5
                while not got and time.monotonic() < deadline:
                    time.sleep(0.5)
                    got = prometheus.query(f'sum(memrec_process_traced_bytes{{pid="{late.pid}"}})')
                if got:
                    seen = float(got[0]["value"][1])
                    break
            assert seen > 0 and seen % (5 << 20) == 0, f"pid {late.pid}: {seen} bytes seen:\n{runner.log()}"
            late.stdin.close()
            assert late.wait(30) == 0
        finally:
            if late.poll() is None:
                late.kill()

        # WHEN systemd stops it (SIGTERM) THEN it says STOPPING, exits 0 and is not restarted
        second.send_signal(signal.SIGTERM)
        runner.wait_for("STOPPING", 30)
        assert not runner.supervise(timeout=runner.stop_timeout), runner.log()
        assert second.returncode == 0, runner.log()
        files = sorted(traces.glob("memrec-*.mrec"))
        assert len(files) == 2  # one per start; the killed one has no trailer
        complete = [load_trace(f).trailer is not None for f in files]
        assert sorted(complete) == [False, True], runner.log()
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        prometheus.close()
        runner.close()
