"""``memrec tui --live`` as a user runs it on a host without NVML (this one): a real ``memrec daemon``
with real uprobes on the stub driver, stub workloads, and the TUI in tmux (tmux's own TERM, 120x36).

The reported case: a daemon that had recorded workloads (all exited, nothing held) gave the TUI a
header listing no GPU (no NVML) and a state holding nothing, so the TUI named no GPU and stayed
blank, "0 events", "daemon stalled?" (silence is what an idle daemon without NVML sends).
"""

from __future__ import annotations

import re
import shutil
import time

import pytest

from tests.bpf.test_daemon import DaemonProcess
from tests.bpf.test_daemon import run_workload
from tests.bpf.test_daemon import workdir  # noqa: F401 (a fixture)
from tests.tui.tmux_term import Tmux
from tests.tui.tmux_term import main_view_painted
from tests.tui.tmux_term import tui_command

pytestmark = [pytest.mark.bpf, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]

_EVENTS = re.compile(r"│ ([\d,]+) events? │")


def events_on(screen: str) -> int:
    m = _EVENTS.search(screen)
    return int(m.group(1).replace(",", "")) if m else -1


def wait_events_above(t: Tmux, floor: int, timeout: float = 30.0) -> str:
    end = time.monotonic() + timeout
    s = ""
    while time.monotonic() < end:
        s = t.screen()
        if events_on(s) > floor:
            return s
        time.sleep(0.2)
    raise AssertionError(f"the events count stayed at or below {floor}:\n{s}")


def test_live_tui_without_nvml_paints_and_counts(workdir, stub_lib):  # noqa: F811
    # GIVEN a daemon on this host without NVML that has recorded a workload (exited: nothing held)
    daemon = DaemonProcess(workdir, stub_lib)
    t = None
    try:
        daemon.wait_ready()
        if "NVML unavailable" not in daemon.log():
            pytest.skip("this host has NVML: the case is a host without it")
        run_workload(stub_lib, "basic", "leak", "multi")
        # WHEN the user opens the live view
        t = Tmux("memrec-live-nonvml", tui_command("--live", str(daemon.socket)), (120, 36))
        # THEN the GPU view is drawn (tabs, header, axis), not a blank screen
        painted, screen = t.wait_painted()
        assert painted, screen
        assert "GPU1" in screen.splitlines()[0]
        # AND an idle daemon is not called stalled (without NVML it sends nothing while idle)
        time.sleep(4.5)
        screen = t.screen()
        assert "stalled" not in screen and "live, idle" in screen, screen
        # WHEN workloads allocate, THEN the events count rises and the GPU view stays
        first = events_on(screen)
        run_workload(stub_lib, "basic", "leak")
        screen = wait_events_above(t, max(first, 0))
        counted = events_on(screen)
        run_workload(stub_lib, "multi")
        screen = wait_events_above(t, counted)
        assert main_view_painted(screen) and "● live" in screen, screen
    finally:
        if t is not None:
            t.close()
        daemon.stop()

