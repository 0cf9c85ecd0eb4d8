"""What one SGLang hook is (:class:`HookSpec`) and the markers hooks send: the vocabulary the
targets table (:mod:`memrec.sglang_hooks.targets`) is written in. Stdlib only."""

from __future__ import annotations

from dataclasses import dataclass

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

#: Extractors (named in HookSpec.extras) implemented in values.py.
#: - ``caller``: the function that called the hooked one (skipping hook frames): ``caller``,
#:   ``caller_module``.
#: - ``parallel_config``: sizes and flags from SGLang's runtime context (0.5.23) or
#:   ``server_args`` (older): ``tp_size``, ``pp_size``, ``dp_size``, ``mem_fraction_static``,
#:   ``disable_custom_all_reduce``.
#: - ``mem_fraction_static``: ``self.mem_fraction_static`` or, on 0.5.23, the runtime context's
#:   ``get_schedule().mem_fraction_static``.
#: - ``class_name``: ``custom_ar_class`` = the class of ``self`` (which custom all-reduce was built).
EXTRAS = ("caller", "parallel_config", "mem_fraction_static", "class_name")

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


def pairs(*names: str, **renamed: str) -> tuple[tuple[str, str], ...]:
    """Parameter (or attribute) pairs: ``pairs("a", b="key")`` → ``(("a", "a"), ("b", "key"))``."""
    return tuple((n, n) for n in names) + tuple(renamed.items())
