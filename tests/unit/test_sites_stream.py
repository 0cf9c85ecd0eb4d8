"""The allocation sites built in the report's pass, a chunk at a time (issue 26): a trace with stacks
is no longer kept whole, and the section is the one its definition gives, whatever the batches."""

from __future__ import annotations

import numpy as np
import pytest

from memrec.analysis.diff import build as diff_build
from memrec.analysis.report import build as report_build
from memrec.analysis.report import sites as sites_module
from memrec.analysis.report.build import build_report
from memrec.analysis.report.sites import LEVELS
from memrec.analysis.report.sites import Site
from memrec.analysis.report.sites import sites_section
from memrec.engine.replay import trace_bounds
from memrec.engine.replay import trace_phases
from memrec.engine import source as source_module
from memrec.engine.source import scan_trace
from memrec.engine.stream import replay_pass
from memrec.terms.columns import empty_events
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.trace import format as fmt
from memrec.trace.reader import load_trace
from memrec.trace.stacks import Frame
from memrec.trace.stacks import Unavailable
from memrec.trace.writer import TraceWriter

BURST = 8  # tensor blocks alive at once in write_bursts' trace


def write_bursts(path, bursts: int) -> int:
    """A trace with stacks: two driver segments, then ``bursts`` bursts of BURST tensor blocks
    allocated and freed (each block naming a stack), a failed call; returns its events."""
    n = 2 + 2 * BURST * bursts + 1
    ev = empty_events(n)
    ev["ts"] = 1_000 + np.arange(n) * 10
    ev["pid"] = ev["tid"] = 7
    ev["kind"][:2] = int(Kind.ALLOC)
    ev["ptr"][:2] = [0x1000_0000, 0x2000_0000]
    ev["size"][:2] = 1 << 30
    ev["gpu"] = 0
    j = np.arange(2 * BURST * bursts) % (2 * BURST)
    block = np.where(j < BURST, j, 2 * BURST - 1 - j)
    ev["kind"][2:-1] = np.where(j < BURST, int(Kind.TENSOR_ALLOC), int(Kind.TENSOR_FREE))
    ev["ptr"][2:-1] = 0x1000_0000 + block * 4096
    ev["size"][2:-1] = np.where(j < BURST, 4096, 0)
    ev["kind"][-1] = int(Kind.ALLOC)
    ev["result"][-1] = 2  # out of memory
    with TraceWriter(path, fmt.make_header(host="h"), max_chunk_rows=256) as w:
        ids = np.array([w.intern_stack([Frame(f"/app/layer{k}.py", 10 + k, "forward")]) for k in range(BURST + 1)])
        ev["stack"][:2] = ids[-1]
        ev["stack"][2:-1] = np.where(j < BURST, ids[block], 0)
        ev["stack"][-1] = ids[0]
        w.write_marker(Marker(1_000, 7, 0, 7, "serve", "begin", 0))
        w.write_events(ev)
    return n


@pytest.mark.parametrize("command", ["report", "diff"])
def test_a_stacked_trace_is_read_keeping_what_an_unstacked_one_keeps(tmp_path, monkeypatch, command):
    # GIVEN a trace of 16,000 tensor blocks, each naming a stack, at most BURST alive at once
    n = write_bursts(tmp_path / "t.mrec", 1000)
    kept, pending = [], []
    monkeypatch.setattr(sites_module, "BATCH", 100)  # a batch a record

    def capture(*args, **kwargs):
        kept.append(replay_pass(*args, **kwargs))
        return kept[-1]

    end = sites_module.SitesFeed._end

    def counted(self, final):
        end(self, final)
        pending.append(len(self._pending))

    monkeypatch.setattr(sites_module.SitesFeed, "_end", counted)
    # WHEN the report (or diff) reads it from the file
    if command == "report":
        monkeypatch.setattr(report_build, "replay_pass", capture)
        trace, events = scan_trace(tmp_path / "t.mrec")
        sites = build_report(trace, events=events).sites
    else:
        monkeypatch.setattr(diff_build, "replay_pass", capture)
        trace, events = scan_trace(tmp_path / "t.mrec")
        sites = diff_build.analyze(trace, "a", events=events).sites
    # THEN the rows kept are the driver's calls and the failed one, not the 16,000 blocks; the
    # sites feed held no more allocations than were alive (the segments and a burst's blocks)
    (rows,) = kept
    assert n > 16_000 and len(rows.rows) == 3
    assert len(pending) > 20 and max(pending) <= 2 + BURST
    # AND the section has every site, the failed call's among them
    assert sites is not None and sites.with_stack == 2 + BURST * 1000
    assert {r.site.line for p in sites.phases for r in p.rows} == set(range(10, 10 + BURST + 1))
    assert len(sites.failures) == 1 and sites.failures[0].site.line == 10


def random_trace(tmp_path, seed: int, ordered: bool):
    """Events of every pairing case (addresses reused, allocations twice at one address, frees of
    nothing, exits and a process's id reused, failed calls, three levels), phases closed and not,
    repeated instants; ``ordered``: in time order, else some neighbours swapped."""
    rng = np.random.default_rng(seed)
    n = 3000
    ev = empty_events(n)
    ts = 10_000 + np.cumsum(rng.integers(0, 3, n))
    if not ordered:
        swap = rng.integers(0, n - 1, 40)
        ts[swap], ts[swap + 1] = ts[swap + 1].copy(), ts[swap].copy()
    ev["ts"] = ts
    ev["pid"] = ev["tid"] = rng.integers(100, 104, n)
    kinds = np.array([Kind.ALLOC, Kind.FREE, Kind.TENSOR_ALLOC, Kind.TENSOR_FREE, Kind.VMM_CREATE,
                      Kind.VMM_RELEASE, Kind.PROC_EXIT])
    kind = kinds[rng.choice(len(kinds), n, p=[.2, .2, .25, .22, .07, .058, .002])]
    ev["kind"] = kind
    addr = rng.integers(0, 12, n)
    ev["ptr"] = 0x7F00_0000_0000 + addr * 4096
    ev["handle"] = addr + 1
    ev["size"] = np.where(np.isin(kind, [Kind.ALLOC, Kind.TENSOR_ALLOC, Kind.VMM_CREATE]), rng.integers(1, 64, n) * 512, 0)
    ev["gpu"] = rng.integers(-1, 2, n)
    ev["result"] = np.where(rng.random(n) < 0.03, 2, 0)
    path = tmp_path / f"r{seed}.mrec"
    with TraceWriter(path, fmt.make_header(host="h")) as w:
        frames = [Frame("/app/a.py", 10, "f"), Frame("/app/b.py", 20, "g"), Frame("/usr/lib/python3.12/x.py", 3, "h"),
                  Frame("libc.so", 0, "malloc", True), Frame("/app/a.py", 11, "f2")]
        ids = [w.intern_stack([frames[i % 5], frames[(3 * i + 1) % 5]]) for i in range(8)]
        ids += [w.intern_stack(Unavailable("no python")), w.intern_stack([])]
        ev["stack"] = np.array([0, *ids])[rng.integers(0, len(ids) + 1, n)]
        for p in range(100, 104):
            for k in range(3):
                begin = int(ts[rng.integers(0, n)])
                w.write_marker(Marker(begin, p, 0, p, ["load", "step"][k % 2], "begin", 0))
                if rng.random() < 0.7:
                    w.write_marker(Marker(begin + int(rng.integers(1, 2000)), p, 0, p, ["load", "step"][k % 2], "end", 0))
        w.write_events(ev)
    return path


def by_definition(trace, phases, end_ts: int, pid=None, gpu=None) -> dict:
    """(phase, site, level) -> (allocated, held, allocations, peak), one allocation at a time as
    the module docstring defines them (the oracle)."""
    e = trace.event_columns
    pairs = {int(Kind.ALLOC): (int(Kind.FREE), "ptr"), int(Kind.VMM_CREATE): (int(Kind.VMM_RELEASE), "handle"),
             int(Kind.TENSOR_ALLOC): (int(Kind.TENSOR_FREE), "ptr")}
    exits: dict[int, int] = {}
    for i in np.flatnonzero(e["kind"] == int(Kind.PROC_EXIT)).tolist():
        exits.setdefault(int(e["pid"][i]), int(e["ts"][i]))
    never = np.iinfo(np.int64).max
    alive: dict[tuple, list] = {}  # group -> (start, end, size) of each allocation
    sums: dict[tuple, list] = {}
    for i in range(len(e)):
        k = int(e["kind"][i])
        if k not in pairs or e["result"][i] or not e["stack"][i]:
            continue
        p = int(e["pid"][i])
        if (pid is not None and p != pid) or (gpu is not None and int(e["gpu"][i]) != gpu):
            continue
        site = Site.of(trace.stacks.stack(int(e["stack"][i])))
        if site is None:
            continue
        free, key = pairs[k]
        end = never
        for j in range(i + 1, len(e)):
            if e["pid"][j] == p and e[key][j] == e[key][i] and e["result"][j] == 0 and int(e["kind"][j]) in (k, free):
                end = int(e["ts"][j]) if int(e["kind"][j]) == free else never
                break
        end = min(end, exits.get(p, never))
        ts, size = int(e["ts"][i]), int(e["size"][i])
        ph = int(phases.phase_at(p, ts))
        clip = phases.phases[ph].end if ph >= 0 else end_ts
        group = (ph, site, LEVELS[int(k == int(Kind.TENSOR_ALLOC))])
        s = sums.setdefault(group, [0, 0, 0])
        s[0] += size
        s[1] += size if end > clip else 0
        s[2] += 1
        alive.setdefault(group, []).append((ts, max(min(end, clip), ts), size))
    out: dict[tuple, list] = {}
    for group, spans in alive.items():
        peak = max(sum(size for s, e_, size in spans if s <= t < e_) for t, _, _ in spans)
        row = out.setdefault((phases.label(group[0]), group[1], group[2]), [0, 0, 0, 0])
        for k, v in enumerate([*sums[group], peak]):
            row[k] += v
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("select", [{}, {"pid": 101}, {"gpu": 0}])
def test_the_sites_are_their_definition_whatever_the_batches(tmp_path, monkeypatch, seed, ordered, select):
    trace = load_trace(random_trace(tmp_path, seed, ordered))
    phases = trace_phases(trace)
    end = trace_bounds(trace)[1]
    want = by_definition(trace, phases, end, **select)
    got = []
    # a batch a chunk, of a few, of all; the ended phases' groups folded at every batch, at a few, at the end
    for chunk, batch, fold in ((37, 1, 1), (101, 150, 2), (1 << 20, 1 << 18, sites_module.FOLD_AT)):
        monkeypatch.setattr(source_module, "CHUNK", chunk)
        monkeypatch.setattr(sites_module, "BATCH", batch)
        monkeypatch.setattr(sites_module, "FOLD_AT", fold)
        section = sites_section(trace, phases, end, limit=None, **select)
        got.append({(p.phase, r.site, r.level): [r.allocated, r.held, r.allocations, r.peak]
                    for p in section.phases for r in p.rows})
    assert got[0] == got[1] == got[2] == want


def test_the_groups_are_those_of_the_open_phases(tmp_path, monkeypatch):
    # GIVEN a stacked trace of 500 bursts of BURST blocks, a step phase around each burst, so
    # 500 phases of one path with BURST sites each (4,000 groups of (phase, site, level))
    path = tmp_path / "t.mrec"
    n = write_bursts(path, 500)
    trace = load_trace(path)
    steps = trace.event_columns["ts"][2:-1:2 * BURST].tolist()
    trace.markers = [Marker(t + d, 7, 0, 7, "step", phase, 0) for t in steps
                     for d, phase in ((-1, "begin"), (2 * BURST * 10 - 5, "end"))]
    phases = trace_phases(trace)
    end = trace_bounds(trace)[1]
    assert len(phases.table) == 500
    held = []
    pair = sites_module.SitesFeed._pair

    def counted(self):
        pair(self)
        held.append(len(self._groups))

    monkeypatch.setattr(sites_module.SitesFeed, "_pair", counted)
    monkeypatch.setattr(sites_module, "BATCH", 64)
    monkeypatch.setattr(source_module, "CHUNK", 256)
    sections = []
    for fold in (16, 1 << 30):  # folded as the pass goes, and never (the groups of every phase)
        monkeypatch.setattr(sites_module, "FOLD_AT", fold)
        held.clear()
        sections.append(sites_section(trace, phases, end, limit=None).to_json())
        # THEN folded, the feed holds the groups of a few phases (at most twice FOLD_AT), not 4,000
        assert max(held) <= (2 * 16 if fold == 16 else 500 * BURST + 1)
    assert max(held) == 500 * BURST + 1  # (the control, unfolded: a group per phase and site, and the segments')
    # AND the section is the same, its rows in the same order
    assert sections[0] == sections[1]
    assert [r["allocations"] for r in sections[0]["phases"][0]["rows"]] == [500] * BURST
