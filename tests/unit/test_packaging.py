"""The installed package holds every module of the tree.

``pyproject.toml`` lists its packages by hand (``daemon/``, ``probes/``, ``tui/`` ... install as
``memrec.*`` through ``package-dir``). A package folder missing from that list still imports in the
editable checkout the tests run from, and is absent from every wheel and ``pip install .``: the
daemon on a GPU host then fails at its first import. This test walks the tree instead.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _source_dir(package: str, mapping: dict[str, str]) -> Path:
    for name, folder in sorted(mapping.items(), key=lambda kv: -len(kv[0])):
        if package == name or package.startswith(name + "."):
            rest = package[len(name) :].lstrip(".")
            return ROOT / folder / Path(*rest.split(".")) if rest else ROOT / folder
    return ROOT / Path(*package.split("."))


def test_every_package_folder_of_the_tree_is_in_the_wheel() -> None:
    # GIVEN the packages pyproject.toml installs and the folders they come from
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    mapping = conf.get("package-dir", {})
    roots = {name: _source_dir(name, mapping) for name in listed if "." not in name or name in mapping}
    # WHEN every folder with an __init__.py below those roots is named as a package
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    # THEN each one is installed, and each listed package exists
    assert found - listed == set(), f"package folders missing from pyproject.toml: {sorted(found - listed)}"
    # (a data folder, no Python in it, is listed with its files in package-data instead)
    data = set(conf.get("package-data", {}))
    missing = {p for p in listed if not (_source_dir(p, mapping) / "__init__.py").is_file()
               and not (p in data and _source_dir(p, mapping).is_dir())}
    assert missing == set(), f"listed packages without a folder: {sorted(missing)}"
