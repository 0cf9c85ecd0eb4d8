"""Run a service the way its systemd unit says, on a host where systemd is not PID 1.

These tests run where systemd cannot be the service manager (a container whose PID 1 is not
systemd), so this stands in for the parts of systemd a ``Type=notify`` service meets, read from
the unit file itself and nothing else:

- ``ExecStart=`` (its argv, with the memrec path replaced by this interpreter's ``-m memrec``
  and the test's paths appended: the daemon's last option wins), ``Environment=``;
- the notify socket: ``$NOTIFY_SOCKET`` names an ``AF_UNIX`` datagram socket bound here;
  ``$WATCHDOG_USEC`` comes from ``WatchdogSec=``;
- ``Restart=`` / ``RestartSec=``: systemd's table (systemd.service(5)) for the policies
  ``no``, ``always``, ``on-failure`` and ``on-abnormal``: a clean exit is code 0 or death by
  SIGHUP, SIGINT, SIGTERM or SIGPIPE; ``on-failure`` restarts after anything else, as does a
  watchdog timeout (which systemd answers with SIGABRT).

Do not reach for ``systemd --user`` instead: it starts here (in a private mount namespace with
``/run/systemd/system`` faked), but at start it moves every process of the cgroup it finds itself
in, which on these hosts is the root of every hierarchy (the host's PID 1 and all sessions), into
a new ``init.scope`` with a task limit. Tried once (2026-12-01) and undone by hand.

It does not emulate sandboxing (``Protect*``, ``CapabilityBoundingSet`` ...): ``systemd-analyze
verify`` checks those directives, and the daemon's own capability drop is checked in the test.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CLEAN_SIGNALS = {signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE}


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section → key → values (in order), with ``\\`` line continuations joined."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        out.setdefault(section, {}).setdefault(key.strip(), []).append(value.strip())
    return out


def seconds(value: str) -> float:
    """systemd time spans as these units write them: ``30``, ``30s``, ``500ms``, ``2min``."""
    for suffix, scale in (("ms", 1e-3), ("min", 60.0), ("s", 1.0)):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * scale
    return float(value)


def should_restart(policy: str, returncode: int, watchdog_fired: bool = False) -> bool:
    """systemd.service(5)'s restart table for the policies above."""
    clean = returncode == 0 or (returncode < 0 and signal.Signals(-returncode) in CLEAN_SIGNALS)
    if policy == "always":
        return True
    if policy == "on-failure":
        return not clean or watchdog_fired
    if policy == "on-abnormal":
        return watchdog_fired or (returncode < 0 and not clean)
    return False


class UnitRunner:
    """Starts the unit's ExecStart with a notify socket; restarts it as its Restart= says."""

    def __init__(self, unit: Path, workdir: Path, extra_args: list[str]) -> None:
        self.unit = parse_unit(unit)
        service = self.unit["Service"]
        assert service["Type"] == ["notify"], "the tests expect a Type=notify unit"
        self.argv = shlex.split(service["ExecStart"][-1])
        self.extra_args = extra_args
        self.restart = service.get("Restart", ["no"])[-1]
        self.restart_sec = seconds(service.get("RestartSec", ["0.1"])[-1])
        self.stop_timeout = seconds(service.get("TimeoutStopSec", ["90"])[-1])  # systemd's default: 90 s
        watchdog = service.get("WatchdogSec")
        self.watchdog_usec = int(seconds(watchdog[-1]) * 1e6) if watchdog else None
        self.environment: dict[str, str] = {}
        for line in service.get("Environment", []):
            for assignment in shlex.split(line):
                key, _, value = assignment.partition("=")
                self.environment[key] = value
        self.workdir = workdir
        self.notify_path = workdir / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(os.fspath(self.notify_path))
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log_path = workdir / "service.log"

    def command(self) -> list[str]:
        assert Path(self.argv[0]).name == "memrec", self.argv
        return [sys.executable, "-m", "memrec", *self.argv[1:], *self.extra_args]

    def start(self) -> subprocess.Popen:
        env = dict(os.environ, **self.environment, NOTIFY_SOCKET=os.fspath(self.notify_path))
        if self.watchdog_usec:
            env["WATCHDOG_USEC"] = str(self.watchdog_usec)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/")
        self.starts += 1
        return self.proc

    def receive(self, timeout: float) -> dict[str, str] | None:
        """The next notify message (KEY=VALUE lines) within ``timeout`` s, else None."""
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        message = dict(line.partition("=")[::2] for line in data.decode().splitlines() if "=" in line)
        self.messages.append((time.monotonic(), message))
        return message

    def wait_for(self, key: str, timeout: float) -> dict[str, str]:
        """Wait for a message with ``key`` (READY, STOPPING, WATCHDOG); fail if the service dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.receive(min(0.5, deadline - time.monotonic()))
            if message and key in message:
                return message
            if self.proc is not None and self.proc.poll() is not None and message is None:
                raise AssertionError(f"the service exited {self.proc.returncode} before {key}:\n{self.log()}")
        raise AssertionError(f"no {key}=1 within {timeout} s:\n{self.log()}")

    def supervise(self, timeout: float) -> bool:
        """Once the main process has exited: restart it if Restart= says so; return whether it did."""
        assert self.proc is not None
        returncode = self.proc.wait(timeout)
        if not should_restart(self.restart, returncode):
            return False
        time.sleep(self.restart_sec)
        self.start()
        return True

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()
