"""What stacks cost the trace and the report: bytes an event, and the allocation sites' share of
``memrec report``, against the same trace without stacks in the same run.

    python bench/bench_sites.py [--events 1000000] [--stacks 1000] [--repeat 3]

One trace of ``--events`` events (half allocations, half their frees, 8 processes), written twice
through the real writer: without stacks, and with each allocation naming one of ``--stacks``
distinct stacks (two frames each) in turn. Per repeat, interleaved: ``build_report`` on each
(the report with stacks has the ``sites`` section; without, none), and ``sites_section`` alone.
Prints the files' sizes, the bytes an event the stacks cost, and the medians with the ratio of
the report with stacks to the report without (the floor, measured in the same run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memrec.analysis.report.build import build_report  # noqa: E402
from memrec.analysis.report.sites import sites_section  # noqa: E402
from memrec.terms.columns import empty_events  # noqa: E402
from memrec.engine.replay import trace_bounds  # noqa: E402
from memrec.engine.replay import trace_phases  # noqa: E402
from memrec.terms.events import Kind  # noqa: E402
from memrec.trace import format as fmt  # noqa: E402
from memrec.trace.reader import load_trace  # noqa: E402
from memrec.trace.stacks import Frame  # noqa: E402
from memrec.trace.writer import TraceWriter  # noqa: E402


def write(path: Path, n: int, n_stacks: int) -> Path:
    ev = empty_events(n)
    i = np.arange(n)
    ev["ts"] = i * 1000 + 10**9
    ev["pid"] = 7 + (i // 2) % 8
    ev["tid"] = ev["pid"]
    ev["kind"] = np.where(i % 2 == 0, int(Kind.ALLOC), int(Kind.FREE))
    ev["api"] = 1
    ev["gpu"] = ev["pid"] - 7
    ev["ptr"] = (i // 2) * 4096 + 0x7F00_0000_0000
    ev["size"] = np.where(i % 2 == 0, 1 << 20, 0)
    with TraceWriter(path, fmt.make_header(host="bench")) as w:
        if n_stacks:
            ids = np.array([w.intern_stack([Frame(f"/app/pkg/mod{k % 50}.py", 10 + k, f"layer{k}.forward"),
                                            Frame("/app/train.py", 1, "main")]) for k in range(n_stacks)])
            ev["stack"] = np.where(i % 2 == 0, ids[(i // 2) % n_stacks], 0)
        w.write_events(ev)
    return path


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--stacks", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain = write(Path(tmp) / "plain.mrec", args.events, 0)
        stacked = write(Path(tmp) / "stacks.mrec", args.events, args.stacks)
        a, b = plain.stat().st_size, stacked.stat().st_size
        print(f"{args.events:,} events, {args.stacks:,} stacks: file {a:,} B without stacks, {b:,} B with "
              f"({(b - a) / args.events:.3f} B an event, definitions included)")
        base, with_sites, alone = [], [], []
        for _ in range(args.repeat):
            t_plain, t_stacks = load_trace(plain), load_trace(stacked)
            base.append(timed(lambda: build_report(t_plain)))
            with_sites.append(timed(lambda: build_report(t_stacks)))
            phases = trace_phases(t_stacks)
            alone.append(timed(lambda: sites_section(t_stacks, phases, trace_bounds(t_stacks)[1])))
        m0, m1, m2 = (statistics.median(x) for x in (base, with_sites, alone))
        print(f"report without stacks {m0:.2f} s (the floor); with stacks {m1:.2f} s = {m1 / m0:.2f}x; "
              f"sites_section alone {m2:.2f} s = {m2 / m0:.2f}x of the floor (medians of {args.repeat})")


if __name__ == "__main__":
    main()
