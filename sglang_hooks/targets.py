"""The SGLang functions memrec hooks, per SGLang version line, and what each hook records.

This module is pure data (stdlib only, no SGLang, no torch): the plugin (0.5.11+), the ``.pth``
bootstrap (0.4.10 – 0.5.10) and the tests all read the same table. A line is named by the first
release it applies to; a release uses the newest line at or below it.

Every release from 0.4.10 on is checked offline against ``tests/data/sglang_releases.json``
(``tests/unit/test_sglang_releases.py``): each target is defined right where the table says (not
inherited), with the parameters the hook reads, a ``@staticmethod`` exactly when marked, and the
attributes it reads assigned in that module (or the class mixing it in).
``tests/data/make_sglang_fixture.py`` rebuilds that file from every release's wheel;
``tests/unit/test_sglang_targets.py`` checks deeper facts (the formula, the failure texts)
against one wheel per line (:data:`WHEELS`).

Units: SGLang's memory numbers are GiB floats (``free_bytes / (1 << 30)``) that its logs label
"GB". Values keep SGLang's names and units; memrec's own additions end in ``_bytes`` (bytes) or
``_gib`` (GiB). See ``shared/research/sglang.md`` for the lifecycle the targets belong to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from dataclasses import field

from memrec.sglang_hooks import roles as r
from memrec.sglang_hooks.spec import ATTENTION_BACKENDS
from memrec.sglang_hooks.spec import CUDA_GRAPH_CAPTURE
from memrec.sglang_hooks.spec import CUSTOM_AR_GRAPH_REGISTER
from memrec.sglang_hooks.spec import CUSTOM_AR_INIT
from memrec.sglang_hooks.spec import CUSTOM_AR_SHARED_BUFFER
from memrec.sglang_hooks.spec import CUSTOM_AR_WORKSPACE
from memrec.sglang_hooks.spec import DIST_INIT
from memrec.sglang_hooks.spec import EXTRAS
from memrec.sglang_hooks.spec import GPU_MEMORY_MEASURED
from memrec.sglang_hooks.spec import HOOK_TYPES
from memrec.sglang_hooks.spec import INIT_MODEL_WORKER
from memrec.sglang_hooks.spec import KV_BUDGET
from memrec.sglang_hooks.spec import KV_POOL
from memrec.sglang_hooks.spec import LOAD_WEIGHTS
from memrec.sglang_hooks.spec import MARKER_NAMES
from memrec.sglang_hooks.spec import MEMORY_BASELINE
from memrec.sglang_hooks.spec import HookSpec

#: Version lines, newest first. A version uses the newest line at or below it.
LINES = ("0.5.22", "0.5.21", "0.5.17", "0.5.16", "0.5.14", "0.5.13", "0.5.11", "0.5.10", "0.5.7", "0.5.3", "0.5.2", "0.5.1", "0.4.10")


# -- the lines ---------------------------------------------------------------------------------

def _line_0_5_21(*, fixed_overhead: bool) -> tuple[HookSpec, ...]:
    """0.5.21+: groups and the custom all-reduce built in ``Scheduler.__init__``
    (``bootstrap.init_parallel_runtime``); ``fixed_overhead`` (0.5.22+): the pool configurator
    charges a page-shard scratch before dividing."""
    return (
        r.measure("sglang.srt.utils.common", "re-exported as sglang.srt.utils"),
        *r.dist_init_in_scheduler(),
        *r.custom_ar_legacy(),
        *r.custom_ar_v2(("max_size",), workspace=True, graph_ipc=True),
        r.load_weights(),
        r.kv_budget_bytes(r.KV_CONFIGURATOR, "KVCacheConfigurator"),
        r.mamba_cache(r.KV_CONFIGURATOR, "KVCacheConfigurator", "_handle_max_mamba_cache"),
        r.mm_reservation(),
        r.cell_size_pools(fixed_overhead=fixed_overhead),
        r.kv_pool(r.MODEL_RUNNER, "ModelRunner", "alloc_memory_pool", None, ("max_total_num_tokens", "max_running_requests")),
        r.attention("init_attention_backends"),
        r.graphs("init_cuda_graphs", "graph_memory_usage", ("capture_decode_cuda_graph",)),
        r.worker_in_scheduler(()),  # ranks from runtime_context.get_parallel()
    )


_LINE_0_5_22 = _line_0_5_21(fixed_overhead=True)
_LINE_0_5_21 = _line_0_5_21(fixed_overhead=False)


def _line_0_5_16(graph_attr: str) -> tuple[HookSpec, ...]:
    """0.5.16 – 0.5.20: groups built inside ``ModelRunner.init_torch_distributed`` (through
    ``bootstrap.init_torch_distributed``), which returns None; KV sizing in the configurator."""
    return (
        r.measure("sglang.srt.utils.common", "re-exported as sglang.srt.utils"),
        r.dist_init_in_runner(returns_baseline=False, ranks=r.RUNNER_PS_RANKS),
        *r.custom_ar_legacy(),
        *r.custom_ar_v2(("max_size",), workspace=True, graph_ipc=True),
        r.load_weights(),
        r.kv_budget_bytes(r.KV_CONFIGURATOR, "KVCacheConfigurator"),
        r.mamba_cache(r.KV_CONFIGURATOR, "KVCacheConfigurator", "_handle_max_mamba_cache"),
        *((r.mm_reservation(),) if graph_attr == "graph_memory_usage" else ()),
        r.cell_size_pools(),
        r.kv_pool(r.MODEL_RUNNER, "ModelRunner", "alloc_memory_pool", None, ("max_total_num_tokens", "max_running_requests")),
        r.attention("init_attention_backends"),
        r.graphs("init_cuda_graphs", graph_attr, ("capture_decode_cuda_graph",)),
        r.worker_in_scheduler(r.SCHED_PS_RANKS),
    )


_LINE_0_5_17 = _line_0_5_16("graph_memory_usage")
_LINE_0_5_16 = _line_0_5_16("graph_mem_usage")

def _line_0_5_11(*, renamed: bool, scheduler_ranks: tuple[tuple[str, str], ...]) -> tuple[HookSpec, ...]:
    """0.5.11 – 0.5.15: the budget in bytes (``_profile_available_bytes``, still on the mixin),
    the cell size in the pool configurator. ``renamed`` (0.5.14): ``init_attention_backends``,
    ``init_cuda_graphs(capture_decode_cuda_graph)`` and the V2's graph-input IPC."""
    return (
        r.measure("sglang.srt.utils.common", "re-exported as sglang.srt.utils"),
        r.dist_init_in_runner(returns_baseline=True),
        *r.custom_ar_legacy(),
        *r.custom_ar_v2(("max_pull_size", "max_push_size"), workspace=False, graph_ipc=renamed),
        r.load_weights(),
        r.kv_budget_bytes(r.KV_MIXIN, "ModelRunnerKVCacheMixin"),
        r.mamba_cache(r.KV_MIXIN, "ModelRunnerKVCacheMixin", "handle_max_mamba_cache"),
        r.cell_size_pools(),
        r.kv_pool(r.KV_MIXIN, "ModelRunnerKVCacheMixin", "init_memory_pool", "pre_model_load_memory",
                 ("max_total_num_tokens", "max_running_requests")),
        r.attention("init_attention_backends" if renamed else "init_attention_backend"),
        r.graphs("init_cuda_graphs", "graph_mem_usage", ("capture_decode_cuda_graph",)) if renamed
        else r.graphs("init_device_graphs", "graph_mem_usage"),
        r.worker_in_scheduler(scheduler_ranks),
    )


_LINE_0_5_14 = _line_0_5_11(renamed=True, scheduler_ranks=r.SCHED_PS_RANKS)
#: 0.5.13: the Scheduler's ranks moved into ``self.ps``.
_LINE_0_5_13 = _line_0_5_11(renamed=False, scheduler_ranks=r.SCHED_PS_RANKS)
_LINE_0_5_11 = _line_0_5_11(renamed=False, scheduler_ranks=r.SCHED_RANKS)


def _line_0_5_7(pre_param: str, *, v2: bool) -> tuple[HookSpec, ...]:
    """0.5.7 – 0.5.10: KV methods on the mixin; ``pre_model_load_memory`` replaced
    ``total_gpu_memory`` and the (opt-in) V2 custom all-reduce came in 0.5.10."""
    return (
        r.measure("sglang.srt.utils.common", "re-exported as sglang.srt.utils"),
        r.dist_init_in_runner(returns_baseline=True),
        *r.custom_ar_legacy(),
        *(r.custom_ar_v2(("max_pull_size", "max_push_size"), workspace=False, graph_ipc=False) if v2 else ()),
        r.load_weights(),
        r.kv_budget_tokens(r.KV_MIXIN, "ModelRunnerKVCacheMixin", pre_param),
        r.cell_size_mixin(),
        r.mamba_cache(r.KV_MIXIN, "ModelRunnerKVCacheMixin", "handle_max_mamba_cache"),
        r.kv_pool(r.KV_MIXIN, "ModelRunnerKVCacheMixin", "init_memory_pool", pre_param,
                 ("max_total_num_tokens", "max_running_requests")),
        r.attention("init_attention_backend"),
        r.graphs("init_device_graphs", "graph_mem_usage"),
        r.worker_in_scheduler(r.SCHED_RANKS),
    )


_LINE_0_5_10 = _line_0_5_7("pre_model_load_memory", v2=True)
_LINE_0_5_7 = _line_0_5_7("total_gpu_memory", v2=False)


def _line_0_5_1(measure_module: str, note: str, graph_attr: str = "graph_mem_usage") -> tuple[HookSpec, ...]:
    """0.5.1 – 0.5.6: all on ModelRunner, graphs in ``init_device_graphs``."""
    return (
        r.measure(measure_module, note),
        r.dist_init_in_runner(returns_baseline=True),
        *r.custom_ar_legacy(),
        r.load_weights(),
        r.kv_budget_tokens(r.MODEL_RUNNER, "ModelRunner", "total_gpu_memory"),
        r.kv_pool(r.MODEL_RUNNER, "ModelRunner", "init_memory_pool", "total_gpu_memory", ("max_total_num_tokens",)),
        r.attention("init_attention_backend"),
        r.graphs("init_device_graphs", graph_attr),
        r.worker_in_tp_worker(),
    )


_LINE_0_5_3 = _line_0_5_1("sglang.srt.utils.common", "utils became a package in 0.5.3; re-exported as sglang.srt.utils")
_LINE_0_5_2 = _line_0_5_1("sglang.srt.utils", "utils.py (a module, not a package, until 0.5.2)")
_LINE_0_5_1 = _line_0_5_1("sglang.srt.utils", "utils.py", graph_attr="cuda_graph_mem_usage")

_LINE_0_4_10: tuple[HookSpec, ...] = (
    r.measure("sglang.srt.utils", "utils.py (a module, not a package, in 0.4.x)"),
    r.dist_init_in_runner(returns_baseline=True),
    *r.custom_ar_legacy(),
    r.load_weights(),
    r.kv_budget_tokens(r.MODEL_RUNNER, "ModelRunner", "total_gpu_memory"),
    r.kv_pool(r.MODEL_RUNNER, "ModelRunner", "init_memory_pool", "total_gpu_memory", ("max_total_num_tokens",)),
    r.attention("init_attention_backend"),
    r.graphs("init_cuda_graphs", "cuda_graph_mem_usage"),
    r.worker_in_tp_worker(),
)

#: Every line's hooks.
TARGETS: dict[str, tuple[HookSpec, ...]] = {
    "0.5.22": _LINE_0_5_22,
    "0.5.21": _LINE_0_5_21,
    "0.5.17": _LINE_0_5_17,
    "0.5.16": _LINE_0_5_16,
    "0.5.14": _LINE_0_5_14,
    "0.5.13": _LINE_0_5_13,
    "0.5.11": _LINE_0_5_11,
    "0.5.10": _LINE_0_5_10,
    "0.5.7": _LINE_0_5_7,
    "0.5.3": _LINE_0_5_3,
    "0.5.2": _LINE_0_5_2,
    "0.5.1": _LINE_0_5_1,
    "0.4.10": _LINE_0_4_10,
}

#: A wheel each line's deeper tests read the real source of (the newest of its range unless an
#: older one is the interesting one).
WHEELS: dict[str, str] = {
    "0.5.22": "0.5.23",
    "0.5.21": "0.5.21",
    "0.5.17": "0.5.20",
    "0.5.16": "0.5.16",
    "0.5.14": "0.5.15.post1",
    "0.5.13": "0.5.13",
    "0.5.11": "0.5.12.post1",
    "0.5.10": "0.5.10",
    "0.5.7": "0.5.7",
    "0.5.3": "0.5.6.post2",
    "0.5.2": "0.5.2",
    "0.5.1": "0.5.1.post3",
    "0.4.10": "0.4.10.post2",
}

#: Lines that have SGLang's plugin system (entry-point group ``sglang.srt.plugins``).
#: It exists since 0.5.11: ``load_plugins()`` is the first thing ``run_scheduler_process`` does.
PLUGIN_LINES = frozenset({"0.5.22", "0.5.21", "0.5.17", "0.5.16", "0.5.14", "0.5.13", "0.5.11"})

#: The two failure texts of KV sizing (both mean: the KV budget is too small).
NOT_ENOUGH_MEMORY = "Not enough memory"
NO_MEMORY_FOR_KV = "Loaded weights leave no GPU memory"

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(version: str | None) -> tuple[int, int, int] | None:
    """``"0.5.10.post1"`` → ``(0, 5, 10)``; None when it does not start with a version."""
    if not version:
        return None
    m = _VERSION_RE.match(str(version))
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def line_for_version(version: str | None) -> str:
    """The version line whose table applies to ``version``.

    A version uses the newest line at or below it; versions between two lines (e.g. 0.5.15)
    use the older line, and any of its targets that moved are reported missing and stay off.
    An unknown version uses the newest line.
    """
    parsed = parse_version(version)
    if parsed is None:
        return LINES[0]
    for line in LINES:
        line_version = parse_version(line)
        assert line_version is not None
        if parsed >= line_version:
            return line
    return LINES[-1]


def targets_for_version(version: str | None) -> tuple[HookSpec, ...]:
    """The hooks for an SGLang version (see :func:`line_for_version`)."""
    return TARGETS[line_for_version(version)]


def modules(line: str) -> frozenset[str]:
    """The modules that hold a line's targets."""
    return frozenset(spec.module for spec in TARGETS[line])


def all_modules() -> frozenset[str]:
    """The modules of every line (what the bootstrap's import hook watches)."""
    return frozenset(spec.module for specs in TARGETS.values() for spec in specs)


@dataclass(frozen=True)
class TargetRow:
    """One row of the documentation table (see :func:`table`)."""

    line: str
    target: str
    hook: str
    marker: str
    reads: str
    note: str = field(default="")


def table() -> list[TargetRow]:
    """The whole table as rows, for docs and ``memrec`` help output."""
    rows = []
    for line, specs in TARGETS.items():
        for spec in specs:
            reads = [f"arg {p}→{k}" if p != k else f"arg {p}" for p, k in spec.params]
            reads += [f"self.{a}→{k}" if a != k else f"self.{a}" for a, k in spec.attrs_before]
            reads += [f"self.{a}→{k} (after)" if a != k else f"self.{a} (after)" for a, k in spec.attrs_after]
            if spec.result:
                reads.append(f"result→{spec.result}")
            reads += [f"result.{a}→{k}" for a, k in spec.result_attrs]
            reads += [f"[{e}]" for e in spec.extras]
            rows.append(
                TargetRow(line, spec.target, spec.hook, spec.marker or "(into span)", ", ".join(reads), spec.note)
            )
    return rows


#: The table's public names (the marker names and :class:`HookSpec` come from
#: :mod:`memrec.sglang_hooks.spec`; readers of the table find them here too).
__all__ = [
    "ATTENTION_BACKENDS", "CUDA_GRAPH_CAPTURE", "CUSTOM_AR_GRAPH_REGISTER", "CUSTOM_AR_INIT",
    "CUSTOM_AR_SHARED_BUFFER", "CUSTOM_AR_WORKSPACE", "DIST_INIT", "EXTRAS", "GPU_MEMORY_MEASURED", "HOOK_TYPES",
    "INIT_MODEL_WORKER", "KV_BUDGET", "KV_POOL", "LINES", "LOAD_WEIGHTS", "MARKER_NAMES", "MEMORY_BASELINE",
    "NOT_ENOUGH_MEMORY", "NO_MEMORY_FOR_KV", "PLUGIN_LINES", "TARGETS", "WHEELS", "HookSpec", "TargetRow",
    "all_modules", "line_for_version", "modules", "parse_version", "table", "targets_for_version",
]
