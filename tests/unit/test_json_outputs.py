"""Every JSON output parses with a strict parser, whatever values a marker carried.

``memrec mark x a=nan`` and ``memrec.mark(..., a=float("inf"))`` are taken (the trace keeps
them); JSON has no NaN or infinity, and Python's encoder writes ``NaN``/``Infinity``, which
JavaScript's ``JSON.parse`` refuses. They come out as null (memrec/base/jsontext.py).
"""

from __future__ import annotations

import json
import math

import pytest

from memrec.base.jsontext import dumps
from memrec.base.jsontext import finite
from memrec.commands import main
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace import format as fmt
from memrec.trace.writer import TraceWriter

from tests.utils import MiB
from tests.utils import ev
from tests.utils import events

VALUES = {"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "ok": 1.5, "list": [math.nan, 2.0]}


def strict(text: str):
    """json.loads refusing what strict parsers refuse."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.mrec"
    with TraceWriter(path, fmt.make_header(host="h", boot_id="b")) as w:
        w.write_process(ProcessInfo(7, 1, ["python"], None, None, [], 1))
        w.write_marker(Marker(ts=5, pid=7, uid=0, tid=7, name="load", phase="begin", values=dict(VALUES)))
        w.write_events(events(ev(Kind.ALLOC, ts=10, pid=7, gpu=0, ptr=0x1000, size=MiB)))
        w.write_marker(Marker(ts=20, pid=7, uid=0, tid=7, name="load", phase="end", values=dict(VALUES)))
    return path


def test_finite_replaces_only_what_json_lacks():
    assert finite(VALUES) == {"nan": None, "inf": None, "ninf": None, "ok": 1.5, "list": [None, 2.0]}
    assert strict(dumps({"v": (math.inf, 1e308, -0.0, "nan")})) == {"v": [None, 1e308, -0.0, "nan"]}
    assert dumps({"a": 1}, sort_keys=True, indent=1) == json.dumps({"a": 1}, sort_keys=True, indent=1)


def test_dump_report_and_diff_write_strict_json(trace, capsys):
    assert main(["dump", str(trace)]) == 0
    lines = [strict(line) for line in capsys.readouterr().out.splitlines()]
    markers = [line for line in lines if line.get("type") == "marker"]
    assert len(markers) == 2 and markers[0]["values"]["nan"] is None and markers[0]["values"]["ok"] == 1.5
    for argv in (["report", str(trace), "--json"], ["report", str(trace), "--json", "-a"],
                 ["diff", str(trace), str(trace), "--json"]):
        assert main(argv) == 0
        strict(capsys.readouterr().out)


def test_the_api_s_marker_values_are_strict_json(trace):
    import memrec

    values = memrec.load(trace, pandas=False).markers_array()["values"]
    assert [strict(v)["inf"] for v in values] == [None, None]
