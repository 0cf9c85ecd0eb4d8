"""The SGLang hooks on a real GPU never create a CUDA context nor move a byte.

The situation of SGLang 0.4.10 - 0.5.15 workers: torch imported, ``get_device_capability()``
called at import time (``torch.cuda.is_initialized()`` is then true, with no context), and the
first hooks (``init_model_worker``, ``dist_init``) firing before SGLang's ``set_device``. A hook
that asked torch for ``mem_get_info()`` there made a ~500 MiB context on GPU 0 in every rank.

Checked two ways: NVML's per-process list (no entry for the process on any GPU after every hook
ran), and memrec's own trace of the same steps (no driver event at all from the process while
the hooks ran). Each test also makes a context on purpose afterwards, to show that the check
sees one when there is one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import memrec_cmd

from memrec.terms.events import Kind
from memrec.sglang_hooks.targets import MARKER_NAMES
from memrec.trace.reader import load_trace

pytestmark = pytest.mark.usefixtures("torch")

# The worker: the hooks first (no context), then SGLang's set_device + an allocation and the
# hooks again, then the old hooks' mistake (mem_get_info of GPU 0) as the control (on a host
# with more than one GPU: the target is the last GPU). With "--wait", it prints a JSON line after
# each step and waits for a line on stdin.
CHILD = r"""
import json, sys, time
import torch
from memrec import client
from memrec.sglang_hooks import selfcheck
from memrec.sglang_hooks.state import STATE

wait = "--wait" in sys.argv
target = torch.cuda.device_count() - 1
facts = {"pid": __import__("os").getpid(), "capability": list(torch.cuda.get_device_capability()),
         "initialized": torch.cuda.is_initialized(), "target": target,
         "uuid0": str(torch.cuda.get_device_properties(0).uuid)}

def hooks(step):
    sent = []
    def send(name, phase, gpu, values):
        sent.append({"gpu": gpu, **{k: values.get(k) for k in ("cuda_device", "gpu_uuid", "free_bytes")}})
        client.mark(name, phase=phase, gpu=gpu, **values)
    STATE.reset()
    t0 = time.monotonic_ns()
    n = selfcheck.run_every_hook(send)
    facts[step] = {"t0": t0, "t1": time.monotonic_ns(), "hooks": n, "markers": len(sent),
                   "devices": sorted({str(s["cuda_device"]) for s in sent}),
                   "uuids": sorted({str(s["gpu_uuid"]) for s in sent})}
    if wait:
        print(json.dumps(facts), flush=True)
        sys.stdin.readline()

hooks("before_set_device")
t = time.monotonic_ns()
torch.cuda.set_device(target)  # what SGLang does, then its first allocation: the one context
x = torch.zeros(1 << 20, device="cuda")
torch.cuda.synchronize()
facts["make_context"] = {"t0": t, "t1": time.monotonic_ns()}
hooks("after_set_device")
t = time.monotonic_ns()
torch.cuda.mem_get_info(0)  # the control: what the old hooks did
facts["control"] = {"t0": t, "t1": time.monotonic_ns()}
print(json.dumps(facts), flush=True)
if wait:
    sys.stdin.readline()
"""


def _nvml_gpus_of(pid: int, settle_s: float = 2.0, want: set[int] | None = None) -> set[int]:
    """NVML indices listing ``pid`` (polled up to ``settle_s`` for ``want`` to show up)."""
    from memrec.probes.nvml import list_gpus
    from memrec.probes.nvml import process_gpus

    indices = [g.index for g in list_gpus()]
    deadline = time.monotonic() + settle_s
    while True:
        got = process_gpus(indices).get(pid, set())
        if (want is not None and got == want) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _nvml_index_of(uuid: str) -> int:
    from memrec.probes.nvml import list_gpus

    return next(g.index for g in list_gpus() if g.uuid == uuid)


def test_hooks_make_no_context_nvml_shows(tmp_path):
    # GIVEN a worker that imported torch and called get_device_capability()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "--wait"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        # WHEN every hook entry point has run before set_device
        facts = json.loads(proc.stdout.readline())
        print("before set_device:", facts)
        pid, step = facts["pid"], facts["before_set_device"]
        assert facts["initialized"] and step["hooks"] > 40 and step["markers"] > 40
        # THEN NVML lists the process on no GPU, and no marker carried device numbers
        assert _nvml_gpus_of(pid) == set()
        assert step["devices"] == ["None"]
        proc.stdin.write("\n")
        proc.stdin.flush()
        # WHEN SGLang's set_device(target) and an allocation made the one context, and the hooks ran
        facts = json.loads(proc.stdout.readline())
        step = facts["after_set_device"]
        print("after set_device:", facts)
        # THEN the markers name that device and its NVML UUID, and NVML lists the process there only
        assert step["devices"] == [str(facts["target"])]
        [uuid] = step["uuids"]
        target_index = _nvml_index_of(uuid)
        assert _nvml_gpus_of(pid, want={target_index}) == {target_index}
        proc.stdin.write("\n")
        proc.stdin.flush()
        # AND the control (mem_get_info of GPU 0, the old hooks' call) shows up in NVML: the check sees contexts
        facts = json.loads(proc.stdout.readline())
        if facts["target"] != 0:
            uuid0 = facts["uuid0"]
            gpu0 = _nvml_index_of(uuid0 if uuid0.startswith("GPU-") else f"GPU-{uuid0}")
            assert _nvml_gpus_of(pid, want={target_index, gpu0}) == {target_index, gpu0}
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_hooks_make_no_driver_event_memrecs_trace_shows(tmp_path):
    # GIVEN the same worker recorded by memrec
    trace_path = tmp_path / "hooks.mrec"
    run = subprocess.run(memrec_cmd("record", "-o", str(trace_path), "--", sys.executable, "-c", CHILD),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    trace = load_trace(trace_path)
    events = trace.events
    mine = events[events["pid"] == facts["pid"]]

    def window(step: dict):
        return mine[(mine["ts"] >= step["t0"]) & (mine["ts"] <= step["t1"])]

    # WHEN the driver events of the hook windows are counted
    before, after, control = window(facts["before_set_device"]), window(facts["after_set_device"]), window(facts["control"])
    print("events before set_device:", len(before), "after:", len(after), "control:", len(control),
          "CTX in control:", int((control["kind"] == Kind.CTX).sum()))
    # THEN before set_device the hooks made no driver event at all (no CTX, no byte)
    assert len(before) == 0
    # AND after it at most the driver's context query (cuCtxGetDevice, once), no context, no byte
    assert set(after["kind"].tolist()) <= {int(Kind.CTX)} and len(after) <= 1
    # AND the context SGLang's own set_device + allocation made is in the trace (the probes see
    # contexts), as is the control's on GPU 0 when that is another GPU
    assert (window(facts["make_context"])["kind"] == Kind.CTX).sum() >= 1
    if facts["target"] != 0:
        assert (control["kind"] == Kind.CTX).sum() >= 1
    # AND the hooks' markers reached the trace
    hook_markers = [m for m in trace.markers if m.pid == facts["pid"] and m.name in MARKER_NAMES]
    assert len(hook_markers) >= facts["before_set_device"]["markers"]
