"""The daemon's service add-ons without BPF: sd_notify on a real datagram socket, the metrics
endpoint scraped over HTTP, the trace directory's retention, capabilities, --version.

Probes are the stand-ins of tests/unit/daemon_fakes.py; the daemon, its sockets, the HTTP server
and the notify socket are real.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from memrec.client import MarkerClient
from memrec.commands import main
from memrec.commands.common import exit_code
from memrec.daemon.notify import Notifier
from memrec.daemon.retention import prune
from memrec.daemon.retention import record
from memrec.daemon.service import Service
from memrec.daemon.service import file_count
from memrec.daemon.service import metrics_addr
from memrec.terms.events import Kind
from memrec.trace.format import FORMAT_MINOR
from memrec.trace.format import FORMAT_VERSION
from tests.unit.daemon_fakes import raw
from tests.unit.test_daemon_unit import make_daemon
from tests.unit.test_daemon_unit import pump
from tests.unit.test_daemon_unit import workdir  # noqa: F401 (a fixture)

MiB = 1 << 20


@pytest.fixture
def listener(workdir):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(workdir / "notify"))
    sock.settimeout(2)
    yield sock
    sock.close()


def recv(sock: socket.socket) -> dict[str, str]:
    return dict(line.partition("=")[::2] for line in sock.recv(4096).decode().splitlines())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ sd_notify


def test_notifier_speaks_the_protocol_to_a_real_socket(workdir, listener):
    n = Notifier({"NOTIFY_SOCKET": str(workdir / "notify"), "WATCHDOG_USEC": "4000000"})
    assert n.enabled and n.watchdog_interval == 2.0
    assert n.ready("up")
    assert recv(listener) == {"READY": "1", "STATUS": "up", "MAINPID": str(os.getpid())}
    assert n.watchdog() and recv(listener) == {"WATCHDOG": "1"}
    assert n.stopping("bye") and recv(listener) == {"STOPPING": "1", "STATUS": "bye"}
    n.close()


def test_notifier_abstract_socket_and_no_manager():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"memrec-test-{os.getpid()}"
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2)
    try:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready("x")
        assert recv(sock)["READY"] == "1"
    finally:
        sock.close()
    quiet = Notifier({})
    assert not quiet.enabled and not quiet.ready("x") and quiet.watchdog_interval is None
    # WATCHDOG_PID of another process: the watchdog is not ours
    assert Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_interval is None


def test_a_vanished_manager_is_logged_once_and_never_raises(workdir, caplog):
    n = Notifier({"NOTIFY_SOCKET": str(workdir / "gone")})
    assert not n.ready("x") and not n.watchdog()
    assert sum("cannot notify" in r.message for r in caplog.records) == 1


# ------------------------------------------------------------------------------ metrics


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def series(samples: dict, name: str, **labels: str) -> dict[tuple, float]:
    return {k: v for k, v in samples.items() if k[0] == name and set(labels.items()) <= set(k[1])}


def test_metrics_follow_the_live_state_with_bounded_labels(workdir, listener):
    pytest.importorskip("prometheus_client")
    port = free_port()
    daemon = make_daemon(workdir)
    notifier = Notifier({"NOTIFY_SOCKET": str(workdir / "notify")})
    service = Service(metrics_addr=("127.0.0.1", port), notifier=notifier)
    service.listen()
    daemon.start()
    try:
        service.started(daemon)
        assert recv(listener)["READY"] == "1"
        probes = daemon.probes._inner
        # GIVEN a phase begun by a marker, 12 processes holding memory on GPU 0, one on GPU 1,
        # a failed out-of-memory call and an IPC open
        client = MarkerClient(daemon.config.socket_path)
        assert client.mark("load_weights", "begin")
        pump(daemon, 0.05)
        rows = [raw(Kind.ALLOC, pid=1000 + i, ptr=0x1000, size=(i + 1) * MiB, ordinal=0, ts=time.monotonic_ns())
                for i in range(12)]
        rows.append(raw(Kind.ALLOC, pid=2000, ptr=0x2000, size=64 * MiB, ordinal=1, ts=time.monotonic_ns()))
        rows.append(raw(Kind.ALLOC, pid=2000, ptr=0, size=1 << 40, ordinal=1, result=2, ts=time.monotonic_ns()))
        probes.push(*rows)
        pump(daemon, 0.1)
        assert client.mark("load_weights", "end")
        # free the biggest after the phase ended: the phase peak keeps it, the traced bytes do not
        probes.push(raw(Kind.FREE, pid=1011, ptr=0x1000, ordinal=0, ts=time.monotonic_ns()))
        pump(daemon, 1.3)  # a snapshot a second
        got = scrape(port)
    finally:
        service.stopping(daemon, "test")
        daemon.stop()
        service.close()
    held0 = sum((i + 1) * MiB for i in range(11))
    assert series(got, "memrec_traced_bytes", gpu="0", category="driver") == {
        ("memrec_traced_bytes", (("Hostname", socket.gethostname()), ("UUID", ""), ("category", "driver"),
                                 ("device", "nvidia0"), ("gpu", "0"), ("modelName", ""))): held0}
    assert list(series(got, "memrec_traced_bytes", gpu="1").values()) == [64 * MiB]
    procs = series(got, "memrec_process_traced_bytes", gpu="0")
    by_pid = {dict(k[1])["pid"]: v for k, v in procs.items()}
    # THEN the 10 largest have series of their own and the rest is one "other"
    assert len(by_pid) == 11 and by_pid["other"] == 1 * MiB
    assert by_pid["1010"] == 11 * MiB and "1011" not in by_pid
    assert list(series(got, "memrec_phase_peak_bytes", gpu="0", phase="load_weights").values()) == [held0 + 12 * MiB]
    assert list(series(got, "memrec_failed_calls_total", result="CUDA_ERROR_OUT_OF_MEMORY").values()) == [1]
    assert list(series(got, "memrec_events_total").values()) == [15]
    assert list(series(got, "memrec_lost_events_total").values()) == [0]
    assert list(series(got, "memrec_probed_libraries").values()) == [1]
    # AND the keyframe counters are the daemon's own, as its stats give them
    kf = {k: list(series(got, f"memrec_keyframes_{k}_total").values()) for k in ("written", "skipped", "waited")}
    assert kf == {"written": [1], "skipped": [0], "waited": [0]}, kf  # only the file's first one (every 10 s)
    assert len(series(got, "memrec_ring_fill_ratio")) == len(series(got, "memrec_drain_lag_seconds")) == 1
    info = next(k for k in got if k[0] == "memrec_info")
    assert dict(info[1])["trace_format"] == f"{FORMAT_VERSION}.{FORMAT_MINOR}"
    assert recv(listener) == {"STOPPING": "1", "STATUS": "shutting down (test)"}


def test_keyframe_counters_are_in_the_stats_and_the_metrics(workdir):
    from tests.unit.test_daemon_keyframes import _allocs
    from tests.unit.test_daemon_keyframes import _held_build

    pytest.importorskip("prometheus_client")
    port = free_port()
    daemon = make_daemon(workdir, keyframe_interval=0.02)
    service = Service(metrics_addr=("127.0.0.1", port), notifier=Notifier({}))
    service.listen()
    daemon.start()
    try:
        service.started(daemon)
        t = time.monotonic_ns()
        # GIVEN a new file whose first keyframe is slow to build, and more records behind it than
        # may be held: the loop waits for it once
        daemon.probes.push(_allocs(50, 1, t))
        pump(daemon, 0.1)
        release = _held_build(daemon.state)
        daemon.rotate("test")
        daemon.keyframes.max_held = 0
        threading.Timer(0.3, release.set).start()
        daemon.probes.push(_allocs(50, 1000, t + 1000))
        pump(daemon, 0.5)
        # AND then an idle loop: periodic keyframes skipped (nothing changed)
        pump(daemon, 0.3)
        stats = daemon.stats()["keyframes"]
        service.metrics.take_snapshot(daemon.clock())
        got = scrape(port)
    finally:
        service.stopping(daemon, "test")
        daemon.stop()
        service.close()
    # THEN the stats count them, and the metrics say the same
    assert stats["waited"] == 1 and stats["written"] >= 3 and stats["skipped"] >= 5, stats
    assert {k: list(series(got, f"memrec_keyframes_{k}_total").values()) for k in stats} == {
        k: [v] for k, v in stats.items()}


def test_a_taken_metrics_port_fails_before_start(workdir, capsys):
    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = Service(metrics_addr=("127.0.0.1", port))
        with pytest.raises(Exception) as err:
            service.listen()
        assert exit_code(err.value) == 73 and f"127.0.0.1:{port}" in str(err.value)


def test_drain_meter_fill_lag_and_results():
    import numpy as np

    from memrec.terms.columns import RAW_DTYPE
    from memrec.daemon.metrics import RECORD_BYTES
    from memrec.daemon.metrics import DrainMeter

    now = [10**12]
    meter = DrainMeter(ring_bytes=64 * RECORD_BYTES, clock=lambda: now[0])
    batch = np.zeros(16, RAW_DTYPE)
    batch["ts"] = now[0] - 250_000_000  # a quarter second old
    batch["result"][:3] = [2, 2, 999]
    meter.batch(batch)
    assert meter.take() == (0.25, 0.25)
    assert meter.take() == (0.0, 0.0)
    assert meter.failed == {"CUDA_ERROR_OUT_OF_MEMORY": 2, "CUDA_ERROR_UNKNOWN": 1}


def test_metrics_without_prometheus_client_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(Exception) as err:
        Service(metrics_addr=("127.0.0.1", free_port())).listen()
    assert exit_code(err.value) == 69 and "-m pip install" in str(err.value) and "prometheus-client" in str(err.value)


@pytest.mark.parametrize("text, want", [("127.0.0.1:9862", ("127.0.0.1", 9862)), (":9862", ("", 9862)),
                                        ("[::1]:80", ("::1", 80)), ("host.example:1", ("host.example", 1))])
def test_metrics_addr(text, want):
    assert metrics_addr(text) == want


@pytest.mark.parametrize("text", ["9862", "host:", "host:0", "host:70000", "[::1]", "a:b:1"])
def test_metrics_addr_refuses(text):
    with pytest.raises(ValueError, match="not HOST:PORT"):
        metrics_addr(text)


def test_daemon_refuses_bad_service_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["daemon", "--keep", "-1"])
    assert exc.value.code == 2 and "must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["daemon", "--metrics-addr", "9862"])
    assert "not HOST:PORT" in capsys.readouterr().err
    assert file_count("3") == 3


# ------------------------------------------------------------------------------ retention


def test_prune_keeps_the_newest_it_wrote_and_touches_nothing_else(workdir):
    # GIVEN five files the daemon wrote (noted in its ledger), oldest first, with mtimes that lie
    written = []
    for i in range(5):
        p = workdir / f"memrec-host-2026120{i}-000000-1-abcd.mrec"
        p.write_bytes(b"x")
        os.utime(p, (5000 - i, 5000 - i))
        record(workdir, p)
        written.append(p)
    current = written[1]
    # AND an operator's copy, a planted file dated 2030, a folder and a link, all named like traces
    (workdir / "memrec-host-20261201-000000-1-copy.mrec").write_bytes(b"mine")
    planted = workdir / "memrec-planted.mrec"
    planted.write_bytes(b"x")
    os.utime(planted, (1_900_000_000, 1_900_000_000))
    (workdir / "memrec-dir.mrec").mkdir()
    os.symlink("/etc/hostname", workdir / "memrec-link.mrec")
    deleted = prune(workdir, keep=3, current=current)
    # THEN the two oldest it wrote go (the current one stays and counts as one of the three)
    assert sorted(deleted) == sorted([written[0].name, written[2].name])
    left = sorted(p.name for p in workdir.iterdir() if not p.name.startswith("."))
    assert left == sorted([written[1].name, written[3].name, written[4].name, "memrec-dir.mrec",
                           "memrec-host-20261201-000000-1-copy.mrec", "memrec-link.mrec", "memrec-planted.mrec"])
    assert prune(workdir, keep=0) == []
    # AND none of the others holds a slot: with one more file written, keep=3 deletes one of its own
    extra = workdir / "memrec-host-20261209-000000-1-abcd.mrec"
    extra.write_bytes(b"x")
    record(workdir, extra)
    assert prune(workdir, keep=3) == [written[1].name]


def test_prune_ignores_a_file_put_in_place_of_one_it_wrote(workdir):
    # GIVEN a file the daemon wrote, then replaced by an operator's copy under the same name
    p = workdir / "memrec-h-1-1-abcd.mrec"
    p.write_bytes(b"x")
    record(workdir, p)
    record(workdir, p, closed=True)
    p.unlink()
    p.write_bytes(b"operator's copy")
    for n in (1, 2):
        q = workdir / f"memrec-h-1-1-abcd.{n}.mrec"
        q.write_bytes(b"x")
        record(workdir, q)
        record(workdir, q, closed=True)
    # THEN keep=1 deletes only the daemon's own older part, never the copy
    assert prune(workdir, keep=1) == ["memrec-h-1-1-abcd.1.mrec"]
    assert p.read_bytes() == b"operator's copy"


def test_a_ledger_planted_by_a_user_is_set_aside(workdir, caplog):
    victim = workdir / "memrec-victim.mrec"
    victim.write_bytes(b"operator's")
    st = victim.stat()
    ledger = workdir / ".memrec-written"
    ledger.write_text(f"{victim.name}\t{st.st_dev}\t{st.st_ino}\t-\n" * 3)
    os.chown(ledger, 65534, 65534)
    assert prune(workdir, keep=1) == []
    assert victim.exists() and any("set aside" in r.message for r in caplog.records)


def test_daemon_keeps_n_files_across_rotations(workdir):
    daemon = make_daemon(workdir, output=f"{workdir}/traces/")
    service = Service(keep_files=2, notifier=Notifier({}))
    daemon.start()
    try:
        service.started(daemon)
        for _ in range(4):
            daemon.rotate("test")
        service._prune(daemon)
        left = sorted(p.name for p in (workdir / "traces").iterdir() if p.name != ".memrec-written")
    finally:
        daemon.stop()
    assert len(daemon.files) == 5 and left == sorted(p.name for p in daemon.files[-2:])


# ------------------------------------------------------------------------------ capabilities, version


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping capabilities needs them first: run as root")
def test_drop_capabilities_keeps_only_what_recording_needs():
    code = (
        "from memrec.daemon.caps import KEEP, drop_capabilities, thread_capabilities\n"
        "drop_capabilities()\n"
        "c = thread_capabilities()\n"
        "keep = sum(1 << k for k in KEEP)\n"
        "assert c['CapEff'] & ~keep == 0 and c['CapPrm'] & ~keep == 0 and c['CapBnd'] & ~keep == 0, c\n"
        "assert c['CapEff'] & (1 << 39), 'CAP_BPF kept'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping capabilities needs them first: run as root")
def test_drop_capabilities_without_setpcap_still_reduces_what_it_can():
    code = (
        "from memrec.daemon.caps import KEEP, drop_capabilities, thread_capabilities\n"
        "drop_capabilities(KEEP | {21})\n"  # CAP_SYS_ADMIN kept, CAP_SETPCAP gone
        "drop_capabilities()\n"  # cannot touch the bounding set now; the rest it can
        "c = thread_capabilities()\n"
        "keep = sum(1 << k for k in KEEP)\n"
        "assert c['CapEff'] == c['CapPrm'] == c['CapEff'] & keep and c['CapBnd'] & (1 << 21), c\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_version_names_the_trace_format_and_bpf_program():
    proc = subprocess.run([sys.executable, "-m", "memrec", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert proc.stdout.startswith("memrec ") and f"trace format {FORMAT_VERSION}." in proc.stdout
    assert "BPF program sha256:" in proc.stdout


def test_the_grafana_dashboard_queries_only_metrics_the_daemon_exposes():
    pytest.importorskip("prometheus_client")
    import json
    import re

    from memrec.daemon.metrics import DaemonMetrics
    from memrec.daemon.metrics import Snapshot

    m = DaemonMetrics(("127.0.0.1", 0))
    m.snapshot = Snapshot({}, {}, {}, {}, {}, {}, 0, 0, 0, 0.0, 0.0, 0, 0, {"written": 0, "skipped": 0, "waited": 0})
    exposed = set()
    for family in m.collect():
        exposed.add(family.name + ("_total" if family.type == "counter" else ""))
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "contrib/grafana/memrec.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"]]
    used = {name for e in exprs for name in re.findall(r"\bmemrec_[a-z0-9_]+", e)}
    assert used and used <= exposed, used - exposed


def test_tensor_metrics_with_daemon_tensors(workdir):
    # GIVEN a daemon with --tensors, a PyTorch install found, and a process whose 20 MiB segment
    # holds two tensor blocks, one freed again
    from tests.unit.daemon_fakes import FakeLibrary

    pytest.importorskip("prometheus_client")
    port = free_port()
    daemon = make_daemon(workdir, tensors=True,
                         find_torch=lambda extra: [FakeLibrary("/venv/torch/lib/libc10_cuda.so", 1, 43)])
    service = Service(metrics_addr=("127.0.0.1", port), notifier=Notifier({}))
    service.listen()
    daemon.start()
    try:
        service.started(daemon)
        t = time.monotonic_ns()
        seg = 0x7F0000000000
        daemon.probes.push(
            raw(Kind.ALLOC, pid=3000, ptr=seg, size=20 * MiB, ordinal=0, ts=t),
            raw(Kind.TENSOR_ALLOC, pid=3000, ptr=seg, size=4 * MiB, ordinal=0, ts=t + 1),
            raw(Kind.TENSOR_ALLOC, pid=3000, ptr=seg + 4 * MiB, size=MiB, ordinal=0, ts=t + 2),
            raw(Kind.TENSOR_FREE, pid=3000, ptr=seg, ts=t + 3),
        )
        pump(daemon, 0.1)
        service.metrics.take_snapshot(daemon.clock())
        got = scrape(port)
    finally:
        service.stopping(daemon, "test")
        daemon.stop()
        service.close()
    # THEN the process's allocated, reserved and blocks are exported, and the install is counted
    assert list(series(got, "memrec_tensor_allocated_bytes", gpu="0", pid="3000").values()) == [MiB]
    assert list(series(got, "memrec_tensor_reserved_bytes", gpu="0", pid="3000").values()) == [20 * MiB]
    assert list(series(got, "memrec_tensor_blocks", gpu="0", pid="3000").values()) == [1]
    assert list(series(got, "memrec_torch_libraries", probes="attached").values()) == [1]
    from memrec.trace.reader import load_trace

    trace = load_trace(daemon.files[-1])
    assert trace.header["probes"]["torch"] == trace.trailer["torch"] == [
        {"path": "/venv/torch/lib/libc10_cuda.so", "attached": ["malloc", "free", "free"], "problem": ""}]
