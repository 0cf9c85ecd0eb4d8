"""The answer wherever a user looks (issue 22): on the SGLang examples, the plot, the Perfetto trace
and the memory-viz snapshot show the same failure, cause and window as ``memrec report``'s first
three lines. Each is made by the real command and read back by its real consumer: the SVG's text,
Perfetto's own protos, PyTorch's ``_memory_viz``. (The TUI's first screen:
tests/tui/test_tui_answer_e2e.py, in a real terminal.)"""

from __future__ import annotations

import json
import pickle
import re
import sys
from pathlib import Path

import pytest

from memrec.analysis.report.answer import Answer
from memrec.commands import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from perfetto_tracks import read_perfetto  # noqa: E402
from unit.test_export import memory_viz  # noqa: E402
from unit.test_export import track  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAILING = [ROOT / "examples" / n for n in ("sglang-standin-ipc.mrec", "seed-x2-ipc.mrec")]
IDS = [p.stem for p in FAILING]


def report(path: Path, capsys, monkeypatch, width: int = 200) -> tuple[list[str], Answer]:
    """``memrec report``'s first three lines (at ``width`` columns) and its ``--json`` answer."""
    monkeypatch.setenv("COLUMNS", str(width))
    assert main(["report", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()[:3]
    assert main(["report", "--json", str(path)]) == 0
    return lines, Answer.from_json(json.loads(capsys.readouterr().out)["answer"])


@pytest.mark.parametrize("path", FAILING, ids=IDS)
def test_report_names_the_failure_its_cause_the_fix_and_the_window(path, capsys, monkeypatch):
    lines, answer = report(path, capsys, monkeypatch)
    # THEN the first three lines are the answer's, the window at the end of the second
    assert lines == answer.text(200)
    assert lines[0].startswith("FAILED  SGLang's KV cache sizing") and lines[1].startswith("CAUSE   GPU 0: custom_ar_init")
    w = answer.window
    assert lines[1].endswith(f"; window +{w.start_s:.3f}–{w.end_s:.3f}s")
    # AND the failure is a rank's KV sizing inside that window, and every rank's is counted
    assert answer.failure.kind == "kv_sizing" and w.start_ts < answer.failure.ts <= w.end_ts
    assert sorted(f.who for f in answer.failures) == ["TP0", "TP1"]


@pytest.mark.parametrize("path", FAILING, ids=IDS)
def test_plot_shows_the_report_s_lines_marks_the_failures_and_reaches_the_capacity(path, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'memrec[plot]')")
    lines, answer = report(path, capsys, monkeypatch, width=150)
    out = tmp_path / "run.svg"
    assert main(["plot", str(path), "-o", str(out)]) == 0
    svg = out.read_text()
    texts = [re.sub(r"\s+", " ", t).strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]
    texts = [t.replace("&#39;", "'").replace("&gt;", ">").replace("&lt;", "<") for t in texts]
    # THEN the report's first three lines are its heading, one after the other
    said = [" ".join(line.split()) for line in lines]
    assert said[0] in texts
    at = texts.index(said[0])
    assert texts[at : at + 3] == said
    # AND each failure is marked with what failed and on which rank
    for f in answer.failures:
        assert f"{f.what} · {f.who}" in texts
    # AND the capacity is drawn, as the report writes it (140.40 GiB on the H200), within the y axis
    assert "capacity 140.40 GiB" in texts
    ticks = [float(t.split()[0]) for t in texts if re.fullmatch(r"[\d.]+ GiB", t)]
    assert max(ticks) >= 125  # the axis goes up to the capacity, not to the traced peak
    assert "the answer's window" in texts


@pytest.mark.parametrize("path", FAILING, ids=IDS)
def test_perfetto_has_the_answer_s_window_and_every_failure_as_instants(path, tmp_path, capsys, monkeypatch):
    pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2", reason="perfetto not installed")
    lines, answer = report(path, capsys, monkeypatch, width=10_000)
    out = tmp_path / "run.pftrace"
    assert main(["export", str(path), "--to", "perfetto", "-o", str(out)]) == 0
    read = read_perfetto(out)
    pb = read["pb"]
    # THEN one slice spans the window, named by the report's first line, its cause and fix as arguments
    (begin_ts, begin), (end_ts, _) = read["events"][track(read, "answer")]
    args = {a.name: a.string_value for a in begin.debug_annotations}
    assert begin.type == pb.TrackEvent.TYPE_SLICE_BEGIN
    assert (begin_ts, end_ts) == (answer.window.start_ts, answer.window.end_ts)
    assert "FAILED  " + begin.name == lines[0]
    assert "CAUSE   " + args["cause"] == lines[1] and "FIX     " + args["fix"] == lines[2]
    # AND every failure the report counts is an instant on its process's failures track (not an argument)
    for f in answer.failures:
        got = read["events"][track(read, "failures", f.pid)]
        hits = [(ts, e) for ts, e in got if ts == f.ts and e.type == pb.TrackEvent.TYPE_INSTANT]
        assert len(hits) == 1 and hits[0][1].name == "KV cache sizing failed"
        said = {a.name: a.string_value for a in hits[0][1].debug_annotations}
        assert said["failure"] == f.what and said["rank"] == f.who
        if f == answer.failure:
            assert said["answer"] == lines[0].removeprefix("FAILED  ")


def test_perfetto_ipc_instants_carry_size_peer_and_handle(tmp_path):
    pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2", reason="perfetto not installed")
    from memrec.terms.events import Kind
    from memrec.trace.reader import load_trace

    path = FAILING[0]
    out = tmp_path / "run.pftrace"
    assert main(["export", str(path), "--to", "perfetto", "-o", str(out)]) == 0
    read = read_perfetto(out)
    ev = load_trace(path).events
    opens = ev[ev["kind"] == int(Kind.IPC_OPEN)]
    seen = 0
    for pid in sorted({int(p) for p in opens["pid"]}):
        for ts, e in read["events"][track(read, "IPC", pid)]:
            args = {a.name: (a.int_value or a.string_value) for a in e.debug_annotations}
            if e.name != "cuIpcOpenMemHandle_v2":
                continue
            row = opens[(opens["ts"] == ts) & (opens["pid"] == pid)][0]
            # THEN an open says how much it mapped (18 GiB: the peer's custom all-reduce buffer), from whom, which handle
            assert args["size"] == 18 << 30 and args["peer"] != pid and args["peer"] in {int(p) for p in ev["pid"]}
            assert args["handle"] == row["ipc"].tobytes().hex()
            seen += 1
    assert seen == len(opens) == 2


@pytest.mark.parametrize("path", FAILING, ids=IDS)
def test_memory_viz_snapshot_at_the_failure_holds_what_the_cause_names(path, tmp_path, capsys, monkeypatch):
    lines, answer = report(path, capsys, monkeypatch)
    f = answer.failure
    out = tmp_path / "snap.pickle"
    assert main(["export", str(path), "--to", "memory-viz", "-o", str(out), "-p", str(f.pid)]) == 0
    snap = pickle.loads(out.read_bytes())
    # THEN the snapshot is at the failure (the default): its history stops there, its segments are what was held
    last = max(a["time_us"] for trace in snap["device_traces"] for a in trace)
    assert last <= f.ts // 1000
    phases = [s["frames"][0]["filename"] for s in snap["segments"]]
    assert "memrec:custom_ar_init" in phases and "memrec:load_weights" in phases
    # AND the peer's buffer mapped by IPC is there, named as such
    assert any("ipc_mapped from pid" in s["frames"][0]["name"] for s in snap["segments"])
    # AND PyTorch's own reader shows them: stats counts them, segment_plot draws them
    stats = memory_viz("stats", str(out)).stdout
    total = sum(s["total_size"] for s in snap["segments"])
    assert f"segments: {len(snap['segments'])}" in stats and len(snap["segments"]) >= 4
    assert total > 40 << 30
    html = tmp_path / "segments.html"
    memory_viz("segment_plot", str(out), "-o", str(html))
    assert html.stat().st_size > 1000
    # AND --at end has nothing left (the ranks exited), --at peak and a time work too
    assert main(["export", str(path), "--to", "memory-viz", "-f", "-o", str(out), "-p", str(f.pid), "--at", "end"]) == 0
    assert pickle.loads(out.read_bytes())["segments"] == []
    at = f"{answer.window.start_s:.3f}"
    assert main(["export", str(path), "--to", "memory-viz", "-f", "-o", str(out), "-p", str(f.pid), "--at", at]) == 0
    assert len(pickle.loads(out.read_bytes())["segments"]) < len(snap["segments"])


def test_memory_viz_at_refuses_what_is_not_a_moment(tmp_path, capsys):
    ok = ROOT / "examples" / "sglang-standin-base.mrec"
    out = tmp_path / "snap.pickle"
    for at, said in (("failure", "nothing failed in this trace"), ("soon", "not failure, peak, end or seconds"),
                     ("99", "the trace runs from 0 to"), ("nan", "not failure, peak, end or seconds"),
                     ("inf", "not failure, peak, end or seconds"), ("1e400", "not failure, peak, end or seconds")):
        assert main(["export", str(ok), "--to", "memory-viz", "-o", str(out), "--at", at]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0]
    assert not out.exists()
