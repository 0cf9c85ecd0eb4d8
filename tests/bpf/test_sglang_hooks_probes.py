"""The SGLang hooks under memrec's real uprobes on the stub driver: no driver event of their own.

A worker with the driver loaded and initialised but no context (SGLang before ``set_device``)
calls every hook entry point: the probes must see nothing from it. Then it makes a context on
device 1 (the probes see that: the control) and calls every hook again: the only driver call
the hooks may make is one ``cuCtxGetDevice`` (a query, recorded as a CTX event) — no context,
no allocation.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from memrec.terms.events import Api
from memrec.terms.events import Kind

CHILD = r"""
import ctypes, json, os, sys, time
lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)
assert lib.cuInit(0) == 0
from memrec.sglang_hooks import selfcheck
from memrec.sglang_hooks.state import STATE
facts = {"pid": os.getpid()}
def hooks(step):
    STATE.reset()
    t0 = time.monotonic_ns()
    n = selfcheck.run_every_hook(lambda *a: None)
    facts[step] = {"t0": t0, "t1": time.monotonic_ns(), "hooks": n}
hooks("no_context")
t0 = time.monotonic_ns()
ctx = ctypes.c_void_p()
assert lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, 1) == 0
facts["control"] = {"t0": t0, "t1": time.monotonic_ns()}
hooks("context")
print(json.dumps(facts))
"""


def test_hooks_make_no_driver_event_before_a_context_exists(probes, stub_lib):
    # GIVEN real probes on the stub driver and a worker that initialised it
    probes.poll()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(stub_lib)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    # WHEN its events are collected (until its process exit arrives)
    got, deadline = [], time.monotonic() + 10
    while time.monotonic() < deadline:
        ev = probes.poll()
        got.append(ev[ev["pid"] == facts["pid"]])
        if any((g["kind"] == Kind.PROC_EXIT).any() for g in got):
            break
        time.sleep(0.02)
    events = np.concatenate(got)

    def window(step):
        return events[(events["ts"] >= facts[step]["t0"]) & (events["ts"] <= facts[step]["t1"])]

    # THEN while the hooks ran without a context there was no driver event at all
    assert facts["no_context"]["hooks"] > 40
    assert len(window("no_context")) == 0
    # AND the control context is seen by the probes (its entry, CTX_BEGIN, and its return)
    control = window("control")
    assert [Api(a).name for a in control["api"]] == ["cuCtxCreate_v2", "cuCtxCreate_v2"]
    # AND with the context current, the hooks only asked for its device, once
    assert [Api(a).name for a in window("context")["api"]] == ["cuCtxGetDevice"]
