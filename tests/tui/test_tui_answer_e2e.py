"""The TUI's first screen leads with the report's answer (issue 22): the real ``memrec tui`` in tmux
with tmux's own TERM, on the SGLang examples, read with capture-pane and compared with what
``memrec report --json`` says (failure, cause, window) and ``memrec diff`` says (the verdict)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tmux_term import Tmux
from tmux_term import tui_command

from memrec.analysis.report.answer import Answer

ROOT = Path(__file__).resolve().parents[2]
IPC = ROOT / "examples" / "sglang-standin-ipc.mrec"
BASE = ROOT / "examples" / "sglang-standin-base.mrec"

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")


def memrec_json(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "memrec", *args, "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def axis_seconds(screen: str) -> list[float]:
    """The times under the chart (``└7.7369s``), in seconds."""
    return [float(x) for x in re.findall(r"└(\d+\.\d+)s", screen)]


@pytest.mark.parametrize("size", [(120, 36), (80, 24)], ids=["120x36", "80x24"])
def test_first_screen_is_the_report_s_failure_cause_and_window(size):
    answer = Answer.from_json(memrec_json("report", str(IPC))["answer"])
    t = Tmux(f"memrec-answer-{size[0]}", tui_command(IPC), size)
    try:
        # GIVEN the TUI on the run whose KV sizing failed
        # THEN its status line says what the report's first line says, with the cause where it fits
        screen = t.wait_for(f"✗ {answer.headline.short}")
        if size[0] >= 120:
            screen = t.wait_for(answer.cause.short)
        # AND the chart shows the answer's window, with enough decimals to tell its times apart
        w = answer.window
        ticks = axis_seconds(screen)
        pad = (w.end_s - w.start_s) * 0.2 + 1e-3
        assert len(ticks) >= 4 and len(set(ticks)) == len(ticks)
        assert all(w.start_s - pad <= x <= w.end_s + pad for x in ticks), (ticks, w)
        # AND the phases the cause names are readable in it, and the cursor is on the failure
        assert "custom_ar_init" in screen and "kv_budget" in screen
        assert f"t={answer.failure.t_s:.4f}" in screen or f"t={answer.failure.t_s:.5f}" in screen
        # AND the events table shows the result column whole
        assert "result" in screen
    finally:
        t.close()


def test_o_visits_every_failure_the_report_counts_and_no_other():
    answer = Answer.from_json(memrec_json("report", str(IPC))["answer"])
    t = Tmux("memrec-answer-o", tui_command(IPC), (120, 36))
    try:
        t.wait_for(f"✗ {answer.headline.short}")
        # WHEN o is pressed from the start of the trace
        t.keys("Home")
        seen = []
        for _ in range(len(answer.failures) + 1):
            t.keys("o")
            time.sleep(0.5)
            seen.append(t.screen())
        # THEN each failure the report counts comes in turn, named by what failed, its phase and rank
        for f, screen in zip(answer.failures, seen):
            assert f"✗ {f.what} in {f.phase} · {f.who}" in screen, screen
        # AND after the last one there is no next
        assert "no next failure" in seen[-1]
    finally:
        t.close()


def test_diff_opens_on_the_failing_run_with_memrec_diff_s_verdict():
    d = memrec_json("diff", str(BASE), str(IPC))
    t = Tmux("memrec-answer-diff", tui_command(BASE, "--diff", IPC), (120, 36))
    try:
        # THEN the status line is memrec diff's verdict (cut at the edge: it is long)
        t.wait_for("✗ " + d["verdict"]["headline"][:80])
        # AND at the moment the runs are aligned on (the KV sizing), the failing run holds more,
        # signed B − A as memrec diff writes it: custom_ar_init's 18 GiB per rank
        t.wait_for("aligned on kv_budget begin")
        t.wait_for("+36.00 GiB")
        screen = t.wait_for("+18.00 GiB")
        assert "-15.04" not in screen
    finally:
        t.close()
