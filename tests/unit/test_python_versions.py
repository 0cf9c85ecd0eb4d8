"""memrec runs on Python 3.10 – 3.13 (SGLang up to 0.5.10 supports 3.10): no syntax or standard
library newer than 3.10 in the installed package.

The unit suite itself was run on 3.10.13 and 3.13.0 (see the SGLang helper's report); this test
keeps CI, which runs one Python, from letting 3.11-only code in.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("memrec", "daemon", "probes", "tui", "sglang_hooks")
#: Standard-library names added after 3.10, as ``module.name`` (or a module alone).
NEWER = {
    "tomllib", "datetime.UTC", "typing.Self", "typing.LiteralString", "typing.Never", "typing.assert_never",
    "typing.reveal_type", "typing.override", "enum.StrEnum", "asyncio.TaskGroup", "asyncio.timeout",
    "hashlib.file_digest", "itertools.batched", "contextlib.chdir",
}
#: Builtins added after 3.10.
NEWER_BUILTINS = {"ExceptionGroup", "BaseExceptionGroup"}


def _files() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_package_source_is_python_3_10(path: Path):
    # GIVEN a module of the installed package
    text = path.read_text(encoding="utf-8")
    # WHEN parsed with the 3.10 grammar (no `except*`, no PEP 695 generics, ...)
    tree = ast.parse(text, filename=str(path), feature_version=(3, 10))
    # THEN it uses no standard-library name newer than 3.10
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            used |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            used.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in NEWER_BUILTINS:
            used.add(node.id)
    assert not used & (NEWER | NEWER_BUILTINS), f"{path}: newer than Python 3.10: {sorted(used & (NEWER | NEWER_BUILTINS))}"


def test_python_versions_declared_match():
    # GIVEN pyproject.toml  THEN it says 3.10 – 3.13
    if sys.version_info < (3, 11):
        pytest.skip("reading pyproject.toml needs tomllib (Python 3.11+)")
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10"
    versions = {c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if c.startswith("Programming Language :: Python :: 3.")}
    assert versions == {"3.10", "3.11", "3.12", "3.13"}
