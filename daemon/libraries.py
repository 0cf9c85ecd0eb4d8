"""Which driver files the probes are attached to: found, checked, capped, remembered.

Every rescan (``rescan_interval``) asks ``find`` for the libcuda files the host uses now (by
default :func:`memrec.probes.libs.find_libcuda`, which keeps only root's driver files) plus the
files named with ``--libcuda``, and attaches the probes to each (dev, inode) not seen before. At
most :data:`MAX_LIBRARIES` files are probed: each costs about 90 uprobes, their file descriptors,
and time at every stop (20 copies once took a daemon from 169 to 1,669 fds and its stop past
systemd's 90 s). A file that cannot be attached, or one beyond the cap, is said once and skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any
from typing import Callable

from memrec.base.errors import one_line

log = logging.getLogger(__name__)

#: The most distinct driver files (inodes) probed.
MAX_LIBRARIES = 16


@dataclasses.dataclass(frozen=True)
class _Library:
    path: str
    dev: int
    inode: int


def _default_find(extra: tuple[str, ...]) -> list:
    from memrec.probes.libs import find_libcuda

    return find_libcuda(list(extra))


def _explicit(paths: tuple[str, ...]) -> list[_Library]:
    """The libcuda files named on the command line (missing ones are logged by the daemon once)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        out.append(_Library(path, st.st_dev, st.st_ino))
    return out


def _report_dict(report: Any) -> dict:
    """An AttachReport (path, attached, missing) as the header records it."""
    attached = getattr(report, "attached", 0)
    missing = getattr(report, "missing", ())
    return {
        "path": os.fspath(getattr(report, "path", "?")),
        "attached": len(attached) if isinstance(attached, (list, tuple, set, frozenset)) else int(attached),
        "missing": sorted(str(m) for m in missing),
    }


def _search(owner: Any, what: str, option: str) -> list:
    """The files ``owner.find`` gives now, plus ``owner.explicit`` (named with ``option``); a
    search that fails is said once and leaves the explicit ones."""
    try:
        found = list(owner.find(owner.explicit))
    except Exception as error:
        if not owner._search_failed:
            log.warning("%s search failed: %s; probing only %s paths", what, one_line(error), option)
        owner._search_failed = True
        found = []
    return found + _explicit(owner.explicit)


class Libraries:
    """The driver files probed so far.

    Args:
        find: ``(extra_paths) -> [LibraryFile(path, dev, inode)]`` (None: the host's search).
        explicit: paths named with ``--libcuda`` (always tried, whatever the search says).
    """

    def __init__(self, find: Callable[[tuple[str, ...]], list] | None, explicit: tuple[str, ...]) -> None:
        self.find = find or _default_find
        self.explicit = explicit
        #: (dev, inode) -> what the header records of it
        self.attached: dict[tuple[int, int], dict] = {}
        self._skip: set[tuple[int, int]] = set()  # failed, over the cap, or known under another identity
        self._search_failed = False

    def header(self) -> dict:
        """The header's ``probes`` entries about libraries."""
        reports = list(self.attached.values())
        return {
            "libraries": reports,
            "attached": sum(r["attached"] for r in reports),
            "missing": sorted({m for r in reports for m in r["missing"]}),
        }

    def scan(self, probes: Any) -> int:
        """Attach ``probes`` to every file not attached yet; return how many were new."""
        found = _search(self, "libcuda", "--libcuda")
        new = 0
        for lib in found:
            key = (int(lib.dev), int(lib.inode))
            if key in self.attached or key in self._skip:
                continue
            if len(self.attached) >= MAX_LIBRARIES:
                self._skip.add(key)
                log.warning("not probing %s: %d driver files are probed already (the most memrec probes)",
                            lib.path, MAX_LIBRARIES)
                continue
            try:
                report = probes.attach_library(lib.path, identity=key)
            except Exception as error:
                self._skip.add(key)
                log.warning("cannot attach to %s: %s", lib.path, one_line(error))
                continue
            rec = _report_dict(report)
            if getattr(report, "already_attached", False):  # another path to an attached inode
                self._skip.add(key)
                continue
            self.attached[key] = rec
            new += 1
            if rec["missing"]:
                log.info(
                    "attached %d probe(s) to %s; %d symbol(s) missing: %s",
                    rec["attached"], rec["path"], len(rec["missing"]), ", ".join(rec["missing"]),
                )
            else:
                log.debug("attached %d probe(s) to %s", rec["attached"], rec["path"])
        return new


def _default_find_torch(extra: tuple[str, ...]) -> list:
    from memrec.probes.libs import find_libc10_cuda

    return find_libc10_cuda(list(extra))


class TorchLibraries:
    """The ``libc10_cuda.so`` files (PyTorch installs) tried so far, with ``--tensors``.

    Every rescan asks ``find`` for the files processes map now (a process that imports torch
    later is found then; the kernel raises the probes' semaphores in processes already running)
    and attaches the tensor-block probes to each new (dev, inode). A file without usable probes
    is recorded with its problem (the header's and trailer's ``torch`` list, ``memrec doctor``):
    its processes have driver segments only. At most :data:`MAX_LIBRARIES` files are tried.

    Args:
        find: ``(extra_paths) -> [LibraryFile(path, dev, inode)]`` (None: the host's search).
        explicit: paths named with ``--torch-lib``.
        pids: only these processes get the probes (``--tensors-pid``); empty: every process.
    """

    def __init__(self, find: Callable[[tuple[str, ...]], list] | None, explicit: tuple[str, ...],
                 pids: tuple[int, ...] = ()) -> None:
        self.find = find or _default_find_torch
        self.explicit = explicit
        self.pids = pids
        #: (dev, inode) -> {"path", "attached" (probe sites), "problem"}
        self.tried: dict[tuple[int, int], dict] = {}
        self._search_failed = False

    def header(self) -> list[dict]:
        """The ``torch`` list of the header and trailer: one entry per file tried."""
        return list(self.tried.values())

    def scan(self, probes: Any) -> int:
        """Attach the tensor probes to every file not tried yet; return how many now give blocks."""
        found = _search(self, "libc10_cuda", "--torch-lib")
        new = 0
        for lib in found:
            key = (int(lib.dev), int(lib.inode))
            if key in self.tried:
                continue
            if len(self.tried) >= MAX_LIBRARIES:
                log.warning("not probing %s: %d libc10_cuda files were tried already", lib.path, MAX_LIBRARIES)
                self.tried[key] = {"path": lib.path, "attached": [], "problem": "over the cap of probed files"}
                continue
            try:
                report = probes.attach_torch(lib.path, identity=key, pids=self.pids)
            except Exception as error:
                self.tried[key] = {"path": lib.path, "attached": [], "problem": one_line(error)}
                log.warning("cannot attach to %s: %s", lib.path, one_line(error))
                continue
            if report.already_attached:
                continue
            self.tried[key] = {"path": os.fspath(report.path), "attached": list(report.attached),
                               "problem": report.problem}
            if self.pids:
                self.tried[key]["pids"] = list(report.pids)
            new += bool(report.attached)
        return new
