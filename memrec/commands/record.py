"""``memrec record``: record one command's process tree, then exit with its exit code."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.commands.common import arg_type
from memrec.commands.common import check_output

log = logging.getLogger(__name__)


@dataclass
class SuspendedChild:
    """A forked child held before ``exec`` until the probes follow it.

    It is forked before the daemon starts any thread, and it waits on a pipe, so the first
    instruction of the command already runs under the probes and inside the tracked tree.
    """

    pid: int
    _release_fd: int
    status: int | None = None

    @classmethod
    def spawn(cls, argv: list[str], env: dict[str, str]) -> SuspendedChild:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: wait for the go, then become the command
            try:
                os.close(write_fd)
                if os.read(read_fd, 1) != b"1":
                    os._exit(126)
                os.close(read_fd)
                os.execvpe(argv[0], argv, env)
            except OSError as error:
                os.write(2, f"memrec record: cannot run {argv[0]}: {error.strerror}\n".encode())
            os._exit(127)
        os.close(read_fd)
        return cls(pid, write_fd)

    def release(self) -> None:
        """Let the child exec the command."""
        os.write(self._release_fd, b"1")
        os.close(self._release_fd)
        self._release_fd = -1

    def abandon(self) -> None:
        """Make the child exit without running the command (the recorder failed to start)."""
        if self._release_fd >= 0:
            os.close(self._release_fd)
            self._release_fd = -1
        self.wait()

    def poll(self) -> bool:
        """Return True once the child has exited (and reap it)."""
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
        return self.status is not None

    def wait(self) -> int:
        if self.status is None:
            _, self.status = os.waitpid(self.pid, 0)
        return self.exit_code

    @property
    def exit_code(self) -> int:
        """The command's exit code as a shell reports it (128 + signal when killed)."""
        assert self.status is not None
        if os.WIFSIGNALED(self.status):
            return 128 + os.WTERMSIG(self.status)
        return os.WEXITSTATUS(self.status)


def resolve_command(command: list[str]) -> list[str]:
    """Strip the ``--`` separator and check the program exists (one-line error if not)."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise MemrecCommandError(
            "no command to record: memrec record -o run.mrec -- CMD ARGS...", exit_code=ExitCode.USAGE
        )
    if shutil.which(command[0]) is None:
        raise MemrecCommandError(f"command not found: {command[0]}", exit_code=127)
    return command


def require_root() -> None:
    """Loading probes needs root (or CAP_BPF + CAP_PERFMON, which `memrec doctor` checks)."""
    if os.geteuid() != 0:
        raise MemrecCommandError(
            "recording needs root (or CAP_BPF+CAP_PERFMON): run with sudo, or see memrec doctor",
            exit_code=ExitCode.NO_PERM,
        )


def record_tree(
    command: list[str],
    output: Path,
    libcuda_paths: tuple[str, ...] = (),
    socket_path: str | None = None,
    nvml_device_hz: float | None = None,
    nvml_process_hz: float | None = None,
    prog: str = "memrec record",
    tensors: bool = False,
) -> int:
    """Record ``command`` and every process it starts into ``output``; return its exit code.

    The command's environment gets ``MEMREC=1`` and ``MEMREC_SOCKET`` so that memrec.mark() and
    the SGLang hooks in any process of the tree send their markers into this recording. Compiling
    the probes before the command starts and removing them after it ends take seconds each (most
    of a short recording); a line on stderr (``prog: ...``) says so before each.
    """
    from memrec.daemon.config import DaemonConfig
    from memrec.daemon.server import Daemon

    socket_path = socket_path or f"/run/memrec/record-{os.getpid()}.sock"
    env = dict(os.environ, MEMREC="1", MEMREC_SOCKET=socket_path)
    child = SuspendedChild.spawn(command, env)
    overrides = {}
    if nvml_device_hz is not None:
        overrides["nvml_device_hz"] = nvml_device_hz
    if nvml_process_hz is not None:
        overrides["nvml_process_hz"] = nvml_process_hz
    config = DaemonConfig(
        output=output,
        socket_path=Path(socket_path),
        libcuda_paths=tuple(libcuda_paths),
        follow_tree=True,
        rotate_bytes=0,
        tensors=tensors,
        **overrides,
    )
    daemon = Daemon(config, stop_signal_handler=lambda signum: _forward(child, signum))
    print(f"{prog}: loading the BPF probes", file=sys.stderr, flush=True)
    try:
        daemon.start()
        daemon.track_pid(child.pid)
    except BaseException:
        child.abandon()
        raise
    print(f"{prog}: recording; probe program {daemon.feed.origin()}", file=sys.stderr, flush=True)
    child.release()
    try:
        daemon.run(until=child.poll)
    finally:
        print(f"{prog}: closing the trace, then detaching the probes", file=sys.stderr, flush=True)
        daemon.stop()
    return child.wait()


def _forward(child: SuspendedChild, signum: int) -> None:
    """Ctrl-C or SIGTERM goes to the command; recording goes on until it has exited."""
    if not child.poll():
        log.info("forwarding signal %d to pid %d", signum, child.pid)
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass


class RecordCommand:
    """Record a command and every process it starts, then exit with the command's exit code.

    Probes are attached before the command starts; forks, exec'd and spawned children are followed
    in the kernel. Ctrl-C is passed to the command, and recording goes on until it exits. The
    output's folder must exist; an existing trace is replaced only with -f.

    examples:
        sudo memrec record -o run.mrec -- python train.py
        sudo memrec record -f -o run.mrec -- python train.py      # replace run.mrec
        sudo memrec record -o sgl.mrec -- python -m sglang.launch_server --model-path M --tp 8
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-o", "--output", required=True, type=Path,
                            help="trace file to write (.mrec), in an existing folder; or an existing folder")
        parser.add_argument("-f", "--force", action="store_true", help="replace the output file if it exists")
        parser.add_argument("--libcuda", action="append", default=[], metavar="PATH", help="also probe this libcuda")
        parser.add_argument("--socket", metavar="PATH", help="marker socket for the recorded tree")
        from memrec.daemon.config import rate

        parser.add_argument("--nvml-hz", type=arg_type(rate), metavar="F",
                            help="NVML device samples per second (0: off; at most 1000; default 10)")
        parser.add_argument("--nvml-process-hz", type=arg_type(rate), metavar="F",
                            help="NVML per-process samples per second (0: off; at most 1000; default 1)")
        parser.add_argument("--tensors", action="store_true",
                            help="also record PyTorch's tensor blocks (its libc10_cuda.so's USDT probes; "
                                 "about 1 us per tensor allocation or free)")
        parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        command = resolve_command(args.command)
        if check_output(args.output, args.force):
            print(f"memrec record: replacing {args.output}", file=sys.stderr)
        require_root()
        return record_tree(
            command,
            args.output,
            tuple(args.libcuda),
            args.socket,
            args.nvml_hz,
            args.nvml_process_hz,
            tensors=args.tensors,
        )

