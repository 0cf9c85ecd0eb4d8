"""Snapshots in PyTorch's memory-snapshot format, for ``torch.cuda._memory_viz`` and pytorch.org/memory_viz.

PyTorch's format (``torch.cuda.memory._snapshot()``) describes one process: ``segments`` (what
the caching allocator holds from the driver at the snapshot, each with its ``blocks``) and
``device_traces`` (per device ordinal, the history of actions). memrec sees the driver, which is
exactly the allocator's segment level, so each process gets one snapshot:

- ``cuMemAlloc*`` / ``cuMemFree*`` are ``segment_alloc`` / ``segment_free`` (what ``cudaMalloc``
  / ``cudaFree`` of a segment are in PyTorch's own traces), each with an ``alloc`` /
  ``free_completed`` of the whole range so that the default "Active Memory Timeline" shows them;
- ``cuMemMap`` / ``cuMemUnmap`` (expandable segments and other VMM users) are ``segment_map`` /
  ``segment_unmap``, with ``alloc`` / ``free_completed`` likewise;
- a failed allocation with ``CUDA_ERROR_OUT_OF_MEMORY`` is an ``oom`` action (``device_free`` from
  the last NVML sample of that GPU before it, 0 when there is none);
- ``segments`` are the pieces held at the snapshot's moment (``--at``: the answer's failure, its
  peak, the end, or a time), one active block each, with one frame naming the call, the phase
  it was allocated in and the process: driver allocations, VMM mappings (``is_expandable``) and
  peers' memory mapped by IPC (``ipc_mapped from pid N`` in the frame: not this process's own,
  but in its address space, as ``nvidia-smi`` counts it); and the device traces stop there.

The default moment is the answer's (:mod:`memrec.analysis.report.answer`): its failure when it is a lack
of memory, else the peak.

A process recorded with ``memrec daemon --tensors`` has PyTorch's own blocks: its segments get
only their ``segment_*`` actions, its tensor blocks the ``alloc`` / ``free_requested`` +
``free_completed`` actions (a free's size and device are its allocation's), and its segments at
the end list the live blocks in them (``active_allocated``) and the gaps (``inactive``), as
PyTorch's snapshot does.

The device index is the physical GPU (NVML index); ``time_us`` is the trace's clock in µs. The
last frame of each action, segment and block names the driver call, the phase and the process:
``memrec:<phase>`` / ``cuMemAlloc_v2 (TP0)`` in memory_viz's stack panel. A trace with stacks
(format 2.3) puts the allocation's own frames before it, innermost first as PyTorch does:
Python frames as ``{filename, line, name}``, native ones with the module as the filename and
the symbol as the name (line 0), an unavailable stack as one ``memrec:stack unavailable`` frame
with the reason; a segment or block takes the stack of the allocation that made it.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import pickle
from collections import deque
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from memrec.base.files import create_in
from memrec.base.files import open_folder
from memrec.base.files import remove_made
from memrec.analysis.report.answer import Answer
from memrec.analysis.report.answer import DRIVER_OOM
from memrec.analysis.report.answer import KV_SIZING
from memrec.api import Recording
from memrec.api import ReplayedChunk
from memrec.engine.replay import state_at
from memrec.analysis.names import api_name
from memrec.terms.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.terms.events import DRIVER
from memrec.terms.events import Kind
from memrec.state.tensors import rounded
from memrec.trace.stacks import StackTable
from memrec.trace.stacks import Unavailable

#: Actions kept per process and device, the latest (``--max-entries``).
MAX_ENTRIES = 100_000
#: Events looked at and turned into Python values at a time (:func:`_selected`).
SLICE_ROWS = 1 << 20
_FREE = int(Kind.FREE)
_T_ALLOC, _T_FREE = int(Kind.TENSOR_ALLOC), int(Kind.TENSOR_FREE)

_SEGMENT = {
    int(Kind.ALLOC): ("segment_alloc", "alloc"),
    int(Kind.FREE): ("segment_free", "free_completed"),
    int(Kind.VMM_MAP): ("segment_map", "alloc"),
    int(Kind.VMM_UNMAP): ("segment_unmap", "free_completed"),
}


#: ``--at`` words: the answer's failure, the answer's peak (its window's end when nothing failed,
#: else the highest traced peak), the trace's end.
MOMENTS = ("failure", "peak", "end")


def moment(rec: Recording, at: str | None, answer: Answer) -> int | None:
    """The trace-clock ns ``--at`` names (None: the end): ``failure``, ``peak``, ``end``, or seconds
    from the trace's start (``7.74``, ``+7.74s``, as the report writes times); default: the answer's
    failure when it is a lack of memory (out of memory, SGLang's KV sizing), else the peak.

    Raises:
        ValueError: an unknown word, a time outside the trace, or ``failure`` in a trace without one.
    """
    start, end = rec.start, rec.end
    if at is None:  # a failure that is no lack of memory (a refused call) may come before anything is held
        short = answer.failure is not None and answer.failure.kind in (KV_SIZING, DRIVER_OOM)
        at = "failure" if short else "peak"
    if at == "end":
        return None
    if at == "failure":
        if answer.failure is None:
            raise ValueError("--at failure: nothing failed in this trace (try --at peak)")
        return answer.failure.ts
    if at == "peak":
        if answer.status == "ok" and answer.window is not None:
            return answer.window.end_ts  # the report's highest peak
        peaks = [s.peak() for g, s in sorted(rec.timeline.gpus.items()) if g >= 0 and len(s.ts)]
        return max(peaks, key=lambda p: p[0])[1] if peaks else None
    try:
        secs = float(at.strip().lstrip("+").removesuffix("s"))
    except ValueError:
        secs = math.nan
    if not math.isfinite(secs):  # "nan" and "inf" parse as floats but name no moment
        raise ValueError(f"--at {at}: not failure, peak, end or seconds from the start")
    ts = start + int(round(secs * 1e9))
    if not start <= ts <= end:
        raise ValueError(f"--at {at}: the trace runs from 0 to {(end - start) / 1e9:.3f} s")
    return ts


def snapshots(rec: Recording, max_entries: int = MAX_ENTRIES, at: int | None = None) -> tuple[dict[int, dict], int]:
    """One PyTorch memory snapshot per process that touched GPU memory: pid -> snapshot dict.

    ``at``: the moment (trace-clock ns; None the end): the segments are what was held then and
    the device traces stop there. Each device trace keeps its last ``max_entries`` actions
    (PyTorch's own history is a ring buffer too; memory_viz draws every entry, and a browser
    stalls on millions). Returns the snapshots and how many actions were left out.
    """
    nv = rec.trace.nvml
    nv = nv[np.argsort(nv["ts"], kind="stable")] if len(nv) else nv
    # processes with tensor blocks by then (their segments get no block actions)
    with_blocks = {p for p, ts in rec.trace_events.census.tensor_since.items() if at is None or ts <= at}
    history = _History(rec, with_blocks, nv, max_entries)
    stack_frames = history.stack_frames
    made_by: dict[tuple[int, int], int] = {}  # (pid, address) -> the stack of the allocation there
    upto = 0  # the events up to the moment
    whole = True  # every event is before the moment
    for part in rec.replayed():  # GPUs filled in by the replay (a free gets its allocation's GPU)
        ev = part.events
        cut = len(ev) if at is None else int(np.searchsorted(ev["ts"], np.uint64(at), side="right"))
        upto += cut
        history.add(part, cut)
        made_by.update(_allocating_stacks(ev[:cut]))
        if cut < len(ev):
            whole = False
            break
    blocks, made = history.blocks, history.made
    snaps: dict[int, dict] = {}
    kept = 0
    for (pid, gpu), actions in sorted(history.traces.items()):
        snap = snaps.setdefault(pid, {"segments": [], "device_traces": [], "allocator_settings": {}})
        while len(snap["device_traces"]) <= gpu:
            snap["device_traces"].append([])
        snap["device_traces"][gpu] = list(actions)
        kept += len(actions)
    state = rec.timeline.state if whole else state_at(rec.trace_events.source, upto, rec.trace.keyframes)
    live = [(h.pid, h.address, h.size, h.gpu, h.api, h.ts, h.category, h.peer) for h in state.holdings()
            if h.gpu >= 0 and h.category in SEGMENT_CATEGORIES]
    live += [(pid, va, size, gpu, None, None, "vmm", 0) for pid, va, size, gpu in state.mappings() if gpu >= 0]
    inside = _blocks_by_segment(blocks, [(pid, addr, size) for pid, addr, size, *_ in live])
    made_in = _phases_made_in(rec, live)
    for (pid, addr, size, gpu, api, ts, category, peer), phase in zip(live, made_in):
        snap = snaps.setdefault(pid, {"segments": [], "device_traces": [], "allocator_settings": {}})
        while len(snap["device_traces"]) <= gpu:
            snap["device_traces"].append([])
        own = stack_frames(made_by.get((pid, addr), 0)) if category != "ipc_mapped" else []
        segment = _segment(rec, pid, gpu, addr, size, api, phase, category, peer, own)
        if pid in with_blocks:  # PyTorch's own blocks in it, and the free stretches between them
            seg_blocks = _segment_blocks(addr, size, inside.get((pid, addr), []), stack_frames)
            used = sum(b["size"] for b in seg_blocks if b["state"] == "active_allocated")
            requested = sum(b["requested_size"] for b in seg_blocks if b["state"] == "active_allocated")
            segment.update(allocated_size=used, active_size=used, requested_size=requested, blocks=seg_blocks)
        snap["segments"].append(segment)
    for snap in snaps.values():
        snap["segments"].sort(key=lambda x: (x["device"], x["address"]))
    return snaps, made - kept


class _History:
    """Each process's and device's actions, the latest ``max_entries`` (PyTorch's device traces),
    from a replay's chunks in order (:meth:`add`), and the tensor blocks alive."""

    def __init__(self, rec: Recording, with_blocks: set[int], nv: np.ndarray, max_entries: int) -> None:
        self.rec, self.with_blocks, self.nv, self.max_entries = rec, with_blocks, nv, max_entries
        self.blocks: dict[tuple[int, int], tuple[int, int, int]] = {}  # (pid, ptr) -> (size, gpu, stack), alive
        self.traces: dict[tuple[int, int], deque] = {}
        self.made = 0
        self.frames_of: dict[tuple[int, int, int, int], list] = {}  # one list per (pid, api, phase, stack): pickled once
        self.stack_frames = _StackFrames(rec.trace.stacks)

    def add(self, part: ReplayedChunk, cut: int) -> None:
        """The actions of ``part``'s first ``cut`` events."""
        for pid, gpu, kind, api, ts, addr, size, oom, ph, stack, freed in _selected(self.rec, part, cut):
            if kind == _T_FREE:
                size, gpu, stack = self.blocks.pop((pid, addr), (0, -1, 0))
                if not size:
                    continue  # a block from before the recording: no size to show
            elif kind == _T_ALLOC:
                if gpu < 0:
                    continue
                self.blocks[(pid, addr)] = (size, gpu, stack)
            frames = self.frames_of.get((pid, api, ph, stack))
            if frames is None:
                call = f"{api_name(api)} ({self.rec.name_of(pid)})"
                frames = self.frames_of[(pid, api, ph, stack)] = [
                    *self.stack_frames(stack), {"filename": f"memrec:{self.rec.phases.label(ph)}", "line": 0, "name": call}]
            out = self.traces.get((pid, gpu))
            if out is None:
                out = self.traces[(pid, gpu)] = deque(maxlen=self.max_entries)
            base = {"stream": 0, "time_us": ts // 1000, "frames": frames}
            if oom:
                free = _nvml_free_before(self.nv, gpu, ts)
                out.append({**base, "action": "oom", "addr": 0, "size": size, "device_free": free})
                self.made += 1
                continue
            if kind == _FREE:
                size = freed
                if not size:
                    continue  # a free of memory from before the recording: no size to show
            if kind in (_T_ALLOC, _T_FREE):
                actions: tuple[str, ...] = ("alloc",) if kind == _T_ALLOC else ("free_requested", "free_completed")
                for action in actions:
                    out.append({**base, "action": action, "addr": addr, "size": size})
                self.made += len(actions)
                continue
            segment_action, block_action = _SEGMENT[kind]
            if pid in self.with_blocks:
                actions = (segment_action,)  # its blocks are PyTorch's own
            elif block_action == "free_completed":
                actions = ("free_requested", "free_completed", segment_action)
            else:
                actions = (segment_action, block_action)
            for action in actions:
                out.append({**base, "action": action, "addr": addr, "size": size})
            self.made += len(actions)


#: The holdings that are segments: driver allocations and peers' memory mapped by IPC (VMM memory
#: is a segment where it is mapped: :meth:`memrec.state.LiveState.mappings`).
SEGMENT_CATEGORIES = ("driver", "ipc_mapped")


class _StackFrames:
    """A stack id's frames in PyTorch's form (innermost first), each stack's list built once."""

    def __init__(self, stacks: StackTable) -> None:
        self._stacks = stacks
        self._lists: dict[int, list[dict]] = {0: []}

    def __call__(self, stack_id: int) -> list[dict]:
        out = self._lists.get(stack_id)
        if out is None:
            stack = self._stacks.stack(stack_id)
            if isinstance(stack, Unavailable):
                out = [{"filename": "memrec:stack unavailable", "line": 0, "name": stack.reason}]
            else:
                out = [{"filename": f.file, "line": 0 if f.native else f.line,
                        "name": (f.function or f"+0x{f.line:x}") if f.native else f.function} for f in stack or ()]
            self._lists[stack_id] = out
        return out


def _allocating_stacks(ev: np.ndarray) -> dict[tuple[int, int], int]:
    """(pid, address) -> the stack of the last successful driver allocation or mapping there (a
    slice of the events at a time)."""
    out: dict[tuple[int, int], int] = {}
    for lo in range(0, len(ev), SLICE_ROWS):
        part = ev[lo:lo + SLICE_ROWS]
        made = np.flatnonzero(np.isin(part["kind"], (int(Kind.ALLOC), int(Kind.VMM_MAP))) & (part["result"] == 0)
                              & (part["stack"] != 0))
        out.update(zip(zip(part["pid"][made].tolist(), part["ptr"][made].tolist()), part["stack"][made].tolist()))
    return out


def _phases_made_in(rec: Recording, live: list[tuple]) -> list[str]:
    """The phase each live segment (:func:`snapshots`' rows) was made in, ``(mapped)`` for a VMM
    mapping: one search of the phases for them all (a search each was one per process with
    markers per segment: 4,000 segments and a step loop's markers took a second)."""
    made = [k for k, row in enumerate(live) if row[5] is not None]
    ids = rec.phases.assign(np.array([live[k][0] for k in made], dtype=np.int64),
                            np.array([live[k][5] for k in made], dtype=np.int64))
    out = ["(mapped)"] * len(live)
    for k, phase in zip(made, ids.tolist()):
        out[k] = rec.phases.label(phase)
    return out


def _segment(rec: Recording, pid: int, gpu: int, addr: int, size: int, api: int | None, phase: str,
             category: str, peer: int, own: list[dict] = ()) -> dict:  # type: ignore[assignment]
    """One segment with its one active block, as PyTorch's snapshot has them; the frames are the
    allocation's own (``own``, with stacks) then one naming the call, the phase it was made in
    (``phase``) and the process (for IPC, the peer it came from)."""
    call = api_name(api) if api is not None else "cuMemMap"
    who = f"ipc_mapped from pid {peer}" if category == "ipc_mapped" else rec.name_of(pid)
    frames = [*own, {"filename": f"memrec:{phase}", "line": 0, "name": f"{call} ({who})"}]
    return {
        "device": gpu, "address": addr, "total_size": size, "allocated_size": size,
        "active_size": size, "requested_size": size, "stream": 0, "segment_type": "large",
        "segment_pool_id": (0, 0), "is_expandable": category == "vmm", "frames": frames,
        "blocks": [{"address": addr, "size": size, "requested_size": size,
                    "state": "active_allocated", "frames": frames}],
    }


def _blocks_by_segment(blocks: dict[tuple[int, int], tuple[int, int, int]],
                       segments: list[tuple[int, int, int]]) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """(pid, segment address) -> the live tensor blocks (address, size, stack) in it, by address;
    ``segments`` are (pid, address, size)."""
    starts: dict[int, list[tuple[int, int]]] = {}
    for pid, addr, size in segments:
        starts.setdefault(pid, []).append((addr, size))
    for segs in starts.values():
        segs.sort()
    out: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for (pid, ptr), (size, _gpu, stack) in sorted(blocks.items()):
        segs = starts.get(pid, [])
        k = bisect.bisect_right(segs, (ptr, 1 << 64)) - 1
        if k >= 0 and ptr < segs[k][0] + segs[k][1]:
            out.setdefault((pid, segs[k][0]), []).append((ptr, size, stack))
    return out


def _segment_blocks(addr: int, size: int, inside: list[tuple[int, int, int]],
                    frames_of: Callable[[int], list[dict]]) -> list[dict]:
    """A segment's blocks as PyTorch lists them: the live ones (at the allocator's rounding, with
    their allocation's frames) and the free stretches between them."""
    out = []
    at = addr
    for ptr, requested, stack in inside:
        if ptr > at:
            out.append({"address": at, "size": ptr - at, "requested_size": 0, "state": "inactive", "frames": []})
        block = min(rounded(requested), addr + size - ptr)
        out.append({"address": ptr, "size": block, "requested_size": requested, "state": "active_allocated",
                    "frames": frames_of(stack)})
        at = max(at, ptr + block)
    if at < addr + size:
        out.append({"address": at, "size": addr + size - at, "requested_size": 0, "state": "inactive", "frames": []})
    return out


def _selected(rec: Recording, part: ReplayedChunk, cut: int) -> Iterator[tuple]:
    """The fields of the events that make actions (driver allocations, frees, maps and unmaps that
    succeeded on a GPU, allocations out of memory, tensor blocks) among ``part``'s first ``cut``
    events, as Python values, with whether the event is an out-of-memory failure, its phase and,
    for a driver free, the bytes it released (from the chunk's journal rows: a free names no
    size). :data:`SLICE_ROWS` events at a time, so that the export's own memory does not grow
    with the events (100M events' fields as Python lists whole: tens of GB)."""
    j = part.journal
    at, delta, category = j.index - part.first, j.delta, j.category  # (a replay journals in event order)
    for lo in range(0, cut, SLICE_ROWS):
        piece = part.events[lo:min(lo + SLICE_ROWS, cut)]
        kinds, on_gpu = piece["kind"], piece["gpu"] >= 0
        oom = (kinds == int(Kind.ALLOC)) & (piece["result"] == CUDA_ERROR_OUT_OF_MEMORY) & on_gpu
        ok = np.isin(kinds, list(_SEGMENT)) & on_gpu & (piece["result"] == 0)
        sel = np.flatnonzero(ok | oom | (kinds == _T_ALLOC) | (kinds == _T_FREE))
        pid, ts, index = piece["pid"][sel], piece["ts"][sel], sel + lo
        phase = rec.phases.assign(pid.astype(np.int64), ts.astype(np.int64))
        rows = slice(*np.searchsorted(at, [lo, lo + len(piece)]).tolist())  # the slice's journal rows
        frees = (category[rows] == DRIVER) & (delta[rows] < 0)
        freed_at, freed = at[rows][frees], -delta[rows][frees]
        k = np.searchsorted(freed_at, index, side="right") - 1  # an event's last journal row, as a dict kept it
        size = np.zeros(len(sel), np.int64)
        if len(freed_at):
            hit = (k >= 0) & (freed_at[np.maximum(k, 0)] == index)
            size[hit] = freed[k[hit]]
        yield from zip(pid.tolist(), piece["gpu"][sel].tolist(), kinds[sel].tolist(), piece["api"][sel].tolist(),
                       ts.tolist(), piece["ptr"][sel].tolist(), piece["size"][sel].tolist(), oom[sel].tolist(),
                       phase.tolist(), piece["stack"][sel].tolist(), size.tolist())


def _nvml_free_before(nv: np.ndarray, gpu: int, ts: int) -> int:
    s = nv[(nv["gpu"] == gpu) & (nv["ts"] <= ts) & (nv["free"] >= 0)] if len(nv) else nv
    return int(s["free"][-1]) if len(s) else 0


def write_memory_viz(rec: Recording, path: Path, pid: int | None = None, max_entries: int = MAX_ENTRIES,
                     check: Callable[[Path], None] | None = None, at: int | None = None) -> tuple[list[Path], int]:
    """Write the snapshots: ``path`` itself for one process (or ``pid``), else ``<stem>.<pid><suffix>``
    beside it for each process. Returns the paths written (empty when no process used GPU memory)
    and how many early actions were left out (see :func:`snapshots`). ``check`` sees every path
    before the first is written (it raises to refuse one: the names depend on the trace's processes)."""
    snaps, dropped = snapshots(rec, max_entries, at)
    if pid is not None:
        snaps = {p: s for p, s in snaps.items() if p == pid}
    targets = {path if len(snaps) == 1 else path.with_name(f"{path.stem}.{p}{path.suffix or '.pickle'}"): snap
               for p, snap in sorted(snaps.items())}
    for target in targets if check else ():
        check(target)
    if not targets:
        return [], dropped
    # the folder reached once (its path walked safely), each file made in it: a process each,
    # 100,000 of them on a host of short processes (walking the path for each took most of the export)
    folder = open_folder(path.parent)
    try:
        for target, snap in targets.items():
            fd, _ = create_in(folder, target.name, shown=str(target))
            made = os.fstat(fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    pickle.dump(snap, f)
            except BaseException:  # a cut pickle left behind would be read as a whole snapshot
                with contextlib.suppress(OSError):
                    remove_made(folder, target.name, made)
                raise
    finally:
        os.close(folder)
    return list(targets), dropped
