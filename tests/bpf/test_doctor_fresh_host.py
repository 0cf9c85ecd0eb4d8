"""`memrec doctor` on a host without kernel headers, the way a fresh host is: a private mount
namespace with an empty /lib/modules (the real one is untouched), real bcc failing to compile."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import pytest


def test_doctor_json_stays_json_when_bcc_cannot_find_kernel_headers(bpf_host):
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is needed to hide /lib/modules in a private mount namespace")
    # GIVEN a host whose /lib/modules is empty, so bcc prints its own complaints while it fails
    script = f"mount -t tmpfs none /lib/modules && exec {sys.executable} -m memrec doctor --json"
    # WHEN doctor checks it, as JSON
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    # THEN stdout is doctor's JSON alone, nothing of bcc's on stderr either, and the bcc check
    # fails with bcc's own reason in its detail
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert proc.returncode == 1 and proc.stderr == ""
    assert checks["kernel headers"]["status"] == checks["bcc"]["status"] == "fail"
    assert "Unable to find kernel headers" in checks["bcc"]["detail"]
    assert "privileges and kernel headers above" in checks["bcc"]["fix"]


def test_the_bcc_check_passes_bcc_the_bytes_it_asks_for(bpf_host):
    # GIVEN bcc warns (DeprecationWarning) for program text and names that are not bytes
    from memrec.probes import health

    # WHEN doctor's bcc check runs with warnings as errors  THEN it compiles and loads, unwarned
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        check = health.check_bcc()
    assert check.status == "ok", check.detail
