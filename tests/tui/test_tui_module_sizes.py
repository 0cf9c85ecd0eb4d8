"""The TUI's modules stay small enough to read in one go (issue 16: one concept per module)."""

from __future__ import annotations

from pathlib import Path

TUI = Path(__file__).resolve().parents[2] / "tui"


def test_every_tui_module_is_under_500_lines():
    # GIVEN every Python module of tui/ WHEN its lines are counted THEN none passes 500
    sizes = {str(p.relative_to(TUI)): len(p.read_text().splitlines()) for p in TUI.rglob("*.py")}
    assert sizes and {name: n for name, n in sizes.items() if n > 500} == {}
