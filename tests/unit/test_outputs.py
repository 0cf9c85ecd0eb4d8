"""Every command that writes a file keeps an existing one unless -f/--force, with one message and exit code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memrec.base.errors import ExitCode
from memrec.api import load
from memrec.commands import main

ROOT = Path(__file__).resolve().parents[2]
IPC = ROOT / "examples" / "sglang-standin-ipc.mrec"  # two ranks: memory-viz writes one file per process

#: command line (OUT is the output) -> the file it writes
WRITERS = {
    "record": (["record", "-o", "OUT", "--", "true"], "OUT"),
    "merge": (["merge", str(IPC), "-o", "OUT"], "OUT"),
    "export-perfetto": (["export", str(IPC), "--to", "perfetto", "-o", "OUT"], "OUT"),
    "export-memory-viz": (["export", str(IPC), "--to", "memory-viz", "-o", "OUT"], "OUT"),
    "export-csv": (["export", str(IPC), "--to", "csv", "-o", "OUT"], "OUT/events.csv"),
    "plot": (["plot", str(IPC), "-o", "OUT"], "OUT"),
}
SUFFIX = {"plot": ".png", "export-csv": "", "export-memory-viz": ".pickle"}


def command(name: str, out: Path, *extra: str) -> list[str]:
    argv, _ = WRITERS[name]
    return [argv[0], *extra, *(str(out) if a == "OUT" else a for a in argv[1:])]


def existing_output(name: str, tmp_path: Path) -> tuple[Path, Path]:
    """The -o path, and a file the command would write there, made beforehand (memory-viz: the
    last rank's own file, which has a name of its own)."""
    out = tmp_path / f"out{SUFFIX.get(name, '.mrec')}"
    target = Path(WRITERS[name][1].replace("OUT", str(out)))
    if name == "export-csv":
        out.mkdir()
    if name == "export-memory-viz":
        pid = max(int(p) for p in load(IPC, pandas=False).events["pid"])
        target = out.with_name(f"{out.stem}.{pid}.pickle")
    target.write_bytes(b"an earlier output")
    return out, target


@pytest.mark.parametrize("name", list(WRITERS))
def test_an_existing_output_is_kept_without_force(name, tmp_path, capsys):
    # GIVEN a file the command would write already exists
    out, target = existing_output(name, tmp_path)
    # WHEN the command runs without --force
    rc = main(command(name, out))
    # THEN the exit code and the one line are record's, and the file is untouched
    assert rc == ExitCode.CANT_CREATE
    assert capsys.readouterr().err == f"memrec: error: {target} exists: use -f/--force to replace it, or another -o\n"
    assert target.read_bytes() == b"an earlier output"
    assert {p.name for p in tmp_path.rglob("*")} == {target.name} | ({out.name} if out.is_dir() else set())


@pytest.mark.parametrize("name", [n for n in WRITERS if n != "record"])  # record -f: tests/bpf/test_record_cli.py
def test_force_replaces_an_existing_output(name, tmp_path, capsys):
    needs = {"plot": "matplotlib", "export-perfetto": "perfetto.trace_builder.proto_builder"}
    if name in needs:
        pytest.importorskip(needs[name], reason=f"{needs[name]} not installed (pip install 'memrec[plot,export]')")
    # GIVEN a file the command would write already exists
    out, target = existing_output(name, tmp_path)
    # WHEN the command runs with -f
    rc = main(command(name, out, "-f"))
    # THEN it is replaced
    assert rc == ExitCode.OK, capsys.readouterr().err
    assert target.read_bytes() != b"an earlier output"


@pytest.mark.parametrize("name,to,out", [("run.mrec", "perfetto", "TRACE"), ("events.csv", "csv", "FOLDER")],
                         ids=["onto-itself", "a-table-named-as-it"])
def test_export_force_still_never_replaces_the_trace_itself(name, to, out, tmp_path, capsys):
    # GIVEN a recording, and -o naming it (or the folder where a table would take its name), with --force
    trace = tmp_path / name
    trace.write_bytes(IPC.read_bytes())
    # WHEN exported onto itself
    rc = main(["export", "-f", str(trace), "--to", to, "-o", str(trace if out == "TRACE" else tmp_path)])
    # THEN a usage error and the recording is still there, byte for byte
    assert rc == ExitCode.USAGE
    assert capsys.readouterr().err == f"memrec: error: {trace}: is a trace this command reads; give another name\n"
    assert trace.read_bytes() == IPC.read_bytes()


@pytest.mark.parametrize("how", ["same name", "hard link"])
@pytest.mark.parametrize("argv", [
    ["plot", "-f", "TRACE", "-o", "OUT"],
    ["plot", "-f", str(IPC), "--diff", "TRACE", "-o", "OUT"],
    ["export", "-f", "TRACE", "--to", "perfetto", "-o", "OUT"],
    ["merge", "-f", str(ROOT / "examples" / "sglang-standin-base.mrec"), "TRACE", "-o", "OUT"],
], ids=["plot", "plot-diff", "export", "merge"])
def test_force_never_replaces_an_input_even_under_another_name(argv, how, tmp_path, capsys):
    # GIVEN a recording whose name ends in .png (as a picture's would), and -o naming it, or a
    # hard link to it, with --force
    trace = tmp_path / "x.png"
    trace.write_bytes(IPC.read_bytes())
    out = trace if how == "same name" else tmp_path / "y.png"
    if how == "hard link":
        out.hardlink_to(trace)
    # WHEN the command would write over it
    rc = main([str(trace) if a == "TRACE" else str(out) if a == "OUT" else a for a in argv])
    # THEN a usage error names it, and the recording is still there, byte for byte
    assert rc == ExitCode.USAGE
    assert capsys.readouterr().err == f"memrec: error: {out}: is a trace this command reads; give another name\n"
    assert trace.read_bytes() == IPC.read_bytes()


@pytest.mark.parametrize("name", list(WRITERS))
def test_an_output_in_a_folder_the_user_may_not_look_into_is_one_line(name, tmp_path):
    # GIVEN an ordinary user (nobody), and -o inside a folder only root may look into
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run memrec as another user")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    out = private / f"out{SUFFIX.get(name, '.mrec')}"
    # WHEN the command runs as that user
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                           "memrec", *command(name, out)], capture_output=True, text=True, timeout=120)
    # THEN CANT_CREATE and one line saying why, not an internal error
    assert (proc.returncode, proc.stderr.count("\n")) == (ExitCode.CANT_CREATE, 1), proc.stderr
    assert proc.stderr.startswith("memrec: error: ") and "Permission denied" in proc.stderr


@pytest.mark.parametrize("argv", [["report", "IN"], ["dump", "IN"], ["diff", str(IPC), "IN"], ["tui", "IN"],
                                  ["export", "IN", "--to", "csv", "-o", "OUT"], ["merge", "IN", "-o", "OUT"]],
                         ids=lambda argv: argv[0])
def test_an_input_in_a_folder_the_user_may_not_look_into_is_one_line(argv, tmp_path):
    # GIVEN an ordinary user (nobody), and a trace inside a folder only root may look into
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run memrec as another user")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "run.mrec").write_bytes(IPC.read_bytes())
    words = [str(private / "run.mrec") if a == "IN" else "/tmp/memrec-never-written" if a == "OUT" else a
             for a in argv]
    # WHEN the command reads it as that user
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                           "memrec", *words], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    # THEN NO_INPUT and the one line every unreadable trace gets, not an internal error
    assert (proc.returncode, proc.stderr) == (ExitCode.NO_INPUT, f"memrec: error: {private / 'run.mrec'}: Permission denied\n")


def test_export_tables_need_the_parent_folder_as_a_file_does(tmp_path, capsys):
    out = tmp_path / "no" / "tables"
    assert main(["export", str(IPC), "--to", "csv", "-o", str(out)]) == ExitCode.CANT_CREATE
    assert capsys.readouterr().err == f"memrec: error: cannot write {out}: {out.parent}: no such folder\n"
    assert not out.parent.exists()
