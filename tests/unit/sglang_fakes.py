"""Helpers for the SGLang hook tests: real wheels, fake SGLang packages and a marker server.

- :func:`wheel_source` fetches a real SGLang wheel (``pip download --no-deps``, cached under
  ``$MEMREC_WHEEL_CACHE`` or ``~/.cache/memrec-test-wheels``) and unpacks its ``.py`` files;
  the caller skips with the reason when it cannot (offline).
- :func:`write_fake_sglang` writes a small ``sglang`` package shaped like one version line:
  same module paths, class names, method names and signatures as the real targets, with a fake
  device whose free memory the lifecycle lowers step by step (no torch, no GPU).
- :class:`MarkerServer` is a Unix-socket server speaking the marker protocol (4-byte big-endian
  length + one msgpack map), recording each frame with the peer's pid from SO_PEERCRED.

This module imports no pytest at the top: spawned children import it.
"""

from __future__ import annotations

import __future__
import ast
import glob
import os
import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import msgpack

from memrec.sglang_hooks.targets import WHEELS


#: The markers one TP worker of the fake SGLang 0.5.7 sends, in order (measurements left out).
EXPECTED_PHASES = [
    ("init_model_worker", "begin"),
    ("dist_init", "begin"),
    ("custom_ar_init", "begin"),
    ("custom_ar_shared_buffer", "instant"),
    ("custom_ar_shared_buffer", "instant"),
    ("custom_ar_init", "end"),
    ("dist_init", "end"),
    ("memory_baseline", "instant"),
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

GiB = 1 << 30


# -- real wheels -------------------------------------------------------------------------------


def wheel_cache() -> Path:
    return Path(os.environ.get("MEMREC_WHEEL_CACHE") or Path.home() / ".cache" / "memrec-test-wheels")


class WheelUnavailable(Exception):
    """The wheel could not be fetched (the message says why)."""


_unavailable: dict[str, str] = {}


def _download(version: str, cache: Path) -> None:
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(cache)]
    attempts = [
        base + [f"sglang=={version}"],
        # 0.5.23 ships platform wheels only: ask for the x86-64 CPython 3.11 one explicitly.
        base + ["--only-binary=:all:", "--platform", "manylinux_2_34_x86_64", "--python-version", "311",
                f"sglang=={version}"],
    ]
    errors = []
    for cmd in attempts:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as error:
            errors.append(str(error))
            continue
        if proc.returncode == 0 and _find_wheel(version, cache):
            return
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()
        errors.append(tail[-1] if tail else f"exit status {proc.returncode}")
    raise WheelUnavailable(f"pip download sglang=={version} failed (offline?): {'; '.join(errors)}")


def _find_wheel(version: str, cache: Path) -> Path | None:
    found = sorted(glob.glob(str(cache / f"sglang-{version}-*.whl")))
    return Path(found[0]) if found else None


def wheel_source(line: str) -> Path:
    """The unpacked ``.py`` files of the wheel a targets line was read from (the root holding
    ``sglang/``).

    Raises:
        WheelUnavailable: it could not be downloaded.
    """
    return release_source(WHEELS[line])


def release_source(version: str) -> Path:
    """The unpacked ``.py`` files of SGLang release ``version`` (the root holding ``sglang/``),
    downloaded once into :func:`wheel_cache`.

    Raises:
        WheelUnavailable: it could not be downloaded.
    """
    if version in _unavailable:  # do not retry a failed download in every test
        raise WheelUnavailable(_unavailable[version])
    cache = wheel_cache()
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / f"src-{version}"
    done = root / ".complete"
    if done.exists():
        return root
    wheel = _find_wheel(version, cache)
    if wheel is None:
        try:
            _download(version, cache)
        except WheelUnavailable as error:
            _unavailable[version] = str(error)
            raise
        wheel = _find_wheel(version, cache)
        assert wheel is not None
    tmp = cache / f".src-{version}.{os.getpid()}"
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("sglang/") and name.endswith(".py"):
                zf.extract(name, tmp)
    try:
        os.replace(tmp, root)
    except OSError:  # another process (an xdist worker) won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    done.touch()
    return root


def module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def find_def(tree: ast.AST, qualname: str) -> ast.AST | None:
    node = tree
    for part in qualname.split("."):
        found = None
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part:
                found = child  # the last definition wins, as at runtime
        if found is None:
            return None
        node = found
    return node


def def_source(root: Path, module: str, qualname: str) -> str:
    """The dedented source of a function or class (with its decorators) from a wheel."""
    path = module_file(root, module)
    assert path is not None, module
    text = path.read_text(encoding="utf-8")
    node = find_def(ast.parse(text), qualname)
    assert node is not None, f"{module}.{qualname}"
    lines = text.splitlines()
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno])) + "\n"


def compile_real(source: str, namespace: dict, filename: str = "<sglang>") -> dict:
    """Execute a real SGLang definition in ``namespace`` (annotations left unevaluated, as the
    real modules do with ``from __future__ import annotations``)."""
    code = compile(source, filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)
    return namespace


# -- fake SGLang packages ----------------------------------------------------------------------

_COMMON = '''
"""Fake sglang.srt.utils.common: a fake device whose free memory the fake lifecycle lowers."""
__all__ = ["get_available_gpu_memory"]

FREE_GIB = {"value": 0.0}
CALLS = []


def take(gib):
    FREE_GIB["value"] -= gib


def get_available_gpu_memory(device, gpu_id, distributed=False, empty_cache=True, cpu_group=None):
    CALLS.append((device, gpu_id, distributed, empty_cache))
    return FREE_GIB["value"]
'''

_CUSTOM_AR = '''
from sglang.srt.utils.common import take


class CustomAllreduce:
    def __init__(self, group, device, max_size=8192 * 1024):
        self.disabled = True
        self.group = group
        self.max_size = max_size
        self.rank = group["rank"]
        self.world_size = group["world_size"]
        self.full_nvlink = True
        self.meta_ptrs = self.create_shared_buffer(4096 + max_size, group=group)
        self.buffer_ptrs = self.create_shared_buffer(max_size, group=group)
        self.disabled = False

    @staticmethod
    def create_shared_buffer(size_in_bytes, group=None):
        take(size_in_bytes / (1 << 30))
        return [0] * group["world_size"]

    def register_graph_buffers(self):
        return None
'''

# 0.5.7 shape: KV methods on the mixin, init_device_graphs, init_attention_backend.
_MIXIN_0_5_7 = '''
from sglang.srt.utils import get_available_gpu_memory
from sglang.srt.utils.common import take


class ModelRunnerKVCacheMixin:
    def get_cell_size_per_token(self, num_layers):
        return self.plan["kv_bytes_per_layer_token"] * num_layers

    def profile_max_num_token(self, total_gpu_memory):
        available_gpu_memory = get_available_gpu_memory(
            self.device, self.gpu_id, distributed=self.tp_size > 1, cpu_group=None
        )
        cell_size = self.get_cell_size_per_token(self.plan["num_layers"])
        rest_memory = available_gpu_memory - total_gpu_memory * (1 - self.mem_fraction_static)
        return int(rest_memory * (1 << 30)) // cell_size

    def init_memory_pool(self, total_gpu_memory, server_args):
        self.max_total_num_tokens = self.profile_max_num_token(total_gpu_memory)
        self.max_total_num_tokens = self.max_total_num_tokens // self.plan["page_size"] * self.plan["page_size"]
        self.max_running_requests = 2048
        if self.max_total_num_tokens <= 0:
            raise RuntimeError(
                f"Not enough memory. Please try to increase --mem-fraction-static. "
                f"Current value: {server_args.mem_fraction_static=}"
            )
        take(self.max_total_num_tokens * self.get_cell_size_per_token(self.plan["num_layers"]) / (1 << 30))
'''

_MODEL_RUNNER_0_5_7 = '''
from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce
from sglang.srt.model_executor.model_runner_kv_cache_mixin import ModelRunnerKVCacheMixin
from sglang.srt.utils import get_available_gpu_memory
from sglang.srt.utils.common import take


class ModelRunner(ModelRunnerKVCacheMixin):
    def __init__(self, model_config, mem_fraction_static, gpu_id, tp_rank, tp_size, moe_ep_rank, moe_ep_size,
                 pp_rank, pp_size, nccl_port, server_args, dp_rank=None, is_draft_worker=False,
                 req_to_token_pool=None, token_to_kv_pool_allocator=None, draft_model_idx=None):
        self.model_config = model_config
        self.mem_fraction_static = mem_fraction_static
        self.device = "cuda"
        self.gpu_id = gpu_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.dp_rank = dp_rank
        self.server_args = server_args
        self.is_draft_worker = is_draft_worker
        self.plan = server_args.plan
        min_per_gpu_memory = self.init_torch_distributed()
        self.initialize(min_per_gpu_memory)

    def init_torch_distributed(self):
        get_available_gpu_memory(self.device, self.gpu_id)
        take(self.plan["nccl_gib"])
        if not self.server_args.disable_custom_all_reduce and self.tp_size > 1:
            self.ca_comm = CustomAllreduce({"rank": self.tp_rank, "world_size": self.tp_size}, "cuda")
        min_per_gpu_memory = get_available_gpu_memory(self.device, self.gpu_id, distributed=self.tp_size > 1)
        return min_per_gpu_memory

    def initialize(self, min_per_gpu_memory):
        self.load_model()
        self.init_memory_pool(min_per_gpu_memory, self.server_args)
        self.init_attention_backend()
        self.init_device_graphs()

    def load_model(self):
        before_avail_memory = get_available_gpu_memory(self.device, self.gpu_id)
        take(self.plan["weights_gib"])
        after_avail_memory = get_available_gpu_memory(self.device, self.gpu_id)
        self.weight_load_mem_usage = before_avail_memory - after_avail_memory

    def init_attention_backend(self):
        take(self.plan["workspace_gib"])

    def init_device_graphs(self):
        self.graph_mem_usage = 0
        before_mem = get_available_gpu_memory(self.device, self.gpu_id)
        take(self.plan["graphs_gib"])
        after_mem = get_available_gpu_memory(self.device, self.gpu_id)
        self.graph_mem_usage = before_mem - after_mem
'''

_SCHEDULER_0_5_7 = '''
import types

from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.utils.common import FREE_GIB


class Scheduler:
    def __init__(self, server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank):
        self.server_args = server_args
        self.gpu_id = gpu_id
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.dp_rank = dp_rank
        self.init_model_worker()

    def init_model_worker(self):
        self.tp_worker = ModelRunner(
            model_config=None,
            mem_fraction_static=self.server_args.mem_fraction_static,
            gpu_id=self.gpu_id,
            tp_rank=self.tp_rank,
            tp_size=self.server_args.tp_size,
            moe_ep_rank=0,
            moe_ep_size=1,
            pp_rank=self.pp_rank,
            pp_size=1,
            nccl_port=0,
            server_args=self.server_args,
            dp_rank=self.dp_rank,
        )


def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank, pipe_writer=None):
    FREE_GIB["value"] = server_args.plan["free_gib"]
    return Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)
'''

# 0.5.23 shape: bootstrap, runtime context, KV configurator, pool configurator, plugins.
_RUNTIME_CONTEXT_0_5_23 = '''
import types


class ParallelContext:
    def __init__(self):
        self._stamp = {}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._stamp:
            raise RuntimeError(f"parallel name {name!r} has not been written in this process.")
        return self._stamp[name]


_PARALLEL = ParallelContext()
_BAGS = {}


def get_parallel():
    return _PARALLEL


def get_schedule():
    if "schedule" not in _BAGS:
        raise ValueError("config namespace 'schedule' not published")
    return _BAGS["schedule"]


def get_exec():
    if "exec" not in _BAGS:
        raise ValueError("config namespace 'exec' not published")
    return _BAGS["exec"]


def publish(server_args, *, tp_rank, pp_rank, dp_rank):
    _PARALLEL._stamp.update(
        tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
        tp_size=server_args.tp_size, pp_size=1, dp_size=1, launch_world_size=server_args.tp_size,
    )
    _BAGS["schedule"] = types.SimpleNamespace(mem_fraction_static=server_args.mem_fraction_static)
    _BAGS["exec"] = types.SimpleNamespace(
        comm=types.SimpleNamespace(disable_custom_all_reduce=server_args.disable_custom_all_reduce)
    )
'''

_CUSTOM_AR_V2_0_5_23 = '''
from sglang.srt.utils.common import take


class CustomAllReduceV2:
    def __init__(self, group, device, max_size=16 * 1024 * 1024, *, max_pull_size=None, max_push_size=None,
                 max_pull_blocks=None, max_push_blocks=None):
        self.disabled = True
        self.group = group
        self.rank = group["rank"]
        self.world_size = group["world_size"]
        self.max_pull_size = max_pull_size or max_size
        self.max_push_size = max_push_size or max_size
        self.max_size = max(self.max_pull_size, self.max_push_size)
        self._init_workspace()
        self.disabled = False

    def _init_workspace(self):
        take(2 * self.world_size * self.max_push_size / (1 << 30))

    def _register_graph_inputs_ipc(self):
        return None
'''

_BOOTSTRAP_0_5_23 = '''
from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce
from sglang.srt.distributed.device_communicators.custom_all_reduce_v2 import CustomAllReduceV2
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import get_available_gpu_memory
from sglang.srt.utils.common import take

CA = {}


def init_parallel_runtime(*, server_args, device, dist_port):
    take(server_args.plan["nccl_gib"])
    if not server_args.disable_custom_all_reduce and server_args.tp_size > 1:
        group = {"rank": get_parallel().tp_rank, "world_size": server_args.tp_size}
        cls = CustomAllReduceV2 if server_args.plan.get("car_v2") else CustomAllreduce
        CA["tp"] = cls(group, device)


def measure_pre_model_load_memory(*, device, is_draft_worker):
    get_available_gpu_memory(device, 0)
    pre_model_load_memory = get_available_gpu_memory(
        device, 0, distributed=get_parallel().launch_world_size > 1 and not is_draft_worker
    )
    get_available_gpu_memory(device, 0)
    return pre_model_load_memory
'''

_POOL_CONFIGURATOR_0_5_23 = '''
from dataclasses import dataclass
from typing import Optional


@dataclass
class MemoryPoolConfig:
    max_total_num_tokens: int
    max_running_requests: Optional[int] = None
    mem_fraction_static: Optional[float] = None

    def __post_init__(self):
        if self.max_total_num_tokens <= 0:
            msg = "Not enough memory. Please try to increase --mem-fraction-static."
            if self.mem_fraction_static is not None:
                msg += f" Current value: mem_fraction_static={self.mem_fraction_static}"
            raise RuntimeError(msg)


class DefaultPoolConfigurator:
    def __init__(self, kvc):
        self._cell_size = kvc.plan["kv_bytes_per_layer_token"] * kvc.plan["num_layers"]
        self._fixed_overhead_bytes = 0

    def calculate_pool_sizes(self, available_bytes, page_size):
        available_bytes = max(available_bytes - self._fixed_overhead_bytes, 0)
        max_total_num_tokens = available_bytes // self._cell_size
        max_total_num_tokens = max_total_num_tokens // page_size * page_size
        return MemoryPoolConfig(max_total_num_tokens=max_total_num_tokens)
'''

_KV_CONFIGURATOR_0_5_23 = '''
import gc
import math
from dataclasses import dataclass

from sglang.srt.runtime_context import get_parallel, get_schedule
from sglang.srt.utils import get_available_gpu_memory
from sglang.srt.utils.common import take


@dataclass
class KVCacheConfigurator:
    device: str
    gpu_id: int
    is_draft_worker: bool
    plan: dict

    def configure(self, *, pre_model_load_memory):
        from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

        available_bytes = self._profile_available_bytes(pre_model_load_memory)
        config = DefaultPoolConfigurator(self).calculate_pool_sizes(available_bytes, self.plan["page_size"])
        take(config.max_total_num_tokens * self.plan["kv_bytes_per_layer_token"] * self.plan["num_layers"] / (1 << 30))
        config.max_running_requests = 2048
        return config

    def _profile_available_bytes(self, pre_model_load_memory):
        gc.collect()
        available_gpu_memory = get_available_gpu_memory(
            self.device, self.gpu_id, distributed=get_parallel().launch_world_size > 1
        )
        slack_gb = pre_model_load_memory * (1 - get_schedule().mem_fraction_static)
        rest_memory = available_gpu_memory - slack_gb
        if rest_memory <= 0:
            minimum_mem_fraction_static = 1 - available_gpu_memory / pre_model_load_memory
            suggested_mem_fraction_static = math.ceil(minimum_mem_fraction_static * 1000) / 1000
            raise ValueError(
                f"Loaded weights leave no GPU memory for the KV cache under "
                f"--mem-fraction-static={get_schedule().mem_fraction_static}. "
                f"Raise --mem-fraction-static above {suggested_mem_fraction_static:.3f} "
                f"(minimum viable = 1 - available/pre = {minimum_mem_fraction_static:.4f})."
            )
        return int(rest_memory * (1 << 30))
'''

_MODEL_RUNNER_0_5_23 = '''
from sglang.srt.distributed import bootstrap
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.utils import get_available_gpu_memory
from sglang.srt.utils.common import take


class ModelRunner:
    def __init__(self, model_config, mem_fraction_static, gpu_id, nccl_port, server_args, is_draft_worker=False,
                 req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None,
                 draft_model_idx=None, draft_attention_backend=None, load_group=None):
        self.mem_fraction_static = mem_fraction_static
        self.gpu_id = gpu_id
        self.device = "cuda"
        self.is_draft_worker = is_draft_worker
        self.server_args = server_args
        self.plan = server_args.plan
        self.graph_memory_usage = {}
        self.init_torch_distributed()
        self.initialize()

    def init_torch_distributed(self):
        self.pre_model_load_memory = bootstrap.measure_pre_model_load_memory(
            device=self.device, is_draft_worker=self.is_draft_worker
        )

    def initialize(self):
        self.load_model()

    def load_model(self):
        before_avail_memory = get_available_gpu_memory(self.device, self.gpu_id)
        take(self.plan["weights_gib"])
        after_avail_memory = get_available_gpu_memory(self.device, self.gpu_id)
        self.weight_load_mem_usage = before_avail_memory - after_avail_memory

    def alloc_memory_pool(self, memory_pool_config=None, *, draft_parallel_layout=None):
        self.kv_cache_configurator = KVCacheConfigurator(self.device, self.gpu_id, self.is_draft_worker, self.plan)
        result = self.kv_cache_configurator.configure(pre_model_load_memory=self.pre_model_load_memory)
        self.max_total_num_tokens = result.max_total_num_tokens
        self.max_running_requests = result.max_running_requests

    def init_attention_backends(self):
        take(self.plan["workspace_gib"])

    def init_cuda_graphs(self, capture_decode_cuda_graph=True):
        before = get_available_gpu_memory(self.device, self.gpu_id)
        take(self.plan["graphs_gib"])
        after = get_available_gpu_memory(self.device, self.gpu_id)
        self.graph_memory_usage = {"decode": before - after, "prefill": 0.0}
'''

_SCHEDULER_0_5_23 = '''
from sglang.srt.distributed import bootstrap
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import publish
from sglang.srt.utils.common import FREE_GIB


class Scheduler:
    def __init__(self, server_args, port_args):
        self.server_args = server_args
        bootstrap.init_parallel_runtime(server_args=server_args, device="cuda", dist_port=0)
        self.init_model_worker()

    def init_model_worker(self):
        from sglang.srt.model_executor.model_runner import ModelRunner

        self.model_runner = ModelRunner(
            model_config=None,
            mem_fraction_static=self.server_args.mem_fraction_static,
            gpu_id=0,
            nccl_port=0,
            server_args=self.server_args,
        )
        self.model_runner.alloc_memory_pool()
        self.model_runner.init_attention_backends()
        self.model_runner.init_cuda_graphs()


def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer=None):
    load_plugins()
    publish(server_args, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)
    FREE_GIB["value"] = server_args.plan["free_gib"]
    return Scheduler(server_args, port_args)
'''

#: Real SGLang files a 0.5.23 fake copies from the wheel (they need no torch).
REAL_0_5_23_FILES = (
    "sglang/srt/environ.py",
    "sglang/srt/plugins/__init__.py",
    "sglang/srt/plugins/hook_registry.py",
)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")


def write_fake_sglang(root: Path, line: str, real_root: Path | None = None) -> Path:
    """Write a fake ``sglang`` package of ``line``'s shape under ``root``; return ``root``.

    ``line`` is ``"0.5.7"`` (the ``.pth`` bootstrap shape) or ``"0.5.22"`` (the plugin shape, SGLang 0.5.23;
    ``real_root`` must be an unpacked 0.5.23 wheel: SGLang's real plugin loader, HookRegistry
    and environ module are copied from it).
    """
    version = {"0.5.7": "0.5.7", "0.5.22": "0.5.23"}[line]
    _write(root, "sglang/__init__.py", "from sglang.version import __version__\n")
    _write(root, "sglang/version.py", f'__version__ = "{version}"\n')
    _write(root, "sglang/srt/__init__.py", "")
    _write(root, "sglang/srt/utils/__init__.py", "from sglang.srt.utils.common import *\n")
    _write(root, "sglang/srt/utils/common.py", _COMMON)
    _write(root, "sglang/srt/distributed/__init__.py", "")
    _write(root, "sglang/srt/distributed/device_communicators/__init__.py", "")
    _write(root, "sglang/srt/distributed/device_communicators/custom_all_reduce.py", _CUSTOM_AR)
    _write(root, "sglang/srt/model_executor/__init__.py", "")
    _write(root, "sglang/srt/managers/__init__.py", "")
    if line == "0.5.7":
        _write(root, "sglang/srt/model_executor/model_runner_kv_cache_mixin.py", _MIXIN_0_5_7)
        _write(root, "sglang/srt/model_executor/model_runner.py", _MODEL_RUNNER_0_5_7)
        _write(root, "sglang/srt/managers/scheduler.py", _SCHEDULER_0_5_7)
        return root
    assert real_root is not None, "the 0.5.23 fake needs the real wheel's plugin loader"
    for rel in REAL_0_5_23_FILES:
        _write(root, rel, (real_root / rel).read_text(encoding="utf-8"))
    _write(root, "sglang/srt/runtime_context.py", _RUNTIME_CONTEXT_0_5_23)
    _write(root, "sglang/srt/distributed/bootstrap.py", _BOOTSTRAP_0_5_23)
    _write(root, "sglang/srt/distributed/device_communicators/custom_all_reduce_v2.py", _CUSTOM_AR_V2_0_5_23)
    _write(root, "sglang/srt/mem_cache/__init__.py", "")
    _write(root, "sglang/srt/mem_cache/kv_cache_configurator.py", _KV_CONFIGURATOR_0_5_23)
    _write(root, "sglang/srt/model_executor/pool_configurator.py", _POOL_CONFIGURATOR_0_5_23)
    _write(root, "sglang/srt/model_executor/model_runner.py", _MODEL_RUNNER_0_5_23)
    _write(root, "sglang/srt/managers/scheduler.py", _SCHEDULER_0_5_23)
    return root


def write_plugin_dist(root: Path) -> Path:
    """A ``.dist-info`` declaring memrec's entry point (as pyproject.toml will), under ``root``."""
    info = root / "memrec_sglang_test_plugin-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: memrec-sglang-test-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text('[sglang.srt.plugins]\nmemrec = memrec.sglang_hooks.plugin:register\n')
    return info


def server_args(**plan_overrides):
    """A picklable stand-in for ServerArgs with the fake device's plan (GiB unless named)."""
    import types

    plan = dict(
        free_gib=80.0,
        nccl_gib=0.5,
        weights_gib=16.0,
        workspace_gib=0.375,
        graphs_gib=1.25,
        num_layers=32,
        kv_bytes_per_layer_token=4096,  # 8 KV heads × 128 dims × 2 (K, V) × 2 bytes
        page_size=1,
        car_v2=False,
    )
    mem_fraction_static = plan_overrides.pop("mem_fraction_static", 0.875)
    tp_size = plan_overrides.pop("tp_size", 2)
    disable_custom_all_reduce = plan_overrides.pop("disable_custom_all_reduce", False)
    plan.update(plan_overrides)
    return types.SimpleNamespace(
        plan=plan,
        mem_fraction_static=mem_fraction_static,
        tp_size=tp_size,
        pp_size=1,
        dp_size=1,
        disable_custom_all_reduce=disable_custom_all_reduce,
        max_total_tokens=None,
    )


def child_main(tp_rank: int, plan_overrides: dict) -> None:
    """A spawned "TP worker": runs the fake 0.5.7 scheduler lifecycle, then flushes markers.

    Exits 3 when the bootstrap did not hook the model runner (so the parent sees it).
    """
    from memrec.sglang_hooks.wrappers import is_wrapped
    from sglang.srt.managers import scheduler
    from sglang.srt.model_executor.model_runner import ModelRunner

    if not is_wrapped(ModelRunner.__dict__["load_model"]):
        sys.exit(3)
    plan = dict(plan_overrides)
    args = server_args(**plan)
    scheduler.run_scheduler_process(args, None, gpu_id=tp_rank, tp_rank=tp_rank, moe_ep_rank=0, pp_rank=0, dp_rank=None)
    from memrec import client

    deadline = time.monotonic() + 5
    while not client._default_client().flush() and time.monotonic() < deadline:
        time.sleep(0.01)


# -- a marker server ---------------------------------------------------------------------------

_LEN = struct.Struct(">I")
_PEERCRED = struct.Struct("3i")


class MarkerServer:
    """A Unix-socket server that records marker frames: ``(pid, message)`` in arrival order.

    Args:
        path: the socket path.
        read: False makes a server that accepts and never reads (a stuck daemon).
    """

    def __init__(self, path: str | os.PathLike[str], read: bool = True) -> None:
        self.path = os.fspath(path)
        self.read = read
        self.records: list[tuple[int, dict]] = []
        self.connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._run, name="marker-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buffers: dict[socket.socket, tuple[int, bytearray]] = {}
        while not self._stop.is_set():
            watch = [self._sock] + (list(buffers) if self.read else [])
            try:
                ready, _, _ = select.select(watch, [], [], 0.05)
            except (OSError, ValueError):
                return
            for sock in ready:
                if sock is self._sock:
                    try:
                        conn, _ = self._sock.accept()
                    except OSError:
                        continue
                    cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                    pid, _uid, _gid = _PEERCRED.unpack(cred)
                    self.connections.append(conn)
                    buffers[conn] = (pid, bytearray())
                    continue
                pid, buf = buffers[sock]
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    buffers.pop(sock, None)
                    sock.close()
                    continue
                buf += data
                while len(buf) >= 4:
                    (size,) = _LEN.unpack_from(buf)
                    if len(buf) < 4 + size:
                        break
                    message = msgpack.unpackb(bytes(buf[4 : 4 + size]), raw=False)
                    del buf[: 4 + size]
                    with self._lock:
                        self.records.append((pid, message))

    def marks(self, name: str | None = None) -> list[tuple[int, dict]]:
        """The ``mark`` messages received so far (optionally only ``name``)."""
        with self._lock:
            records = list(self.records)
        return [(pid, m) for pid, m in records if m.get("type") == "mark" and (name is None or m.get("name") == name)]

    def wait_for(self, predicate, timeout: float = 10.0) -> bool:
        """Wait until ``predicate(self)`` is true."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.01)
        return predicate(self)

    def drop_connections(self) -> None:
        """Close every accepted connection (a daemon that went away)."""
        for conn in self.connections:
            try:
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.drop_connections()
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
