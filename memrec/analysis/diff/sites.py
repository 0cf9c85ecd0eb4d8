"""``memrec diff`` by allocation site: which lines of the user's code take more (or less) in B.

Both runs' sites by phase (:mod:`memrec.analysis.report.sites`) are matched by phase path, level and
site. A site is matched by its file's path inside its package (what follows ``site-packages/``
or ``dist-packages/``, else the whole path: two hosts install SGLang in different folders), its
line and its function; an unavailable stack by its reason. The rows are the sites whose peak
(the most they held at once in the phase: what a run that died still shows) changed, the
largest change first.
"""

from __future__ import annotations

from dataclasses import asdict
from dataclasses import dataclass

from memrec.base.untrusted import clean_text
from memrec.analysis.report.sites import Site
from memrec.analysis.report.sites import SitesSection
from memrec.analysis.text import fit_lines
from memrec.analysis.text import human
from memrec.analysis.text import signed_human
from memrec.analysis.text import table

#: How many changed sites the diff keeps (the largest changes).
SITES_CHANGED = 30


def site_key(site: Site) -> tuple:
    """What makes two runs' sites the same (see the module docstring)."""
    path = site.file
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            break
    return (path, site.line, site.function, site.native, site.unavailable)


@dataclass(frozen=True)
class SiteChange:
    """One site in one phase at one level, in both runs (0 where a run has no such site)."""

    phase: str
    level: str
    site: Site  # as B names it (else A)
    peak_a: int
    peak_b: int
    allocated_a: int
    allocated_b: int

    @property
    def delta(self) -> int:
        return self.peak_b - self.peak_a


@dataclass(frozen=True)
class SitesDiff:
    """The sites whose peak changed from A to B, largest change first."""

    changes: tuple[SiteChange, ...]
    only_a: bool  # only A has stacks
    only_b: bool

    def to_json(self) -> dict:
        return {"changes": [{**asdict(c), "delta": c.delta} for c in self.changes], "only_a": self.only_a,
                "only_b": self.only_b}

    @classmethod
    def from_json(cls, data: dict) -> SitesDiff:
        changes = tuple(SiteChange(c["phase"], c["level"], Site(**c["site"]), c["peak_a"], c["peak_b"],
                                   c["allocated_a"], c["allocated_b"]) for c in data["changes"])
        return cls(changes, data["only_a"], data["only_b"])


def _rows(section: SitesSection | None) -> dict[tuple, tuple[Site, int, int]]:
    out: dict[tuple, tuple[Site, int, int]] = {}
    for phase in section.phases if section is not None else ():
        for r in phase.rows:
            key = (phase.phase, r.level, site_key(r.site))
            site, peak, allocated = out.get(key, (r.site, 0, 0))
            out[key] = (site, peak + r.peak, allocated + r.allocated)
    return out


def diff_sites(a: SitesSection | None, b: SitesSection | None) -> SitesDiff | None:
    """The sites whose peak or allocated bytes changed between the runs; None when neither has stacks."""
    if a is None and b is None:
        return None
    ra, rb = _rows(a), _rows(b)
    changes = []
    for key in list(ra) + [k for k in rb if k not in ra]:
        site_a, peak_a, alloc_a = ra.get(key, (None, 0, 0))
        site_b, peak_b, alloc_b = rb.get(key, (None, 0, 0))
        if peak_a == peak_b and alloc_a == alloc_b:
            continue
        changes.append(SiteChange(key[0], key[1], site_b or site_a, peak_a, peak_b, alloc_a, alloc_b))  # type: ignore[arg-type]
    changes.sort(key=lambda c: (-abs(c.delta), -abs(c.allocated_b - c.allocated_a), c.phase, c.site.label))
    return SitesDiff(tuple(changes[:SITES_CHANGED]), b is None, a is None)


def verdict_line(diff: SitesDiff, b_name: str, least: int) -> str | None:
    """The verdict's line on sites (``memrec diff``'s first lines, ``tui --diff``, ``plot --diff``):
    the site whose peak changed most, when both runs have stacks and it changed by ``least`` bytes
    or more."""
    if diff.only_a or diff.only_b or not diff.changes or abs(diff.changes[0].delta) < least:
        return None
    c = diff.changes[0]
    level = "" if c.level == "driver" else " (tensor blocks)"
    return (f"in {clean_text(c.phase, 60)}, {clean_text(c.site.label, 120)}{level} peaks {signed_human(c.delta)} "
            f"in {b_name} ({human(c.peak_a)} → {human(c.peak_b)}, all ranks)")


def render_sites_diff(diff: SitesDiff, width: int | None = None) -> list[str]:
    """The diff's sites section: per site and phase, its peak in A and B and the change."""
    if diff.only_a or diff.only_b:
        which = "A" if diff.only_a else "B"
        note = f" (only {which} has stacks: the other run's sites count as 0)"
    else:
        note = ""
    title = f"allocation sites that changed (the most held at once in the phase, B − A; innermost user frame){note}"
    out = fit_lines([title], width) if width is not None else [title]
    if not diff.changes:
        out.append("  no site took a different amount")
        return out
    rows = [[clean_text(c.phase, 60), human(c.peak_a), human(c.peak_b), signed_human(c.delta),
             clean_text(c.site.label + ("" if c.level == "driver" else " (tensor blocks)"), 160)] for c in diff.changes]
    out.extend(table(["PHASE", "A", "B", "Δ", "SITE"], rows, right={1, 2, 3}, indent="  ", width=width, wrap=True))
    return out
