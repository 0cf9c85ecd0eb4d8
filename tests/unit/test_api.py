"""``memrec.load``: the documented Python API, as a notebook uses it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import memrec
import memrec.commands
from memrec.base.errors import ExitCode
from memrec.base.errors import TraceFormatError
from memrec.analysis.report.build import build_report
from memrec.terms.events import Kind
from memrec.trace.reader import load_trace

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "golden_v1.mrec"
SGLANG_IPC = ROOT / "examples" / "sglang-standin-ipc.mrec"


def test_tables_as_numpy_without_pandas():
    rec = memrec.load(SGLANG_IPC, pandas=False)
    ev = rec.events
    raw = load_trace(SGLANG_IPC).events
    assert isinstance(ev, np.ndarray) and len(ev) == len(raw)
    assert ev["kind"].tolist() == [Kind(k).name for k in raw["kind"].tolist()]
    opens = ev["kind"] == "IPC_OPEN"
    assert ev["size"].dtype == np.int64 and ev["size"][~opens].tolist() == raw["size"][~opens].tolist()
    # the phase of each event is its own process's phase at that time
    weights = ev[(ev["kind"] == "ALLOC") & (ev["phase"] == "load_weights")]
    assert len(weights) == 2 and len(set(weights["pid"].tolist())) == 2
    assert len(rec.samples) == len(load_trace(SGLANG_IPC).nvml)
    assert set(rec.processes["rank"].tolist()) >= {"TP0", "TP1"}


def test_tables_as_dataframes():
    pd = pytest.importorskip("pandas", reason="pandas not installed")
    rec = memrec.load(GOLDEN)
    assert isinstance(rec.events, pd.DataFrame)
    oom = rec.events.query("result_name == 'CUDA_ERROR_OUT_OF_MEMORY'")
    assert len(oom) == 1 and oom["api"].iloc[0] == "cuMemAlloc_v2"
    assert list(rec.markers["name"]) == [m.name for m in sorted(load_trace(GOLDEN).markers, key=lambda m: m.ts)]


def test_state_at_agrees_with_the_report_at_the_peak():
    rec = memrec.load(SGLANG_IPC, pandas=False)
    report = build_report(load_trace(SGLANG_IPC)).to_json()
    peak = report["gpus"][0]["peak"]
    state = rec.state_at(peak["t_s"])
    owned = state[(state["gpu"] == 0) & (state["category"] != "ipc_mapped")]
    assert int(owned["size"].sum()) == peak["bytes"]
    assert set(state["phase"].tolist()) <= {p["name"] for p in report["phases"]} | {"(no phase)"}
    # before anything happened, nothing is held
    assert len(rec.state_at(0.0)) == 0


def test_by_phase_and_reconcile():
    rec = memrec.load(SGLANG_IPC, pandas=False)
    ph = rec.by_phase()
    ev = load_trace(SGLANG_IPC).events
    alloc = ev[(ev["kind"] == int(Kind.ALLOC)) & (ev["result"] == 0)]
    owned = ph[ph["owned"]]
    assert int(owned["allocated"].sum()) == int(alloc["size"].sum())
    rc = rec.reconcile()
    device = rc[rc["pid"] == -1]
    assert len(device) == int((load_trace(SGLANG_IPC).nvml["gpu"] == 0).sum())
    assert (rc["untraced"] == rc["nvml_used"] - rc["traced"]).all()


def test_process_names_prefer_titles_and_never_cut_a_command():
    from memrec.analysis.names import process_title
    from memrec.terms.events import ProcessInfo

    def info(*argv: str) -> ProcessInfo:
        return ProcessInfo(pid=1, ppid=None, cmdline=list(argv), exe=None, cuda_visible_devices=None, gpu_map=[],
                           first_ts=0)

    # a title set with setproctitle, as /proc shows it (padded with empty arguments)
    assert process_title(info("sglang::scheduler_TP0", "", ""), "TP0") == "TP0 sglang::scheduler_TP0"
    spawn = info("/opt/venv/bin/python3", "-B", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(3)")
    assert process_title(spawn) == "python3 (spawned)"
    # every argument (the late flags tell runs apart), a path by its last part
    assert process_title(info("/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "/models/Llama-3-70B/",
                              "--tp", "8", "--port", "1", "--enable-custom-all-reduce")) == (
        "python3 -m sglang.launch_server --model-path …/Llama-3-70B --tp 8 --port 1 --enable-custom-all-reduce")
    # a very long command keeps whole arguments and says that some were left out
    long = process_title(info("python3", "train.py", *[f"--option-{i} {i}" for i in range(30)]))
    assert len(long) <= 120 and long.endswith(" …") and long.startswith("python3 train.py --option-0 0")
    assert process_title(None) == ""


def test_load_of_a_cut_trace_warns_and_keeps_what_is_readable(tmp_path):
    # GIVEN a copy of a recording cut in the middle (a crashed recorder, a partial copy)
    data = SGLANG_IPC.read_bytes()
    cut = tmp_path / "cut.mrec"
    cut.write_bytes(data[: len(data) // 2])
    # WHEN loaded from Python
    with pytest.warns(UserWarning) as caught:
        rec = memrec.load(cut, pandas=False)
    # THEN each reader warning is a Python warning naming the file, also kept on the trace
    messages = [str(w.message) for w in caught]
    assert any(m.startswith(f"{cut}: truncated tail after") for m in messages)
    assert any("no trailer" in m for m in messages) and len(messages) == len(rec.trace.warnings)
    assert {w.filename for w in caught} == {__file__}  # pointing at the line that called memrec.load
    # AND the events before the cut are there
    assert 0 < len(rec.events) < len(load_trace(SGLANG_IPC).events)


@pytest.mark.parametrize("size, reason", [(0, "empty file, not a memrec trace (yet?)"),
                                          (20, "trace ends inside its header")])
def test_load_of_a_trace_with_no_records_raises_what_the_commands_say(tmp_path, capsys, size, reason):
    # GIVEN an empty file, or one cut inside its header (every command refuses both, exit 65)
    path = tmp_path / "run.mrec"
    path.write_bytes(SGLANG_IPC.read_bytes()[:size])
    # WHEN loaded from Python  THEN the error the commands report, as TraceFormatError (it was an
    # empty Recording and a warning)
    with pytest.raises(TraceFormatError) as error:
        memrec.load(path, pandas=False)
    assert str(error.value).startswith(f"{path}: {reason}")
    assert memrec.commands.main(["report", str(path)]) == ExitCode.DATA
    assert capsys.readouterr().err == f"memrec: error: {error.value}\n"


def test_load_of_a_whole_trace_warns_nothing(recwarn):
    memrec.load(SGLANG_IPC, pandas=False)
    assert [str(w.message) for w in recwarn if issubclass(w.category, UserWarning)] == []


def test_without_pandas_load_names_the_install_command_and_numpy_still_works():
    # GIVEN a Python where pandas is not installed (a child interpreter that cannot import it)
    script = (
        "import sys; sys.modules['pandas'] = None\n"
        "import memrec\n"
        f"rec = memrec.load({str(SGLANG_IPC)!r}, pandas=False)\n"
        "print('numpy', type(rec.events).__name__, len(rec.by_phase()))\n"
        f"memrec.load({str(SGLANG_IPC)!r})\n"
    )
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    # WHEN the notebook's first line runs  THEN it fails at load, not at the first .query, with an
    # ImportError that says which command adds pandas to this very environment, and pandas=False
    assert proc.returncode == 1
    assert "numpy ndarray" in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("memrec.api.PandasMissing: memrec.load returns pandas DataFrames")
    assert f"{sys.executable} -m pip install" in last and "pandas" in last and "pandas=False" in last


def test_state_at_names_both_phases_apart():
    # GIVEN the failing run, at the KV sizing (after custom_ar_init allocated its buffers)
    rec = memrec.load(SGLANG_IPC, pandas=False)
    kv = next(m for m in rec.trace.markers if m.name == "kv_budget")
    state = rec.state_at((kv.ts - rec.start) / 1e9 + 1e-6)
    # THEN `phase` is the phase that allocated each piece (the weights are load_weights' even
    # though the process has moved on), `phase_at_t` the phase the owner is in at t
    weights = state[state["size"] == 25 * 2**30]
    assert len(weights) == 2 and set(weights["phase"].tolist()) == {"load_weights"}
    assert "load_weights" not in set(state["phase_at_t"].tolist())
    assert set(state["phase"].tolist()) >= {"load_weights", "custom_ar_init", "dist_init"}
    # AND `phase` is the rule the report uses for what is held ("held at the peak, by phase")
    report = build_report(load_trace(SGLANG_IPC)).to_json()
    peak = report["gpus"][0]["peak"]
    at_peak = rec.state_at(peak["t_s"])
    owned = at_peak[(at_peak["gpu"] == 0) & (at_peak["category"] != "ipc_mapped")]
    by_phase = {}
    for row in owned:
        by_phase[row["phase"]] = by_phase.get(row["phase"], 0) + int(row["size"])
    assert by_phase == {p["phase"]: p["bytes"] for p in peak["by_phase"]}


def test_marker_values_keep_their_types():
    rec = memrec.load(SGLANG_IPC, pandas=False)
    import json

    values = [json.loads(v) for v in rec.markers["values"]]
    assert any(v.get("standin") is True for v in values)  # true, not "True"


def test_the_notebook_in_docs_prints_what_the_doc_shows(monkeypatch):
    """docs/python-api.md's notebook session, run as written: each output block is what its call prints."""
    import re

    pd = pytest.importorskip("pandas", reason="pandas not installed")
    doc = (ROOT / "docs" / "python-api.md").read_text()
    session = doc.split("## A notebook session", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w*)\n(.*?)```", session, re.S)
    monkeypatch.chdir(ROOT)
    scope: dict = {}
    checked = 0
    for (lang, code), (next_lang, shown) in zip(blocks, blocks[1:] + [("", "")]):
        if lang != "python" or "run.mrec" in code:  # the pandas=False lines name no real file
            continue
        *body, last = code.strip().splitlines()
        exec("\n".join(body), scope)
        with pd.option_context("display.width", 200, "display.max_columns", 50):
            printed = str(eval(last, scope))
        if next_lang == "" and shown:
            assert [s.rstrip() for s in printed.splitlines()] == [s.rstrip() for s in shown.strip("\n").splitlines()]
            checked += 1
    assert checked >= 4
