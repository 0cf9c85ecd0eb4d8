"""How much one read of a trace may decode: in proportion to the file's size, with a ceiling.

Compression makes a few bytes stand for many: a chunk of 65,536 events whose columns are all
constant takes 51 bytes (a 14 KB file held 16.7 M events: ``report`` took 1.45 GB), and a
keyframe's state is one Zstandard frame (a 9.6 KB file decompressed to gigabytes). A per-record
limit does not stop many records. So every read of a file (:class:`~memrec.trace.reader.TraceReader`,
hence ``load_trace``, every command, ``memrec.load`` and the TUI's scan) draws from one
:class:`ReadBudget` made by :func:`read_budget` from the file's size:

============================  ===========================  =========  =============================
what                          per byte of file             at least   ceiling
============================  ===========================  =========  =============================
rows of columnar records      :data:`ROWS_PER_BYTE` (8)    256 Ki     :data:`CEILING_ROWS` (2^30)
decompressed bytes            :data:`BYTES_PER_BYTE` (256) 64 MiB     :data:`CEILING_BYTES` (1 TiB)
 of which keyframe states     :data:`STATE_PER_BYTE` (8)   1 MiB      :data:`CEILING_STATE` (64 GiB)
============================  ===========================  =========  =============================

Genuine traces stay below: bench_tui.py's 1M-event traces hold 1.3-1.7 rows and 22-29
decompressed bytes a byte of file, their keyframe states 0.45-0.53, and an hour of NVML samples
of 8 idle GPUs 2.2 rows a byte (2026-12-01); format 2.3's context columns (a pointer from the
last one of its own process) take bench_tui.py's 1M events to 4.0 rows a byte (2.2: 2.1), so
the rows' share went from 4 to 8 a byte (2026-12-02). Rows are what a reader's memory follows (``report``
about 270 bytes a row, ``memrec.load``'s tables 450), so their share is the tightest that leaves
genuine traces a margin: a file of 64 KiB or less gets 256 Ki rows (``report`` 112 MB at most,
``memrec.load`` 160 MB). A state becomes Python objects when read (up to ~70 bytes each for a
byte of empty lists), so states get the smallest share of bytes.

Past the budget a read stops with :class:`OverBudget` (a :class:`TraceFormatError`): the reader
keeps what it read and warns that the rest was skipped and why. A genuine trace larger than the
ceiling (or one compressed beyond these ratios) reads in full with the environment variable
:data:`ENV` set to a factor for every number above (``MEMREC_READ_BUDGET=8``) or to ``unlimited``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.base.errors import TraceFormatError

ROWS_PER_BYTE = 8
BYTES_PER_BYTE = 256
STATE_PER_BYTE = 8
FLOOR_ROWS = 1 << 18
FLOOR_BYTES = 64 << 20
FLOOR_STATE = 1 << 20
CEILING_ROWS = 1 << 30
CEILING_BYTES = 1 << 40
CEILING_STATE = 64 << 30
#: The override: a factor for every budget (``8``, ``0.5``), or ``unlimited``.
ENV = "MEMREC_READ_BUDGET"


class OverBudget(TraceFormatError):
    """A read went past its file's budget (:func:`read_budget`); the message says which and how
    to raise it."""


@dataclasses.dataclass
class ReadBudget:
    """What one read of one file may still decode (see the module docstring). Thread-safe: the
    reader decodes chunks in worker threads."""

    rows: int
    bytes: int
    state: int
    source: str = "the file"
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def state_limit(self) -> int:
        """The most bytes the next keyframe state may decompress to (what is left of both)."""
        return max(0, min(self.state, self.bytes))

    def spend(self, *, rows: int = 0, nbytes: int = 0, state: int = 0) -> None:
        """Take ``rows`` rows and ``nbytes`` decompressed bytes (``state`` of them a keyframe's).

        Raises:
            OverBudget: more than is left; nothing is taken.
        """
        with self._lock:
            if rows > self.rows or nbytes > self.bytes or state > self.state:
                what = ("rows" if rows > self.rows else "keyframe state bytes" if state > self.state
                        else "decompressed bytes")
                raise OverBudget(f"{self.source} decodes to more {what} than a file of its size may "
                                 f"(a compression bomb?); set {ENV}=8 (a factor) or {ENV}=unlimited "
                                 f"to read a genuine one (docs/format.md)")
            self.rows -= rows
            self.bytes -= nbytes
            self.state -= state


def read_budget(file_size: int, source: str = "the file") -> ReadBudget:
    """The budget of one read of a file of ``file_size`` bytes (see the module docstring).

    Raises:
        MemrecCommandError: :data:`ENV` is set to neither a positive number nor ``unlimited``.
    """
    factor_text = os.environ.get(ENV, "").strip()
    if factor_text.lower() == "unlimited":
        return ReadBudget(1 << 62, 1 << 62, 1 << 62, source)
    try:
        factor = float(factor_text) if factor_text else 1.0
    except ValueError:
        factor = -1.0
    if not 0 < factor < math.inf:  # "inf" is no factor: `unlimited` says it
        raise MemrecCommandError(f"{ENV}={factor_text!r}: give a positive factor (e.g. 8) or 'unlimited'",
                                 exit_code=ExitCode.USAGE)

    def share(per_byte: int, floor: int, ceiling: int) -> int:
        return int(factor * min(max(per_byte * file_size, floor), ceiling))

    return ReadBudget(share(ROWS_PER_BYTE, FLOOR_ROWS, CEILING_ROWS), share(BYTES_PER_BYTE, FLOOR_BYTES, CEILING_BYTES),
                      share(STATE_PER_BYTE, FLOOR_STATE, CEILING_STATE), source)
