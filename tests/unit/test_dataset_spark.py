"""The named queries run unchanged on Apache Spark and give DuckDB's answers.

One local Spark session (pyspark from the test extra, the Java runtime scripts/setup --test
installs) reads the dataset ``memrec export --to dataset`` wrote, through
:func:`memrec.export.sql.register_spark`, and runs the text of every named query as
``memrec sql --print-sql`` gives it. Skipped with the reason where pyspark or Java is missing,
except in CI (``CI`` set), which installs both.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path

import pytest

from memrec.commands import main
from tests.fleet import Host
from tests.fleet import write_host
from tests.stack_traces import sglang_trace


def _need(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what}: CI must run the named queries on Spark (scripts/setup --test installs it)")
    pytest.skip(what)


@pytest.fixture(scope="module")
def spark():
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        _need("pyspark not installed (the test extra)")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        _need("no Java runtime (apt-get install openjdk-17-jre-headless)")
    session = (SparkSession.builder.master("local[1]").appName("memrec-dataset-test")
               .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
               .config("spark.sql.session.timeZone", "UTC").config("spark.driver.memory", "1g")
               .getOrCreate())
    yield session
    session.stop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("spark")
    hosts = [Host(1, "0.5.20"), Host(2, "0.5.21", oom=True), Host(3, "0.5.21"), Host(3, "0.5.21", part=1)]
    traces = [write_host(tmp / f"h{h.index}.{h.part}.mrec", h) for h in hosts]
    traces.append(sglang_trace(tmp / "stacks.mrec", host="stacked"))  # the sites query's rows
    assert main(["export", *map(str, traces), "--to", "dataset", "-o", str(tmp / "ds")]) == 0
    return tmp / "ds"


def _value(v):
    if isinstance(v, datetime.datetime):
        return round(v.timestamp(), 6)  # Spark: naive local time; DuckDB (via jsonl): ISO with +00:00
    if isinstance(v, datetime.date):
        return v.isoformat()
    return v


def _duck(capsys, *args: str) -> list[dict]:
    capsys.readouterr()
    assert main(["sql", "--format", "jsonl", *args]) == 0
    rows = []
    for line in capsys.readouterr().out.splitlines():
        row = json.loads(line)
        for k, v in row.items():
            if isinstance(v, str) and len(v) > 19 and v[10] == "T" and v.endswith("+00:00"):
                row[k] = round(datetime.datetime.fromisoformat(v).timestamp(), 6)
        rows.append(row)
    return rows


@pytest.mark.parametrize("query,params", [
    ("fleet", []),
    ("failures", ["--set", "since=2025-11-01"]),
    ("holders", []),
    ("peaks", []),
    ("phase-growth", ["--set", "old=0.5.20", "--set", "new=0.5.21"]),
    ("sites", []),
    ("sites", ["--set", "level=tensor"]),
])
def test_named_query_gives_duckdbs_answer_on_spark(spark, dataset, capsys, query, params):
    from memrec.export.sql import register_spark

    # GIVEN the query's text, as a Spark user would take it
    capsys.readouterr()
    assert main(["sql", "-q", query, *params, "--print-sql"]) == 0
    text = capsys.readouterr().out
    # WHEN Spark runs it over the dataset's folders
    register_spark(spark, [str(dataset)])
    got = [{k: _value(v) for k, v in row.asDict().items()} for row in spark.sql(text).collect()]
    # THEN the rows are DuckDB's, column for column, in the same order
    want = _duck(capsys, "-q", query, *params, str(dataset))
    assert want, "the fleet answers every question"
    assert got == want


def test_a_layout_1_dataset_reads_on_spark_as_in_duckdb(spark, dataset, tmp_path, capsys):
    import tarfile

    from memrec.export.sql import register_spark

    # GIVEN a dataset of layout 1 (no stacks table, no events.stack column) beside a layout-2 one
    old = tmp_path / "old"
    old.mkdir()
    with tarfile.open(Path(__file__).parents[1] / "data" / "dataset_v1.tar.xz") as tar:
        tar.extractall(old)  # the repository's own file
    assert not (old / "stacks").exists()
    # WHEN Spark registers both, and the old one alone
    for roots in ([old, dataset], [old]):
        register_spark(spark, [str(r) for r in roots])
        # THEN every table is a view, the old events' stacks null, as memrec sql (DuckDB) says
        text = "SELECT host, count(*) AS n, count(stack) AS with_stack FROM events GROUP BY host ORDER BY host"
        got = [row.asDict() for row in spark.sql(text).collect()]
        assert got == _duck(capsys, "-e", text, *map(str, roots))
        assert spark.sql("SELECT count(*) AS n FROM stacks").collect()[0]["n"] == len(
            _duck(capsys, "-e", "SELECT * FROM stacks", *map(str, roots)))
        # AND a named query of layout 1 gives DuckDB's rows
        capsys.readouterr()
        assert main(["sql", "-q", "failures", "--print-sql"]) == 0
        query = capsys.readouterr().out
        got = [{k: _value(v) for k, v in row.asDict().items()} for row in spark.sql(query).collect()]
        want = _duck(capsys, "-q", "failures", *map(str, roots))
        assert got == want
