"""``memrec report``: output of a real trace file, filters, and one-line errors with exit codes."""

from __future__ import annotations

import json

import pytest

from memrec import commands
from memrec.base.errors import ExitCode
from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace import format as fmt
from memrec.trace.writer import TraceWriter
from tests.utils import GiB
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events


@pytest.fixture
def main():
    """``memrec.commands.main``: the real command line."""
    return commands.main


def write_trace(path, close: bool = True, nvml: bool = True):
    """``nvml=False``: as a host without NVML records it (no GPU list in the header)."""
    gpus = [GpuInfo(0, "GPU-0", "NVIDIA H200", 140 * GiB), GpuInfo(1, "GPU-1", "NVIDIA H200", 140 * GiB)]
    header = fmt.make_header(
        host="gpu-host",
        boot_id="b",
        anchor={"monotonic_ns": 1_000, "wall_ns": 0},
        gpus=gpus if nvml else [],
    )
    w = TraceWriter(path, header)
    w.write_process(ProcessInfo(7, 1, ["python3", "serve.py"], None, "0", [0], 1_000, {"tp": 0}))
    w.write_marker(Marker(ts=1_500, pid=7, uid=0, tid=7, name="load", phase="begin"))
    w.write_events(
        events(
            ev(Kind.ALLOC, pid=7, ptr=0x1000, size=3 * GiB, gpu=0),
            ev(Kind.ALLOC, pid=8, ptr=0x1000, size=MiB, gpu=1),
            ev(Kind.ALLOC, pid=7, size=200 * GiB, gpu=0, result=2),
        )
    )
    w.write_marker(Marker(ts=5_000, pid=7, uid=0, tid=7, name="load", phase="end"))
    if close:
        w.close()
    else:
        w.abort()
    return path


def test_report_prints_the_text_report(main, tmp_path, capsys):
    # GIVEN a trace written by the real writer
    path = write_trace(tmp_path / "run.mrec")
    # WHEN reported
    rc = main(["report", str(path)])
    out, err = capsys.readouterr()
    # THEN it succeeds with the per-GPU text and says nothing on stderr
    assert rc == ExitCode.OK and err == ""
    # the answer first (the out-of-memory), then the details
    assert out.splitlines()[0].startswith("FAILED  cuMemAlloc") and out.splitlines()[4] == "memrec report"
    assert "GPU 0  NVIDIA H200  GPU-0  140.00 GiB total" in out
    assert "GPU 1  NVIDIA H200  GPU-1  140.00 GiB total" in out
    assert "CUDA_ERROR_OUT_OF_MEMORY" in out
    assert "no trailer" not in out


def test_report_json_is_the_built_report(main, tmp_path, capsys):
    # GIVEN a trace
    path = write_trace(tmp_path / "run.mrec")
    # WHEN reported as JSON for GPU 0
    rc = main(["report", str(path), "--json", "--gpu", "0"])
    report = json.loads(capsys.readouterr().out)
    # THEN it is one JSON document with GPU 0 alone, its numbers exact
    assert rc == ExitCode.OK
    assert [g["gpu"] for g in report["gpus"]] == [0]
    assert report["gpus"][0]["peak"]["bytes"] == 3 * GiB
    assert report["gpus"][0]["failures"][0]["size"] == 200 * GiB
    assert report["phases"][0]["name"] == "load"


def test_report_of_an_unfinished_trace_says_so(main, tmp_path, capsys):
    # GIVEN a trace whose recorder died (no trailer)
    path = write_trace(tmp_path / "run.mrec", close=False)
    # WHEN reported
    rc = main(["report", str(path)])
    out = capsys.readouterr().out
    # THEN it still reports, and warns
    assert rc == ExitCode.OK
    assert "!! no trailer: the recording did not end cleanly" in out


def test_missing_file_is_no_input(main, tmp_path, capsys):
    # WHEN the trace does not exist
    rc = main(["report", str(tmp_path / "nope.mrec")])
    err = capsys.readouterr().err
    # THEN exit 66 with one line
    assert rc == ExitCode.NO_INPUT
    assert err == f"memrec: error: {tmp_path / 'nope.mrec'}: no such file\n"


def test_directory_is_no_input(main, tmp_path, capsys):
    rc = main(["report", str(tmp_path)])
    assert rc == ExitCode.NO_INPUT
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_not_a_trace_is_a_data_error(main, tmp_path, capsys):
    # GIVEN a file that is not a trace
    path = tmp_path / "notes.txt"
    path.write_bytes(b"this is not a memrec trace\n" * 10)
    # WHEN reported
    rc = main(["report", str(path)])
    err = capsys.readouterr().err
    # THEN exit 65 with one line naming the file once
    assert rc == ExitCode.DATA
    assert len(err.splitlines()) == 1 and err.count(str(path)) == 1 and "not a memrec trace" in err


def test_unknown_gpu_or_pid_is_a_usage_error(main, tmp_path, capsys):
    # GIVEN a trace with GPUs 0 and 1
    path = write_trace(tmp_path / "run.mrec")
    # WHEN asked for GPU 5, then for a pid that is not there
    rc_gpu = main(["report", str(path), "--gpu", "5"])
    err_gpu = capsys.readouterr().err
    rc_pid = main(["report", str(path), "-p", "999"])
    err_pid = capsys.readouterr().err
    # THEN both are usage errors that say what is there
    assert rc_gpu == ExitCode.USAGE and "GPU 5 is not in this trace (GPUs: 0, 1)" in err_gpu
    assert rc_pid == ExitCode.USAGE and "process 999 is not in this trace" in err_pid


def test_gpus_of_a_trace_without_nvml_come_from_its_events(main, tmp_path, capsys):
    # GIVEN a trace recorded without NVML: its header lists no GPU, its events name GPUs 0 and 1
    path = write_trace(tmp_path / "run.mrec", nvml=False)
    # WHEN a GPU it does not have is asked for
    rc = main(["report", "-g", "7", str(path)])
    err = capsys.readouterr().err
    # THEN the error lists the GPUs the events name
    assert rc == ExitCode.USAGE and "GPU 7 is not in this trace (GPUs: 0, 1)" in err
    # AND one it has is reported alone
    assert main(["report", "-g", "1", "--json", str(path)]) == ExitCode.OK
    report = json.loads(capsys.readouterr().out)
    assert [g["gpu"] for g in report["gpus"]] == [1]


def test_pid_filter(main, tmp_path, capsys):
    # GIVEN a trace with pid 7 on GPU 0 and pid 8 on GPU 1
    path = write_trace(tmp_path / "run.mrec")
    # WHEN reported for pid 8
    rc = main(["report", str(path), "--pid", "8", "--json"])
    report = json.loads(capsys.readouterr().out)
    # THEN only GPU 1 and pid 8 are there
    assert rc == ExitCode.OK
    assert [g["gpu"] for g in report["gpus"]] == [1] and [p["pid"] for p in report["processes"]] == [8]


def test_report_spells_boolean_and_null_values_as_the_trace_does(main, tmp_path, capsys):
    # GIVEN a marker with true, false and null values (`memrec mark x ok=true`, memrec.mark(...))
    path = tmp_path / "run.mrec"
    header = fmt.make_header(host="h", boot_id="b", anchor={"monotonic_ns": 0, "wall_ns": 0},
                             gpus=[GpuInfo(0, "GPU-0", "NVIDIA H200", 140 * GiB)])
    w = TraceWriter(path, header)
    w.write_process(ProcessInfo(7, 1, ["python3", "serve.py"], None, "0", [0], 1_000, {}))
    w.write_marker(Marker(ts=1_500, pid=7, uid=0, tid=7, name="checked", phase="instant",
                          values={"ok": True, "cached": False, "why": None}))
    w.write_events(events(ev(Kind.ALLOC, pid=7, ptr=0x1000, size=MiB, gpu=0)))
    w.close()
    # WHEN reported
    assert main(["report", str(path)]) == ExitCode.OK
    out = capsys.readouterr().out
    # THEN the values read true/false/null, as in the trace and the JSON, not Python's True/False/None
    assert "ok=true, cached=false, why=null" in out
    assert "True" not in out and "False" not in out and "None" not in out
