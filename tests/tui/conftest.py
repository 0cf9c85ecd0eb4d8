"""Fixtures of the TUI tests: scripted traces, trace files, and the snapshot gate.

Snapshot tests compare SVG screenshots with the ones under ``__snapshots__``; they only mean
something with the exact textual and pytest-textual-snapshot versions that made them, so they are
skipped (saying why) with any other version, and when the plugin is not installed.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import synth  # noqa: E402

#: The versions the committed snapshots were made with.
SNAPSHOT_PINS = {"textual": "8.2.8", "pytest-textual-snapshot": "1.1.0"}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def snapshot_skip_reason() -> str | None:
    for name, pin in SNAPSHOT_PINS.items():
        got = _version(name)
        if got != pin:
            return f"snapshot tests need {name}=={pin} (have {got or 'none'}): pip install {name}=={pin}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = snapshot_skip_reason()
    if reason is None and not config.pluginmanager.hasplugin("textual-snapshot"):
        reason = "the pytest-textual-snapshot plugin is not active"
    if reason is None:
        return
    for item in items:
        if "snap_compare" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def trace():
    return synth.sglang_like()


@pytest.fixture
def trace_file(tmp_path, trace):
    path = tmp_path / "run.mrec"
    synth.write_trace(path, trace)
    return path


class FixedClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FixedClock()


async def _until_scrolls_settle(pilot, rounds: int = 40) -> None:
    """Wait until no widget's scroll offset moves between two pauses, on every screen of the stack
    (tables scroll to their cursor row after a refresh, behind a modal too; a loaded machine
    otherwise snapshots them before they do)."""
    def offsets():
        widgets = [w for screen in pilot.app.screen_stack for w in screen.walk_children()]
        return [(id(w), w.scroll_offset) for w in widgets if hasattr(w, "scroll_offset")]

    before, stable = offsets(), 0
    for _ in range(rounds):
        await pilot.pause(0.05)
        now = offsets()
        stable = stable + 1 if now == before else 0
        if stable >= 4:  # 200 ms without a move: a deferred scroll would have landed
            return
        before = now


async def _until_tables_measured(pilot, rounds: int = 40) -> None:
    """Wait until every table has measured its new rows: a DataTable sizes its columns when its
    message queue is empty, which on a loaded machine can come after a snapshot (columns as wide
    as their labels, the values cut)."""
    from textual.widgets import DataTable

    for _ in range(rounds):
        tables = [w for screen in pilot.app.screen_stack for w in screen.query(DataTable)]
        if not any(t._require_update_dimensions or t._updated_cells for t in tables):
            return
        await pilot.pause(0.05)


async def settle(pilot, rounds: int = 3, timeout: float = 20.0) -> None:
    """Let the file load, the workers finish and their messages be handled."""
    import time

    from textual.worker import WorkerCancelled

    app = pilot.app
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        # a file source's thread still at work (splitting the untraced band after the replay) posts
        # once more: its messages must be handled before the view is settled
        busy = not app.source.live and getattr(app.source, "running", False)
        for _ in range(rounds):
            await pilot.pause()
            try:
                await app.workers.wait_for_complete()
            except WorkerCancelled:  # a cursor request replaced by a newer one (a key, the replay's end)
                pass
        await pilot.pause()
        live = app.source.live
        state_ok = app.main.gpu == -1 or app.main.cursor_state is not None or not app.main.loaded
        key_ok = app.main._state_key is None or app.main.gpu == -1 or app.main.answered_key == app.main._state_key
        if (live or (app.main.loaded and app.main.indexed)) and not busy and state_ok and key_ok and not app.workers._workers:
            # Tables scroll to their cursor row with an animation: a loaded machine can snapshot
            # a scrollbar mid-way (seen once in CI: the events table's thumb one row apart).
            await pilot.wait_for_scheduled_animations()
            await _until_tables_measured(pilot)
            await _until_scrolls_settle(pilot)
            await _until_tables_measured(pilot)
            return
        await pilot.pause(0.02)
