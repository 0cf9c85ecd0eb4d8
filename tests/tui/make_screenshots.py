"""Regenerate docs/img/tui-*.svg from the scripted trace (run by hand: python tests/tui/make_screenshots.py)."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import synth  # noqa: E402
from conftest import FixedClock  # noqa: E402
from conftest import settle  # noqa: E402

from memrec.tui.app import MemrecApp  # noqa: E402
from memrec.tui.sources import DiffSource  # noqa: E402
from memrec.tui.sources import FileSource  # noqa: E402

OUT = HERE.parents[1] / "docs" / "img"

SHOTS = [
    # (file name, size, keys, diff)
    ("tui-oom.svg", (160, 48), ["1", "home", "o"], False),
    ("tui-80x24.svg", (80, 24), ["1", "home", "o"], False),
    ("tui-largest.svg", (160, 48), ["home", "p", "p", "h", "h"], False),
    ("tui-overview.svg", (160, 48), ["a"], False),
    ("tui-diff.svg", (160, 48), ["1", "home", "o", "h"], True),
    ("tui-help.svg", (100, 36), ["question_mark"], False),
]


async def shoot(tmp: Path, name: str, size, keys, diff: bool) -> None:
    a = tmp / "run.mrec"
    synth.write_trace(a, synth.sglang_like())
    if diff:
        b = tmp / "other.mrec"
        synth.write_trace(b, synth.sglang_like(oom=False, weights_gib=40))
        app = MemrecApp(DiffSource(a, b), clock=FixedClock())
    else:
        app = MemrecApp(FileSource(a), clock=FixedClock())
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        await pilot.press(*keys)
        await settle(pilot)
        app.save_screenshot(name, str(OUT))
    print(OUT / name)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, size, keys, diff in SHOTS:
            asyncio.run(shoot(Path(tmp), name, size, keys, diff))


if __name__ == "__main__":
    main()
