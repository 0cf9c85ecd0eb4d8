"""``memrec report`` answers first: its first three lines on the recorded examples, the width it
fits, and what the default view leaves out (kept with ``--all``)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from memrec.analysis.report.answer import Line
from memrec.analysis.report.answer import span
from memrec.analysis.report.build import build_report
from memrec.analysis.text import human
from memrec.analysis.text import table
from memrec.commands import main
from memrec.trace.reader import load_trace

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.mrec"))
GOLDEN = ROOT / "tests" / "data" / "golden_v1.mrec"


def report_text(path: Path, capsys, monkeypatch, columns: int | None = None, *extra: str) -> list[str]:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["report", str(path), *extra]) == 0
    return capsys.readouterr().out.splitlines()


def test_sglang_failure_answer_names_the_phase_the_gpu_and_the_fix(capsys, monkeypatch):
    # GIVEN the two-rank run that failed with custom all-reduce (recorded on an H200)
    path = ROOT / "examples" / "sglang-standin-ipc.mrec"
    report = build_report(load_trace(path)).to_json()
    summary = report["sglang"]["summary"]
    # WHEN reported
    first, cause, fix = report_text(path, capsys, monkeypatch)[:3]
    # THEN line 1 says what failed and on which ranks
    assert first.startswith("FAILED") and "KV cache sizing" in first and "TP0, TP1" in first
    assert f"rest {summary['min_rest_gib']:.2f} GiB" in first
    # AND line 2 the phase, on which GPU, and how much it took (both ranks' custom all-reduce buffers)
    window = report["sglang"]["windows"][0]
    took = sum(r["owned"] for r in window["between"] if r["name"] == "custom_ar_init")
    assert cause.startswith(f"CAUSE   GPU {window['gpu']}: custom_ar_init took {human(took)}")
    # AND line 3 the fraction that works (rounded up) and the flag that drops the phase
    need = math.ceil(summary["needed_mem_fraction_static"] * 100) / 100
    assert fix.startswith(f"FIX     --mem-fraction-static {need:.2f}+") and "--disable-custom-all-reduce" in fix


def test_out_of_memory_answer_says_what_the_gpu_held_and_how_much_to_free(capsys, monkeypatch):
    first, cause, fix = report_text(GOLDEN, capsys, monkeypatch, 200)[:3]
    ev = load_trace(GOLDEN).events
    oom = ev[ev["result"] == 2][0]
    assert first.startswith(f"FAILED  cuMemAlloc_v2 of {human(int(oom['size']))} on GPU {int(oom['gpu'])}: "
                            "CUDA_ERROR_OUT_OF_MEMORY")
    assert "(+1 more failed call)" in first
    assert cause.startswith(f"CAUSE   GPU {int(oom['gpu'])} held")
    assert fix.startswith("FIX")


def test_a_holder_outside_any_phase_is_named_by_its_process_not_as_no_phase(capsys, monkeypatch):
    # GIVEN `memrec demo`'s trace: no markers, so what GPU 0 held at its out-of-memory is (no phase)
    path = ROOT / "tests" / "data" / "demo_oom.mrec"
    fix = report_text(path, capsys, monkeypatch, 200)[2]
    # THEN the FIX line names the process that held it ("the largest holder is (no phase)" read as
    # if a phase held the memory), as the CAUSE line does
    assert fix.endswith("; the largest holder is pid 6865") and "(no phase)" not in fix


def test_no_failure_answer_names_the_peak_and_what_held_it(capsys, monkeypatch):
    path = ROOT / "examples" / "sglang-standin-base.mrec"
    report = build_report(load_trace(path)).to_json()
    top = max(report["gpus"], key=lambda s: s["peak"]["bytes"])
    first, peak, room = report_text(path, capsys, monkeypatch)[:3]
    assert first.startswith(f"OK      no failed call; highest peak {human(top['peak']['bytes'])} on GPU {top['gpu']}")
    biggest = top["peak"]["by_phase"][0]
    assert f": {biggest['phase']} {human(biggest['bytes'])}" in peak
    assert room.startswith("ROOM    KV cache sized on every rank")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_fits_80_columns_and_says_no_ellipsis(path, capsys, monkeypatch):
    lines = report_text(path, capsys, monkeypatch)
    assert max(len(line) for line in lines) <= 80
    assert not any("..." in line for line in lines)
    assert lines[0].split()[0] in ("FAILED", "OK") and lines[3] == ""
    # process names come from titles or say what a process is, never a cut command line
    assert not any("multiprocessing.sp" in line for line in lines)


def test_columns_is_the_width(capsys, monkeypatch):
    path = ROOT / "examples" / "seed-x2-ipc.mrec"
    wide = report_text(path, capsys, monkeypatch, 200)
    narrow = report_text(path, capsys, monkeypatch, 60)
    assert max(map(len, wide)) > 100 and max(map(len, narrow)) <= 60
    # a wider terminal shows what did not fit the answer's lines in 80 columns
    assert len(wide[2]) >= len(report_text(path, capsys, monkeypatch)[2])


def test_not_a_terminal_is_80_columns():
    out = subprocess.run(
        [sys.executable, "-m", "memrec", "report", str(ROOT / "examples" / "seed-x2-ipc.mrec")],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, cwd=ROOT, check=True,
    ).stdout
    assert max(len(line) for line in out.splitlines()) <= 80


def test_default_view_leaves_out_exit_frees_and_zero_peaks_all_keeps_them(capsys, monkeypatch):
    path = ROOT / "examples" / "seed-x2-ipc.mrec"
    default = report_text(path, capsys, monkeypatch, 200)
    full = report_text(path, capsys, monkeypatch, 200, "--all")
    # the exit of TP0 freed 90.25 GiB implicitly: a "(no phase)" row with that free is --all only
    exits = build_report(load_trace(path)).to_json()["gpus"][0]["held_at_exit"]
    freed = human(exits[0]["owned"])
    assert any("(no phase)" in line and f"-{freed}" in line for line in full)
    assert not any("(no phase)" in line and f"-{freed}" in line for line in default)
    # a peer that only mapped memory has no "0 B  +0.000s" peak in the default view
    assert any("0 B  +0.000s" in line for line in full)
    assert not any("0 B  +0.000s" in line for line in default)
    # the second GPU repeats the first one apart from one NVML row: only that row is shown
    assert any(line.startswith("GPU 1: same as GPU 0 except") for line in default)
    assert any(line.startswith("GPU 1  NVIDIA H200") for line in full)


def test_helpers():
    assert span(["TP0", "TP1", "TP2", "TP3"]) == "TP0–TP3"
    assert span(["TP0", "TP2"]) == "TP0, TP2"
    assert Line("FIX", ("a", " bbbb", " cc")).fit(14) == "FIX     a bbbb"
    # a table's last column wraps under itself; other columns are dropped first when asked
    lines = table(["A", "B", "TEXT"], [["1", "22", "word " * 12]], right={0}, width=40, drop=(1,), wrap=True)
    assert max(map(len, lines)) <= 40 and lines[0].split() == ["A", "TEXT"]
    assert " ".join(x.strip() for x in lines[1:]).split() == ["1"] + ["word"] * 12


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_docs_show_the_current_answer_of_every_example(path, capsys, monkeypatch):
    """docs/report.md shows each example's first three lines as memrec prints them today."""
    doc = (ROOT / "docs" / "report.md").read_text()
    lines = report_text(path, capsys, monkeypatch)[:3]
    block = "\n".join([f"$ memrec report examples/{path.name} | head -3"] + lines)
    assert block in doc


def test_identical_blocks_collapse_into_one_line():
    from memrec.analysis.report.text import _GPU_BLOCK
    from memrec.analysis.report.text import collapse

    # GIVEN eight GPU sections, each one rank's, alike but for pids, ranks, GPU numbers and times;
    # GPU 5's rank held more
    lines = []
    for g in range(8):
        held = "60.00 GiB" if g != 5 else "70.00 GiB"
        lines += [f"GPU {g}  NVIDIA H200  GPU-{g:04x}", "=" * 20,
                  f"  peak traced   {held} at +8.{g}09s", f"  {100 + g}  TP{g}  {held}  +8.{g}09s", ""]
    procs = {100 + g: {} for g in range(8)}
    out = collapse(lines, _GPU_BLOCK, procs)
    # THEN GPU 0 is shown, 1-4 and 6-7 are one line each run, GPU 5 only shows what differs
    text = "\n".join(out)
    assert "GPU 1–4: same as GPU 0 (pids, ranks, times aside)" in out
    assert "GPU 6–7: same as GPU 0 (pids, ranks, times aside)" in out
    assert "GPU 5: same as GPU 0 except" in out and "70.00 GiB" in text
    assert text.count("peak traced") == 2


def test_seed_example_ranks_collapse(capsys, monkeypatch):
    lines = report_text(ROOT / "examples" / "seed-x2-ipc.mrec", capsys, monkeypatch)
    assert "TP1: same as TP0 (pids, ranks, times aside)" in lines
    full = report_text(ROOT / "examples" / "seed-x2-ipc.mrec", capsys, monkeypatch, None, "--all")
    assert any(line.startswith("TP1  pid") for line in full)


def test_a_pid_filter_answers_for_that_process(capsys, monkeypatch):
    path = ROOT / "examples" / "seed-x2-ipc.mrec"
    report = build_report(load_trace(path)).to_json()
    tp1 = next(r for r in report["sglang"]["ranks"] if r["label"] == "TP1")
    cause = report_text(path, capsys, monkeypatch, None, "-p", str(tp1["pid"]))[1]
    assert cause.startswith(f"CAUSE   GPU {tp1['gpu']}: ") and "(TP1)" in cause


def test_a_filter_that_keeps_no_memory_says_so_of_its_selection_not_of_the_trace(capsys, monkeypatch):
    # GIVEN the SGLang run that allocated 86.50 GiB, and its launcher, which allocated nothing
    path = ROOT / "examples" / "sglang-standin-ipc.mrec"
    launcher = next(p["pid"] for p in build_report(load_trace(path)).to_json()["processes"] if not p["rank"])
    # WHEN the report is filtered to the launcher, or to the launcher on GPU 0
    # THEN the first line speaks of that selection (it said "in this trace")
    assert report_text(path, capsys, monkeypatch, None, "-p", str(launcher))[0] == \
        f"OK      no GPU memory was allocated by pid {launcher}"
    assert report_text(path, capsys, monkeypatch, None, "-p", str(launcher), "-g", "0")[0] == \
        f"OK      no GPU memory was allocated by pid {launcher} on GPU 0"

def test_a_pid_filter_names_only_that_process_s_memory_at_the_peak(capsys, monkeypatch):
    # GIVEN two ranks that each held a 32.81 GiB KV pool at GPU 0's peak (65.62 GiB together)
    path = ROOT / "examples" / "sglang-standin-stock.mrec"
    report = build_report(load_trace(path)).to_json()
    ranks = {r["label"]: r["pid"] for r in report["sglang"]["ranks"]}
    assert "kv_pool 65.62 GiB (TP0, TP1)" in report_text(path, capsys, monkeypatch)[1]
    for label, pid in ranks.items():
        # WHEN the report is filtered to one rank
        peak = report_text(path, capsys, monkeypatch, None, "-p", str(pid))[1]
        # THEN the PEAK line holds that rank's pool alone, and names no other process
        assert peak.startswith("PEAK    held at the peak on GPU 0: kv_pool 32.81 GiB"), peak
        assert f"({label})" in peak and "pid" not in peak, peak
