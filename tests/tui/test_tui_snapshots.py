"""SVG snapshots of the TUI at 80x24 and 160x48 (pinned textual and pytest-textual-snapshot).

Time on screen is relative to the trace (no wall clock), the app's clock is fixed, and the
traces are scripted, so the screens are deterministic. Update with ``--snapshot-update`` after
looking at the report.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import synth
from conftest import FixedClock
from conftest import settle

from memrec.tui.app import MemrecApp
from memrec.tui.sources import DiffSource
from memrec.tui.sources import FileSource

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((160, 48), id="160x48")]


def _app(tmp_path: Path, diff: bool = False) -> MemrecApp:
    a = tmp_path / "run.mrec"
    synth.write_trace(a, synth.sglang_like())
    if diff:
        b = tmp_path / "other.mrec"
        synth.write_trace(b, synth.sglang_like(oom=False, weights_gib=40))
        return MemrecApp(DiffSource(a, b), clock=FixedClock())
    return MemrecApp(FileSource(a), clock=FixedClock())


async def _ready(pilot) -> None:
    await settle(pilot)


@pytest.mark.parametrize("size", SIZES)
def test_gpu_view_at_the_oom(snap_compare, tmp_path, size):
    # GPU1 with the cursor on its failed KV-cache allocation
    async def run_before(pilot):
        await _ready(pilot)
        await pilot.press("1", "home", "o")
        await settle(pilot)

    assert snap_compare(_app(tmp_path), terminal_size=size, run_before=run_before)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("size", [pytest.param((80, 24), id="80x24"), pytest.param((120, 36), id="120x36")])
def test_sglang_example_opens_on_the_answer(snap_compare, size):
    # The first screen, no key pressed: the window from SGLang's memory baseline to the failed KV
    # sizing, the cursor on the failure, the report's first line and its cause in the status line
    assert snap_compare(MemrecApp(FileSource(EXAMPLES / "sglang-standin-ipc.mrec"), clock=FixedClock()),
                        terminal_size=size, run_before=_ready)


def test_sglang_example_diff_opens_on_the_verdict(snap_compare):
    app = MemrecApp(DiffSource(EXAMPLES / "sglang-standin-base.mrec", EXAMPLES / "sglang-standin-ipc.mrec"),
                    clock=FixedClock())
    assert snap_compare(app, terminal_size=(120, 36), run_before=_ready)


@pytest.mark.parametrize("size", SIZES)
def test_overview(snap_compare, tmp_path, size):
    async def run_before(pilot):
        await _ready(pilot)
        await pilot.press("a")
        await settle(pilot)

    assert snap_compare(_app(tmp_path), terminal_size=size, run_before=run_before)


def test_largest_allocations_with_a_filter(snap_compare, tmp_path):
    async def run_before(pilot):
        await _ready(pilot)
        await pilot.press("home", "p", "p", "h", "h", "slash", *"size>=200m", "enter")
        await settle(pilot)

    assert snap_compare(_app(tmp_path), terminal_size=(160, 48), run_before=run_before)


def test_help(snap_compare, tmp_path):
    async def run_before(pilot):
        await _ready(pilot)
        await pilot.press("question_mark")
        await settle(pilot)

    assert snap_compare(_app(tmp_path), terminal_size=(80, 24), run_before=run_before)


def test_diff(snap_compare, tmp_path):
    async def run_before(pilot):
        await _ready(pilot)
        await pilot.press("1", "home", "o", "h")
        await settle(pilot)

    assert snap_compare(_app(tmp_path, diff=True), terminal_size=(160, 48), run_before=run_before)
