"""Regenerate docs/img/tui-*.svg (run by hand: python tests/tui/make_screenshots.py).

The README's and docs/tui.md's first screens are the SGLang example's (``examples/``): the run whose
KV sizing failed, as the TUI opens on it (the answer's window, its failure and cause in the status
line), and ``tui --diff`` against the run that worked. The others come from the scripted trace
(two GPUs, an out-of-memory), which shows the views the example is too small for."""

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

EXAMPLES = HERE.parents[1] / "examples"
IPC = EXAMPLES / "sglang-standin-ipc.mrec"
BASE = EXAMPLES / "sglang-standin-base.mrec"

SHOTS = [
    # (file name, size, keys, what: "example" | "example-diff" | "synth" | "synth-diff")
    ("tui-sglang.svg", (120, 36), [], "example"),
    ("tui-80x24.svg", (80, 24), [], "example"),
    ("tui-sglang-diff.svg", (120, 36), [], "example-diff"),
    ("tui-oom.svg", (160, 48), ["1", "home", "o"], "synth"),
    ("tui-largest.svg", (160, 48), ["home", "p", "p", "h", "h"], "synth"),
    ("tui-overview.svg", (160, 48), ["a"], "synth"),
    ("tui-diff.svg", (160, 48), ["1", "home", "o", "h"], "synth-diff"),
    ("tui-help.svg", (100, 36), ["question_mark"], "synth"),
]


async def shoot(tmp: Path, name: str, size, keys, what: str) -> None:
    a = tmp / "run.mrec"
    synth.write_trace(a, synth.sglang_like())
    if what == "example":
        app = MemrecApp(FileSource(IPC), clock=FixedClock())
    elif what == "example-diff":
        app = MemrecApp(DiffSource(BASE, IPC), clock=FixedClock())
    elif what == "synth-diff":
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
        for name, size, keys, what in SHOTS:
            asyncio.run(shoot(Path(tmp), name, size, keys, what))


if __name__ == "__main__":
    main()
