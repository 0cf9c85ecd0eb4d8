"""The house measures of issue 24, re-runnable on any checkout: how a newcomer finds the tree.

Run: ``python tests/house_metrics.py [--root DIR] [--list]`` (DIR defaults to this checkout; point it
at ``git worktree add /tmp/x REV`` to measure another revision). Prints:

- modules: the ``.py`` files of the ``memrec.*`` namespace (memrec/ plus the top-level folders that
  pyproject's ``package-dir`` maps into it), and the loose modules in the package root;
- functions over 80 lines (decorators excluded, the ``def`` line to the last line of the body);
- private reaches across modules: ``obj._name`` where ``obj`` is not ``self``/``cls``/``super()``,
  and ``from x import _name`` of a name that is not itself a module, in shipped code;
- import circles: strongly connected components of memrec's own import graph, imports inside
  functions included (``if TYPE_CHECKING:`` blocks left out: they never run);
- string-key reads: ``x["name"]`` (a string literal, read, not assigned) and ``x.get("name", ...)``
  in the packages that build and read the report, the diff and the exports (:data:`KEY_READERS`);
  they count every such read, whatever ``x`` is: a report dict, a numpy structured array's column
  (``events["pid"]``), the trace header or a marker's values (``--list`` names the keys per module);
- the ``duplicates`` pairs of the tree (the tool's own count line), when the tool is on PATH.

The import graph here is the one ``tests/unit/test_layers.py`` checks the layer table against, so
the measure and the test cannot disagree about what an edge is.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

#: Attribute names with a leading underscore that are public API of the standard library
#: (namedtuple's methods, ``os._exit``, ``sys._getframe``): not a reach into memrec's privates.
STDLIB_PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults", "_exit",
                            "_getframe"}
#: Where the report, the diff and the exports are built and read (issue 24's first point).
KEY_READERS = ("memrec.analysis", "memrec.export", "memrec.tui", "memrec.commands")


def package_dirs(root: Path) -> dict[str, Path]:
    """Import name → source folder, from pyproject's ``package-dir`` table plus ``memrec`` itself."""
    text = (root / "pyproject.toml").read_text()
    section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?:^\[|\Z)", text, re.M | re.S)
    out = {"memrec": root / "memrec"}
    for name, folder in re.findall(r'^"([\w.]+)"\s*=\s*"([\w./-]+)"', section.group(1) if section else "", re.M):
        out[name] = root / folder
    return out


def modules(root: Path) -> dict[str, Path]:
    """Every module of the ``memrec.*`` namespace, by its import name."""
    trees = package_dirs(root)
    out: dict[str, Path] = {}
    for prefix, tree in trees.items():
        for path in sorted(tree.rglob("*.py")):
            parts = [p for p in path.relative_to(tree).with_suffix("").parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            # a folder mapped elsewhere (memrec/tui would shadow tui/) belongs to its own tree
            if any(other != prefix and (name == other or name.startswith(other + "."))
                   for other in trees if other.startswith(prefix + ".")):
                continue
            out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    return {id(n) for top in ast.walk(tree)
            if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
            for n in ast.walk(top)}


def from_base(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` reads from, relative imports resolved against ``package``."""
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
    return base


def imports(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """The modules ``name`` imports (module level and inside functions) → the first line of each.

    ``from pkg import x`` is an edge to ``pkg.x`` when that is a module, else to ``pkg`` itself (the
    name comes from its ``__init__``), so a module reading its own package root is an edge too.
    """
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: dict[str, int] = {}

    def resolve(target: str) -> str:
        while target and target not in known:
            target = target.rsplit(".", 1)[0] if "." in target else ""
        return target

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [resolve(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            for a in node.names:
                full = f"{base}.{a.name}"
                targets.append(full if full in known else resolve(base))
        for t in targets:
            if t and t != name:
                out.setdefault(t, node.lineno)
    return out


def graph(root: Path) -> dict[str, dict[str, int]]:
    mods = modules(root)
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def cycles(g: dict[str, object]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
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
    return sorted(out)


def long_functions(mods: dict[str, Path], limit: int = 80) -> list[tuple[int, str]]:
    out = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append((n, f"{name}.{node.name}"))
    return sorted(out, reverse=True)


def private_reaches(mods: dict[str, Path]) -> list[str]:
    known = set(mods)
    out = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                attr = node.attr
                if not attr.startswith("_") or attr.startswith("__") or attr in STDLIB_PUBLIC_UNDERSCORE:
                    continue
                v = node.value
                if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                    continue
                if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                    continue
                out.append(f"{name}:{node.lineno} .{attr} on {ast.unparse(v)[:40]}")
            elif isinstance(node, ast.ImportFrom):
                base = from_base(node, package)
                for a in node.names:
                    if (a.name.startswith("_") and not a.name.startswith("__") and base != name
                            and f"{base}.{a.name}" not in known):
                        out.append(f"{name}:{node.lineno} from {base} import {a.name}")
    return out


def key_reads(mods: dict[str, Path]) -> dict[str, Counter]:
    """Module (of :data:`KEY_READERS`) -> how often each string key is read there (see the docstring)."""
    out: dict[str, Counter] = {}
    for name, path in mods.items():
        if not any(name == p or name.startswith(p + ".") for p in KEY_READERS):
            continue
        keys: Counter = Counter()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                    and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
                keys[node.slice.value] += 1
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                keys[node.args[0].value] += 1
        if keys:
            out[name] = keys
    return out


def duplicate_pairs(root: Path) -> str:
    tool = shutil.which("duplicates")
    if tool is None:
        return "n/a (no `duplicates` on PATH)"
    run = subprocess.run([tool, "--repo", str(root), "--seconds", "300"], capture_output=True,
                         text=True, check=False)
    lines = run.stdout.splitlines()
    return lines[0] if lines else f"n/a ({run.stderr.strip()[:80]})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--list", action="store_true", help="list every long function, reach and circle")
    parser.add_argument("--no-duplicates", action="store_true", help="skip the (slow) duplicates count")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    mods = modules(root)
    loose = sorted(n for n, p in mods.items() if n.count(".") == 1 and p.parent == root / "memrec"
                   and p.name != "__init__.py")
    longs = long_functions(mods)
    reaches = private_reaches(mods)
    circles = cycles(graph(root))
    keys = key_reads(mods)
    key_total = Counter({p: sum(sum(c.values()) for m, c in keys.items() if m == p or m.startswith(p + "."))
                         for p in KEY_READERS})
    by_package = Counter(r.split(":")[0].rsplit(".", 1)[0] if r.count(".") > 1 else r.split(":")[0]
                         for r in reaches)
    print(f"root: {root}")
    print(f"modules: {len(mods)} (memrec.* namespace); loose in the package root: {len(loose)}: "
          + " ".join(n.split(".", 1)[1] for n in loose))
    print(f"functions over 80 lines: {len(longs)}")
    print(f"private reaches across modules: {len(reaches)} "
          f"({', '.join(f'{k} {v}' for k, v in by_package.most_common(6))})")
    print(f"import circles (function-level imports included): {len(circles)} "
          f"(modules in them: {sum(len(c) for c in circles)})")
    print(f"string-key reads (x['k'], x.get('k')): {sum(key_total.values())} "
          f"({', '.join(f'{k} {v}' for k, v in key_total.most_common())})")
    if not args.no_duplicates:
        print(f"duplicates: {duplicate_pairs(root)}")
    if args.list:
        for n, f in longs:
            print(f"  long {n:4d} {f}")
        for r in reaches:
            print(f"  reach {r}")
        for c in circles:
            print(f"  circle {' '.join(c)}")
        for m, c in sorted(keys.items(), key=lambda mc: -sum(mc[1].values())):
            print(f"  keys {sum(c.values()):4d} {m}: " + " ".join(f"{k}:{n}" for k, n in c.most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
