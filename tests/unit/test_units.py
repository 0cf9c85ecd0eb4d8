"""One size format for the report, the diff and the TUI (``memrec.terms.units.fmt_bytes``)."""

from __future__ import annotations

import pytest

from memrec.terms.units import fmt_bytes
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


def test_one_size_parser_reads_what_fmt_bytes_writes():
    # GIVEN sizes as every command writes them, WHEN read back, THEN they give the bytes again
    from memrec.terms.units import parse_size

    for n in (0, 777, 512 * MiB, 60 * GiB, 3 * GiB // 2):
        assert parse_size(fmt_bytes(n)) == n
    # AND the daemon's options and the TUI's filter read the same spellings with the same parser
    from daemon.config import byte_size
    from memrec.tui.filters import parse_filter

    assert byte_size is parse_size
    for text, value in (("512M", 512 * MiB), ("1g", GiB), ("1.5GiB", 3 * GiB // 2), ("2KB", 2 * KiB)):
        assert parse_size(text) == value == parse_filter(f"size>={text}").min_size


def test_durations():
    from memrec.terms.units import fmt_dur

    assert [fmt_dur(n) for n in (850, 12_300_000, 4_200_000_000, 185e9, 7380e9)] == ["850ns", "12.3ms", "4.20s", "3m05s", "2h03m"]
    assert fmt_dur(-1_500_000) == "-1.5ms"


def test_a_size_past_what_a_trace_holds_is_a_usage_error_not_a_crash():
    # GIVEN sizes a user may mistype: more digits than a float holds, or past int64 (8 EiB)
    from memrec.terms.units import parse_size

    for text in ("9" * 400, "99999999999999999999999", "9000000P", 1 << 63):
        # THEN each is a ValueError with the text in it (argparse prints it as one line)
        with pytest.raises(ValueError, match="8 EiB"):
            parse_size(text)
    # AND 8 EiB less a byte still reads
    assert parse_size(str((1 << 63) - 1024)) == (1 << 63) - 1024


def test_the_daemon_refuses_a_huge_rotate_size_before_it_starts(capsys):
    # GIVEN `memrec daemon --rotate-size` with 400 digits (a traceback once) or 1e23 bytes (once
    # accepted, then a crash writing the trace's header after the probes were attached)
    from memrec import commands

    for size in ("9" * 400, "99999999999999999999999"):
        with pytest.raises(SystemExit) as done:
            commands.main(["daemon", "--rotate-size", size, "-o", "/nonexistent/x.mrec"])
        # THEN it is argparse's usage error, one line naming the option
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert "argument --rotate-size: not a byte size" in err and "Traceback" not in err


def test_a_size_of_uint64_max_is_unlimited_not_16_million_tib():
    # GIVEN the size a pool attribute carries for "no limit" (cuMemPoolSetAttribute, UINT64_MAX)
    # WHEN it is shown (the TUI's events table, the report)  THEN as the driver means it
    assert fmt_bytes(2**64 - 1) == "unlimited"
    assert fmt_bytes(2**64 - 2) == "16777216.00 TiB" and fmt_bytes(60 << 30) == "60.00 GiB"
