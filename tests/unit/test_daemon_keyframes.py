"""The daemon's keyframes: none while nothing changes, periodic ones built off the loop and
written valid after the events they cover, readable by every reader."""

from __future__ import annotations

import os
import time

from memrec.events import Kind
from memrec.state import LiveState
from memrec.trace.reader import load_trace
from tests.unit.daemon_fakes import raw
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
