"""How long memrec takes to start and to stop, against floors measured in the same run.

    sudo .venv/bin/python bench/bench_start_stop.py [--repeat 3] [--threads 8] [--skip-probes]

Stop: the kernel frees each uprobe with RCU grace periods (~0.1 s each on these VMs), so the floor
is detaching N no-op uprobes (a one-instruction BPF program) one after another; the same N
detached from ``--threads`` threads shows whether the kernel serialises them. Then the real
probes (``CudaProbes.close()``) on the stub driver, and the daemon: SIGTERM to a complete trace
(trailer on disk) and SIGTERM to exit.

Start: compiling and loading the BPF program (``CudaProbes.load()``), the floor being bcc
compiling a one-line program.

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
from concurrent.futures import ThreadPoolExecutor
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
    from memrec import protocol

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


def stub_symbols(lib: Path) -> list[str]:
    """The probed driver symbols the stub exports (what CudaProbes attaches to)."""
    from bcc import BPF

    from memrec.probes.cuda import SYMBOLS

    exported = {name.decode() for name, _ in BPF.get_user_functions_and_addresses(str(lib).encode(), b"^cu")}
    return [s for s in SYMBOLS if s in exported]


def noop_detach(lib: Path, symbols: list[str], threads: int) -> tuple[int, float]:
    """Attach an entry and a return no-op uprobe per symbol, then time detaching them all."""
    from bcc import BPF

    from memrec.probes.cuda import detach_uprobes

    bpf = BPF(text=NOOP)
    for sym in symbols:
        bpf.attach_uprobe(name=str(lib).encode(), sym=sym.encode(), fn_name=b"noop", pid=-1)
        bpf.attach_uretprobe(name=str(lib).encode(), sym=sym.encode(), fn_name=b"noop", pid=-1)
    n = len(bpf.uprobe_fds)
    t = time.perf_counter()
    if threads <= 1:
        for ev in list(bpf.uprobe_fds):
            bpf.detach_uprobe_event(ev)
    else:
        detach_uprobes(bpf, threads)
    elapsed = time.perf_counter() - t
    bpf.cleanup()
    return n, elapsed


def bench_probes(repeat: int, threads: int) -> None:
    from bcc import BPF

    from memrec.probes.cuda import CudaProbes
    from memrec.stubdriver.build import build_stub

    lib = build_stub()
    symbols = stub_symbols(lib)

    compile_floor = best_of(repeat, lambda: _timed(lambda: BPF(text=NOOP).cleanup()))
    print(f"compile a one-line program       {fmt(compile_floor)}")

    def load() -> float:
        t = time.perf_counter()
        p = CudaProbes().load()
        elapsed = time.perf_counter() - t
        p.close()
        return elapsed

    loads = best_of(repeat, load)
    print(f"CudaProbes.load()                {fmt(loads)}")

    serial = [noop_detach(lib, symbols, 1) for _ in range(repeat)]
    n = serial[0][0]
    serial_t = [s for _, s in serial]
    print(f"detach {n} no-op uprobes, serial  {fmt(serial_t)}  ({statistics.median(serial_t) / n * 1e3:.1f} ms each)")
    par_t = [noop_detach(lib, symbols, threads)[1] for _ in range(repeat)]
    print(f"same, {threads} threads              {fmt(par_t)}  = {statistics.median(par_t) / statistics.median(serial_t):.2f}x serial")

    def close() -> float:
        p = CudaProbes().load()
        p.attach_library(lib)
        t = time.perf_counter()
        p.close()
        return time.perf_counter() - t

    closes = best_of(repeat, close)
    print(f"CudaProbes.close() ({n} probes)  {fmt(closes)}  = {statistics.median(closes) / statistics.median(serial_t):.2f}x the serial floor")
    bench_daemon(lib, repeat)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_daemon(lib: Path, repeat: int) -> None:
    """SIGTERM a real daemon attached to the stub: time to the trailer on disk and to exit."""
    from memrec.trace.reader import load_trace

    to_trailer, to_exit, to_ready = [], [], []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="mrb", dir="/tmp") as tmp:
            out = Path(tmp, "t.mrec")
            sock = Path(tmp, "s.sock")
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-m", "memrec", "daemon", "--output", str(out), "--socket", str(sock),
                 "--libcuda", str(lib), "--nvml-hz", "0", "--nvml-process-hz", "0"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            while not (sock.exists() and out.exists() and out.stat().st_size > 0):
                if proc.poll() is not None:
                    raise SystemExit(f"the daemon exited with {proc.returncode}")
                time.sleep(0.01)
            to_ready.append(time.perf_counter() - t0)
            time.sleep(0.3)
            t = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            trailer_at = None
            while proc.poll() is None:
                if trailer_at is None and _has_trailer(out, load_trace):
                    trailer_at = time.perf_counter() - t
                time.sleep(0.01)
            to_exit.append(time.perf_counter() - t)
            if trailer_at is None and _has_trailer(out, load_trace):
                trailer_at = to_exit[-1]
            to_trailer.append(trailer_at if trailer_at is not None else float("nan"))
    print(f"daemon start to recording        {fmt(to_ready)}")
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
    args = parser.parse_args()
    bench_cli(max(args.repeat, 20))
    if not args.skip_probes:
        bench_probes(args.repeat, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
