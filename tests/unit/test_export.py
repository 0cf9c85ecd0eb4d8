"""``memrec export``: each format written by the real CLI and read back by its real consumer.

Perfetto's own protos (the ``perfetto`` package) parse the .pftrace; PyTorch's ``_memory_viz``
reads the snapshot pickles; pyarrow reads the Parquet and CSV tables. The expected numbers come
from the trace itself (its events, NVML samples, markers) or from ``memrec report``'s JSON, never
from constants. Each consumer that is not installed skips its tests with the reason.
"""

from __future__ import annotations

import csv as csvlib
import importlib.util
import os
import pickle
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from memrec.base.errors import ExitCode
from memrec.analysis.report.build import build_report
from memrec.commands import main
from memrec.terms.events import Kind
from memrec.trace.reader import load_trace
from tests import perfetto_tracks

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "golden_v1.mrec"  # an OOM, an IPC export/open pair, markers, NVML
SGLANG_IPC = ROOT / "examples" / "sglang-standin-ipc.mrec"  # two TP ranks on an H200, custom all-reduce
EXPANDABLE = ROOT / "examples" / "torch-expandable.mrec"  # PyTorch expandable segments: cuMemMap granules
SEED_IPC = ROOT / "examples" / "seed-x2-ipc.mrec"  # two ranks, each opening the other's 30 GiB by IPC


def export(trace: Path, to: str, out: Path, *extra: str) -> int:
    return main(["export", str(trace), "--to", to, "-o", str(out), *extra])


# ------------------------------------------------------------------------------------------ perfetto


def read_perfetto(path: Path) -> dict:
    """Tracks by uuid and each track's events, parsed with the protos the perfetto package ships.

    (Perfetto's trace processor would be the other reader, but the package downloads its binary on
    first use, which this offline host cannot do.)
    """
    pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2", reason="perfetto not installed")
    return perfetto_tracks.read_perfetto(path)


def track(read: dict, name: str, parent_pid: int | None = None):
    """The uuid of the track named ``name`` (under the process ``parent_pid`` when given)."""
    tracks = read["tracks"]
    for uuid, d in tracks.items():
        if d.name != name:
            continue
        if parent_pid is None or tracks[d.parent_uuid].process.pid == parent_pid:
            return uuid
    raise AssertionError(f"no track {name!r} (pid {parent_pid}) in {sorted(d.name for d in tracks.values())}")


def counter_values(read: dict, uuid: int) -> list[tuple[int, int]]:
    return [(ts, e.counter_value) for ts, e in read["events"].get(uuid, [])]


def test_perfetto_counters_per_gpu_category_and_nvml(tmp_path):
    # GIVEN a two-rank recording with NVML samples
    out = tmp_path / "run.pftrace"
    # WHEN it is exported
    assert export(SGLANG_IPC, "perfetto", out) == 0
    read = read_perfetto(out)
    # THEN GPU 0's driver counter peaks where the report's driver category peaks
    report = build_report(load_trace(SGLANG_IPC)).to_json()
    cats = {c["category"]: c for c in report["gpus"][0]["categories"]}
    driver = counter_values(read, track(read, "GPU 0 driver"))
    assert read["tracks"][track(read, "GPU 0 driver")].counter.unit == read["pb"].CounterDescriptor.UNIT_SIZE_BYTES
    assert max(v for _, v in driver) == cats["driver"]["peak"]
    assert driver[-1][1] == cats["driver"]["final"]
    assert max(v for _, v in counter_values(read, track(read, "GPU 0 ipc_mapped"))) == cats["ipc_mapped"]["peak"]
    # AND NVML used is every sample of GPU 0 where the value changed
    nv = load_trace(SGLANG_IPC).nvml
    nv = nv[nv["gpu"] == 0]
    used = nv["used"].tolist()
    changes = [(int(t), u) for k, (t, u) in enumerate(zip(nv["ts"].tolist(), used)) if k == 0 or used[k - 1] != u]
    assert counter_values(read, track(read, "GPU 0 NVML used")) == changes


def test_perfetto_processes_phases_and_ipc_flows(tmp_path):
    out = tmp_path / "run.pftrace"
    assert export(SGLANG_IPC, "perfetto", out) == 0
    read = read_perfetto(out)
    trace = load_trace(SGLANG_IPC)
    TE = read["pb"].TrackEvent
    procs = {d.process.pid: d.process.process_name for d in read["tracks"].values() if d.HasField("process")}
    ranks = {m.pid: m.values.get("tp_rank") for m in trace.markers if "tp_rank" in m.values}
    for pid, tp in ranks.items():
        # THEN each rank is a process named by its rank, holding what it allocated on GPU 0
        assert procs[pid].startswith(f"TP{tp} ")
        held = counter_values(read, track(read, "held on GPU 0", pid))
        sizes = trace.events["size"][(trace.events["pid"] == pid) & (trace.events["kind"] == int(Kind.ALLOC))]
        assert max(v for _, v in held) == int(sizes.sum())
        # AND its phases are slices in begin order, each ended
        slices = read["events"][track(read, "phases", pid)]
        begins = [e.name for _, e in slices if e.type == TE.TYPE_SLICE_BEGIN]
        mine = [m for m in sorted(trace.markers, key=lambda m: m.ts) if m.pid == pid]
        assert begins == [m.name for m in mine if m.phase == "begin"]
        assert sum(e.type == TE.TYPE_SLICE_END for _, e in slices) == len(begins)
        instants = [e.name for _, e in slices if e.type == TE.TYPE_INSTANT]
        assert instants == [m.name for m in mine if m.phase == "instant"]
    # AND every IPC open ends a flow that starts at the other rank's export of the same handle
    starts, ends = {}, {}
    for uuid, evs in read["events"].items():
        d = read["tracks"][uuid]
        if d.name != "IPC":
            continue
        pid = read["tracks"][d.parent_uuid].process.pid
        for _, e in evs:
            starts.update({f: (pid, e.name) for f in e.flow_ids})
            ends.update({f: (pid, e.name) for f in e.terminating_flow_ids})
    opens = int((trace.events["kind"] == int(Kind.IPC_OPEN)).sum())
    assert len(ends) == opens > 0 and set(ends) == set(starts)
    for f, (pid, name) in ends.items():
        assert name == "cuIpcOpenMemHandle_v2" and starts[f][1] == "cuIpcGetMemHandle" and starts[f][0] != pid


def test_perfetto_failed_calls_are_instants_named_by_result(tmp_path):
    out = tmp_path / "golden.pftrace"
    assert export(GOLDEN, "perfetto", out) == 0
    read = read_perfetto(out)
    ev = load_trace(GOLDEN).events
    failed = ev[ev["result"] != 0]
    pid = int(failed["pid"][0])
    # (the failures track also has the marker's error the answer counts: the calls are the CUDA_ERROR_ ones)
    got = [(ts, e) for ts, e in read["events"][track(read, "failures", pid)] if e.name.startswith("CUDA_ERROR_")]
    assert [e.type for _, e in got] == [read["pb"].TrackEvent.TYPE_INSTANT] * len(failed)
    assert [ts for ts, _ in got] == failed["ts"].tolist()
    assert got[0][1].name == "CUDA_ERROR_OUT_OF_MEMORY" and got[1][1].name == "CUDA_ERROR_UNKNOWN"
    args = {a.name: (a.int_value or a.string_value) for a in got[0][1].debug_annotations}
    assert args["size"] == int(failed["size"][0]) and args["api"] == "cuMemAlloc_v2"


def test_perfetto_rendering_draws_every_track_of_the_file(tmp_path):
    """The README's picture of the export (tests/perfetto_tracks.py) draws what the file holds."""
    pytest.importorskip("matplotlib", reason="matplotlib not installed")
    # GIVEN the README's example exported to Perfetto
    out = tmp_path / "run.pftrace"
    assert export(SGLANG_IPC, "perfetto", out) == 0
    read = read_perfetto(out)
    # WHEN its tracks are drawn
    png = tmp_path / "tracks.png"
    rows = perfetto_tracks.render(read, png)
    # THEN there is one row per track that has events, and the picture is not blank
    assert rows == len(read["events"]) > 0
    from matplotlib.image import imread

    img = imread(png)
    assert img.shape[0] > 600 and img.shape[1] > 1000
    assert (img[..., :3] < 0.9).any(axis=2).mean() > 0.02
    # AND each phase slice of a rank is drawn with its begin and end paired
    TE = read["pb"].TrackEvent
    slices = perfetto_tracks.slices(read["pb"], read["events"][track(read, "phases")])
    begins = [e.name for _, e in read["events"][track(read, "phases")] if e.type == TE.TYPE_SLICE_BEGIN]
    assert sorted(name for *_, name in slices) == sorted(begins)


# ---------------------------------------------------------------------------------------- memory_viz


def memory_viz(*args: str) -> subprocess.CompletedProcess:
    """``python -m torch.cuda._memory_viz ARGS``: PyTorch's own reader, as its users run it.

    Skipped where torch is not installed, except in CI (``CI`` set), which installs it
    (``.ci/run``: the viz-test extra) and where a skip would hide that the consumer was never run.
    """
    if importlib.util.find_spec("torch") is None:
        why = "torch not installed (pip install 'memrec[viz-test]' or a torch CPU wheel)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI must run PyTorch's memory_viz (MEMREC_TEST_EXTRAS=viz-test, .ci/run)")
        pytest.skip(why)
    return subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", *args], capture_output=True, text=True,
                          timeout=120, check=True)


def test_memory_viz_one_snapshot_per_process_read_by_pytorch(tmp_path, capsys):
    out = tmp_path / "snapshot.pickle"
    assert export(SGLANG_IPC, "memory-viz", out) == 0
    trace = load_trace(SGLANG_IPC)
    allocs = trace.events[trace.events["kind"] == int(Kind.ALLOC)]
    pids = sorted({int(p) for p in allocs["pid"]})
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / f"snapshot.{p}.pickle") for p in pids]
    for pid in pids:
        path = tmp_path / f"snapshot.{pid}.pickle"
        mine = allocs[allocs["pid"] == pid]
        # THEN PyTorch's own reader replays one cudaMalloc per driver allocation, on device 0
        text = memory_viz("trace", str(path)).stdout
        assert "Device 0 ----" in text
        assert text.count("= cudaMalloc(") == len(mine)
        for size in mine["size"].tolist():
            assert f"cudaMalloc({int(mine['ptr'][mine['size'] == size][0])}," in text
        # AND its stats and its HTML timeline take the file
        assert "segments:" in memory_viz("stats", str(path)).stdout
        html = tmp_path / f"{pid}.html"
        memory_viz("trace_plot", str(path), "-o", str(html))
        assert "snapshot.pickle" in html.read_text()


def test_memory_viz_maps_and_oom(tmp_path):
    # GIVEN expandable segments (cuMemMap granules) and a trace with an out-of-memory
    out = tmp_path / "exp.pickle"
    assert export(EXPANDABLE, "memory-viz", out, "--at", "end") == 0  # the whole history
    snap = pickle.loads(out.read_bytes())
    ev = load_trace(EXPANDABLE).events
    actions = [a["action"] for trace in snap["device_traces"] for a in trace]
    # THEN each cuMemMap is a segment_map and each cuMemUnmap a segment_unmap, as PyTorch records them
    assert actions.count("segment_map") == int((ev["kind"] == int(Kind.VMM_MAP)).sum()) > 0
    assert actions.count("segment_unmap") == int((ev["kind"] == int(Kind.VMM_UNMAP)).sum())
    memory_viz("trace", str(out))
    oom = tmp_path / "oom.pickle"
    assert export(GOLDEN, "memory-viz", oom, "-p", "4243") == 0
    text = memory_viz("trace", str(oom)).stdout
    assert "raise OutOfMemoryError" in text


def test_memory_viz_keeps_the_last_entries(tmp_path, caplog):
    out = tmp_path / "exp.pickle"
    assert export(EXPANDABLE, "memory-viz", out, "--max-entries", "5") == 0
    snap = pickle.loads(out.read_bytes())
    full = tmp_path / "full.pickle"
    assert export(EXPANDABLE, "memory-viz", full) == 0
    every = pickle.loads(full.read_bytes())["device_traces"][0]
    assert snap["device_traces"][0] == every[-5:]
    assert f"the first {len(every) - 5} actions were left out" in caplog.text


def test_memory_viz_keeps_every_entry_under_a_limit_past_any_length(tmp_path):
    # GIVEN --max-entries of 10^23 (more than a deque's length holds: "internal error: OverflowError")
    out = tmp_path / "exp.pickle"
    assert export(EXPANDABLE, "memory-viz", out, "--max-entries", "1" + "0" * 23) == 0
    # THEN it is no limit: the same actions as the default's, which keeps all of this trace's
    full = tmp_path / "full.pickle"
    assert export(EXPANDABLE, "memory-viz", full) == 0
    assert pickle.loads(out.read_bytes())["device_traces"] == pickle.loads(full.read_bytes())["device_traces"]


# --------------------------------------------------------------------------------------- parquet/csv


@pytest.mark.parametrize("to", ["csv", "parquet"])
def test_an_export_stopped_half_way_leaves_no_cut_table(to, tmp_path, monkeypatch):
    if to == "parquet":
        pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed")
    from memrec.export import columnar

    # GIVEN an export stopped (Ctrl-C) right after the events table's first slice was written:
    # a 0-byte events.parquet, or an events.csv cut at a row, was left and read as the whole table
    parts = columnar.table_parts

    def first_then_stop(rec, name):
        for part in parts(rec, name):
            yield part
            if name == "events":
                raise KeyboardInterrupt

    monkeypatch.setattr(columnar, "table_parts", first_then_stop)
    out = tmp_path / "tables"
    # WHEN the command runs: the interrupt is its exit code 130
    assert export(GOLDEN, to, out) == 130
    # THEN the events table (the first one written) is not there, cut
    assert out.is_dir() and list(out.iterdir()) == []


def test_parquet_tables_are_typed(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed")
    pa = pytest.importorskip("pyarrow")
    out = tmp_path / "tables"
    assert export(GOLDEN, "parquet", out) == 0
    events = pq.read_table(out / "events.parquet")
    ev = load_trace(GOLDEN).events
    assert events.num_rows == len(ev)
    assert pa.types.is_dictionary(events.schema.field("kind").type)
    assert events.schema.field("size").type == pa.int64()
    assert events.schema.field("ts").type == pa.int64()
    kinds = events.column("kind").to_pylist()
    assert kinds == [Kind(k).name for k in ev["kind"].tolist()]
    opens = ev["kind"] == int(Kind.IPC_OPEN)
    assert np.array(events.column("size").to_pylist())[~opens].tolist() == ev["size"][~opens].tolist()
    oom = [r for r in events.to_pylist() if r["result"] == 2]
    assert oom[0]["result_name"] == "CUDA_ERROR_OUT_OF_MEMORY" and oom[0]["api"] == "cuMemAlloc_v2"
    markers = pq.read_table(out / "markers.parquet")
    assert markers.num_rows == len(load_trace(GOLDEN).markers)
    assert {p.stem for p in out.iterdir()} == {"events", "samples", "process_samples", "markers", "processes",
                                                "by_phase"}


def test_csv_tables_read_back_with_types(tmp_path):
    csv = pytest.importorskip("pyarrow.csv", reason="pyarrow not installed")
    pa = pytest.importorskip("pyarrow")
    out = tmp_path / "tables"
    assert export(SGLANG_IPC, "csv", out) == 0
    events = csv.read_csv(out / "events.csv")
    ev = load_trace(SGLANG_IPC).events
    assert events.schema.field("size").type == pa.int64()
    assert events.schema.field("kind").type == pa.string()
    opens = ev["kind"] == int(Kind.IPC_OPEN)
    assert np.array(events.column("size").to_pylist())[~opens].tolist() == ev["size"][~opens].tolist()
    phases = csv.read_csv(out / "by_phase.csv")
    alloc = dict(zip(phases.column("phase").to_pylist(), phases.column("allocated").to_pylist()))
    assert alloc["load_weights"] == int(ev["size"][ev["size"] > 20 * 2**30][0])


def test_tables_written_a_slice_at_a_time_equal_the_whole(tmp_path, monkeypatch):
    """The events table is built and written a slice of rows at a time (its memory bounded by the
    slice, not the trace): the files read back equal those of a single slice."""
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed")
    from memrec.export import columnar

    assert export(SGLANG_IPC, "parquet", tmp_path / "whole") == 0
    assert export(SGLANG_IPC, "csv", tmp_path / "whole-csv") == 0
    # GIVEN slices of 7 events and CSV text made 3 rows at a time
    monkeypatch.setattr(columnar, "SLICE_ROWS", 7)
    monkeypatch.setattr(columnar, "CSV_ROWS", 3)
    built = []
    real = columnar.Recording.event_rows

    def event_rows(self, every, ipc):  # each slice's (first, past its last) event index
        lo = built[-1][1] if built else 0
        built.append((lo, lo + len(every)))
        return real(self, every, ipc)

    monkeypatch.setattr(columnar.Recording, "event_rows", event_rows)
    # WHEN both are exported again
    assert export(SGLANG_IPC, "parquet", tmp_path / "sliced") == 0
    assert export(SGLANG_IPC, "csv", tmp_path / "sliced-csv") == 0
    # THEN the events table was built in slices of 7, never whole
    n = len(load_trace(SGLANG_IPC).events)
    assert n > 14 and built[: -(-n // 7)] == [(lo, min(lo + 7, n)) for lo in range(0, n, 7)]
    # AND every file reads back the same, row groups of 7 events in the Parquet one
    for name in ("events", "markers", "by_phase"):
        whole, sliced = pq.read_table(tmp_path / "whole" / f"{name}.parquet"), pq.read_table(tmp_path / "sliced" / f"{name}.parquet")
        assert repr(sliced.to_pylist()) == repr(whole.to_pylist()) and sliced.schema == whole.schema  # NaN: by repr
        assert (tmp_path / "sliced-csv" / f"{name}.csv").read_text() == (tmp_path / "whole-csv" / f"{name}.csv").read_text()
    assert pq.ParquetFile(tmp_path / "sliced" / "events.parquet").num_row_groups == -(-n // 7)


# ------------------------------------------------------------------------------------------- errors


def test_export_errors(tmp_path, capsys):
    assert export(tmp_path / "nope.mrec", "csv", tmp_path / "x") == ExitCode.NO_INPUT
    assert capsys.readouterr().err.count("\n") == 1
    (tmp_path / "afile").write_text("")
    assert export(GOLDEN, "parquet", tmp_path / "afile") == ExitCode.CANT_CREATE
    assert "not a folder" in capsys.readouterr().err
    assert export(GOLDEN, "perfetto", tmp_path) == ExitCode.CANT_CREATE
    assert export(GOLDEN, "memory-viz", tmp_path / "s.pickle", "-p", "1") == ExitCode.DATA
    assert "process 1 used no GPU memory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export(GOLDEN, "csv", tmp_path / "c", "-p", "1")


@pytest.mark.parametrize("to,extra", [("perfetto", ()), ("memory-viz", ("-p", "{pid}"))])
def test_export_onto_the_trace_itself_is_refused_and_the_trace_kept(tmp_path, capsys, to, extra):
    # GIVEN a copy of a recording, and a slip of the keyboard: -o names the trace itself
    trace = tmp_path / "run.mrec"
    trace.write_bytes(GOLDEN.read_bytes())
    pid = str(int(load_trace(trace).events["pid"][0]))
    # WHEN exported (memory-viz for one process writes exactly -o's name)
    rc = export(trace, to, trace, *(e.format(pid=pid) for e in extra))
    # THEN a usage error, one line, and the recording is still there, byte for byte
    assert rc == ExitCode.USAGE
    assert capsys.readouterr().err.count("\n") == 1
    assert trace.read_bytes() == GOLDEN.read_bytes()


def test_missing_package_is_one_line_with_a_command_that_works_here(tmp_path, capsys, monkeypatch):
    # GIVEN perfetto cannot be imported
    monkeypatch.setitem(sys.modules, "perfetto.trace_builder.proto_builder", None)
    # WHEN exporting to perfetto THEN one line says what to install, and the exit code says unavailable
    assert export(GOLDEN, "perfetto", tmp_path / "x.pftrace") == ExitCode.UNAVAILABLE
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    # AND the command it names is this environment's own pip (not the shell's `pip`, and not
    # `memrec[export]`, which the index does not have), with the export extra's packages
    command = err.rstrip("\n").rsplit("): ", 1)[1]
    argv = shlex.split(command)
    assert argv[:4] == [sys.executable, "-m", "pip", "install"] and "memrec[export]" not in command
    assert {a.split("<")[0].split(">")[0] for a in argv if not a.startswith("-") and "/" not in a} >= {"perfetto",
                                                                                                    "pyarrow"}
    # AND, copied as printed, it runs here (everything is installed already: a dry run says so)
    run = subprocess.run([*argv, "--dry-run", "--no-index"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    # AND no empty file is left where the trace was to go
    assert not (tmp_path / "x.pftrace").exists()


def test_missing_pyarrow_makes_no_folder(tmp_path, capsys, monkeypatch):
    # GIVEN pyarrow cannot be imported
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    # WHEN exporting to parquet THEN it says what to install and leaves no empty folder behind
    assert export(GOLDEN, "parquet", tmp_path / "tables") == ExitCode.UNAVAILABLE
    assert f"{sys.executable} -m pip install" in capsys.readouterr().err
    assert not (tmp_path / "tables").exists()


def test_large_values_stay_exact(tmp_path):
    """Sizes above 2**53 (no float on the way) survive the columnar path."""
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed")
    out = tmp_path / "t"
    assert export(GOLDEN, "parquet", out) == 0
    ptrs = pq.read_table(out / "events.parquet").column("ptr").to_pylist()
    assert ptrs == load_trace(GOLDEN).events["ptr"].tolist()
    assert np.uint64(max(ptrs)) == load_trace(GOLDEN).events["ptr"].max()


def test_memory_viz_shows_pytorch_blocks_inside_segments(tmp_path):
    # GIVEN a --tensors trace: a 20 MiB segment holding three tensor blocks, one freed
    from tests.utils import MiB
    from tests.utils import write_tensor_trace

    seg = 0x7F0000000000
    path = write_tensor_trace(tmp_path / "t.mrec", [(0, 4 * MiB), (4 * MiB, 1000), (8 * MiB, 2 * MiB), (4 * MiB, -1)],
                              segment=seg)
    out = tmp_path / "snap.pickle"
    assert export(path, "memory-viz", out, "--at", "end") == 0  # the whole history
    snap = pickle.loads(out.read_bytes())
    actions = [(a["action"], a["addr"], a["size"]) for a in snap["device_traces"][0]]
    # THEN the segment is a segment_alloc only, and each block has its own alloc and free
    assert actions == [("segment_alloc", seg, 20 * MiB), ("alloc", seg, 4 * MiB), ("alloc", seg + 4 * MiB, 1000),
                       ("alloc", seg + 8 * MiB, 2 * MiB), ("free_requested", seg + 4 * MiB, 1000),
                       ("free_completed", seg + 4 * MiB, 1000)]
    (segment,) = snap["segments"]
    assert [(b["address"], b["size"], b["state"]) for b in segment["blocks"]] == [
        (seg, 4 * MiB, "active_allocated"), (seg + 4 * MiB, 4 * MiB, "inactive"),
        (seg + 8 * MiB, 2 * MiB, "active_allocated"), (seg + 10 * MiB, 10 * MiB, "inactive")]
    assert segment["allocated_size"] == 6 * MiB
    # AND PyTorch's own reader replays the blocks as slices of the segment, as it shows its own
    text = memory_viz("trace", str(out)).stdout
    assert text.count("cudaMalloc(") == 1 and "d = a[8388608:2.0MiB]" in text and "del c # 1000.0B" in text
    assert "segments:" in memory_viz("stats", str(out)).stdout


def test_perfetto_tensor_counters_per_process(tmp_path):
    # GIVEN a --tensors trace: blocks of 4 MiB and 2 MiB in a 20 MiB segment, the first freed
    from tests.utils import MiB
    from tests.utils import write_tensor_trace

    path = write_tensor_trace(tmp_path / "t.mrec", [(0, 4 * MiB), (4 * MiB, 2 * MiB), (0, -1)])
    out = tmp_path / "t.pftrace"
    assert export(path, "perfetto", out) == 0
    read = read_perfetto(out)
    # THEN the process has its allocated and reserved counters (a value where it changes)
    allocated = [v for _, v in counter_values(read, track(read, "tensors allocated on GPU 0", parent_pid=7))]
    reserved = [v for _, v in counter_values(read, track(read, "tensors reserved on GPU 0", parent_pid=7))]
    assert allocated == [4 * MiB, 6 * MiB, 2 * MiB]
    assert reserved == [20 * MiB]


def test_perfetto_counter_packets_are_the_builders_bytes():
    # GIVEN counter values of every width: zeros, negatives (ten-byte varints), timestamps up to
    # 2^63, track uuids of one to six bytes, more values than one slice of the encoder
    pb = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2", reason="perfetto not installed")
    builder = pytest.importorskip("perfetto.trace_builder.proto_builder").StreamingTraceProtoBuilder
    import io

    from memrec.export.perfetto import COUNTER_SLICE
    from memrec.export.perfetto import _counter_packets

    rng = np.random.default_rng(26)
    n = COUNTER_SLICE + 999
    ts = (rng.integers(0, 2**63, n, dtype=np.int64) >> rng.integers(0, 63, n)).astype(np.uint64)
    values = rng.integers(-2**63, 2**63, n, dtype=np.int64) >> rng.integers(0, 64, n)
    values[::7] = 0
    for track in (1, 127, 128, 2**40 + 3):
        # WHEN they are encoded at once, and by perfetto's builder a packet at a time (as before)
        f = io.BytesIO()
        b = builder(f)
        for t, v in zip(ts.tolist(), values.tolist()):
            p = b.create_packet()
            p.trusted_packet_sequence_id = 1
            p.timestamp = t
            p.track_event.type = pb.TrackEvent.TYPE_COUNTER
            p.track_event.track_uuid = track
            p.track_event.counter_value = v
            b.write_packet(p)
        # THEN the bytes are the same
        assert _counter_packets(track, pb.TrackEvent.TYPE_COUNTER, ts, values) == f.getvalue()


# ------------------------------------------------------------------ what a user joins the tables on


def test_ipc_opens_carry_the_bytes_mapped_and_the_exporter(tmp_path):
    # GIVEN the two-rank run whose custom all-reduce maps each rank's buffer into the other
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed")
    out = tmp_path / "tables"
    # WHEN exported as Parquet and as CSV
    assert export(SEED_IPC, "parquet", out) == 0
    assert export(SEED_IPC, "csv", tmp_path / "csv") == 0
    rows = [r for r in pq.read_table(out / "events.parquet").to_pylist() if r["kind"] == "IPC_OPEN"]
    exports = {r["pid"]: r for r in pq.read_table(out / "events.parquet").to_pylist() if r["kind"] == "IPC_EXPORT"}
    # THEN each open has the size it mapped (the 30 GiB buffer of the other rank) and that rank's pid
    assert len(rows) == 2 and {r["size"] for r in rows} == {30 * 2**30}
    assert {r["pid"]: r["peer"] for r in rows} == {a: b for a, b in zip(sorted(exports), sorted(exports)[::-1])}
    # AND the CSV has the same numbers
    with open(tmp_path / "csv" / "events.csv", newline="") as f:
        csv_rows = [r for r in csvlib.DictReader(f) if r["kind"] == "IPC_OPEN"]
    assert [(int(r["size"]), int(r["peer"])) for r in csv_rows] == [(r["size"], r["peer"]) for r in rows]


def test_marker_values_are_json_and_every_table_has_a_wall_clock(tmp_path):
    # GIVEN the SGLang run, exported as Parquet and CSV
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed")
    pa = pytest.importorskip("pyarrow")
    import json

    trace = load_trace(SEED_IPC)
    anchor = trace.header["anchor"]
    assert export(SEED_IPC, "parquet", tmp_path / "pq") == 0
    assert export(SEED_IPC, "csv", tmp_path / "csv") == 0
    # THEN markers.values parses as JSON with the values' own types (true, not "True"; numbers)
    markers = pq.read_table(tmp_path / "pq" / "markers.parquet").to_pylist()
    values = [json.loads(m["values"]) for m in markers]
    dist = next(v for m, v in zip(markers, values) if m["name"] == "dist_init")
    assert dist["standin"] is True and dist["tp_size"] == 2 and dist["mem_fraction_static"] == 0.6
    # AND every table has a wall-clock column, UTC, the monotonic ts moved by the header's anchor
    for path in sorted((tmp_path / "pq").glob("*.parquet")):
        table = pq.read_table(path)
        walls = [f for f in table.schema if pa.types.is_timestamp(f.type)]
        assert walls and all(f.type.tz == "UTC" for f in walls), path.name
        if "ts" in table.column_names:
            ts = table.column("ts").to_pylist()
            wall = table.column("wall").cast(pa.int64()).to_pylist()
            assert wall == [t - anchor["monotonic_ns"] + anchor["wall_ns"] for t in ts], path.name
    # AND the CSV's wall clock is ISO 8601 text a join can parse, to the nanosecond
    with open(tmp_path / "csv" / "samples.csv", newline="") as f:
        first = next(csvlib.DictReader(f))
    expected = np.datetime64(int(first["ts"]) - anchor["monotonic_ns"] + anchor["wall_ns"], "ns")
    assert first["wall"] == np.datetime_as_string(expected, unit="ns", timezone="UTC") and first["wall"].endswith("Z")
