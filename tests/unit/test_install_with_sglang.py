"""memrec installs into SGLang's environment without moving anything SGLang pins.

pip resolves ``sglang==X`` alone, and ``sglang==X`` together with memrec's own requirements
(pyproject.toml's ``dependencies`` and the ``nvml`` extra: memrec has no others), against the
package index (``pip install --dry-run --report``, metadata only). Every package of SGLang's own
resolution must come out at the same version. Releases: the newest (plugin line) and one of the
``.pth`` line on Python 3.10, the oldest Python that line supports.

Needs the package index; skipped with the reason when it is unreachable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+ (tomllib)")

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.network

#: (SGLang requirement, Python version to resolve for). 0.4.x keeps its runtime (torch, ...)
#: in the ``srt`` extra.
CASES = [("sglang==0.5.23", None), ("sglang==0.5.10", "3.10"), ("sglang[srt]==0.4.10.post2", None)]


def memrec_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["nvml"]]


@pytest.fixture(scope="module")
def index_reachable() -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang"],
                          capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        pytest.skip(f"package index unreachable: {lines[-1] if lines else proc.returncode}")


def resolve(requirements: list[str], python: str | None, report: Path) -> dict[str, str]:
    """pip's resolution of ``requirements`` (name → version), installing nothing."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report), "--disable-pip-version-check"]
    if python:
        cmd += ["--python-version", python, "--only-binary=:all:"]
    # pip builds the metadata of a package without a wheel in an environment of its build
    # requirements (torch's: 5 GB) under TMPDIR, and leaves it there when it fails or times out:
    # its own folder, removed whatever happens.
    with tempfile.TemporaryDirectory(prefix="memrec-pip-") as scratch:
        proc = subprocess.run([*cmd, *requirements], capture_output=True, text=True, timeout=900, check=False,
                              env={**os.environ, "TMPDIR": scratch})
    assert proc.returncode == 0, f"pip could not resolve {requirements}: {proc.stderr[-3000:]}"
    data = json.loads(report.read_text())
    return {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"] for item in data["install"]}


@pytest.mark.parametrize(("sglang", "python"), CASES)
def test_memrec_changes_nothing_sglang_pins(index_reachable, tmp_path, sglang, python):
    # GIVEN SGLang's resolution alone, and with memrec's requirements added
    release = sglang.split("==")[1]
    alone_req = [sglang]
    both_req = [*alone_req, *memrec_requirements()]
    with ThreadPoolExecutor(2) as pool:
        alone_f = pool.submit(resolve, alone_req, python, tmp_path / "alone.json")
        both_f = pool.submit(resolve, both_req, python, tmp_path / "both.json")
        alone, both = alone_f.result(), both_f.result()
    # WHEN they are compared
    changed = {name: (version, both.get(name)) for name, version in alone.items() if both.get(name) != version}
    added = sorted(set(both) - set(alone))
    print(f"{sglang} (Python {python or sys.version.split()[0]}): {len(alone)} packages; "
          f"numpy {alone.get('numpy')}, msgpack {alone.get('msgpack')}; memrec adds {added or 'nothing'}")
    # THEN every package SGLang resolved to keeps its version, and memrec adds only its own
    assert alone["sglang"] == release
    assert changed == {}
    # (zstandard: trace format 2's codec; SGLang's own resolution may or may not bring it)
    assert set(added) <= {"msgpack", "numpy", "nvidia-ml-py", "zstandard"}
