"""What a report says about a merged trace (``memrec merge``): the header's ``merged`` map as a
report section, and its lines. The merge itself is the engine's (:mod:`memrec.engine.merge`); its
words are the analysis', so that the engine renders no text.
"""

from __future__ import annotations


def merged_summary(header: dict) -> dict | None:
    """The header's ``merged`` map as a report shows it (None for a trace of one recording)."""
    merged = header.get("merged")
    if not isinstance(merged, dict):
        return None
    return {
        "reference": merged.get("reference"),
        "clock_error_ns": merged.get("clock_error_ns"),
        "clock_error_why": merged.get("clock_error_why"),
        "hosts": [
            {k: h.get(k) for k in ("index", "host", "boot_id", "pid_base", "gpus", "offset_ns", "events", "lost", "complete", "files")}
            for h in merged.get("hosts") or [] if isinstance(h, dict)
        ],
    }


def render_merged(summary: dict) -> list[str]:
    """The report's lines about a merged trace: hosts, their pids and GPUs, the clock error."""
    err = summary.get("clock_error_ns")
    err_text = f"±{err / 1e6:.3f} ms" if isinstance(err, int) else "unknown"
    out = [f"  merged: {len(summary['hosts'])} hosts on {summary['reference']}'s clock; "
           f"expected clock error {err_text} ({summary.get('clock_error_why')})"]
    for h in summary["hosts"]:
        gpus = ", ".join(f"GPU {m} = {h['host']}:{own}" for m, own in sorted(h["gpus"].items(), key=lambda kv: int(kv[0])))
        pids = f"pids {h['pid_base']} + pid" if h["pid_base"] else "pids as recorded"
        out.append(f"    {h['host']}: {pids}; clock {h['offset_ns'] / 1e9:+.6f} s; "
                   f"{h['events']:,} events{'' if h['complete'] else ' (incomplete)'}; {gpus or 'no GPUs'}")
    return out
