"""The event table's filter language: ``pid:123,456 kind:alloc,free size>=1G phase:weights fail
some text``, parsed into an :class:`EventFilter` and evaluated on event rows by :func:`event_mask`.

Pure numpy, no Textual: the model runs it in a worker thread, the tests without an app.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable
from typing import Iterable

import numpy as np

from memrec.terms.events import CU_RESULT_NAMES
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.terms.units import parse_size

KIND_NAMES = {int(k): k.name.lower() for k in Kind}
API_NAMES = {int(a): a.name for a in Api}
#: The largest pid the events hold (their pid column is uint32).
PID_MAX = (1 << 32) - 1

#: ``phases_of(pids, tss)``: the phase each event's process was in at its time.
PhasesOf = Callable[[np.ndarray, np.ndarray], list[str]]


@dataclass(frozen=True)
class EventFilter:
    """Which events the event table shows. Empty fields match everything."""

    pids: frozenset[int] = frozenset()
    kinds: frozenset[int] = frozenset()
    min_size: int = 0
    phase: str = ""
    text: str = ""
    failed: bool = False

    @property
    def empty(self) -> bool:
        return self == EventFilter()


def parse_filter(text: str) -> EventFilter:
    """Parse the filter box: ``pid:123,456 kind:alloc,free size>=1G phase:weights fail some text``.

    Unknown ``key:value`` words and malformed values raise ValueError with a one-line reason.
    """
    pids: set[int] = set()
    kinds: set[int] = set()
    min_size = 0
    phase = ""
    failed = False
    words = []
    for word in text.split():
        low = word.lower()
        if low.startswith("pid:"):
            try:
                wanted = {int(p) for p in low[4:].split(",") if p}
            except ValueError:
                raise ValueError(f"pid: wants numbers, got {word[4:]!r}") from None
            # the events' pid column is uint32: a number past it would crash the view, not filter it
            if any(not 0 <= p <= PID_MAX for p in wanted):
                raise ValueError(f"pid: wants process ids (0 to {PID_MAX}), got {word[4:]!r}")
            pids.update(wanted)
        elif low.startswith("kind:"):
            for name in low[5:].split(","):
                if not name:
                    continue
                match = [int(k) for k in Kind if k.name.lower() == name or k.name.lower().startswith(name)]
                if not match:
                    raise ValueError(f"kind: no event kind {name!r} (alloc, free, vmm_create, ipc_open, ...)")
                kinds.update(match)
        elif low.startswith(("size>=", "size>", "size:")):
            value = low.split(">=", 1)[1] if ">=" in low else low.split(">", 1)[1] if ">" in low else low[5:]
            min_size = parse_size(value)
        elif low.startswith("phase:"):
            phase = word[6:]
        elif low in ("fail", "failed", "oom", "!ok"):
            failed = True
        else:
            words.append(word)
    return EventFilter(frozenset(pids), frozenset(kinds), min_size, phase, " ".join(words).lower(), failed)


def event_mask(rows: np.ndarray, flt: EventFilter, gpu: int | None, gpu_pids: Iterable[int],
               phases_of: PhasesOf | None, pids_named: Callable[[str], list[int]]) -> np.ndarray:
    """Which of ``rows`` (EVENT_DTYPE) pass ``flt`` on ``gpu`` (None: any GPU).

    Args:
        gpu_pids: processes seen on ``gpu``: their events of unknown GPU (``gpu`` -1) count as its.
        phases_of: the phase of each row (needed for ``phase:`` and free text).
        pids_named: processes whose rank label or command line contains a text.
    """
    m = np.ones(len(rows), dtype=bool)
    if gpu is not None:
        pids = np.fromiter(gpu_pids, np.uint32)
        m &= (rows["gpu"] == gpu) | ((rows["gpu"] < 0) & np.isin(rows["pid"], pids))
    if flt.pids:
        m &= np.isin(rows["pid"], np.fromiter(flt.pids, np.uint32))
    if flt.kinds:
        m &= np.isin(rows["kind"], np.fromiter(flt.kinds, np.uint16))
    if flt.min_size:
        m &= rows["size"] >= flt.min_size
    if flt.failed:
        m &= rows["result"] != 0
    if flt.phase and phases_of is not None and m.any():
        idx = np.flatnonzero(m)
        ph = phases_of(rows["pid"][idx], rows["ts"][idx])
        want = flt.phase.lower()
        m[idx] = [want in p.lower() for p in ph]
    if flt.text and m.any():
        m &= _text_mask(rows, flt.text, phases_of, pids_named)
    return m


def _text_mask(rows: np.ndarray, text: str, phases_of: PhasesOf | None, pids_named: Callable[[str], list[int]]) -> np.ndarray:
    """Rows whose kind, API, result name, pid, rank, command, phase or pointer match ``text``."""
    out = np.zeros(len(rows), dtype=bool)
    kinds = [k for k, name in KIND_NAMES.items() if text in name]
    apis = [a for a, name in API_NAMES.items() if text in name.lower()]
    results = [r for r, name in CU_RESULT_NAMES.items() if text in name.lower()]
    if kinds:
        out |= np.isin(rows["kind"], kinds)
    if apis:
        out |= np.isin(rows["api"], apis)
    if results:
        out |= np.isin(rows["result"], results)
    pids = pids_named(text)
    if text.isdigit():
        pids.append(int(text))
    if pids:
        out |= np.isin(rows["pid"], pids)
    hex_text = text[2:] if text.startswith("0x") else text
    if hex_text and all(c in "0123456789abcdef" for c in hex_text) and len(hex_text) >= 4:
        v = int(hex_text, 16)
        out |= (rows["ptr"] == v) | (rows["handle"] == v)
    if phases_of is not None and not out.all():
        idx = np.flatnonzero(~out)
        ph = phases_of(rows["pid"][idx], rows["ts"][idx])
        out[idx] = [text in p.lower() for p in ph]
    return out
