"""A Perfetto trace (``.pftrace``) of a recording, written with the ``perfetto`` package's trace builder.

What opens in ui.perfetto.dev:

- per GPU a group of counter tracks: one per category (``GPU 0 driver``, ``GPU 0 vmm``,
  ``GPU 0 ipc_mapped``; the host's ``host_pinned``), and NVML's ``used`` and ``reserved``;
- a track ``answer`` first: one slice over the answer's window (:mod:`memrec.analysis.report.answer`, what
  ``memrec report`` prints first), named by its headline, with its cause, fix and why the window
  is that as arguments;
- per process (named by rank and title) a counter of the bytes it owns on each GPU
  (``held on GPU 0``), its phases as nested slices (marker values as arguments) with its instant
  markers, its failures as instants on a ``failures`` track: every failure the answer counts
  (a failed driver call, named by its result ``CUDA_ERROR_OUT_OF_MEMORY`` with api, size and GPU
  as arguments; SGLang's failed KV sizing, ``KV cache sizing failed``; a marker's error), the
  answer's own failure with its cause and fix; and its IPC calls, with the size mapped, the peer
  (the exporter of an open, the openers of an export) and the 64 handle bytes as arguments: each
  ``cuIpcOpenMemHandle_v2`` is the end of a flow that starts at the exporter's
  ``cuIpcGetMemHandle`` of the same handle bytes; for a trace recorded with ``memrec daemon
  --tensors``, its PyTorch tensor blocks on each GPU as two counters (``tensors allocated on GPU
  0``, ``tensors reserved on GPU 0``: the caching allocator's segments that held a block).

Timestamps are the trace's own (CLOCK_MONOTONIC ns). Packets are streamed to the file one by one
(the builder's streaming mode), and the events are read from the trace file a record at a time in
one replay pass: memory stays in proportion to one GPU's series and the failed and IPC calls,
not the events; the tensor counters (a point per tensor event) wait in a temporary file until
their process's tracks are written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any
from typing import NamedTuple
from typing import Iterable
from typing import Iterator

import numpy as np

from memrec.base.files import create_output
from memrec.analysis.report.answer import Answer
from memrec.analysis.report.answer import DRIVER_CALL
from memrec.analysis.report.answer import DRIVER_OOM
from memrec.analysis.report.answer import Failure
from memrec.analysis.names import api_name
from memrec.analysis.names import process_title
from memrec.analysis.names import result_name
from memrec.analysis.report.build import trace_answer
from memrec.terms.events import IPC_MAPPED
from memrec.terms.events import OWNED
from memrec.api import Recording
from memrec.terms.columns import empty_events
from memrec.terms.columns import failed_calls
from memrec.terms.events import Kind
from memrec.state.batch import Batch
from memrec.state.tensors import BlockSeries
from memrec.export import require

#: Every packet comes from one writer: one trusted sequence.
SEQUENCE_ID = 1


class _Writer:
    """Track uuids and packets on one stream (the perfetto package's StreamingTraceProtoBuilder)."""

    def __init__(self, f: Any) -> None:
        builder_mod = require("perfetto.trace_builder.proto_builder", "export", "--to perfetto")
        pb = require("perfetto.protos.perfetto.trace.perfetto_trace_pb2", "export", "--to perfetto")
        self.pb = pb
        self.builder = builder_mod.StreamingTraceProtoBuilder(f)
        self.f = f
        self.next_uuid = 1
        self.first = True
        self.counts = {"tracks": 0, "counter_values": 0, "slices": 0, "instants": 0, "flows": 0}
        self._rests: dict[tuple[int, str, str], bytes] = {}  # (track, kind, name) -> a packet's bytes after its time (_plain_events)

    def packet(self) -> Any:
        p = self.builder.create_packet()
        p.trusted_packet_sequence_id = SEQUENCE_ID
        if self.first:
            p.sequence_flags = self.pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            self.first = False
        return p

    def track(self, name: str, parent: int = 0, counter: bool = False, pid: int | None = None) -> int:
        """Declare a track (a process track when ``pid`` is given) and return its uuid."""
        uuid = self.next_uuid
        self.next_uuid += 1
        p = self.packet()
        d = p.track_descriptor
        d.uuid = uuid
        if parent:
            d.parent_uuid = parent
        if pid is not None:
            if 0 <= pid < 2**31:  # (perfetto's pid is an int32; a merge of many hosts goes past it)
                d.process.pid = pid
            d.process.process_name = name
        else:
            d.name = name
        if counter:
            d.counter.unit = self.pb.CounterDescriptor.UNIT_SIZE_BYTES
        self.builder.write_packet(p)
        self.counts["tracks"] += 1
        return uuid

    def counter(self, track: int, ts: np.ndarray, values: np.ndarray) -> None:
        """Counter values at each change (repeats of the previous value left out)."""
        self.counter_parts(track, [(ts, values)])

    def counter_parts(self, track: int, parts: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """:meth:`counter` of the values of ``parts`` (``(ts, values)`` in order) one after another.

        A counter value is a packet per value (a tensor counter: one per tensor event, 100M at
        100M events), so its bytes are encoded here a part at a time (:func:`_counter_packets`)
        rather than by the builder a packet at a time: the same bytes, without the Python of
        three protobuf messages per value."""
        last = None
        for ts, values in parts:
            if not len(values):
                continue
            keep = np.ones(len(values), dtype=bool)
            keep[1:] = values[1:] != values[:-1]
            if last is not None and values[0] == last:
                keep[0] = False
            last = values[-1]
            self.f.write(_counter_packets(track, self.pb.TrackEvent.TYPE_COUNTER, ts[keep], values[keep]))
            self.counts["counter_values"] += int(np.count_nonzero(keep))

    def event(self, track: int, ts: int, kind: str, name: str = "", args: dict | None = None,
              flows: list[int] = (), ends_flows: list[int] = ()) -> None:
        """A slice begin/end or an instant, with debug arguments and flow ids."""
        p = self.packet()
        p.timestamp = int(ts)
        e = p.track_event
        e.type = getattr(self.pb.TrackEvent, kind)
        e.track_uuid = track
        if name:
            e.name = name
        for k, v in (args or {}).items():
            _annotate(e.debug_annotations.add(), k, v)
        e.flow_ids.extend(flows)
        e.terminating_flow_ids.extend(ends_flows)
        self.builder.write_packet(p)
        if kind == "TYPE_SLICE_BEGIN":
            self.counts["slices"] += 1
        elif kind == "TYPE_INSTANT":
            self.counts["instants"] += 1
        self.counts["flows"] += len(ends_flows)


    def events(self, track: int, points: list[tuple[int, str, str, dict | None]]) -> None:
        """:meth:`event` for each ``(ts, kind, name, args)`` of ``points``, in order; a run of those
        without arguments is encoded at once (:meth:`_plain_events`)."""
        run: list[tuple[int, str, str, dict | None]] = []
        for point in points:
            ts, kind, name, args = point
            if not args and not self.first and 0 <= ts < 1 << 63:
                run.append(point)
                continue
            self._plain_events(track, run)
            run = []
            self.event(track, ts, kind, name, args)
        self._plain_events(track, run)

    def _plain_events(self, track: int, run: list[tuple[int, str, str, dict | None]]) -> None:
        """The builder's bytes for events without arguments or flows: each packet's fields after its
        timestamp serialized once per (kind, name) on the track, the timestamps' varints with numpy
        (a step loop's 50,000 phase slices: a protobuf message and a ``Trace`` each were most of
        their export's time)."""
        if not run:
            return
        rests = self._rests
        t, n = _varints(np.array([p[0] for p in run], dtype=np.uint64))
        times = t.tobytes()
        parts = []
        for i, ((_, kind, name, _), k) in enumerate(zip(run, n.tolist())):
            rest = rests.get((track, kind, name))
            if rest is None:
                p = self.packet()
                e = p.track_event
                e.type = getattr(self.pb.TrackEvent, kind)
                e.track_uuid = track
                if name:
                    e.name = name
                rest = rests[(track, kind, name)] = p.SerializeToString()  # (field 8, the time, would come first)
            size = 1 + k + len(rest)
            # Trace.packet, its length, then TracePacket.timestamp and the rest, as the builder writes them
            parts.append(b"\x0a" + (_ONE_BYTE[size] if size < 128 else _varint(size)) + b"\x40"
                         + times[10 * i:10 * i + k] + rest)
            if kind == "TYPE_SLICE_BEGIN":
                self.counts["slices"] += 1
            elif kind == "TYPE_INSTANT":
                self.counts["instants"] += 1
        self.f.write(b"".join(parts))


#: A byte of each value below 128 (a varint of one byte).
_ONE_BYTE = [bytes((b,)) for b in range(128)]


def _varint(value: int) -> bytes:
    """A non-negative integer as protobuf's varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _annotate(a: Any, key: str, value: Any) -> None:
    a.name = str(key)
    if isinstance(value, bool):
        a.bool_value = value
    elif isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        a.int_value = value
    elif isinstance(value, float):
        a.double_value = value
    else:
        a.string_value = str(value)


#: Counter values encoded at a time (:func:`_counter_packets`: ~60 bytes of work per value).
COUNTER_SLICE = 1 << 16


def _varints(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each value's protobuf varint, as 10 byte columns (the first ``length`` of a row are its
    bytes); a negative int64 is its two's complement, ten bytes, as protobuf writes an int64."""
    groups = v.astype(np.uint64)[:, None] >> (np.uint64(7) * np.arange(10, dtype=np.uint64))
    more = groups[:, 1:] != 0  # a byte follows
    out = (groups & np.uint64(0x7F)).astype(np.uint8)
    out[:, :9] |= more.astype(np.uint8) << 7
    return out, 1 + more.sum(axis=1)


def _counter_packets(track: int, counter_type: int, ts: np.ndarray, values: np.ndarray) -> bytes:
    """The bytes the builder writes for each counter value on ``track`` (a ``Trace`` of one
    ``TracePacket``: its timestamp, sequence id 1 and a ``TrackEvent`` of the counter's type,
    track and value, fields in number order as protobuf writes them), every value's at once."""
    (uuid,), (n_uuid,) = _varints(np.array([track], np.uint64))
    middle = np.array([0x50, SEQUENCE_ID, 0x5A, 0, 0x48, counter_type, 0x58, *uuid[:n_uuid], 0xF0, 0x01], np.uint8)
    out = []
    for lo in range(0, len(values), COUNTER_SLICE):
        t, n_t = _varints(ts[lo:lo + COUNTER_SLICE])
        v, n_v = _varints(values[lo:lo + COUNTER_SLICE])
        inner = 5 + n_uuid + n_v  # the TrackEvent's length, then the packet's: both below 128
        rows = np.empty((len(t), 3 + 10 + len(middle) + 10), np.uint8)
        rows[:, 0] = 0x0A  # Trace.packet
        rows[:, 1] = 5 + n_t + inner
        rows[:, 2] = 0x40  # TracePacket.timestamp
        rows[:, 3:13] = t
        rows[:, 13:13 + len(middle)] = middle
        rows[:, 16] = inner  # TracePacket.track_event's length
        rows[:, 13 + len(middle):] = v
        used = np.ones(rows.shape, bool)
        used[:, 3:13] = np.arange(10) < n_t[:, None]
        used[:, 13 + len(middle):] = np.arange(10) < n_v[:, None]
        out.append(rows[used].tobytes())
    return b"".join(out)


def write_perfetto(rec: Recording, path: Path, answer: Answer | None = None) -> dict[str, int]:
    """Write ``rec`` as a Perfetto trace at ``path``; return how many tracks, values, slices... it
    has. ``answer``: the trace's (:func:`memrec.analysis.report.build.trace_answer`, built when not given).

    One replay pass (:meth:`Recording.replayed`) gathers what the tracks read of the events
    (:class:`_Calls`), then the tracks are written in their order: the series come from that
    pass, the tensor counters back from the file they were spilled to."""
    if answer is None:
        answer = trace_answer(rec.trace, rec.trace_events, rec.phases)
    with tempfile.TemporaryFile(prefix="memrec-perfetto-") as spill:
        calls = _Calls(rec, _Spill(spill))
        with create_output(path) as f:
            w = _Writer(f)
            _answer_track(w, answer)
            _gpu_tracks(w, rec)
            _process_tracks(w, rec, answer, calls)
    return w.counts


class _Spill:
    """Each (pid, GPU)'s tensor counters, (ts, allocated, reserved) as int64 triples, appended to
    one temporary file a chunk at a time and read back in order: at 100M tensor events they are
    2.4 GB, and the process tracks are written in pid order, after every event is read."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.at: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (pid, gpu) -> [(offset, rows)]

    def add(self, points: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        for key, columns in points.items():
            block = np.stack([c.astype(np.int64, copy=False) for c in columns], axis=1)
            self.at.setdefault(key, []).append((self.f.seek(0, os.SEEK_END), len(block)))
            self.f.write(block.tobytes())

    def pairs(self) -> list[tuple[int, int]]:
        return sorted(self.at)

    def parts(self, key: tuple[int, int], column: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(ts, values)`` of ``key``'s counter ``column`` (1 allocated, 2 reserved), a chunk at a time."""
        for offset, n in self.at[key]:
            self.f.seek(offset)
            block = np.frombuffer(self.f.read(n * 24), dtype=np.int64).reshape(n, 3)
            yield block[:, 0].astype(np.uint64), block[:, column]


class _Calls:
    """What the process tracks read of the events, from one replay pass: the failed calls' and the
    IPC calls' rows (and their indexes), each paired open's export, the bytes each open mapped
    (from the pass's journal: the event names no size), and the tensor counters (spilled)."""

    def __init__(self, rec: Recording, spill: _Spill) -> None:
        rows, index = [], []
        self.source: dict[int, int] = {}  # open index -> its export's index
        self.mapped: dict[int, int] = {}  # open index -> bytes it mapped
        self.failed = np.zeros(0, np.int64)  # the failed calls' indexes
        blocks = BlockSeries() if rec.trace_events.census.tensor_events else None
        failed = []
        for part in rec.replayed():
            ev, first = part.events, part.first
            bad = failed_calls(ev)
            paired = part.ipc.source >= 0
            keep = np.flatnonzero(bad | paired | (ev["kind"] == int(Kind.IPC_EXPORT)))
            if len(keep):
                rows.append(ev[keep])
                index.append(keep + first)
            failed.append(np.flatnonzero(bad) + first)
            opens = np.flatnonzero(paired)
            self.source.update(zip((opens + first).tolist(), part.ipc.source[opens].tolist()))
            j = part.journal
            m = (j.category == IPC_MAPPED) & (j.delta > 0)
            self.mapped.update(zip(j.index[m].tolist(), j.delta[m].tolist()))
            if blocks is not None:
                spill.add(blocks.add(ev))
        self.rows = Batch.concat(rows) if rows else Batch.of(empty_events(0))
        self.index = np.concatenate(index) if index else np.zeros(0, np.int64)
        self.failed = np.concatenate(failed) if failed else self.failed
        self.blocks = spill

    def row(self, i: int) -> dict:
        """The fields of the event at index ``i`` (one kept)."""
        return self.rows[int(np.searchsorted(self.index, i))]


def _answer_track(w: _Writer, answer: Answer) -> None:
    """The answer's window as one slice named by its headline (nothing for an empty trace)."""
    win = answer.window
    if win is None:
        return
    track = w.track("answer")
    args = {"status": answer.status, "window": win.why}
    for name, line in (("cause", answer.cause), ("fix", answer.fix)):
        if line is not None:
            args[name] = "".join(line.parts)
    w.event(track, win.start_ts, "TYPE_SLICE_BEGIN", "".join(answer.headline.parts), args)
    w.event(track, max(win.end_ts, win.start_ts), "TYPE_SLICE_END")


def _gpu_tracks(w: _Writer, rec: Recording) -> None:
    info = {g.index: g for g in rec.trace.gpus}
    nv = rec.trace.nvml
    gpus = sorted(set(rec.timeline.gpus) | set(np.unique(nv["gpu"]).tolist()))
    for g in gpus:
        label = f"GPU {g}" if g >= 0 else "host"
        title = f"{label} {info[g].name}" if g in info else label
        parent = w.track(title if g >= 0 else "host (pinned memory) and unknown GPU")
        series = rec.timeline.gpus.get(g)
        if series is not None:
            for category, values in series.by_category().items():
                w.counter(w.track(f"{label} {category}", parent, counter=True), series.ts, values)
        s = nv[nv["gpu"] == g]
        s = s[np.argsort(s["ts"], kind="stable")]
        for field in ("used", "reserved"):
            ok = s[field] >= 0
            if ok.any():
                w.counter(w.track(f"{label} NVML {field}", parent, counter=True), s["ts"][ok], s[field][ok])


def _process_tracks(w: _Writer, rec: Recording, answer: Answer, calls: _Calls) -> None:
    phases = rec.phases
    table = phases.table  # columns: a step loop's 25,000 phases without a Phase object each
    columns = _PhaseColumns(table.start.tolist(), table.end.tolist(), table.depth.tolist(), table.name, table.values)
    pids = sorted(set(rec.event_pids()) | set(table.pid.tolist()) | {i.pid for i in phases.instants})
    flows_out, flows_in = _ipc_flows(calls.source)
    failed = calls.failed
    ipc_args = _ipc_args(calls, flows_out, flows_in)
    owned = {g: s.per_pid(OWNED) for g, s in sorted(rec.timeline.gpus.items())}
    # each process's phases, instants, failed calls and IPC events, grouped once (not searched per process)
    phases_of: dict[int, list[int]] = {}
    for phase_id, pid in enumerate(table.pid.tolist()):
        phases_of.setdefault(pid, []).append(phase_id)
    instants_of: dict[int, list] = {}
    for i in phases.instants:
        instants_of.setdefault(i.pid, []).append(i)
    failed_of: dict[int, list[int]] = {}
    for i in failed.tolist():
        failed_of.setdefault(int(calls.row(i)["pid"]), []).append(i)
    failures_of: dict[int, list[Failure]] = {}
    for f in answer.failures:
        failures_of.setdefault(f.pid, []).append(f)
    ipc_of: dict[int, list[int]] = {}
    for i in sorted(set(flows_out) | set(flows_in)):
        ipc_of.setdefault(int(calls.row(i)["pid"]), []).append(i)
    blocks_of: dict[int, list[int]] = {}
    for p, g in calls.blocks.pairs():
        blocks_of.setdefault(p, []).append(g)
    for pid in pids:
        title = process_title(rec.trace.processes.get(pid), rec.ranks.get(pid, "")) or f"pid {pid}"
        proc = w.track(title, pid=pid)
        for g, steps in owned.items():
            k = steps.index(pid)
            if k is not None:  # its own change points: the counter leaves repeats out anyway
                where = f"GPU {g}" if g >= 0 else "host"
                rows, values = steps.steps(k)
                w.counter(w.track(f"held on {where}", proc, counter=True), rec.timeline.gpus[g].ts[rows], values)
        for g in blocks_of.get(pid, []):
            w.counter_parts(w.track(f"tensors allocated on GPU {g}", proc, counter=True), calls.blocks.parts((pid, g), 1))
            w.counter_parts(w.track(f"tensors reserved on GPU {g}", proc, counter=True), calls.blocks.parts((pid, g), 2))
        _phase_slices(w, proc, columns, phases_of.get(pid, []), instants_of.get(pid, []))
        _failure_instants(w, calls, answer, failed_of.get(pid, []), failures_of.get(pid, []), proc)
        ipc = ipc_of.get(pid, [])
        if ipc:
            track = w.track("IPC", proc)
            for i in ipc:
                e = calls.row(i)
                args = {"ptr": f"{int(e['ptr']):#x}", "gpu": int(e["gpu"]), **ipc_args.get(i, {})}
                w.event(track, int(e["ts"]), "TYPE_INSTANT", api_name(int(e["api"])), args,
                        flows=flows_out.get(i, []), ends_flows=flows_in.get(i, []))


def _failure_instants(w: _Writer, calls: _Calls, answer: Answer, failed: list[int], mine: list[Failure],
                      proc: int) -> None:
    """A process's failures (``mine``, the answer's) as instants on its ``failures`` track: a failed
    driver call (``failed``: its failed calls' event indexes) named by its result with api, size,
    GPU as arguments; any other failure by what failed; the answer's own failure with its
    headline, cause and fix."""
    if not mine:
        return
    track = w.track("failures", proc)
    at = {int(calls.row(i)["ts"]): i for i in failed}
    for f in mine:
        args: dict = {"failure": f.what, "kind": f.kind, "rank": f.who, "phase": f.phase}
        if f.gpu is not None:
            args["gpu"] = f.gpu
        i = at.get(f.ts) if f.kind in (DRIVER_OOM, DRIVER_CALL) else None
        if i is not None:
            e = calls.row(i)
            args.update({"api": api_name(int(e["api"])), "size": int(e["size"]), "gpu": int(e["gpu"]),
                         "result": int(e["result"])})
            name = result_name(int(e["result"]))
        else:
            name = f.what.split(":")[0] + " failed"
        if f == answer.failure:
            args["answer"] = "".join(answer.headline.parts)
            for key, line in (("cause", answer.cause), ("fix", answer.fix)):
                if line is not None:
                    args[key] = "".join(line.parts)
        w.event(track, f.ts, "TYPE_INSTANT", name, args)


def _ipc_args(calls: _Calls, flows_out: dict[int, list[int]], flows_in: dict[int, list[int]]) -> dict[int, dict]:
    """Event index -> the IPC call's arguments: the bytes an open mapped (from the replay's
    journal: the event names no size), the peer (an open's exporter; an export's openers) and the
    64 handle bytes in hex."""
    mapped = calls.mapped
    source = {fid: i for i, fids in flows_out.items() for fid in fids}
    out: dict[int, dict] = {}
    for i in set(flows_out) | set(flows_in):
        out[i] = {"handle": calls.row(i)["ipc"].hex()}
    for i, fids in flows_in.items():
        exporter = source[fids[0]]
        out[i]["peer"] = int(calls.row(exporter)["pid"])
        if i in mapped:
            out[i]["size"] = int(mapped[i])
            out[exporter].setdefault("size", int(mapped[i]))
        openers = out[exporter].setdefault("peer", "")
        out[exporter]["peer"] = ", ".join(x for x in (str(openers), str(int(calls.row(i)["pid"]))) if x)
    return out


class _PhaseColumns(NamedTuple):
    """The fields of the phase table the slices read, as lists (by phase id)."""

    start: list[int]
    end: list[int]
    depth: list[int]
    name: list[str]
    values: list[dict]


def _phase_slices(w: _Writer, proc: int, columns: _PhaseColumns, mine: list[int], instants: list) -> None:
    """A process's phases (``mine``: their ids) as nested slices and its instants, on one track."""
    if not mine and not instants:
        return
    track = w.track("phases", proc)
    points: list[tuple] = []  # (ts, order, tie, kind, name, args): ends before begins at one time
    start, end, depth, name, values = columns
    for i in mine:
        points.append((start[i], 1, i, "TYPE_SLICE_BEGIN", name[i], values[i]))
        # A phase that ends at its own start must end after its begin; otherwise inner ends first.
        points.append((end[i], 2 if end[i] == start[i] else 0, -depth[i], "TYPE_SLICE_END", "", None))
    for n, i in enumerate(instants):
        points.append((i.ts, 1, 1 << 40 | n, "TYPE_INSTANT", i.name, i.values))
    w.events(track, [(ts, kind, name_, args) for ts, _, _, kind, name_, args in sorted(points, key=lambda p: p[:3])])


def _ipc_flows(source: dict[int, int]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Flows from each export to each open of the same handle bytes (``source``: a paired open's
    index -> its export's, :mod:`memrec.engine.ipc`): event index -> flow ids it starts, and ->
    flow ids it ends."""
    out: dict[int, list[int]] = {}
    into: dict[int, list[int]] = {}
    next_id = 1
    for i in sorted(source):
        src = source[i]
        out.setdefault(src, []).append(next_id)
        into.setdefault(i, []).append(next_id)
        next_id += 1
    return out, into
