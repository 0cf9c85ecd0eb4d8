"""Match what a workload says it did (its *facts*) against what the recorder saw (events).

Pure functions, so ``memrec selftest`` on a GPU host and the unit tests here share the same
checks. A fact is one JSON object a workload printed per driver call (see
:mod:`memrec.validation.gpu.driver_calls`); it matches exactly one recorded event of the same process, API
and arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import Api
from memrec.terms.events import Kind

#: Fact "call" → (event kind, the fact fields that must equal the event's columns).
_EXPECTED: dict[str, tuple[Kind, tuple[str, ...]]] = {
    "cuMemAlloc_v2": (Kind.ALLOC, ("size", "ptr", "result")),
    "cuMemFree_v2": (Kind.FREE, ("ptr", "result")),
    "cuMemCreate": (Kind.VMM_CREATE, ("size", "handle", "result")),
    "cuMemAddressReserve": (Kind.VA_RESERVE, ("size", "ptr", "result")),
    "cuMemMap": (Kind.VMM_MAP, ("size", "ptr", "handle", "result")),
    "cuMemUnmap": (Kind.VMM_UNMAP, ("size", "ptr", "result")),
    "cuMemRelease": (Kind.VMM_RELEASE, ("handle", "result")),
    "cuMemAddressFree": (Kind.VA_FREE, ("size", "ptr", "result")),
    "cuMemHostAlloc": (Kind.HOST_ALLOC, ("size", "ptr", "result")),
    "cuMemFreeHost": (Kind.HOST_FREE, ("ptr", "result")),
    "cuIpcGetMemHandle": (Kind.IPC_EXPORT, ("ptr", "ipc", "result")),
    "cuIpcOpenMemHandle_v2": (Kind.IPC_OPEN, ("ptr", "ipc", "result")),
    "cuIpcCloseMemHandle": (Kind.IPC_CLOSE, ("ptr", "result")),
}

#: Device-memory calls whose event must land on the expected physical GPU.
_ON_GPU = {
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemCreate",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemRelease",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
}


@dataclass(frozen=True)
class CheckResult:
    """One line of the selftest: a fact, whether it was recorded exactly, and why not."""

    name: str
    passed: bool
    detail: str


def _describe(fact: dict) -> str:
    parts = [fact["call"]]
    for key in ("size", "ptr", "handle"):
        if fact.get(key):
            value = fact[key]
            parts.append(f"{key}={value:#x}" if key != "size" else f"size={value}")
    if fact.get("result"):
        parts.append(f"result={fact['result']}")
    parts.append(f"pid={fact['pid']}")
    return " ".join(parts)


def _column_matches(events: np.ndarray, fact: dict, field: str) -> np.ndarray:
    if field == "ipc":
        want = bytes.fromhex(fact["ipc"])
        has = (events["flags"] & FLAG_IPC_BYTES) != 0
        same = np.array([bytes(v) == want for v in events["ipc"]], dtype=bool)
        return has & same
    return events[field] == np.asarray(fact[field]).astype(events.dtype[field])


def check_facts(facts: list[dict], events: np.ndarray, expected_gpu: int | None) -> list[CheckResult]:
    """Check every fact against ``events``; each event can satisfy one fact only.

    Args:
        facts: what the workload did, in order.
        events: recorded events (EVENT_DTYPE) of at least the workload's processes.
        expected_gpu: the physical GPU (NVML index) the calls ran on; None skips that check.
    """
    results: list[CheckResult] = []
    used = np.zeros(len(events), dtype=bool)
    for fact in facts:
        call = fact.get("call")
        if call not in _EXPECTED:
            continue
        kind, fields = _EXPECTED[call]
        candidates = (events["pid"] == fact["pid"]) & (events["kind"] == kind) & ~used
        candidates &= events["api"] == int(Api[call])
        for field in fields:
            if field in fact:
                candidates &= _column_matches(events, fact, field)
        name = _describe(fact)
        hits = np.flatnonzero(candidates)
        if len(hits) == 0:
            results.append(CheckResult(name, False, "not recorded"))
            continue
        index = hits[0]
        used[index] = True
        gpu = int(events["gpu"][index])
        if expected_gpu is not None and call in _ON_GPU and gpu != expected_gpu:
            results.append(CheckResult(name, False, f"recorded on GPU {gpu}, expected GPU {expected_gpu}"))
            continue
        results.append(CheckResult(name, True, f"recorded (gpu {gpu})"))
    return results


def check_exits(pids: set[int], events: np.ndarray) -> list[CheckResult]:
    """Every workload process's exit must be recorded (its memory is freed implicitly then)."""
    exited = set(events["pid"][events["kind"] == Kind.PROC_EXIT].tolist())
    return [
        CheckResult(f"process exit pid={pid}", pid in exited, "recorded" if pid in exited else "not recorded")
        for pid in sorted(pids)
    ]
