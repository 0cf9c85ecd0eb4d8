"""Parquet and CSV: the tables of ``memrec.load`` as files pandas, polars and DuckDB read.

One file per table in an output folder (``events``, ``samples``, ``process_samples``,
``markers``, ``processes``, ``by_phase``). Parquet columns are typed (names as dictionary-encoded
strings, sizes and times as int64, ``t_s`` as float64); CSV has one header line and the same
columns, with integers written as integers.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from memrec._files import create_file
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
}


def tables(rec: Recording) -> dict[str, np.ndarray]:
    """Every table as a numpy structured array (string columns hold Python str)."""
    return {name: getattr(rec, method)() for name, method in TABLES.items()}


def table_files(folder: Path, suffix: str) -> dict[str, Path]:
    """Table name -> the file it is written to in ``folder`` (``<table>.<suffix>``), so a command can
    check them before anything is written."""
    return {name: folder / f"{name}.{suffix}" for name in TABLES}


def write_parquet(rec: Recording, folder: Path) -> list[Path]:
    """Write one ``<table>.parquet`` per table into ``folder``; return the paths written."""
    pa = require("pyarrow", "export", "--to parquet")
    pq = require("pyarrow.parquet", "export", "--to parquet")
    out = []
    files = table_files(folder, "parquet")
    for name, arr in tables(rec).items():
        columns = {}
        for field in arr.dtype.names:
            col = arr[field]
            if col.dtype == object:
                columns[field] = pa.array(col.tolist(), type=pa.string()).dictionary_encode()
            else:
                columns[field] = pa.array(col)
        path = files[name]
        with create_file(path) as f:
            pq.write_table(pa.table(columns), f)
        out.append(path)
    return out


def write_csv(rec: Recording, folder: Path) -> list[Path]:
    """Write one ``<table>.csv`` per table into ``folder``; return the paths written."""
    out = []
    files = table_files(folder, "csv")
    for name, arr in tables(rec).items():
        path = files[name]
        with create_file(path, text=True) as f:
            writer = csv.writer(f)
            writer.writerow(arr.dtype.names)
            floats = [i for i, k in enumerate(arr.dtype.names) if arr.dtype[k].kind == "f"]
            for row in arr.tolist():
                if floats:
                    row = list(row)
                    for i in floats:
                        row[i] = "" if row[i] != row[i] else f"{row[i]:.9f}"  # NaN: empty
                writer.writerow(row)
        out.append(path)
    return out
