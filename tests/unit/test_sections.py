"""The typed sections serialise to the JSON the report always printed: fields in declaration
order under their own names, OMITTED fields absent, flattened sections merged into their parent."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from memrec.analysis.report.build import build_report
from memrec.analysis.report.model import FailedCall
from memrec.analysis.report.model import HeldThen
from memrec.analysis.report.model import NvmlSummary
from memrec.analysis.sections import OMITTED
from memrec.analysis.sections import Section
from memrec.analysis.sections import hidden
from memrec.analysis.sections import renamed
from memrec.commands import main
from memrec.trace.reader import load_trace

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class _Inner(Section):
    b: int
    a: list


@dataclass
class _Outer(Section):
    z: str
    inner: _Inner
    maybe: int = OMITTED


def test_fields_keep_their_order_and_omitted_ones_are_left_out():
    # GIVEN a section whose fields are not in alphabetical order, one of them never set
    s = _Outer("x", _Inner(2, [_Inner(1, ())]))
    # THEN its JSON keeps the declaration order, converts nested sections and tuples, and has no "maybe"
    assert json.dumps(s.to_json()) == '{"z": "x", "inner": {"b": 2, "a": [{"b": 1, "a": []}]}}'
    # AND once set, it is there, last
    s.maybe = 0
    assert list(s.to_json()) == ["z", "inner", "maybe"]


@dataclass
class _Row(Section):
    kind: str
    where: str = renamed("in")
    first_ts: int = hidden()


def test_a_hidden_field_is_never_in_the_json_and_a_renamed_one_goes_under_its_key():
    # GIVEN a row with a sort key the renderers share and a field whose JSON key is a keyword
    row = _Row("driver_call", first_ts=7)
    # THEN the sort key is not in the JSON, and the renamed field is absent until set
    assert row.to_json() == {"kind": "driver_call"} and row.first_ts == 7
    row.where = "both"
    assert json.dumps(row.to_json()) == '{"kind": "driver_call", "in": "both"}'


def test_a_failed_call_flattens_the_holders_then_into_its_own_keys():
    f = FailedCall(index=3, ts=10, t_s=0.0, pid=1, tid=2, process="p", kind="ALLOC", api="cuMemAlloc_v2",
                   size=4, result=2, result_name="CUDA_ERROR_OUT_OF_MEMORY", gpu=0, gpu_inferred=False)
    # WHEN on an unknown GPU (no snapshot): no snapshot keys at all
    assert "holders" not in f.to_json() and list(f.to_json())[-2:] == ["phase", "nvml_free"]
    # WHEN the holders then are known: their keys follow the call's
    f.held = HeldThen(owned_on_gpu=5, mapped_on_gpu=0, holders=[], largest=[], by_phase=[])
    assert list(f.to_json())[-5:] == ["owned_on_gpu", "mapped_on_gpu", "holders", "largest", "by_phase"]


def test_nvml_without_a_series_has_no_traced_at_last():
    nv = NvmlSummary(1, None, 5, 0.0, 10, None, None, None, None, None)
    assert "traced_at_last" not in nv.to_json() and "untraced_at_last" not in nv.to_json()


def test_report_json_of_the_cli_is_the_typed_report(capsys):
    # GIVEN the two-rank SGLang example (SGLang section, NVML, failed KV sizing)
    path = ROOT / "examples" / "sglang-standin-ipc.mrec"
    # WHEN reported as JSON by the CLI
    assert main(["report", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    # THEN it is the typed report's JSON, and reading attributes gives the same numbers as the keys
    report = build_report(load_trace(path))
    assert printed == json.dumps(report.to_json(), indent=2) + "\n"
    d = json.loads(printed)
    assert [s["peak"]["bytes"] for s in d["gpus"]] == [s.peak.bytes for s in report.gpus]
    assert d["sglang"]["summary"]["kv_failed"] is report.sglang.summary.kv_failed is True
    assert [r["label"] for r in d["sglang"]["ranks"]] == [r.label for r in report.sglang.ranks]
