"""The daemon's loop at a million live allocations: its longest step at a rotation and at a live
subscriber's join, against the same loop without either.

    .venv/bin/python bench/bench_daemon_stalls.py [--live 1000000] [--repeat 3] [--seconds 1.5]

The real :class:`daemon.server.Daemon` runs its own loop (probes stood in by
``tests.unit.daemon_fakes.FakeProbes``, everything else real: the trace file, the live state, the
socket, the keyframe threads), its live state filled with ``--live`` allocations as in
``bench_state.py``, a small batch (an alloc and its free) pushed every loop step. A *step* is the
time between two turns of the loop (its select waits at most 1 ms here). Per repeat, in one run:

- floor: the loop for ``--seconds`` with neither;
- rotation: SIGHUP (queued as the handler does) at the start, then the loop until the new file's
  first keyframe is written;
- subscriber: a client subscribes at the start (a thread receives everything it is sent), then
  the loop until its sync was sent whole;
- reference: what the loop used to spend on either, a keyframe built and encoded at once.

Each prints the longest step and the 99th percentile in ms. The machine is shared: compare within
a run.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_state import live_state  # noqa: E402
from daemon.config import DaemonConfig  # noqa: E402
from daemon.server import Daemon  # noqa: E402
from memrec.terms import protocol  # noqa: E402
from memrec.terms.events import Kind  # noqa: E402
from memrec.state import LiveState  # noqa: E402
from memrec.trace import frames  # noqa: E402
from memrec.trace.format import encode_record  # noqa: E402
from memrec.trace.format import keyframe_record  # noqa: E402
from tests.unit.daemon_fakes import FakeLibrary  # noqa: E402
from tests.unit.daemon_fakes import FakeProbes  # noqa: E402
from tests.unit.daemon_fakes import raw  # noqa: E402


def _daemon(workdir: Path, state: LiveState) -> Daemon:
    config = DaemonConfig(output=workdir / "out.mrec", socket_path=workdir / "s.sock", nvml_device_hz=0,
                          nvml_process_hz=0, poll_interval=0.001, flush_interval=0.2, keyframe_interval=3600)
    d = Daemon(config, probes_factory=FakeProbes, install_signals=False,
               find_libraries=lambda extra: [FakeLibrary("/fake/libcuda.so.1", 1, 42)])
    d.state = state
    return d


def _steps(d: Daemon, done, at_least: float) -> list[float]:
    """Run the loop, pushing an alloc and its free every step, until ``done()`` and ``at_least``
    seconds passed; return the steps' durations in seconds."""
    me = os.getpid()
    ptr = 0x1_0000_0000
    steps: list[float] = []
    start = last = time.perf_counter()

    def until() -> bool:
        nonlocal last, ptr
        now = time.perf_counter()
        steps.append(now - last)
        last = now
        ptr += 0x1000
        t = time.monotonic_ns()
        d.probes.push(raw(Kind.ALLOC, ts=t, pid=me, ordinal=0, ptr=ptr, size=4096),
                      raw(Kind.FREE, ts=t + 1, pid=me, ordinal=0, ptr=ptr))
        return now - start >= at_least and done()

    d.run(until=until)
    return steps[1:]


def _read_all(sock: socket.socket, got: list[bytes]) -> None:
    """Receive without decoding (decoding here would hold the interpreter lock the loop needs; a
    real subscriber is another process)."""
    while data := sock.recv(1 << 20):
        got.append(data)


def _synced(d: Daemon) -> bool:
    """Whether every subscriber got its sync whole."""
    subs = d.fanout.subscribers
    return bool(subs) and not any(s.syncing or s.queued for s in subs)


def _show(name: str, steps: list[float]) -> None:
    ms = np.array(steps) * 1e3
    print(f"  {name:<44} longest {ms.max():7.1f} ms   p99 {np.percentile(ms, 99):6.2f} ms   ({len(ms):,} steps)")


def one_run(state: LiveState, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = _daemon(Path(tmp), state)
        d.start()
        try:
            _steps(d, lambda: not d.keyframes.holding, 0.2)  # the first file's first keyframe
            _show("floor (neither)", _steps(d, lambda: True, seconds))
            d.queue_signal(signal.SIGHUP)
            written = d.keyframes.written
            _show("rotation", _steps(d, lambda: d.keyframes.written > written, seconds))
            assert len(d.files) == 2
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(d.config.socket_path))
            sock.sendall(protocol.encode_frame({"type": "subscribe"}))
            got: list[bytes] = []
            reader = threading.Thread(target=_read_all, args=(sock, got), daemon=True)
            reader.start()
            n0 = state.n_events
            _show("subscriber join", _steps(d, lambda: _synced(d), seconds))
            time.sleep(0.2)
            records = frames.FrameDecoder(frames.MAX_SUBSCRIBER_FRAME).feed(b"".join(got))
            kf = next(r for r in records if r["type"] == "keyframe")
            assert kf["state"]["n"] >= n0, "the subscriber's keyframe misses allocations"
        finally:
            d.stop()
        t0 = time.perf_counter()
        encode_record(keyframe_record(1, 0, state.snapshot()))
        print(f"  {'reference: a keyframe built on the loop':<44} {(time.perf_counter() - t0) * 1e3:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.live:,} live allocations")
    for i in range(args.repeat):
        state = live_state(LiveState, args.live)
        print(f"run {i + 1}")
        one_run(state, args.seconds)


if __name__ == "__main__":
    main()
