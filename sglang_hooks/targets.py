"""The SGLang functions memrec hooks, per SGLang version line, and what each hook records.

This module is pure data (stdlib only, no SGLang, no torch): the plugin (0.5.23+), the ``.pth``
bootstrap (0.4.10 – 0.5.22) and the tests all read the same table. ``tests/unit/test_sglang_targets.py``
checks every row against the real wheel's source with ``ast``: the module, the class and the
function exist, the parameters a hook reads are in the signature, the attributes it reads after
the call are assigned somewhere in that module, and ``static`` matches a ``@staticmethod``.

Units: SGLang's memory numbers are GiB floats (``free_bytes / (1 << 30)``) that its logs label
"GB". Values keep SGLang's names and units; memrec's own additions end in ``_bytes`` (bytes) or
``_gib`` (GiB).

Line numbers in the notes are those of the wheel named by the line (``pip download --no-deps
sglang==VERSION``); see ``shared/research/sglang.md`` for the lifecycle they belong to.
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
LINES = ("0.5.23", "0.5.10", "0.5.7", "0.4.10")


@dataclass(frozen=True)
class HookSpec:
    """One hooked SGLang function and what its hook records.

    Attributes:
        module: the module that defines it (where the hook patches it).
        qualname: ``function`` or ``Class.method`` inside ``module``.
        hook: ``before`` | ``after`` | ``around`` (see :data:`HOOK_TYPES`).
        marker: the marker name; None for a hook that only adds values to the enclosing span.
        params: ``(parameter, value key)`` pairs read from the call's arguments (at begin).
        attrs_before: ``(attribute of self, value key)`` read before the call.
        attrs_after: ``(attribute of self, value key)`` read after the call.
        result: value key for the return value (None: not recorded).
        extras: extractor names (:data:`EXTRAS`).
        static: the target is a ``@staticmethod`` (the patch keeps it one).
        capture_measurement: a span that records the first ``get_available_gpu_memory`` result
            taken inside it as ``available_gpu_memory`` (GiB).
        contribute: the values go into the innermost open span's end marker (as well as this
            hook's own marker, if it has one).
        baseline_from_result: also emit an instant ``memory_baseline`` marker carrying the
            result as ``pre_model_load_memory`` (older lines, where the baseline is the return
            value of ``init_torch_distributed``).
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
    extras: tuple[str, ...] = ()
    static: bool = False
    capture_measurement: bool = False
    contribute: bool = False
    baseline_from_result: bool = False
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
        """The attributes of ``self`` the hook reads (before and after the call)."""
        return tuple(name for name, _ in self.attrs_before + self.attrs_after)


def _p(*names: str, **renamed: str) -> tuple[tuple[str, str], ...]:
    """Parameter (or attribute) pairs: ``_p("a", b="key")`` → ``(("a", "a"), ("b", "key"))``."""
    return tuple((n, n) for n in names) + tuple(renamed.items())


# -- building blocks shared by several lines ---------------------------------------------------

_MEASURE_PARAMS = _p("device", "gpu_id", "distributed", "empty_cache")


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


_CAR = "sglang.srt.distributed.device_communicators.custom_all_reduce"
_CAR_V2 = "sglang.srt.distributed.device_communicators.custom_all_reduce_v2"
_MR = "sglang.srt.model_executor.model_runner"
_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin"
_SCHED = "sglang.srt.managers.scheduler"
_CAR_AFTER = _p("max_size", "world_size", "rank", "full_nvlink", "disabled")


def _custom_ar_legacy(line_note: str) -> tuple[HookSpec, ...]:
    return (
        HookSpec(
            _CAR,
            "CustomAllreduce.__init__",
            "around",
            CUSTOM_AR_INIT,
            params=_p("max_size"),
            attrs_after=_CAR_AFTER,
            extras=("class_name",),
            note=f"legacy custom all-reduce: cudaMalloc + cudaIpcGetMemHandle/OpenMemHandle per peer ({line_note})",
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


def _model_runner_common(
    *, kv_param: str, graphs: str, graph_attr: str, attention: str, mixin: bool, pool_attrs: tuple[str, ...]
) -> tuple[HookSpec, ...]:
    """Hooks of the 0.4.10 – 0.5.10 ModelRunner (KV methods on the mixin from 0.5.7)."""
    kv_module, kv_class = (_MIXIN, "ModelRunnerKVCacheMixin") if mixin else (_MR, "ModelRunner")
    rank_attrs = _p("gpu_id", "tp_rank", "pp_rank", "is_draft_worker")
    specs = [
        HookSpec(
            _MR,
            "ModelRunner.init_torch_distributed",
            "around",
            DIST_INIT,
            attrs_before=rank_attrs,
            result="pre_model_load_memory",
            extras=("parallel_config",),
            baseline_from_result=True,
            note="NCCL/gloo groups and the custom all-reduce are built here; returns the WORLD-MIN "
            "free GiB measured after them (min_per_gpu_memory / pre_model_load_memory)",
        ),
        HookSpec(
            _MR,
            "ModelRunner.load_model",
            "around",
            LOAD_WEIGHTS,
            attrs_before=rank_attrs,
            attrs_after=_p("weight_load_mem_usage"),
            note="weights; SGLang stores weight_load_mem_usage (GiB) = free before − free after",
        ),
        HookSpec(
            kv_module,
            f"{kv_class}.profile_max_num_token",
            "around",
            KV_BUDGET,
            params=((kv_param, "pre_model_load_memory"),),
            attrs_before=_p("gpu_id", "is_draft_worker", "mem_fraction_static"),
            result="max_num_token",
            capture_measurement=True,
            note="rest_memory = available − pre_model_load_memory × (1 − mem_fraction_static); "
            "returns int(rest_memory × 2**30) // cell_size (profiled tokens, before caps)",
        ),
        HookSpec(
            kv_module,
            f"{kv_class}.init_memory_pool",
            "around",
            KV_POOL,
            params=((kv_param, "pre_model_load_memory"),),
            attrs_before=_p("gpu_id", "is_draft_worker"),
            attrs_after=_p(*pool_attrs),
            note="caps, page alignment, PP MIN; raises RuntimeError 'Not enough memory...' when "
            "max_total_num_tokens <= 0; allocates the pools",
        ),
        HookSpec(
            _MR,
            f"ModelRunner.{attention}",
            "around",
            ATTENTION_BACKENDS,
            attrs_before=_p("gpu_id"),
            note="attention backend workspaces (FlashInfer float workspace)",
        ),
        HookSpec(
            _MR,
            f"ModelRunner.{graphs}",
            "around",
            CUDA_GRAPH_CAPTURE,
            attrs_before=_p("gpu_id"),
            attrs_after=((graph_attr, "graph_memory_usage"),),
            note=f"CUDA graph capture; SGLang stores {graph_attr} (GiB)",
        ),
    ]
    if mixin:
        specs.append(
            HookSpec(
                _MIXIN,
                "ModelRunnerKVCacheMixin.get_cell_size_per_token",
                "after",
                None,
                params=_p("num_layers"),
                result="cell_size",
                contribute=True,
                note="bytes of KV cache per token (all layers); read into the kv_budget span",
            )
        )
    return tuple(specs)


# -- the lines ---------------------------------------------------------------------------------

_LINE_0_5_23: tuple[HookSpec, ...] = (
    _measure("sglang.srt.utils.common", "utils/common.py:427, re-exported as sglang.srt.utils"),
    HookSpec(
        "sglang.srt.distributed.bootstrap",
        "init_parallel_runtime",
        "around",
        DIST_INIT,
        params=_p("device", "dist_port"),
        extras=("parallel_config",),
        note="bootstrap.py:90: set_device, NCCL/gloo groups, custom all-reduce, NCCL prewarm",
    ),
    *_custom_ar_legacy("0.5.23 custom_all_reduce.py:51"),
    HookSpec(
        _CAR_V2,
        "CustomAllReduceV2.__init__",
        "around",
        CUSTOM_AR_INIT,
        params=_p("max_size"),
        attrs_after=_p("max_size", "max_push_size", "max_pull_size", "world_size", "rank", "disabled"),
        extras=("class_name",),
        note="custom_all_reduce_v2.py:110: symmetric memory (cuMemCreate/cuMemMap + shareable "
        "handles), the default on CUDA (SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2)",
    ),
    HookSpec(
        _CAR_V2,
        "CustomAllReduceV2._init_workspace",
        "after",
        CUSTOM_AR_WORKSPACE,
        attrs_after=_p("max_size", "max_push_size", "max_pull_size"),
        note="custom_all_reduce_v2.py:265: (re)allocates the symmetric workspace "
        "(also from reserve_push_capacity)",
    ),
    HookSpec(
        _CAR_V2,
        "CustomAllReduceV2._register_graph_inputs_ipc",
        "around",
        CUSTOM_AR_GRAPH_REGISTER,
        extras=("class_name",),
        note="custom_all_reduce_v2.py:522: IPC-opens captured graph inputs after capture",
    ),
    HookSpec(
        "sglang.srt.distributed.bootstrap",
        "measure_pre_model_load_memory",
        "around",
        MEMORY_BASELINE,
        params=_p("device", "is_draft_worker"),
        result="pre_model_load_memory",
        note="bootstrap.py:193: WORLD-MIN free GiB after distributed init (local only for a draft)",
    ),
    HookSpec(
        _MR,
        "ModelRunner.load_model",
        "around",
        LOAD_WEIGHTS,
        attrs_before=_p("gpu_id", "is_draft_worker"),
        attrs_after=_p("weight_load_mem_usage"),
        note="model_runner.py:1270; weight_load_mem_usage (GiB) = free before − free after",
    ),
    HookSpec(
        "sglang.srt.mem_cache.kv_cache_configurator",
        "KVCacheConfigurator._profile_available_bytes",
        "around",
        KV_BUDGET,
        params=_p("pre_model_load_memory"),
        attrs_before=_p("gpu_id", "is_draft_worker"),
        result="rest_memory_bytes",
        extras=("mem_fraction_static",),
        capture_measurement=True,
        note="kv_cache_configurator.py:2990: rest = available − pre × (1 − mem_fraction_static) "
        "(− multimodal reservation, mamba); raises ValueError 'Loaded weights leave no GPU "
        "memory...' when rest <= 0; returns int(rest × 2**30) bytes",
    ),
    HookSpec(
        "sglang.srt.model_executor.pool_configurator",
        "DefaultPoolConfigurator.calculate_pool_sizes",
        "after",
        None,
        params=_p("available_bytes", "page_size"),
        attrs_before=(("_cell_size", "cell_size"),),
        contribute=True,
        note="pool_configurator.py:637: max_tokens = available_bytes // cell_size (MHA/MLA/DSA); "
        "MemoryPoolConfig.__post_init__ raises 'Not enough memory...' when it is <= 0",
    ),
    HookSpec(
        _MR,
        "ModelRunner.alloc_memory_pool",
        "around",
        KV_POOL,
        attrs_before=_p("gpu_id", "is_draft_worker", "pre_model_load_memory"),
        attrs_after=_p("max_total_num_tokens", "max_running_requests"),
        note="model_runner.py:971: KVCacheConfigurator.configure → pools",
    ),
    HookSpec(
        _MR,
        "ModelRunner.init_attention_backends",
        "around",
        ATTENTION_BACKENDS,
        attrs_before=_p("gpu_id"),
        note="model_runner.py:1105",
    ),
    HookSpec(
        _MR,
        "ModelRunner.init_cuda_graphs",
        "around",
        CUDA_GRAPH_CAPTURE,
        params=_p("capture_decode_cuda_graph"),
        attrs_before=_p("gpu_id"),
        attrs_after=_p("graph_memory_usage"),
        note="model_runner.py:1170; graph_memory_usage is a dict {phase: GiB}",
    ),
    HookSpec(
        _SCHED,
        "Scheduler.init_model_worker",
        "around",
        INIT_MODEL_WORKER,
        note="scheduler.py:1128: target + draft workers, pools, backends, graphs",
    ),
)

_LINE_0_5_10: tuple[HookSpec, ...] = (
    _measure("sglang.srt.utils.common", "utils/common.py:498"),
    *_custom_ar_legacy("0.5.10 custom_all_reduce.py:47"),
    HookSpec(
        _CAR_V2,
        "CustomAllReduceV2.__init__",
        "around",
        CUSTOM_AR_INIT,
        params=_p("max_pull_size", "max_push_size"),
        attrs_after=_p("world_size", "rank", "disabled"),
        extras=("class_name",),
        note="custom_all_reduce_v2.py:32: JIT all-reduce, opt-in (SGLANG_USE_JIT_ALL_REDUCE=1)",
    ),
    *_model_runner_common(
        kv_param="pre_model_load_memory",
        graphs="init_device_graphs",
        graph_attr="graph_mem_usage",
        attention="init_attention_backend",
        mixin=True,
        pool_attrs=("max_total_num_tokens", "max_running_requests"),
    ),
    HookSpec(
        _SCHED,
        "Scheduler.init_model_worker",
        "around",
        INIT_MODEL_WORKER,
        attrs_before=_p("gpu_id", "tp_rank", "pp_rank", "dp_rank"),
        note="scheduler.py:631",
    ),
)

_LINE_0_5_7: tuple[HookSpec, ...] = (
    _measure("sglang.srt.utils.common", "utils/common.py:479"),
    *_custom_ar_legacy("0.5.7 custom_all_reduce.py:52"),
    *_model_runner_common(
        kv_param="total_gpu_memory",
        graphs="init_device_graphs",
        graph_attr="graph_mem_usage",
        attention="init_attention_backend",
        mixin=True,
        pool_attrs=("max_total_num_tokens", "max_running_requests"),
    ),
    HookSpec(
        _SCHED,
        "Scheduler.init_model_worker",
        "around",
        INIT_MODEL_WORKER,
        attrs_before=_p("gpu_id", "tp_rank", "pp_rank", "dp_rank"),
        note="scheduler.py:468",
    ),
)

_LINE_0_4_10: tuple[HookSpec, ...] = (
    _measure("sglang.srt.utils", "utils.py:357 (utils is a module, not a package, in 0.4.x)"),
    *_custom_ar_legacy("0.4.10 custom_all_reduce.py:66"),
    *_model_runner_common(
        kv_param="total_gpu_memory",
        graphs="init_cuda_graphs",
        graph_attr="cuda_graph_mem_usage",
        attention="init_attention_backend",
        mixin=False,
        pool_attrs=("max_total_num_tokens",),  # 0.4.x keeps max_num_reqs local
    ),
    HookSpec(
        "sglang.srt.managers.tp_worker",
        "TpModelWorker.__init__",
        "around",
        INIT_MODEL_WORKER,
        params=_p("gpu_id", "tp_rank", "pp_rank", "dp_rank", "is_draft_worker"),
        note="tp_worker.py:54 (0.4.x has no Scheduler.init_model_worker): builds the ModelRunner",
    ),
)

#: Every line's hooks.
TARGETS: dict[str, tuple[HookSpec, ...]] = {
    "0.5.23": _LINE_0_5_23,
    "0.5.10": _LINE_0_5_10,
    "0.5.7": _LINE_0_5_7,
    "0.4.10": _LINE_0_4_10,
}

#: The exact wheels each line was read from (the test fetches these).
WHEELS: dict[str, str] = {
    "0.5.23": "0.5.23",
    "0.5.10": "0.5.10",
    "0.5.7": "0.5.7",
    "0.4.10": "0.4.10.post2",
}

#: Lines that have SGLang's plugin system (entry-point group ``sglang.srt.plugins``).
PLUGIN_LINES = frozenset({"0.5.23"})

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
            reads += [f"[{e}]" for e in spec.extras]
            rows.append(
                TargetRow(line, spec.target, spec.hook, spec.marker or "(into span)", ", ".join(reads), spec.note)
            )
    return rows
