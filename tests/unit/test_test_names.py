"""The suite runs as one pytest invocation (the README's test command): test modules are imported
by their basename (the test folders are no packages), so two test files of one name in different
folders stop the whole run at collection. This holds it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_name():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert sorted(n for n, c in names.items() if c > 1) == []
