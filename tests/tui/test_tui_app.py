"""Pilot tests: keys, cursor, zoom, jumps, filters, tabs, help, diff (behaviour, not pixels)."""

from __future__ import annotations

import numpy as np
import pytest
import synth
from conftest import settle

from memrec.tui.app import MemrecApp
from memrec.tui.sources import DiffSource
from memrec.tui.sources import FileSource
from memrec.tui.widgets.panels import EventsTable
from memrec.tui.widgets.panels import HoldersTable
from memrec.tui.widgets.timeline import GUTTER

SEC = synth.SEC
T0 = synth.T0


async def test_opens_at_the_first_failed_call_and_names_it(trace_file):
    # GIVEN the app on a trace whose only failed call is rank 1's KV-cache allocation on GPU1
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        # THEN GPU1's tab is shown with the cursor on that call, and the holders are filled
        main = app.main
        assert main.gpu == 1 and main.loaded and main.indexed
        assert main.cursor_ts == T0 + int(7.05 * SEC)
        assert main.cursor_state is not None and main.cursor_state.gpu == 1
        table = app.query_one("#holders", HoldersTable)
        assert table.get_row_at(0)[0] == "tp1 4102"
        assert "tab-gpu0" in [t.id for t in app.query("Tab")]
        # AND the status line says what failed, as the report's first line does, and its cause
        status = str(app.query_one("#status").render())
        assert "✗ cuMemAlloc_v2 of 90.00 GiB on GPU 1: CUDA_ERROR_OUT_OF_MEMORY" in status
        assert "GPU 1 held" in status
        # AND o from the start goes to the same call, named by its phase and rank
        await pilot.press("home", "o")
        assert main.cursor_ts == T0 + int(7.05 * SEC)
        assert "✗ cuMemAlloc_v2 of 90.00 GiB: CUDA_ERROR_OUT_OF_MEMORY in kv_cache · tp1" in str(app.query_one("#status").render())


async def test_without_a_failure_opens_at_the_peak(tmp_path):
    # GIVEN a run without the failure: GPU1 peaks once its KV cache is allocated
    path = tmp_path / "ok.mrec"
    synth.write_trace(path, synth.sglang_like(oom=False))
    app = MemrecApp(FileSource(path))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        # THEN the view opens on GPU1 at the first instant of that peak, named in the status line
        # as the report's first line names it
        assert (app.main.gpu, app.main.cursor_ts) == (1, T0 + int(7.05 * SEC))
        # (owned bytes, as the report counts them: the 512 MiB it maps from a peer is not its own)
        assert "highest peak 152.12 GiB on GPU 1 at +7.050s" in str(app.query_one("#status").render())


async def test_cursor_keys_zoom_and_fit(trace_file):
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        # WHEN home, then right three times
        await pilot.press("home")
        assert app.main.cursor_ts == T0
        span = app.main.t1 - app.main.t0
        await pilot.press("right", "right", "right")
        # THEN the cursor moved three columns
        step = span / (app.query_one("#timeline").size.width - GUTTER)
        assert abs(app.main.cursor_ts - (T0 + 3 * step)) <= 3
        # WHEN zooming in twice then out once
        await pilot.press("plus", "plus", "minus")
        assert app.main.t1 - app.main.t0 == span // 2
        assert app.main.t0 <= app.main.cursor_ts < app.main.t1
        # WHEN fitting
        await pilot.press("f")
        assert app.main.t0 == T0


async def test_jump_to_oom_shows_the_failed_gpu(trace_file):
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        # GIVEN GPU1 shown and the cursor at the start
        await pilot.press("1", "home")
        # WHEN o is pressed
        await pilot.press("o")
        await settle(pilot)
        # THEN the cursor is on the failed KV allocation and the event table shows it at the cursor
        assert app.main.cursor_ts == T0 + int(7.05 * SEC)
        events = app.query_one("#events", EventsTable)
        row = events.get_row_at(events.cursor_row)
        assert row[1] == "alloc" and "OUT_OF_MEMORY" in str(row[3])
        # AND there is no further failure
        await pilot.press("o")
        assert app.main.cursor_ts == T0 + int(7.05 * SEC)


async def test_marker_phase_and_big_jumps(trace_file):
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        await pilot.press("0", "home", "m")
        assert app.main.cursor_ts == T0 + int(0.5 * SEC)
        # AND the status line names what the cursor landed on
        assert "marker load_weights begin · tp0" in str(app.query_one("#status").render())
        await pilot.press("p")
        assert app.main.cursor_ts == T0 + int(4.0 * SEC)
        await pilot.press("p")
        assert app.main.cursor_ts == T0 + int(5.2 * SEC)
        await pilot.press("P")
        assert app.main.cursor_ts == T0 + int(4.0 * SEC)
        await pilot.press("home")
        await pilot.press("b")
        assert app.main.cursor_ts == T0 + int(0.6 * SEC)


async def test_filter_box_filters_the_event_table(trace_file):
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        # WHEN a filter is typed and submitted
        await pilot.press("slash")
        assert app.focused.id == "filter"
        await pilot.press(*"kind:free", "enter")
        await settle(pilot)
        # THEN only frees are listed, and the filter is kept
        events = app.query_one("#events", EventsTable)
        kinds = {events.get_row_at(i)[1] for i in range(events.row_count)}
        assert kinds == {"free"} and events.row_count == 3
        assert app.main.flt_text == "kind:free"
        # WHEN a bad filter is submitted, THEN the old one stays
        await pilot.press("slash", *" kind:nope", "enter")
        await settle(pilot)
        assert app.main.flt_text == "kind:free"


@pytest.mark.parametrize("size", [(80, 24), (120, 36)], ids=["80x24", "120x36"])
async def test_the_filter_box_sits_inside_the_events_panel(trace_file, size):
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        holders = app.query_one("#holders", HoldersTable)
        pane = app.query_one("#events-pane")
        closed = pane.region
        # WHEN the filter box opens
        await pilot.press("slash")
        await pilot.pause()
        box, table = app.query_one("#filter").region, app.query_one("#events", EventsTable).region
        # THEN it is the first row inside the events panel's frame, above the table, and the frame
        # (title included) still starts on the holders' top row: the panel did not move
        inside = pane.content_region
        assert pane.region == closed and pane.region.y == holders.region.y
        assert (box.x, box.y, box.width, box.height) == (inside.x, inside.y, inside.width, 1)
        assert table.y == box.y + 1 and table.x == inside.x and table.bottom == inside.bottom
        assert "events" in str(pane.border_title)


async def test_tabs_overview_and_holders_views(trace_file):
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        await pilot.press("a")
        assert app.main.gpu == -1
        assert app.query_one("#switcher").current == "overview"
        assert "GPU1" in str(app.query_one("#ov-label1").render())
        await pilot.press("g")
        assert app.main.gpu == 0
        await pilot.press("G", "G")
        assert app.main.gpu == 1
        await pilot.press("home", "o")  # rank 1 exits at 9 s: look before that
        await settle(pilot)
        holders = app.query_one("#holders", HoldersTable)
        await pilot.press("h")
        assert holders.view_name == "phase"
        assert holders.get_row_at(0)[0] == "load_weights"
        await pilot.press("h")
        assert holders.view_name == "largest"
        assert holders.get_row_at(0)[2] == "load_weights"


async def test_click_moves_the_cursor(trace_file):
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        graph = app.query_one("#timeline")
        await pilot.click("#timeline", offset=(6 + 10, 2))
        await settle(pilot)
        expected = graph.ts_at(6 + 10)
        assert app.main.cursor_ts == expected


async def test_help_screen(trace_file):
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        assert type(app.screen).__name__ == "MainScreen"


async def test_at_80x24_the_events_table_shows_each_size_with_its_unit(trace_file):
    # GIVEN the app at 80x24, on the events around the failed call
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("1", "o")
        await settle(pilot)
        events = app.query_one("#events", EventsTable)
        # WHEN the table's columns are laid out
        names = [str(c.label) for c in events.ordered_columns]
        widths = [c.get_render_width(events) for c in events.ordered_columns]
        # THEN time, kind, size and result come first and fit in view, whatever the rank labels' width
        assert names[:5] == ["time", "kind", "size", "result", "rank"]
        assert sum(widths[:4]) <= events.scrollable_content_region.width
        sizes = [str(events.get_row_at(i)[2]) for i in range(events.row_count)]
        assert any(s.endswith(("GiB", "MiB", "KiB", " B")) for s in sizes), sizes


async def test_diff_mode_compares_holders(tmp_path, trace):
    # GIVEN a base with the OOM and another run with smaller weights and no OOM
    a, b = tmp_path / "a.mrec", tmp_path / "b.mrec"
    synth.write_trace(a, trace)
    synth.write_trace(b, synth.sglang_like(oom=False, weights_gib=40))
    app = MemrecApp(DiffSource(a, b))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        await pilot.press("1")
        app.main._set_cursor(T0 + 8 * SEC)
        await settle(pilot)
        holders = app.query_one("#holders", HoldersTable)
        await pilot.press("h")  # by phase
        rows = {holders.get_row_at(i)[0]: holders.get_row_at(i) for i in range(holders.row_count)}
        # THEN the KV cache exists only in the other run, and weights shrank by 20 GiB
        assert rows["kv_cache"][1] == "0 B" and rows["kv_cache"][2] == "90.00 GiB"
        assert rows["load_weights"][3] == "-20.00 GiB"
        assert app.main.other_state is not None


async def test_o_jumps_to_every_failed_call_and_names_its_result(tmp_path):
    # GIVEN the scripted run plus a cuMemCreate refused with CUresult 800 (not permitted) on GPU1
    from memrec.terms.events import Api
    from memrec.terms.events import Kind
    from memrec.trace.model import Trace

    base = synth.sglang_like()
    s = synth.Script()
    s.add(2.0, synth.PIDS[1], Kind.VMM_CREATE, Api.cuMemCreate, 1, size=1 << 20, result=800)
    events = np.sort(np.concatenate([base.events, s.events()]), order="ts", kind="stable")
    path = tmp_path / "run.mrec"
    synth.write_trace(path, Trace(header=base.header, events=events, nvml=base.nvml, markers=base.markers,
                                  processes=base.processes, trailer=base.trailer))
    app = MemrecApp(FileSource(path))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        status = app.query_one("#status")
        # THEN the footer does not call the key "OOM", and the status counts the failures
        assert "OOM" not in _footer_text(app) and "failure" in _footer_text(app)
        await pilot.press("home")
        assert "2 failures" in str(status.render())
        # WHEN GPU1 is shown and o pressed from the start
        await pilot.press("1", "home", "o")
        await settle(pilot)
        # THEN the cursor is on the refused cuMemCreate, named with its CUresult, not as an OOM
        assert app.main.cursor_ts == T0 + 2 * SEC
        assert "cuMemCreate of 1.0 MiB: CUDA_ERROR_NOT_PERMITTED" in str(status.render())
        # AND the next o goes on to the out-of-memory allocation
        await pilot.press("o")
        await settle(pilot)
        assert app.main.cursor_ts == T0 + int(7.05 * SEC)
        assert "cuMemAlloc_v2 of 90.00 GiB: CUDA_ERROR_OUT_OF_MEMORY" in str(status.render())


def _footer_text(app) -> str:
    """The footer's keys as drawn."""
    from textual.widgets._footer import FooterKey

    return " ".join(f"{k.key_display} {k.description}" for k in app.query(FooterKey))


async def test_report_diff_and_tui_use_the_same_words_and_sizes(trace_file, capsys):
    # GIVEN the scripted run, whose ranks allocate a 32 MiB workspace before any phase begins
    from memrec.commands import main

    # WHEN the report and the diff are printed
    assert main(["report", str(trace_file)]) == 0
    report = capsys.readouterr().out
    assert main(["diff", str(trace_file), str(trace_file)]) == 0
    diff = capsys.readouterr().out
    # THEN both call that memory "(no phase)" and write its size the same way
    for text in (report, diff):
        assert "(no phase)" in text and "32.0 MiB" in text and "outside phases" not in text
    # AND so does the TUI's "by phase" view at the cursor
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        await pilot.press("f", "home", "right", "right", "right", "right", "h")  # t≈0.4 s: the workspace only
        await settle(pilot)
        holders = app.query_one("#holders", HoldersTable)
        rows = [tuple(map(str, holders.get_row_at(i))) for i in range(holders.row_count)]
        assert ("(no phase)", "32.0 MiB", "1") in rows, rows
        # AND the header's total is written as in the report ("140.00 GiB")
        assert "total 140.00 GiB" in str(app.query_one("#gpu-header").render())


async def test_narrow_layout_follows_resizes(trace_file):
    from textual.widgets import Footer

    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        holders = app.query_one("#holders", HoldersTable)
        # (the categories someone holds at the cursor: driver and the peer's memory mapped by IPC;
        # with one owned category alone, "owned" says it)
        wide = [str(c.label) for c in holders.columns.values()]
        assert wide == ["rank/pid", "owned", "ipc"] or wide == ["rank/pid", "owned", "driver", "vmm", "ipc"], wide
        # WHEN the terminal shrinks under 100 columns, THEN the short forms are used
        await pilot.resize_terminal(80, 24)
        await settle(pilot)
        assert app.main.narrow and app.query_one(Footer).compact
        assert [str(c.label) for c in holders.columns.values()] == ["rank", "owned", "ipc"]
        # AND when it grows again, the wide ones come back
        await pilot.resize_terminal(120, 36)
        await settle(pilot)
        assert not app.main.narrow and not app.query_one(Footer).compact
        assert [str(c.label) for c in holders.columns.values()] == wide


async def test_y_axis_fits_the_data_and_y_shows_the_gpu_total(trace_file):
    app = MemrecApp(FileSource(trace_file))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        graph = app.query_one("#timeline")
        # GIVEN GPU1 (at most ~64 GiB of its 140 GiB used) WHEN it opens
        top = graph.render_line(0).text
        # THEN the axis tops out just above the data, not at the GPU's total
        assert "GiB┤" in top and "140.00 GiB" not in top
        assert 60 < float(top.split()[0]) < 70
        # WHEN y is pressed THEN the axis shows the whole GPU; again, and it fits the data again
        await pilot.press("y")
        assert graph.render_line(0).text.startswith("140.00 GiB┤")
        await pilot.press("y")
        assert graph.render_line(0).text == top


async def test_diff_aligns_the_runs_on_their_first_common_marker(tmp_path):
    # GIVEN a base run and another whose phases all start 2 s later after its first event
    from dataclasses import replace

    a, b = tmp_path / "a.mrec", tmp_path / "b.mrec"
    synth.write_trace(a, synth.sglang_like())
    other = synth.sglang_like(oom=False, weights_gib=40)
    late = replace(other, markers=[replace(m, ts=m.ts + 2 * SEC) for m in other.markers])
    synth.write_trace(b, late)
    app = MemrecApp(DiffSource(a, b))
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        # THEN the other run is read 2 s later than the base, and the header says on what
        assert app.main.alignment.shift == 2 * SEC
        assert "aligned on load_weights begin" in str(app.query_one("#gpu-header").render())


async def _cursor_states_at_the_end(tmp_path, then=None) -> tuple[list, int]:
    """The cursor states a --tensors trace's view posts when the cursor goes to its last event (the
    blocks at a cursor may need a replay from the first event), and how many came before ``then``
    (a coroutine function given the app, run after them)."""
    from memrec.tui import messages
    from tests.utils import MiB
    from tests.utils import write_tensor_trace

    path = write_tensor_trace(tmp_path / "t.mrec", [(0, 4 * MiB), (4 * MiB, MiB)])
    app = MemrecApp(FileSource(path))
    got = []
    async with app.run_test(size=(160, 40)) as pilot:
        app.main.message_signal.subscribe(
            app, lambda m: got.append(m) if isinstance(m, messages.CursorStateReady) else None, immediate=True)
        await settle(pilot)
        await pilot.press("end")
        await settle(pilot)
        before = len(got)
        if then is not None:
            await then(app)
            await settle(pilot)
    return got, before


async def test_the_cursor_state_does_not_wait_for_the_tensor_blocks(tmp_path):
    # GIVEN a --tensors trace; WHEN the cursor goes to the last event
    got, _ = await _cursor_states_at_the_end(tmp_path)
    # THEN its state came first without the blocks (the holders, the events), then with them
    last = [m for m in got if m.key == got[-1].key]
    assert len(last) == 2
    assert last[0].state.tensors == [] and [f.blocks for _, f in last[1].state.tensors] == [2]
    assert last[0].state.by_category == last[1].state.by_category and last[0].events is last[1].events


async def test_the_replay_s_end_told_again_does_not_compute_the_same_state_again(tmp_path):
    # GIVEN a --tensors trace shown at its last event, its state computed (without, then with blocks)
    # WHEN the source says once more that its replay is done (it does after splitting the
    # untraced band; on a loaded machine that came after the key press)
    from memrec.tui import messages

    async def told_again(app) -> None:
        app.post_message(messages.Indexed(0.0))

    got, before = await _cursor_states_at_the_end(tmp_path, told_again)
    # THEN the view kept the state it had: nothing was computed again
    assert before >= 2 and len(got) == before


async def test_holders_tensors_view_shows_allocated_and_reserved(tmp_path):
    # GIVEN a --tensors trace: a 20 MiB segment with blocks of 4 MiB and 1 MiB, the first freed
    from tests.utils import MiB
    from tests.utils import write_tensor_trace

    path = write_tensor_trace(tmp_path / "t.mrec", [(0, 4 * MiB), (4 * MiB, MiB), (0, -1)])
    app = MemrecApp(FileSource(path))
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(pilot)
        await pilot.press("end", *["h"] * 6)
        await settle(pilot)
        holders = app.query_one("#holders", HoldersTable)
        # THEN the last holders view lists the process's blocks at the cursor
        assert holders.view_name == "tensors"
        assert [str(c) for c in holders.get_row_at(0)] == ["7", "1.0 MiB", "20.0 MiB", "19.0 MiB", "15.0 MiB", "1"]
        # AND back at the first event (the segment only) there are no blocks yet
        await pilot.press("home")
        await settle(pilot)
        assert "no tensor blocks" in str(holders.get_row_at(0)[0])
