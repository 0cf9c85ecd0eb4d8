"""``memrec dump``: JSON lines for every record, refusal of a terminal, exit codes."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

from memrec import commands
from memrec.base.errors import ExitCode
from memrec.terms.columns import empty_events
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.trace import format as fmt
from memrec.trace.writer import TraceWriter

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "golden_v2_3.mrec"
GOLDEN_DUMP = DATA / "golden_v2_3.dump.jsonl"
#: (trace, expected dump) for today's format and the older ones (2.2, 2.1, 2.0, 1), which must still dump the same
GOLDENS = [pytest.param(DATA / f"golden_v{v}.mrec", DATA / f"golden_v{v}.dump.jsonl", id=f"v{v}") for v in ("2_3", "2_2", "2_1", 2, 1)]


@pytest.fixture
def main():
    """``memrec.commands.main``: the real command line."""
    return commands.main


def lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("golden,golden_dump", GOLDENS)
def test_dump_of_the_golden_trace_is_the_expected_output(main, capsys, golden, golden_dump):
    # GIVEN the committed golden trace and its expected dump
    # WHEN dumped
    rc = main(["dump", str(golden)])
    out, err = capsys.readouterr()
    # THEN the output is exactly the expected JSON lines, and nothing is reported
    assert rc == ExitCode.OK
    assert err == ""
    assert out == golden_dump.read_text(encoding="utf-8")


def test_dump_prints_one_line_per_event_with_names_and_hex(main, capsys):
    # GIVEN the golden trace
    # WHEN dumped
    main(["dump", str(GOLDEN)])
    out = lines(capsys.readouterr().out)
    # THEN the header comes first, the trailer last, and each event is its own line
    assert out[0]["type"] == "header" and out[0]["magic"] == fmt.MAGIC
    assert out[-1]["type"] == "trailer"
    events = [line for line in out if line["type"] == "event"]
    assert len(events) == 58
    # (2.2's kinds by name too)
    assert [e["kind"] for e in events[24:26]] == ["TENSOR_ALLOC", "TENSOR_FREE"] and events[24]["api"] == "torch_malloc"
    oom = next(e for e in events if e["result"] == 2)
    assert oom["kind"] == "ALLOC" and oom["api"] == "cuMemAlloc_v2" and oom["result_name"] == "CUDA_ERROR_OUT_OF_MEMORY"
    alloc = next(e for e in events if e["kind"] == "ALLOC" and e["result"] == 0)
    assert alloc["ptr"] == "0x7f1200000000" and alloc["handle"] == "0x0"
    # AND only events with IPC bytes have an ipc key
    assert [e["kind"] for e in events if "ipc" in e] == ["IPC_EXPORT", "IPC_OPEN"]
    assert {e["ipc"] for e in events if "ipc" in e} == {bytes(range(64)).hex()}
    # AND samples, markers, processes, lost and the keyframe summary are there
    types = [line["type"] for line in out]
    assert types.count("nvml") == 2 and types.count("procmem") == 2 and types.count("marker") == 3
    assert types.count("process") == 3 and types.count("lost") == 1
    keyframes = [line for line in out if line["type"] == "keyframe"]
    assert [k["event_index"] for k in keyframes] == [8, 42]
    for keyframe in keyframes:
        assert keyframe["sizes"]["allocs"] > 0 and keyframe["sizes"]["v"] is None
        assert keyframe["state_bytes"] > 0 and "state" not in keyframe
    # AND (2.3) the event lines of a chunk with stacks have their stack ids, each defined by a
    # stacks record printed before it; those of a chunk without (the last: frees) have no key
    assert {e.get("stack") for e in events} == {0, 1, 2, 3, 4, None} and "stack" not in events[-1]
    defined = 0
    for line in out:
        if line["type"] == "stacks":
            defined = line["k0"] + len(line["k"]) - 1
        elif line["type"] == "event":
            assert line.get("stack", 0) <= defined


def test_unknown_kind_api_and_result_numbers_are_shown_as_numbers(main, capsys, tmp_path):
    # GIVEN an event with numbers this memrec does not name (from a newer recorder)
    ev = empty_events(1)
    ev["kind"], ev["api"], ev["result"] = 200, 300, 12345
    ev["flags"] = FLAG_IPC_BYTES | 0x4
    path = tmp_path / "t.mrec"
    with TraceWriter(path, {"anchor": {"monotonic_ns": 0, "wall_ns": 0}}) as w:
        w.write_events(ev)
    # WHEN dumped
    main(["dump", str(path)])
    event = next(line for line in lines(capsys.readouterr().out) if line["type"] == "event")
    # THEN the numbers appear in the names
    assert (event["kind"], event["api"], event["result_name"]) == ("KIND_200", "API_300", "CUresult 12345")
    assert event["flags"] == 5 and event["ipc"] == "00" * 64


def test_names_of_code_loads_survive_the_file_and_are_dumped_as_text(main, capsys, tmp_path):
    # GIVEN a kernel fetch whose probe read the kernel's name (FLAG_NAME: the ipc column holds it)
    from memrec.terms.events import FLAG_NAME
    from memrec.terms.events import Api
    from memrec.terms.events import Kind

    ev = empty_events(2)
    ev["kind"], ev["api"] = int(Kind.KERNEL_LOAD), int(Api.cuLibraryGetKernel)
    ev["flags"][0] = FLAG_NAME
    ev["ipc"][0] = np.void(b"ncclDevKernel_AllReduce_Sum_f32".ljust(64, b"\0"))
    path = tmp_path / "t.mrec"
    with TraceWriter(path, {"anchor": {"monotonic_ns": 0, "wall_ns": 0}}) as w:
        w.write_events(ev)
    # WHEN dumped
    main(["dump", str(path)])
    events = [line for line in lines(capsys.readouterr().out) if line["type"] == "event"]
    # THEN the name came back from the file's sparse column, as text, and only where it was read
    assert events[0]["name"] == "ncclDevKernel_AllReduce_Sum_f32" and "ipc" not in events[0]
    assert "name" not in events[1]


def test_dump_refuses_a_terminal_unless_forced(main, capsys, monkeypatch):
    # GIVEN stdout is a terminal
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    # WHEN dumping without --force
    rc = main(["dump", str(GOLDEN)])
    out, err = capsys.readouterr()
    # THEN it refuses with a usage error that says how to proceed, and prints nothing
    assert rc == ExitCode.USAGE
    assert out == ""
    assert err.count("\n") == 1 and "terminal" in err and "--force" in err
    # WHEN forced THEN it dumps
    assert main(["dump", "--force", str(GOLDEN)]) == ExitCode.OK
    assert capsys.readouterr().out == GOLDEN_DUMP.read_text(encoding="utf-8")


@pytest.mark.parametrize("make", [lambda p: None, lambda p: p.mkdir()], ids=["missing", "directory"])
def test_an_input_that_cannot_be_opened_is_no_input(main, capsys, tmp_path, make):
    # GIVEN a path that does not exist, or is a directory
    path = tmp_path / "nope.mrec"
    make(path)
    # WHEN dumped
    rc = main(["dump", str(path)])
    out, err = capsys.readouterr()
    # THEN NO_INPUT with one line naming the file, the very line memrec report prints for it
    assert rc == ExitCode.NO_INPUT
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"memrec: error: {path}: ")
    assert main(["report", str(path)]) == ExitCode.NO_INPUT and capsys.readouterr().err == err


@pytest.mark.parametrize(
    "data,message",
    [
        (b"not a trace at all", "not a memrec trace"),
        (fmt.encode_record({**fmt.finalize_header({"anchor": {}}), "version": 9}), f"version 9.{fmt.FORMAT_MINOR} is newer"),
    ],
    ids=["bad-magic", "newer-version"],
)
def test_a_file_that_is_not_a_readable_trace_is_a_data_error(main, capsys, tmp_path, data, message):
    # GIVEN a file that is not a trace, or a trace of a newer major version
    path = tmp_path / "x.mrec"
    path.write_bytes(data)
    # WHEN dumped
    rc = main(["dump", str(path)])
    out, err = capsys.readouterr()
    # THEN DATA with one line saying why
    assert rc == ExitCode.DATA
    assert out == "" and err.count("\n") == 1 and message in err


def test_a_trace_cut_inside_its_header_is_a_data_error_as_in_every_command(main, capsys, tmp_path):
    # GIVEN the golden trace cut inside its header (no records: still being created, or cut)
    path = tmp_path / "cut.mrec"
    path.write_bytes(GOLDEN.read_bytes()[:20])
    # WHEN dumped
    rc = main(["dump", str(path)])
    out, err = capsys.readouterr()
    # THEN DATA with the one line memrec report prints for it, and no empty header on stdout
    assert rc == ExitCode.DATA
    assert out == "" and err.count("\n") == 1 and "ends inside its header" in err
    assert main(["report", str(path)]) == ExitCode.DATA and capsys.readouterr().err == err


@pytest.mark.parametrize("golden,golden_dump", GOLDENS)
def test_a_truncated_trace_is_dumped_up_to_the_cut_with_warnings_on_stderr(main, capsys, tmp_path, golden, golden_dump):
    # GIVEN the golden trace cut in the middle of its last record
    data = golden.read_bytes()
    path = tmp_path / "cut.mrec"
    path.write_bytes(data[:-5])
    # WHEN dumped
    rc = main(["dump", str(path)])
    out, err = capsys.readouterr()
    # THEN it succeeds, prints everything but the trailer, and warns on stderr
    assert rc == ExitCode.OK
    expected = golden_dump.read_text(encoding="utf-8").splitlines(keepends=True)
    assert out == "".join(expected[:-1])
    assert "memrec: warning: " in err and "truncated tail after" in err and "no trailer" in err


@pytest.mark.parametrize("n", [1, 2, 5, 3000])
def test_chunk_at_a_time_event_lines_are_the_json_encoders_lines(n):
    from memrec.terms.events import FLAG_NAME
    from memrec.export.jsonl import event_lines
    from memrec.export.jsonl import event_text

    # GIVEN events with values at the edges of every column, constant and varied columns, names
    # this memrec does not know, and rows with handle bytes or a name
    rng = np.random.default_rng(n)
    ev = empty_events(n)
    for name in ("ts", "ptr", "size", "handle", "aux"):
        ev[name] = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    ev["ts"][0], ev["ptr"][-1] = 0, 2**64 - 1
    ev["pid"] = rng.choice([1, 4242, 2**32 - 1], n)
    ev["tid"] = 7
    ev["gpu"] = rng.choice([-(2**15), -1, 0, 3, 2**15 - 1], n)
    ev["ordinal"] = rng.choice([-(2**31), -1, 0, 2**31 - 1], n)
    ev["kind"] = rng.choice([1, 2, 10, 200], n)
    ev["api"] = rng.choice([1, 8, 300], n)
    ev["result"] = rng.choice([0, 2, 800, -5, 12345], n)
    ev["flags"] = rng.choice([0, 0, 0, FLAG_IPC_BYTES, FLAG_NAME, 4], n)
    ev["ipc"][ev["flags"] == FLAG_NAME] = np.void("kernel_é".encode().ljust(64, b"\0"))
    ev["ipc"][ev["flags"] == FLAG_IPC_BYTES] = np.void(bytes(range(64)))
    encode = json.JSONEncoder(separators=(", ", ": "), ensure_ascii=False).encode
    # WHEN the chunk is formatted column-wise (as memrec dump does) and one dict per event
    chunk = fmt.decode_columns(fmt.unpackb(fmt.encode_record({"type": "events", "events": ev})))
    fast = event_text(chunk, encode).decode()
    slow = "".join(encode(line) + "\n" for line in event_lines(chunk.to_array()))
    # THEN the text is the same, byte for byte
    assert fast == slow


def test_a_marker_records_line_is_the_json_encoders_whatever_its_shape(main, capsys, tmp_path):
    # GIVEN marker records of the writer's shape (values or none, odd text, no GPU) and of others
    # (a field missing, the keys in another order, an unknown field): the first without values take
    # the dump's own line (no JSON encoder each), the rest the encoder
    import json as json_
    from memrec.base.jsontext import strict
    from memrec.export.jsonl import jsonable

    base = {"type": "marker", "ts": 5, "pid": 7, "uid": 0, "tid": 7, "name": "step", "phase": "begin", "gpu": 1, "values": {}}
    records = [
        base,
        {**base, "name": 'a"b\\c\u00e9\n\x01\u2028', "gpu": None, "ts": 2**63 - 1, "pid": 2**32 - 1},
        {**base, "values": {"step": 3, "blob": b"\x00\x01", "x": 1.5, "s": "t"}},
        {k: v for k, v in base.items() if k != "values"},
        dict(reversed(list(base.items()))),
        {**base, "extra": [1, 2]},
    ]
    path = tmp_path / "m.mrec"
    with TraceWriter(path, {"host": "test"}) as w:
        for rec in records:
            w.write_record(rec)
    # WHEN dumped
    rc = main(["dump", str(path)])
    out, err = capsys.readouterr()
    # THEN each marker's line is what the JSON encoder writes for its record, in its keys' order
    encode = strict(json_.JSONEncoder(separators=(", ", ": "), ensure_ascii=False, allow_nan=False).encode)
    assert rc == ExitCode.OK
    assert out.split("\n")[1:-2] == [encode(jsonable(rec)) for rec in records]  # (not splitlines: U+2028)
