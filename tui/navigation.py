"""Where the cursor can jump, and what it lands on: markers, phase begins, failures, big
allocations, and the place a trace opens at (the answer's failure and window, else the highest peak).

:class:`Landmarks` indexes the failed calls and big allocations as the model reads events (a few
numpy appends per chunk). Once the source has the trace's answer (:mod:`memrec.analysis.report.answer`,
the model ``memrec report`` prints first), the failures are the answer's: every failure the report
counts (failed driver calls, SGLang's KV sizing on each rank, error markers) and no other. Before
(the answer comes after the replay) and live, they are the failed driver calls read so far. The
jump functions read the model and return a :class:`Landing`, which names what is there ("marker
load_weights begin · tp0") for the status line.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any
from typing import Callable
from typing import Protocol

import numpy as np

from memrec.analysis.report.answer import Answer
from memrec.analysis.report.answer import Failure
from memrec.analysis.report.answer import Window
from memrec.analysis.diff.build import Verdict
from memrec.analysis.diff.build import align_markers
from memrec.engine.phases import NO_PHASE
from memrec.terms.columns import failed_calls
from memrec.terms.events import Kind
from memrec.terms.events import OWNED_CATEGORIES
from memrec.terms.events import cu_result_name
from memrec.tui.filters import API_NAMES
from memrec.engine.series import Grow
from memrec.terms.units import fmt_bytes

#: Kinds that allocate (the "big allocation" jumps look at these).
ALLOC_KINDS = np.array([Kind.ALLOC, Kind.VMM_CREATE, Kind.HOST_ALLOC, Kind.IPC_OPEN, Kind.HOST_REGISTER], dtype=np.uint16)
#: Allocations of at least this many bytes are remembered for "next big allocation" (key b).
BIG_MIN = 1 << 30
#: What each jump is called when there is none.
JUMP_NAMES = {"marker": "marker", "phase": "phase", "failure": "failure", "big": "big allocation"}


@dataclass(frozen=True)
class Landing:
    """Where a jump put the cursor: the time, the GPU it concerns (None: any), and what is there
    (for a failed call, ``failure``: where it happened, "in kv_cache · tp1", which the status line
    writes after the call's name and result). Where the trace opened on its answer: ``cause``, the
    answer's cause line (``text`` is then its headline), and ``window``, the time it zooms to."""

    ts: int
    gpu: int | None
    text: str
    failure: bool = False
    cause: tuple[str, ...] = ()  # the parts of a Line: the first, then details while they fit
    window: Window | None = None


class TraceModel(Protocol):
    """What the jumps read of :class:`memrec.tui.model.TraceModel` (which holds the landmarks)."""

    lock: Any
    markers: list
    series: dict
    landmarks: Landmarks

    def phase_index(self) -> Any: ...

    def pid_label(self, pid: int) -> str: ...

    def gpu_pids(self, gpu: int) -> list[int]: ...

    def gpu_ids(self) -> list[int]: ...


class Landmarks:
    """Failed driver calls (as ``memrec report`` counts them: ``failed_calls``) and big
    successful allocations, in trace order, fed chunk by chunk by the model."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fail = {k: Grow(np.int64) for k in ("seq", "gpu", "api", "result", "pid")}
        self._fail_ts = Grow(np.uint64)
        self._big = {k: Grow(np.int64) for k in ("seq", "gpu", "size", "pid")}
        self._big_ts = Grow(np.uint64)
        #: The trace's answer, once the source has it: its failures replace the failed calls.
        self.answer: Answer | None = None

    def set_answer(self, answer: Answer) -> None:
        """From now on the failures are ``answer``'s (see the module)."""
        with self._lock:
            self.answer = answer

    def _answer_failures(self, gpu: int | None) -> list:
        """The answer's failures on ``gpu`` (or of unknown GPU; all for None), in time order."""
        return [f for f in self.answer.failures if gpu is None or f.gpu is None or f.gpu == gpu]

    def add(self, column: Callable[[str], np.ndarray], start: int) -> None:
        """Index a chunk of events whose first is ``start`` (``column(name)`` reads one column)."""
        result, size = column("result"), column("size")
        bad = np.flatnonzero(failed_calls({"result": result, "kind": column("kind")}))
        big = np.flatnonzero(size >= BIG_MIN)
        big = big[(result[big] == 0) & np.isin(column("kind")[big], ALLOC_KINDS)]
        with self._lock:
            for rows, table, tss in ((bad, self._fail, self._fail_ts), (big, self._big, self._big_ts)):
                if not len(rows):
                    continue
                table["seq"].extend(rows + start)
                tss.extend(column("ts")[rows])
                for name, grow in table.items():
                    if name != "seq":
                        grow.extend(column(name)[rows])

    def drop_before_seq(self, seq: int) -> None:
        """Live mode: forget what lies before event ``seq``."""
        with self._lock:
            for table, ts in ((self._fail, self._fail_ts), (self._big, self._big_ts)):
                k = int(np.searchsorted(table["seq"].a, seq))
                for g in table.values():
                    g.drop_front(k)
                ts.drop_front(k)

    def count(self) -> int:
        """Failures: the answer's, else the failed calls seen."""
        return len(self.answer.failures) if self.answer is not None else self._fail_ts.n

    def _failed_on(self, gpu: int | None) -> np.ndarray:
        """Indices of the failed calls on ``gpu`` or of unknown GPU (all for None)."""
        if gpu is None:
            return np.arange(self._fail_ts.n)
        g = self._fail["gpu"].a
        return np.flatnonzero((g == gpu) | (g < 0))

    def failures(self, gpu: int | None, t0: int, t1: int) -> np.ndarray:
        """Timestamps of failed calls in [t0, t1) (on ``gpu``, or unknown GPU)."""
        with self._lock:
            if self.answer is not None:
                tss = np.array([f.ts for f in self._answer_failures(gpu)], dtype=np.uint64)
            else:
                tss = self._fail_ts.a[self._failed_on(gpu)]
            return tss[(tss >= t0) & (tss < t1)]

    def failure_text(self, ts: int, gpu: int | None = None) -> str | None:
        """What failed at ``ts`` (on ``gpu``, or unknown GPU): ``cuMemCreate: CUDA_ERROR_NOT_PERMITTED``
        (several: the first, and how many more). With the answer: its failure's words,
        ``KV cache sizing: Not enough memory``."""
        with self._lock:
            if self.answer is not None:
                at_ts = [f for f in self._answer_failures(gpu) if f.ts == ts]
                if not at_ts:
                    return None
                more = f" (+{len(at_ts) - 1} more)" if len(at_ts) > 1 else ""
                return f"{at_ts[0].what}{more}"
            idx = self._failed_on(gpu)
            at = idx[self._fail_ts.a[idx] == np.uint64(max(ts, 0))]
            if not len(at):
                return None
            api, result = int(self._fail["api"].a[at[0]]), int(self._fail["result"].a[at[0]])
        more = f" (+{len(at) - 1} more)" if len(at) > 1 else ""
        return f"{API_NAMES.get(api, f'api {api}')}: {cu_result_name(result)}{more}"

    def next_answer_failure(self, ts: int, forward: bool, gpu: int | None = None) -> Failure | None:
        """With the answer: its next (or previous) failure after ``ts``, or None (also without it)."""
        with self._lock:
            if self.answer is None:
                return None
            mine = self._answer_failures(gpu)
            i = next_index([f.ts for f in mine], ts, forward)
            return None if i is None else mine[i]

    def next_failure(self, ts: int, forward: bool, gpu: int | None = None) -> tuple[int, int, int] | None:
        """The next (or previous) failure after ``ts``: (ts, pid, gpu), or None."""
        hit = self.next_answer_failure(ts, forward, gpu)
        if hit is not None or self.answer is not None:
            return None if hit is None else (hit.ts, hit.pid, -1 if hit.gpu is None else hit.gpu)
        with self._lock:
            j = _next_among(self._fail_ts.a, self._failed_on(gpu), ts, forward)
            return None if j is None else (int(self._fail_ts.a[j]), int(self._fail["pid"].a[j]), int(self._fail["gpu"].a[j]))

    def next_big(self, ts: int, forward: bool, gpu: int | None = None, min_size: int = BIG_MIN) -> tuple[int, int, int] | None:
        """The next (or previous) successful allocation of ``min_size`` or more: (ts, pid, size)."""
        with self._lock:
            m = self._big["size"].a >= min_size
            if gpu is not None:
                m &= self._big["gpu"].a == gpu
            j = _next_among(self._big_ts.a, np.flatnonzero(m), ts, forward)
            return None if j is None else (int(self._big_ts.a[j]), int(self._big["pid"].a[j]), int(self._big["size"].a[j]))


def _next_among(tss: np.ndarray, idx: np.ndarray, ts: int, forward: bool) -> int | None:
    """Of the rows ``idx`` (in time order), the one :func:`next_index` picks by their ``tss``."""
    i = next_index(tss[idx], ts, forward)
    return None if i is None else int(idx[i])


def next_index(keys: Any, ts: int, forward: bool) -> int | None:
    """Index of the first key after ``ts`` (``forward``) or the last one before it, in sorted ``keys``."""
    keys = np.asarray(keys, dtype=np.uint64)
    if not len(keys):
        return None
    t = np.uint64(max(ts, 0))
    if forward:
        i = int(np.searchsorted(keys, t, side="right"))
        return i if i < len(keys) else None
    i = int(np.searchsorted(keys, t, side="left")) - 1
    return i if i >= 0 else None


def _where(model: TraceModel, pid: int, ts: int) -> str:
    """``in kv_cache · tp1``: the phase ``pid`` was in at ``ts`` and its rank label."""
    phase = model.phase_index().phase_of(pid, ts) or NO_PHASE
    return f"in {phase} · {model.pid_label(pid)}"


def jump(model: TraceModel, what: str, ts: int, forward: bool, gpu: int | None) -> Landing | None:
    """The next (``forward``) or previous marker, phase begin, failed call or big allocation
    (``what``: a key of :data:`JUMP_NAMES`) from ``ts``, on ``gpu`` (None: any)."""
    if what == "marker":
        markers = list(model.markers)
        i = next_index([m.ts for m in markers], ts, forward)
        if i is None:
            return None
        m = markers[i]
        phase = "" if m.phase == "instant" else f" {m.phase}"
        return Landing(m.ts, gpu, f"marker {m.name}{phase} · {model.pid_label(m.pid)}")
    if what == "phase":
        spans = [s for s in model.phase_index().spans if s.end != s.begin and not s.resumed]
        if gpu is not None:
            pids = set(model.gpu_pids(gpu))
            if pids:
                spans = [s for s in spans if s.pid in pids or s.gpu == gpu] or spans
        spans.sort(key=lambda s: s.begin)
        i = next_index([s.begin for s in spans], ts, forward)
        if i is None:
            return None
        at = spans[i].begin
        names = sorted({f"{s.name} · {model.pid_label(s.pid)}" for s in spans if s.begin == at})
        return Landing(at, gpu, "phase " + ", ".join(names))
    if what == "failure":
        known = model.landmarks.next_answer_failure(ts, forward, gpu)
        if known is not None:  # the answer's own words: its phase and rank
            where = f"in {known.phase} · {known.who}" if known.phase else known.who
            return Landing(known.ts, gpu, where, failure=True)
        hit = model.landmarks.next_failure(ts, forward, gpu)
        if hit is None:
            return None
        return Landing(hit[0], gpu, _where(model, hit[1], hit[0]), failure=True)
    hit = model.landmarks.next_big(ts, forward, gpu)
    if hit is None:
        return None
    return Landing(hit[0], gpu, f"{fmt_bytes(hit[2])} allocated {_where(model, hit[1], hit[0])}")


def answer(model: TraceModel) -> Landing | None:
    """Where a trace opens: the answer's failure (else the end of its window, the peak) on its GPU,
    named by its headline and cause, with the window to zoom to, once the source has the answer.
    Before: its first failed driver call (on the GPU it failed on), else the first instant of the
    highest traced peak over all GPUs; None for an empty trace. That peak is of owned bytes, as the
    report's "peak traced" (peers' memory mapped by IPC is the exporter's, drawn above the stack but
    never counted), and of what has been replayed so far."""
    known = model.landmarks.answer
    if known is not None and known.window is not None:
        w = known.window
        f = known.failure
        gpu = w.gpu if f is None or f.gpu is None else f.gpu
        cause = known.cause.parts if known.cause is not None else ()
        return Landing(w.end_ts if f is None else f.ts, gpu, known.headline.short, failure=f is not None,
                       cause=cause, window=w)
    hit = model.landmarks.next_failure(-1, True)
    if hit is not None:
        ts, pid, gpu = hit
        if gpu < 0:  # a call that failed before naming its device: the GPU its process used
            gpu = next((g for g in model.gpu_ids() if pid in model.gpu_pids(g)), -1)
        return Landing(ts, gpu if gpu >= 0 else None, _where(model, pid, ts), failure=True)
    best: tuple[int, int, int] | None = None  # (bytes, gpu, ts)
    with model.lock:
        for g, series in model.series.items():
            if not len(series):
                continue
            owned = np.sum([series.column(c) for c in OWNED_CATEGORIES], axis=0)
            i = int(np.argmax(owned))
            peak = (int(owned[i]), -g, int(series.ts.a[i]))
            best = peak if best is None or peak > best else best
    if best is None or best[0] <= 0:
        return None
    return Landing(best[2], -best[1], f"peak {fmt_bytes(best[0])} on GPU{-best[1]}")


def opening(model: TraceModel, other: TraceModel | None, verdict: Verdict | None, alignment: Alignment) -> Landing | None:
    """Where the view opens: :func:`answer`; in diff mode, ``memrec diff``'s verdict (its headline,
    its first line as the cause) at the failing run's answer (the other run's, moved onto this
    one's clock by the ``alignment``, when only the other run failed)."""
    where = answer(model)
    if verdict is None or other is None:
        return where
    cause = verdict.lines[:1]
    theirs = answer(other)
    if verdict.failing == "b" and theirs is not None and theirs.window is not None:
        s = alignment.shift
        w = dataclasses.replace(theirs.window, start_ts=theirs.window.start_ts - s, end_ts=theirs.window.end_ts - s)
        return dataclasses.replace(theirs, ts=theirs.ts - s, text=verdict.headline, cause=cause, window=w)
    if where is None:
        return None
    return dataclasses.replace(where, text=verdict.headline, cause=cause, failure=verdict.failing is not None)


@dataclass(frozen=True)
class Alignment:
    """How ``memrec tui A --diff B`` lines B up with A: B's time = A's time + ``shift``."""

    shift: int
    text: str  # what both runs were aligned on, for the header


def align(base: TraceModel, other: TraceModel, base_start: int, other_start: int) -> Alignment:
    """Align two traces as ``plot --diff`` does (:func:`memrec.analysis.diff.build.align_markers`: on
    SGLang's KV sizing, else on their first common marker): two runs of one server start their
    phases at different offsets from the first event, so aligning on the start would compare
    different moments. Without a common marker: on the starts."""
    common = align_markers(base.markers, other.markers)
    if common is None:
        return Alignment(other_start - base_start, "aligned on the start (no common marker)")
    name, phase, ts_a, ts_b = common
    label = "" if phase == "instant" else f" {phase}"
    return Alignment(ts_b - ts_a, f"aligned on {name}{label}")
