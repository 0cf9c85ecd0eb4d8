"""One size format for the report, the diff and the TUI (``memrec.units.fmt_bytes``)."""

from __future__ import annotations

from memrec.units import fmt_bytes
from tests.utils import GiB
from tests.utils import KiB
from tests.utils import MiB


def test_sizes_read_the_same_everywhere():
    assert fmt_bytes(0) == "0 B" and fmt_bytes(777) == "777 B" and fmt_bytes(1536) == "1.5 KiB"
    assert fmt_bytes(146 * MiB + 100 * KiB) == "146.1 MiB" and fmt_bytes(60 * GiB) == "60.00 GiB"
    assert fmt_bytes(3 * 1024 * GiB // 2) == "1.50 TiB" and fmt_bytes(None) == "-"


def test_signed_deltas():
    assert fmt_bytes(-GiB) == "-1.00 GiB" and fmt_bytes(GiB, signed=True) == "+1.00 GiB"
    assert fmt_bytes(0, signed=True) == "0 B" and fmt_bytes(-2 * MiB, signed=True) == "-2.0 MiB"
