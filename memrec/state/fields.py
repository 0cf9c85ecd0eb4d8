"""Names and numbers the state's modules share: snapshot tables, kinds as ints, limits."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from memrec.terms.events import QUIET_FAILURE_KINDS
from memrec.terms.events import TENSOR_KINDS
from memrec.terms.events import Api
from memrec.terms.events import Kind

#: Snapshot format version (a keyframe's ``"v"``). 2: driver allocations as columns of bytes
#: (:data:`ALLOC_COLUMNS`); 3 (trace format 2.3): the same columns with ``ptr`` as the gap after
#: the process's previous block and ``ts`` as differences (``allocs["form"]``; a reader of
#: version 2 refuses the keyframe rather than misread its pointers). Versions 1 and 2 still read.
SNAPSHOT_VERSION = 3
READ_VERSIONS = (1, 2, 3)

#: Field order of each table in a snapshot: every table is one flat list of rows of this stride.
ALLOC_FIELDS = ("pid", "ptr", "size", "gpu", "ts", "api")
HANDLE_FIELDS = ("pid", "handle", "size", "gpu", "ts", "category", "refs", "nmaps", "exporter", "api")
MAP_FIELDS = ("pid", "va", "size", "handle", "offset", "ts")
ALIAS_FIELDS = ("pid", "alias", "handle")
EXPORT_FIELDS = ("handle_bytes", "pid", "ptr", "gpu", "size", "ts")
FABRIC_FIELDS = ("fabric_bytes", "pid", "handle")
OPEN_FIELDS = ("pid", "ptr", "handle_bytes", "exporter", "owner_gpu", "size", "gpu", "refs", "ts", "exporter_ptr")
HOST_FIELDS = ("pid", "ptr", "size", "ts", "api")
FAILURE_FIELDS = ("index", "ts", "pid", "tid", "kind", "api", "result", "gpu", "size", "ptr")
PEAK_FIELDS = ("gpu", "bytes", "ts")
#: An exit record: [pid, ts, held rows (HELD_FIELDS, flat), largest rows (LARGEST_FIELDS, flat)].
HELD_FIELDS = ("gpu", "category", "bytes", "count")
LARGEST_FIELDS = ("gpu", "category", "size", "address", "ts", "api", "peer")
#: Version 2's driver allocations: one column per field, of this type (see snapshot.encode_allocs).
ALLOC_COLUMNS = {"pid": "<u4", "ptr": "<u8", "size": "<i8", "gpu": "<i2", "ts": "<i8", "api": "<u2"}

#: Journal columns (one row per change of a counter): see :attr:`LiveState.journal`.
JOURNAL_FIELDS = ("index", "ts", "gpu", "pid", "category", "delta")

#: How many recent failed calls the state keeps, and how many largest allocations an exit record keeps.
MAX_FAILURES = 256
EXIT_LARGEST = 5
#: The largest size and ts the accounting takes (larger ones can only come from a damaged file).
MAX_SIZE = np.uint64(1 << 52)
MAX_TS = np.uint64((1 << 63) - 1)

# Kind numbers as plain ints for the hot loop.
ALLOC = int(Kind.ALLOC)
FREE = int(Kind.FREE)
VMM_CREATE = int(Kind.VMM_CREATE)
VMM_RELEASE = int(Kind.VMM_RELEASE)
VMM_MAP = int(Kind.VMM_MAP)
VMM_UNMAP = int(Kind.VMM_UNMAP)
IPC_EXPORT = int(Kind.IPC_EXPORT)
IPC_OPEN = int(Kind.IPC_OPEN)
IPC_CLOSE = int(Kind.IPC_CLOSE)
SHARE_EXPORT = int(Kind.SHARE_EXPORT)
SHARE_IMPORT = int(Kind.SHARE_IMPORT)
VMM_RETAIN = int(Kind.VMM_RETAIN)
HOST_ALLOC = int(Kind.HOST_ALLOC)
HOST_FREE = int(Kind.HOST_FREE)
HOST_REGISTER = int(Kind.HOST_REGISTER)
HOST_UNREGISTER = int(Kind.HOST_UNREGISTER)
PROC_EXIT = int(Kind.PROC_EXIT)
ARRAY_CREATE = int(Kind.ARRAY_CREATE)
ARRAY_DESTROY = int(Kind.ARRAY_DESTROY)
QUIET_KINDS = frozenset(int(k) for k in QUIET_FAILURE_KINDS)
#: Kinds whose ``ipc`` column may carry handle bytes (IPC handle or fabric handle).
HANDLE_BYTES_KINDS = frozenset((IPC_EXPORT, IPC_OPEN, SHARE_EXPORT, SHARE_IMPORT))
#: Successful kinds that change the VMM, IPC or host tables (event by event, but VMM_RUN_KINDS in a run).
OTHER_KINDS = (VMM_CREATE, VMM_RELEASE, VMM_MAP, VMM_UNMAP, VMM_RETAIN, IPC_CLOSE, SHARE_EXPORT, SHARE_IMPORT,
               HOST_ALLOC, HOST_FREE, HOST_REGISTER, HOST_UNREGISTER, ARRAY_CREATE, ARRAY_DESTROY)
#: VMM kinds a run applies at once (memrec.state.vmm_run), and those that keep their process's
#: VMM events in the run event by event.
VMM_RUN_KINDS = (VMM_CREATE, VMM_MAP, VMM_UNMAP, VMM_RELEASE)
VMM_SERIAL_KINDS = (VMM_RETAIN, SHARE_EXPORT, SHARE_IMPORT, ARRAY_CREATE, ARRAY_DESTROY)
#: Successful kinds that read driver allocations or IPC exports: one joins a run applied at once
#: when the run's allocations and frees before it cannot change what it reads (planner.Planner).
JOINABLE_KINDS = (IPC_EXPORT, IPC_OPEN)
#: Kinds that may end a run: those and process exits (which drop every allocation of a process).
BARRIER_KINDS = (*JOINABLE_KINDS, PROC_EXIT)
API_IPC_OPEN = int(Api.cuIpcOpenMemHandle_v2)


def kind_mask(kinds: tuple[int, ...]) -> np.ndarray:
    """A table kind -> whether it is one of ``kinds``: ``mask[events["kind"]]`` is one gather,
    where ``np.isin`` sorts the batch."""
    mask = np.zeros(1 << 16, bool)
    mask[list(kinds)] = True
    return mask


#: Whether each kind is applied at once by memrec.state.vmm_run, or may end a run.
VMM_RUN_MASK = kind_mask(VMM_RUN_KINDS)
BARRIER_MASK = kind_mask(BARRIER_KINDS)
HANDLE_BYTES_MASK = kind_mask(tuple(HANDLE_BYTES_KINDS))
#: Tensor-block events: no driver memory changes hands (the event-by-event path skips them).
TENSOR_MASK = kind_mask(tuple(int(k) for k in TENSOR_KINDS))

#: CUmemLocationType of a cuMemCreate: 0 (not read) and 1 are device memory, others are host.
LOCATION_DEVICE = (0, 1)

# Open record slots: [handle_bytes, exporter, owner_gpu, size, gpu, refs, ts, exporter_ptr]
O_BYTES, O_EXPORTER, O_OWNER_GPU, O_SIZE, O_GPU, O_REFS, O_TS, O_EPTR = range(8)

REQUIRED_COLUMNS = ("ts", "pid", "tid", "kind", "api", "result", "flags", "ptr", "size", "handle", "aux", "ipc", "gpu")


class Holding(NamedTuple):
    """One live piece of memory a process holds (or, for ipc_mapped, has mapped)."""

    pid: int
    gpu: int
    category: str
    size: int
    address: int  # device or host pointer; the VMM handle for category "vmm" (or a host-located handle)
    ts: int  # when it was allocated, created or opened
    api: int  # memrec.terms.events.Api of the call that made it
    peer: int = 0  # ipc_mapped: the exporter's pid (0 unknown)
