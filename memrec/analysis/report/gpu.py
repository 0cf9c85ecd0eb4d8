"""``memrec report``'s section of one GPU: peak, final, categories, processes, phases, held at
exit, failures, NVML and the reconciliation, from the replay's series (:mod:`memrec.analysis.report.build`
builds the rest and calls :func:`gpu_section` per GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from memrec.analysis.names import api_name
from memrec.analysis.untraced.reconcile import GpuReconciliation
from memrec.analysis.untraced.reconcile import Reconciliation
from memrec.analysis.report.model import CategoryRow
from memrec.analysis.report.model import FailedCall
from memrec.analysis.report.model import Final
from memrec.analysis.report.model import GpuProcess
from memrec.analysis.report.model import GpuSection
from memrec.analysis.report.model import HeldAtExit
from memrec.analysis.report.model import NvmlSummary
from memrec.analysis.report.model import HoldingRow
from memrec.analysis.report.model import Peak
from memrec.analysis.report.model import PidBytes
from memrec.analysis.report.model import ProcessEntry
from memrec.analysis.text import seconds
from memrec.engine.phases import Phases
from memrec.engine.phases import UsageTable
from memrec.analysis.report.phase_rows import GpuPhaseList
from memrec.analysis.report.phase_rows import PhaseTimes
from memrec.engine.series import GpuSeries
from memrec.terms.events import CATEGORIES
from memrec.terms.events import OWNED
from memrec.state.fields import Holding

#: Process exit records list this many largest pieces still held.
EXIT_LARGEST = 3


def holding_row(h: Holding | dict) -> HoldingRow:
    """A holding (or the state's record of one, :meth:`Holding._asdict`) as the report shows it:
    its API by name."""
    if isinstance(h, dict):
        h = Holding(**h)
    return HoldingRow(h.pid, h.gpu, h.category, h.size, h.address, h.ts, api_name(h.api), h.peer)


@dataclass
class ReportContext:
    """What every GPU's section of one report is built from: the trace and its start, the
    filter's process, the processes, the exit records, usage by phase (all changes, and the
    changes a process exit made), the phases and the NVML reconciliation."""

    trace: Any
    start: int
    pid: int | None
    procs: dict[int, ProcessEntry]
    exits: list[dict]
    usage: UsageTable  # the usage by phase, every GPU's
    exit_usage: UsageTable
    phases: Phases
    rec: Reconciliation
    phase_s: PhaseTimes  # each phase's start and end in seconds


def gpu_section(ctx: ReportContext, g: int, series: GpuSeries | None, info: Any,
                failures: list[FailedCall]) -> GpuSection | None:
    """GPU ``g``'s section (None when the filter's process has nothing there); ``info``: the
    trace's GPU record, ``failures``: the failed calls placed on ``g``."""
    pids = series.pids() if series is not None else []
    if ctx.pid is not None:
        pids = [p for p in pids if p == ctx.pid]
    held = _held_at_exit(g, ctx.exits, ctx.pid, ctx.start)
    if ctx.pid is not None and not pids and not failures and not held:
        return None
    if series is not None:
        peak, final, categories = _series_summary(series, pids, ctx.pid, ctx.start)
    else:
        peak = Peak(bytes=0, ts=ctx.start, t_s=0.0, by_category={}, by_pid=[])
        final, categories = Final(bytes=0, by_category={}, by_pid=[]), []
    return GpuSection(
        gpu=g,
        name=info.name if info else None,
        uuid=info.uuid if info else None,
        total=info.total if info else None,
        peak=peak,
        final=final,
        categories=categories,
        processes=_process_rows(ctx, g, series, pids, held),
        phases=GpuPhaseList.of(ctx.phase_s, ctx.usage, ctx.exit_usage, g, ctx.pid),
        held_at_exit=held,
        failures=failures,
        nvml=_nvml(ctx.trace, g, series, ctx.start),
        reconciliation=_reconciliation(ctx.rec, g, ctx.pid, ctx.start),
    )


def _series_summary(series: GpuSeries, pids: list[int], pid: int | None,
                    start: int) -> tuple[Peak, Final, list[CategoryRow]]:
    """The GPU's traced peak and final (by category and by listed process) and each category's
    own peak, from the replay's series."""
    total = series.total(pid)
    peak_b, peak_ts, row = series.peak(pid)
    cats = series.by_category(pid)
    owned = series.per_pid(OWNED)  # every process at once: O(changes), not O(processes × rows)
    listed = np.isin(owned.pids, pids)
    at_peak = owned.at_row(row)
    peak = Peak(
        bytes=peak_b,
        ts=peak_ts,
        t_s=seconds(peak_ts - start),
        by_category={c: int(s[row]) for c, s in cats.items() if s[row]},
        by_pid=_by_pid(owned.pids, at_peak, listed),
    )
    final = Final(
        bytes=int(total[-1]),
        by_category={c: int(s[-1]) for c, s in cats.items() if s[-1]},
        by_pid=_by_pid(owned.pids, owned.final, listed),
    )
    categories = []
    for c, s in cats.items():
        i = int(np.argmax(s))
        if not s[i]:  # a category only other processes used (a -p filter): no row of zeros
            continue
        categories.append(
            CategoryRow(category=c, owned=c != "ipc_mapped", peak=int(s[i]), peak_ts=int(series.ts[i]),
                        peak_t_s=seconds(int(series.ts[i]) - start), final=int(s[-1]))
        )
    return peak, final, categories


def _process_rows(ctx: ReportContext, g: int, series: GpuSeries | None, pids: list[int],
                  held: list[HeldAtExit]) -> list[GpuProcess]:
    """The listed processes on ``g``, largest owned peak first."""
    if not pids:
        return []
    held_by_pid: dict[int, int] = {}
    for r in held:
        held_by_pid[r.pid] = held_by_pid.get(r.pid, 0) + r.owned
    nvml_used = _procmem_last(ctx.trace, g)
    assert series is not None  # pids come from the series
    owned, mapped = series.per_pid(OWNED), series.per_pid(("ipc_mapped",))
    final_by_pid = _final_by_category(series)
    # every listed pid has keys here, and per_pid lists every pid of the keys, ascending
    at = np.searchsorted(owned.pids, pids)
    peak, mapped_peak = owned.peak[at], mapped.peak[at]
    # largest owned peak first, then mapped, then pid: one sort of the columns, not of 100,000 rows
    order = np.lexsort((np.asarray(pids, dtype=np.int64), -mapped_peak, -peak))
    at = at[order]
    columns = zip(np.asarray(pids, dtype=np.int64)[order].tolist(), peak[order].tolist(),
                  series.ts[owned.peak_row[at]].tolist(), owned.final[at].tolist(), mapped_peak[order].tolist(),
                  mapped.final[at].tolist())
    rows = []
    start = ctx.start
    procs = ctx.procs
    for p, peak_b, peak_ts, final, mapped_b, mapped_final in columns:
        proc = procs.get(p)
        rows.append(
            GpuProcess(
                pid=p,
                process=proc.short if proc else "",
                rank=proc.rank if proc else "",
                peak=peak_b,
                peak_ts=peak_ts,
                peak_t_s=seconds(peak_ts - start),
                final=final,
                mapped_peak=mapped_b,
                mapped_final=mapped_final,
                by_category=final_by_pid.get(p, {}),
                exit_ts=proc.exit_ts if proc else None,
                held_at_exit=held_by_pid.get(p, 0),
                nvml_used=nvml_used.get(p),
            )
        )
    return rows


def _by_pid(pids: np.ndarray, held: np.ndarray, listed: np.ndarray) -> list[PidBytes]:
    """The listed processes holding something, pids ascending."""
    keep = listed & (held != 0)
    return [PidBytes(p, b) for p, b in zip(pids[keep].tolist(), held[keep].tolist())]


def _final_by_category(series: GpuSeries) -> dict[int, dict[str, int]]:
    """Per process, what each category holds at the end (zeros left out), categories in order."""
    out: dict[int, dict[str, int]] = {}
    held = series.held_at(len(series.ts) - 1).tolist()
    for (p, c), b in sorted(zip(series.keys, held), key=lambda kb: (kb[0][0], CATEGORIES.index(kb[0][1]))):
        if b:
            out.setdefault(p, {})[c] = b
    return out


def _reconciliation(rec: Reconciliation, g: int, pid: int | None, start: int) -> GpuReconciliation | None:
    """NVML vs traced on GPU ``g`` (None for the host section and GPUs without NVML samples)."""
    if g < 0 or g not in rec.gpus():
        return None
    return rec.gpu_summary(g, pid).with_seconds(start)


def _held_at_exit(g: int, exits: list[dict], pid: int | None, start: int) -> list[HeldAtExit]:
    out = []
    for r in exits:
        if pid is not None and r["pid"] != pid:
            continue
        rows = [h for h in r["held"] if h["gpu"] == g]
        if not rows:
            continue
        out.append(
            HeldAtExit(
                pid=r["pid"],
                ts=r["ts"],
                t_s=seconds(r["ts"] - start),
                owned=sum(h["bytes"] for h in rows if h["category"] != "ipc_mapped"),
                mapped=sum(h["bytes"] for h in rows if h["category"] == "ipc_mapped"),
                count=sum(h["count"] for h in rows),
                by_category={h["category"]: h["bytes"] for h in rows},
                largest=[holding_row(h) for h in r["largest"] if h["gpu"] == g][:EXIT_LARGEST],
            )
        )
    return out


def _procmem_last(trace: Any, g: int) -> dict[int, int]:
    pm = trace.procmem
    if not len(pm):
        return {}
    sel = pm[pm["gpu"] == g]
    out: dict[int, int] = {}
    for ts, p, used in sorted(zip(sel["ts"].tolist(), sel["pid"].tolist(), sel["used"].tolist())):
        out[p] = used
    return out


def _nvml(trace: Any, g: int, series: GpuSeries | None, start: int) -> NvmlSummary | None:
    nv = trace.nvml
    if not len(nv):
        return None
    s = nv[nv["gpu"] == g]
    if not len(s):
        return None
    s = s[np.argsort(s["ts"], kind="stable")]
    used = s["used"]
    reserved = s["reserved"]
    last = s[-1]
    out = NvmlSummary(
        samples=int(len(s)),
        total=int(last["total"]) if last["total"] >= 0 else None,
        last_ts=int(last["ts"]),
        last_t_s=seconds(int(last["ts"]) - start),
        last_used=int(last["used"]) if last["used"] >= 0 else None,
        last_reserved=int(last["reserved"]) if last["reserved"] >= 0 else None,
        peak_used=None,
        peak_used_ts=None,
        peak_used_t_s=None,
        peak_reserved=int(reserved.max()) if reserved.max() >= 0 else None,
    )
    if used.max() >= 0:
        i = int(np.argmax(used))
        out.peak_used = int(used[i])
        out.peak_used_ts = int(s["ts"][i])
        out.peak_used_t_s = seconds(int(s["ts"][i]) - start)
    if series is not None and out.last_used is not None:
        traced = series.at(out.last_ts)
        out.traced_at_last = traced
        out.untraced_at_last = out.last_used - traced
    return out
