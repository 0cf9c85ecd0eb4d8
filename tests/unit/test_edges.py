"""Issue 23, item 6: integers at any int64/uint64 edge, in every record type, read by every reader.

A failed call at ts = 2^63 made ``report``, ``report --json`` and the TUI exit 70 (OverflowError
in ``engine/phases.py``); an api of 32,768 made ``diff`` raise, a pid of 2^31 the Perfetto export.
Here a sample of :mod:`tests.fuzz.edges`' traces goes through every reader
(:func:`tests.fuzz.harness.every_reader`); ``bench/reliability.py edges`` runs all of them.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from memrec.commands import main
from memrec.trace.reader import load_trace

from tests.fuzz import edges
from tests.fuzz import harness
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events

#: The sample the unit suite reads (the bench reads all 342): the values past int64 and the
#: columns and fields that broke a reader.
SAMPLE = ("events.ts=9223372036854775808", "events.ts=-1", "events.size=-1",
          "events.ptr=9223372036854775808", "events.result=-1", "events.api=32768", "events.kind=-1",
          "events.pid=2147483648", "events.gpu=-1", "events.ordinal=2147483647", "nvml.ts=9223372036854775808",
          "nvml.used=-1", "procmem.used=9223372036854775807", "marker.gpu=18446744073709551615",
          "process.first_ts=9223372036854775808", "lost.total=-9223372036854775808",
          "keyframe.event_index=18446744073709551615", "trailer.end_ts=9223372036854775808")
TRACES = {name: data for name, data in [*edges.column_edges(), *edges.record_edges()] if name in SAMPLE}


def test_the_sample_names_traces_that_exist():
    assert sorted(TRACES) == sorted(SAMPLE)


@pytest.mark.parametrize("name", SAMPLE)
def test_every_reader_reads_a_trace_with_an_edge_value(tmp_path, name):
    path = tmp_path / "edge.mrec"
    path.write_bytes(TRACES[name])
    codes = harness.every_reader(str(path), str(tmp_path))
    assert set(codes.values()) <= {0}, codes


def test_a_failed_call_at_2_63_is_a_damaged_record_not_an_internal_error(tmp_path):
    # GIVEN the review's file: a failed allocation at ts 2^63 after an ordinary one
    rows = events(ev(edges.Kind.ALLOC, pid=7, ptr=0x10, size=MiB, gpu=0, ts=10),
                  ev(edges.Kind.ALLOC, pid=7, size=MiB, gpu=0, ts=2**63, result=2))
    path = tmp_path / "t.mrec"
    path.write_bytes(edges.pack([{"type": "events", "events": rows}]))
    # WHEN report (text, JSON) reads it THEN it exits 0 and says the record was skipped, and why
    for argv in (["report"], ["report", "--json"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert main([*argv, str(path)]) == 0
        assert "at or past 2^63" in out.getvalue()
    assert any("a ts at or past 2^63 ns" in w for w in load_trace(path).warnings)
    harness.load_in_tui(str(path))
