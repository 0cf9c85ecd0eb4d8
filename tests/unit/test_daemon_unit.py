"""The daemon without BPF: signals, config, the socket, the marker server, GPU stamping, files.

Probes and library discovery are stand-ins (tests/unit/daemon_fakes.py); sockets, /proc, the
trace writer and reader, the live state and NVML's code above its choke point are real.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from memrec.terms import protocol
from memrec.base.errors import ExitCode
from memrec.base.errors import ProbeLoadError
from memrec.client import MarkerClient
from memrec.commands.common import exit_code
from memrec.daemon import config as cfgmod
from memrec.daemon import heap
from memrec.daemon import scheduling
from memrec.daemon.config import DaemonConfig
from memrec.daemon.fanout import Fanout
from memrec.daemon.feed import ProbeFeed
from memrec.daemon.server import Daemon
from memrec.daemon.server import Mood
from memrec.daemon.sockets import SocketError
from memrec.daemon.sockets import bind_unix_socket
from memrec.terms.events import Kind
from memrec.state import alloc_rows
from memrec.trace import frames
from memrec.trace.reader import TraceReader
from memrec.trace.reader import load_trace

from tests.unit.daemon_fakes import FakeLibrary
from tests.unit.daemon_fakes import FakeProbes
from tests.unit.daemon_fakes import raw

MiB = 1 << 20


@pytest.fixture
def workdir():
    d = Path(tempfile.mkdtemp(prefix="mrd", dir="/tmp"))  # short: sun_path holds 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def make_daemon(workdir: Path, find_torch=None, **overrides) -> Daemon:
    options = dict(
        output=workdir / "out.mrec",
        socket_path=workdir / "s.sock",
        nvml_device_hz=0,
        nvml_process_hz=0,
        poll_interval=0.01,
        flush_interval=0.05,
    )
    options.update(overrides)
    return Daemon(
        DaemonConfig(**options),
        probes_factory=FakeProbes,
        find_libraries=lambda extra: [FakeLibrary("/fake/libcuda.so.1", 1, 42)],
        find_torch=find_torch,
        install_signals=False,
    )


def pump(daemon: Daemon, seconds: float = 0.1) -> str:
    """Run the daemon's loop for a while (the test thread plays the clients in between)."""
    end = time.monotonic() + seconds
    return daemon.run(until=lambda: time.monotonic() >= end)


@pytest.fixture
def daemon(workdir):
    d = make_daemon(workdir)
    d.start()
    yield d
    d.stop()


def connect(path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(str(path))
    return s


def recv_frames(sock: socket.socket, decoder=None, timeout: float = 0.5) -> list[dict]:
    decoder = decoder or protocol.FrameDecoder(protocol.MAX_SERVER_FRAME)
    sock.settimeout(timeout)
    out = []
    try:
        while True:
            data = sock.recv(1 << 20)
            if not data:
                break
            out += decoder.feed(data)
    except (TimeoutError, socket.timeout):
        pass
    return out


def pump_until_reply(daemon: Daemon, sock: socket.socket, seconds: float = 10.0) -> list[dict]:
    """Run the loop until the client's replies arrive: on a loaded machine one 50 ms pump may
    only accept the connection (the test thread and the loop share the process)."""
    decoder = protocol.FrameDecoder(protocol.MAX_SERVER_FRAME)
    end = time.monotonic() + seconds
    out: list[dict] = []
    while not out and time.monotonic() < end:
        pump(daemon, 0.05)
        out = recv_frames(sock, decoder, timeout=0.02)
    return out


# ------------------------------------------------------------------------------ signals


def test_sigterm_is_queued_then_handled(daemon, caplog):
    # GIVEN a running daemon
    assert daemon.mood is Mood.RUNNING
    # WHEN SIGTERM arrives (the handler only queues it) twice before the loop looks
    daemon.queue_signal(signal.SIGTERM, None)
    daemon.queue_signal(signal.SIGTERM, None)
    assert daemon.mood is Mood.RUNNING  # nothing done in "signal context"
    with caplog.at_level(logging.INFO, logger="memrec.daemon"):
        daemon.handle_signal()
    # THEN the daemon is shutting down, said once (the duplicate was not queued)
    assert daemon.mood is Mood.STOPPING
    assert daemon.stop_reason == "signal SIGTERM"
    assert caplog.text.count("received SIGTERM: shutting down") == 1
    # AND run() returns at once with the reason
    assert daemon.run() == "signal SIGTERM"


def test_sighup_rotates_and_is_ignored_during_shutdown(daemon, caplog):
    # GIVEN a running daemon WHEN SIGHUP is handled
    daemon.queue_signal(signal.SIGHUP)
    with caplog.at_level(logging.INFO, logger="memrec.daemon"):
        daemon.handle_signal()
        # THEN a second file is open
        assert [p.name for p in daemon.files] == ["out.mrec", "out.1.mrec"]
        # WHEN SIGINT then SIGHUP come
        daemon.queue_signal(signal.SIGINT)
        daemon.queue_signal(signal.SIGHUP)
        daemon.handle_signal()
    # THEN the HUP is ignored, and said so
    assert "received SIGINT: shutting down" in caplog.text
    assert "received SIGHUP: ignored, shutdown in progress" in caplog.text
    assert len(daemon.files) == 2


def test_record_mode_passes_stop_signals_on(workdir, caplog):
    # GIVEN a daemon in record mode that forwards stop signals to the command
    forwarded = []
    d = make_daemon(workdir, follow_tree=True)
    d.stop_signal_handler = forwarded.append
    d.start()
    try:
        with caplog.at_level(logging.INFO, logger="memrec.daemon"):
            # WHEN SIGINT comes twice THEN it is passed on and the recording goes on
            for _ in range(2):
                d.queue_signal(signal.SIGINT)
                d.handle_signal()
            assert forwarded == [signal.SIGINT, signal.SIGINT]
            assert d.mood is Mood.RUNNING
            # WHEN a third comes THEN the daemon stops anyway
            d.queue_signal(signal.SIGINT)
            d.handle_signal()
        assert d.mood is Mood.STOPPING and len(forwarded) == 2
    finally:
        d.stop()


def test_real_signal_wakes_the_loop(workdir):
    # GIVEN a daemon with its handlers installed (main thread), in its loop with a long poll
    d = make_daemon(workdir, poll_interval=5.0)
    d._install_signals = True
    d.start()
    try:
        previous = signal.getsignal(signal.SIGTERM)
        assert previous == d.queue_signal
        # WHEN SIGTERM is sent to this process
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        old_alarm = signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGTERM))
        try:
            reason = d.run()
        finally:
            signal.signal(signal.SIGALRM, old_alarm)
        # THEN the loop returns promptly with the reason
        assert reason == "signal SIGTERM"
        assert time.monotonic() - start < 2.0
    finally:
        d.stop()
    # AND the handlers are restored
    assert signal.getsignal(signal.SIGTERM) != d.queue_signal


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "text, value",
    [("0", 0), ("4096", 4096), ("512M", 512 * MiB), ("512MiB", 512 * MiB), ("1g", 1 << 30), ("1.5G", 3 << 29), ("2KB", 2048)],
)
def test_byte_size(text, value):
    assert cfgmod.byte_size(text) == value


@pytest.mark.parametrize("text", ["", "-1", "12X", "M", "1.2.3", "5Mi"])
def test_byte_size_refuses(text):
    with pytest.raises(ValueError, match="not a byte size"):
        cfgmod.byte_size(text)


def test_other_converters():
    assert cfgmod.positive_float("0.2") == 0.2
    for bad in ("0", "-1", "nan", "inf", "x"):
        with pytest.raises(ValueError):
            cfgmod.positive_float(bad)
    assert cfgmod.rate("0") == 0.0
    with pytest.raises(ValueError):
        cfgmod.rate("-1")
    assert cfgmod.duration("500ms") == 0.5 and cfgmod.duration("5m") == 300 and cfgmod.duration("2") == 2
    with pytest.raises(ValueError):
        cfgmod.duration("0s")
    assert cfgmod.octal_mode("660") == 0o660 and cfgmod.octal_mode("0o600") == 0o600
    with pytest.raises(ValueError):
        cfgmod.octal_mode("999")
    assert cfgmod.ring_pages("64") == 64
    with pytest.raises(ValueError):
        cfgmod.ring_pages("100")
    # a power of two past the kernel's largest ring (2^40 pages once failed as "cannot compile the
    # probe program" after the daemon started) is refused with the largest it takes
    most = (1 << 31) // os.sysconf("SC_PAGE_SIZE")
    assert cfgmod.ring_pages(str(most)) == most
    for pages in (most * 2, 1 << 40):
        with pytest.raises(ValueError, match=f"at most {most}"):
            cfgmod.ring_pages(str(pages))


def test_config_defaults_and_validation(tmp_path):
    c = DaemonConfig()
    assert c.output_is_dir and os.fspath(c.output) == "/var/lib/memrec"
    assert c.socket_path == Path("/run/memrec/memrec.sock") and c.socket_mode == 0o660
    assert c.rotate_bytes == 1 << 30 and c.flush_interval == 0.2 and c.keyframe_interval == 10.0
    assert c.rescan_interval == 5.0 and c.poll_interval == 0.05
    assert (c.nvml_device_hz, c.nvml_process_hz) == (10.0, 1.0)
    # a file vs a directory: a trailing slash or an existing directory
    assert not DaemonConfig(output=tmp_path / "t.mrec").output_is_dir
    assert DaemonConfig(output=tmp_path).output_is_dir
    assert DaemonConfig(output=f"{tmp_path}/new/").replace(rotate_bytes="1M").output_is_dir
    with pytest.raises(ValueError):
        DaemonConfig(poll_interval=0)
    with pytest.raises(ValueError):
        DaemonConfig(rotate_bytes="lots")
    assert DaemonConfig(rotate_bytes="512M").to_dict()["rotate_bytes"] == 512 * MiB


# ------------------------------------------------------------------------------ socket


def test_bind_sets_mode_and_removes_only_its_own(workdir):
    path = workdir / "sub" / "m.sock"
    # WHEN a socket is bound in a directory that does not exist yet
    b = bind_unix_socket(path, mode=0o660)
    # THEN the socket is there with the mode asked, and no temp name is left over
    st = os.lstat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.sock"]
    connect(path).close()
    # WHEN someone else replaced the path before close
    os.unlink(path)
    path.write_text("not ours")
    b.close()
    # THEN close leaves their file alone
    assert path.read_text() == "not ours"


def test_stale_socket_is_replaced(workdir):
    # GIVEN a socket file nobody listens on (a crashed daemon)
    path = workdir / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    assert path.exists()
    # WHEN a new daemon binds THEN it takes the path over and accepts connections
    b = bind_unix_socket(path)
    try:
        connect(path).close()
        assert b.owns_path()
    finally:
        b.close()
    # AND the path is gone after close (and the directory, not ours, stays)
    assert not path.exists() and workdir.exists()


def test_live_owner_is_a_clear_error(workdir):
    # GIVEN a live listener on the path
    path = workdir / "live.sock"
    first = bind_unix_socket(path)
    try:
        # WHEN a second daemon binds THEN it refuses, naming the path, and leaves the first alone
        with pytest.raises(SocketError, match="listening on .*live.sock") as info:
            bind_unix_socket(path)
        assert exit_code(info.value) == ExitCode.CANT_CREATE
        assert first.owns_path()
        connect(path).close()
        assert sorted(p.name for p in workdir.iterdir()) == ["live.sock"]
    finally:
        first.close()


def test_a_regular_file_is_never_removed(workdir):
    path = workdir / "file.sock"
    path.write_text("precious")
    with pytest.raises(SocketError, match="not a socket"):
        bind_unix_socket(path)
    assert path.read_text() == "precious"


def test_socket_group(workdir):
    b = bind_unix_socket(workdir / "g.sock", group=12345)
    try:
        assert os.lstat(workdir / "g.sock").st_gid == 12345
    finally:
        b.close()
    with pytest.raises(SocketError, match="no such group"):
        bind_unix_socket(workdir / "h.sock", group="no-such-group-memrec")
    assert not (workdir / "h.sock").exists()


def test_second_daemon_fails_before_loading_probes(daemon, workdir):
    # GIVEN a running daemon WHEN another starts on the same socket
    FakeProbes.instances.clear()
    other = make_daemon(workdir, output=workdir / "other.mrec")
    with pytest.raises(SocketError):
        other.start()
    # THEN it never loaded probes nor created a file, and the first one's socket is intact
    assert FakeProbes.instances == []
    assert not (workdir / "other.mrec").exists()
    assert daemon.bound.owns_path()
    connect(daemon.config.socket_path).close()


# ------------------------------------------------------------------------------ marker server


def test_ping(daemon):
    # GIVEN a daemon WHEN pinged (the loop runs in between)
    s = connect(daemon.config.socket_path)
    s.sendall(protocol.encode_frame({"type": "ping"}))
    # THEN it answers with the protocol version and its pid
    assert pump_until_reply(daemon, s) == [{"type": "pong", "version": protocol.PROTOCOL_VERSION, "pid": os.getpid()}]
    s.close()


@pytest.mark.parametrize(
    "payload, reason",
    [
        (struct.pack(">I", 1 << 20), "exceeds the limit"),
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "not valid msgpack"),
        (protocol.frame(msgpack.packb({"type": "mark", "name": "x"})), "phase must be"),
        (protocol.frame(msgpack.packb({"type": "mark", "name": "x", "phase": "instant", "ts": 1, "tid": 1, "pid": -1})),
         "pid must be a process id"),
        (protocol.frame(msgpack.packb({"type": "shout"})), "unknown message type"),
    ],
    ids=["oversized", "garbage", "incomplete-mark", "bad-pid", "unknown-type"],
)
def test_bad_frames_are_answered_counted_and_the_daemon_keeps_serving(daemon, payload, reason):
    # GIVEN a client that sends a bad frame, and a good client
    bad = connect(daemon.config.socket_path)
    good = MarkerClient(daemon.config.socket_path)
    bad.sendall(payload)
    # THEN the bad one gets an error saying why, then the connection closes
    replies = pump_until_reply(daemon, bad)
    assert len(replies) == 1 and replies[0]["type"] == "error" and reason in replies[0]["message"]
    assert bad.recv(10) == b""
    assert daemon.markers.errors == 1
    # AND the daemon still serves the good one
    assert good.mark("still-here")
    pump(daemon, 0.05)
    daemon.stop()
    trace = load_trace(daemon.files[0])
    assert [m.name for m in trace.markers] == ["still-here"]
    assert trace.trailer["markers"]["bad_frames"] == 1


def test_connection_closed_inside_a_frame_is_counted(daemon):
    s = connect(daemon.config.socket_path)
    s.sendall(protocol.encode_frame({"type": "ping"})[:3])
    s.close()
    pump(daemon, 0.05)
    assert daemon.markers.errors == 1
    assert daemon.markers.clients == 0


def test_markers_carry_the_peers_real_pid(daemon):
    # GIVEN a forked child that sends a marker on its own connection
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        ok = MarkerClient(daemon.config.socket_path).mark("from-child", "instant", gpu=None, who="child")
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)
    # AND the parent sends one too
    assert MarkerClient(daemon.config.socket_path).mark("from-parent")
    pump(daemon, 0.05)
    daemon.stop()
    # THEN each marker is stamped with its sender's real pid and uid
    markers = {m.name: m for m in load_trace(daemon.files[0]).markers}
    assert markers["from-child"].pid == pid and markers["from-child"].uid == os.getuid()
    assert markers["from-child"].values == {"who": "child"}
    assert markers["from-parent"].pid == os.getpid()


def test_markers_sent_just_before_shutdown_are_kept(daemon):
    # GIVEN markers sent, and the loop never ran after them
    c = MarkerClient(daemon.config.socket_path)
    pump(daemon, 0.02)  # accept the connection... (the client connects lazily on its first mark)
    assert c.mark("last-words")
    # WHEN the daemon stops THEN they are in the file anyway
    daemon.stop()
    assert [m.name for m in load_trace(daemon.files[0]).markers] == ["last-words"]


# ------------------------------------------------------------------------------ events, GPUs


@pytest.fixture
def worker():
    """A live process with CUDA_VISIBLE_DEVICES=1,0 (what a remapped worker looks like)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="1,0")
    p = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    )
    assert p.stdout.readline() == b"up\n"
    yield p
    p.stdin.close()
    p.wait()


def test_events_get_physical_gpus_and_process_records(daemon, worker):
    # GIVEN no NVML on this host (ordinals are indices) and a worker with CUDA_VISIBLE_DEVICES=1,0
    probes = FakeProbes.instances[-1]
    t = time.monotonic_ns()
    me = os.getpid()
    probes.push(
        raw(Kind.ALLOC, ts=t + 1, pid=worker.pid, tid=worker.pid, ordinal=0, ptr=0x1000, size=MiB),
        raw(Kind.ALLOC, ts=t + 2, pid=worker.pid, tid=worker.pid, ordinal=1, ptr=0x2000, size=2 * MiB),
        raw(Kind.FREE, ts=t + 3, pid=worker.pid, tid=worker.pid, ordinal=-1, ptr=0x1000),  # the state knows
        raw(Kind.ALLOC, ts=t + 4, pid=me, tid=me, ordinal=1, ptr=0x3000, size=MiB),  # no CVD: identity
    )
    pump(daemon, 0.05)
    daemon.stop()
    trace = load_trace(daemon.files[0])
    # THEN ordinal 0 of the worker is GPU 1 and its ordinal 1 is GPU 0; the free gets its alloc's GPU
    assert trace.events["gpu"].tolist() == [1, 0, 1, 1]
    # AND each pid has a process record read from /proc
    assert trace.processes[worker.pid].cuda_visible_devices == "1,0"
    assert trace.processes[worker.pid].cmdline[0] == sys.executable
    assert trace.processes[me].ppid == os.getppid()
    # AND the header notes the missing NVML, the probes attached and the config
    assert trace.header["gpus"] == []
    assert any("NVML" in n for n in trace.header["notes"])
    lib = trace.header["probes"]["libraries"][0]
    assert lib["path"] == "/fake/libcuda.so.1" and lib["missing"] == ["cuMemAllocAsync_ptsz"]
    assert trace.header["config"]["socket_path"] == str(daemon.config.socket_path)
    assert trace.trailer is not None and trace.trailer["reason"] == "stop"


def test_the_heap_is_given_back_once_the_host_goes_quiet(daemon, monkeypatch):
    # GIVEN a daemon whose sweep (once a second) has seen no event yet
    trims = []
    monkeypatch.setattr(heap, "give_back", lambda: trims.append(daemon.events_recorded) or True)
    pump(daemon, 1.2)
    assert trims == []  # nothing recorded: nothing to give back
    # WHEN a process allocates and frees, then the host goes quiet for two sweeps
    probes = FakeProbes.instances[-1]
    t, me = time.monotonic_ns(), os.getpid()
    probes.push(raw(Kind.ALLOC, ts=t + 1, pid=me, tid=me, ordinal=0, ptr=0x1000, size=MiB),
                raw(Kind.FREE, ts=t + 2, pid=me, tid=me, ordinal=0, ptr=0x1000))
    pump(daemon, 2.3)
    # THEN the sweep trimmed the heap once, after those events, and not again while quiet
    assert trims == [2]


def test_single_gpu_process_gets_its_gpu_for_unknown_ordinals(workdir):
    # GIVEN a process that sees exactly one GPU (CUDA_VISIBLE_DEVICES=3)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="3")
    p = subprocess.Popen([sys.executable, "-c", "import sys; print(1, flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    p.stdout.readline()
    d = make_daemon(workdir)
    d.start()
    try:
        t = time.monotonic_ns()
        FakeProbes.instances[-1].push(
            raw(Kind.VA_RESERVE, ts=t, pid=p.pid, ptr=0x7000_0000, size=1 << 30),  # ordinal -1
            raw(Kind.PROC_EXIT, ts=t + 1, pid=p.pid),  # a process event: no GPU
        )
        pump(d, 0.05)
    finally:
        d.stop()
        p.stdin.close()
        p.wait()
    # THEN the VA reserve is on GPU 3, the exit on none
    assert load_trace(d.files[0]).events["gpu"].tolist() == [3, -1]


def test_lost_events_are_recorded(daemon):
    probes = FakeProbes.instances[-1]
    probes.lost_total = 7
    pump(daemon, 0.05)
    daemon.stop()
    trace = load_trace(daemon.files[0])
    assert trace.lost == 7 and trace.trailer["lost"] == 7


def test_probe_load_failure_is_one_line_and_cleans_up(workdir):
    # GIVEN probes that cannot load (bcc's multi-line compiler complaint)
    class Broken(FakeProbes):
        def load(self):
            raise RuntimeError("Failed to compile BPF module\n<built-in>:1:10: fatal error: 'x.h' file not found")

    d = Daemon(DaemonConfig(output=workdir / "o.mrec", socket_path=workdir / "s.sock"), probes_factory=Broken,
               find_libraries=lambda e: [], install_signals=False)
    # WHEN the daemon starts THEN one line says why, exit code UNAVAILABLE
    with pytest.raises(ProbeLoadError) as info:
        d.start()
    assert exit_code(info.value) == ExitCode.UNAVAILABLE
    assert "\n" not in str(info.value) and "Failed to compile" in str(info.value)
    # AND the socket is gone and no trace was created
    assert not (workdir / "s.sock").exists() and not (workdir / "o.mrec").exists()


def test_phased_shutdown_order(daemon):
    # GIVEN events still in the ring buffer at shutdown
    probes = daemon.probes
    t = time.monotonic_ns()
    probes.push(raw(Kind.ALLOC, ts=t, pid=os.getpid(), ordinal=0, ptr=0x10, size=MiB))
    # WHEN the daemon stops
    daemon.stop()
    # THEN they were drained before the probes were closed, the file has its trailer, the socket is gone
    trace = load_trace(daemon.files[0])
    assert len(trace.events) == 1 and probes.closed
    assert trace.trailer is not None and trace.warnings == []
    assert not daemon.config.socket_path.exists()
    assert daemon.mood is Mood.STOPPED
    daemon.stop()  # idempotent


def test_trace_is_complete_on_disk_before_the_probes_detach(daemon):
    # GIVEN a daemon whose probes look at the trace file when they are told to detach
    probes = daemon.probes
    seen = {}

    def close() -> None:
        trace = load_trace(daemon.files[0])
        seen.update(trailer=trace.trailer, warnings=trace.warnings, socket=daemon.config.socket_path.exists())
        probes.closed = True

    probes.close = close
    probes.push(raw(Kind.ALLOC, ts=time.monotonic_ns(), pid=os.getpid(), ordinal=0, ptr=0x10, size=MiB))
    # WHEN the daemon stops
    daemon.stop()
    # THEN the trailer was on disk (and the socket gone) before the slow detach began
    assert probes.closed
    assert seen["trailer"] is not None and seen["warnings"] == []
    assert seen["socket"] is False


# ------------------------------------------------------------------------------ files


def test_size_rotation_gives_files_that_stand_alone(workdir):
    # GIVEN a tiny rotation size, and events with random threads and pointer bits (trace format 2
    # stores regular events in under a byte each)
    d = make_daemon(workdir, rotate_bytes=1_500)  # counted after each opening (issue 23)
    d.start()
    rng = random.Random(5)
    try:
        pid = os.getpid()
        t = time.monotonic_ns()
        for i in range(6):
            d.probes.push(*[raw(Kind.ALLOC, ts=t + i * 100 + j, pid=pid, tid=rng.getrandbits(31), ordinal=0,
                                ptr=(rng.getrandbits(20) << 20 | (i * 100 + j + 1)) << 12, size=MiB)
                            for j in range(100)])
            pump(d, 0.06)
    finally:
        d.stop()
    # THEN several files, each with a header, a keyframe at event 0 and a trailer
    assert len(d.files) >= 3
    total = 0
    for i, path in enumerate(d.files):
        trace = load_trace(path)
        assert trace.warnings == [] and trace.trailer is not None
        assert trace.header["daemon"]["part"] == i
        assert trace.keyframes[0].event_index == 0
        assert os.getpid() in trace.processes
        if i:
            # the first keyframe of a later file holds every allocation made before it
            assert trace.keyframes[0].state["n"] == total
            assert trace.header["previous"] == str(d.files[i - 1])
        total += len(trace.events)
    assert total == 600
    assert [p.name for p in d.files[:3]] == ["out.mrec", "out.1.mrec", "out.2.mrec"]


def test_output_directory_names(workdir):
    d = make_daemon(workdir, output=f"{workdir}/traces/")
    d.start()
    d.rotate("test")
    d.stop()
    names = [p.name for p in d.files]
    # host, start time, pid, and a random part nobody can guess (issue 15: no name to plant a link at)
    assert re.fullmatch(rf"memrec-{re.escape(socket.gethostname())}-\d{{8}}-\d{{6}}-{os.getpid()}-[0-9a-f]{{8}}\.mrec", names[0])
    assert names[1] == names[0].replace(".mrec", ".1.mrec")
    assert all(TraceReader(p).header for p in d.files)
    again = make_daemon(workdir, output=f"{workdir}/traces/", socket_path=workdir / "s2.sock")
    again.start()
    again.stop()
    assert again.files[0].name != names[0]


def test_flush_interval_makes_records_visible_while_running(daemon):
    # GIVEN an event WHEN the loop runs past the flush interval (50 ms here)
    daemon.probes.push(raw(Kind.ALLOC, ts=time.monotonic_ns(), pid=os.getpid(), ordinal=0, ptr=0x10, size=MiB))
    pump(daemon, 0.12)
    # THEN another process reading the file sees it, before any close
    assert len(load_trace(daemon.files[0]).events) == 1


# ------------------------------------------------------------------------------ subscribers


def test_subscriber_gets_header_keyframe_then_the_files_records(daemon):
    # GIVEN an allocation already recorded
    pid = os.getpid()
    t = time.monotonic_ns()
    daemon.probes.push(raw(Kind.ALLOC, ts=t, pid=pid, ordinal=0, ptr=0x10, size=MiB))
    pump(daemon, 0.05)
    # WHEN a subscriber connects
    sub = connect(daemon.config.socket_path)
    sub.sendall(protocol.encode_frame({"type": "subscribe"}))
    pump(daemon, 0.05)
    decoder = frames.FrameDecoder(frames.MAX_SUBSCRIBER_FRAME)
    first = recv_frames(sub, decoder)
    # THEN it gets the header, its process, and a keyframe that already holds the allocation
    assert [r["type"] for r in first] == ["header", "process", "keyframe"]
    assert first[2]["state"]["n"] == 1 and alloc_rows(first[2]["state"])[:3] == [pid, 0x10, MiB]
    # WHEN more happens THEN it gets the same records as the file, no event twice
    daemon.probes.push(raw(Kind.FREE, ts=t + 1, pid=pid, ptr=0x10))
    MarkerClient(daemon.config.socket_path).mark("live")
    pump(daemon, 0.1)
    later = recv_frames(sub, decoder)
    kinds = [r["type"] for r in later]
    assert "marker" in kinds
    events = np.concatenate([r["events"] for r in later if r["type"] == "events"])
    assert events["kind"].tolist() == [int(Kind.FREE)]
    # AND at shutdown it gets the trailer
    daemon.stop()
    assert recv_frames(sub, decoder)[-1]["type"] == "trailer"


def slow_subscriber():
    """A fanout with a small queue (200 kB) and a subscriber whose socket takes 4 KiB: (selector,
    fanout, its socket, the reader's end)."""
    import selectors

    sel = selectors.DefaultSelector()
    fan = Fanout(sel, max_queue_bytes=200_000)
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    fan.add(a)
    return sel, fan, a, b


def read_everything(sel, fan, a, b) -> list[dict]:
    """The frames the reader's end ``b`` gets once it reads (the loop writing as ``a`` becomes writable)."""
    decoder = frames.FrameDecoder(frames.MAX_SUBSCRIBER_FRAME, decode=False)
    got = []
    b.setblocking(False)
    sub = next(s for s in fan.subscribers if s.sock is a)
    for _ in range(2000):
        for key, mask in sel.select(0):
            key.data(mask)
        try:
            got += decoder.feed(b.recv(1 << 16))
        except BlockingIOError:
            if not sub.queue:
                break
    return got


def test_slow_subscriber_is_resynced_not_corrupted():
    # GIVEN a fanout with a small queue and a subscriber that does not read yet
    sel, fan, a, b = slow_subscriber()

    def sync() -> None:
        fan.start_sync([msgpack.packb({"type": "hello"})], lambda: msgpack.packb({"type": "keyframe"}))

    sync()
    fan.collect(wait=True)
    # WHEN far more is published than fits
    for i in range(200):
        fan.publish(msgpack.packb({"type": "marker", "i": i, "pad": "x" * 5000}))
    # THEN the subscriber waits for a resync, and the drops are counted
    assert fan.needs_resync and fan.dropped_records > 0
    fan.resync(lambda dropped: msgpack.packb({"type": "lost", "ts": 0, "total": 0, "subscriber_dropped": dropped}))
    assert fan.wants_sync
    sync()
    fan.collect(wait=True)
    # WHEN the subscriber reads everything (the loop writing as it becomes writable)
    got = read_everything(sel, fan, a, b)
    # THEN every frame is whole, and the lost notice counts exactly what was not delivered
    assert [r["type"] for r in got if r["type"] != "marker"] == ["hello", "keyframe", "hello", "lost", "keyframe"]
    lost = [r for r in got if r["type"] == "lost"]
    markers = [r for r in got if r["type"] == "marker"]
    assert len(lost) == 1 and lost[0]["subscriber_dropped"] == 200 - len(markers)
    assert [m["i"] for m in markers] == list(range(len(markers)))
    fan.close()
    sel.close()


def test_a_resync_joining_a_running_sync_counts_only_what_it_never_gets():
    # GIVEN a subscriber that overflowed (it does not read yet)
    sel, fan, a, b = slow_subscriber()
    fan.start_sync([msgpack.packb({"type": "hello"})], lambda: msgpack.packb({"type": "keyframe"}))
    fan.collect(wait=True)
    record = lambda i: msgpack.packb({"type": "marker", "i": i, "pad": "x" * 5000})  # noqa: E731
    for i in range(100):
        fan.publish(record(i))
    assert fan.needs_resync
    # AND a second subscriber's sync being built (its keyframe waits), while 30 more are published:
    # the slow one drops them, the sync's tail keeps them
    c, d = socket.socketpair()
    fan.add(c)
    release = threading.Event()
    fan.start_sync([msgpack.packb({"type": "hello"})],
                   lambda: release.wait(5) and msgpack.packb({"type": "keyframe"}))
    for i in range(100, 130):
        fan.publish(record(i))
    # WHEN the slow one is resynced now: it joins that sync
    fan.resync(lambda dropped: msgpack.packb({"type": "lost", "ts": 0, "total": 0, "subscriber_dropped": dropped}))
    release.set()
    fan.collect(wait=True)
    slow = next(s for s in fan.subscribers if s.sock is a)
    got = read_everything(sel, fan, a, b)
    # THEN after its notice it gets the 30 again (the sync's tail), and the notice counts only the
    # records it never gets: neither before its overflow nor in the sync
    assert [r["type"] for r in got if r["type"] != "marker"] == ["hello", "keyframe", "hello", "lost", "keyframe"]
    notice = got.index(next(r for r in got if r["type"] == "lost"))
    assert [r["i"] for r in got[notice:] if r["type"] == "marker"] == list(range(100, 130))
    never = set(range(130)) - {r["i"] for r in got if r["type"] == "marker"}
    assert got[notice]["subscriber_dropped"] == len(never) > 0
    assert slow.dropped == fan.dropped_records == len(never)
    fan.close()
    sel.close()
    for s in (b, d):
        s.close()


# ------------------------------------------------------------------------------ command


def test_daemon_command_needs_privileges(workdir):
    # GIVEN an unprivileged user (nobody, no capabilities)
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the command as an unprivileged user")
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
           sys.executable, "-m", "memrec", "daemon", "-o", str(workdir / "x.mrec"), "--socket", str(workdir / "x.sock")]
    # WHEN it runs the daemon THEN a one-line hint and exit code NO_PERM
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == ExitCode.NO_PERM, proc.stderr
    assert "run as root or see memrec doctor" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_daemon_command_bpf_failure_is_unavailable(workdir, monkeypatch, capsys):
    # GIVEN probes that cannot load
    from memrec.commands import main
    from memrec.daemon import feed

    class Broken(FakeProbes):
        def load(self):
            raise RuntimeError("bpf(BPF_PROG_LOAD) failed: Operation not permitted")

    monkeypatch.setattr(feed, "default_probes_factory", Broken)
    # WHEN the command runs THEN exit code UNAVAILABLE and the reason on one line
    rc = main(["daemon", "-o", str(workdir / "x.mrec"), "--socket", str(workdir / "x.sock"), "--nvml-hz", "0"])
    assert rc == ExitCode.UNAVAILABLE
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "memrec: error: cannot load the BPF probes: bpf(BPF_PROG_LOAD) failed: Operation not permitted"


@pytest.mark.parametrize("command", [["daemon", "--nvml-hz", "0"], ["record", "--nvml-hz", "0", "--", "sleep", "30"]],
                         ids=["daemon", "record"])
def test_a_stop_signal_while_loading_the_probes_unwinds_the_start(workdir, monkeypatch, capsys, command):
    # GIVEN probes whose load (the seconds-long BPF compile) is interrupted by SIGTERM
    from memrec.commands import main
    from memrec.daemon import feed

    class Interrupted(FakeProbes):
        def load(self):
            os.kill(os.getpid(), signal.SIGTERM)
            return super().load()

    def not_taken(signum, frame):  # without the start's own handler: a failure, not the test run killed
        raise RuntimeError("the start did not take the signal")

    monkeypatch.setattr(feed, "default_probes_factory", lambda **kw: Interrupted())
    before = signal.signal(signal.SIGTERM, not_taken)
    sock = workdir / "x.sock"
    try:
        # WHEN the command starts THEN it exits as SIGTERM would (143) with one line, not killed
        # mid-start: its socket is removed and the handler it found is back
        rc = main([command[0], "-o", str(workdir / "x.mrec"), "--socket", str(sock), *command[1:]])
        assert rc == 128 + signal.SIGTERM, capsys.readouterr().err
        assert capsys.readouterr().err.strip().splitlines()[-1] == "memrec: stopped by signal 15 while starting"
        assert not sock.exists()
        assert signal.getsignal(signal.SIGTERM) is not_taken
    finally:
        signal.signal(signal.SIGTERM, before)


def test_no_untraced_probes_reaches_the_probes(workdir, monkeypatch):
    # GIVEN probes that record how they were made (and stop the daemon there)
    from memrec.commands import main
    from memrec.daemon import feed

    made = []

    class Recording(FakeProbes):
        def __init__(self, **kwargs):
            made.append(kwargs)
            super().__init__(follow_tree=kwargs["follow_tree"], ringbuf_pages=kwargs["ringbuf_pages"])

        def load(self):
            raise RuntimeError("stop here")

    monkeypatch.setattr(feed, "default_probes_factory", lambda **kw: Recording(**kw))
    argv = ["daemon", "-o", str(workdir / "x.mrec"), "--socket", str(workdir / "x.sock"), "--nvml-hz", "0"]
    # WHEN the daemon starts with and without --no-untraced-probes
    main(argv)
    main([*argv, "--no-untraced-probes"])
    # THEN the code-loading and pool probes are asked for by default and left out on request
    assert "untraced" not in made[0] and made[1]["untraced"] is False


def test_name_images_names_the_mapped_file_an_image_lies_in():
    # GIVEN a batch with two in-memory code loads (one inside libnccl's mapping, one anonymous)
    from memrec.terms.columns import with_gpu
    from memrec.daemon.untraced import name_images
    from memrec.terms.events import FLAG_NAME

    maps = ("7f0000000000-7f0000100000 r--p 00000000 08:01 1234 /usr/lib/libnccl.so.2.28.9\n"
            "7f0000200000-7f0000300000 rw-p 00000000 00:00 0 \n")
    ev = with_gpu(np.concatenate([raw(Kind.CODE_LOAD, pid=7, ptr=0x7F0000000800),
                                  raw(Kind.CODE_LOAD, pid=7, ptr=0x7F0000200800)]), -1)
    # WHEN named from the process's maps
    assert name_images(ev, read_maps=lambda pid: maps) == 1
    # THEN the first carries the library's file name, the second stays unnamed
    assert ev["flags"][0] & FLAG_NAME and bytes(ev["ipc"][0]).rstrip(b"\0") == b"libnccl.so.2.28.9"
    assert not ev["flags"][1] & FLAG_NAME


def test_daemon_command_bad_size_is_usage(capsys):
    from memrec.commands import main

    with pytest.raises(SystemExit) as info:
        main(["daemon", "--rotate-size", "lots"])
    assert info.value.code == 2
    assert "not a byte size: 'lots'" in capsys.readouterr().err


def test_a_probe_wakeup_drains_at_once(workdir):
    # GIVEN probes that offer a pollable fd (a pipe stands in for the ring buffer's map fd), and
    # a drain timer far away
    r, w = os.pipe()

    class WakingProbes(FakeProbes):
        def fileno(self):
            return r

        def poll(self):
            try:
                os.read(r, 4096) if select_ready(r) else None
            except BlockingIOError:
                pass
            return super().poll()

    def select_ready(fd):
        import select
        return bool(select.select([fd], [], [], 0)[0])

    d = make_daemon(workdir, poll_interval=30.0)
    d.feed = ProbeFeed(WakingProbes, d.config)
    d.start()
    try:
        pump(d, 0.05)  # the start-up drain
        # WHEN an event arrives with a wakeup
        d.probes.push(raw(Kind.ALLOC, ts=time.monotonic_ns(), pid=os.getpid(), ordinal=0, ptr=0x10, size=MiB))
        os.write(w, b"!")
        t0 = time.monotonic()
        end = t0 + 2
        d.run(until=lambda: d.events_recorded == 1 or time.monotonic() > end)
        # THEN it is recorded at once, not at the next timer drain
        assert d.events_recorded == 1 and time.monotonic() - t0 < 1.0
    finally:
        d.stop()
        os.close(r)
        os.close(w)


def test_process_log_lines_say_how_ordinals_map_without_python_reprs(workdir, worker, caplog):
    # GIVEN a daemon without NVML, a worker with CUDA_VISIBLE_DEVICES=1,0 and this process
    daemon = make_daemon(workdir)
    with caplog.at_level(logging.INFO, logger="memrec.daemon.server"):
        daemon.start()
        probes = FakeProbes.instances[-1]
        t = time.monotonic_ns()
        me = os.getpid()
        probes.push(
            raw(Kind.ALLOC, ts=t + 1, pid=worker.pid, tid=worker.pid, ordinal=0, ptr=0x1000, size=MiB),
            raw(Kind.ALLOC, ts=t + 2, pid=me, tid=me, ordinal=1, ptr=0x3000, size=MiB),
        )
        pump(daemon, 0.05)
        daemon.stop()
    # THEN the log says what it is doing during the slow steps, and each process line reads as text
    assert "loading the BPF probes" in caplog.text and "probe program loaded" in caplog.text
    assert "detaching the probes" in caplog.text
    assert f"pid {worker.pid}: " in caplog.text and "(CUDA_VISIBLE_DEVICES=1,0 → GPUs 1, 0)" in caplog.text
    mine = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mine is None:
        assert "(CUDA_VISIBLE_DEVICES unset, no GPU list (no NVML): ordinal n is GPU n)" in caplog.text
    assert "None" not in caplog.text and "[]" not in caplog.text


def _run_script(daemon, script: str, *, make: str | None = None, cwd=None) -> int:
    """Run ``script`` in a session of its own (as a terminal's shell is), pumping the daemon while
    it runs; return the session's leader (the pid of the setsid'd process)."""
    argv = ["setsid", "bash", "-c", script] if make is None else ["setsid", "make", "-s", "-f", make]
    shell = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    while shell.poll() is None:  # the daemon answers each `memrec mark` while it runs
        pump(daemon, 0.05)
    assert shell.returncode == 0, shell.stderr.read()
    pump(daemon, 0.05)
    return shell.pid


@pytest.mark.parametrize("how", ["script", "exec", "make", "shell"])
def test_shell_markers_pair_into_one_phase(daemon, capsys, tmp_path, how):
    # GIVEN two `memrec mark` runs, a begin and an end, in each of the ways a shell sends them:
    # two lines of a script (the end under a wrapper, as sudo), a `bash -c` whose last command is
    # the end (bash execs it: its parent is bash's parent), two lines of a Makefile (a shell
    # each), and `--scope shell` in one script
    sock = daemon.config.socket_path
    memrec = f"{sys.executable} -m memrec"
    begin, end = f"{memrec} mark load --phase begin --socket {sock}", f"{memrec} mark load --phase end --socket {sock}"
    if how == "script":
        leader = _run_script(daemon, f"{begin} && timeout 30 {end} tokens=3 && true")
    elif how == "exec":
        leader = _run_script(daemon, f"{begin}; sleep 0.1; {end} tokens=3")
    elif how == "make":
        makefile = tmp_path / "Makefile"
        makefile.write_text(f"all:\n\t{begin}\n\tsleep 0.1\n\t{end} tokens=3\n")
        leader = _run_script(daemon, "", make=str(makefile), cwd=tmp_path)
    else:
        leader = _run_script(daemon, f"{begin} --scope shell && {end} --scope shell tokens=3 && echo $$")
    daemon.stop()
    # WHEN the trace is reported
    from memrec import commands

    assert commands.main(["report", str(daemon.files[0])]) == 0
    out = capsys.readouterr().out
    # THEN both markers carry one pid, the session's leader (with --scope shell: that shell, here
    # the leader too), and the report shows one closed phase, not an end without a begin
    markers = load_trace(daemon.files[0]).markers
    assert [(m.name, m.phase, m.pid) for m in markers] == [("load", "begin", leader), ("load", "end", leader)]
    assert "unclosed" not in out and "without a begin" not in out
    assert any(line.split()[:2] == [str(leader), "load"] for line in out.splitlines())


@pytest.mark.parametrize("script, code", [("echo $$ > {pidfile}; exit 3", 3),
                                          ("echo $$ > {pidfile}; kill -TERM $$", 128 + signal.SIGTERM)])
def test_mark_with_a_command_makes_the_command_s_process_the_phase(daemon, tmp_path, script, code):
    # GIVEN `memrec mark NAME -- CMD` run from a shell, CMD a child that ends with a status or a signal
    sock = daemon.config.socket_path
    pidfile = tmp_path / "pid"
    argv = [sys.executable, "-m", "memrec", "mark", "load", "tokens=3", "--socket", str(sock), "--",
            "sh", "-c", script.format(pidfile=pidfile)]
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while run.poll() is None:  # the daemon answers both markers while it runs
        pump(daemon, 0.05)
    pump(daemon, 0.05)
    daemon.stop()
    # THEN mark exits with CMD's status (128+N for a signal), and a begin and an end, both taken,
    # are stamped with CMD's pid (exec'd in the child: the pid the shell wrote), not mark's session
    assert run.returncode == code, run.stderr.read()
    child = int(pidfile.read_text())
    markers = load_trace(daemon.files[0]).markers
    assert [(m.name, m.phase, m.pid) for m in markers] == [("load", "begin", child), ("load", "end", child)]
    assert markers[0].values == {"tokens": 3} and daemon.markers.claims_refused == 0


def test_mark_with_a_command_and_no_daemon_still_runs_it(tmp_path):
    # GIVEN no daemon at the socket
    # WHEN a command is run as a phase
    run = subprocess.run([sys.executable, "-m", "memrec", "mark", "x", "--socket", str(tmp_path / "none.sock"), "--",
                          "sh", "-c", "echo ran; exit 4"], capture_output=True, text=True, timeout=60)
    # THEN it runs, its status is mark's, and the missing daemon is said once
    assert run.stdout == "ran\n" and run.returncode == 4
    assert run.stderr.count("no memrec daemon") == 1 and "runs without its phase" in run.stderr


def test_scope_shell_keeps_two_scripts_of_one_session_apart(daemon, capsys):
    # GIVEN one session running two scripts, each marking a phase of the same name, with --scope shell
    sock = daemon.config.socket_path
    memrec = f"{sys.executable} -m memrec"
    one = f"{memrec} mark step --scope shell --phase begin --socket {sock}; {memrec} mark step --scope shell --phase end --socket {sock}; true"
    _run_script(daemon, f"bash -c '{one}'; bash -c '{one}'")
    daemon.stop()
    # THEN each script's markers carry its own shell's pid: two phases, each closed
    markers = load_trace(daemon.files[0]).markers
    pids = [m.pid for m in markers]
    assert len(markers) == 4 and pids[0] == pids[1] != pids[2] == pids[3]


def test_mark_pid_names_another_process_of_this_user(daemon, worker, capsys):
    # GIVEN a process of ours running (a server started in the background)
    from memrec import commands

    # WHEN a marker names it with --pid, and another names a process that does not exist
    sock = str(daemon.config.socket_path)
    loop = threading.Thread(target=pump, args=(daemon, 1.0))
    loop.start()
    assert commands.main(["mark", "warmup", "--pid", str(worker.pid), "--socket", sock]) == 0
    assert commands.main(["mark", "x", "--pid", "4194304", "--socket", sock]) == ExitCode.USAGE
    loop.join()
    err = capsys.readouterr().err
    daemon.stop()
    # THEN the first is that process's marker; the second is refused in one line
    (marker,) = load_trace(daemon.files[0]).markers
    assert (marker.name, marker.pid) == ("warmup", worker.pid)
    assert err == "memrec: error: --pid 4194304: no such process\n"


def test_daemon_keeps_the_peers_pid_when_the_named_process_is_not_the_peers(daemon, caplog):
    # GIVEN a non-root writer naming root's process 1, and a writer naming a process that is gone
    with caplog.at_level(logging.WARNING, logger="memrec.daemon.markers"):
        # WHEN the daemon decides whose marker each is (writer pid, writer uid, pid named)
        other_user = daemon.markers._about(4321, 12345, 1)
        gone = daemon.markers._about(4321, 0, 4194304)
        root = daemon.markers._about(4321, 0, 1)
    # THEN only root (or the owner) may speak for another process; refusals are logged
    assert (other_user, gone, root) == (4321, 4321, 1)
    assert "not allowed" in caplog.text and "does not exist" in caplog.text


# ---------------------------------------------------------------------- scheduling


@pytest.mark.parametrize("text, want", [("nice:-10", "nice:-10"), (" NICE : 5 ", "nice:5"), ("fifo:10", "fifo:10"),
                                        ("rr:99", "rr:99"), ("off", "off")])
def test_scheduling_policies_parse(text, want):
    assert scheduling.parse(text) == want


def test_the_loop_runs_at_its_priority_and_gives_it_back(workdir):
    # GIVEN a daemon with the default policy, started from this thread
    before = os.getpriority(os.PRIO_PROCESS, 0)
    d = make_daemon(workdir)
    d.start()
    try:
        # THEN the loop's thread runs at nice -10 (root may raise it) while the daemon runs
        assert os.getpriority(os.PRIO_PROCESS, 0) == (-10 if os.geteuid() == 0 else before)
    finally:
        d.stop()
    # AND the thread has its own priority back once the daemon stopped
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_a_realtime_policy_that_is_refused_falls_back_to_nice(monkeypatch, caplog):
    # GIVEN a host that refuses real-time scheduling (a container without CAP_SYS_NICE)
    def refuse(*_args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    priority = scheduling.Priority("fifo:10")
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        # WHEN applied THEN the loop gets nice -10 instead, and the log says why
        with caplog.at_level(logging.WARNING):
            got = priority.apply()
        assert got == ("nice -10" if os.geteuid() == 0 else f"nice {before} (nice -10 not permitted)")
        assert "cannot run the loop at SCHED_FIFO 10 (Operation not permitted)" in caplog.text
    finally:
        monkeypatch.undo()
        priority.restore()
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_the_trailer_carries_the_exact_lost_total(workdir):
    # GIVEN a daemon whose probes dropped 7 events (a full ring buffer)
    d = make_daemon(workdir)
    d.start()
    d.probes.lost_total = 7
    pump(d, 0.05)
    # WHEN it stops THEN the trailer says so, besides the lost records, and the reader agrees
    d.stop()
    trace = load_trace(workdir / "out.mrec")
    assert trace.trailer["lost"] == 7 and trace.lost == 7


def test_tensors_a_pytorch_install_is_looked_for_when_a_process_binds_a_context(workdir):
    # GIVEN a daemon with --tensors and no PyTorch mapped at its start
    found: list = []
    daemon = make_daemon(workdir, tensors=True, find_torch=lambda extra: list(found))
    daemon.start()
    try:
        assert daemon.torch.header() == []
        # WHEN a process that maps a new install binds a context (long before the next rescan)
        found.append(FakeLibrary("/venv/torch/lib/libc10_cuda.so", 1, 77))
        daemon.probes.push(raw(Kind.CTX, pid=4000, ordinal=0, ts=time.monotonic_ns()))
        pump(daemon, 0.1)
        # THEN the install is probed already
        assert [t["path"] for t in daemon.torch.header()] == ["/venv/torch/lib/libc10_cuda.so"]
    finally:
        daemon.stop()
