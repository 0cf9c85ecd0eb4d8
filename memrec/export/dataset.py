"""A fleet's recordings as one dataset: Parquet tables, Hive-partitioned by host and day.

``memrec export --to dataset DIR`` and the daemon's ``--dataset DIR`` write here; ``memrec sql``
(DuckDB), Spark, Trino and ClickHouse read it (docs/format.md, "The dataset"). One trace part
(one ``.mrec`` file) becomes one Parquet file in each table::

    DIR/_memrec_dataset.json                     {"memrec_dataset": 2, "tables": [...]}
    DIR/<table>/host=<host>/day=<YYYY-MM-DD>/<trace_id>-<part>.parquet

The file name is fixed by the trace (its recording id and part), so exporting a trace again
replaces its files instead of adding rows twice: the export is idempotent and safe to re-run (each
file is written under a temporary name and renamed over the old one; readers see the old file or
the new, never half). Every table gets a file for every part, empty ones included, so a table's
folder exists and every file has the table's exact schema, which Spark's reader needs.

The rows come from the replay every command shares: :class:`memrec.api.Recording` (events,
markers, NVML samples, phases) and :func:`memrec.analysis.report.build.build_report` (peaks per process
and GPU, failed calls with who held what then). Every time is a CLOCK_MONOTONIC ``ts`` (ns) and a
wall-clock ``time`` (UTC, µs) from the header's anchor.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any
from typing import Iterator

import numpy as np

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.base.files import create_in
from memrec.base.files import open_folder
from memrec.base.jsontext import dumps
from memrec.export import require
from memrec.trace.clock import wall_offset_ns

if TYPE_CHECKING:  # the report is built on demand (its import is heavy)
    from memrec.analysis.report.model import FailedCall
    from memrec.engine.source import TraceEvents

#: The layout's version (``_memrec_dataset.json``, and the ``schema_version`` of every trace row).
#: Adding a column keeps it; renaming, retyping or removing one, or a new partitioning, bumps it.
SCHEMA_VERSION = 2
#: The layout versions ``memrec sql`` reads (a folder of another is refused).
READ_VERSIONS = (1, 2)
#: What each version added to the one before: table -> its new columns (None: the whole table).
ADDED: dict[int, dict[str, tuple[str, ...] | None]] = {2: {"events": ("stack",), "stacks": None}}
MANIFEST = "_memrec_dataset.json"
#: Hive partition keys, in folder order.
PARTITIONS = ("host", "day")
#: The day of a trace without a wall-clock anchor (traces of memrec before the anchor existed).
NO_DAY = "1970-01-01"

_S, _I16, _I32, _I64, _F64, _B, _T = "string", "int16", "int32", "int64", "float64", "bool", "time"
#: The columns every table starts with: the trace and its part.
KEY_COLUMNS = (("trace_id", _S), ("part", _I32))
#: Rows of the events table built and written at a time (a row group each).
EVENT_ROWS = 1 << 20

#: Every table's columns (name, type), after the trace id and part; ``time`` is timestamp[us, UTC].
COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "traces": (
        ("schema_version", _I32), ("hostname", _S), ("boot_id", _S), ("file", _S), ("format_version", _S),
        ("created_by", _S), ("sglang_version", _S), ("start_ts", _I64), ("end_ts", _I64), ("start_time", _T),
        ("end_time", _T), ("duration_s", _F64), ("events", _I64), ("failed_calls", _I64), ("markers", _I64),
        ("nvml_samples", _I64), ("processes", _I64), ("lost", _I64), ("complete", _B), ("gpu_uuids", _S),
        ("peak_bytes", _I64), ("clock_synchronized", _B), ("clock_maxerror_us", _I64),
    ),
    "gpus": (
        ("gpu", _I16), ("gpu_uuid", _S), ("name", _S), ("total", _I64), ("peak_bytes", _I64), ("peak_ts", _I64),
        ("peak_time", _T), ("final_bytes", _I64),
    ),
    "processes": (
        ("pid", _I64), ("ppid", _I64), ("job", _S), ("rank", _S), ("name", _S), ("cmdline", _S),
        ("cuda_visible_devices", _S), ("sglang_version", _S), ("first_ts", _I64), ("first_time", _T),
        ("exit_time", _T), ("gpus", _S), ("peak_bytes", _I64), ("peak_gpu", _I16), ("peak_gpu_uuid", _S),
        ("peak_time", _T), ("final_bytes", _I64),
    ),
    "events": (
        ("ts", _I64), ("time", _T), ("pid", _I64), ("tid", _I64), ("job", _S), ("rank", _S), ("kind", _S),
        ("api", _S), ("result", _I32), ("result_name", _S), ("gpu", _I16), ("gpu_uuid", _S), ("ordinal", _I32),
        ("size", _I64), ("ptr", _I64), ("handle", _I64), ("aux", _I64), ("flags", _I64), ("peer", _I64),
        ("phase", _S), ("stack", _I64),
    ),
    "stacks": (
        ("stack", _I64), ("depth", _I32), ("file", _S), ("line", _I64), ("function", _S), ("native", _B),
        ("site", _B), ("unavailable", _S),
    ),
    "markers": (
        ("ts", _I64), ("time", _T), ("pid", _I64), ("tid", _I64), ("job", _S), ("rank", _S), ("name", _S),
        ("phase", _S), ("gpu", _I16), ("gpu_uuid", _S), ("values", _S),
    ),
    "phases": (
        ("phase", _S), ("name", _S), ("start_ts", _I64), ("end_ts", _I64), ("start_time", _T), ("end_time", _T),
        ("pid", _I64), ("job", _S), ("rank", _S), ("sglang_version", _S), ("gpu", _I16), ("gpu_uuid", _S),
        ("category", _S), ("owned", _B), ("allocated", _I64), ("freed", _I64), ("net", _I64),
    ),
    "samples": (
        ("ts", _I64), ("time", _T), ("gpu", _I16), ("gpu_uuid", _S), ("used", _I64), ("reserved", _I64),
        ("free", _I64), ("total", _I64), ("bar1_used", _I64), ("bar1_total", _I64),
    ),
    "process_samples": (
        ("ts", _I64), ("time", _T), ("gpu", _I16), ("gpu_uuid", _S), ("pid", _I64), ("used", _I64),
    ),
    "failures": (
        ("failure", _I64), ("ts", _I64), ("time", _T), ("pid", _I64), ("job", _S), ("rank", _S), ("kind", _S),
        ("api", _S), ("size", _I64), ("result", _I32), ("result_name", _S), ("gpu", _I16), ("gpu_uuid", _S),
        ("gpu_inferred", _B), ("phase", _S), ("nvml_free", _I64), ("owned_on_gpu", _I64), ("mapped_on_gpu", _I64),
    ),
    "failure_holders": (
        ("failure", _I64), ("holder_pid", _I64), ("holder_job", _S), ("holder_rank", _S), ("holder_name", _S),
        ("category", _S), ("owned", _B), ("bytes", _I64),
    ),
}
TABLES = tuple(COLUMNS)


def layout_columns(table: str, version: int) -> tuple[str, ...] | None:
    """The columns of ``table`` (after the key) in layout ``version``; None: no such table then."""
    names = tuple(name for name, _ in COLUMNS[table])
    for later in range(SCHEMA_VERSION, version, -1):
        added = ADDED.get(later, {})
        if table in added:
            if added[table] is None:
                return None
            names = tuple(n for n in names if n not in added[table])
    return names


def arrow_schema(table: str) -> Any:
    """The pyarrow schema of ``table`` (the key columns first)."""
    pa = require("pyarrow", "sql", "--to dataset")
    types = {_S: pa.string(), _I16: pa.int16(), _I32: pa.int32(), _I64: pa.int64(), _F64: pa.float64(),
             _B: pa.bool_(), _T: pa.timestamp("us", tz="UTC")}
    return pa.schema([(name, types[kind]) for name, kind in KEY_COLUMNS + COLUMNS[table]])


@dataclass(frozen=True)
class TracePart:
    """Where one trace file goes in the dataset: its recording, part, host and day."""

    trace_id: str
    part: int
    host: str  # the partition value (the host name made safe for a folder name)
    day: str

    @property
    def file_name(self) -> str:
        return f"{self.trace_id}-{self.part}.parquet"

    def folder(self, table: str) -> tuple[str, ...]:
        return (table, f"host={self.host}", f"day={self.day}")


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def partition_value(text: str) -> str:
    """A host name as a Hive partition value: the characters a folder name, a URL and every engine
    take as they are; anything else (``/``, ``=``, spaces) as ``_``."""
    return _UNSAFE.sub("_", text)[:200] or "_"


def trace_part(header: dict) -> TracePart:
    """The dataset identity of the trace whose header this is.

    The trace id is the daemon's recording id (every part of one recording shares it); a trace
    without one (written before it existed, or not by the daemon) gets a digest of what identifies
    its recording: host, boot and daemon pid for a daemon's parts, the wall-clock anchor otherwise.
    """
    daemon = header.get("daemon") if isinstance(header.get("daemon"), dict) else {}
    part = daemon.get("part", 0)
    part = part if isinstance(part, int) and not isinstance(part, bool) and part >= 0 else 0
    recording = header.get("recording_id")
    if not (isinstance(recording, str) and re.fullmatch(r"[0-9a-f]{8,64}", recording)):
        who = daemon.get("pid") if daemon else header.get("anchor")
        key = json.dumps([header.get("host"), header.get("boot_id"), who], sort_keys=True, default=str)
        recording = hashlib.sha256(key.encode()).hexdigest()[:16]
    offset = wall_offset_ns(header)
    anchor = header.get("anchor") or {}
    day = NO_DAY
    if offset is not None:
        start_ns = int(anchor["wall_ns"])
        day = datetime.fromtimestamp(start_ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d")
    return TracePart(recording, part, partition_value(str(header.get("host") or "unknown")), day)


# ------------------------------------------------------------------------------- building tables


def _lookup(keys: Any, mapping: dict[int, str]) -> np.ndarray:
    """``mapping[key]`` ("" when missing) for each key, as an object array: one lookup per
    distinct key (a million events have a few pids and GPUs)."""
    keys = np.asarray(keys, dtype=np.int64)
    distinct, index = np.unique(keys, return_inverse=True)
    return np.array([mapping.get(int(k), "") for k in distinct.tolist()], dtype=object)[index]


class _Builder:
    """The rows of every table for one trace part: :class:`memrec.api.Recording`'s tables and the
    report's dict (each replays the part once, with the same engine)."""

    def __init__(self, trace: Any, file_name: str, events: TraceEvents | None = None) -> None:
        from memrec.analysis.report.build import build_report
        from memrec.api import Recording

        self.trace = trace
        self.header = trace.header
        self.where = trace_part(self.header)
        self.file_name = file_name
        self.rec = Recording(trace, pandas=False, events=events)
        self.report = build_report(trace, events=events)
        self.offset = wall_offset_ns(self.header)
        self.uuids = {g.index: g.uuid or "" for g in trace.gpus}
        self.ranks = self.rec.ranks
        self.jobs = self._jobs()
        self.versions = self._sglang_versions()

    # ---------------------------------------------------------------- helpers

    def time(self, ts: Any) -> np.ndarray:
        """Wall-clock µs since the epoch of monotonic ``ts`` (ns); NaT-like None without an anchor."""
        ts = np.asarray(ts, dtype=np.int64)
        if self.offset is None:
            return np.full(len(ts), None, dtype=object)
        return (ts + self.offset) // 1000

    def uuid(self, gpus: Any) -> np.ndarray:
        return _lookup(gpus, self.uuids)

    def _jobs(self) -> dict[int, str]:
        """pid -> its job: the root of its process tree in this trace, as ``host:pid:start``.

        A job is what one launch started (an SGLang server and its schedulers): every process
        whose parent chain leads to the same first process. The root's start time keeps a reused
        pid apart; every part of a recording repeats the process records, so the id is the same
        in each part.
        """
        procs = self.trace.processes
        host = str(self.header.get("host") or "unknown")
        out: dict[int, str] = {}
        pids = set(procs) | set(self.rec.event_pids()) | {m.pid for m in self.trace.markers}
        for pid in pids:
            root, seen = pid, {pid}
            while root in procs and procs[root].ppid in procs and procs[root].ppid not in seen:
                root = int(procs[root].ppid)  # type: ignore[arg-type]
                seen.add(root)
            first = procs[root].first_ts if root in procs else None
            when = ""
            if first is not None and first >= 0 and self.offset is not None:
                when = datetime.fromtimestamp((first + self.offset) / 1e9, tz=timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            out[pid] = f"{host}:{root}:{when}"
        return out

    def _sglang_versions(self) -> dict[int, str]:
        """pid -> the SGLang version its markers name (``sglang_version``), inherited by the job."""
        own: dict[int, str] = {}
        for m in self.trace.markers:
            v = (m.values or {}).get("sglang_version")
            if isinstance(v, str) and m.pid not in own:
                own[m.pid] = v
        by_job = {self.jobs[p]: v for p, v in own.items() if p in self.jobs}
        return {p: own.get(p) or by_job.get(j, "") for p, j in self.jobs.items()}

    def job(self, pids: Any) -> np.ndarray:
        return _lookup(pids, self.jobs)

    def rank(self, pids: Any) -> np.ndarray:
        return _lookup(pids, self.ranks)

    # ---------------------------------------------------------------- tables

    def parts(self, name: str) -> Iterator[dict[str, Any]]:
        """One table's columns: the events :data:`EVENT_ROWS` at a time as a replay pass reads
        them (:meth:`memrec.api.Recording.event_parts`; their rows whole, and Arrow's copy of
        them, grew with the trace: the export streams them into row groups), the other tables
        whole (they grow with markers, samples and processes); always one part at least."""
        if name != "events":
            yield getattr(self, name)()
            return
        for rows in self.rec.event_parts(EVENT_ROWS):
            yield self.events(rows)

    def traces(self) -> dict[str, Any]:
        t = self.report.trace
        h = self.header
        sync = h.get("clock_sync") if isinstance(h.get("clock_sync"), dict) else {}
        peaks = [s.peak.bytes for s in self.report.gpus]
        versions = sorted({v for v in self.versions.values() if v})
        return {
            "schema_version": [SCHEMA_VERSION], "hostname": [str(h.get("host") or "")],
            "boot_id": [str(h.get("boot_id") or "")], "file": [self.file_name],
            "format_version": [f"{h.get('version')}.{h.get('minor', 0)}"], "created_by": [str(h.get("created_by") or "")],
            "sglang_version": [",".join(versions)], "start_ts": [t.start_ts], "end_ts": [t.end_ts],
            "start_time": self.time([t.start_ts]), "end_time": self.time([t.end_ts]),
            "duration_s": [t.duration_s], "events": [t.events], "failed_calls": [t.failed_calls_all],
            "markers": [t.markers], "nvml_samples": [t.nvml_samples], "processes": [t.processes],
            "lost": [t.lost], "complete": [t.complete],
            "gpu_uuids": [",".join(u for _, u in sorted(self.uuids.items()) if u)],
            "peak_bytes": [max(peaks, default=0)],
            "clock_synchronized": [sync.get("synchronized") if sync else None],
            "clock_maxerror_us": [sync.get("maxerror_us") if sync else None],
        }

    def gpus(self) -> dict[str, Any]:
        secs = self.report.gpus
        peak_ts = [s.peak.ts for s in secs]
        return {
            "gpu": [s.gpu for s in secs], "gpu_uuid": [s.uuid or self.uuids.get(s.gpu, "") for s in secs],
            "name": [s.name or "" for s in secs], "total": [s.total for s in secs],
            "peak_bytes": [s.peak.bytes for s in secs], "peak_ts": peak_ts, "peak_time": self.time(peak_ts),
            "final_bytes": [s.final.bytes for s in secs],
        }

    def processes(self) -> dict[str, Any]:
        procs = self.report.processes
        best: dict[int, tuple[int, int, int, int]] = {}  # pid -> (peak, gpu, ts, final)
        for s in self.report.gpus:
            for row in s.processes:
                if row.peak > best.get(row.pid, (-1,))[0]:
                    best[row.pid] = (row.peak, s.gpu, row.peak_ts, row.final)
        pids = [p.pid for p in procs]
        info = self.trace.processes
        first = [info[p].first_ts if p in info else -1 for p in pids]
        peak = [best.get(p, (0, -1, -1, 0)) for p in pids]
        exit_ts = [p.exit_ts for p in procs]
        return {
            "pid": pids, "ppid": [p.ppid if p.ppid is not None else -1 for p in procs], "job": self.job(pids),
            "rank": [p.rank for p in procs], "name": [p.short for p in procs],
            "cmdline": [" ".join(p.cmdline) for p in procs],
            "cuda_visible_devices": [p.cuda_visible_devices or "" for p in procs],
            "sglang_version": [self.versions.get(p, "") for p in pids],
            "first_ts": first, "first_time": self._times_or_null(first),
            "exit_time": self._times_or_null(exit_ts), "gpus": [",".join(map(str, p.gpus)) for p in procs],
            "peak_bytes": [b for b, _, _, _ in peak], "peak_gpu": [g for _, g, _, _ in peak],
            "peak_gpu_uuid": [self.uuids.get(g, "") for _, g, _, _ in peak],
            "peak_time": self._times_or_null([t for _, _, t, _ in peak]), "final_bytes": [f for _, _, _, f in peak],
        }

    def _times_or_null(self, ts: list) -> list:
        """Wall-clock µs of each ``ts``, None where it is unknown (None or negative)."""
        return [None if t is None or t < 0 or self.offset is None else (int(t) + self.offset) // 1000 for t in ts]

    def events(self, ev: np.ndarray) -> dict[str, Any]:
        """The events table's columns of ``ev``, rows of :meth:`memrec.api.Recording.event_rows`."""
        out = {name: ev[name] for name in ("ts", "pid", "tid", "kind", "api", "result", "result_name", "gpu",
                                           "ordinal", "size", "peer", "phase")}
        for name in ("ptr", "handle", "aux"):
            out[name] = ev[name].view(np.int64)  # two's complement: Spark has no unsigned 64-bit type
        out["flags"] = ev["flags"].astype(np.int64)
        out["time"] = self.time(ev["ts"])
        out["job"], out["rank"], out["gpu_uuid"] = self.job(ev["pid"]), self.rank(ev["pid"]), self.uuid(ev["gpu"])
        # the stacks table's id; 0: none (a trace recorded without stacks has no column)
        out["stack"] = ev["stack"] if "stack" in (ev.dtype.names or ()) else np.zeros(len(ev), np.int64)
        return out

    def stacks(self) -> dict[str, Any]:
        """The stacks the events name, one row per frame (``memrec.load``'s ``stacks`` table)."""
        st = self.rec.stacks_array()
        return {name: st[name] for name, _ in COLUMNS["stacks"]}

    def markers(self) -> dict[str, Any]:
        mk = sorted(self.trace.markers, key=lambda m: m.ts)
        ts = [m.ts for m in mk]
        pids = [m.pid for m in mk]
        gpus = [-1 if m.gpu is None else m.gpu for m in mk]
        return {
            "ts": ts, "time": self.time(ts), "pid": pids, "tid": [m.tid for m in mk], "job": self.job(pids),
            "rank": self.rank(pids), "name": [m.name for m in mk], "phase": [m.phase for m in mk], "gpu": gpus,
            "gpu_uuid": self.uuid(gpus),
            "values": [dumps(m.values or {}, sort_keys=True, default=str) for m in mk],
        }

    def phases(self) -> dict[str, Any]:
        bp = self.rec.by_phase_array()
        start = [self.rec.start + int(round(s * 1e9)) if s == s else -1 for s in bp["start_s"].tolist()]
        end = [self.rec.start + int(round(s * 1e9)) if s == s else -1 for s in bp["end_s"].tolist()]
        labels = bp["phase"].tolist()
        return {
            "phase": labels, "name": [p.rsplit("/", 1)[-1] for p in labels], "start_ts": start, "end_ts": end,
            "start_time": self._times_or_null(start), "end_time": self._times_or_null(end), "pid": bp["pid"],
            "job": self.job(bp["pid"]), "rank": bp["rank"], "gpu": bp["gpu"], "gpu_uuid": self.uuid(bp["gpu"]),
            "sglang_version": [self.versions.get(int(p), "") for p in bp["pid"].tolist()],
            "category": bp["category"], "owned": bp["owned"], "allocated": bp["allocated"], "freed": bp["freed"],
            "net": bp["net"],
        }

    def samples(self) -> dict[str, Any]:
        nv = self.trace.nvml
        out = {k: nv[k] for k in ("ts", "gpu", "used", "reserved", "free", "total", "bar1_used", "bar1_total")}
        out["time"], out["gpu_uuid"] = self.time(nv["ts"]), self.uuid(nv["gpu"])
        return out

    def process_samples(self) -> dict[str, Any]:
        pm = self.trace.procmem
        out = {k: pm[k] for k in ("ts", "gpu", "pid", "used")}
        out["time"], out["gpu_uuid"] = self.time(pm["ts"]), self.uuid(pm["gpu"])
        return out

    def _failures(self) -> list[FailedCall]:
        return sorted(self.report.failures(), key=lambda f: f.index)

    def failures(self) -> dict[str, Any]:
        fs = self._failures()
        pids = [f.pid for f in fs]
        ts = [f.ts for f in fs]
        gpus = [f.gpu for f in fs]
        return {
            "failure": [f.index for f in fs], "ts": ts, "time": self.time(ts), "pid": pids, "job": self.job(pids),
            "rank": self.rank(pids), "kind": [f.kind for f in fs], "api": [f.api for f in fs],
            "size": [f.size for f in fs], "result": [f.result for f in fs],
            "result_name": [f.result_name for f in fs], "gpu": gpus, "gpu_uuid": self.uuid(gpus),
            "gpu_inferred": [f.gpu_inferred for f in fs], "phase": [f.phase or "" for f in fs],
            "nvml_free": [f.nvml_free for f in fs],
            "owned_on_gpu": [f.held.owned_on_gpu if f.held is not None else None for f in fs],
            "mapped_on_gpu": [f.held.mapped_on_gpu if f.held is not None else None for f in fs],
        }

    def failure_holders(self) -> dict[str, Any]:
        names = {p.pid: p.short for p in self.report.processes}
        rows = [(f.index, h.pid, cat, b)
                for f in self._failures() if f.held is not None
                for h in f.held.holders for cat, b in h.by_category.items()]
        pids = [r[1] for r in rows]
        return {
            "failure": [r[0] for r in rows], "holder_pid": pids, "holder_job": self.job(pids),
            "holder_rank": self.rank(pids), "holder_name": [names.get(p, "") for p in pids],
            "category": [r[2] for r in rows], "owned": [r[2] != "ipc_mapped" for r in rows],
            "bytes": [r[3] for r in rows],
        }


def build_tables(trace: Any, file_name: str = "", events: TraceEvents | None = None) -> tuple[TracePart, dict[str, Iterator[Any]]]:
    """Every table of one trace part as pyarrow Tables with the table's exact schema: table name ->
    its parts in row order (the events a slice at a time, :meth:`_Builder.parts`), built as they
    are written. ``events``: the trace's events when ``trace`` holds none (read from the file a
    record at a time: :func:`memrec.engine.source.scan_trace`)."""
    pa = require("pyarrow", "sql", "--to dataset")
    builder = _Builder(trace, file_name, events)
    return builder.where, {name: _arrow_parts(pa, builder, name) for name in TABLES}


def _arrow_parts(pa: Any, builder: _Builder, name: str) -> Iterator[Any]:
    schema = arrow_schema(name)
    where = builder.where
    for columns in builder.parts(name):
        n = len(next(iter(columns.values()))) if columns else 0
        arrays = [pa.array([where.trace_id] * n, pa.string()), pa.array(np.full(n, where.part, np.int32))]
        for field in list(schema)[2:]:
            values = columns[field.name]
            if isinstance(values, np.ndarray) and values.dtype == object:
                values = values.tolist()
            arrays.append(pa.array(values, type=field.type) if len(values) else pa.array([], field.type))
        yield pa.Table.from_arrays(arrays, schema=schema)


# ------------------------------------------------------------------------------- writing


def check_manifest(root: Path, write: bool = True) -> int | None:
    """The layout version of the dataset at ``root`` (None: no dataset there yet). A folder of
    another version (or a damaged manifest) is refused: for ``write``, any but this memrec's
    version; for reading, any outside :data:`READ_VERSIONS`.

    Raises:
        MemrecCommandError: the manifest says another version, or cannot be read (DATA).
    """
    path = root / MANIFEST
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # a link there is no manifest
    except FileNotFoundError:
        return None
    except OSError as error:
        raise MemrecCommandError(f"{path}: not a memrec dataset manifest ({error.strerror})",
                                 exit_code=ExitCode.DATA) from error
    try:
        with os.fdopen(fd, "rb") as f:
            manifest = json.loads(f.read(1 << 20))
    except (OSError, ValueError) as error:
        raise MemrecCommandError(f"{path}: not a memrec dataset manifest ({error})", exit_code=ExitCode.DATA) from error
    version = manifest.get("memrec_dataset") if isinstance(manifest, dict) else None
    if isinstance(version, bool):  # JSON's true is no version (though Python's True == 1)
        version = str(version).lower()
    if write and version != SCHEMA_VERSION and version in READ_VERSIONS:
        raise MemrecCommandError(
            f"{root}: a memrec dataset of layout version {version}; this memrec writes version {SCHEMA_VERSION} "
            f"(export into another folder; memrec sql reads both together: memrec sql {root} NEW)",
            exit_code=ExitCode.DATA)
    if version not in READ_VERSIONS:
        raise MemrecCommandError(
            f"{root}: a memrec dataset of layout version {version!r}; this memrec writes version {SCHEMA_VERSION} "
            f"and reads versions {', '.join(map(str, READ_VERSIONS))} (export into another folder)",
            exit_code=ExitCode.DATA)
    return version


def _write_atomic(dir_fd: int, name: str, write: Any) -> None:
    """Write ``name`` in ``dir_fd`` through a fresh temporary file renamed over it: a reader sees
    the old file or the new one; a link at ``name`` is replaced, never followed."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd, _ = create_in(dir_fd, tmp, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def _write_parquet(pq: Any, parts: Iterator[Any], f: Any) -> None:
    """A table's parts as row groups of one file. Zstandard, and the integer columns that grow
    steadily (times, ns, pointers) delta-encoded: bench/bench_dataset.py's day of 32,105 events
    takes 267 KiB where dictionaries took 468 KiB."""
    writer = None
    for table in parts:
        if writer is None:
            delta = [f.name for f in table.schema
                     if f.name in ("ts", "time", "ptr") or f.name.endswith(("_ts", "_time"))]
            writer = pq.ParquetWriter(f, table.schema, compression="zstd",
                                      use_dictionary=[c for c in table.column_names if c not in delta],
                                      column_encoding=dict.fromkeys(delta, "DELTA_BINARY_PACKED"))
        writer.write_table(table)
    writer.close()


def _write_manifest(root_fd: int) -> None:
    from memrec.base.version import __version__

    try:
        os.stat(MANIFEST, dir_fd=root_fd, follow_symlinks=False)
        return
    except FileNotFoundError:
        pass
    body = {"memrec_dataset": SCHEMA_VERSION, "partitioning": list(PARTITIONS), "tables": list(TABLES),
            "written_by": f"memrec {__version__}"}
    _write_atomic(root_fd, MANIFEST, lambda f: f.write((json.dumps(body, indent=1) + "\n").encode()))


def write_trace(trace: Any, root: Path, file_name: str = "", events: TraceEvents | None = None
                ) -> tuple[TracePart, list[Path]]:
    """Write (or replace) one trace part's files in the dataset at ``root``; return them.
    ``events``: as :func:`build_tables`'.

    Raises:
        MemrecCommandError: ``root`` holds a dataset of another layout version.
        OSError: a folder or file cannot be made (a symbolic link in the way: ELOOP / ENOTDIR).
    """
    pq = require("pyarrow.parquet", "sql", "--to dataset")
    check_manifest(root)
    where, tables = build_tables(trace, file_name, events)
    root_fd = open_folder(root, create=True, parents=True, mode=0o755)
    written = []
    try:
        _write_manifest(root_fd)
        for name, table in tables.items():
            path = root.joinpath(*where.folder(name), where.file_name)
            try:
                fd = open_folder(root, *where.folder(name), create=True, parents=True, mode=0o755)
                try:
                    _write_atomic(fd, where.file_name, lambda f, t=table: _write_parquet(pq, t, f))  # written as built
                finally:
                    os.close(fd)
            except OSError as error:  # named by the whole path (the calls name the last part)
                raise OSError(error.errno, error.strerror, os.fspath(path)) from error
            written.append(path)
    finally:
        os.close(root_fd)
    return where, written
