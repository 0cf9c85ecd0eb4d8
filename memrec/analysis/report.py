"""``memrec report``: per GPU, where the memory went, when, and who took it.

:func:`build_report` replays a :class:`memrec.trace.model.Trace` once and returns a JSON-able dict
(plain ints, floats, strings, lists, dicts with string keys); :func:`render_text` turns it into
fixed-width text. Byte counts are exact ints; ``*_s`` fields are seconds since the trace start.

Per GPU: traced peak (and when) and final bytes, by category and by process; by phase where
markers exist; what each process still held when it exited (freed implicitly); every failed call
with who held what on that GPU at that instant; NVML beside it, and per NVML sample the traced
bytes of each process and of the GPU with the rest as "untraced" (:mod:`memrec.analysis.reconcile`,
section ``reconciliation``). "Traced" means owned memory the
probes saw (driver allocations + VMM physical); ``ipc_mapped`` is peers' memory mapped by a
process, shown in its view and never added to a GPU's total.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from memrec.analysis.phases import NO_PHASE
from memrec.analysis.phases import Phases
from memrec.analysis.phases import attribute
from memrec.analysis.phases import build_phases
from memrec.analysis.reconcile import Reconciliation
from memrec.analysis.reconcile import reconcile
from memrec.analysis.sglang_report import build_sglang_section
from memrec.analysis.sglang_report import rank_labels
from memrec.analysis.sglang_report import render_sglang
from memrec.analysis.text import table
from memrec.analysis.timeline import OWNED
from memrec.analysis.timeline import GpuSeries
from memrec.analysis.timeline import Timeline
from memrec.analysis.timeline import build_timeline
from memrec.analysis.untraced import SPLIT
from memrec.events import CATEGORIES
from memrec.events import CU_RESULT_NAMES
from memrec.events import Api
from memrec.events import Kind
from memrec.events import ProcessInfo
from memrec.state import LiveState

REPORT_VERSION = 1
#: How many holders' largest allocations an OOM snapshot lists, and how many on the GPU.
HOLDER_LARGEST = 3
GPU_LARGEST = 5
#: Process exit records list this many largest pieces still held.
EXIT_LARGEST = 3

_CATEGORY_NOTE = {
    "driver": "cuMemAlloc*",
    "vmm": "cuMemCreate physical",
    "ipc_mapped": "peers' memory mapped here: not owned, not in totals",
    "host_pinned": "pinned host memory",
}


# ----------------------------------------------------------------------------------------- build


def build_report(trace: Any, gpu: int | None = None, pid: int | None = None) -> dict:
    """Replay ``trace`` and summarise it per GPU (JSON-able).

    Args:
        trace: a :class:`memrec.trace.model.Trace`; its ``events["gpu"]`` are filled in where the
            replay knows them.
        gpu: only this GPU (-1: the host / unknown-GPU section).
        pid: only this process's memory (peaks, phases, exits, failed calls are its own; the
            holders at its failed calls still show every process on that GPU).
    """
    events = trace.events
    start, end = _bounds(trace)
    n = len(events)
    kinds = events["kind"] if n else np.zeros(0, np.uint16)
    failed_idx = np.nonzero(events["result"] != 0)[0].tolist() if n else []
    failed_gpu = _failure_gpus(events, failed_idx)

    snapshots: dict[int, dict] = {}
    cache: dict[tuple[int, int], dict] = {}

    def at_stop(index: int, state: LiveState) -> None:
        g = failed_gpu[index][0]
        # The journal grows with every change: failed calls in a row with nothing in between
        # see the same state, computed once.
        key = (len(state.journal or ()), g)
        snap = cache.get(key)
        if snap is None:
            cache.clear()
            snap = cache[key] = _oom_snapshot(state, g)
        snapshots[index] = snap

    initial, notes = _initial_state(trace)
    prior_exits = len(initial.exit_records()) if initial is not None else 0
    prior_anomalies = dict(initial.anomalies) if initial is not None else {}
    tl = build_timeline(events, start=start, state=initial, stops=failed_idx, at_stop=at_stop)
    exits = tl.state.exit_records()[prior_exits:]
    anomalies = {
        k: v - prior_anomalies.get(k, 0) for k, v in sorted(tl.state.anomalies.items()) if v > prior_anomalies.get(k, 0)
    }
    phases = build_phases(trace.markers, end)
    usage = attribute(phases, tl.journal) if trace.markers else []
    procs = _processes(trace, tl, exits)
    rec = reconcile(trace, tl, phases)

    gpu_ids = set(tl.gpus) | {g for g, _ in failed_gpu.values()}
    gpu_ids |= {gi.index for gi in trace.gpus}
    gpu_ids |= set(rec.gpus())
    gpu_info = {gi.index: gi for gi in trace.gpus}

    report: dict = {
        "memrec_report": REPORT_VERSION,
        "filter": {"gpu": gpu, "pid": pid},
        "trace": {
            "host": trace.header.get("host"),
            "start_ts": start,
            "end_ts": end,
            "duration_s": _sec(end - start),
            "events": n,
            "failed_calls": len(failed_idx),
            "lost": int(trace.lost),
            "complete": trace.trailer is not None,
            "warnings": list(trace.warnings) + notes,
            "phase_warnings": list(phases.warnings),
            "anomalies": anomalies,
            "markers": len(trace.markers),
            "nvml_samples": int(len(trace.nvml)),
        },
        "processes": [p for p in procs.values() if pid is None or p["pid"] == pid],
        "gpus": [],
        "host": None,
        "phases": _phase_list(phases, start, pid),
        "instants": [
            {"pid": i.pid, "name": i.name, "ts": i.ts, "t_s": _sec(i.ts - start), "phase": phases.label(i.phase),
             "gpu": i.gpu, "values": _jsonable(i.values)}
            for i in phases.instants
            if pid is None or i.pid == pid
        ],
        "failures_unknown_gpu": [],
    }
    failures_by_gpu: dict[int, list[dict]] = {}
    for i in failed_idx:
        g, inferred = failed_gpu[i]
        if pid is not None and int(events["pid"][i]) != pid:
            continue
        f = _failure(events, i, g, inferred, start, procs)
        if g < 0 and not _is_host_kind(int(kinds[i])):
            report["failures_unknown_gpu"].append(f)
            continue
        f.update(snapshots[i])
        failures_by_gpu.setdefault(g, []).append(f)

    for g in sorted(gpu_ids):
        if gpu is not None and g != gpu:
            continue
        section = _gpu_section(
            g, tl.gpus.get(g), gpu_info.get(g), start, pid, procs, exits, usage, phases,
            failures_by_gpu.get(g, []), trace, rec,
        )
        if section is None:
            continue
        if g < 0:
            report["host"] = section
        else:
            report["gpus"].append(section)
    report["sglang"] = build_sglang_section(trace, phases, tl.journal, usage, start, gpu=gpu, pid=pid)
    return report


def _initial_state(trace: Any) -> tuple[LiveState | None, list[str]]:
    """The state the file starts from: its keyframe at event 0 (a rotated file continues the
    previous one's state), or None (empty)."""
    for kf in trace.keyframes:
        if kf.event_index != 0:
            continue
        try:
            state = LiveState.from_snapshot(kf.state, journal=True)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            return None, [f"the keyframe at the start is not a state this memrec reads ({error}): replayed from empty"]
        state.n_events = 0
        return state, []
    return None, []


def _bounds(trace: Any) -> tuple[int, int]:
    """The trace's first and last timestamp over events, markers and samples (trailer end if later)."""
    firsts: list[int] = []
    lasts: list[int] = []
    for arr in (trace.events, trace.nvml, trace.procmem):
        if len(arr):
            firsts.append(int(arr["ts"].min()))
            lasts.append(int(arr["ts"].max()))
    if trace.markers:
        firsts.append(min(m.ts for m in trace.markers))
        lasts.append(max(m.ts for m in trace.markers))
    trailer = trace.trailer or {}
    for key in ("end_ts", "end"):
        if isinstance(trailer.get(key), int):
            lasts.append(trailer[key])
            break
    anchor = trace.header.get("anchor")
    if isinstance(anchor, dict) and isinstance(anchor.get("monotonic_ns"), int):
        firsts.append(anchor["monotonic_ns"])  # when the recording started
    start = min(firsts) if firsts else 0
    return start, max(lasts) if lasts else start


def _sec(ns: int) -> float:
    return round(ns / 1e9, 6)


def _is_host_kind(kind: int) -> bool:
    return kind in (Kind.HOST_ALLOC, Kind.HOST_FREE, Kind.HOST_REGISTER, Kind.HOST_UNREGISTER)


def _failure_gpus(events: np.ndarray, failed_idx: list[int]) -> dict[int, tuple[int, bool]]:
    """Each failed call's GPU: its own, else its process's last known GPU before it (inferred)."""
    out: dict[int, tuple[int, bool]] = {}
    if not failed_idx:
        return out
    gpus = events["gpu"]
    pids = events["pid"]
    known = np.nonzero(gpus >= 0)[0]
    known_pids = pids[known]
    per_pid: dict[int, np.ndarray] = {}
    for i in failed_idx:
        g = int(gpus[i])
        kind = int(events["kind"][i])
        if g >= 0 or _is_host_kind(kind):
            out[i] = (g if not _is_host_kind(kind) else -1, False)
            continue
        p = int(pids[i])
        if p not in per_pid:
            per_pid[p] = known[known_pids == p]
        idx = per_pid[p]
        k = int(np.searchsorted(idx, i)) - 1
        out[i] = (int(gpus[idx[k]]), True) if k >= 0 else (-1, False)
    return out


def _oom_snapshot(state: LiveState, g: int) -> dict:
    return {
        "owned_on_gpu": state.owned_bytes(gpu=g),
        "mapped_on_gpu": state.mapped_bytes(gpu=g),
        "holders": [_holding_json(h) for h in state.holders(g, n=HOLDER_LARGEST)],
        "largest": [_holding_json(h._asdict()) for h in state.largest(g, GPU_LARGEST)],
    }


def _holding_json(h: dict) -> dict:
    h = dict(h)
    if "api" in h:
        h["api"] = _api_name(h["api"])
    if "largest" in h:
        h["largest"] = [_holding_json(x) for x in h["largest"]]
    return h


def _api_name(api: int) -> str:
    try:
        return Api(api).name
    except ValueError:
        return str(api)


def _result_name(result: int) -> str:
    return CU_RESULT_NAMES.get(result, f"CUresult {result}")


def _failure(events: np.ndarray, i: int, g: int, inferred: bool, start: int, procs: dict) -> dict:
    e = events[i]
    p = int(e["pid"])
    kind = int(e["kind"])
    return {
        "index": i,
        "ts": int(e["ts"]),
        "t_s": _sec(int(e["ts"]) - start),
        "pid": p,
        "tid": int(e["tid"]),
        "process": procs.get(p, {}).get("short", ""),
        "kind": Kind(kind).name if kind in Kind._value2member_map_ else str(kind),
        "api": _api_name(int(e["api"])),
        "size": int(e["size"]),
        "result": int(e["result"]),
        "result_name": _result_name(int(e["result"])),
        "gpu": g,
        "gpu_inferred": inferred,
    }


def _short_cmdline(info: ProcessInfo | None, limit: int = 40) -> str:
    if info is None or not info.cmdline:
        return ""
    argv = list(info.cmdline)
    argv[0] = os.path.basename(argv[0])
    text = " ".join(argv)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _rank(info: ProcessInfo | None) -> str:
    if info is None or not info.rank:
        return ""
    return " ".join(f"{k}{v}" for k, v in sorted(info.rank.items()))


def _processes(trace: Any, tl: Timeline, exit_records: list[dict]) -> dict[int, dict]:
    pids = set(trace.processes) | {p for s in tl.gpus.values() for p in s.pids()}
    if len(trace.events):
        pids |= {int(p) for p in np.unique(trace.events["pid"])}
    exits = {r["pid"]: r["ts"] for r in exit_records}
    ranks = rank_labels(trace.markers)  # "TP0" from the markers' tp/pp/dp_rank, else ProcessInfo.rank
    gpus_of: dict[int, set[int]] = {}
    for g, s in tl.gpus.items():
        for p in s.pids():
            gpus_of.setdefault(p, set()).add(g)
    out = {}
    for p in sorted(pids):
        info = trace.processes.get(p)
        out[p] = {
            "pid": p,
            "ppid": info.ppid if info else None,
            "short": _short_cmdline(info),
            "cmdline": list(info.cmdline) if info else [],
            "rank": ranks.get(p) or _rank(info),
            "cuda_visible_devices": info.cuda_visible_devices if info else None,
            "gpus": sorted(gpus_of.get(p, ())),
            "exit_ts": exits.get(p),
        }
    return out


def _phase_list(phases: Phases, start: int, pid: int | None) -> list[dict]:
    return [
        {
            "id": ph.id,
            "pid": ph.pid,
            "name": ph.name,
            "path": ph.path,
            "depth": ph.depth,
            "start_ts": ph.start,
            "end_ts": ph.end,
            "start_s": _sec(ph.start - start),
            "end_s": _sec(ph.end - start),
            "closed": ph.closed,
            "gpu": ph.gpu,
            "values": _jsonable(ph.values),
        }
        for ph in phases.phases
        if pid is None or ph.pid == pid
    ]


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).hex()
    if isinstance(v, np.generic):
        return v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def _gpu_section(
    g: int,
    series: GpuSeries | None,
    info: Any,
    start: int,
    pid: int | None,
    procs: dict,
    exits: list[dict],
    usage: list,
    phases: Phases,
    failures: list[dict],
    trace: Any,
    rec: Reconciliation,
) -> dict | None:
    pids = series.pids() if series is not None else []
    if pid is not None:
        pids = [p for p in pids if p == pid]
    held = _held_at_exit(g, exits, pid, start)
    if pid is not None and not pids and not failures and not held:
        return None
    sec: dict = {
        "gpu": g,
        "name": info.name if info else None,
        "uuid": info.uuid if info else None,
        "total": info.total if info else None,
    }
    if series is not None:
        total = series.total(pid)
        peak_b, peak_ts, row = series.peak(pid)
        cats = series.by_category(pid)
        sec["peak"] = {
            "bytes": peak_b,
            "ts": peak_ts,
            "t_s": _sec(peak_ts - start),
            "by_category": {c: int(s[row]) for c, s in cats.items() if s[row]},
            "by_pid": [{"pid": p, "bytes": int(series.total(p)[row])} for p in pids if series.total(p)[row]],
        }
        sec["final"] = {
            "bytes": int(total[-1]),
            "by_category": {c: int(s[-1]) for c, s in cats.items() if s[-1]},
            "by_pid": [{"pid": p, "bytes": int(series.total(p)[-1])} for p in pids if series.total(p)[-1]],
        }
        sec["categories"] = []
        for c, s in cats.items():
            i = int(np.argmax(s))
            sec["categories"].append(
                {"category": c, "owned": c != "ipc_mapped", "peak": int(s[i]), "peak_ts": int(series.ts[i]),
                 "peak_t_s": _sec(int(series.ts[i]) - start), "final": int(s[-1])}
            )
    else:
        sec["peak"] = {"bytes": 0, "ts": start, "t_s": 0.0, "by_category": {}, "by_pid": []}
        sec["final"] = {"bytes": 0, "by_category": {}, "by_pid": []}
        sec["categories"] = []
    held_by_pid = {}
    for r in held:
        held_by_pid[r["pid"]] = held_by_pid.get(r["pid"], 0) + r["owned"]
    nvml_used = _procmem_last(trace, g)
    rows = []
    for p in pids:
        own = series.total(p)
        mapped = series.series(p, ("ipc_mapped",))
        i = int(np.argmax(own))
        rows.append(
            {
                "pid": p,
                "process": procs.get(p, {}).get("short", ""),
                "rank": procs.get(p, {}).get("rank", ""),
                "peak": int(own[i]),
                "peak_ts": int(series.ts[i]),
                "peak_t_s": _sec(int(series.ts[i]) - start),
                "final": int(own[-1]),
                "mapped_peak": int(mapped.max()),
                "mapped_final": int(mapped[-1]),
                "by_category": {c: int(s[-1]) for c, s in series.by_category(p).items() if s[-1]},
                "exit_ts": procs.get(p, {}).get("exit_ts"),
                "held_at_exit": held_by_pid.get(p, 0),
                "nvml_used": nvml_used.get(p),
            }
        )
    rows.sort(key=lambda r: (-r["peak"], -r["mapped_peak"], r["pid"]))
    sec["processes"] = rows
    sec["phases"] = _gpu_phases(g, usage, phases, pid, start) if phases.phases else []
    sec["held_at_exit"] = held
    sec["failures"] = failures
    sec["nvml"] = _nvml(trace, g, series, start)
    sec["reconciliation"] = _reconciliation(rec, g, pid, start)
    return sec


def _reconciliation(rec: Reconciliation, g: int, pid: int | None, start: int) -> dict | None:
    """NVML vs traced on GPU ``g`` (None for the host section and GPUs without NVML samples)."""
    if g < 0 or g not in rec.gpus():
        return None
    out = rec.gpu_summary(g, pid)
    rows = out["processes"] + ([out["device"]] if out["device"] else []) + out["contexts"]
    rows += [st for p in out["processes"] for st in p.get("steps", [])]
    for row in rows:
        for key in ("last_ts", "untraced_max_ts", "exit_ts", "ts", "cause_ts"):
            if key in row:
                row[key[:-2] + "t_s"] = _sec(row[key] - start) if row[key] is not None else None
    return out


def _held_at_exit(g: int, exits: list[dict], pid: int | None, start: int) -> list[dict]:
    out = []
    for r in exits:
        if pid is not None and r["pid"] != pid:
            continue
        rows = [h for h in r["held"] if h["gpu"] == g]
        if not rows:
            continue
        out.append(
            {
                "pid": r["pid"],
                "ts": r["ts"],
                "t_s": _sec(r["ts"] - start),
                "owned": sum(h["bytes"] for h in rows if h["category"] != "ipc_mapped"),
                "mapped": sum(h["bytes"] for h in rows if h["category"] == "ipc_mapped"),
                "count": sum(h["count"] for h in rows),
                "by_category": {h["category"]: h["bytes"] for h in rows},
                "largest": [_holding_json(h) for h in r["largest"] if h["gpu"] == g][:EXIT_LARGEST],
            }
        )
    return out


def _gpu_phases(g: int, usage: list, phases: Phases, pid: int | None, start: int) -> list[dict]:
    rows: dict[tuple[int, int], dict] = {}
    for u in usage:
        if u.gpu != g or (pid is not None and u.pid != pid):
            continue
        row = rows.get((u.pid, u.phase))
        if row is None:
            ph = phases.phases[u.phase] if u.phase >= 0 else None
            row = rows[(u.pid, u.phase)] = {
                "pid": u.pid,
                "phase": u.phase,
                "path": phases.label(u.phase),
                "start_ts": ph.start if ph else None,
                "end_ts": ph.end if ph else None,
                "start_s": _sec(ph.start - start) if ph else None,
                "end_s": _sec(ph.end - start) if ph else None,
                "closed": ph.closed if ph else None,
                "by_category": {},
                "allocated": 0,
                "freed": 0,
                "net": 0,
                "mapped_net": 0,
            }
        row["by_category"][u.category] = row["by_category"].get(u.category, 0) + u.net
        if u.category in OWNED:
            row["allocated"] += u.allocated
            row["freed"] += u.freed
            row["net"] += u.net
        else:
            row["mapped_net"] += u.net
    out = list(rows.values())
    for r in out:
        r["by_category"] = {c: r["by_category"][c] for c in CATEGORIES if c in r["by_category"]}
    # By process, then in time order, (no phase) last.
    out.sort(key=lambda r: (r["pid"], r["phase"] < 0, r["start_ts"] or 0, r["phase"]))
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


def _nvml(trace: Any, g: int, series: GpuSeries | None, start: int) -> dict | None:
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
    out: dict = {
        "samples": int(len(s)),
        "total": int(last["total"]) if last["total"] >= 0 else None,
        "last_ts": int(last["ts"]),
        "last_t_s": _sec(int(last["ts"]) - start),
        "last_used": int(last["used"]) if last["used"] >= 0 else None,
        "last_reserved": int(last["reserved"]) if last["reserved"] >= 0 else None,
        "peak_used": None,
        "peak_used_ts": None,
        "peak_used_t_s": None,
        "peak_reserved": int(reserved.max()) if reserved.max() >= 0 else None,
    }
    if used.max() >= 0:
        i = int(np.argmax(used))
        out["peak_used"] = int(used[i])
        out["peak_used_ts"] = int(s["ts"][i])
        out["peak_used_t_s"] = _sec(int(s["ts"][i]) - start)
    if series is not None and out["last_used"] is not None:
        traced = series.at(out["last_ts"])
        out["traced_at_last"] = traced
        out["untraced_at_last"] = out["last_used"] - traced
    return out


# ---------------------------------------------------------------------------------------- render


def human(n: int | None) -> str:
    """Bytes as B, KiB, MiB (one decimal) or GiB, TiB (two decimals); ``-`` for None."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    a = abs(n)
    if a < 1024:
        return f"{sign}{a} B"
    for unit, shift, digits in (("TiB", 40, 2), ("GiB", 30, 2), ("MiB", 20, 1), ("KiB", 10, 1)):
        if a >= 1 << shift:
            return f"{sign}{a / (1 << shift):.{digits}f} {unit}"
    raise AssertionError("unreachable")


def _t(seconds: float | None) -> str:
    return "-" if seconds is None else f"+{seconds:.3f}s"


def _values(values: dict, limit: int = 60) -> str:
    text = ", ".join(f"{k}={_fmt_value(v)}" for k, v in values.items())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt_value(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 1 << 20:
        return human(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _pid_label(pid: int, procs: dict[int, dict]) -> str:
    p = procs.get(pid, {})
    bits = [f"pid {pid}"]
    if p.get("rank"):
        bits.append(p["rank"])
    if p.get("short"):
        bits.append(p["short"])
    return " ".join(bits)


def _holding_text(h: dict) -> str:
    addr = f"handle {h['address']:#x}" if h["category"] == "vmm" else f"{h['address']:#x}"
    text = f"{human(h['size'])} {h['category']} {addr}"
    if h["category"] == "ipc_mapped" and h.get("peer"):
        text += f" from pid {h['peer']}"
    return text


def render_text(report: dict) -> str:
    """The report as fixed-width text (deterministic for a given report)."""
    out: list[str] = []
    tr = report["trace"]
    procs = {p["pid"]: p for p in report["processes"]}
    out.append("memrec report")
    failed = tr["failed_calls"]
    head = (
        f"  trace: {tr['duration_s']:.3f} s, {tr['events']:,} events, {failed:,} failed call{'' if failed == 1 else 's'}, "
        f"{len(report['processes'])} processes, {tr['markers']:,} markers, {tr['nvml_samples']:,} NVML samples"
    )
    out.append(head)
    flt = report["filter"]
    if flt["gpu"] is not None or flt["pid"] is not None:
        parts = [f"{k} {flt[k]}" for k in ("gpu", "pid") if flt[k] is not None]
        out.append("  filter: " + ", ".join(parts))
    if tr["lost"]:
        out.append(f"  !! LOST EVENTS: {tr['lost']:,} events were dropped while recording; the numbers below miss them")
    if not tr["complete"]:
        out.append("  !! no trailer: the recording did not end cleanly (the trace may stop early)")
    for w in tr["warnings"]:
        out.append(f"  !! reader warning: {w}")
    for w in tr["phase_warnings"]:
        out.append(f"  !  markers: {w}")
    if tr["anomalies"]:
        out.append(
            "  note: events that did not match the recorded state (usually memory from before the recording): "
            + ", ".join(f"{k} {v:,}" for k, v in tr["anomalies"].items())
        )

    if report.get("sglang"):
        out.append("")
        out.extend(render_sglang(report["sglang"]))
    for sec in report["gpus"]:
        out.append("")
        out.extend(_render_gpu(sec, procs))
    if report["host"] is not None:
        out.append("")
        out.extend(_render_gpu(report["host"], procs))

    if report["failures_unknown_gpu"]:
        out.append("")
        out.append("failed calls on an unknown GPU")
        out.extend(_failure_table(report["failures_unknown_gpu"]))

    if report["processes"]:
        out.append("")
        out.append("processes")
        rows = [
            [str(p["pid"]), p["rank"], ",".join("host" if g < 0 else str(g) for g in p["gpus"]) or "-",
             _t_exit(p, tr), p["short"]]
            for p in report["processes"]
        ]
        out.extend(table(["PID", "RANK", "GPUS", "EXIT", "COMMAND"], rows, right={0}))

    if report["phases"] or report["instants"]:
        out.append("")
        out.append("phases")
        keyed = []
        for ph in report["phases"]:
            name = "  " * ph["depth"] + ph["name"] + ("" if ph["closed"] else " (unclosed)")
            keyed.append(
                ((ph["pid"], ph["start_ts"], 0, ph["id"]),
                 [str(ph["pid"]), name, _t(ph["start_s"]), _t(ph["end_s"]), f"{ph['end_s'] - ph['start_s']:.3f}s",
                  _values(ph["values"])])
            )
        for n, i in enumerate(report["instants"]):
            keyed.append(
                ((i["pid"], i["ts"], 1, n),
                 [str(i["pid"]), f"* {i['name']}", _t(i["t_s"]), "", "", _values(i["values"])])
            )
        rows = [row for _, row in sorted(keyed, key=lambda kr: kr[0])]
        out.extend(table(["PID", "PHASE", "START", "END", "DURATION", "VALUES"], rows, right={0, 2, 3, 4}))
    return "\n".join(out) + "\n"


def _t_exit(p: dict, tr: dict) -> str:
    if p["exit_ts"] is None:
        return "-"
    return _t(_sec(p["exit_ts"] - tr["start_ts"]))


def _render_gpu(sec: dict, procs: dict) -> list[str]:
    out: list[str] = []
    g = sec["gpu"]
    if g < 0:
        title = "HOST (pinned memory) and device memory of unknown GPU"
    else:
        bits = [f"GPU {g}"]
        if sec["name"]:
            bits.append(sec["name"])
        if sec["uuid"]:
            bits.append(sec["uuid"])
        if sec["total"]:
            bits.append(f"{human(sec['total'])} total")
        title = "  ".join(bits)
    out.append(title)
    out.append("=" * len(title))
    pk = sec["peak"]
    final = human(sec["final"]["bytes"])
    out.append(f"  peak traced   {human(pk['bytes'])} at {_t(pk['t_s'])}    final traced   {final}")
    nv = sec["nvml"]
    if nv is not None:
        line = f"  NVML used     last {human(nv['last_used'])}, peak {human(nv['peak_used'])}"
        line += f" at {_t(nv['peak_used_t_s'])}"
        line += f"; reserved last {human(nv['last_reserved'])}, peak {human(nv['peak_reserved'])}"
        out.append(line)
        if "untraced_at_last" in nv:
            out.append(
                f"                not traced at the last sample: {human(nv['untraced_at_last'])} "
                f"(contexts, pools, other processes)"
            )

    if sec["categories"]:
        out.append("")
        rows = [
            [c["category"], human(c["peak"]), _t(c["peak_t_s"]), human(c["final"]),
             _CATEGORY_NOTE.get(c["category"], "")]
            for c in sec["categories"]
        ]
        out.extend(table(["CATEGORY", "PEAK", "AT", "FINAL", ""], rows, right={1, 2, 3}))

    if sec["processes"]:
        out.append("")
        rows = []
        for p in sec["processes"]:
            rows.append(
                [str(p["pid"]), p["rank"], human(p["peak"]), _t(p["peak_t_s"]), human(p["final"]),
                 human(p["mapped_peak"]) if p["mapped_peak"] else "-",
                 human(p["held_at_exit"]) if p["held_at_exit"] else "-",
                 human(p["nvml_used"]) if p["nvml_used"] is not None else "-",
                 p["process"]]
            )
        out.extend(
            table(
                ["PID", "RANK", "PEAK", "AT", "FINAL", "MAPPED", "HELD AT EXIT", "NVML USED", "COMMAND"],
                rows, right={0, 2, 3, 4, 5, 6, 7},
            )
        )

    if sec.get("reconciliation"):
        out.append("")
        out.extend(_render_reconciliation(sec["reconciliation"], procs))

    if sec["phases"]:
        out.append("")
        out.append("  by phase (net bytes per category during each phase of the process that made them; owned totals)")
        cats = [c for c in CATEGORIES if any(c in r["by_category"] for r in sec["phases"])]
        rows = []
        for r in sec["phases"]:
            rows.append(
                [str(r["pid"]), r["path"], _t(r["start_s"]), _t(r["end_s"])]
                + [human(r["by_category"][c]) if c in r["by_category"] else "-" for c in cats]
                + [human(r["allocated"]), human(r["freed"]), human(r["net"])]
            )
        out.extend(
            table(
                ["PID", "PHASE", "START", "END"] + [c.upper() for c in cats] + ["ALLOCATED", "FREED", "NET OWNED"],
                rows, right=set(range(2, 7 + len(cats))) | {0},
            )
        )

    if sec["held_at_exit"]:
        out.append("")
        out.append("  held at exit (freed implicitly when the process exited)")
        rows = [
            [str(r["pid"]), _t(r["t_s"]), human(r["owned"]), human(r["mapped"]) if r["mapped"] else "-",
             str(r["count"]), "; ".join(_holding_text(h) for h in r["largest"])]
            for r in sec["held_at_exit"]
        ]
        out.extend(table(["PID", "EXIT AT", "OWNED", "MAPPED", "PIECES", "LARGEST"], rows, right={0, 1, 2, 3, 4}))

    if sec["failures"]:
        out.append("")
        out.append(f"  failed calls ({len(sec['failures'])}), each with who held what on GPU {g} at that instant")
        failure_lines = _failure_table(sec["failures"])
        out.append(failure_lines[0])
        for f, row in zip(sec["failures"], failure_lines[1:]):
            out.append(row)
            if "holders" not in f:
                continue
            out.append(
                f"        GPU {f['gpu']} then: {human(f['owned_on_gpu'])} owned"
                + (f", {human(f['mapped_on_gpu'])} mapped from peers" if f["mapped_on_gpu"] else "")
            )
            for h in f["holders"]:
                cats = ", ".join(f"{c} {human(b)}" for c, b in h["by_category"].items())
                out.append(f"          {_pid_label(h['pid'], procs)}: {human(h['owned'])} owned ({cats})")
                if h["largest"]:
                    out.append("            largest: " + "; ".join(_holding_text(x) for x in h["largest"]))
        if any(f["gpu_inferred"] for f in sec["failures"]):
            out.append("    (GPU n? = the call named no GPU: inferred from the process's previous calls)")
    return out


def _render_reconciliation(rc: dict, procs: dict) -> list[str]:
    """The "NVML vs traced" table: each process NVML listed, then the whole GPU."""
    out = ["  NVML vs traced (at each NVML sample; untraced = NVML - traced, split below)"]
    rows = []
    for r in rc["processes"]:
        notes = []
        if not r["recorded"]:
            notes.append("not recorded by memrec")
        if r["negative_samples"]:
            notes.append(f"! traced > NVML in {r['negative_samples']} of {r['samples']} samples")
        if r["unavailable"]:
            notes.append(f"{r['unavailable']} sample{'' if r['unavailable'] == 1 else 's'} without a value")
        if r["after_exit_samples"]:
            n = r["after_exit_samples"]
            notes.append(f"{n} sample{'' if n == 1 else 's'} after its exit left out"
                         " (the driver frees later)")
        rows.append(
            [str(r["pid"]), procs.get(r["pid"], {}).get("rank", ""), human(r["nvml_used_last"]),
             human(r["traced_last"]), human(r["untraced_last"]), _range(r["untraced_min"], r["untraced_max"]),
             str(r["samples"]), "; ".join(notes)]
        )
    d = rc["device"]
    if d is not None:
        notes = []
        if d["reserved_last"] is not None:
            notes.append(f"reserved {human(d['reserved_last'])} (driver/firmware, not in used)")
        else:
            notes.append("reserved unknown (NVML v1: used includes it)")
        if d["negative_samples"]:
            notes.append(f"! traced > NVML in {d['negative_samples']} of {d['samples']} samples")
        rows.append(
            ["GPU", "", human(d["used_last"]), human(d["traced_last"]), human(d["untraced_last"]),
             _range(d["untraced_min"], d["untraced_max"]), str(d["samples"]), "; ".join(notes)]
        )
    out.extend(
        table(["PID", "RANK", "NVML USED", "TRACED", "UNTRACED", "UNTRACED MIN..MAX", "SAMPLES", ""], rows,
               right={0, 2, 3, 4, 5, 6})
    )
    if rc["unsampled_pids"]:
        out.append(
            "    traced here but never in NVML's process samples: "
            + ", ".join(f"pid {p}" for p in rc["unsampled_pids"])
            + " (gone between samples, or another PID namespace)"
        )
    out.extend(_render_split(rc, procs))
    return out


def _render_split(rc: dict, procs: dict) -> list[str]:
    """The untraced band split (memrec.analysis.untraced), the contexts, and the split per phase."""
    rows = []
    for r in rc["processes"]:
        sp = r.get("split")
        if sp:
            rows.append([str(r["pid"]), procs.get(r["pid"], {}).get("rank", ""), human(r["untraced_last"]),
                         *(human(sp[k]) for k in SPLIT)])
    d = rc["device"]
    if d is not None and d.get("split"):
        rows.append(["GPU", "", human(sum(d["split"].values())), *(human(d["split"][k]) for k in SPLIT)])
    out: list[str] = []
    if rows:
        out.append("  Untraced, split (at the last sample; unexplained = untraced - the rest; GPU = its processes)")
        out.extend(table(["PID", "RANK", "UNTRACED", "CONTEXT", "MODULE CODE", "POOLS", "BEFORE REC.", "UNEXPLAINED"],
                         rows, right={0, 2, 3, 4, 5, 6, 7}))
        for r in rc["processes"]:
            libs = {k: v for k, v in r.get("module_code_by_library", {}).items() if v}
            if libs:
                out.append(f"    pid {r['pid']} module code: " + "; ".join(f"{k} {human(v)}" for k, v in list(libs.items())[:6]))
    ctx_rows = []
    for c in rc["contexts"]:
        note = f"foreign: pid {c['pid']} owns nothing on this GPU" if c["foreign"] else ""
        ctx_rows.append([_t(c.get("t_s")), str(c["pid"]), c["api"], c["phase"], human(c["cost"]), note])
    if ctx_rows:
        out.append("  Contexts (cost: NVML steps over the bind and the first kernel in it)")
        out.extend(table(["TIME", "PID", "API", "PHASE", "COST", ""], ctx_rows, right={0, 1, 4}))
    phase_rows = []
    for r in rc["processes"]:
        phased = r.get("split_by_phase", [])
        if all(ph["phase"] == NO_PHASE for ph in phased):
            continue  # no markers: the split above says it all
        for ph in phased:
            if any(ph[k] for k in SPLIT if k != "before_recording"):
                phase_rows.append([str(r["pid"]), ph["phase"], *(human(ph[k]) for k in SPLIT if k != "before_recording")])
    if phase_rows:
        out.append("  Untraced steps per phase")
        out.extend(table(["PID", "PHASE", "CONTEXT", "MODULE CODE", "POOLS", "UNEXPLAINED"], phase_rows,
                         right={0, 2, 3, 4, 5}))
    return out


def _range(lo: int | None, hi: int | None) -> str:
    return "-" if lo is None or hi is None else f"{human(lo)}..{human(hi)}"


def _failure_table(failures: list[dict]) -> list[str]:
    rows = []
    for f in failures:
        gpu = "?" if f["gpu"] < 0 else str(f["gpu"]) + ("?" if f["gpu_inferred"] else "")
        size = human(f["size"]) if f["size"] else "-"
        rows.append([_t(f["t_s"]), str(f["pid"]), gpu, f["api"], size, f["result_name"]])
    return table(["TIME", "PID", "GPU", "API", "SIZE", "RESULT"], rows, right={0, 1, 4}, indent="    ")
