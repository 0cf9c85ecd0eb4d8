"""A trace recorded the way a user records one, opened the way a user opens it.

``memrec record`` of a two-process stub-driver program with one failed allocation, on this host
without NVML: the header lists no GPU, the events name GPUs 0 and 1. ``memrec tui`` must paint its
main view on it in tmux (tmux's own TERM and xterm-256color, 120x36 and 80x24), and ``memrec
report -g`` must list the GPUs the events name.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from memrec.trace.reader import load_trace
from tests.tui.tmux_term import Tmux
from tests.tui.tmux_term import tui_command


@pytest.fixture(scope="module")
def recorded(stub_lib, tmp_path_factory):
    path = tmp_path_factory.mktemp("recorded") / "run.mrec"
    workload = [sys.executable, "-m", "memrec.validation.stubdriver.workload", "--lib", str(stub_lib), "basic", "leak"]
    proc = subprocess.run(
        [sys.executable, "-m", "memrec", "record", "--libcuda", str(stub_lib), "-o", str(path), "--", *workload],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return path


def test_the_recorded_trace_is_the_reported_case(recorded):
    trace = load_trace(recorded)
    assert trace.header["gpus"] == [] and len(trace.nvml) == 0 and not trace.markers
    assert len(trace.processes) == 2 and int((trace.events["result"] != 0).sum()) == 1
    assert trace.gpu_ids() == [0, 1]


def test_report_lists_the_gpus_the_events_name(recorded):
    proc = subprocess.run([sys.executable, "-m", "memrec", "report", "-g", "7", str(recorded)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "GPU 7 is not in this trace (GPUs: 0, 1)" in proc.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")
@pytest.mark.parametrize(
    "size, env",
    [
        pytest.param((120, 36), {}, id="tmux-default-term-120x36"),
        pytest.param((80, 24), {}, id="tmux-default-term-80x24"),
        pytest.param((120, 36), {"TERM": "xterm-256color"}, id="xterm-256color-120x36"),
    ],
)
def test_tui_paints_the_recorded_trace(recorded, size, env):
    # GIVEN the recorded trace opened with the real command in tmux
    t = Tmux(f"memrec-recorded-{size[0]}", tui_command(recorded), size, env)
    try:
        # THEN the GPU tabs, the header and the timeline are drawn
        painted, screen = t.wait_painted()
        assert painted, screen
        assert "GPU1" in screen.splitlines()[0]
        # AND they stay after keys and a resize
        t.keys("1", "End")
        t.resize(size[0] - 10, size[1] - 2)
        t.wait_width(size[0] - 10)
        painted, screen = t.wait_painted(10)
        assert painted and "GPU1 " in screen, screen
    finally:
        t.close()
