"""Trace format v2: record types, column layouts, and msgpack encoding of one record.

A trace (``.mrec``) is a plain concatenation of msgpack objects, one per record (the full spec is
``docs/format.md``)::

    header  →  events | nvml | procmem | marker | process | lost | keyframe ...  →  trailer

Every record is a msgpack map with a ``"type"`` key. The header's first key is ``"magic"``. The
columnar records (``events``, ``nvml``, ``procmem``) hold the fields of
:data:`memrec.terms.columns.EVENT_DTYPE` / ``NVML_DTYPE`` / ``PROCMEM_DTYPE`` column by column
(:mod:`memrec.trace.chunks`): in format 2 as one Zstandard frame of delta / frame-of-reference
encoded columns (:mod:`memrec.trace.codec`), in format 1 (still read) as one little-endian byte
string per column.

Two forms of a record exist:

* the *logical* form, what writers take and readers give: a dict whose columnar payload is a numpy
  structured array (``rec["events"]`` or ``rec["samples"]``), every other record a plain dict;
* the *wire* form, what msgpack holds: the same dict with the array replaced by ``n`` and ``z``
  (format 2), or ``n``, ``columns`` and, for events, ``ipc_index`` / ``ipc`` (format 1).

:func:`encode_record` goes from logical to bytes and :func:`decode_record` from an unpacked wire
object back to logical. The trace writer, the reader and the live socket (``frames.py``) all go
through these two functions, so a live subscriber receives exactly the bytes the file holds.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import os
import re
import socket
import time
from typing import Any

import msgpack
import numpy as np

from memrec.base.errors import TraceFormatError
from memrec.base.untrusted import too_deep
from memrec.terms.events import MAX_CMDLINE_ARGS
from memrec.terms.events import GpuInfo
from memrec.terms.events import Marker
from memrec.terms.events import checked_marker
from memrec.terms.events import ProcessInfo
from memrec.trace import codec
from memrec.trace.budget import OverBudget
from memrec.trace.budget import ReadBudget
from memrec.trace.chunks import COLUMNAR
from memrec.trace.chunks import COLUMNAR_TYPE
from memrec.trace.chunks import DEFAULT_SCHEMA
from memrec.trace.chunks import EVENTS
from memrec.trace.chunks import NVML
from memrec.trace.chunks import PROCMEM
from memrec.trace.chunks import ROWS_KEY
from memrec.trace.chunks import Schema
from memrec.trace.chunks import decode_columns
from memrec.trace.chunks import rows_to_wire
from memrec.trace.clock import read_clock_sync
from memrec.trace.stacks import STACKS

#: The value of the header's first key, ``"magic"``.
MAGIC = "memrec-trace"
#: Major format version: a reader refuses a trace whose major version is newer than its own.
#: Version 2 compresses columnar records (:mod:`memrec.trace.codec`); version 1 files still read.
FORMAT_VERSION = 2
#: Minor format version: a newer minor only adds record types or fields, which older readers skip.
FORMAT_MINOR = 3
#: The clock of every ``ts`` in a trace (ns); the header's ``anchor`` ties it to wall-clock time.
CLOCK = "CLOCK_MONOTONIC"

# Record types (the value of every record's "type" key).
HEADER = "header"
MARKER = "marker"
PROCESS = "process"
LOST = "lost"
KEYFRAME = "keyframe"
TRAILER = "trailer"

#: Every record type the format defines (a reader skips any other type with a warning).
RECORD_TYPES = frozenset({HEADER, *COLUMNAR_TYPE, MARKER, PROCESS, LOST, KEYFRAME, STACKS, TRAILER})

_WIRE_KEYS = frozenset({"n", "columns", "ipc_index", "ipc", *codec.KEYS})
#: A format-2 keyframe's key for its state: one Zstandard frame of the msgpack map.
STATE_Z = "state_z"
#: The largest keyframe state a reader decompresses (a state of 1M live allocations: ~27 MiB).
MAX_STATE_SIZE = 1 << 30


# ---------------------------------------------------------------------------------------------
# msgpack


def _msgpack_default(obj: Any) -> Any:
    """Turn what msgpack cannot pack natively into what it can (numpy scalars, dataclasses...)."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in a trace record")


def packb(obj: Any) -> bytes:
    """msgpack-encode ``obj`` the way every trace record is encoded (bin type for bytes)."""
    return msgpack.packb(obj, use_bin_type=True, default=_msgpack_default)


def unpacker(max_buffer_size: int) -> msgpack.Unpacker:
    """Return a feed-mode Unpacker configured the way every trace reader must be."""
    return msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max_buffer_size)


def unpackb(data: bytes) -> Any:
    """Decode one msgpack object the way every trace reader does (str keys, any map key type)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---------------------------------------------------------------------------------------------
# header


def column_schema() -> dict[str, list[list[str]]]:
    """The header's ``columns`` entry: for each columnar type, ``[name, numpy dtype string]`` pairs."""
    return {
        kind: [[name, dtype.fields[name][0].str] for name in dtype.names] for kind, dtype in COLUMNAR.items()
    }


#: A column dtype a header may declare: byte order, kind (unsigned, signed, float, bool, raw), size.
_DTYPE_STR = re.compile(r"[<>|=]?[uifbV][1-9][0-9]{0,3}")


def parse_schema(header: dict) -> Schema:
    """Read the header's ``columns`` entry (the dtype the writer used for each column).

    Raises:
        TraceFormatError: the entry is malformed.
    """
    columns = header.get("columns")
    if columns is None:
        return DEFAULT_SCHEMA
    schema: Schema = dict(DEFAULT_SCHEMA)
    try:
        for kind, pairs in columns.items():
            schema[kind] = {}
            for name, dt in pairs:
                if not isinstance(name, str) or not isinstance(dt, str) or not _DTYPE_STR.fullmatch(dt):
                    raise ValueError(f"bad column {name!r}: {dt!r}")
                schema[kind][name] = np.dtype(dt)
    except (AttributeError, TypeError, ValueError) as error:
        raise TraceFormatError(f"malformed column schema in the header: {error}") from None
    for kind, target in COLUMNAR.items():
        for name, dtype in schema.get(kind, {}).items():
            if name not in target.names:
                continue
            want = target.fields[name][0]
            if dtype.hasobject or dtype.itemsize == 0 or not np.can_cast(dtype, want, casting="same_kind"):
                raise TraceFormatError(
                    f"malformed column schema in the header: {kind}.{name} is {dtype.str}, "
                    f"which cannot be read as {want.str}"
                )
    return schema


def read_boot_id() -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``): CLOCK_MONOTONIC is only comparable
    between traces of the same boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def clock_anchor() -> dict[str, int]:
    """One simultaneous reading of CLOCK_MONOTONIC and the wall clock (both ns)."""
    before = time.monotonic_ns()
    wall = time.time_ns()
    after = time.monotonic_ns()
    return {"monotonic_ns": (before + after) // 2, "wall_ns": wall}


def make_header(
    *,
    host: str | None = None,
    boot_id: str | None = None,
    gpus: list[GpuInfo] | list[dict] = (),  # type: ignore[assignment]
    probes: dict | None = None,
    config: dict | None = None,
    created_by: str | None = None,
    anchor: dict[str, int] | None = None,
    **extra: Any,
) -> dict:
    """Build a header with this host's defaults (host name, boot id, a clock anchor taken now).

    ``probes`` says what was attached and what was missing (e.g. ``{"attached": [...],
    "missing": [...], "libraries": [...]}``); ``config`` is the recorder's configuration. Both are
    free-form maps. Extra keyword arguments become extra header keys.
    """
    if created_by is None:
        from memrec.base.version import __version__

        created_by = f"memrec {__version__}"
    header = {
        "host": host if host is not None else socket.gethostname(),
        "boot_id": boot_id if boot_id is not None else read_boot_id(),
        "clock": CLOCK,
        "anchor": anchor if anchor is not None else clock_anchor(),
        "clock_sync": read_clock_sync(),  # the wall clock's error estimate (merging hosts needs it)
        "gpus": [gpu_dict(g) for g in gpus],
        "probes": probes if probes is not None else {},
        "config": config if config is not None else {},
        "created_by": created_by,
    }
    header.update(extra)
    return finalize_header(header)


def gpus_from_header(header: dict) -> list[GpuInfo]:
    """The header's GPU list as GpuInfo, leaving out entries a damaged file made unusable."""
    out = []
    entries = header.get("gpus")
    for g in entries if isinstance(entries, list) else ():
        if not isinstance(g, dict):
            continue
        fields = {f.name: g.get(f.name) for f in dataclasses.fields(GpuInfo)}
        if not (_int_in(_GPU)(fields["index"]) and _optional(_is(str))(fields["uuid"])
                and isinstance(fields["name"], str) and _int_in(_TS)(fields["total"])
                and _optional(_int_in(_TS))(fields["bar1_total"])
                and _optional(_int_in(_TS))(fields["resident_threads"])):
            continue
        out.append(GpuInfo(**fields))
    return out


def gpu_dict(gpu: GpuInfo | dict) -> dict:
    """A GpuInfo as the header stores it."""
    out = dataclasses.asdict(gpu) if isinstance(gpu, GpuInfo) else dict(gpu)
    if out.get("resident_threads", 0) is None:  # format 2.2's field, written only where NVML told it
        del out["resident_threads"]
    return out


def finalize_header(header: dict) -> dict:
    """Return ``header`` as a writer writes it: magic, version, minor and type first, then the
    caller's keys, with ``gpus`` as dicts, the clock and an anchor (taken now if missing), and the
    column schema. The caller's values for magic, version, minor, type and columns are replaced."""
    reserved = {"magic", "version", "minor", "type", "columns"}
    out: dict[str, Any] = {"magic": MAGIC, "version": FORMAT_VERSION, "minor": FORMAT_MINOR, "type": HEADER}
    for key, value in header.items():
        if key not in reserved:
            out[key] = value
    out["gpus"] = [gpu_dict(g) for g in out.get("gpus") or ()]
    out.setdefault("clock", CLOCK)
    if "anchor" not in out:
        out["anchor"] = clock_anchor()
    out["columns"] = column_schema()
    return out


def check_header(obj: Any, source: str = "input") -> dict:
    """Validate a decoded header record and return it.

    Raises:
        TraceFormatError: not a memrec header (bad magic), or a newer major format version.
    """
    if not isinstance(obj, dict) or obj.get("magic") != MAGIC:
        raise TraceFormatError(f"{source}: not a memrec trace (bad magic)")
    version = obj.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TraceFormatError(f"{source}: not a memrec trace (bad format version {version!r})")
    if version > FORMAT_VERSION:
        minor = obj.get("minor", 0)
        raise TraceFormatError(
            f"{source}: trace format version {version}.{minor} is newer than this memrec reads "
            f"(format version {FORMAT_VERSION}.{FORMAT_MINOR}); upgrade memrec to read it"
        )
    parse_schema(obj)
    return obj


def header_prefix_plausible(data: bytes) -> bool:
    """Whether ``data`` (the first bytes of a file) can be the start of a memrec header.

    Used to tell a trace cut inside its header (a file just created, or a crash) from a file that
    is not a trace at all: a header is a map whose first entry is ``"magic": MAGIC``.
    """
    if not data:
        return True
    first = data[0]
    if 0x80 <= first <= 0x8F:
        body = data[1:]
    elif first == 0xDE:
        body = data[3:]
    elif first == 0xDF:
        body = data[5:]
    else:
        return False
    expected = packb("magic") + packb(MAGIC)
    body = body[: len(expected)]
    return expected[: len(body)] == body


# ---------------------------------------------------------------------------------------------
# records


def encode_record(rec: dict) -> bytes:
    """Encode one logical record to the bytes a trace file (and a live subscriber) gets.

    Columnar records (``type`` events / nvml / procmem) carry their rows as a numpy structured
    array under ``"events"`` or ``"samples"``; every other record is packed as it is (numpy
    scalars, enums and dataclasses are converted). A record already in wire form (it has
    ``"columns"``) is packed as it is.

    Raises:
        ValueError: a columnar record without its rows, or rows of the wrong shape.
        TypeError: a value msgpack cannot encode.
    """
    kind = rec.get("type")
    if not isinstance(kind, str):
        raise ValueError("a record needs a string 'type'")
    if kind in COLUMNAR and "columns" not in rec and not any(key in rec for key in codec.KEYS):
        key = ROWS_KEY[kind]
        if key not in rec:
            raise ValueError(f"a {kind} record needs its rows under {key!r}")
        wire = rows_to_wire(kind, rec[key])
        for k, v in rec.items():
            if k not in (key, "type") and k not in _WIRE_KEYS:
                wire[k] = v
        return packb(wire)
    if kind == KEYFRAME and "state" in rec:
        # the state compresses several-fold (ids and sizes repeat): stored as one Zstandard frame
        wire = {k: v for k, v in rec.items() if k != "state"}
        wire[STATE_Z] = codec.compress(packb(rec["state"]))
        return packb(wire)
    return packb(rec)


def decode_record(obj: Any, schema: Schema | None = None, budget: ReadBudget | None = None) -> dict:
    """Turn one unpacked wire record into its logical form.

    Columnar records get their rows as a new structured array under ``"events"`` / ``"samples"``
    (built from zero-copy column views); other records are returned as they are.

    Raises:
        TraceFormatError: not a map with a string ``type``, or a malformed columnar record.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise TraceFormatError("malformed record: not a map with a string 'type'")
    kind = obj["type"]
    if kind == KEYFRAME:
        return expand_keyframe(obj, budget)
    if kind not in COLUMNAR_TYPE:
        return obj
    chunk = decode_columns(obj, schema, budget)
    rec = {k: v for k, v in obj.items() if k not in _WIRE_KEYS}
    rec["type"] = chunk.kind
    rec[ROWS_KEY[chunk.kind]] = chunk.to_array()
    return rec


@functools.cache
def _fields(cls: type) -> tuple[str, ...]:
    """The field names of a record's dataclass (looked up once: a trace has a record per marker)."""
    return tuple(f.name for f in dataclasses.fields(cls))


_U32 = (0, 2**32)
_TS = (0, 2**63)  # timestamps are u8 in the columns and int64 in the analysis
_GPU = (-(2**15), 2**15)


def _int_in(bounds: tuple[int, int]) -> Any:
    def check(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and bounds[0] <= value < bounds[1]

    check.__doc__ = f"an integer in [{bounds[0]}, {bounds[1]})"
    return check


def _optional(check: Any) -> Any:
    def optional(value: Any) -> bool:
        return value is None or check(value)

    optional.__doc__ = f"nil or {check.__doc__}"
    return optional


def _is(*types: type) -> Any:
    def check(value: Any) -> bool:
        return isinstance(value, types)

    check.__doc__ = " or ".join(t.__name__ for t in types)
    return check


def _list_of(check: Any, limit: int) -> Any:
    def list_of(value: Any) -> bool:
        return isinstance(value, list) and len(value) <= limit and all(check(v) for v in value)

    list_of.__doc__ = f"a list of {check.__doc__} (at most {limit})"
    return list_of


def _value_map(value: Any) -> bool:
    """a map with string keys, nested at most 8 deep"""
    return isinstance(value, dict) and all(isinstance(k, str) for k in value) and not too_deep(value, 8)


#: What each field of Marker / ProcessInfo must be for a record to be used: a damaged file must
#: not hand the analysis a value it cannot hold (a ts past int64, a cmdline of numbers, a map key
#: that is a list).
_FIELD_CHECKS: dict[type, dict[str, Any]] = {
    Marker: {"ts": _int_in(_TS), "pid": _int_in(_U32), "uid": _int_in(_U32), "tid": _int_in(_U32),
             "name": _is(str), "phase": _is(str), "gpu": _optional(_int_in(_GPU)), "values": _value_map},
    ProcessInfo: {"pid": _int_in(_U32), "ppid": _optional(_int_in(_U32)), "cmdline": _list_of(_is(str), MAX_CMDLINE_ARGS),
                  "exe": _optional(_is(str)), "cuda_visible_devices": _optional(_is(str)),
                  "gpu_map": _list_of(_int_in(_GPU), 1 << 12), "first_ts": _int_in(_TS), "rank": _value_map,
                  "gpu_map_source": _is(str)},
}


def _from_record(cls: type, rec: dict) -> Any:
    kwargs = {k: rec[k] for k in _fields(cls) if k in rec}
    for name, check in _FIELD_CHECKS[cls].items():
        if name in kwargs and not check(kwargs[name]):
            raise TraceFormatError(
                f"malformed {rec.get('type')} record: {name} is not {check.__doc__}"
            )
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise TraceFormatError(f"malformed {rec.get('type')} record: {error}") from None


def marker_record(marker: Marker) -> dict:
    """The logical record of a marker."""
    return {"type": MARKER, **{k: getattr(marker, k) for k in _fields(Marker)}}


def marker_from_record(rec: dict) -> Marker:
    """The Marker a marker record holds (unknown fields are ignored).

    A record of the writer's own shape takes the checks of :data:`_FIELD_CHECKS` inline
    (:func:`shallow_marker`); any other goes through :func:`_from_record`, which says what is wrong.
    """
    marker = shallow_marker(rec)
    return marker if marker is not None else _from_record(Marker, rec)


#: The keys of a marker record as the writer writes it: ``type`` and every field of Marker.
_MARKER_KEYS = 1 + len(dataclasses.fields(Marker))
_CONTAINER_TYPES = frozenset((list, tuple, dict))


def shallow_marker(rec: dict) -> Marker | None:
    """The Marker of a record of exactly the writer's shape whose values hold no container (the
    checks of :data:`_FIELD_CHECKS`, inline), else None: then :func:`marker_from_record` takes the
    general path, which names what is wrong.

    Such a record nests two levels at most, so a reader may skip its depth walk: what is left of
    reading a step loop's 50,000 marker records is their unpacking and these checks.
    """
    try:
        ts, pid, uid, tid, name, phase, gpu, values = _MARKER_FIELDS(rec)
    except KeyError:
        return None
    if (type(ts) is int and 0 <= ts < _TS_END and type(pid) is int and 0 <= pid < _U32_END
            and type(uid) is int and 0 <= uid < _U32_END and type(tid) is int and 0 <= tid < _U32_END
            and type(name) is str and type(phase) is str
            and (gpu is None or (type(gpu) is int and _GPU[0] <= gpu < _GPU[1]))
            and len(rec) == _MARKER_KEYS and type(values) is dict
            and (not values or (_CONTAINER_TYPES.isdisjoint(map(type, values.values()))
                                and all(type(k) is str for k in values)))):
        return checked_marker(ts, pid, uid, tid, name, phase, gpu, values)
    return None


#: A marker record's fields, in :class:`Marker`'s order (KeyError: one is missing).
_MARKER_FIELDS = operator.itemgetter(*(f.name for f in dataclasses.fields(Marker)))
_TS_END = 2**63
_U32_END = 2**32


def process_record(process: ProcessInfo) -> dict:
    """The logical record of a process."""
    return {"type": PROCESS, **{k: getattr(process, k) for k in _fields(ProcessInfo)}}


def process_from_record(rec: dict) -> ProcessInfo:
    """The ProcessInfo a process record holds (unknown fields are ignored)."""
    return _from_record(ProcessInfo, rec)


def lost_record(ts: int, total: int) -> dict:
    """A lost-events record: ``total`` events lost since the start of the recording, as of ``ts``."""
    return {"type": LOST, "ts": int(ts), "total": int(total)}


def keyframe_record(ts: int, event_index: int, state: dict) -> dict:
    """A keyframe: the live state at ``ts``, valid after the first ``event_index`` events."""
    return {"type": KEYFRAME, "ts": int(ts), "event_index": int(event_index), "state": state}


def expand_keyframe(rec: dict, budget: ReadBudget | None = None) -> dict:
    """A keyframe record with its state decompressed (format 2 stores it as ``state_z``), at most
    :data:`MAX_STATE_SIZE` bytes and what is left of the read's ``budget``
    (:mod:`memrec.trace.budget`).

    Raises:
        OverBudget: the state is larger than what is left of ``budget``.
        TraceFormatError: the state does not decompress, is not msgpack, or nests too deep.
    """
    if STATE_Z not in rec:
        return rec
    blob = rec[STATE_Z]
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TraceFormatError("malformed keyframe record: state_z is not binary")
    limit = MAX_STATE_SIZE if budget is None else min(MAX_STATE_SIZE, budget.state_limit())
    try:
        raw = codec.decompress(blob, limit)
        if budget is not None:
            budget.spend(nbytes=len(raw), state=len(raw))
        state = unpackb(raw)
    except codec.TooLarge as error:
        if limit < MAX_STATE_SIZE:
            budget.spend(nbytes=limit + 1, state=limit + 1)  # raises the read's OverBudget (what a user can do about it)
        raise TraceFormatError(f"malformed keyframe record: its state {error}") from None
    except OverBudget:
        raise
    except TraceFormatError as error:
        raise TraceFormatError(f"malformed keyframe record: its state {error}") from None
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise TraceFormatError(f"malformed keyframe record: its state is not msgpack ({type(error).__name__})") from None
    if too_deep(state):
        raise TraceFormatError("malformed keyframe record: its state nests too deep")
    out = {k: v for k, v in rec.items() if k != STATE_Z}
    out["state"] = state
    return out


def check_keyframe(rec: dict, budget: ReadBudget | None = None) -> tuple[int, int, dict]:
    """Validate a keyframe record (compressed or not) and return ``(ts, event_index, state)``.

    Raises:
        OverBudget: its state is larger than what is left of the read's ``budget``.
        TraceFormatError: a field is missing or of the wrong type.
    """
    rec = expand_keyframe(rec, budget)
    ts, index, state = rec.get("ts"), rec.get("event_index"), rec.get("state")
    if not isinstance(ts, int) or not isinstance(index, int) or not isinstance(state, dict):
        raise TraceFormatError("malformed keyframe record: needs int ts, int event_index and a map state")
    return ts, index, state
