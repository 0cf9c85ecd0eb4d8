"""JSON lines of a trace, one object per record (what ``memrec dump`` prints).

Kept apart from the command so that the command line itself (``memrec --help``) does not import
numpy and the trace reader.
"""

from __future__ import annotations

import json
from typing import Any
from typing import Iterator
from typing import TextIO

import numpy as np

from memrec.events import cu_result_name
from memrec.events import FLAG_IPC_BYTES
from memrec.events import Api
from memrec.events import Kind
from memrec.trace.format import EVENTS
from memrec.trace.format import KEYFRAME
from memrec.trace.format import NVML
from memrec.trace.format import PROCMEM
from memrec.trace.format import packb
from memrec.trace.reader import TraceReader

_KIND_NAMES = {int(k): k.name for k in Kind}
_API_NAMES = {int(a): a.name for a in Api}


def _kind_name(number: int) -> str:
    return _KIND_NAMES.get(number) or f"KIND_{number}"


def _api_name(number: int) -> str:
    return _API_NAMES.get(number) or f"API_{number}"


def jsonable(obj: Any) -> Any:
    """``obj`` with bytes as ``0x`` hex strings, numpy values as Python ones, map keys as str."""
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return "0x" + bytes(obj).hex()
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return jsonable(obj.item())
    return obj


def event_lines(events: np.ndarray) -> Iterator[dict]:
    """One dict per event, in the order of ``events`` (EVENT_DTYPE)."""
    cols = {name: events[name].tolist() for name in events.dtype.names if name != "ipc"}
    ipc_rows = set(np.flatnonzero(events["flags"] & FLAG_IPC_BYTES).tolist())
    for i in range(len(events)):
        line = {
            "type": "event",
            "kind": _kind_name(cols["kind"][i]),
            "api": _api_name(cols["api"][i]),
            "ts": cols["ts"][i],
            "pid": cols["pid"][i],
            "tid": cols["tid"][i],
            "gpu": cols["gpu"][i],
            "ordinal": cols["ordinal"][i],
            "ptr": f"0x{cols['ptr'][i]:x}",
            "size": cols["size"][i],
            "handle": f"0x{cols['handle'][i]:x}",
            "aux": cols["aux"][i],
            "flags": cols["flags"][i],
            "result": cols["result"][i],
            "result_name": cu_result_name(cols["result"][i]),
        }
        if i in ipc_rows:
            line["ipc"] = events["ipc"][i].tobytes().hex()
        yield line


def sample_lines(kind: str, samples: np.ndarray) -> Iterator[dict]:
    """One dict per NVML or procmem sample."""
    cols = {name: samples[name].tolist() for name in samples.dtype.names}
    for i in range(len(samples)):
        yield {"type": kind, **{name: col[i] for name, col in cols.items()}}


def keyframe_line(rec: dict) -> dict:
    """A keyframe, summarised: its ts, event_index, encoded size and the size of each state entry."""
    state = rec.get("state")
    sizes = {}
    if isinstance(state, dict):
        for key, value in state.items():
            sizes[str(key)] = len(value) if isinstance(value, (dict, list, str, bytes)) else None
    return {
        "type": KEYFRAME,
        "ts": rec.get("ts"),
        "event_index": rec.get("event_index"),
        "state_bytes": len(packb(state)),
        "sizes": sizes,
    }


def record_lines(rec: dict) -> Iterator[dict]:
    """The dump lines of one decoded record."""
    kind = rec["type"]
    if kind == EVENTS:
        yield from event_lines(rec["events"])
    elif kind in (NVML, PROCMEM):
        yield from sample_lines(kind, rec["samples"])
    elif kind == KEYFRAME:
        yield jsonable(keyframe_line(rec))
    else:
        yield jsonable(rec)


def dump_trace(reader: TraceReader, out: TextIO) -> None:
    """Write the header and every record of ``reader`` to ``out``, one JSON object per line."""
    encode = json.JSONEncoder(separators=(", ", ": "), ensure_ascii=False).encode
    out.write(encode(jsonable(reader.header)) + "\n")
    for rec in reader:
        out.write("".join(encode(line) + "\n" for line in record_lines(rec)))
