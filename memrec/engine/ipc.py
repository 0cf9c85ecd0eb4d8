"""Which export each CUDA IPC open maps, and how many bytes: the open's row made whole.

The driver's ``cuIpcOpenMemHandle`` returns a pointer and takes 64 handle bytes; it says neither
whose memory that is nor its size. The exporter's ``cuIpcGetMemHandle`` of the same bytes does
(the pid), and the replay's journal has the bytes the open mapped (its ``ipc_mapped`` change).
The events table, the Parquet/CSV exports and Perfetto's flows all read the pairing here.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def ipc_opens(events: np.ndarray, journal: Journal) -> IpcOpens:
    """Pair every successful IPC open in ``events`` (the replayed events, with their ``ipc`` bytes)
    with its export, and size it from ``journal`` (the same replay's)."""
    n = len(events)
    source = np.full(n, -1, dtype=np.int64)
    peer = np.full(n, -1, dtype=np.int64)
    size = np.zeros(n, dtype=np.int64)
    if not n:
        return IpcOpens(source, peer, size)
    ok = (events["result"] == 0) & ((events["flags"] & FLAG_IPC_BYTES) != 0)
    opens = np.nonzero(ok & (events["kind"] == int(Kind.IPC_OPEN)))[0]
    if not len(opens):
        return IpcOpens(source, peer, size)
    exports: dict[bytes, list[tuple[int, int]]] = {}
    for i in np.nonzero(ok & (events["kind"] == int(Kind.IPC_EXPORT)))[0].tolist():
        exports.setdefault(events["ipc"][i].tobytes(), []).append((int(events["ts"][i]), i))
    mapped = (journal.category == IPC_MAPPED) & (journal.delta > 0)
    opened = dict(zip(journal.index[mapped].tolist(), journal.delta[mapped].tolist()))
    last: dict[tuple[int, int], int] = {}  # (pid, pointer) -> bytes its first open mapped
    for i in opens.tolist():
        blob = events["ipc"][i].tobytes()
        cands = exports.get(blob)
        if cands:
            ts = int(events["ts"][i])
            before = [c for c in cands if c[0] <= ts]
            src = (before[-1] if before else cands[0])[1]
            source[i] = src
            peer[i] = int(events["pid"][src])
        key = (int(events["pid"][i]), int(events["ptr"][i]))
        if i in opened:
            last[key] = opened[i]
        size[i] = last.get(key, 0)
    return IpcOpens(source, peer, size)
