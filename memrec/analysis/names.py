"""How every output names things: driver calls, event kinds, CUresults and processes.

One vocabulary for the report, the diff, ``memrec.load`` and the exports, so a name a user sees
in one is the name they search for in the other.
"""

from __future__ import annotations

import os

from memrec.events import Api
from memrec.events import Kind
from memrec.events import ProcessInfo
from memrec.events import cu_result_name as result_name  # the one CUresult vocabulary, re-exported


def api_name(api: int) -> str:
    """The driver entry point's name (``cuMemAlloc_v2``), or its number as text when unknown."""
    try:
        return Api(api).name
    except ValueError:
        return str(api)


def kind_name(kind: int) -> str:
    """The event kind's name (``ALLOC``), or its number as text when unknown."""
    try:
        return Kind(kind).name
    except ValueError:
        return str(kind)


def process_title(info: ProcessInfo | None, rank: str = "") -> str:
    """A short name a user recognises a process by: its rank, then its title or its command.

    A title set with setproctitle (``sglang::scheduler_TP0``; /proc then shows it padded with empty
    arguments) is shown as is; a multiprocessing
    child (``python -c 'from multiprocessing.spawn import spawn_main...'``) is "python3 (spawned)"
    rather than the start of that line; otherwise the program and its first four arguments.
    Never cut inside a word: no "..." in a name a user reads.
    """
    parts = [rank] if rank else []
    argv = [a for a in (info.cmdline if info is not None else []) if a.strip()]
    if argv:
        prog = os.path.basename(argv[0])
        if "::" in argv[0] or (len(argv) == 1 and "/" not in argv[0] and " " in argv[0].strip()):
            parts.append(argv[0].strip())  # a title, not a command line
        elif any("multiprocessing" in a and "spawn_main" in a for a in argv[1:]):
            parts.append(f"{prog} (spawned)")
        else:
            parts.append(" ".join([prog] + argv[1:5]))
    return " ".join(parts)
