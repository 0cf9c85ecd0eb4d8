"""Whole-trace commands cost O(events + processes), not O(processes × events) (issue 26).

``memrec report`` built a full-length series for every (GPU, process) pair: 100,000 short
processes over 1M events did not finish. :class:`memrec.engine.series.PidSteps` keeps each
process's own change points instead. Here: it says exactly what the dense per-process series say
(peak, its first row, final, low, the value at any row), and the report's work, counted as the
rows of every dense series it computes, does not grow with the number of processes (a count, not
a timing: it fails on a quadratic regression whatever the machine's load).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from memrec import commands
from memrec.terms.columns import empty_events
from memrec.engine.replay import build_timeline
from memrec.engine.series import GpuSeries
from memrec.terms.events import OWNED
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.trace.writer import TraceWriter


def events(n_alloc: int, processes: int, seed: int = 0, exits: bool = True) -> np.ndarray:
    """Allocations on 3 GPUs by ``processes`` processes, each freed a few allocations later or
    left held; some processes exit holding memory (one event, several changes)."""
    rng = np.random.default_rng(seed)
    rows = []
    live: list[tuple[int, int]] = []
    t = 1_000
    ptr = 1 << 40
    for a in range(n_alloc):
        pid = 5_000 + int(rng.integers(processes))
        ev = empty_events(1)
        ev["ts"], ev["pid"], ev["tid"] = t, pid, pid
        host = rng.random() < 0.1
        ev["kind"] = int(Kind.HOST_ALLOC if host else Kind.ALLOC)
        ev["api"] = int(Api.cuMemHostAlloc if host else Api.cuMemAlloc_v2)
        ev["ptr"], ev["size"], ev["gpu"] = ptr, int(rng.integers(1, 1 << 20)), -1 if host else int(rng.integers(3))
        rows.append(ev)
        live.append((pid, ptr, host))
        ptr += 1 << 21
        t += 10
        if live and rng.random() < 0.6:
            pid, p, host = live.pop(int(rng.integers(len(live))))
            ev = empty_events(1)
            ev["ts"], ev["pid"], ev["tid"], ev["ptr"] = t, pid, pid, p
            ev["kind"] = int(Kind.HOST_FREE if host else Kind.FREE)
            ev["api"] = int(Api.cuMemFreeHost if host else Api.cuMemFree_v2)
            rows.append(ev)
            t += 10
        if exits and rng.random() < 0.02:
            pid = 5_000 + int(rng.integers(processes))
            ev = empty_events(1)
            ev["ts"], ev["pid"], ev["tid"], ev["kind"] = t, pid, pid, int(Kind.PROC_EXIT)
            rows.append(ev)
            live = [x for x in live if x[0] != pid]
            t += 10
    return np.concatenate(rows)


@pytest.mark.parametrize(("seed", "processes"), [(0, 12), (1, 12), (2, 12), (3, 1), (4, 2)])
def test_every_process_at_once_says_what_each_dense_series_says(seed: int, processes: int) -> None:
    tl = build_timeline(events(600, processes, seed))
    assert tl.gpus
    for s in tl.gpus.values():
        for cats in (OWNED, ("ipc_mapped",), ("driver",), None):
            steps = s.per_pid(cats)
            assert steps.pids.tolist() == s.pids()
            rows = np.arange(-1, len(s.ts))
            for i, p in enumerate(s.pids()):
                dense = s.series(p, cats)
                assert steps.peak[i] == dense.max() and steps.low[i] == dense.min()
                assert steps.peak_row[i] == int(np.argmax(dense))
                assert steps.final[i] == dense[-1] and steps.initial[i] == dense[0]
                assert steps.at_rows(i, rows).tolist() == dense[np.maximum(rows, 0)].tolist()
            for row in (0, len(s.ts) // 3, len(s.ts) - 1):
                assert steps.at_row(row).tolist() == [int(s.series(p, cats)[row]) for p in s.pids()]


def _report_work(path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Rows of every dense series ``memrec report`` (text and JSON) computes."""
    work = [0]
    dense = GpuSeries.series

    def counted(self: GpuSeries, *args, **kwargs) -> np.ndarray:
        work[0] += len(self.ts)
        return dense(self, *args, **kwargs)

    monkeypatch.setattr(GpuSeries, "series", counted)
    for argv in (["report", str(path)], ["report", "--json", str(path)], ["report", "-a", str(path)]):
        with contextlib.redirect_stdout(io.StringIO()):
            assert commands.main(argv) == 0
    monkeypatch.setattr(GpuSeries, "series", dense)
    return work[0]


def test_the_reports_work_does_not_grow_with_the_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = {}
    for processes in (4, 400):
        path = tmp_path / f"p{processes}.mrec"
        with TraceWriter(path, {"host": "test"}) as w:
            w.write_events(events(3_000, processes, seed=1, exits=False))
        work[processes] = _report_work(path, monkeypatch)
    assert work[4] > 0
    # the same events: the per-GPU and per-category series only (a series per process made it 100 ×)
    assert work[400] <= 1.5 * work[4], work


def _lines(run: Callable[[], None]) -> int:
    """Lines of Python ``run()`` executes (its output to stdout discarded): a comprehension's
    every item counts, numpy's work does not (it is per row, not per marker)."""
    import sys

    lines = [0]

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202 - sys.settrace's signature
        if event == "line":
            lines[0] += 1
        return tracer

    with contextlib.redirect_stdout(io.StringIO()):
        sys.settrace(tracer)
        try:
            run()
        finally:
            sys.settrace(None)
    return lines[0]


def _command(argv: list[str]) -> Callable[[], None]:
    def run() -> None:
        assert commands.main(argv) == 0

    return run


def _report_lines(path: Path, modes: tuple[tuple[str, ...], ...] = ((), ("--json",), ("-a",))) -> int:
    """Lines of Python ``memrec report`` (text, and each of ``modes``) executes on ``path``."""
    return sum(_lines(_command(["report", *mode, str(path)])) for mode in modes)


def _with_markers(path: Path, pairs: int, processes: int = 4) -> None:
    """The same 1,500 allocations with ``pairs`` step phases (begin/end, every 5th with an instant
    inside, every 7th with values): a step loop's markers, spread over the processes."""
    from memrec.terms.events import Marker

    ev = events(1_500, processes, seed=2, exits=False)
    t0, t1 = int(ev["ts"].min()), int(ev["ts"].max())
    every = (t1 - t0) // max(pairs, 1)
    pids = sorted(set(ev["pid"].tolist()))
    with TraceWriter(path, {"host": "test"}) as w:
        w.write_events(ev)
        for k in range(pairs):
            pid, ts = pids[k % len(pids)], t0 + every * k
            values = {"step": k} if k % 7 == 0 else {}
            w.write_marker(Marker(ts, pid, 0, pid, "step", "begin", k % 3, values))
            if k % 5 == 0:
                w.write_marker(Marker(ts + 1, pid, 0, pid, "tick", "instant", None, {}))
            w.write_marker(Marker(ts + every * len(pids) // 2, pid, 0, pid, "step", "end", k % 3))


def test_the_reports_work_per_marker_does_not_grow_with_the_markers(tmp_path: Path) -> None:
    # Issue 26: 50,000 markers took × 3.6 the report of the same events without them. Every marker
    # is some work (its record, phase, rows); what it must not be is work that grows with the
    # other markers (each phase searching every phase, a list of every marker's time per marker).
    # The text and -a: the JSON's encoding (the standard library's, a few hundred lines a phase)
    # would hide a quadratic term of a line per pair of markers. Both sizes past the text's 200
    # rows a table, so that a marker's share of the text is the same in both.
    work, text = {}, {}
    for pairs in (0, 400, 1600):
        path = tmp_path / f"m{pairs}.mrec"
        _with_markers(path, pairs)
        if not work:
            _report_lines(path, ((),))  # the first report imports what it needs: their lines are no report's
        text[pairs] = _report_lines(path, ((),))
        work[pairs] = text[pairs] + _report_lines(path, (("-a",),))
    per_pair_small = (work[400] - work[0]) / 400
    per_pair_large = (work[1600] - work[0]) / 1600
    assert per_pair_small > 0, work
    assert per_pair_large <= 1.3 * per_pair_small, work
    # and a pair's own work is bounded: 853 lines on main before the marker records were read
    # without their depth walk and the phases built as columns (branch `markers`: 663; branch
    # `markers2`, the phases kept as columns to the text: 476)
    assert per_pair_large <= PER_PAIR_LINES, work
    # the text makes objects only for the rows it shows (`-a` and `--json` make every row's):
    # reading the pair's records, pairing and folding them as columns
    assert (text[1600] - text[0]) / 1600 <= PER_PAIR_TEXT_LINES, text


#: The most Python lines ``memrec report`` and ``report -a`` may run per begin/end pair of markers
#: (the pair's record read and checked, its phase, its rows in the text): 476 on 2026-12-02.
PER_PAIR_LINES = 520
#: The same for the text alone (``memrec report``): 145 on 2026-12-02 (making a PhaseEntry and a
#: GpuPhase of every pair in the text, as before, fails both bounds).
PER_PAIR_TEXT_LINES = 165


def test_the_reports_work_per_process_does_not_grow_with_the_processes(tmp_path: Path) -> None:
    # The same for processes, counted in Python lines (the dense series are counted above): 100,000
    # short processes each make a few rows; a row must not cost in proportion to the others.
    work = {}
    for processes in (4, 400, 1600):  # as above: both past the text's 200 rows
        path = tmp_path / f"p{processes}.mrec"
        with TraceWriter(path, {"host": "test"}) as w:
            w.write_events(events(1_500, processes, seed=1, exits=True))
        if not work:
            _report_lines(path)  # the first report imports what it needs: their lines are no report's
        work[processes] = _report_lines(path, ((), ("-a",)))
    per_process_small = (work[400] - work[4]) / 396
    per_process_large = (work[1600] - work[4]) / 1596
    assert per_process_small > 0, work
    assert per_process_large <= 1.3 * per_process_small, work


def test_phases_of_many_processes_are_assigned_by_one_sort_the_same_as_by_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    # 100,000 processes with markers made Phases.assign mask every row once per process; past
    # FEW_PROCESSES it groups the rows with one sort: the same phase for every row, nested and
    # resumed phases, instants and rows of processes without markers included.
    from memrec.engine import phases as phases_mod
    from memrec.terms.events import Marker

    rng = np.random.default_rng(5)
    markers = []
    for pid in range(200):
        t = int(rng.integers(0, 50))
        for k in range(4):
            markers.append(Marker(t, pid, 0, pid, "step", "begin", None, {}))
            if k % 2:
                markers.append(Marker(t + 3, pid, 0, pid, "inner", "begin", None, {}))
                markers.append(Marker(t + 9, pid, 0, pid, "step", "end", None, {}))  # inner goes on
                markers.append(Marker(t + 12, pid, 0, pid, "inner", "end", None, {}))
            else:
                markers.append(Marker(t + 10, pid, 0, pid, "step", "end", None, {}))
            t += 20 + int(rng.integers(0, 5))
    phases = phases_mod.build_phases(markers)
    pids = rng.integers(0, 260, 20_000)  # some without markers
    ts = rng.integers(0, 160, 20_000)
    assert len(phases.segments) > phases_mod.FEW_PROCESSES
    by_sort = phases.assign(pids, ts)
    monkeypatch.setattr(phases_mod, "FEW_PROCESSES", 10**9)
    by_masks = phases.assign(pids, ts)
    assert by_sort.tolist() == by_masks.tolist() and (by_sort >= 0).any() and (by_sort < 0).any()


def _load(path: Path) -> None:
    """``memrec.load`` and the tables the exports write."""
    import memrec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no trailer: the writer's test traces have one, but say so)
        rec = memrec.load(path, pandas=False)
    rec.events_array(), rec.processes_array(), rec.by_phase_array(), rec.samples_array(), rec.markers_array()


def _tui_model(path: Path) -> None:
    """The TUI's model: the file's scan (the first frame's wait) and the replay."""
    from memrec.tui.sources import FileSource

    source = FileSource(str(path))
    source.scan()
    source.index()


def _whole_trace(command: str, path: Path, out: Path) -> Callable[[], None]:
    """One whole-trace command on ``path`` (its output files under ``out``)."""
    if command == "load":
        return lambda: _load(path)
    if command == "tui":
        return lambda: _tui_model(path)
    argv = {
        "diff": ["diff", str(path), str(path)],
        "dump": ["dump", str(path)],
        "plot": ["plot", str(path), "-o", str(out / "plot.svg"), "-f"],
    }.get(command) or ["export", str(path), "--to", command, "-o", str(out / f"out.{command}"), "-f"]
    return _command(argv)


#: The most Python lines each whole-trace command besides the report may run per begin/end pair of
#: markers (``_with_markers``), with what it ran on 2026-12-03 (branch `markers4`), on 2026-12-02
#: (branch `markers3`) and on main before that. A per-marker pass that came back (an SGLang walk of
#: every marker, an object per phase for the diff's rows or the by-phase table, a protobuf message
#: per slice, a JSON encoder per marker record) fails the bound; work per pair that grows with the
#: other pairs fails the linearity. Not ``plot``: matplotlib's work per band is its picture, and past
#: 100 bands a panel names only the wide ones (400 pairs name theirs, 1,600 do not).
PER_PAIR_WHOLE_TRACE = {
    "diff": 230,  # 208 (246 before: a Python step per usage row and per phase for the paths; main 581)
    "load": 150,  # 129 (131; main 252: a PhaseUsage and a Phase per by-phase row)
    "parquet": 145,  # 129 (131; main 252: the same tables)
    "csv": 180,  # 164 (165; main 286)
    "memory-viz": 145,  # 132 (141: the phases built twice; main 168)
    "perfetto": 185,  # 168 (200: a Phase and a protobuf message per slice, the phases built twice)
    "dump": 140,  # 125 (176: a JSON encoder per marker record)
    "tui": 185,  # 168 (185: the checks of the scan's loop per record)
}


@pytest.mark.parametrize("command", sorted(PER_PAIR_WHOLE_TRACE))
def test_each_whole_trace_commands_work_per_marker_is_bounded(command: str, tmp_path: Path) -> None:
    # Issue 26: 50,000 markers ≤ 1.5 × none for every whole-trace command, not the report alone.
    work = {}
    for pairs in (0, 400, 1600):
        path = tmp_path / f"m{pairs}.mrec"
        _with_markers(path, pairs)
        run = _whole_trace(command, path, tmp_path)
        if not work:
            _lines(run)  # the first run imports what it needs: their lines are no command's
        work[pairs] = _lines(run)
    per_pair_small = (work[400] - work[0]) / 400
    per_pair_large = (work[1600] - work[0]) / 1600
    assert per_pair_small > 0, work
    assert per_pair_large <= 1.3 * per_pair_small, work
    assert per_pair_large <= PER_PAIR_WHOLE_TRACE[command], work
