"""A whole trace in memory, as the analysis, the report and the TUI consume it."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

import numpy as np

from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.columns import NVML_DTYPE
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import FLAG_NAME
from memrec.terms.events import GpuInfo
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace.format import gpus_from_header
from memrec.trace.stacks import Stack
from memrec.trace.stacks import StackTable


@dataclass
class Keyframe:
    """The full live state at ``ts``, valid after the first ``event_index`` events."""

    ts: int
    event_index: int
    state: dict


_BLOCK = 1 << 16


@dataclass
class EventColumns:
    """The events of a trace column by column: what a loaded trace holds until someone asks for
    rows (``Trace.events``). Each column is of its EVENT_DTYPE field's dtype, contiguous, or a
    read-only broadcast of one value when every event holds it (a load makes those; ``gpu`` is
    always a real, writable column); the 64-byte ``ipc`` field is sparse (the few rows that have
    bytes, as in the file)."""

    n: int
    columns: dict[str, np.ndarray]
    ipc_index: np.ndarray  # int64 row numbers, ascending
    ipc: np.ndarray  # V64, one per ipc_index

    def __getitem__(self, name: str) -> np.ndarray:
        """One column (``ipc`` as full rows: 64 bytes per event, built on demand)."""
        if name == "ipc":
            out = np.zeros(self.n, dtype=EVENT_DTYPE["ipc"])
            out[self.ipc_index] = self.ipc
            return out
        return self.columns[name]

    def __len__(self) -> int:
        return self.n

    def to_array(self) -> np.ndarray:
        """The events as one EVENT_DTYPE structured array (130 bytes a row).

        Filled 65,536 rows at a time, every column per block: the rows of a block stay in the
        cache while its columns are written (a whole column at a time: 4× slower on 10M events).
        """
        out = np.zeros(self.n, dtype=EVENT_DTYPE)
        for lo in range(0, self.n, _BLOCK):
            block = out[lo : lo + _BLOCK]
            for name, col in self.columns.items():
                block[name] = col[lo : lo + _BLOCK]
        if len(self.ipc_index):
            out["ipc"][self.ipc_index] = self.ipc
        return out

    @classmethod
    def from_array(cls, events: np.ndarray) -> EventColumns:
        """Column views of an EVENT_DTYPE array (no copy; ``ipc`` made sparse)."""
        has = np.flatnonzero(events["flags"] & (FLAG_IPC_BYTES | FLAG_NAME)).astype(np.int64)
        names = [n for n in EVENT_DTYPE.names if n != "ipc"]
        return cls(len(events), {n: events[n] for n in names}, has, events["ipc"][has])


class _LazyEvents:
    """``Trace.events``: the rows, built from ``Trace.event_columns`` when first used.

    Loading a trace decodes its columns only (a 10M-event trace: 0.7 GB of columns, where the
    130-byte rows take 1.3 GB and seconds to fill); a consumer that wants rows gets them, once.
    A dataclass field whose default is this descriptor (see the dataclasses docs).
    """

    def __get__(self, obj: Trace | None, objtype: type | None = None) -> np.ndarray | None:
        if obj is None:
            return None  # the field's default: no rows given
        events = obj.__dict__.get("_events")
        if events is None:
            columns = obj.__dict__.get("_event_columns")
            events = columns.to_array() if columns is not None else np.zeros(0, dtype=EVENT_DTYPE)
            obj.__dict__["_events"] = events
            # the rows hold everything: the columns become views of them (0.7 GB less for 10M)
            obj.__dict__["_event_columns"] = None
        return events

    def __set__(self, obj: Trace, value: np.ndarray | None) -> None:
        obj.__dict__["_events"] = value
        obj.__dict__["_event_columns"] = None


@dataclass
class Trace:
    """Everything one ``.mrec`` file (or a live session so far) holds, decoded.

    ``events`` (EVENT_DTYPE rows) and ``event_columns`` (the same events column by column) are
    two views of one set of events: a loaded trace has contiguous columns and builds the rows on
    first use (the columns are then views of the rows); a trace made from rows gives column views
    of them.
    """

    header: dict
    events: np.ndarray = _LazyEvents()  # type: ignore[assignment]
    nvml: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=NVML_DTYPE))
    procmem: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=PROCMEM_DTYPE))
    markers: list[Marker] = field(default_factory=list)
    processes: dict[int, ProcessInfo] = field(default_factory=dict)
    keyframes: list[Keyframe] = field(default_factory=list)
    lost: int = 0
    trailer: dict | None = None
    warnings: list[str] = field(default_factory=list)
    #: The stacks the events' ``stack`` column names (format 2.3; empty before, or without stacks).
    stacks: StackTable = field(default_factory=StackTable)

    def stack(self, stack_id: int) -> Stack | None:
        """The frames (innermost first) or :class:`~memrec.trace.stacks.Unavailable` that an
        event's ``stack`` id names; None for 0 (no stack recorded) or an id not defined."""
        return self.stacks.stack(stack_id)

    @property
    def event_columns(self) -> EventColumns:
        """The events column by column (contiguous after a load; views of ``events`` otherwise)."""
        columns = self.__dict__.get("_event_columns")
        if columns is None:
            columns = EventColumns.from_array(self.events)
            self.__dict__["_event_columns"] = columns
        return columns

    @event_columns.setter
    def event_columns(self, columns: EventColumns) -> None:
        self.__dict__["_events"] = None
        self.__dict__["_event_columns"] = columns

    @property
    def n_events(self) -> int:
        """How many events (without building the rows)."""
        columns = self.__dict__.get("_event_columns")
        return columns.n if columns is not None else len(self.events)

    @property
    def gpus(self) -> list[GpuInfo]:
        """The GPUs the header names (NVML's list: empty on a host without NVML); entries a
        damaged file made unusable are left out."""
        return gpus_from_header(self.header)

    def gpu_ids(self) -> list[int]:
        """Every GPU the trace names: the header's and those its events and NVML samples name."""
        ids = GpuIds()
        ids.add_header(self.header)
        ids.add_column(self.event_columns["gpu"])
        ids.add_column(self.nvml["gpu"])
        return ids.sorted()


class GpuIds:
    """The GPUs a trace names, gathered as it is read: the one place that says which GPUs a
    trace has, for every command that lists or filters GPUs (report, TUI).

    The header's list comes from NVML, so a trace recorded without it (no NVIDIA driver, the stub
    driver, ``memrec demo``) lists none there; its GPUs are known only from what its events and
    samples name. -1 (the host, or a GPU not resolved) is not a GPU.
    """

    def __init__(self) -> None:
        self._ids: set[int] = set()

    def add_header(self, header: dict) -> None:
        for g in gpus_from_header(header):
            if g.index >= 0:
                self._ids.add(g.index)

    def add_column(self, column: np.ndarray) -> None:
        """A ``gpu`` column of events or NVML samples (any length; counted, not sorted)."""
        column = np.asarray(column)
        if not len(column):
            return
        lo, hi = max(int(column.min()), 0), int(column.max())
        if hi < 0 or (hi - lo < 64 and all(g in self._ids for g in range(lo, hi + 1))):
            return  # every index the column can hold is known (two passes instead of a count)
        named = column[column >= 0]
        if len(named):
            self._ids.update(np.flatnonzero(np.bincount(named.astype(np.intp))).tolist())

    def add(self, index: int) -> None:
        if index >= 0:
            self._ids.add(int(index))

    def __contains__(self, index: object) -> bool:
        return index in self._ids

    def sorted(self) -> list[int]:
        return sorted(self._ids)
