"""The command that installs one of memrec's optional extras into the environment memrec runs from.

``pip install 'memrec[export]'`` is no use to a user: memrec is not on the package index, and the
``pip`` on the shell's PATH is seldom the one of the environment memrec runs from (a clone's
``.venv``, SGLang's environment). So the command named in an error is this interpreter's own pip
(``sys.executable -m pip``) with the extra's packages spelled out from memrec's installed metadata,
and, in a clone set up by ``scripts/setup``, its ``constraints.txt`` for the exact versions the
tests use. Copied as printed, it installs what is missing where memrec looks for it.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

_EXTRA = re.compile(r"""\bextra\s*==\s*["']([^"']+)["']""")


def extra_requirements(extra: str) -> list[str]:
    """The requirement strings of ``memrec[extra]`` (``["pyarrow<27,>=26", ...]``), from the
    installed metadata; empty when memrec's metadata is not installed (a bare source tree)."""
    from importlib import metadata

    try:
        requires = metadata.requires("memrec") or []
    except metadata.PackageNotFoundError:
        return []
    out = []
    for req in requires:
        spec, _, marker = req.partition(";")
        found = _EXTRA.search(marker)
        if found and found.group(1) == extra:
            out.append(spec.strip().replace(" ", ""))
    return out


def _constraints() -> Path | None:
    """``constraints.txt`` of the clone this memrec runs from (an editable install), else None."""
    root = Path(__file__).resolve().parents[2]
    path = root / "constraints.txt"
    return path if path.is_file() and (root / "pyproject.toml").is_file() else None


def install_command(extra: str, modules: tuple[str, ...] = ()) -> str:
    """The shell command that installs ``memrec[extra]``'s packages for this interpreter.

    ``modules``: the import names to ask pip for when the metadata is not installed.
    """
    packages = extra_requirements(extra) or list(modules) or [f"memrec[{extra}]"]
    parts = [sys.executable, "-m", "pip", "install"]
    constraints = _constraints()
    if constraints is not None:
        parts += ["-c", str(constraints)]
    return " ".join(shlex.quote(p) for p in parts + packages)
