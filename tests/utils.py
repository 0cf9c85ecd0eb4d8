"""Helpers for tests: build event arrays by hand.

    events(
        ev(Kind.ALLOC, pid=1, ptr=0x1000, size=MiB, gpu=0),
        ev(Kind.FREE, pid=1, ptr=0x1000),
    )
"""

from __future__ import annotations

import numpy as np

from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.columns import empty_events
from memrec.terms.events import API_KIND
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import IPC_HANDLE_SIZE
from memrec.terms.events import Api
from memrec.terms.events import Kind

KiB = 2**10
MiB = 2**20
GiB = 2**30

#: The Api an event of each kind gets when a test does not name one (the first in API_KIND).
DEFAULT_API: dict[Kind, Api] = {}
for _api, _kind in API_KIND.items():
    DEFAULT_API.setdefault(_kind, _api)


def handle_bytes(n: int) -> bytes:
    """64 distinct, deterministic IPC/fabric handle bytes for ``n``."""
    return bytes((n + i) % 256 for i in range(IPC_HANDLE_SIZE))


def ev(kind: Kind, api: Api | None = None, **fields) -> np.void:
    """One EVENT_DTYPE row: ``ordinal``/``gpu`` default to -1, ``api`` to the kind's usual one.

    ``ipc=<bytes>`` (up to 64) also sets FLAG_IPC_BYTES.
    """
    row = empty_events(1)
    row["kind"] = int(kind)
    row["api"] = int(api if api is not None else DEFAULT_API.get(kind, Api.NONE))
    ipc = fields.pop("ipc", None)
    if ipc is not None:
        row["ipc"] = np.void(bytes(ipc).ljust(IPC_HANDLE_SIZE, b"\0"))
        row["flags"] |= FLAG_IPC_BYTES
    for key, value in fields.items():
        row[key] = value
    return row[0]


def events(*rows: np.void, step: int = 1000) -> np.ndarray:
    """An EVENT_DTYPE array of ``rows``; a row without ``ts`` gets the previous one's + ``step``."""
    out = np.zeros(len(rows), dtype=EVENT_DTYPE)
    ts = 0
    for i, row in enumerate(rows):
        out[i] = row
        if out["ts"][i] == 0:
            out["ts"][i] = ts + step
        ts = int(out["ts"][i])
    return out


def v1_wire(kind: str, rows: np.ndarray) -> dict:
    """A columnar record in format 1's wire form (one raw byte string per column, the ``ipc``
    column sparse): what memrec 0.1 wrote, for the tests that read format 1."""
    from memrec.trace.chunks import SPARSE_FLAGS

    names = [n for n in rows.dtype.names if n != "ipc"]
    wire = {"type": kind, "n": len(rows), "columns": {n: np.ascontiguousarray(rows[n]).tobytes() for n in names}}
    if kind == "events":
        index = np.flatnonzero(rows["flags"] & SPARSE_FLAGS).astype("<u4")
        wire["ipc_index"] = index.tobytes()
        wire["ipc"] = rows["ipc"][index].tobytes()
    return wire


def write_tensor_trace(path, blocks: list[tuple[int, int]], segment: int = 0x7F0000000000,
                       segment_size: int = 20 * MiB, pid: int = 7) -> object:
    """A trace as ``memrec daemon --tensors`` writes it: one process on GPU 0 with one driver
    segment and tensor blocks ``(offset in the segment, size)``; a negative size frees the block
    at that offset. Returns the path."""
    from memrec.terms.events import GpuInfo
    from memrec.terms.events import ProcessInfo
    from memrec.trace import format as fmt
    from memrec.trace.writer import TraceWriter

    header = fmt.make_header(host="h", boot_id="b", anchor={"monotonic_ns": 1_000, "wall_ns": 0},
                             gpus=[GpuInfo(0, "GPU-0", "NVIDIA H200", 140 << 30)])
    w = TraceWriter(path, header)
    w.write_process(ProcessInfo(pid, 1, ["python3", "train.py"], None, None, [0], 1_000))
    rows = [ev(Kind.ALLOC, pid=pid, ptr=segment, size=segment_size, gpu=0, ordinal=0)]
    for offset, size in blocks:
        if size < 0:
            rows.append(ev(Kind.TENSOR_FREE, pid=pid, ptr=segment + offset))
        else:
            rows.append(ev(Kind.TENSOR_ALLOC, pid=pid, ptr=segment + offset, size=size, gpu=0, ordinal=0))
    w.write_events(events(*rows))
    w.close()
    return path
