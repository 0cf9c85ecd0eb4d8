"""``memrec merge``: traces of two hosts with shifted clocks joined on their wall-clock anchors,
then read by report, diff, dump and the TUI model; errors as one line with their exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memrec.base.errors import ExitCode
from memrec.commands import main
from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace import format as fmt
from memrec.engine.merge import PID_STRIDE
from memrec.trace.reader import TraceReader
from memrec.trace.reader import load_trace
from memrec.trace.writer import TraceWriter
from tests.utils import GiB
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_v1.mrec"
WALL = 1_764_000_000 * 10**9  # a wall-clock instant, ns
S = 10**9


def host_trace(path: Path, host: str, boot: str, mono_at_wall: int, wall_shift: int, allocs, esterror_us: int):
    """A trace of ``host`` whose CLOCK_MONOTONIC read ``mono_at_wall`` when the wall clock read WALL
    + ``wall_shift``; ``allocs``: (seconds after WALL, pid, gpu, size)."""
    header = fmt.make_header(
        host=host, boot_id=boot, anchor={"monotonic_ns": mono_at_wall, "wall_ns": WALL + wall_shift},
        gpus=[GpuInfo(0, f"GPU-{host}-0", "NVIDIA H200", 140 * GiB), GpuInfo(1, f"GPU-{host}-1", "NVIDIA H200", 140 * GiB)],
        clock_sync={"synchronized": True, "esterror_us": esterror_us, "maxerror_us": 10 * esterror_us},
    )

    def mono(seconds: float) -> int:
        return mono_at_wall + int(seconds * S) - wall_shift

    with TraceWriter(path, header) as w:
        w.write_process(ProcessInfo(100, 1, ["python", "-m", "worker", host], None, "0,1", [0, 1], mono(0.5)))
        w.write_marker(Marker(ts=mono(0.6), pid=100, uid=0, tid=100, name="load", phase="begin", gpu=0))
        w.write_events(events(*(ev(Kind.ALLOC, ts=mono(t), pid=pid, ptr=0x7000 + i * 0x1000000, size=size, gpu=gpu)
                                for i, (t, pid, gpu, size) in enumerate(allocs))))
        w.write_marker(Marker(ts=mono(9.0), pid=100, uid=0, tid=100, name="load", phase="end", gpu=0))
    return path


@pytest.fixture
def two_hosts(tmp_path):
    # node-a's monotonic clock read 100 s at WALL; node-b's (booted long before) read 5000 s when
    # the wall clock read WALL + 0.25 s: its anchor was taken a quarter second later
    a = host_trace(tmp_path / "a.mrec", "node-a", "boot-a", 100 * S, 0,
                   [(1.0, 100, 0, 1 * GiB), (3.0, 100, 0, 2 * GiB)], esterror_us=500)
    b = host_trace(tmp_path / "b.mrec", "node-b", "boot-b", 5000 * S, S // 4,
                   [(2.0, 100, 0, 512 * MiB), (4.0, 100, 1, 256 * MiB)], esterror_us=300)
    return a, b


def test_merge_orders_two_hosts_on_wall_clock_and_keeps_per_host_totals(two_hosts, tmp_path, capsys):
    a, b = two_hosts
    out = tmp_path / "job.mrec"
    # WHEN the two hosts' traces are merged
    assert main(["merge", str(a), str(b), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "2 host(s), 4 events" in said and "±0.820 ms" in said
    merged = load_trace(out)
    # THEN the events interleave by wall-clock time, on node-a's clock
    ev_ = merged.events
    assert ev_["ts"].tolist() == [101 * S, 102 * S, 103 * S, 104 * S]
    assert ev_["size"].tolist() == [1 * GiB, 512 * MiB, 2 * GiB, 256 * MiB]
    # AND the same pid on two hosts is two processes; GPUs are numbered host after host
    assert ev_["pid"].tolist() == [100, PID_STRIDE + 100, 100, PID_STRIDE + 100]
    assert ev_["gpu"].tolist() == [0, 2, 0, 3]
    assert [g.name for g in merged.gpus] == ["node-a:0 NVIDIA H200", "node-a:1 NVIDIA H200",
                                             "node-b:0 NVIDIA H200", "node-b:1 NVIDIA H200"]
    assert [g.uuid for g in merged.gpus][2] == "GPU-node-b-0"
    assert merged.processes[PID_STRIDE + 100].gpu_map == [2, 3]
    assert sorted(m.ts for m in merged.markers) == [100 * S + 6 * S // 10, 100 * S + 6 * S // 10, 109 * S, 109 * S]
    assert merged.trailer is not None and merged.trailer["hosts"] == 2

    # WHEN it is reported THEN the per-host, per-GPU totals are each host's own
    assert main(["report", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    peaks = {s["gpu"]: s["peak"]["bytes"] for s in report["gpus"]}
    assert peaks == {0: 3 * GiB, 1: 0, 2: 512 * MiB, 3: 256 * MiB}
    hosts = report["merged"]["hosts"]
    assert [(h["host"], h["pid_base"], h["offset_ns"]) for h in hosts] == [
        ("node-a", 0, 0), ("node-b", PID_STRIDE, 100 * S - 5000 * S + S // 4)]
    assert report["merged"]["clock_error_ns"] == (500 + 300) * 1000 + 2 * 10_000
    # AND the text report says so at the top
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "merged: 2 hosts on node-a's clock; expected clock error ±0.820 ms" in text
    assert "GPU 2  node-b:0 NVIDIA H200" in text


def test_a_merged_trace_reads_in_dump_diff_and_the_tui_model(two_hosts, tmp_path, capsys):
    a, b = two_hosts
    out = tmp_path / "job.mrec"
    assert main(["merge", str(a), str(b), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["dump", str(out)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["type"] == "header" and len(lines[0]["merged"]["hosts"]) == 2
    assert main(["diff", str(a), str(out)]) == 0
    assert capsys.readouterr().out
    pytest.importorskip("textual")
    from memrec.tui.model import TraceModel

    model = TraceModel.from_trace(load_trace(out))
    assert model.gpu_ids() == [0, 1, 2, 3]
    assert model.gpus[2].name == "node-b:0 NVIDIA H200"


def shifted_copy(src: Path, dst: Path, host: str, boot: str, mono_shift: int, wall_shift: int) -> Path:
    """``src`` as if recorded on another host whose monotonic clock reads ``mono_shift`` more and
    whose wall clock ``wall_shift`` more at the same instant: every timestamp moves with its clock."""
    with TraceReader(src) as reader:
        header = dict(reader.header)
        header.update(host=host, boot_id=boot)
        anchor = dict(header["anchor"])
        header["anchor"] = {"monotonic_ns": anchor["monotonic_ns"] + mono_shift, "wall_ns": anchor["wall_ns"] + wall_shift}
        with TraceWriter(dst, header) as w:
            for rec in reader:
                kind = rec["type"]
                if kind == "trailer":
                    continue
                if kind in ("events", "nvml", "procmem"):
                    key = "events" if kind == "events" else "samples"
                    rows = rec[key].copy()
                    rows["ts"] += np.uint64(mono_shift)
                    w.write_record({**rec, key: rows})
                elif kind == "marker":
                    w.write_record({**rec, "ts": rec["ts"] + mono_shift})
                elif kind == "process":
                    w.write_record({**rec, "first_ts": rec["first_ts"] + mono_shift})
                elif kind in ("keyframe", "lost"):
                    w.write_record({**rec, "ts": rec["ts"] + mono_shift})
    return dst


def test_a_recorded_trace_and_its_copy_from_a_shifted_host_report_the_same_per_gpu(tmp_path, capsys):
    # GIVEN the golden recording, and the same recording as seen from a host whose monotonic clock
    # is 3600.5 s ahead and whose wall clock is 2 s ahead
    b = shifted_copy(GOLDEN, tmp_path / "b.mrec", "other-host", "other-boot", 3600 * S + S // 2, 2 * S)
    out = tmp_path / "job.mrec"
    assert main(["merge", str(GOLDEN), str(b), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["report", str(GOLDEN), "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main(["report", str(out), "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    # THEN each host's GPUs show what the recording alone shows: peak and final bytes
    n = len(alone["gpus"])
    per_gpu = [(s["peak"]["bytes"], s["final"]["bytes"]) for s in alone["gpus"]]
    assert [(s["peak"]["bytes"], s["final"]["bytes"]) for s in merged["gpus"]] == per_gpu * 2
    # AND the copy's events sit 2 s later (its wall clock), its processes under their own pids
    b_peak = merged["gpus"][n]["peak"]["ts"] - merged["gpus"][0]["peak"]["ts"]
    assert b_peak == 2 * S
    assert len(merged["processes"]) == 2 * len(alone["processes"])
    assert merged["trace"]["lost"] == 2 * alone["trace"]["lost"]
    # AND merge read a format-1 file (the golden recording) and a format-2 one, and wrote format 2
    versions = [load_trace(p).header["version"] for p in (GOLDEN, b, out)]
    assert versions == [1, 2, 2]


def test_merge_errors_are_one_line_with_exit_codes(two_hosts, tmp_path, capsys):
    a, b = two_hosts
    out = tmp_path / "job.mrec"
    out.write_bytes(b"x")
    assert main(["merge", str(a), str(b), "-o", str(out)]) == ExitCode.CANT_CREATE
    assert capsys.readouterr().err == f"memrec: error: {out} exists: use -f/--force to replace it, or another -o\n"
    assert main(["merge", str(a), str(tmp_path / "missing.mrec"), "-o", str(tmp_path / "j2.mrec")]) == ExitCode.NO_INPUT
    not_trace = tmp_path / "n.mrec"
    not_trace.write_text("hello")
    assert main(["merge", str(a), str(not_trace), "-o", str(tmp_path / "j3.mrec")]) == ExitCode.DATA
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "not a memrec trace" in err
    assert main(["merge", str(a), "-o", str(a), "--force"]) == ExitCode.USAGE
    # a host whose events fall before the reference host booted: name it first instead
    early = host_trace(tmp_path / "early.mrec", "node-c", "boot-c", 200 * S, 0, [(-150.0, 1, 0, MiB)], esterror_us=100)
    assert main(["merge", str(a), str(early), "-o", str(tmp_path / "j4.mrec")]) == ExitCode.DATA
    assert "before the reference host booted" in capsys.readouterr().err
    assert main(["merge", str(early), str(a), "-o", str(tmp_path / "j5.mrec")]) == 0


def test_memory_held_before_a_file_began_joins_on_the_right_host_and_gpu(two_hosts, tmp_path, capsys):
    # GIVEN host c's trace is a rotated part: its first keyframe holds 1 GiB pid 50 took on its GPU 1
    from memrec.state import LiveState

    before = LiveState()
    before.apply(events(ev(Kind.ALLOC, ts=900 * S, pid=50, ptr=0xA000, size=GiB, gpu=1)))
    header = fmt.make_header(host="node-c", boot_id="boot-c", anchor={"monotonic_ns": 1000 * S, "wall_ns": WALL},
                             gpus=[GpuInfo(0, "GPU-c0", "NVIDIA H200", 140 * GiB), GpuInfo(1, "GPU-c1", "NVIDIA H200", 140 * GiB)])
    c = tmp_path / "c.mrec"
    with TraceWriter(c, header) as w:
        w.write_keyframe(1000 * S, 0, before.snapshot())
        w.write_events(events(ev(Kind.FREE, ts=1005 * S, pid=50, ptr=0xA000, gpu=-1)))
    a, _ = two_hosts
    out = tmp_path / "job.mrec"
    assert main(["merge", str(a), str(c), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["report", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # THEN the free matches the held memory (no anomaly), on node-c:1 = merged GPU 3, pid 10000050
    assert report["trace"]["anomalies"] == {}
    gpu3 = next(s for s in report["gpus"] if s["gpu"] == 3)
    assert gpu3["name"].startswith("node-c:1") and gpu3["peak"]["bytes"] == GiB and gpu3["final"]["bytes"] == 0
    freed = load_trace(out).events
    assert freed["pid"].tolist() == [100, 100, PID_STRIDE + 50] and freed["gpu"].tolist() == [0, 0, 3]


def test_hosts_are_keyed_by_boot_id_and_name(tmp_path, capsys):
    # two files of one host and boot are one host (one clock, one pid space); a reboot is another host
    a1 = host_trace(tmp_path / "a1.mrec", "node-a", "boot-1", 100 * S, 0, [(1.0, 100, 0, MiB)], esterror_us=500)
    a2 = host_trace(tmp_path / "a2.mrec", "node-a", "boot-1", 100 * S, 0, [(2.0, 101, 1, 2 * MiB)], esterror_us=500)
    a3 = host_trace(tmp_path / "a3.mrec", "node-a", "boot-2", 7 * S, 0, [(3.0, 100, 0, 4 * MiB)], esterror_us=500)
    out = tmp_path / "job.mrec"
    assert main(["merge", str(a1), str(a2), str(a3), "-o", str(out)]) == 0
    capsys.readouterr()
    merged = load_trace(out)
    hosts = merged.header["merged"]["hosts"]
    assert [(h["host"], len(h["files"])) for h in hosts] == [("node-a@boot-1", 2), ("node-a@boot-2", 1)]
    assert merged.events["pid"].tolist() == [100, 101, PID_STRIDE + 100]
    assert merged.events["gpu"].tolist() == [0, 1, 2]
    assert merged.events["ts"].tolist() == [101 * S, 102 * S, 103 * S]


def test_one_recording_given_twice_is_refused_not_counted_twice(two_hosts, tmp_path, capsys):
    # GIVEN a host's trace and a copy of it under another name (a path given twice, a file copied
    # off the node twice)
    a, b = two_hosts
    copy = tmp_path / "a-copy.mrec"
    copy.write_bytes(a.read_bytes())
    for twice in ([a, b, a], [a, copy, b]):
        out = tmp_path / "job.mrec"
        # WHEN merged
        rc = main(["merge", *map(str, twice), "-o", str(out)])
        # THEN one line names both, exit 65, and no merged trace with every event doubled is written
        err = capsys.readouterr().err
        assert rc == ExitCode.DATA and err.count("\n") == 1
        assert f"{twice[2] if twice[2] == a else copy}: the same recording as {a}" in err
        assert not out.exists()


def test_two_separate_runs_of_one_host_are_refused_with_what_to_use_instead(tmp_path, capsys):
    # GIVEN the two runs of the seed recorded one after the other on one host, each by its own
    # `memrec record` (the working one and the one with custom all-reduce)
    examples = Path(__file__).resolve().parents[2] / "examples"
    base, ipc = examples / "seed-x2-base.mrec", examples / "seed-x2-ipc.mrec"
    out = tmp_path / "job.mrec"
    # WHEN merged as if they were one job's hosts
    rc = main(["merge", str(base), str(ipc), "-o", str(out)])
    # THEN one line says they are separate recordings of one host and names the diff, exit 65, and
    # no trace with both runs' ranks mixed (and KV numbers of neither) is written
    err = capsys.readouterr().err
    assert rc == ExitCode.DATA and err.count("\n") == 1
    assert f"{ipc}: a separate recording on the same host as {base}" in err
    assert f"memrec diff {base} {ipc}" in err
    assert not out.exists()
    # AND merge's --help says the same (it once said several recordings of one host join as it)
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "two recordings of one host are refused" in help_text and "several recordings" not in help_text


def test_a_merge_of_a_cut_trace_reports_as_cut_short(tmp_path, capsys):
    # GIVEN a recording cut before its end (no trailer: the recorder was killed), merged alone
    cut = tmp_path / "cut.mrec"
    cut.write_bytes(GOLDEN.read_bytes()[: GOLDEN.stat().st_size * 2 // 3])
    out = tmp_path / "job.mrec"
    assert main(["merge", str(cut), "-o", str(out)]) == 0
    capsys.readouterr()
    # WHEN the merged trace, which has merge's own trailer, is reported
    assert main(["report", str(out), "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    # THEN it is as incomplete as the cut trace: its answer says cut short, never a plain OK
    assert merged["merged"]["hosts"][0]["complete"] is False and merged["trace"]["complete"] is False
    assert "cut short" in "".join(merged["answer"]["lines"][0][1:])
    assert "!! no trailer (a merged host's trace)" in text
