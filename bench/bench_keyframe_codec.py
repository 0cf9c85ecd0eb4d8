"""A keyframe at a million live allocations, its columns Zstandard-compressed (what the daemon
writes), zlib-compressed (what it wrote before) or raw inside the record's Zstandard frame:
bytes and time.

    .venv/bin/python bench/bench_keyframe_codec.py [--live 1000000] [--repeat 3]

Per repeat and variant: the bytes of the keyframe record as the file holds it; the time to build
the snapshot's columns from the state's copies (sort, delta, compression: the daemon does this
in a thread); the time to encode the record (msgpack, then Zstandard: the daemon's loop does this
when it writes the keyframe); the time to read it back (decode the record, restore the columns).
CPU times of this process (the machine is shared: compare within a run).
"""

from __future__ import annotations

import argparse
import sys
import time
import types
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_state import live_state  # noqa: E402
from memrec.state import LiveState  # noqa: E402
from memrec.state import snapshot as snap  # noqa: E402
from memrec.trace.format import encode_record  # noqa: E402
from memrec.trace.format import expand_keyframe  # noqa: E402
from memrec.trace.format import keyframe_record  # noqa: E402
from memrec.trace.format import unpackb  # noqa: E402


def timed(fn):
    t = time.process_time()
    out = fn()
    return out, time.process_time() - t


def variant(state: LiveState, name: str) -> dict:
    """One variant's numbers: ``zstd`` (the daemon's columns), ``zlib`` (before) or ``raw``."""
    later, take = timed(state.snapshot_later)
    stand_in = {"zlib": lambda data: zlib.compress(data, 1), "raw": bytes}.get(name)
    real = snap.codec
    if stand_in is not None:  # the same sorted, delta-coded columns, through another compressor
        snap.codec = types.SimpleNamespace(compress=stand_in)  # type: ignore[assignment]
    try:
        state_dict, build = timed(later)
    finally:
        snap.codec = real
    if name == "zlib":
        del state_dict["allocs"]["z"]  # as the files of then: no codec flag
    data, encode = timed(lambda: encode_record(keyframe_record(1, 0, state_dict)))

    def read() -> dict:
        allocs = expand_keyframe(unpackb(data))["state"]["allocs"]
        if name == "raw":
            return {k: np.frombuffer(allocs[k], dt) for k, dt in snap.ALLOC_COLUMNS.items()}
        return snap.alloc_arrays(allocs)

    _, decode = timed(read)
    return {"bytes": len(data), "take": take, "build": build, "encode": encode, "decode": decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--live", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    state = live_state(LiveState, args.live)
    print(f"{args.live:,} live allocations")
    print(f"{'variant':8} {'record MB':>10} {'build ms':>9} {'encode ms':>10} {'build+encode':>13} {'decode ms':>10}")
    for r in range(args.repeat):
        for name in ("zstd", "zlib", "raw"):
            v = variant(state, name)
            print(f"{name:8} {v['bytes'] / 1e6:10.2f} {v['build'] * 1e3:9.0f} {v['encode'] * 1e3:10.0f} "
                  f"{(v['build'] + v['encode']) * 1e3:13.0f} {v['decode'] * 1e3:10.0f}")


if __name__ == "__main__":
    main()
