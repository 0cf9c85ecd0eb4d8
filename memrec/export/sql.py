"""SQL over the dataset (:mod:`memrec.export.dataset`): named queries, DuckDB here, Spark anywhere.

The named queries answer the fleet's questions (which jobs failed to allocate and what held the
memory, the peak per job and rank, which phase grew between two SGLang releases). They are
written in the SQL that DuckDB and Spark SQL both accept (joins, GROUP BY, CASE, window
functions, ``DATE 'YYYY-MM-DD'`` literals; no engine's own functions), against one view per
table named as the table, so the same text runs in ``memrec sql`` and on a Spark cluster
(:func:`register_spark`; tests/unit/test_dataset_spark.py runs them on a local Spark session).

Parameters (``--set since=2026-11-24``) are put into the text as SQL literals after a strict
check of their form, since the two engines bind parameters differently.
"""

from __future__ import annotations

import glob
import re
import shutil
import tempfile
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import Iterator

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.export import require
from memrec.export.dataset import COLUMNS
from memrec.export.dataset import KEY_COLUMNS
from memrec.export.dataset import MANIFEST
from memrec.export.dataset import READ_VERSIONS
from memrec.export.dataset import SCHEMA_VERSION
from memrec.export.dataset import TABLES
from memrec.export.dataset import arrow_schema
from memrec.export.dataset import check_manifest
from memrec.export.dataset import layout_columns


@dataclass(frozen=True)
class Param:
    """A named query's parameter: the form its value must have, and its default (None: required)."""

    pattern: str
    default: str | None
    help: str


_DATE = Param(r"\d{4}-\d{2}-\d{2}", "1970-01-01", "only days from this one on (YYYY-MM-DD)")
_RELEASE = r"[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}"


@dataclass(frozen=True)
class NamedQuery:
    """One question the dataset answers, as SQL both DuckDB and Spark run."""

    help: str
    sql: str
    params: dict[str, Param] = field(default_factory=dict)


#: Each process's rank and SGLang release as any part of its recording names them: the markers
#: that name them come once, at start-up, so a later part of a rotated recording has them only here.
_KNOWN = """WITH known AS (
    SELECT trace_id, pid, COALESCE(MAX(NULLIF(rank, '')), '') AS rank,
           COALESCE(MAX(NULLIF(sglang_version, '')), '') AS sglang_version
    FROM processes GROUP BY trace_id, pid)"""

_HOLDER_RANKED = """
    SELECT trace_id, part, failure, holder_pid, holder_name, held,
           ROW_NUMBER() OVER (PARTITION BY trace_id, part, failure ORDER BY held DESC, holder_pid) AS n
    FROM (SELECT trace_id, part, failure, holder_pid, holder_name, CAST(SUM(bytes) AS BIGINT) AS held
          FROM failure_holders WHERE owned
          GROUP BY trace_id, part, failure, holder_pid, holder_name) held_by"""

NAMED: dict[str, NamedQuery] = {
    "fleet": NamedQuery(
        "per day: hosts, trace parts, events, failed calls, lost events, incomplete parts, the highest GPU peak",
        """
SELECT day, COUNT(DISTINCT host) AS hosts, COUNT(*) AS parts, CAST(SUM(events) AS BIGINT) AS events,
       CAST(SUM(failed_calls) AS BIGINT) AS failed_calls, CAST(SUM(lost) AS BIGINT) AS lost,
       CAST(SUM(CASE WHEN complete THEN 0 ELSE 1 END) AS BIGINT) AS incomplete, MAX(peak_bytes) AS peak_bytes
FROM traces
WHERE day >= DATE '{since}'
GROUP BY day
ORDER BY day""",
        {"since": _DATE},
    ),
    "failures": NamedQuery(
        "every failed allocation: host, job, rank, call, size, phase, and the process that held the most then",
        f"""{_KNOWN}
SELECT f.day, f.host, f.job, COALESCE(NULLIF(k.rank, ''), f.rank) AS rank, f.pid, f.time, f.api, f.size,
       f.result_name, f.gpu_uuid, f.phase, f.owned_on_gpu, h.holder_pid AS top_holder_pid,
       kh.rank AS top_holder_rank, h.holder_name AS top_holder, h.held AS top_holder_bytes
FROM failures f
LEFT JOIN known k ON k.trace_id = f.trace_id AND k.pid = f.pid
LEFT JOIN ({_HOLDER_RANKED}
) h ON h.trace_id = f.trace_id AND h.part = f.part AND h.failure = f.failure AND h.n = 1
LEFT JOIN known kh ON kh.trace_id = h.trace_id AND kh.pid = h.holder_pid
WHERE f.day >= DATE '{{since}}'
ORDER BY f.time, f.host, f.pid, f.trace_id, f.part, f.failure""",  # the last three: a total order (ties are equal times)
        {"since": _DATE},
    ),
    "holders": NamedQuery(
        "who held what at each failed allocation: one row per holder and category",
        f"""{_KNOWN}
SELECT f.host, f.job, COALESCE(NULLIF(k.rank, ''), f.rank) AS rank, f.time, f.api, f.size, f.gpu_uuid,
       h.holder_pid, COALESCE(NULLIF(kh.rank, ''), h.holder_rank) AS holder_rank, h.holder_name, h.category,
       h.bytes
FROM failures f
JOIN failure_holders h ON h.trace_id = f.trace_id AND h.part = f.part AND h.failure = f.failure
LEFT JOIN known k ON k.trace_id = f.trace_id AND k.pid = f.pid
LEFT JOIN known kh ON kh.trace_id = h.trace_id AND kh.pid = h.holder_pid
WHERE f.day >= DATE '{{since}}'
ORDER BY f.time, f.host, h.bytes DESC, h.holder_pid, h.category, f.trace_id, f.part, f.failure""",
        {"since": _DATE},
    ),
    "peaks": NamedQuery(
        "the peak of each job and rank (its highest owned bytes on one GPU), highest first",
        f"""{_KNOWN}
SELECT host, job, rank, pid, name, sglang_version, peak_bytes, peak_time, peak_gpu_uuid
FROM (SELECT p.host, p.job, k.rank, p.pid, p.name, k.sglang_version, p.peak_bytes, p.peak_time,
             p.peak_gpu_uuid,
             ROW_NUMBER() OVER (PARTITION BY p.job, k.rank ORDER BY p.peak_bytes DESC, p.peak_time) AS n
      FROM processes p
      JOIN known k ON k.trace_id = p.trace_id AND k.pid = p.pid
      WHERE p.peak_bytes > 0 AND p.day >= DATE '{{since}}') ranked
WHERE n = 1
ORDER BY peak_bytes DESC, job, rank""",
        {"since": _DATE},
    ),
    "phase-growth": NamedQuery(
        "which phase grew between two SGLang releases: its average net bytes per process in each, largest growth first",
        """
SELECT name, category,
       CAST(FLOOR(AVG(CASE WHEN sglang_version = '{old}' THEN net END)) AS BIGINT) AS old_bytes,
       CAST(FLOOR(AVG(CASE WHEN sglang_version = '{new}' THEN net END)) AS BIGINT) AS new_bytes,
       CAST(FLOOR(AVG(CASE WHEN sglang_version = '{new}' THEN net END)
                  - AVG(CASE WHEN sglang_version = '{old}' THEN net END)) AS BIGINT) AS growth_bytes,
       COUNT(CASE WHEN sglang_version = '{old}' THEN 1 END) AS old_processes,
       COUNT(CASE WHEN sglang_version = '{new}' THEN 1 END) AS new_processes
FROM (SELECT trace_id, pid, name, category, sglang_version, CAST(SUM(net) AS BIGINT) AS net
      FROM phases
      WHERE owned AND sglang_version IN ('{old}', '{new}') AND day >= DATE '{since}'
      GROUP BY trace_id, pid, name, category, sglang_version) per_process
GROUP BY name, category
HAVING COUNT(CASE WHEN sglang_version = '{old}' THEN 1 END) > 0
   AND COUNT(CASE WHEN sglang_version = '{new}' THEN 1 END) > 0
ORDER BY growth_bytes DESC, name, category""",
        {"old": Param(_RELEASE, None, "the earlier SGLang release (e.g. 0.5.20)"),
         "new": Param(_RELEASE, None, "the later SGLang release (e.g. 0.5.21)"),
         "since": _DATE},
    ),
    "sites": NamedQuery(
        "which lines of code took the most memory across the fleet: each allocation site (the innermost "
        "user frame of the allocation's stack, as memrec report names it) with the bytes allocated there, "
        "on how many hosts and jobs (traces recorded with memrec daemon --stacks)",
        """
SELECT CASE WHEN s.unavailable <> '' THEN CONCAT('stack unavailable (', s.unavailable, ')') ELSE s.file END AS file,
       s.line, s.function, CAST(SUM(e.size) AS BIGINT) AS allocated_bytes, COUNT(*) AS allocations,
       MAX(e.size) AS largest, COUNT(DISTINCT e.host) AS hosts, COUNT(DISTINCT e.job) AS jobs
FROM events e
JOIN stacks s ON s.trace_id = e.trace_id AND s.part = e.part AND s.stack = e.stack
WHERE (s.site OR s.unavailable <> '') AND e.result = 0 AND e.day >= DATE '{since}'
  AND e.kind IN ({kinds})
GROUP BY CASE WHEN s.unavailable <> '' THEN CONCAT('stack unavailable (', s.unavailable, ')') ELSE s.file END,
         s.line, s.function
ORDER BY allocated_bytes DESC, file, s.line""",
        {"level": Param(r"driver|tensor", "driver",
                        "driver (cuMemAlloc*, cuMemCreate) or tensor (PyTorch's blocks, memrec daemon --tensors)"),
         "since": _DATE},
    ),
}

#: The event kinds each ``level`` of the sites query counts (memrec.analysis.report.sites's levels).
_LEVEL_KINDS = {"driver": "'ALLOC', 'VMM_CREATE'", "tensor": "'TENSOR_ALLOC'"}


def render(name: str, values: dict[str, str]) -> str:
    """The SQL of named query ``name`` with its parameters filled in.

    Raises:
        MemrecCommandError: an unknown query or parameter, a missing one, or a value of the wrong
            form (USAGE).
    """
    query = NAMED.get(name)
    if query is None:
        raise MemrecCommandError(f"no named query {name!r}; there are: {', '.join(NAMED)}", exit_code=ExitCode.USAGE)
    unknown = sorted(set(values) - set(query.params))
    if unknown:
        known = ", ".join(query.params) or "none"
        raise MemrecCommandError(f"--query {name} has no parameter {unknown[0]!r} (it takes: {known})",
                                 exit_code=ExitCode.USAGE)
    filled = {}
    for key, param in query.params.items():
        value = values.get(key, param.default)
        if value is None:
            raise MemrecCommandError(f"--query {name} needs --set {key}=VALUE: {param.help}", exit_code=ExitCode.USAGE)
        if not re.fullmatch(param.pattern, value):
            raise MemrecCommandError(f"--set {key}={value!r}: {param.help}", exit_code=ExitCode.USAGE)
        filled[key] = value
    if "level" in filled:
        filled["kinds"] = _LEVEL_KINDS[filled["level"]]
    return query.sql.format(**filled).strip()


def register_spark(spark: Any, roots: list[str]) -> None:
    """Make one temporary view per table in a Spark session, over the datasets at ``roots`` (local
    folders or ``s3a://``/``gs://``/``abfss://`` URLs): then ``spark.sql(render(...))`` runs a named
    query. Partition values are read as strings (a host named ``001`` stays a name).

    Roots of an older layout are read as :class:`DuckDB` reads them: the columns their layout
    lacks are null, a table it lacks has no rows from them, and a table no root has yet is an
    empty view of its columns (so every named query runs over a layout-1 dataset too).
    """
    spark.conf.set("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
    layouts: dict[int, list[str]] = {}
    for root in roots:
        layouts.setdefault(_spark_layout(spark, root), []).append(root.rstrip("/"))
    for table in TABLES:
        frame = None
        for version, group in sorted(layouts.items(), reverse=True):
            columns = layout_columns(table, version)
            part = None if columns is None else _spark_parquet(spark, [f"{root}/{table}" for root in group])
            if part is None:
                continue
            for name, kind in COLUMNS[table]:
                if name not in columns:
                    part = part.withColumn(name, _spark_null(kind))
            frame = part if frame is None else frame.unionByName(part)
        if frame is None:
            frame = spark.createDataFrame([], _spark_schema(table))
        frame.createOrReplaceTempView(table)


def _spark_layout(spark: Any, root: str) -> int:
    """The layout version of the dataset at ``root``: a local folder's manifest is checked as
    ``memrec sql`` checks it (a clear error for another version); a URL's is read through Spark."""
    if "://" not in root:
        version = check_manifest(Path(root), write=False)
        return SCHEMA_VERSION if version is None else version
    try:
        row = spark.read.option("multiLine", "true").json(f"{root.rstrip('/')}/{MANIFEST}").first()
    except Exception:  # noqa: BLE001 - Spark's errors are Java exceptions of many kinds
        return SCHEMA_VERSION  # no manifest: a new dataset's folders, read as this layout
    version = row["memrec_dataset"] if row is not None and "memrec_dataset" in row else SCHEMA_VERSION
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise MemrecCommandError(f"{root}: a memrec dataset of layout version {version!r}; this memrec reads "
                                 f"versions {', '.join(map(str, READ_VERSIONS))}", exit_code=ExitCode.DATA)
    return version


def _spark_parquet(spark: Any, paths: list[str]) -> Any:
    """A table's Parquet files under ``paths`` (partitions as columns), or None where none is there
    yet (checked before reading for local folders; a URL's missing path is Spark's error)."""
    present = [p for p in paths if "://" in p or glob.glob(f"{p}/*/*/*.parquet")]
    if not present:
        return None
    reader = spark.read.option("basePath", present[0]) if len(present) == 1 else spark.read
    try:
        return reader.parquet(*present)
    except Exception as error:  # noqa: BLE001 - pyspark's AnalysisException, without importing pyspark
        if "PATH_NOT_FOUND" in str(error) or "Path does not exist" in str(error):
            return None
        raise


def _spark_types() -> dict[str, Any]:
    from pyspark.sql import types  # only here: Spark is the caller's, never memrec's dependency

    return {"string": types.StringType(), "int16": types.ShortType(), "int32": types.IntegerType(),
            "int64": types.LongType(), "float64": types.DoubleType(), "bool": types.BooleanType(),
            "time": types.TimestampType()}


def _spark_null(kind: str) -> Any:
    from pyspark.sql import functions

    return functions.lit(None).cast(_spark_types()[kind])


def _spark_schema(table: str) -> Any:
    """``table``'s columns, the key first and the partitions last, as a Spark schema."""
    from pyspark.sql import types

    kinds = _spark_types()
    fields = [*KEY_COLUMNS, *COLUMNS[table], ("host", "string"), ("day", "string")]  # partitions as strings
    return types.StructType([types.StructField(name, kinds[kind], True) for name, kind in fields])


# ------------------------------------------------------------------------------- DuckDB


#: DuckDB's name of each dataset column type (the null columns of an older layout).
_DUCK_TYPES = {"string": "VARCHAR", "int16": "SMALLINT", "int32": "INTEGER", "int64": "BIGINT", "float64": "DOUBLE",
               "bool": "BOOLEAN", "time": "TIMESTAMPTZ"}


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class DuckDB:
    """An in-process DuckDB with one view per table over dataset folders, its memory bounded.

    ``memory_limit`` bounds what DuckDB holds (it spills to a private temporary folder beyond,
    removed on close); no extension is installed or loaded from the network.
    """

    def __init__(self, roots: list[Path], memory_limit: str = "1GB", threads: int | None = None) -> None:
        duckdb = require("duckdb", "sql", "memrec sql")
        self._tmp = tempfile.mkdtemp(prefix="memrec-sql-")
        config = {"memory_limit": memory_limit, "temp_directory": self._tmp,
                  "autoinstall_known_extensions": "false", "autoload_known_extensions": "false"}
        if threads:
            config["threads"] = str(threads)
        try:
            self.con = duckdb.connect(":memory:", config=config)
        except duckdb.Error as error:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise MemrecCommandError(f"duckdb: {error}", exit_code=ExitCode.USAGE) from error
        self.error = duckdb.Error
        self.con.execute("SET TimeZone = 'UTC'")
        try:
            layouts: dict[int, list[Path]] = {}  # layout version -> its roots
            for root in roots:
                layouts.setdefault(check_manifest(root, write=False) or SCHEMA_VERSION, []).append(root)
            for table in TABLES:
                self._view(table, layouts)
        except (duckdb.Error, MemrecCommandError) as error:
            self.close()
            if isinstance(error, MemrecCommandError):
                raise
            raise MemrecCommandError(f"sql: {str(error).splitlines()[0]}", exit_code=ExitCode.DATA) from error

    def _view(self, table: str, layouts: dict[int, list[Path]]) -> None:
        """``table`` as a view over its files in every root; an empty one of its columns when no
        root has any yet (a new dataset). The schema is the first file's: every file of one layout
        version has the same (``union_by_name``, which reads every file's, took 2.7× as long
        over 1,100 files). Roots of an older layout are read apart, the columns it lacks null
        (``UNION ALL BY NAME``); a table it lacks has no rows from them."""
        pa = require("pyarrow", "sql", "memrec sql")
        parts = []
        for version, roots in sorted(layouts.items(), reverse=True):
            columns = layout_columns(table, version)
            globs = [str(root / table / "*" / "*" / "*.parquet") for root in roots]
            if columns is None or not any(next(iter(glob.glob(g)), None) for g in globs):
                continue
            nulls = "".join(f", CAST(NULL AS {_DUCK_TYPES[kind]}) AS {name}"
                            for name, kind in COLUMNS[table] if name not in columns)
            parts.append(f"SELECT *{nulls} FROM read_parquet([{', '.join(map(_literal, globs))}], "
                         "hive_partitioning = true, hive_types = {'host': 'VARCHAR', 'day': 'DATE'})")
        if not parts:
            schema = arrow_schema(table).append(pa.field("host", pa.string())).append(pa.field("day", pa.date32()))
            self.con.register(f"_empty_{table}", schema.empty_table())
            self.con.execute(f"CREATE VIEW {table} AS SELECT * FROM _empty_{table}")
            return
        self.con.execute(f"CREATE VIEW {table} AS {' UNION ALL BY NAME '.join(parts)}")

    def query(self, sql: str) -> tuple[list[str], Iterator[tuple]]:
        """Column names and the rows (fetched in batches as they are read).

        Raises:
            MemrecCommandError: DuckDB refused the SQL or could not read a file (DATA).
        """
        try:
            rel = self.con.sql(sql)  # None for a statement without rows (SET, CREATE VIEW...)
        except self.error as error:
            raise MemrecCommandError(f"sql: {str(error).splitlines()[0]}", exit_code=ExitCode.DATA) from error
        names = list(rel.columns) if rel is not None else []

        def rows() -> Iterator[tuple]:
            # Through Arrow: batches as DuckDB makes them, and UTC times without pytz.
            try:
                for batch in rel.to_arrow_reader(4096) if rel is not None else ():
                    yield from zip(*(column.to_pylist() for column in batch.columns))
            except self.error as error:
                raise MemrecCommandError(f"sql: {str(error).splitlines()[0]}", exit_code=ExitCode.DATA) from error

        return names, rows()

    def close(self) -> None:
        self.con.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> DuckDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
