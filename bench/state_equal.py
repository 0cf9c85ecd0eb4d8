"""Whether this LiveState gives what another one (main's) gives, batch by batch: the check a
change of the daemon path's speed must pass before it is measured.

    .venv/bin/python bench/state_equal.py --baseline /path/to/main/memrec/state [--events 60000]
                                          [--batches 20000,3000,257] [--seeds 1,2]

Both states are applied the daemon's way (``bench_state.py``'s churn and VMM mixes, decoded
batches of each size, with and without the journal; the trace written, a keyframe every 5
batches) and compared after every batch: the counters, owned totals, peaks, anomalies, failures,
exports, exported pointers, opens, host buffers and aliases, the VMM handles and mappings, the
snapshot, the journal and the GPUs filled into the events; at the end the written trace byte for
byte and every table's ``check()``. Prints each case and exits 1 at the first difference.
(``bench_state.py --baseline`` loads the other package the same way.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_state import load_baseline  # noqa: E402
from bench_state import churn  # noqa: E402
from bench_state import decode  # noqa: E402
from bench_state import mixed  # noqa: E402

from memrec.state import LiveState  # noqa: E402
from memrec.trace.format import make_header  # noqa: E402
from memrec.trace.writer import BytesSink  # noqa: E402
from memrec.trace.writer import TraceWriter  # noqa: E402

KEYFRAME_EVERY = 5


def _view(state) -> dict:
    """Everything a state holds that a reader can see, as plain values."""
    t = state.tables
    return {
        "bytes": dict(t.bytes), "gpu_owned": dict(t.gpu_owned), "peaks": {g: list(p) for g, p in t.peaks.items()},
        "anomalies": dict(state.anomalies), "failures": [list(f) for f in state.failures],
        "n_failures": state.n_failures, "exports": {k: list(v) for k, v in t.exports.items()},
        "exported": {p: {q: list(h) for q, h in d.items()} for p, d in t.exported.items()},
        "opens": {p: {q: list(o) for q, o in d.items()} for p, d in t.opens.items()},
        "host": {p: {q: list(h) for q, h in d.items()} for p, d in t.host.items()},
        "aliases": {p: dict(d) for p, d in t.aliases.items()}, "fabric": {k: list(v) for k, v in t.fabric.items()},
        "handles": t.handles.flat(), "maps": t.maps.flat(), "allocs": t.allocs.flat(),
        "n": state.n_events, "ts": state.last_ts, "exits": [list(map(list, e[2:])) + e[:2] for e in t.exits],
    }


def run_case(new_cls, old_cls, gen, seed: int, events: int, batch: int, journal: bool) -> str | None:
    """Apply both over one mix; the first difference (None: none)."""
    raw = gen(events, seed)
    header = make_header(host="eq", boot_id="eq", anchor={"monotonic_ns": 0, "wall_ns": 0}, gpus=[])
    states, sinks, writers = [], [], []
    for cls in (new_cls, old_cls):
        states.append(cls(journal=journal))
        sinks.append(BytesSink())
        writers.append(TraceWriter(sinks[-1], header))
    for n, lo in enumerate(range(0, len(raw), batch)):
        decoded = decode(raw[lo : lo + batch])
        evs = [decoded.copy(), decoded.copy()]
        for s, w, ev in zip(states, writers, evs):
            s.apply(ev)
            w.write_events(ev)
        if not (evs[0] == evs[1]).all():
            return f"batch {n}: the events' filled-in GPUs differ"
        views = [_view(s) for s in states]
        for key in views[0]:
            if views[0][key] != views[1][key]:
                return f"batch {n}: {key} differs"
        if journal and states[0].journal != states[1].journal:
            return f"batch {n}: the journal differs"
        snaps = [s.snapshot() for s in states]
        if snaps[0] != snaps[1]:
            return f"batch {n}: the snapshot differs"
        if n % KEYFRAME_EVERY == KEYFRAME_EVERY - 1:
            for s, w, snap in zip(states, writers, snaps):
                w.write_keyframe(s.last_ts, snap)
    for w in writers:
        w.close()
    if sinks[0].data != sinks[1].data:
        return "the written traces differ"
    for table in ("allocs", "handles", "maps"):
        getattr(states[0].tables, table).check()
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the other memrec/state/ folder (or state.py)")
    parser.add_argument("--events", type=int, default=60_000)
    parser.add_argument("--batches", default="20000,3000,257")
    parser.add_argument("--seeds", default="1,2")
    args = parser.parse_args()
    old_cls = load_baseline(args.baseline).LiveState
    bad = 0
    for gen in (mixed, churn):
        for seed in map(int, args.seeds.split(",")):
            for batch in map(int, args.batches.split(",")):
                for journal in (False, True):
                    what = run_case(LiveState, old_cls, gen, seed, args.events, batch, journal)
                    print(f"{gen.__name__} seed {seed} batch {batch:>6} journal {journal!s:5}: {what or 'identical'}",
                          flush=True)
                    bad += what is not None
    print("all identical" if not bad else f"{bad} cases differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
