"""The daemon's metrics on a real GPU: NVML values under dcgm-exporter's labels, traced bytes of a
real allocation, and NVML still sampled after the capability drop (GPU host only).

Run there: ``python -m pytest -q tests/gpu/test_metrics_nvml.py`` (root, bcc, cuda-python,
prometheus-client).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from memrec.base.errors import MemrecCommandError
from memrec.subscriber import wait_for_daemon
from conftest import cuda_alloc_source
from conftest import memrec_cmd

SIZE = 96 * 2**20 + 4096 + 17  # distinctive

HOLDER = cuda_alloc_source(SIZE) + """
import sys
print("held", flush=True)
sys.stdin.readline()
"""


def scrape(port: int) -> dict[str, list[tuple[dict, float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_metrics_carry_nvml_and_a_real_allocation(tmp_path):
    pytest.importorskip("prometheus_client")
    from memrec.probes import nvml

    gpu0 = nvml.list_gpus()[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = tmp_path / "memrec.sock"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen(memrec_cmd("daemon", "-o", str(tmp_path / "traces") + "/", "--socket", str(sock),
                                       "--metrics-addr", f"127.0.0.1:{port}", "--drop-capabilities"), env=env)
    holder = None
    try:
        try:
            wait_for_daemon(str(sock), timeout=120)
        except MemrecCommandError as error:
            pytest.fail(f"daemon did not start (rc={proc.poll()}): {error}")
        holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu0.index)))
        assert holder.stdout.readline().strip() == "held"
        deadline = time.monotonic() + 20
        got: dict = {}
        while time.monotonic() < deadline:
            got = scrape(port)
            traced = [v for labels, v in got.get("memrec_process_traced_bytes", [])
                      if labels.get("pid") == str(holder.pid) and labels.get("gpu") == str(gpu0.index)]
            if traced and traced[0] >= SIZE and got.get("memrec_nvml_used_bytes"):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"no traced bytes of pid {holder.pid} on GPU {gpu0.index}: {json.dumps(got)[:2000]}")
        used = {labels["gpu"]: (labels, v) for labels, v in got["memrec_nvml_used_bytes"]}
        labels, value = used[str(gpu0.index)]
        assert labels["UUID"] == gpu0.uuid and labels["modelName"] == gpu0.name
        assert labels["Hostname"] == socket.gethostname() and labels["device"] == f"nvidia{gpu0.index}"
        assert value >= SIZE
        untraced = {lab["gpu"]: v for lab, v in got["memrec_untraced_bytes"]}
        traced_owned = sum(v for lab, v in got["memrec_traced_bytes"]
                           if lab["gpu"] == str(gpu0.index) and lab["category"] != "ipc_mapped")
        assert untraced[str(gpu0.index)] == value - traced_owned
        # NVML keeps sampling after the drop: the used value follows the free
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            now = {lab["gpu"]: v for lab, v in scrape(port)["memrec_nvml_used_bytes"]}
            if now[str(gpu0.index)] <= value - SIZE:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"NVML used stayed at {now[str(gpu0.index)]} after the holder exited (was {value})")
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
