"""The layers of docs/architecture.md hold: no import circles, and the replay engine below the tools.

Reads every module's imports from its source (module level and inside functions: a function-level
import that works around a circle is still a circle), resolves them to memrec's own modules and
looks for cycles. ``if TYPE_CHECKING:`` imports are left out (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Where each importable name's source is (the package-dir mapping of pyproject.toml).
TREES = {"memrec": ROOT / "memrec", "memrec.tui": ROOT / "tui", "memrec.daemon": ROOT / "daemon",
         "memrec.probes": ROOT / "probes"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for prefix, tree in TREES.items():
        for path in tree.rglob("*.py"):
            rel = path.relative_to(tree).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if any(name.startswith(other + ".") or name == other for other in TREES if other != prefix
                   and other.startswith(prefix + ".")) or "stubdriver" in name or "gpu" in parts:
                continue
            out[name] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = {id(n) for top in ast.walk(tree) if _type_checking(top) for n in ast.walk(top)}
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name and not name.startswith(t + "."):  # a package's own __init__ is no edge
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def test_the_core_the_engine_and_the_tools_import_no_circle():
    # GIVEN every module of memrec, the daemon, the probes and the TUI, with all their imports
    graph = _graph()
    engine_side = {m: deps for m, deps in graph.items()
                   if m.startswith(("memrec.engine", "memrec.analysis", "memrec.api", "memrec.export", "memrec.ranks"))}
    # THEN the engine, analysis, api and exports form no circle (function-level imports included)
    assert _cycles(engine_side) == []


def test_the_engine_sits_below_analysis_and_the_tui():
    # GIVEN the engine's and the shared terms' imports
    graph = _graph()
    # THEN the engine and memrec.ranks import neither the analysis, nor the api, the exports or the TUI
    for m, deps in graph.items():
        if m.startswith("memrec.engine") or m == "memrec.ranks":
            assert not {d for d in deps if d.startswith(("memrec.analysis", "memrec.tui", "memrec.api", "memrec.export"))}, m
    # THEN the TUI reaches the SGLang report for nothing (rank labels live below both)
    assert "memrec.analysis.sglang.section" not in graph["memrec.tui.model"]
