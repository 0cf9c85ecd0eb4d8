"""The layers of docs/architecture.md hold over the whole import graph: no circle, nothing upward.

The graph is every module of the ``memrec.*`` namespace (memrec/ and the top-level folders that
pyproject's ``package-dir`` maps into it: daemon/, probes/, tui/, sglang_hooks/, contrib/), with
every import read from the source: module level and inside functions (a function-level import that
works around a circle is still a circle). ``if TYPE_CHECKING:`` imports are left out (they never
run). ``tests/house_metrics.py`` builds the graph; its circle count is the one this file asserts.

:data:`LAYERS` is the documented table, top first. A module belongs to the entry with the longest
matching prefix (``memrec`` is the package root's ``__init__`` alone); it may import its own unit (cycle-checked) and any unit of a lower layer, never a
unit of its own layer or of a higher one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.house_metrics import cycles
from tests.house_metrics import graph

ROOT = Path(__file__).resolve().parents[2]

#: The layers, top first: each a list of units (a module, or a package and all below it).
#: docs/architecture.md ("Layers") draws the same table.
LAYERS: list[tuple[str, list[str]]] = [
    ("entry points", ["memrec.__main__", "memrec.tui.__main__"]),
    ("the command line", ["memrec.commands"]),
    ("tools and validation", ["memrec.tui", "memrec.daemon", "memrec.sglang_hooks", "memrec.contrib",
                              "memrec.validation"]),
    ("public API", ["memrec"]),
    ("exports and subscribers", ["memrec.export", "memrec.subscriber", "memrec.build_info"]),
    ("recordings", ["memrec.api"]),
    ("analysis", ["memrec.analysis"]),
    ("the replay engine", ["memrec.engine"]),
    ("the live state", ["memrec.state"]),
    ("the probes", ["memrec.probes"]),
    ("the trace file", ["memrec.trace"]),
    ("the marker client", ["memrec.client"]),
    ("shared terms", ["memrec.terms.protocol", "memrec.terms.columns", "memrec.terms.ranks", "memrec.terms.units"]),
    ("event vocabulary", ["memrec.terms"]),
    ("leaf helpers", ["memrec.base"]),
]


def unit_of(module: str, layers: list[tuple[str, list[str]]]) -> tuple[int, str] | None:
    """(layer index, unit) of ``module``: the longest unit that is the module or a package above it."""
    best = None
    for level, (_, units) in enumerate(layers):
        for unit in units:
            # "memrec" is the package root's __init__ alone, not everything below it
            below = unit != "memrec" and module.startswith(unit + ".")
            if (module == unit or below) and (best is None or len(unit) > len(best[1])):
                best = (level, unit)
    return best


def violations(g: dict[str, dict[str, int]], layers: list[tuple[str, list[str]]]) -> list[str]:
    """Every module without a layer, and every import that is not downward (or within a unit)."""
    out = []
    for module, deps in sorted(g.items()):
        here = unit_of(module, layers)
        if here is None:
            out.append(f"{module}: in no layer of LAYERS")
            continue
        for dep, line in sorted(deps.items()):
            there = unit_of(dep, layers)
            if there is None or there[1] == here[1]:
                continue
            if there[0] <= here[0]:
                out.append(f"{module}:{line} imports {dep} ({layers[there[0]][0]}), which is not below "
                           f"{layers[here[0]][0]}")
    return out


def test_the_whole_import_graph_has_no_circle():
    # GIVEN every module of the memrec.* namespace (sglang_hooks, daemon, probes, tui included),
    # with every import, those inside functions too
    g = graph(ROOT)
    assert {"memrec.sglang_hooks.wrappers", "memrec.daemon.server", "memrec.tui.app", "memrec.probes.cuda",
            "memrec.state.live", "memrec.trace.reader"} <= set(g)
    # THEN no module reaches itself through its imports
    assert cycles(g) == []


def test_every_module_sits_in_a_layer_and_imports_only_below_it():
    # GIVEN the whole graph and the documented layer table
    # THEN every module is in a layer and every import goes to its own unit or a lower layer
    assert violations(graph(ROOT), LAYERS) == []


def test_the_layer_table_is_the_one_the_architecture_page_draws():
    # GIVEN docs/architecture.md
    text = (ROOT / "docs" / "architecture.md").read_text()
    # THEN it names every layer of the table, in this order
    where = [text.find(f"**{name}**") for name, _ in LAYERS]
    assert -1 not in where, [name for (name, _), w in zip(LAYERS, where) if w == -1]
    assert where == sorted(where)


def _fake_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"memrec.hooks" = "hooks"\n')
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("where", ["module level", "inside a function", "through a package-dir folder"])
def test_a_circle_is_found_wherever_its_import_is(tmp_path, where):
    # GIVEN a tiny package whose two modules import each other, one of the imports written
    # at module level, inside a function, or in a folder mapped by package-dir
    other = "memrec.hooks.b" if where == "through a package-dir folder" else "memrec.b"
    back = ("def f():\n    from memrec import a\n" if where == "inside a function" else "from memrec import a\n")
    files = {"memrec/__init__.py": "", "memrec/a.py": f"import {other}\n", "hooks/__init__.py": ""}
    files["hooks/b.py" if other == "memrec.hooks.b" else "memrec/b.py"] = back
    root = _fake_tree(tmp_path, files)
    # WHEN the graph is read THEN the circle is reported
    assert cycles(graph(root)) == [sorted(["memrec.a", other])]


def test_a_type_checking_import_is_no_circle(tmp_path):
    # GIVEN two modules that import each other, one only for the type checker
    root = _fake_tree(tmp_path, {"memrec/__init__.py": "", "hooks/__init__.py": "", "memrec/a.py": "import memrec.b\n",
                                 "memrec/b.py": "TYPE_CHECKING = False\nif TYPE_CHECKING:\n    import memrec.a\n"})
    # THEN there is no circle
    assert cycles(graph(root)) == []


def test_an_upward_or_sideways_import_breaks_the_table(tmp_path):
    # GIVEN a low module that imports a high one, and two units of one layer that import each other
    root = _fake_tree(tmp_path, {"memrec/__init__.py": "", "hooks/__init__.py": "",
                                 "memrec/low.py": "def f():\n    import memrec.high\n", "memrec/high.py": "",
                                 "memrec/left.py": "import memrec.right\n", "memrec/right.py": ""})
    layers = [("top", ["memrec.high"]), ("middle", ["memrec.left", "memrec.right", "memrec.hooks"]),
              ("bottom", ["memrec.low", "memrec"])]
    # THEN both imports are named, and a module outside the table too
    found = violations(graph(root), layers)
    assert any(v.startswith("memrec.low:2 imports memrec.high") for v in found), found
    assert any(v.startswith("memrec.left:1 imports memrec.right") for v in found), found
    assert "memrec.high: in no layer of LAYERS" in violations(graph(root), layers[1:])


#: The folders a path on the architecture page starts from (the repository's own).
TOP = ("memrec/", "daemon/", "probes/", "tui/", "sglang_hooks/", "contrib/", "tests/", "bench/", "docs/",
       "scripts/", "examples/")


def named_paths(text: str) -> set[str]:
    """Every repository path ``text`` names: a word starting with one of :data:`TOP`."""
    import re

    found = set()
    for m in re.finditer(r"(?<![\w./-])(?:" + "|".join(re.escape(t) for t in TOP) + r")[\w./-]*", text):
        found.add(m.group(0).rstrip(".,:;)"))
    return found


def test_every_path_the_architecture_page_names_exists_and_none_points_outside():
    # GIVEN docs/architecture.md
    text = (ROOT / "docs" / "architecture.md").read_text()
    paths = named_paths(text)
    assert len(paths) > 40
    # THEN each path it names exists in the repository
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []
    # AND it points nowhere outside it (no parent folder, no other checkout)
    assert "../" not in text and "/work/" not in text and "steering repo" not in text


def test_the_path_check_finds_a_missing_path():
    # GIVEN a page naming one real path and one that is gone
    paths = named_paths("see `memrec/state/tables.py` and memrec/state/gone.py, or cuMemAlloc/cuMemFree.")
    # THEN both are found, the gone one does not exist, the API pair is no path
    assert paths == {"memrec/state/tables.py", "memrec/state/gone.py"}
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == ["memrec/state/gone.py"]


#: What the analysis layer keeps at its top level: what its families share (docs/architecture.md,
#: "memrec/analysis/"); each family's modules live in its sub-package.
ANALYSIS_SHARED = {"__init__.py", "sections.py", "names.py", "text.py", "merge_text.py"}


def test_analysis_modules_live_in_their_family_s_sub_package():
    # GIVEN memrec/analysis/ (the allocation sites' modules moved into report/ and diff/ on
    # 2026-12-02, as the report's, diff's, SGLang's and the untraced band's had before them)
    top = {p.name for p in (ROOT / "memrec" / "analysis").glob("*.py")}
    # THEN its top level holds only what the families share
    assert top == ANALYSIS_SHARED
    # AND every family module the architecture page names is where it says
    text = (ROOT / "docs" / "architecture.md").read_text()
    for family in ("report", "diff", "sglang", "untraced"):
        modules = {p.name for p in (ROOT / "memrec" / "analysis" / family).glob("*.py")} - {"__init__.py"}
        listed = text[text.index(f"  - `{family}/`:"):]
        listed = listed[:listed.index("\n  - ")]
        assert sorted(m for m in modules if f"`{m}`" not in listed and f"/ `{m}`" not in listed) == [], family
