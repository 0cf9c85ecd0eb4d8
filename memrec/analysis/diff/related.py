"""Are two traces runs of one workload? What ``memrec diff`` checks before it gives a verdict.

A diff matches processes by rank and phases by name, so it can always be computed; it means
something only when the two runs are the same workload with something changed (a flag, a
version, a setting). Given a training script's trace and an SGLang server's, it would say "B
fails where A works because load_weights took 50 GiB that does not run in A": confident and
meaningless. So the diff first compares what identifies a workload:

- the **command**: of each run's root processes (no parent in the trace), the program and what
  it runs (``python -m sglang.launch_server``, ``python train.py``, a module's subcommand:
  ``python -m pkg.tool ipc``), not its flags, which are what one changes between two runs worth
  comparing;
- the **model**: ``--model-path``/``--model`` in those commands (the last part of a path);
- the **phases**: the names of the phase markers.

Two runs are unrelated when, for any of these that both runs have, they have nothing in common.
The GPUs (the header's model names) are compared too, but only said: the same workload on an
H100 and an H200 is a comparison worth making.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from memrec.engine.phases import Phases

#: Command-line options that name the model a server or a script loads.
MODEL_OPTIONS = ("--model-path", "--model", "--model-name", "--model_name_or_path")


@dataclass(frozen=True)
class Identity:
    """What identifies one run's workload (see the module docstring)."""

    commands: frozenset[str]
    models: frozenset[str]
    phases: frozenset[str]
    gpus: frozenset[str]


@dataclass(frozen=True)
class Relation:
    """Whether two runs are one workload: ``related``, and why not (``reasons``), plus ``notes``
    that do not make them unrelated (different GPUs)."""

    related: bool
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"related": self.related, "reasons": list(self.reasons), "notes": list(self.notes)}


def command_identity(argv: list[str]) -> str | None:
    """``python -m sglang.launch_server`` / ``python train.py`` / ``torchrun``: a command's program
    (interpreter versions folded: python3.12 is python) and what it runs; None for a process
    that is a title or a multiprocessing child rather than a command."""
    argv = [a for a in argv if a.strip()]
    if not argv or "::" in argv[0]:
        return None
    prog = re.sub(r"[\d.]+$", "", os.path.basename(argv[0])) or os.path.basename(argv[0])
    if not prog.startswith("python"):
        return prog
    rest = argv[1:]
    for k, arg in enumerate(rest):
        if arg == "-m" and k + 1 < len(rest):
            after = rest[k + 2] if k + 2 < len(rest) else ""
            sub = f" {after}" if after and not after.startswith("-") and "/" not in after else ""
            return f"python -m {rest[k + 1]}{sub}"  # a module's subcommand is part of what it runs
        if arg == "-c":
            return None  # multiprocessing's spawn_main and other inline code: not a workload's name
        if not arg.startswith("-"):
            return f"python {os.path.basename(arg)}"
    return "python"


def _models(argv: list[str]) -> set[str]:
    out = set()
    for k, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in MODEL_OPTIONS:
            value = value if eq else (argv[k + 1] if k + 1 < len(argv) else "")
            if value:
                out.add(os.path.basename(value.rstrip("/")))
    return out


def identity(trace: Any, phases: Phases) -> Identity:
    """The workload identity of one trace (its processes, phases and header)."""
    procs = trace.processes
    roots = [p for p in procs.values() if p.ppid not in procs]
    commands = {c for p in roots if (c := command_identity(p.cmdline)) is not None}
    models = set().union(*(_models(p.cmdline) for p in procs.values())) if procs else set()
    names = set(phases.table.name)
    gpus = {str(g.get("name")) for g in trace.header.get("gpus") or [] if isinstance(g, dict) and g.get("name")}
    return Identity(frozenset(commands), frozenset(models), frozenset(names), frozenset(gpus))


def _few(items: frozenset[str]) -> str:
    shown = sorted(items)
    return ", ".join(shown[:3]) + (f" (+{len(shown) - 3})" if len(shown) > 3 else "")


def relate(a: Identity, b: Identity, an: str, bn: str) -> Relation:
    """Compare two identities: unrelated when commands, models or phase names are disjoint."""
    reasons = []
    for what, x, y in (("commands", a.commands, b.commands), ("models", a.models, b.models)):
        if x and y and not x & y:
            reasons.append(f"different {what} ({an}: {_few(x)}; {bn}: {_few(y)})")
    if a.phases and b.phases and not a.phases & b.phases:
        reasons.append(f"no phase in common ({an}: {_few(a.phases)}; {bn}: {_few(b.phases)})")
    notes = []
    if a.gpus and b.gpus and a.gpus != b.gpus:
        notes.append(f"the runs used different GPUs ({an}: {_few(a.gpus)}; {bn}: {_few(b.gpus)})")
    return Relation(not reasons, reasons, notes)
