"""Coverage-guided fuzzing of the trace reader and every reading command (long run, not in CI).

    .venv/bin/python tests/fuzz/run_atheris.py -atheris_runs=200000 [-max_len=8192] [corpus_dir]

Each input is a whole file: the golden trace seeds the corpus. The check is the CI fuzz tests'
(tests/fuzz/harness.py): ``memrec report``, ``report --json``, ``dump`` and the TUI's loading path
must read it or refuse it with exit code 65 and one line, never raise. Atheris instruments
memrec's modules (and msgpack's Python parts), so inputs that reach new code are kept and mutated
further. At the end it prints how many inputs were tried and how long it took.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time

import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

with atheris.instrument_imports(include=["memrec"]):
    import memrec.analysis.diff.build  # noqa: F401
    import memrec.analysis.report.build  # noqa: F401
    import memrec.commands  # noqa: F401
    import memrec.commands.dump  # noqa: F401
    import memrec.commands.report  # noqa: F401
    import memrec.state  # noqa: F401
    import memrec.trace.format  # noqa: F401
    import memrec.trace.mapped  # noqa: F401
    import memrec.trace.reader  # noqa: F401
    import memrec.tui.model  # noqa: F401
    import memrec.tui.sources  # noqa: F401

from tests.fuzz.harness import check_trace_bytes  # noqa: E402

WORKDIR = tempfile.mkdtemp(prefix="memrec-fuzz-")
COUNT = [0]
START = time.monotonic()


def one_input(data: bytes) -> None:
    COUNT[0] += 1
    check_trace_bytes(data, WORKDIR)


def _report() -> None:
    print(f"memrec fuzz: {COUNT[0]} inputs tried in {time.monotonic() - START:.0f} s", file=sys.stderr)
    shutil.rmtree(WORKDIR, ignore_errors=True)


def main() -> None:
    logging.disable(logging.CRITICAL)  # the commands' warnings are expected; only failures matter
    argv = list(sys.argv)
    if not any(not a.startswith("-") for a in argv[1:]):  # no corpus dir: seed one with the golden traces
        corpus = tempfile.mkdtemp(prefix="memrec-corpus-")
        for version in ("1", "2", "2_1", "2_2", "2_3"):
            shutil.copy(os.path.join(HERE, "..", "data", f"golden_v{version}.mrec"), corpus)
        argv.append(corpus)
    import atexit

    atexit.register(_report)
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
