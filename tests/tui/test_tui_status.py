"""The status line fits its width: it drops what a user reads it least for, never cuts a phrase."""

from __future__ import annotations

import pytest
from rich.text import Text

from memrec.tui.navigation import Landing
from memrec.tui.widgets.panels import StatusFacts
from memrec.tui.widgets.panels import fit_status

LANDING = Landing(5, 0, "in kv_cache_allocation · TP1", failure=True)


def _facts(**kw) -> StatusFacts:
    base = dict(title="sglang-standin-ipc.mrec vs sglang-standin-base.mrec", events=123_456, progress="",
                failure_here="cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY", failures=3, landing=LANDING, lost=None,
                warnings=2, span=12_120_000_000)
    base.update(kw)
    return StatusFacts(**base)


@pytest.mark.parametrize("width", [200, 160, 120, 100, 80, 60])
def test_the_status_line_fits_and_keeps_what_failed_where(width):
    # GIVEN a diff of two long file names with the cursor on a failed call, and a live prefix
    prefix = ["[b green]●[/] live"]
    # WHEN the status line is fitted to the width
    text = fit_status(prefix, _facts(), width)
    plain = Text.from_markup(text).plain
    # THEN it fits, and what failed is there in full (the failure is the line's point)
    assert Text.from_markup(text).cell_len <= width or width < 80, plain
    assert "OUT_OF_MEMORY" in plain and "live" in plain
    # AND pieces are whole: no piece ends mid-phrase
    assert all(piece.strip() for piece in plain.split("│"))


def test_a_wide_status_line_says_everything():
    # GIVEN room for everything
    plain = Text.from_markup(fit_status([], _facts(landing=None), 300)).plain
    # THEN the file names, the event count and the view's span are all there
    assert "sglang-standin-ipc.mrec" in plain and "123,456 events" in plain and "view 12.12s" in plain


def test_the_file_name_goes_first_then_the_count_then_the_span():
    # GIVEN a line just too wide for the narrow pieces
    full = Text.from_markup(fit_status([], _facts(landing=None), 1000)).plain
    # WHEN narrowed step by step
    widths = range(len(full), 20, -1)
    seen = [Text.from_markup(fit_status([], _facts(landing=None), w)).plain for w in widths]
    # THEN the file name leaves before the event count, and the count before the view's span
    first_gone = {key: next((w for w, s in zip(widths, seen) if key not in s), 0)
                  for key in ("sglang-standin-ipc.mrec", "123,456 events", "view 12.12s")}
    assert first_gone["sglang-standin-ipc.mrec"] >= first_gone["123,456 events"] >= first_gone["view 12.12s"]
