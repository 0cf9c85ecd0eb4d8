"""Issue 23 (the daemon's half): a user who may only send markers cannot steer, flood or starve
the root daemon. One section per numbered item of the issue; each attacks as the review did, as
user nobody switched with ``setpriv``, against the real daemon loop with stand-in probes
(tests/unit/daemon_fakes.py): the socket, /proc, the writer, the reader and the commands are real.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memrec.client import MarkerClient
from memrec.daemon.intake import Budget
from memrec.daemon.markers import OPEN_PER_CONNECTION
from memrec.daemon.metrics import MAX_OPEN
from memrec.daemon.metrics import PhasePeaks
from memrec.daemon.notify import Notifier
from memrec.daemon.service import Service
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.probes.procinfo import MAX_CMDLINE_BYTES
from memrec.trace.reader import load_trace

from tests.unit.daemon_fakes import raw
from tests.unit.test_daemon_unit import make_daemon
from tests.unit.test_daemon_unit import pump
from tests.unit.test_daemon_unit import workdir  # noqa: F401  (fixture)
from tests.unit.test_hardening import small_disk  # noqa: F401  (fixture)
from tests.utils import MiB

NOBODY = 65534
SETPRIV = shutil.which("setpriv")
pytestmark = pytest.mark.skipif(SETPRIV is None or os.geteuid() != 0, reason="needs root and setpriv")

#: A client in a child process: ``argv[1]`` the socket, then what to send (see _client_code).
CLIENT = """
import socket, sys, time
from memrec.terms import protocol
path, what, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
if what == "flood":      # n markers as fast as the socket takes them
    frame = protocol.encode_frame(protocol.make_mark("flood" * 40, "instant", time.monotonic_ns(), 1, None,
                                                     {f"k{i}": "v" * 190 for i in range(int(sys.argv[4]))}))
    for _ in range(n):
        s.sendall(frame)
elif what == "begins":   # n begin markers with distinct names
    s.setblocking(True)
    for i in range(n):
        s.sendall(protocol.encode_frame(protocol.make_mark(f"p{i}", "begin", time.monotonic_ns(), 1, None, {})))
elif what == "connect":  # connect, send one marker, say so, then stay for n seconds
    s.sendall(protocol.encode_frame(protocol.make_mark("hello", "instant", time.monotonic_ns(), 1, None, {})))
    print("done", flush=True)
    time.sleep(n)
    sys.exit()
print("done", flush=True)
"""


def as_nobody(*args: str, env: dict | None = None, argv_padding: int = 0) -> subprocess.Popen:
    """Run the CLIENT code as user and group nobody (setpriv), with ``argv_padding`` bytes of
    extra arguments (in 100 KB pieces: one argument may not pass 128 KiB)."""
    padding = ["x" * 100_000] * (argv_padding // 100_000)
    return subprocess.Popen(
        [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", CLIENT,
         *args, *padding],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def pump_until(d, proc: subprocess.Popen, seconds: float = 20) -> None:
    """Run the daemon's loop until ``proc`` exits (it needs the loop to read what it sends)."""
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        pump(d, 0.02)
    assert proc.poll() is not None, "the client did not finish"
    pump(d, 0.05)


@pytest.fixture
def daemon(workdir):  # noqa: F811
    os.chmod(workdir, 0o755)
    d = make_daemon(workdir, socket_mode=0o666)
    d.start()
    yield d
    d.stop()


# ------------------------------------------------------------------------------ 1. pid reuse

def spawn_at_pid(pid: int, argv: list[str], env: dict) -> subprocess.Popen:
    """Start ``argv`` with process id ``pid`` (root sets the kernel's last pid first: the reuse an
    attacker waits for); skip when other processes keep taking the pid first."""
    for _ in range(200):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        proc = subprocess.Popen(argv, env=env)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    pytest.skip("could not get the pid back (a busy host)")


def test_1_a_reused_pid_is_not_filed_under_the_last_clients_command_line_and_rank(daemon):
    # GIVEN a client of another user with RANK=7 CUDA_VISIBLE_DEVICES=1, who connected and left
    attacker = as_nobody(daemon.config.socket_path.as_posix(), "connect", "0",
                         env={"RANK": "7", "CUDA_VISIBLE_DEVICES": "1"})
    pump_until(daemon, attacker)
    pid = attacker.pid
    assert daemon.stamper.processes[pid].rank == {"rank": 7}
    # WHEN a victim gets its pid before the daemon looked again, and makes a CUDA call on ordinal 0
    victim = spawn_at_pid(pid, ["sleep", "30"], env={"PATH": os.environ["PATH"]})
    try:
        daemon.probes.push(raw(Kind.ALLOC, ts=time.monotonic_ns(), pid=pid, tid=pid, ordinal=0, ptr=1 << 20,
                               size=MiB))
        pump(daemon, 0.05)
        # THEN the victim is itself: its own command line, no rank, ordinal 0 is GPU 0 (not 1)
        info = daemon.stamper.processes[pid]
        assert info.cmdline == ["sleep", "30"] and info.rank == {} and info.cuda_visible_devices is None
        daemon.stop()
        trace = load_trace(daemon.files[0])
        assert trace.processes[pid].cmdline == ["sleep", "30"]
        assert trace.events["gpu"].tolist() == [0]
        assert trace.trailer["processes_expired"] >= 1
    finally:
        victim.kill()
        victim.wait()


def test_1_a_marker_clients_entry_goes_when_its_process_is_gone(daemon):
    clients = [as_nobody(daemon.config.socket_path.as_posix(), "connect", "60") for _ in range(5)]
    for c in clients:
        assert b"done" in c.stdout.readline()
    pump(daemon, 0.1)
    assert all(c.pid in daemon.stamper.processes for c in clients)
    for c in clients:
        c.kill()
        c.wait()
    pump(daemon, 1.1)  # one sweep
    assert not any(c.pid in daemon.stamper.processes for c in clients)
    assert daemon.stamper.expired >= 5


# ------------------------------------------------------------------------------ 2. connections alone

def test_2_a_1mb_argv_costs_the_trace_at_most_the_capped_command_line(daemon):
    # GIVEN 20 connects of processes with a 1 MB argv (the review used 200 for 192 MB of trace),
    # each kept alive until the daemon has its process record: one that exits first has no /proc
    # left to read (on a loaded machine the loop may get there late)
    before = daemon.writer.bytes_written
    clients = []
    try:
        for _ in range(20):
            c = as_nobody(daemon.config.socket_path.as_posix(), "connect", "30", argv_padding=1_000_000)
            clients.append(c)
            assert b"done" in c.stdout.readline(), c.stderr.read()
            deadline = time.monotonic() + 20
            while c.pid not in daemon.stamper.processes and time.monotonic() < deadline:
                pump(daemon, 0.02)
    finally:
        for c in clients:
            c.kill()
            c.wait()
    daemon.writer.flush()
    # THEN each kept at most MAX_CMDLINE_BYTES of command line, and the trace grew by about that
    grown = daemon.writer.bytes_written - before
    assert grown < 20 * (MAX_CMDLINE_BYTES + 1024), grown
    kept = [p for p in daemon.stamper.processes.values() if any(a.startswith("x" * 100) for a in p.cmdline)]
    assert kept and all(sum(map(len, p.cmdline)) <= MAX_CMDLINE_BYTES + 3 for p in kept)


def test_2_connects_over_the_uids_budget_leave_no_process_record_and_are_counted(daemon):
    daemon.intake.budget = Budget(daemon.clock, rate=100, bytes_rate=1000, burst=1.0)  # less than one record
    clients = [as_nobody(daemon.config.socket_path.as_posix(), "connect", "0") for _ in range(3)]
    for c in clients:
        pump_until(daemon, c)
    assert not any(c.pid in daemon.stamper.processes for c in clients)
    daemon.stop()
    trace = load_trace(daemon.files[0])
    # (each client's /proc was asked for twice: at its connect and at its marker)
    assert trace.trailer["process_reads_refused"] == 6 and not any(c.pid in trace.processes for c in clients)
    assert sum(m.name == "hello" for m in trace.markers) == 3  # their markers still pass


def test_2_new_files_that_open_above_the_rotation_size_do_not_rotate_at_once(workdir):  # noqa: F811
    # GIVEN --rotate-size 20k and 25 marker clients with a 1 MB argv that stay connected: every
    # new file's process table alone is above the rotation size
    os.chmod(workdir, 0o755)
    d = make_daemon(workdir, socket_mode=0o666, rotate_bytes=20_000)
    d.start()
    clients = []
    try:
        for _ in range(25):
            c = as_nobody(d.config.socket_path.as_posix(), "connect", "30", argv_padding=1_000_000)
            clients.append(c)
            line = c.stdout.readline()
            assert b"done" in line, c.stderr.read()
            pump(d, 0.02)
        # WHEN a new file starts with their 25 process records (about 110 kB), and the daemon runs
        # on for 3 s with a trickle of events
        d.rotate("test")
        opened = len(d.files)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            d.probes.push(raw(Kind.ALLOC, ts=time.monotonic_ns(), pid=os.getpid(), tid=1, ordinal=0,
                              ptr=random.getrandbits(40) << 8, size=MiB))
            pump(d, 0.05)
    finally:
        for c in clients:
            c.kill()
            c.wait()
        d.stop()
    # THEN that file never rotated (it did at every tick before: 172 rotations in 20 s)
    assert len(d.files) == opened, (opened, len(d.files))
    assert all(load_trace(p).trailer is not None for p in d.files)


# ------------------------------------------------------------------------------ 3. marker flood

def test_3_a_flood_is_cut_to_the_uids_budget_and_counted_and_root_and_events_pass(daemon, caplog):
    # GIVEN a small budget (100 markers/s, 64 KiB/s, 1 s of burst) and a user who floods
    daemon.intake.budget = Budget(daemon.clock, rate=100, bytes_rate=64 << 10, burst=1.0)
    flood = as_nobody(daemon.config.socket_path.as_posix(), "flood", "20000", "2")
    root = MarkerClient(daemon.config.socket_path)
    t0 = time.monotonic()
    n_events = 0
    while flood.poll() is None and time.monotonic() - t0 < 30:
        daemon.probes.push(raw(Kind.ALLOC, ts=time.monotonic_ns(), pid=os.getpid(), tid=1, ordinal=0,
                               ptr=(n_events + 1) << 12, size=4096))
        n_events += 1
        assert root.mark("root", n=n_events)
        pump(daemon, 0.01)
    pump(daemon, 0.1)
    seconds = time.monotonic() - t0
    stats = daemon.stats()
    daemon.stop()
    # THEN the user's markers passed at most the budget; the rest were counted, and said
    trace = load_trace(daemon.files[0])
    floods = [m for m in trace.markers if m.name.startswith("flood")]
    assert len(floods) <= 100 * (1 + seconds) + 5
    dropped = trace.trailer["markers_dropped"]["budget"]
    assert dropped == 20000 - len(floods) and stats["markers_dropped"]["budget"] == dropped
    assert 1 <= sum("over its marker budget" in r.message for r in caplog.records) <= seconds / 10 + 2
    # AND root's markers and every driver event passed
    assert sum(m.name == "root" for m in trace.markers) == n_events
    assert len(trace.events) == n_events


def test_3_memrec_mark_over_the_budget_says_its_marker_was_dropped(workdir):  # noqa: F811
    os.chmod(workdir, 0o755)
    d = make_daemon(workdir, socket_mode=0o666)
    d.start()
    d.intake.budget = Budget(d.clock, rate=1, bytes_rate=1 << 20, burst=1.0)  # one marker, then none
    results = []
    try:
        for name in ("first", "second"):
            proc = subprocess.Popen([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                     sys.executable, "-m", "memrec", "mark", name, "--socket", str(d.config.socket_path)],
                                    env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                                    stderr=subprocess.PIPE, text=True)
            pump_until(d, proc)
            results.append((proc.returncode, proc.stderr.read()))
    finally:
        d.stop()
    assert results[0] == (0, "")
    code, err = results[1]
    assert code == 75 and "dropped the marker: your user is over its marker budget" in err and err.count("\n") == 1
    assert [m.name for m in load_trace(d.files[0]).markers] == ["first"]


# ------------------------------------------------------------------------------ 4. open phases

def test_4_open_phases_are_capped_per_uid_and_per_connection(daemon):
    # GIVEN a user who begins 3,000 phases of distinct names
    flood = as_nobody(daemon.config.socket_path.as_posix(), "begins", "3000")
    pump_until(daemon, flood)
    # THEN 1,024 are open, the rest dropped and counted
    assert daemon.intake.open_phases.open_count(NOBODY) == 1024
    assert daemon.intake.dropped["open_phases"] == 3000 - 1024
    # AND when the user's process is gone its phases expire
    pump(daemon, 1.1)
    assert daemon.intake.open_phases.open_count(NOBODY) == 0
    # AND one connection (root's too) holds at most OPEN_PER_CONNECTION
    root = MarkerClient(daemon.config.socket_path)
    for i in range(OPEN_PER_CONNECTION + 10):
        root.mark(f"r{i}", phase="begin")
        if i % 100 == 0:
            pump(daemon, 0.02)
    pump(daemon, 0.1)
    assert daemon.intake.dropped["open_phases"] == 3000 - 1024 + 10


def test_4_the_phase_peak_gauge_never_walks_an_unbounded_set():
    # GIVEN 300,000 open phases of distinct names (sample() took 220 ms here before)
    peaks = PhasePeaks()
    for i in range(300_000):
        peaks.marker(Marker(ts=i, pid=1 + i % 7, uid=1000, tid=1, name=f"p{i}", phase="begin"))
    assert len(peaks.open) == MAX_OPEN and peaks.forgotten == 300_000 - MAX_OPEN
    t = time.perf_counter()
    for _ in range(100):
        peaks.sample({0: 1 << 30, 1: 2 << 30})
    per_sample = (time.perf_counter() - t) / 100
    assert per_sample < 0.002, per_sample
    assert len(peaks.values()) == 2 * 32


# ------------------------------------------------------------------------------ 8. retention

def _service_daemon(output: str, keep: int):
    d = make_daemon(Path(output).parent if not output.endswith("/") else Path(output).parent.parent,
                    output=output)
    service = Service(keep_files=keep, notifier=Notifier({}))
    d.start()
    service.started(d)
    return d, service


def test_8_keep_deletes_only_its_own_files_across_restarts_and_through_a_linked_folder(workdir):  # noqa: F811
    real = workdir / "real"
    real.mkdir()
    (workdir / "traces").symlink_to(real)
    # GIVEN an operator's copy and a planted file dated 2030, both named like traces
    copy = real / "memrec-host-20260101-000000-1-0000abcd.mrec"
    copy.write_bytes(b"operator's copy")
    planted = real / "memrec-planted.mrec"
    planted.write_bytes(b"x")
    os.utime(planted, (1_900_000_000, 1_900_000_000))
    # WHEN a daemon with --keep 2 writes into the linked folder and rotates 5 times, twice (a restart)
    written = []
    for _ in range(2):
        d, service = _service_daemon(f"{workdir}/traces/", keep=2)
        try:
            for _ in range(5):
                d.rotate("test")
            service._prune(d)
        finally:
            d.stop()
        written += d.files
        assert all(p.parent == real for p in d.files)
    service._prune(d)
    # THEN only the 2 newest files it wrote are left, and the copy and the planted file untouched
    left = sorted(p.name for p in real.iterdir() if not p.name.startswith("."))
    assert left == sorted([copy.name, planted.name, written[-2].name, written[-1].name])
    assert copy.read_bytes() == b"operator's copy"


def test_8_a_linked_output_folder_of_another_user_is_refused(workdir):  # noqa: F811
    real = workdir / "real"
    real.mkdir()
    link = workdir / "traces"
    link.symlink_to(real)
    os.lchown(link, NOBODY, NOBODY)
    d = make_daemon(workdir, output=f"{link}/")
    with pytest.raises(Exception, match="symbolic link of uid 65534"):
        d.start()
    assert list(real.iterdir()) == []


# ------------------------------------------------------------------------------ 9. full disk and flood

def test_9_a_full_disk_and_a_flood_lose_no_event_and_the_log_tells_the_truth(workdir, small_disk, caplog):  # noqa: F811
    # GIVEN an 8 MiB file system (markers stop below its eighth) and a flood of 16 MB with a
    # budget that lets it through
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    disk_8m = small_disk
    os.chmod(workdir, 0o755)
    d = make_daemon(workdir, socket_mode=0o666, output=disk_8m / "out.mrec", flush_interval=0.01)
    d.start()
    d.intake.budget = Budget(d.clock, rate=1e6, bytes_rate=1e9, burst=1.0)
    flood = as_nobody(d.config.socket_path.as_posix(), "flood", "4000", "20")
    pump_until(d, flood)
    assert d.intake.dropped["disk"] > 0, "the disk never got low"
    # WHEN 30,000 allocations come while the flood goes on
    for batch in range(30):
        d.probes.push(*[raw(Kind.ALLOC, ts=time.monotonic_ns(), pid=os.getpid(), tid=1, ordinal=0,
                            ptr=(batch * 1000 + i + 1) << 12, size=4096) for i in range(1000)])
        flood = as_nobody(d.config.socket_path.as_posix(), "flood", "20", "20") if batch % 10 == 0 else flood
        pump(d, 0.02)
    pump_until(d, flood)
    d.stop()
    # THEN every allocation reached the file, with a trailer that counts the markers dropped
    trace = load_trace(d.files[0])
    assert len(trace.events) == 30_000 and trace.trailer is not None
    assert trace.trailer["markers_dropped"]["disk"] == d.intake.dropped["disk"] > 0
    assert not any("already complete" in r.message for r in caplog.records)


def test_9_stopped_with_the_disk_still_full_the_log_says_the_trailer_is_missing(workdir, small_disk, caplog):  # noqa: F811
    from tests.unit.test_hardening import _fill_until_stalled

    d = make_daemon(workdir, output=small_disk / "out.mrec", flush_interval=0.01)
    d.start()
    _fill_until_stalled(d, os.getpid())
    d.stop()
    assert any("WITHOUT its trailer" in r.message for r in caplog.records)
    assert not any("already complete" in r.message for r in caplog.records)


# ------------------------------------------------------------------------------ 10. refused rotation

def test_10_a_refused_rotation_backs_off_says_so_once_and_resumes_past_the_link(workdir, caplog):  # noqa: F811
    # GIVEN --rotate-size 2k and a link planted at the next part's name
    secret = workdir / "secret"
    secret.write_text("root's data")
    (workdir / "out.1.mrec").symlink_to(secret)
    d = make_daemon(workdir, rotate_bytes=2_000)
    d.start()
    caplog.set_level(logging.INFO)
    # WHEN events keep coming for 3 s
    end = time.monotonic() + 3
    n = 0
    while time.monotonic() < end:
        d.probes.push(*[raw(Kind.ALLOC, ts=time.monotonic_ns(), pid=os.getpid(), tid=random.getrandbits(31),
                            ordinal=0, ptr=random.getrandbits(40) << 8, size=MiB) for _ in range(50)])
        n += 50
        pump(d, 0.02)
    d.stop()
    # THEN one ERROR line (not 698 in 5 s), the link untouched, and rotation went on past it
    refused = [r for r in caplog.records if "cannot rotate" in r.message]
    assert len(refused) == 1 and refused[0].levelno == logging.ERROR
    assert secret.read_text() == "root's data"
    assert d.files[1].name == "out.2.mrec" and len(d.files) >= 3
    assert any("rotation works again after 1 refused" in r.message for r in caplog.records)
    assert sum(len(load_trace(p).events) for p in d.files) == n


# ------------------------------------------------------------------------------ memrec mark

def test_mark_against_a_stopped_daemon_says_it_was_sent_and_exits_75(workdir):  # noqa: F811
    d = make_daemon(workdir)
    d.start()
    try:
        # WHEN the daemon's loop does not run (as under SIGSTOP) while memrec mark waits
        proc = subprocess.run([sys.executable, "-m", "memrec", "mark", "stopped", "--socket",
                               str(d.config.socket_path)], capture_output=True, text=True, timeout=30)
        # THEN it says the marker was sent and may be recorded, with its own exit code
        assert proc.returncode == 75, proc.stderr
        assert "was sent and is recorded if the daemon resumes" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        # AND when the loop runs again (SIGCONT) the marker is recorded, as it said
        pump(d, 0.1)
    finally:
        d.stop()
    assert [m.name for m in load_trace(d.files[0]).markers] == ["stopped"]


@pytest.mark.parametrize("words", [["\udcff"], ["ok", "k=\udcffx"], ["ok", "\udcff=1"]])
def test_mark_with_a_name_that_is_not_utf8_gets_one_clean_line(words):
    argv = [os.fsencode(w) for w in words]
    proc = subprocess.run([sys.executable.encode(), b"-m", b"memrec", b"mark", *argv, b"--socket", b"/nonexistent"],
                          capture_output=True, timeout=30)
    assert proc.returncode == 2
    err = proc.stderr.decode()
    assert "is not valid UTF-8" in err and "\\xff" in err and "codec" not in err
    assert len(err.strip().splitlines()) == 1


def test_mark_sigstop_with_a_real_loop(workdir):  # noqa: F811
    """The same with the daemon's loop in a process of its own, stopped and continued with signals."""
    code = (
        "import sys, time\n"
        "from tests.unit.test_daemon_unit import make_daemon, pump\n"
        "from pathlib import Path\n"
        "d = make_daemon(Path(sys.argv[1]))\n"
        "d.start(); print('up', flush=True)\n"
        "end = time.monotonic() + 20\n"
        "while time.monotonic() < end and not Path(sys.argv[1], 'stop').exists(): pump(d, 0.05)\n"
        "d.stop()\n"
    )
    loop = subprocess.Popen([sys.executable, "-c", code, str(workdir)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2])
    try:
        assert loop.stdout.readline().strip() == "up"
        os.kill(loop.pid, signal.SIGSTOP)
        proc = subprocess.run([sys.executable, "-m", "memrec", "mark", "stopped", "--socket",
                               str(workdir / "s.sock")], capture_output=True, text=True, timeout=30)
        os.kill(loop.pid, signal.SIGCONT)
        assert proc.returncode == 75, proc.stderr
        time.sleep(0.3)
        (workdir / "stop").touch()
        loop.wait(30)
    finally:
        if loop.poll() is None:
            loop.kill()
            loop.wait()
    assert [m.name for m in load_trace(workdir / "out.mrec").markers] == ["stopped"]
