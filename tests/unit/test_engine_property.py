"""Report, diff and the TUI model replay a trace the same way (issue 16's property).

Hypothesis generates markers (overlapping, unclosed, nested, instants, per process and per rank)
and driver/host allocations, frees and process exits; the trace is written with the real writer
and read back. A plain-Python oracle written from the documented semantics (docs/report.md,
"Phases") says, at every time, each process's phase and the bytes per GPU, category and phase;
``memrec report --json``, ``memrec diff --json``, ``memrec.load`` and the TUI's TraceModel must all
agree with it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import memrec
from memrec import commands
from memrec.base.errors import ExitCode
from memrec.terms.columns import EVENT_DTYPE
from memrec.engine.phases import NO_PHASE
from memrec.engine.phases import held_by_phase
from memrec.engine.replay import state_at
from memrec.terms.events import CATEGORIES
from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace import format as fmt
from memrec.trace.writer import TraceWriter
from memrec.tui.model import TraceModel
from tests.utils import MiB
from tests.utils import ev

T = 1_000_000  # one time step of the generated scenarios (1 ms)
START = 10 * T
PIDS = (101, 102, 103)


@dataclass(frozen=True)
class Op:
    t: int
    pid: int
    what: str  # "alloc" | "free" | "host" | "exit"
    gpu: int
    size: int
    pick: int  # which live allocation a free releases


markers_st = st.lists(
    st.tuples(st.integers(0, 30), st.sampled_from(PIDS), st.sampled_from("ABC"),
              st.sampled_from(("begin", "begin", "end", "end", "instant"))),
    max_size=14,
)
ops_st = st.lists(
    st.builds(Op, st.integers(0, 32), st.sampled_from(PIDS), st.sampled_from(("alloc", "alloc", "free", "host", "exit")),
              st.integers(0, 1), st.integers(1, 64).map(lambda k: k * MiB), st.integers(0, 7)),
    min_size=1, max_size=30,
)


# ---------------------------------------------------------------------------------------- the oracle


def oracle_label(markers: list[Marker], pid: int, ts: int) -> str:
    """The documented semantics, the slow way: an end closes the latest open begin of its name in
    its process; the phase is the open names, earliest begun first; spans are [begin, end)."""
    open_: list[str] = []
    for m in sorted(markers, key=lambda m: m.ts):  # stable: same-ts markers in arrival order
        if m.ts > ts:
            break
        if m.pid != pid:
            continue
        if m.phase == "begin":
            open_.append(m.name)
        elif m.phase == "end" and m.name in open_:
            del open_[len(open_) - 1 - open_[::-1].index(m.name)]
    return "/".join(open_) or NO_PHASE


def build(marks: list[tuple], ops: list[Op], ranked: bool) -> tuple[list[Marker], np.ndarray, list[dict]]:
    """Markers, events (time order) and the allocations they make (the oracle's own book)."""
    markers = []
    for t, pid, name, phase in marks:
        values = {"tp_rank": PIDS.index(pid)} if ranked else {}
        markers.append(Marker(START + t * T, pid, 0, pid, name, phase, None, values))
    rows = []
    book: list[dict] = []  # {pid, gpu, cat, size, t0, t1 (None: held), ptr}
    live: dict[int, list[dict]] = {p: [] for p in PIDS}
    exited: set[int] = set()
    ptr = 0x7F00_0000_0000
    at_t: dict[int, int] = {}
    for op in sorted(ops, key=lambda o: o.t):
        k = at_t[op.t] = at_t.get(op.t, -1) + 1
        ts = START + op.t * T + min(k, 3) * (T // 4)  # the first at a step shares a marker's time
        if op.pid in exited:
            continue
        if op.what in ("alloc", "host"):
            ptr += 0x20_0000
            host = op.what == "host"
            rows.append(ev(Kind.HOST_ALLOC if host else Kind.ALLOC, ts=ts, pid=op.pid, tid=op.pid, ptr=ptr,
                           size=op.size, gpu=-1 if host else op.gpu, ordinal=-1 if host else op.gpu))
            a = dict(pid=op.pid, gpu=-1 if host else op.gpu, cat="host_pinned" if host else "driver", size=op.size,
                     t0=ts, t1=None, ptr=ptr)
            book.append(a)
            live[op.pid].append(a)
        elif op.what == "free" and live[op.pid]:
            a = live[op.pid].pop(op.pick % len(live[op.pid]))
            kind = Kind.HOST_FREE if a["cat"] == "host_pinned" else Kind.FREE
            rows.append(ev(kind, ts=ts, pid=op.pid, tid=op.pid, ptr=a["ptr"]))
            a["t1"] = ts
        elif op.what == "exit":
            rows.append(ev(Kind.PROC_EXIT, ts=ts, pid=op.pid, tid=op.pid))
            for a in live[op.pid]:
                a["t1"] = ts
                a["exit"] = True
            live[op.pid] = []
            exited.add(op.pid)
    events = np.array(rows, dtype=EVENT_DTYPE) if rows else np.zeros(0, EVENT_DTYPE)
    return markers, events, book


def write(path: str, markers: list[Marker], events: np.ndarray) -> None:
    header = fmt.make_header(host="h", boot_id="b", anchor={"monotonic_ns": START, "realtime_ns": 0},
                             gpus=[GpuInfo(index=g, uuid=f"GPU-{g}", name="H200", total=1 << 40) for g in (0, 1)])
    with TraceWriter(path, header) as w:
        for p in PIDS:
            w.write_process(ProcessInfo(pid=p, ppid=1, cmdline=["python3", f"rank{p}"], exe="/usr/bin/python3",
                                          cuda_visible_devices=None, gpu_map=[], first_ts=START))
        for m in markers:
            w.write_marker(m)
        if len(events):
            w.write_events(events)


def cli_json(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert commands.main(list(argv)) == ExitCode.OK
    return json.loads(out.getvalue())


# ------------------------------------------------------------------------------------- the property


#: Issue 16's case on one process: A-begin t=10, B-begin t=20, A-end t=30, B never closed; memory
#: allocated at 25 (in "A/B") and at 31 (in "B"), one freed at 32 (in "B").
ISSUE_16 = dict(
    marks=[(10, 101, "A", "begin"), (20, 101, "B", "begin"), (30, 101, "A", "end")],
    ops=[Op(25, 101, "alloc", 0, 4 * MiB, 0), Op(31, 101, "alloc", 0, 2 * MiB, 0), Op(32, 101, "free", 0, 0, 0)],
    ranked=True,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(**ISSUE_16)
@given(markers_st, ops_st, st.booleans())
def test_report_diff_and_tui_give_the_same_phase_and_bytes_at_every_time(marks, ops, ranked):
    # GIVEN a trace of overlapping, unclosed and nested markers and allocations of three processes
    markers, events, book = build(marks, ops, ranked)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.mrec")
        write(path, markers, events)
        # WHEN the report, the diff (of the trace with itself), memrec.load and the TUI read it
        report = cli_json("report", path, "--json")
        diff = cli_json("diff", path, path, "--json")
        rec = memrec.load(path)
        tui = TraceModel.from_trace(rec.trace)
    times = sorted({int(t) for t in events["ts"]} | {m.ts for m in markers} | {START})
    end = times[-1]  # past the trace's end the TUI shows nothing (it does not know)
    times = sorted({t + d for t in times for d in (-1, 0, 1) if t + d <= end})
    pix = tui.phase_index()

    # THEN every process is in the same phase at every time, in the engine, the TUI and the oracle
    for t in times:
        for pid in PIDS:
            want = oracle_label(markers, pid, t)
            assert rec.phases.label_at(pid, t) == want, (pid, t)
            assert (pix.phase_of(pid, t) or NO_PHASE) == want, (pid, t)

    # THEN the bytes per GPU and category agree at every time (report's series, TUI's series, oracle)
    for t in times:
        for g in (-1, 0, 1):
            for c in ("driver", "host_pinned"):
                want = sum(a["size"] for a in book
                           if a["gpu"] == g and a["cat"] == c and a["t0"] <= t and (a["t1"] is None or a["t1"] > t))
                s = rec.timeline.gpus.get(g)
                assert (s.at(t, categories=(c,)) if s is not None else 0) == want, (g, c, t)
                v = tui.series_at(g, t)
                if len(events):  # a trace without events has no series in the TUI at all
                    assert v is not None and int(v[CATEGORIES.index(c)]) == want, (g, c, t)

    # THEN what each GPU holds, by the phase that allocated it, agrees after every event
    n = len(events)
    for i in range(n):
        t = int(events["ts"][i])
        st_ = state_at(events, i + 1, rec.trace.keyframes)
        for g in (-1, 0, 1):
            want: dict[str, int] = {}
            for a in book[: sum(1 for b in book if b["t0"] <= t)]:
                if a["gpu"] == g and (a["t1"] is None or a["t1"] > t):
                    label = oracle_label(markers, a["pid"], a["t0"])
                    want[label] = want.get(label, 0) + a["size"]
            got = {r.phase: r.bytes for r in held_by_phase(st_, g, rec.phases)}
            if i + 1 == n or int(events["ts"][i + 1]) != t:  # the oracle reads a time, not an event
                assert got == want, (g, i)
                tui_phases = {p: b for p, b, _ in tui.state_at(i, g, t).by_phase}
                assert tui_phases == want, (g, i)

    # THEN the whole trace's net bytes per (phase, GPU, category), process exits left out, are the
    # same in the report's phase rows, the diff's phase rows and the oracle
    oracle: dict[tuple, int] = {}
    for a in book:
        k = (oracle_label(markers, a["pid"], a["t0"]), a["gpu"], a["cat"])
        oracle[k] = oracle.get(k, 0) + a["size"]
        if a["t1"] is not None and not a.get("exit"):
            k = (oracle_label(markers, a["pid"], a["t1"]), a["gpu"], a["cat"])
            oracle[k] = oracle.get(k, 0) - a["size"]
    oracle = {k: v for k, v in oracle.items() if v}
    from_report: dict[tuple, int] = {}
    sections = report["gpus"] + ([report["host"]] if report["host"] else [])
    for sec in sections:
        for row in sec["phases"]:
            for c, b in row["by_category"].items():
                k = (row["path"], sec["gpu"], c)
                from_report[k] = from_report.get(k, 0) + b + row["exit_by_category"].get(c, 0)
    from_report = {k: v for k, v in from_report.items() if v}
    from_diff: dict[tuple, int] = {}
    for row in diff["phases"]:
        k = (row["phase"], row["gpu"], row["category"])
        from_diff[k] = from_diff.get(k, 0) + (row["a"] or 0)
    from_diff = {k: v for k, v in from_diff.items() if v}
    if rec.phases.phases:  # the report lists phase rows when the trace has phases
        assert from_report == oracle
    assert from_diff == oracle


def test_issue_16_case_reads_the_same_in_report_diff_and_tui(tmp_path):
    # GIVEN the issue's markers (B never closed) and memory taken in "A/B" and in "B"
    markers, events, _ = build(**ISSUE_16)
    path = str(tmp_path / "t.mrec")
    write(path, markers, events)
    # WHEN the report, the diff and the TUI read it
    report = cli_json("report", path, "--json")
    diff = cli_json("diff", path, path, "--json")
    tui = TraceModel.from_trace(memrec.load(path).trace)
    # THEN all say "A/B" at t=25 and "B" at t=40 (not "(no phase)", not "B" at both), and the
    # bytes of each land in the same phase row of the report and the diff
    pix = tui.phase_index()
    assert pix.phase_of(101, START + 25 * T) == "A/B" and pix.phase_of(101, START + 40 * T) == "B"
    rows = {r["path"]: r["net"] for r in report["gpus"][0]["phases"]}
    assert rows == {"A/B": 4 * MiB, "B": 2 * MiB - 4 * MiB}  # B freed at 32 what A/B took at 25
    assert {r["phase"]: r["a"] for r in diff["phases"]} == rows
