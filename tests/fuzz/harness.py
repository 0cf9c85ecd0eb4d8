"""What every fuzz input must survive, shared by the bounded hypothesis tests and the long run.

- :func:`check_trace_bytes`: a file of any bytes, given to ``memrec report``, ``report --json``,
  ``dump`` and the TUI's loading path (the file source's scan, the replay, the queries the views
  make), must give exit code 0 (read, maybe with warnings) or 65 (not a trace) and no traceback.
- :func:`check_socket_bytes`: any bytes sent on the daemon's socket must leave the daemon
  serving (a fresh client still gets its marker recorded).
"""

from __future__ import annotations

import contextlib
import io
import os
import random

from memrec.commands import main

#: Exit codes a damaged or foreign file may give: read (with warnings), or not a trace.
ACCEPTED = {0, 65}


def run_commands(path: str) -> dict[str, int]:
    """Run the reading commands on ``path``; return their exit codes (exceptions propagate)."""
    codes = {}
    for argv in (["report", path], ["report", "--json", path], ["dump", path]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            codes[" ".join(argv[:-1])] = main(argv)
        if codes[" ".join(argv[:-1])] != 0:
            assert err.getvalue().count("\n") == 1, f"{argv}: not one line on stderr: {err.getvalue()!r}"
    return codes


def every_reader(path: str, workdir: str) -> dict[str, int]:
    """Every command that reads a trace, and the library, on ``path``: report (text and JSON),
    dump, diff against itself, export to each format, plot, the TUI's loading path and
    ``memrec.load``'s tables. Returns the exit codes; raises what a reader raised."""
    import glob
    import shutil

    import warnings

    import memrec
    from memrec.base.errors import TraceFormatError

    codes = run_commands(path)
    out = os.path.join(workdir, "out")
    for argv in (["diff", path, path], ["export", path, "--to", "csv", "-o", out + ".csv.d"],
                 ["export", path, "--to", "memory-viz", "-o", out + ".pickle"],
                 ["export", path, "--to", "perfetto", "-o", out + ".pftrace"],
                 ["export", path, "--to", "parquet", "-o", out + ".parquet.d"],
                 ["plot", path, "-o", out + ".png"]):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            codes[" ".join(argv[:2])] = code = main(argv)
        lines = err.getvalue().splitlines()
        if code != 0:  # (the reader's warnings come first)
            assert lines and lines[-1].startswith("memrec: error: ") and not any(
                line.startswith("memrec: internal error") for line in lines), f"{argv}: {err.getvalue()!r}"
        for made in glob.glob(out + "*"):
            shutil.rmtree(made) if os.path.isdir(made) else os.unlink(made)
    load_in_tui(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rec = memrec.load(path, pandas=False)
    except TraceFormatError:
        return codes
    for table in ("events", "samples", "process_samples", "markers", "processes", "by_phase"):
        getattr(rec, table)
    rec.reconcile()
    return codes


def load_in_tui(path: str) -> None:
    """The TUI's loading path without a screen: scan, replay, and the model queries views make."""
    from memrec.base.errors import TraceFormatError
    from memrec.tui.navigation import answer
    from memrec.tui.sources import FileSource

    src = FileSource(path)
    try:
        src.open()
    except TraceFormatError:
        return
    src.scan()
    src.index()
    model = src.model
    model.time_range()
    answer(model)  # where the view opens
    for g in model.gpu_ids():
        n = model.store.n
        if n:
            model.state_at(n - 1, g)


def check_trace_bytes(data: bytes, workdir: str) -> None:
    """Write ``data`` as a trace file and read it every way; raise AssertionError on a failure."""
    path = os.path.join(workdir, "fuzz.mrec")
    with open(path, "wb") as f:
        f.write(data)
    codes = run_commands(path)
    assert set(codes.values()) <= ACCEPTED, codes
    load_in_tui(path)


def mutate(data: bytes, rng: random.Random, edits: int = 4) -> bytes:
    """A few random byte edits of ``data``: flips, overwrites with edge values, cuts, copies."""
    buf = bytearray(data)
    for _ in range(edits):
        if not buf:
            break
        op = rng.randrange(5)
        i = rng.randrange(len(buf))
        if op == 0:
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[i] = rng.choice((0x00, 0x7F, 0x80, 0xC0, 0xCF, 0xD3, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF, 0x91, 0xC4))
        elif op == 2:
            del buf[i:]
        elif op == 3:
            j = rng.randrange(len(buf))
            buf[i:i] = buf[j : j + rng.randrange(1, 64)]
        else:
            buf[i : i + 8] = rng.randbytes(8)
    return bytes(buf)


def golden_records(path: str) -> tuple[dict, list[dict]]:
    """The header and raw records of a trace (the seed that structured fuzzing edits)."""
    from memrec.trace.reader import TraceReader

    with TraceReader(path) as reader:
        return reader.header, list(reader.raw_records())


def edited_trace(header: dict, records: list[dict], edits: list[tuple[int, list, object]]) -> bytes:
    """Pack ``header`` + ``records`` after the edits ``(record index, key path, new value)``.

    The value ``DELETE`` removes the key; an index past the records appends the value as a record.
    """
    import copy

    from memrec.trace.format import packb

    recs = copy.deepcopy(records)
    for index, path, value in edits:
        if index >= len(recs):
            recs.append(value)
            continue
        target = recs[index]
        for key in path[:-1]:
            if isinstance(target, dict) and key in target:
                target = target[key]
            elif isinstance(target, list) and isinstance(key, int) and key < len(target):
                target = target[key]
            else:
                break
        else:
            last = path[-1] if path else None
            if isinstance(target, dict) and last is not None:
                if value is DELETE:
                    target.pop(last, None)
                else:
                    target[last] = value
            elif isinstance(target, list) and isinstance(last, int) and last < len(target) and value is not DELETE:
                target[last] = value
    return b"".join(packb(r) for r in [header, *recs])


DELETE = object()


def key_paths(obj: object, prefix: tuple = (), depth: int = 3) -> list[list]:
    """Every key path into ``obj`` up to ``depth`` levels (where structured edits land)."""
    out = []
    if depth and isinstance(obj, dict):
        for k, v in obj.items():
            out.append([*prefix, k])
            out += key_paths(v, (*prefix, k), depth - 1)
    elif depth and isinstance(obj, list):
        for i, v in enumerate(obj[:4]):
            out.append([*prefix, i])
            out += key_paths(v, (*prefix, i), depth - 1)
    return out
