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

#: Hook types. ``around``: begin and end markers bracketing the call (the end carries the values
#: read after the call, or ``error`` when it raised). ``after``: one instant marker after the call
#: (with ``error`` when it raised). ``before``: one instant marker before the call.
HOOK_TYPES = ("before", "after", "around")

#: Marker names (phase names) the hooks emit.
DIST_INIT = "dist_init"
CUSTOM_AR_INIT = "custom_ar_init"
CUSTOM_AR_SHARED_BUFFER = "custom_ar_shared_buffer"
CUSTOM_AR_WORKSPACE = "custom_ar_workspace"
CUSTOM_AR_GRAPH_REGISTER = "custom_ar_graph_register"
MEMORY_BASELINE = "memory_baseline"
LOAD_WEIGHTS = "load_weights"
KV_BUDGET = "kv_budget"
KV_POOL = "kv_pool"
ATTENTION_BACKENDS = "attention_backends"
CUDA_GRAPH_CAPTURE = "cuda_graph_capture"
INIT_MODEL_WORKER = "init_model_worker"
GPU_MEMORY_MEASURED = "gpu_memory_measured"

MARKER_NAMES = (
    DIST_INIT,
    CUSTOM_AR_INIT,
    CUSTOM_AR_SHARED_BUFFER,
    CUSTOM_AR_WORKSPACE,
    CUSTOM_AR_GRAPH_REGISTER,
    MEMORY_BASELINE,
    LOAD_WEIGHTS,
    KV_BUDGET,
    KV_POOL,
    ATTENTION_BACKENDS,
    CUDA_GRAPH_CAPTURE,
    INIT_MODEL_WORKER,
    GPU_MEMORY_MEASURED,
)

#: Extractors (named in HookSpec.extras) implemented in wrappers.py.
#: - ``caller``: the function that called the hooked one (skipping hook frames): ``caller``,
#:   ``caller_module``.
#: - ``parallel_config``: sizes and flags from SGLang's runtime context (0.5.23) or
#:   ``server_args`` (older): ``tp_size``, ``pp_size``, ``dp_size``, ``mem_fraction_static``,
#:   ``disable_custom_all_reduce``.
#: - ``mem_fraction_static``: ``self.mem_fraction_static`` or, on 0.5.23, the runtime context's
#:   ``get_schedule().mem_fraction_static``.
#: - ``class_name``: ``custom_ar_class`` = the class of ``self`` (which custom all-reduce was built).
EXTRAS = ("caller", "parallel_config", "mem_fraction_static", "class_name")

#: Version lines, newest first. A version uses the newest line at or below it.
LINES = ("0.5.22", "0.5.21", "0.5.17", "0.5.16", "0.5.14", "0.5.13", "0.5.11", "0.5.10", "0.5.7", "0.5.3", "0.5.2", "0.5.1", "0.4.10")


@dataclass(frozen=True)
class HookSpec:
    """One hooked SGLang function and what its hook records.

    Attributes:
        module: the module that defines it (where the hook patches it).
        qualname: ``function`` or ``Class.method`` inside ``module``.
        hook: ``before`` | ``after`` | ``around`` (see :data:`HOOK_TYPES`).
        marker: the marker name; None for a hook that only adds values to the enclosing span.
        params: ``(parameter, value key)`` pairs read from the call's arguments (at begin).
        attrs_before: ``(attribute of self, value key)`` read before the call; a dotted
            attribute (``ps.tp_rank``) is read through the objects it names.
        attrs_after: ``(attribute of self, value key)`` read after the call.
        result: value key for the return value (None: not recorded).
        result_attrs: ``(attribute of the return value, value key)`` read after the call.
        extras: extractor names (:data:`EXTRAS`).
        static: the target is a ``@staticmethod`` (the patch keeps it one).
        capture_measurement: a span that records the first ``get_available_gpu_memory`` result
            taken inside it as ``available_gpu_memory`` (GiB).
        contribute: the values go into the innermost open span's end marker (as well as this
            hook's own marker, if it has one).
        since: the first release of the line's range that has this target (None: all of
            them); before it the target is expected to be missing (logged at debug level only).
        baseline_from: also emit an instant ``memory_baseline`` marker carrying this value
            key (``pre_model_load_memory``, the return value of ``init_torch_distributed`` up to
            0.5.15, ``self.pre_model_load_memory`` after it in 0.5.16 – 0.5.20).
        note: where it sits in SGLang's lifecycle (file:line in that wheel).
    """

    module: str
    qualname: str
    hook: str
    marker: str | None
    params: tuple[tuple[str, str], ...] = ()
    attrs_before: tuple[tuple[str, str], ...] = ()
    attrs_after: tuple[tuple[str, str], ...] = ()
    result: str | None = None
    result_attrs: tuple[tuple[str, str], ...] = ()
    extras: tuple[str, ...] = ()
    static: bool = False
    capture_measurement: bool = False
    contribute: bool = False
    baseline_from: str | None = None
    since: str | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.hook not in HOOK_TYPES:
            raise ValueError(f"{self.target}: hook type {self.hook!r} not in {HOOK_TYPES}")
        if self.marker is not None and self.marker not in MARKER_NAMES:
            raise ValueError(f"{self.target}: unknown marker {self.marker!r}")
        if self.marker is None and not self.contribute:
            raise ValueError(f"{self.target}: a hook without a marker must contribute")
        unknown = set(self.extras) - set(EXTRAS)
        if unknown:
            raise ValueError(f"{self.target}: unknown extras {sorted(unknown)}")

    @property
    def target(self) -> str:
        """The dotted target, as SGLang's ``HookRegistry.register`` takes it."""
        return f"{self.module}.{self.qualname}"

    @property
    def key(self) -> str:
        """A short unique name for logs: ``module:qualname``."""
        return f"{self.module}:{self.qualname}"

    @property
    def param_names(self) -> tuple[str, ...]:
        """The parameters the hook reads (they must exist in the real signature)."""
        return tuple(name for name, _ in self.params)

    @property
    def attr_names(self) -> tuple[str, ...]:
        """The attributes of ``self`` the hook reads (before and after the call; the first
        part of a dotted one)."""
        return tuple(name.split(".")[0] for name, _ in self.attrs_before + self.attrs_after)


def _p(*names: str, **renamed: str) -> tuple[tuple[str, str], ...]:
    """Parameter (or attribute) pairs: ``_p("a", b="key")`` → ``(("a", "a"), ("b", "key"))``."""
    return tuple((n, n) for n in names) + tuple(renamed.items())


# -- building blocks shared by several lines ---------------------------------------------------
#
# Each function below is one role of the lifecycle; a line is the roles as that SGLang range
# has them. tests/data/sglang_releases.json (regenerated by tests/data/make_sglang_fixture.py
# from every release's wheel) is what tests/unit/test_sglang_releases.py checks them against.

_MEASURE_PARAMS = _p("device", "gpu_id", "distributed", "empty_cache")

_CAR = "sglang.srt.distributed.device_communicators.custom_all_reduce"
_CAR_V2 = "sglang.srt.distributed.device_communicators.custom_all_reduce_v2"
_MR = "sglang.srt.model_executor.model_runner"
_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin"
_KVC = "sglang.srt.mem_cache.kv_cache_configurator"
_POOLS = "sglang.srt.model_executor.pool_configurator"
_BOOT = "sglang.srt.distributed.bootstrap"
_SCHED = "sglang.srt.managers.scheduler"
_CAR_AFTER = _p("max_size", "world_size", "rank", "full_nvlink", "disabled")
_RUNNER_RANKS = _p("gpu_id", "tp_rank", "pp_rank", "is_draft_worker")
#: 0.5.16 – 0.5.20: the runner keeps its ranks in ``self.ps`` (a ParallelState).
_RUNNER_PS_RANKS = _p("gpu_id", "is_draft_worker", **{"ps.tp_rank": "tp_rank", "ps.pp_rank": "pp_rank"})


def _measure(module: str, note: str) -> HookSpec:
    return HookSpec(
        module,
        "get_available_gpu_memory",
        "after",
        GPU_MEMORY_MEASURED,
        params=_MEASURE_PARAMS,
        result="result_gib",
        extras=("caller",),
        note=note,
    )


def _custom_ar_legacy() -> tuple[HookSpec, ...]:
    return (
        HookSpec(
            _CAR,
            "CustomAllreduce.__init__",
            "around",
            CUSTOM_AR_INIT,
            params=_p("max_size"),
            attrs_after=_CAR_AFTER,
            extras=("class_name",),
            note="legacy custom all-reduce: cudaMalloc + cudaIpcGetMemHandle/OpenMemHandle per peer",
        ),
        HookSpec(
            _CAR,
            "CustomAllreduce.create_shared_buffer",
            "after",
            CUSTOM_AR_SHARED_BUFFER,
            params=_p("size_in_bytes"),
            static=True,
            note="staticmethod: one cudaMalloc of size_in_bytes, its IPC handle all-gathered and opened by every peer",
        ),
        HookSpec(
            _CAR,
            "CustomAllreduce.register_graph_buffers",
            "around",
            CUSTOM_AR_GRAPH_REGISTER,
            extras=("class_name",),
            note="after CUDA-graph capture: IPC-opens every peer's captured input buffers",
        ),
    )


def _custom_ar_v2(init_params: tuple[str, ...], *, workspace: bool, graph_ipc: bool) -> tuple[HookSpec, ...]:
    """The symmetric-memory custom all-reduce (0.5.10+: opt-in, then the default on CUDA)."""
    specs = [
        HookSpec(
            _CAR_V2,
            "CustomAllReduceV2.__init__",
            "around",
            CUSTOM_AR_INIT,
            params=_p(*init_params),
            attrs_after=_p(*(("max_size",) if workspace else ()), "max_push_size", "max_pull_size",
                           "world_size", "rank", "disabled"),
            extras=("class_name",),
            note="symmetric memory (cuMemCreate/cuMemMap + shareable handles); opt-in "
            "(SGLANG_USE_JIT_ALL_REDUCE=1) on 0.5.10, the default on CUDA later "
            "(SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2)",
        )
    ]
    if workspace:
        specs.append(
            HookSpec(
                _CAR_V2,
                "CustomAllReduceV2._init_workspace",
                "after",
                CUSTOM_AR_WORKSPACE,
                attrs_after=_p("max_size", "max_push_size", "max_pull_size"),
                note="(re)allocates the symmetric workspace (also from reserve_push_capacity)",
            )
        )
    if graph_ipc:
        specs.append(
            HookSpec(
                _CAR_V2,
                "CustomAllReduceV2._register_graph_inputs_ipc",
                "around",
                CUSTOM_AR_GRAPH_REGISTER,
                extras=("class_name",),
                note="IPC-opens captured graph inputs after capture",
            )
        )
    return tuple(specs)


def _dist_init_in_runner(*, returns_baseline: bool, ranks: tuple[tuple[str, str], ...] = _RUNNER_RANKS) -> HookSpec:
    """``ModelRunner.init_torch_distributed``: NCCL/gloo groups and the custom all-reduce; the
    WORLD-MIN baseline is its return value (≤ 0.5.15) or ``self.pre_model_load_memory``."""
    return HookSpec(
        _MR,
        "ModelRunner.init_torch_distributed",
        "around",
        DIST_INIT,
        attrs_before=ranks,
        attrs_after=() if returns_baseline else _p("pre_model_load_memory"),
        result="pre_model_load_memory" if returns_baseline else None,
        extras=("parallel_config",),
        baseline_from="pre_model_load_memory",
        note="set_device, NCCL/gloo groups, custom all-reduce; then the WORLD-MIN free GiB "
        + ("returned (min_per_gpu_memory)" if returns_baseline else
           "stored as self.pre_model_load_memory (it returns None; groups built by "
           "bootstrap.init_torch_distributed)"),
    )


def _dist_init_in_scheduler() -> tuple[HookSpec, ...]:
    """0.5.21+: ``Scheduler.__init__`` builds the groups (``bootstrap.init_parallel_runtime``);
    the runner only measures the baseline (``bootstrap.measure_pre_model_load_memory``)."""
    return (
        HookSpec(
            _BOOT,
            "init_parallel_runtime",
            "around",
            DIST_INIT,
            params=_p("device", "dist_port"),
            extras=("parallel_config",),
            note="called from Scheduler.__init__: set_device, NCCL/gloo groups, custom all-reduce, NCCL prewarm",
        ),
        HookSpec(
            _BOOT,
            "measure_pre_model_load_memory",
            "around",
            MEMORY_BASELINE,
            params=_p("device", "is_draft_worker"),
            result="pre_model_load_memory",
            note="WORLD-MIN free GiB after distributed init (local only for a draft)",
        ),
    )


def _load_weights() -> HookSpec:
    return HookSpec(
        _MR,
        "ModelRunner.load_model",
        "around",
        LOAD_WEIGHTS,
        attrs_before=_p("gpu_id", "is_draft_worker"),
        attrs_after=_p("weight_load_mem_usage"),
        note="weights; SGLang stores weight_load_mem_usage (GiB) = free before − free after",
    )


def _kv_budget_tokens(module: str, cls: str, pre_param: str) -> HookSpec:
    """≤ 0.5.10: ``profile_max_num_token`` returns the profiled token count."""
    return HookSpec(
        module,
        f"{cls}.profile_max_num_token",
        "around",
        KV_BUDGET,
        params=((pre_param, "pre_model_load_memory"),),
        attrs_before=_p("gpu_id", "is_draft_worker", "mem_fraction_static"),
        result="max_num_token",
        capture_measurement=True,
        note="rest_memory = available − pre_model_load_memory × (1 − mem_fraction_static) "
        "(− mamba cache); returns int(rest_memory × 2**30) // cell_size (profiled tokens, before caps)",
    )


def _kv_budget_bytes(module: str, cls: str) -> HookSpec:
    """0.5.11+: ``_profile_available_bytes`` returns the budget in bytes (raises when <= 0)."""
    return HookSpec(
        module,
        f"{cls}._profile_available_bytes",
        "around",
        KV_BUDGET,
        params=_p("pre_model_load_memory"),
        attrs_before=_p("gpu_id", "is_draft_worker"),
        result="rest_memory_bytes",
        extras=("mem_fraction_static",),
        capture_measurement=True,
        note="rest = available − pre × (1 − mem_fraction_static) (− multimodal reservation, "
        "mamba); raises ValueError 'Loaded weights leave no GPU memory...' when rest <= 0 "
        "(0.5.15+); returns int(rest × 2**30) bytes",
    )


def _mamba_cache(module: str, cls: str, method: str) -> HookSpec:
    """The mamba state cache SGLang takes out of the rest before dividing (mamba/hybrid models)."""
    return HookSpec(
        module,
        f"{cls}.{method}",
        "after",
        None,
        params=(("total_rest_memory", "rest_before_mamba_gib"),),
        result="rest_after_mamba_gib",
        contribute=True,
        note="rest (GiB) before and after the mamba state cache; read into the kv_budget span",
    )


def _mm_reservation() -> HookSpec:
    return HookSpec(
        _KVC,
        "mm_runtime_reservation_gb",
        "after",
        None,
        result="mm_reservation_gib",
        contribute=True,
        since="0.5.18",
        note="multimodal runtime reservation (GiB) subtracted from the rest; read into the kv_budget span",
    )


def _cell_size_mixin() -> HookSpec:
    return HookSpec(
        _MIXIN,
        "ModelRunnerKVCacheMixin.get_cell_size_per_token",
        "after",
        None,
        params=_p("num_layers"),
        result="cell_size",
        contribute=True,
        note="bytes of KV cache per token (all layers); read into the kv_budget span",
    )


def _cell_size_pools(*, fixed_overhead: bool = False) -> HookSpec:
    overhead = (("_fixed_overhead_bytes", "fixed_overhead_bytes"),) if fixed_overhead else ()
    return HookSpec(
        _POOLS,
        "DefaultPoolConfigurator.calculate_pool_sizes",
        "after",
        None,
        params=_p("available_bytes", "page_size"),
        attrs_before=(("_cell_size", "cell_size"),) + overhead,
        result_attrs=(("max_total_num_tokens", "sglang_tokens"),),
        contribute=True,
        note="max_tokens = available_bytes // cell_size (MHA/MLA/DSA); MemoryPoolConfig.__post_init__ "
        "raises 'Not enough memory...' when it is <= 0 (hybrid SWA / DSv4 configurators: not read)",
    )


def _kv_pool(module: str, cls: str, method: str, pre_param: str | None, pool_attrs: tuple[str, ...]) -> HookSpec:
    return HookSpec(
        module,
        f"{cls}.{method}",
        "around",
        KV_POOL,
        params=((pre_param, "pre_model_load_memory"),) if pre_param else (),
        attrs_before=_p("gpu_id", "is_draft_worker") + (() if pre_param else _p("pre_model_load_memory")),
        attrs_after=_p(*pool_attrs),
        note="caps, page alignment, PP MIN; 'Not enough memory...' when max_total_num_tokens <= 0; "
        "allocates the pools",
    )


def _attention(method: str) -> HookSpec:
    return HookSpec(
        _MR,
        f"ModelRunner.{method}",
        "around",
        ATTENTION_BACKENDS,
        attrs_before=_p("gpu_id"),
        note="attention backend workspaces (FlashInfer float workspace)",
    )


def _graphs(method: str, attr: str, params: tuple[str, ...] = ()) -> HookSpec:
    return HookSpec(
        _MR,
        f"ModelRunner.{method}",
        "around",
        CUDA_GRAPH_CAPTURE,
        params=_p(*params),
        attrs_before=_p("gpu_id"),
        attrs_after=((attr, "graph_memory_usage"),),
        note=f"CUDA graph capture; SGLang stores {attr} (GiB, or a dict of GiB per phase)",
    )


def _worker_in_tp_worker() -> HookSpec:
    return HookSpec(
        "sglang.srt.managers.tp_worker",
        "TpModelWorker.__init__",
        "around",
        INIT_MODEL_WORKER,
        params=_p("gpu_id", "tp_rank", "pp_rank", "dp_rank", "is_draft_worker"),
        note="no Scheduler.init_model_worker before 0.5.7: the worker builds the ModelRunner",
    )


def _worker_in_scheduler(ranks: tuple[tuple[str, str], ...]) -> HookSpec:
    return HookSpec(
        _SCHED,
        "Scheduler.init_model_worker",
        "around",
        INIT_MODEL_WORKER,
        attrs_before=ranks,
        note="target + draft workers, pools, backends, graphs",
    )


_SCHED_RANKS = _p("gpu_id", "tp_rank", "pp_rank", "dp_rank")
#: 0.5.13 – 0.5.20: the Scheduler keeps its ranks in ``self.ps`` (a ParallelState).
_SCHED_PS_RANKS = tuple((f"ps.{a}", a) for a in ("gpu_id", "tp_rank", "pp_rank", "dp_rank"))


# -- the lines ---------------------------------------------------------------------------------

def _line_0_5_21(*, fixed_overhead: bool) -> tuple[HookSpec, ...]:
    """0.5.21+: groups and the custom all-reduce built in ``Scheduler.__init__``
    (``bootstrap.init_parallel_runtime``); ``fixed_overhead`` (0.5.22+): the pool configurator
    charges a page-shard scratch before dividing."""
    return (
        _measure("sglang.srt.utils.common", "re-exported as sglang.srt.utils"),
        *_dist_init_in_scheduler(),
        *_custom_ar_legacy(),
        *_custom_ar_v2(("max_size",), workspace=True, graph_ipc=True),
        _load_weights(),
        _kv_budget_bytes(_KVC, "KVCacheConfigurator"),
        _mamba_cache(_KVC, "KVCacheConfigurator", "_handle_max_mamba_cache"),
        _mm_reservation(),
        _cell_size_pools(fixed_overhead=fixed_overhead),
        _kv_pool(_MR, "ModelRunner", "alloc_memory_pool", None, ("max_total_num_tokens", "max_running_requests")),
        _attention("init_attention_backends"),
        _graphs("init_cuda_graphs", "graph_memory_usage", ("capture_decode_cuda_graph",)),
        _worker_in_scheduler(()),  # ranks from runtime_context.get_parallel()
    )


_LINE_0_5_22 = _line_0_5_21(fixed_overhead=True)
_LINE_0_5_21 = _line_0_5_21(fixed_overhead=False)


def _line_0_5_16(graph_attr: str) -> tuple[HookSpec, ...]:
    """0.5.16 – 0.5.20: groups built inside ``ModelRunner.init_torch_distributed`` (through
    ``bootstrap.init_torch_distributed``), which returns None; KV sizing in the configurator."""
    return (
        _measure("sglang.srt.utils.common", "re-exported as sglang.srt.utils"),
        _dist_init_in_runner(returns_baseline=False, ranks=_RUNNER_PS_RANKS),
        *_custom_ar_legacy(),
        *_custom_ar_v2(("max_size",), workspace=True, graph_ipc=True),
        _load_weights(),
        _kv_budget_bytes(_KVC, "KVCacheConfigurator"),
        _mamba_cache(_KVC, "KVCacheConfigurator", "_handle_max_mamba_cache"),
        *((_mm_reservation(),) if graph_attr == "graph_memory_usage" else ()),
        _cell_size_pools(),
        _kv_pool(_MR, "ModelRunner", "alloc_memory_pool", None, ("max_total_num_tokens", "max_running_requests")),
        _attention("init_attention_backends"),
        _graphs("init_cuda_graphs", graph_attr, ("capture_decode_cuda_graph",)),
        _worker_in_scheduler(_SCHED_PS_RANKS),
    )


_LINE_0_5_17 = _line_0_5_16("graph_memory_usage")
_LINE_0_5_16 = _line_0_5_16("graph_mem_usage")

def _line_0_5_11(*, renamed: bool, scheduler_ranks: tuple[tuple[str, str], ...]) -> tuple[HookSpec, ...]:
    """0.5.11 – 0.5.15: the budget in bytes (``_profile_available_bytes``, still on the mixin),
    the cell size in the pool configurator. ``renamed`` (0.5.14): ``init_attention_backends``,
    ``init_cuda_graphs(capture_decode_cuda_graph)`` and the V2's graph-input IPC."""
    return (
        _measure("sglang.srt.utils.common", "re-exported as sglang.srt.utils"),
        _dist_init_in_runner(returns_baseline=True),
        *_custom_ar_legacy(),
        *_custom_ar_v2(("max_pull_size", "max_push_size"), workspace=False, graph_ipc=renamed),
        _load_weights(),
        _kv_budget_bytes(_MIXIN, "ModelRunnerKVCacheMixin"),
        _mamba_cache(_MIXIN, "ModelRunnerKVCacheMixin", "handle_max_mamba_cache"),
        _cell_size_pools(),
        _kv_pool(_MIXIN, "ModelRunnerKVCacheMixin", "init_memory_pool", "pre_model_load_memory",
                 ("max_total_num_tokens", "max_running_requests")),
        _attention("init_attention_backends" if renamed else "init_attention_backend"),
        _graphs("init_cuda_graphs", "graph_mem_usage", ("capture_decode_cuda_graph",)) if renamed
        else _graphs("init_device_graphs", "graph_mem_usage"),
        _worker_in_scheduler(scheduler_ranks),
    )


_LINE_0_5_14 = _line_0_5_11(renamed=True, scheduler_ranks=_SCHED_PS_RANKS)
#: 0.5.13: the Scheduler's ranks moved into ``self.ps``.
_LINE_0_5_13 = _line_0_5_11(renamed=False, scheduler_ranks=_SCHED_PS_RANKS)
_LINE_0_5_11 = _line_0_5_11(renamed=False, scheduler_ranks=_SCHED_RANKS)


def _line_0_5_7(pre_param: str, *, v2: bool) -> tuple[HookSpec, ...]:
    """0.5.7 – 0.5.10: KV methods on the mixin; ``pre_model_load_memory`` replaced
    ``total_gpu_memory`` and the (opt-in) V2 custom all-reduce came in 0.5.10."""
    return (
        _measure("sglang.srt.utils.common", "re-exported as sglang.srt.utils"),
        _dist_init_in_runner(returns_baseline=True),
        *_custom_ar_legacy(),
        *(_custom_ar_v2(("max_pull_size", "max_push_size"), workspace=False, graph_ipc=False) if v2 else ()),
        _load_weights(),
        _kv_budget_tokens(_MIXIN, "ModelRunnerKVCacheMixin", pre_param),
        _cell_size_mixin(),
        _mamba_cache(_MIXIN, "ModelRunnerKVCacheMixin", "handle_max_mamba_cache"),
        _kv_pool(_MIXIN, "ModelRunnerKVCacheMixin", "init_memory_pool", pre_param,
                 ("max_total_num_tokens", "max_running_requests")),
        _attention("init_attention_backend"),
        _graphs("init_device_graphs", "graph_mem_usage"),
        _worker_in_scheduler(_SCHED_RANKS),
    )


_LINE_0_5_10 = _line_0_5_7("pre_model_load_memory", v2=True)
_LINE_0_5_7 = _line_0_5_7("total_gpu_memory", v2=False)


def _line_0_5_1(measure_module: str, note: str, graph_attr: str = "graph_mem_usage") -> tuple[HookSpec, ...]:
    """0.5.1 – 0.5.6: all on ModelRunner, graphs in ``init_device_graphs``."""
    return (
        _measure(measure_module, note),
        _dist_init_in_runner(returns_baseline=True),
        *_custom_ar_legacy(),
        _load_weights(),
        _kv_budget_tokens(_MR, "ModelRunner", "total_gpu_memory"),
        _kv_pool(_MR, "ModelRunner", "init_memory_pool", "total_gpu_memory", ("max_total_num_tokens",)),
        _attention("init_attention_backend"),
        _graphs("init_device_graphs", graph_attr),
        _worker_in_tp_worker(),
    )


_LINE_0_5_3 = _line_0_5_1("sglang.srt.utils.common", "utils became a package in 0.5.3; re-exported as sglang.srt.utils")
_LINE_0_5_2 = _line_0_5_1("sglang.srt.utils", "utils.py (a module, not a package, until 0.5.2)")
_LINE_0_5_1 = _line_0_5_1("sglang.srt.utils", "utils.py", graph_attr="cuda_graph_mem_usage")

_LINE_0_4_10: tuple[HookSpec, ...] = (
    _measure("sglang.srt.utils", "utils.py (a module, not a package, in 0.4.x)"),
    _dist_init_in_runner(returns_baseline=True),
    *_custom_ar_legacy(),
    _load_weights(),
    _kv_budget_tokens(_MR, "ModelRunner", "total_gpu_memory"),
    _kv_pool(_MR, "ModelRunner", "init_memory_pool", "total_gpu_memory", ("max_total_num_tokens",)),
    _attention("init_attention_backend"),
    _graphs("init_cuda_graphs", "cuda_graph_mem_usage"),
    _worker_in_tp_worker(),
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
