"""`memrec selftest` on a real GPU: every scripted driver call recorded exactly."""

from __future__ import annotations

import subprocess

from conftest import memrec_cmd


def test_selftest_passes_against_running_daemon(daemon):
    # GIVEN a running daemon
    sock, _ = daemon
    # WHEN the selftest makes its driver calls
    run = subprocess.run(memrec_cmd("selftest", "--socket", str(sock)), capture_output=True, text=True, timeout=300)
    print(run.stdout)
    print(run.stderr)
    # THEN every check passes
    assert run.returncode == 0
    assert "FAIL" not in run.stdout
    assert " 0 failed" in run.stdout
