"""The TUI's model without Textual: series, state at the cursor, event window, filters."""

from __future__ import annotations

import numpy as np
import pytest
import synth

from memrec.terms.events import OWNED_CATEGORIES
from memrec.state import LiveState
from memrec.tui import views
from memrec.tui.filters import EventFilter
from memrec.tui.filters import parse_filter
from memrec.tui.model import TraceModel
from memrec.tui.model import phase_spans
from memrec.tui.views import NCAT
from memrec.engine.phases import build_phases
from memrec.engine.series import BLOCK
from memrec.engine.series import CategorySeries

GiB = synth.GiB
SEC = synth.SEC
T0 = synth.T0


def owned(st) -> int:
    return st.owned


def test_series_match_livestate_at_every_event(trace):
    # GIVEN the scripted trace replayed into the model
    m = TraceModel.from_trace(trace, checkpoint_every=16)
    ref = LiveState()
    # WHEN the series is read after each event
    for i in range(len(trace.events)):
        ref.apply(trace.events[i : i + 1].copy())
        ts = int(trace.events["ts"][i])
        if i + 1 < len(trace.events) and trace.events["ts"][i + 1] == ts:
            continue
        for g in (0, 1):
            v = m.series_at(g, ts)
            # THEN it equals what a LiveState says at that instant (owned and mapped)
            assert int(v[list(OWNED_CATEGORIES)].sum()) == ref.owned_bytes(gpu=g), (i, g)
            assert int(v[2]) == ref.mapped_bytes(gpu=g)


def test_state_at_uses_a_checkpoint_not_a_replay_from_the_start(trace, monkeypatch):
    # GIVEN a model with a checkpoint every 16 events
    m = TraceModel.from_trace(trace, checkpoint_every=16)
    applied = []
    real = LiveState.apply

    def spy(self, events):
        applied.append(len(events))
        return real(self, events)

    monkeypatch.setattr(LiveState, "apply", spy)
    # WHEN the state near the end is asked for
    seq = len(trace.events) - 2
    st = m.state_at(seq, 0)
    # THEN at most one checkpoint's worth of events is replayed, and the answer is exact
    assert sum(applied) < 16
    monkeypatch.setattr(LiveState, "apply", real)
    ref = LiveState()
    ref.apply(trace.events[: seq + 1].copy())
    assert st.owned == ref.owned_bytes(gpu=0)


def test_state_at_before_indexing_uses_the_files_keyframes(trace, monkeypatch):
    # GIVEN a model that has read the trace but not replayed it
    m = TraceModel.from_trace(trace, index=False)
    assert m.frontier == 0
    kf = trace.keyframes[2]
    applied = []
    real = LiveState.apply
    monkeypatch.setattr(LiveState, "apply", lambda self, ev: (applied.append(len(ev)), real(self, ev))[1])
    # WHEN the state right at a keyframe is asked for
    st = m.state_at(kf.event_index - 1, 0)
    # THEN nothing is replayed and the keyframe's state is shown
    assert sum(applied) == 0
    ref = LiveState.from_snapshot(kf.state)
    assert st.owned == ref.owned_bytes(gpu=0)
    # AND the viewport beyond the frontier is drawn from keyframes, marked coarse
    t0, t1 = m.time_range()
    view = m.viewport(0, t0, t1, 40)
    assert view.coarse.all()
    assert view.owned.max() > 0


def test_cursor_state_holders_phases_and_largest(trace):
    # GIVEN the model, and the cursor just after rank 1's failed KV allocation
    m = TraceModel.from_trace(trace)
    seq = m.store.seq_at(T0 + int(8.0 * SEC))
    # WHEN the state of GPU1 is computed
    st = m.state_at(seq, 1)
    # THEN rank 1 holds its weights (60 GiB) and NCCL buffers, grouped by phase
    assert st.by_process[0][1] == "tp1"
    phases = {name: b for name, b, _ in st.by_phase}
    assert phases["load_weights"] == pytest.approx(60 * GiB, rel=0.01)
    assert phases["nccl_init"] == 4 * 256 * synth.MiB + 512 * synth.MiB
    assert "kv_cache" not in phases  # it failed
    # AND the largest live allocations carry their age and the phase that made them
    big = st.largest[0]
    assert big.phase == "load_weights" and big.age > 4 * SEC
    assert st.nvml is not None and st.untraced is not None


def test_viewport_keeps_a_spike_narrower_than_a_column():
    # GIVEN 1000 s of nothing with a 1 ms spike of 10 GiB in the middle
    s = synth.Script()
    s.add(0, 1, synth.Kind.ALLOC, synth.Api.cuMemAlloc_v2, 0, ptr=0x1000, size=GiB)
    s.add(500, 1, synth.Kind.ALLOC, synth.Api.cuMemAlloc_v2, 0, ptr=0x2000, size=10 * GiB)
    s.add(500.001, 1, synth.Kind.FREE, synth.Api.cuMemFree_v2, 0, ptr=0x2000)
    s.add(1000, 1, synth.Kind.FREE, synth.Api.cuMemFree_v2, 0, ptr=0x1000)
    tr = synth.Trace(header=synth.header(1), events=s.events())
    m = TraceModel.from_trace(tr)
    # WHEN it is drawn in 50 columns (20 s each)
    view = m.viewport(0, T0, T0 + 1000 * SEC, 50)
    # THEN the column holding the spike shows its peak, the others only the base allocation
    assert view.owned.max() == 11 * GiB
    assert (view.owned == 11 * GiB).sum() == 1
    assert view.owned[10] == GiB


def test_viewport_peak_through_the_block_pyramid():
    # GIVEN many more change points than BLOCK in one column, with the maximum in the middle
    n = BLOCK * 20
    series = CategorySeries()
    deltas = np.ones(n, dtype=np.int64)
    deltas[n // 2 :] = -1
    series.append(np.arange(n), np.arange(n, dtype=np.uint64), np.zeros(n, np.int8), deltas)
    # WHEN the argmax of a range is asked for
    i = series.argmax(3, n - 5)
    # THEN it is the top of the ramp
    assert series.total.a[i] == n // 2
    assert series.argmax(n - 100, n) == n - 100


def test_series_per_category_equal_a_cumulative_sum_whatever_the_chunks():
    # GIVEN random changes, mostly of one category, another starting late, one never changing,
    # appended in chunks of random sizes, with room reserved (or not) part way
    rng = np.random.default_rng(3)
    n = 5000
    cat = np.where(rng.random(n) < 0.9, 0, 3).astype(np.int8)
    cat[: n // 2][cat[: n // 2] == 3] = 0  # host_pinned first changes half way
    cat[rng.integers(0, n, 40)] = 2
    cat[:3] = 2  # ipc_mapped: three zero changes first (a start state of 0 bytes)
    delta = rng.integers(-50, 100, n)
    delta[:3] = 0
    series = CategorySeries()
    at = 0
    while at < n:
        step = int(rng.integers(1, 700))
        if at > 1000 and series.seq.capacity < n:
            series.reserve(n)
        series.append(np.arange(at, min(at + step, n)), np.arange(at, min(at + step, n), dtype=np.uint64),
                      cat[at : at + step], delta[at : at + step])
        at += step
    # THEN every category at every point is the running sum of its changes, and total their sum
    want = np.stack([np.cumsum(np.where(cat == c, delta, 0)) for c in range(NCAT)])  # "array" (4) never changes
    for c in range(NCAT):
        np.testing.assert_array_equal(series.column(c), want[c])
    np.testing.assert_array_equal(series.total.a, want.sum(axis=0))
    assert series.cum[1] is None and series.column(1).shape == (n,)  # vmm never changed: not stored
    for i in (0, n // 2 - 1, n // 2 + 7, n - 1):
        np.testing.assert_array_equal(series.values_at(i), want[:, i])
    # AND dropping the first points keeps the values of the rest
    series.drop_before_seq(3000)
    np.testing.assert_array_equal(series.column(3), want[3][series.offset :])
    np.testing.assert_array_equal(series.column(1), np.zeros(n - series.offset))


def test_events_window_filters_and_centre(trace):
    # GIVEN the model and the cursor at 5 s
    m = TraceModel.from_trace(trace)
    seq = m.store.seq_at(T0 + 5 * SEC)
    # WHEN only allocations of at least 1 GiB on GPU0 are asked for
    ev = m.events_window(seq, parse_filter("kind:alloc size>=1G"), gpu=0, before=5, after=5)
    # THEN every row matches, the centre row is at or before the cursor
    assert len(ev.rows) == 6  # 5 weight segments before, the KV cache after
    assert (ev.rows["size"] >= GiB).all() and (ev.rows["gpu"] == 0).all()
    assert ev.rows["ts"][ev.center] <= T0 + 5 * SEC < ev.rows["ts"][ev.center + 1]
    assert ev.phases[0] == "load_weights"
    # AND the failed allocation is found by "fail", text finds phases and kinds
    fails = m.events_window(seq, parse_filter("fail"), gpu=None)
    assert len(fails.rows) == 1 and fails.rows["result"][0] == 2
    by_text = m.events_window(seq, parse_filter("cuda_graph"), gpu=1, before=100, after=100)
    assert set(by_text.phases) == {"cuda_graph"}
    # AND a free (gpu -1 in the trace) is shown on the GPU the replay resolved for it
    frees = m.events_window(seq, parse_filter("kind:free"), gpu=0, before=100, after=100)
    assert len(frees.rows) == 3 and (frees.rows["pid"] == synth.PIDS[0]).all()


def test_parse_filter_words_and_errors():
    f = parse_filter("pid:12,13 kind:alloc,vmm_c size>=1.5g phase:Weights oom some Text")
    assert f.pids == {12, 13} and f.min_size == int(1.5 * GiB) and f.failed and f.phase == "Weights"
    assert f.text == "some text"
    assert 3 in f.kinds and 1 in f.kinds
    assert parse_filter("").empty
    with pytest.raises(ValueError, match="kind"):
        parse_filter("kind:bogus")
    with pytest.raises(ValueError, match="pid"):
        parse_filter("pid:x")
    assert EventFilter().empty


def test_phase_spans_pair_nested_and_open():
    from memrec.terms.events import Marker

    mk = [Marker(1, 7, 0, 7, "a", "begin"), Marker(2, 7, 0, 7, "b", "begin"), Marker(3, 7, 0, 7, "b", "end"),
          Marker(4, 7, 0, 7, "i", "instant"), Marker(5, 8, 0, 8, "a", "begin")]
    spans = phase_spans(mk)
    assert [(s.name, s.begin, s.end) for s in spans] == [("a", 1, views.NEVER), ("b", 2, 3), ("i", 4, 4),
                                                         ("a", 5, views.NEVER)]
    pix = views.PhaseIndex(build_phases(mk))
    assert pix.phase_of(7, 2) == "a/b" and pix.phase_of(7, 3) == "a" and pix.phase_of(9, 3) == ""


def test_live_trim_bounds_memory():
    # GIVEN a live model that keeps 20k events, fed 200k alloc/free events in batches
    m = TraceModel(checkpoint_every=4096, max_events=20_000)
    m.set_header(synth.header(1))
    from memrec.terms.columns import empty_events

    for b in range(20):
        ev = empty_events(10_000)
        ev["ts"] = T0 + (b * 10_000 + np.arange(10_000)) * 1000
        ev["pid"] = 1
        ev["kind"] = np.where(np.arange(10_000) % 2, 2, 1)
        ev["ptr"] = 0x1000 + (np.arange(10_000) // 2) * 0x1000 + b * 0x10_0000_0000
        ev["size"] = np.where(np.arange(10_000) % 2, 0, 4096)
        ev["gpu"] = 0
        m.add_events(ev)
        m.index_step(1 << 30)
        m.trim()
    # THEN the store, the checkpoints and the series stay bounded, and the state is still right
    assert len(m.store) <= 20_000 + 10_000
    assert len(m._checkpoints) <= 30_000 // 4096 + 2
    assert len(m.series[0]) <= 30_000 + 10
    st = m.state_at(m.store.n - 2, 0)  # after an alloc whose free is the last event
    assert st.owned == 4096
    assert m.state_at(m.store.n - 1, 0).owned == 0


def test_pid_labels_come_from_marker_ranks_then_process_records():
    # GIVEN a process whose markers carry tp_rank=1, and one with only a ProcessInfo rank
    from memrec.terms.events import Marker
    from memrec.terms.events import ProcessInfo

    m = TraceModel()
    m.add_marker(Marker(ts=10, pid=100, uid=0, tid=100, name="load_weights", phase="begin", values={"tp_rank": 1}))
    m.processes[200] = ProcessInfo(200, None, [], None, None, [], 0, rank={"tp": 0})
    # WHEN labels are asked for
    # THEN markers name TP1 as memrec report does, the record names tp0, and others keep their pid
    assert m.pid_label(100) == "TP1"
    assert m.pid_label(200) == "tp0"
    assert m.pid_label(300) == "300"


def test_markers_come_in_time_order_whatever_order_they_arrive_in():
    # GIVEN markers in time order, ends written after later begins (near the end and far back), and
    # markers with text to clean among them
    import random

    from memrec.terms.events import Marker

    rng = random.Random(3)
    times = list(range(0, 4_000, 10))
    arrival = sorted(times, key=lambda t: t + rng.choice([0, 0, 0, 15, 40, 900]))
    m = TraceModel()
    for k, t in enumerate(arrival):
        m.add_marker(Marker(t, 100, 0, 100, f"step{k % 3}\x1b[2J" if k % 50 == 0 else "step", "instant", None,
                            {"k": k} if k % 7 == 0 else {}))
    # THEN the model holds every one in time order, their text cleaned
    assert [x.ts for x in m.markers] == sorted(times)
    assert not any("\x1b" in x.name for x in m.markers)
    assert sum(1 for x in m.markers if x.values) == len(range(0, len(times), 7))


def test_state_at_skips_the_tensor_replay_without_tensor_events(trace, tmp_path, monkeypatch):
    # GIVEN a driver-only trace, and a --tensors trace, both read but not replayed
    from memrec.state.tensors import TensorBlocks
    from memrec.trace.reader import load_trace
    from tests.utils import MiB
    from tests.utils import write_tensor_trace

    plain = TraceModel.from_trace(trace, index=False)
    tensors = TraceModel.from_trace(load_trace(write_tensor_trace(tmp_path / "t.mrec", [(0, 4 * MiB), (4 * MiB, MiB)])),
                                    index=False)
    applied = []
    real = TensorBlocks.apply
    monkeypatch.setattr(TensorBlocks, "apply", lambda self, ev: (applied.append(len(ev["kind"])), real(self, ev))[1])
    # WHEN the state far ahead is asked for on the driver-only trace
    st = plain.state_at(len(trace.events) - 1, 0)
    # THEN no event goes through the blocks' replay (it read every event from the first: a seek
    # ahead on 2M events of 1M live allocations spent 16 of its 18 s there) and none are shown
    assert plain.tensor_events == 0 and applied == [] and st.tensors == []
    # AND a --tensors trace still replays its blocks to the cursor
    st = tensors.state_at(tensors.store.n - 1, 0)
    assert tensors.tensor_events == 2 and sum(applied) == tensors.store.n
    assert [f.blocks for _, f in st.tensors] == [2]


def test_filter_refuses_a_pid_or_size_the_events_cannot_hold(trace):
    # GIVEN filter words a user may mistype: a pid past the events' uint32 column (which crashed
    # the TUI with a traceback from numpy), a negative pid, a size of 400 digits
    for text in ("pid:99999999999999999999", "pid:12,-1", "size>=" + "9" * 400):
        # THEN each is a one-line ValueError, which the filter box shows as a notice
        with pytest.raises(ValueError, match="pid|size"):
            parse_filter(text)
    # AND the largest pid still filters the model's events (none match)
    m = TraceModel.from_trace(trace)
    seq = m.store.seq_at(T0 + 5 * SEC)
    assert len(m.events_window(seq, parse_filter(f"pid:{2**32 - 1}"), gpu=None).rows) == 0
