"""Issue 23, item 7: every reader is bounded by its input (:mod:`memrec.trace.budget`).

A 33 KB file of keyframes whose states are Zstandard bombs made ``report`` pass 6 GB; 51-byte
chunks of 65,536 constant rows put 16.7 M events in 14 KB. Each reader (report, dump, the TUI's
loading path, ``memrec.load``) now draws from one budget per read, in proportion to the file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

import memrec
from memrec.base.errors import ExitCode
from memrec.trace import budget
from memrec.trace import codec
from memrec.trace.reader import load_trace

from tests.fuzz import bombs
from tests.unit.test_hardening import run

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _peak_over_baseline(path: str) -> int:
    """Peak RSS (bytes) of a fresh Python running every reader on ``path``, minus the same Python
    with the same imports that reads nothing."""
    prelude = (f"import sys, warnings; sys.path.insert(0, {ROOT!r}); warnings.simplefilter('ignore')\n"
               "import memrec, memrec.tui.sources, memrec.analysis.report.build\n"
               "from tests.fuzz.harness import run_commands, load_in_tui\n")
    work = (f"run_commands({path!r}); load_in_tui({path!r})\n"
            f"r = memrec.load({path!r}, pandas=False); r.events_array(); r.by_phase_array()\n")
    peaks = []
    for code in (prelude, prelude + work):
        # VmHWM, not ru_maxrss: that one keeps the parent's (pytest's) high-water mark across exec
        script = code + ("print(next(int(line.split()[1]) for line in open('/proc/self/status') "
                         "if line.startswith('VmHWM:')))")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        peaks.append(int(out.stdout.split()[-1]) * 1024)
    return peaks[1] - peaks[0]


BOMBS = {
    "four-256MiB-states-of-zeros": lambda: bombs.keyframe_bomb(4, 256 << 20),
    "states-of-empty-lists": lambda: bombs.keyframe_bomb(2, 64 << 20, empty_lists=True),
    "16.7M-constant-rows": lambda: bombs.rows_bomb(256),
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_compression_bomb_costs_every_reader_little_memory(tmp_path, name):
    data = BOMBS[name]()
    # GIVEN a file of a few KB that decompresses to gigabytes
    path = tmp_path / "bomb.mrec"
    path.write_bytes(data)
    assert path.stat().st_size < 64 << 10
    # WHEN report, report --json, dump, the TUI's loading path and memrec.load read it
    # THEN together they take less than 160 MiB over an idle interpreter (2.4-6 GB before)
    assert _peak_over_baseline(str(path)) < 160 * MiB
    # AND the reader says why it stopped, and how to read a genuine file of that kind
    warnings = " ".join(load_trace(path).warnings)
    assert "compression bomb?" in warnings and budget.ENV in warnings


def test_a_rows_bomb_reads_up_to_its_budget_and_the_override_reads_all(tmp_path, monkeypatch):
    path = tmp_path / "rows.mrec"
    path.write_bytes(bombs.rows_bomb(8))  # 524,288 rows in a few hundred bytes
    # WHEN read with the default budget THEN the rows of the floor come back (whole chunks)
    assert load_trace(path).n_events == budget.FLOOR_ROWS
    # WHEN the user raises it (a genuine trace that compresses that well) THEN every row comes back
    monkeypatch.setenv(budget.ENV, "4")
    trace = load_trace(path)
    assert trace.n_events == 8 * 65536 and not any("bomb" in w for w in trace.warnings)
    monkeypatch.setenv(budget.ENV, "unlimited")
    assert load_trace(path).n_events == 8 * 65536


def test_a_bad_override_is_one_line_with_a_usage_exit_code(tmp_path, monkeypatch):
    path = tmp_path / "rows.mrec"
    path.write_bytes(bombs.rows_bomb(1))
    for bad in ("lots", "0", "nan", "inf"):  # inf once overflowed in int(): an internal error, exit 70
        monkeypatch.setenv(budget.ENV, bad)
        code, _, err = run("report", str(path))
        assert code == ExitCode.USAGE and err.count("\n") == 1 and budget.ENV in err, (bad, err)


def test_the_budget_is_proportional_with_a_floor_and_a_ceiling():
    small, mid, huge = (budget.read_budget(size) for size in (1 << 10, 1 << 24, 1 << 50))
    assert small.rows == budget.FLOOR_ROWS and small.state == budget.FLOOR_STATE
    assert mid.rows == budget.ROWS_PER_BYTE << 24 and mid.bytes == budget.BYTES_PER_BYTE << 24
    assert huge.rows == budget.CEILING_ROWS and huge.bytes == budget.CEILING_BYTES
    # a 100M-event trace (about 50 MB at 0.5 byte an event) reads in full
    assert budget.read_budget(50 * 10**6).rows > 100 * 10**6


def test_genuine_traces_read_whole(tmp_path):
    # GIVEN every trace shipped with memrec (recorded on real GPUs and the stub driver)
    paths = [os.path.join(ROOT, "examples", p) for p in os.listdir(os.path.join(ROOT, "examples")) if p.endswith(".mrec")]
    paths += [os.path.join(ROOT, "tests", "data", p) for p in ("golden_v1.mrec", "golden_v2.mrec", "golden_v2_1.mrec", "golden_v2_2.mrec", "golden_v2_3.mrec")]
    for path in paths:
        # THEN none comes near its budget
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert not any("bomb" in w for w in memrec.load(path, pandas=False).trace.warnings), path


def test_a_frame_that_declares_a_huge_size_is_refused_before_it_is_allocated():
    # GIVEN a 15-byte Zstandard frame that declares 1 TiB of content (zstandard allocates the size a
    # frame declares, whatever max_output_size says), holding one RLE block of 1,000 bytes
    size = 1 << 40
    frame = (b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + size.to_bytes(8, "little")
             + (1 | 1 << 1 | 1000 << 3).to_bytes(3, "little") + b"x")
    assert codec.zstandard.frame_content_size(frame) == size
    # WHEN decompressed with a limit THEN it is refused by what it declares, nothing allocated
    with pytest.raises(codec.TooLarge, match=f"decompresses to {size} bytes"):
        codec.decompress(frame, 64 << 20)
    # AND an honest frame at the limit decompresses
    assert len(codec.decompress(codec.compress(b"x" * 1000), 1000)) == 1000


def test_proc_pseudo_files_are_not_regular_traces(tmp_path):
    # GIVEN /proc/self/status: a "regular" file of size 0 that reads non-empty
    for argv in (["report"], ["dump"], ["tui"]):
        code, _, err = run(*argv, "/proc/self/status")
        # THEN it is "not a regular file", not "empty file"
        assert code == ExitCode.NO_INPUT and "not a regular file" in err and err.count("\n") == 1, (argv, err)


def _flood(tmp_path, name):
    """A trace with 3,000 phases of one process named ``name(i)``, one after the other."""
    from tests.fuzz import edges

    records = [{"type": "events", "events": edges.base_events()}]
    for i in range(3000):
        for phase, ts in (("begin", 2000 + 2 * i), ("end", 2001 + 2 * i)):
            records.append({"type": "marker", "ts": ts, "pid": 7, "uid": 0, "tid": 7, "name": name(i),
                            "phase": phase, "gpu": 0, "values": {}})
    path = tmp_path / "flood.mrec"
    path.write_bytes(edges.pack(records))
    return path


def test_the_text_report_of_a_marker_flood_is_bounded_with_a_summary(tmp_path):
    # GIVEN a flood: 3,000 distinct phase names (1.43 GB of text for 300,000), names that differ
    # in more than a number (those fold into one row: below)
    path = _flood(tmp_path, lambda i: f"flood-{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}{i}")
    # WHEN reported as text THEN at most 200 rows a table, and a line that counts the rest
    code, out, _ = run("report", str(path))
    assert code == 0
    assert "… and 2,800 more phases and instants (memrec report --all, or --json, lists" in out
    assert out.count("flood-") <= 2 * 200 and len(out) < 100_000
    # AND --all lists every one
    code, out, _ = run("report", "--all", str(path))
    assert code == 0 and out.count("flood-") >= 3000 and "more phases" not in out


def test_a_numbered_flood_is_one_row_in_the_text(tmp_path):
    # GIVEN 3,000 phases of one process named flood-0 .. flood-2999 (a step loop's numbered steps)
    path = _flood(tmp_path, lambda i: f"flood-{i}")
    # WHEN reported as text THEN the phases are one row that says how many, with a note
    code, out, _ = run("report", str(path))
    assert code == 0 and len(out) < 100_000
    assert "flood-0 … flood-2999 ×3,000" in out and out.count("flood-") < 20, out
    assert "(×N: a process's phases of one name in a row" in out and "more phases" not in out
    # AND --all lists every one
    code, out, _ = run("report", "--all", str(path))
    assert code == 0 and out.count("flood-2999") >= 1 and "×3,000" not in out
