"""PyTorch's own segment history against memrec's recording of the same run, on a real GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import memrec_cmd

from memrec.validation.crosscheck import crosscheck_segments
from memrec.terms.events import Kind
from memrec.trace.reader import load_trace

pytestmark = pytest.mark.usefixtures("torch")


def _record(tmp_path, scenario: str):
    trace_path = tmp_path / f"{scenario}.mrec"
    facts_path = tmp_path / f"{scenario}.json"
    workload = [sys.executable, "-m", "memrec.validation.gpu.torch_workloads", scenario, "--facts", str(facts_path)]
    run = subprocess.run(memrec_cmd("record", "-o", str(trace_path), "--", *workload), timeout=600)
    assert run.returncode == 0
    return load_trace(trace_path), json.loads(facts_path.read_text())


@pytest.mark.parametrize("scenario", ["caching", "expandable"])
def test_every_pytorch_segment_recorded(tmp_path, scenario):
    # GIVEN a PyTorch workload recorded by memrec and by PyTorch's memory history
    trace, facts = _record(tmp_path, scenario)
    # WHEN PyTorch's segment actions are matched against memrec's events
    check = crosscheck_segments(facts["segments"], facts["pids"][0], trace.events)
    print(f"{scenario}: segments matched {check.matched} / {check.total}; missing {check.missing[:5]}")
    # THEN every one is there with the same address and size
    assert check.ok


def test_torch_multiprocessing_ipc_joined(tmp_path):
    # GIVEN a CUDA tensor sent to a spawned child by torch.multiprocessing
    trace, facts = _record(tmp_path, "ipc")
    ipc = facts["ipc"]
    assert ipc["child_wrote"]
    events = trace.events
    # WHEN the exporter's and the importer's IPC events are looked up
    exports = events[(events["pid"] == ipc["exporter"]) & (events["kind"] == Kind.IPC_EXPORT)]
    opens = events[(events["pid"] == ipc["importer"]) & (events["kind"] == Kind.IPC_OPEN)]
    # THEN the exporter exported the segment's base and the importer opened the same handle bytes
    assert ipc["segment_addr"] in exports["ptr"].tolist()
    export_bytes = {bytes(b) for b in exports["ipc"]}
    assert any(bytes(b) in export_bytes for b in opens["ipc"])
    check = crosscheck_segments(facts["segments"], ipc["exporter"], events)
    print(f"ipc: segments matched {check.matched} / {check.total}; opens {len(opens)}; exports {len(exports)}")
    assert check.ok
