"""The quick commands stay quick: ``memrec --help`` and ``memrec mark`` never import numpy.

numpy alone costs several times a bare interpreter's start; ``memrec mark`` runs from shell
scripts between benchmark phases. Checked with ``-X importtime`` on the real command line. The
goal, within 2× a bare interpreter, is measured by bench/bench_start_stop.py (docs/performance.md);
these checks only keep out what it took to get there.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("numpy", "msgpack_numpy", "bcc", "pynvml", "textual", "memrec.trace.reader", "memrec.state")


def imported_modules(*argv: str) -> set[str]:
    """What ``python -m memrec ARGV`` imports (``-c pass`` when ARGV is ``("-c", ...)``)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *(argv if argv[:1] == ("-c",) else ("-m", "memrec", *argv))],
        capture_output=True, text=True, timeout=60, env={"MEMREC_SOCKET": "/nonexistent/memrec.sock", "PATH": "/usr/bin:/bin"},
    )
    return {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--help"], id="help"),
        pytest.param(["mark", "--socket", "/nonexistent/memrec.sock", "phase", "x=1"], id="mark-without-daemon"),
        pytest.param(["dump", "--help"], id="dump-help"),
    ],
)
def test_quick_commands_import_nothing_heavy(argv):
    # WHEN the command runs
    modules = imported_modules(*argv)
    # THEN it imported memrec's command line but none of the heavy modules
    assert "memrec.commands" in modules
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_dump_still_imports_what_it_needs(tmp_path):
    # GIVEN a file that is not a trace  WHEN memrec dump reads it
    bad = tmp_path / "x.mrec"
    bad.write_bytes(b"not a trace")
    modules = imported_modules("dump", "--force", str(bad))
    # THEN the reader was imported when the command ran (the lazy import is not dead)
    assert "memrec.trace.reader" in modules and "numpy" in modules


#: What the quick commands left out to start within 2× a bare interpreter: every other command's
#: module, and the standard library's slower modules that they do not need.
NOT_QUICK = ("logging", "typing", "dataclasses", "pathlib", "memrec.commands.daemon", "memrec.commands.report",
             "memrec.commands.completion", "memrec.daemon.config")


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--help"], id="help"),
        pytest.param(["-h", "mark"], id="help-before-a-command"),
        pytest.param(["mark", "--socket", "/nonexistent/memrec.sock", "phase", "x=1"], id="mark-without-daemon"),
    ],
)
def test_quick_commands_import_only_their_own_command(argv):
    # GIVEN what a bare interpreter imports by itself (site and its .pth files)
    bare = imported_modules("-c", "pass")
    # WHEN a quick command runs THEN it adds no other command's module and none of the slow ones
    added = imported_modules(*argv) - bare
    assert not added & set(NOT_QUICK), sorted(added & set(NOT_QUICK))
    # (memrec.commands.table is the table of commands itself: a leaf of no imports)
    assert {m for m in added if m.startswith("memrec.commands.")} <= {"memrec.commands.mark", "memrec.commands.parser",
                                                                     "memrec.commands.table"}


#: What `memrec --help` and the documented forms of `memrec mark` leave out besides: argparse (the
#: help is rendered by hand, mark's arguments parsed by hand), msgpack (the marker packed by hand),
#: socket.py (its enums and selectors), threading, enum (ExitCode is plain ints), and what
#: argparse's help would bring (shutil with its compression modules, textwrap).
NO_ARGPARSE = ("argparse", "memrec.commands.parser", "msgpack", "socket", "threading", "enum", "shutil", "textwrap")


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--help"], id="help"),
        pytest.param(["mark", "--socket", "/nonexistent/memrec.sock", "phase", "x=1", "--phase", "begin"], id="mark"),
    ],
)
def test_help_and_mark_run_without_argparse_msgpack_or_socket(argv):
    # GIVEN what a bare interpreter imports by itself  WHEN `memrec --help` or `memrec mark` runs
    added = imported_modules(*argv) - imported_modules("-c", "pass")
    # THEN none of the modules they were rid of came back
    assert not added & set(NO_ARGPARSE), sorted(added & set(NO_ARGPARSE))


def test_the_listed_summaries_are_the_commands_docstrings():
    """`memrec --help` lists the commands from memrec.commands.COMMANDS without importing them."""
    from memrec import commands

    for name, summary in commands.COMMANDS.items():
        doc = type(commands.load_command(name)).__doc__ or ""
        assert doc.strip().splitlines()[0] == summary, name


def test_mark_with_v_configures_logging(tmp_path):
    # GIVEN mark, which leaves logging out  WHEN -v is given THEN logging is configured after all
    modules = imported_modules("mark", "-v", "--socket", str(tmp_path / "none.sock"), "x")
    assert "logging" in modules
