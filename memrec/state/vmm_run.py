"""VMM creates, maps, unmaps and releases of a run of events, applied at once with numpy.

A VMM-backed allocator (PyTorch's expandable segments, SGLang's memory pools) makes these calls
by the thousand; one Python step each made them the daemon's bottleneck. :func:`apply_vmm` gives
what the event-by-event path (:meth:`memrec.state.vmm_ipc.VmmIpc._apply_other`) gives, for a run
whose VMM events follow the driver's rules, and declines (changing nothing) otherwise, so that
the caller applies them event by event:

- mappings, grouped by (pid, va) in event order: each map meets a free address, each unmap the
  mapping the event before it (or the table) left there, at least as large as the unmap (an
  unmap over several mappings, or of an unknown one, declines);
- handles, grouped by (pid, handle) with every map and unmap counted on the handle it maps: a
  create starts a new record (``refs`` 1, ``nmaps`` 0), a release takes a reference, a map adds
  one mapping and an unmap takes one; the record goes when both reach 0, which must be at its
  last event (a create over a live handle, an event on a gone or unknown one, a map of a peer's
  imported handle, whose size the map may change: declines).

Retains, shareable exports and imports, and processes with retained aliases always go event
by event (they are rare); so do runs with an anomaly. The counter changes come back in event
order, for :func:`memrec.state.plain.apply_changes` with the rest of the run's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from memrec.events import HOST_PINNED
from memrec.events import IPC_MAPPED
from memrec.events import VMM
from memrec.state.allocs import by_key
from memrec.state.fields import MAX_SIZE
from memrec.state.fields import MAX_TS
from memrec.state.fields import VMM_CREATE
from memrec.state.fields import VMM_MAP
from memrec.state.fields import VMM_RELEASE
from memrec.state.fields import VMM_UNMAP

if TYPE_CHECKING:
    from memrec.state.batch import Batch
    from memrec.state.live import LiveState

# What each event does to the handle it names (or, for an unmap, the handle mapped there).
_CREATE, _RELEASE, _MAP, _UNMAP = range(4)
_STEP = np.full(1 << 16, -1, np.int8)
_STEP[[VMM_CREATE, VMM_RELEASE, VMM_MAP, VMM_UNMAP]] = [_CREATE, _RELEASE, _MAP, _UNMAP]


def apply_vmm(state: LiveState, events: Batch, pos: np.ndarray, fill: list) -> list[np.ndarray] | None:
    """Apply the successful VMM_CREATE/MAP/UNMAP/RELEASE events at batch positions ``pos``
    (ascending; the run's only events that touch handles and mappings) at once.

    Returns their counter changes in event order (index, ts, gpu, pid, category, delta, peak),
    or None, with nothing changed, when the event-by-event path must apply them.
    """
    pid = events["pid"][pos]
    if state._aliases and any(state._aliases.get(p) for p in np.unique(pid).tolist()):
        return None
    step = _STEP[events["kind"][pos]]
    va = events["ptr"][pos]
    size = np.minimum(events["size"][pos], MAX_SIZE).astype(np.int64)
    handle = events["handle"][pos]

    # Mappings: each (pid, va) alternates map, unmap, ... from what the table holds.
    mm = np.flatnonzero(step >= _MAP)
    ms = state._maps
    morder = mm[by_key(pid[mm], va[mm])]
    is_map = step[morder] == _MAP
    mhead = _heads(pid[morder], va[morder])
    mrows, mslots = ms.lookup(pid[morder][mhead], va[morder][mhead])
    mfound = mrows >= 0
    present = _shift(is_map, mhead, mfound)
    r = np.maximum(mrows, 0)
    mapped_size = _shift(size[morder], mhead, ms.size[r])
    mapped_handle = _shift(handle[morder], mhead, ms.handle[r])
    unmaps = ~is_map
    if np.any(is_map == present) or np.any(mapped_size[unmaps] < size[morder][unmaps]):
        return None
    handle[morder[unmaps]] = mapped_handle[unmaps]  # an unmap acts on the handle it unmaps

    # Handles: runs of events per (pid, handle), a new generation at each create.
    hs = state._handles
    order = by_key(pid, handle)
    st = step[order]
    head = _heads(pid[order], handle[order])
    rows, slots = hs.lookup(pid[order][head], handle[order][head])
    found = rows >= 0
    is_create = st == _CREATE
    if np.any(is_create[head] & found) or np.any(~is_create[head] & ~found):
        return None
    gen_start = is_create | head
    gen = np.cumsum(gen_start) - 1
    starts = np.flatnonzero(gen_start)
    from_table = ~is_create[starts]  # a generation that continues the table's record
    trow = np.zeros(len(starts), np.int64)  # the table's row of each generation that continues it
    trow[gen[head][found]] = rows[found]
    if np.any(from_table & (hs.category[trow] == IPC_MAPPED) & _any_in(st == _MAP, gen, len(starts))):
        return None
    refs0 = np.where(from_table, hs.refs[trow], 1)
    nmaps0 = np.where(from_table, hs.nmaps[trow], 0)
    refs = refs0[gen] - _cum_in(st == _RELEASE, gen, starts)
    nmaps = nmaps0[gen] + _cum_in(st == _MAP, gen, starts) - _cum_in(st == _UNMAP, gen, starts)
    gone = ((st == _RELEASE) | (st == _UNMAP)) & (refs <= 0) & (nmaps <= 0)
    last = np.ones(len(st), bool)
    last[:-1] = gen_start[1:]
    if np.any(gone & ~last) or np.any(is_create[1:] & ~head[1:] & ~gone[:-1]):
        return None

    # Each generation's record: the create's event, or the table's row.
    ev_cols = {name: events[name][pos] for name in ("gpu", "ts", "api", "aux")}
    origin = order[starts]
    cat = np.where(from_table, hs.category[trow], np.where(ev_cols["aux"][origin] <= 1, VMM, HOST_PINNED))
    g = np.where(from_table, hs.gpu[trow], np.where(cat == VMM, ev_cols["gpu"][origin], -1)).astype(np.int16)
    gsize = np.where(from_table, hs.size[trow], size[origin])
    gts = np.where(from_table, hs.ts[trow], np.minimum(ev_cols["ts"][origin], MAX_TS).astype(np.int64))
    gapi = np.where(from_table, hs.api[trow], ev_cols["api"][origin])
    gexp = np.where(from_table, hs.exporter[trow], 0)

    # The GPU each map, unmap and release fills in: its handle's.
    ev_gpu = ev_cols["gpu"][order]
    want = ~is_create & (ev_gpu < 0) & (g[gen] >= 0)
    if want.any():
        fill.append((pos[order[want]], g[gen][want]))

    # The tables' end state: found rows leave, each key's last generation (if not gone) comes in.
    ms.remove(mrows[mfound], mslots[mfound])
    mtail = _tails(mhead)
    mlast = morder[mtail[is_map[mtail]]]
    ms.insert(pid[mlast], va[mlast], size[mlast], handle[mlast], ev_cols["aux"][mlast],
              np.minimum(ev_cols["ts"][mlast], MAX_TS).astype(np.int64))
    hs.remove(rows[found], slots[found])
    tail = _tails(head)
    keep = tail[~gone[tail]]
    kg = gen[keep]
    hs.insert(pid[order][keep], handle[order][keep], gsize[kg], g[kg], gts[kg], cat[kg], refs[keep], nmaps[keep],
              gexp[kg], gapi[kg])

    # Changes: +size at each create, -size where a record goes; none for 0 bytes.
    made = is_create & (gsize[gen] != 0)
    went = gone & (gsize[gen] != 0)
    at = np.flatnonzero(made | went)
    at = at[np.argsort(order[at], kind="stable")]
    sign = np.where(made[at], 1, -1)
    idx = order[at]
    return [
        pos[idx] + state.n_events,
        np.minimum(ev_cols["ts"][idx], MAX_TS).astype(np.int64),
        g[gen[at]].astype(np.int64),
        pid[idx].astype(np.int64),
        cat[gen[at]].astype(np.int64),
        sign * gsize[gen[at]],
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
