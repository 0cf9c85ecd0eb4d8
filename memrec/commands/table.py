"""The table of subcommands and the top-level options, as ``memrec --help`` lists them.

A leaf module (it imports a command's module only when asked for it): :mod:`memrec.commands`
(``main``, the quick ``--help``) and :mod:`memrec.commands.parser` (argparse's help) both read
it, neither through the other.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see memrec.TYPE_CHECKING)

if TYPE_CHECKING:
    from memrec.commands import Command

#: The subcommands, in ``memrec --help`` order, with the one-line summary that lists each there (the
#: first line of its class's docstring; tests/unit/test_lazy_imports.py checks that they agree).
#: The summaries are written here as well so that a run imports the module of the one command it
#: runs: importing all fifteen to list them made `memrec --help` and `memrec mark` take 6× a bare
#: interpreter (docs/performance.md).
COMMANDS: dict[str, str] = {
    "daemon": "Record GPU memory events of every CUDA process on this host, until SIGINT/SIGTERM.",
    "record": "Record a command and every process it starts, then exit with the command's exit code.",
    "report": "Summarise a trace per GPU: peaks, processes, categories, phases, exits and failed calls.",
    "diff": "Compare two traces: a verdict first, then the KV budget per rank and the phases side by side.",
    "merge": "Merge the traces of several hosts of one job (multi-node TP/PP) into one trace.",
    "dump": "Print every record of a trace as one JSON object per line (for debugging).",
    "export": "Write a trace for Perfetto, PyTorch's memory_viz, or pandas/polars/DuckDB.",
    "sql": "Query a dataset of many hosts' recordings with SQL (DuckDB, in-process).",
    "plot": "Draw a trace as a picture for a bug report: one panel per GPU.",
    "tui": "Browse GPU memory over time: one tab per GPU, a timeline stacked by category, who held what.",
    "mark": "Send a phase marker to the running daemon (from a shell script or by hand).",
    "doctor": "Check this host: privileges, BPF, tracefs, bcc, kernel headers, libcuda, NVML.",
    "demo": "Record the bundled stub-driver workload with real probes, then print its report.",
    "selftest": "Make a scripted set of real CUDA driver calls and check the daemon recorded each exactly.",
    "install-service": "Install the systemd service (unit, socket group, shell completions); --enable starts it.",
    "completion": "Print a shell completion script for bash, zsh or fish.",
}

#: What memrec is, under the usage line of ``memrec --help``.
DESCRIPTION = ("Record and explain GPU memory: every driver allocation, mapping and IPC open on the host, "
               "NVML beside it, phase markers from the application.")

#: The options before a command, as ``memrec --help`` lists them, with their help (-h's is argparse's).
OPTIONS: dict[str, str] = {
    "-h, --help": "show this help message and exit",
    "--version": "print the version, trace format and BPF program, then exit",
    "-v, --verbose": "more logging (-vv: debug)",
}


def load_command(name: str) -> Command:
    """The command ``name`` (``install-service`` → ``install_service.InstallServiceCommand``)."""
    module_name = f"memrec.commands.{name.replace('-', '_')}"
    __import__(module_name)  # importlib.import_module without importing importlib (the quick commands)
    return getattr(sys.modules[module_name], "".join(part.capitalize() for part in name.split("-")) + "Command")()
