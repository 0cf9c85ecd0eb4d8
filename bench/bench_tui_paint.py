"""Does ``memrec tui`` paint its main view on every start? Many starts in tmux on a busy host.

    sudo .venv/bin/python bench/bench_tui_paint.py [--starts 20] [--load 2] [--size 120x36] [TRACE...]

Why: the TUI once built its GPU tabs only when the file was loaded; a trace whose header lists
no GPU (recorded without NVML: every stub-driver and ``memrec demo`` trace) learns them later,
so the main view stayed blank, always on some traces and in some starts on others, depending on
which thread won. A race shows up only over many starts under load, so this starts the real
command ``--starts`` times per trace in tmux (its own server, no configuration: tmux's default
TERM), with ``--load`` processes spinning on the CPU, and counts the starts whose GPU tabs, header
and timeline appeared within ``--timeout`` seconds. Exit status 1 if any start did not paint.

Without TRACE arguments it uses, as a user makes them: ``memrec record`` of a two-process
stub-driver program with one failed allocation (no NVML, no markers) and ``memrec demo`` (both
need root and BPF; skipped with the reason otherwise), a scripted trace without a GPU list, and
``examples/seed-x2-base.mrec`` (recorded on an H200: a GPU list in the header).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "tui"))

from tmux_term import Tmux  # noqa: E402
from tmux_term import cpu_load  # noqa: E402
from tmux_term import tui_command  # noqa: E402


def recorded_traces(out: Path) -> list[Path]:
    """The stub-driver traces a user records (root and BPF needed); [] with a note otherwise."""
    if os.geteuid() != 0:
        print("(not root: no recorded stub-driver traces; run with sudo to include them)", file=sys.stderr)
        return []
    from memrec.validation.stubdriver.build import build_stub

    stub = str(build_stub())
    run = out / "run.mrec"
    workload = [sys.executable, "-m", "memrec.validation.stubdriver.workload", "--lib", stub, "basic", "leak"]
    jobs = [
        [sys.executable, "-m", "memrec", "record", "--libcuda", stub, "-o", str(run), "--", *workload],
        [sys.executable, "-m", "memrec", "demo", "-o", str(out / "demo.mrec")],
    ]
    made = []
    for cmd, path in zip(jobs, (run, out / "demo.mrec")):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"(could not record {path.name}: {proc.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
            continue
        made.append(path)
    return made


def scripted_trace(out: Path) -> Path:
    import synth

    path = out / "scripted-no-nvml.mrec"
    synth.write_trace(path, synth.without_nvml(synth.sglang_like()))
    return path


def has_gpu_list(path: Path) -> bool:
    from memrec.trace.reader import TraceReader

    reader = TraceReader(str(path))
    try:
        return bool(reader.header.get("gpus"))
    finally:
        reader.close()


def measure(path: Path, starts: int, size: tuple[int, int], timeout: float) -> tuple[int, list[float], list[str]]:
    """(starts that painted, seconds to paint of each, last screen of each that did not)."""
    ok, took, failed = 0, [], []
    for i in range(starts):
        t0 = time.monotonic()
        t = Tmux(f"memrec-paint-bench-{i}", tui_command(path), size)
        try:
            painted, screen = t.wait_painted(timeout)
        finally:
            t.close()
        if painted:
            ok += 1
            took.append(time.monotonic() - t0)
        else:
            failed.append(screen)
    return ok, took, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("traces", nargs="*", type=Path, help="traces to open (default: see the module docstring)")
    parser.add_argument("--starts", type=int, default=20, help="starts per trace (default 20)")
    parser.add_argument("--load", type=int, default=2, help="processes spinning on the CPU meanwhile (default 2)")
    parser.add_argument("--size", default="120x36", help="terminal WIDTHxHEIGHT (default 120x36)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a start may take to paint (default 30)")
    args = parser.parse_args(argv)
    size = tuple(int(x) for x in args.size.split("x"))
    with tempfile.TemporaryDirectory(prefix="memrec-paint-") as tmp:
        traces = list(args.traces)
        if not traces:
            traces = [*recorded_traces(Path(tmp)), scripted_trace(Path(tmp)), ROOT / "examples" / "seed-x2-base.mrec"]
        print(f"memrec tui, {args.starts} starts per trace in tmux {size[0]}x{size[1]} (default TERM), "
              f"{args.load} CPU-spinning processes, {os.cpu_count()} CPUs")
        print(f"{'TRACE':28} {'GPU LIST':8} {'PAINTED':>9} {'MEDIAN':>7} {'MAX':>6}")
        missed = 0
        with cpu_load(args.load):
            for path in traces:
                ok, took, failed = measure(path, args.starts, size, args.timeout)
                missed += args.starts - ok
                med = f"{statistics.median(took):.1f}s" if took else "-"
                worst = f"{max(took):.1f}s" if took else "-"
                listed = "yes" if has_gpu_list(path) else "no"
                print(f"{path.name:28} {listed:8} {ok:>4}/{args.starts:<4} {med:>7} {worst:>6}", flush=True)
                for screen in failed[:1]:
                    print("  a start that did not paint showed:\n" + screen, file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
