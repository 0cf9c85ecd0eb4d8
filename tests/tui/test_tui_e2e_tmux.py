"""End to end: the real command in a real terminal (tmux), driven with send-keys and read with
capture-pane — 256 colours at 100x30, then without colour at 80x24."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")


def _command(trace_file) -> str:
    from memrec import commands

    try:
        import argparse

        parser = commands.get_argument_parser()
        choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        registered = "tui" in choices
    except Exception:
        registered = False
    module = "memrec tui" if registered else "memrec.tui"
    return f"{sys.executable} -m {module} {trace_file}"


class Tmux:
    def __init__(self, name: str, command: str, size: tuple[int, int], env: dict[str, str]) -> None:
        self.name = name
        exports = " ".join(f"{k}={v}" for k, v in env.items())
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", name, "-x", str(size[0]), "-y", str(size[1]),
             f"env {exports} {command}; sleep 30"],
            check=True,
        )

    def screen(self) -> str:
        out = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True)
        return out.stdout

    def keys(self, *keys: str) -> None:
        for k in keys:
            subprocess.run(["tmux", "send-keys", "-t", self.name, k], check=True)
            time.sleep(0.15)

    def wait_for(self, text: str, timeout: float = 20.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            s = self.screen()
            if text in s:
                return s
            time.sleep(0.2)
        raise AssertionError(f"{text!r} not on screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


@pytest.mark.parametrize(
    "size, env",
    [
        pytest.param((100, 30), {"TERM": "xterm-256color", "COLORTERM": ""}, id="256-colours"),
        pytest.param((80, 24), {"TERM": "xterm-256color", "NO_COLOR": "1"}, id="no-colour-80x24"),
    ],
)
def test_replay_in_a_terminal(trace_file, size, env):
    name = f"memrec-e2e-{os.getpid()}-{size[0]}"
    t = Tmux(name, _command(trace_file), size, env)
    try:
        # GIVEN the TUI on the scripted trace
        screen = t.wait_for("107 events")
        t.wait_for("tp0 4101")  # the state at the cursor is in
        assert "GPU0" in screen and "GPU1" in screen
        # WHEN GPU1 is chosen and the cursor jumps to the first failed allocation
        t.keys("1", "Home", "o")
        t.wait_for("t=7.05s")
        # THEN the event at the cursor is the out-of-memory KV-cache allocation (OUT_OF_MEMORY, cut at 80 columns)
        screen = t.wait_for("OUT_O")
        assert "tp1" in screen
        # WHEN the help is opened, THEN it lists the keys; escape closes it
        t.keys("?")
        t.wait_for("next / previous failed allocation")
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
