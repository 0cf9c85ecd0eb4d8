"""memrec: where did each GPU's memory go, when, and who took it.

The public API for programs is the marker client: :func:`mark` and :func:`phase` send phase
markers to a running ``memrec daemon``; they never block, never raise, and do nothing without one.
"""

from __future__ import annotations

from memrec.client import mark
from memrec.client import phase

__version__ = "0.1.0"
__all__ = ["__version__", "mark", "phase"]
