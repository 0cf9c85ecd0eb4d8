"""The holders panel's context and untraced views: the same split as ``memrec report``."""

from __future__ import annotations

import dataclasses

import numpy as np
import synth
from conftest import settle

from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.trace.writer import TraceWriter
from memrec.tui.app import MemrecApp
from memrec.tui.sources import FileSource
from memrec.tui.widgets.panels import HOLDER_VIEWS
from memrec.tui.widgets.panels import HoldersTable

SEC, T0, MiB = synth.SEC, synth.T0, 2**20


def write_context_trace(path) -> None:
    """pid 4101 binds a context on GPU 0 (cost 500 MiB, then 90 MiB at its first kernel) and allocates
    there; it also binds one on GPU 1 and allocates nothing there (a foreign context)."""
    s = synth.Script()
    s.add(1.0, 4101, Kind.CTX, Api.cuDevicePrimaryCtxRetain, 0, handle=0xC0)
    s.add(2.0, 4101, Kind.KERNEL_LOAD, Api.cuLibraryGetKernel, 0, handle=0x11)
    s.add(3.0, 4101, Kind.ALLOC, Api.cuMemAlloc_v2, 0, ptr=0x7F00_0000_0000, size=64 * MiB)
    s.add(4.0, 4101, Kind.CTX, Api.cuDevicePrimaryCtxRetain, 1, handle=0xC1)
    pm = np.array([(T0 + int(t * SEC), g, 4101, used) for t, g, used in (
        (1.5, 0, 500 * MiB), (2.5, 0, 590 * MiB), (3.5, 0, 654 * MiB), (4.5, 1, 500 * MiB), (5.0, 0, 654 * MiB),
    )], dtype=PROCMEM_DTYPE)
    with TraceWriter(path, synth.header()) as w:
        w.write_events(s.events())
        w.write_procmem(pm)


async def test_holders_list_contexts_with_their_cost_and_the_split(tmp_path):
    # GIVEN a trace with two contexts and NVML per-process samples
    path = tmp_path / "ctx.mrec"
    write_context_trace(path)
    app = MemrecApp(FileSource(path))
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        holders = app.query_one("#holders", HoldersTable)
        # WHEN the cursor goes to the end (it opens at the 64 MiB peak, before GPU 1's context)
        # and the holders cycle to the context view (process, phase, largest, category, context)
        await pilot.press("end", "h", "h", "h", "h")
        await settle(pilot)
        # THEN GPU 0's context is there with its cost (the bind and its first kernel)
        assert holders.view_name == "context"
        row = holders.get_row_at(0)
        assert (row[1], row[3], row[4]) == ("cuDevicePrimaryCtxRetain", "590.0 MiB", "")
        # AND the next view is each process's split
        await pilot.press("h")
        await settle(pilot)
        assert holders.view_name == "untraced"
        assert [str(c) for c in holders.get_row_at(0)[1:]] == ["590.0 MiB"] + ["0 B"] * 7
        # AND on GPU 1 (the view stays; once round the other views comes back to contexts) it is foreign
        await pilot.press("g")  # the next GPU
        await settle(pilot)
        assert app.main.gpu == 1
        await pilot.press(*["h"] * (len(HOLDER_VIEWS) - 1))
        await settle(pilot)
        assert holders.view_name == "context"
        assert holders.get_row_at(0)[4] == "foreign: allocates nothing here"


def _split_by_the_tui(path, **source) -> dict:
    src = FileSource(path, **source)
    src.scan()
    src.index()
    assert src.reconcile(), src.model.untraced_note
    return src.model.reconciliation.summary()


def test_the_split_from_the_tuis_own_replay_is_the_reports(tmp_path):
    # GIVEN traces with contexts and per-process samples, and one with markers, NVML and
    # keyframes (the replay's journal spans their keyframes; chunks of an odd size)
    from memrec.analysis.untraced.reconcile import reconcile
    from memrec.trace.reader import load_trace

    ctx = tmp_path / "ctx.mrec"
    write_context_trace(ctx)
    sg = tmp_path / "sglang.mrec"
    synth.write_trace(sg, synth.sglang_like())
    # a rotated file: it starts with the state at a keyframe, and NVML lists its processes
    full = synth.sglang_like()
    kf = next(k for k in full.keyframes if k.event_index == 64)
    pids = sorted({int(p) for p in full.events["pid"]})
    pm = np.array([(int(ts), g, pid, (1 + g) * 900 * MiB) for ts in full.nvml["ts"][::8] for g in (0, 1) for pid in pids],
                  dtype=PROCMEM_DTYPE)
    rotated = tmp_path / "rotated.mrec"
    synth.write_trace(rotated, dataclasses.replace(full, events=full.events[64:], procmem=pm,
                                                   keyframes=[dataclasses.replace(kf, event_index=0)]))
    # and one with per-process samples and no events at all
    quiet = tmp_path / "quiet.mrec"
    with TraceWriter(quiet, synth.header()) as w:
        w.write_procmem(np.array([(T0 + i * SEC, 0, 4101, 5 * MiB) for i in range(3)], dtype=PROCMEM_DTYPE))
    for path in (ctx, sg, rotated, quiet):
        # WHEN the TUI splits the untraced band from its own replay (no second read or replay)
        ours = _split_by_the_tui(path, index_step=777)
        # THEN it is memrec report's split of the file, number for number
        assert ours == reconcile(load_trace(path)).summary(), path
