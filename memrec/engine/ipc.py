"""Which export each CUDA IPC open maps, and how many bytes: the open's row made whole.

The driver's ``cuIpcOpenMemHandle`` returns a pointer and takes 64 handle bytes; it says neither
whose memory that is nor its size. The exporter's ``cuIpcGetMemHandle`` of the same bytes does
(the pid), and the replay's journal has the bytes the open mapped (its ``ipc_mapped`` change).
The events table, the Parquet/CSV exports and Perfetto's flows all read the pairing here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from memrec.engine.journal import Journal
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import IPC_MAPPED
from memrec.terms.events import Kind


@dataclass(frozen=True)
class IpcOpens:
    """Per replayed event: the export an IPC open maps, its exporter and its size.

    ``source[i]``: the index of the export event of open ``i`` (the latest successful export of the
    same handle bytes at or before the open, else the first one after), -1 for any other event or
    an open whose export was not recorded. ``peer[i]``: that export's pid (-1 where unknown).
    ``size[i]``: the bytes open ``i`` mapped (its journal change; a repeated open of a mapping the
    process already holds maps nothing new and has the size of that earlier open), 0 elsewhere.
    """

    source: np.ndarray  # int64, -1: none
    peer: np.ndarray  # int64, -1: none
    size: np.ndarray  # int64

    def __getitem__(self, rows: slice) -> IpcOpens:
        """The pairing of the events ``rows`` (a slice)."""
        return IpcOpens(self.source[rows], self.peer[rows], self.size[rows])

    @classmethod
    def concat(cls, parts: list[IpcOpens]) -> IpcOpens:
        """The pairings of consecutive ``parts``, as one."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, name) for p in parts] or [np.zeros(0, np.int64)])
                     for name in ("source", "peer", "size")))

    @classmethod
    def none(cls, n: int) -> IpcOpens:
        """``n`` events without an IPC open."""
        return cls(np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64))


#: An export's place, for pairing: (its ts, its event index, its pid).
Export = tuple[int, int, int]


def ipc_exports(events: Any, first: int = 0) -> list[tuple[bytes, Export]]:
    """The successful IPC exports among ``events`` (rows or a :class:`~memrec.state.batch.Batch`;
    ``first``: the index of their first event), as (handle bytes, (ts, index, pid)), in order:
    what a first pass over a trace gathers (:class:`memrec.engine.source.Census`) so that a later
    one pairs an open with an export recorded after it."""
    kinds = events["kind"]
    found = np.flatnonzero((kinds == int(Kind.IPC_EXPORT)) & (events["result"] == 0)
                           & ((events["flags"] & FLAG_IPC_BYTES) != 0))
    if not len(found):
        return []
    blobs = _handles(events, found)
    return [(blob, (ts, i + first, pid)) for blob, ts, i, pid in
            zip(blobs, events["ts"][found].tolist(), found.tolist(), events["pid"][found].tolist())]


def _handles(events: Any, idx: np.ndarray) -> list[bytes]:
    """The 64 handle bytes of the events at ``idx`` (each one has them)."""
    if isinstance(events, np.ndarray):
        return [events["ipc"][i].tobytes() for i in idx.tolist()]
    pos = np.searchsorted(events.ipc_index, idx)  # a Batch keeps the few events' bytes apart
    return [events.ipc[k].tobytes() for k in pos.tolist()]


class IpcPairing:
    """:func:`ipc_opens` over a replay's chunks, in order (:meth:`add`): ``exports`` are every
    export of the trace (handle bytes -> its exports in event order: :func:`ipc_exports`, from
    the first pass), so that an open is paired as the whole trace pairs it."""

    def __init__(self, exports: dict[bytes, list[Export]]) -> None:
        self._exports = exports
        self._last: dict[tuple[int, int], int] = {}  # (pid, pointer) -> bytes its first open mapped

    def add(self, first: int, events: Any, journal: Journal) -> IpcOpens:
        """The pairing of ``events`` (indexes from ``first``), sized from ``journal`` (the same
        replay's rows for them)."""
        out = IpcOpens.none(len(events))
        source, peer, size = out.source, out.peer, out.size
        if not len(events):
            return out
        ok = (events["result"] == 0) & ((events["flags"] & FLAG_IPC_BYTES) != 0)
        opens = np.flatnonzero(ok & (events["kind"] == int(Kind.IPC_OPEN)))
        if not len(opens):
            return out
        mapped = (journal.category == IPC_MAPPED) & (journal.delta > 0)
        opened = dict(zip((journal.index[mapped] - first).tolist(), journal.delta[mapped].tolist()))
        for i, blob, ts, pid, ptr in zip(opens.tolist(), _handles(events, opens), events["ts"][opens].tolist(),
                                         events["pid"][opens].tolist(), events["ptr"][opens].tolist()):
            cands = self._exports.get(blob)
            if cands:
                before = [c for c in cands if c[0] <= ts]
                _, source[i], peer[i] = before[-1] if before else cands[0]
            key = (int(pid), int(ptr))
            if i in opened:
                self._last[key] = opened[i]
            size[i] = self._last.get(key, 0)
        return out


def ipc_opens(events: np.ndarray, journal: Journal) -> IpcOpens:
    """Pair every successful IPC open in ``events`` (the replayed events, with their ``ipc`` bytes)
    with its export, and size it from ``journal`` (the same replay's)."""
    exports: dict[bytes, list[Export]] = {}
    for blob, export in ipc_exports(events):
        exports.setdefault(blob, []).append(export)
    return IpcPairing(exports).add(0, events, journal)
