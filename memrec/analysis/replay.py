"""Where a trace's replay starts and what span it covers: shared by the report, the API and the exports.

A rotated file continues the previous file's state: its keyframe at event 0 is the state the replay
starts from (:func:`initial_state`). The span of a trace (:func:`trace_bounds`) is what every
``+N.NNNs`` a user reads is relative to, so the report, ``memrec.load``, the plot and the exports
must agree on it: one function.
"""

from __future__ import annotations

from typing import Any

from memrec.state import LiveState


def initial_state(trace: Any) -> tuple[LiveState | None, list[str]]:
    """The state the file starts from (journal on): its keyframe at event 0, or None (empty).

    Returns the state and notes for the user (a keyframe this memrec cannot read is replayed over).
    """
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


def trace_bounds(trace: Any) -> tuple[int, int]:
    """The trace's first and last timestamp over events, markers and samples (trailer end if later).

    The recording's start (the header's monotonic anchor) counts as a first timestamp: times are
    relative to when memrec started recording, not to the first event.
    """
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
