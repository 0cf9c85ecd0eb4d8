"""The report's ``tensors`` section as text (built by :mod:`memrec.analysis.report.tensors`)."""

from __future__ import annotations

from memrec.analysis.report.sites import Site
from memrec.analysis.report.tensors import TensorSection
from memrec.analysis.text import human
from memrec.base.untrusted import clean_text
from memrec.analysis.text import table


def render_tensors(sec: TensorSection, width: int) -> list[str]:
    """Lines of the section: which installs gave blocks, allocated vs reserved, failed calls."""
    out = ["tensor blocks (PyTorch caching allocator)"]
    for lib in sec.libraries:
        if lib.problem:
            out.append(f"  !  {lib.path}: {lib.problem}")
        else:
            out.append(f"  probes: {lib.path} ({len(lib.attached)} sites)")
    if not sec.events:
        out.append("  no tensor events: driver segments only")
        return out
    note = f"  {sec.events:,} block events"
    if sec.unjoined_blocks or sec.unknown_frees:
        note += (f"; {sec.unjoined_blocks:,} blocks in segments allocated before the recording, "
                 f"{sec.unknown_frees:,} frees of blocks from before it")
    out.append(note)
    rows = []
    for r in sec.rows:
        last = r.last
        rows.append([str(r.gpu), str(r.pid), r.phase, human(r.peak_allocated), human(r.peak_reserved),
                     human(last.allocated), human(last.reserved), human(last.free), human(last.largest_free),
                     f"{last.blocks:,}"])
    out.extend(table(["GPU", "PID", "PHASE", "PEAK ALLOC", "PEAK RESV", "ALLOC", "RESV", "RESV-ALLOC",
                      "LARGEST FREE", "BLOCKS"], rows, right={0, 1, 3, 4, 5, 6, 7, 8, 9}, width=width,
                     drop=(5, 6, 3)))
    out.append("  (ALLOC, RESV ... BLOCKS: where the process left the phase, exited, or the trace ended)")
    for f in sec.failures:
        st = f.state
        out.append("")
        out.append(f"  failed segment allocation at {f.t_s:.3f}s, pid {f.pid} GPU {f.gpu}, "
                   f"{human(f.size)} asked: {human(st.allocated)} in {st.blocks:,} blocks of "
                   f"{human(st.reserved)} reserved, largest free {human(st.largest_free)}")
        rows = [[hex(b.ptr), human(b.size), f"{b.age_s:.3f}s", hex(b.segment) if b.segment is not None else "-",
                 b.phase] for b in f.largest]
        head = ["BLOCK", "SIZE", "AGE", "SEGMENT", "PHASE"]
        if any(b.site is not None for b in f.largest):  # a trace with stacks: the line that allocated each
            head.append("ALLOCATED AT")
            for row, b in zip(rows, f.largest):
                row.append(clean_text(b.site.label, 160) if b.site is not None else "-")
        out.extend(table(head, rows, right={1, 2}, indent="    ", width=width, drop=(3,), wrap=len(head) > 5))
    return out
