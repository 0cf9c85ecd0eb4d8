"""The report's first three lines: what failed, what caused it on which GPU, and what to change.

:func:`build_answer` reads the report's own dict (nothing is replayed again) and returns three
lines, each a label and parts: the first part must be shown, the later ones are added while the
line fits the terminal (:func:`fit`), so an 80-column report loses detail, never a number cut in
half. The cases, in order:

1. SGLang's KV-cache sizing failed (the markers carry SGLang's own numbers): the ranks and the
   error; the phases that took memory between SGLang's baseline and its sizing, other than the
   weights, on the GPU of the worst rank; the ``--mem-fraction-static`` that works and the flag
   that drops the phase that took most (custom all-reduce, CUDA graphs).
2. A driver call failed: the first out-of-memory (else the first failed call), with what the
   GPU held then, by the phase that allocated it, and how much would have had to be free.
3. Nothing failed: the highest traced peak, what held it by phase, and the headroom left.

A trace without a trailer (the recorder crashed or was killed, a file still being written, a
partial copy) says so in the first line: ``PARTIAL cut short (no trailer): ...`` instead of
``OK``, and "(trace cut short)" after a failure, since what was not read may hold the failure or the peak.
"""

from __future__ import annotations

import math
import re

from memrec.analysis.text import human

#: SGLang phases (memrec's hook names) whose memory a server flag removes or shrinks.
PHASE_FLAGS = {
    "custom_ar_init": "--disable-custom-all-reduce",
    "cuda_graph_capture": "--disable-cuda-graph or a smaller --cuda-graph-max-bs",
    "attention_workspace": "a smaller --max-running-requests",
}
#: What a failed call's result means when it is not a lack of memory.
RESULT_HINTS = {
    "CUDA_ERROR_NOT_PERMITTED": "not allowed now (e.g. inside a CUDA graph capture)",
    "CUDA_ERROR_INVALID_VALUE": "an argument the driver refused (size 0, bad flags)",
    "CUDA_ERROR_INVALID_CONTEXT": "no CUDA context current on the calling thread",
    "CUDA_ERROR_NOT_INITIALIZED": "cuInit was not called in this process",
    "CUDA_ERROR_INVALID_DEVICE": "a device ordinal this process cannot see",
}
OOM = "CUDA_ERROR_OUT_OF_MEMORY"
LABEL_WIDTH = 8


def build_answer(report: dict) -> dict:
    """``{"status": "failed"|"ok"|"empty", "lines": [[label, part, ...] x 3]}`` for ``report``."""
    sg = report.get("sglang") or {}
    summary = sg.get("summary") or {}
    if summary.get("failed") and summary.get("kv_failed"):
        return {"status": "failed", "lines": _cut_short(report, _sglang_failed(sg, summary))}
    failures = [f for sec in report["gpus"] + ([report["host"]] if report["host"] else []) for f in sec["failures"]]
    failures += report["failures_unknown_gpu"]
    if failures:
        return {"status": "failed", "lines": _cut_short(report, _call_failed(report, failures))}
    secs = [s for s in report["gpus"] if s.get("peak") and s["peak"]["bytes"]]
    if not secs:
        return {"status": "empty", "lines": _cut_short(report, [["OK", "no GPU memory was allocated in this trace"]])}
    return {"status": "ok", "lines": _cut_short(report, _no_failure(report, secs, sg, summary))}


def _cut_short(report: dict, lines: list[list[str]]) -> list[list[str]]:
    """The answer of a trace without a trailer says so first: what was not read may hold the
    failure or the peak, so neither "OK" nor a lone failure is the whole answer."""
    if report["trace"].get("complete", True):
        return lines
    first = list(lines[0])
    if first[0] == "OK":
        text = first[1].replace(" in this trace", "")
        first = ["PARTIAL", f"cut short (no trailer): {text}", " in what was read", *first[2:]]
    else:
        first = [first[0], f"{first[1]} (trace cut short)", *first[2:]]
    return [first, *lines[1:]]


def fit(line: list[str], width: int) -> str:
    """One answer line: the label, the first part, then each later part while the line fits."""
    label, first, *rest = line
    text = f"{label:<{LABEL_WIDTH}}{first}"
    for part in rest:
        if len(text) + len(part) <= width:
            text += part
    return text


def span(labels: list[str]) -> str:
    """Rank labels as a range where they run on: TP0, TP1, ..., TP7 -> "TP0–TP7"."""
    parsed = [re.fullmatch(r"([A-Za-z ]*?)(\d+)", x) for x in labels]
    if len(labels) > 2 and all(parsed) and len({m.group(1) for m in parsed}) == 1:
        nums = sorted(int(m.group(2)) for m in parsed)
        if nums == list(range(nums[0], nums[0] + len(nums))):
            prefix = parsed[0].group(1)
            return f"{prefix}{nums[0]}–{prefix}{nums[-1]}"
    return ", ".join(labels)


def _gib(x: float) -> str:
    return f"{x:.2f} GiB"


def _short_error(text: str) -> str:
    """The error's first sentence without the exception class: "Not enough memory"."""
    text = text.split(". ")[0].rstrip(".")
    return re.sub(r"^[A-Za-z_.]*(Error|Exception): ", "", text)


def _sglang_failed(sg: dict, summary: dict) -> list[list[str]]:
    labels = summary.get("failed_labels") or []
    error = _short_error((summary.get("errors") or ["KV cache sizing failed"])[0])
    first = ["FAILED", f"SGLang's KV cache sizing on {span(sorted(labels))}: {error}"]
    if summary.get("min_rest_gib") is not None:
        first.append(f" (rest {_gib(summary['min_rest_gib'])})")
    ranks = sg.get("ranks", [])  # (only the filtered process's with -p)
    worst = summary.get("min_rest_label")
    rank = next((r for r in ranks if r["label"] == worst), None)
    if rank is None:  # the worst rank is filtered out: the first shown rank whose sizing failed
        rank = next((r for r in ranks if any(not b.get("ok", True) for b in r.get("budgets", []))),
                    ranks[0] if ranks else None)
        worst = rank["label"] if rank else worst
    gpu = rank["gpu"] if rank else None
    windows = sg.get("windows", [])
    window = next((w for w in windows if w["gpu"] == gpu), windows[0] if windows else None)
    extras: dict[str, dict] = {}
    if window is not None:
        gpu = window["gpu"]
        for row in window["between"]:
            if row["weights"] or not row["owned"]:
                continue
            e = extras.setdefault(row["name"], {"owned": 0, "labels": []})
            e["owned"] += row["owned"]
            e["labels"].append(row["label"])
    order = sorted(extras.items(), key=lambda kv: -kv[1]["owned"])
    if order:
        name, e = order[0]
        cause = ["CAUSE", f"GPU {gpu}: {name} took {human(e['owned'])}"]
        cause.append(f" ({span(sorted(e['labels']))})")
        cause.append(" after SGLang's memory baseline")
        for other, o in order[1:3]:
            cause.append(f"; {other} {human(o['owned'])}")
    else:
        cause = ["CAUSE", f"GPU {gpu}: the weights and what was already in use left too little for the KV cache"]
    need = summary.get("needed_mem_fraction_static")
    ran = summary.get("mem_fraction_static") or []
    fix = ["FIX"]
    if need is not None and need < 1:
        fix.append(f"--mem-fraction-static {math.ceil(need * 100) / 100:.2f}+")
        if ran:
            fix.append(f" (was {ran[0]:.3f})")
    else:
        fix.append("no --mem-fraction-static below 1 fits: free memory before the KV sizing")
    if order and order[0][0] in PHASE_FLAGS:
        fix.append(f", or {PHASE_FLAGS[order[0][0]]}")
    if order:
        diag = next((b.get("diagnosis") for r in ranks for b in r.get("budgets", [])
                     if r["label"] == worst and b.get("diagnosis")), None)
        if diag and diag.get("rest_without_extras_gib") is not None:
            fix.append(f" (without it rest = {_gib(diag['rest_without_extras_gib'])})")
    return [first, cause, fix]


def _who(pids: list[int], procs: dict[int, dict]) -> str:
    labels = [procs.get(p, {}).get("rank") or f"pid {p}" for p in pids]
    return span(labels)


def _call_failed(report: dict, failures: list[dict]) -> list[list[str]]:
    procs = {p["pid"]: p for p in report["processes"]}
    f = next((x for x in failures if x["result_name"] == OOM), failures[0])
    where = f"GPU {f['gpu']}" if f["gpu"] >= 0 else "an unknown GPU"
    size = f" of {human(f['size'])}" if f["size"] else ""
    first = ["FAILED", f"{f['api']}{size} on {where}: {f['result_name']}",
             f", {_who([f['pid']], procs)} at +{f['t_s']:.3f}s"]
    if len(failures) > 1:
        first.append(f" (+{len(failures) - 1} more failed call{'s' if len(failures) > 2 else ''})")
    phases = f.get("by_phase") or []
    if f["result_name"] != OOM:
        hint = RESULT_HINTS.get(f["result_name"], "see the call's arguments and state")
        cause = ["CAUSE", f"not a lack of memory: {hint}"]
        phase = f" in {f['phase']}" if f.get("phase") and not f["phase"].startswith("(") else ""
        fix = ["FIX", f"nothing to free: see what {_who([f['pid']], procs)} did at +{f['t_s']:.3f}s{phase}"]
        return [first, cause, fix]
    cause = ["CAUSE", f"{where} held {human(f.get('owned_on_gpu', 0))} then"]
    for k, ph in enumerate(phases[:3]):
        cause.append(f"{':' if k == 0 else ','} {ph['phase']} {human(ph['bytes'])} ({_who(ph['pids'], procs)})")
    sec = next((s for s in report["gpus"] if s["gpu"] == f["gpu"]), None)
    total = sec.get("total") if sec else None
    free = f.get("nvml_free")
    if total and f["size"] > total:
        fix = ["FIX", f"ask for less: {human(f['size'])} is more than {where}'s {human(total)}"]
    elif free is not None:
        short = f["size"] - free
        if short > 0:
            fix = ["FIX", f"free {human(short)} on {where} first",
                   f" (it needed {human(f['size'])}, NVML had {human(free)} free)"]
        else:
            fix = ["FIX", f"NVML had {human(free)} free for {human(f['size'])}: see NVML vs traced below",
                   " (memory memrec did not see: contexts, other processes)"]
    elif total:
        room = total - f.get("owned_on_gpu", 0)
        fix = ["FIX", f"free {human(max(f['size'] - room, 0))} on {where} first",
               f" (it needed {human(f['size'])}; {human(total)} total minus what memrec saw held)"]
    else:
        fix = ["FIX", f"free memory on {where} before this call or ask for less than {human(f['size'])}"]
    if phases and fix[0] == "FIX":
        fix.append(f"; the largest holder is {phases[0]['phase']}")
    return [first, cause, fix]


def _no_failure(report: dict, secs: list[dict], sg: dict, summary: dict) -> list[list[str]]:
    procs = {p["pid"]: p for p in report["processes"]}
    sec = max(secs, key=lambda s: (s["peak"]["bytes"], -s["gpu"]))
    pk = sec["peak"]
    first = ["OK", f"no failed call; highest peak {human(pk['bytes'])} on GPU {sec['gpu']} at +{pk['t_s']:.3f}s"]
    if sec.get("total"):
        first.append(f" of {human(sec['total'])}")
    others = [s["gpu"] for s in secs if s is not sec and s["peak"]["bytes"] == pk["bytes"]]
    if others:
        first.append(f" (same on GPU {span([str(g) for g in others])})")
    held = ["PEAK", f"held at the peak on GPU {sec['gpu']}"]
    for k, ph in enumerate(pk.get("by_phase") or []):
        if k == 3:
            break
        held.append(f"{':' if k == 0 else ','} {ph['phase']} {human(ph['bytes'])} ({_who(ph['pids'], procs)})")
    if len(held) == 2:
        held = ["PEAK", f"GPU {sec['gpu']} held {human(pk['bytes'])} at its peak (no phase markers)"]
    third = ["ROOM"]
    if summary and summary.get("min_rest_gib") is not None:
        third.append(f"KV cache sized on every rank: smallest rest {_gib(summary['min_rest_gib'])}"
                     f" ({summary.get('min_rest_label')})")
        if summary.get("min_tokens") is not None:
            third.append(f", {summary['min_tokens']:,} tokens")
    elif sec.get("total"):
        nv = sec.get("nvml") or {}
        used = nv.get("peak_used")
        if used is not None:
            third.append(f"GPU {sec['gpu']}: {human(sec['total'] - used)} never used (NVML peak {human(used)})")
        else:
            third.append(f"GPU {sec['gpu']}: {human(sec['total'] - pk['bytes'])} above the traced peak"
                         " (contexts and untraced memory not counted)")
    else:
        third.append("GPU totals unknown (no NVML in this trace)")
    return [first, held, third]
