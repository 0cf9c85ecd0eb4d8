"""The daemon's keyframes: none while nothing changes, periodic ones built off the loop and
written valid after the events they cover, readable by every reader."""

from __future__ import annotations

import os
import threading
import time

from memrec.daemon.keyframes import Keyframes
from memrec.events import Kind
from memrec.state import LiveState
from memrec.trace.format import make_header
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter
from tests.unit.daemon_fakes import raw
from tests.utils import ev
from tests.utils import events
from tests.unit.test_daemon_unit import make_daemon
from tests.unit.test_daemon_unit import pump
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
