"""systemd's notify protocol (``sd_notify``) without libsystemd: one datagram per message.

A service of ``Type=notify`` tells systemd it is ready (``READY=1``), that it is stopping
(``STOPPING=1``), what it is doing (``STATUS=...``) and that its loop still turns (``WATCHDOG=1``)
by sending ``KEY=VALUE`` lines to the ``AF_UNIX`` datagram socket named in ``$NOTIFY_SOCKET``
(a path, or ``@name`` for the abstract namespace). Without ``$NOTIFY_SOCKET`` (not started by
systemd) every call does nothing, so the daemon needs no flag to run either way.

The watchdog interval comes from ``$WATCHDOG_USEC`` (set when the unit has ``WatchdogSec=``),
for this process only when ``$WATCHDOG_PID`` is unset or names it; systemd's advice is to ping
at half the interval. The protocol is documented in ``sd_notify(3)`` and ``sd_watchdog_enabled(3)``.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def _address(name: str) -> str | bytes | None:
    """``$NOTIFY_SOCKET`` as a socket address (None: not one this module can use)."""
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    if name.startswith("/"):
        return name
    return None  # vsock addresses (vsock:CID:PORT) are for VMs, not for this daemon


class Notifier:
    """Sends notify messages to the service manager; every method is a no-op without one.

    Args:
        environ: where ``NOTIFY_SOCKET`` / ``WATCHDOG_USEC`` / ``WATCHDOG_PID`` are read
            (default ``os.environ``); the variables are read once, here.
    """

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_usec = _watchdog_usec(env)
        self._sock: socket.socket | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        """Whether a service manager listens."""
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between two ``WATCHDOG=1`` pings (half of ``WatchdogSec=``), or None."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=VALUE`` lines (``notify(READY=1, STATUS="...")``); return whether it went out.

        A failure is logged once and never raised: the manager going away must not stop recording.
        """
        if self.address is None:
            return False
        text = "\n".join(f"{key}={value}" for key, value in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(text.encode(), self.address)
        except OSError as error:
            if not self._failed:
                log.warning("cannot notify the service manager at %s: %s", os.fsdecode(self.address), error)
            self._failed = True
            return False
        return True

    def ready(self, status: str) -> bool:
        """The service is up (systemd's ``Type=notify`` start finishes here)."""
        return self.notify(READY=1, STATUS=status, MAINPID=os.getpid())

    def stopping(self, status: str) -> bool:
        """Shutdown began (systemd stops waiting for READY and shows the status)."""
        return self.notify(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        """The loop is alive."""
        return self.notify(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_usec(env: dict[str, str] | os._Environ) -> int | None:
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (the variable was inherited)
    return usec if usec > 0 else None
