"""The dataset with stacks (layout 2): what the stacks table and the events' stack column cost the
export, and what ``memrec sql --query sites`` costs, as ratios within one run.

    .venv/bin/python bench/bench_dataset_stacks.py [--hosts 40] [--rounds 3] [--base-tree DIR]

The traces: ``--hosts`` hosts' day from tests/fleet.py (as bench/bench_dataset.py makes them, 8 TP
ranks each), written again through the real writer with a Python stack on every successful driver
allocation (tests/stack_traces.py's SGLang-like stacks, one per phase; the day's activations get
stacks of 64 lines of their own, as a model's many layers would).

- **Export**: each round, one fresh process exports every trace into a new dataset with this tree
  (layout 2: the stacks table, the events' ``stack``), and one with the tree at ``--base-tree``
  (an earlier memrec, e.g. ``git archive`` of the commit before layout 2: layout 1, the same
  traces without their stacks in the dataset), alternating; the ratio is of medians.
- **Queries**: ``memrec sql --query sites`` (events joined to stacks), against ``--query peaks``
  (a query of layout 1) and a fresh Python that reads the events and stacks tables' files whole
  with pyarrow (the floor), each a fresh process, alternating.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_dataset import floor_argv  # noqa: E402
from bench_dataset import host_of  # noqa: E402
from bench_dataset import load  # noqa: E402
from bench_dataset import measure  # noqa: E402

#: One process's export of every trace given (argv: dataset folder, traces...), run from a tree.
EXPORT = ("import sys, time\n"
          "from pathlib import Path\n"
          "from memrec.export.dataset import write_trace\n"
          "from memrec.trace.reader import load_trace\n"
          "t0 = time.monotonic()\n"
          "for p in sys.argv[2:]:\n"
          "    write_trace(load_trace(p), Path(sys.argv[1]), Path(p).name)\n"
          "print(time.monotonic() - t0)\n")


def stack_of(phase: str, layer: list[int]):
    """The stack a host's allocation gets in ``phase`` (the activations: 64 lines in turn)."""
    from memrec.trace.stacks import Frame
    from tests import stack_traces as st

    named = {"load_weights": st.WEIGHTS, "kv_pool": st.KV_POOL, "cuda_graph_capture": st.CUSTOM_AR}
    if phase in named:
        return named[phase]
    layer[0] = (layer[0] + 1) % 64
    return (*st.KV_POOL[:3], Frame(f"{st.SP}/sglang/srt/layers/linear.py", 100 + layer[0], f"Layer{layer[0]}.forward"))


def make(folder: Path, hosts: int) -> list[Path]:
    from tests.fleet import write_host
    from tests.stack_traces import with_stacks

    out = []
    for i in range(hosts):
        for h in [host_of(i)] + ([host_of(i, 1)] if i % 10 == 3 else []):
            plain = write_host(folder / f"plain-{h.name}.{h.part}.mrec", h)
            layer = [0]
            out.append(with_stacks(plain, folder / f"{h.name}.{h.part}.mrec", lambda p: stack_of(p, layer)))
            plain.unlink()
    return out


def export(tree: Path, root: Path, traces: list[Path]) -> float:
    """Seconds one fresh process (run from ``tree``) takes to export ``traces`` into ``root``."""
    if root.exists():
        shutil.rmtree(root)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", EXPORT, str(root), *map(str, traces)], cwd=tree, env=env, check=True,
                   capture_output=True)
    return time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base-tree", type=Path, help="an earlier memrec's tree (layout 1): the export's floor")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="memrec-bench-stacks-") as tmp:
        folder = Path(tmp)
        t0 = time.monotonic()
        traces = make(folder, args.hosts)
        from memrec.trace.reader import load_trace

        events = sum(load_trace(p).n_events for p in traces)
        print(f"{len(traces)} trace parts, {events:,} events, made in {time.monotonic() - t0:.0f} s "
              f"(load {load()})", flush=True)
        mine, base = [], []
        for _ in range(args.rounds):
            mine.append(export(ROOT, folder / "ds2", traces))
            if args.base_tree is not None:
                base.append(export(args.base_tree, folder / "ds1", traces))
        line = f"export, layout 2 (this tree): {' '.join(f'{x:.1f}' for x in mine)} s"
        if base:
            line += (f"; layout 1 ({args.base_tree}): {' '.join(f'{x:.1f}' for x in base)} s; "
                     f"ratio of medians {statistics.median(mine) / statistics.median(base):.2f}x")
        print(line, flush=True)
        for name in ("ds2", "ds1") if base else ("ds2",):
            files = list((folder / name).rglob("*.parquet"))
            stacks = sum(p.stat().st_size for p in files if p.parts[-4] == "stacks")
            print(f"{name}: {len(files):,} files, {sum(p.stat().st_size for p in files) / 2**20:.1f} MiB"
                  + (f" (stacks table {stacks / 2**20:.2f} MiB)" if stacks else ""))
        root = folder / "ds2"
        cells = {"sites": [], "peaks": [], "floor": []}
        for _ in range(args.rounds):
            for name, argv in (("sites", [sys.executable, "-m", "memrec", "sql", "--query", "sites", "--format", "csv",
                                          str(root)]),
                               ("peaks", [sys.executable, "-m", "memrec", "sql", "--query", "peaks", "--format", "csv",
                                          str(root)]),
                               ("floor", floor_argv(root, ["events", "stacks"]))):
                cells[name].append(measure(argv))
        print(f"load average {load()}")
        print("| command | wall (median) | CPU | peak RSS | rows |")
        print("|---|---:|---:|---:|---:|")
        for name, runs in cells.items():
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            rss = max(r[2] for r in runs)
            print(f"| {name} | {wall:.2f} s | {cpu:.2f} s | {rss / 2**20:.0f} MiB | {runs[0][3]} |")
        sites = statistics.median(r[0] for r in cells["sites"])
        print(f"sites / peaks: {sites / statistics.median(r[0] for r in cells['peaks']):.2f}x wall; "
              f"sites / floor: {sites / statistics.median(r[0] for r in cells['floor']):.2f}x wall")


if __name__ == "__main__":
    main()
