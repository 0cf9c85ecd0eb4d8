"""The timeline graph rendered without an app (render_timeline is pure)."""

from __future__ import annotations

import numpy as np

from memrec.tui.views import NCAT
from memrec.tui.views import PhaseSpan
from memrec.tui.views import SeriesView
from memrec.tui.widgets.timeline import GUTTER
from memrec.tui.widgets.timeline import TimelineOptions
from memrec.tui.widgets.timeline import render_timeline

G = 1 << 30


def view(driver, vmm=None, nvml=None, coarse=None):
    w = len(driver)
    cats = np.zeros((NCAT, w), dtype=np.int64)
    cats[0] = driver
    if vmm is not None:
        cats[1] = vmm
    nv = np.array(nvml if nvml is not None else [-1] * w, dtype=np.int64)
    return SeriesView(0, w * 1000, w, cats, nv, np.array(coarse or [False] * w), np.ones(w, dtype=bool))


def chart_rows(strips, n):
    return [s.text[GUTTER:] for s in strips[:n]]


def test_full_and_empty_columns():
    # GIVEN a 4-row chart scaled to 4 GiB: 0, 2, 4 GiB of driver memory
    v = view([0, 2 * G, 4 * G])
    # WHEN rendered without axis, event row or bands
    strips = render_timeline(v, TimelineOptions(4, 4 * G, axis=False, event_row=False))
    rows = chart_rows(strips, 4)
    # THEN column 0 is empty, column 1 is filled half way, column 2 to the top
    assert [r[0] for r in rows] == [" "] * 4
    assert [r[1] for r in rows] == [" ", " ", "█", "█"]
    assert [r[2] for r in rows] == ["█"] * 4
    assert strips[0].text.startswith("  4.00 GiB┤") and strips[3].text.startswith("       0 B┤")


def test_eighth_blocks_between_layers():
    # GIVEN 1.5 rows of driver under 1 row of vmm
    v = view([int(1.5 * G)], vmm=[G])
    strips = render_timeline(v, TimelineOptions(4, 4 * G, axis=False, event_row=False))
    col = [r[0] for r in chart_rows(strips, 4)]
    # THEN the cell where driver ends is half a block in driver's colour on vmm's colour,
    # and the cell where vmm ends is half a block of vmm on nothing
    assert col == [" ", "▄", "▄", "█"]
    seg = list(strips[2])[1]
    assert str(seg.style.color.name) == "#5f87ff" and str(seg.style.bgcolor.name) == "#5fd787"
    top = list(strips[1])[1]
    assert str(top.style.color.name) == "#5fd787" and top.style.bgcolor is None


def test_nvml_line_cursor_failures_bands_axis():
    v = view([G] * 10, nvml=[3 * G] * 10)
    band = [PhaseSpan("weights", 1, 0, 2000, 6000)]
    strips = render_timeline(
        v, TimelineOptions(8, 4 * G, cursor_ts=4500, bands=[("tp0", band)], failures=np.array([7500], dtype=np.uint64))
    )
    text = [s.text for s in strips]
    # chart rows: 5 (8 - event row - band - axis); NVML at 3 GiB is row 3 of 5 from the bottom
    assert "─" * 4 in text[5 - 1 - 3]
    # the failure marker is in column 7 of the event row
    assert text[5][GUTTER + 7] == "✗"
    # the band names the phase from its first column; too short for its name, but the cursor is
    # in it: the whole name is written
    assert text[6].startswith("tp0") and text[6][GUTTER + 2 :].startswith("weights ")
    # the axis starts at 0s
    assert "└0s" in text[7]
    # the cursor column has a background in the chart
    cell = list(strips[0])[1 + 4]
    assert cell.style.bgcolor is not None


def test_phase_names_cut_with_an_ellipsis_unless_the_cursor_is_in_them():
    # GIVEN a 4-column phase "load_weights" then a 4-column phase "kv_cache" (1000 ns per column)
    v = view([G] * 20)
    bands = [("tp0", [PhaseSpan("load_weights", 1, 0, 1000, 5000), PhaseSpan("kv_cache", 1, 0, 5000, 9000)])]

    def band(cursor: int) -> str:
        strips = render_timeline(v, TimelineOptions(8, 4 * G, cursor_ts=cursor, bands=bands))
        return strips[6].text[GUTTER:]

    # THEN away from both, each shows the start of its name and "…"
    assert band(9500).startswith(" lo… kv_…  ")
    # AND with the cursor in one, its whole name is written over its neighbour, nothing of the
    # neighbour's name left to read as part of it
    assert band(2500).startswith(" load_weights") and "kv" not in band(2500)
    assert band(6500)[5:].startswith("kv_cache")


def test_no_colour_uses_shading_characters():
    v = view([2 * G], vmm=[2 * G])
    strips = render_timeline(v, TimelineOptions(4, 4 * G, axis=False, event_row=False, color=False))
    assert [r[0] for r in chart_rows(strips, 4)] == ["▓", "▓", "█", "█"]
    assert all(seg.style is None or seg.style.color is None for s in strips for seg in s)


def test_coarse_columns_are_dim_and_outside_is_blank():
    v = view([G, G, G], coarse=[False, True, True])
    v.has_data[2] = False
    strips = render_timeline(v, TimelineOptions(2, G, axis=False, event_row=False))
    segs = list(strips[1])
    assert not segs[1].style.dim and segs[2].style.dim
    assert segs[3].text == " "


def test_every_layer_keeps_its_own_colour_in_16_colours():
    # GIVEN the palette, WHEN a 16-colour terminal downgrades it, THEN no two layers share a colour
    from rich.color import Color
    from rich.color import ColorSystem

    from memrec.tui.widgets.timeline import LAYERS

    ansi = {name: Color.parse(c).downgrade(ColorSystem.STANDARD).number for name, c, _ in LAYERS}
    assert len(set(ansi.values())) == len(LAYERS), ansi


def test_console_glyphs_draw_half_blocks_and_ascii():
    from memrec.tui.widgets.timeline import CONSOLE_GLYPHS
    from memrec.tui.widgets.timeline import glyphs_for

    # GIVEN 1.5 rows of driver under 1 row of vmm, and a failed call, on the Linux console
    assert glyphs_for("linux") is CONSOLE_GLYPHS and glyphs_for("xterm-256color") is not CONSOLE_GLYPHS
    v = view([int(1.5 * G)], vmm=[G])
    strips = render_timeline(v, TimelineOptions(5, 4 * G, axis=False, failures=np.array([0]), glyphs=CONSOLE_GLYPHS))
    cells = "".join(s.text[GUTTER:] for s in strips)
    # THEN only blocks the console font has are drawn, and the failure is an x
    assert set(cells) <= set(" ▄█x") and "▄" in cells
    assert strips[-1].text[GUTTER] == "x"


def test_negative_untraced_reads_as_nvml_lag():
    # GIVEN NVML's last sample below the traced memory (it lags the calls)
    from memrec.tui.widgets.panels import header_text

    text = str(header_text(None, 0, "1.00s", None, 3 * G, {"used": 2 * G, "reserved": 0}))
    # THEN the header says so instead of a negative size
    assert "untraced NVML lag" in text and "-1.00 GiB" not in text
    assert "untraced 1.00 GiB" in str(header_text(None, 0, "1.00s", None, G, {"used": 2 * G, "reserved": 0}))
