"""Exports of a trace to the tools people already use: Perfetto, PyTorch's memory_viz, Parquet and CSV.

Each exporter takes a :class:`memrec.api.Recording` (one replay, shared with ``memrec.load``,
the report and the plot) and writes files; none replays the events itself. Optional packages
(``perfetto``, ``pyarrow``) are imported when an exporter runs; a missing one is named with the
command that installs it where memrec runs (:func:`memrec.base.extras.install_command`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import an optional dependency or raise the one-line error that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        from memrec.base.extras import install_command

        package = module.split(".")[0]
        raise MemrecCommandError(
            f"{purpose} needs the {package} package ({error}): {install_command(extra, (package,))}",
            exit_code=ExitCode.UNAVAILABLE,
        ) from error
