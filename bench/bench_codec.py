"""Trace format 2.3 (the context transform, version-3 keyframes) against the code before it.

    .venv/bin/python bench/bench_codec.py --base DIR [--events 10000000] [--repeat 3] [--keep DIR2]

``DIR``: a tree of the code before (``git archive main | tar -x -C DIR``); its own ``memrec``
(``tui/``, ``daemon/`` ... linked into it as the installed package maps them) is put first on
``sys.path`` of the processes that stand for it. Two traces are written by each tree's own writer:

* ``realistic``: ``bench/bench_realistic.py --child now`` (16 processes, 1M live allocations,
  500k churn pairs, the daemon's own keyframe cadence): the file issue 26 names;
* ``tui10m``: ``bench/bench_tui.py``'s 10M-event trace (8 GPUs, an allocation freed 4,000
  events later, a keyframe every 1M events): the load and TUI figures of docs/performance.md.

Then, each in a fresh process, the trees alternating within every repeat, each tree on its own
files (and this tree on the older tree's files too: 2.2 still reads):

* the floor: read the older tree's file of the same trace and decompress every chunk's
  Zstandard frame into one buffer (the least its reader does; the same work in every process):
  its CPU time is what the other figures are divided by;
* ``load_trace`` (``memrec.load``, every command's reader), CPU time;
* the TUI's model: ``FileSource.scan`` + ``index`` (the first frame's wait and the replay);
* the seeks ahead of the replay (realistic trace only): the state at 8 cursors spread over the
  events right after the scan, each the nearest keyframe restored and the gap replayed
  (``TraceModel.live_state_at``).

Prints bytes per event and the keyframes' share, then per tree and trace the medians and the ratio
of each figure to the same process's floor. The machine is shared: CPU times, and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The folders the installed package maps into ``memrec`` (pyproject.toml's package-dir).
MAPPED = ("daemon", "probes", "tui", "sglang_hooks", "contrib")

WRITE_TUI = r"""
import sys
from pathlib import Path
tree, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path[:0] = [tree, tree + "/bench"]
import bench_tui
bench_tui.write_trace(Path(path), n, 4000, 1_000_000)
"""

MEASURE = r"""
import json, resource, sys, time
tree, path, seeks, floor_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, tree)
import msgpack, zstandard

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def floor():
    data = open(floor_path, "rb").read()
    d = zstandard.ZstdDecompressor()
    out = []
    for rec in _records(data):
        for key in ("c", "z", "state_z"):
            if key in rec:
                out.append(d.decompress(rec[key]))
        if "r" in rec:
            out.append(bytes(rec["r"]))
    return b"".join(out)

def _records(data):
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 31)
    u.feed(data)
    return u

res = {}
t = cpu(); floor(); res["floor"] = cpu() - t
import memrec.trace.format as fmt
res["format"] = f"{fmt.FORMAT_VERSION}.{fmt.FORMAT_MINOR}"
from memrec.trace.reader import load_trace
t = cpu(); trace = load_trace(path); res["load"] = cpu() - t
res["warnings"] = len(trace.warnings)
del trace
from memrec.tui.sources import FileSource
src = FileSource(path)
t = cpu(); src.scan(); res["scan"] = cpu() - t
if seeks:
    model = src.model
    n = model.store.n
    times = []
    for k in range(1, seeks + 1):
        t = cpu()
        model.live_state_at(n * k // (seeks + 1))
        times.append(cpu() - t)
    res["seek_worst"], res["seek_median"] = max(times), sorted(times)[len(times) // 2]
t = cpu(); src.index(); res["replay"] = cpu() - t
print(json.dumps(res))
"""


def tree_of(base: Path) -> Path:
    """``base`` with the mapped folders linked into its ``memrec`` (as the installed package has them)."""
    for name in MAPPED:
        link = base / "memrec" / name
        if (base / name).is_dir() and not link.exists():
            link.symlink_to(Path("..") / name)
    return base


def child(args: list[str], tree: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, *args], check=True, capture_output=True, text=True, env=env, cwd=tree).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="a tree of the code before (git archive)")
    ap.add_argument("--events", type=int, default=10_000_000, help="events of the tui10m trace")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="write the traces here and keep them (reused when they exist)")
    ap.add_argument("--traces", nargs="+", default=["realistic", "tui10m"])
    args = ap.parse_args()
    trees = {"before": tree_of(args.base.resolve()), "now": ROOT}
    folder = args.keep or Path(tempfile.mkdtemp(prefix="bench-codec-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    files: dict[tuple[str, str], Path] = {}
    for tree_name, tree in trees.items():
        for trace in args.traces:
            path = folder / f"{trace}-{tree_name}.mrec"
            if not path.exists():
                if trace == "realistic":
                    child([str(tree / "bench" / "bench_realistic.py"), "--child", "now", "--path", str(path)], tree)
                else:
                    child(["-c", WRITE_TUI, str(tree), str(path), str(args.events)], tree)
            files[tree_name, trace] = path
    runs = [(tree_name, tree, trace, files[tree_name, trace]) for trace in args.traces for tree_name, tree in trees.items()]
    runs += [("now on before's file", ROOT, trace, files["before", trace]) for trace in args.traces]
    res: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeat):
        for name, tree, trace, path in runs:  # alternating: a change of the host's load hits all alike
            seeks = 8 if trace == "realistic" else 0
            floor = files["before", trace]
            r = json.loads(child(["-c", MEASURE, str(tree), str(path), str(seeks), str(floor)], tree).strip().splitlines()[-1])
            res.setdefault((name, trace), []).append(r)
            print(name, trace, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    for (tree_name, trace), path in files.items():
        size = path.stat().st_size
        info = json.loads(child(["-c", SIZES, str(trees[tree_name]), str(path)], trees[tree_name]))
        print(f"{trace} written by {tree_name}: {size / info['events']:.2f} B/event ({size:,} bytes), keyframes "
              f"{info['keyframe_bytes'] / size:.1%} ({info['keyframes']})")
    for (name, trace), rs in res.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
        ratios = {k: statistics.median(r[k] / r["floor"] for r in rs) for k in med if k != "floor"}
        print(f"{name:>20} {trace:>9} (format {rs[0]['format']}, {rs[0]['warnings']} warnings): floor {med['floor']:.2f} s; "
              + ", ".join(f"{k} {med[k]:.2f} s (x{ratios[k]:.2f})" for k in ratios))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


SIZES = r"""
import json, sys
tree, path = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
import msgpack
u = msgpack.Unpacker(open(path, "rb"), raw=False, strict_map_key=False, max_buffer_size=1 << 31)
kf = kfb = 0
pos = 0
for rec in u:
    end = u.tell()
    if rec.get("type") == "keyframe":
        kf += 1
        kfb += end - pos
    elif rec.get("type") == "trailer":
        events = rec["counts"]["events"]
    pos = end
print(json.dumps({"events": events, "keyframes": kf, "keyframe_bytes": kfb}))
"""


if __name__ == "__main__":
    sys.exit(main())
