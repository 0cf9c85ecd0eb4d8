"""Edges of the command line a new user hits first (issue "First contact", section 3), run as a
user runs them: ``main([...])`` with the output captured, or ``python -m memrec`` in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest

from memrec import commands
from memrec.base.errors import ExitCode
from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.terms.events import ProcessInfo
from memrec.trace import format as fmt
from memrec.trace.writer import TraceWriter
from tests.utils import GiB
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events

ROOT = Path(__file__).resolve().parents[2]


def write_trace(path: Path) -> Path:
    """Two processes on GPU 0: pid 7 (driver and VMM memory, two failed calls: OOM and 800),
    pid 8 (driver memory only, no failure)."""
    header = fmt.make_header(
        host="h", boot_id="b", anchor={"monotonic_ns": 1_000, "wall_ns": 0},
        gpus=[GpuInfo(0, "GPU-0", "NVIDIA H200", 140 * GiB)],
    )
    w = TraceWriter(path, header)
    w.write_process(ProcessInfo(7, 1, ["python3", "serve.py"], None, None, [0], 1_000))
    w.write_process(ProcessInfo(8, 1, ["python3", "side.py"], None, None, [0], 1_000))
    w.write_events(
        events(
            ev(Kind.ALLOC, pid=7, ptr=0x1000, size=3 * GiB, gpu=0),
            ev(Kind.VMM_CREATE, pid=7, handle=0x55, size=2 * MiB, gpu=0),
            ev(Kind.ALLOC, pid=8, ptr=0x9000, size=MiB, gpu=0),
            ev(Kind.ALLOC, pid=7, size=200 * GiB, gpu=0, result=2),
            ev(Kind.ALLOC, pid=7, size=MiB, gpu=0, result=800),
        )
    )
    w.close()
    return path


# ---------------------------------------------------------------------- 3.6 every CUresult named


def test_report_and_dump_name_cuda_error_not_permitted(tmp_path, capsys):
    # GIVEN a trace with a call that failed with CUresult 800
    path = write_trace(tmp_path / "run.mrec")
    # WHEN reported, as text and as JSON
    assert commands.main(["report", str(path)]) == 0
    text = capsys.readouterr().out
    assert commands.main(["report", "--json", str(path)]) == 0
    failures = json.loads(capsys.readouterr().out)["gpus"][0]["failures"]
    # THEN it is named as the driver's header names it, beside the out-of-memory one
    assert "CUDA_ERROR_NOT_PERMITTED" in text and "CUresult 800" not in text
    assert [f["result_name"] for f in failures] == ["CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_NOT_PERMITTED"]
    # AND the report calls them failed calls, not OOMs
    assert "failed calls (2)" in text and "OOM" not in text


def test_the_name_table_is_what_the_drivers_header_gives():
    # GIVEN the generator and the committed table  WHEN checked against cuda.h (when the toolkit is here)
    header = Path("/usr/local/cuda/include/cuda.h")
    from memrec.terms.cu_results import CU_RESULT_NAMES

    # THEN every code CUDA 12+ documents for allocations is there, and the table is the header's
    assert {2: "CUDA_ERROR_OUT_OF_MEMORY", 800: "CUDA_ERROR_NOT_PERMITTED", 999: "CUDA_ERROR_UNKNOWN"}.items() \
        <= CU_RESULT_NAMES.items()
    assert len(CU_RESULT_NAMES) > 90
    if header.exists():
        check = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-cu-results"), "--check", str(header)],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stderr


def test_the_generator_reads_a_header_enum_and_refuses_a_header_without_one(tmp_path):
    # GIVEN a header with a two-entry enum (comments between), and one with none
    good = tmp_path / "cuda.h"
    good.write_text("#define CUDA_VERSION 12345\ntypedef enum cudaError_enum {\n  /** ok */\n"
                    "  CUDA_SUCCESS = 0,\n  /**\n   * no\n   */\n  CUDA_ERROR_X = 7\n} CUresult;\n")
    bad = tmp_path / "empty.h"
    bad.write_text("int x;\n")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import importlib.machinery
        import importlib.util

        loader = importlib.machinery.SourceFileLoader("gen_cu_results", str(ROOT / "scripts" / "gen-cu-results"))
        spec = importlib.util.spec_from_loader("gen_cu_results", loader)
        gen = importlib.util.module_from_spec(spec)
        loader.exec_module(gen)
    finally:
        sys.path.pop(0)
    # WHEN parsed  THEN names by value and the version; the other is one clear error
    assert gen.parse(good.read_text()) == ({0: "CUDA_SUCCESS", 7: "CUDA_ERROR_X"}, "12345")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-cu-results"), "--check", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 66 and "no 'typedef enum cudaError_enum" in result.stderr


# ---------------------------------------------------------------------- 3.9 small report errors


def test_filtered_report_counts_its_own_selection_and_prints_no_empty_rows(tmp_path, capsys):
    # GIVEN a trace where pid 8 made no failed call and used no VMM memory
    path = write_trace(tmp_path / "run.mrec")
    # WHEN reported for pid 8 alone
    rc = commands.main(["report", "-p", "8", str(path)])
    out = capsys.readouterr().out
    # THEN the trace line counts the trace and the filter line the selection, in good English
    assert rc == 0
    assert "  trace: " in out and "2 failed calls, 2 processes" in out
    assert "  filter: pid 8 (1 process, 0 failed calls)" in out
    assert "1 processes" not in out
    # AND no category row for memory only pid 7 had
    assert "vmm" not in out
    assert "driver" in out


def test_unfiltered_one_process_trace_says_1_process(tmp_path, capsys):
    # GIVEN a trace of one process WHEN reported THEN "1 process", "1 failed call"
    header = fmt.make_header(host="h", boot_id="b", anchor={"monotonic_ns": 1_000, "wall_ns": 0})
    w = TraceWriter(tmp_path / "one.mrec", header)
    w.write_events(events(ev(Kind.ALLOC, pid=7, size=200 * GiB, gpu=0, result=2)))
    w.close()
    assert commands.main(["report", str(tmp_path / "one.mrec")]) == 0
    out = capsys.readouterr().out
    assert "1 failed call, 1 process, 0 markers" in out


# ---------------------------------------------------------------------- 3.8 -v after the subcommand


def test_verbose_after_the_subcommand_counts_like_before_it(tmp_path):
    # GIVEN a trace  WHEN `memrec report -v` / `-vv` / `memrec -v report -v` run in a fresh process
    path = write_trace(tmp_path / "run.mrec")
    probe = "import logging, sys; from memrec.commands import main; rc = main(sys.argv[1:]); " \
            "print('LEVEL', logging.getLogger().level, file=sys.stderr); sys.exit(rc)"
    levels = {}
    for args in (["report", "-v"], ["report", "-vv"], ["-v", "report", "-v"], ["report"]):
        proc = subprocess.run([sys.executable, "-c", probe, *args, str(path)], capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        levels[" ".join(args)] = int(proc.stderr.split("LEVEL")[-1])
    # THEN each is accepted, and the counts add up
    assert levels == {"report -v": 20, "report -vv": 10, "-v report -v": 10, "report": 30}


# ---------------------------------------------------------------------- 3.4 record's output


def test_record_refuses_a_missing_folder_and_creates_nothing(tmp_path, capsys):
    # GIVEN an output in a folder that does not exist
    out = tmp_path / "no" / "such" / "x.mrec"
    # WHEN recording
    rc = commands.main(["record", "-o", str(out), "--", "true"])
    err = capsys.readouterr().err
    # THEN one line, exit 73, and no folder made
    assert rc == ExitCode.CANT_CREATE
    assert err == f"memrec: error: cannot write {out}: {out.parent}: no such folder\n"
    assert not (tmp_path / "no").exists()


def test_record_refuses_to_replace_a_trace_without_force(tmp_path, capsys):
    # GIVEN an existing trace
    out = tmp_path / "run.mrec"
    out.write_bytes(b"an earlier recording")
    # WHEN recording to it again without --force
    rc = commands.main(["record", "-o", str(out), "--", "true"])
    err = capsys.readouterr().err
    # THEN it is kept, and the user is told how to replace it
    assert rc == ExitCode.CANT_CREATE
    assert err == f"memrec: error: {out} exists: use -f/--force to replace it, or another -o\n"
    assert out.read_bytes() == b"an earlier recording"


def test_record_refuses_a_folder_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    rc = commands.main(["record", "-o", str(tmp_path / "file" / "x.mrec"), "--", "true"])
    assert rc == ExitCode.CANT_CREATE
    assert "is not a folder" in capsys.readouterr().err



@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_record_refuses_a_sampling_rate_the_daemon_refuses_before_recording(tmp_path, capsys, value):
    # GIVEN a rate `memrec daemon --nvml-hz` refuses (it was an internal error, exit 70, once the
    # probes were loaded)
    out = tmp_path / "x.mrec"
    # WHEN recording with it
    with pytest.raises(SystemExit) as exc:
        commands.main(["record", "--nvml-hz", value, "-o", str(out), "--", "true"])
    # THEN argparse's usage error names it, exit 2, and nothing was recorded
    err = capsys.readouterr().err
    assert exc.value.code == ExitCode.USAGE and "argument --nvml-hz: must be a finite number >= 0" in err
    assert not out.exists()


@pytest.mark.parametrize("command", ["record", "daemon"])
@pytest.mark.parametrize("option", ["--nvml-hz", "--nvml-process-hz"])
def test_a_sampling_rate_past_1000_hz_is_a_usage_error(tmp_path, capsys, command, option):
    # GIVEN a rate no sampler can keep (1e300 was accepted: on a GPU host the sampler would spin)
    out = tmp_path / "x.mrec"
    argv = [command, option, "1e300", "-o", str(out)] + (["--", "true"] if command == "record" else [])
    # WHEN it is given  THEN one usage line, exit 2, nothing started or written; 1000 itself is accepted
    with pytest.raises(SystemExit) as exc:
        commands.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == ExitCode.USAGE and f"argument {option}: at most 1000 samples a second, got '1e300'" in err
    assert not out.exists()
    from memrec.daemon.config import rate

    assert rate("1000") == 1000.0


# ---------------------------------------------------------------------- the daemon's domain errors


@pytest.mark.skipif(os.geteuid() != 0, reason="the daemon refuses to start without root before it binds")
def test_daemon_on_a_socket_in_use_is_one_line_and_exit_73(tmp_path, capsys):
    # GIVEN another process listening on the marker socket
    path = tmp_path / "taken.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as taken:
        taken.bind(str(path))
        taken.listen()
        # WHEN a daemon is started on it (the socket is bound before the slow BPF compile)
        rc = commands.main(["daemon", "-o", str(tmp_path / "x.mrec"), "--socket", str(path)])
    err = capsys.readouterr().err
    # THEN the socket's domain error becomes one line and CANT_CREATE, and no trace is made
    assert rc == ExitCode.CANT_CREATE
    assert [line for line in err.splitlines() if line.startswith("memrec: error:")] == [err.splitlines()[-1]]
    assert "taken.sock" in err.splitlines()[-1] and not (tmp_path / "x.mrec").exists()


@pytest.mark.parametrize("policy", ["nice", "nice:-21", "fifo:0", "rr:100", "off:1", "idle"])
def test_daemon_scheduling_policy_is_checked_before_anything_starts(policy, capsys):
    # WHEN --scheduling is not a policy THEN a usage error that says what is wrong, exit 2
    with pytest.raises(SystemExit) as info:
        commands.main(["daemon", "--scheduling", policy])
    assert info.value.code == ExitCode.USAGE
    assert "--scheduling" in capsys.readouterr().err


def test_daemon_tensors_pid_names_a_running_process(tmp_path, capsys):
    # GIVEN a process that has exited and a thread of this process that is not its main thread
    import threading

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    started, stop, tids = threading.Event(), threading.Event(), []

    def thread() -> None:
        tids.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    threading.Thread(target=thread, daemon=True).start()
    started.wait(10)
    try:
        # WHEN --tensors-pid is not a number, no running process, or a thread rather than a process
        # THEN a usage error that says which, exit 2, before anything starts
        for value, says in (("abc", "'abc' is not a process id"), ("0", "0 is not a process id"),
                            (str(gone.pid), f"no process {gone.pid} runs"),
                            (str(tids[0]), f"{tids[0]} is a thread of process {os.getpid()}: name the process")):
            with pytest.raises(SystemExit) as info:
                commands.main(["daemon", "-o", str(tmp_path / "x.mrec"), "--tensors-pid", value])
            assert info.value.code == ExitCode.USAGE
            assert f"argument --tensors-pid: {says}" in capsys.readouterr().err
    finally:
        stop.set()


# ---------------------------------------------------------------------- 3.5 selftest without cuda-python


def test_selftest_without_a_gpu_says_so_before_asking_for_cuda_python(monkeypatch, tmp_path, capsys):
    # GIVEN a host without the NVIDIA driver's control device, and no cuda-python either
    from memrec.commands import selftest

    monkeypatch.setattr(selftest, "NVIDIACTL", str(tmp_path / "nvidiactl"))
    monkeypatch.setitem(sys.modules, "cuda", None)
    # WHEN selftest runs
    rc = commands.main(["selftest", "--socket", "/nonexistent/memrec.sock"])
    err = capsys.readouterr().err
    # THEN one line says there is no GPU to test (not to install cuda-python first), exit 69
    assert rc == ExitCode.UNAVAILABLE and len(err.splitlines()) == 1
    assert err.startswith("memrec: error: no NVIDIA GPU here") and "cuda-python" not in err


def test_selftest_without_cuda_python_says_what_to_install(monkeypatch, capsys):
    # GIVEN a GPU (its driver's device: /dev/null stands in) and no cuda-python (None in
    # sys.modules makes its import fail, as when it is not installed)
    from memrec.commands import selftest

    monkeypatch.setattr(selftest, "NVIDIACTL", "/dev/null")
    monkeypatch.setitem(sys.modules, "cuda", None)
    # WHEN selftest runs (no daemon either: the missing package is said first)
    rc = commands.main(["selftest", "--socket", "/nonexistent/memrec.sock"])
    err = capsys.readouterr().err
    # THEN one line naming the extra to install, exit 69 like the other missing dependencies
    assert rc == ExitCode.UNAVAILABLE
    assert err.startswith("memrec: error: selftest makes real driver calls through cuda-python")
    assert f"{sys.executable} -m pip install" in err and "cuda-python" in err and "memrec[gpu]" not in err
    assert "ModuleNotFoundError" not in err and "[" not in err.split("memrec[gpu]")[0].replace("memrec: error: ", "")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("timeout", ["nan", "-1", "0"])
def test_selftest_refuses_a_timeout_it_cannot_wait(timeout, capsys):
    # GIVEN --timeout nan or a negative number (once accepted: the wait ended at once and every
    # check failed for events that had not arrived yet)
    with pytest.raises(SystemExit) as done:
        commands.main(["selftest", "--timeout", timeout])
    # THEN it is a usage error naming the option, before anything runs
    assert done.value.code == ExitCode.USAGE
    assert "argument --timeout: must be a finite number > 0" in capsys.readouterr().err


def test_mark_accepts_verbose_after_its_name(tmp_path, capsys):
    # GIVEN no daemon WHEN `memrec mark x -v` THEN the usual one-line "no daemon" (not a usage error)
    rc = commands.main(["mark", "x", "-v", "--socket", str(tmp_path / "none.sock")])
    assert rc == ExitCode.UNAVAILABLE
    assert capsys.readouterr().err.startswith("memrec: error: no memrec daemon")


@pytest.mark.parametrize("gpu", ["-1", "32768", "70000"])
def test_mark_names_the_gpu_it_refuses_and_the_range_it_takes(gpu, tmp_path, capsys):
    # GIVEN no daemon needed: the ordinal is refused before anything is sent
    # WHEN `memrec mark x --gpu N` with N out of a device ordinal's range
    rc = commands.main(["mark", "x", "--gpu", gpu, "--socket", str(tmp_path / "none.sock")])
    # THEN a usage error naming the option and the range (70000 is not negative: saying so misled)
    assert rc == ExitCode.USAGE
    assert capsys.readouterr().err == f"memrec: error: --gpu {gpu}: not a CUDA device ordinal (0..32767)\n"


def test_every_help_fits_80_columns_and_keeps_every_word(monkeypatch, capsys):
    # GIVEN help piped to a file or another program (memrec assumes 80 columns there)
    monkeypatch.setenv("COLUMNS", "80")
    for name in commands.COMMANDS:
        command = commands.load_command(name)
        # WHEN a subcommand's --help is asked for
        with pytest.raises(SystemExit) as done:
            commands.main([name, "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        # THEN no line is wider than 80 columns but an example copied whole (see the test below),
        # and the docstring's words are all there, in order
        doc = type(command).__doc__ or ""
        examples = {line.strip() for line in doc.splitlines() if line.strip().startswith(("memrec ", "sudo "))}
        assert [line for line in text.splitlines() if len(line) > 80 and line.strip() not in examples] == [], name
        assert " ".join(text.split()).find(" ".join(doc.split())) >= 0, name


@pytest.mark.parametrize("name", ["record", "completion", "export", "install-service"])
def test_help_never_wraps_an_example_command_line(name, monkeypatch, capsys):
    # GIVEN help piped (80 columns) for a command whose examples are wider than that
    monkeypatch.setenv("COLUMNS", "80")
    doc = type(commands.load_command(name)).__doc__ or ""
    examples = [line.strip() for line in doc.splitlines() if line.strip().startswith(("memrec ", "sudo "))]
    assert any(len(line) > 72 for line in examples)
    # WHEN its --help is asked for
    with pytest.raises(SystemExit):
        commands.main([name, "--help"])
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    # THEN every example command line is on one line, as written, so it pastes into a shell
    assert [line for line in examples if line not in lines] == []


def test_doctor_fits_80_columns_and_says_everything(monkeypatch, capsys):
    # GIVEN doctor's output piped (80 columns assumed), on this host whatever it lacks
    monkeypatch.setenv("COLUMNS", "80")
    rc = commands.main(["doctor"])
    text = capsys.readouterr().out
    assert rc in (ExitCode.OK, ExitCode.ERROR)
    # THEN no line is wider than 80, and every check's detail and fix are there in full
    assert [line for line in text.splitlines() if len(line) > 80] == []
    assert commands.main(["doctor", "--json"]) == rc
    words = " ".join(text.split())
    for check in json.loads(capsys.readouterr().out):
        assert " ".join(check["detail"].split()) in words
        if check["fix"] and check["status"] != "ok":
            assert " ".join(f"-> {check['fix']}".split()) in words


def test_doctor_says_a_named_library_does_not_exist(tmp_path):
    from memrec.commands.doctor import check_libcuda
    from memrec.commands.doctor import check_torch

    # GIVEN --libcuda or --torch-lib naming a file that is not there (a typo) WHEN doctor checks
    missing = str(tmp_path / "lib.so.l")
    # THEN it says so, rather than "no libcuda.so.1 ... name one with --libcuda PATH" or "ok: no
    # libc10_cuda.so mapped or importable here"
    for check, option in ((check_libcuda([missing]), "--libcuda"), (check_torch([missing]), "--torch-lib")):
        assert check.status == "warn" and check.detail == f"{option} {missing}: no such file"
        assert check.fix == f"name an existing file with {option}"

def test_doctor_as_an_ordinary_user_says_what_it_lacks_and_never_crashes():
    # GIVEN an ordinary user (nobody), who cannot look inside /sys/kernel/tracing (mode 0700)
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run doctor as another user")
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "memrec", "doctor"]
    # WHEN doctor runs as that user, as text and as JSON
    text = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    as_json = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120)
    # THEN no internal error: it fails (no privileges) and says so, every check in its place
    assert (text.returncode, text.stderr) == (ExitCode.ERROR, ""), text.stderr
    checks = {c["name"]: c for c in json.loads(as_json.stdout)}
    assert checks["privileges"]["status"] == "fail"
    assert checks["tracefs"]["status"] == "warn" and "run memrec doctor as root" in checks["tracefs"]["fix"]
    assert "uid 65534 without CAP_BPF+CAP_PERFMON" in text.stdout


@pytest.mark.parametrize("where", ["in a folder it may not open", "under a folder it may not pass"])
def test_doctor_as_an_ordinary_user_says_it_cannot_read_the_probe_cache(where, tmp_path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run doctor as another user")
    # GIVEN a probe cache only root may read (a root folder of mode 0700, or one below pytest's
    # root-only tmp_path), holding a file of root's
    if where == "in a folder it may not open":
        cache = Path(tempfile.mkdtemp(dir="/tmp"))
    else:
        cache = tmp_path / "probes"
        cache.mkdir(mode=0o700)
    (cache / "x.mrprobe").write_bytes(b"root's")
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "memrec", "doctor",
            "--json", "--probe-cache", str(cache)]
    try:
        # WHEN doctor runs as uid 65534
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(cache)
    check = {c["name"]: c for c in json.loads(done.stdout)}["probe cache"]
    # THEN it says it may not read the cache as this user and to check as root, not that the
    # cache is unusable or will be rewritten
    assert check["status"] == "warn"
    assert check["detail"] == f"uid 65534 may not read the probe cache in {cache} (root's alone)"
    assert check["fix"] == "run memrec doctor as root to check it"


def test_mark_without_a_name_asks_only_for_the_name(capsys):
    # GIVEN `memrec mark` with nothing after it  THEN a usage error that names only what is missing
    # (KEY=VALUE pairs are optional: `memrec mark x` is complete)
    with pytest.raises(SystemExit) as done:
        commands.main(["mark"])
    assert done.value.code == ExitCode.USAGE
    assert capsys.readouterr().err.splitlines()[-1] == "memrec mark: error: the following arguments are required: name"


def test_an_unexpected_error_is_one_line_and_exit_70(monkeypatch, capsys):
    # GIVEN a command that fails in a way memrec did not foresee (a bug)
    from memrec.commands import report

    def boom(self, args, parser):
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(report.ReportCommand, "run", boom)
    # WHEN a user runs it
    rc = commands.main(["report", "x.mrec"])
    err = capsys.readouterr().err
    # THEN one line says it is a bug and how to see more, with the internal-error exit code
    assert rc == 70
    assert err.count("\n") == 1 and "internal error: ZeroDivisionError: division by zero" in err
    assert "Traceback" not in err and "-v" in err
    # AND with -v the traceback is there too
    assert commands.main(["report", "-v", "x.mrec"]) == 70
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["diff", "{ok}", "{cut}"],
        ["export", "{cut}", "--to", "csv", "-o", "{tmp}/tables"],
        ["plot", "{cut}", "-o", "{tmp}/cut.png"],
        ["merge", "{cut}", str(ROOT / "tests" / "data" / "golden_v1.mrec"), "-o", "{tmp}/merged.mrec"],
    ],
    ids=["diff", "export", "plot", "merge"],
)
def test_a_cut_trace_is_warned_about_on_stderr_by_every_command_that_reads_it(tmp_path, capsys, argv):
    pytest.importorskip("matplotlib")
    # GIVEN a whole trace and a copy cut in its last record (a crashed recorder, a partial copy)
    ok = write_trace(tmp_path / "ok.mrec")
    cut = tmp_path / "cut.mrec"
    cut.write_bytes(ok.read_bytes()[:-5])
    # WHEN a command other than report or dump reads it
    rc = commands.main([a.format(ok=ok, cut=cut, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    # THEN it still succeeds, and says on stderr that the trace is cut, naming the file
    assert rc == ExitCode.OK
    assert f"memrec: warning: {cut}: truncated tail after" in err and "no trailer" in err
    assert f"memrec: warning: {ok}:" not in err


def test_report_shows_a_cut_traces_warnings_once_in_its_output(tmp_path, capsys):
    # GIVEN a cut trace
    cut = tmp_path / "cut.mrec"
    cut.write_bytes(write_trace(tmp_path / "ok.mrec").read_bytes()[:-5])
    # WHEN reported
    assert commands.main(["report", str(cut)]) == 0
    out, err = capsys.readouterr()
    # THEN the report says it, and stderr does not say it again
    assert "truncated tail after" in out and err == ""


def test_doctor_without_the_nvml_binding_says_to_install_the_extra_not_the_driver(monkeypatch, capsys):
    from memrec.probes import nvml

    # GIVEN `pip install memrec` without [nvml]: pynvml cannot be imported (the driver may be there)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(nvml, "_pynvml", None)
    monkeypatch.setattr(nvml, "_unavailable", None)
    # WHEN the host is checked
    commands.main(["doctor", "--json"])
    check = next(c for c in json.loads(capsys.readouterr().out) if c["name"] == "nvml")
    # THEN the fix names the package extra, not a driver install
    assert "nvidia-ml-py package is not installed" in check["detail"]
    assert check["fix"].startswith(f"{sys.executable} -m pip install") and "NVIDIA driver" not in check["fix"]
    assert "nvidia-ml-py" in check["fix"]


@pytest.mark.parametrize("system_bcc", [True, False], ids=["system-bcc-out-of-reach", "no-bcc"])
def test_without_bcc_doctor_and_record_say_whether_to_install_it_or_reach_it(monkeypatch, capsys, tmp_path, system_bcc):
    from memrec.probes import loader

    # GIVEN `pip install memrec` in a virtualenv: bcc does not import; the system's python3-bpfcc is
    # installed (a folder where the distribution puts it) or not
    monkeypatch.setitem(sys.modules, "bcc", None)
    system = tmp_path / "dist-packages" / "bcc"
    if system_bcc:
        system.mkdir(parents=True)
    monkeypatch.setattr(loader, "SYSTEM_BCC_GLOBS", (str(system),))
    # WHEN the host is checked, and a command is recorded
    commands.main(["doctor", "--json"])
    check = next(c for c in json.loads(capsys.readouterr().out) if c["name"] == "bcc")
    rc = commands.main(["record", "-o", str(tmp_path / "r.mrec"), "--", "true"])
    err = capsys.readouterr().err
    # THEN both say the same thing: reach the installed bcc, or install it
    if system_bcc:
        assert f"the system's bcc is installed ({system})" in check["fix"] and "scripts/setup" in check["fix"]
    else:
        assert check["fix"].startswith("install python3-bpfcc")
    if os.geteuid() == 0:  # as another user, record stops earlier, at the privilege check
        last = err.splitlines()[-1]
        assert rc == ExitCode.UNAVAILABLE and last.startswith("memrec: error: ") and last.endswith(check["fix"])


@pytest.mark.parametrize("mistake", [["--phase", "bogus"], ["--gpu", "abc"], ["--pid", "x"]])
def test_mark_reports_a_mistake_alike_before_and_after_name(mistake, tmp_path, capsys):
    # GIVEN one mistaken option (no daemon needed: it is refused before anything is sent)
    socket = ["--socket", str(tmp_path / "none.sock")]
    errors = []
    for argv in (["mark", *mistake, "x", *socket], ["mark", "x", *mistake, *socket]):
        # WHEN it stands before NAME, then after it
        with pytest.raises(SystemExit) as done:
            commands.main(argv)
        # THEN a usage error, exit code 2, as any other command's
        assert done.value.code == ExitCode.USAGE
        errors.append(capsys.readouterr().err)
    # AND the same usage and the same error line wherever the option stands
    assert errors[0] == errors[1]
    assert errors[0].startswith("usage: memrec mark ")
    assert errors[0].splitlines()[-1].startswith("memrec mark: error: argument ")


@pytest.mark.parametrize("kind", ["fifo", "char-device"])
def test_a_fifo_or_a_device_as_a_trace_is_not_a_regular_file_to_every_command(kind, tmp_path):
    # GIVEN a FIFO (nobody writing to it) or /dev/zero given as a trace
    if kind == "fifo":
        path = tmp_path / "pipe.mrec"
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    out = tmp_path / "out"
    for argv in (["report", path], ["dump", path], ["diff", path, path], ["merge", path, "-o", out],
                 ["export", path, "--to", "perfetto", "-o", out], ["plot", path, "-o", f"{out}.png"]):
        # WHEN a command reads it (in a child: a FIFO opened for reading would wait for a writer)
        done = subprocess.run([sys.executable, "-m", "memrec", *map(str, argv)], capture_output=True, text=True,
                              timeout=60)
        # THEN one line saying it is not a regular file (not "empty file"), and the input exit code
        assert (done.returncode, done.stdout, done.stderr) == (
            ExitCode.NO_INPUT, "", f"memrec: error: {path}: not a regular file\n"), argv


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_output_to_a_full_device_is_one_line_and_exit_73_not_a_bug(tmp_path):
    # GIVEN standard output that no write fits in (`> /dev/full`: a full disk under a redirection)
    trace = write_trace(tmp_path / "run.mrec")
    for argv in (["report", trace], ["report", "--json", trace], ["dump", trace], ["--version"], ["--help"], ["-h"],
                 ["report", "-h"], ["mark", "--help"]):
        with open("/dev/full", "w") as full:
            # WHEN a command prints to it (--version prints while its arguments are parsed)
            done = subprocess.run([sys.executable, "-m", "memrec", *map(str, argv)], stdout=full,
                                  stderr=subprocess.PIPE, text=True, timeout=60)
        # THEN one line says the output could not be written and why, with the output exit code
        # (it was "internal error ... a bug in memrec", exit 70, and a raw traceback for --version)
        assert (done.returncode, done.stderr) == (
            ExitCode.CANT_CREATE, "memrec: error: cannot write the output: No space left on device\n"), argv


@pytest.mark.parametrize("argv, prog", [(["report", "--bogus", "x"], "memrec report"),
                                        (["dump", "x", "y"], "memrec dump"), (["--bogus", "report", "x"], "memrec")])
def test_an_unknown_argument_is_reported_with_the_usage_of_the_command_it_follows(argv, prog, capsys):
    # GIVEN an argument no parser knows (after a command: it was memrec's usage, `usage: memrec [-h] ...`)
    # WHEN the command line runs
    with pytest.raises(SystemExit) as exc:
        commands.main(argv)
    # THEN the usage and the error are those of the command it follows, exit 2
    err = capsys.readouterr().err.splitlines()
    assert exc.value.code == ExitCode.USAGE
    assert err[0].startswith(f"usage: {prog} [-h]") and err[-1].startswith(f"{prog}: error: unrecognized arguments: ")
