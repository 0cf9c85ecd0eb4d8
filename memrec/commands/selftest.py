"""``memrec selftest``: make real driver calls and check the running daemon recorded each one."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError

if TYPE_CHECKING:  # numpy is imported where it is used, so `memrec --help` stays light
    import numpy as np


class _Collector(threading.Thread):
    """Reads the live stream on its own thread and keeps the header and every event."""

    def __init__(self, sock) -> None:
        super().__init__(daemon=True)
        self.sock = sock
        self.header: dict = {}
        self.chunks: list[np.ndarray] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.ready = threading.Event()  # set once the header arrived: we are subscribed

    def run(self) -> None:
        from memrec.subscriber import records

        self.sock.settimeout(0.2)
        while not self.stopping.is_set():
            for rec in records(self.sock):
                with self.lock:
                    if rec.get("type") == "header":
                        self.header = rec
                        self.ready.set()
                    elif rec.get("type") == "events":
                        self.chunks.append(rec["events"])

    def events(self) -> np.ndarray:
        import numpy as np

        from memrec.terms.columns import EVENT_DTYPE

        with self.lock:
            return np.concatenate(self.chunks) if self.chunks else np.zeros(0, EVENT_DTYPE)


def _expected_gpu(header: dict, ordinal: int) -> int | None:
    """The physical GPU this process's device ``ordinal`` is, as the daemon maps it."""
    from memrec.terms.events import GpuInfo
    from memrec.probes.procinfo import gpu_map

    gpus = [GpuInfo(**g) for g in header.get("gpus", [])]
    mapping = gpu_map(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
    return mapping[ordinal] if ordinal < len(mapping) else None


#: The NVIDIA driver's control device: there on every host where the driver is loaded.
NVIDIACTL = "/dev/nvidiactl"


def _require_gpu() -> None:
    """A GPU to make the calls on, asked before cuda-python (which there is no use installing without one).

    Raises:
        MemrecCommandError: no NVIDIA driver is loaded (exit code UNAVAILABLE).
    """
    if not os.path.exists(NVIDIACTL):
        raise MemrecCommandError(
            f"no NVIDIA GPU here ({NVIDIACTL} does not exist: no driver loaded): selftest makes real driver "
            "calls on a GPU; memrec demo records the bundled stub driver without one",
            exit_code=ExitCode.UNAVAILABLE,
        )


def _require_cuda_python() -> None:
    """The driver calls go through cuda-python, an extra (``memrec[gpu]``), not a dependency.

    Raises:
        MemrecCommandError: it is not importable (exit code UNAVAILABLE, with what to install).
    """
    from memrec.validation.gpu.driver_calls import driver_api

    try:
        driver_api()
    except ImportError as error:
        from memrec.base.extras import install_command

        raise MemrecCommandError(
            f"selftest makes real driver calls through cuda-python, which is not importable "
            f"(no module {error.name or 'cuda'}): {install_command('gpu', ('cuda-python',))}",
            exit_code=ExitCode.UNAVAILABLE,
        ) from None


class SelftestCommand:
    """Make a scripted set of real CUDA driver calls and check the daemon recorded each exactly.

    With `memrec daemon` running, this runs cuda-python in child processes: allocations of
    distinctive sizes, VMM create/reserve/map/unmap/release, an IPC export opened by a second
    process, pinned host memory and a deliberate out-of-memory request. Each call must appear in
    the daemon's live stream with the same process, sizes, pointers, handle bytes and physical
    GPU. Prints PASS/FAIL per check; exits 1 if any fails.
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--socket", metavar="PATH", help="the daemon's socket")
        parser.add_argument("--device", type=int, default=0, help="device ordinal to test (default 0)")
        from memrec.commands.common import arg_type
        from memrec.daemon.config import positive_float

        # nan or a negative number waited for nothing and failed every check
        parser.add_argument("--timeout", type=arg_type(positive_float), default=20.0,
                            help="seconds to wait for the events")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        from memrec.terms.events import Kind
        from memrec.subscriber import subscribe
        from memrec.subscriber import wait_for_daemon
        from memrec.validation.selftest import check_exits
        from memrec.validation.selftest import check_facts

        _require_gpu()
        _require_cuda_python()
        wait_for_daemon(args.socket)
        sock = subscribe(args.socket)
        collector = _Collector(sock)
        collector.start()
        if not collector.ready.wait(30):
            raise MemrecCommandError("the daemon accepted the subscription but sent nothing", exit_code=ExitCode.UNAVAILABLE)
        workload = subprocess.run(
            [sys.executable, "-m", "memrec.validation.gpu.driver_calls", "--device", str(args.device)],
            capture_output=True,
            text=True,
        )
        if workload.returncode != 0:
            collector.stopping.set()
            last = (workload.stderr.strip().splitlines() or [f"exit code {workload.returncode}"])[-1]
            raise MemrecCommandError(f"the driver-call workload failed: {last}", exit_code=ExitCode.ERROR)
        facts = [json.loads(line) for line in workload.stdout.splitlines() if line.startswith("{")]
        pids = {fact["pid"] for fact in facts}
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:  # every workload process's exit closes its events
            events = collector.events()
            exited = set(events["pid"][events["kind"] == Kind.PROC_EXIT].tolist())
            if pids <= exited:
                break
            time.sleep(0.2)
        collector.stopping.set()
        collector.join(timeout=2)
        sock.close()
        events = collector.events()
        gpu = _expected_gpu(collector.header, args.device)
        results = check_facts(facts, events, gpu) + check_exits(pids, events)
        for r in results:
            print(f"{'PASS' if r.passed else 'FAIL'}  {r.name}: {r.detail}")
        failed = sum(not r.passed for r in results)
        calls = sum(1 for f in facts if f.get("call") != "context")
        print(f"selftest: {len(results) - failed} passed, {failed} failed ({calls} driver calls made, "
              f"{len(events)} events seen, expected GPU {gpu})")
        return ExitCode.ERROR if failed else ExitCode.OK
