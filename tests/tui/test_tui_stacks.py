"""The stack screen (``s``): the frames of the selected allocation at 80x24, on traces written
through the real writer with stacks (tests/stack_traces.py)."""

from __future__ import annotations

from conftest import settle

from memrec.tui.app import MemrecApp
from memrec.tui.screens.stack import StackScreen
from memrec.tui.sources import FileSource
from memrec.tui.widgets.panels import EventsTable
from memrec.tui.widgets.panels import HoldersTable
from tests.stack_traces import sglang_trace


def body(app) -> str:
    screen = app.screen
    assert isinstance(screen, StackScreen)
    return screen.body.plain


async def test_s_shows_the_stack_of_the_failed_allocation_at_80x24(tmp_path):
    # GIVEN a trace with stacks whose first failed call is KV pool's 100 GiB allocation on TP0
    app = MemrecApp(FileSource(sglang_trace(tmp_path / "t.mrec", fail=True)))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)  # the view opens at the first failed call
        await pilot.press("s")
        await settle(pilot)
        text = body(app)
        lines = text.splitlines()
        # THEN the screen names the event, then its frames innermost first, the site marked
        assert lines[0].startswith("alloc 100.00 GiB by TP0 at +6.50s")
        assert lines[2].strip() == "libcuda.so.1+0x2a1f0 cuMemAlloc_v2"
        assert "▶ sglang/srt/mem_cache/memory_pool.py:210 MHATokenToKVPool._create_buffers" in lines
        assert all(len(line) <= 80 for line in lines)
        # AND it closes with esc
        await pilot.press("escape")
        assert type(app.screen).__name__ == "MainScreen"


async def test_s_on_the_largest_holders_row_shows_that_allocations_stack(tmp_path):
    app = MemrecApp(FileSource(sglang_trace(tmp_path / "t.mrec")))
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("end", "h", "h")  # by process -> phase -> largest
        await settle(pilot)
        holders = app.query_one("#holders", HoldersTable)
        assert holders.view_name == "largest"
        holders.focus()
        await pilot.press("s")
        await settle(pilot)
        # THEN the largest allocation at the end (the weights) shows the loader's line as its site
        assert "▶ sglang/srt/model_loader/loader.py:377 DefaultModelLoader.load_model" in body(app).splitlines()


async def test_events_without_a_stack_say_so(tmp_path):
    app = MemrecApp(FileSource(sglang_trace(tmp_path / "t.mrec", stacks=False)))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        events = app.query_one("#events", EventsTable)
        assert events.seqs
        await pilot.press("s")
        await settle(pilot)
        assert "no stack recorded for this event" in body(app)


async def test_an_unreadable_stack_says_why(tmp_path):
    from memrec.trace.reader import load_trace

    path = sglang_trace(tmp_path / "t.mrec")
    trace = load_trace(path)
    unreadable = [i for i, s in enumerate(trace.event_columns["stack"].tolist()) if s and
                  trace.stack(s).__class__.__name__ == "Unavailable"][0]
    app = MemrecApp(FileSource(path))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        view = app.screen.model.stack_view(unreadable)
        assert view.site is None and view.kind == "alloc"
        from memrec.tui.screens.stack import stack_text

        assert "stack unavailable: python 3.9: interpreter layout unknown" in stack_text(view, "TP0", "+4.6s").plain


def test_a_live_stream_delivers_stacks_to_the_model(tmp_path):
    # GIVEN the records a daemon's writer sends its subscribers (the bytes the file gets)
    from memrec.terms.events import Kind
    from memrec.trace import format as fmt
    from memrec.trace.writer import BytesSink
    from memrec.trace.writer import TraceWriter
    from memrec.tui.model import TraceModel
    from tests.stack_traces import CUSTOM_AR
    from tests.utils import GiB
    from tests.utils import ev
    from tests.utils import events

    sink = BytesSink()
    with TraceWriter(sink, fmt.make_header(host="h")) as w:
        sid = w.intern_stack(CUSTOM_AR)
        w.write_events(events(ev(Kind.ALLOC, ts=10, pid=5, gpu=0, ptr=0x10, size=GiB, stack=sid)))
    model = TraceModel()
    for data in sink.records:
        model.add_record(fmt.unpackb(data), live=True)
    # THEN the model resolves the event's stack as a file's scan does
    view = model.stack_view(0)
    assert view.stack == CUSTOM_AR and view.site.function == "CustomAllreduce.__init__" and model.warnings == []


def test_a_live_stream_s_stacks_keep_their_file_across_a_rotation_and_a_resync():
    # GIVEN a stream as the daemon sends it: a file, then (a resync) its header and its record of
    # every stack again, then (a rotation) a new file that numbers its stacks from 1 again
    from memrec.terms.events import Kind
    from memrec.trace import format as fmt
    from memrec.trace.stacks import Unavailable
    from memrec.trace.writer import BytesSink
    from memrec.trace.writer import TraceWriter
    from memrec.tui.model import TraceModel
    from tests.stack_traces import CUSTOM_AR
    from tests.stack_traces import KV_POOL
    from tests.stack_traces import WEIGHTS
    from tests.utils import GiB
    from tests.utils import ev
    from tests.utils import events

    stream = []
    first = BytesSink()
    with TraceWriter(first, fmt.make_header(host="h")) as w:
        a = w.intern_stack(WEIGHTS)
        w.write_events(events(ev(Kind.ALLOC, ts=10, pid=5, gpu=0, ptr=0x10, size=1 * GiB, stack=a)))
        w.flush()
        stream += first.records
        resync = [first.records[0], fmt.packb(w.stack_definitions())]  # header, the file's stacks so far
        b = w.intern_stack(CUSTOM_AR)
        w.write_events(events(ev(Kind.ALLOC, ts=20, pid=5, gpu=0, ptr=0x20, size=2 * GiB, stack=b)))
        w.flush()
        stream += resync + first.records[len(stream):]
    second = BytesSink()
    with TraceWriter(second, fmt.make_header(host="h")) as w:
        c = w.intern_stack(KV_POOL)  # id 1 again
        d = w.intern_stack(WEIGHTS)
        w.write_events(events(ev(Kind.ALLOC, ts=30, pid=5, gpu=0, ptr=0x30, size=3 * GiB, stack=c),
                              ev(Kind.ALLOC, ts=40, pid=5, gpu=0, ptr=0x40, size=4 * GiB, stack=d),
                              ev(Kind.ALLOC, ts=50, pid=5, gpu=0, ptr=0x50, size=5 * GiB, stack=99)))
    stream += second.records
    assert (a, b, c, d) == (1, 2, 1, 2)
    model = TraceModel()
    for data in stream:
        model.add_record(fmt.unpackb(data), live=True)
    # THEN each event shows its own file's stack; the one whose id its file never defined, none
    stacks = {model.stack_view(seq).size // GiB: model.stack_view(seq).stack for seq in range(model.store.n)}
    assert stacks == {1: WEIGHTS, 2: CUSTOM_AR, 3: KV_POOL, 4: WEIGHTS, 5: None}
    assert model.warnings == [] and not isinstance(stacks[3], Unavailable)
    # AND a stack seen in both files is one stack of the stream
    assert len(model.stacks) == 3


async def test_s_on_a_free_shows_the_stack_of_the_allocation_it_frees(tmp_path):
    from memrec.terms.events import Kind
    from memrec.trace.reader import load_trace
    from memrec.tui.screens.stack import stack_text
    from tests.stack_traces import SCRATCH

    # GIVEN a trace whose scratch buffer (2 GiB, its own stack) is freed inside load_weights, and
    # the free's own row has no stack (the probe records stacks on allocations only)
    path = sglang_trace(tmp_path / "t.mrec")
    ev = load_trace(path).event_columns
    frees = [i for i, k in enumerate(ev["kind"].tolist()) if k == Kind.FREE and ev["pid"][i] == 100]
    (free,) = frees
    assert ev["stack"][free] == 0
    made = [i for i in range(free) if ev["kind"][i] == Kind.ALLOC and ev["ptr"][i] == ev["ptr"][free]
            and ev["pid"][i] == 100]
    app = MemrecApp(FileSource(path))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        model = app.screen.model
        # WHEN the free is selected THEN its view is the allocation's: its size, time and stack
        view = model.stack_view(free)
        assert (view.seq, view.free_seq, view.size, view.stack) == (made[-1], free, 2 << 30, SCRATCH)
        assert view.site.function == "scratch_buffer"
        text = stack_text(view, "TP0", "+1.60s").plain.splitlines()
        assert text[0].startswith("alloc 2.00 GiB by TP0 at +1.60s")
        assert f"the allocation that event {free:,} (the free selected) gives back" in text[1]
        assert "▶ sglang/srt/model_loader/weight_utils.py:51 scratch_buffer" in text
        # AND `s` on the events table's row of the free opens that screen
        app.main._set_cursor(int(ev["ts"][free]))
        await settle(pilot)
        events = app.query_one("#events", EventsTable)
        events.move_cursor(row=events.seqs.index(free))
        await pilot.press("s")
        await settle(pilot)
        assert "▶ sglang/srt/model_loader/weight_utils.py:51 scratch_buffer" in body(app).splitlines()


def test_a_free_whose_allocation_came_before_the_events_says_so(tmp_path):
    from memrec.terms.events import Kind
    from memrec.trace import format as fmt
    from memrec.trace.writer import BytesSink
    from memrec.trace.writer import TraceWriter
    from memrec.tui.model import TraceModel
    from memrec.tui.screens.stack import stack_text
    from tests.stack_traces import WEIGHTS
    from tests.utils import GiB
    from tests.utils import ev
    from tests.utils import events

    sink = BytesSink()
    with TraceWriter(sink, fmt.make_header(host="h")) as w:
        sid = w.intern_stack(WEIGHTS)
        w.write_events(events(ev(Kind.ALLOC, ts=10, pid=5, gpu=0, ptr=0x10, size=GiB, stack=sid),
                              ev(Kind.FREE, ts=20, pid=5, gpu=0, ptr=0x99),  # made before the recording
                              ev(Kind.FREE, ts=30, pid=6, gpu=0, ptr=0x10),  # another process's pointer
                              ev(Kind.FREE, ts=40, pid=5, gpu=0, ptr=0x10)))
    model = TraceModel()
    for data in sink.records:
        model.add_record(fmt.unpackb(data), live=True)
    assert model.stack_view(3).stack == WEIGHTS and model.stack_view(3).free_seq == 3
    for seq in (1, 2):
        view = model.stack_view(seq)
        assert view.free_unmatched and view.stack is None and view.seq == seq
        assert "no allocation of this free among the events" in stack_text(view, "pid 5", "+0s").plain
    # AND an allocation without a stack still says so
    assert not model.stack_view(0).free_unmatched


async def test_tui_diff_says_which_line_of_code_changed(tmp_path):
    # GIVEN two runs with stacks alike but for custom all-reduce (18 GiB a rank, then 30 GiB)
    from memrec.tui.sources import DiffSource

    a = sglang_trace(tmp_path / "a.mrec")
    b = sglang_trace(tmp_path / "b.mrec", custom_ar=30 << 30)
    app = MemrecApp(DiffSource(a, b))
    async with app.run_test(size=(160, 36)) as pilot:
        await settle(pilot)
        # THEN the status line carries memrec diff's verdict, and its line names the site that grew
        status = str(app.query_one("#status").render())
        assert "custom_all_reduce.py:123 CustomAllreduce.__init__ peaks +24.00 GiB" in status, status


def test_the_answer_is_of_the_file_the_view_shows(tmp_path):
    import os

    # GIVEN a view of a trace, and the answer of that trace read again from the path
    path = sglang_trace(tmp_path / "t.mrec", fail=True)
    src = FileSource(path)
    src.open()
    assert src.answer() is not None
    # WHEN another trace is moved over the path after the view opened it
    os.rename(sglang_trace(tmp_path / "o.mrec"), path)
    # THEN the view gets no answer (not the other trace's), and says why
    assert src.answer() is None
    assert any("changed while it was read" in w for w in src.model.warnings)
