"""The KV sizing windows of SGLang ranks: what every process took before the memory baseline and
between the baseline and the KV sizing, per GPU.

SGLang sizes its KV cache from what is free at the sizing minus what was free at the baseline, so
memory taken in between lowers the budget one for one. ``memrec report``'s SGLang section
(:mod:`memrec.analysis.sglang.section`) and ``memrec diff`` (:mod:`memrec.analysis.diff.build`) both
read these windows. Pure: markers, :class:`~memrec.engine.phases.Phases` and the replay's
:class:`~memrec.engine.journal.Journal` in, rows of exact byte counts (:class:`WindowRow`) out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field

import numpy as np

from memrec.analysis.sglang.kv_budget import PROFILERS
from memrec.analysis.sglang.kv_budget import any_named
from memrec.analysis.sglang.kv_budget import KvBudget
from memrec.analysis.sglang.kv_budget import kv_budgets
from memrec.analysis.sections import Section
from memrec.analysis.sections import hidden
from memrec.analysis.text import seconds
from memrec.engine.group import group
from memrec.engine.group import group_sum
from memrec.engine.journal import Journal
from memrec.engine.phases import NO_PHASE
from memrec.engine.phases import Phases
from memrec.terms.events import CATEGORIES
from memrec.terms.events import OWNED
from memrec.terms.events import Marker
from memrec.terms.ranks import rank_labels

WEIGHTS = "load_weights"
MAPPED = "ipc_mapped"


# ------------------------------------------------------------------------------- KV sizing times


@dataclass(frozen=True)
class KvTimes:
    """When one scheduler process took its memory baseline and sized its KV cache."""

    pid: int
    gpu: int | None
    baseline_ts: int | None
    sizing_ts: int | None  # the measurement of available_after_weights (or the kv_budget span)


@dataclass
class _Seen:
    """What one process's markers said so far, in time order (:func:`kv_times`)."""

    measured: list[int] = field(default_factory=list)  # gpu_memory_measured by a profiler
    baseline: int | None = None  # memory_baseline
    dist_baseline: int | None = None  # dist_init's end with pre_model_load_memory (older hooks)
    kv_begin: int | None = None
    kv_end: int | None = None
    gpu: int | None = None


#: The names without which :func:`kv_times` finds no time.
_TIMES = frozenset({"memory_baseline", "dist_init", "kv_budget"})


def kv_times(markers: Iterable[Marker]) -> dict[int, KvTimes]:
    """Per pid (target runner, not draft): the baseline and the last KV sizing."""
    markers = markers if isinstance(markers, list) else list(markers)
    if not any_named(markers, _TIMES):
        return {}
    per: dict[int, _Seen] = {}
    for m in sorted(markers, key=lambda m: m.ts):
        values = m.values or {}
        if values.get("is_draft_worker"):
            continue
        d = per.setdefault(m.pid, _Seen())
        if m.name == "memory_baseline" and m.phase in ("end", "instant"):
            d.baseline = m.ts
            d.gpu = m.gpu if m.gpu is not None else d.gpu
        elif m.name == "dist_init" and m.phase == "end" and "pre_model_load_memory" in values:
            d.dist_baseline = m.ts
        elif m.name == "gpu_memory_measured" and str(values.get("caller", "")).endswith(PROFILERS):
            d.measured.append(m.ts)
        elif m.name == "kv_budget" and m.phase == "begin":
            d.kv_begin = m.ts
        elif m.name == "kv_budget" and m.phase in ("end", "instant"):
            d.kv_end = m.ts
            if m.gpu is not None:
                d.gpu = m.gpu
    out = {}
    for pid, d in per.items():
        baseline = d.baseline if d.baseline is not None else d.dist_baseline
        end = d.kv_end
        if baseline is None and end is None:
            continue
        sizing = None
        if end is not None:
            begin = d.kv_begin
            measured = [t for t in d.measured if t <= end and (baseline is None or t >= baseline)]
            # The measurement is inside the span (0.5.10, 0.5.23) or just before it (the stand-in).
            sizing = measured[-1] if measured else (begin if begin is not None and begin <= end else end)
        out[pid] = KvTimes(pid, d.gpu, baseline, sizing)
    return out


# ----------------------------------------------------------------------------------------- windows


@dataclass
class WindowRow(Section):
    """What one process took in one phase within a window on one GPU: net bytes per category,
    ``owned`` (``ipc_mapped`` left out) and ``mapped``; ``weights``: the phase loads the weights."""

    pid: int
    label: str  # the process's rank label ("" without one)
    phase: str  # the phase's path
    name: str  # its last part
    by_category: dict[str, int]
    owned: int = 0
    mapped: int = 0
    weights: bool = False
    first_ts: int = hidden()  # its first change in the window (the rows' order; not in the JSON)


def window_rows(
    journal: Journal, phases: Phases, gpu: int, t0: int | None, t1: int | None, labels: dict[int, str],
    skip: np.ndarray | None = None,
) -> list[WindowRow]:
    """Net bytes every process changed on ``gpu`` in ``(t0, t1]``, per (process, phase) and category.

    ``t0`` None: from the start; ``t1`` None: to the end. ``skip``: journal rows to leave out
    (a boolean mask). Rows in order of their first change; ``owned`` leaves ``ipc_mapped`` out.
    """
    if len(journal) == 0:
        return []
    m = journal.gpu == gpu
    if t0 is not None:
        m &= journal.ts > t0
    if t1 is not None:
        m &= journal.ts <= t1
    if skip is not None:
        m &= ~skip
    idx = np.nonzero(m)[0]
    if not len(idx):
        return []
    pids = journal.pid[idx]
    ts = journal.ts[idx]
    ph = phases.assign(pids, ts)
    # Sum per (pid, phase id, category) with numpy; the loop below runs once per group.
    inverse, (gp, gph, gc) = group([pids, ph, journal.category[idx]])
    sums = group_sum(inverse, len(gp), journal.delta[idx])
    first = np.full(len(gp), len(idx), dtype=np.int64)
    np.minimum.at(first, inverse, np.arange(len(idx)))
    rows: dict[tuple[int, str], WindowRow] = {}
    for p, phase_id, c, i, d in zip(gp.tolist(), gph.tolist(), gc.tolist(), first.tolist(), sums.tolist()):
        path = NO_PHASE if phase_id < 0 else phases.phases[phase_id].path
        t = int(ts[i])
        row = rows.get((p, path))
        if row is None:
            row = rows[(p, path)] = WindowRow(pid=p, label=labels.get(p, ""), phase=path, name=path.rsplit("/", 1)[-1],
                                              by_category={}, weights=WEIGHTS in path.split("/"), first_ts=t)
        row.first_ts = min(row.first_ts, t)
        cat = CATEGORIES[c]
        row.by_category[cat] = row.by_category.get(cat, 0) + d
        if cat in OWNED:
            row.owned += d
        else:
            row.mapped += d
    out = [r for r in rows.values() if any(r.by_category.values())]
    for r in out:
        r.by_category = {c: r.by_category[c] for c in CATEGORIES if r.by_category.get(c)}
    out.sort(key=lambda r: (r.first_ts, r.pid, r.phase))
    return out


@dataclass
class ShownWindow(Section):
    """A :class:`KvWindow` as the report shows it: times also in seconds since the trace's start."""

    gpu: int
    pids: list[int]
    baseline_ts: int | None
    sizing_ts: int | None
    baseline_s: float | None
    sizing_s: float | None
    before: list[WindowRow]
    between: list[WindowRow]


@dataclass(frozen=True)
class KvWindow:
    """One GPU's KV sizing: the ranks sized on it and what was allocated before and since the baseline."""

    gpu: int
    pids: tuple[int, ...]
    baseline_ts: int | None  # the earliest baseline of the ranks on this GPU
    sizing_ts: int | None  # the latest sizing of the ranks on this GPU
    before: list[WindowRow]  # (start, baseline]: lowers pre_model_load_memory (and the slack)
    between: list[WindowRow]  # (baseline, sizing]: lowers available_after_weights, so rest, one for one

    def shown(self, start: int) -> ShownWindow:
        """The window with its times also in seconds since ``start``."""
        return ShownWindow(
            gpu=self.gpu, pids=list(self.pids), baseline_ts=self.baseline_ts, sizing_ts=self.sizing_ts,
            baseline_s=None if self.baseline_ts is None else seconds(self.baseline_ts - start),
            sizing_s=None if self.sizing_ts is None else seconds(self.sizing_ts - start),
            before=self.before, between=self.between,
        )


def rank_gpus(markers: list[Marker], journal: Journal, budgets: list[KvBudget]) -> dict[int, int]:
    """Per SGLang pid, the GPU it sized its KV cache on: from its markers, else where it held the most."""
    times = kv_times(markers)
    out = {pid: t.gpu for pid, t in times.items() if t.gpu is not None}
    for b in budgets:
        if not b.draft and b.gpu is not None:
            out.setdefault(b.pid, b.gpu)
    for pid in times:
        if pid in out or len(journal) == 0:
            continue
        sel = (journal.pid == pid) & (journal.delta > 0)
        if sel.any():
            gpus, inv = np.unique(journal.gpu[sel], return_inverse=True)
            sums = np.bincount(inv.reshape(-1), weights=journal.delta[sel])
            out[pid] = int(gpus[int(np.argmax(sums))])
    return out


def kv_windows(
    markers: list[Marker], phases: Phases, journal: Journal, budgets: list[KvBudget] | None = None,
    labels: dict[int, str] | None = None, skip: np.ndarray | None = None,
) -> dict[int, KvWindow]:
    """Per GPU with a KV sizing: what every process allocated before the baseline and between the
    baseline and the sizing (the ranks on one GPU share one window: earliest baseline, latest sizing)."""
    budgets = kv_budgets(markers) if budgets is None else budgets
    labels = rank_labels(markers) if labels is None else labels
    times = kv_times(markers)
    gpus = rank_gpus(markers, journal, budgets)
    per_gpu: dict[int, list[KvTimes]] = {}
    for pid, t in times.items():
        if pid in gpus:
            per_gpu.setdefault(gpus[pid], []).append(t)
    out = {}
    for g, ts in sorted(per_gpu.items()):
        bases = [t.baseline_ts for t in ts if t.baseline_ts is not None]
        sizes = [t.sizing_ts for t in ts if t.sizing_ts is not None]
        base = min(bases) if bases else None
        size = max(sizes) if sizes else None
        before = window_rows(journal, phases, g, None, base, labels, skip) if base is not None else []
        between = window_rows(journal, phases, g, base, size, labels, skip) if base is not None and size is not None else []
        out[g] = KvWindow(g, tuple(sorted(t.pid for t in ts)), base, size, before, between)
    return out
