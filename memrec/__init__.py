"""memrec: where did each GPU's memory go, when, and who took it.

The public API for programs is the marker client: :func:`mark` and :func:`phase` send phase
markers to a running ``memrec daemon``; they never block, never raise, and do nothing without one.
For reading a trace in Python (notebooks, pandas): :func:`load` (docs/python-api.md); it imports
numpy and the analysis only when called, so a program that only marks phases never pays for them.
"""

from __future__ import annotations

import os
#: typing.TYPE_CHECKING without importing typing (type checkers take this spelling too): the quick
#: commands (`memrec mark`, `--help`) import this package, and typing costs them milliseconds.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from memrec.api import Recording
    from memrec.client import mark
    from memrec.client import phase

from memrec.base.version import __version__
__all__ = ["__version__", "load", "mark", "phase"]


def load(path: str | os.PathLike, pandas: bool | None = None) -> Recording:
    """Read a ``.mrec`` trace as tables: see :func:`memrec.api.load`."""
    from memrec.api import load as _load

    return _load(path, pandas=pandas)


def __getattr__(name: str):
    """``memrec.mark`` and ``memrec.phase`` on first use: the command line (``memrec --help``)
    imports this package too, and need not pay for the client's socket and msgpack."""
    if name in ("mark", "phase"):
        from memrec import client

        return getattr(client, name)
    raise AttributeError(f"module 'memrec' has no attribute {name!r}")
