"""Reliability figures of docs/reliability.md, measured from outside on the stub driver (root).

    sudo .venv/bin/python bench/reliability.py kill --runs 26
    sudo .venv/bin/python bench/reliability.py overload --runs 7
    sudo .venv/bin/python bench/reliability.py soak --seconds 120
    sudo .venv/bin/python bench/reliability.py hostile          # issue 23: all four attacks
    .venv/bin/python bench/reliability.py readers --mutations 60
    .venv/bin/python bench/reliability.py fuzz --files 100000 --frames 1000000
    .venv/bin/python bench/reliability.py edges

- ``kill``: a daemon records a workload that allocates without pause; it is SIGKILLed at a random
  moment; the trace it leaves must read back (``load_trace`` and ``memrec report``). Prints how
  much before the kill the last recorded event lies (what a crash costs) and, per run, whether
  every alloc between the first and the last recorded one is there (sizes count up by one).
- ``overload``: a small ring buffer and a burst of allocations far faster than the daemon drains;
  recorded + lost must equal what the workload made.
- ``soak``: steady events and markers (``--rate`` allocs+frees per second, ``--markers`` per
  second) for ``--seconds``; prints the daemon's RSS and fds at the start and the end, and loss.
- ``hostile``: issue 23's attacks by a socket-group user (nobody, switched with ``setpriv``):
  ``connects`` (processes with a 1 MB argv that only connect: the daemon's RSS and the trace's
  growth against the attacker's bytes), ``rotation`` (those connects plus a marker flood under
  ``--rotate-size 20M --keep 3``, with an operator's copy and a planted file in the folder:
  rotations, deletions, bytes on disk), ``phases`` (3 M ``begin`` markers of distinct names with
  metrics on: the daemon's CPU while they come and after), ``diskfull`` (a nearly full file system,
  a marker flood and 30,000 allocations: how many reach the file). One JSON line each.

- ``readers`` (issue 23): the peak RSS of every reader (report, report --json, dump, the TUI's
  loading path, ``memrec.load``'s tables), each file in a fresh interpreter, over the crafted
  compression bombs of ``tests/fuzz/bombs.py`` and ``--mutations`` byte-mutations of them and of
  the golden traces, every file at most 64 KiB; prints the largest.
- ``fuzz`` (issue 23): ``--files`` byte-mutated traces (golden traces and bombs as seeds) each read
  by ``load_trace``, the report (text and JSON) and ``dump``, every ``--full-every``-th also by the
  whole ``tests/fuzz/harness.py`` check (the commands and the TUI's loading path); then
  ``--frames`` fuzzed frames written to a daemon's socket (real daemon, stand-in probes), which
  must keep serving. Counts tracebacks (must be 0).
- ``edges`` (issue 23): every trace of ``tests/fuzz/edges.py`` (each column and field at each
  integer edge) through every reader (``tests.fuzz.harness.every_reader``).

``kill``, ``overload`` and ``soak`` run a real ``memrec daemon`` (BPF uprobes on the stub libcuda)
in a subprocess.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fuzz (the crafted files, the checks)

from memrec.terms import protocol  # noqa: E402
from memrec.terms.events import Kind  # noqa: E402
from memrec.state import LiveState  # noqa: E402
from memrec.trace.reader import load_trace  # noqa: E402

#: A workload: allocates (size = 4096 + i, i = 0, 1, 2...) and frees at a given rate, forever or
#: ``count`` times; prints its pid, then "done <n> <t_ns>" when finished.
WORKLOAD = r"""
import ctypes, os, sys, time
from memrec.validation.stubdriver.workload import Driver, Facts
lib_path, rate, count, markers = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
drv = Driver(lib_path, Facts())
drv.init()
drv.ctx_set_current(drv.primary_ctx_retain(0))
alloc, free = drv.lib.cuMemAlloc_v2, drv.lib.cuMemFree_v2
import memrec
print(os.getpid(), flush=True)
p = ctypes.c_uint64()
i = 0
period = 1.0 / rate if rate else 0.0
next_t = time.monotonic()
next_mark = time.monotonic()
while count < 0 or i < count:
    alloc(ctypes.byref(p), 4096 + i)
    free(p.value)
    i += 1
    if markers and time.monotonic() >= next_mark:
        memrec.mark("soak", "instant", i=i)
        next_mark += 1.0 / markers
    if period:
        next_t += period
        delay = next_t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
print("done", i, time.monotonic_ns(), flush=True)
"""


class Daemon:
    def __init__(self, workdir: Path, lib: Path, *extra: str, python: str = sys.executable, cwd: Path | None = None,
                 output: Path | None = None) -> None:
        self.socket = workdir / "d.sock"
        self.output = output or workdir / "out.mrec"
        self.log = open(workdir / "daemon.log", "w")
        self.proc = subprocess.Popen(
            [python, "-m", "memrec", "daemon", "-o", str(self.output), "--socket", str(self.socket),
             "--libcuda", str(lib), "--rotate-size", "0", "--nvml-hz", "0", "--nvml-process-hz", "0", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd,
        )
        deadline = time.monotonic() + 180
        while True:
            try:
                protocol.ping(self.socket, timeout=1.0)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"daemon did not start: {(workdir / 'daemon.log').read_text()}") from None
                time.sleep(0.2)

    def cpu_seconds(self) -> float:
        """User + system CPU the daemon used so far (/proc/PID/stat fields 14 and 15)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_fds(self) -> tuple[int, int]:
        with open(f"/proc/{self.proc.pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
        return rss, len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(120)
        self.log.close()


def workload(lib: Path, socket_path: Path, rate: float, count: int, markers: float = 0) -> subprocess.Popen:
    env = dict(os.environ, MEMREC_SOCKET=str(socket_path))
    proc = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(lib), str(rate), str(count), str(markers)],
                            stdout=subprocess.PIPE, text=True, env=env)
    proc.pid_reported = int(proc.stdout.readline())
    return proc


def _allocs(trace, pid: int):
    ev = trace.events
    mine = ev[(ev["pid"] == pid) & (ev["kind"] == int(Kind.ALLOC))]
    return mine


def cmd_kill(args, lib: Path) -> None:
    lost_ms, gaps, ok = [], 0, 0
    unmatched = 0
    for run in range(args.runs):
        workdir = Path(tempfile.mkdtemp(prefix="mrk", dir="/tmp"))
        if args.workload_first:  # already allocating while the probes attach (issue 15, item 13)
            w = workload(lib, workdir / "d.sock", rate=args.rate, count=-1)
            d = Daemon(workdir, lib)
        else:
            d = Daemon(workdir, lib)
            w = workload(lib, d.socket, rate=args.rate, count=-1)
        time.sleep(random.uniform(0.5, 2.0))
        t_kill = time.monotonic_ns()
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        d.log.close()
        w.kill()
        w.wait()
        trace = load_trace(d.output)
        report = subprocess.run([sys.executable, "-m", "memrec", "report", str(d.output)], capture_output=True, text=True)
        mine = _allocs(trace, w.pid_reported)
        sizes = mine["size"].astype(int) - 4096
        contiguous = bool(len(sizes)) and (sizes == sizes[0] + range(len(sizes))).all()
        missing = sorted(set(range(int(sizes.min()), int(sizes.max()) + 1)) - set(sizes.tolist())) if len(sizes) else []
        gaps += len(missing) > trace.lost  # a gap the lost count does not cover
        last = int(trace.events["ts"].max()) if len(trace.events) else None
        ms = (t_kill - last) / 1e6 if last else float("nan")
        lost_ms.append(ms)
        ok += report.returncode == 0
        state = LiveState()
        state.apply(trace.events.copy())
        frees_unknown = state.anomalies.get("free_unknown", 0)
        unmatched += frees_unknown
        print(f"run {run + 1}: {len(mine)} allocs read back, report rc {report.returncode}, last event {ms:.0f} ms "
              f"before the kill, contiguous {contiguous} (missing {missing[:5]} of {int(sizes.min()) if len(sizes) else None}.., lost {trace.lost}), frees of unrecorded allocs {frees_unknown}, "
              f"warnings {len(trace.warnings)}", flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"kill: {ok} of {args.runs} traces read back (report exit 0); last event before the kill: "
          f"min {min(lost_ms):.0f} ms, median {statistics.median(lost_ms):.0f} ms, max {max(lost_ms):.0f} ms; "
          f"{args.runs - gaps} of {args.runs} with every alloc between the first and last recorded either "
          f"recorded or counted lost; "
          f"{unmatched} free(s) of an alloc made before the probes were in place")


def cmd_overload(args, lib: Path) -> None:
    """The workload makes 2 events per iteration (alloc, free) plus 3 of its own (the context
    retain's CTX_BEGIN at entry and CTX at return, and its exit): recorded + lost must be exactly that. The daemon probes every process
    on the host, so the lost count would include other processes' losses: events of other
    processes in the trace are shown, and such a run says so."""
    exact = 0
    for run in range(args.runs):
        workdir = Path(tempfile.mkdtemp(prefix="mro", dir="/tmp"))
        d = Daemon(workdir, lib, "--ringbuf-pages", "8")
        w = workload(lib, d.socket, rate=0, count=args.count)
        done = w.stdout.readline().split()
        w.wait()
        time.sleep(1.0)
        d.stop()
        trace = load_trace(d.output)
        made = 2 * int(done[1]) + 3
        ev = trace.events
        recorded = int((ev["pid"] == w.pid_reported).sum())
        others = int((ev["pid"] != w.pid_reported).sum())
        ok = recorded + trace.lost == made
        exact += ok
        print(f"run {run + 1}: made {made}, recorded {recorded}, lost {trace.lost}, other processes' events "
              f"recorded {others}: {'exact' if ok else f'off by {recorded + trace.lost - made}'}", flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"overload: recorded + lost = made in {exact} of {args.runs} runs")


def cmd_soak(args, lib: Path) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="mrs", dir="/tmp"))
    d = Daemon(workdir, lib)
    w = workload(lib, d.socket, rate=args.rate / 2, count=-1, markers=args.markers)
    time.sleep(5)
    rss0, fds0 = d.rss_fds()
    samples = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        time.sleep(min(10, max(0.1, end - time.monotonic())))
        samples.append(d.rss_fds())
    rss1, fds1 = d.rss_fds()
    w.kill()
    w.wait()
    d.stop()
    trace = load_trace(d.output)
    n = len(trace.events)
    secs = (int(trace.events["ts"].max()) - int(trace.events["ts"].min())) / 1e9 if n else 0
    print(json.dumps({"seconds": args.seconds, "events": n, "events_per_s": round(n / secs) if secs else 0,
                      "markers": len(trace.markers), "lost": trace.lost,
                      "rss_mib": [round(rss0 / 2**20), round(rss1 / 2**20)],
                      "rss_max_mib": round(max(s[0] for s in samples) / 2**20), "fds": [fds0, fds1],
                      "warnings": trace.warnings}))
    shutil.rmtree(workdir, ignore_errors=True)


#: An attacker's client, run as nobody: ``flood SECONDS VALUES`` (markers of about VALUES × 200
#: bytes as fast as the socket takes them), ``begins N`` (N begin markers of distinct names),
#: ``connect SECONDS`` (one marker, then stay). Prints what it sent.
ATTACKER = r"""
import socket, sys, time
from memrec.terms import protocol
path, what, arg = sys.argv[1], sys.argv[2], float(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
sent = n = 0
if what == "flood":
    frame = protocol.encode_frame(protocol.make_mark("flood" * 40, "instant", time.monotonic_ns(), 1, None,
                                                     {f"k{i}": "v" * 190 for i in range(int(sys.argv[4]))}))
    end = time.monotonic() + arg
    while time.monotonic() < end:
        try:
            s.sendall(frame)
        except OSError:
            break
        sent += len(frame); n += 1
elif what == "begins":
    batch = []
    for i in range(int(arg)):
        batch.append(protocol.encode_frame(protocol.make_mark(f"p{i}", "begin", time.monotonic_ns(), 1, None, {})))
        if len(batch) == 1000:
            data = b"".join(batch); s.sendall(data); sent += len(data); n += len(batch); batch = []
    if batch:
        data = b"".join(batch); s.sendall(data); sent += len(data); n += len(batch)
else:
    frame = protocol.encode_frame(protocol.make_mark("hello", "instant", time.monotonic_ns(), 1, None, {}))
    s.sendall(frame); sent, n = len(frame), 1
print(n, sent, flush=True)
if what == "connect":
    time.sleep(arg)
"""
NOBODY = 65534


def attacker(socket_path: Path, *args: str, argv_bytes: int = 0) -> subprocess.Popen:
    """ATTACKER as user and group nobody, with ``argv_bytes`` of extra arguments (100 KB each)."""
    padding = ["x" * 100_000] * (argv_bytes // 100_000)
    return subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", ATTACKER,
         str(socket_path), *args, *padding],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), stdout=subprocess.PIPE, text=True,
    )


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.is_symlink())


def _hostile_daemon(workdir: Path, lib: Path, *extra: str, output: Path | None = None) -> Daemon:
    os.chmod(workdir, 0o755)  # nobody reaches the socket through the group (nogroup) only
    return Daemon(workdir, lib, "--socket-group", "nogroup", *extra, output=output)


def hostile_connects(lib: Path, n: int = 200) -> dict:
    """``n`` processes with a 1 MB argv connect, send one marker and leave (the review: 200 of them
    took root's RSS from 210 to 401 MB, never freed, and grew the trace by 192 MB)."""
    workdir = Path(tempfile.mkdtemp(prefix="mrh", dir="/tmp"))
    folder = workdir / "traces"
    d = _hostile_daemon(workdir, lib, "-o", f"{folder}/", output=folder)
    time.sleep(2)
    rss0, _ = d.rss_fds()
    bytes0 = _folder_bytes(folder)
    for _ in range(n // 8):
        clients = [attacker(d.socket, "connect", "0", argv_bytes=1_000_000) for _ in range(8)]
        for c in clients:
            c.wait()
    time.sleep(3)  # a few sweeps: the clients are gone
    rss1, _ = d.rss_fds()
    d.stop()
    out = {"figure": "connects", "clients": n, "attacker_argv_mb": round(n * 1.0, 1),
           "rss_mib": [round(rss0 / 2**20), round(rss1 / 2**20)],
           "trace_growth_kb": round((_folder_bytes(folder) - bytes0) / 1024)}
    shutil.rmtree(workdir, ignore_errors=True)
    return out


def hostile_rotation(lib: Path, seconds: float = 20) -> dict:
    """25 connects with a 1 MB argv that stay, and a marker flood, under ``--rotate-size 20M
    --keep 3`` (the review: 172 rotations in 20 s and 2.0 GB on disk), with an operator's copy and
    a planted file dated 2030 in the folder (the review: both deleted or holding a slot)."""
    workdir = Path(tempfile.mkdtemp(prefix="mrh", dir="/tmp"))
    folder = workdir / "traces"
    folder.mkdir()
    copy = folder / "memrec-host-20260101-000000-1-0000abcd.mrec"
    copy.write_bytes(b"an operator's copy")
    planted = folder / "memrec-planted.mrec"
    planted.write_bytes(b"x")
    os.utime(planted, (1_900_000_000, 1_900_000_000))
    d = _hostile_daemon(workdir, lib, "-o", f"{folder}/", "--rotate-size", "20M", "--keep", "3", output=folder)
    stay = [attacker(d.socket, "connect", str(seconds + 10), argv_bytes=1_000_000) for _ in range(25)]
    for c in stay:
        c.stdout.readline()
    cpu0 = d.cpu_seconds()
    flood = [attacker(d.socket, "flood", str(seconds), "20") for _ in range(2)]
    sent = sum(int(f.stdout.readline().split()[1]) for f in flood)
    for c in flood + stay:
        c.kill()
        c.wait()
    cpu = d.cpu_seconds() - cpu0
    time.sleep(11)  # one more look of --keep
    on_disk = _folder_bytes(folder)
    d.stop()
    log = (workdir / "daemon.log").read_text()
    out = {"figure": "rotation", "seconds": seconds, "flood_mb_sent": round(sent / 1e6, 1),
           "rotations": log.count("rotated (size)"), "deleted": sum(int(line.split("deleted ")[1].split()[0])
                                                                  for line in log.splitlines() if "old trace file" in line),
           "mb_on_disk": round(on_disk / 1e6, 1), "operator_copy_kept": copy.exists(), "planted_kept": planted.exists(),
           "daemon_cpu_s": round(cpu, 1), "markers_dropped": _last_trailer(folder).get("markers_dropped")}
    shutil.rmtree(workdir, ignore_errors=True)
    return out


def _last_trailer(folder: Path) -> dict:
    """The trailer of the daemon's newest file (by its ledger; by mtime where there is none)."""
    ledger = folder / ".memrec-written"
    if ledger.exists():
        newest = folder / ledger.read_text().splitlines()[-1].split("\t")[0]
    else:
        newest = max(folder.glob("memrec-*-*-*-*.mrec"), key=lambda p: p.stat().st_mtime)
    return load_trace(newest).trailer or {}


def hostile_phases(lib: Path, count: int = 3_000_000) -> dict:
    """``count`` begin markers of distinct names with metrics on (the review: a core used forever,
    sample() 1.7 s at 3 M open phases): the daemon's CPU while they come and in the 10 s after."""
    workdir = Path(tempfile.mkdtemp(prefix="mrh", dir="/tmp"))
    d = _hostile_daemon(workdir, lib, "--metrics-addr", f"127.0.0.1:{random.randrange(20000, 60000)}")
    cpu0 = d.cpu_seconds()
    t0 = time.monotonic()
    a = attacker(d.socket, "begins", str(count))
    n, sent = map(int, a.stdout.readline().split())
    a.wait()
    t1 = time.monotonic()
    cpu1 = d.cpu_seconds()
    time.sleep(10)
    cpu2 = d.cpu_seconds()
    rss, _ = d.rss_fds()
    d.stop()
    trailer = load_trace(d.output).trailer or {}
    out = {"figure": "phases", "begins_sent": n, "mb_sent": round(sent / 1e6, 1), "send_seconds": round(t1 - t0, 1),
           "daemon_cpu_s_while_sent": round(cpu1 - cpu0, 1), "daemon_cpu_pct_10s_after": round((cpu2 - cpu1) * 10, 1),
           "rss_mib": round(rss / 2**20), "markers_dropped": trailer.get("markers_dropped")}
    shutil.rmtree(workdir, ignore_errors=True)
    return out


def hostile_diskfull(lib: Path, allocs: int = 30_000, seconds: float = 15) -> dict:
    """A 64 MiB file system left with 12 MiB free, a marker flood from nobody and ``allocs``
    allocations meanwhile (the review: 0 of 30,000 reached the file, no trailer, no dropped count)."""
    workdir = Path(tempfile.mkdtemp(prefix="mrh", dir="/tmp"))
    disk = workdir / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    try:
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (52 << 20))
        d = _hostile_daemon(workdir, lib, "-o", str(disk / "out.mrec"), output=disk / "out.mrec")
        flood = [attacker(d.socket, "flood", str(seconds), "20") for _ in range(2)]
        time.sleep(seconds / 3)
        w = workload(lib, d.socket, rate=0, count=allocs)
        w.stdout.readline()
        w.wait()
        sent = sum(int(f.stdout.readline().split()[1]) for f in flood)
        for f in flood:
            f.wait()
        time.sleep(1)
        d.stop()
        trace = load_trace(d.output)
        log = (workdir / "daemon.log").read_text()
        out = {"figure": "diskfull", "allocs_made": allocs, "allocs_in_file": len(_allocs(trace, w.pid_reported)),
               "flood_mb_sent": round(sent / 1e6, 1), "markers_in_file": len(trace.markers),
               "trailer": trace.trailer is not None,
               "markers_dropped": (trace.trailer or {}).get("markers_dropped"),
               "disk_full": (trace.trailer or {}).get("disk_full"), "lost": trace.lost,
               "log_says_without_trailer": "WITHOUT its trailer" in log,
               "log_says_already_complete": "already complete" in log}
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def cmd_hostile(args, lib: Path) -> None:
    figures = {"connects": hostile_connects, "rotation": hostile_rotation, "phases": hostile_phases,
               "diskfull": hostile_diskfull}
    for name in args.only or list(figures):
        print(json.dumps(figures[name](lib)), flush=True)
READER_SCRIPT = r"""
import contextlib, io, logging, resource, sys, warnings
sys.path.insert(0, sys.argv[2])
logging.disable(logging.CRITICAL)
warnings.simplefilter("ignore")
path = sys.argv[1]
import memrec, memrec.tui.sources, memrec.analysis.report.build
from memrec.base.errors import TraceFormatError
from tests.fuzz.harness import run_commands, load_in_tui
if sys.argv[3] == "work":
    run_commands(path)
    load_in_tui(path)
    try:
        r = memrec.load(path, pandas=False)
        r.events_array(); r.by_phase_array()
    except TraceFormatError:
        pass
# VmHWM, not ru_maxrss: that one keeps the parent's high-water mark across fork and exec
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def _seeds() -> dict[str, bytes]:
    """Files the reader checks start from: the golden traces and the crafted bombs."""
    from tests.fuzz import bombs

    root = Path(__file__).resolve().parents[1]
    seeds = {f"golden_v{v}": (root / "tests" / "data" / f"golden_v{v}.mrec").read_bytes() for v in ("1", "2", "2_1", "2_2", "2_3")}
    seeds.update({
        "keyframe-zeros-4x256MiB": bombs.keyframe_bomb(4, 256 << 20),
        "keyframe-empty-lists-2x64Mi": bombs.keyframe_bomb(2, 64 << 20, empty_lists=True),
        "keyframe-zeros-1GiB": bombs.keyframe_bomb(1, (1 << 30) - 64),  # (the format's per-state limit)
        "rows-16.7M": bombs.rows_bomb(256),
        "rows-64KiB": bombs.rows_bomb(1900),
    })
    return seeds


def cmd_readers(args, lib: Path | None) -> None:
    import random as _random

    from tests.fuzz.harness import mutate

    root = str(Path(__file__).resolve().parents[1])
    workdir = Path(tempfile.mkdtemp(prefix="mrr"))
    seeds = _seeds()
    rng = _random.Random(args.seed)
    files = list(seeds.items())
    names = list(seeds)
    for i in range(args.mutations):
        name = rng.choice(names)
        files.append((f"{name}~{i}", mutate(seeds[name], rng, rng.randint(1, 8))))

    def peak(path: Path, what: str) -> int:
        out = subprocess.run([sys.executable, "-c", READER_SCRIPT, str(path), root, what], capture_output=True,
                             text=True, timeout=600)
        if out.returncode != 0:
            raise SystemExit(f"{path}: a reader failed:\n{out.stderr[-3000:]}")
        return int(out.stdout.split()[-1]) * 1024

    path = workdir / "f.mrec"
    path.write_bytes(b"")
    baseline = peak(workdir / "f.mrec", "idle")
    worst = (0, "")
    for name, data in files:
        if len(data) > 64 << 10:
            continue
        path.write_bytes(data)
        rss = peak(path, "work")
        if name in seeds or rss > worst[0]:
            print(f"{name}: {len(data):,} bytes, peak {rss / 2**20:.0f} MiB", flush=True)
        worst = max(worst, (rss, name))
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({"files": len(files), "baseline_mib": round(baseline / 2**20), "largest_peak_mib":
                      round(worst[0] / 2**20), "largest_file": worst[1]}))


def _core_check(path: str) -> None:
    """The cheaper check of every file: load, the report in text and JSON, and dump's walk."""
    from memrec.base.errors import TraceFormatError
    from memrec.analysis.report.build import build_report
    from memrec.analysis.report.text import render_text
    from memrec.export.jsonl import dump_trace
    from memrec.trace.reader import TraceReader

    try:
        trace = load_trace(path)
    except TraceFormatError:
        return
    if not trace.header:
        return
    report = build_report(trace)
    render_text(report)
    json.dumps(report)
    with TraceReader(path) as reader, open(os.devnull, "w") as null:
        dump_trace(reader, null)


def _fuzzed_frames(rng: random.Random, count: int):
    """``count`` frames for the marker socket: 97 % honest marks, the rest marks with fuzzed values,
    byte-mutated ones and random bytes (a bad frame makes the daemon close that connection, and
    what was sent after it on that connection is never read)."""
    import msgpack

    from tests.fuzz.harness import mutate

    edges = [0, -1, 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 1.5, None, "x", b"\x00", [], {}]
    names = ["load", "", "x" * 300, "\x1b]0;pwned\x07", "\u202e", "step"]
    for _ in range(count):
        roll = rng.random()
        if roll >= 0.03:  # most are honest marks: a bad frame closes its connection, these keep it open
            yield protocol.encode_frame(protocol.make_mark("step", "instant", time.monotonic_ns(), 1)), True
            continue
        mark = {"type": "mark", "name": rng.choice(names), "phase": rng.choice(["begin", "end", "instant", "x"]),
                "ts": time.monotonic_ns(), "tid": 1}
        for _ in range(rng.randint(0, 3)):
            mark[rng.choice(["ts", "tid", "gpu", "pid", "values", "name", "type", "extra"])] = rng.choice(edges)
        if rng.random() < 0.2:
            mark["values"] = {rng.choice(names): rng.choice(edges) for _ in range(rng.randint(0, 4))}
        data = protocol.frame(msgpack.packb(mark, use_bin_type=True))
        if roll < 0.01:
            data = mutate(data, rng, rng.randint(1, 3))
        elif roll < 0.012:
            data = rng.randbytes(rng.randint(1, 40))
        yield data, False


def _frames_against_a_daemon(count: int, seed: int) -> dict:
    import contextlib
    import socket as _socket
    import threading

    from memrec.client import MarkerClient
    from tests.unit.test_daemon_unit import make_daemon
    from tests.unit.test_daemon_unit import pump

    import logging

    class Internal(logging.Handler):  # a traceback the daemon caught while serving a client
        count = 0

        def emit(self, record: logging.LogRecord) -> None:
            if "internal error" in record.getMessage() or record.exc_info:
                Internal.count += 1

    logging.disable(logging.NOTSET)
    logging.getLogger().addHandler(Internal())
    workdir = Path(tempfile.mkdtemp(prefix="mrf", dir="/tmp"))
    daemon = make_daemon(workdir)
    daemon.start()
    sent = [0, 0]  # frames written, connections
    done = threading.Event()

    def client() -> None:
        rng = random.Random(seed)
        frames = _fuzzed_frames(rng, count)
        s = None
        for data, honest in frames:
            if s is None:
                s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(str(daemon.config.socket_path))
                s.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVBUF, 1 << 16)
                sent[1] += 1
            try:
                s.sendall(data)
                sent[0] += 1
            except OSError:  # the daemon closed it after a bad frame: a new connection
                s.close()
                s = None
            if s is not None and not honest:  # a fuzzed frame ends its connection (what follows a bad one is lost)
                s.shutdown(_socket.SHUT_WR)
                with contextlib.suppress(OSError):
                    while s.recv(1 << 16):
                        pass
                s.close()
                s = None
            if s is not None and sent[0] % 64 == 0:  # drain the daemon's replies (errors) now and then
                s.setblocking(False)
                try:
                    while s.recv(1 << 16):
                        pass
                except (BlockingIOError, OSError):
                    pass
                s.settimeout(10)
        if s is not None:
            s.close()
        done.set()

    t = threading.Thread(target=client, daemon=True)
    start = time.monotonic()
    t.start()
    while not done.is_set():
        pump(daemon, 0.05)
    pump(daemon, 0.2)
    before = daemon.markers_recorded
    assert MarkerClient(daemon.config.socket_path).mark("alive")
    deadline = time.monotonic() + 10
    while daemon.markers_recorded == before and time.monotonic() < deadline:
        pump(daemon, 0.01)
    serving = daemon.mood.value == "running" and daemon.markers_recorded > before
    markers = daemon.markers_recorded
    server = daemon.markers
    decoded = server.markers + server.pings + server.errors
    daemon.stop()
    trace = load_trace(daemon.files[0])
    shutil.rmtree(workdir, ignore_errors=True)
    return {"frames_written": sent[0], "frames_decoded_by_the_daemon": decoded, "bad_frames": server.errors,
            "internal_errors": Internal.count, "connections": sent[1], "seconds": round(time.monotonic() - start),
            "markers_recorded": markers, "still_serving": serving, "trace_markers": len(trace.markers)}


def cmd_fuzz(args, lib: Path | None) -> None:
    import logging
    import traceback

    from tests.fuzz.harness import check_trace_bytes
    from tests.fuzz.harness import mutate

    logging.disable(logging.CRITICAL)
    rng = random.Random(args.seed)
    seeds = {k: v for k, v in _seeds().items() if len(v) <= 64 << 10}
    goldens = [name for name in seeds if name.startswith("golden")]
    bombs = [name for name in seeds if name not in goldens]
    workdir = tempfile.mkdtemp(prefix="mrz")
    path = os.path.join(workdir, "f.mrec")
    tracebacks = full = 0
    start = time.monotonic()
    for i in range(args.files):
        name = rng.choice(bombs if rng.random() < args.bomb_share else goldens)
        data = mutate(seeds[name], rng, rng.randint(1, 8))
        try:
            with open(path, "wb") as f:
                f.write(data)
            _core_check(path)
            if args.full_every and i % args.full_every == 0:
                check_trace_bytes(data, workdir)
                full += 1
        except Exception:  # noqa: BLE001 - counting is the point
            tracebacks += 1
            keep = os.path.join(workdir, f"crash-{i}.mrec")
            shutil.copy(path, keep)
            print(f"file {i} (from {name}): {traceback.format_exc(limit=3)}\nkept as {keep}", flush=True)
        if (i + 1) % 2000 == 0:
            print(f"{i + 1} files, {tracebacks} tracebacks, {time.monotonic() - start:.0f} s", flush=True)
    files_s = time.monotonic() - start
    frames = _frames_against_a_daemon(args.frames, args.seed) if args.frames else {}
    print(json.dumps({"files": args.files, "full_checks": full, "tracebacks": tracebacks,
                      "files_seconds": round(files_s), "frames": frames}))


def cmd_edges(args, lib: Path | None) -> None:
    import collections
    import logging
    import traceback

    from tests.fuzz import edges
    from tests.fuzz.harness import every_reader

    logging.disable(logging.CRITICAL)
    workdir = tempfile.mkdtemp(prefix="mre")
    path = os.path.join(workdir, "e.mrec")
    codes: collections.Counter = collections.Counter()
    failures = []
    traces = [*edges.column_edges(), *edges.record_edges()]
    for name, data in traces:
        with open(path, "wb") as f:
            f.write(data)
        try:
            codes.update(every_reader(path, workdir).values())
        except Exception:  # noqa: BLE001
            failures.append(name)
            print(f"{name}: {traceback.format_exc(limit=3)}", flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({"traces": len(traces), "exit_codes": dict(codes), "failures": failures}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kill")
    k.add_argument("--runs", type=int, default=26)
    k.add_argument("--rate", type=float, default=2000)
    k.add_argument("--workload-first", action="store_true", help="start allocating before the daemon attaches")
    o = sub.add_parser("overload")
    o.add_argument("--runs", type=int, default=7)
    o.add_argument("--count", type=int, default=200_000)
    s = sub.add_parser("soak")
    s.add_argument("--seconds", type=float, default=120)
    s.add_argument("--rate", type=float, default=6000)
    s.add_argument("--markers", type=float, default=50)
    h = sub.add_parser("hostile")
    h.add_argument("--only", action="append", choices=("connects", "rotation", "phases", "diskfull"))
    # issue 23's readers, fuzzing and edges: (option, default, help)
    for name, options in (
        ("readers", (("--mutations", 60, None), ("--seed", 23, None))),
        ("fuzz", (("--files", 100_000, None), ("--frames", 1_000_000, None), ("--seed", 23, None),
                  ("--full-every", 100, "the whole harness check on every N-th file"),
                  ("--bomb-share", 0.01, "the share of files mutated from a bomb (each reads up to its budget: slow)"))),
        ("edges", ()),
    ):
        p = sub.add_parser(name)
        for option, default, text in options:
            p.add_argument(option, type=type(default), default=default, help=text)
    args = parser.parse_args()
    commands = {"kill": cmd_kill, "overload": cmd_overload, "soak": cmd_soak, "hostile": cmd_hostile,
                "readers": cmd_readers, "fuzz": cmd_fuzz, "edges": cmd_edges}
    lib = None
    if args.what in ("kill", "overload", "soak", "hostile"):
        from memrec.validation.stubdriver.build import build_stub

        lib = build_stub()
    commands[args.what](args, lib)

if __name__ == "__main__":
    main()
