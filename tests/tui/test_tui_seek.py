"""The TUI's seek ahead of the replay: the cursor's state from a keyframe and the gap, one GPU's.

``TraceModel.state_at`` replays the gap from the nearest keyframe for the GPU on screen only
(:func:`memrec.engine.replay.advance_for_gpu`): these tests hold it to the state the whole
replay gives (the old path) at many cursors, and count the work a far seek does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import synth

from memrec.terms.columns import empty_events
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.state import LiveState
from memrec.state.queries import Queries
from memrec.trace.model import Keyframe
from memrec.trace.model import Trace
from memrec.trace.reader import load_trace
from memrec.tui import model as tui_model
from memrec.engine import replay

ROOT = Path(__file__).resolve().parents[2]
MiB = synth.MiB
GPUS = 4


def mix(procs: int = 8, live: int = 3000, churn: int = 3000, seed: int = 3) -> Trace:
    """The realistic mix in small (``bench/bench_realistic.py``'s shape): ``procs`` processes,
    each on GPU ``pid % GPUS``, build up ``live`` allocations, then free a random live one and
    allocate a new one ``churn`` times; half the processes exit midway, the rest at the end;
    phases per process; keyframes only at the start and after the build-up (a gap of most of
    the trace, as the cadence by bytes leaves)."""
    rng = np.random.default_rng(seed)
    rows: list[tuple[int, int, int, int, int]] = []  # kind, pid, gpu, ptr, size
    held: dict[int, list[int]] = {p: [] for p in range(procs)}
    nxt = [0x7F00_0000_0000 + (p << 36) for p in range(procs)]

    def alloc(p: int) -> None:
        size = int(rng.choice([512, 4096, 65536, 2 * MiB]))
        rows.append((int(Kind.ALLOC), 1000 + p, p % GPUS, nxt[p], size))
        held[p].append(nxt[p])
        nxt[p] += size + 512 * int(rng.integers(0, 8))

    def free(p: int) -> None:
        ptr = held[p].pop(int(rng.integers(0, len(held[p]))))
        rows.append((int(Kind.FREE), 1000 + p, -1, ptr, 0))  # the file's GPU: unknown (filled by the replay)

    for _ in range(live):
        alloc(int(rng.integers(0, procs)))
    built = len(rows)
    for i in range(churn):
        p = int(rng.integers(0, procs))
        if i == churn // 2:
            for q in range(0, procs, 2):
                rows.append((int(Kind.PROC_EXIT), 1000 + q, -1, 0, 0))
                held[q] = []
        if held[p]:
            free(p)
        alloc(p)
    for q in range(1, procs, 2):
        rows.append((int(Kind.PROC_EXIT), 1000 + q, -1, 0, 0))
    ev = empty_events(len(rows))
    cols = np.array(rows, dtype=np.int64)
    ev["kind"], ev["pid"], ev["tid"], ev["gpu"] = cols[:, 0], cols[:, 1], cols[:, 1], cols[:, 2]
    ev["ptr"], ev["size"] = cols[:, 3].astype(np.uint64), cols[:, 4]
    ev["api"] = np.where(ev["kind"] == int(Kind.ALLOC), int(Api.cuMemAlloc_v2), int(Api.cuMemFree_v2))
    ev["ts"] = synth.T0 + np.arange(len(ev), dtype=np.int64) * 25_000
    first = LiveState()
    first.apply(ev[:10].copy())
    later = LiveState.from_snapshot(first.snapshot())
    later.apply(ev[10:built].copy())
    markers = [Marker(int(ev["ts"][at]), 1000 + p, 0, 1000 + p, f"step{at}", phase, p % GPUS, {})
               for p in range(procs) for at, phase in ((built // 3, "begin"), (2 * built // 3, "end"))]
    return Trace(header=synth.header(GPUS), events=ev, markers=markers, processes={},
                 keyframes=[Keyframe(int(ev["ts"][9]), 10, first.snapshot()),
                            Keyframe(int(ev["ts"][built - 1]), built, later.snapshot())],
                 lost=0, trailer={})


def repository_traces() -> list[Path]:
    """The repository's traces: VMM, IPC, shareable handles, host memory, tensor blocks."""
    return sorted((ROOT / "tests" / "data").glob("*.mrec")) + sorted((ROOT / "examples").glob("*.mrec"))


def whole_replay(state, covered, chunks, gpu):
    """The old path: every event of the gap replayed, whatever the GPU."""
    return replay.advance(state, covered, chunks())


def cursors(n: int, most: int = 60) -> list[int]:
    return sorted(set(np.linspace(0, n - 1, min(n, most)).astype(int).tolist()))


def assert_same_states(m: tui_model.TraceModel, monkeypatch) -> int:
    """Every GPU's cursor state at many cursors, from the seek's path and the old one."""
    gpus = sorted({-1, *range(GPUS), *np.unique(m.store.column("gpu", 0, m.store.n)).tolist()})
    checked = 0
    for seq in cursors(m.store.n):
        for g in gpus:
            now = m.state_at(seq, g)
            with monkeypatch.context() as patch:
                patch.setattr(tui_model, "advance_for_gpu", whole_replay)
                before = m.state_at(seq, g)
            assert now == before, (seq, g)
            checked += bool(now.by_process)
    return checked


def test_seek_state_equals_the_whole_replay_on_the_realistic_mix(monkeypatch):
    # GIVEN the realistic mix, read but not replayed (a seek ahead of the replay)
    m = tui_model.TraceModel.from_trace(mix(), index=False)
    # WHEN each GPU's cursor state is asked for at 60 cursors, by the seek and by the old path
    # THEN they are equal: holders, categories, phases, the largest allocations
    assert assert_same_states(m, monkeypatch) > 100


@pytest.mark.parametrize("path", repository_traces(), ids=lambda p: p.name)
def test_seek_state_equals_the_whole_replay_on_the_repository_traces(path, monkeypatch):
    # GIVEN a repository trace (VMM, IPC, shareable handles, host memory, tensor blocks), not replayed
    m = tui_model.TraceModel.from_trace(load_trace(path), index=False)
    # WHEN / THEN every GPU's cursor state at 60 cursors (or every event) is the old path's
    assert_same_states(m, monkeypatch)


def test_a_far_seek_replays_one_gpus_processes_and_builds_no_row_per_allocation(monkeypatch):
    # GIVEN the realistic mix (two processes per GPU, 4 GPUs), read but not replayed
    trace = mix()
    m = tui_model.TraceModel.from_trace(trace, index=False)
    built = trace.keyframes[-1].event_index
    seq = len(trace.events) - 10  # before the last exits: a gap of most of the trace
    applied: list[int] = []
    real = LiveState.apply
    monkeypatch.setattr(LiveState, "apply", lambda self, ev: (applied.append(len(ev)), real(self, ev))[1])
    monkeypatch.setattr(Queries, "holdings", lambda *a, **k: pytest.fail("a Holding built per allocation"))
    # WHEN GPU 1's state far ahead of the keyframe is asked for (its processes run to the end)
    st = m.state_at(seq, 1)
    # THEN only the events of GPU 1's processes (2 of 8) are replayed, not the gap's every one
    gap = seq + 1 - built
    mine = np.isin(trace.events["pid"][built : seq + 1], [1001, 1005]).sum()
    assert sum(applied) == mine < gap / 3
    # AND the phases are summed without a Holding per live allocation
    assert len(st.by_phase) == 2 and sum(n for _, _, n in st.by_phase) > 500


def test_a_gap_that_joins_processes_replays_every_event(monkeypatch):
    # GIVEN the realistic mix with one IPC close in its gap (an event that may join processes)
    trace = mix()
    built = trace.keyframes[-1].event_index
    at = built + 100
    trace.events["kind"][at], trace.events["gpu"][at] = int(Kind.IPC_CLOSE), 1
    m = tui_model.TraceModel.from_trace(trace, index=False)
    applied: list[int] = []
    real = LiveState.apply
    monkeypatch.setattr(LiveState, "apply", lambda self, ev: (applied.append(len(ev)), real(self, ev))[1])
    # WHEN GPU 0's state far ahead is asked for
    seq = len(trace.events) - 10
    st = m.state_at(seq, 0)
    # THEN every event of the gap is replayed, and the state is the old path's
    assert sum(applied) == seq + 1 - built
    monkeypatch.setattr(tui_model, "advance_for_gpu", whole_replay)
    assert st == m.state_at(seq, 0)
