"""memrec.mark() / memrec.phase(): never block, never raise, never corrupt the stream."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import memrec
from memrec import client as client_mod
from memrec.terms import protocol
from memrec.client import MarkerClient
from memrec.daemon.markers import peer_credentials


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="mrc", dir="/tmp")  # short: sun_path holds 108 bytes
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


class Listener:
    """A stand-in daemon: a listening socket whose connections the test reads (or not)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.sock.settimeout(5)

    def accept(self) -> socket.socket:
        conn, _ = self.sock.accept()
        return conn

    def close(self) -> None:
        self.sock.close()
        if self.path.exists():
            self.path.unlink()


def read_frames(
    conn: socket.socket, timeout: float = 0.2, decoder: protocol.FrameDecoder | None = None
) -> tuple[list[dict], int]:
    """Everything the peer sent so far, decoded (raises on a corrupt stream); and leftover bytes.

    Pass the same ``decoder`` to read one connection in several goes.
    """
    decoder = decoder if decoder is not None else protocol.FrameDecoder()
    out: list[dict] = []
    conn.settimeout(timeout)
    while True:
        try:
            data = conn.recv(1 << 20)
        except (TimeoutError, socket.timeout):
            break
        if not data:
            break
        out += decoder.feed(data)
    return out, decoder.pending


def test_no_daemon_is_a_quick_no_op(sock_dir):
    # GIVEN no daemon at the socket path
    c = MarkerClient(sock_dir / "none.sock")
    # WHEN markers are sent
    start = time.monotonic()
    results = [c.mark("x") for _ in range(1000)]
    elapsed = time.monotonic() - start
    # THEN every one returns False at once and is counted as dropped
    assert results == [False] * 1000
    assert c.dropped == 1000 and c.sent == 0
    assert elapsed < 0.5


def test_connect_is_retried_at_most_every_interval(sock_dir, monkeypatch):
    # GIVEN a client that found no daemon, counting its connect attempts
    path = sock_dir / "late.sock"
    c = MarkerClient(path, reconnect_interval=0.3)
    attempts = []
    real_connect = c._connect

    def counting():
        attempts.append(time.monotonic())
        return real_connect()

    monkeypatch.setattr(c, "_connect", counting)
    assert c.mark("a") is False
    # WHEN the daemon appears right away
    server = Listener(path)
    try:
        # THEN the client does not try again before the interval...
        assert c.mark("b") is False
        assert len(attempts) == 2 and c._last_attempt is not None
        # ...and connects once it has passed
        time.sleep(0.35)
        assert c.mark("c") is True
        conn = server.accept()
        frames, _ = read_frames(conn)
        # ...with the count of the markers dropped meanwhile ahead of the first one through
        assert [f["name"] for f in frames] == [client_mod.DROPPED_MARKER, "c"]
        assert frames[0]["values"]["no_daemon"] == 2
    finally:
        server.close()


def test_markers_dropped_before_the_daemon_is_up_are_counted_and_reported(sock_dir):
    # GIVEN a worker that marks 5 times before the daemon is up
    path = sock_dir / "late.sock"
    c = MarkerClient(path, reconnect_interval=0.0)
    before = time.monotonic_ns()
    assert [c.mark(f"early{i}") for i in range(5)] == [False] * 5
    server = Listener(path)
    try:
        # WHEN the daemon is up and the next markers get through
        assert c.mark("late", step=1) and c.mark("later")
        frames, _ = read_frames(server.accept())
    finally:
        server.close()
    # THEN one markers_dropped marker says how many were lost, why and when, ahead of them
    assert [f["name"] for f in frames] == [client_mod.DROPPED_MARKER, "late", "later"]
    report = frames[0]["values"]
    assert report["dropped"] == report["since_last_report"] == report["no_daemon"] == 5
    assert report["socket_full"] == report["connection_lost"] == report["busy"] == report["invalid"] == 0
    assert before <= report["first_drop_ts"] <= report["last_drop_ts"] <= frames[1]["ts"]
    assert (c.dropped, c.dropped_reported, c.sent) == (5, 5, 2)
    assert memrec.client.DROP_REASONS == ("no_daemon", "socket_full", "connection_lost", "busy", "invalid")


def test_flush_reports_drops_even_without_another_marker(sock_dir):
    # GIVEN markers dropped while no daemon answered, then a daemon that came up
    path = sock_dir / "exit.sock"
    c = MarkerClient(path, reconnect_interval=60.0)
    assert c.mark("a") is False and c.mark("b") is False
    server = Listener(path)
    try:
        # WHEN the client flushes (as it does at exit), inside the reconnect interval
        assert c.flush()
        frames, _ = read_frames(server.accept())
    finally:
        server.close()
    # THEN the daemon is told about both, and the report itself is not counted as a marker sent
    assert [f["name"] for f in frames] == [client_mod.DROPPED_MARKER]
    assert frames[0]["values"]["no_daemon"] == 2 and c.sent == 0


def test_marker_fields(sock_dir):
    # GIVEN a daemon
    server = Listener(sock_dir / "d.sock")
    c = MarkerClient(server.path)
    try:
        # WHEN a marker with values is sent
        before = time.monotonic_ns()
        assert c.mark("sized", "instant", gpu=1, tokens=10, frac=0.5, ok=True, note=None, path=Path("/x"))
        after = time.monotonic_ns()
        frames, _ = read_frames(server.accept())
    finally:
        server.close()
    # THEN the frame is a valid mark on CLOCK_MONOTONIC with this thread's native id
    (m,) = frames
    assert protocol.validate_message(m) is None
    assert m["name"] == "sized" and m["phase"] == "instant" and m["gpu"] == 1
    assert before <= m["ts"] <= after
    assert m["tid"] == __import__("threading").get_native_id()
    assert m["values"] == {"tokens": 10, "frac": 0.5, "ok": True, "note": None, "path": "/x"}


def test_peer_that_never_reads_never_blocks_and_stream_stays_whole(sock_dir):
    # GIVEN a daemon that accepts but never reads, and markers of mixed sizes (some ~60 KiB)
    server = Listener(sock_dir / "slow.sock")
    c = MarkerClient(server.path)
    try:
        assert c.mark("first")
        conn = server.accept()
        results = []
        slowest = 0.0
        # WHEN far more is sent than the socket buffer holds
        for i in range(400):
            big = "y" * (60_000 if i % 3 == 0 else 10)
            t0 = time.monotonic()
            results.append(c.mark(f"m{i}", i=i, big=big))
            slowest = max(slowest, time.monotonic() - t0)
        # THEN no call blocked, some markers were dropped and counted, none raised
        assert slowest < 0.05
        assert False in results and True in results
        assert c.dropped == results.count(False)
        # WHEN the daemon finally reads, and the client flushes its pending remainder
        decoder = protocol.FrameDecoder()
        frames, _ = read_frames(conn, decoder=decoder)
        for _ in range(100):
            if c.flush():
                break
            more, _ = read_frames(conn, 0.05, decoder)
            frames += more
        more, leftover = read_frames(conn, decoder=decoder)
        frames += more
    finally:
        server.close()
    # THEN every accepted marker arrived whole, in order, and nothing else did but the reports
    # of the dropped ones, whose last count is every drop (all for a full socket)
    sent_names = ["first"] + [f"m{i}" for i, ok in enumerate(results) if ok]
    assert [f["name"] for f in frames if f["name"] != client_mod.DROPPED_MARKER] == sent_names
    reports = [f["values"] for f in frames if f["name"] == client_mod.DROPPED_MARKER]
    assert reports and reports[-1]["dropped"] == reports[-1]["socket_full"] == c.dropped
    assert leftover == 0
    assert all(protocol.validate_message(f) is None for f in frames)


def test_daemon_gone_mid_stream(sock_dir):
    # GIVEN a connected client
    server = Listener(sock_dir / "gone.sock")
    c = MarkerClient(server.path, reconnect_interval=0.1)
    assert c.mark("before")
    conn = server.accept()
    # WHEN the daemon closes the connection and goes away
    conn.close()
    server.close()
    # THEN marks return False without raising, and the connection is dropped
    results = [c.mark("after") for _ in range(3)]
    assert results[-1] is False
    assert not c.connected
    # WHEN a daemon comes back THEN the client reconnects after the interval
    server = Listener(sock_dir / "gone.sock")
    try:
        time.sleep(0.15)
        assert c.mark("again") is True
        frames, _ = read_frames(server.accept())
        # ... and tells the daemon about the markers lost while it was gone
        assert [f["name"] for f in frames] == [client_mod.DROPPED_MARKER, "again"]
        report = frames[0]["values"]
        assert report["dropped"] == report["connection_lost"] + report["no_daemon"] == results.count(False)
    finally:
        server.close()


def test_sigpipe_default_does_not_kill_the_host(sock_dir):
    # GIVEN a host program that restored SIGPIPE's default action (dies on a broken pipe)
    server = Listener(sock_dir / "pipe.sock")
    script = textwrap.dedent(
        f"""
        import signal, sys, time
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        from memrec.client import MarkerClient
        c = MarkerClient({str(server.path)!r})
        assert c.mark("one")
        sys.stdout.write("connected\\n"); sys.stdout.flush()
        sys.stdin.readline()          # the daemon has closed its end
        for _ in range(5):
            c.mark("two", pad="x" * 1000)
        print("alive")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "connected"
        conn = server.accept()
        # WHEN the daemon's end closes and the program marks again
        conn.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=10)
    finally:
        server.close()
    # THEN the program lives on (MSG_NOSIGNAL: EPIPE, not SIGPIPE)
    assert proc.returncode == 0, f"killed by signal {-proc.returncode}" if proc.returncode < 0 else out
    assert "alive" in out


def test_forked_child_opens_its_own_connection(sock_dir):
    # GIVEN a client connected in the parent
    server = Listener(sock_dir / "fork.sock")
    c = MarkerClient(server.path)
    try:
        assert c.mark("parent")
        parent_conn = server.accept()
        # WHEN a forked child marks
        pid = os.fork()
        if pid == 0:
            ok = c.mark("child")
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        child_conn = server.accept()
        # THEN the child's marker came on a new connection, credited to the child's pid
        assert peer_credentials(child_conn)[0] == pid
        assert peer_credentials(parent_conn)[0] == os.getpid()
        assert [f["name"] for f in read_frames(child_conn)[0]] == ["child"]
        assert [f["name"] for f in read_frames(parent_conn)[0]] == ["parent"]
        # AND the parent's connection still works
        assert c.mark("parent again")
        assert [f["name"] for f in read_frames(parent_conn)[0]] == ["parent again"]
    finally:
        server.close()


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (("",), {}),
        (("x",), {"phase": "sideways"}),
        (("x",), {"gpu": "zero"}),
        (("x", "instant", -3), {}),
        (("x",), {"blob": "z" * 70_000}),
    ],
    ids=["empty-name", "bad-phase", "bad-gpu", "negative-gpu", "too-large"],
)
def test_bad_arguments_return_false(sock_dir, args, kwargs):
    # GIVEN a daemon WHEN mark() gets arguments the protocol refuses THEN False, no exception
    server = Listener(sock_dir / "bad.sock")
    try:
        c = MarkerClient(server.path)
        assert c.mark(*args, **kwargs) is False
        assert c.dropped == 1
    finally:
        server.close()


def test_odd_values_are_converted_not_refused(sock_dir):
    # GIVEN values that are not protocol scalars (a list, an object with .item(), a huge int)
    class Scalar:
        def item(self):
            return 3

    server = Listener(sock_dir / "odd.sock")
    try:
        c = MarkerClient(server.path)
        # WHEN they are sent THEN they arrive as scalars
        assert c.mark("odd", lst=[1, 2], s=Scalar(), huge=2**70)
        (m,), _ = read_frames(server.accept())
    finally:
        server.close()
    assert m["values"] == {"lst": "[1, 2]", "s": 3, "huge": str(2**70)}


@pytest.fixture
def default_client(sock_dir, monkeypatch):
    """memrec.mark/phase's process-wide client, pointed at a test socket."""
    server = Listener(sock_dir / "default.sock")
    monkeypatch.setenv(protocol.SOCKET_ENV, str(server.path))
    monkeypatch.setattr(client_mod, "_client", None)
    yield server
    server.close()


def test_phase_marks_begin_and_end(default_client):
    # GIVEN the public API and a daemon
    # WHEN a block runs inside memrec.phase
    with memrec.phase("load", gpu=0, model="m"):
        pass
    frames, _ = read_frames(default_client.accept())
    # THEN a begin (with the values) and an end arrive
    assert [(f["name"], f["phase"]) for f in frames] == [("load", "begin"), ("load", "end")]
    assert frames[0]["values"] == {"model": "m"} and frames[0]["gpu"] == 0
    assert "error" not in frames[1]["values"]
    assert frames[0]["ts"] <= frames[1]["ts"]


def test_phase_end_carries_the_error_and_reraises(default_client):
    # GIVEN a block that raises
    class Boom(RuntimeError):
        pass

    # WHEN it runs inside memrec.phase THEN the same exception comes out
    with pytest.raises(Boom, match="out of memory"):
        with memrec.phase("kv_cache"):
            raise Boom("out of memory")
    frames, _ = read_frames(default_client.accept())
    # AND the end marker says what went wrong
    assert frames[1]["phase"] == "end"
    assert frames[1]["values"]["error"] == "Boom: out of memory"


def test_phase_as_decorator(default_client):
    @memrec.phase("step")
    def step(x):
        return x * 2

    assert step(21) == 42
    frames, _ = read_frames(default_client.accept())
    assert [f["phase"] for f in frames] == ["begin", "end"]


def test_public_mark_without_daemon(monkeypatch, sock_dir):
    # GIVEN no daemon for the process-wide client
    monkeypatch.setenv(protocol.SOCKET_ENV, str(sock_dir / "absent.sock"))
    monkeypatch.setattr(client_mod, "_client", None)
    # WHEN the public API is used THEN it does nothing and says so with False
    assert memrec.mark("x") is False
    with memrec.phase("y"):
        pass
    assert client_mod.stats()["dropped"] == 3


SIGNAL_SCRIPT = """
import json, signal, socket, sys, threading, time
from memrec.terms import protocol
from memrec.client import MarkerClient

path = sys.argv[1]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen()
c = MarkerClient(path)
assert c.mark("start")
conn, _ = server.accept()
received, decoder, done = [], protocol.FrameDecoder(), threading.Event()

def reader():
    conn.settimeout(0.05)
    while not done.is_set():
        try:
            data = conn.recv(1 << 20)
        except socket.timeout:
            continue
        if not data:
            break
        received.extend(decoder.feed(data))  # raises on a corrupt stream

t = threading.Thread(target=reader)
t.start()
handler, depth = [], [0, 0]  # handlers running inside one another: now, deepest

def on_alarm(*_):
    depth[0] += 1
    depth[1] = max(depth)
    handler.append(c.mark("from-handler", n=len(handler)))
    depth[0] -= 1

signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
main = [c.mark("main", i=i, pad="p" * 3000) for i in range(3000)]
signal.setitimer(signal.ITIMER_REAL, 0)
while not c.flush():
    time.sleep(0.01)
time.sleep(0.2)
done.set()
t.join()
names = [f["name"] for f in received]
print(json.dumps({"main_sent": main.count(True), "main_got": names.count("main"),
                  "handler_calls": len(handler), "handler_sent": handler.count(True),
                  "handler_got": names.count("from-handler"), "pending": decoder.pending,
                  "deepest": depth[1], "invalid": c.drops["invalid"]}))
"""


def run_signal_child(script: str, sock: Path) -> dict:
    """Run ``script`` in a child (so that a deadlock fails the test instead of hanging it) and
    return the JSON it prints."""
    try:
        proc = subprocess.run([sys.executable, "-c", script, str(sock)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("mark() deadlocked when called from a signal handler")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_marks_from_a_signal_handler_never_deadlock_or_corrupt(sock_dir):
    # GIVEN a program that marks in its main loop and also from a signal handler firing every
    # 0.5 ms, and a daemon that reads everything
    # WHEN it runs
    r = run_signal_child(SIGNAL_SCRIPT, sock_dir / "sig.sock")
    # THEN every frame the daemon got is whole, and exactly the markers reported sent arrived
    assert r["handler_calls"] > 0, "the timer never fired"
    assert r["main_got"] == r["main_sent"] and r["handler_got"] == r["handler_sent"]
    assert r["pending"] == 0
    # AND no handler waited for the lock its own thread held: such a wait is interrupted by the
    # next signal, whose handler waits too, ~250 deep (RecursionError drops count as invalid);
    # the pile-up can unwind by luck (a descheduled process gets one signal for many periods), so
    # the timeout alone misses it on a loaded machine
    assert r["deepest"] < 10 and r["invalid"] == 0, r


# A child connected to a listening socket, and ``when_lock_taken(then)``: ``then()`` runs in the
# instant after the client's lock is taken (sys.setprofile's c_return of the lock's acquire is that
# instant: CPython runs a pending handler right after the call returns).
LOCK_TAKEN_PROLOGUE = """
import json, signal, socket, sys, threading
from memrec.terms import protocol
from memrec.client import MarkerClient

server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen()
c = MarkerClient(sys.argv[1])
assert c.mark("start")
conn, _ = server.accept()
lock_types = (type(threading.Lock()), type(threading.RLock()))

def when_lock_taken(then):
    def hook(frame, event, arg):
        if event == "c_return" and getattr(arg, "__name__", "") == "acquire" \\
                and type(getattr(arg, "__self__", None)) in lock_types:
            sys.setprofile(None)
            then()
    sys.setprofile(hook)
"""


# A signal that arrives in the instant after mark() took its lock. The handler's mark must see
# that its own thread is inside and drop at once: waiting for the lock can never end (the thread
# holding it is the one the handler interrupted), and the wait is interruptible, so the next timer
# signal's handler re-enters and waits too, without end.
SIGNAL_AFTER_LOCK_SCRIPT = LOCK_TAKEN_PROLOGUE + """
handler, depth = [], [0, 0]  # depth: now, deepest

def on_alarm(*_):
    depth[0] += 1
    depth[1] = max(depth)
    handler.append(c.mark("from-handler"))
    depth[0] -= 1

signal.signal(signal.SIGALRM, on_alarm)

def alarms():
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
    signal.raise_signal(signal.SIGALRM)  # its handler runs before the profile hook returns

when_lock_taken(alarms)
main = c.mark("main")
signal.setitimer(signal.ITIMER_REAL, 0)
first_handler_call = handler[0]
c.close()
conn.settimeout(5)
decoder, names = protocol.FrameDecoder(), []
while data := conn.recv(1 << 16):
    names += [f["name"] for f in decoder.feed(data)]
print(json.dumps({"main": main, "first_handler_call": first_handler_call, "deepest": depth[1],
                  "busy": c.drops["busy"], "invalid": c.drops["invalid"],
                  "handler_sent": handler.count(True), "names": names, "pending": decoder.pending}))
"""


def test_a_mark_from_a_signal_right_after_the_lock_was_taken_is_dropped_at_once(sock_dir):
    # GIVEN a signal that arrives just after mark() took its lock, its handler marking, and a
    # 0.5 ms timer that keeps signalling
    # WHEN the mark runs
    r = run_signal_child(SIGNAL_AFTER_LOCK_SCRIPT, sock_dir / "w.sock")
    # THEN the handler's mark was dropped as busy at once: handlers did not pile up inside one
    # another (waiting for the lock, they nest until the recursion limit, ~250 deep, whose
    # RecursionError drops count as invalid)
    assert r["main"] is True and r["first_handler_call"] is False and r["busy"] >= 1
    assert r["deepest"] < 10 and r["invalid"] == 0, r
    # AND the interrupted mark went out whole, after the report of the drop, and so did every
    # later handler mark reported sent
    assert r["names"] == ["start", "markers_dropped", "main"] + ["from-handler"] * r["handler_sent"]
    assert r["pending"] == 0


# A KeyboardInterrupt (a signal handler that raises) in the instant after mark() took its lock:
# the interrupted mark is lost, and every later mark must go out, not find the lock held forever.
RAISE_AFTER_LOCK_SCRIPT = LOCK_TAKEN_PROLOGUE + """
# Python's handler, which raises KeyboardInterrupt: a child started from a shell's background job
# inherits SIGINT ignored, and Python then installs none
signal.signal(signal.SIGINT, signal.default_int_handler)
when_lock_taken(lambda: signal.raise_signal(signal.SIGINT))
try:
    c.mark("interrupted")
    interrupted = False
except KeyboardInterrupt:
    interrupted = True
after = []  # from another thread: a lock left held by the main thread would keep it out
worker = threading.Thread(target=lambda: after.extend(c.mark(f"after-{i}") for i in range(3)))
worker.start()
worker.join()
c.close()
conn.settimeout(5)
decoder, names = protocol.FrameDecoder(), []
while data := conn.recv(1 << 16):
    names += [f["name"] for f in decoder.feed(data)]
print(json.dumps({"interrupted": interrupted, "after": after, "busy": c.drops["busy"], "names": names}))
"""


def test_an_interrupt_right_after_the_lock_was_taken_does_not_keep_it(sock_dir):
    # GIVEN a KeyboardInterrupt raised the instant after mark() took its lock
    r = run_signal_child(RAISE_AFTER_LOCK_SCRIPT, sock_dir / "k.sock")
    # THEN that mark is interrupted, and the next marks go out (before: the lock stayed held and
    # each later mark waited and was dropped as busy)
    assert r["interrupted"] is True
    assert r["after"] == [True, True, True] and r["busy"] == 0, r
    assert r["names"][-3:] == ["after-0", "after-1", "after-2"]
