"""End to end: the real command in a real terminal (tmux), driven with send-keys and read with
capture-pane: with tmux's own TERM and with ``xterm-256color``, at 120x36, 100x30 and 80x24, on
traces with a GPU list in the header and without one (no NVML), and started again and again on a
busy host (the long version: ``bench/bench_tui_paint.py``)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import synth
from tmux_term import Tmux
from tmux_term import cpu_load
from tmux_term import tui_command

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "seed-x2-base.mrec"

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")


@pytest.mark.parametrize(
    "size, env",
    [
        pytest.param((120, 36), {}, id="tmux-default-term-120x36"),
        pytest.param((100, 30), {"TERM": "xterm-256color", "COLORTERM": ""}, id="256-colours"),
        pytest.param((80, 24), {"TERM": "xterm-256color", "NO_COLOR": "1"}, id="no-colour-80x24"),
    ],
)
def test_replay_in_a_terminal(trace_file, size, env):
    name = f"memrec-e2e-{size[0]}"
    t = Tmux(name, tui_command(trace_file), size, env)
    try:
        # GIVEN the TUI on the scripted trace
        # it opens on the failed call, named as the report's first line names it
        screen = t.wait_for("✗ cuMemAlloc_v2 of 90.00 GiB on GPU 1:")
        # the state at the cursor (GPU1's failed call, where it opens) is in (under 100 columns the
        # holders name the rank without its pid)
        t.wait_for("tp1 4102" if size[0] >= 100 else "│ tp1 ")
        assert "GPU0" in screen and "GPU1" in screen
        # WHEN GPU1 is chosen and the cursor jumps to the first failed call
        t.keys("1", "Home", "o")
        t.wait_for("t=7.05s")
        # THEN the event at the cursor is the out-of-memory KV-cache allocation (OUT_OF_MEMORY, cut at 80 columns)
        screen = t.wait_for("OUT_O")
        assert "tp1" in screen
        # WHEN the help is opened, THEN it lists the keys; escape closes it
        t.keys("?")
        t.wait_for("next / previous failure")
        t.keys("Escape")
        t.wait_for("events")
        # WHEN q is pressed, THEN the program ends (the shell's sleep keeps the pane)
        t.keys("q")
        end = time.monotonic() + 10
        while time.monotonic() < end and "t=7.05s" in t.screen():
            time.sleep(0.2)
        assert "t=7.05s" not in t.screen()
    finally:
        t.close()


@pytest.fixture
def no_gpu_list_file(tmp_path):
    """The scripted trace as a host without NVML records it (GPUs named only by the events)."""
    path = tmp_path / "no-nvml.mrec"
    synth.write_trace(path, synth.without_nvml(synth.sglang_like()))
    return path


@pytest.mark.parametrize("which", ["no-gpu-list", "gpu-list"])
@pytest.mark.parametrize(
    "size, env",
    [
        pytest.param((120, 36), {}, id="tmux-default-term-120x36"),
        pytest.param((80, 24), {}, id="tmux-default-term-80x24"),
        pytest.param((120, 36), {"TERM": "xterm-256color"}, id="xterm-256color-120x36"),
    ],
)
def test_main_view_paints(no_gpu_list_file, which, size, env):
    # GIVEN a trace whose header lists no GPU (no NVML), or one that lists them
    path = no_gpu_list_file if which == "no-gpu-list" else EXAMPLE
    t = Tmux(f"memrec-paint-{which}-{size[0]}", tui_command(path), size, env)
    try:
        # WHEN the user opens it, THEN the GPU tabs, the header and the timeline are drawn
        painted, screen = t.wait_painted()
        assert painted, f"the main view never painted (TERM {env.get('TERM') or t.term()}):\n{screen}"
        # and they stay drawn after keys and a resize
        t.keys("g", "G", "Right")
        t.resize(100, 30)
        t.wait_width(100)
        painted, screen = t.wait_painted(10)
        assert painted, screen
    finally:
        t.close()


def test_main_view_paints_on_every_start_under_load(no_gpu_list_file):
    # GIVEN a busy host (two spinning processes) and tmux's own TERM
    paths = {"no-gpu-list": no_gpu_list_file, "gpu-list": EXAMPLE}
    failed = []
    with cpu_load(2):
        # WHEN the TUI is started three times on each trace
        for which, path in paths.items():
            for i in range(3):
                t = Tmux(f"memrec-load-{which}-{i}", tui_command(path), (120, 36))
                try:
                    painted, screen = t.wait_painted()
                finally:
                    t.close()
                if not painted:
                    failed.append(f"{which} start {i + 1}:\n{screen}")
    # THEN every start drew the main view
    assert not failed, "\n".join(failed)


def _fits_at_80x24(screen: str) -> None:
    lines = screen.splitlines()
    footer = lines[-1]
    for key in ("? help", "q quit", "←→ cursor", "+- zoom", "mM marker", "pP phase", "oO failure", "bB big", "/ filter"):
        assert key in footer, footer
    assert lines[3].lstrip().startswith("used") and "┤" in lines[4], "the GPU header takes two lines"
    holders = next(line for line in lines if " owned " in line)  # narrow: "rank", not "rank/pid"
    assert holders.lstrip("│ ").startswith("rank") and " ipc " in holders, holders
    assert all(len(line) <= 80 for line in lines)


def test_everything_fits_at_80x24(trace_file):
    # GIVEN the TUI on the scripted trace at 120x36, with tmux's own TERM
    t = Tmux("memrec-80x24", tui_command(trace_file), (120, 36))
    try:
        t.wait_for("tp1 4102")
        # WHEN the terminal shrinks to 80x24 and the cursor goes to GPU1's failed KV-cache allocation
        t.resize(80, 24)
        t.keys("1", "Home", "o")
        screen = t.wait_for("t=7.05s")
        time.sleep(0.5)
        screen = t.screen()
        # THEN the footer keeps all its keys, the GPU header one line of memory, the holders their
        # columns, and the failed call is named in the status line
        _fits_at_80x24(screen)
        assert "✗ cuMemAlloc_v2 of 90.00 GiB: OUT_OF_MEMORY" in screen
        # AND the phase the cursor is in is named in full, however short it is at this zoom
        t.keys("P", "P", "P")  # back to the start of nccl_init (1 s of 12: too short for its name)
        screen = t.wait_for("nccl_init")
        _fits_at_80x24(screen)
        # AND back at 120x36 the wide layout returns
        t.resize(120, 36)
        screen = t.wait_for("rank/pid")  # the holders' wide header
        assert "bB big  / filter" in screen
    finally:
        t.close()


#: What the Linux console's fonts lack and the view used to draw: eighth blocks, braille, ✗ • ┃ … ↑ ● ⚠, heavy lines, round corners.
NOT_IN_CONSOLE_FONT = set("▁▂▃▅▆▇") | {chr(c) for c in range(0x2800, 0x2900)} | set("✗•┃…↑●⚠━╸╺╭╮╰╯")


def test_linux_console_gets_its_own_glyphs_and_16_distinct_colours(trace_file):
    # GIVEN the TUI on the Linux console (TERM=linux: 16 colours, a font without eighth blocks)
    t = Tmux("memrec-linux", tui_command(trace_file), (160, 40), {"TERM": "linux", "COLORTERM": ""})
    try:
        # WHEN it opens (at GPU1's failed call)
        t.wait_for("tp1 4102")
        time.sleep(0.5)
        screen = t.screen()
        # THEN the header, the chart, the failure row and the bands use only glyphs the console has
        lines = screen.splitlines()
        bottom = next(i for i, line in enumerate(lines) if "0 B┤" in line)
        body = "\n".join(lines[:bottom + 4])  # the tabs, their underline, the header, the chart, the bands, the axis
        body += "\n" + "\n".join(line[:1] + line[-1:] for line in lines[bottom + 4 : -2])  # the tables' borders, not their scrollbars
        assert not (set(body) & NOT_IN_CONSOLE_FONT), sorted(set(body) & NOT_IN_CONSOLE_FONT)
        assert "x" in lines[bottom + 1][11:]  # the failed call, in ASCII, under the chart
        # AND the legend's five categories are drawn in five different ANSI colours
        colours = t.legend_colours()
        assert len(colours) == 5 and len(set(colours.values())) == 5, colours
        print("legend colours under TERM=linux:", colours)
    finally:
        t.close()
