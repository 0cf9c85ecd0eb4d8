"""``memrec.load(path)``: a trace as tables, for notebooks, pandas, polars and DuckDB.

A :class:`Recording` replays the trace once (the same replay as ``memrec report``: keyframe at
event 0, :func:`memrec.engine.replay.build_timeline`, :func:`memrec.engine.phases.build_phases`)
and hands out typed tables: pandas DataFrames (the default: the notebook in docs/python-api.md is
pandas, so without pandas ``load`` says how to install it rather than handing back arrays that
fail on the first ``.query``), or numpy structured arrays with ``pandas=False``. Names (kind,
api, result, phase, category) are strings, sizes and times integers (ns on CLOCK_MONOTONIC, plus
``t_s``: seconds since the recording started, the ``+N.NNNs`` of the report, and a wall-clock
``wall`` column, UTC, to join with DCGM or Prometheus samples). The exports (``memrec export``)
are written from these same tables.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from typing import Iterator

import numpy as np

from memrec.analysis.names import api_name
from memrec.base.jsontext import dumps
from memrec.analysis.names import kind_name
from memrec.analysis.names import process_title
from memrec.analysis.names import result_name
from memrec.engine.phases import Phases
from memrec.engine.phases import Attribution
from memrec.engine.phases import UsageTable
from memrec.engine.phases import attribute_table
from memrec.analysis.untraced.reconcile import Reconciliation
from memrec.analysis.untraced.reconcile import reconcile
from memrec.engine.replay import initial_state
from memrec.engine.replay import trace_bounds
from memrec.engine.replay import trace_phases
from memrec.terms.events import CATEGORIES
from memrec.terms.events import OWNED_CATEGORIES
from memrec.engine.replay import Timeline
from memrec.engine.replay import Replay
from memrec.engine.replay import build_timeline
from memrec.engine.journal import Journal
from memrec.engine.source import TraceEvents
from memrec.engine.stream import replayed
from memrec.state.batch import Batch
from memrec.engine.replay import state_at
from memrec.engine.ipc import IpcOpens
from memrec.engine.ipc import IpcPairing
from memrec.engine.ipc import ipc_opens
from memrec.terms.ranks import pid_labels
from memrec.terms.columns import empty_events
from memrec.trace.clock import wall_offset_ns
from memrec.trace.model import Trace

#: Object columns hold Python str (names shared between rows: 8 bytes a row, not a fixed width).
_STR = "O"
#: Wall-clock columns: ns since the epoch, UTC (NaT when the trace has no clock anchor).
_WALL = "<M8[ns]"


class PandasMissing(ImportError):
    """``memrec.load`` was asked for DataFrames (the default) and pandas cannot be imported."""


def load(path: str | os.PathLike, pandas: bool | None = None) -> Recording:
    """Read a ``.mrec`` trace: what is readable of a cut or damaged one, each of the reader's
    warnings (a truncated tail, skipped records, no trailer) issued as a ``UserWarning`` naming the
    file, as the commands print them; they stay in ``rec.trace.warnings``.

    Args:
        path: the trace file.
        pandas: tables as pandas DataFrames (True, the default; None means the same), or numpy
            structured arrays (False), which need nothing beyond memrec.

    Raises:
        PandasMissing: DataFrames were asked for and pandas is not installed (an ImportError whose
            message is the command that installs it, and ``pandas=False``).
        OSError: the file cannot be opened.
        memrec.base.errors.TraceFormatError: not a memrec trace, a newer format, or one with no
            records at all (an empty file, or cut inside its header), which every memrec command
            refuses alike (exit 65); it was an empty Recording and a warning.
    """
    from memrec.base.errors import TraceFormatError
    from memrec.trace.reader import load_trace
    from memrec.trace.reader import nothing_read

    use_pandas = _use_pandas(pandas)
    trace = load_trace(path)
    problem = nothing_read(trace, path)
    if problem is not None:
        raise TraceFormatError(f"{os.fspath(path)}: {problem}")
    for warning in trace.warnings:
        warnings.warn(f"{os.fspath(path)}: {warning}", UserWarning, stacklevel=3)  # the caller of memrec.load
    return Recording(trace, pandas=use_pandas)


def _use_pandas(choice: bool | None) -> bool:
    """DataFrames unless ``choice`` is False; raise :class:`PandasMissing` when pandas is absent."""
    if choice is False:
        return False
    try:
        import pandas  # noqa: F401
    except ImportError as error:
        from memrec.base.extras import install_command

        raise PandasMissing(
            f"memrec.load returns pandas DataFrames and pandas is not installed ({error}): "
            f"{install_command('pandas', ('pandas',))}; or memrec.load(path, pandas=False) for numpy "
            "structured arrays"
        ) from None
    return True


def _names(values: np.ndarray, name_of: Any) -> np.ndarray:
    """``name_of(v)`` for each of ``values`` (small integer codes: kinds, APIs, results, phase ids),
    as an object array through a table of the codes' range: no Python int or list per row (a
    list and ``tolist()`` per column were ~100 B a row of temporaries at 10M events)."""
    if not len(values):
        return np.zeros(0, dtype=object)
    lo, hi = int(values.min()), int(values.max())
    if hi - lo >= 1 << 20:  # sparse codes: one name per distinct value
        distinct, index = np.unique(values, return_inverse=True)
        return np.array([name_of(int(v)) for v in distinct.tolist()], dtype=object)[index]
    present = np.bincount((values - lo) if lo else values, minlength=hi - lo + 1) > 0
    table = np.empty(hi - lo + 1, dtype=object)
    for code in np.flatnonzero(present).tolist():
        table[code] = name_of(code + lo)
    return table[(values - lo) if lo else values]


def _table(columns: dict[str, Any], dtypes: dict[str, str], n: int) -> np.ndarray:
    out = np.zeros(n, dtype=[(k, dtypes[k]) for k in columns])
    for k, v in columns.items():
        out[k] = v
    return out


@dataclass
class ReplayedChunk:
    """One chunk of a :meth:`Recording.replayed` pass: its events (GPUs filled in), the replay's
    journal rows for them, and their IPC opens paired (indexes into the whole trace)."""

    first: int  # the index of its first event
    events: Batch
    journal: Journal
    ipc: IpcOpens


@dataclass
class _Passed:
    """What a whole :meth:`Recording.replayed` pass leaves: its timeline (the journal let go,
    no events) and the bytes each phase moved."""

    timeline: Timeline
    usage: UsageTable


class Recording:
    """One trace, replayed once, as tables (see the module docstring).

    Attributes:
        trace: the decoded :class:`memrec.trace.model.Trace`.
        start: the recording's start (CLOCK_MONOTONIC ns): ``t_s`` is relative to it.
        end: its last timestamp.

    ``events``: the trace's events when ``trace`` holds none (the exports read them from the file
    a record at a time, :func:`memrec.engine.source.scan_trace`): then the events are read only
    in :meth:`replayed` passes (the whole-trace tables and :meth:`state_at` need a loaded trace),
    and :attr:`timeline` is such a pass's (no events, no journal).
    """

    def __init__(self, trace: Trace, pandas: bool | None = None, events: TraceEvents | None = None) -> None:
        self.trace = trace
        self._events = events
        self._census = events.census if events is not None else None
        self.start, self.end = trace_bounds(trace, self._census)
        self._pandas = _use_pandas(pandas)
        self._wall_offset = wall_offset_ns(trace.header)
        self.notes: list[str] = []
        self._passed: _Passed | None = None

    # ------------------------------------------------------------------ the one replay

    @cached_property
    def timeline(self) -> Timeline:
        """The replay: per-GPU step series, the journal and the final state (fills ``events["gpu"]``)."""
        if self._events is not None:
            return self._pass().timeline
        initial, self.notes = initial_state(self.trace)
        return build_timeline(self.trace.events, start=self.start, state=initial)

    @cached_property
    def trace_events(self) -> TraceEvents:
        """The events as a pass reads them: the file's a record at a time, or the loaded columns."""
        return self._events if self._events is not None else TraceEvents.of(self.trace.event_columns)

    def replayed(self) -> Iterator[ReplayedChunk]:
        """One replay of the events a chunk at a time (:func:`memrec.engine.stream.replayed`, the
        report's pass): each chunk with its GPUs, journal rows and IPC pairing, used and let go,
        so that what reads it (the exports' events table, memory-viz, Perfetto) holds no more of
        the events than a chunk. Once every chunk is read, the pass's timeline and usage by
        phase are kept (:attr:`timeline` of a Recording of the file's events)."""
        events = self.trace_events
        initial, self.notes = initial_state(self.trace)
        parts: list[Journal] = []
        replay = Replay(events.census.n, self.start, initial, on_journal=lambda j: parts.append(Journal.concat([j])))
        usage = Attribution(self.phases)
        pairing = IpcPairing(events.census.ipc_exports)
        for first, chunk in replayed(self.trace, events, replay):
            replay.flush()
            journal = Journal.concat(parts)
            parts.clear()
            usage.add(journal)
            yield ReplayedChunk(first, chunk, journal, pairing.add(first, chunk, journal))
        self._passed = _Passed(replay.finish(), usage.table())

    def _pass(self) -> _Passed:
        """The whole pass's timeline and usage (a pass made now when none was read to its end)."""
        if self._passed is None:
            for _ in self.replayed():
                pass
        assert self._passed is not None
        return self._passed

    @cached_property
    def phases(self) -> Phases:
        """Phases (begin/end marker pairs per process) and instants."""
        return trace_phases(self.trace, self._census)

    @cached_property
    def ipc_opens(self) -> IpcOpens:
        """Each IPC open's export, exporter pid and mapped bytes (:mod:`memrec.engine.ipc`)."""
        return ipc_opens(self.timeline.events, self.timeline.journal)

    @cached_property
    def ranks(self) -> dict[int, str]:
        """pid -> rank label ("TP0") from the markers' SGLang ranks, else the process record's rank."""
        return pid_labels(self.trace.markers, self.trace.processes)

    def name_of(self, pid: int) -> str:
        """``pid 1054 TP0 python3 (spawned)``: how tables and exports name a process."""
        title = process_title(self.trace.processes.get(pid), self.ranks.get(pid, ""))
        return f"pid {pid} {title}".rstrip()

    def _out(self, arr: np.ndarray) -> Any:
        if not self._pandas:
            return arr
        import pandas as pd

        return pd.DataFrame({
            k: pd.Series(arr[k]).dt.tz_localize("UTC") if arr.dtype[k].kind == "M" else arr[k]
            for k in arr.dtype.names
        })

    def _t_s(self, ts: np.ndarray) -> np.ndarray:
        return (ts.astype(np.int64) - self.start) / 1e9

    def wall(self, ts: Any) -> np.ndarray:
        """CLOCK_MONOTONIC ns (the ``ts`` of every table) as wall-clock datetime64[ns], UTC, through
        the header's anchor (:func:`memrec.trace.clock.wall_offset_ns`); NaT without an anchor, and
        where ``ts`` is negative (unknown, as in ``first_ts`` -1)."""
        ts = np.asarray(ts, dtype=np.int64)
        if self._wall_offset is None:
            return np.full(ts.shape, np.datetime64("NaT"), dtype=_WALL)
        out = (ts + np.int64(self._wall_offset)).astype(_WALL)
        out[ts < 0] = np.datetime64("NaT")
        return out

    # ------------------------------------------------------------------ tables

    def events_array(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Every driver event, one row each, with names and the phase of its process at that time;
        only the rows ``[lo, hi)`` when given (see :meth:`event_rows`).

        An IPC open's row has the bytes it mapped in ``size`` and the exporting pid in ``peer``
        (the driver's call carries neither: :mod:`memrec.engine.ipc`); ``peer`` is -1 elsewhere.
        """
        every = self.timeline.events  # the replay has filled in each event's GPU where it could
        rows = slice(lo, len(every) if hi is None else min(hi, len(every)))
        return self.event_rows(every[rows], self.ipc_opens[rows])

    def event_parts(self, rows: int) -> Iterator[np.ndarray]:
        """The events table (:meth:`event_rows`) ``rows`` rows at a time (the last part fewer),
        from one :meth:`replayed` pass: what the exports write, in the same slices (Parquet's
        row groups) whatever the file's records. Always one part at least, so that an empty
        table still has its columns."""
        events: list[Batch] = []
        ipc: list[IpcOpens] = []
        have, made = 0, False
        for part in self.replayed():
            lo = 0
            while lo < len(part.events):
                hi = lo + min(rows - have, len(part.events) - lo)
                events.append(part.events[lo:hi])
                ipc.append(part.ipc[lo:hi])
                have, lo = have + hi - lo, hi
                if have == rows:
                    yield self.event_rows(Batch.concat(events), IpcOpens.concat(ipc))
                    events, ipc, have, made = [], [], 0, True
        if have or not made:
            yield self.event_rows(Batch.concat(events) if events else Batch.of(empty_events(0)), IpcOpens.concat(ipc))

    def event_rows(self, every: Any, ipc: IpcOpens) -> np.ndarray:
        """The events table's rows of ``every`` (replayed events: rows, or a chunk of
        :meth:`replayed`) with ``ipc``, their pairing: the exports write the table a slice at a
        time (132 bytes a row, 1.3 GB for 10M events, never whole)."""
        ev = {name: every[name] for name in ("ts", "pid", "tid", "kind", "api", "result", "gpu", "ordinal",
                                             "size", "ptr", "handle", "aux", "flags")}
        ipc_size = ipc.size
        size = np.where(ipc_size > 0, ipc_size, ev["size"].astype(np.int64))
        n = len(ev["ts"])
        phase_ids = self.phases.assign(ev["pid"].astype(np.int64), ev["ts"].astype(np.int64)) if n else np.zeros(0)
        cols = {
            "ts": ev["ts"], "t_s": self._t_s(ev["ts"]), "wall": self.wall(ev["ts"]), "pid": ev["pid"], "tid": ev["tid"],
            "kind": _names(ev["kind"], kind_name), "api": _names(ev["api"], api_name),
            "result": ev["result"], "result_name": _names(ev["result"], result_name),
            "gpu": ev["gpu"], "ordinal": ev["ordinal"], "size": size, "ptr": ev["ptr"],
            "handle": ev["handle"], "aux": ev["aux"], "flags": ev["flags"], "peer": ipc.peer,
            "phase": _names(phase_ids, lambda i: self.phases.label(int(i))),
        }
        types = {"ts": "<i8", "t_s": "<f8", "wall": _WALL, "pid": "<i8", "tid": "<i8", "kind": _STR, "api": _STR, "result": "<i4",
                 "result_name": _STR, "gpu": "<i2", "ordinal": "<i4", "size": "<i8", "ptr": "<u8", "handle": "<u8",
                 "aux": "<u8", "flags": "<u4", "peer": "<i8", "phase": _STR, "stack": "<i8"}
        if self.has_stacks:  # format 2.3: the stacks table's id (0: none); a trace without has no column
            cols["stack"] = every["stack"]
        return _table(cols, types, n)

    @property
    def has_stacks(self) -> bool:
        """Whether the trace defines stacks (format 2.3, recorded with them): then the events
        table has a ``stack`` column and :attr:`stacks` rows."""
        return bool(len(self.trace.stacks))

    def stacks_array(self) -> np.ndarray:
        """Every stack the events name, one row per frame: ``stack`` (the events' id), ``depth``
        (0 the innermost), ``file``, ``line``, ``function``, ``native`` (a native frame: ``file``
        the module, ``line`` the offset, ``function`` the symbol), ``site`` (the frame ``memrec
        report`` names the allocation's site: :mod:`memrec.analysis.report.sites`) and ``unavailable``
        (the reason, on the one row of a stack memrec could not read; "" otherwise)."""
        from memrec.analysis.report.sites import user_frame
        from memrec.trace.stacks import Unavailable

        rows = []
        for sid, stack in self.trace.stacks.items():
            if isinstance(stack, Unavailable):
                rows.append((sid, 0, "", 0, "", False, False, stack.reason))
                continue
            site = user_frame(stack)
            rows += [(sid, depth, f.file, f.line, f.function, f.native, f == site, "") for depth, f in enumerate(stack)]
        names = ("stack", "depth", "file", "line", "function", "native", "site", "unavailable")
        cols = {name: [r[i] for r in rows] for i, name in enumerate(names)}
        types = {"stack": "<i8", "depth": "<i4", "file": _STR, "line": "<i8", "function": _STR, "native": "?",
                 "site": "?", "unavailable": _STR}
        return _table(cols, types, len(rows))

    @property
    def stacks(self) -> Any:
        """The stacks the events' ``stack`` column names (see :meth:`stacks_array`)."""
        return self._out(self.stacks_array())

    @property
    def events(self) -> Any:
        """Every driver event (see :meth:`events_array`)."""
        return self._out(self.events_array())

    def samples_array(self) -> np.ndarray:
        """NVML device samples: used, reserved, free, total (bytes; -1 where NVML gave none)."""
        nv = self.trace.nvml
        cols = {"ts": nv["ts"], "t_s": self._t_s(nv["ts"]), "wall": self.wall(nv["ts"])}
        cols.update({k: nv[k] for k in ("gpu", "used", "reserved", "free", "total", "bar1_used", "bar1_total")})
        types = {k: "<i8" for k in cols}
        types.update(t_s="<f8", wall=_WALL, gpu="<i2")
        return _table(cols, types, len(nv))

    @property
    def samples(self) -> Any:
        """NVML device samples (see :meth:`samples_array`)."""
        return self._out(self.samples_array())

    def process_samples_array(self) -> np.ndarray:
        """NVML per-process samples: a process's used bytes on one GPU."""
        pm = self.trace.procmem
        cols = {"ts": pm["ts"], "t_s": self._t_s(pm["ts"]), "wall": self.wall(pm["ts"]), "gpu": pm["gpu"],
                "pid": pm["pid"], "used": pm["used"]}
        types = {"ts": "<i8", "t_s": "<f8", "wall": _WALL, "gpu": "<i2", "pid": "<i8", "used": "<i8"}
        return _table(cols, types, len(pm))

    @property
    def process_samples(self) -> Any:
        """NVML per-process samples (see :meth:`process_samples_array`)."""
        return self._out(self.process_samples_array())

    def markers_array(self) -> np.ndarray:
        """Phase markers as recorded; ``values`` is the marker's values as one JSON object
        (``{"tp_rank": 0, "ok": true}``: typed, for ``json.loads`` or DuckDB's ``json_extract``)."""
        mk = sorted(self.trace.markers, key=lambda m: m.ts)
        ts = np.array([m.ts for m in mk], dtype=np.int64)
        cols = {
            "ts": ts, "t_s": self._t_s(ts), "wall": self.wall(ts), "pid": [m.pid for m in mk],
            "tid": [m.tid for m in mk],
            "name": [m.name for m in mk], "phase": [m.phase for m in mk],
            "gpu": [-1 if m.gpu is None else m.gpu for m in mk],
            "rank": [self.ranks.get(m.pid, "") for m in mk],
            "values": [dumps(m.values, default=str) if m.values else "{}" for m in mk],  # (a step loop's have none)
        }
        types = {"ts": "<i8", "t_s": "<f8", "wall": _WALL, "pid": "<i8", "tid": "<i8", "name": _STR, "phase": _STR, "gpu": "<i2",
                 "rank": _STR, "values": _STR}
        return _table(cols, types, len(mk))

    @property
    def markers(self) -> Any:
        """Phase markers (see :meth:`markers_array`)."""
        return self._out(self.markers_array())

    def processes_array(self) -> np.ndarray:
        """Every process the trace knows: pid, parent, rank, name, command line, GPUs visible."""
        pids = sorted(set(self.trace.processes) | set(self.event_pids()))
        infos = [self.trace.processes.get(p) for p in pids]
        cols = {
            "pid": pids,
            "ppid": [i.ppid if i and i.ppid is not None else -1 for i in infos],
            "rank": [self.ranks.get(p, "") for p in pids],
            "name": [process_title(i) for i in infos],
            "cmdline": [" ".join(i.cmdline) if i else "" for i in infos],
            "cuda_visible_devices": [(i.cuda_visible_devices or "") if i else "" for i in infos],
            "first_ts": [i.first_ts if i else -1 for i in infos],
        }
        cols["first_wall"] = self.wall(cols["first_ts"])
        types = {"pid": "<i8", "ppid": "<i8", "rank": _STR, "name": _STR, "cmdline": _STR,
                 "cuda_visible_devices": _STR, "first_ts": "<i8", "first_wall": _WALL}
        return _table(cols, types, len(pids))

    def event_pids(self) -> list[int]:
        """Every process an event names, ascending."""
        if self._census is not None:
            return self._census.pids
        return np.unique(self.trace.event_columns["pid"]).tolist()

    @property
    def processes(self) -> Any:
        """Processes (see :meth:`processes_array`)."""
        return self._out(self.processes_array())

    # ------------------------------------------------------------------ questions

    def state_at(self, t: float) -> Any:
        """Who held what at ``t`` seconds after the recording started: one row per live piece.

        Columns: pid, gpu (-1 host), category, size, address (pointer, or the VMM handle), since_s
        and since_wall (when it was made), api, peer (ipc_mapped: the exporter's pid), and two
        phases, named apart:

        - ``phase``: the phase its owner was in when it **allocated** it: who is holding this
          memory, the rule of docs/report.md "Phases" that the report's "held ..., by phase" lines
          and the TUI's holders use;
        - ``phase_at_t``: the phase its owner is in **at** ``t`` (what it was doing then).

        Starts from the latest keyframe at or before ``t`` and replays only the rest.
        """
        ts = self.start + int(round(t * 1e9))
        ev = self.timeline.events
        index = int(np.searchsorted(ev["ts"], ts, side="right")) if len(ev) else 0
        state = state_at(ev, index, self.trace.keyframes)
        rows = sorted(state.holdings(), key=lambda h: (h.gpu, h.pid, -h.size, h.address))
        n = len(rows)
        pids = np.array([h.pid for h in rows], dtype=np.int64)
        made = np.array([h.ts for h in rows], dtype=np.int64)
        made_in = self.phases.assign(pids, made) if n else np.zeros(0, np.int64)
        now_in = self.phases.assign(pids, np.full(n, ts, dtype=np.int64)) if n else np.zeros(0, np.int64)
        cols = {
            "pid": pids, "gpu": [h.gpu for h in rows], "category": [h.category for h in rows],
            "size": [h.size for h in rows], "address": [h.address for h in rows],
            "since_s": self._t_s(made), "since_wall": self.wall(made), "api": [api_name(h.api) for h in rows],
            "peer": [h.peer for h in rows], "phase": [self.phases.label(int(i)) for i in made_in.tolist()],
            "phase_at_t": [self.phases.label(int(i)) for i in now_in.tolist()],
        }
        types = {"pid": "<i8", "gpu": "<i2", "category": _STR, "size": "<i8", "address": "<u8", "since_s": "<f8",
                 "since_wall": _WALL, "api": _STR, "peer": "<i8", "phase": _STR, "phase_at_t": _STR}
        return self._out(_table(cols, types, n))

    def by_phase(self) -> Any:
        """Bytes each phase allocated and freed per process, GPU and category (see :meth:`by_phase_array`)."""
        return self._out(self.by_phase_array())

    def by_phase_array(self) -> np.ndarray:
        """Bytes each phase allocated and freed, per process, GPU and category (the report's "by phase").

        One row per (phase, pid, gpu, category) with ``allocated``, ``freed`` and ``net``; changes
        outside any phase of their process are in ``(no phase)``; ``owned`` is False for
        ipc_mapped (a peer's memory, in the importer's view).
        """
        # the usage and the phases as columns: a step loop's 25,000 phases, no object per row
        usage = self._pass().usage if self._events is not None else attribute_table(self.phases, self.timeline.journal)
        table = self.phases.table
        ids = usage.phase
        if len(table):
            starts = np.where(ids >= 0, table.start[np.maximum(ids, 0)], -1)
            ends = np.where(ids >= 0, table.end[np.maximum(ids, 0)], -1)
        else:
            starts = ends = np.full(len(ids), -1, dtype=np.int64)
        category = np.array(CATEGORIES, dtype=object)[usage.category]
        cols = {
            "phase": [self.phases.label(i) for i in ids.tolist()],
            "start_s": np.where(starts >= 0, (starts - self.start) / 1e9, np.nan),
            "end_s": np.where(ends >= 0, (ends - self.start) / 1e9, np.nan),
            "start_wall": self.wall(starts), "end_wall": self.wall(ends),
            "pid": usage.pid, "rank": [self.ranks.get(pid, "") for pid in usage.pid.tolist()],
            "gpu": usage.gpu, "category": category,
            "allocated": usage.allocated, "freed": usage.freed,
            "net": usage.allocated - usage.freed,
            "owned": np.isin(usage.category, OWNED_CATEGORIES),
        }
        types = {"phase": _STR, "start_s": "<f8", "end_s": "<f8", "start_wall": _WALL, "end_wall": _WALL, "pid": "<i8", "rank": _STR, "gpu": "<i2",
                 "category": _STR, "allocated": "<i8", "freed": "<i8", "net": "<i8", "owned": "?"}
        return _table(cols, types, len(usage))

    def reconciliation(self) -> Reconciliation:
        """NVML vs traced, as series (:class:`memrec.analysis.untraced.reconcile.Reconciliation`)."""
        return reconcile(self.trace, self.timeline)

    def reconcile(self) -> Any:
        """NVML beside the traced bytes at every NVML sample: one row per (sample, process or GPU).

        ``pid`` is -1 for the whole GPU's row (NVML ``used`` vs every traced process's owned bytes);
        ``untraced = nvml_used - traced`` (context, modules, pools, other processes; negative
        when NVML lags the driver calls).
        """
        rec = self.reconciliation()
        parts = []
        for (g, p), s in sorted(rec.processes.items()):
            parts.append((g, p, s.ts, s.nvml_used, s.traced, s.untraced))
        for g, d in sorted(rec.devices.items()):
            parts.append((g, -1, d.ts, d.used, d.traced, d.untraced))
        n = sum(len(x[2]) for x in parts)
        cols: dict[str, Any] = {k: np.zeros(n, dtype=np.int64) for k in ("ts", "gpu", "pid", "nvml_used", "traced",
                                                                          "untraced")}
        at = 0
        for g, p, ts, used, traced, untraced in parts:
            sl = slice(at, at + len(ts))
            cols["ts"][sl], cols["gpu"][sl], cols["pid"][sl] = ts, g, p
            cols["nvml_used"][sl], cols["traced"][sl], cols["untraced"][sl] = used, traced, untraced
            at += len(ts)
        cols = {"ts": cols["ts"], "t_s": self._t_s(cols["ts"]), "wall": self.wall(cols["ts"]),
                **{k: v for k, v in cols.items() if k != "ts"}}
        types = {k: "<i8" for k in cols}
        types.update(t_s="<f8", wall=_WALL, gpu="<i2")
        return self._out(_table(cols, types, n))

