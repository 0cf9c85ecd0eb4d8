"""A controlled load for the benchmarks: N CPU-bound competitors running from before a bench's
floors to after its figures, so that the floor and the figure see the same load.

    .venv/bin/python bench/load.py [--procs 2] [--kind mix] [--settle 3] [--json PATH] -- CMD [ARGS...]

Issue 26 asks every headline figure to hold "at a load of 2 on this 2-core machine". A load
average read beside a figure says what the machine happened to be doing; this makes it a
condition of the run: ``--procs`` processes that never sleep, started ``--settle`` seconds before
``CMD`` (any bench, unchanged: every bench measures its floors inside its own run), stopped when
it exits. ``--procs 0`` runs ``CMD`` alone with the same record, the quiet column.

Competitors (``--kind``): ``python`` an interpreter's integer loop (the bench's own kind of work:
bytecode, small objects); ``numpy`` a loop over an 8 MiB array (a working set larger than a
core's L2, as a test suite's or another bench's arrays are: it takes memory bandwidth and the
shared L3); ``mix`` (default) alternates them, a python one first.

After ``CMD`` it prints one line (and, with ``--json``, writes it as a record): each competitor's
share of a CPU while it ran (``utime + stime`` from /proc/PID/stat over the wall time: 2
competitors and a single-threaded bench on 2 cores get about 2/3 each), the 1-minute load
average's range and median, and the mean count of runnable tasks (/proc/stat ``procs_running``,
this sampler not counted) sampled every ``--every`` seconds: with 2 competitors and a bench it
is about 3, and anything above that is other work on the machine (other sessions' tests), which
the record is there to show. ``CMD``'s exit status is this command's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from dataclasses import dataclass
from pathlib import Path

# Each competitor dies with this process (PR_SET_PDEATHSIG, SIGKILL), however this one ends.
_ORPHAN_GUARD = "import ctypes\nctypes.CDLL(None).prctl(1, 9)\n"
BODIES = {
    "python": "x = 1\nwhile True:\n    x = (x * 1103515245 + 12345) % 2147483648\n",
    "numpy": ("import numpy as np\na = np.random.default_rng(1).random(1 << 20)\n"
              "while True:\n    a = np.sqrt(a * a + 1.0) - 0.5\n"),
}
TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class LoadRecord:
    """What the machine did while a bench ran: the competitors asked for, the CPU they got, and
    everything else that was runnable."""

    procs: int
    kinds: list[str]
    seconds: float
    competitor_cpu_share: list[float]
    loadavg_min: float
    loadavg_median: float
    loadavg_max: float
    runnable_mean: float

    def line(self) -> str:
        shares = ", ".join(f"{s:.0%}" for s in self.competitor_cpu_share) or "none"
        kinds = f" ({', '.join(self.kinds)})" if self.kinds else ""
        return (f"load: {self.procs} competitor(s){kinds} for {self.seconds:.0f} s, CPU share each {shares}; "
                f"1-min load average {self.loadavg_min:.2f} - {self.loadavg_max:.2f} (median "
                f"{self.loadavg_median:.2f}); runnable tasks {self.runnable_mean:.1f} on average "
                f"({self.procs} competitors + the bench's own would be {self.procs + 1})")


def competitor_kinds(procs: int, kind: str) -> list[str]:
    """The kind of each competitor: ``mix`` alternates python and numpy, a python one first."""
    if kind == "mix":
        return [("python", "numpy")[i % 2] for i in range(procs)]
    return [kind] * procs


def _cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (fields 14 and 15 of /proc/PID/stat; the command
    name in parentheses may hold spaces, so the fields are counted after its closing one)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _runnable() -> int:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("procs_running"):
                return int(line.split()[1])
    return 0


class Competitors:
    """``procs`` busy processes and a sampler of the machine's load, from ``__enter__`` to
    ``__exit__``; ``record`` says what they got and what else ran."""

    def __init__(self, procs: int = 2, kind: str = "mix", every: float = 0.5):
        self.kinds = competitor_kinds(procs, kind)
        self.every = every
        self.children: list[subprocess.Popen] = []
        self.loadavg: list[float] = []
        self.runnable: list[int] = []
        self.record: LoadRecord | None = None
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.loadavg.append(os.getloadavg()[0])
            self.runnable.append(max(_runnable() - 1, 0))  # this sampler reads it while running
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> Competitors:
        self.children = [subprocess.Popen([sys.executable, "-c", _ORPHAN_GUARD + BODIES[k]], stdin=subprocess.DEVNULL)
                         for k in self.kinds]
        self._start = time.monotonic()
        self._ticks = [_cpu_ticks(c.pid) for c in self.children]
        self._sampler.start()
        return self

    def __exit__(self, *exc) -> None:
        seconds = time.monotonic() - self._start
        ticks = [_cpu_ticks(c.pid) - t0 for c, t0 in zip(self.children, self._ticks)]
        self._stop.set()
        self._sampler.join()
        for c in self.children:
            c.kill()
        for c in self.children:
            c.wait()
        self.record = LoadRecord(
            procs=len(self.children), kinds=self.kinds, seconds=seconds,
            competitor_cpu_share=[t / TICK / seconds for t in ticks],
            loadavg_min=min(self.loadavg), loadavg_median=statistics.median(self.loadavg),
            loadavg_max=max(self.loadavg), runnable_mean=statistics.fmean(self.runnable))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("load.py: give the command after --, e.g. load.py --procs 2 -- python bench/bench_state.py",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2, help="competitors (default 2; 0 = the quiet run)")
    ap.add_argument("--kind", choices=("mix", "python", "numpy"), default="mix")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between the competitors' start and CMD's")
    ap.add_argument("--every", type=float, default=0.5, help="seconds between samples of the load")
    ap.add_argument("--json", type=Path, help="append the record here as a JSON line")
    args = ap.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd or args.procs < 0:
        ap.error("a command after --, and --procs >= 0")
    # a SIGTERM ends CMD (subprocess.call kills it) and the competitors as a ^C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with Competitors(args.procs, args.kind, args.every) as load:
        time.sleep(args.settle if args.procs else 0)
        sys.stdout.flush()
        rc = subprocess.call(cmd)
    assert load.record is not None
    print(load.record.line(), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"cmd": cmd, "rc": rc, **asdict(load.record)}) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
