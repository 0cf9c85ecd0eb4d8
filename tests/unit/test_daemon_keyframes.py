"""The daemon's keyframes: none while nothing changes, periodic ones built off the loop and
written valid after the events they cover, readable by every reader."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from memrec.terms import protocol
from memrec.terms.columns import empty_events
from memrec.daemon.keyframes import Keyframes
from memrec.terms.events import Kind
from memrec.state import LiveState
from memrec.trace import frames
from memrec.trace.format import make_header
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter
from tests.unit.daemon_fakes import raw
from tests.utils import ev
from tests.utils import events
from tests.unit.test_daemon_unit import connect
from tests.unit.test_daemon_unit import make_daemon
from tests.unit.test_daemon_unit import pump
from tests.unit.test_daemon_unit import recv_frames
from tests.unit.test_daemon_unit import workdir  # noqa: F401 (a fixture)

MiB = 1 << 20


def test_an_idle_daemon_writes_no_keyframes(workdir):
    # GIVEN a daemon asked for a keyframe every 20 ms
    d = make_daemon(workdir, keyframe_interval=0.02)
    d.start()
    # WHEN nothing happens for 0.3 s and it stops
    pump(d, 0.3)
    d.stop()
    # THEN the file holds only its first keyframe: the others (and the last at stop) were skipped
    trace = load_trace(d.files[0])
    assert [k.event_index for k in trace.keyframes] == [0]
    assert d.keyframes.skipped >= 5 and d.keyframes.written == 1


def test_periodic_keyframes_cover_the_events_before_them(workdir):
    # GIVEN a daemon asked for a keyframe every 20 ms
    d = make_daemon(workdir, keyframe_interval=0.02)
    d.start()
    me, t = os.getpid(), time.monotonic_ns()
    # WHEN two allocations come, then a free, with time for keyframes in between
    d.probes.push(raw(Kind.ALLOC, ts=t + 1, pid=me, ordinal=0, ptr=0x10, size=MiB),
                  raw(Kind.ALLOC, ts=t + 2, pid=me, ordinal=0, ptr=0x20, size=2 * MiB))
    pump(d, 0.2)
    d.probes.push(raw(Kind.FREE, ts=t + 3, pid=me, ordinal=0, ptr=0x10))
    pump(d, 0.2)
    d.stop()
    trace = load_trace(d.files[0])
    # THEN one keyframe per change: at the start, after the allocations, after the free
    assert [k.event_index for k in trace.keyframes] == [0, 2, 3]
    # AND each is the state of replaying the events before it
    for kf in trace.keyframes:
        ref = LiveState()
        ref.apply(trace.events[: kf.event_index].copy())
        assert LiveState.from_snapshot(kf.state).snapshot() == ref.snapshot()


def test_a_keyframe_taken_before_a_rotation_is_dropped_without_waiting(tmp_path):
    # GIVEN a periodic keyframe whose build in the thread has not finished
    state = LiveState()
    state.apply(events(ev(Kind.ALLOC, pid=1, ptr=0x10, size=MiB, gpu=0)))
    release = threading.Event()
    finish = state.snapshot_later()

    def slow() -> dict:
        release.wait(5)
        return finish()

    header = make_header(host="h", boot_id="b", anchor={"monotonic_ns": 0, "wall_ns": 0}, gpus=[])
    old, new = TraceWriter(tmp_path / "a.mrec", header), TraceWriter(tmp_path / "b.mrec", header)
    kf = Keyframes()
    state.snapshot_later = lambda: slow  # type: ignore[method-assign]
    assert kf.start(old, state, 100)
    del state.snapshot_later  # later keyframes are built as usual
    # WHEN the file rotates and the new one gets its first keyframe at once
    old.close()
    t0 = time.monotonic()
    kf.write_now(new, state, 200, 0)
    # THEN that does not wait for the build, and the stale keyframe goes nowhere
    assert time.monotonic() - t0 < 1
    release.set()
    assert not kf.collect(new, wait=True)
    new.close()
    assert load_trace(tmp_path / "a.mrec").keyframes == []
    assert [k.ts for k in load_trace(tmp_path / "b.mrec").keyframes] == [200]


def _held_build(state: LiveState) -> threading.Event:
    """Make the next keyframe taken of ``state`` wait in its thread until the event returned is set."""
    release = threading.Event()
    take = state.snapshot_later

    def later():
        finish = take()
        del state.snapshot_later  # the keyframes after this one are built as usual

        def slow() -> dict:
            release.wait(10)
            return finish()

        return slow

    state.snapshot_later = later  # type: ignore[method-assign]
    return release


def _allocs(n: int, first: int, t: int, kind: Kind = Kind.ALLOC) -> np.ndarray:
    """``n`` allocations of 4 KiB from pointer number ``first`` on (``kind=Kind.FREE``: their frees)."""
    size = 4096 if kind == Kind.ALLOC else 0
    return np.concatenate([raw(kind, ts=t + i, pid=os.getpid(), ordinal=0, ptr=(first + i) << 12, size=size)
                           for i in range(n)])


def _daemon_holding(workdir, n: int, t: int):
    """A started daemon whose state holds ``n`` live allocations."""
    d = make_daemon(workdir)
    d.start()
    d.probes.push(_allocs(n, 1, t))
    pump(d, 0.2)
    return d


def test_a_rotation_at_many_live_allocations_keeps_every_event_after_its_first_keyframe(workdir):
    # GIVEN a daemon holding 20,000 live allocations
    t = time.monotonic_ns()
    d = _daemon_holding(workdir, 20_000, t)
    try:
        # WHEN the file rotates and the new file's first keyframe is still being built while
        # allocations and frees go on
        release = _held_build(d.state)
        d.rotate("test")
        assert d.keyframes.holding
        d.probes.push(_allocs(300, 100_000, t + 50_000), _allocs(200, 1, t + 60_000, Kind.FREE))
        pump(d, 0.2)
        # THEN the new file, read meanwhile (as after a crash), holds no event before its keyframe
        early = load_trace(d.files[1])
        assert len(early.events) == 0 and early.keyframes == [] and os.getpid() in early.processes
        assert [w for w in early.warnings if "no trailer" not in w] == []
        # WHEN the keyframe is done and more comes
        release.set()
        pump(d, 0.2)
        d.probes.push(_allocs(100, 200_000, t + 90_000))
        pump(d, 0.1)
    finally:
        d.stop()
    old, new = load_trace(d.files[0]), load_trace(d.files[1])
    assert old.warnings == [] and new.warnings == []
    # THEN every event is in one of the files, once
    assert len(old.events) == 20_000 and len(new.events) == 600
    # AND the new file's first keyframe, at its event 0, is the state the old file leaves
    first = new.keyframes[0]
    assert first.event_index == 0
    ref = LiveState()
    ref.apply(old.events.copy())
    assert LiveState.from_snapshot(first.state).snapshot() == ref.snapshot()
    # AND replaying the new file from it gives the daemon's last state
    restored = LiveState.from_snapshot(first.state)
    restored.apply(new.events.copy())
    assert restored.snapshot() == d.state.snapshot()


def test_a_subscriber_joining_while_its_keyframe_is_built_gets_every_later_event_after_it(workdir):
    # GIVEN a daemon holding 5,000 live allocations, and a subscriber whose keyframe is slow to build
    t = time.monotonic_ns()
    d = _daemon_holding(workdir, 5_000, t)
    try:
        release = _held_build(d.state)
        sub = connect(d.config.socket_path)
        sub.sendall(protocol.encode_frame({"type": "subscribe"}))
        pump(d, 0.1)
        # WHEN events come while it is built
        d.probes.push(_allocs(100, 1, t + 10_000, Kind.FREE))
        pump(d, 0.1)
        decoder = frames.FrameDecoder(frames.MAX_SUBSCRIBER_FRAME)
        assert recv_frames(sub, decoder, timeout=0.1) == []  # nothing before its keyframe
        release.set()
        pump(d, 0.2)
        d.probes.push(_allocs(50, 100_000, t + 20_000))
        pump(d, 0.1)
        got = recv_frames(sub, decoder)
    finally:
        d.stop()
    # THEN it got header, process, keyframe, then the events, each once: keyframe + events = the daemon's state
    assert [r["type"] for r in got[:3]] == ["header", "process", "keyframe"]
    state = LiveState.from_snapshot(got[2]["state"])
    assert got[2]["state"]["n"] == 5_000
    state.apply(np.concatenate([r["events"] for r in got[3:] if r["type"] == "events"]))
    assert state.n_events == 5_150 and state.snapshot() == d.state.snapshot()


def test_periodic_keyframes_take_at_most_their_share_of_the_file(tmp_path):
    # GIVEN a state of 60,000 live allocations (a keyframe of a few hundred kB) and a file
    rng = np.random.default_rng(5)
    state = LiveState()
    n = 60_000
    live = empty_events(n)
    live["kind"], live["pid"], live["gpu"] = int(Kind.ALLOC), 1000 + rng.integers(0, 8, n), 0
    live["ptr"] = (1 << 40) + np.cumsum(rng.integers(1, 1 << 20, n)).astype(np.uint64)
    live["size"] = rng.integers(1, 1 << 20, n)
    live["ts"] = np.arange(n)
    state.apply(live)
    header = make_header(host="h", boot_id="b", anchor={"monotonic_ns": 0, "wall_ns": 0}, gpus=[])
    w = TraceWriter(tmp_path / "t.mrec", header)
    w.write_events(live)
    kf = Keyframes()
    kf.write_now(w, state, n)
    first = w.last_keyframe_size
    assert first >= 64 << 10
    # WHEN a periodic keyframe is due after every batch of churn (a free and an allocation each)
    t, written = n, []
    for _ in range(200):
        batch = empty_events(2_000)
        rows = rng.integers(0, n, 1_000)
        batch["kind"][0::2], batch["pid"][0::2], batch["ptr"][0::2] = int(Kind.FREE), live["pid"][rows], live["ptr"][rows]
        batch["kind"][1::2], batch["pid"][1::2], batch["gpu"][1::2] = int(Kind.ALLOC), live["pid"][rows], 0
        batch["ptr"][1::2] = live["ptr"][rows] + 1
        batch["size"][1::2] = live["size"][rows]
        live["ptr"][rows] += 1
        batch["ts"] = t + np.arange(2_000)
        t += 2_000
        state.apply(batch)
        w.write_events(batch)
        w.flush()
        since, last = w.bytes_written - w.last_keyframe_end, w.last_keyframe_size
        if kf.start(w, state, t):
            assert since >= 4 * last  # the periodic ones: at most a fifth of the file
            kf.collect(w, wait=True)
            written.append(state.n_events)
        else:
            assert since < 4 * last
    w.close()
    # THEN some were written, most skipped: each written one followed 4 × the last one's bytes
    trace = load_trace(tmp_path / "t.mrec")
    assert 1 <= len(written) < 100 and kf.skipped >= 100, (first, w.bytes_written, written)
    assert len(trace.keyframes) == 1 + len(written) and w.keyframe_bytes > first
    # AND each is the state after the events before it (a seek restores it)
    for k in trace.keyframes[1:]:
        ref = LiveState()
        ref.apply(trace.events[: k.event_index].copy())
        assert LiveState.from_snapshot(k.state).snapshot() == ref.snapshot()
    # AND with share 0 (no byte rule) every one is taken
    assert Keyframes(share=0).grown(w)
