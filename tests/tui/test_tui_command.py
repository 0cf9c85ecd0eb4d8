"""``memrec tui``: arguments, one-line errors and exit codes (the app itself is not started)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.commands.tui import TuiCommand


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    TuiCommand().prepare_parser(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, code, text",
    [
        (("/nonexistent/run.mrec",), ExitCode.NO_INPUT, "no such file"),
        ((), ExitCode.USAGE, "give a trace file"),
        (("--live", "/tmp/memrec-test-no-such.sock"), ExitCode.UNAVAILABLE, "no memrec daemon at /tmp/memrec-test-no-such.sock"),
        (("a.mrec", "--live", "/x.sock"), ExitCode.USAGE, "--live takes no trace file"),
    ],
)
def test_errors_have_exit_codes(argv, code, text):
    with pytest.raises(MemrecCommandError) as info:
        TuiCommand().make_source(parse(*argv))
    assert info.value.exit_code == code
    assert text in str(info.value) and "\n" not in str(info.value)


def test_not_a_trace_is_a_data_error(tmp_path):
    bad = tmp_path / "bad.mrec"
    bad.write_bytes(b"hello, not msgpack")
    with pytest.raises(MemrecCommandError) as info:
        TuiCommand().make_source(parse(str(bad)))
    assert info.value.exit_code == ExitCode.DATA and "not a memrec trace" in str(info.value)


def test_diff_checks_both_files(trace_file, tmp_path):
    with pytest.raises(MemrecCommandError) as info:
        TuiCommand().make_source(parse(str(trace_file), "--diff", str(tmp_path / "missing.mrec")))
    assert info.value.exit_code == ExitCode.NO_INPUT
    source = TuiCommand().make_source(parse(str(trace_file), "--diff", str(trace_file)))
    assert type(source).__name__ == "DiffSource" and source.other_model is not None


def test_run_starts_the_app_with_the_source(trace_file, monkeypatch):
    started = []

    class FakeApp:
        return_code = 0  # as textual's App after a clean exit

        def __init__(self, source):
            started.append(source)

        def run(self):
            started.append("ran")

    monkeypatch.setattr("memrec.tui.app.MemrecApp", FakeApp)
    monkeypatch.setattr("memrec.commands.tui.on_a_terminal", lambda: True)
    assert TuiCommand().run(parse(str(trace_file)), argparse.ArgumentParser()) == ExitCode.OK
    assert type(started[0]).__name__ == "FileSource" and not started[0].live and started[1] == "ran"


def test_an_app_that_crashed_is_exit_70_not_0(trace_file, monkeypatch):
    # GIVEN an app that stops on an unhandled error: textual prints its traceback, sets
    # return_code 1 and returns from run() (the shell saw exit 0 after a traceback)
    class CrashedApp:
        return_code = None

        def __init__(self, source):
            pass

        def run(self):
            self.return_code = 1

    monkeypatch.setattr("memrec.tui.app.MemrecApp", CrashedApp)
    monkeypatch.setattr("memrec.commands.tui.on_a_terminal", lambda: True)
    # THEN memrec tui says so in one line, with the internal-error exit code
    with pytest.raises(MemrecCommandError) as info:
        TuiCommand().run(parse(str(trace_file)), argparse.ArgumentParser())
    assert info.value.exit_code == ExitCode.SOFTWARE and "a bug in memrec" in str(info.value)


def test_registered_in_the_memrec_command(trace_file):
    from memrec import commands
    from memrec.commands.parser import get_argument_parser

    parser = get_argument_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if "tui" not in choices:
        pytest.skip("memrec.commands does not register TuiCommand yet (the lead adds it)")
    assert commands.main(["tui", "/nonexistent.mrec"]) == ExitCode.NO_INPUT


def test_without_a_terminal_it_says_so_instead_of_waiting(trace_file):
    # GIVEN a trace, and stdin and stderr that are not a terminal (a script, a pipe, cron)
    # WHEN memrec tui runs THEN it ends at once with one line and the usage exit code (it used to
    # start the app, which waited forever for keys that could not come)
    done = subprocess.run([sys.executable, "-m", "memrec", "tui", str(trace_file)], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == ExitCode.USAGE
    assert done.stderr.count("\n") == 1 and "needs a terminal" in done.stderr


def test_python_dash_m_memrec_tui_ends_as_memrec_tui_does(tmp_path):
    # GIVEN a trace path that does not exist and a file that is not a trace
    bad = tmp_path / "bad.mrec"
    bad.write_bytes(b"hello, not msgpack")
    for path, code in ((tmp_path / "missing.mrec", ExitCode.NO_INPUT), (bad, ExitCode.DATA)):
        # WHEN both entry points open it
        runs = [subprocess.run([sys.executable, "-m", *entry, str(path)], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=60)
                for entry in (("memrec.tui",), ("memrec", "tui"))]
        # THEN they end with the same one line and the same exit code
        assert [r.returncode for r in runs] == [code, code]
        assert runs[0].stderr == runs[1].stderr and runs[0].stderr.count("\n") == 1, runs


def test_a_domain_error_through_python_dash_m_memrec_tui_is_mapped_once(monkeypatch, capsys):
    # GIVEN a live source whose socket cannot be used: a domain error (no exit code of its own),
    # which the command does not turn into a MemrecCommandError itself
    from memrec.base.errors import SocketError
    from memrec.commands import main as memrec_main
    from memrec.tui.__main__ import main as tui_main

    def refuse(self):
        raise SocketError(f"{self.path}: not a socket")

    monkeypatch.setattr("memrec.tui.sources.LiveSource.open", refuse)
    # WHEN `python -m memrec.tui --live X` and `memrec tui --live X` run
    lines = []
    for run in (tui_main, lambda argv: memrec_main(["tui", *argv])):
        # THEN both return the exit code of memrec.commands.common.exit_code with one line
        assert run(["--live", "/tmp/memrec-test-x.sock"]) == ExitCode.CANT_CREATE
        lines.append(capsys.readouterr().err)
    assert lines[0] == lines[1] == "memrec: error: /tmp/memrec-test-x.sock: not a socket\n"
