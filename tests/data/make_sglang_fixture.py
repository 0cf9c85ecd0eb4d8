"""Regenerate ``tests/data/sglang_releases.json``: what every SGLang release defines for the hooks.

For every release from 0.4.10 on (``pip index versions sglang``, or the versions given), the
wheel is downloaded (``pip download --no-deps``, cached in ``$MEMREC_WHEEL_CACHE`` or
``~/.cache/memrec-test-wheels``) and read with ``ast`` — nothing from it is imported. Recorded,
for every target of every line of ``memrec.sglang_hooks.targets``:

- ``defs``: where ``module:qualname`` is defined (right there, not inherited or re-exported),
  its parameters and whether it is a ``@staticmethod``;
- ``reexports``: modules that import a target function under the same name (the hooks rebind
  such stale names);
- ``attrs``: which of the attributes the hooks read are assigned in each target module;
- ``bases``: the base classes of the target classes (a mixin's attributes are assigned in the
  class that mixes it in);
- ``facts``: releases with SGLang's plugin loader (``load_plugins()`` called in
  ``run_scheduler_process``) and with the process title memrec parses.

Identical entries of consecutive releases are grouped, so the file stays small. A new SGLang
release is one run away::

    .venv/bin/python tests/data/make_sglang_fixture.py            # every release from 0.4.10
    .venv/bin/python tests/data/make_sglang_fixture.py 0.5.24     # add one release

then ``pytest tests/unit/test_sglang_releases.py`` says which targets it lacks.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent / "unit"))

import sglang_fakes  # noqa: E402

from memrec.sglang_hooks.targets import TARGETS  # noqa: E402
from memrec.sglang_hooks.targets import parse_version  # noqa: E402

OUT = HERE / "sglang_releases.json"
FIRST = (0, 4, 10)
#: Attributes the hooks read from SGLang objects beyond the tables (ranks, see wrappers.ranks).
EXTRA_ATTRS = ("tp_rank", "pp_rank", "dp_rank", "gpu_id", "is_draft_worker")
_PROCTITLE = "setproctitle.setproctitle(f\"sglang::scheduler{prefix.replace(' ', '_')}\")"


def releases_on_index() -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang"],
                          capture_output=True, text=True, check=True, timeout=300)
    found = re.search(r"Available versions: (.*)", proc.stdout)
    assert found, proc.stdout
    versions = [v.strip() for v in found.group(1).split(",")]
    return sorted((v for v in versions if (parse_version(v) or (0, 0, 0)) >= FIRST), key=_order)


def _order(version: str) -> tuple:
    post = re.search(r"post(\d+)", version)
    return (*(parse_version(version) or (0, 0, 0)), int(post.group(1)) if post else -1)


def _params(fn: ast.AST) -> list[str]:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


def _assigned_attrs(tree: ast.Module) -> set[str]:
    """Attributes assigned as ``<x>.attr = ...`` anywhere, plus class-level annotated fields."""
    out = set()
    for node in ast.walk(tree):
        targets_: list = []
        if isinstance(node, ast.Assign):
            targets_ = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets_ = [node.target]
        for target in targets_:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute):
                    out.add(sub.attr)
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    out.add(stmt.target.id)
    return out


def _wanted() -> tuple[set[tuple[str, str]], set[str], set[str]]:
    """(module, qualname) targets, the attributes read, and the target function names."""
    defs, attrs, names = set(), set(EXTRA_ATTRS), set()
    for specs in TARGETS.values():
        for spec in specs:
            defs.add((spec.module, spec.qualname))
            attrs.update(spec.attr_names)
            if "." not in spec.qualname:
                names.add(spec.qualname)
    return defs, attrs, names


def read_release(root: Path) -> dict:
    """The facts of one unpacked release (see the module docstring)."""
    wanted, wanted_attrs, functions = _wanted()
    modules = {m for m, _ in wanted} | {"sglang.srt.managers.scheduler", "sglang.srt.plugins"}
    out: dict = {"defs": {}, "attrs": {}, "bases": {}, "reexports": {}, "facts": []}
    trees: dict[str, ast.Module] = {}
    for module in sorted(modules):
        path = sglang_fakes.module_file(root, module)
        if path is not None:
            text = path.read_text(encoding="utf-8")
            trees[module] = ast.parse(text)
            if module == "sglang.srt.managers.scheduler":
                if _PROCTITLE in text:
                    out["facts"].append("proctitle")
                if "load_plugins()" in text:
                    out["facts"].append("plugins")
    for module, qualname in sorted(wanted):
        tree = trees.get(module)
        node = sglang_fakes.find_def(tree, qualname) if tree is not None else None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = {ast.unparse(d) for d in node.decorator_list}
            out["defs"][f"{module}:{qualname}"] = {"params": _params(node), "static": "staticmethod" in decorators}
    classes = {q.split(".")[0] for _, q in wanted if "." in q}
    for module, tree in trees.items():
        assigned = sorted(_assigned_attrs(tree) & wanted_attrs)
        if assigned:
            out["attrs"][module] = assigned
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name in classes:
                out["bases"][f"{module}:{node.name}"] = [ast.unparse(b).split(".")[-1] for b in node.bases]
    # Stale names the hooks rebind: `from <module> import <function>` in the sglang package.
    for path in sorted((root / "sglang").rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
            if not any(name in text for name in functions):
                continue
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError):
            continue
        importer = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if alias.name in functions and (alias.asname or alias.name) == alias.name:
                        out["reexports"].setdefault(f"{node.module}:{alias.name}", []).append(importer)
    for key in out["reexports"]:
        out["reexports"][key] = len(out["reexports"][key])  # how many importers: the count is enough
    return out


def spans(releases: list[str], order: list[str]) -> list[str]:
    """``["0.5.1", "0.5.1.post1", "0.5.2"]`` → ``["0.5.1..0.5.2"]`` (runs in ``order``)."""
    index = {r: i for i, r in enumerate(order)}
    out: list[list[str]] = []
    for release in sorted(releases, key=index.__getitem__):
        if out and index[out[-1][-1]] + 1 == index[release]:
            out[-1][-1:] = [out[-1][-1], release] if len(out[-1]) == 1 else [release]
        else:
            out.append([release])
    return [r[0] if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in out]


def expand(span_list: list[str], order: list[str]) -> set[str]:
    """The inverse of :func:`spans`."""
    out: set[str] = set()
    for item in span_list:
        first, _, last = item.partition("..")
        i, j = order.index(first), order.index(last or first)
        out.update(order[i : j + 1])
    return out


def group(per_release: dict[str, dict]) -> dict:
    """Turn ``{release: facts}`` into ``{section: {key: [[value, spans], ...]}}``."""
    releases = list(per_release)
    out: dict = {"releases": releases, "defs": {}, "attrs": {}, "bases": {}, "reexports": {}, "facts": {}}
    for section in ("defs", "attrs", "bases", "reexports"):
        keys = sorted({k for facts in per_release.values() for k in facts[section]})
        for key in keys:
            entries: list = []
            for release in releases:
                value = per_release[release][section].get(key)
                if value is None:
                    continue
                for entry in entries:
                    if entry[0] == value:
                        entry[1].append(release)
                        break
                else:
                    entries.append([value, [release]])
            out[section][key] = [[value, spans(rs, releases)] for value, rs in entries]
    for fact in ("plugins", "proctitle"):
        out["facts"][fact] = spans([r for r in releases if fact in per_release[r]["facts"]], releases)
    return out


def dump(data: dict) -> str:
    """JSON with one line per entry: small, and a new release shows as a readable diff."""
    lines = ["{"]
    sections = list(data.items())
    for n, (section, value) in enumerate(sections):
        comma = "," if n < len(sections) - 1 else ""
        if isinstance(value, dict) and value:
            lines.append(f"{json.dumps(section)}: {{")
            items = list(value.items())
            for m, (key, entry) in enumerate(items):
                sep = "," if m < len(items) - 1 else ""
                lines.append(f" {json.dumps(key)}: {json.dumps(entry, separators=(',', ':'))}{sep}")
            lines.append("}" + comma)
        else:
            lines.append(f"{json.dumps(section)}: {json.dumps(value, separators=(',', ':'))}{comma}")
    return "\n".join(lines) + "\n}\n"


def release_table(data: dict) -> str:
    """The per-release table of docs/sglang.md: which function each phase is read from."""
    from memrec.sglang_hooks import targets as t

    columns = [
        ("dist_init", lambda s: s.marker == t.DIST_INIT),
        ("memory_baseline", lambda s: s.marker == t.MEMORY_BASELINE or bool(s.baseline_from)),
        ("kv_budget", lambda s: s.marker == t.KV_BUDGET),
        ("terms read into the spans", lambda s: s.contribute),
        ("kv_pool", lambda s: s.marker == t.KV_POOL),
        ("attention_backends", lambda s: s.marker == t.ATTENTION_BACKENDS),
        ("cuda_graph_capture", lambda s: s.marker == t.CUDA_GRAPH_CAPTURE),
        ("custom AR", lambda s: s.marker == t.CUSTOM_AR_INIT),
        ("init_model_worker", lambda s: s.marker == t.INIT_MODEL_WORKER),
    ]
    releases = data["releases"]
    runs: list[list] = []
    for release in releases:
        line = t.line_for_version(release)
        if runs and runs[-1][0] == line:
            runs[-1][1].append(release)
        else:
            runs.append([line, [release]])
    out = ["| SGLang | line | way in | " + " | ".join(c for c, _ in columns) + " |",
           "|---" * (len(columns) + 3) + "|"]
    for line, members in runs:
        first, last = members[0], members[-1]
        way = "plugin" if line in t.PLUGIN_LINES else "`.pth`"
        cells = []
        for title, wanted in columns:
            specs = [s for s in t.TARGETS[line] if wanted(s)]
            if title == "memory_baseline" and specs and specs[0].baseline_from:
                cells.append("its return value" if specs[0].result else "`self.pre_model_load_memory`")
                continue
            names = [s.qualname if s.qualname.endswith("__init__") else s.qualname.split(".")[-1] for s in specs]
            cells.append(", ".join(f"`{n}`" for n in names) or "—")
        span = first if first == last else f"{first} – {last}"
        out.append(f"| {span} | {line} | {way} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if argv == ["--table"]:
        print(release_table(json.loads(OUT.read_text())), end="")
        return 0
    old = json.loads(OUT.read_text()) if OUT.exists() else None
    versions = argv or releases_on_index()
    if argv and old:  # add to the releases already there
        versions = sorted(set(old["releases"]) | set(argv), key=_order)
    per_release = {}
    for version in versions:
        root = sglang_fakes.release_source(version)
        per_release[version] = read_release(root)
        print(f"{version}: {len(per_release[version]['defs'])} targets defined", file=sys.stderr)
    data = {"generated_by": "tests/data/make_sglang_fixture.py", **group(per_release)}
    OUT.write_text(dump(data))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(versions)} releases)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
