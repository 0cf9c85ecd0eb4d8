"""The compiled-program cache on the real driver: a second daemon start loads the program from the
cache (this kernel's verifier accepts what memrec's own loader hands it) and records a real
cuMemAlloc (GPU host only).

Run there: ``python -m pytest -q -s tests/gpu/test_probe_cache_gpu.py`` (root, bcc, cuda-python);
``-s`` shows the two start times.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from memrec.base.errors import MemrecCommandError
from memrec.subscriber import wait_for_daemon
from memrec.trace.reader import load_trace
from conftest import cuda_alloc_source
from conftest import memrec_cmd

SIZE = 48 * 2**20 + 4096 + 29  # distinctive

WORKLOAD = cuda_alloc_source(SIZE) + "assert cu.cuMemFree(ptr)[0] == 0\n"


def run_daemon(tmp_path, name: str, cache) -> tuple[float, str, int]:
    """Start a daemon, run the workload, stop it: (start to ready in s, its log, allocations of SIZE)."""
    sock, out, log_path = tmp_path / f"{name}.sock", tmp_path / f"{name}.mrec", tmp_path / f"{name}.log"
    with open(log_path, "w") as log:
        started = time.monotonic()
        proc = subprocess.Popen(memrec_cmd("daemon", "-o", str(out), "--socket", str(sock), "--rotate-size", "0",
                                           "--probe-cache", str(cache)), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_daemon(str(sock), timeout=180)
            ready = time.monotonic() - started
            subprocess.run([sys.executable, "-c", WORKLOAD], check=True, timeout=120)
            time.sleep(0.5)  # two flushes
        except (MemrecCommandError, subprocess.SubprocessError) as error:
            proc.kill()
            proc.wait()
            pytest.fail(f"{name}: {error}\n{log_path.read_text()}")
        proc.send_signal(2)
        assert proc.wait(timeout=300) == 0, log_path.read_text()
    ev = load_trace(out).events
    allocs = int(((ev["kind"] == 1) & (ev["size"] == SIZE)).sum())
    return ready, log_path.read_text(), allocs


def test_second_start_loads_from_the_cache_and_records_a_real_allocation(tmp_path):
    cache = tmp_path / "cache"
    cold_s, cold_log, cold_allocs = run_daemon(tmp_path, "cold", cache)
    warm_s, warm_log, warm_allocs = run_daemon(tmp_path, "warm", cache)
    print(f"\nstart to ready: cold {cold_s:.2f} s, warm {warm_s:.2f} s")
    assert "compiled the probe program" in cold_log, cold_log
    assert "loaded the compiled probe program from the cache" in warm_log, warm_log
    assert "not using the cache" not in warm_log and "compiled the probe program" not in warm_log, warm_log
    assert cold_allocs == 1 and warm_allocs == 1, (cold_allocs, warm_allocs)
