"""The real ``memrec tui`` in a real terminal: tmux, driven with send-keys and read with capture-pane.

Each session runs on a tmux server of its own (``-L``) started without a configuration file
(``-f /dev/null``), so the program sees what a user's fresh tmux gives it: tmux's own default
TERM (``tmux-256color`` on Debian 12) unless a test names another. Used by the end-to-end tests
and by ``bench/bench_tui_paint.py`` (many starts under CPU load).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

#: The timeline's value axis ("  153M┤", " 140.00 GiB┤"): only the main (GPU) view draws it.
_AXIS = re.compile(r"┤")


def tui_command(*args: str) -> str:
    """``memrec tui ARGS`` as a user runs it (this interpreter, so the worktree's package)."""
    return " ".join(shlex.quote(a) for a in (sys.executable, "-m", "memrec", "tui", *map(str, args)))


def main_view_painted(screen: str) -> bool:
    """The main view is on screen: the GPU tabs, the header at the cursor and the timeline's axis
    (not only the status line and the footer, as when the tabs were never built)."""
    lines = screen.splitlines()
    return (
        bool(lines) and "GPU0" in lines[0]
        and any("t=" in line and "GPU" in line for line in lines[1:5])
        and any(_AXIS.search(line) for line in lines)
    )


class Tmux:
    """One detached tmux session on a private server running ``command`` at ``size``.

    Args:
        env: variables set for the command (``TERM`` only when a test wants another terminal).
    """

    def __init__(self, name: str, command: str, size: tuple[int, int], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.socket = f"{name}-{os.getpid()}"
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        # COLUMNS and LINES: a pane started from pytest gets them, and a program that honours them
        # (Textual does) then never follows a resize
        self._tmux("-f", "/dev/null", "new-session", "-d", "-s", name, "-x", str(size[0]), "-y", str(size[1]),
                   f"env -u COLUMNS -u LINES {exports} {command}; sleep 60", check=True)

    def _tmux(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=check)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", self.name).stdout

    def legend_colours(self) -> dict[str, str]:
        """The foreground colour (SGR parameters) of each category's block in the header's legend."""
        text = self._tmux("capture-pane", "-e", "-p", "-t", self.name).stdout
        out = {}
        for name in ("driver", "vmm", "host_pinned", "untraced", "ipc_mapped"):
            m = re.search(r"((?:\x1b\[[0-9;]*m)+)█(?:\x1b\[[0-9;]*m)*" + name + " ", text)
            if m:
                params = ";".join(re.findall(r"\x1b\[([0-9;]*)m", m.group(1)))
                fg = re.findall(r"(?:^|;)(3[0-7]|9[0-7]|38;5;\d+|38;2;\d+;\d+;\d+)(?=;|$)", params)
                out[name] = fg[-1] if fg else params
        return out

    def term(self) -> str:
        """TERM as the pane's program got it (tmux's ``default-terminal``)."""
        return self._tmux("show-options", "-gv", "default-terminal").stdout.strip()

    def keys(self, *keys: str) -> None:
        for k in keys:
            self._tmux("send-keys", "-t", self.name, k, check=True)
            time.sleep(0.15)

    def resize(self, width: int, height: int) -> None:
        self._tmux("resize-window", "-t", self.name, "-x", str(width), "-y", str(height))

    def wait_for(self, text: str, timeout: float = 20.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            s = self.screen()
            if text in s:
                return s
            time.sleep(0.2)
        raise AssertionError(f"{text!r} not on screen:\n{self.screen()}")

    def wait_width(self, width: int, timeout: float = 20.0) -> str:
        """Wait until the program has redrawn at ``width`` columns (its tabs' rule spans them)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            lines = self.screen().splitlines()
            if len(lines) > 1 and len(lines[1]) == width:
                return "\n".join(lines)
            time.sleep(0.2)
        raise AssertionError(f"not redrawn at {width} columns:\n{self.screen()}")

    def wait_painted(self, timeout: float = 30.0) -> tuple[bool, str]:
        """(painted, last screen): wait until :func:`main_view_painted` or ``timeout``."""
        end = time.monotonic() + timeout
        s = ""
        while time.monotonic() < end:
            s = self.screen()
            if main_view_painted(s):
                return True, s
            time.sleep(0.2)
        return False, s

    def close(self) -> None:
        self._tmux("kill-server")


@contextmanager
def cpu_load(workers: int) -> Iterator[None]:
    """``workers`` processes spinning on the CPU (a busy host) while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(workers)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
