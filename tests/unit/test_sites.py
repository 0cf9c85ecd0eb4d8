"""Allocation sites by phase (``memrec report``'s ``sites`` section and the answer's SITE line),
on traces with stacks written through the real writer (tests/stack_traces.py)."""

from __future__ import annotations

import json

import pytest

from memrec.analysis.report.build import build_report
from memrec.analysis.report.sites import Site
from memrec.analysis.report.sites import SitesSection
from memrec.analysis.report.sites import is_user_frame
from memrec.analysis.report.sites import user_frame
from memrec.commands import main
from memrec.trace.reader import load_trace
from memrec.trace.stacks import Frame
from tests.stack_traces import CUSTOM_AR
from tests.stack_traces import SP
from tests.stack_traces import sglang_trace
from tests.utils import GiB
from tests.utils import MiB


@pytest.mark.parametrize("frame, user", [
    (Frame(f"{SP}/sglang/srt/x.py", 1, "f"), True),
    (Frame("/home/me/train.py", 1, "main"), True),
    (Frame("train.py", 1, "main"), True),
    (Frame(f"{SP}/torch/cuda/memory.py", 1, "f"), False),
    (Frame(f"{SP}/memrec/sglang_hooks/hook.py", 1, "f"), False),
    (Frame("/usr/lib/python3.12/importlib/__init__.py", 1, "import_module"), False),
    (Frame("/usr/lib/python3.12/threading.py", 1, "run"), False),
    (Frame("/usr/local/lib/python3.11/dist-packages/vllm/x.py", 1, "f"), True),
    (Frame("<frozen importlib._bootstrap>", 1, "_call_with_frames_removed"), False),
    (Frame("<unreadable>", 0, "EFAULT"), False),
    (Frame("/usr/lib/libcuda.so.1", 0x10, "cuMemAlloc_v2", native=True), False),
])
def test_the_user_frame_rule(frame, user):
    assert is_user_frame(frame) is user


def test_a_stack_without_a_user_frame_takes_its_innermost_python_frame():
    native = Frame("/usr/lib/libcuda.so.1", 0x10, "cuMemAlloc_v2", native=True)
    torch = Frame(f"{SP}/torch/cuda/memory.py", 1, "f")
    assert user_frame((native, torch)) == torch
    assert user_frame((native,)) == native
    assert user_frame(CUSTOM_AR).function == "CustomAllreduce.__init__"
    # native frames under the recorder's note that Python could not be read: that note is the site
    why = Frame("<python stack unavailable>", 0, "EFAULT reading the thread state")
    assert Site.of((native, why)).label == "stack unavailable (python stack unavailable: EFAULT reading the thread state)"
    assert Site.of((native, Frame("<frozen runpy>", 88, "_run_code"))).label == "<frozen runpy>:88 _run_code"


def sites_of(path) -> SitesSection:
    return SitesSection.from_json(build_report(load_trace(path)).to_json()["sites"])


def test_sites_by_phase_join_the_ranks_and_say_what_each_held(tmp_path):
    # GIVEN two ranks that each allocate 18 GiB for custom all-reduce, 40 GiB of weights, a 2 GiB
    # scratch buffer freed inside load_weights, tensor blocks, and one stack that could not be read
    section = sites_of(sglang_trace(tmp_path / "t.mrec"))
    by = {p.phase: p.rows for p in section.phases}
    # THEN each phase names its sites, joined over both ranks, the most held first
    ar = by["custom_ar_init"][0]
    assert ar.site.label == "custom_all_reduce.py:123 CustomAllreduce.__init__" and ar.site.file.endswith(
        "device_communicators/custom_all_reduce.py")
    assert (ar.held, ar.allocated, ar.allocations, ar.pids, ar.ranks, ar.who) == (
        36 * GiB, 36 * GiB, 2, (100, 101), ("TP0", "TP1"), "2 ranks")
    # AND an unreadable stack is its own site, said so
    assert by["custom_ar_init"][1].site == Site("", 0, "", unavailable="python 3.9: interpreter layout unknown")
    # AND what was freed inside the phase was allocated there but is not held
    weights, scratch, tensors = by["load_weights"]
    assert (weights.site.function, weights.held) == ("DefaultModelLoader.load_model", 80 * GiB)
    assert (scratch.site.function, scratch.held, scratch.allocated) == ("scratch_buffer", 0, 4 * GiB)
    # AND its peak is what it took at once: 2 GiB on each rank, at the same time
    assert (weights.peak, ar.peak, scratch.peak) == (80 * GiB, 36 * GiB, 4 * GiB)
    # AND tensor blocks are counted apart from the driver memory that holds them
    assert (tensors.level, tensors.site.function, tensors.held) == ("tensor", "LlamaForCausalLM.load_weights", GiB)
    assert [p.phase for p in section.phases] == ["load_weights", "custom_ar_init"]
    assert (section.with_stack, section.without_stack) == (10, 2)


def test_filters_apply_to_sites(tmp_path):
    path = sglang_trace(tmp_path / "t.mrec")
    one = SitesSection.from_json(build_report(load_trace(path), pid=101).to_json()["sites"])
    assert one.top_in("custom_ar_init").pids == (101,) and one.top_in("custom_ar_init").held == 18 * GiB
    gpu0 = SitesSection.from_json(build_report(load_trace(path), gpu=0).to_json()["sites"])
    assert gpu0.top_in("load_weights").pids == (100,)


def test_a_process_exit_ends_what_it_held(tmp_path):
    from memrec.terms.events import Kind
    from memrec.trace import format as fmt
    from memrec.trace.writer import TraceWriter
    from tests.utils import ev
    from tests.utils import events

    with TraceWriter(tmp_path / "t.mrec", fmt.make_header(host="h")) as w:
        sid = w.intern_stack(CUSTOM_AR)
        w.write_events(events(ev(Kind.ALLOC, ts=10, pid=5, gpu=0, ptr=0x10, size=MiB, stack=sid),
                              ev(Kind.PROC_EXIT, ts=20, pid=5), ev(Kind.ALLOC, ts=30, pid=6, gpu=0, ptr=0x10, size=MiB)))
    row = sites_of(tmp_path / "t.mrec").top_in("(no phase)")
    assert (row.allocated, row.held, row.peak) == (MiB, 0, MiB)


def test_a_site_is_ranked_by_what_it_took_at_once_not_by_what_a_dead_process_still_holds(tmp_path):
    # GIVEN a process that allocated 3 x 1 GiB at one site (freed as it went: 1 GiB at once) and
    # 2 GiB at another, held until it died; and a 1 MiB buffer of a process still running
    from memrec.terms.events import Kind
    from memrec.trace import format as fmt
    from memrec.trace.writer import TraceWriter
    from tests.utils import ev
    from tests.utils import events

    loop = (Frame("/srv/app/loop.py", 7, "step"),)
    big = (Frame("/srv/app/model.py", 42, "build"),)
    small = (Frame("/srv/app/cache.py", 3, "warm"),)
    with TraceWriter(tmp_path / "t.mrec", fmt.make_header(host="h")) as w:
        a, b, c = w.intern_stack(loop), w.intern_stack(big), w.intern_stack(small)
        rows = [ev(Kind.ALLOC, ts=10, pid=5, gpu=0, ptr=0x100, size=GiB, stack=a),
                ev(Kind.FREE, ts=11, pid=5, gpu=0, ptr=0x100),
                ev(Kind.ALLOC, ts=11, pid=5, gpu=0, ptr=0x100, size=GiB, stack=a),  # reuses the address at once
                ev(Kind.FREE, ts=12, pid=5, gpu=0, ptr=0x100),
                ev(Kind.ALLOC, ts=13, pid=5, gpu=0, ptr=0x200, size=GiB, stack=a),
                ev(Kind.FREE, ts=14, pid=5, gpu=0, ptr=0x200),
                ev(Kind.ALLOC, ts=15, pid=5, gpu=0, ptr=0x300, size=2 * GiB, stack=b),
                ev(Kind.ALLOC, ts=16, pid=6, gpu=0, ptr=0x400, size=MiB, stack=c),
                ev(Kind.PROC_EXIT, ts=20, pid=5)]
        w.write_events(events(*rows))
    (phase,) = sites_of(tmp_path / "t.mrec").phases
    # THEN the sites come by their peak: model.py (2 GiB, gone with its process), loop.py (1 GiB at
    # once of 3 GiB allocated), cache.py (1 MiB, still held)
    assert [(r.site.function, r.peak, r.held, r.allocated) for r in phase.rows] == [
        ("build", 2 * GiB, 0, 2 * GiB), ("step", GiB, 0, 3 * GiB), ("warm", MiB, MiB, MiB)]


def test_the_report_text_and_json_show_the_sites(tmp_path, capsys):
    path = sglang_trace(tmp_path / "t.mrec")
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "allocation sites by phase" in out
    line = next(x for x in out.splitlines() if "custom_all_reduce.py:123" in x)
    assert "36.00 GiB" in line and "2 ranks" in line
    assert all(len(x) <= 80 for x in out.splitlines())
    assert main(["report", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    row = data["sites"]["phases"][1]["rows"][0]
    assert row["site"]["line"] == 123 and row["held"] == row["peak"] == 36 * GiB and row["level"] == "driver"


def test_the_answer_names_the_top_site_of_the_phase_it_names(tmp_path):
    answer = build_report(load_trace(sglang_trace(tmp_path / "t.mrec"))).to_json()["answer"]
    site = next(line for line in answer["lines"] if line[0] == "SITE")
    assert site[1:] == ["load_weights took most from loader.py:377 DefaultModelLoader.load_model: 80.00 GiB at its peak on 2 ranks"]


def test_the_answer_names_the_failed_calls_site(tmp_path):
    answer = build_report(load_trace(sglang_trace(tmp_path / "t.mrec", fail=True))).to_json()["answer"]
    assert answer["lines"][0][0] == "FAILED"
    site = next(line for line in answer["lines"] if line[0] == "SITE")
    assert site[1] == "the failed call came from memory_pool.py:210 MHATokenToKVPool._create_buffers"
    assert site[2].startswith("; load_weights took most from loader.py:377")


def test_a_trace_without_stacks_has_no_sites_and_the_same_report(tmp_path):
    with_stacks = build_report(load_trace(sglang_trace(tmp_path / "a.mrec"))).to_json()
    without = build_report(load_trace(sglang_trace(tmp_path / "b.mrec", stacks=False))).to_json()
    assert "sites" not in without
    assert [line[0] for line in without["answer"]["lines"]] == ["OK", "PEAK", "ROOM"]
    # every other section is the same: stacks only add
    for key in ("gpus", "phases", "processes", "tensors", "sglang"):
        assert json.dumps(with_stacks[key], sort_keys=True) == json.dumps(without[key], sort_keys=True), key


def test_a_site_named_with_terminal_escapes_is_shown_escaped(tmp_path, capsys):
    from memrec.terms.events import Kind
    from memrec.trace import format as fmt
    from memrec.trace.writer import TraceWriter
    from tests.utils import ev
    from tests.utils import events

    with TraceWriter(tmp_path / "t.mrec", fmt.make_header(host="h")) as w:
        sid = w.intern_stack([Frame("/x/\x1b]0;pwned\x07.py", 1, "f\x1b[2J")])
        w.write_events(events(ev(Kind.ALLOC, ts=10, pid=5, gpu=0, ptr=0x10, size=MiB, stack=sid)))
    assert main(["report", str(tmp_path / "t.mrec")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b]0;pwned" in out


def test_the_sglang_failure_answer_names_the_site_of_the_phase_that_took_the_memory(tmp_path, capsys, monkeypatch):
    # GIVEN the two-rank H200 run that failed with custom all-reduce, written again with stacks on
    # its allocations (custom_ar_init's from CustomAllreduce.__init__, the others' from the loader)
    from pathlib import Path

    from tests.stack_traces import WEIGHTS
    from tests.stack_traces import with_stacks

    src = Path(__file__).resolve().parents[2] / "examples" / "sglang-standin-ipc.mrec"
    path = with_stacks(src, tmp_path / "t.mrec", lambda name: CUSTOM_AR if name == "custom_ar_init" else WEIGHTS)
    plain, stacked = build_report(load_trace(src)).to_json(), build_report(load_trace(path)).to_json()
    # THEN the answer's three lines are the recording's, and a SITE line names custom all-reduce's line
    assert stacked["answer"]["lines"][:3] == plain["answer"]["lines"][:3]
    site = next(line for line in stacked["answer"]["lines"] if line[0] == "SITE")
    assert site[1].startswith("custom_ar_init took most from custom_all_reduce.py:123 CustomAllreduce.__init__: ")
    assert site[1].endswith(" on 2 ranks")
    # AND the report's text shows it at 80 columns, cut at a clause, never inside one
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["report", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].startswith("SITE    custom_ar_init took most from custom_all_reduce.py:123")


def test_a_damaged_size_is_clamped_and_a_stack_id_not_defined_names_no_site(tmp_path):
    from memrec.terms.events import Kind
    from memrec.trace import format as fmt
    from memrec.trace.writer import TraceWriter
    from tests.utils import ev
    from tests.utils import events

    with TraceWriter(tmp_path / "t.mrec", fmt.make_header(host="h")) as w:
        sid = w.intern_stack(CUSTOM_AR)
        w.write_events(events(ev(Kind.ALLOC, ts=10, pid=5, gpu=0, ptr=0x10, size=2**64 - 1, stack=sid),
                              ev(Kind.ALLOC, ts=20, pid=5, gpu=0, ptr=0x20, size=MiB, stack=999)))
    section = sites_of(tmp_path / "t.mrec")
    (row,) = section.phases[0].rows
    assert row.held == row.allocated == 1 << 52 and section.with_stack == 2


def test_report_all_lists_every_site(tmp_path, capsys):
    # GIVEN one phase whose 60 allocations each come from a line of their own
    from memrec.terms.events import Kind
    from memrec.terms.events import Marker
    from memrec.trace import format as fmt
    from memrec.trace.writer import TraceWriter
    from tests.utils import ev
    from tests.utils import events

    path = tmp_path / "many.mrec"
    with TraceWriter(path, fmt.make_header(host="h")) as w:
        w.write_marker(Marker(ts=1, pid=7, uid=0, tid=7, name="load", phase="begin"))
        rows = [ev(Kind.ALLOC, ts=10 + i, pid=7, gpu=0, ptr=0x1000 * (i + 1), size=(100 - i) * MiB,
                   stack=w.intern_stack([Frame("/srv/app/load.py", 1000 + i, f"part_{i}")])) for i in range(60)]
        w.write_events(events(*rows))
        w.write_marker(Marker(ts=100, pid=7, uid=0, tid=7, name="load", phase="end"))
    # WHEN reported as by default THEN the text shows the first 5 and says how many more
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "load.py:1004 part_4" in out and "load.py:1005 part_5" not in out
    assert "... 55 more sites (report --all lists them)" in out
    # AND the JSON keeps 50 and counts the rest
    assert main(["report", str(path), "--json"]) == 0
    (phase,) = json.loads(capsys.readouterr().out)["sites"]["phases"]
    assert (len(phase["rows"]), phase["more"]) == (50, 10)
    # WHEN reported with --all THEN every site is there, in the text and the JSON, most held first
    assert main(["report", str(path), "--all"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("allocation sites by phase"):]
    lines = [line for line in section.splitlines() if "load.py:" in line]
    assert [int(line.split("load.py:")[1].split()[0]) for line in lines] == list(range(1000, 1060))
    assert "more site" not in out
    assert main(["report", str(path), "--json", "--all"]) == 0
    (phase,) = json.loads(capsys.readouterr().out)["sites"]["phases"]
    assert (len(phase["rows"]), phase["more"]) == (60, 0)
    assert SitesSection.from_json({"phases": [phase], "stacks": 60, "with_stack": 60, "without_stack": 0}).phases[0].more == 0


def test_the_blocks_alive_at_a_failed_call_name_the_line_that_allocated_each(tmp_path, capsys):
    # GIVEN two ranks whose KV pool's segment allocation fails while a 512 MiB tensor block made by
    # the model's load_weights is alive (a trace recorded with --tensors --stacks)
    path = sglang_trace(tmp_path / "t.mrec", fail=True)
    failures = build_report(load_trace(path)).to_json()["tensors"]["failures"]
    # THEN each failure's blocks carry their site, the line that made the tensor
    assert [(f["pid"], [(b["size"], b["site"]["function"], b["site"]["line"]) for b in f["largest"]])
            for f in failures] == [(pid, [(512 * MiB, "LlamaForCausalLM.load_weights", 402)]) for pid in (100, 101)]
    # AND the text shows it under ALLOCATED AT, in 80 columns
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    section = out[out.index("failed segment allocation"):out.index("allocation sites by phase")]
    assert "ALLOCATED AT" in section and section.count("llama.py:402 LlamaForCausalLM.load_weights") == 2
    assert all(len(line) <= 80 for line in section.splitlines())
    # AND without stacks the blocks are listed as before, without the column
    plain = sglang_trace(tmp_path / "plain.mrec", fail=True, stacks=False)
    failures = build_report(load_trace(plain)).to_json()["tensors"]["failures"]
    assert [b["site"] for f in failures for b in f["largest"]] == [None, None]
    assert main(["report", str(plain)]) == 0
    assert "ALLOCATED AT" not in capsys.readouterr().out
