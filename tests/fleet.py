"""Traces of a serving fleet, made with the real writer: the dataset tests' and bench's input.

One trace is one host's SGLang server for a day (or a part of one): a launcher process and its
TP schedulers (children), each scheduler's phases as the hooks mark them (``load_weights``,
``kv_pool``, ``cuda_graph_capture``, with ``tp_rank`` and ``sglang_version``), the allocations
inside them, then a day of activation churn (allocate, free), NVML device and process samples,
and, when asked, a failed allocation (out of memory) while the others hold their memory. The
sizes depend on the SGLang release (``KV_GIB``), so the phase-growth question has an answer that
the tests know in advance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.columns import empty_events
from memrec.terms.events import Api
from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace import format as fmt
from memrec.trace.writer import TraceWriter

GiB = 1 << 30
MiB = 1 << 20
S = 10**9
#: A day's midnight, UTC (2025-11-30), as wall-clock ns.
DAY0_WALL = 1_764_460_800 * S
#: The KV pool of each release, per rank (0.5.21 takes 2 GiB more: the growth the query finds).
KV_GIB = {"0.5.20": 60, "0.5.21": 62}
WEIGHTS_GIB = 16
GRAPH_MIB = 512
OOM_SIZE = 40 * GiB
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


@dataclass(frozen=True)
class Host:
    """One host of the fleet and what its trace holds."""

    index: int
    sglang_version: str = "0.5.21"
    tp: int = 2
    oom: bool = False
    churn: int = 2000  # activation allocate/free pairs per rank over the day
    part: int = 0  # a later part of the recording (rotated) holds the day's churn only
    day: int = 0  # days after DAY0_WALL

    @property
    def name(self) -> str:
        return f"node-{self.index:04d}"

    @property
    def launcher(self) -> int:
        return 1000 + 10 * self.index % 30000

    def rank_pid(self, r: int) -> int:
        return self.launcher + 1 + r


def write_host(path: Path, host: Host) -> Path:
    """Write ``host``'s trace to ``path`` with the real writer; return ``path``."""
    mono0 = (1000 + host.index) * S  # each host booted at another time
    wall0 = DAY0_WALL + host.day * 86400 * S + (host.index % 60) * S
    gpus = [GpuInfo(g, f"GPU-{host.index:04d}{g:04d}-0000-0000-0000-000000000000", "NVIDIA H200", 140 * GiB, None)
            for g in range(host.tp)]
    header = fmt.make_header(
        host=host.name, boot_id=f"{host.index:08x}-0000-0000-0000-000000000000",
        anchor={"monotonic_ns": mono0, "wall_ns": wall0}, gpus=gpus,
        daemon={"pid": 77, "version": "bench", "part": host.part, "opened_by": "start"},
        recording_id=f"{host.index:08x}{host.day:08x}",
    )
    day_ns = 86400 * S - 120 * S
    rows, markers = [], []
    ptr = [0x7F0000000000 + r * 0x10000000000 for r in range(host.tp)]

    def alloc(r: int, ts: int, size: int, result: int = 0) -> None:
        rows.append((ts, host.rank_pid(r), int(Kind.ALLOC), int(Api.cuMemAlloc_v2), result, r, size,
                     0 if result else ptr[r]))
        if not result:
            ptr[r] += size

    def mark(r: int, ts: int, name: str, phase: str) -> None:
        markers.append(Marker(ts, host.rank_pid(r), 0, host.rank_pid(r), name, phase, r,
                              {"tp_rank": r, "sglang_version": host.sglang_version}))

    for r in range(host.tp if host.part == 0 else 0):  # a later part goes on serving
        t = mono0 + S
        mark(r, t, "load_weights", "begin")
        for i in range(8):
            alloc(r, t + (i + 1) * 1000, WEIGHTS_GIB * GiB // 8)
        mark(r, t + 10_000, "load_weights", "end")
        mark(r, t + 20_000, "kv_pool", "begin")
        alloc(r, t + 21_000, KV_GIB[host.sglang_version] * GiB)
        mark(r, t + 30_000, "kv_pool", "end")
        mark(r, t + 40_000, "cuda_graph_capture", "begin")
        for i in range(4):
            alloc(r, t + 41_000 + i * 1000, GRAPH_MIB * MiB // 4)
        mark(r, t + 50_000, "cuda_graph_capture", "end")
    ev = empty_events(len(rows))
    for name, values in zip(("ts", "pid", "kind", "api", "result", "gpu", "size", "ptr"), zip(*rows)):
        ev[name] = values
    ev["tid"], ev["ordinal"] = ev["pid"], ev["gpu"]
    parts = [ev]
    rng = np.random.default_rng(host.index)
    for r in range(host.tp):  # the day's activations: allocate, then free a little later
        n = host.churn
        churn = empty_events(2 * n)
        ts = np.sort(rng.integers(mono0 + 60 * S, mono0 + day_ns, n))
        churn["ts"][0::2], churn["ts"][1::2] = ts, ts + 1000
        churn["kind"][0::2], churn["kind"][1::2] = int(Kind.ALLOC), int(Kind.FREE)
        churn["api"][0::2], churn["api"][1::2] = int(Api.cuMemAlloc_v2), int(Api.cuMemFree_v2)
        churn["size"][0::2] = rng.integers(1, 64, n) * 2 * MiB
        churn["ptr"][0::2] = churn["ptr"][1::2] = 0x7E0000000000 + r * 0x1000000000 + np.arange(n) * 0x10000000
        churn["pid"] = churn["tid"] = host.rank_pid(r)
        churn["gpu"] = churn["ordinal"] = r
        parts.append(churn)
    if host.oom:
        oom = empty_events(1)
        oom["ts"], oom["pid"], oom["tid"] = mono0 + day_ns + S, host.rank_pid(0), host.rank_pid(0)
        oom["kind"], oom["api"], oom["result"] = int(Kind.ALLOC), int(Api.cuMemAlloc_v2), OUT_OF_MEMORY
        oom["gpu"], oom["ordinal"], oom["size"] = 0, 0, OOM_SIZE
        parts.append(oom)
    events = np.concatenate(parts)
    events = events[np.argsort(events["ts"], kind="stable")]
    with TraceWriter(path, header) as w:
        launcher = ProcessInfo(host.launcher, 1, ["python3", "-m", "sglang.launch_server", "--tp", str(host.tp)],
                               "/usr/bin/python3", None, [], mono0)
        w.write_process(launcher)
        for r in range(host.tp):
            w.write_process(ProcessInfo(host.rank_pid(r), host.launcher, [f"sglang::scheduler_TP{r}"],
                                        "/usr/bin/python3", str(r), [r], mono0 + S // 2))
        for m in sorted(markers, key=lambda m: m.ts):
            w.write_marker(m)
        for lo in range(0, len(events), 100_000):
            w.write_events(events[lo : lo + 100_000])
        w.write_nvml(nvml_samples(host, mono0, day_ns))
        w.write_procmem(process_samples(host, mono0, day_ns))
    return path


def nvml_samples(host: Host, mono0: int, day_ns: int, every_s: int = 60) -> np.ndarray:
    """One device sample a minute per GPU: the serving footprint, steady."""
    ts = np.arange(mono0 + 60 * S, mono0 + day_ns, every_s * S, dtype=np.uint64)
    out = np.zeros(len(ts) * host.tp, dtype=NVML_DTYPE)
    held = (WEIGHTS_GIB + KV_GIB[host.sglang_version]) * GiB + GRAPH_MIB * MiB + 600 * MiB
    for r in range(host.tp):
        sl = slice(r * len(ts), (r + 1) * len(ts))
        out["ts"][sl], out["gpu"][sl] = ts, r
    out["used"], out["reserved"], out["total"] = held, 500 * MiB, 140 * GiB
    out["free"] = 140 * GiB - held - 500 * MiB
    out["bar1_used"], out["bar1_total"] = 8 * MiB, 256 * MiB
    return out[np.argsort(out["ts"], kind="stable")]


def process_samples(host: Host, mono0: int, day_ns: int, every_s: int = 300) -> np.ndarray:
    """One process sample every five minutes per rank."""
    ts = np.arange(mono0 + 60 * S, mono0 + day_ns, every_s * S, dtype=np.uint64)
    out = np.zeros(len(ts) * host.tp, dtype=PROCMEM_DTYPE)
    for r in range(host.tp):
        sl = slice(r * len(ts), (r + 1) * len(ts))
        out["ts"][sl], out["gpu"][sl], out["pid"][sl] = ts, r, host.rank_pid(r)
    out["used"] = (WEIGHTS_GIB + KV_GIB[host.sglang_version]) * GiB
    return out[np.argsort(out["ts"], kind="stable")]
