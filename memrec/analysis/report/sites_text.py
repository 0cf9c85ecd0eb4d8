"""The text of ``memrec report``'s allocation sites by phase (:mod:`memrec.analysis.report.sites`)."""

from __future__ import annotations

from memrec.base.untrusted import clean_text
from memrec.analysis.report.sites import SITES_SHOWN
from memrec.analysis.report.sites import SitesSection
from memrec.analysis.text import count
from memrec.analysis.text import human
from memrec.analysis.text import table

_HEADINGS = {"driver": "driver memory", "tensor": "tensor blocks"}


def site_line(row) -> str:
    """``custom_all_reduce.py:123 CustomAllreduce.__init__: 36.00 GiB on 2 ranks`` (its peak)."""
    return f"{clean_text(row.site.label, 120)}: {human(row.peak)} on {row.who}"


def render_sites(section: SitesSection, width: int | None = None, show_all: bool = False) -> list[str]:
    """Per phase, the sites whose allocations peaked highest (then held the most when the phase
    ended, then allocated the most): the first :data:`SITES_SHOWN` of each level, or with
    ``show_all`` (``report --all``) every one."""
    out = [f"allocation sites by phase  (innermost user frame of each allocation's stack; "
           f"{count(section.with_stack, 'allocation')} with a stack, {section.without_stack:,} without)"]
    for phase in section.phases:
        out.append(f"  {clean_text(phase.phase, 120)}")
        levels = [level for level in ("driver", "tensor") if any(r.level == level for r in phase.rows)]
        for level in levels:
            rows = [r for r in phase.rows if r.level == level]
            shown = rows if show_all else rows[:SITES_SHOWN]
            cells = [[human(r.peak), human(r.held), human(r.allocated), f"{r.allocations:,}", r.who,
                      clean_text(r.site.label, 160)] for r in shown]
            lines = table(["PEAK", "HELD", "ALLOCATED", "ALLOCS", "BY", f"SITE ({_HEADINGS[level]})"], cells,
                          right={0, 1, 2, 3}, indent="    ", width=width, drop=(3, 2, 1), wrap=True)
            out.extend(lines)
            # the sites the section left out (past SITES_JSON) sort after the last level's rows
            left = len(rows) - len(shown) + (phase.more if level == levels[-1] else 0)
            if left:
                out.append(f"    ... {count(left, 'more site')} (report --all lists them)")
    return out
