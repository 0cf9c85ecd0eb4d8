"""What ``memrec daemon`` adds when it runs as a service: systemd's notify protocol and watchdog,
Prometheus metrics, a bounded trace directory and giving up capabilities after attaching.

The daemon's loop knows nothing of these; they hang on its small hooks (``every``, the marker and
sample listeners). Order matters and is kept here in one place::

    service.listen()            # bind the metrics port: a taken port fails before the BPF compile
    daemon.start()              # probes loaded and attached, trace open
    service.started(daemon)     # drop capabilities, serve metrics, READY=1, watchdog, retention, dataset
    daemon.run()
    service.stopping(daemon)    # STOPPING=1
    daemon.stop(); service.close()  # close: the last file's export into the dataset
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from memrec.base.errors import PrivilegeError
from memrec.daemon.notify import Notifier

log = logging.getLogger(__name__)

#: Seconds between two looks at the trace directory for files beyond ``--keep``.
PRUNE_INTERVAL = 10.0
#: Seconds after the drop to look for threads that kept their capabilities (the NVML sampler
#: drops its own at its first sample, at most 1 s later).
CHECK_THREADS_AFTER = 3.0

_ADDR = re.compile(r"^(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d{1,5})$")


def metrics_addr(text: str) -> tuple[str, int]:
    """``"127.0.0.1:9862"``, ``"[::1]:9862"`` or ``":9862"`` (every address) → (host, port).

    Raises:
        ValueError: not HOST:PORT with a port in 1..65535.
    """
    match = _ADDR.match(text.strip())
    port = int(match.group("port")) if match else 0
    if not match or not 0 < port < 65536:
        raise ValueError(f"not HOST:PORT: {text!r} (examples: 127.0.0.1:9862, :9862, [::1]:9862)")
    return match.group("v6") or match.group("host") or "", port


def file_count(text: str) -> int:
    """A number of files: an integer >= 0 (0: no limit).

    Raises:
        ValueError: not an integer >= 0.
    """
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"not an integer: {text!r}") from None
    if value < 0:
        raise ValueError(f"must be >= 0, got {text!r}")
    return value


class Service:
    """The service add-ons of one daemon run (each optional; see the module docstring)."""

    def __init__(
        self,
        metrics_addr: tuple[str, int] | None = None,
        keep_files: int = 0,
        drop_capabilities: bool = False,
        notifier: Notifier | None = None,
        dataset: Path | None = None,
    ) -> None:
        self.notifier = notifier or Notifier()
        self.dataset_dir = dataset
        self.dataset: Any = None
        self.keep_files = keep_files
        self.drop_capabilities = drop_capabilities
        self.metrics: Any = None
        if metrics_addr is not None:
            from memrec.daemon.metrics import DaemonMetrics

            self.metrics = DaemonMetrics(metrics_addr)

    def listen(self) -> None:
        if self.metrics is not None:
            self.metrics.listen()

    def started(self, daemon: Any) -> None:
        """After ``daemon.start()``: everything the running service needs, then READY=1."""
        if self.drop_capabilities:
            self._drop_capabilities(daemon)
        if self.metrics is not None:
            self.metrics.attach(daemon)
            self.metrics.serve()
        if self.dataset_dir is not None:
            from memrec.daemon.dataset import DatasetShipper

            self.dataset = DatasetShipper(self.dataset_dir)
            daemon.closed_listeners.append(self.dataset.submit)
        if self.keep_files and daemon.config.output_is_dir:
            self._prune(daemon)
            daemon.every(PRUNE_INTERVAL, lambda _now: self._prune(daemon))
        if self.notifier.watchdog_interval:
            daemon.every(self.notifier.watchdog_interval, lambda _now: self.notifier.watchdog())
        stats = daemon.stats()
        self.notifier.ready(
            f"recording to {stats['files'][-1]}; {len(daemon.gpus)} GPU(s), {stats['libraries']} libcuda file(s) probed"
        )

    def _drop_capabilities(self, daemon: Any) -> None:
        from memrec.daemon.caps import CapabilityError
        from memrec.daemon.caps import drop_capabilities
        from memrec.daemon.caps import threads_keeping_more

        try:
            drop_capabilities()
        except CapabilityError as error:
            raise PrivilegeError(f"--drop-capabilities: {error.strerror}") from None
        # Capabilities are per thread: the NVML sampler, started with the daemon, drops its own at
        # its next sample (its listener runs on its thread).
        if daemon.sampler is not None:
            done: list[bool] = []

            def drop_on_sampler_thread(_rows: Any) -> None:
                if not done:
                    done.append(True)
                    drop_capabilities()

            daemon.sample_listeners.insert(0, drop_on_sampler_thread)
        log.info("capabilities reduced to what recording needs")
        checked: list[bool] = []

        def check_threads(_now: int) -> None:
            """Once, when the sampler has surely sampled: say which threads kept more."""
            if not checked:
                checked.append(True)
                others = threads_keeping_more()
                if others:
                    log.warning("thread(s) %s, started by a library before the drop, keep every capability "
                                "(OPENBLAS_NUM_THREADS=1 stops numpy's)", ", ".join(others))

        daemon.every(CHECK_THREADS_AFTER, check_threads)

    def _prune(self, daemon: Any) -> None:
        from memrec.daemon.retention import prune

        prune(daemon.config.output, self.keep_files, current=daemon.files[-1] if daemon.files else None)

    def stopping(self, daemon: Any, reason: str | None) -> None:
        self.notifier.stopping(f"shutting down ({reason or daemon.stop_reason or 'stop'})")

    def close(self) -> None:
        if self.dataset is not None:
            self.dataset.close()
        if self.metrics is not None:
            self.metrics.close()
        self.notifier.close()
