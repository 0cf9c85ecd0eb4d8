"""The writer refuses what the readers would skip: one rule (``check_record``) on both sides."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from memrec.terms.events import MAX_CMDLINE_ARGS
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.probes.procinfo import MAX_CMDLINE_BYTES
from memrec.trace import format as fmt
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter

from tests.unit.daemon_fakes import FakeProbes
from tests.unit.daemon_fakes import raw
from tests.unit.test_daemon_unit import make_daemon
from tests.unit.test_daemon_unit import pump
from tests.unit.test_daemon_unit import workdir  # noqa: F401 (fixture)

HEADER = fmt.make_header(host="h", boot_id="b")
PROCESS = ProcessInfo(10, 1, ["python", "x.py"], "/usr/bin/python3", "2,3", [2, 3], 4, {"tp": 1})
MARKER = Marker(ts=5, pid=10, uid=0, tid=11, name="load", phase="begin", gpu=3, values={"a": 1})

BAD = {
    "process gpu_map None": (lambda w: w.write_process(dataclasses.replace(PROCESS, gpu_map=None)), "gpu_map"),
    "process cmdline of ints": (lambda w: w.write_process(dataclasses.replace(PROCESS, cmdline=[1, 2])), "cmdline"),
    "process pid negative": (lambda w: w.write_process(dataclasses.replace(PROCESS, pid=-1)), "pid"),
    "marker ts past int64": (lambda w: w.write_marker(dataclasses.replace(MARKER, ts=2**63)), "ts"),
    "marker value key not str": (lambda w: w.write_marker(dataclasses.replace(MARKER, values={1: 2})), "values"),
    "lost negative": (lambda w: w.write_lost(9, -1), "total"),
    "keyframe state not a map": (lambda w: w.write_keyframe(9, 0, [1, 2]), "keyframe"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_record_the_reader_would_skip_is_refused_and_nothing_is_written(name, tmp_path):
    write, field = BAD[name]
    path = tmp_path / "t.mrec"
    teed: list[bytes] = []
    # GIVEN a writer with a good process and marker in it
    with TraceWriter(path, HEADER, tee=teed.append) as w:
        w.write_process(PROCESS)
        w.write_marker(MARKER)
        before = (w.records_written, w.bytes_written, len(teed))
        # WHEN a record the reader would skip as malformed is written
        with pytest.raises(ValueError, match=f"refusing to write a record memrec's readers would skip: malformed .*{field}"):
            write(w)
        # THEN nothing of it reached the file or a subscriber
        assert (w.records_written, w.bytes_written, len(teed)) == before
    # AND the file reads back whole: no record skipped, the good ones there
    trace = load_trace(path)
    assert trace.warnings == []
    assert trace.processes == {10: PROCESS} and trace.markers == [MARKER]


def test_a_process_with_more_arguments_than_a_trace_holds_is_written_cut(workdir):  # noqa: F811
    # GIVEN a live process with 70,000 arguments (more than a process record holds: 65,536)
    argv = [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()", *["x"] * 70_000]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"up\n"
    d = make_daemon(workdir)
    d.start()
    try:
        # WHEN the daemon sees it allocate
        FakeProbes.instances[-1].push(raw(Kind.ALLOC, ts=time.monotonic_ns(), pid=p.pid, tid=p.pid, ordinal=0,
                                          ptr=0x1000, size=1 << 20))
        pump(d, 0.05)
    finally:
        d.stop()
        p.stdin.close()
        p.wait()
    # THEN its process record is in the trace (the reader skips none), with its command line cut
    # to MAX_CMDLINE_BYTES (issue 23: any user's argv may be 1 MB; the last argument ends in "...")
    trace = load_trace(d.files[0])
    assert trace.warnings == []
    kept = (b"\0".join(a.encode() for a in argv) + b"\0")[:MAX_CMDLINE_BYTES].split(b"\0")
    kept[-1] += b"..."
    assert trace.processes[p.pid].cmdline == [a.decode() for a in kept][:MAX_CMDLINE_ARGS]
    assert np.array_equal(trace.events["pid"], [p.pid])
    assert os.path.exists(d.files[0])
