"""The targets table against the real SGLang wheels, read with ``ast`` (SGLang needs torch and
CUDA to import, so nothing from the wheel is imported here).

Each wheel (0.5.23, 0.5.10, 0.5.7, 0.4.10.post2) is fetched with ``pip download --no-deps`` into
``$MEMREC_WHEEL_CACHE`` or ``~/.cache/memrec-test-wheels``; without network the tests skip and
say so.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import sglang_fakes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
import make_sglang_fixture  # noqa: E402

from memrec.sglang_hooks import targets
from memrec.sglang_hooks.targets import TARGETS
from memrec.sglang_hooks.targets import HookSpec

_sources: dict[str, Path] = {}
_trees: dict[tuple[str, str], tuple[ast.Module, str]] = {}


def _source(line: str) -> Path:
    if line not in _sources:
        try:
            _sources[line] = sglang_fakes.wheel_source(line)
        except sglang_fakes.WheelUnavailable as error:
            pytest.skip(f"real SGLang {targets.WHEELS[line]} wheel unavailable: {error}")
    return _sources[line]


def _tree(line: str, module: str) -> tuple[ast.Module, str]:
    key = (line, module)
    if key not in _trees:
        path = sglang_fakes.module_file(_source(line), module)
        assert path is not None, f"SGLang {targets.WHEELS[line]} has no module {module}"
        text = path.read_text(encoding="utf-8")
        _trees[key] = (ast.parse(text), text)
    return _trees[key]


_params = make_sglang_fixture._params  # (the fixture's *args/**kwargs entries are never read)
_assigned_attrs = make_sglang_fixture._assigned_attrs


_CASES = [pytest.param(line, spec, id=f"{line}:{spec.qualname}") for line, specs in TARGETS.items() for spec in specs]


@pytest.mark.parametrize(("line", "spec"), _CASES)
def test_target_exists_with_the_parameters_the_hook_reads(line: str, spec: HookSpec):
    # GIVEN the real wheel's source of the module the table names
    tree, _ = _tree(line, spec.module)
    # WHEN the function or method is looked up by its qualified name
    node = sglang_fakes.find_def(tree, spec.qualname)
    # THEN it is defined right there (not inherited), ...
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), (
        f"{spec.target} is not defined in SGLang {targets.WHEELS[line]}"
    )
    # ... with every parameter the hook reads, ...
    missing = [p for p in spec.param_names if p not in _params(node)]
    assert not missing, f"{spec.target}: no parameter(s) {missing}; has {_params(node)}"
    # ... a staticmethod exactly when the table says so, ...
    decorators = {ast.unparse(d) for d in node.decorator_list}
    assert ("staticmethod" in decorators) == spec.static, f"{spec.target}: decorators {decorators}"
    # ... and every attribute it reads is assigned in that module (or, for a mixin such as
    # ModelRunnerKVCacheMixin, in the module of the class that mixes it in).
    assigned = _assigned_attrs(tree)
    for other in _subclass_modules(line, spec):
        assigned |= _assigned_attrs(_tree(line, other)[0])
    absent = [a for a in spec.attr_names if a not in assigned]
    assert not absent, f"{spec.target}: attributes {absent} never assigned in {spec.module}"


def _subclass_modules(line: str, spec: HookSpec) -> list[str]:
    """Modules of the line's targets that define a class deriving from ``spec``'s class."""
    if "." not in spec.qualname:
        return []
    cls = spec.qualname.split(".")[0]
    out = []
    for module in sorted(targets.modules(line) - {spec.module}):
        tree, _ = _tree(line, module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).split(".")[-1] == cls for b in node.bases):
                out.append(module)
                break
    return out


@pytest.mark.parametrize("line", list(TARGETS))
def test_every_line_emits_every_phase_of_the_lifecycle(line: str):
    # GIVEN the table of one line
    specs = TARGETS[line]
    # WHEN the markers it emits are collected (a baseline may come from the dist_init result)
    emitted = {s.marker for s in specs if s.marker} | {
        targets.MEMORY_BASELINE for s in specs if s.baseline_from
    }
    # THEN every phase the issue asks for is there
    wanted = {
        targets.DIST_INIT, targets.CUSTOM_AR_INIT, targets.CUSTOM_AR_GRAPH_REGISTER, targets.MEMORY_BASELINE,
        targets.LOAD_WEIGHTS, targets.KV_BUDGET, targets.KV_POOL, targets.ATTENTION_BACKENDS,
        targets.CUDA_GRAPH_CAPTURE, targets.INIT_MODEL_WORKER, targets.GPU_MEMORY_MEASURED,
    }
    assert wanted <= emitted, sorted(wanted - emitted)
    # ... and no target is listed twice
    keys = [s.key for s in specs]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("line", list(TARGETS))
def test_kv_budget_target_holds_the_formula_memrec_rebuilds(line: str):
    # GIVEN the function the kv_budget hook wraps on this line
    spec = next(s for s in TARGETS[line] if s.marker == targets.KV_BUDGET)
    tree, text = _tree(line, spec.module)
    node = sglang_fakes.find_def(tree, spec.qualname)
    body = ast.get_source_segment(text, node)
    # WHEN its body is read
    # THEN it measures available memory itself (the measurement the span captures) and applies
    # rest = available - pre * (1 - mem_fraction_static) with the parameter the hook reads as pre
    assert "get_available_gpu_memory(" in body
    pre_param = spec.params[0][0]
    compact = "".join(body.split())
    assert f"{pre_param}*(1-" in compact and "mem_fraction_static" in compact, body[:400]


@pytest.mark.parametrize(
    ("line", "texts"),
    [
        ("0.5.22", (targets.NO_MEMORY_FOR_KV, targets.NOT_ENOUGH_MEMORY)),
        ("0.5.10", (targets.NOT_ENOUGH_MEMORY,)),
        ("0.5.7", (targets.NOT_ENOUGH_MEMORY,)),
        ("0.4.10", (targets.NOT_ENOUGH_MEMORY,)),
    ],
)
def test_failure_texts_memrec_matches_are_raised_inside_hooked_spans(line: str, texts: tuple[str, ...]):
    # GIVEN the modules of the KV spans (kv_budget, kv_pool) and the pool configurator
    spans = [s for s in TARGETS[line] if s.marker in (targets.KV_BUDGET, targets.KV_POOL)]
    modules = {s.module for s in spans} | {s.module for s in TARGETS[line] if s.contribute}
    if line in ("0.5.10",):
        modules.add("sglang.srt.model_executor.model_runner_kv_cache_mixin")
    if line in ("0.5.22", "0.5.21"):
        modules.add("sglang.srt.model_executor.pool_configurator")
    # WHEN their source is searched
    found = {text: any(text in _tree(line, m)[1] for m in modules) for text in texts}
    # THEN both failure texts are raised there
    assert all(found.values()), found


@pytest.mark.parametrize("line", list(TARGETS))
def test_scheduler_process_title_is_the_one_memrec_parses(line: str):
    # GIVEN the scheduler module
    _, text = _tree(line, "sglang.srt.managers.scheduler")
    # WHEN its setproctitle call is looked for
    # THEN it is "sglang::scheduler" + the rank prefix with spaces turned into underscores
    assert 'setproctitle.setproctitle(f"sglang::scheduler{prefix.replace(\' \', \'_\')}")' in text


def test_plugin_api_memrec_uses_exists_in_0_5_23():
    # GIVEN SGLang 0.5.23's plugin package
    tree, text = _tree("0.5.22", "sglang.srt.plugins.hook_registry")
    _, init_text = _tree("0.5.22", "sglang.srt.plugins")
    # WHEN the registry and the loader are read
    register = sglang_fakes.find_def(tree, "HookRegistry.register")
    hook_type = sglang_fakes.find_def(tree, "HookType")
    # THEN register(target, hook, hook_type) exists, AROUND calls hook(original_fn, *args, **kwargs),
    # and the entry-point group is the one memrec declares
    assert _params(register)[:4] == ["cls", "target", "hook", "hook_type"]
    assert any(isinstance(n, ast.Assign) and n.targets[0].id == "AROUND" for n in hook_type.body)
    assert "return hook(original_fn, *args, **kwargs)" in text
    assert 'GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"' in init_text
    assert "load_plugins()" in _tree("0.5.22", "sglang.srt.managers.scheduler")[1]


@pytest.mark.parametrize("line", list(TARGETS))
def test_get_available_gpu_memory_is_a_local_measure_unless_distributed(line: str):
    # GIVEN get_available_gpu_memory of this line
    spec = next(s for s in TARGETS[line] if s.marker == targets.GPU_MEMORY_MEASURED)
    tree, text = _tree(line, spec.module)
    node = sglang_fakes.find_def(tree, spec.qualname)
    body = ast.get_source_segment(text, node)
    # WHEN its body is read
    # THEN the only collective sits behind `if distributed:` (a hook never passes distributed=True)
    # and the result is GiB (divided by 1 << 30)
    assert "if distributed:" in body
    assert "(1 << 30)" in body
