"""Real uprobes on the stub driver: every workload scenario must produce exactly the events the
architecture's per-kind field table predicts from what the workload says it did.

The workload prints its calls as JSON facts (``--facts``); ``expected_event`` turns one fact into
the event the BPF program must emit (docs/architecture.md, "Per-kind field use"). Events are
compared per thread, in order, field by field.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from memrec.terms.columns import RAW_DTYPE
from memrec.terms.events import API_KIND
from memrec.terms.events import CONTEXT_TRACKING_APIS
from memrec.terms.events import FLAG_IPC_BYTES
from memrec.terms.events import FLAG_NAME
from memrec.terms.events import Api
from memrec.terms.events import Kind

pytestmark = pytest.mark.bpf

CMP_FIELDS = ("kind", "api", "result", "ordinal", "flags", "ptr", "size", "handle", "aux", "ipc")
NO_EVENT = {a.name for a in CONTEXT_TRACKING_APIS}
#: Kinds whose ordinal is not the current context's (the table says -1).
UNBOUND = {Kind.VMM_RELEASE, Kind.VMM_MAP, Kind.VMM_UNMAP, Kind.VA_RESERVE, Kind.VA_FREE,
           Kind.SHARE_EXPORT, Kind.VMM_RETAIN, Kind.POOL_DESTROY, Kind.POOL_TRIM, Kind.POOL_ATTR}
#: Kinds whose aux is the call's entry time (a reading taken while the call runs is its).
ENTRY_TIMED = {Kind.CODE_LOAD, Kind.CODE_UNLOAD, Kind.KERNEL_LOAD, Kind.POOL_DESTROY, Kind.POOL_TRIM,
               Kind.ARRAY_DESTROY, Kind.GRAPH_TRIM}
#: Calls whose entry also emits a CTX_BEGIN (the daemon reads NVML before the context exists).
CTX_BINDS = {"cuDevicePrimaryCtxRetain", "cuCtxCreate_v2", "cuCtxCreate_v3", "cuCtxCreate_v4"}


def name_bytes(name: str) -> bytes:
    """A name as the probe reads it: at most 63 bytes and a NUL, zeros after."""
    return name.encode()[:63].ljust(64, b"\0")


# ---- helpers ----------------------------------------------------------------------------------


def expected_event(fact: dict) -> dict | None:
    """The event one driver call must produce (None for context bookkeeping calls)."""
    api = fact["api"]
    if api in NO_EVENT:
        return None
    kind = API_KIND[Api[api]]
    a, out, ok = fact["args"], fact["out"], fact["result"] == 0
    ev = {"kind": int(kind), "api": int(Api[api]), "result": fact["result"], "flags": 0,
          "ptr": 0, "size": 0, "handle": 0, "aux": 0, "ipc": bytes(64),
          "ordinal": -1 if kind in UNBOUND else fact["ordinal"]}
    if kind == Kind.ALLOC:
        ev["ptr"] = out.get("dptr", 0)
        if api == "cuMemAllocPitch_v2":
            ev["size"] = out["pitch"] * a["height"] if ok else a["width"] * a["height"]
        else:
            ev["size"] = a["bytesize"]
        ev["handle"] = a.get("pool", a.get("stream", 0))
        ev["aux"] = a.get("flags", 0)
    elif kind == Kind.FREE:
        ev.update(ptr=a["dptr"], handle=a.get("stream", 0))
    elif kind == Kind.VMM_CREATE:
        ev.update(size=a["size"], handle=out.get("handle", 0), aux=a["location_type"], ordinal=a["location_id"])
    elif kind == Kind.VMM_RELEASE:
        ev.update(handle=a["handle"])
    elif kind == Kind.VMM_MAP:
        ev.update(ptr=a["ptr"], size=a["size"], aux=a["offset"], handle=a["handle"])
    elif kind in (Kind.VMM_UNMAP, Kind.VA_FREE):
        ev.update(ptr=a["ptr"], size=a["size"])
    elif kind == Kind.VA_RESERVE:
        ev.update(ptr=out.get("ptr", 0), size=a["size"], handle=a["addr"], aux=a["alignment"])
    elif kind == Kind.IPC_EXPORT:
        ev["ptr"] = a["dptr"]
        if ok:
            ev.update(ipc=bytes.fromhex(out["handle"]), flags=FLAG_IPC_BYTES)
    elif kind == Kind.IPC_OPEN:
        ev.update(ptr=out.get("dptr", 0), aux=a["flags"], ipc=bytes.fromhex(a["handle"]), flags=FLAG_IPC_BYTES)
    elif kind == Kind.IPC_CLOSE:
        ev["ptr"] = a["dptr"]
    elif kind == Kind.SHARE_EXPORT:
        ev.update(handle=a["handle"], aux=a["type"])
        if ok and a["type"] == 1:
            ev["ptr"] = out["fd"]
        elif ok and a["type"] == 8:
            ev.update(ipc=bytes.fromhex(out["fabric"]), flags=FLAG_IPC_BYTES)
    elif kind == Kind.SHARE_IMPORT:
        ev.update(handle=out.get("handle", 0), aux=a["type"])
        if a["type"] == 1:
            ev["ptr"] = a["fd"]
        else:
            ev.update(ipc=bytes.fromhex(a["fabric"]), flags=FLAG_IPC_BYTES)
    elif kind == Kind.VMM_RETAIN:
        ev.update(ptr=a["addr"], handle=out.get("handle", 0))
    elif kind == Kind.HOST_ALLOC:
        ev.update(ptr=out.get("p", 0), size=a["bytesize"], aux=a.get("flags", 0))
    elif kind in (Kind.HOST_FREE, Kind.HOST_UNREGISTER):
        ev["ptr"] = a["p"]
    elif kind == Kind.HOST_REGISTER:
        ev.update(ptr=a["p"], size=a["bytesize"], aux=a["flags"])
    elif kind == Kind.CTX:
        if api == "cuCtxGetDevice":
            ev.update(aux=2, handle=fact["ctx"], ordinal=out.get("device", -1))
        else:
            ev.update(aux=0 if api == "cuDevicePrimaryCtxRetain" else 1, handle=out.get("ctx", 0), ordinal=a["dev"])
    elif kind == Kind.CODE_LOAD:
        ev.update(handle=out.get("library", out.get("module", 0)), ptr=a.get("code", 0))
        if "file" in a:
            ev.update(ipc=name_bytes(a["file"]), flags=FLAG_NAME)
    elif kind == Kind.CODE_UNLOAD:
        ev["handle"] = a["handle"]
    elif kind == Kind.KERNEL_LOAD:
        if api == "cuLibraryGetKernel":
            ev.update(ptr=a["library"], handle=out.get("kernel", 0), ipc=name_bytes(a["name"]), flags=FLAG_NAME)
        else:
            ev.update(ptr=a["kernel"], handle=out.get("function", 0))
    elif kind == Kind.POOL:
        ev["handle"] = out.get("pool", 0)
        if api == "cuMemPoolCreate":
            ev.update(ordinal=a["location_id"], aux=a["location_type"], size=a["max_size"])
        else:
            ev["ordinal"] = a["dev"]
    elif kind == Kind.POOL_DESTROY:
        ev["handle"] = a["handle"]
    elif kind == Kind.POOL_TRIM:
        ev.update(handle=a["handle"], size=a["keep"])
    elif kind == Kind.POOL_ATTR:
        ev.update(handle=a["handle"], aux=a["attr"], size=a["value"])
    if kind in ENTRY_TIMED:
        ev["aux"] = "entry"
    return ev


def expected_events(fact: dict) -> list[dict]:
    """Every event one driver call must produce, in order: a context bind's CTX_BEGIN at entry
    (whatever the call returns), then the call's own event."""
    ev = expected_event(fact)
    if ev is None:
        return []
    if fact["api"] not in CTX_BINDS:
        return [ev]
    begin = dict(ev, kind=int(Kind.CTX_BEGIN), result=0, handle=0)
    return [begin, ev]


def as_dict(rec: np.void) -> dict:
    out = {name: (bytes(rec[name]) if name == "ipc" else int(rec[name])) for name in CMP_FIELDS}
    if out["kind"] in ENTRY_TIMED and 0 < out["aux"] <= int(rec["ts"]):
        out["aux"] = "entry"  # its entry time: before its return, when the record was stamped
    return out


def run_workload(lib: Path, *scenarios: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "memrec.validation.stubdriver.workload", "--lib", str(lib), "--facts", *scenarios],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, f"workload failed: {proc.stderr}"
    return json.loads(proc.stdout)


def pids_of(facts: dict) -> set[int]:
    return {c["pid"] for c in facts["calls"]}


def collect(probes, pids: set[int], want: int, timeout: float = 10.0, batches: list | None = None) -> np.ndarray:
    """Poll until ``want`` events of ``pids`` arrived (or the timeout); return those events."""
    got: list[np.ndarray] = []
    n = 0
    deadline = time.monotonic() + timeout
    while True:
        ev = probes.poll()
        if batches is not None:
            batches.append(ev)
        mine = ev[np.isin(ev["pid"], list(pids))]
        got.append(mine)
        n += len(mine)
        if n >= want or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    # Give a late duplicate or stray event a chance to show up before the exact comparison.
    time.sleep(0.05)
    ev = probes.poll()
    got.append(ev[np.isin(ev["pid"], list(pids))])
    out = np.concatenate(got) if got else np.zeros(0, RAW_DTYPE)
    return out[np.argsort(out["ts"], kind="stable")]


def assert_exact(events: np.ndarray, facts: dict) -> None:
    """Per thread, the events are exactly the expected ones in order; each process ends with
    one PROC_EXIT."""
    procs = pids_of(facts)
    exits = events[events["kind"] == Kind.PROC_EXIT]
    assert sorted(exits["pid"].tolist()) == sorted(procs), "one PROC_EXIT per process that called the driver"
    for pid in procs:
        mine = events[events["pid"] == pid]
        assert mine[-1]["kind"] == Kind.PROC_EXIT, f"PROC_EXIT is the last event of {pid}"
    calls = events[events["kind"] != Kind.PROC_EXIT]
    tids = {(c["pid"], c["tid"]) for c in facts["calls"]}
    assert {(int(e["pid"]), int(e["tid"])) for e in calls} <= tids
    for pid, tid in sorted(tids):
        expected = [e for f in facts["calls"] if (f["pid"], f["tid"]) == (pid, tid) for e in expected_events(f)]
        actual = [as_dict(e) for e in calls if (e["pid"], e["tid"]) == (pid, tid)]
        assert len(actual) == len(expected), f"{pid}/{tid}: {len(actual)} events, expected {len(expected)}"
        for i, (got, want) in enumerate(zip(actual, expected)):
            assert got == want, f"{pid}/{tid} event {i} ({Api(want['api']).name})"


def expected_count(facts: dict) -> int:
    return sum(len(expected_events(f)) for f in facts["calls"]) + len(pids_of(facts))


def record(probes, lib: Path, *scenarios: str) -> tuple[dict, np.ndarray]:
    probes.poll()  # drop whatever earlier tests left
    facts = run_workload(lib, *scenarios)
    events = collect(probes, pids_of(facts), expected_count(facts))
    return facts, events


def by_api(events: np.ndarray, api: Api) -> np.ndarray:
    return events[events["api"] == api]


# ---- attaching ----------------------------------------------------------------------------------


def test_attach_reports_every_symbol_and_is_idempotent(probes, stub_lib):
    # GIVEN probes attached to the stub by the fixture
    from memrec.probes.cuda import SYMBOLS

    # WHEN the same file is attached again, through another path to the same inode
    again = probes.attach_library(Path(stub_lib).parent / "." / Path(stub_lib).name)

    # THEN nothing new is attached and the first report says every symbol is probed
    assert again.already_attached
    assert set(again.attached) == set(SYMBOLS) and not again.missing
    assert len(probes.attached_libraries()) == 1


def test_a_library_that_is_not_the_driver_gets_no_probes(stub_lib):
    # GIVEN an ELF library that exports none of the driver's API (issue 15: any file named
    # libcuda.so* used to get probes, uncapped)
    from memrec.probes.cuda import CudaProbes
    from memrec.probes.cuda import ProbeError

    libc = next(p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/libc.so.6", "/lib64/libc.so.6") if Path(p).exists())
    with CudaProbes(ringbuf_pages=16) as p:
        # THEN attaching is refused, saying what it lacks, and nothing is attached or kept open
        with pytest.raises(ProbeError, match="does not export the CUDA driver API .*cuInit"):
            p.attach_library(libc)
        assert p.attached_libraries() == [] and p._lib_fds == []


def test_poll_on_an_idle_ring_returns_an_empty_raw_array(probes):
    probes.poll()
    ev = probes.poll()
    assert ev.dtype == RAW_DTYPE


# ---- scenarios ----------------------------------------------------------------------------------


def test_basic_scenario_events_are_exact(probes, stub_lib):
    facts, events = record(probes, stub_lib, "basic")
    assert_exact(events, facts)

    # Spot checks of what matters most, readable on their own.
    allocs = by_api(events, Api.cuMemAlloc_v2)
    failed = allocs[allocs["result"] != 0]
    assert len(failed) == 1
    assert failed[0]["result"] == 2 and failed[0]["ptr"] == 0 and failed[0]["size"] == 80 * 2**30 + 1
    assert failed[0]["ordinal"] == 0
    pitch = by_api(events, Api.cuMemAllocPitch_v2)[0]
    assert pitch["size"] == 1024 * 300  # pitch (1000 rounded to 512) × height
    assert set(allocs[allocs["result"] == 0]["size"].tolist()) == {4 * 2**20 + 512, 123_456_768, 777}
    assert probes.lost() == 0


def test_vmm_scenario_events_are_exact(probes, stub_lib):
    facts, events = record(probes, stub_lib, "vmm")
    assert_exact(events, facts)

    create = by_api(events, Api.cuMemCreate)
    ok = create[create["result"] == 0][0]
    assert ok["ordinal"] == 1, "cuMemCreate's device comes from prop->location.id, not the current context"
    assert ok["aux"] == 1 and ok["size"] == 32 * 2**20 and ok["handle"] != 0
    oom = create[create["result"] != 0][0]
    assert oom["result"] == 2 and oom["handle"] == 0 and oom["ordinal"] == 1
    maps = by_api(events, Api.cuMemMap)
    assert (maps["handle"] == ok["handle"]).all() and maps["aux"].tolist() == [0, 16 * 2**20]
    share = by_api(events, Api.cuMemImportFromShareableHandle)
    exported = by_api(events, Api.cuMemExportToShareableHandle)
    fabric_out = exported[exported["aux"] == 8][0]
    fabric_in = share[share["aux"] == 8][0]
    assert bytes(fabric_out["ipc"]) == bytes(fabric_in["ipc"]) != bytes(64)
    assert share[share["aux"] == 1][0]["ptr"] == exported[exported["aux"] == 1][0]["ptr"], "the fd value"


def test_ipc_handle_bytes_join_exporter_and_importers(probes, stub_lib):
    facts, events = record(probes, stub_lib, "ipc")
    assert_exact(events, facts)

    export = by_api(events, Api.cuIpcGetMemHandle)
    opens = by_api(events, Api.cuIpcOpenMemHandle_v2)
    assert len(export) == 1 and len(opens) == 2
    handle = bytes(export[0]["ipc"])
    assert handle != bytes(64) and export[0]["flags"] & FLAG_IPC_BYTES
    for o in opens:
        assert bytes(o["ipc"]) == handle, "the by-value handle read at [sp+8] equals the exporter's bytes"
        assert o["pid"] != export[0]["pid"]
    forked = next(p["pid"] for p in facts["processes"] if p["role"] == "ipc-fork")
    importer = next(p["pid"] for p in facts["processes"] if p["role"] == "ipc-importer")
    # Flags is the second integer argument (rsi) because the struct goes to memory: the forked
    # child passes 1 and the importer 0, and each is read back.
    assert opens[opens["pid"] == forked][0]["aux"] == 1
    assert opens[opens["pid"] == importer][0]["aux"] == 0
    assert opens[opens["pid"] == forked][0]["ordinal"] == 0
    assert opens[opens["pid"] == importer][0]["ordinal"] == 1


def test_multi_device_ordinals_follow_the_current_context(probes, stub_lib):
    facts, events = record(probes, stub_lib, "multi")
    assert_exact(events, facts)

    main = facts["pid"]
    allocs = by_api(events, Api.cuMemAlloc_v2)
    sizes_to_ordinal = {int(e["size"]): int(e["ordinal"]) for e in allocs if e["pid"] == main}
    MiB = 2**20
    assert sizes_to_ordinal[MiB + 1] == 0 and sizes_to_ordinal[MiB + 2] == 1  # set-current
    assert sizes_to_ordinal[MiB + 3] == 0 and sizes_to_ordinal[MiB + 4] == 1  # push / pop
    assert [sizes_to_ordinal[2 * MiB + v] for v in (2, 3, 4)] == [0, 1, 0]  # cuCtxCreate_v2/3/4
    assert sizes_to_ordinal[MiB + 5] == 1  # back on device 1 after destroying the created ones
    worker = allocs[(allocs["pid"] == main) & (allocs["size"] == MiB + 6)][0]
    assert worker["tid"] != main and worker["ordinal"] == 0  # another thread, its own context

    child = next(p for p in facts["processes"] if p["role"] == "visible-devices-1")
    assert child["cuda_visible_devices"] == "1"
    child_alloc = allocs[allocs["pid"] == child["pid"]][0]
    fact = next(c for c in facts["calls"] if c["pid"] == child["pid"] and c["api"] == "cuMemAlloc_v2")
    assert child_alloc["ordinal"] == 0, "the probe sees the process's ordinal"
    assert fact["physical"] == 1, "which CUDA_VISIBLE_DEVICES maps to physical device 1"


def test_leaking_child_gets_a_process_exit(probes, stub_lib):
    facts, events = record(probes, stub_lib, "leak")
    assert_exact(events, facts)

    leaker = next(p["pid"] for p in facts["processes"] if p["role"] == "leaker")
    mine = events[events["pid"] == leaker]
    assert [Kind(k).name for k in mine["kind"]] == ["CTX_BEGIN", "CTX", "ALLOC", "ALLOC", "ALLOC", "PROC_EXIT"]
    assert not (mine["kind"] == Kind.FREE).any()
    assert mine[-1]["api"] == Api.sched_process_exit and mine[-1]["ordinal"] == -1


def test_code_loading_events_are_exact(probes, stub_lib):
    # GIVEN the stub driver; WHEN a workload loads libraries and modules and fetches kernels
    facts, events = record(probes, stub_lib, "code")

    # THEN every call is one event with the handles the driver returned
    assert_exact(events, facts)
    loads = events[events["kind"] == Kind.CODE_LOAD]
    first = loads[0]
    assert first["api"] == Api.cuLibraryLoadData and first["ordinal"] == -1, "a library loaded before any context"
    assert first["ptr"] != 0 and first["handle"] != 0
    from_file = by_api(events, Api.cuLibraryLoadFromFile)[0]
    assert from_file["flags"] & FLAG_NAME and bytes(from_file["ipc"]).rstrip(b"\0").decode() == str(stub_lib)
    kernels = by_api(events, Api.cuLibraryGetKernel)
    assert bytes(kernels[1]["ipc"])[63] == 0 and len(bytes(kernels[1]["ipc"]).rstrip(b"\0")) == 63, "long names are cut"
    functions = by_api(events, Api.cuKernelGetFunction)
    assert functions["ptr"].tolist() == kernels["handle"].tolist(), "a function names the kernel it came from"
    missing = by_api(events, Api.cuModuleLoad)
    assert missing[-1]["result"] == 301 and missing[-1]["handle"] == 0


def test_pool_events_are_exact(probes, stub_lib):
    # GIVEN the stub; WHEN a workload uses the default pool, trims it, and a pool of its own
    facts, events = record(probes, stub_lib, "pool")

    # THEN pool creation, attributes (64-bit and int values), trims and destruction are exact
    assert_exact(events, facts)
    default = by_api(events, Api.cuDeviceGetDefaultMemPool)[0]
    attrs = by_api(events, Api.cuMemPoolSetAttribute)
    assert attrs[0]["handle"] == default["handle"] and attrs[0]["aux"] == 4 and attrs[0]["size"] == 2**64 - 1
    assert attrs[1]["aux"] == 1 and attrs[1]["size"] == 1
    created = by_api(events, Api.cuMemPoolCreate)[0]
    assert created["ordinal"] == 0 and created["size"] == 1 << 30
    assert by_api(events, Api.cuMemPoolDestroy)[0]["handle"] == created["handle"]
    from_pool = by_api(events, Api.cuMemAllocFromPoolAsync)
    assert (from_pool["handle"] == created["handle"]).all(), "allocations name their pool"


def test_context_binds_emit_a_begin_record_first(probes, stub_lib):
    # GIVEN a workload retaining and creating contexts on two devices
    facts, events = record(probes, stub_lib, "multi")
    main = facts["pid"]
    mine = events[(events["pid"] == main) & np.isin(events["kind"], [Kind.CTX_BEGIN, Kind.CTX])]
    mine = mine[mine["api"] != Api.cuCtxGetDevice]

    # THEN each bind is a CTX_BEGIN (entry, same device) followed by its CTX (return)
    kinds = mine["kind"].tolist()
    assert kinds == [Kind.CTX_BEGIN, Kind.CTX] * (len(kinds) // 2) and len(kinds) == 10
    assert (mine["ordinal"][0::2] == mine["ordinal"][1::2]).all()
    assert (mine["ts"][0::2] <= mine["ts"][1::2]).all()


def test_without_untraced_probes_code_and_pool_calls_are_not_seen(stub_lib):
    # GIVEN probes built without the untraced set (what bench/ compares against)
    from memrec.probes.cuda import UNTRACED_SYMBOLS
    from memrec.probes.cuda import CudaProbes

    with CudaProbes(ringbuf_pages=64, untraced=False) as p:
        report = p.attach_library(stub_lib)
        assert not set(UNTRACED_SYMBOLS) & set(report.attached)

        # WHEN the code and pool scenarios run
        facts = run_workload(stub_lib, "code", "pool")
        time.sleep(0.1)
        events = p.poll()
        events = events[np.isin(events["pid"], list(pids_of(facts)))]

    # THEN only the allocation and context events are there
    assert len(events) and not np.isin(events["kind"], [Kind.CODE_LOAD, Kind.KERNEL_LOAD, Kind.POOL, Kind.POOL_TRIM]).any()


def test_demo_records_everything_without_loss(probes, stub_lib):
    facts, events = record(probes, stub_lib, "demo")
    assert_exact(events, facts)
    assert probes.lost() == 0


# ---- follow-tree mode --------------------------------------------------------------------------


def test_follow_tree_records_only_the_tracked_tree(tree_probes, stub_lib):
    # GIVEN a tracked workload and an untracked one, both waiting to start
    tree_probes.poll()
    cmd = [sys.executable, "-m", "memrec.validation.stubdriver.workload", "--lib", str(stub_lib), "--facts", "--wait"]
    tracked = subprocess.Popen([*cmd, "ipc", "multi", "leak"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([*cmd, "basic", "leak"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tree_probes.track_pid(tracked.pid)

    # WHEN both run
    out_t, _ = tracked.communicate("go\n", timeout=120)
    out_o, _ = other.communicate("go\n", timeout=120)
    assert tracked.returncode == 0 and other.returncode == 0
    facts, facts_other = json.loads(out_t), json.loads(out_o)
    children = {p["pid"] for p in facts["processes"]}
    pids = pids_of(facts) | children | {tracked.pid}
    seen: list[np.ndarray] = []
    events = collect(tree_probes, pids, expected_count(facts) + len(children), batches=seen)

    # THEN the tracked tree is recorded exactly, with a PROC_FORK per child (not per thread:
    # "multi" starts one), and nothing else is
    forks = events[events["kind"] == Kind.PROC_FORK]
    assert sorted(forks["ptr"].tolist()) == sorted(children)
    assert len({int(t) for t in events[events["pid"] == tracked.pid]["tid"]}) == 2, "the worker thread is recorded"
    assert (forks["pid"] == tracked.pid).all() and (forks["api"] == Api.sched_process_fork).all()
    for child in children:
        fork = forks[forks["ptr"] == child][0]
        first = events[events["pid"] == child][0]
        assert fork["ts"] <= first["ts"], "the fork is recorded before the child's first call"
    assert_exact(events[events["kind"] != Kind.PROC_FORK], facts)
    everything = np.concatenate(seen)
    assert not np.isin(everything["pid"], list(pids_of(facts_other) | {other.pid})).any(), "untracked processes are not recorded"
    assert tree_probes.lost() == 0


def test_track_pid_needs_follow_tree(probes):
    from memrec.probes.cuda import ProbeError

    with pytest.raises(ProbeError):
        probes.track_pid(1)


# ---- the ring buffer under pressure -----------------------------------------------------------


def test_small_ring_wraps_without_loss_and_counts_loss_when_full(stub_lib):
    # GIVEN probes with a 2-page ring (≈ 60 records), far less than the demo produces
    import threading

    from memrec.probes.cuda import CudaProbes

    with CudaProbes(ringbuf_pages=2) as small:
        small.attach_library(stub_lib)

        # WHEN the demo runs while the ring is polled often (it wraps several times)
        batches: list[np.ndarray] = []
        stop = threading.Event()

        def poller() -> None:
            while not stop.is_set():
                batches.append(small.poll())
                time.sleep(0.002)

        th = threading.Thread(target=poller)
        th.start()
        try:
            facts = run_workload(stub_lib, "demo")
            deadline = time.monotonic() + 10
            while sum(np.isin(b["pid"], list(pids_of(facts))).sum() for b in batches) < expected_count(facts):
                assert time.monotonic() < deadline, "events missing"
                time.sleep(0.02)
        finally:
            stop.set()
            th.join()

        # THEN every event arrives exactly once, decoded across the wrap of the double mapping
        events = np.concatenate(batches)
        events = events[np.isin(events["pid"], list(pids_of(facts)))]
        assert_exact(events[np.argsort(events["ts"], kind="stable")], facts)
        assert small.lost() == 0

        # WHEN nobody polls during a run, THEN the overflow is counted, not silent
        facts = run_workload(stub_lib, "demo")
        time.sleep(0.1)
        kept = small.poll()
        kept = kept[np.isin(kept["pid"], list(pids_of(facts)))]
        assert small.lost() > 0
        assert len(kept) + small.lost() == expected_count(facts), "every event is either kept or counted"


def test_attaching_a_file_that_is_not_elf_fails_cleanly(probes, tmp_path):
    from memrec.probes.cuda import ProbeError

    bogus = tmp_path / "libcuda.so.1"
    bogus.write_bytes(b"not an ELF file")
    before = len(probes.attached_libraries())
    with pytest.raises(ProbeError):
        probes.attach_library(bogus)
    assert len(probes.attached_libraries()) == before


#: A process that makes alloc/free pairs without a pause (argv: the driver, the number of pairs).
BURST = r"""
import ctypes, sys
from memrec.validation.stubdriver.workload import Driver, Facts
drv = Driver(sys.argv[1], Facts())
drv.init()
drv.ctx_set_current(drv.primary_ctx_retain(0))
alloc, free, p = drv.lib.cuMemAlloc_v2, drv.lib.cuMemFree_v2, ctypes.c_uint64()
for i in range(int(sys.argv[2])):
    alloc(ctypes.byref(p), 4096 + i)
    free(p.value)
"""


def test_a_burst_of_many_rings_is_drained_on_the_programs_wakeups(tmp_path):
    # GIVEN probes with a 1 MiB ring (about 7,700 records) on a private copy of the stub, and a
    # reader that drains only when the ring's fd wakes it: no timer (its select waits 60 s), and a
    # real-time priority so that a loaded host does not delay it (it sleeps between wakeups)
    import os
    import select
    import threading

    from memrec.probes.cuda import CudaProbes
    from memrec.validation.stubdriver.build import build_stub

    lib = build_stub(tmp_path / "stub")
    pairs = 25_000  # 50,000 records: six and a half rings, far more than a 50 ms poll would find
    with CudaProbes(ringbuf_pages=256) as probes:
        probes.attach_library(lib)
        batches: list[np.ndarray] = []
        wakeups = [0]
        stop_r, stop_w = os.pipe()

        def reader() -> None:
            try:
                os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
            except OSError:
                os.setpriority(os.PRIO_PROCESS, 0, -10)
            while True:
                ready, _, _ = select.select([probes.fileno(), stop_r], [], [], 60)
                if stop_r in ready:
                    return
                if ready:
                    wakeups[0] += 1
                    batches.append(probes.poll())

        th = threading.Thread(target=reader)
        th.start()
        try:
            # WHEN a process makes the burst without a pause
            proc = subprocess.run([sys.executable, "-c", BURST, str(lib), str(pairs)], capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, proc.stderr
        finally:
            os.write(stop_w, b"x")
            th.join()
            os.close(stop_r)
            os.close(stop_w)
        batches.append(probes.poll())  # the last quarter ring, below the wakeup threshold
        events = np.concatenate(batches)
        calls = events[np.isin(events["kind"], [int(Kind.ALLOC), int(Kind.FREE)])]
        # THEN every call was recorded and none lost, over several wakeups by the program
        assert probes.lost() == 0
        assert len(calls) == 2 * pairs
        assert sorted(calls["size"][calls["kind"] == int(Kind.ALLOC)].tolist()) == list(range(4096, 4096 + pairs))
        assert wakeups[0] >= 4
