"""``memrec plot``: the picture checked as an image (size, panel count, not blank, what is drawn)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memrec._errors import ExitCode
from memrec.commands import main
from memrec.export import plot as plot_module

ROOT = Path(__file__).resolve().parents[2]
SEED_X2 = ROOT / "examples" / "seed-x2-ipc.mrec"  # two GPUs
BASE = ROOT / "examples" / "sglang-standin-base.mrec"
IPC = ROOT / "examples" / "sglang-standin-ipc.mrec"
GOLDEN = ROOT / "tests" / "data" / "golden_v1.mrec"

pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'memrec[plot]')")


def read_png(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    return imread(path)[:, :, :3]


def panel_frames(img: np.ndarray) -> int:
    """Axes drawn: each panel's frame has a dark top and bottom edge across most of the width."""
    dark = (img.sum(axis=2) < 0.6).mean(axis=1) > 0.7
    edges = np.count_nonzero(dark[1:] & ~dark[:-1]) + int(dark[0])
    return edges // 2


def colour_share(img: np.ndarray, hex_colour: str, alpha: float = 1.0, tol: float = 0.08) -> float:
    """The share of pixels of ``hex_colour`` (drawn with ``alpha`` over white)."""
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]) * alpha + (1 - alpha)
    return float((np.abs(img - rgb).max(axis=2) < tol).mean())


def test_one_panel_per_gpu(tmp_path, capsys):
    out = tmp_path / "timeline.png"
    assert main(["plot", str(SEED_X2), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: 2 panels"
    img = read_png(out)
    assert img.shape[1] == plot_module.WIDTH_IN * plot_module.DPI
    assert img.shape[0] == round((plot_module.PANEL_HEIGHT_IN * 2 + 0.6) * plot_module.DPI)
    assert panel_frames(img) == 2
    # not blank: the driver allocations' colour fills a real part of the picture
    driver = dict(plot_module._STACK)["driver"]
    assert colour_share(img, driver, plot_module.STACK_ALPHA) > 0.05


def test_failed_call_is_marked(tmp_path):
    out = tmp_path / "golden.png"
    assert main(["plot", str(GOLDEN), "-o", str(out)]) == 0
    img = read_png(out)
    assert colour_share(img, "#D55E00") > 0  # the OOM's cross and its label


def test_diff_aligns_on_the_first_common_marker(tmp_path, capsys):
    out = tmp_path / "diff.png"
    assert main(["plot", str(BASE), "--diff", str(IPC), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    from memrec.api import load

    name = plot_module.common_marker(load(BASE, pandas=False), load(IPC, pandas=False))[0]
    assert text.strip() == f"{out}: 2 panels, aligned on {name!r}"
    assert panel_frames(read_png(out)) == 2


def test_svg_and_errors(tmp_path, capsys):
    assert main(["plot", str(IPC), "-o", str(tmp_path / "t.svg")]) == 0
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(SystemExit) as exc:
        main(["plot", str(IPC), "-o", str(tmp_path / "t.txt")])
    assert exc.value.code == ExitCode.USAGE
    assert main(["plot", str(tmp_path / "missing.mrec"), "-o", str(tmp_path / "x.png")]) == ExitCode.NO_INPUT
    assert main(["plot", str(IPC), "-o", str(tmp_path / "nodir" / "x.png")]) == ExitCode.CANT_CREATE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 2 and all(line.startswith("memrec: error:") or "usage" in line or "plot" in line for line in err)
