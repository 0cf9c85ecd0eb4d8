"""SGLang's process model for real: workers started with multiprocessing ``spawn`` run ``site``
first, so the ``.pth`` bootstrap reaches each of them; each sends its own markers, stamped by the
server with the worker's pid (SO_PEERCRED), in the order the worker ran its phases."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import sglang_fakes

from memrec.analysis.sglang import kv_budget
from memrec.terms.events import Marker
from memrec.sglang_hooks import bootstrap


@pytest.fixture
def workdir():
    path = Path(tempfile.mkdtemp(prefix="mrsp", dir="/tmp"))  # short: it holds a Unix socket
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_spawned_workers_send_their_markers_with_their_own_pid_in_order(workdir, monkeypatch):
    # GIVEN memrec_sglang.pth in a site directory every new interpreter processes (through a
    # sitecustomize on PYTHONPATH: the test must not write into the venv), a fake SGLang 0.5.7
    # on the workers' path, MEMREC=1 and a marker server at MEMREC_SOCKET
    site_dir = workdir / "site"
    site_dir.mkdir()
    bootstrap.install_pth(site_dir)
    boot = workdir / "boot"
    boot.mkdir()
    (boot / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    pkgs = workdir / "pkgs"
    sglang_fakes.write_fake_sglang(pkgs, "0.5.7")
    sock = workdir / "m.sock"
    pythonpath = [str(boot), str(pkgs)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(pythonpath))
    monkeypatch.setenv("MEMREC", "1")
    monkeypatch.setenv("MEMREC_SOCKET", str(sock))
    monkeypatch.syspath_prepend(str(pkgs))  # spawn gives children the parent's sys.path
    server = sglang_fakes.MarkerServer(sock)
    ctx = multiprocessing.get_context("spawn")
    plans = {0: {}, 1: {"weights_gib": 17.0}, 2: {"weights_gib": 18.0}}
    procs = {rank: ctx.Process(target=sglang_fakes.child_main, args=(rank, plan)) for rank, plan in plans.items()}
    try:
        # WHEN three TP workers are spawned and run their startup
        for proc in procs.values():
            proc.start()
        for proc in procs.values():
            proc.join(timeout=60)
        codes = {rank: proc.exitcode for rank, proc in procs.items()}
        assert codes == {0: 0, 1: 0, 2: 0}, f"exit codes {codes} (3 = the bootstrap did not hook the worker)"
        pids = {rank: proc.pid for rank, proc in procs.items()}
        assert server.wait_for(lambda s: len(s.marks("init_model_worker")) == 6)
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
        server.close()
    # THEN each worker's markers came from its own pid, name its rank, and follow its phases in order
    marks = server.marks()
    assert {pid for pid, _ in marks} == set(pids.values())
    for rank, pid in pids.items():
        mine = [m for p, m in marks if p == pid]
        assert [(m["name"], m["phase"]) for m in mine if m["name"] != "gpu_memory_measured"] == sglang_fakes.EXPECTED_PHASES
        assert all(m["values"]["tp_rank"] == rank for m in mine if "tp_rank" in m["values"])
        stamps = [m["ts"] for m in mine]
        assert stamps == sorted(stamps)
        assert len({m["tid"] for m in mine}) == 1
    # AND the budgets rebuilt from what the server received differ by exactly the extra weights
    markers = [Marker(ts=m["ts"], pid=pid, uid=0, tid=m["tid"], name=m["name"], phase=m["phase"], gpu=m["gpu"],
                      values=m["values"]) for pid, m in marks]
    budgets = kv_budget.kv_budgets(markers)
    assert [(b.tp_rank, b.pid) for b in budgets] == [(r, pids[r]) for r in range(3)]
    rests = [b.rest_gib for b in budgets]
    assert rests[0] - rests[1] == pytest.approx(1.0) and rests[0] - rests[2] == pytest.approx(2.0)
    assert all(b.ok and b.tokens == b.sglang_tokens for b in budgets)
