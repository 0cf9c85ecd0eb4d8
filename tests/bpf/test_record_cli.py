"""`memrec demo` and `memrec record` as a user runs them (real probes on the stub driver): what they
say while they work, what they do with an existing output, and where they point the user next."""

from __future__ import annotations

import subprocess
import sys

from memrec.trace.reader import load_trace


def memrec(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memrec", *args], capture_output=True, text=True, timeout=180,
                          cwd=cwd)


def test_demo_says_each_slow_step_replaces_its_own_file_and_points_at_a_command_that_works(bpf_host, tmp_path):
    # GIVEN the demo's trace from an earlier run
    out = tmp_path / "demo.mrec"
    out.write_bytes(b"an earlier demo")
    # WHEN the demo runs again
    proc = memrec("demo", "-o", str(out))
    # THEN it replaces its file and says so, and says what it does before each silent wait
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert f"memrec demo: replacing {out}" in err and "replaced the existing file" not in err
    assert "memrec demo: loading the BPF probes" in err and "memrec demo: recording; probe program " in err
    assert "memrec demo: closing the trace, then detaching the probes" in err
    assert load_trace(out).trailer is not None
    # AND the hint it ends with names commands that work on a terminal (not a bare `memrec dump`)
    hint = err.strip().splitlines()[-1]
    assert f"memrec tui {out}" in hint and f"memrec dump {out} | head" in hint
    assert "GPU 0" in proc.stdout and "CUDA_ERROR_OUT_OF_MEMORY" in proc.stdout


def test_demo_into_a_folder_writes_demo_mrec_there_and_reports_it(bpf_host, tmp_path):
    # GIVEN a folder as the demo's output
    # WHEN the demo runs
    proc = memrec("demo", "-o", str(tmp_path))
    # THEN it writes demo.mrec in it and reports that trace (not an internal error reading the folder)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "demo.mrec"
    assert [p.name for p in tmp_path.iterdir()] == ["demo.mrec"]
    assert load_trace(out).trailer is not None
    assert "CUDA_ERROR_OUT_OF_MEMORY" in proc.stdout and f"memrec tui {out}" in proc.stderr


def test_record_force_replaces_an_existing_trace_and_says_so(bpf_host, tmp_path):
    # GIVEN an existing file at the output
    out = tmp_path / "run.mrec"
    out.write_bytes(b"an earlier recording")
    # WHEN recording with --force
    proc = memrec("record", "-f", "-o", str(out), "--", "true")
    # THEN the command's exit code, one line about the replaced file, one before each slow step
    assert proc.returncode == 0, proc.stderr
    assert f"memrec record: replacing {out}" in proc.stderr and "replaced the existing file" not in proc.stderr
    assert "memrec record: loading the BPF probes" in proc.stderr and "memrec record: recording; probe program " in proc.stderr
    assert "memrec record: closing the trace, then detaching the probes" in proc.stderr
    assert load_trace(out).trailer is not None


def test_mark_with_a_command_gives_the_command_s_memory_to_its_phase(stub_lib, tmp_path):
    # GIVEN the stub workload run as a phase: `memrec mark x -- WORKLOAD`, under memrec record
    out = tmp_path / "run.mrec"
    workload = [sys.executable, "-m", "memrec.validation.stubdriver.workload", "demo", "--lib", str(stub_lib)]
    proc = memrec("record", "-o", str(out), "--libcuda", str(stub_lib), "--", sys.executable, "-m", "memrec",
                  "mark", "x", "--", *workload)
    # THEN the workload's exit status is record's, and the report's by-phase table gives its memory to x
    assert proc.returncode == 0, proc.stderr
    report = memrec("report", str(out)).stdout
    phases = report[report.index("by phase"):]
    assert any(line.split()[1:2] == ["x"] for line in phases.splitlines()), phases
    assert "(no phase)" not in phases.split("\n\n")[0], phases
