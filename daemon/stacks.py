"""``--stacks``: which processes' interpreters the probe reads, and the stack each event names.

Why here: the probe records, per allocation, a raw stack (code objects and instruction pointers)
in its own ring and names it in the event; turning it into file, line and function needs the
process's memory, which only the daemon reads (:class:`memrec.probes.pystacks.Symboliser`). The
interpreters are located per process (its ``_PyRuntime`` is at an address of its own): every
process at start and at each rescan (one that started since), and a process the events name
for the first time at once, so that its next allocations already have stacks. An allocation
made before its process was located gets "stack unavailable (interpreter located after this
allocation)", never a guess.

Order: the probe commits a stack at the call's entry and the event naming it at the return, so
the events are polled first and the stacks after them: every stack an event names is then in
hand (or was lost: the ring was full). Each stack is read from its process the moment it is
polled, not when its event comes: a process that allocates and exits (an SGLang rank that fails,
a short worker) takes its memory with it, and its frames can only be read while it lives. Stacks
whose events have not come yet wait, read and bounded.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from memrec.base.errors import one_line
from memrec.terms.events import FLAG_STACK
from memrec.terms.events import Kind
from memrec.probes.procinfo import read_start_time
from memrec.probes.pystacks import Interpreter
from memrec.probes.pystacks import Symboliser
from memrec.probes.pystacks import locate
from memrec.trace.stacks import Stack
from memrec.trace.stacks import Unavailable

log = logging.getLogger(__name__)

#: Raw stacks kept while their events have not come (a thread killed inside the call never returns).
MAX_WAITING = 1 << 16
_LOST = Unavailable("stack lost: the probes' stacks ring was full")
_EXIT = int(Kind.PROC_EXIT)


class StackRecorder:
    """The interpreters located and the stacks resolved for one daemon.

    Args:
        probes: the loaded CudaProbes (``set_interpreter``, ``forget_interpreter``, ``poll_stacks``).
        depth: the most Python frames a stack keeps (``--stack-depth``).
        proc: the /proc to read.
    """

    def __init__(self, probes: Any, depth: int, proc: Path = Path("/proc")) -> None:
        self.probes = probes
        self.proc = proc
        self.symboliser = Symboliser(proc, depth)
        #: pid -> (start time, the interpreter or None when the process has none)
        self._known: dict[int, tuple[int | None, Interpreter | None]] = {}
        self._waiting: OrderedDict[int, Stack] = OrderedDict()
        self.resolved = 0
        self.unavailable = 0

    # -- interpreters ---------------------------------------------------------------------------
    def discover(self, pids: list[int] | None = None) -> int:
        """Locate the interpreter of each of ``pids`` (None: every process) not located yet;
        return how many new ones the probe can read."""
        if pids is None:
            pids = [int(name) for name in os.listdir(self.proc) if name.isdigit()]
        new = 0
        for pid in pids:
            start = read_start_time(pid, self.proc)
            known = self._known.get(pid)
            if known is not None and known[0] == start:
                continue
            try:
                interp = locate(pid, self.proc)
            except OSError:
                continue  # gone, or not readable: tried again at the next rescan
            self._known[pid] = (start, interp)
            if interp is None:
                continue
            if interp.problem:
                self.symboliser.set_problem(pid, interp.problem)
                log.info("pid %d runs %s: no Python stacks (%s)", pid, interp.label, interp.problem)
                continue
            self.probes.set_interpreter(interp)
            self.symboliser.set_interpreter(interp)
            new += 1
            log.debug("pid %d: %s at %s, _PyRuntime 0x%x", pid, interp.label, interp.path, interp.runtime)
        return new

    def interpreters(self) -> list[dict]:
        """The interpreters located so far (the trailer's and doctor's ``interpreters``)."""
        seen: dict[tuple[str, str], dict] = {}
        for _start, interp in self._known.values():
            if interp is not None:
                entry = seen.setdefault((interp.path, interp.label),
                                        {"path": interp.path, "version": interp.label, "problem": interp.problem,
                                         "processes": 0})
                entry["processes"] += 1
        return list(seen.values())

    # -- events ---------------------------------------------------------------------------------
    def resolve(self, events: np.ndarray, writer: Any) -> None:
        """Set the ``stack`` column of ``events`` (the ids ``writer`` gives their stacks) and clear
        the raw stack ids from their ipc column; forget the processes that exited."""
        new_pids = [int(p) for p in np.unique(events["pid"]) if int(p) not in self._known]
        if new_pids:
            self.discover(new_pids)
        for rec in self.probes.poll_stacks():
            self._waiting[int(rec["id"])] = self._read(rec)
            if len(self._waiting) > MAX_WAITING:
                self._waiting.popitem(last=False)
        marked = np.flatnonzero(events["flags"] & FLAG_STACK)
        if len(marked):
            ids = np.frombuffer(events["ipc"][marked].tobytes(), dtype="<u8").reshape(len(marked), -1)[:, 0]
            for row, sid in zip(marked.tolist(), ids.tolist()):
                events["stack"][row] = writer.intern_stack(self._stack(sid))
            events["flags"][marked] &= ~np.uint32(FLAG_STACK)
            events["ipc"][marked] = b"\0" * 64
        for pid in events["pid"][events["kind"] == _EXIT].tolist():
            self.forget(int(pid))

    def _read(self, rec: np.void) -> Stack:
        try:
            return self.symboliser.stack(rec)
        except Exception as error:  # a record memrec cannot make sense of must not cost the batch its events
            log.warning("stack of pid %d not read: %s", int(rec["pid"]), one_line(error))
            return Unavailable(f"memrec could not read it: {one_line(error)}")

    def _stack(self, sid: int) -> Stack:
        stack = self._waiting.pop(sid, None)
        if stack is None:
            self.unavailable += 1
            return _LOST
        if isinstance(stack, Unavailable):
            self.unavailable += 1
        else:
            self.resolved += 1
        return stack

    def forget(self, pid: int) -> None:
        """``pid`` exited: its probe entry and caches go (a new process with its pid is located anew)."""
        if self._known.pop(pid, (None, None))[1] is not None:
            self.probes.forget_interpreter(pid)
        self.symboliser.forget(pid)

    def close(self) -> None:
        self.symboliser.close()
