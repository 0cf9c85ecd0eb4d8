"""How long memrec takes to start and to stop, against floors measured in the same run.

    sudo .venv/bin/python bench/bench_start_stop.py [--repeat 3] [--threads 8] [--skip-probes | --start-only]

Stop: the kernel frees each perf-event uprobe with RCU grace periods (~0.1 s each on these VMs), so
the floor is detaching N no-op perf-event uprobes (a two-instruction BPF program) one after another;
the same N detached from ``--threads`` threads shows whether the kernel serialises them, and the
same as multi-uprobe links (kernel >= 6.6, what memrec attaches there) whether links do better. Then the real
probes (``CudaProbes.close()``) on the stub driver, and the daemon: SIGTERM to a complete trace
(trailer on disk) and SIGTERM to exit.

Start: ``CudaProbes.load()`` compiling (empty cache) and from the compiled-program cache, against
bcc compiling a one-line program; the daemon's start to recording (its socket answers a ping)
cold and warm, against the floor of an interpreter importing what the daemon imports.

Command line: ``python -c pass`` and ``python -S -c pass`` (the floors) against ``memrec --help``
and ``memrec mark`` (no daemon: the command fails fast after importing everything it needs; and
to a socket that answers as the daemon does), through ``python -m memrec`` and the ``memrec`` script.

Needs root, tracefs and a C compiler for the stub driver (as tests/bpf); the command-line part
runs anywhere (``--skip-probes``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

NOOP = "int noop(void *ctx) { return 0; }"


def best_of(repeat: int, fn) -> list[float]:
    return [fn() for _ in range(repeat)]


def fmt(times: list[float]) -> str:
    return f"median {statistics.median(times):.3f} s (min {min(times):.3f}, max {max(times):.3f})"


# ------------------------------------------------------------------ command line


def bench_cli(repeat: int) -> None:
    """Each command once per round, in turn, so that the host's load falls on all of them alike.

    Two floors: ``python -c pass`` (the interpreter with its site-packages and their .pth files,
    which memrec pays for too: an editable install's finder is most of it) and ``python -S -c
    pass`` (no site at all: the interpreter alone); and what `memrec --help` and `memrec mark` would
    need at the least through argparse: argparse printing an empty parser's help; argparse, socket
    and msgpack. Besides ``python -m memrec``: what ``-m`` adds alone, the ``memrec`` script that
    pip wrote beside the interpreter (what users run), and a marker that a daemon takes (a socket
    answering as the daemon does, in this process: its CPU is not the child's).
    """
    py = sys.executable
    script = str(Path(py).with_name("memrec"))
    commands = {
        "python -c pass": [py, "-c", "pass"],
        "python -S -c pass": [py, "-S", "-c", "pass"],
        # What `memrec --help` cannot do without: an empty argparse parser printing its help.
        "argparse -h alone": [py, "-c", "import argparse; argparse.ArgumentParser().parse_args(['-h'])"],
        # What `memrec mark` cannot do without (parse its arguments, connect, encode the marker).
        "import argparse+socket+msgpack": [py, "-c", "import argparse, socket, msgpack"],
        "import runpy (what -m adds)": [py, "-c", "import runpy"],
        "memrec --help": [py, "-m", "memrec", "--help"],
        "memrec mark (no daemon)": [py, "-m", "memrec", "mark", "--socket", "/nonexistent/s", "bench", "x=1"],
        "memrec dump --help": [py, "-m", "memrec", "dump", "--help"],
        "memrec --help, the script": [script, "--help"],
        "memrec mark (no daemon), script": [script, "mark", "--socket", "/nonexistent/s", "bench", "x=1"],
    }
    with tempfile.TemporaryDirectory() as tmp, _pong_server(f"{tmp}/memrec.sock") as sock:
        commands["memrec mark (a daemon answers)"] = [py, "-m", "memrec", "mark", "--socket", sock, "bench", "x=1"]
        commands["memrec mark (answered), script"] = [script, "mark", "--socket", sock, "bench", "x=1"]
        times: dict[str, list[float]] = {name: [] for name in commands}
        cpu: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(repeat):
            for name, argv in commands.items():
                t = time.perf_counter()
                # cwd="/": `python -m memrec` must find the installed memrec, not a checkout in cwd.
                proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
                _pid, _status, usage = os.wait4(proc.pid, 0)
                proc.returncode = 0  # reaped here
                times[name].append(time.perf_counter() - t)
                cpu[name].append(usage.ru_utime + usage.ru_stime)
    floor = statistics.median(times["python -c pass"])
    bare = statistics.median(times["python -S -c pass"])
    cpu_floor = statistics.median(cpu["python -c pass"])
    cpu_bare = statistics.median(cpu["python -S -c pass"])
    print(f"{py}, {repeat} rounds, load average {os.getloadavg()[0]:.1f}; ratios: to python -c pass, to python -S")
    for name, t in times.items():
        c = statistics.median(cpu[name])
        print(f"{name:32} wall {fmt(t)} = {statistics.median(t) / floor:.1f}x, {statistics.median(t) / bare:.1f}x; "
              f"CPU median {c:.3f} s = {c / cpu_floor:.1f}x, {c / cpu_bare:.1f}x")


@contextlib.contextmanager
def _pong_server(path: str):
    """A socket at ``path`` that answers each connection's ping with the daemon's pong."""
    from memrec.terms import protocol

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the bench is over
                return
            with conn:
                decoder = protocol.FrameDecoder()
                while (data := conn.recv(65536)) and not any(m.get("type") == "ping" for m in decoder.feed(data)):
                    pass
                conn.sendall(protocol.encode_frame(protocol.make_pong(os.getpid())))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(timeout=5)


# ------------------------------------------------------------------ probes


def private_stub() -> Path:
    """A copy of the stub driver with its own inode: uprobes belong to an inode, and bcc 0.26 (other
    programs on this host, older memrec) places its uprobes with a garbage ref_ctr_offset, which
    makes the kernel refuse any other probe at the same offset of the same inode."""
    import shutil

    from memrec.validation.stubdriver.build import build_stub

    lib = build_stub()
    dest = Path(tempfile.mkdtemp(prefix="mrbstub", dir="/tmp")) / lib.name
    shutil.copy2(lib, dest)
    return dest


def stub_offsets(lib: Path) -> dict[str, int]:
    """The probed driver symbols the stub exports, with their uprobe offsets."""
    from memrec.probes.cuda import SYMBOLS
    from memrec.probes.elfsyms import function_offsets

    fd = os.open(lib, os.O_RDONLY)
    try:
        return {s: off for s, off in function_offsets(fd, b"cu").items() if s in SYMBOLS}
    finally:
        os.close(fd)


def noop_detach(lib: Path, offsets: dict[str, int], threads: int, links: bool = False) -> tuple[int, float]:
    """Attach an entry and a return no-op uprobe per symbol (perf events, or multi-uprobe links),
    then time detaching them all."""
    from memrec.probes.loader import NoopProbes

    probes = NoopProbes(str(lib), list(offsets), links=links)
    n = len(probes.fds)
    t = time.perf_counter()
    probes.close(threads)
    return n, time.perf_counter() - t


def bench_load(repeat: int) -> None:
    """``CudaProbes.load()`` compiling (cache empty) and from the cache, rounds interleaved; the
    floor: bcc compiling a one-line program."""
    from bcc import BPF

    from memrec.probes.cuda import CudaProbes

    compile_floor, cold, warm = [], [], []
    for _ in range(repeat):
        compile_floor.append(_timed(lambda: BPF(text=NOOP.encode()).cleanup()))
        with tempfile.TemporaryDirectory(prefix="mrb", dir="/tmp") as cache:
            for times, how in ((cold, "compiled"), (warm, "cache")):
                t = time.perf_counter()
                p = CudaProbes(probe_cache=cache).load()
                times.append(time.perf_counter() - t)
                p.close()
                assert p.loaded_from == how, p.loaded_from
    print(f"bcc compiling a one-line program {fmt(compile_floor)}")
    print(f"CudaProbes.load(), compiling     {fmt(cold)}")
    print(f"CudaProbes.load(), from cache    {fmt(warm)}  = {statistics.median(warm) / statistics.median(cold):.3f}x compiling")


def bench_stop(repeat: int, threads: int) -> None:
    from memrec.probes.cuda import CudaProbes

    lib = private_stub()
    offsets = stub_offsets(lib)
    serial = [noop_detach(lib, offsets, 1) for _ in range(repeat)]
    n = serial[0][0]
    serial_t = [s for _, s in serial]
    print(f"detach {n} no-op uprobes, serial  {fmt(serial_t)}  ({statistics.median(serial_t) / n * 1e3:.1f} ms each)")
    par_t = [noop_detach(lib, offsets, threads)[1] for _ in range(repeat)]
    print(f"same, {threads} threads              {fmt(par_t)}  = {statistics.median(par_t) / statistics.median(serial_t):.2f}x serial")
    from memrec.probes.bpfsys import uprobe_multi_supported

    if uprobe_multi_supported():
        link_t = [noop_detach(lib, offsets, threads, links=True)[1] for _ in range(repeat)]
        print(f"same as multi-uprobe links, {threads} threads {fmt(link_t)}  = "
              f"{statistics.median(link_t) / statistics.median(serial_t):.3f}x serial")

    def close() -> float:
        p = CudaProbes().load()
        p.attach_library(lib)
        t = time.perf_counter()
        p.close()
        return time.perf_counter() - t

    closes = best_of(repeat, close)
    print(f"CudaProbes.close() ({n} probes)  {fmt(closes)}  = {statistics.median(closes) / statistics.median(serial_t):.2f}x the serial floor")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _floor_imports() -> float:
    """What a daemon imports before it does anything (interpreter, memrec, numpy, the probes' modules)."""
    return _timed(lambda: subprocess.run([sys.executable, "-c", "import memrec.daemon.server, memrec.probes.cuda"],
                                         check=True, cwd="/"))


def daemon_run(lib: Path, cache: str, stop: bool) -> tuple[float, float, float]:
    """Start a daemon on the stub; return (start to recording, SIGTERM to trailer, SIGTERM to exit).

    Recording means the marker socket answers a ping (the loop runs: probes attached, first file open).
    """
    from memrec.terms import protocol
    from memrec.trace.reader import load_trace

    with tempfile.TemporaryDirectory(prefix="mrb", dir="/tmp") as tmp:
        out = Path(tmp, "t.mrec")
        sock = Path(tmp, "s.sock")
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "memrec", "daemon", "--output", str(out), "--socket", str(sock),
             "--libcuda", str(lib), "--nvml-hz", "0", "--nvml-process-hz", "0", "--probe-cache", cache],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/",
        )
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the daemon exited with {proc.returncode}")
            try:
                protocol.ping(sock, timeout=1.0)
                break
            except OSError:
                time.sleep(0.005)
        ready = time.perf_counter() - t0
        if not stop:  # a start-only round: the exit (detach) is not timed
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            return ready, float("nan"), float("nan")
        time.sleep(0.3)
        t = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        trailer_at = None
        while proc.poll() is None:
            if trailer_at is None and _has_trailer(out, load_trace):
                trailer_at = time.perf_counter() - t
            time.sleep(0.01)
        to_exit = time.perf_counter() - t
        if trailer_at is None and _has_trailer(out, load_trace):
            trailer_at = to_exit
        return ready, trailer_at if trailer_at is not None else float("nan"), to_exit


def bench_daemon(repeat: int, stop: bool) -> None:
    """Daemon start to recording, cold (empty cache) and warm (cache filled by the cold start),
    rounds interleaved with the floor; with ``stop``, SIGTERM to a complete trace and to exit."""
    lib = private_stub()
    floor, cold, warm, to_trailer, to_exit = [], [], [], [], []
    for _ in range(repeat):
        floor.append(_floor_imports())
        with tempfile.TemporaryDirectory(prefix="mrb", dir="/tmp") as cache:
            cold.append(daemon_run(lib, cache, stop=False)[0])
            ready, trailer, exited = daemon_run(lib, cache, stop=stop)
            warm.append(ready)
            to_trailer.append(trailer)
            to_exit.append(exited)
    f = statistics.median(floor)
    print(f"floor: python importing the daemon {fmt(floor)}")
    print(f"daemon start to recording, cold  {fmt(cold)}  = {statistics.median(cold) / f:.1f}x the floor")
    print(f"daemon start to recording, warm  {fmt(warm)}  = {statistics.median(warm) / f:.1f}x the floor")
    if stop:
        print(f"daemon SIGTERM to trailer        {fmt(to_trailer)}")
        print(f"daemon SIGTERM to exit           {fmt(to_exit)}")


def _has_trailer(path: Path, load_trace) -> bool:
    try:
        return load_trace(path).trailer is not None
    except Exception:  # noqa: BLE001 - a file being written may not parse yet
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--skip-probes", action="store_true", help="only the command-line part")
    parser.add_argument("--start-only", action="store_true", help="only the start (load, daemon start)")
    args = parser.parse_args()
    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if not args.start_only:
        bench_cli(max(args.repeat, 20))
    if not args.skip_probes:
        bench_load(args.repeat)
        bench_daemon(args.repeat, stop=not args.start_only)
        if not args.start_only:
            bench_stop(args.repeat, args.threads)
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
