"""``memrec daemon``: record every CUDA process on the host, in the foreground."""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

from memrec.terms import protocol
from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.commands.common import arg_type


def _pid(text: str) -> int:
    """A running process's id (``--tensors-pid``): its probes go into that process only."""
    try:
        pid = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a process id") from None
    if pid <= 0:
        raise ValueError(f"{pid} is not a process id")
    try:
        with open(f"/proc/{pid}/status") as f:
            tgid = next((int(line.split()[1]) for line in f if line.startswith("Tgid:")), pid)
    except OSError:
        raise ValueError(f"no process {pid} runs") from None
    if tgid != pid:
        raise ValueError(f"{pid} is a thread of process {tgid}: name the process")
    return pid


def require_privileges() -> None:
    """Root, or CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN).

    Raises:
        MemrecCommandError: neither (exit code NO_PERM, with a hint).
    """
    from memrec.commands.doctor import check_privileges

    check = check_privileges()
    if check.status != "ok":
        raise MemrecCommandError(
            f"the daemon needs root or CAP_BPF+CAP_PERFMON ({check.detail}): run as root or see memrec doctor",
            exit_code=ExitCode.NO_PERM,
        )


class DaemonCommand:
    """Record GPU memory events of every CUDA process on this host, until SIGINT/SIGTERM.

    Runs in the foreground and logs to stderr (made for systemd: with $NOTIFY_SOCKET it sends READY
    once the probes are attached, WATCHDOG from its loop and STOPPING). Probes every libcuda.so.1 that
    is installed or mapped (new ones are picked up every few seconds), samples NVML, accepts phase
    markers on a Unix socket, and writes a trace (SIGHUP starts a new file).

    examples:
        sudo memrec daemon -o /var/lib/memrec/
        sudo memrec daemon -o run.mrec -d 10m --rotate-size 0
        sudo memrec daemon --socket /tmp/memrec.sock --libcuda /opt/nvidia/lib64/libcuda.so.1
        sudo memrec daemon -o /var/lib/memrec/ --keep 20 --metrics-addr 127.0.0.1:9862
        sudo memrec install-service --enable     # the same under systemd (docs/operations.md)
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        from memrec.daemon import config as c
        from memrec.daemon import scheduling
        from memrec.daemon.service import file_count
        from memrec.daemon.service import metrics_addr

        parser.add_argument(
            "-o", "--output", default=c.DEFAULT_OUTPUT, metavar="PATH",
            help=f"trace file, or directory for trace files (a trailing / or an existing directory; default {c.DEFAULT_OUTPUT})",
        )
        parser.add_argument("--socket", metavar="PATH", help=f"marker socket (default: $MEMREC_SOCKET or {protocol.DEFAULT_SOCKET})")
        parser.add_argument("--socket-group", metavar="GROUP", help="group allowed to send markers (socket mode 0660)")
        parser.add_argument("--live-group", metavar="GROUP",
                            help="group also allowed to subscribe to the live view: every event and every traced "
                                 "process's command line (default: root only)")
        parser.add_argument("--libcuda", action="append", default=[], metavar="PATH", help="also probe this libcuda (repeatable)")
        parser.add_argument("--rotate-size", type=arg_type(c.byte_size), default=c.GiB, metavar="SIZE",
                            help="start a new file once SIZE bytes are written after its opening (header, processes, "
                                 "first keyframe) (e.g. 512M; 0: never; default 1G)")
        parser.add_argument("--nvml-hz", type=arg_type(c.rate), default=10.0, metavar="F",
                            help="NVML device-memory samples per second (0: off; at most 1000; default 10)")
        parser.add_argument("--nvml-process-hz", type=arg_type(c.rate), default=1.0, metavar="F",
                            help="NVML per-process samples per second (0: off; at most 1000; default 1)")
        parser.add_argument("--ringbuf-pages", type=arg_type(c.ring_pages), default=c.DEFAULT_RINGBUF_PAGES, metavar="N",
                            help=f"BPF ring buffer size in pages (power of two; default {c.DEFAULT_RINGBUF_PAGES}: 16 MiB)")
        parser.add_argument("--scheduling", type=arg_type(scheduling.parse), default=scheduling.DEFAULT, metavar="POLICY",
                            help="the daemon's CPU priority, so that it drains the ring buffer while the traced "
                                 f"processes keep every CPU busy: nice:N, fifo:N, rr:N or off (default {scheduling.DEFAULT}; "
                                 "falls back to the priority it has where not permitted)")
        parser.add_argument("--tensors", action="store_true",
                            help="also record PyTorch's tensor blocks inside the caching allocator's segments, in "
                                 "every process that maps a libc10_cuda.so with the pytorch:malloc/free USDT probes "
                                 "(already running ones included; costs about 1 us per tensor allocation or free)")
        parser.add_argument("--stacks", action="store_true",
                            help="also record the allocating thread's Python stack (file, line, function; CPython "
                                 "3.10-3.13, read by the probe: nothing runs in the process) and native return "
                                 "addresses, for every driver allocation and every tensor block of --stack-min-bytes "
                                 "or more (off by default; docs/probes.md, docs/performance.md)")
        parser.add_argument("--stack-depth", type=arg_type(c.stack_depth), default=32, metavar="N",
                            help="with --stacks, the most Python frames kept per stack, innermost first (1-32; default 32)")
        parser.add_argument("--stack-min-bytes", type=arg_type(c.byte_size), default=1 << 20, metavar="SIZE",
                            help="with --stacks --tensors, tensor blocks smaller than this get no stack "
                                 "(0: every block; default 1M). Driver allocations always get one")
        parser.add_argument("--torch-lib", action="append", default=[], metavar="PATH",
                            help="with --tensors, also probe this libc10_cuda.so (repeatable)")
        parser.add_argument("--tensors-pid", action="append", type=arg_type(_pid), default=[], metavar="PID",
                            help="record tensor blocks only in this running process (repeatable; implies "
                                 "--tensors): the probes' traps and semaphores are in the named processes only, so "
                                 "every other process on the host runs at no cost")
        parser.add_argument("--no-untraced-probes", dest="untraced_probes", action="store_false",
                            help="leave out the code-loading and pool probes (to measure what they cost)")
        parser.add_argument("--probe-cache", type=arg_type(c.probe_cache), default=c.DEFAULT_PROBE_CACHE, metavar="DIR|off",
                            help="keep the compiled BPF program here and reuse it while the program, its options and "
                                 "the kernel are unchanged (start in well under a second instead of compiling for "
                                 "seconds); a root-owned directory no one else can write; off: compile at every "
                                 f"start (default {c.DEFAULT_PROBE_CACHE})")
        parser.add_argument("-d", "--duration", type=arg_type(c.duration), metavar="DURATION",
                            help="stop after this long (e.g. 30s, 10m, 2h)")
        parser.add_argument("--keep", type=arg_type(file_count), default=0, metavar="N",
                            help="in a trace directory, keep the N newest trace files this daemon wrote (its ledger "
                                 ".memrec-written) and delete its older ones; other files are never touched "
                                 "(0: keep all; with --rotate-size, its files stay under about N x SIZE)")
        parser.add_argument("--metrics-addr", type=arg_type(metrics_addr), metavar="HOST:PORT",
                            help="serve Prometheus metrics at http://HOST:PORT/metrics (needs prometheus-client, "
                                 "the metrics extra; :PORT listens on every address)")
        parser.add_argument("--dataset", type=Path, metavar="DIR",
                            help="export each trace file, once closed (rotation, stop), into the Parquet dataset at DIR "
                                 "for memrec sql, Spark, Trino (in a child process at lower priority; needs pyarrow, "
                                 "the sql extra)")
        parser.add_argument("--drop-capabilities", action="store_true",
                            help="once the probes are attached, keep only the capabilities recording needs "
                                 "(CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH, CAP_SYS_RESOURCE)")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        from memrec.daemon.config import DaemonConfig
        from memrec.daemon.server import Daemon
        from memrec.daemon.service import Service

        if getattr(args, "verbose", 0) == 0:
            logging.getLogger("memrec").setLevel(logging.INFO)  # a daemon says what it does
        require_privileges()
        config = DaemonConfig(
            output=args.output,
            socket_path=protocol.socket_path(args.socket),
            socket_group=args.socket_group,
            live_group=args.live_group,
            libcuda_paths=tuple(args.libcuda),
            rotate_bytes=args.rotate_size,
            nvml_device_hz=args.nvml_hz,
            nvml_process_hz=args.nvml_process_hz,
            ringbuf_pages=args.ringbuf_pages,
            scheduling=args.scheduling,
            untraced_probes=args.untraced_probes,
            tensors=args.tensors or bool(args.tensors_pid),
            torch_paths=tuple(args.torch_lib),
            stacks=args.stacks,
            stack_depth=args.stack_depth,
            stack_min_bytes=args.stack_min_bytes,
            tensor_pids=tuple(args.tensors_pid),
            probe_cache=args.probe_cache,
        )
        if args.dataset is not None:
            _check_dataset(args.dataset)
        service = Service(args.metrics_addr, args.keep, args.drop_capabilities, dataset=args.dataset)
        service.listen()  # a taken metrics port fails before the slow BPF compile
        daemon = Daemon(config)
        try:
            daemon.start()
            service.started(daemon)
        except BaseException:
            daemon.stop("failed to start")
            service.close()
            raise
        until = None
        if args.duration:
            deadline = time.monotonic() + args.duration
            until = lambda: time.monotonic() >= deadline  # noqa: E731
        reason = None
        try:
            if daemon.run(until=until) == "until":
                reason = f"duration {args.duration:g} s"
        finally:
            service.stopping(daemon, reason)
            daemon.stop(reason)
            service.close()
        return ExitCode.OK


def _check_dataset(folder: Path) -> None:
    """Fail before recording starts when --dataset cannot work: pyarrow missing, the folder's
    parent missing, or a dataset of another layout there."""
    from memrec.commands.common import check_output
    from memrec.export import require
    from memrec.export.dataset import check_manifest

    require("pyarrow.parquet", "sql", "--dataset")
    if folder.exists() and not folder.is_dir():
        raise MemrecCommandError(f"--dataset {folder}: exists and is not a folder", exit_code=ExitCode.CANT_CREATE)
    check_output(folder, force=True)
    check_manifest(folder)
