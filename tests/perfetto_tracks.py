"""Read a ``.pftrace`` back with Perfetto's own protos, and draw its tracks (the README's picture).

The tests read ``memrec export --to perfetto`` back with :func:`read_perfetto`. :func:`render`
draws what that reader finds, track by track in the file's order, the way Perfetto's UI lays a
trace out (counters as filled steps, slices as nested bars, instants as marks, flows as arrows);
it is not a screenshot of ui.perfetto.dev, which this host cannot reach, and Perfetto's trace
processor needs a binary that the ``perfetto`` package downloads on first use, which it cannot
either. Regenerate the README's picture with::

    .venv/bin/python tests/perfetto_tracks.py examples/sglang-standin-ipc.mrec docs/img/perfetto-sglang-ipc.png
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

#: Rows: a counter or an instant track is one row high, a slice track one row per nesting level.
ROW_INCHES = 0.42


def read_perfetto(path: Path) -> dict:
    """Tracks by uuid (in the file's order) and each track's ``(timestamp, TrackEvent)`` list."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    trace = pb.Trace()
    trace.ParseFromString(Path(path).read_bytes())
    tracks: dict[int, object] = {}
    events: dict[int, list] = {}
    for p in trace.packet:
        if p.HasField("track_descriptor"):
            tracks[p.track_descriptor.uuid] = p.track_descriptor
        elif p.HasField("track_event"):
            assert p.track_event.track_uuid in tracks, "an event before its track's descriptor"
            events.setdefault(p.track_event.track_uuid, []).append((p.timestamp, p.track_event))
    return {"pb": pb, "tracks": tracks, "events": events}


def _name(d) -> str:
    return d.name or d.process.process_name or f"pid {d.process.pid}"


def slices(pb, evs: list) -> list[tuple[int, int, int, str]]:
    """``(start, end, depth, name)`` of each slice: begins and ends paired as a stack, as Perfetto does."""
    out, open_ = [], []
    for ts, e in evs:
        if e.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            open_.append((ts, e.name))
        elif e.type == pb.TrackEvent.TYPE_SLICE_END and open_:
            start, name = open_.pop()
            out.append((start, ts, len(open_), name))
    return out


def render(read: dict, png: Path, title: str = "") -> int:
    """Draw every leaf track of ``read`` as a row, labelled with its group; return the rows drawn.

    The time axis is zoomed, as one would zoom in Perfetto's UI, to the slices and instants (the
    phases and IPC calls) with a margin: the counters' values before it are carried into it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pb, tracks, events = read["pb"], read["tracks"], read["events"]
    stamps = [ts for evs in events.values() for ts, _ in evs]
    t0 = min(stamps)
    marks = [ts for u, evs in events.items() if not tracks[u].HasField("counter") for ts, _ in evs] or stamps
    pad = max((max(marks) - min(marks)) * 0.15, 1e6)
    window = ((min(marks) - pad - t0) / 1e6, (max(marks) + pad - t0) / 1e6)
    leaves = [u for u in tracks if u in events]
    # Slice rows per nesting level, then a row for instants (below the slices when there are both).
    depths = [max((s[2] + 1 for s in slices(pb, events[u])), default=0) for u in leaves]
    heights = [max(1, d + any(e.type == pb.TrackEvent.TYPE_INSTANT for _, e in events[u]))
               for u, d in zip(leaves, depths)]
    fig, axes = plt.subplots(len(leaves), 1, sharex=True, figsize=(11, 0.6 + ROW_INCHES * (sum(heights) + len(leaves))),
                             gridspec_kw={"height_ratios": [h + 0.6 for h in heights], "hspace": 0.12})
    where: dict[int, tuple] = {}  # flow id -> (axes, x, y) of the instant that starts or ends it
    for ax, uuid, height, depth_rows in zip(axes, leaves, heights, depths):
        d = tracks[uuid]
        parent = tracks.get(d.parent_uuid)
        ax.set_ylabel(f"{_name(parent)}\n{_name(d)}" if parent is not None else _name(d), rotation=0,
                      ha="right", va="center", fontsize=7)
        ax.tick_params(axis="y", left=False, labelleft=False)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        evs = events[uuid]
        if d.HasField("counter"):
            xs = [(ts - t0) / 1e6 for ts, _ in evs] + [(max(stamps) - t0) / 1e6]
            ys = [e.counter_value / 2**30 for _, e in evs]
            ys.append(ys[-1])
            ax.fill_between(xs, ys, step="post", alpha=0.45, color="C0")
            ax.step(xs, ys, where="post", color="C0", linewidth=0.8)
            ax.set_ylim(0, max(max(ys), 1e-9) * 1.15)
            ax.text(1.005, 0.5, f"max {max(ys):.2f} GiB", transform=ax.transAxes, fontsize=7, va="center")
            continue
        ax.set_ylim(height, -0.15)
        for n, (start, end, depth, name) in enumerate(slices(pb, evs)):
            x, w = (start - t0) / 1e6, max((end - start) / 1e6, 1e-3)
            ax.barh(depth + 0.45, w, left=x, height=0.85, color=f"C{n % 10}", alpha=0.75, edgecolor="white")
            ax.text(x + w / 2, depth + 0.45, name, ha="center", va="center", fontsize=6, clip_on=True)
        for ts, e in evs:
            if e.type != pb.TrackEvent.TYPE_INSTANT:
                continue
            x, y = (ts - t0) / 1e6, depth_rows + 0.45
            ax.plot([x], [y], marker="D", color="C3", markersize=5)
            ax.annotate(e.name, (x, y), xytext=(4, -2), textcoords="offset points", fontsize=6)
            for f in list(e.flow_ids) + list(e.terminating_flow_ids):
                where.setdefault(f, []).append((ax, x, y))
    for ends in where.values():
        if len(ends) == 2:  # the start first: it was written before its end
            (a0, x0, y0), (a1, x1, y1) = ends
            fig.add_artist(matplotlib.patches.ConnectionPatch(
                (x0, y0), (x1, y1), coordsA=a0.transData, coordsB=a1.transData, arrowstyle="->", color="C3",
                linewidth=0.8))
    axes[-1].set_xlim(*window)
    axes[-1].set_xlabel("milliseconds from the first event in the file (the trace's CLOCK_MONOTONIC)")
    if title:
        axes[0].set_title(title, fontsize=9, loc="left")
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return len(leaves)


def main(argv: list[str]) -> int:
    from memrec.commands import main as memrec

    trace, png = Path(argv[0]), Path(argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        pftrace = Path(tmp) / "run.pftrace"
        if memrec(["export", str(trace), "--to", "perfetto", "-o", str(pftrace)]) != 0:
            return 1
        rows = render(read_perfetto(pftrace), png, f"memrec export {trace.name} --to perfetto: the tracks of the .pftrace")
    print(f"{png}: {rows} tracks")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
