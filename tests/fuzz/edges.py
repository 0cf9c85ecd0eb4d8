"""Traces whose every field sits at an integer edge (issue 23, item 6): what each reader must survive.

A failed call at ts = 2^63 made ``report``, ``report --json`` and the TUI exit 70 (OverflowError in
``engine/phases.py``) from a 1,364-byte file. :func:`edge_traces` builds, for every column of
every columnar record type and every edge value its dtype holds (0, 1, the largest, the
smallest, 2^31, 2^32, 2^63 - 1, 2^63, 2^64 - 1, as the dtype's bits), one trace in which one row of
every event kind carries that value, among ordinary allocations, markers, processes and a
keyframe; :func:`record_edges` does the same for the fields of markers, processes, lost totals,
keyframes and the trailer. ``tests/unit/test_edges.py`` reads a sample of them with every
command; ``bench/reliability.py edges`` reads all of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.trace import format as fmt

#: Edge values as Python ints; each is stored as the column's bits (so -1 in a u8 is 2^64 - 1, and a
#: trace is named by the first value of this list that gives its bits).
EDGES = (0, 1, -1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)
GiB = 2**30
MiB = 2**20


def _bits(value: int, dtype: np.dtype) -> np.ndarray:
    """``value`` modulo 2^(8·itemsize) as one element of ``dtype``."""
    unsigned = np.dtype(f"<u{dtype.itemsize}")
    return np.array(value % (1 << (8 * dtype.itemsize)), dtype=unsigned).view(dtype)


def _edges_of(dtype: np.dtype) -> list[int]:
    """The distinct edge values a column of ``dtype`` can hold (as its bits)."""
    seen: dict[int, int] = {}
    for value in EDGES:
        seen.setdefault(int(_bits(value, dtype)), value)
    return sorted(seen.values(), key=lambda v: (v < 0, v))


def header() -> dict:
    return fmt.make_header(host="h", boot_id="b", anchor={"monotonic_ns": 0, "wall_ns": 0},
                           gpus=[GpuInfo(0, "GPU-0", "NVIDIA H200", 140 * GiB)])


def base_events(n_kinds_row: int = 0) -> np.ndarray:
    """Ordinary events: two allocations and a free on GPU 0, then one row of every kind."""
    kinds = [int(k) for k in Kind]
    out = np.zeros(3 + len(kinds), EVENT_DTYPE)
    out["ordinal"] = 0
    out["gpu"] = 0
    out["pid"] = out["tid"] = 7
    out["ts"] = np.arange(1, len(out) + 1) * 1000
    out[:3]["kind"] = [int(Kind.ALLOC), int(Kind.ALLOC), int(Kind.FREE)]
    out[:3]["ptr"] = [0x1000, 0x2000, 0x1000]
    out[:3]["size"] = [MiB, 2 * MiB, 0]
    out[3:]["kind"] = kinds
    out[3:]["ptr"] = 0x100000 + np.arange(len(kinds)) * 0x1000
    out[3:]["size"] = MiB
    out[3:]["result"] = np.where(np.arange(len(kinds)) % 2 == 0, 0, 2)  # every other one a failed call
    return out


def base_records() -> list[dict]:
    """The other record types, ordinary: NVML and per-process samples, markers, a process, lost."""
    nv = np.zeros(2, NVML_DTYPE)
    nv["ts"] = [500, 40_000]
    nv["used"] = [GiB, 2 * GiB]
    nv["total"] = 140 * GiB
    nv["free"] = nv["total"] - nv["used"]
    pm = np.zeros(2, PROCMEM_DTYPE)
    pm["ts"] = [500, 40_000]
    pm["pid"] = 7
    pm["used"] = [MiB, 3 * MiB]
    return [
        {"type": "nvml", "samples": nv},
        {"type": "procmem", "samples": pm},
        {"type": "process", "pid": 7, "ppid": 1, "cmdline": ["python", "serve.py"], "exe": "/usr/bin/python",
         "cuda_visible_devices": None, "gpu_map": [0], "first_ts": 1, "rank": {"rank": 0}},
        {"type": "marker", "ts": 1500, "pid": 7, "uid": 0, "tid": 7, "name": "load", "phase": "begin", "gpu": 0,
         "values": {"step": 1}},
        {"type": "marker", "ts": 30_000, "pid": 7, "uid": 0, "tid": 7, "name": "load", "phase": "end", "gpu": 0,
         "values": {}},
        {"type": "lost", "ts": 30_000, "total": 0},
    ]


def pack(records: list[dict]) -> bytes:
    return b"".join(fmt.encode_record(r) if r.get("type") != "header" else fmt.packb(r) for r in [header(), *records])


def column_edges() -> Iterator[tuple[str, bytes]]:
    """``(name, file bytes)``: one trace per column of every columnar type and each of its edges."""
    for kind, dtype, key in (("events", EVENT_DTYPE, "events"), ("nvml", NVML_DTYPE, "samples"),
                             ("procmem", PROCMEM_DTYPE, "samples")):
        for column in dtype.names:
            if column == "ipc":
                continue
            for value in _edges_of(dtype.fields[column][0]):
                records = base_records()
                ev = base_events()
                if kind == "events":
                    ev[3:][column] = _bits(value, dtype.fields[column][0])  # every kind, failed calls too
                else:
                    rec = next(r for r in records if r["type"] == kind)
                    rec[key][column][1] = _bits(value, dtype.fields[column][0])
                yield f"{kind}.{column}={value}", pack([{"type": "events", "events": ev}, *records])


def record_edges() -> Iterator[tuple[str, bytes]]:
    """``(name, file bytes)``: one trace per integer field of the other record types and each edge
    (the values msgpack can carry: -2^63 .. 2^64 - 1)."""
    fields = {"marker": ("ts", "pid", "uid", "tid", "gpu"), "process": ("pid", "ppid", "first_ts"),
              "lost": ("ts", "total"), "keyframe": ("ts", "event_index"), "trailer": ("end_ts", "lost")}
    for kind, names in fields.items():
        for name in names:
            for value in (*EDGES[:3], 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)):
                records = base_records()
                ev = base_events()
                extra: list[dict] = []
                if kind == "keyframe":
                    extra.append({"type": "keyframe", "ts": 2000, "event_index": 2, "state": _state(), name: value})
                elif kind == "trailer":
                    extra.append({"type": "trailer", "end_ts": 50_000, "lost": 0, "counts": {"events": len(ev)},
                                  name: value})
                else:
                    rec = next(r for r in records if r["type"] == kind)
                    rec[name] = value
                yield f"{kind}.{name}={value}", pack([{"type": "events", "events": ev}, *records, *extra])


def _state() -> dict:
    """A real keyframe state after the first two events of :func:`base_events`."""
    from memrec.state import LiveState

    s = LiveState()
    s.apply(base_events()[:2].copy())
    return s.snapshot()


def write_all(folder: Path) -> list[Path]:
    """Every edge trace as a file in ``folder``; returns the paths."""
    out = []
    for i, (name, data) in enumerate([*column_edges(), *record_edges()]):
        path = folder / f"{i:03d}-{name.replace('/', '_')}.mrec"
        path.write_bytes(data)
        out.append(path)
    return out
