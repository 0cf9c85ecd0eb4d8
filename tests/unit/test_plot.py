"""``memrec plot``: the picture checked as an image (size, panel count, not blank, what is drawn)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from memrec.base.errors import ExitCode
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
    # (two panels under the answer's three lines)
    assert img.shape[0] == round((plot_module.PANEL_HEIGHT_IN * 2 + 0.6 + 3 * plot_module.HEAD_LINE_IN) * plot_module.DPI)
    assert panel_frames(img) == 2
    # not blank: the driver allocations' colour fills a real part of the picture
    driver = dict(plot_module._STACK)["driver"]
    assert colour_share(img, driver, plot_module.STACK_ALPHA) > 0.05


def test_failed_call_is_marked(tmp_path):
    out = tmp_path / "golden.png"
    assert main(["plot", str(GOLDEN), "-o", str(out)]) == 0
    img = read_png(out)
    assert colour_share(img, "#D55E00") > 0  # the OOM's cross and its label


def test_diff_aligns_on_the_kv_sizing_as_the_tui_does(tmp_path, capsys):
    out = tmp_path / "diff.png"
    assert main(["plot", str(BASE), "--diff", str(IPC), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    # (the moment memrec diff's window ends: SGLang's KV sizing, where the other run failed)
    assert text.strip() == f"{out}: 2 panels, aligned on 'kv_budget begin'"
    assert panel_frames(read_png(out)) == 2


def test_diff_draws_every_panel_on_one_scale_that_holds_the_highest(tmp_path, monkeypatch, capsys):
    import matplotlib.pyplot as plt

    from memrec.terms.events import Kind
    from memrec.trace import format as fmt
    from memrec.trace.writer import TraceWriter
    from tests.utils import events
    from tests.utils import ev

    # GIVEN two runs with 1 GiB on GPU 0 and, drawn last, 4 KiB of pinned host memory
    traces = []
    for name in ("a.mrec", "b.mrec"):
        rows = [ev(Kind.ALLOC, pid=7, gpu=0, ptr=0x1000, size=1 << 30, ts=1000),
                ev(Kind.HOST_ALLOC, pid=7, ptr=0x9000, size=4096, ts=2000)]
        with TraceWriter(tmp_path / name, fmt.make_header(host="h", boot_id=name)) as w:
            w.write_events(events(*rows))
        traces.append(tmp_path / name)
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    # WHEN drawn side by side
    out = tmp_path / "diff.png"
    assert main(["plot", str(traces[0]), "--diff", str(traces[1]), "-o", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"{out}: 4 panels")
    # THEN every panel's y axis reaches the GiB on GPU 0 (the host panel's 4 KiB, set last, once
    # set the shared axis of all of them and cut GPU 0's panels off)
    axes = figures[0].axes
    assert len(axes) == 4 and all(ax.get_ylim()[1] >= 1.0 for ax in axes), [ax.get_ylim() for ax in axes]


def test_a_drawing_that_fails_leaves_no_file_behind(tmp_path, monkeypatch, capsys):
    from matplotlib.figure import Figure

    # GIVEN matplotlib failing while it draws (as FreeType's "raster overflow" once did)
    def fail(self, *args, **kwargs):
        raise RuntimeError("FT_Render_Glyph failed with error 0x62: raster overflow")

    monkeypatch.setattr(Figure, "savefig", fail)
    out = tmp_path / "t.png"
    # WHEN plotting THEN the error, and no empty picture that a second try would be refused over
    assert main(["plot", str(IPC), "-o", str(out)]) == ExitCode.SOFTWARE
    assert "raster overflow" in capsys.readouterr().err and not out.exists()

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


def short_peak_trace(path: Path, peak_us: int, background: int = 0) -> Path:
    """20 s on GPU 0: 4 KiB held throughout, and one 16 KiB allocation freed ``peak_us`` µs later at 10 s
    (``background`` more 4 KiB alloc/free pairs spread over the run: a series with more points than pixels)."""
    from memrec.terms.events import Kind
    from memrec.trace import format as fmt
    from memrec.trace.writer import TraceWriter
    from tests.utils import events
    from tests.utils import ev

    s, kib = 10**9, 1024
    rows = [ev(Kind.ALLOC, pid=7, gpu=0, ptr=0x1000, size=4 * kib, ts=1)]
    for i in range(background):  # short-lived 4 KiB pairs (at most 8 KiB held: below the peak)
        t = 1 + (i + 1) * (20 * s // (background + 2))
        rows += [ev(Kind.ALLOC, pid=7, gpu=0, ptr=0x9000, size=4 * kib, ts=t),
                 ev(Kind.FREE, pid=7, gpu=0, ptr=0x9000, ts=t + 1000)]
    rows += [ev(Kind.ALLOC, pid=7, gpu=0, ptr=0x2000, size=16 * kib, ts=10 * s + 500),
             ev(Kind.FREE, pid=7, gpu=0, ptr=0x2000, ts=10 * s + 500 + peak_us * 1000),
             ev(Kind.FREE, pid=7, gpu=0, ptr=0x1000, ts=20 * s)]
    rows.sort(key=lambda r: int(r["ts"]))
    with TraceWriter(path, fmt.make_header(host="h", boot_id="b")) as w:
        w.write_events(events(*rows))
    return path


@pytest.mark.parametrize("background", [0, 5000], ids=["few-points", "more-points-than-pixels"])
def test_a_peak_shorter_than_a_pixel_is_drawn(tmp_path, background):
    # GIVEN a 20 s run whose only peak (4 KiB -> 20 KiB) lasts 6 µs
    trace = short_peak_trace(tmp_path / "t.mrec", peak_us=6, background=background)
    out = tmp_path / "t.png"
    # WHEN drawn
    assert main(["plot", str(trace), "-o", str(out)]) == 0
    # THEN some pixel column holds the driver colour as high as the 20 KiB peak: 5 times the 4 KiB
    # held all along (with the background pairs, whose 4 KiB more show in every column: 20 / 8)
    img = read_png(out)
    rgb = np.array([int(dict(plot_module._STACK)["driver"][i : i + 2], 16) / 255 for i in (1, 3, 5)])
    rgb = rgb * plot_module.STACK_ALPHA + (1 - plot_module.STACK_ALPHA)
    driver = np.abs(img - rgb).max(axis=2) < 0.12
    heights = driver.sum(axis=0)
    drawn = heights[heights > 0]
    assert len(drawn) > 500  # the 4 KiB all along the run
    ratio = 20 / (8 if background else 4)
    assert heights.max() >= 0.9 * ratio * np.median(drawn), (heights.max(), np.median(drawn))


def test_plot_without_a_writable_home_prints_only_its_own_line(tmp_path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run plot as another user")
    # GIVEN a user whose HOME does not exist (a service user): matplotlib cannot keep its folders there
    out_dir = Path(tempfile.mkdtemp(dir="/tmp"))
    out_dir.chmod(0o777)
    out = out_dir / "timeline.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "MPLCONFIGDIR"))}
    env["HOME"] = "/nonexistent"
    try:
        # WHEN that user plots a trace
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                               "memrec", "plot", str(SEED_X2), "-o", str(out)],
                              capture_output=True, text=True, timeout=120, env=env)
        # THEN the picture is written and plot says so, with no matplotlib warning about its folders
        assert (done.returncode, done.stdout, done.stderr) == (ExitCode.OK, f"{out}: 2 panels\n", "")
        assert out.stat().st_size > 0
    finally:
        shutil.rmtree(out_dir)
    # AND the private folder it used is gone
    assert not [p for p in Path(tempfile.gettempdir()).glob("memrec-matplotlib-*") if p.owner() == "nobody"]


def phased_trace(path: Path, phases: int) -> Path:
    """One process on GPU 0 holding 1 MiB through ``phases`` begin/end phases of 10 ms each."""
    from memrec.terms.events import Kind
    from memrec.terms.events import Marker
    from memrec.terms.events import ProcessInfo
    from memrec.trace import format as fmt
    from memrec.trace.writer import TraceWriter
    from tests.utils import events
    from tests.utils import ev

    ms = 10**6
    with TraceWriter(path, fmt.make_header(host="h", boot_id="b")) as w:
        w.write_process(ProcessInfo(7, 1, ["python"], None, None, [], 1))
        w.write_events(events(ev(Kind.ALLOC, pid=7, gpu=0, ptr=0x1000, size=1 << 20, ts=1)))
        for i in range(phases):
            for phase, t in (("begin", 2 + 20 * i * ms), ("end", 2 + (20 * i + 10) * ms)):
                w.write_marker(Marker(ts=t, pid=7, uid=0, tid=7, name=f"step{i}", phase=phase, values={}))
        w.write_events(events(ev(Kind.FREE, pid=7, gpu=0, ptr=0x1000, ts=2 + 20 * phases * ms)))
    return path


def test_past_named_phases_a_vector_file_holds_the_bands_as_one_image(tmp_path):
    # GIVEN a run with a few phases and one with more than plot.NAMED (a step loop's markers)
    few = phased_trace(tmp_path / "few.mrec", 10)
    many = phased_trace(tmp_path / "many.mrec", 4 * plot_module.NAMED)
    # WHEN each is drawn as SVG
    svgs = {}
    for trace in (few, many):
        assert main(["plot", str(trace), "-o", str(tmp_path / f"{trace.stem}.svg")]) == 0
        svgs[trace.stem] = (tmp_path / f"{trace.stem}.svg").read_text()
    # THEN the few bands are vector paths, the many are one embedded image, not a path each
    assert "<image" not in svgs["few"]
    assert svgs["many"].count("<image") == 1
    assert svgs["many"].count("<path") < svgs["few"].count("<path") + 100
    # AND as PNG the bands are drawn all the same: the band colour covers a part of the picture
    assert main(["plot", str(many), "-o", str(tmp_path / "many.png")]) == 0
    img = read_png(tmp_path / "many.png")
    assert sum(colour_share(img, c, tol=0.02) for c in plot_module._BAND) > 0.008


def test_band_corners_are_the_floats_broken_barh_makes():
    # GIVEN bands as the panel computes them: starts and widths in seconds, some far from zero,
    # some narrower than a float's step there, one empty
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(7)
    ns = np.sort(rng.integers(0, 10**13, 2000))
    x0 = (ns - 123_456_789) / 1e9
    width = (ns + rng.integers(0, 5000, 2000) - 123_456_789) / 1e9 - x0
    # WHEN the corners are made at once, and by matplotlib's own broken_barh from the same floats
    fig, ax = plt.subplots()
    try:
        theirs = ax.broken_barh(list(zip(x0.tolist(), width.tolist())), (0, 1)).get_paths()
    finally:
        plt.close(fig)
    ours = plot_module._band_corners(x0, width)
    # THEN every corner is the same float (the picture is drawn from them, byte for byte as before)
    assert len(theirs) == len(ours)
    for path, corners in zip(theirs, ours):
        assert np.array_equal(path.vertices[:4], corners)


def test_a_strip_column_is_the_bands_share_of_it_in_their_colours():
    # GIVEN bands over a view of 4 columns: band 0 (first colour) covers column 0 whole, band 1
    # (second colour) half of column 1, band 2 (first colour) columns 2 and 3 and band 3 (second)
    # column 3 again, over it; an empty band 4 at the edge of column 2
    from matplotlib.colors import to_rgb

    x0 = np.array([0.0, 1.5, 2.0, 3.0, 2.0])
    width = np.array([1.0, 0.5, 2.0, 1.0, 0.0])
    # WHEN the strip is made
    strip = plot_module._band_strip(x0, width, (0.0, 4.0), 4)[0]
    first, second = (np.array(to_rgb(c)) for c in plot_module._BAND)
    # THEN each column's alpha is the covered share, its colour the bands' own, the second
    # colour over the first where both cover it (as the two collections were drawn)
    assert np.allclose(strip[:, 3], [1.0, 0.5, 1.0, 1.0])
    assert np.allclose(strip[0, :3], first) and np.allclose(strip[2, :3], first)
    assert np.allclose(strip[1, :3], second) and np.allclose(strip[3, :3], second)
    # AND bands narrower than a column add up: 1,000 bands of a thousandth of a column each in
    # every other thousandth cover half of it
    many = np.arange(2000) / 2000
    strip = plot_module._band_strip(many, np.full(2000, 1 / 2000), (0.0, 1.0), 1)[0]
    assert np.isclose(strip[0, 3], 1.0)
    x0 = np.arange(0, 2000, 2) / 2000
    strip = plot_module._band_strip(np.repeat(x0, 2), np.tile([1 / 2000, 0.0], 1000), (0.0, 1.0), 1)[0]
    assert np.isclose(strip[0, 3], 0.5) and np.allclose(strip[0, :3], first)
