"""Stacks in the views other than the report: ``memrec diff`` by site, the memory-viz export read
back by PyTorch's own ``torch.cuda._memory_viz``, and the table exports; each on traces written
through the real writer with stacks (tests/stack_traces.py), and unchanged without stacks."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle

import pytest

from memrec.analysis.diff.build import diff_traces
from memrec.analysis.diff.build import verdict_of
from memrec.analysis.diff.sites import SitesDiff
from memrec.commands import main
from memrec.trace.reader import load_trace
from tests.stack_traces import sglang_trace
from tests.utils import GiB


def viz():
    """PyTorch's own memory_viz module (skipped where torch is missing, except in CI)."""
    if importlib.util.find_spec("torch") is None:
        if os.environ.get("CI"):
            pytest.fail("torch missing: CI must run PyTorch's memory_viz (MEMREC_TEST_EXTRAS=viz-test)")
        pytest.skip("torch not installed (pip install 'memrec[viz-test]')")
    import torch.cuda._memory_viz as memory_viz

    return memory_viz


# ------------------------------------------------------------------------------------------ diff


def test_diff_says_which_site_grew(tmp_path, capsys):
    # GIVEN two runs alike but for custom all-reduce's buffers: 18 GiB a rank in A, 30 GiB in B
    a = sglang_trace(tmp_path / "a.mrec", custom_ar=18 * GiB)
    b = sglang_trace(tmp_path / "b.mrec", custom_ar=30 * GiB)
    diff = diff_traces(load_trace(a), load_trace(b))
    d = diff.to_json()
    sites = SitesDiff.from_json(d["sites"])
    # THEN the one site that changed is custom all-reduce's line, +12 GiB on each of 2 ranks
    (change,) = sites.changes
    assert (change.phase, change.site.function, change.site.line) == ("custom_ar_init", "CustomAllreduce.__init__", 123)
    assert (change.peak_a, change.peak_b, change.delta) == (36 * GiB, 60 * GiB, 24 * GiB)
    # AND the text says so in 80 columns
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    section = out[out.index("allocation sites that changed"):]
    assert "+24.00 GiB  custom_all_reduce.py:123" in section
    assert all(len(line) <= 80 for line in section.splitlines())
    # AND the verdict, which tui --diff and plot --diff show too, names that line
    line = "in custom_ar_init, custom_all_reduce.py:123 CustomAllreduce.__init__ peaks +24.00 GiB in B"
    assert line + " (36.00 GiB → 60.00 GiB, all ranks)" in diff.verdict.lines
    assert verdict_of(diff).lines == tuple(diff.verdict.lines)
    assert " ".join(out[:out.index("KV budget")].split()).count("custom_all_reduce.py:123") == 1


def test_diff_matches_sites_installed_in_different_folders(tmp_path):
    from memrec.analysis.report.sites import Site
    from memrec.analysis.diff.sites import site_key

    a = Site("/opt/venv/lib/python3.12/site-packages/sglang/x.py", 3, "f")
    b = Site("/home/u/.local/lib/python3.11/site-packages/sglang/x.py", 3, "f")
    assert site_key(a) == site_key(b) != site_key(Site("/opt/other/sglang/x.py", 3, "f"))


def test_diff_with_stacks_in_one_run_only(tmp_path, capsys):
    a = sglang_trace(tmp_path / "a.mrec", stacks=False)
    b = sglang_trace(tmp_path / "b.mrec")
    diff = diff_traces(load_trace(a), load_trace(b))
    sites = SitesDiff.from_json(diff.to_json()["sites"])
    assert not any(" peaks " in line for line in diff.verdict.lines)  # a verdict line compares two runs' stacks
    assert sites.only_b and not sites.only_a
    assert {c.site.function for c in sites.changes} >= {"CustomAllreduce.__init__", "DefaultModelLoader.load_model"}
    assert main(["diff", str(a), str(b)]) == 0
    assert "only B has stacks" in capsys.readouterr().out


def test_diff_without_stacks_is_unchanged(tmp_path):
    a = sglang_trace(tmp_path / "a.mrec", stacks=False)
    b = sglang_trace(tmp_path / "b.mrec", stacks=False, custom_ar=30 * GiB)
    assert "sites" not in diff_traces(load_trace(a), load_trace(b)).to_json()


# ------------------------------------------------------------------------------------ memory-viz


def test_memory_viz_segments_carry_the_allocations_frames(tmp_path, capsys):
    memory_viz = viz()
    # GIVEN a trace with stacks, exported for TP0 at its end
    path = sglang_trace(tmp_path / "t.mrec", tensors=False)
    out = tmp_path / "snap.pickle"
    assert main(["export", str(path), "--to", "memory-viz", "-o", str(out), "-p", "100", "--at", "end"]) == 0
    snap = pickle.loads(out.read_bytes())
    # THEN PyTorch's own flamegraph of the memory held names the user's lines under memrec's phase
    lines = memory_viz.memory(snap, format_flamegraph=lambda text: text).splitlines()
    ar = next(line for line in lines if "custom_all_reduce.py:123:CustomAllreduce.__init__" in line)
    assert ar.startswith("stream_0;active_allocated;memrec:custom_ar_init:0:cuMemAlloc_v2")
    assert ar.endswith(f" {18 * GiB}")
    # AND innermost first as PyTorch orders its frames: the driver, then torch, then SGLang
    frames = next(s["frames"] for s in snap["segments"] if s["total_size"] == 18 * GiB)
    assert [f["name"] for f in frames[:4]] == ["cuMemAlloc_v2", "caching_allocator_alloc", "decorate_context",
                                              "CustomAllreduce.__init__"]
    assert frames[3]["line"] == 123 and frames[-1]["filename"] == "memrec:custom_ar_init"
    # AND an unreadable stack says why, and the device trace's actions carry the same frames
    assert any("memrec:stack unavailable:0:python 3.9" in line for line in lines)
    alloc = next(a for a in snap["device_traces"][0] if a["action"] == "segment_alloc" and a["size"] == 18 * GiB)
    assert alloc["frames"] == frames
    assert "segments:" in memory_viz.segsum(snap)


def test_memory_viz_tensor_blocks_carry_their_frames(tmp_path):
    memory_viz = viz()
    path = sglang_trace(tmp_path / "t.mrec")
    out = tmp_path / "snap.pickle"
    assert main(["export", str(path), "--to", "memory-viz", "-o", str(out), "-p", "101", "--at", "end"]) == 0
    snap = pickle.loads(out.read_bytes())
    lines = memory_viz.memory(snap, format_flamegraph=lambda text: text).splitlines()
    assert f"stream_0;active_allocated;llama.py:402:LlamaForCausalLM.load_weights;module.py:1340:Module.to {512 << 20}" in lines


def test_memory_viz_without_stacks_is_unchanged(tmp_path):
    path = sglang_trace(tmp_path / "t.mrec", stacks=False, tensors=False)
    out = tmp_path / "snap.pickle"
    assert main(["export", str(path), "--to", "memory-viz", "-o", str(out), "-p", "100", "--at", "end"]) == 0
    snap = pickle.loads(out.read_bytes())
    assert all(len(s["frames"]) == 1 and s["frames"][0]["filename"].startswith("memrec:") for s in snap["segments"])


# ------------------------------------------------------------------------- tables and JSON lines


def test_load_gives_the_stack_column_and_the_stacks_table(tmp_path):
    import memrec

    rec = memrec.load(sglang_trace(tmp_path / "t.mrec"), pandas=False)
    events, stacks = rec.events_array(), rec.stacks_array()
    ar = events[(events["kind"] == "ALLOC") & (events["size"] == 18 * GiB)][0]
    frames = stacks[stacks["stack"] == ar["stack"]]
    # THEN the allocation's stack id names its frames, innermost first, the site marked
    assert frames["depth"].tolist() == list(range(len(frames)))
    assert frames["native"][0] and frames["function"][0] == "cuMemAlloc_v2"
    (site,) = frames[frames["site"]]
    assert (site["function"], site["line"]) == ("CustomAllreduce.__init__", 123)
    (unreadable,) = stacks[stacks["unavailable"] != ""]
    assert unreadable["unavailable"] == "python 3.9: interpreter layout unknown" and unreadable["file"] == ""
    # AND an event without a stack names none
    assert (events["stack"][events["size"] == 1 << 20] == 0).any()


def test_parquet_and_csv_exports_have_the_stacks_table_only_with_stacks(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    path = sglang_trace(tmp_path / "t.mrec")
    assert main(["export", str(path), "--to", "parquet", "-o", str(tmp_path / "pq")]) == 0
    stacks = pq.read_table(tmp_path / "pq" / "stacks.parquet").to_pydict()
    events = pq.read_table(tmp_path / "pq" / "events.parquet").to_pydict()
    assert "CustomAllreduce.__init__" in stacks["function"] and set(stacks["stack"]) <= set(events["stack"])
    assert main(["export", str(path), "--to", "csv", "-o", str(tmp_path / "csv")]) == 0
    header = (tmp_path / "csv" / "stacks.csv").read_text().splitlines()[0]
    assert header == "stack,depth,file,line,function,native,site,unavailable"
    # AND a trace without stacks exports the files and columns it always did
    plain = sglang_trace(tmp_path / "p.mrec", stacks=False)
    assert main(["export", str(plain), "--to", "csv", "-o", str(tmp_path / "csv2")]) == 0
    assert not (tmp_path / "csv2" / "stacks.csv").exists()
    assert "stack" not in (tmp_path / "csv2" / "events.csv").read_text().splitlines()[0].split(",")


def test_dump_prints_stack_ids_and_definitions(tmp_path, capsys):
    from memrec.export.jsonl import event_lines
    from memrec.export.jsonl import event_text
    from memrec.trace.reader import TraceReader

    path = sglang_trace(tmp_path / "t.mrec")
    assert main(["dump", str(path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    stacks = [x for x in lines if x["type"] == "stacks"]
    events = [x for x in lines if x["type"] == "event"]
    assert stacks and lines.index(stacks[0]) < lines.index(events[0])
    assert {e["stack"] for e in events} >= {0, 1}
    # AND the chunk-at-a-time lines are the JSON encoder's
    encode = json.JSONEncoder(separators=(", ", ": "), ensure_ascii=False).encode
    chunk = next(item for kind, item in TraceReader(path).items() if kind == "events")
    slow = "".join(encode(line) + "\n" for line in event_lines(chunk.to_array()))
    assert event_text(chunk, encode).decode() == slow
