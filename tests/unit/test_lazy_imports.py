"""The quick commands stay quick: ``memrec --help`` and ``memrec mark`` never import numpy.

numpy alone costs several times a bare interpreter's start; ``memrec mark`` runs from shell
scripts between benchmark phases. Checked with ``-X importtime`` on the real command line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("numpy", "msgpack_numpy", "bcc", "pynvml", "textual", "memrec.trace.reader", "memrec.state")


def imported_modules(*argv: str) -> set[str]:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "memrec", *argv],
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
