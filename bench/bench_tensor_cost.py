#!/usr/bin/env python3
"""bench_tensor_cost: what `memrec daemon --tensors` costs a PyTorch process, as ratios against
the same process with no daemon, interleaved within one run.

Usage (root, memrec and torch importable):
    python bench/bench_tensor_cost.py [--rounds 10] [--device cuda] [--configs none,plain,tensors]

Why one long-lived worker: a fresh Python per measurement pays torch's import and CUDA's start-up
each time, and a GPU host's clocks and caches drift over minutes (the first H200 run saw the
no-daemon step drift from 6.4 to 9.8 ms). Here one worker process imports torch once, builds its
model, and measures on command, while the daemon is started and stopped around it: started with
``--tensors``, the kernel raises the probes' semaphores in the already-running worker (the
"process started before the daemon" path); stopped, they fall back to 0 and the sites are skipped
again. Each round runs every configuration once, in a rotated order, and a configuration's ratio
is taken per round against that round's no-daemon measurement, so drift cancels.

Workloads (each measurement: the median of its repeats):
  small  a 4-layer transformer encoder (d_model 256, 4 heads, ffn 1024, batch 16 x 128) forward +
         backward + Adam step, eager mode, synchronized: ms per step (--steps steps, median); on a
         fast GPU this is launch-bound: the CPU's time per op is the step time
         (and ``small_cpu_ms``: the process's CPU time per step, all threads, which the host's
         swings of wall time move less; a trap is CPU time of the thread that hits it)
  large  6 layers, d_model 1024, 16 heads, ffn 4096, batch 16 x 512 (--large-steps steps): GPU-bound,
         the CPU runs ahead of the GPU and a probe's CPU time can hide behind the kernels
  loop   ``torch.empty(256)`` + ``del``: ns per pair (--loop-reps repeats of --pairs pairs, median);
         the worst case: every pair is two probe hits and nothing else

Configurations:
  none      no daemon
  plain     ``memrec daemon`` (driver probes only: "the daemon with none of this enabled")
  tensors   ``memrec daemon --tensors``
  self      ``memrec daemon --tensors-pid WORKER`` (scoped to the worker: it pays as with --tensors)
  other     ``memrec daemon --tensors-pid OTHER``, OTHER a process this bench starts that maps
            nothing: what every process outside the scope pays
  trap      no daemon: a no-op BPF program at every pytorch probe site of the worker's
            libc10_cuda.so, semaphores raised (bench_tensor_probes.py's NoopSites): what any
            recorder of these probes pays before its program does anything
  EXTRA     any ``--extra NAME='daemon options'`` (e.g. another build's option), run like the others
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tensor_probes import NoopSites  # noqa: E402  (the no-op program at PyTorch's sites)

WORKER = r"""
import json, os, statistics, sys, time
dev, cpu, sizes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
if cpu >= 0:
    os.sched_setaffinity(0, {cpu})
import torch
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
SHAPES = {"small": (256, 4, 1024, 4, 16, 128), "large": (1024, 16, 4096, 6, 16, 512)}
models = {}
for size in sizes:
    d, heads, ffn, layers, batch, seq = SHAPES[size]
    layer = torch.nn.TransformerEncoderLayer(d_model=d, nhead=heads, dim_feedforward=ffn, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=layers).to(dev)
    models[size] = (model, torch.optim.Adam(model.parameters(), lr=1e-4), (batch, seq, d))

def steps(size, n):
    model, opt, shape = models[size]
    out, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        loss = model(torch.randn(*shape, device=dev)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        out.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    return statistics.median(out), statistics.median(cpu)

def loop(pairs, reps):
    out = []
    for _ in range(reps):
        sync(); t = time.perf_counter_ns()
        for _ in range(pairs):
            x = torch.empty(256, device=dev)
            del x
        sync(); out.append((time.perf_counter_ns() - t) / pairs)
    return statistics.median(out)

for size in models:  # warm up: the allocator's pools, cuBLAS handles, autograd's graphs
    steps(size, 3)
loop(2000, 2)
print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
for line in sys.stdin:
    counts = [int(v) for v in line.split()]
    row = {}
    for i, size in enumerate(models):
        row[f"{size}_ms"], row[f"{size}_cpu_ms"] = steps(size, counts[i])
    row["loop_ns"] = loop(counts[-2], counts[-1])
    print(json.dumps(row), flush=True)
"""


class Worker:
    """The PyTorch process measured: one for the whole run."""

    def __init__(self, python: str, device: str, cpu: int, sizes: list[str]) -> None:
        self.sizes = sizes
        self.proc = subprocess.Popen([python, "-c", WORKER, device, str(cpu), ",".join(sizes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        hello = self._read()
        self.torch = hello["torch"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench_tensor_cost: the worker exited ({self.proc.wait()})")
        return json.loads(line)

    def measure(self, steps: dict[str, int], pairs: int, reps: int) -> dict:
        self.proc.stdin.write(" ".join(str(v) for v in [*(steps[s] for s in self.sizes), pairs, reps]) + "\n")
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Daemon:
    """``memrec daemon`` with ``options`` for one measurement, its trace discarded after."""

    def __init__(self, python: str, options: list[str], tmp: Path, cpus: set[int]) -> None:
        from memrec.subscriber import wait_for_daemon

        self.sock = str(tmp / "bench.sock")
        self.trace = tmp / "bench.mrec"
        self.log = open(tmp / "daemon.log", "ab")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen([python, "-m", "memrec", "daemon", "-o", str(self.trace), "--socket", self.sock,
                                      "--rotate-size", "0", *options], stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        started = time.monotonic()
        wait_for_daemon(self.sock, timeout=300)
        self.start_s = time.monotonic() - started

    def stop(self) -> dict:
        """Stop it; return its trace's event counts (what it recorded during the measurement)."""
        self.proc.send_signal(2)
        self.proc.wait(timeout=120)
        self.log.close()
        counts = {}
        try:
            from memrec.trace.reader import load_trace

            counts = _kind_counts(load_trace(self.trace))
        except Exception as error:  # the counts are a check, not the measurement
            counts = {"error": str(error)[:200]}
        self.trace.unlink(missing_ok=True)
        return counts


def torch_library(pid: int) -> Path:
    """The libc10_cuda.so process ``pid`` maps."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.rstrip().endswith("/libc10_cuda.so"):
            return Path(line.split(maxsplit=5)[5])
    raise SystemExit(f"bench_tensor_cost: pid {pid} maps no libc10_cuda.so")


def _kind_counts(trace) -> dict:
    from memrec.terms.events import Kind

    kinds = trace.events["kind"]
    counts = {k.name: int((kinds == int(k)).sum()) for k in (Kind.TENSOR_ALLOC, Kind.TENSOR_FREE)}
    counts["torch_sites"] = sum(len(lib.get("attached") or ()) for lib in trace.header.get("torch") or ())
    counts["lost"] = trace.trailer.get("lost")  # events the daemon could not take from the ring
    if "stacks_read" in trace.trailer:
        counts["stacks_read"] = {k: v for k, v in trace.trailer["stacks_read"].items() if k != "interpreters"}
    return counts


def ratio_line(name: str, ratios: list[float]) -> str:
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return (f"  {name:12} median {statistics.median(ratios):.3f}x  (quartiles {q[0]:.3f}-{q[2]:.3f}, "
            f"range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--device", default="cuda", help="torch device of the workloads (default cuda)")
    parser.add_argument("--configs", default="none,plain,tensors",
                        help="configurations, comma-separated: none, plain, tensors, self, other, trap (default "
                             "none,plain,tensors)")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME=OPTIONS",
                        help="another configuration: the daemon with these options")
    parser.add_argument("--models", default="small,large",
                        help="transformers to step: small (d_model 256, 4 layers, batch 16 x 128: launch-bound), "
                             "large (d_model 1024, 6 layers, batch 16 x 512: GPU-bound); default both")
    parser.add_argument("--steps", type=int, default=30, help="small-model steps per measurement (default 30)")
    parser.add_argument("--large-steps", type=int, default=10, help="large-model steps per measurement (default 10)")
    parser.add_argument("--pairs", type=int, default=20_000, help="empty/del pairs per repeat (default 20000)")
    parser.add_argument("--loop-reps", type=int, default=5, help="loop repeats per measurement (default 5)")
    parser.add_argument("--cpu", type=int, default=-2,
                        help="pin the worker to this CPU and the daemon to the others (-1: no pinning; "
                             "default: the last CPU) so the two never share a core and the worker never migrates")
    parser.add_argument("--python", default=sys.executable, help="the Python of the worker and the daemon")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_tensor_cost: needs root (the daemon's BPF)", file=sys.stderr)
        return 1
    configs: dict[str, list[str] | None] = {}
    idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    for name in args.configs.split(","):
        configs[name] = {"none": None, "plain": [], "tensors": ["--tensors"], "self": ["--tensors-pid", "WORKER"],
                         "other": ["--tensors-pid", str(idle.pid)], "trap": None}[name]
    for extra in args.extra:
        name, _, options = extra.partition("=")
        configs[name] = shlex.split(options)
    if "none" not in configs:
        parser.error("the ratios need the 'none' configuration")

    all_cpus = os.sched_getaffinity(0)
    cpu = max(all_cpus) if args.cpu == -2 else args.cpu
    others = all_cpus - {cpu} if cpu >= 0 and len(all_cpus) > 1 else all_cpus
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="memrec-bench-") as tmp:
        sizes = args.models.split(",")
        worker = Worker(args.python, args.device, cpu, sizes)
        print(f"worker pid {worker.proc.pid}, torch {worker.torch}, device {args.device}; "
              f"{args.rounds} rounds of {', '.join(configs)}; worker on CPU {cpu}, daemon on {len(others)} others",
              flush=True)
        names = list(configs)
        try:
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]  # rotated: no config always first
                for name in order:
                    options = configs[name]
                    if options is not None:
                        options = [str(worker.proc.pid) if o == "WORKER" else o for o in options]
                    daemon = Daemon(args.python, options, Path(tmp), others) if options is not None else None
                    trap = NoopSites(torch_library(worker.proc.pid)) if name == "trap" else None
                    m = worker.measure({"small": args.steps, "large": args.large_steps}, args.pairs, args.loop_reps)
                    if trap is not None:
                        trap.close()
                    row = {"round": r, "config": name, **m}
                    if daemon is not None:
                        row["daemon_start_s"] = round(daemon.start_s, 2)
                        row.update(daemon.stop())
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            worker.close()
            idle.stdin.close()
            idle.wait()
            if args.json and (Path(tmp) / "daemon.log").exists():  # the daemons' logs, beside the measurements
                shutil.copy(Path(tmp) / "daemon.log", Path(args.json).with_suffix(".daemon.log"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    by = {(row["round"], row["config"]): row for row in rows}
    print(f"\nratios against 'none' of the same round (torch {worker.torch}, {args.device}):")
    metrics = [(f"{size}_ms", f"{size} transformer step") for size in sizes] + [
        (f"{size}_cpu_ms", f"{size} transformer step, CPU time of the process (all its threads)") for size in sizes] + [
        ("loop_ns", "torch.empty(256)/del pair")]
    for metric, label in metrics:
        print(f"{label}: none median {statistics.median(by[r, 'none'][metric] for r in range(args.rounds)):.1f} "
              f"{metric[-2:]}")
        for name in (n for n in names if n != "none"):
            print(ratio_line(name, [by[r, name][metric] / by[r, "none"][metric] for r in range(args.rounds)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
