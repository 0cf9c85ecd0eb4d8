"""``memrec diff``: two runs compared phase by phase, rank by rank and GPU by GPU.

:func:`diff_traces` replays both traces and returns a :class:`~memrec.analysis.diff.model.Diff`
(``to_json()`` is ``diff --json``); :func:`memrec.analysis.diff.text.render_diff` turns it into text. Processes are matched by rank (``dp``, ``pp``, ``tp`` from the markers, else from
``ProcessInfo.rank``), never by pid; processes without a rank are pooled as ``(no rank)``. GPUs
are matched by index.

The diff holds:

- ``related``: whether the two runs are one workload (:mod:`memrec.analysis.diff.related`: commands,
  models, phase names); when they are not, the verdict says so, with why, and each run's own
  outcome, instead of explaining one run by the other;
- ``verdict``: a headline and a few lines that answer "why does one run fail when the other
  works": which run fails (SGLang's error, a KV budget <= 0, or a driver call that ran out of
  memory) and with what error, how the KV budget moved on every rank
  (``Δrest = Δavailable_after_weights − Δslack``), and which phases' allocations between the
  memory baseline and the KV sizing (or before the baseline) changed;
- ``kv``: the KV budget of every rank side by side (:func:`memrec.analysis.sglang.kv_budget.compare_budgets`);
- ``windows``: per GPU, what each (phase, rank) allocated between the baseline and the KV sizing
  and before the baseline, in both runs;
- ``phases``: per phase × rank × GPU × category, the net bytes in each run and the delta
  (memory freed implicitly when a process exited is left out: it belongs to no phase);
- ``failures``: SGLang errors, KV budgets that came out ``<= 0`` and failed driver calls, each
  marked as in both runs or in one only;
- ``tensors``: per phase × rank × GPU, the tensor blocks' peak allocated and reserved bytes in
  each run (traces recorded with ``memrec daemon --tensors``; empty otherwise);
- ``sites`` (runs with stacks only): the allocation sites whose held bytes changed
  (:mod:`memrec.analysis.diff.sites`);
- ``untraced``: per rank and GPU, the untraced band's split (context, module code, pools, before
  recording, unexplained) and the contexts bound in each run (:mod:`memrec.analysis.untraced.diff`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any
from typing import Iterable
from typing import NamedTuple

import numpy as np

from memrec.analysis.diff.model import Diff
from memrec.analysis.diff.model import DiffSide
from memrec.analysis.diff.model import DiffVerdict
from memrec.analysis.diff.model import DiffWindows
from memrec.analysis.diff.model import Failure
from memrec.analysis.diff.model import KvChange
from memrec.analysis.diff.model import PhaseChange
from memrec.analysis.diff.model import TensorChange
from memrec.analysis.diff.model import WindowChange
from memrec.analysis.diff.model import WindowDiff
from memrec.analysis.sglang.kv_budget import KvBudget
from memrec.analysis.sglang.kv_budget import kv_budgets
from memrec.analysis.sglang.kv_budget_diff import compare_budgets
from memrec.analysis.names import api_name
from memrec.analysis.names import result_name
from memrec.engine.phases import NO_PHASE
from memrec.engine.phases import Phases
from memrec.engine.phases import ATTRIBUTE_CHUNK
from memrec.engine.group import distinct
from memrec.engine.group import group
from memrec.engine.group import group_sum
from memrec.analysis.untraced.reconcile import reconcile
from memrec.engine.replay import initial_state
from memrec.engine.replay import trace_bounds
from memrec.engine.replay import trace_phases
from memrec.analysis.sglang.facts import CustomAllReduce
from memrec.analysis.sglang.facts import ProcessContext
from memrec.analysis.sglang.facts import custom_ar_facts
from memrec.analysis.sglang.facts import custom_ar_line
from memrec.analysis.sglang.facts import process_contexts
from memrec.analysis.diff.related import Relation
from memrec.analysis.diff.related import identity
from memrec.analysis.diff.related import relate
from memrec.analysis.sglang.windows import KvWindow
from memrec.analysis.sglang.windows import WindowRow
from memrec.analysis.sglang.windows import MAPPED
from memrec.terms.ranks import format_rank
from memrec.analysis.sglang.windows import kv_windows
from memrec.terms.ranks import marker_ranks
from memrec.terms.ranks import process_info_ranks
from memrec.analysis.sglang.windows import rank_gpus
from memrec.terms.ranks import rank_sort_key
from memrec.terms.ranks import shown_dims
from memrec.analysis.report.tensors import TensorSection
from memrec.analysis.report.tensors import TensorFeed
from memrec.analysis.report.sites import SitesSection
from memrec.analysis.report.sites import sites_feed
from memrec.analysis.diff.sites import SitesDiff
from memrec.analysis.diff.sites import diff_sites
from memrec.analysis.diff.sites import verdict_line
from memrec.analysis.text import human
from memrec.analysis.text import signed_human
from memrec.engine.journal import Journal
from memrec.terms.events import CUDA_ERROR_OUT_OF_MEMORY
from memrec.terms.events import OWNED
from memrec.engine.replay import APPLY_CHUNK
from memrec.engine.replay import Replay
from memrec.engine.source import TraceEvents
from memrec.engine.stream import replay_pass
from memrec.analysis.untraced.diff import UntracedCell
from memrec.analysis.untraced.diff import split_by_rank
from memrec.analysis.untraced.diff import untraced_rows
from memrec.terms.columns import failed_calls
from memrec.terms.events import CATEGORIES
from memrec.state.batch import Batch

DIFF_VERSION = 1
NO_RANK = "(no rank)"
#: Changes smaller than this are not named in the verdict.
MIN_NAMED = 1 << 20
#: How many changed phases the verdict names per window.
VERDICT_PHASES = 3
#: The result name of a driver call that ran out of memory: such a call makes its run a failed one.
OUT_OF_MEMORY = result_name(CUDA_ERROR_OUT_OF_MEMORY)

RankKey = tuple  # (dp, pp, tp) or () for processes without a rank


# ------------------------------------------------------------------------------------------ one run


@dataclass
class Run:
    """One trace, replayed and cut into what the diff compares."""

    name: str
    start: int
    phases: Phases
    journal: Journal
    exit_rows: np.ndarray  # journal rows caused by a process exit (implicit frees)
    rank_of: dict[int, RankKey]  # pid -> rank key
    budgets: list[KvBudget]
    windows: dict[int, KvWindow]
    events: Batch  # the replayed events the diff reads (memrec.engine.stream.KeptEvents), column by column
    untraced: dict[tuple[RankKey, int], UntracedCell]  # (rank, gpu) -> the untraced band (memrec.analysis.untraced.diff)
    paths: PathCodes  # the phases' paths as codes (PathCodes.of)
    contexts: list[ProcessContext] = dataclasses.field(default_factory=list)  # foreign CUDA contexts (facts.process_contexts)
    custom_ar: CustomAllReduce | None = None  # facts.custom_ar_facts
    tensors: TensorSection | None = None  # memrec.analysis.report.tensors.tensor_section (a --tensors trace)
    sites: SitesSection | None = None  # memrec.analysis.report.sites (a trace with stacks)


def _norm_rank(rank: dict[str, int]) -> RankKey:
    """(dp, pp, tp); a missing dp/pp is 0 when tp is known (SGLang sends None without DP/PP)."""
    if not rank:
        return ()
    if "tp" in rank:
        return (rank.get("dp", 0), rank.get("pp", 0), rank["tp"])
    return (rank.get("dp"), rank.get("pp"), rank.get("tp"))


def _norm_budget(b: KvBudget) -> KvBudget:
    if b.tp_rank is None:
        return b
    return dataclasses.replace(b, dp_rank=b.dp_rank or 0, pp_rank=b.pp_rank or 0)


def analyze(trace: Any, name: str, events: TraceEvents | None = None) -> Run:
    """Replay ``trace`` (its events' ``gpu`` get filled in) and gather what :func:`diff_traces` needs.

    ``events``: the trace's events when ``trace`` holds none (``memrec diff`` reads them from the
    file a record at a time, as the report does); default: ``trace.event_columns``.
    """
    if events is None:
        events = TraceEvents.of(trace.event_columns)
    census = events.census
    start, end = trace_bounds(trace, census)
    phases = trace_phases(trace, census)
    # the journal is kept whole (the windows and phases read it): as it grows, not a change per
    # event from the start (on a trace of tensor blocks, the driver's changes are few)
    replay = Replay(census.n, start, initial_state(trace)[0], capacity=min(census.n, APPLY_CHUNK))
    tensors = TensorFeed(phases, start, census.tensor_events, census.tensor_pids)
    sites = sites_feed(trace, events, phases, end)
    kept = replay_pass(trace, events, replay, [tensors] if sites is None else [tensors, sites])
    tl = replay.finish()
    j = tl.journal
    exit_rows = j.exit_mask(replay.exits)
    ranks = marker_ranks(trace.markers)
    rank_of: dict[int, RankKey] = {}
    for pid in set(trace.processes) | set(ranks) | {int(p) for p in np.unique(j.pid)}:
        info = trace.processes.get(pid)
        rank_of[pid] = _norm_rank(ranks.get(pid) or process_info_ranks(info.rank if info else None))
    budgets = [_norm_budget(b) for b in kv_budgets(trace.markers)]
    labels = {p: format_rank(_as_dict(k)) for p, k in rank_of.items() if k}
    windows = kv_windows(trace.markers, phases, j, budgets, labels, skip=exit_rows)
    ranked = [p for p, k in rank_of.items() if k]
    contexts = process_contexts(trace, ranked, rank_gpus(trace.markers, j, budgets), labels, kept.rows)
    untraced = split_by_rank(reconcile(trace, tl, phases, events=kept.rows, pids=census.pids), rank_of)
    return Run(name, start, phases, j, exit_rows, rank_of, budgets, windows, kept.rows, untraced, PathCodes.of(phases),
               [c for c in contexts if c.foreign], custom_ar_facts(trace.markers),
               tensors.section(trace.header, trace.trailer),
               sites.section(trace) if sites is not None else None)


def _as_dict(key: RankKey) -> dict[str, int]:
    return {s: v for s, v in zip(("dp", "pp", "tp"), key) if v is not None}


# ------------------------------------------------------------------------------------------ phases


def _phase_order(run: Run) -> list[str]:
    """The run's phase paths, by the first start of each (then by path)."""
    paths, code = run.paths
    first = np.full(len(paths), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, code, run.phases.table.start)  # (a step loop's 25,000 phases: no Python step each)
    f = first.tolist()
    return [paths[i] for i in sorted(range(len(paths)), key=lambda i: (f[i], paths[i]))]


class PathCodes(NamedTuple):
    """A run's distinct phase paths (first seen first) and each phase's index among them: the diff
    groups by path, and a step loop's 25,000 phases have a few dozen."""

    paths: list[str]
    code: np.ndarray  # by phase id

    @classmethod
    def of(cls, phases: Phases) -> PathCodes:
        index: dict[str, int] = {}
        code = [index.setdefault(path, len(index)) for path in phases.table.path]
        return cls(list(index), np.array(code, dtype=np.int64))


def _merge_order(a: list[str], b: list[str]) -> list[str]:
    """A's order, with B's other phases each placed after the phase that precedes it in B.

    Each of B's phases not in A follows the one just before it in B (placed by then), so each
    phase is followed by at most one of them: a chain per phase, walked once. (Inserting into a
    list, with list membership, took 7 s for each of two calls at 20,000 phases.)
    """
    placed = set(a)
    after: dict[str | None, str] = {}
    prev = None
    for path in b:
        if path not in placed:
            placed.add(path)
            after[prev] = path
        prev = path
    out: list[str] = []
    for head in (None, *a):
        if head is not None:
            out.append(head)
        while head in after:
            head = after[head]
            out.append(head)
    return out


def _phase_bytes(run: Run) -> tuple[dict[tuple, int], set[tuple]]:
    """(path, rank key, gpu, category) -> net bytes (exits left out); and which (path, rank) exist.

    The journal's rows are grouped by codes of their phase's path and their process's rank with
    numpy, a chunk of rows at a time (:data:`~memrec.engine.phases.ATTRIBUTE_CHUNK`, as the
    attribution by phase): a step loop's 25,000 phases have a few paths, and the diff sums by path,
    not by phase and process first."""
    j = run.journal.take(~run.exit_rows)
    t = run.phases.table  # columns: no object per phase or row
    paths, code = run.paths
    paths = list(paths)
    no_phase = paths.index(NO_PHASE) if NO_PHASE in paths else len(paths)
    if no_phase == len(paths):
        paths.append(NO_PHASE)
    pids = np.asarray(distinct(np.concatenate([j.pid.astype(np.int64), t.pid])), dtype=np.int64)
    rank_index: dict[RankKey, int] = {}
    pid_rank = np.array([rank_index.setdefault(run.rank_of.get(pid, ()), len(rank_index)) for pid in pids.tolist()],
                        dtype=np.int64)
    ranks = list(rank_index)
    phase_path = np.append(code, no_phase)  # phase -1 (no phase): the last
    parts = []
    for lo in range(0, len(j), ATTRIBUTE_CHUNK):
        pid = j.pid[lo : lo + ATTRIBUTE_CHUNK]
        path = phase_path[run.phases.assign(pid, j.ts[lo : lo + ATTRIBUTE_CHUNK])]
        inverse, keys = group([path, pid_rank[np.searchsorted(pids, pid)], j.gpu[lo : lo + ATTRIBUTE_CHUNK],
                               j.category[lo : lo + ATTRIBUTE_CHUNK]])
        parts.append(keys + [group_sum(inverse, len(keys[0]), j.delta[lo : lo + ATTRIBUTE_CHUNK])])
    out: dict[tuple, int] = {}
    if parts:
        cols = [np.concatenate(c) for c in zip(*parts)]
        inverse, (kp, kr, kg, kc) = group(cols[:4])
        net = group_sum(inverse, len(kp), cols[4])
        out = {(paths[p], ranks[r], g, CATEGORIES[c]): v
               for p, r, g, c, v in zip(kp.tolist(), kr.tolist(), kg.tolist(), kc.tolist(), net.tolist())}
    _, (pp, pr) = group([code, pid_rank[np.searchsorted(pids, t.pid)]])
    present = {(paths[p], ranks[r]) for p, r in zip(pp.tolist(), pr.tolist())}
    present |= {(k[0], k[1]) for k in out}
    return out, present


def _rank_label(key: RankKey, dims: tuple[str, ...], draft: bool = False) -> str:
    return format_rank(_as_dict(key), dims, draft) if key else NO_RANK


def _phase_rows(a: Run, b: Run, dims: tuple[str, ...]) -> list[PhaseChange]:
    bytes_a, present_a = _phase_bytes(a)
    bytes_b, present_b = _phase_bytes(b)
    order = _merge_order(_phase_order(a), _phase_order(b)) + [NO_PHASE]
    pos = {p: i for i, p in enumerate(order)}
    rows = []
    for key in set(bytes_a) | set(bytes_b):
        va, vb = bytes_a.get(key, 0), bytes_b.get(key, 0)
        if not va and not vb:
            continue
        path, rank, g, cat = key
        rows.append(PhaseChange(
            phase=path, rank=_rank_label(rank, dims), rank_key=list(rank), gpu=g, category=cat, owned=cat in OWNED,
            a=va if (path, rank) in present_a else None, b=vb if (path, rank) in present_b else None, delta=vb - va,
        ))
    rows.sort(key=lambda r: (pos.get(r.phase, len(order)), rank_sort_key(tuple(r.rank_key) + (None,) * 3),
                             r.gpu, CATEGORIES.index(r.category)))
    return rows


def _tensor_peaks(run: Run) -> dict[tuple, list[int]]:
    """(phase, rank key, gpu) -> [peak allocated, peak reserved] of tensor blocks (processes of a
    rank summed)."""
    out: dict[tuple, list[int]] = {}
    for r in run.tensors.rows if run.tensors else ():
        key = (r.phase, run.rank_of.get(r.pid, ()), r.gpu)
        acc = out.setdefault(key, [0, 0])
        acc[0] += r.peak_allocated
        acc[1] += r.peak_reserved
    return out


def _tensor_rows(a: Run, b: Run, dims: tuple[str, ...]) -> list[TensorChange]:
    """Per phase, rank and GPU: the tensor blocks' peak allocated and reserved in each run (None:
    no blocks there), and the deltas. Empty unless a run was recorded with --tensors."""
    pa, pb = _tensor_peaks(a), _tensor_peaks(b)
    order = _merge_order(_phase_order(a), _phase_order(b)) + [NO_PHASE]
    pos = {p: i for i, p in enumerate(order)}
    rows = []
    for key in set(pa) | set(pb):
        path, rank, g = key
        va, vb = pa.get(key), pb.get(key)
        rows.append(TensorChange(
            phase=path, rank=_rank_label(rank, dims), rank_key=list(rank), gpu=g,
            a_allocated=va[0] if va else None, b_allocated=vb[0] if vb else None,
            a_reserved=va[1] if va else None, b_reserved=vb[1] if vb else None,
            delta_allocated=(vb[0] if vb else 0) - (va[0] if va else 0),
            delta_reserved=(vb[1] if vb else 0) - (va[1] if va else 0),
        ))
    rows.sort(key=lambda r: (pos.get(r.phase, len(order)), rank_sort_key(tuple(r.rank_key) + (None,) * 3), r.gpu))
    return rows


# ------------------------------------------------------------------------------------------ windows


@dataclass
class _WindowSum:
    """One (phase, rank)'s rows of a window, summed over the rank's processes."""

    weights: bool
    owned: int = 0
    mapped: int = 0
    by_category: dict[str, int] = dataclasses.field(default_factory=dict)


def _window_table(rows: list[WindowRow], rank_of: dict[int, RankKey]) -> dict[tuple[str, RankKey], _WindowSum]:
    out: dict[tuple[str, RankKey], _WindowSum] = {}
    for r in rows:
        e = out.setdefault((r.phase, rank_of.get(r.pid, ())), _WindowSum(r.weights))
        e.owned += r.owned
        e.mapped += r.mapped
        for c, v in r.by_category.items():
            e.by_category[c] = e.by_category.get(c, 0) + v
    return out


def _window_diff(a: Run, b: Run, which: str, dims: tuple[str, ...]) -> list[WindowDiff]:
    """Per GPU: each (phase, rank) in window ``which`` ("between" | "before") of both runs."""
    out = []
    for g in sorted(set(a.windows) | set(b.windows)):
        wa, wb = a.windows.get(g), b.windows.get(g)
        ta = _window_table(getattr(wa, which) if wa else [], a.rank_of)
        tb = _window_table(getattr(wb, which) if wb else [], b.rank_of)
        rows = []
        order = _merge_order(list(dict.fromkeys(k[0] for k in ta)), list(dict.fromkeys(k[0] for k in tb)))
        keys = sorted(set(ta) | set(tb), key=lambda k: (order.index(k[0]), rank_sort_key(tuple(k[1]) + (None,) * 3)))
        for key in keys:
            ea, eb = ta.get(key), tb.get(key)
            rows.append(WindowChange(
                phase=key[0],
                rank=_rank_label(key[1], dims),
                weights=(ea or eb).weights,  # type: ignore[union-attr]
                a_owned=ea.owned if ea else None,
                b_owned=eb.owned if eb else None,
                a_mapped=ea.mapped if ea else None,
                b_mapped=eb.mapped if eb else None,
                a_by_category=ea.by_category if ea else {},
                b_by_category=eb.by_category if eb else {},
                delta_owned=(eb.owned if eb else 0) - (ea.owned if ea else 0),
                delta_mapped=(eb.mapped if eb else 0) - (ea.mapped if ea else 0),
            ))
        out.append(WindowDiff(gpu=g, in_a=wa is not None, in_b=wb is not None, rows=rows,
                              a_owned=sum(r.a_owned or 0 for r in rows), b_owned=sum(r.b_owned or 0 for r in rows)))
    return out


# ----------------------------------------------------------------------------------------- failures


def _failures(run: Run, dims: tuple[str, ...]) -> dict[tuple, Failure]:
    """Key -> failure: SGLang errors, KV budgets <= 0 without an error, failed driver calls."""
    out: dict[tuple, Failure] = {}
    t = run.phases.table
    for i in _erring(run.phases):
        err, name = t.values[i]["error"], t.name[i]
        rank = run.rank_of.get(int(t.pid[i]), ())
        label = _rank_label(rank, dims)
        key = ("sglang", label, name, str(err))
        out.setdefault(key, Failure("sglang_error", label, list(rank), phase=name, error=str(err))).count += 1
    for b in run.budgets:
        if not b.ok and not b.error:
            rank = run.rank_of.get(b.pid, ())
            label = _rank_label(rank, dims, b.draft)
            error = f"KV budget {b.rest_gib:.2f} GiB (<= 0)" if b.rest_gib is not None else "KV budget <= 0"
            out[("kv", label)] = Failure("kv_budget", label, list(rank), phase="kv_budget", error=error, count=1)
    ev = run.events
    if len(ev):
        for i in np.nonzero(failed_calls(ev))[0].tolist():
            e = ev[i]
            rank = run.rank_of.get(int(e["pid"]), ())
            label = _rank_label(rank, dims)
            api, result = api_name(int(e["api"])), result_name(int(e["result"]))
            key = ("driver", label, int(e["gpu"]), api, result)
            f = out.setdefault(key, Failure("driver_call", label, list(rank), gpu=int(e["gpu"]), api=api, result=result,
                                            bytes=0))
            f.count += 1
            f.bytes += int(e["size"])
    return out


def _erring(phases: Phases) -> list[int]:
    """The ids of the phases with an ``error`` value, in order (only phases with values are looked
    at: a step loop's have none)."""
    return [i for i, v in enumerate(phases.table.values) if v and v.get("error")]


def _sglang_failed(run: Run) -> bool:
    """SGLang said the run failed: an error in a phase, or a KV budget <= 0."""
    return bool(_erring(run.phases)) or any(not b.ok for b in run.budgets)


def _failed(run: Run, failures: dict[tuple, Failure]) -> bool:
    """A run failed when SGLang said so or the driver ran out of memory (which SGLang may never
    report: the process dies in the allocator, or a library catches the error)."""
    return _sglang_failed(run) or bool(_driver_ooms(failures.values()))


def _driver_ooms(failures: Iterable[Failure]) -> list[Failure]:
    """The failed driver calls that ran out of memory (a failed cuMemAlloc, cuMemCreate...)."""
    return [f for f in failures if f.kind == "driver_call" and f.result == OUT_OF_MEMORY]


# ------------------------------------------------------------------------------------------ verdict


def _what_failed(fails: list[Failure]) -> str:
    kv = [f for f in fails if f.kind in ("sglang_error", "kv_budget") and f.phase in ("kv_budget", "kv_pool")]
    pick = kv or [f for f in fails if f.kind != "driver_call"]
    if not pick:
        return _what_ran_out(_driver_ooms(fails))
    ranks = list(dict.fromkeys(f.rank for f in pick))
    errors = list(dict.fromkeys(f.error for f in pick))
    what = "KV sizing" if kv else f"{pick[0].phase}"
    return f"{what} failed on {', '.join(ranks)} ({' | '.join(errors)})"


def _what_ran_out(ooms: list[Failure]) -> str:
    """The driver's out-of-memory failures in a few words: which call, on which rank and GPU, how much."""
    if not ooms:
        return "?"
    n = sum(f.count for f in ooms)
    # "TP0 (GPU 0)"; a process without a rank (no SGLang markers) by its GPU alone
    where = list(dict.fromkeys(f"GPU {f.gpu}" if f.rank == NO_RANK else f"{f.rank} (GPU {f.gpu})" for f in ooms))
    apis = list(dict.fromkeys(f.api for f in ooms))
    return (f"{', '.join(apis)} ran out of GPU memory on {', '.join(where[:4])}{', …' if len(where) > 4 else ''}: "
            f"{n} failed call{'' if n == 1 else 's'} for {human(sum(f.bytes for f in ooms))} ({OUT_OF_MEMORY})")


def _kv_lines(kv: list[KvChange], an: str, bn: str) -> list[str]:
    pairs = [d for d in kv if d.budgets.before is not None and d.budgets.after is not None
             and "rest_gib" in d.budgets.deltas]
    if not pairs:
        return []
    groups: dict[tuple, list[KvChange]] = {}
    for d in pairs:
        a, b, dl = d.budgets.before, d.budgets.after, d.budgets.deltas
        key = tuple(round(x, 2) for x in (a.rest_gib, b.rest_gib, dl.get("available_gpu_memory", 0.0),  # type: ignore[union-attr]
                                           dl.get("slack_gib", 0.0), dl.get("pre_model_load_memory", 0.0)))
        groups.setdefault(key, []).append(d)
    lines = []
    for (ra, rb, da, ds, dp), ds_ in list(groups.items())[:4]:
        where = "on every rank" if len(groups) == 1 and len(pairs) > 1 else "on " + ", ".join(d.label for d in ds_)
        before, after = ds_[0].budgets.before, ds_[0].budgets.after
        ta, tb = before.tokens, after.tokens  # type: ignore[union-attr]
        tokens = f"; tokens {ta:,} → {tb:,}" if ta is not None and tb is not None else ""
        lines.append(
            f"KV budget: rest {ra:.2f} GiB → {rb:.2f} GiB {where} (Δrest {rb - ra:+.2f} GiB = "
            f"Δavailable_after_weights {da:+.2f} GiB − Δslack {ds:+.2f} GiB){tokens}"
        )
        if abs(dp) >= 0.005:
            lines.append(
                f"  pre_model_load_memory {before.pre_model_load_memory:.2f} → "  # type: ignore[union-attr]
                f"{after.pre_model_load_memory:.2f} GiB ({dp:+.2f} GiB): memory taken before the baseline changed"  # type: ignore[union-attr]
            )
    if len(groups) > 4:
        lines.append(f"  ({len(groups) - 4} more rank groups in the KV table)")
    return lines


def _gpus_text(gpus: list[int]) -> str:
    return f"GPU {gpus[0]}" if len(gpus) == 1 else "each of GPUs " + ", ".join(map(str, gpus))


@dataclass
class _PhaseMove:
    """How one phase's allocations in a window moved from A to B, over its ranks."""

    delta: int = 0
    mapped: int = 0
    a: int | None = None  # owned in A; None: the phase did not run there
    b: int | None = None
    ranks: list[str] = dataclasses.field(default_factory=list)
    cats: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, r: WindowChange) -> None:
        self.delta += r.delta_owned
        self.mapped += r.delta_mapped
        if r.a_owned is not None:
            self.a = (self.a or 0) + r.a_owned
        if r.b_owned is not None:
            self.b = (self.b or 0) + r.b_owned
        if r.delta_owned:
            self.ranks.append(f"{r.rank} {signed_human(r.delta_owned)}")
        for c in set(r.a_by_category) | set(r.b_by_category):
            if c != MAPPED:
                self.cats[c] = self.cats.get(c, 0) + r.b_by_category.get(c, 0) - r.a_by_category.get(c, 0)

    def line(self, p: str, where: str, an: str, bn: str) -> str:
        """What the phase (path ``p``) took, in the window ``where``, with ``{gpus}`` left to fill in."""
        name = "allocations outside any phase" if p == NO_PHASE else p.rsplit("/", 1)[-1]
        if self.a is None:
            took = f"{name} took {human(self.b or 0)} on {{gpus}} in {bn}; it does not run in {an}"
        elif self.b is None:
            took = f"{name} took {human(self.a)} on {{gpus}} in {an}; it does not run in {bn}"
        else:
            took = f"{name} took {human(self.b)} on {{gpus}} in {bn}, {human(self.a)} in {an} ({signed_human(self.delta)})"
        details = [", ".join(self.ranks)] if len(self.ranks) > 1 else []
        details += [", ".join(f"{c} {signed_human(v)}" for c, v in self.cats.items() if v)]
        if self.mapped:
            more = "more" if self.mapped > 0 else "less"
            details.append(f"{human(abs(self.mapped))} {more} of peers' memory mapped by IPC, not owned")
        return f"{where}, {took} ({'; '.join(x for x in details if x)})"


def _cause_lines(windows: list[WindowDiff], which: str, an: str, bn: str) -> list[str]:
    """The phases whose allocations in a window changed most, one line per phase (GPUs alike merged)."""
    where = "between the memory baseline and the KV sizing" if which == "between" else "before the memory baseline"
    said: dict[str, list[int]] = {}  # line with "{gpus}" -> GPUs
    totals: dict[str, list[int]] = {}
    for w in windows:
        by_phase: dict[str, _PhaseMove] = {}
        for r in w.rows:
            by_phase.setdefault(r.phase, _PhaseMove()).add(r)
        named = sorted((p for p, e in by_phase.items() if abs(e.delta) >= MIN_NAMED),
                       key=lambda p: (-abs(by_phase[p].delta), p))[:VERDICT_PHASES]
        for p in named:
            said.setdefault(by_phase[p].line(p, where, an, bn), []).append(w.gpu)
        if named and w.in_a and w.in_b:
            total = f"  all traced changes {where} on {{gpus}}: {signed_human(w.b_owned - w.a_owned)} owned"
            totals.setdefault(total, []).append(w.gpu)
    lines = [line.replace("{gpus}", _gpus_text(gpus)) for line, gpus in said.items()]
    lines += [line.replace("{gpus}", _gpus_text(gpus)) for line, gpus in totals.items()]
    return lines


def _sglang_fact_lines(a: Run, b: Run) -> list[str]:
    """Foreign CUDA contexts and the custom all-reduce, when they differ between the runs."""
    def foreign(run: Run) -> str:
        return ", ".join(f"{c.label or 'pid ' + str(c.pid)} on GPU {c.gpu}"
                         + (f" (NVML {human(c.nvml_peak)})" if c.nvml_peak is not None else "")
                         for c in run.contexts) or "none"

    def car(run: Run) -> str:
        c = run.custom_ar
        if not c:
            return "none"
        return custom_ar_line(c, human).split(": ", 1)[1]

    lines = []
    if foreign(a) != foreign(b):
        lines.append(f"foreign CUDA contexts: {a.name}: {foreign(a)}; {b.name}: {foreign(b)}")
    if car(a) != car(b):
        lines.append(f"custom all-reduce: {a.name}: {car(a)}; {b.name}: {car(b)}")
    return lines


def _unrelated_verdict(d: Diff, relation: Relation) -> DiffVerdict:
    """Two different workloads: say so and why, and each run's own outcome, and nothing that
    explains one by the other."""
    lines = list(relation.reasons)
    for side in ("a", "b"):
        mine = [f for f in d.failures if f.where in (side, "both")]
        outcome = f"fails: {_what_failed(mine)}" if d.side(side).failed else "works"
        lines.append(f"{d.side(side).name} {outcome}")
    lines += relation.notes
    lines.append("the tables below match ranks and phase names only: compare a run with one of the same workload")
    return DiffVerdict("not comparable: these look like two different workloads", lines)


def _verdict(d: Diff, a: Run, b: Run, relation: Relation) -> DiffVerdict:
    if not relation.related:
        return _unrelated_verdict(d, relation)
    an, bn = d.a.name, d.b.name
    fa, fb = d.a.failed, d.b.failed
    only_a = [f for f in d.failures if f.where == "a"]
    only_b = [f for f in d.failures if f.where == "b"]
    both = [f for f in d.failures if f.where == "both"]
    if fb and not fa:
        head = f"{bn} fails where {an} works: {_what_failed(only_b + both)}"
    elif fa and not fb:
        head = f"{bn} works where {an} fails: {an}'s {_what_failed(only_a + both)}"
    elif fa and fb:
        head = f"both runs fail: {an}: {_what_failed(only_a + both)}; {bn}: {_what_failed(only_b + both)}"
    else:
        head = "both runs work"
    lines = _kv_lines(d.kv, an, bn)
    lines += _cause_lines(d.windows.between, "between", an, bn)
    pre_moved = any(abs(x.budgets.deltas.get("pre_model_load_memory", 0.0)) >= 0.005 for x in d.kv)
    if pre_moved or not d.kv:
        lines += _cause_lines(d.windows.before, "before", an, bn)
    site = verdict_line(d.sites, bn, MIN_NAMED) if isinstance(d.sites, SitesDiff) else None
    if site is not None:  # runs with stacks: the line of code whose memory changed most
        lines.append(site)
    needed = {}
    for name, run in (("a", a), ("b", b)):
        mins = [x.min_mem_fraction_static for x in run.budgets if not x.draft and x.min_mem_fraction_static is not None]
        fracs = sorted({x.mem_fraction_static for x in run.budgets if x.mem_fraction_static is not None})
        needed[name] = (max(mins) if mins else None, fracs)
    for name, run in (("a", a), ("b", b)):
        need, fracs = needed[name]
        if _sglang_failed(run) and need is not None:  # a driver OOM alone is not the KV sizing's
            ran = f" (it ran with {', '.join(f'{x:.3f}' for x in fracs)})" if fracs else ""
            if need < 1:
                lines.append(f"{d.side(name).name} needs --mem-fraction-static > {need:.4f} on every rank to size a KV cache{ran}")
            else:
                lines.append(f"no --mem-fraction-static sizes a KV cache in {d.side(name).name}: it would have to exceed {need:.4f}{ran}")
    lines += _sglang_fact_lines(a, b)
    drv_a = [f for f in only_a if f.kind == "driver_call"]
    drv_b = [f for f in only_b if f.kind == "driver_call"]
    for name, drv in ((an, drv_a), (bn, drv_b)):
        if drv:
            n = sum(f.count for f in drv)
            lines.append(f"{n} failed driver call{'' if n == 1 else 's'} only in {name} ({drv[0].api} {drv[0].result}{', …' if len(drv) > 1 else ''})")
    if not lines and head == "both runs work":
        lines.append("no change in the KV budget or between the baseline and the KV sizing")
    return DiffVerdict(head, lines + relation.notes)


# ------------------------------------------------------------------------------------------- public


@dataclass(frozen=True)
class Verdict:
    """What ``memrec diff`` says first, for the views that show it too (``tui --diff``, ``plot
    --diff``): the headline, the lines under it, and which run failed (``"a"``, ``"b"``, ``"both"``
    or None). Deltas are always B − A."""

    headline: str
    lines: tuple[str, ...]
    failing: str | None
    a_name: str
    b_name: str


#: Markers two runs are lined up on first, in this order, by the views that draw them side by side
#: (``tui --diff``, ``plot --diff``): SGLang's KV sizing (where the window "between the memory
#: baseline and the KV sizing" this diff compares ends: the runs are compared at the moment one of
#: them failed) and its memory baseline; else the first marker they share.
ALIGN_FIRST = (("kv_budget", "begin"), ("memory_baseline", "instant"))


def align_markers(a: Iterable, b: Iterable) -> tuple[str, str, int, int] | None:
    """The marker two runs are lined up on (:data:`ALIGN_FIRST`, else the first of ``a``'s markers
    in time whose name and phase ``b`` also has): ``(name, phase, ts in a, ts in b)``, each the
    first such marker of its run; None without a common marker."""
    first_a: dict[tuple[str, str], int] = {}
    for m in sorted(a, key=lambda m: m.ts):
        first_a.setdefault((m.name, m.phase), m.ts)
    first_b: dict[tuple[str, str], int] = {}
    for m in sorted(b, key=lambda m: m.ts):
        first_b.setdefault((m.name, m.phase), m.ts)
    keys = [k for k in ALIGN_FIRST if k in first_a and k in first_b] + [k for k in first_a if k in first_b]
    if not keys:
        return None
    name, phase = keys[0]
    return name, phase, first_a[keys[0]], first_b[keys[0]]


def verdict_of(d: Diff) -> Verdict:
    """The verdict of :func:`diff_traces`'s diff."""
    fa, fb = d.a.failed, d.b.failed
    failing = "both" if fa and fb else "a" if fa else "b" if fb else None
    return Verdict(d.verdict.headline, tuple(d.verdict.lines), failing, d.a.name, d.b.name)


def _side(run: Run, name: str, failures: dict[tuple, Failure]) -> DiffSide:
    """One run's line of the diff: whether it failed and how many driver calls ran out of memory."""
    ooms = sum(f.count for f in _driver_ooms(failures.values()))
    return DiffSide(name=name, failed=_failed(run, failures), driver_ooms=ooms,
                    ranks=len([k for k in set(run.rank_of.values()) if k]))


def diff_traces(a_trace: Any, b_trace: Any, a_name: str = "A", b_name: str = "B",
                a_events: TraceEvents | None = None, b_events: TraceEvents | None = None) -> Diff:
    """Compare two traces (``a`` the reference, ``b`` the other; see the module). ``a_events``,
    ``b_events``: their events when the traces hold none (see :func:`analyze`)."""
    a, b = analyze(a_trace, a_name, a_events), analyze(b_trace, b_name, b_events)
    dims = shown_dims([_as_dict(k) for k in list(a.rank_of.values()) + list(b.rank_of.values()) if k])
    kv = []
    for bd in compare_budgets(a.budgets, b.budgets):
        dp, pp, tp, draft = bd.rank_key
        kv.append(KvChange(bd, _rank_label((dp, pp, tp), dims, draft) if tp is not None else bd.label))
    fa, fb = _failures(a, dims), _failures(b, dims)
    failures = []
    for key in list(fa) + [k for k in fb if k not in fa]:
        f = dataclasses.replace(fb.get(key) or fa[key])
        f.where = "both" if key in fa and key in fb else ("a" if key in fa else "b")
        if f.where == "both":
            f.count_a, f.count_b = fa[key].count, fb[key].count
        failures.append(f)
    kinds = ["sglang_error", "kv_budget", "driver_call"]
    failures.sort(key=lambda f: (kinds.index(f.kind), rank_sort_key(tuple(f.rank_key) + (None,) * 3),
                                 f.phase or "", f.gpu or 0, f.api or "", f.error or ""))
    relation = relate(identity(a_trace, a.phases), identity(b_trace, b.phases), a_name, b_name)
    d = Diff(
        memrec_diff=DIFF_VERSION,
        a=_side(a, a_name, fa),
        b=_side(b, b_name, fb),
        verdict=DiffVerdict("", []),  # below: it reads the rest
        related=relation.to_dict(),
        kv=kv,
        windows=DiffWindows(between=_window_diff(a, b, "between", dims), before=_window_diff(a, b, "before", dims)),
        phases=_phase_rows(a, b, dims),
        failures=failures,
        untraced=untraced_rows(a.untraced, b.untraced, lambda key: _rank_label(key, dims)),
        tensors=_tensor_rows(a, b, dims),
    )
    sites = diff_sites(a.sites, b.sites)
    if sites is not None:  # a run with stacks (format 2.3); without, the diff is as it was
        d.sites = sites
    d.verdict = _verdict(d, a, b, relation)
    return d
