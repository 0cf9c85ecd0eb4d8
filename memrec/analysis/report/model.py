"""The report's typed sections: what :func:`memrec.analysis.report.build.build_report` builds and every
view reads (the text, the answer, the dataset export, the TUI through the answer).

:meth:`Report.to_json` (:class:`memrec.analysis.sections.Section`) is ``memrec report --json``.
Keys the report only has sometimes are :data:`~memrec.analysis.sections.OMITTED` until set
(``traced_at_last`` without a series, ``by_phase`` on all but the highest peak); a failed call's
snapshot of the holders is flattened into the call's JSON.

The reconciliation (:class:`memrec.analysis.untraced.reconcile.GpuReconciliation`) and the tensors
(:class:`memrec.analysis.report.tensors.TensorSection`) are typed where they are built. The parts
that stay plain dicts are the merge summary (the trace header's ``merged`` map) and marker values.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import TYPE_CHECKING

from memrec.analysis.report.answer import Answer
from memrec.analysis.sections import OMITTED
from memrec.analysis.sections import Section
from memrec.analysis.sections import flatten
from memrec.analysis.report.tensors import TensorSection
from memrec.analysis.sglang.model import SglangSection
from memrec.analysis.report.sites import SitesSection
from memrec.analysis.untraced.reconcile import GpuReconciliation

if TYPE_CHECKING:  # they make this module's rows
    from memrec.analysis.report.phase_rows import GpuPhaseList
    from memrec.analysis.report.phase_rows import PhaseList


# ------------------------------------------------------------------------------------ the trace


@dataclass
class ReportFilter(Section):
    gpu: int | None
    pid: int | None


@dataclass
class TraceSummary(Section):
    """The trace as a whole; ``failed_calls`` counts the filter's selection, ``_all`` all of them."""

    host: str | None
    start_ts: int
    end_ts: int
    duration_s: float
    events: int
    failed_calls: int
    failed_calls_all: int
    processes: int
    lost: int
    complete: bool
    warnings: list[str]
    phase_warnings: list[str]
    anomalies: dict[str, int]
    markers: int
    nvml_samples: int


@dataclass
class ProcessEntry(Section):
    pid: int
    ppid: int | None
    short: str
    cmdline: list[str]
    rank: str
    cuda_visible_devices: str | None
    gpus: list[int]
    exit_ts: int | None


@dataclass
class PhaseEntry(Section):
    id: int
    pid: int
    name: str
    path: str
    depth: int
    start_ts: int
    end_ts: int
    start_s: float
    end_s: float
    closed: bool
    gpu: int | None
    values: dict


@dataclass
class InstantEntry(Section):
    pid: int
    name: str
    ts: int
    t_s: float
    phase: str
    gpu: int | None
    values: dict


@dataclass
class HeldPhase(Section):
    """Bytes a GPU held at one instant that a phase allocated (``pids``: whose they are)."""

    phase: str
    bytes: int
    pids: list[int]


@dataclass
class HoldingRow(Section):
    """One live piece of memory (:class:`memrec.state.fields.Holding`) with its API by name."""

    pid: int
    gpu: int
    category: str
    size: int
    address: int  # the VMM handle for category "vmm"
    ts: int
    api: str
    peer: int  # ipc_mapped: the exporter's pid (0 unknown)


@dataclass
class Holder(Section):
    """One process's memory on a GPU at an instant: owned, mapped from peers, by category, and its
    largest pieces (owned first)."""

    pid: int
    owned: int
    mapped: int
    by_category: dict[str, int]
    largest: list[HoldingRow]


@dataclass
class HeldThen(Section):
    """Who held what on a failed call's GPU at that instant (flattened into the call's JSON)."""

    owned_on_gpu: int
    mapped_on_gpu: int
    holders: list[Holder]
    largest: list[HoldingRow]
    by_phase: list[HeldPhase]


@dataclass
class FailedCall(Section):
    index: int
    ts: int
    t_s: float
    pid: int
    tid: int
    process: str
    kind: str
    api: str
    size: int
    result: int
    result_name: str
    gpu: int
    gpu_inferred: bool
    phase: str = ""
    nvml_free: int | None = None
    held: HeldThen | None = flatten()  # None for calls on an unknown GPU


# ---------------------------------------------------------------------------------- one GPU


@dataclass
class PidBytes(Section):
    pid: int
    bytes: int


@dataclass
class Peak(Section):
    bytes: int
    ts: int
    t_s: float
    by_category: dict[str, int]
    by_pid: list[PidBytes]
    #: By phase, for the GPU with the highest peak only (the answer's second line).
    by_phase: list[HeldPhase] = OMITTED


@dataclass
class Final(Section):
    bytes: int
    by_category: dict[str, int]
    by_pid: list[PidBytes]


@dataclass
class CategoryRow(Section):
    category: str
    owned: bool
    peak: int
    peak_ts: int
    peak_t_s: float
    final: int


@dataclass
class GpuProcess(Section):
    """One process on one GPU: its owned peak and final, mapped peers' memory, what it held at exit."""

    pid: int
    process: str
    rank: str
    peak: int
    peak_ts: int
    peak_t_s: float
    final: int
    mapped_peak: int
    mapped_final: int
    by_category: dict[str, int]
    exit_ts: int | None
    held_at_exit: int
    nvml_used: int | None

    def matters(self) -> bool:
        """Anything in it: held, mapped, held at exit or seen by NVML."""
        return bool(self.peak or self.final or self.mapped_peak or self.held_at_exit or self.nvml_used)


@dataclass
class GpuPhase(Section):
    """Per (pid, phase) on one GPU: bytes by category, allocated, freed, net; ``exit_freed`` and
    ``exit_by_category`` are the part of ``freed`` a process exit made implicitly."""

    pid: int
    phase: int
    path: str
    start_ts: int | None
    end_ts: int | None
    start_s: float | None
    end_s: float | None
    closed: bool | None
    by_category: dict[str, int] = field(default_factory=dict)
    allocated: int = 0
    freed: int = 0
    net: int = 0
    mapped_net: int = 0
    exit_freed: int = 0
    exit_by_category: dict[str, int] = field(default_factory=dict)


@dataclass
class HeldAtExit(Section):
    pid: int
    ts: int
    t_s: float
    owned: int
    mapped: int
    count: int
    by_category: dict[str, int]
    largest: list[HoldingRow]


@dataclass
class NvmlSummary(Section):
    samples: int
    total: int | None
    last_ts: int
    last_t_s: float
    last_used: int | None
    last_reserved: int | None
    peak_used: int | None
    peak_used_ts: int | None
    peak_used_t_s: float | None
    peak_reserved: int | None
    #: Only where the GPU has a series and NVML a last used value.
    traced_at_last: int = OMITTED
    untraced_at_last: int = OMITTED


@dataclass
class GpuSection(Section):
    """One GPU (``gpu`` -1: pinned host memory and device memory of an unknown GPU)."""

    gpu: int
    name: str | None
    uuid: str | None
    total: int | None
    peak: Peak
    final: Final
    categories: list[CategoryRow]
    processes: list[GpuProcess]
    phases: GpuPhaseList  # made GpuPhase as read
    held_at_exit: list[HeldAtExit]
    failures: list[FailedCall]
    nvml: NvmlSummary | None
    #: :meth:`memrec.analysis.untraced.reconcile.Reconciliation.gpu_summary` with ``*_t_s`` added.
    reconciliation: GpuReconciliation | None


# ----------------------------------------------------------------------------------- the whole


@dataclass
class Report(Section):
    memrec_report: int
    filter: ReportFilter
    trace: TraceSummary
    merged: dict | None
    processes: list[ProcessEntry]
    gpus: list[GpuSection]
    host: GpuSection | None
    phases: PhaseList  # made PhaseEntry as read
    instants: list[InstantEntry]
    failures_unknown_gpu: list[FailedCall]
    sglang: SglangSection | None = None
    tensors: TensorSection | None = None
    #: Allocation sites by phase (a trace with stacks, format 2.3; absent from the JSON without).
    sites: SitesSection = OMITTED
    answer: Answer | None = None

    def sections(self) -> list[GpuSection]:
        """The GPUs' sections, then the host's when there is one."""
        return self.gpus + ([self.host] if self.host is not None else [])

    def failures(self) -> list[FailedCall]:
        """Every failed call of the filter's selection: per GPU, the host, then the unknown GPU's."""
        return [f for sec in self.sections() for f in sec.failures] + self.failures_unknown_gpu

    def process_map(self) -> dict[int, ProcessEntry]:
        return {p.pid: p for p in self.processes}
