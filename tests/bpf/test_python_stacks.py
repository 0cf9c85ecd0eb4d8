"""--stacks with real uprobes on the stub driver: the Python stack of each allocation, read by the
probe from real CPython 3.10-3.13 interpreters (pyenv's builds), against the lines the worker
script (tests/bpf/stack_worker.py) allocates from; 3.9 is said to be unreadable."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from memrec.terms.events import Kind

pytestmark = pytest.mark.bpf

WORKER = Path(__file__).with_name("stack_worker.py")
PYENV = Path("/root/.pyenv/versions")


def _line(tag: str) -> int:
    """The line of ``stack_worker.py`` marked ``# LINE tag``."""
    (number,) = [i for i, text in enumerate(WORKER.read_text().splitlines(), 1) if text.endswith(f"# LINE {tag}")]
    return number


def _python(minor: str) -> Path:
    found = sorted(PYENV.glob(f"{minor}.*/bin/python{minor}"))
    if not found:
        pytest.skip(f"no CPython {minor} under {PYENV}")
    return found[-1]


class StackWorker:
    def __init__(self, python: Path, *libs: Path) -> None:
        self.proc = subprocess.Popen([str(python), str(WORKER), *map(str, libs)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, *words: object) -> None:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "done"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


def _named(frames: list[tuple[str, int, str]], minor: str) -> list[tuple[str, int, str]]:
    """``frames`` as CPython ``minor`` names functions: 3.10's code objects have no qualified name
    (``Holder.outer`` is ``outer`` there)."""
    if minor != "3.10":
        return frames
    return [(file, line, function.rsplit(".", 1)[-1]) for file, line, function in frames]


def _python_frames(trace, event) -> list[tuple[str, int, str]]:
    stack = trace.stack(int(event["stack"]))
    assert isinstance(stack, tuple), stack
    return [(Path(f.file).name, f.line, f.function) for f in stack if not f.native]


def test_daemon_stacks_name_the_allocating_lines_in_every_supported_cpython(stub_lib, torch_stub, tmp_path):
    from memrec.trace.reader import load_trace
    from memrec.trace.stacks import Unavailable

    from test_daemon import DaemonProcess

    early = StackWorker(_python("3.12"), stub_lib, torch_stub)  # running before the daemon
    workers = {"3.12": early}
    d = DaemonProcess(tmp_path, stub_lib, args=("--stacks", "--tensors", "--torch-lib", str(torch_stub),
                                                "--stack-min-bytes", "1M"))
    try:
        d.wait_ready()
        for minor in ("3.11", "3.13", "3.10", "3.9"):
            if sorted(PYENV.glob(f"{minor}.*/bin/python{minor}")):
                workers[minor] = StackWorker(_python(minor), stub_lib, torch_stub)
        for w in workers.values():  # the first allocation makes the daemon locate a late process
            w.ask("alloc", 4096)
        time.sleep(1.0)
        for w in workers.values():  # both at once: every process is live during the others' calls
            w.ask("alloc", 1 << 20)
            w.ask("thread", 2 << 20)
            w.ask("tensor", 0x7000_0000, 4 << 20)
            w.ask("tensor", 0x7100_0000, 4096)  # below --stack-min-bytes: no stack
            w.ask("deep", 20, 3 << 20)  # 42 frames and 20 shims (3.12+): cut at --stack-depth 32
        time.sleep(1.0)  # the daemon reads the code objects while the processes live
        gone = workers.pop("3.11" if "3.11" in workers else "3.13")
        gone.close()  # exits while the daemon runs: its exit is recorded, the others go on
        time.sleep(0.5)
        early.ask("alloc", 5 << 20)
        time.sleep(0.5)
        assert d.stop() == 0
    finally:
        for w in workers.values():
            w.close()
        d.kill()
    trace = load_trace(d.output)
    ev = trace.events
    main_stack = [("stack_worker.py", _line("allocate"), "allocate"),
                  ("stack_worker.py", _line("Holder.outer"), "Holder.outer"),
                  ("stack_worker.py", _line("main.alloc"), "main"),
                  ("stack_worker.py", _line("module"), "<module>")]
    assert len(ev[(ev["pid"] == gone.pid) & (ev["kind"] == Kind.PROC_EXIT)]) == 1
    (after,) = ev[(ev["pid"] == early.pid) & (ev["size"] == 5 << 20)]
    assert _python_frames(trace, after) == main_stack
    for minor, w in workers.items():
        mine = ev[ev["pid"] == w.pid]
        allocs = mine[mine["kind"] == Kind.ALLOC]
        big, thread = allocs[allocs["size"] == 1 << 20], allocs[allocs["size"] == 2 << 20]
        blocks = mine[mine["kind"] == Kind.TENSOR_ALLOC]
        assert len(big) == 1 and len(thread) == 1 and len(blocks) == 2, minor
        assert blocks[blocks["size"] == 4096]["stack"][0] == 0  # under the threshold
        if minor == "3.9":  # unsupported: said, never a wrong stack
            for e in (big[0], thread[0]):
                stack = trace.stack(int(e["stack"]))
                reason = stack.reason if isinstance(stack, Unavailable) else stack[0].function
                assert f"CPython {minor}" in reason and "3.10, 3.11, 3.12, 3.13" in reason, (minor, stack)
                assert not isinstance(stack, tuple) or all(f.native or f.file.startswith("<") for f in stack)
            continue
        assert _python_frames(trace, big[0]) == _named(main_stack, minor), minor
        on_thread = _python_frames(trace, thread[0])
        assert on_thread[:2] == _named(main_stack[:2], minor), minor  # the other thread's own stack
        assert [f[2] for f in on_thread[2:]] == [f[2] for f in _named(
            [("", 0, "Thread.run"), ("", 0, "Thread._bootstrap_inner"), ("", 0, "Thread._bootstrap")], minor)], minor
        assert _python_frames(trace, blocks[blocks["size"] == 4 << 20][0]) == [
            ("stack_worker.py", _line("make_block"), "make_block"),
            ("stack_worker.py", _line("main.tensor"), "main"),
            ("stack_worker.py", _line("module"), "<module>")], minor
        (deep,) = allocs[allocs["size"] == 3 << 20]
        frames = _python_frames(trace, deep)
        assert len(frames) == 33 and frames[-1][0] == "<truncated>", minor  # 32 kept, none a shim
        assert frames[:3] == _named([("stack_worker.py", _line("allocate"), "allocate"),
                                     ("stack_worker.py", _line("deep.leaf"), "deep"),
                                     ("stack_worker.py", _line("deep (through C: a shim frame each)"),
                                      "deep.<locals>.<lambda>")], minor), minor
        native = [f for f in trace.stack(int(big[0]["stack"])) if f.native]
        assert native and native[0].file == str(stub_lib) and native[0].function.startswith("cuMemAlloc_v2")
    versions = {i["version"]: i for i in trace.trailer["stacks_read"]["interpreters"]}
    assert any(v.startswith("CPython 3.12") and not i["problem"] for v, i in versions.items())
    if "3.10" in workers:  # read: the file's name says 3.10, not which 3.10
        assert versions["CPython 3.10"]["problem"] == ""


def test_the_program_without_stacks_is_unchanged(stub_lib):
    """--stacks off compiles exactly the program it compiled before (no STACKS code, no stacks ring)."""
    from memrec.probes.cuda import StackOptions
    from memrec.probes.cuda import program_cflags

    assert not [f for f in program_cflags(False, 1024) if "STACK" in f and "FLAG_STACK" not in f]
    assert "-DSTACKS=1" in program_cflags(False, 1024, StackOptions())
    with pytest.raises(ValueError):
        StackOptions(depth=33).cflags()


class Subscriber:
    """A live subscriber reading the daemon's stream as the TUI does (records in wire form)."""

    def __init__(self, socket_path: Path) -> None:
        from memrec.subscriber import subscribe
        from memrec.trace.frames import MAX_SUBSCRIBER_FRAME
        from memrec.trace.frames import FrameDecoder

        self.sock = subscribe(str(socket_path))
        self.sock.settimeout(0.2)
        self.decoder = FrameDecoder(MAX_SUBSCRIBER_FRAME, decode=False)
        self.records: list[dict] = []

    def drain(self, seconds: float = 1.0) -> None:
        """Read what the daemon sent for ``seconds`` (it flushes every 200 ms)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            if not data:
                return
            self.records += self.decoder.feed(data)


def test_a_live_subscriber_resolves_the_stacks_defined_after_it_joined_and_after_a_rotation(stub_lib, tmp_path):
    """The daemon writes a stack's definition when an allocation first needs it: a subscriber that
    joined before gets it mid-stream. After SIGHUP the next file numbers its stacks from 1 again;
    the live model must resolve each event through its own file's ids, never the previous file's."""
    from memrec.trace.reader import load_trace
    from memrec.tui.model import TraceModel

    from test_daemon import DaemonProcess
    from test_daemon import sighup

    worker = StackWorker(_python("3.12"), stub_lib)
    d = DaemonProcess(tmp_path, stub_lib, args=("--stacks",))
    try:
        d.wait_ready()
        worker.ask("alloc", 1 << 20)  # stack 1 of the first file, defined before anyone subscribed
        time.sleep(0.5)
        sub = Subscriber(d.socket)
        sub.drain(0.5)  # the sync: header, processes, the stacks so far, a keyframe
        worker.ask("thread", 2 << 20)  # stack 2: its definition comes mid-stream
        worker.ask("alloc", 5 << 20)  # stack 1 again: defined in the sync's record of the file's stacks
        sub.drain()
        second = sighup(d)
        sub.drain(0.5)
        worker.ask("thread", 3 << 20)  # the second file's stack 1: the first file's 1 is another stack
        worker.ask("alloc", 4 << 20)  # its stack 2: the first file's 1 again
        sub.drain()
        assert d.stop() == 0, d.log()
    finally:
        worker.close()
        d.kill()
    files = [load_trace(d.output), load_trace(second)]
    truth = {}  # size -> (file's own stack id, the stack) from the files the daemon wrote
    for trace in files:
        ev = trace.events
        for row in ev[(ev["pid"] == worker.pid) & (ev["kind"] == Kind.ALLOC)]:
            truth[int(row["size"])] = (int(row["stack"]), trace.stack(int(row["stack"])))
    assert sorted(truth) == [1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20]
    assert truth[3 << 20][0] == 1 and truth[3 << 20][1] != truth[1 << 20][1], "the second file reuses id 1"
    assert truth[4 << 20][1] == truth[1 << 20][1] == truth[5 << 20][1] and truth[2 << 20][1] == truth[3 << 20][1]
    # WHEN the stream is given to the TUI's live model
    assert any(r.get("type") == "stacks" for r in sub.records[3:]), "a stacks record came mid-stream"
    model = TraceModel(max_events=100_000)
    for rec in sub.records:
        model.add_record(rec, live=True)
    assert model.warnings == []
    # THEN every allocation of the worker since it subscribed shows the stack its file gives it
    # (the 1 MiB one came before: it is in the sync's keyframe, not an event of the stream)
    seen = {}
    for seq in range(model.store.n):
        view = model.stack_view(seq)
        if view.pid == worker.pid and view.kind == "alloc":
            seen[view.size] = view.stack
    assert seen == {size: stack for size, (_, stack) in truth.items() if size != 1 << 20}
    main_stack = ("stack_worker.py", _line("main.alloc"), "main")
    assert main_stack in [(Path(f.file).name, f.line, f.function) for f in seen[4 << 20]]
