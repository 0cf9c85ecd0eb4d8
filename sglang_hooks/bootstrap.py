"""The ``.pth`` way in, for SGLang without a plugin system (0.4.10 – 0.5.10).

SGLang starts every worker (schedulers, detokenizer, DP controller) with multiprocessing
``spawn``: a fresh interpreter that runs ``site`` first and inherits the environment. A ``.pth``
file in site-packages therefore reaches every worker. Its one line checks the environment and,
only when memrec is asked for (``MEMREC=1``, or ``MEMREC_SOCKET`` set and ``MEMREC`` unset), imports
this module and calls :func:`install`. Otherwise it costs one ``os.environ`` lookup.

:func:`install` puts an import hook at the front of ``sys.meta_path``. It only looks at the few
module names in the targets table; when one of them has finished executing, the hooks for that
module are applied (:func:`memrec.sglang_hooks.wrappers.patch_target`), so every later
``from X import f`` sees the wrapper, and names imported earlier are rebound.

On an SGLang line with the plugin system (0.5.11+) the bootstrap steps aside when memrec's
entry point will be loaded (see :func:`plugin_will_load`), so targets are never hooked twice.

Set-up: ``python -c "import memrec.sglang_hooks as h; print(h.install_pth())"`` with the Python
that runs SGLang writes ``memrec_sglang.pth`` into its site-packages; ``h.uninstall_pth()``
removes it. (A wheel cannot portably install a top-level ``.pth``, and an editable install
would not run it: the file is written by this explicit step.)
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any
from typing import Callable

from memrec.sglang_hooks.active import is_active
from memrec.sglang_hooks import targets as _targets
from memrec.sglang_hooks.state import STATE

# memrec.sglang_hooks.wrappers is imported only once a watched SGLang module loads: a Python
# process that never imports SGLang pays for the import hook and the targets table only.

log = logging.getLogger("memrec.sglang_hooks")

#: The file :func:`install_pth` writes.
PTH_NAME = "memrec_sglang.pth"

_PTH_CODE = (
    "try:\n"
    " from memrec.sglang_hooks import bootstrap as _memrec_bootstrap\n"
    " _memrec_bootstrap.install()\n"
    "except Exception as _memrec_error:\n"
    " import sys\n"
    " print('memrec: SGLang bootstrap off:', _memrec_error, file=sys.stderr)\n"
)
#: The executable line of the ``.pth`` file: an environment check, then a lazy import.
PTH_LINE = (
    f"import os; exec({_PTH_CODE!r}) "
    "if (os.environ.get('MEMREC') or ('1' if os.environ.get('MEMREC_SOCKET') else '')) == '1' "
    "else None\n"
)


def pth_text() -> str:
    """The whole ``.pth`` file: a comment, then :data:`PTH_LINE`."""
    return (
        "# memrec: SGLang phase markers in every SGLang worker, only when MEMREC=1 (or MEMREC_SOCKET is set).\n"
        "# Written by memrec.sglang_hooks.install_pth(); remove with uninstall_pth().\n" + PTH_LINE
    )


def default_site_dir() -> Path:
    """This interpreter's site-packages (``purelib``)."""
    return Path(sysconfig.get_paths()["purelib"])


def install_pth(site_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write ``memrec_sglang.pth`` into ``site_dir`` (default: this Python's site-packages).

    Returns:
        The path written.

    Raises:
        OSError: the directory is missing or not writable.
    """
    from memrec.base.files import create_file  # (here: the .pth line imports this module in every process)

    directory = Path(site_dir) if site_dir is not None else default_site_dir()
    path = directory / PTH_NAME
    tmp = directory / f".{PTH_NAME}.{os.getpid()}.tmp"
    with create_file(tmp, text=True) as f:  # never through a link planted at the name
        f.write(pth_text())
    os.replace(tmp, path)
    return path


def uninstall_pth(site_dir: str | os.PathLike[str] | None = None) -> bool:
    """Remove ``memrec_sglang.pth`` from ``site_dir``; True when there was one."""
    directory = Path(site_dir) if site_dir is not None else default_site_dir()
    try:
        (directory / PTH_NAME).unlink()
    except FileNotFoundError:
        return False
    return True


# -- which SGLang ------------------------------------------------------------------------------

def sglang_version() -> str | None:
    """The running SGLang's version, without importing anything heavy.

    Looks at SGLang's version modules if loaded, then the installed distribution's metadata,
    then imports ``sglang.version`` (a tiny module). None when none of these answer.
    """
    if STATE.version:
        return STATE.version[0]
    version = None
    for name in ("sglang.version", "sglang._version", "sglang"):
        mod = sys.modules.get(name)
        value = getattr(mod, "__version__", None) if mod is not None else None
        if isinstance(value, str) and value:
            version = value
            break
    if version is None:
        try:
            from importlib.metadata import version as _dist_version

            version = _dist_version("sglang")
        except Exception:
            version = None
    if version is None and "sglang" in sys.modules:
        try:
            import importlib

            version = getattr(importlib.import_module("sglang.version"), "__version__", None)
        except Exception:
            version = None
    STATE.version.append(version)
    return version


def plugin_will_load() -> bool:
    """Whether SGLang's plugin loader will run memrec's entry point in this process.

    True when an entry point ``memrec`` of group ``sglang.srt.plugins`` is installed and
    ``SGLANG_PLUGINS`` (SGLang's allowlist) is unset or names it.
    """
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and "memrec" not in {x.strip() for x in allowed.split(",")}:
        return False
    try:
        from importlib.metadata import entry_points

        eps = entry_points(group="sglang.srt.plugins")
    except Exception:
        return False
    return any(ep.name == "memrec" and ep.value.startswith("memrec.sglang_hooks.plugin") for ep in eps)


def active_line() -> str | None:
    """The targets line this process patches; None when the plugin does the work instead."""
    if STATE.line:
        return STATE.line[0]
    version = sglang_version()
    line = _targets.line_for_version(version)
    if version is None:
        STATE.warn_once(
            "unknown-version",
            "memrec: SGLang version unknown; using the %s targets (missing ones stay off)",
            line,
            level=logging.INFO,
        )
    if line in _targets.PLUGIN_LINES and plugin_will_load():
        log.debug("memrec: SGLang %s has plugins and memrec's entry point: the bootstrap steps aside", version)
        line = None
    STATE.line.append(line)
    return line


# -- the import hook ---------------------------------------------------------------------------


class _LoaderProxy:
    """Wraps a loader so that ``callback(module)`` runs right after the module executed."""

    def __init__(self, loader: Any, callback: Callable[[Any], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # Put the real loader back first: the module must look untouched.
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """A meta-path finder that finds nothing itself: it lets the real finder find a watched
    module and wraps its loader so that ``callback(module)`` runs after the module executed.

    Args:
        watched: module names to watch (every other import costs one set lookup).
        callback: called with each watched module once it is loaded; must not raise.
    """

    def __init__(self, watched: frozenset[str], callback: Callable[[Any], None]) -> None:
        self.watched = watched
        self.callback = callback
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.watched or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                try:
                    spec = find(fullname, path, target)
                except Exception:
                    return None  # let the normal machinery find it (and raise) on its own
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.name = None
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        spec.loader = _LoaderProxy(loader, self.callback)
        return spec


def _on_loaded(module: Any) -> None:
    """Apply the active line's hooks that live in ``module``. Never raises."""
    try:
        from memrec.sglang_hooks import wrappers as _wrappers

        line = active_line()
        if line is None:
            return
        name = getattr(module, "__name__", None)
        for spec in _targets.TARGETS[line]:
            if spec.module == name:
                _wrappers.patch_target(spec, module)
    except Exception as error:
        log.warning("memrec: SGLang bootstrap failed on %s: %s", getattr(module, "__name__", module), error)


def install(force: bool = False) -> bool:
    """Watch SGLang's modules and hook them as they load; True when the hook is in place.

    Does nothing unless memrec is active (:func:`memrec.sglang_hooks.is_active`) or ``force``. Modules already imported are hooked at once. Idempotent.
    """
    if not (force or is_active()):
        return False
    with STATE.install_lock:
        if STATE.finder is not None:
            return True
        watched = _targets.all_modules()
        STATE.finder = PostImportFinder(watched, _on_loaded)
        sys.meta_path.insert(0, STATE.finder)
    for name in sorted(watched & set(sys.modules)):
        _on_loaded(sys.modules[name])
    return True


#: Stop watching imports (hooks already applied stay: they are harmless without a daemon).
uninstall = STATE.uninstall
