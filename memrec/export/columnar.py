"""Parquet and CSV: the tables of ``memrec.load`` as files pandas, polars and DuckDB read.

One file per table in an output folder (``events``, ``samples``, ``process_samples``,
``markers``, ``processes``, ``by_phase``, and ``stacks`` for a trace with stacks, whose events
then have a ``stack`` column). Parquet columns are typed (names as dictionary-encoded
strings, sizes and times as int64, ``t_s`` as float64, the wall-clock columns as UTC timestamps
in ns, ``markers.values`` as JSON text); CSV has one header line and the same columns, with
integers written as integers and wall-clock times as ISO 8601 (``2026-12-01T23:40:00.123456789Z``).

:func:`table_parts` is the one place the tables are built (from :class:`memrec.api.Recording`;
the events table a slice of rows at a time, as the replay reads them: its 132-byte rows are
never whole, nor the events they come from);
:func:`arrow_table` turns one into a typed Arrow table, for any writer of Parquet.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any
from typing import Iterator

import numpy as np

from memrec.base.files import create_output
from memrec.api import Recording
from memrec.export import require

#: Table name -> the Recording method that builds it as a numpy structured array.
TABLES = {
    "events": "events_array",
    "samples": "samples_array",
    "process_samples": "process_samples_array",
    "markers": "markers_array",
    "processes": "processes_array",
    "by_phase": "by_phase_array",
    "stacks": "stacks_array",
}


#: Rows of the events table built and written at a time: the exports stream it (its 132 bytes a
#: row were 1.3 GB at 10M events, and Arrow's and CSV's copies of it as much again).
SLICE_ROWS = 1 << 20
#: Rows a CSV writer turns into Python tuples at a time.
CSV_ROWS = 1 << 16


def table_names(rec: Recording) -> list[str]:
    """The tables an export of ``rec`` writes: ``stacks`` only for a trace with stacks (an older
    trace exports the files it always did)."""
    return [name for name in TABLES if name != "stacks" or rec.has_stacks]


def table_parts(rec: Recording, name: str) -> Iterator[np.ndarray]:
    """One table as numpy structured arrays (string columns hold Python str): consecutive slices
    of rows, the events table :data:`SLICE_ROWS` at a time as a replay pass reads them
    (:meth:`Recording.event_parts`: from the file a record at a time), the others whole (they
    grow with samples, markers and processes, not with events); always at least one part, so
    that an empty table still has its columns."""
    if name != "events":
        yield getattr(rec, TABLES[name])()
        return
    yield from rec.event_parts(SLICE_ROWS)


def table_files(folder: Path, suffix: str) -> dict[str, Path]:
    """Table name -> the file it is written to in ``folder`` (``<table>.<suffix>``), so a command can
    check them before anything is written."""
    return {name: folder / f"{name}.{suffix}" for name in TABLES}


def arrow_table(arr: np.ndarray) -> Any:
    """One table (a structured array of :func:`table_parts`) as a typed ``pyarrow.Table``: strings
    dictionary-encoded, wall-clock columns ``timestamp[ns, UTC]``, everything else as numpy has it."""
    pa = require("pyarrow", "export", "--to parquet")
    columns = {}
    for field in arr.dtype.names:
        col = arr[field]
        if col.dtype == object:
            columns[field] = pa.array(col, type=pa.string()).dictionary_encode()
        elif col.dtype.kind == "M":
            columns[field] = pa.array(col, type=pa.timestamp("ns", tz="UTC"))
        else:
            columns[field] = pa.array(col)
    return pa.table(columns)


def write_parquet(rec: Recording, folder: Path) -> list[Path]:
    """Write one ``<table>.parquet`` per table into ``folder``, a table's slices as row groups
    (:func:`table_parts`); return the paths written."""
    pq = require("pyarrow.parquet", "export", "--to parquet")
    out = []
    files = table_files(folder, "parquet")
    for name in table_names(rec):
        path = files[name]
        with create_output(path) as f:
            writer = None
            try:
                for part in table_parts(rec, name):
                    table = arrow_table(part)
                    if writer is None:  # each slice's strings have their own dictionary; the type is one
                        writer = pq.ParquetWriter(f, table.schema)
                    writer.write_table(table)
            finally:  # also when stopped: its __del__ would write into the closed file, "Exception ignored"
                if writer is not None:
                    writer.close()
        out.append(path)
    return out


def write_csv(rec: Recording, folder: Path) -> list[Path]:
    """Write one ``<table>.csv`` per table into ``folder``, :data:`CSV_ROWS` rows turned into text
    at a time; return the paths written."""
    out = []
    files = table_files(folder, "csv")
    for name in table_names(rec):
        path = files[name]
        with create_output(path, text=True) as f:
            writer = csv.writer(f)
            for k, arr in enumerate(table_parts(rec, name)):
                if k == 0:
                    writer.writerow(arr.dtype.names)
                floats = [i for i, key in enumerate(arr.dtype.names) if arr.dtype[key].kind == "f"]
                stamps = [i for i, key in enumerate(arr.dtype.names) if arr.dtype[key].kind == "M"]
                for lo in range(0, len(arr), CSV_ROWS):
                    part = arr[lo:lo + CSV_ROWS]
                    walls = {i: _iso(part[arr.dtype.names[i]]) for i in stamps}
                    for n, row in enumerate(part.tolist()):
                        if floats or walls:
                            row = list(row)
                            for i in floats:
                                row[i] = "" if row[i] != row[i] else f"{row[i]:.9f}"  # NaN: empty
                            for i, text in walls.items():
                                row[i] = text[n]
                        writer.writerow(row)
        out.append(path)
    return out


def _iso(col: np.ndarray) -> list[str]:
    """Wall-clock datetime64[ns] as ISO 8601 UTC text, ns precision; NaT (no anchor) as empty."""
    text = np.datetime_as_string(col, unit="ns", timezone="UTC")
    return ["" if t == "NaT" else t for t in text.tolist()]
