"""Every SGLang release from 0.4.10 on, against the hooks its version line chooses.

``tests/data/sglang_releases.json`` holds what each release's wheel defines (read with ``ast``
by ``tests/data/make_sglang_fixture.py``; regenerate it for a new release). No download here:
CI covers every release offline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from memrec.sglang_hooks import targets
from memrec.sglang_hooks.targets import TARGETS

DATA = Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(DATA))
import make_sglang_fixture  # noqa: E402

FIXTURE = json.loads((DATA / "sglang_releases.json").read_text())
RELEASES: list[str] = FIXTURE["releases"]

#: The phases every release must get (the distributed one: dist_init and the custom all-reduce).
REQUIRED = {
    targets.DIST_INIT, targets.CUSTOM_AR_INIT, targets.MEMORY_BASELINE, targets.LOAD_WEIGHTS,
    targets.KV_BUDGET, targets.KV_POOL, targets.ATTENTION_BACKENDS, targets.CUDA_GRAPH_CAPTURE,
    targets.INIT_MODEL_WORKER, targets.GPU_MEMORY_MEASURED,
}


def _entry(section: str, key: str, release: str):
    """The fixture's value of ``key`` for ``release`` (None: not there)."""
    for value, spans in FIXTURE[section].get(key, []):
        if release in make_sglang_fixture.expand(spans, RELEASES):
            return value
    return None


def _attrs_seen(spec, release: str) -> set[str]:
    """Attributes assigned in the spec's module, and in the modules of classes deriving from it."""
    seen = set(_entry("attrs", spec.module, release) or ())
    if "." in spec.qualname:
        cls = spec.qualname.split(".")[0]
        for key in FIXTURE["bases"]:
            module, _, _name = key.partition(":")
            if cls in (_entry("bases", key, release) or ()):
                seen |= set(_entry("attrs", module, release) or ())
    return seen


def problems(release: str) -> list[str]:
    """What is wrong with ``release``'s chosen targets (empty: nothing)."""
    line = targets.line_for_version(release)
    out = []
    for spec in TARGETS[line]:
        found = _entry("defs", spec.key, release)
        if found is None and spec.since and make_sglang_fixture._order(release) < make_sglang_fixture._order(spec.since):
            continue  # only the later releases of the line have it
        if found is None:
            out.append(f"{spec.target}: not defined")
            continue
        missing = [p for p in spec.param_names if p not in found["params"]]
        if missing:
            out.append(f"{spec.target}: no parameter(s) {missing}; has {found['params']}")
        if found["static"] != spec.static:
            out.append(f"{spec.target}: staticmethod is {found['static']}, the table says {spec.static}")
        absent = sorted(set(spec.attr_names) - _attrs_seen(spec, release))
        if absent:
            out.append(f"{spec.target}: attributes {absent} never assigned")
    return out


@pytest.mark.parametrize("release", RELEASES)
def test_every_release_gets_its_targets_and_every_phase(release: str):
    # GIVEN a real release and the line memrec picks for it
    line = targets.line_for_version(release)
    # WHEN the line's targets are looked up in what the release's wheel defines
    # THEN each is defined right there, with the parameters and attributes the hook reads
    assert problems(release) == [], f"SGLang {release} (line {line})"
    # AND the line emits every phase the analysis needs
    specs = TARGETS[line]
    emitted = {s.marker for s in specs if s.marker} | {targets.MEMORY_BASELINE for s in specs if s.baseline_from}
    assert REQUIRED <= emitted, sorted(REQUIRED - emitted)
    assert len({s.key for s in specs}) == len(specs)


def test_the_fixture_covers_every_release_from_0_4_10():
    # GIVEN the releases in the fixture  THEN they start at 0.4.10 and every line has releases
    assert RELEASES[0] == "0.4.10" and "0.5.23" in RELEASES
    assert {targets.line_for_version(r) for r in RELEASES} == set(TARGETS)


def test_the_plugin_is_the_way_in_exactly_where_sglang_loads_plugins():
    # GIVEN the releases whose run_scheduler_process calls load_plugins() (0.5.11+)
    with_plugins = make_sglang_fixture.expand(FIXTURE["facts"]["plugins"], RELEASES)
    # THEN those, and only those, are on plugin lines
    assert with_plugins == {r for r in RELEASES if targets.line_for_version(r) in targets.PLUGIN_LINES}
    assert "0.5.11" in with_plugins and "0.5.10.post1" not in with_plugins


def test_every_release_titles_its_schedulers_the_way_memrec_parses():
    assert make_sglang_fixture.expand(FIXTURE["facts"]["proctitle"], RELEASES) == set(RELEASES)


def test_a_target_marked_since_a_release_is_there_from_that_release_on():
    # GIVEN the targets only the later releases of their line have
    late = [(line, s) for line, specs in TARGETS.items() for s in specs if s.since]
    assert late
    for line, spec in late:
        members = [r for r in RELEASES if targets.line_for_version(r) == line]
        # THEN each is defined from its release on, and missing before it (else `since` is wrong)
        have = [r for r in members if _entry("defs", spec.key, r) is not None]
        order = make_sglang_fixture._order
        expected = [r for r in members if order(r) >= order(spec.since)]
        assert have and have == expected, (line, spec.target)
    # AND `since` names a release where it first appears in some line
    assert all(any(_entry("defs", s.key, s.since) for _, s in late if s.key == spec.key) for _, spec in late)


def test_every_release_imports_the_measuring_function_by_name_so_the_hooks_must_rebind():
    # GIVEN the measuring function each release's line hooks, and the fixture's count of
    # `from X import get_available_gpu_memory` in the sglang package (X its module or a re-export)
    for release in RELEASES:
        spec = next(s for s in TARGETS[targets.line_for_version(release)] if s.marker == targets.GPU_MEMORY_MEASURED)
        importers = sum(_entry("reexports", f"{module}:{spec.qualname}", release) or 0
                        for module in {spec.module, "sglang.srt.utils"})
        # THEN callers hold their own binding: patching the module alone would miss them
        # (patch_target rebinds such names, tested in test_sglang_hooks)
        assert importers > 0, release


def test_a_wrong_table_is_caught():
    # GIVEN 0.5.16, where profile_max_num_token and init_device_graphs are gone, checked with the
    # 0.5.10 line (what memrec used for it before)
    real = targets.line_for_version
    try:
        targets.line_for_version = lambda version: "0.5.10"
        found = problems("0.5.16")
    finally:
        targets.line_for_version = real
    # THEN the missing targets are named
    assert any("profile_max_num_token: not defined" in p for p in found)
    assert any("init_device_graphs: not defined" in p for p in found)


def test_docs_table_is_the_one_the_fixture_gives():
    # GIVEN the per-release table generated from the fixture  WHEN docs/sglang.md is read
    text = (DATA.parents[1] / "docs" / "sglang.md").read_text()
    # THEN it holds that table, as generated (regenerate: make_sglang_fixture.py --table)
    assert make_sglang_fixture.release_table(FIXTURE) in text
