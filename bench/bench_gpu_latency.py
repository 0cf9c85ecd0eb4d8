"""Added latency per traced driver call on a GPU host, and the NVML sampler's CPU cost.

Run as root on a GPU host with bcc importable:  python bench/bench_gpu_latency.py [--pairs N]
In one run it times cuMemAlloc_v2 + cuMemFree_v2 pairs (1 MiB, through cuda-python) in three
phases, interleaved over several rounds: no probes (the floor), a no-op BPF program on entry and
return of both symbols (the cost of a uprobe hit alone on this machine), and memrec's daemon. It then
runs the NVML sampler at 10 Hz device / 1 Hz process for 10 s and reports its CPU time. Prints
one JSON document (the validation page quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

MiB = 2**20


def _driver():
    from cuda.bindings import driver

    driver.cuInit(0)
    _, dev = driver.cuDeviceGet(0)
    _, ctx = driver.cuDevicePrimaryCtxRetain(dev)
    driver.cuCtxSetCurrent(ctx)
    return driver


def time_pairs(cu, pairs: int) -> dict:
    """Median and mean ns of one alloc+free pair (after a warm-up)."""
    for _ in range(200):
        _, p = cu.cuMemAlloc(MiB)
        cu.cuMemFree(p)
    samples = []
    for _ in range(pairs):
        t0 = time.perf_counter_ns()
        _, p = cu.cuMemAlloc(MiB)
        cu.cuMemFree(p)
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return {"median_ns": samples[len(samples) // 2], "mean_ns": sum(samples) // len(samples), "pairs": pairs}


def libcuda_path() -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcuda.so" in line:
                return line.split()[-1]
    raise SystemExit("libcuda.so not mapped")


def with_noop_probes(cu, pairs: int) -> dict:
    from memrec.probes.loader import NoopProbes

    probes = NoopProbes(libcuda_path(), ["cuMemAlloc_v2", "cuMemFree_v2"])
    try:
        return time_pairs(cu, pairs)
    finally:
        probes.close()


def with_daemon(cu, pairs: int) -> dict:
    tmp = tempfile.mkdtemp()
    sock = os.path.join(tmp, "memrec.sock")
    proc = subprocess.Popen([sys.executable, "-m", "memrec", "daemon", "-o", tmp, "--socket", sock])
    from memrec.subscriber import wait_for_daemon

    wait_for_daemon(sock, timeout=120)
    try:
        result = time_pairs(cu, pairs)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    return result


def nvml_cpu(seconds: float = 10.0) -> dict:
    from memrec.probes.nvml import NvmlSampler

    rows = {"device": 0, "process": 0}

    def sink(device, process):
        rows["device"] += len(device)
        rows["process"] += len(process)

    idle0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    idle1 = resource.getrusage(resource.RUSAGE_SELF)
    sampler = NvmlSampler(sink, device_hz=10.0, process_hz=1.0)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    idle = (idle1.ru_utime + idle1.ru_stime) - (idle0.ru_utime + idle0.ru_stime)
    return {
        "seconds": seconds,
        "cpu_seconds": round(cpu, 4),
        "idle_cpu_seconds": round(idle, 4),
        "cpu_percent_of_one_core": round(100 * (cpu - idle) / seconds, 3),
        "device_rows": rows["device"],
        "process_rows": rows["process"],
    }


def _median(values: list[int]) -> int:
    values = sorted(values)
    return values[len(values) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000, help="alloc+free pairs per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each phase, interleaved")
    args = parser.parse_args()
    cu = _driver()
    # Rounds alternate (floor, no-op, floor, memrec, ...) so drift in the driver's own speed
    # lands on every phase alike; each phase's figure is the median of its round medians.
    rounds: dict[str, list[int]] = {"floor": [], "noop_uprobes": [], "memrec_daemon": []}
    for _ in range(args.rounds):
        rounds["floor"].append(time_pairs(cu, args.pairs)["median_ns"])
        rounds["noop_uprobes"].append(with_noop_probes(cu, args.pairs)["median_ns"])
        rounds["floor"].append(time_pairs(cu, args.pairs)["median_ns"])
        rounds["memrec_daemon"].append(with_daemon(cu, args.pairs)["median_ns"])
    out = {"pairs_per_round": args.pairs, "rounds": rounds}
    floor = _median(rounds["floor"])
    out["median_ns_per_pair"] = {name: _median(values) for name, values in rounds.items()}
    out["per_pair_added_ns"] = {
        name: _median(values) - floor for name, values in rounds.items() if name != "floor"
    }
    out["ratio_to_floor"] = {
        name: round(_median(values) / floor, 3) for name, values in rounds.items() if name != "floor"
    }
    noop = _median(rounds["noop_uprobes"])
    out["memrec_over_noop_uprobes"] = round(_median(rounds["memrec_daemon"]) / noop, 3)
    out["nvml_sampler"] = nvml_cpu()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
