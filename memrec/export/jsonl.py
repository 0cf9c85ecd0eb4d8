"""JSON lines of a trace, one object per record (what ``memrec dump`` prints).

Kept apart from the command so that the command line itself (``memrec --help``) does not import
numpy and the trace reader.
"""

from __future__ import annotations

import json
from typing import Any
from typing import Callable
from typing import Iterator
from typing import TextIO

import numpy as np

from memrec.base.jsontext import strict
from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import FLAG_NAME
from memrec.terms.events import Marker
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.terms.events import cu_result_name
from memrec.export.jsonl_fast import EVENT_FIELDS
from memrec.export.jsonl_fast import format_lines
from memrec.trace.chunks import EVENTS
from memrec.trace.chunks import NVML
from memrec.trace.chunks import PROCMEM
from memrec.trace.chunks import ColumnChunk
from memrec.trace.format import KEYFRAME
from memrec.trace.format import MARKER
from memrec.trace.format import marker_record
from memrec.trace.format import packb
from memrec.trace.reader import TraceReader

_KIND_NAMES = {int(k): k.name for k in Kind}
_EVENT_COLUMNS = [name for name in EVENT_DTYPE.names if name != "ipc"]
_API_NAMES = {int(a): a.name for a in Api}


def _kind_name(number: int) -> str:
    return _KIND_NAMES.get(number) or f"KIND_{number}"


def _api_name(number: int) -> str:
    return _API_NAMES.get(number) or f"API_{number}"


#: Values :func:`jsonable` gives back as they are (not looked at again: a marker record's fields).
_PLAIN = frozenset((str, int, float, bool, type(None)))


def jsonable(obj: Any) -> Any:
    """``obj`` with bytes as ``0x`` hex strings, numpy values as Python ones, map keys as str."""
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): v if type(v) in _PLAIN else jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [v if type(v) in _PLAIN else jsonable(v) for v in obj]
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return "0x" + bytes(obj).hex()
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return jsonable(obj.item())
    return obj


def event_lines(events: np.ndarray, with_stack: bool | None = None) -> Iterator[dict]:
    """One dict per event, in the order of ``events`` (EVENT_DTYPE); ``stack`` (its id, format
    2.3) last when ``with_stack`` (None: when an event of ``events`` has one)."""
    cols = {name: events[name].tolist() for name in events.dtype.names if name != "ipc"}
    if with_stack is None:
        with_stack = bool(events["stack"].any())
    ipc_rows = set(np.flatnonzero(events["flags"] & FLAG_IPC_BYTES).tolist())
    name_rows = set(np.flatnonzero(events["flags"] & FLAG_NAME).tolist())
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
        if with_stack:
            line["stack"] = cols["stack"][i]
        if i in ipc_rows:
            line["ipc"] = events["ipc"][i].tobytes().hex()
        if i in name_rows:  # a file or kernel name (code loads), cut at 63 bytes
            line["name"] = events["ipc"][i].tobytes().split(b"\0", 1)[0].decode("utf-8", "replace")
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


def event_text(chunk: ColumnChunk, encode: Callable[[Any], str]) -> bytes:
    """The dump lines of one events chunk (UTF-8), built a chunk at a time (:mod:`.jsonl_fast`);
    the few rows with handle bytes or a name go through :func:`event_lines`. A chunk with a stack
    (format 2.3) gives every line its ``stack`` id; a chunk without, none (the lines 2.2 printed)."""
    columns = {name: chunk.column(name) for name in _EVENT_COLUMNS}
    with_stack = bool(columns["stack"].any())
    fields = EVENT_FIELDS + [("stack", "stack", "d")] if with_stack else EVENT_FIELDS
    special = np.flatnonzero(columns["flags"] & (FLAG_IPC_BYTES | FLAG_NAME))
    names = {"kind": _kind_name, "api": _api_name, "result": cu_result_name}
    parts = []
    start = 0
    for row in [*special.tolist(), chunk.n]:
        if row > start:
            run = {name: col[start:row] for name, col in columns.items()}
            parts.append(format_lines(run, fields, '"type": "event", ', names, encode))
        if row < chunk.n:
            rows = np.zeros(1, dtype=EVENT_DTYPE)
            for name, col in columns.items():
                rows[name] = col[row]
            if chunk.ipc_index is not None:
                at = np.flatnonzero(chunk.ipc_index == row)
                if len(at):
                    rows["ipc"] = chunk.ipc[at[0]]
            parts.append((encode(next(event_lines(rows, with_stack))) + "\n").encode())
        start = row + 1
    return b"".join(parts)


#: A marker record's keys as the writer writes them (:func:`memrec.trace.format.marker_record`).
_MARKER_RECORD_KEYS = tuple(marker_record(Marker(0, 0, 0, 0, "", "begin")))


def _marker_line(m: Marker) -> str:
    """The dump's line of a marker record of the writer's keys, in its order, without values: what
    ``encode(jsonable(record))`` writes for it (its fields checked: ints, strings, a GPU or nil),
    without a JSON encoder made for each of a step loop's 50,000 records."""
    gpu = "null" if m.gpu is None else m.gpu
    return (f'{{"type": "{MARKER}", "ts": {m.ts}, "pid": {m.pid}, "uid": {m.uid}, "tid": {m.tid}, '
            f'"name": {_string(m.name)}, "phase": {_string(m.phase)}, "gpu": {gpu}, "values": {{}}}}\n')


#: A string as JSON, as the dump's encoder writes it (``ensure_ascii=False``).
_string = json.encoder.encode_basestring


def dump_trace(reader: TraceReader, out: TextIO) -> None:
    """Write the header and every usable record of ``reader`` to ``out``, one JSON object per line.

    Records are checked as every reader checks them (:meth:`TraceReader.entries`): a malformed one
    is left out and counted in the reader's warnings.
    """
    encode = strict(json.JSONEncoder(separators=(", ", ": "), ensure_ascii=False, allow_nan=False).encode)
    out.write(encode(jsonable(reader.header)) + "\n")
    binary = getattr(out, "buffer", None)  # a file's bytes: the event text is UTF-8 already
    if binary is not None and (getattr(out, "encoding", "") or "").lower().replace("-", "") != "utf8":
        binary = None
    for kind, item, rec in reader.entries():
        if kind == EVENTS:
            text = event_text(item, encode)
            if binary is not None:
                out.flush()
                binary.write(text)
            else:
                out.write(text.decode())
        elif kind in (NVML, PROCMEM):
            out.write("".join(encode(line) + "\n" for line in sample_lines(kind, item.to_array())))
        elif kind == KEYFRAME:
            line = keyframe_line({"ts": item.ts, "event_index": item.event_index, "state": item.state})
            out.write(encode(jsonable(line)) + "\n")
        elif kind == MARKER and tuple(rec) == _MARKER_RECORD_KEYS and not rec["values"]:
            out.write(_marker_line(item))
        else:
            out.write(encode(jsonable(rec)) + "\n")
