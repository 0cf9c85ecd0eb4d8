"""bench/load.py: the competitors run while the command runs, take CPU, and are gone after it.

The load figures in docs/performance.md ("At a load of 2") rest on this: a command run under
``load.py --procs 2`` must see exactly two busy siblings from its first instruction to its last,
and the record must say what they got.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LOAD = Path(__file__).resolve().parents[2] / "bench" / "load.py"

# The measured command: its siblings (the parent's other children) and how much CPU they use in
# 0.5 s of its own sleep; then it exits with 3, which load.py must pass on.
CHILD = """
import json, os, time
me, parent = os.getpid(), os.getppid()
def siblings():
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        return [int(p) for p in f.read().split() if int(p) != me]
def ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])
pids = siblings()
before = [ticks(p) for p in pids]
time.sleep(0.5)
print(json.dumps({"pids": pids, "used": [ticks(p) - t for p, t in zip(pids, before)]}))
raise SystemExit(3)
"""


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    record = tmp_path / "load.jsonl"
    out = subprocess.run([sys.executable, str(LOAD), *args, "--settle", "0.3", "--json", str(record), "--",
                          sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    seen = json.loads(out.stdout.splitlines()[0])
    return out, seen, json.loads(record.read_text().splitlines()[-1])


def test_two_competitors_run_through_the_command_and_are_gone_after(tmp_path):
    out, seen, record = run(tmp_path, "--procs", "2")
    assert out.returncode == 3, out.stderr  # the command's status
    assert len(seen["pids"]) == 2
    assert all(t > 0 for t in seen["used"]), seen  # busy while the command ran, not sleeping
    for pid in seen["pids"]:
        assert not os.path.exists(f"/proc/{pid}"), "a competitor outlived the command"
    assert record["procs"] == 2 and record["kinds"] == ["python", "numpy"]
    assert record["rc"] == 3
    # each competitor had a share of a CPU, however loaded the machine is (2 of N runnable)
    assert all(0.02 < s <= 1.05 for s in record["competitor_cpu_share"]), record
    assert record["loadavg_min"] <= record["loadavg_median"] <= record["loadavg_max"]
    assert "load: 2 competitor(s) (python, numpy)" in out.stdout.splitlines()[-1]


def test_procs_0_is_the_quiet_run_with_the_same_record(tmp_path):
    out, seen, record = run(tmp_path, "--procs", "0", "--kind", "numpy")
    assert out.returncode == 3
    assert seen["pids"] == []
    assert record["procs"] == 0 and record["competitor_cpu_share"] == []
    assert record["runnable_mean"] >= 0


def test_without_a_command_it_says_how_to_give_one():
    out = subprocess.run([sys.executable, str(LOAD), "--procs", "2"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "load.py: give the command after --, e.g. load.py --procs 2 -- python bench/bench_state.py"]


def test_a_sigterm_ends_the_command_and_the_competitors(tmp_path):
    # the command prints its pid and its siblings', then sleeps; load.py is stopped meanwhile
    child = ("import os, time\nme, parent = os.getpid(), os.getppid()\n"
             "with open(f'/proc/{parent}/task/{parent}/children') as f:\n"
             "    print(me, *[p for p in f.read().split() if int(p) != me], flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(LOAD), "--procs", "2", "--settle", "0.3", "--",
                             sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3
    proc.terminate()
    assert proc.wait(timeout=20) == 143
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
