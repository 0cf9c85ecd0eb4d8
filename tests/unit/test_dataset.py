"""The fleet dataset: ``memrec export --to dataset``, ``memrec sql`` (DuckDB) and the daemon's shipper.

The traces are written by the real writer (tests/fleet.py: a serving fleet whose sizes the tests
know) or are real recordings (examples/); the tables are read back by pyarrow and DuckDB, and
every expected number comes from the trace or from ``memrec report``'s JSON.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest

import memrec
from memrec.base.errors import ExitCode
from memrec.analysis.report.build import build_report
from memrec.commands import main
from memrec.trace.clock import to_wall_ns
from memrec.trace.reader import load_trace
from tests.fleet import GRAPH_MIB
from tests.fleet import KV_GIB
from tests.fleet import OOM_SIZE
from tests.fleet import WEIGHTS_GIB
from tests.fleet import GiB
from tests.fleet import Host
from tests.fleet import MiB
from tests.fleet import write_host
from tests.stack_traces import sglang_trace

pa = pytest.importorskip("pyarrow", reason="pyarrow not installed (memrec[sql])")
pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed (memrec[sql])")
pytest.importorskip("duckdb", reason="duckdb not installed (memrec[sql])")

from memrec.export.dataset import MANIFEST  # noqa: E402
from memrec.export.dataset import SCHEMA_VERSION  # noqa: E402
from memrec.export.dataset import TABLES  # noqa: E402
from memrec.export.dataset import arrow_schema  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SGLANG_IPC = ROOT / "examples" / "sglang-standin-ipc.mrec"  # a real two-rank recording on an H200
GOLDEN = ROOT / "tests" / "data" / "golden_v1.mrec"  # an OOM, markers, NVML; format 1
DATASET_V1 = ROOT / "tests" / "data" / "dataset_v1.tar.xz"  # GOLDEN exported by memrec's layout 1


@pytest.fixture
def fleet(tmp_path) -> list[Path]:
    """Three hosts: one on SGLang 0.5.20, two on 0.5.21, one of which fails to allocate, and
    whose recording rotated into two parts."""
    hosts = [Host(1, "0.5.20"), Host(2, "0.5.21", oom=True), Host(3, "0.5.21"), Host(3, "0.5.21", part=1)]
    return [write_host(tmp_path / f"h{h.index}.{h.part}.mrec", h) for h in hosts]


def export(traces: list[Path], out: Path) -> int:
    return main(["export", *map(str, traces), "--to", "dataset", "-o", str(out)])


def read(out: Path, table: str) -> pa.Table:
    import pyarrow.dataset as ds

    return ds.dataset(out / table, format="parquet", partitioning="hive").to_table()


def sql(capsys, *args: str) -> list[dict]:
    """``memrec sql --format jsonl ...`` as rows."""
    capsys.readouterr()  # what came before
    assert main(["sql", "--format", "jsonl", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


# ------------------------------------------------------------------------------------ export


def test_every_table_has_its_schema_and_the_trace_rows(tmp_path, fleet, capsys):
    out = tmp_path / "ds"
    # WHEN a fleet's traces and two real recordings are exported
    assert export([*fleet, SGLANG_IPC, GOLDEN], out) == 0
    # THEN each table holds one file per trace part, partitioned by host and day, of the table's schema
    assert json.loads((out / MANIFEST).read_text())["memrec_dataset"] == SCHEMA_VERSION
    for table in TABLES:
        files = sorted((out / table).glob("host=*/day=*/*.parquet"))
        assert len(files) == 6, table
        assert all(pq.read_schema(f).remove_metadata().equals(arrow_schema(table)) for f in files), table
    hosts = {p.name for p in (out / "events").iterdir()}
    assert hosts == {"host=node-0001", "host=node-0002", "host=node-0003", "host=vm", "host=golden-host"}
    # AND the events of the real recording are its events, with wall-clock times from its anchor
    trace = load_trace(SGLANG_IPC)
    ev = read(out, "events").filter(pa.compute.equal(pa.compute.field("host"), "vm")).sort_by("ts")
    assert ev.num_rows == trace.n_events
    loaded = memrec.load(SGLANG_IPC, pandas=False).events  # an IPC open's size is the mapped peer's
    assert sorted(zip(ev["ts"].to_pylist(), ev["size"].to_pylist(), ev["peer"].to_pylist())) == sorted(
        zip(loaded["ts"].tolist(), loaded["size"].tolist(), loaded["peer"].tolist()))
    assert (loaded["peer"] >= 0).any()
    first = ev.slice(0, 1).to_pylist()[0]
    assert first["time"].timestamp() * 1e9 == pytest.approx(to_wall_ns(trace.header, first["ts"]), abs=1000)
    uuids = {g.index: g.uuid for g in trace.gpus}
    assert all(u == uuids[g] for g, u in zip(ev["gpu"].to_pylist(), ev["gpu_uuid"].to_pylist()) if g >= 0)
    # AND the ranks and phases are those of memrec.load
    phases = set(ev["phase"].to_pylist())
    assert {"load_weights", "(no phase)"} <= phases
    procs = read(out, "processes").filter(pa.compute.equal(pa.compute.field("host"), "vm")).to_pylist()
    assert {p["rank"] for p in procs} >= {"TP0", "TP1"}
    # AND a process's peak is the report's
    report = build_report(trace).to_json()
    by_pid = {row["pid"]: row["peak"] for s in report["gpus"] for row in s["processes"]}
    assert {p["pid"]: p["peak_bytes"] for p in procs if p["pid"] in by_pid} == by_pid
    # AND the per-trace summary counts what the trace holds
    traces = {(t["hostname"], t["part"]): t for t in read(out, "traces").to_pylist()}
    vm = traces[("vm", 0)]
    assert vm["events"] == trace.n_events and vm["markers"] == len(trace.markers) and vm["complete"]
    assert vm["gpu_uuids"].split(",") == [g.uuid for g in trace.gpus]


def test_rotated_parts_share_a_trace_id_and_a_job(tmp_path, fleet):
    out = tmp_path / "ds"
    assert export(fleet, out) == 0
    traces = [t for t in read(out, "traces").to_pylist() if t["hostname"] == "node-0003"]
    assert sorted(t["part"] for t in traces) == [0, 1] and len({t["trace_id"] for t in traces}) == 1
    jobs = {p["job"] for p in read(out, "processes").to_pylist() if p["host"] == "node-0003"}
    assert len(jobs) == 1  # the launcher and its schedulers, in both parts


def test_export_again_replaces_a_trace_files_and_keeps_the_others(tmp_path, fleet, capsys):
    out = tmp_path / "ds"
    assert export(fleet[:2], out) == 0
    before = sql(capsys, "-e", "SELECT count(*) AS n FROM events", str(out))[0]["n"]
    # WHEN one trace is exported again, then another added
    assert export(fleet[1:2], out) == 0
    assert export(fleet[2:3], out) == 0
    # THEN its rows are there once, and the first trace's are still there
    rows = sql(capsys, "-e", "SELECT host, count(*) AS n FROM events GROUP BY host ORDER BY host", str(out))
    added = load_trace(fleet[2]).n_events
    assert sum(r["n"] for r in rows) == before + added
    assert [r["host"] for r in rows] == ["node-0001", "node-0002", "node-0003"]
    assert not list(out.rglob(".*.tmp"))


def test_a_link_planted_in_the_dataset_is_never_followed(tmp_path, fleet):
    out = tmp_path / "ds"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.mkdir()
    # GIVEN a link where the events table's folder goes
    (out / "events").symlink_to(elsewhere)
    # WHEN exported THEN it is refused, and nothing is written through it
    assert export(fleet[:1], out) == ExitCode.CANT_CREATE
    assert list(elsewhere.iterdir()) == []
    # GIVEN (the link gone) a link at a file's own name, to a file outside
    (out / "events").unlink()
    assert export(fleet[:1], out) == 0
    target = tmp_path / "precious"
    target.write_text("keep")
    victim = next((out / "markers").rglob("*.parquet"))
    victim.unlink()
    victim.symlink_to(target)
    # WHEN exported again THEN the link is replaced by the file, the file outside untouched
    assert export(fleet[:1], out) == 0
    assert not victim.is_symlink() and target.read_text() == "keep"
    # AND a link in the manifest's place is not read as one
    (out / MANIFEST).unlink()
    (out / MANIFEST).symlink_to(target)
    assert export(fleet[:1], out) == ExitCode.DATA


def test_a_dataset_of_another_layout_is_refused(tmp_path, fleet, capsys):
    out = tmp_path / "ds"
    out.mkdir()
    (out / MANIFEST).write_text(json.dumps({"memrec_dataset": SCHEMA_VERSION + 1}))
    assert export(fleet[:1], out) == ExitCode.DATA
    assert f"layout version {SCHEMA_VERSION + 1}" in capsys.readouterr().err
    assert main(["sql", "-q", "fleet", str(out)]) == ExitCode.DATA
    assert not (out / "events").exists()
    # AND a manifest whose version is JSON's true (Python's True == 1) is no layout 1
    (out / MANIFEST).write_text(json.dumps({"memrec_dataset": True}))
    capsys.readouterr()
    assert main(["sql", "-q", "fleet", str(out)]) == ExitCode.DATA
    assert "layout version 'true'" in capsys.readouterr().err


def test_stacks_table_and_each_event_s_stack_answer_which_line_took_the_memory(tmp_path, fleet, capsys):
    # GIVEN two hosts recorded with stacks (each: two ranks; custom all-reduce 18 and 20 GiB a rank)
    # and a fleet's traces without stacks, exported together
    a = sglang_trace(tmp_path / "a.mrec", host="h1")
    b = sglang_trace(tmp_path / "b.mrec", host="h2", custom_ar=20 * GiB)
    out = tmp_path / "ds"
    assert export([a, b, *fleet[:1]], out) == 0
    # THEN the stacks table holds memrec.load's stacks of each part, and every event its stack id
    stacks = read(out, "stacks").filter(pa.compute.equal(pa.compute.field("host"), "h1")).sort_by(
        [("stack", "ascending"), ("depth", "ascending")])
    loaded = memrec.load(a, pandas=False)
    assert stacks["stack"].to_pylist() == loaded.stacks["stack"].tolist()
    assert stacks["file"].to_pylist() == loaded.stacks["file"].tolist()
    assert stacks["site"].to_pylist() == loaded.stacks["site"].tolist()
    ev = read(out, "events").filter(pa.compute.equal(pa.compute.field("host"), "h1")).sort_by("ts")
    assert ev["stack"].to_pylist() == loaded.events["stack"].tolist() and any(ev["stack"].to_pylist())
    # AND the events of a trace without stacks say 0 (none)
    other = read(out, "events").filter(pa.compute.equal(pa.compute.field("host"), "node-0001"))
    assert set(other["stack"].to_pylist()) == {0}
    # WHEN the fleet is asked which line took the most memory
    rows = sql(capsys, "--query", "sites", str(out))
    # THEN the sites are the report's, the bytes summed over both hosts' ranks
    top = [(Path(r["file"]).name, r["line"], r["function"], r["allocated_bytes"], r["allocations"], r["hosts"])
           for r in rows]
    assert top == [
        ("loader.py", 377, "DefaultModelLoader.load_model", 4 * 40 * GiB, 4, 2),
        ("custom_all_reduce.py", 123, "CustomAllreduce.__init__", 2 * 18 * GiB + 2 * 20 * GiB, 4, 2),
        ("weight_utils.py", 51, "scratch_buffer", 4 * 2 * GiB, 4, 2),
        ("stack unavailable (python 3.9: interpreter layout unknown)", 0, "", 4 * MiB, 4, 2),
    ]
    # AND the report of one trace names the same custom all-reduce line
    report_sites = build_report(load_trace(a)).to_json()["sites"]
    assert any(r["site"]["line"] == 123 for p in report_sites["phases"] for r in p["rows"])
    # AND tensor blocks are a level of their own
    tensor = sql(capsys, "--query", "sites", "--set", "level=tensor", str(out))
    assert [(Path(r["file"]).name, r["allocated_bytes"]) for r in tensor] == [("llama.py", 4 * 512 * MiB)]
    assert main(["sql", "--query", "sites", "--set", "level=host", str(out)]) == ExitCode.USAGE


def test_a_dataset_of_layout_1_is_still_read_and_never_written_into(tmp_path, capsys):
    # GIVEN a dataset written by memrec before layout 2 (tests/data/dataset_v1.tar.xz: main at
    # b8de783, `memrec export tests/data/golden_v1.mrec --to dataset`), and a layout-2 one with stacks
    old = tmp_path / "old"
    old.mkdir()
    with tarfile.open(DATASET_V1) as tar:
        tar.extractall(old)  # the repository's own file
    assert json.loads((old / MANIFEST).read_text())["memrec_dataset"] == 1
    assert not (old / "stacks").exists()
    new = tmp_path / "new"
    assert export([sglang_trace(tmp_path / "a.mrec", host="h1")], new) == 0
    # WHEN memrec sql reads the old one THEN its events are there, each without a stack
    rows = sql(capsys, "-e", "SELECT count(*) AS n, count(stack) AS with_stack FROM events", str(old))
    assert rows == [{"n": load_trace(GOLDEN).n_events, "with_stack": 0}]
    assert sql(capsys, "--query", "sites", str(old)) == []
    assert sql(capsys, "-e", "SELECT count(*) AS n FROM stacks", str(old)) == [{"n": 0}]
    # AND read with the new one, each keeps its own: the old events null, the new ones their ids
    rows = sql(capsys, "-e", "SELECT host, count(*) AS n, count(stack) AS with_stack FROM events "
                             "GROUP BY host ORDER BY host", str(old), str(new))
    n_new = load_trace(tmp_path / "a.mrec").n_events
    assert rows == [{"host": "golden-host", "n": load_trace(GOLDEN).n_events, "with_stack": 0},
                    {"host": "h1", "n": n_new, "with_stack": n_new}]
    assert sql(capsys, "--query", "sites", str(old), str(new))[0]["line"] == 377
    # AND the named queries of layout 1 still run on it
    assert sql(capsys, "--query", "failures", str(old))
    # BUT nothing is exported into it: its tables would mix two schemas
    capsys.readouterr()
    assert export([GOLDEN], old) == ExitCode.DATA
    err = capsys.readouterr().err
    assert "layout version 1" in err and "memrec sql reads both together" in err and len(err.splitlines()) == 1
    assert not (old / "stacks").exists()


def test_export_dataset_needs_a_folder_whose_parent_exists(tmp_path, fleet):
    assert export(fleet[:1], tmp_path / "missing" / "ds") == ExitCode.CANT_CREATE
    (tmp_path / "file").write_text("")
    assert export(fleet[:1], tmp_path / "file") == ExitCode.CANT_CREATE
    # one trace only for the one-file formats
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(fleet[0]), str(fleet[1]), "--to", "csv", "-o", str(tmp_path / "t")])
    assert exit_.value.code == ExitCode.USAGE


# ------------------------------------------------------------------------------------ named queries


def test_failures_names_the_job_rank_and_what_held_the_memory(tmp_path, fleet, capsys):
    out = tmp_path / "ds"
    assert export(fleet, out) == 0
    rows = sql(capsys, "--query", "failures", str(out))
    assert len(rows) == 1
    (f,) = rows
    held = WEIGHTS_GIB * GiB + KV_GIB["0.5.21"] * GiB + GRAPH_MIB * MiB
    assert (f["host"], f["rank"], f["size"], f["result_name"]) == ("node-0002", "TP0", OOM_SIZE,
                                                                   "CUDA_ERROR_OUT_OF_MEMORY")
    assert f["job"].startswith("node-0002:") and f["owned_on_gpu"] == held
    assert (f["top_holder_rank"], f["top_holder_bytes"]) == ("TP0", held)
    # the day's window: a later day has none
    assert sql(capsys, "--query", "failures", "--set", "since=2031-01-01", str(out)) == []
    holders = sql(capsys, "--query", "holders", str(out))
    assert [(h["holder_rank"], h["category"], h["bytes"]) for h in holders] == [("TP0", "driver", held)]


def test_peaks_per_job_and_rank(tmp_path, fleet, capsys):
    out = tmp_path / "ds"
    assert export(fleet, out) == 0
    rows = sql(capsys, "--query", "peaks", str(out))
    # three jobs of two ranks: the 0.5.21 ones first, each rank's peak = what it set up + its
    # largest activations in flight (the report's figure)
    assert len(rows) == 6 and len({(r["job"], r["rank"]) for r in rows}) == 6
    report_peaks = {}
    for path in fleet:
        trace = load_trace(path)
        for s in build_report(trace).to_json()["gpus"]:
            for p in s["processes"]:
                key = (trace.header["host"], p["pid"])
                report_peaks[key] = max(report_peaks.get(key, 0), p["peak"])
    assert {(r["host"], r["pid"]): r["peak_bytes"] for r in rows} == report_peaks
    assert [r["sglang_version"] for r in rows][:4] == ["0.5.21"] * 4


def test_phase_growth_between_two_releases(tmp_path, fleet, capsys):
    out = tmp_path / "ds"
    assert export(fleet, out) == 0
    rows = sql(capsys, "--query", "phase-growth", "--set", "old=0.5.20", "--set", "new=0.5.21", str(out))
    first = rows[0]
    assert (first["name"], first["growth_bytes"]) == ("kv_pool", (KV_GIB["0.5.21"] - KV_GIB["0.5.20"]) * GiB)
    assert {r["name"]: r["growth_bytes"] for r in rows}["load_weights"] == 0
    assert (first["old_processes"], first["new_processes"]) == (2, 4)  # host 3's ranks in each of 2 parts


def test_fleet_summary_and_traces_given_directly(tmp_path, fleet, capsys):
    rows = sql(capsys, "--query", "fleet", *map(str, fleet))
    assert len(rows) == 1
    r = rows[0]
    assert (r["hosts"], r["parts"], r["failed_calls"], r["incomplete"]) == (3, 4, 1, 0)
    assert r["events"] == sum(load_trace(p).n_events for p in fleet)


# ------------------------------------------------------------------------------------ the command


def test_sql_errors_have_one_line_and_an_exit_code(tmp_path, fleet, capsys):
    out = tmp_path / "ds"
    assert export(fleet[:1], out) == 0
    capsys.readouterr()
    cases = [
        (["-e", "SELECT * FROM nope", str(out)], ExitCode.DATA, "nope"),
        (["-q", "nope", str(out)], ExitCode.USAGE, "no named query 'nope'"),
        (["-q", "phase-growth", str(out)], ExitCode.USAGE, "needs --set old=VALUE"),
        (["-q", "failures", "--set", "since=yesterday", str(out)], ExitCode.USAGE, "YYYY-MM-DD"),
        (["-q", "phase-growth", "--set", "old=0.5'; DROP", "--set", "new=1", str(out)], ExitCode.USAGE, "old="),
        (["-q", "fleet", "--set", "old=1", str(out)], ExitCode.USAGE, "has no parameter 'old'"),
        (["-q", "fleet", str(tmp_path)], ExitCode.DATA, "not a memrec dataset"),
        (["-q", "fleet", str(tmp_path / "missing.mrec")], ExitCode.NO_INPUT, "missing.mrec"),
        (["-q", "fleet", "--memory-limit", "lots", str(out)], ExitCode.USAGE, "duckdb"),
    ]
    for args, code, text in cases:
        assert main(["sql", *args]) == code, args
        err = capsys.readouterr().err
        assert text in err and len(err.strip().splitlines()) == 1, (args, err)
    for args in (["-q", "fleet"], [str(out)], ["-q", "fleet", "-e", "SELECT 1", str(out)]):
        with pytest.raises(SystemExit) as exit_:
            main(["sql", *args])
        assert exit_.value.code == ExitCode.USAGE


def test_list_print_sql_limit_and_formats(tmp_path, fleet, capsys):
    assert main(["sql", "--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in ("fleet", "failures", "holders", "peaks", "phase-growth"))
    assert main(["sql", "-q", "failures", "--set", "since=2026-11-24", "--print-sql"]) == 0
    assert "DATE '2026-11-24'" in capsys.readouterr().out
    out = tmp_path / "ds"
    assert export(fleet, out) == 0
    capsys.readouterr()
    assert main(["sql", "-e", "SELECT ts FROM events ORDER BY ts", "--limit", "3", str(out)]) == 0
    got = capsys.readouterr()
    assert len(got.out.splitlines()) == 4 and "more not shown" in got.err
    assert main(["sql", "-q", "peaks", "--format", "csv", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("host,job,rank,pid") and len(lines) == 7
    # DuckDB's memory is bounded as asked
    rows = sql(capsys, "-e", "SELECT current_setting('memory_limit') AS m", "--memory-limit", "300MB", str(out))
    assert rows[0]["m"] in ("286.1 MiB", "300.0 MB", "300MB")



def test_the_table_shows_a_marker_s_terminal_escapes_as_text(tmp_path, fleet, capsys):
    # GIVEN a dataset and text a marker client chose (a name that would turn the terminal red)
    out = tmp_path / "ds"
    assert export(fleet, out) == 0
    capsys.readouterr()
    # WHEN the table format prints it
    assert main(["sql", "-e", "SELECT 'evil' || chr(27) || '[31m' || chr(7) AS name", str(out)]) == 0
    printed = capsys.readouterr().out
    # THEN as visible escapes, as the report shows them (the csv and jsonl formats stay data)
    assert "\x1b" not in printed and "\x07" not in printed
    assert "evil\\x1b[31m\\x07" in printed


# ------------------------------------------------------------------------------------ the daemon's shipper


def test_shipper_exports_each_closed_file_off_the_loop(tmp_path, fleet):
    from memrec.daemon.dataset import DatasetShipper

    out = tmp_path / "ds"
    shipper = DatasetShipper(out)
    t0 = time.monotonic()
    for path in fleet[:2]:
        shipper.submit(path)
    assert time.monotonic() - t0 < 0.1  # the loop only queues
    shipper.close(wait=120)
    assert (shipper.exported, shipper.failed, shipper.pending) == (2, 0, 0)
    assert {t["hostname"] for t in read(out, "traces").to_pylist()} == {"node-0001", "node-0002"}


def test_shipper_failure_is_logged_counted_and_not_fatal(tmp_path, fleet, caplog):
    from memrec.daemon.dataset import DatasetShipper

    out = tmp_path / "ds"
    out.mkdir()
    (out / "events").symlink_to(tmp_path)  # every export fails here
    shipper = DatasetShipper(out)
    with caplog.at_level(logging.ERROR, logger="memrec.daemon"):
        shipper.submit(fleet[0])
        shipper.submit(tmp_path / "gone.mrec")
        shipper.close(wait=120)
    assert (shipper.exported, shipper.failed) == (0, 2)
    assert "cannot export" in caplog.text and "recording goes on" in caplog.text


def test_daemon_hands_each_closed_file_to_its_listeners(tmp_path):
    from tests.unit.test_daemon_unit import make_daemon

    work = Path(os.path.realpath(tmp_path))
    d = make_daemon(work)
    closed: list[Path] = []
    d.closed_listeners.append(closed.append)
    d.closed_listeners.append(lambda path: 1 / 0)  # a failing listener is logged, never fatal
    d.start()
    d.rotate("test")
    assert closed == [work / "out.mrec"]
    d.stop()
    assert closed == [work / "out.mrec", work / "out.1.mrec"]
    parts = [load_trace(p).header for p in closed]
    assert parts[0]["recording_id"] == parts[1]["recording_id"]
    assert [h["daemon"]["part"] for h in parts] == [0, 1]


@pytest.mark.skipif(os.geteuid() != 0, reason="memrec daemon needs root before it reads its options")
def test_daemon_dataset_option_fails_before_recording(tmp_path, capsys):
    code = main(["daemon", "--dataset", str(tmp_path / "no" / "ds"), "-o", str(tmp_path / "t.mrec")])
    assert code == ExitCode.CANT_CREATE
    assert f"{tmp_path / 'no'}" in capsys.readouterr().err
    assert not (tmp_path / "t.mrec").exists()


def test_daemon_dataset_option_refuses_a_layout_1_folder_before_recording(tmp_path, capsys):
    old = tmp_path / "old"
    old.mkdir()
    with tarfile.open(DATASET_V1) as tar:
        tar.extractall(old)  # the repository's own file
    code = main(["daemon", "--dataset", str(old), "-o", str(tmp_path / "t.mrec")])
    assert code == ExitCode.DATA
    assert "layout version 1; this memrec writes version 2" in capsys.readouterr().err
    assert not (tmp_path / "t.mrec").exists()
