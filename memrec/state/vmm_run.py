"""VMM creates, maps, unmaps and releases of a run of events, applied at once with numpy.

A VMM-backed allocator (PyTorch's expandable segments, SGLang's memory pools) makes these calls
by the thousand; one Python step each made them the daemon's bottleneck. :func:`apply_vmm` gives
what the event-by-event path (:meth:`memrec.state.vmm_ipc.VmmIpc.apply_other`) gives, for the
processes whose VMM events in the run follow the driver's rules, and declines (changing nothing)
the others' events, which the caller applies event by event:

- mappings, grouped by (pid, va) in event order: each map meets a free address, each unmap the
  mapping the event before it (or the table) left there, at least as large as the unmap (an
  unmap over several mappings, or of an unknown one, declines);
- handles, grouped by (pid, handle) with every map and unmap counted on the handle it maps: a
  create starts a new record (``refs`` 1, ``nmaps`` 0), a release takes a reference, a map adds
  one mapping and an unmap takes one; the record goes when both reach 0, which must be at its
  last event (a create over a live handle, an event on a gone or unknown one, a map of a peer's
  imported handle, whose size the map may change: declines).

A process that retains or shares a handle in the run, or holds retained aliases, is declined
too (those are rare); a run with a shareable import goes event by event altogether (the import
reads a peer's handle). A process's VMM events never read another's, so the two parts may go
in either order. The counter changes come back in event order, for
:func:`memrec.state.plain.apply_changes` with the rest of the run's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import NamedTuple

import numpy as np

from memrec.terms.events import HOST_PINNED
from memrec.terms.events import IPC_MAPPED
from memrec.terms.events import VMM
from memrec.state.allocs import by_key
from memrec.state.allocs import key_hash
from memrec.state.fields import MAX_SIZE
from memrec.state.fields import MAX_TS
from memrec.state.fields import VMM_CREATE
from memrec.state.fields import VMM_MAP
from memrec.state.fields import VMM_RELEASE
from memrec.state.fields import VMM_UNMAP

if TYPE_CHECKING:
    from memrec.state.batch import Batch
    from memrec.state.tables import Tables

# What each event does to the handle it names (or, for an unmap, the handle mapped there).
_CREATE, _RELEASE, _MAP, _UNMAP = range(4)
_STEP = np.full(1 << 16, -1, np.int8)
_STEP[[VMM_CREATE, VMM_RELEASE, VMM_MAP, VMM_UNMAP]] = [_CREATE, _RELEASE, _MAP, _UNMAP]


def apply_vmm(tables: Tables, events: Batch, pos: np.ndarray, fill: list,
              serial_pids: np.ndarray) -> tuple[list[np.ndarray] | None, np.ndarray]:
    """Apply the successful VMM_CREATE/MAP/UNMAP/RELEASE events at batch positions ``pos``
    (ascending) at once, but those of processes in ``serial_pids`` (they retain or share handles
    in the run) and of processes where one of them breaks the driver's rules.

    Returns the counter changes of the events applied (index, ts, gpu, pid, category, delta,
    peak; in event order; None when none was) and the positions of those declined, for the
    event-by-event path.
    """
    pid = events["pid"][pos]
    bad = serial_pids
    if tables.aliases:
        bad = np.append(bad, [p for p, al in tables.aliases.items() if al]).astype(np.int64)
    for _ in range(2):  # a second look at the processes kept finds nothing more
        declined = np.isin(pid, bad) if len(bad) else np.zeros(len(pos), bool)
        if declined.all():
            return None, pos
        plan = _plan(tables, events, pos[~declined])
        if isinstance(plan, _Plan):
            return _commit(tables, plan, fill), pos[declined]
        bad = np.append(bad, plan)
    return None, pos


class _Plan(NamedTuple):
    """What a run's VMM events do, found before anything changes (see :func:`_plan`)."""

    pos: np.ndarray
    cols: dict[str, np.ndarray]  # the events' columns (pid, va, size, handle: of the handle acted on, ...)
    maps: tuple[np.ndarray, ...]  # mapping order, is_map, heads, table rows and slots
    handles: tuple[np.ndarray, ...]  # handle order, steps, heads, table rows and slots, generations
    records: tuple[np.ndarray, ...]  # per generation: category, gpu, size, ts, api, exporter
    counts: tuple[np.ndarray, ...]  # per event in handle order: refs, nmaps, gone


def _plan(tables: Tables, events: Batch, pos: np.ndarray) -> _Plan | np.ndarray:
    """The effect of the VMM events at ``pos``, or the pids whose events break the rules."""
    pid = events["pid"][pos]
    step = _STEP[events["kind"][pos]]
    va = events["ptr"][pos]
    size = np.minimum(events["size"][pos], MAX_SIZE).astype(np.int64)
    handle = events["handle"][pos]
    bad = []

    # Mappings: each (pid, va) alternates map, unmap, ... from what the table holds.
    mm = np.flatnonzero(step >= _MAP)
    ms = tables.maps
    va_hash = key_hash(pid, va)
    morder = mm[by_key(pid[mm], va[mm], va_hash[mm])]
    is_map = step[morder] == _MAP
    mhead = _heads(pid[morder], va[morder])
    mrows, mslots = ms.lookup(pid[morder][mhead], va[morder][mhead], va_hash[morder][mhead])
    present = _shift(is_map, mhead, mrows >= 0)
    r = np.maximum(mrows, 0)
    mapped_size = _shift(size[morder], mhead, ms.size[r])
    mapped_handle = _shift(handle[morder], mhead, ms.handle[r])
    unmaps = ~is_map
    bad.append(morder[(is_map == present) | (unmaps & (mapped_size < size[morder]))])
    handle[morder[unmaps]] = mapped_handle[unmaps]  # an unmap acts on the handle it unmaps

    # Handles: runs of events per (pid, handle), a new generation at each create.
    hs = tables.handles
    handle_hash = key_hash(pid, handle)
    order = by_key(pid, handle, handle_hash)
    st = step[order]
    head = _heads(pid[order], handle[order])
    rows, slots = hs.lookup(pid[order][head], handle[order][head], handle_hash[order][head])
    found = np.zeros(len(st), bool)
    found[head] = rows >= 0
    is_create = st == _CREATE
    bad.append(order[head & (is_create == found)])  # a create over a live handle, an event on an unknown one
    gen_start = is_create | head
    gen = np.cumsum(gen_start) - 1
    starts = np.flatnonzero(gen_start)
    from_table = ~is_create[starts]  # a generation that continues the table's record
    trow = np.zeros(len(starts), np.int64)  # the table's row of each generation that continues it
    trow[gen[head][rows >= 0]] = rows[rows >= 0]
    imported = from_table & (hs.category[trow] == IPC_MAPPED) & _any_in(st == _MAP, gen, len(starts))
    bad.append(order[starts[imported]])
    refs = np.where(from_table, hs.refs[trow], 1)[gen] - _cum_in(st == _RELEASE, gen, starts)
    nmaps = np.where(from_table, hs.nmaps[trow], 0)[gen] + _cum_in(st == _MAP, gen, starts) - _cum_in(st == _UNMAP, gen, starts)
    gone = ((st == _RELEASE) | (st == _UNMAP)) & (refs <= 0) & (nmaps <= 0)
    last = np.ones(len(st), bool)
    last[:-1] = gen_start[1:]
    bad.append(order[gone & ~last])  # an event on a handle already gone
    bad.append(order[1:][is_create[1:] & ~head[1:] & ~gone[:-1]])  # a create over a live one
    bad = np.concatenate(bad)
    if len(bad):
        return np.unique(pid[bad]).astype(np.int64)

    # Each generation's record: the create's event, or the table's row.
    cols = {"pid": pid, "va": va, "size": size, "handle": handle, "va_hash": va_hash, "handle_hash": handle_hash,
            **{name: events[name][pos] for name in ("gpu", "ts", "api", "aux")}}
    cols["ts"] = np.minimum(cols["ts"], MAX_TS).astype(np.int64)
    origin = order[starts]
    cat = np.where(from_table, hs.category[trow], np.where(cols["aux"][origin] <= 1, VMM, HOST_PINNED))
    records = (
        cat,
        np.where(from_table, hs.gpu[trow], np.where(cat == VMM, cols["gpu"][origin], -1)).astype(np.int16),
        np.where(from_table, hs.size[trow], size[origin]),
        np.where(from_table, hs.ts[trow], cols["ts"][origin]),
        np.where(from_table, hs.api[trow], cols["api"][origin]),
        np.where(from_table, hs.exporter[trow], 0),
    )
    return _Plan(pos, cols, (morder, is_map, mhead, mrows, mslots), (order, st, head, rows, slots, gen),
                 records, (refs, nmaps, gone))


def _commit(tables: Tables, plan: _Plan, fill: list) -> list[np.ndarray]:
    """Change the tables as :func:`_plan` found; return the counter changes."""
    pos, c = plan.pos, plan.cols
    morder, is_map, mhead, mrows, mslots = plan.maps
    order, st, head, rows, slots, gen = plan.handles
    cat, g, gsize, gts, gapi, gexp = plan.records
    refs, nmaps, gone = plan.counts

    # The GPU each map, unmap and release fills in: its handle's.
    want = (st != _CREATE) & (c["gpu"][order] < 0) & (g[gen] >= 0)
    if want.any():
        fill.append((pos[order[want]], g[gen][want]))

    # The tables' end state: found rows leave, each key's last generation (if not gone) comes in.
    ms, hs = tables.maps, tables.handles
    ms.remove(mrows[mrows >= 0], mslots[mrows >= 0])
    mtail = _tails(mhead)
    m = morder[mtail[is_map[mtail]]]
    ms.insert(c["pid"][m], c["va"][m], c["size"][m], c["handle"][m], c["aux"][m], c["ts"][m], hashes=c["va_hash"][m])
    hs.remove(rows[rows >= 0], slots[rows >= 0])
    tail = _tails(head)
    keep = tail[~gone[tail]]
    k, kg = order[keep], gen[keep]
    hs.insert(c["pid"][k], c["handle"][k], gsize[kg], g[kg], gts[kg], cat[kg], refs[keep], nmaps[keep], gexp[kg],
              gapi[kg], hashes=c["handle_hash"][k])

    # Changes: +size at each create, -size where a record goes; none for 0 bytes.
    made = (st == _CREATE) & (gsize[gen] != 0)
    place = np.empty_like(order)  # each event's place in handle order: the changes in event order without a sort
    place[order] = np.arange(len(order))
    at = place[np.flatnonzero((made | (gone & (gsize[gen] != 0)))[place])]
    idx, ag = order[at], gen[at]
    return [
        pos[idx] + tables.n_events,
        c["ts"][idx],
        g[ag].astype(np.int64),
        c["pid"][idx].astype(np.int64),
        cat[ag].astype(np.int64),
        np.where(made[at], 1, -1) * gsize[ag],
        np.ones(len(at), bool),
    ]


def _heads(pid: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Where a new (pid, key) begins in rows grouped by key."""
    head = np.ones(len(pid), bool)
    head[1:] = (pid[1:] != pid[:-1]) | (key[1:] != key[:-1])
    return head


def _tails(head: np.ndarray) -> np.ndarray:
    """Positions of each group's last row."""
    if not len(head):
        return np.zeros(0, np.int64)
    return np.concatenate((np.flatnonzero(head)[1:] - 1, [len(head) - 1]))


def _shift(values: np.ndarray, head: np.ndarray, at_head: np.ndarray) -> np.ndarray:
    """Each row's previous row's value in its group, ``at_head`` (one per group) for a group's first."""
    out = np.empty(len(values), np.result_type(values, at_head))
    out[1:] = values[:-1]
    out[head] = at_head
    return out


def _cum_in(flag: np.ndarray, gen: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """How many rows of each row's generation up to and including it have ``flag``."""
    c = np.cumsum(flag)
    before = c[starts] - flag[starts]
    return c - before[gen]


def _any_in(flag: np.ndarray, gen: np.ndarray, n: int) -> np.ndarray:
    """Whether each of ``n`` generations has a row with ``flag``."""
    return np.bincount(gen[flag], minlength=n) > 0
