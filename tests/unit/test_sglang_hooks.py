"""The SGLang hooks on stand-ins shaped like the real targets, on fake SGLang packages (the
``.pth`` bootstrap for 0.5.7, SGLang's own plugin loader for 0.5.23), and on real SGLang
functions that run on the CPU.

What could run for real, without torch (source taken from the wheel, module-level imports
replaced by stubs): ``profile_max_num_token`` and ``get_cell_size_per_token`` (0.4.10, 0.5.7,
0.5.10), ``KVCacheConfigurator._profile_available_bytes``, ``MemoryPoolConfig`` and
``DefaultPoolConfigurator.calculate_pool_sizes`` (0.5.23), and SGLang 0.5.23's
``load_plugins`` / ``HookRegistry`` / ``environ`` as whole modules. What could not:
``get_available_gpu_memory`` (it calls ``torch.cuda``) — it is a stand-in everywhere.

Markers are checked two ways: through a fake client seam (``memrec.client.mark`` replaced) and
through the real client to a real Unix socket server in the test.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from pathlib import Path

import pytest
import sglang_fakes

from memrec import client
from memrec.analysis.sglang import kv_budget
from memrec.sglang_hooks import bootstrap
from memrec.sglang_hooks import plugin
from memrec.sglang_hooks import ranks as ranks_mod
from memrec.sglang_hooks import selfcheck
from memrec.sglang_hooks import targets
from memrec.sglang_hooks import wrappers
from memrec.sglang_hooks.state import STATE
from memrec.sglang_hooks.targets import TARGETS
from memrec.sglang_hooks.targets import HookSpec

GiB = 1 << 30


# -- fixtures ----------------------------------------------------------------------------------


class Recorder:
    """Stands in for ``memrec.client.mark``: keeps every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int | None, dict]] = []

    def __call__(self, name, phase="instant", gpu=None, **values):
        self.calls.append((name, phase, gpu, values))
        return True

    def names(self, skip_measured: bool = True) -> list[tuple[str, str]]:
        return [(n, p) for n, p, _, _ in self.calls if not (skip_measured and n == targets.GPU_MEMORY_MEASURED)]

    def find(self, name: str, phase: str | None = None) -> list[dict]:
        return [v for n, p, _, v in self.calls if n == name and (phase is None or p == phase)]

    def markers(self, pid: int = 1):
        """As trace markers (what the analysis reads)."""
        from memrec.terms.events import Marker

        return [Marker(ts=i, pid=pid, uid=0, tid=0, name=n, phase=p, gpu=g, values=v)
                for i, (n, p, g, v) in enumerate(self.calls)]


@pytest.fixture(autouse=True)
def _fresh_state():
    STATE.reset()
    yield
    STATE.reset()


@pytest.fixture
def rec(monkeypatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(client, "mark", recorder)
    return recorder


@pytest.fixture
def fake_sglang(monkeypatch, tmp_path):
    """A directory on sys.path for a fake ``sglang``; every ``sglang*`` module is dropped after."""
    before_modules = set(sys.modules)
    before_path = list(sys.meta_path)
    root = tmp_path / "pkgs"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    yield root
    bootstrap.uninstall()
    sys.meta_path[:] = before_path
    for name in list(sys.modules):
        if name not in before_modules and (name == "sglang" or name.startswith("sglang.")):
            del sys.modules[name]
    importlib.invalidate_caches()


def _wheel(line: str) -> Path:
    try:
        return sglang_fakes.wheel_source(line)
    except sglang_fakes.WheelUnavailable as error:
        pytest.skip(f"real SGLang {targets.WHEELS[line]} wheel unavailable: {error}")


# -- stand-ins built from the targets table -----------------------------------------------------

make_standin = selfcheck.standin
_call = selfcheck.call_standin


_ALL = [pytest.param(spec, id=f"{line}:{spec.qualname}") for line, specs in TARGETS.items() for spec in specs]


@pytest.mark.parametrize("spec", _ALL)
def test_every_target_hook_records_its_values(rec: Recorder, spec: HookSpec):
    # GIVEN a stand-in shaped like the target, hooked through the shared patch logic
    result = 12.5 if spec.result else None
    module, obj = make_standin(spec, result)
    assert wrappers.patch_target(spec, module)
    obj = getattr(module, spec.qualname.split(".")[0])
    kwargs = {p: f"arg:{p}" for p in spec.param_names}
    # WHEN it is called (outside any span)
    out = _call(spec, obj, kwargs)
    returned = out[0] if isinstance(out, tuple) else out
    # THEN the call returns what the stand-in returned ...
    assert returned == result
    # ... and the markers carry the parameters, attributes and result under the table's keys
    expected_params = {key: f"arg:{p}" for p, key in spec.params}
    expected_before = {key: f"before:{a}" for a, key in spec.attrs_before}
    expected_after = {key: f"after:{a}" for a, key in spec.attrs_after}
    if spec.result:
        expected_after[spec.result] = result
    if spec.marker is None:
        assert rec.calls == []  # contributes only, and there is no open span
        return
    if spec.hook == "around":
        assert [c[:2] for c in rec.calls[:2]] == [(spec.marker, "begin"), (spec.marker, "end")]
        begin, end = rec.calls[0][3], rec.calls[1][3]
        assert expected_params.items() <= begin.items()
        assert expected_before.items() <= begin.items()
        assert (expected_params | expected_before | expected_after).items() <= end.items()
        assert "error" not in end
        if spec.baseline_from:
            assert rec.calls[2][:2] == (targets.MEMORY_BASELINE, "instant")
            assert rec.calls[2][3]["pre_model_load_memory"] == end[spec.baseline_from]
        else:
            assert len(rec.calls) == 2
    else:
        assert [c[:2] for c in rec.calls] == [(spec.marker, "instant")]
        values = rec.calls[0][3]
        assert (expected_params | expected_before | (expected_after if spec.hook == "after" else {})).items() <= values.items()
    if spec.marker == targets.GPU_MEMORY_MEASURED:
        # the caller is the function that called the target (the hook's own frames are skipped)
        assert rec.calls[0][3]["caller"] == "call_standin"
        assert rec.calls[0][3]["caller_module"] == selfcheck.__name__
    if "class_name" in spec.extras:
        assert rec.calls[-1][3]["custom_ar_class"] == spec.qualname.split(".")[0]


def test_arguments_passed_by_position_are_read_like_keywords(rec: Recorder):
    # GIVEN the 0.5.7 kv_budget hook on a stand-in profile_max_num_token(self, total_gpu_memory)
    spec = next(s for s in TARGETS["0.5.7"] if s.marker == targets.KV_BUDGET)
    module, cls = make_standin(spec, 1000)
    wrappers.patch_target(spec, module)
    # WHEN it is called positionally
    cls.profile_max_num_token(object.__new__(cls), 79.25)
    # THEN the parameter is recorded under SGLang's newer name
    assert rec.find(targets.KV_BUDGET, "end")[0]["pre_model_load_memory"] == 79.25


def test_measurements_and_cell_size_go_into_the_enclosing_kv_budget_span(rec: Recorder):
    # GIVEN the 0.5.7 hooks on stand-ins: the kv_budget span, get_cell_size_per_token and
    # get_available_gpu_memory
    line = TARGETS["0.5.7"]
    budget = next(s for s in line if s.marker == targets.KV_BUDGET)
    cell = next(s for s in line if s.qualname.endswith("get_cell_size_per_token"))
    measure = next(s for s in line if s.marker == targets.GPU_MEMORY_MEASURED)
    utils = types.ModuleType("sglang_memrec_standin_utils")
    exec("def get_available_gpu_memory(device, gpu_id, distributed=False, empty_cache=True, cpu_group=None):\n"
         "    return 61.5 if distributed else 70.0\n", utils.__dict__)
    wrappers.patch_target(measure, utils)

    class Runner:
        mem_fraction_static = 0.875
        gpu_id = 3
        is_draft_worker = False

        def get_cell_size_per_token(self, num_layers):
            return 4096 * num_layers

        def profile_max_num_token(self, total_gpu_memory):
            utils.get_available_gpu_memory("cuda", 3)  # a local one first: not the budget's
            available = utils.get_available_gpu_memory("cuda", 3, distributed=True)
            cell_size = self.get_cell_size_per_token(32)
            rest = available - total_gpu_memory * (1 - self.mem_fraction_static)
            return int(rest * (1 << 30)) // cell_size

    module = types.ModuleType("sglang_memrec_standin_runner")
    module.ModelRunnerKVCacheMixin = Runner
    module.ModelRunner = Runner
    for spec in (budget, cell):
        wrappers.patch_target(spec, module)
    # WHEN the budget is profiled
    tokens = Runner().profile_max_num_token(79.0)
    # THEN the span's end carries SGLang's inputs and outputs: the first measurement taken inside
    # it, the cell size, the result ...
    end = rec.find(targets.KV_BUDGET, "end")[0]
    assert end["available_gpu_memory"] == 70.0  # the first measurement in the span
    assert end["available_gpu_memory_distributed"] is False
    assert end["cell_size"] == 4096 * 32 and end["num_layers"] == 32
    assert end["max_num_token"] == tokens
    assert end["pre_model_load_memory"] == 79.0 and end["mem_fraction_static"] == 0.875
    # ... and the measurements are also instants with their caller
    measured = rec.find(targets.GPU_MEMORY_MEASURED)
    assert [m["distributed"] for m in measured] == [False, True]
    assert {m["caller"] for m in measured} == {
        "test_measurements_and_cell_size_go_into_the_enclosing_kv_budget_span.<locals>.Runner.profile_max_num_token"
    }


def test_staticmethod_stays_a_staticmethod(rec: Recorder):
    # GIVEN CustomAllreduce.create_shared_buffer, a staticmethod in every version
    spec = next(s for s in TARGETS["0.5.22"] if s.qualname == "CustomAllreduce.create_shared_buffer")
    module, cls = make_standin(spec, ["ptr0", "ptr1"])
    # WHEN it is hooked
    wrappers.patch_target(spec, module)
    # THEN the class still holds a staticmethod, callable from the class and from an instance
    assert isinstance(cls.__dict__["create_shared_buffer"], staticmethod)
    assert cls.create_shared_buffer(size_in_bytes=8 << 20) == ["ptr0", "ptr1"]
    assert object.__new__(cls).create_shared_buffer(4096) == ["ptr0", "ptr1"]
    assert [v["size_in_bytes"] for v in rec.find(targets.CUSTOM_AR_SHARED_BUFFER)] == [8 << 20, 4096]
    # ... and hooking again changes nothing (both ways in see it is done)
    assert wrappers.patch_target(spec, module)
    assert wrappers.is_wrapped(cls.__dict__["create_shared_buffer"])
    cls.create_shared_buffer(1)
    assert len(rec.find(targets.CUSTOM_AR_SHARED_BUFFER)) == 3


def test_stale_from_import_names_are_rebound(rec: Recorder, monkeypatch):
    # GIVEN module A defining get_available_gpu_memory and module B that did `from A import ...`
    spec = next(s for s in TARGETS["0.5.7"] if s.marker == targets.GPU_MEMORY_MEASURED)
    a, fn = make_standin(spec, 5.0)
    b = types.ModuleType("sglang_memrec_standin_importer")
    b.get_available_gpu_memory = fn
    monkeypatch.setitem(sys.modules, b.__name__, b)
    monkeypatch.setitem(sys.modules, "not_sglang_module", types.SimpleNamespace())
    # WHEN A's function is hooked
    wrappers.patch_target(spec, a)
    # THEN B's stale binding points at the wrapper too
    assert b.get_available_gpu_memory is a.get_available_gpu_memory
    assert b.get_available_gpu_memory("cuda", 0) == 5.0
    assert len(rec.find(targets.GPU_MEMORY_MEASURED)) == 1


def test_missing_target_logs_once_and_stays_off(rec: Recorder, caplog):
    # GIVEN a module without the target a spec names
    spec = next(s for s in TARGETS["0.5.22"] if s.marker == targets.KV_BUDGET)
    module = types.ModuleType("sglang_memrec_standin_empty")
    caplog.set_level(logging.INFO, logger="memrec.sglang_hooks")
    # WHEN it is patched twice
    first = wrappers.patch_target(spec, module)
    second = wrappers.patch_target(spec, module)
    # THEN nothing is hooked and one line says so
    assert first is False and second is False
    lines = [r for r in caplog.records if spec.target in r.getMessage()]
    assert len(lines) == 1 and "stays off" in lines[0].getMessage()


def test_exception_passes_through_as_the_same_object(rec: Recorder):
    # GIVEN a hooked kv_pool stand-in that raises SGLang's RuntimeError
    spec = next(s for s in TARGETS["0.5.7"] if s.marker == targets.KV_POOL)
    error = RuntimeError("Not enough memory. Please try to increase --mem-fraction-static. "
                         "Current value: server_args.mem_fraction_static=0.88")

    class ModelRunnerKVCacheMixin:
        gpu_id = 0

        def init_memory_pool(self, total_gpu_memory, server_args):
            raise error

    init_memory_pool_line = ModelRunnerKVCacheMixin.init_memory_pool.__code__.co_firstlineno
    module = types.ModuleType("sglang_memrec_standin_raise")
    module.ModelRunnerKVCacheMixin = ModelRunnerKVCacheMixin
    wrappers.patch_target(spec, module)
    # WHEN it is called
    with pytest.raises(RuntimeError) as info:
        ModelRunnerKVCacheMixin().init_memory_pool(70.0, None)
    # THEN the very same exception object comes out, its traceback still reaching the raise ...
    assert info.value is error
    assert info.traceback[-1].name == "init_memory_pool"
    # ... and the end marker carries its text, the raising file:line and the traceback below the
    # hooked call (the hook's own frames left out)
    end = rec.find(targets.KV_POOL, "end")[0]
    assert end["error"] == f"RuntimeError: {error}"
    raise_line = init_memory_pool_line + 1
    assert end["error_at"] == f"{__file__}:{raise_line} in init_memory_pool"
    assert end["error_traceback"] == end["error_at"]


def test_a_failing_hook_turns_itself_off_and_the_host_goes_on(monkeypatch, caplog):
    # GIVEN a marker sender that raises (it never should) and a hooked stand-in
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise OSError("broken sender")

    monkeypatch.setattr(client, "mark", broken)
    spec = next(s for s in TARGETS["0.5.7"] if s.marker == targets.LOAD_WEIGHTS)
    module, cls = make_standin(spec, "weights")
    wrappers.patch_target(spec, module)
    caplog.set_level(logging.WARNING, logger="memrec.sglang_hooks")
    # WHEN it is called three times
    results = [cls.load_model(object.__new__(cls)) for _ in range(3)]
    # THEN every call returns normally, the sender was tried once, and one warning was logged
    assert results == ["weights"] * 3
    assert len(calls) == 1
    assert len([r for r in caplog.records if "is off" in r.getMessage()]) == 1


# -- rank, GPU and local memory ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("title", "expected"),
    [
        ("sglang::scheduler_TP3", {"tp_rank": 3}),
        ("sglang::scheduler_DP1_PP2_TP3_EP3", {"dp_rank": 1, "pp_rank": 2, "tp_rank": 3, "ep_rank": 3}),
        ("sglang::scheduler_DP0_ATTN_CP1_MOE_DP1_TP6", {"dp_rank": 0, "tp_rank": 6}),
        ("sglang::scheduler", {}),
        ("sglang::detokenizer", {}),
        ("python -m pytest", {}),
    ],
)
def test_ranks_from_sglangs_process_title(title, expected):
    # GIVEN a process title SGLang sets  WHEN parsed  THEN the ranks are read (MOE_DP is not DP)
    assert ranks_mod.parse_proctitle(title) == expected


def test_ranks_prefer_sglangs_parallel_state(monkeypatch):
    # GIVEN SGLang 0.5.23's runtime context with published ranks, and an object with other ranks
    ctx = types.ModuleType("sglang.srt.runtime_context")
    ctx.get_parallel = lambda: types.SimpleNamespace(tp_rank=6, pp_rank=1, dp_rank=None)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", ctx)
    obj = types.SimpleNamespace(tp_rank=0, pp_rank=0, dp_rank=2)
    # WHEN ranks are resolved
    got = ranks_mod.ranks(obj)
    # THEN SGLang's own values win and the missing dp_rank comes from the object
    assert got == {"tp_rank": 6, "pp_rank": 1, "dp_rank": 2, "rank_source": "sglang"}
    # AND for older lines the group coordinators answer (without their accessor asserts)
    monkeypatch.delitem(sys.modules, "sglang.srt.runtime_context")
    STATE.reset()
    state = types.ModuleType("sglang.srt.distributed.parallel_state")
    state._TP = types.SimpleNamespace(rank_in_group=4)
    state._PP = types.SimpleNamespace(rank_in_group=1)
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed.parallel_state", state)
    assert ranks_mod.ranks()["tp_rank"] == 4 and ranks_mod.ranks()["pp_rank"] == 1


def test_ranks_from_the_objects_parallel_state(monkeypatch):
    # GIVEN a 0.5.13 – 0.5.20 Scheduler: no rank attributes of its own, a ParallelState in self.ps,
    # and no group coordinators yet (before distributed init)
    monkeypatch.setattr(ranks_mod, "_proctitle", lambda: "")
    scheduler = types.SimpleNamespace(ps=types.SimpleNamespace(tp_rank=3, pp_rank=1, dp_rank=0, gpu_id=3))
    # WHEN ranks are resolved  THEN they come from self.ps
    assert ranks_mod.ranks(scheduler) == {"tp_rank": 3, "pp_rank": 1, "dp_rank": 0, "rank_source": "object"}


# -- the real client and a real socket --------------------------------------------------------


@pytest.fixture
def short_dir():
    # Unix socket paths must be short: pytest's tmp_path can be too long.
    path = tempfile.mkdtemp(prefix="mrsg", dir="/tmp")
    yield Path(path)
    import shutil

    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def real_client(monkeypatch, short_dir):
    """The real memrec.client, pointed at a socket in ``short_dir`` (and reset after)."""
    sock = short_dir / "m.sock"
    monkeypatch.setenv("MEMREC_SOCKET", str(sock))
    client._default_client().close()  # forget any earlier connection and its retry timer
    yield sock
    client._default_client().close()


def test_markers_reach_a_real_socket_server_with_our_pid(real_client):
    # GIVEN a marker server on a Unix socket and a hooked kv_budget stand-in (0.5.23 shape)
    server = sglang_fakes.MarkerServer(real_client)
    try:
        spec = next(s for s in TARGETS["0.5.22"] if s.marker == targets.KV_BUDGET)
        module, cls = make_standin(spec, 50 * GiB)
        wrappers.patch_target(spec, module)
        # WHEN it is called
        cls._profile_available_bytes(object.__new__(cls), pre_model_load_memory=79.5)
        # THEN begin and end frames arrive in order, from this pid, with the values
        assert server.wait_for(lambda s: len(s.marks(targets.KV_BUDGET)) == 2)
        (pid1, begin), (pid2, end) = server.marks(targets.KV_BUDGET)
        assert pid1 == pid2 == os.getpid()
        assert (begin["phase"], end["phase"]) == ("begin", "end")
        assert end["values"]["pre_model_load_memory"] == 79.5
        assert end["values"]["rest_memory_bytes"] == 50 * GiB
        assert begin["ts"] <= end["ts"]
    finally:
        server.close()


def _timed(fn, n=200):
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def _host_checks(spec: HookSpec):
    """A hooked stand-in: the same result object, the same exception object, and the time added."""
    sentinel = object()
    error = ValueError("Loaded weights leave no GPU memory for the KV cache")
    state = {"raise": False}

    def plain(self, pre_model_load_memory):
        if state["raise"]:
            raise error
        return sentinel

    cls = type("KVCacheConfigurator", (), {"_profile_available_bytes": plain, "gpu_id": 0, "is_draft_worker": False})
    module = types.ModuleType("sglang_memrec_standin_host")
    module.KVCacheConfigurator = cls
    baseline = _timed(lambda: plain(None, 1.0))
    wrappers.patch_target(spec, module)
    obj = cls()
    added = _timed(lambda: obj._profile_available_bytes(79.0)) - baseline
    assert obj._profile_available_bytes(79.0) is sentinel
    state["raise"] = True
    with pytest.raises(ValueError) as info:
        obj._profile_available_bytes(79.0)
    assert info.value is error
    return added


_KV_0_5_23 = next(s for s in TARGETS["0.5.22"] if s.marker == targets.KV_BUDGET)


def test_no_daemon_costs_the_host_nothing(real_client):
    # GIVEN no daemon at MEMREC_SOCKET  WHEN a hooked function runs
    added = _host_checks(_KV_0_5_23)
    # THEN it returns the same object / raises the same exception, and each call (two markers)
    # adds well under 5 ms
    assert added < 0.005, f"{added * 1e3:.3f} ms per call"
    assert not client.stats()["connected"]


def test_a_daemon_that_stops_reading_never_blocks_the_host(real_client):
    # GIVEN a daemon that accepts and never reads, its socket buffer filled by earlier markers
    server = sglang_fakes.MarkerServer(real_client, read=False)
    try:
        for _ in range(20000):
            client.mark("fill", blob="x" * 2000)
            if client.stats()["dropped"] > 0:
                break
        dropped_before = client.stats()["dropped"]
        assert dropped_before > 0, "the socket buffer never filled"
        # WHEN a hooked function runs
        added = _host_checks(_KV_0_5_23)
        # THEN it neither blocks nor slows: its markers are dropped instead
        assert added < 0.005, f"{added * 1e3:.3f} ms per call"
        assert client.stats()["dropped"] > dropped_before
    finally:
        server.close()


def test_a_daemon_that_went_away_costs_the_host_nothing(real_client):
    # GIVEN a daemon the client connected to, which then closed everything and went away
    server = sglang_fakes.MarkerServer(real_client)
    client.mark("hello")
    assert server.wait_for(lambda s: len(s.marks("hello")) == 1)
    server.close()
    # WHEN a hooked function runs
    added = _host_checks(_KV_0_5_23)
    # THEN it is unaffected
    assert added < 0.005, f"{added * 1e3:.3f} ms per call"


# -- the .pth bootstrap on a fake SGLang 0.5.7 ------------------------------------------------


def _run_0_5_7(fake_sglang, **plan):
    sglang_fakes.write_fake_sglang(fake_sglang, "0.5.7")
    assert bootstrap.install(force=True)
    scheduler = importlib.import_module("sglang.srt.managers.scheduler")
    args = sglang_fakes.server_args(**plan)
    return scheduler, args


def test_bootstrap_hooks_a_0_5_7_worker_as_its_modules_load(rec: Recorder, fake_sglang):
    # GIVEN the import hook installed before a (fake) SGLang 0.5.7 is imported
    scheduler, args = _run_0_5_7(fake_sglang)
    from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce
    from sglang.srt.model_executor import model_runner
    from sglang.srt.utils import common

    # THEN every target is hooked (the staticmethod still one), and the `from ... import`
    # copies of get_available_gpu_memory in later modules are the wrapper
    assert wrappers.is_wrapped(model_runner.ModelRunner.__dict__["load_model"])
    assert isinstance(CustomAllreduce.__dict__["create_shared_buffer"], staticmethod)
    assert model_runner.get_available_gpu_memory is common.get_available_gpu_memory
    assert wrappers.is_wrapped(model_runner.get_available_gpu_memory)
    # WHEN a TP rank starts
    s = scheduler.run_scheduler_process(args, None, gpu_id=1, tp_rank=1, moe_ep_rank=0, pp_rank=0, dp_rank=None)
    # THEN the phases come in SGLang's order
    assert rec.names() == sglang_fakes.EXPECTED_PHASES
    # ... every marker names the release (the dataset compares releases by it)
    assert {v.get("sglang_version") for _, _, _, v in rec.calls} == {"0.5.7"}
    # ... every SGLang measurement is an instant naming its caller
    callers = [v["caller"] for v in rec.find(targets.GPU_MEMORY_MEASURED)]
    assert callers == ["ModelRunner.init_torch_distributed"] * 2 + ["ModelRunner.load_model"] * 2 + [
        "ModelRunnerKVCacheMixin.profile_max_num_token"] + ["ModelRunner.init_device_graphs"] * 2
    # ... and the KV budget rebuilt from the markers is SGLang's, exactly
    runner = s.tp_worker
    car = (4096 + 2 * 8192 * 1024) / GiB
    pre = 80.0 - 0.5 - car
    available = pre - 16.0
    (b,) = kv_budget.kv_budgets(rec.markers())
    assert (b.tp_rank, b.pp_rank, b.draft) == (1, 0, False)
    assert b.pre_model_load_memory == pytest.approx(pre, abs=1e-12)
    assert b.available_gpu_memory == pytest.approx(available, abs=1e-12)
    assert b.mem_fraction_static == 0.875
    assert b.cell_size == 4096 * 32
    assert b.tokens == runner.max_total_num_tokens == b.sglang_tokens  # computed == SGLang's
    assert b.max_total_num_tokens == runner.max_total_num_tokens
    assert b.weight_load_mem_usage == pytest.approx(16.0)
    assert b.ok and b.error is None
    graph = rec.find(targets.CUDA_GRAPH_CAPTURE, "end")[0]
    assert graph["graph_memory_usage"] == pytest.approx(1.25)
    ar = rec.find(targets.CUSTOM_AR_INIT, "end")[0]
    assert (ar["custom_ar_class"], ar["world_size"], ar["rank"], ar["max_size"]) == ("CustomAllreduce", 2, 1, 8 << 20)


def test_bootstrap_reports_not_enough_memory_and_keeps_sglangs_exception(rec: Recorder, fake_sglang):
    # GIVEN a 0.5.7 worker whose weights leave less than the slack
    scheduler, args = _run_0_5_7(fake_sglang, weights_gib=70.0)
    # WHEN it starts
    with pytest.raises(RuntimeError, match="Not enough memory") as info:
        scheduler.run_scheduler_process(args, None, gpu_id=0, tp_rank=0, moe_ep_rank=0, pp_rank=0, dp_rank=None)
    # THEN SGLang's own exception comes out, and the spans it crossed carry its text
    text = f"RuntimeError: {info.value}"
    assert rec.find(targets.KV_POOL, "end")[0]["error"] == text
    assert rec.find(targets.INIT_MODEL_WORKER, "end")[0]["error"] == text
    # ... and where SGLang raised it: the same line seen from every span, the worker's traceback
    # reaching down through the scheduler to the KV mixin
    raised_at = {rec.find(name, "end")[0]["error_at"] for name in (targets.KV_POOL, targets.INIT_MODEL_WORKER)}
    (at,) = raised_at
    assert at.endswith(" in init_memory_pool") and "sglang/srt/model_executor/model_runner_kv_cache_mixin.py:" in at
    chain = rec.find(targets.INIT_MODEL_WORKER, "end")[0]["error_traceback"].split(" ← ")
    assert chain[0] == at and chain[-1].endswith(" in init_model_worker")
    (b,) = kv_budget.kv_budgets(rec.markers())
    assert b.error_kind == "not_enough_memory" and not b.ok
    assert b.rest_gib < 0 and b.tokens < 0
    assert b.min_mem_fraction_static == pytest.approx(1 - b.available_gpu_memory / b.pre_model_load_memory)


def test_bootstrap_without_custom_all_reduce_has_no_custom_ar_phase(rec: Recorder, fake_sglang):
    # GIVEN --disable-custom-all-reduce
    scheduler, args = _run_0_5_7(fake_sglang, disable_custom_all_reduce=True)
    # WHEN a rank starts
    scheduler.run_scheduler_process(args, None, gpu_id=0, tp_rank=0, moe_ep_rank=0, pp_rank=0, dp_rank=None)
    # THEN no custom_ar phase, and the baseline is higher by exactly the custom AR buffers
    assert not rec.find(targets.CUSTOM_AR_INIT)
    assert rec.find(targets.MEMORY_BASELINE)[0]["pre_model_load_memory"] == 79.5
    dist = rec.find(targets.DIST_INIT, "begin")[0]
    assert dist["disable_custom_all_reduce"] is True and dist["tp_size"] == 2


def test_bootstrap_hooks_modules_imported_before_it(rec: Recorder, fake_sglang):
    # GIVEN a fake SGLang already imported when the bootstrap is installed
    sglang_fakes.write_fake_sglang(fake_sglang, "0.5.7")
    scheduler = importlib.import_module("sglang.srt.managers.scheduler")
    from sglang.srt.model_executor import model_runner

    stale = model_runner.get_available_gpu_memory
    # WHEN it is installed
    bootstrap.install(force=True)
    # THEN the loaded modules are hooked and stale imported names rebound
    assert wrappers.is_wrapped(model_runner.ModelRunner.__dict__["load_model"])
    assert model_runner.get_available_gpu_memory is not stale
    scheduler.run_scheduler_process(sglang_fakes.server_args(), None, gpu_id=0, tp_rank=0, moe_ep_rank=0, pp_rank=0,
                                    dp_rank=None)
    assert rec.find(targets.KV_BUDGET, "end")


def test_a_forked_child_starts_with_its_own_per_process_state():
    """STATE's lifecycle across os.fork: what is per process starts afresh, what was installed stays."""
    # GIVEN hooks that installed their import hook, warned, counted measurements and cached ranks
    assert bootstrap.install(force=True)
    STATE.warn_once("before-fork", "memrec: test warning")
    STATE.measure_count = 7
    STATE.rank_cache = {"tp_rank": 3, "rank_source": "sglang"}
    read, write = os.pipe()
    # WHEN the process forks while one of its locks is held (another thread warning, say)
    with STATE.warned_lock:
        pid = os.fork()
        if pid == 0:  # the child: report what it starts with, and that warning does not deadlock
            os.close(read)
            STATE.warn_once("in-child", "memrec: child warning")
            facts = {"warned": sorted(STATE.warned), "measure_count": STATE.measure_count,
                     "rank_cache": STATE.rank_cache, "finder_installed": STATE.finder in sys.meta_path}
            os.write(write, json.dumps(facts).encode())
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 10
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("the forked child deadlocked on a lock held at the fork")
        time.sleep(0.01)
    with os.fdopen(read) as f:
        facts = json.loads(f.read())
    # THEN the child warned afresh and counted nothing yet, read its ranks anew, kept the import hook
    assert facts == {"warned": ["in-child"], "measure_count": 0, "rank_cache": None, "finder_installed": True}
    # AND the parent kept its own
    assert STATE.warned == {"before-fork"} and STATE.measure_count == 7 and STATE.rank_cache["tp_rank"] == 3


def test_bootstrap_install_is_gated_by_the_environment(monkeypatch):
    # GIVEN neither MEMREC nor MEMREC_SOCKET
    monkeypatch.delenv("MEMREC", raising=False)
    monkeypatch.delenv("MEMREC_SOCKET", raising=False)
    # WHEN install() is called  THEN nothing is installed
    assert bootstrap.install() is False
    assert not any(isinstance(f, bootstrap.PostImportFinder) for f in sys.meta_path)
    # AND the activation rules hold
    assert wrappers.is_active({"MEMREC": "1"})
    assert wrappers.is_active({"MEMREC_SOCKET": "/tmp/x.sock"})
    assert not wrappers.is_active({"MEMREC": "0", "MEMREC_SOCKET": "/tmp/x.sock"})
    assert not wrappers.is_active({})
    assert wrappers.is_active({"MEMREC": "", "MEMREC_SOCKET": "/tmp/x.sock"})


@pytest.mark.parametrize(
    ("env", "active"),
    [({}, False), ({"MEMREC": "1"}, True), ({"MEMREC_SOCKET": "/tmp/m.sock"}, True),
     ({"MEMREC": "0", "MEMREC_SOCKET": "/tmp/m.sock"}, False)],
)
def test_pth_line_imports_memrec_only_when_asked(tmp_path, env, active):
    # GIVEN memrec_sglang.pth installed in a site directory
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    path = bootstrap.install_pth(site_dir)
    assert path.read_text().splitlines()[-1] == bootstrap.PTH_LINE.rstrip("\n")
    # WHEN a fresh interpreter processes that site directory
    code = textwrap.dedent(f"""
        import site, sys
        site.addsitedir({str(site_dir)!r})
        from memrec.sglang_hooks.bootstrap import PostImportFinder
        print(int("memrec.sglang_hooks.bootstrap" in sys.modules and
                  any(isinstance(f, PostImportFinder) for f in sys.meta_path)))
    """)
    clean = {k: v for k, v in os.environ.items() if k not in ("MEMREC", "MEMREC_SOCKET")}
    out = subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, timeout=60)
    # THEN the bootstrap is imported and installed exactly when memrec is asked for, silently
    assert out.returncode == 0, out.stderr
    # (the check itself imports the module, so "installed" is the finder being in place)
    assert out.stdout.strip() == ("1" if active else "0"), out.stderr
    assert "memrec: SGLang bootstrap off" not in out.stderr
    # AND uninstall removes it
    assert bootstrap.uninstall_pth(site_dir) is True
    assert not path.exists() and bootstrap.uninstall_pth(site_dir) is False


@pytest.mark.parametrize(
    ("version", "line"),
    [("0.5.23", "0.5.22"), ("0.5.21", "0.5.21"), ("0.6.0", "0.5.22"), ("0.5.20", "0.5.17"), ("0.5.16", "0.5.16"),
     ("0.5.15.post1", "0.5.14"), ("0.5.12.post1", "0.5.11"), ("0.5.10.post1", "0.5.10"), ("0.5.9", "0.5.7"),
     ("0.5.5.post3", "0.5.3"), ("0.5.2", "0.5.2"), ("0.5.1.post3", "0.5.1"), ("0.4.10.post2", "0.4.10"),
     (None, "0.5.22")],
)
def test_line_selection_by_version(version, line):
    # GIVEN versions of every line and between lines  WHEN mapped  THEN the newest line at or below
    assert targets.line_for_version(version) == line


# -- SGLang 0.5.23's own plugin loader on a fake 0.5.23 --------------------------------------


def _write_fake_0_5_23(fake_sglang) -> None:
    """A fake 0.5.23 (its real plugin loader, HookRegistry and environ) with memrec's entry point."""
    sglang_fakes.write_fake_sglang(fake_sglang, "0.5.22", real_root=_wheel("0.5.22"))
    sglang_fakes.write_plugin_dist(fake_sglang)
    importlib.invalidate_caches()


def _plugin_0_5_23(fake_sglang, monkeypatch, **plan):
    _write_fake_0_5_23(fake_sglang)
    monkeypatch.setenv("MEMREC", "1")
    scheduler = importlib.import_module("sglang.srt.managers.scheduler")
    return scheduler, sglang_fakes.server_args(**plan)


_CAR_V2 = [("custom_ar_init", "begin"), ("custom_ar_workspace", "instant"), ("custom_ar_init", "end")]
_CAR_LEGACY = [("custom_ar_init", "begin"), ("custom_ar_shared_buffer", "instant"),
               ("custom_ar_shared_buffer", "instant"), ("custom_ar_init", "end")]


@pytest.mark.parametrize(("car_v2", "car_markers"), [(True, _CAR_V2), (False, _CAR_LEGACY)], ids=["v2", "legacy"])
def test_plugin_hooks_a_0_5_23_worker_through_sglangs_real_plugin_loader(
    rec: Recorder, fake_sglang, monkeypatch, car_v2, car_markers
):
    # GIVEN a fake 0.5.23 worker whose plugin loader, HookRegistry and environ are SGLang's real
    # code, and memrec's entry point installed
    scheduler, args = _plugin_0_5_23(fake_sglang, monkeypatch, car_v2=car_v2)
    # WHEN TP rank 1 starts (load_plugins() runs first, as in SGLang)
    scheduler.run_scheduler_process(args, None, gpu_id=1, tp_rank=1, pp_rank=0, dp_rank=None)
    # THEN the phases arrive in SGLang 0.5.23's order (HookRegistry kept the legacy custom
    # all-reduce's create_shared_buffer a staticmethod)
    assert rec.names() == [
        ("dist_init", "begin"),
        *car_markers,
        ("dist_init", "end"),
        ("init_model_worker", "begin"),
        ("memory_baseline", "begin"),
        ("memory_baseline", "end"),
        ("load_weights", "begin"),
        ("load_weights", "end"),
        ("kv_pool", "begin"),
        ("kv_budget", "begin"),
        ("kv_budget", "end"),
        ("kv_pool", "end"),
        ("attention_backends", "begin"),
        ("attention_backends", "end"),
        ("cuda_graph_capture", "begin"),
        ("cuda_graph_capture", "end"),
        ("init_model_worker", "end"),
    ]
    # ... ranks come from SGLang's runtime context, the baseline caller is named ...
    assert {v["tp_rank"] for _, _, _, v in rec.calls} == {1}
    assert all(v["rank_source"] == "sglang" for _, _, _, v in rec.calls)
    measured = rec.find(targets.GPU_MEMORY_MEASURED)
    assert [m["caller"] for m in measured[:3]] == ["measure_pre_model_load_memory"] * 3
    assert [m["distributed"] for m in measured[:3]] == [False, True, False]
    # ... and the budget matches SGLang's numbers exactly
    car = 2 * 2 * (16 << 20) / GiB if car_v2 else (4096 + 2 * (8 << 20)) / GiB
    pre = 80.0 - 0.5 - car
    available = pre - 16.0
    (b,) = kv_budget.kv_budgets(rec.markers())
    assert b.pre_model_load_memory == pytest.approx(pre, abs=1e-12)
    assert b.available_gpu_memory == pytest.approx(available, abs=1e-12)
    assert b.available_is_world_min is True
    assert b.sglang_rest_bytes == b.rest_bytes  # SGLang's rest == the formula's (no extra reservations)
    assert b.cell_size == 4096 * 32 and b.tokens_source == "sglang" and b.memrec_tokens == b.tokens
    assert b.tokens == b.max_total_num_tokens
    ar = rec.find(targets.CUSTOM_AR_INIT, "end")[0]
    if car_v2:
        assert ar["custom_ar_class"] == "CustomAllReduceV2" and ar["max_size"] == 16 << 20
    else:
        from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce

        assert ar["custom_ar_class"] == "CustomAllreduce" and ar["max_size"] == 8 << 20
        assert isinstance(CustomAllreduce.__dict__["create_shared_buffer"], staticmethod)
        sizes = [v["size_in_bytes"] for v in rec.find(targets.CUSTOM_AR_SHARED_BUFFER)]
        assert sizes == [4096 + (8 << 20), 8 << 20]
    graph = rec.find(targets.CUDA_GRAPH_CAPTURE, "end")[0]
    assert graph["graph_memory_usage.decode"] == pytest.approx(1.25) and graph["graph_memory_usage.prefill"] == 0.0


def test_plugin_reports_loaded_weights_leave_no_memory(rec: Recorder, fake_sglang, monkeypatch):
    # GIVEN a 0.5.23 worker whose weights leave less than the slack
    scheduler, args = _plugin_0_5_23(fake_sglang, monkeypatch, weights_gib=72.0)
    # WHEN it starts
    with pytest.raises(ValueError, match="Loaded weights leave no GPU memory") as info:
        scheduler.run_scheduler_process(args, None, gpu_id=0, tp_rank=0, pp_rank=0, dp_rank=None)
    # THEN the budget names the failure and memrec's minimum fraction is the one SGLang printed
    (b,) = kv_budget.kv_budgets(rec.markers())
    assert b.error_kind == "no_memory_for_kv" and b.error == f"ValueError: {info.value}"
    assert f"minimum viable = 1 - available/pre = {b.min_mem_fraction_static:.4f}" in str(info.value)


def test_plugin_and_bootstrap_never_hook_twice(rec: Recorder, fake_sglang, monkeypatch):
    # GIVEN both ways in active on 0.5.23: the .pth bootstrap first, then the plugin
    _write_fake_0_5_23(fake_sglang)
    monkeypatch.setenv("MEMREC", "1")
    bootstrap.install()
    scheduler = importlib.import_module("sglang.srt.managers.scheduler")
    scheduler_args = sglang_fakes.server_args()
    # WHEN a rank starts
    scheduler.run_scheduler_process(scheduler_args, None, gpu_id=0, tp_rank=0, pp_rank=0, dp_rank=None)
    # THEN the bootstrap stepped aside and each phase is reported once
    assert bootstrap.active_line() is None
    assert len(rec.find(targets.KV_BUDGET, "end")) == 1
    assert len(rec.find(targets.LOAD_WEIGHTS, "begin")) == 1


def test_bootstrap_takes_over_when_sglang_plugins_excludes_memrec(rec: Recorder, fake_sglang, monkeypatch):
    # GIVEN 0.5.23 with SGLANG_PLUGINS naming another plugin only, and the bootstrap installed
    _write_fake_0_5_23(fake_sglang)
    monkeypatch.setenv("MEMREC", "1")
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    bootstrap.install()
    scheduler = importlib.import_module("sglang.srt.managers.scheduler")
    # WHEN a rank starts
    scheduler.run_scheduler_process(sglang_fakes.server_args(), None, gpu_id=0, tp_rank=0, pp_rank=0, dp_rank=None)
    # THEN the bootstrap did the hooking, once
    assert bootstrap.active_line() == "0.5.22"
    assert len(rec.find(targets.KV_BUDGET, "end")) == 1


def test_plugin_does_nothing_unless_memrec_is_asked_for(rec: Recorder, fake_sglang, monkeypatch):
    # GIVEN the entry point installed but neither MEMREC nor MEMREC_SOCKET set
    scheduler, args = _plugin_0_5_23(fake_sglang, monkeypatch)
    monkeypatch.delenv("MEMREC")
    monkeypatch.delenv("MEMREC_SOCKET", raising=False)
    # WHEN a rank starts
    scheduler.run_scheduler_process(args, None, gpu_id=0, tp_rank=0, pp_rank=0, dp_rank=None)
    # THEN nothing was registered and no marker sent
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert not any(t.startswith("sglang.") for t in HookRegistry._hooks)
    assert rec.calls == []


def test_plugin_registers_nothing_in_processes_without_model_memory(monkeypatch):
    # GIVEN memrec asked for
    monkeypatch.setenv("MEMREC", "1")
    monkeypatch.delenv("MEMREC_SGLANG_ALL_PROCESSES", raising=False)

    # WHEN SGLang's detokenizer would call load_plugins()
    def run_detokenizer_process():
        return plugin.wanted_here()

    def run_scheduler_process():
        return plugin.wanted_here()

    # THEN the detokenizer is skipped, the scheduler is not, and the launcher (no
    # multiprocessing parent: this pytest process) is skipped
    assert run_detokenizer_process() is False
    assert run_scheduler_process() is True
    assert plugin.wanted_here() is False
    monkeypatch.setenv("MEMREC_SGLANG_ALL_PROCESSES", "1")
    assert run_detokenizer_process() is True


# -- real SGLang KV functions, run on the CPU ---------------------------------------------------


class _ModelConfig:
    def __init__(self):
        self.head_dim = 128
        self.v_head_dim = 128
        self.is_hybrid_swa = False
        self.full_attention_layer_ids = None
        self.hf_config = types.SimpleNamespace(architectures=["LlamaForCausalLM"])
        self.kv_lora_rank = 512
        self.qk_rope_head_dim = 64

    def get_num_kv_heads(self, tp):
        return 8 // tp


_STUBS = dict(
    torch=types.SimpleNamespace(_utils=types.SimpleNamespace(_element_size=lambda dtype: 2)),
    is_float4_e2m1fn_x2=lambda dtype: False,
    is_deepseek_nsa=lambda cfg: False,
    get_attention_tp_size=lambda: 2,
    get_world_group=lambda: types.SimpleNamespace(world_size=2, cpu_group=None),
)


def _real_runner(line: str, available: float, rec: Recorder):
    """A runner class whose KV methods are the wheel's real code, hooked by memrec."""
    real = _wheel(line)
    specs = TARGETS[line]
    kv_spec = next(s for s in specs if s.marker == targets.KV_BUDGET)
    measure = next(s for s in specs if s.marker == targets.GPU_MEMORY_MEASURED)
    utils = types.ModuleType("sglang_memrec_standin_measure")
    exec("def get_available_gpu_memory(device, gpu_id, distributed=False, empty_cache=True, cpu_group=None):\n"
         f"    return {available!r}\n", utils.__dict__)
    wrappers.patch_target(measure, utils)
    namespace = dict(_STUBS, get_available_gpu_memory=utils.get_available_gpu_memory)
    cls_name = kv_spec.qualname.split(".")[0]
    sglang_fakes.compile_real(sglang_fakes.def_source(real, kv_spec.module, kv_spec.qualname), namespace)
    attrs = {
        "profile_max_num_token": namespace["profile_max_num_token"],
        "device": "cuda", "gpu_id": 0, "is_draft_worker": False, "mambaish_config": None,
        "num_effective_layers": 32, "use_mla_backend": False, "kv_cache_dtype": "bfloat16",
        "mem_fraction_static": 0.85, "model_config": _ModelConfig(), "pp_size": 1,
    }
    cell_spec = next((s for s in specs if s.qualname.endswith("get_cell_size_per_token")), None)
    if cell_spec is not None:
        sglang_fakes.compile_real(sglang_fakes.def_source(real, cell_spec.module, cell_spec.qualname), namespace)
        attrs["get_cell_size_per_token"] = namespace["get_cell_size_per_token"]
    cls = type(cls_name, (), attrs)
    module = types.ModuleType("sglang_memrec_standin_real")
    setattr(module, cls_name, cls)
    for spec in (kv_spec, cell_spec):
        if spec is not None:
            assert wrappers.patch_target(spec, module)
    return cls


@pytest.mark.parametrize("line", ["0.5.10", "0.5.7", "0.4.10"])
def test_real_profile_max_num_token_agrees_with_the_rebuilt_budget(rec: Recorder, line: str):
    # GIVEN SGLang's real profile_max_num_token (and get_cell_size_per_token where it is a method),
    # run on the CPU with stubs for the device, hooked by memrec
    cls = _real_runner(line, available=61.3, rec=rec)
    # WHEN it profiles a budget from a 79.1 GiB baseline
    tokens = cls().profile_max_num_token(79.1)
    # THEN memrec's reconstruction from the markers gives SGLang's own token count
    (b,) = kv_budget.kv_budgets(rec.markers())
    cell = 8 // 2 * (128 + 128) * 32 * 2  # kv heads/tp × (k + v dims) × layers × bf16
    expected_rest = 61.3 - 79.1 * (1 - 0.85)
    assert b.rest_gib == expected_rest
    assert b.sglang_tokens == tokens
    if line == "0.4.10":  # cell size is inline there: memrec reports SGLang's count
        assert (b.cell_size, b.tokens_source, b.tokens) == (None, "sglang", tokens)
        assert tokens == int(expected_rest * (1 << 30) // cell)
    else:
        assert (b.cell_size, b.tokens_source) == (cell, "sglang")
        assert b.tokens == b.memrec_tokens == tokens == kv_budget.tokens_from_rest(expected_rest, cell)


def _real_0_5_23(monkeypatch, rec: Recorder, available: float, fraction: float):
    real = _wheel("0.5.22")
    spec = next(s for s in TARGETS["0.5.22"] if s.marker == targets.KV_BUDGET)
    measure = next(s for s in TARGETS["0.5.22"] if s.marker == targets.GPU_MEMORY_MEASURED)
    utils = types.ModuleType("sglang_memrec_standin_measure")
    exec("def get_available_gpu_memory(device, gpu_id, distributed=False, empty_cache=True, cpu_group=None):\n"
         f"    return {available!r}\n", utils.__dict__)
    wrappers.patch_target(measure, utils)
    schedule = types.SimpleNamespace(mem_fraction_static=fraction, prefill_max_requests=None, max_mamba_cache_size=None)
    ctx = types.ModuleType("sglang.srt.runtime_context")  # where memrec reads the fraction on 0.5.23
    ctx.get_schedule = lambda: schedule
    ctx.get_parallel = lambda: types.SimpleNamespace(launch_world_size=8, world_group=types.SimpleNamespace(cpu_group=None),
                                                     tp_rank=2, pp_rank=0, dp_rank=None)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", ctx)
    import gc
    import math

    graph = types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(
        prefill=types.SimpleNamespace(full_prefill_max_req=None, backend="full")))
    namespace = dict(
        gc=gc, math=math, get_available_gpu_memory=utils.get_available_gpu_memory,
        get_parallel=ctx.get_parallel, get_schedule=ctx.get_schedule,
        get_exec=lambda: types.SimpleNamespace(graph=graph),
        get_disagg=lambda: types.SimpleNamespace(disaggregation_mode="null"),
        Backend=types.SimpleNamespace(FULL="full"),
        get_mm=lambda: types.SimpleNamespace(mm_feature_transport=None),
        mm_runtime_reservation_gb=lambda **kwargs: 0.0,
        pre_capture_activation_reserve_mb=lambda capacity: 0, get_device_memory_capacity=lambda device: 0,
    )
    sglang_fakes.compile_real(sglang_fakes.def_source(real, spec.module, spec.qualname), namespace)
    attrs = dict(_profile_available_bytes=namespace["_profile_available_bytes"], device="cuda", gpu_id=2,
                 is_draft_worker=False, mambaish_config=None, post_capture_kv_active=False,
                 model_config=types.SimpleNamespace(is_multimodal=False))
    cls = type("KVCacheConfigurator", (), attrs)
    module = types.ModuleType("sglang_memrec_standin_kvc")
    module.KVCacheConfigurator = cls
    assert wrappers.patch_target(spec, module)
    return cls


def test_real_0_5_23_profile_agrees_with_the_rebuilt_budget(rec: Recorder, monkeypatch):
    # GIVEN SGLang 0.5.23's real _profile_available_bytes on the CPU, hooked by memrec
    cls = _real_0_5_23(monkeypatch, rec, available=58.75, fraction=0.88)
    # WHEN it sizes the budget from a 79.5 GiB baseline
    got = cls()._profile_available_bytes(79.5)
    # THEN memrec's rest in bytes is SGLang's, bit for bit, with the ranks from SGLang's context
    (b,) = kv_budget.kv_budgets(rec.markers())
    assert got == b.sglang_rest_bytes == b.rest_bytes == int((58.75 - 79.5 * (1 - 0.88)) * GiB)
    assert b.mem_fraction_static == 0.88 and b.tp_rank == 2 and b.available_is_world_min is True


def test_real_0_5_23_failure_names_the_same_minimum_fraction(rec: Recorder, monkeypatch):
    # GIVEN SGLang 0.5.23's real _profile_available_bytes with too little left after the weights
    cls = _real_0_5_23(monkeypatch, rec, available=7.5, fraction=0.88)
    # WHEN it sizes the budget
    with pytest.raises(ValueError) as info:
        cls()._profile_available_bytes(79.5)
    # THEN SGLang's ValueError passes through, and memrec's minimum viable fraction is the one
    # SGLang computed and printed
    (b,) = kv_budget.kv_budgets(rec.markers())
    assert b.error_kind == "no_memory_for_kv"
    assert f"{b.min_mem_fraction_static:.4f}" in str(info.value)
    assert b.min_mem_fraction_static == 1 - 7.5 / 79.5


def test_real_0_5_23_pool_sizing_not_enough_memory_passes_through(rec: Recorder):
    # GIVEN SGLang 0.5.23's real MemoryPoolConfig and DefaultPoolConfigurator.calculate_pool_sizes,
    # the pool hook on the latter and a kv_pool span around it
    real = _wheel("0.5.22")
    from dataclasses import dataclass
    from typing import Optional

    namespace = {"dataclass": dataclass, "Optional": Optional}
    src_module = "sglang.srt.model_executor.pool_configurator"
    sglang_fakes.compile_real(sglang_fakes.def_source(real, src_module, "MemoryPoolConfig"), namespace)
    sglang_fakes.compile_real(
        sglang_fakes.def_source(real, src_module, "DefaultPoolConfigurator.calculate_pool_sizes"), namespace)
    pool_cls = type("DefaultPoolConfigurator", (), {
        "calculate_pool_sizes": namespace["calculate_pool_sizes"], "_cell_size": 131072, "_fixed_overhead_bytes": 0})
    module = types.ModuleType("sglang_memrec_standin_pool")
    module.DefaultPoolConfigurator = pool_cls
    contrib = next(s for s in TARGETS["0.5.22"] if s.qualname == "DefaultPoolConfigurator.calculate_pool_sizes")
    assert wrappers.patch_target(contrib, module)
    kv_pool = next(s for s in TARGETS["0.5.22"] if s.marker == targets.KV_POOL)

    class ModelRunner:
        gpu_id = 0
        is_draft_worker = False
        pre_model_load_memory = 79.5

        def alloc_memory_pool(self, memory_pool_config=None, *, draft_parallel_layout=None):
            self.max_total_num_tokens = pool_cls().calculate_pool_sizes(self.budget, 64).max_total_num_tokens

    runner_module = types.ModuleType("sglang_memrec_standin_mr")
    runner_module.ModelRunner = ModelRunner
    assert wrappers.patch_target(kv_pool, runner_module)
    # WHEN the budget holds less than one page of tokens
    runner = ModelRunner()
    runner.budget = 131072 * 63
    with pytest.raises(RuntimeError) as info:
        runner.alloc_memory_pool()
    # THEN SGLang's "Not enough memory" comes out unchanged and the pool span names it, with the
    # cell size the pool configurator used
    assert str(info.value).startswith("Not enough memory. Please try to increase --mem-fraction-static.")
    end = rec.find(targets.KV_POOL, "end")[0]
    assert end["error"] == f"RuntimeError: {info.value}" and end["cell_size"] == 131072
    (b,) = kv_budget.kv_budgets(rec.markers())
    assert b.error_kind == "not_enough_memory" and b.cell_size == 131072
    # AND with room for 1000 pages it sizes the pool, the span carrying the real count
    rec.calls.clear()
    runner.budget = 131072 * 64 * 1000 + 5
    runner.alloc_memory_pool()
    end = rec.find(targets.KV_POOL, "end")[0]
    assert end["max_total_num_tokens"] == runner.max_total_num_tokens == 64000
    assert end["available_bytes"] == runner.budget and "error" not in end
    assert end["sglang_tokens"] == 64000
    # AND with a fixed overhead (0.5.22+ page-shard scratch), the count reported is SGLang's own,
    # not memrec's rest // cell_size
    rec.calls.clear()
    pool_cls._fixed_overhead_bytes = 131072 * 64 * 10
    spec = next(s for s in TARGETS["0.5.22"] if s.marker == targets.KV_BUDGET)
    budget_module, budget_cls = make_standin(spec, runner.budget)
    wrappers.patch_target(spec, budget_module)
    budget_cls = budget_module.KVCacheConfigurator
    budget_cls.gpu_id, budget_cls.is_draft_worker, budget_cls.mem_fraction_static = 0, False, 0.875
    budget_cls._profile_available_bytes(budget_cls(), pre_model_load_memory=79.5)
    runner.alloc_memory_pool()
    (b,) = kv_budget.kv_budgets(rec.markers())
    assert (b.tokens, b.tokens_source, b.memrec_tokens) == (63360, "sglang", 64000)
    assert any("SGLang subtracted +640 tokens more" in line for line in kv_budget.explain(b))
