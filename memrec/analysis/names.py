"""How every output names things: driver calls, event kinds, CUresults and processes.

One vocabulary for the report, the diff, ``memrec.load`` and the exports, so a name a user sees
in one is the name they search for in the other.
"""

from __future__ import annotations

import os

from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.terms.events import ProcessInfo
from memrec.terms.events import cu_result_name as result_name  # the one CUresult vocabulary, re-exported

#: Longest command a process title shows; beyond it, whole arguments are left out and "…" says so.
TITLE_WIDTH = 120


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
    rather than the start of that line; otherwise the program and its arguments
    (:func:`command_text`): the flags that tell two runs apart (``--tp 8``, ``--ipc``) come late
    in a command line, so none is dropped to make a name short unless it is very long, and then
    with "…".
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
            parts.append(command_text([prog] + argv[1:]))
    return " ".join(parts)


def command_text(argv: list[str], width: int = TITLE_WIDTH) -> str:
    """A command line in at most ``width`` characters: an argument that is a path is shown by its
    last part (``…/Llama-3.1-70B``); arguments that do not fit are left out, whole, from the end,
    and `` …`` marks that some are."""
    words = [f"…/{os.path.basename(a.rstrip('/'))}" if "/" in a.rstrip("/") and " " not in a else a for a in argv]
    text = words[0]
    for k, word in enumerate(words[1:], 1):
        more = len(words) > k + 1
        if len(text) + 1 + len(word) + (2 if more else 0) > width:
            return text + " …"
        text += " " + word
    return text
