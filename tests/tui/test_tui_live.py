"""Live mode against real Unix sockets: a scripted server speaking the subscriber protocol, and
the real daemon (with fake probes, no BPF) — follow, pause, stale warning, reconnect."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
import synth
from conftest import FixedClock

from memrec.trace.frames import encode_frame
from memrec.tui.app import MemrecApp
from memrec.tui.sources import LiveSource

SEC = synth.SEC


@pytest.fixture
def sockdir():
    d = Path(tempfile.mkdtemp(prefix="mrt", dir="/tmp"))  # sun_path is short
    yield d
    shutil.rmtree(d, ignore_errors=True)


class ScriptedDaemon:
    """Accepts subscribers on ``path`` and sends them ``records`` (then more on demand)."""

    def __init__(self, path: Path, records: list[dict]) -> None:
        self.path = path
        self.records = records
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen()
        self.clients: list[socket.socket] = []
        self.subscribed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            data = conn.recv(4096)
            assert b"subscribe" in data
            for rec in self.records:
                conn.sendall(encode_frame(rec))
            self.clients.append(conn)
            self.subscribed.set()

    def send(self, rec: dict) -> None:
        for c in self.clients:
            c.sendall(encode_frame(rec))

    def close(self) -> None:
        self.listener.close()
        for c in self.clients:
            c.close()
        self.path.unlink(missing_ok=True)


def first_records(trace, upto: int) -> list[dict]:
    from memrec.trace.format import finalize_header

    header = finalize_header(trace.header)
    return [
        header,
        {"type": "keyframe", "ts": synth.T0, "event_index": 0, "state": trace.keyframes[0].state},
        {"type": "events", "events": trace.events[:upto]},
        {"type": "nvml", "samples": trace.nvml[: 2 * 30]},  # up to 2.9 s: before event 59
    ]


async def wait_for(pilot, cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.05)
    await pilot.pause(0.15)


async def test_follows_pauses_warns_when_stale_and_reconnects(sockdir, trace):
    path = sockdir / "memrec.sock"
    server = ScriptedDaemon(path, first_records(trace, 40))
    clock = FixedClock()
    source = LiveSource(str(path), backoff=(0.05, 0.2))
    app = MemrecApp(source, clock=clock, stale_after=3.0, refresh_interval=0.05)
    async with app.run_test(size=(120, 36)) as pilot:
        # GIVEN the app subscribed and got the first 40 events
        await wait_for(pilot, lambda: app.model.store.n == 40)
        assert app.link.connected and app.main.follow and app.main.gpu == 0
        assert "live" in str(app.query_one("#status").render())
        first_model = app.model
        # WHEN more events arrive, THEN the cursor follows the newest
        server.send({"type": "events", "events": trace.events[40:60]})
        await wait_for(pilot, lambda: app.model.store.n == 60)
        assert app.main.cursor_ts == app.model.time_range()[1] >= int(trace.events["ts"][59])
        # WHEN paused, new events are recorded but the view stays
        await pilot.press("space")
        cursor = app.main.cursor_ts
        server.send({"type": "events", "events": trace.events[60:80]})
        await wait_for(pilot, lambda: app.model.store.n == 80)
        assert app.main.cursor_ts == cursor and "PAUSED" in str(app.query_one("#status").render())
        await pilot.press("space")
        await wait_for(pilot, lambda: app.main.cursor_ts == int(trace.events["ts"][79]))  # past the NVML samples
        # WHEN nothing arrives for longer than stale_after, THEN the status line warns
        clock.now += 10
        await pilot.pause(0.2)
        assert "no data for 10s" in str(app.query_one("#status").render())
        # WHEN lost events are reported, THEN they are shown
        server.send({"type": "lost", "ts": synth.T0, "total": 1234})
        await wait_for(pilot, lambda: app.model.lost == 1234)
        assert "lost 1,234" in str(app.query_one("#status").render())
        # WHEN the daemon goes away
        server.close()
        await wait_for(pilot, lambda: not app.link.connected)
        assert "retrying" in str(app.query_one("#status").render())
        # AND a new one starts with another trace
        server2 = ScriptedDaemon(path, first_records(trace, 10))
        # THEN the app reconnects and shows the new daemon's data only
        await wait_for(pilot, lambda: app.link.connected and app.model is not first_model and app.model.store.n == 10)
        assert source.attempts >= 2
        server2.close()


async def test_live_against_the_real_daemon(sockdir):
    # GIVEN the real daemon (fake probes: no BPF) running its loop in a thread
    from tests.unit.daemon_fakes import raw
    from tests.unit.test_daemon_unit import make_daemon

    from memrec.terms.events import Kind

    daemon = make_daemon(sockdir, keyframe_interval=0.2)
    daemon.start()
    stop = threading.Event()
    loop = threading.Thread(target=daemon.run, kwargs={"until": stop.is_set}, daemon=True)
    loop.start()
    try:
        source = LiveSource(str(sockdir / "s.sock"), backoff=(0.05, 0.2))
        app = MemrecApp(source, refresh_interval=0.05)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: app.link.connected and bool(app.model.header))
            # WHEN a process allocates 3 x 1 MiB and frees one
            pid = 4242
            daemon.probes.push(
                *[raw(Kind.ALLOC, pid=pid, ptr=0x7F0000000000 + i * 0x100000, size=1 << 20, ordinal=0, ts=time.monotonic_ns())
                  for i in range(3)],
                raw(Kind.FREE, pid=pid, ptr=0x7F0000000000, ordinal=0, ts=time.monotonic_ns()),
            )
            # THEN the app sees the events and the state at the cursor
            await wait_for(pilot, lambda: app.model.store.n >= 4)
            g = app.model.gpu_ids()[0] if app.model.gpu_ids() else -1
            st = app.model.state_at(app.model.store.n - 1, g)
            assert st.owned == 2 << 20
    finally:
        stop.set()
        loop.join(timeout=5)
        daemon.stop()


async def test_a_daemon_without_nvml_after_its_workloads_exited(sockdir):
    # GIVEN a daemon without NVML (its header lists no GPU) whose workloads all exited: its state
    # holds nothing, and only its peaks name the GPUs they used
    from memrec.terms.events import Api
    from memrec.terms.events import Kind
    from memrec.state import LiveState
    from memrec.trace.format import finalize_header

    script = synth.Script()
    for gpu in (0, 1):
        script.add(0.1 + gpu, 4101, Kind.ALLOC, Api.cuMemAlloc_v2, gpu, ptr=0x7F0000000000 + (gpu << 24), size=1 << 20)
        script.add(0.2 + gpu, 4101, Kind.FREE, Api.cuMemFree_v2, gpu, ptr=0x7F0000000000 + (gpu << 24))
    state = LiveState()
    state.apply(script.events())
    assert state.totals() == {} and sorted(state.peaks()) == [0, 1]
    header = finalize_header({"host": "h", "gpus": []})
    server = ScriptedDaemon(sockdir / "memrec.sock", [
        header, {"type": "keyframe", "ts": synth.T0 + 3 * SEC, "event_index": 0, "state": state.snapshot()}])
    clock = FixedClock()
    app = MemrecApp(LiveSource(str(sockdir / "memrec.sock"), backoff=(0.05, 0.2)), clock=clock, stale_after=3.0,
                    refresh_interval=0.05)
    try:
        async with app.run_test(size=(120, 36)) as pilot:
            # WHEN the TUI subscribes, THEN it names the GPUs the state used and shows the first
            await wait_for(pilot, lambda: app.model.gpu_ids() == [0, 1] and app.main.gpu == 0)
            # AND a quiet daemon without NVML is idle, not stalled (it sends nothing while idle)
            clock.now += 10
            await pilot.pause(0.2)
            status = str(app.query_one("#status").render())
            assert "live, idle 10s" in status and "stalled" not in status, status
    finally:
        server.close()


async def test_a_daemon_that_has_recorded_nothing_yet_says_so(sockdir):
    # GIVEN a daemon without NVML on a host where no process has allocated yet
    from memrec.terms.events import Api
    from memrec.terms.events import Kind
    from memrec.state import LiveState
    from memrec.trace.format import finalize_header

    empty_state = {"type": "keyframe", "ts": synth.T0, "event_index": 0, "state": LiveState().snapshot()}
    server = ScriptedDaemon(sockdir / "memrec.sock", [finalize_header({"host": "h", "gpus": []}), empty_state])
    app = MemrecApp(LiveSource(str(sockdir / "memrec.sock"), backoff=(0.05, 0.2)), refresh_interval=0.05)
    try:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: server.subscribed.is_set() and app.link.connected)
            # THEN the screen says what it waits for instead of staying blank
            empty = app.query_one("#ov-empty")
            assert empty.display and "No GPU memory recorded yet" in str(empty.render())
            # AND the first GPU's events replace it with that GPU's view
            script = synth.Script()
            script.add(0.1, 4100, Kind.ALLOC, Api.cuMemAlloc_v2, 0, ptr=0x7F0000000000, size=1 << 20)
            server.send({"type": "events", "events": script.events()})
            await wait_for(pilot, lambda: app.model.gpu_ids() == [0])
            assert not app.query_one("#ov-empty").display and app.main.gpu == 0
    finally:
        server.close()
