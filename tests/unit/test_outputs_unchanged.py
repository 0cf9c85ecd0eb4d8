"""``report`` and ``diff`` print, byte for byte, what they printed when the outputs were stored:
the golden traces and the examples, as JSON and as text.

Why: the report's, the diff's and the SGLang section's rows are typed (dataclasses) that the
builders and the renderers share; a refactoring of those types must not move a key, change a
number's type or reorder a line. The stored outputs are ``tests/data/outputs.json.xz`` (one xz'd
JSON object: case name -> output). After a change meant to alter the output, write them again
with ``.venv/bin/python tests/unit/test_outputs_unchanged.py --write`` and read the diff of what
changed in the test's failure first.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import json
import lzma
import sys
from pathlib import Path

import pytest

from memrec.commands import main

ROOT = Path(__file__).resolve().parents[2]
STORED = ROOT / "tests" / "data" / "outputs.json.xz"
#: The golden traces, and ``memrec demo``'s (recorded on the stub driver: an out-of-memory with holders).
GOLDEN = sorted(p.stem for p in (ROOT / "tests" / "data").glob("golden_v*.mrec")) + ["demo_oom"]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.mrec"))
DIFFS = [("sglang-standin-base", "sglang-standin-ipc"), ("seed-x2-base", "seed-x2-ipc"),
         ("torch-expandable", "torch-ipc"), ("sglang-standin-stock", "sglang-standin-base"),
         ("golden_v2_2", "golden_v2_3"),  # tensor blocks on both sides
         ("demo_oom", "golden_v2_3")]


def _path(stem: str) -> str:
    folder = "tests/data" if stem in GOLDEN else "examples"
    return str(ROOT / folder / f"{stem}.mrec")


def cases() -> dict[str, list[str]]:
    """Case name -> the command line (report as JSON and as full text; diff as JSON and text)."""
    out: dict[str, list[str]] = {}
    for stem in GOLDEN + EXAMPLES:
        out[f"report --json {stem}"] = ["report", "--json", _path(stem)]
        out[f"report -a {stem}"] = ["report", "-a", _path(stem)]
    out["report --json -p 1054 sglang-standin-ipc"] = ["report", "--json", "-p", "1054", _path("sglang-standin-ipc")]
    for a, b in DIFFS:
        out[f"diff --json {a} {b}"] = ["diff", "--json", _path(a), _path(b)]
        out[f"diff {a} {b}"] = ["diff", _path(a), _path(b)]
    return out


def run(argv: list[str]) -> str:
    """What ``memrec ARGV`` prints on stdout (exit code in the last line), 100 columns wide."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return buf.getvalue() + f"[exit {rc}]\n"


@pytest.fixture(scope="module")
def stored() -> dict[str, str]:
    return json.loads(lzma.decompress(STORED.read_bytes()))


@pytest.mark.parametrize("name", sorted(cases()))
def test_the_output_is_the_stored_one(name, stored, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    got = run(cases()[name])
    want = stored[name]
    if got != want:
        diff = "".join(list(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "stored", "now"))[:60])
        pytest.fail(f"{name}: the output changed\n{diff}")


def test_every_stored_case_is_still_run(stored):
    # a case renamed or dropped from cases() would otherwise leave its stored output unchecked
    assert sorted(stored) == sorted(cases())


if __name__ == "__main__":
    import os

    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {sys.argv[0]} --write   (store what report and diff print now)")

    os.environ["COLUMNS"] = "100"
    outputs = {name: run(argv) for name, argv in sorted(cases().items())}
    STORED.write_bytes(lzma.compress(json.dumps(outputs, indent=0, sort_keys=True).encode(), preset=9))
    print(f"{STORED}: {len(outputs)} outputs, {STORED.stat().st_size} bytes")
