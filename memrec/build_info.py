"""What this memrec is made of: its version, the trace format it writes and the BPF program it loads.

``memrec --version`` prints these and the daemon's metrics carry them (``memrec_info``), so an
operator can tell from a fleet's dashboards which hosts record with which program. The BPF
program's version is a digest of its source (``probes/cuda.bpf.c``): it changes exactly when the
program does, with no number to forget to bump.
"""

from __future__ import annotations

import hashlib
import importlib.resources

from memrec.base.version import __version__
from memrec.trace.format import FORMAT_MINOR
from memrec.trace.format import FORMAT_VERSION


def bpf_program_version() -> str:
    """``sha256:<first 12 hex digits>`` of the BPF C source, or ``"missing"`` without it."""
    try:
        source = importlib.resources.files("memrec.probes").joinpath("cuda.bpf.c").read_bytes()
    except (OSError, ModuleNotFoundError):
        return "missing"
    return "sha256:" + hashlib.sha256(source).hexdigest()[:12]


def version_fields() -> dict[str, str]:
    """{"version", "trace_format", "bpf_program"}: the label set of ``memrec_info``."""
    return {
        "version": __version__,
        "trace_format": f"{FORMAT_VERSION}.{FORMAT_MINOR}",
        "bpf_program": bpf_program_version(),
    }


def version_text() -> str:
    """What ``memrec --version`` prints."""
    f = version_fields()
    return f"memrec {f['version']} (trace format {f['trace_format']}, BPF program {f['bpf_program']})"
