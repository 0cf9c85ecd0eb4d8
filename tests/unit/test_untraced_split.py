"""The untraced band split (memrec.analysis.untraced.split) and the daemon's NVML readings around its steps."""

from __future__ import annotations

import numpy as np

from memrec.analysis.untraced.reconcile import reconcile
from memrec.analysis.untraced.split import pool_held
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.columns import with_gpu
from memrec.daemon.untraced import UntracedReadings
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.trace.model import Trace
from tests.unit.daemon_fakes import raw
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events

S = 1_000_000_000  # one second in ns


def procmem(*rows: tuple[float, int, int, int]) -> np.ndarray:
    """PROCMEM rows of (seconds, gpu, pid, used)."""
    return np.array([(int(t * S), g, p, u) for t, g, p, u in rows], dtype=PROCMEM_DTYPE)


def mark(t: float, pid: int, name: str, phase: str) -> Marker:
    return Marker(ts=int(t * S), pid=pid, uid=0, tid=pid, name=name, phase=phase)


def context_trace() -> Trace:
    """pid 1: a context on GPU 0, its first kernel, a second kernel, the context retained again, a
    late step, an allocation with 2 MiB of rounding; phases "init" then "load". pid 2: NVML lists it, memrec saw nothing of it."""
    return Trace(
        header={},
        events=events(
            ev(Kind.CTX_BEGIN, api=Api.cuDevicePrimaryCtxRetain, pid=1, gpu=0, ordinal=0, ts=1 * S),
            ev(Kind.CTX, api=Api.cuDevicePrimaryCtxRetain, pid=1, gpu=0, ordinal=0, handle=0xC1, ts=2 * S),
            ev(Kind.KERNEL_LOAD, api=Api.cuLibraryGetKernel, pid=1, gpu=0, handle=0x11, ts=3 * S),
            ev(Kind.KERNEL_LOAD, api=Api.cuKernelGetFunction, pid=1, gpu=0, handle=0x12, ts=5 * S),
            # retained again (as NCCL does while loading its kernels): costs and explains nothing
            ev(Kind.CTX, api=Api.cuDevicePrimaryCtxRetain, pid=1, gpu=0, ordinal=0, handle=0xC1, ts=int(5.2 * S)),
            ev(Kind.ALLOC, pid=1, gpu=0, ptr=0x1000, size=64 * MiB, ts=10 * S),
        ),
        procmem=procmem(
            (1.5, 0, 1, 14 * MiB),  # read while the context is being made (after its CTX_BEGIN)
            (2.5, 0, 1, 500 * MiB),  # the context
            (3.5, 0, 1, 590 * MiB),  # its first kernel: the lazy first-launch step
            (4.0, 0, 1, 590 * MiB),
            (5.5, 0, 1, 600 * MiB),  # a kernel: module code
            (5.6, 0, 1, 602 * MiB),  # no call in between, just after one: unexplained (no time window)
            (9.0, 0, 1, 602 * MiB),
            (11.0, 0, 1, 668 * MiB),  # 64 MiB traced, 2 MiB of rounding: unexplained
            (1.0, 0, 2, 300 * MiB),
            (3.0, 0, 2, 300 * MiB),
        ),
        markers=[mark(0.5, 1, "init", "begin"), mark(4.5, 1, "init", "end"), mark(4.6, 1, "load", "begin")],
    )


def test_context_first_kernel_module_code_and_the_rest_are_split():
    # WHEN the trace is reconciled
    rec = reconcile(context_trace())
    row = next(r for r in rec.gpu_summary(0).to_json()["processes"] if r["pid"] == 1)

    # THEN the 668 - 64 MiB untraced are: the context with its first kernel, 10 MiB of kernels over
    # the call, the step just after it and the rounding unexplained; and the identity holds at every sample
    assert row["split"] == {"context": 590 * MiB, "module_code": 10 * MiB, "pools": 0, "limits": 0, "graph": 0,
                            "multicast": 0, "before_recording": 0, "unexplained": 4 * MiB}
    sp, s = rec.splits[(0, 1)], rec.process(0, 1)
    total = (sp.context + sp.module_code + sp.pools + sp.limits + sp.graph + sp.multicast + sp.before_recording
             + sp.unexplained)
    assert (total == s.nvml_used - s.traced).all()
    # AND each step is put in the phase of the call that explains it
    assert row["split_by_phase"] == [
        {"phase": "init", "context": 590 * MiB, "module_code": 0, "pools": 0, "limits": 0, "graph": 0, "multicast": 0,
         "before_recording": 0, "unexplained": 0},
        {"phase": "load", "context": 0, "module_code": 10 * MiB, "pools": 0, "limits": 0, "graph": 0, "multicast": 0,
         "before_recording": 0, "unexplained": 4 * MiB},
    ]
    assert [(st["category"], st["cause"]) for st in row["steps"]] == [
        ("context", "cuDevicePrimaryCtxRetain"), ("context", "cuDevicePrimaryCtxRetain"), ("context", "cuLibraryGetKernel"),
        ("module_code", "cuKernelGetFunction"), ("unexplained", None), ("unexplained", None),
    ]
    # AND the context's cost includes its first kernel
    (ctx,) = rec.contexts
    assert (ctx.pid, ctx.gpu, ctx.handle, ctx.cost, ctx.foreign) == (1, 0, 0xC1, 590 * MiB, False)


def test_a_process_memrec_never_saw_bind_a_context_held_its_memory_before_recording():
    rec = reconcile(context_trace())
    row = next(r for r in rec.gpu_summary(0).to_json()["processes"] if r["pid"] == 2)
    assert row["split"] == {"context": 0, "module_code": 0, "pools": 0, "limits": 0, "graph": 0, "multicast": 0,
                            "before_recording": 300 * MiB, "unexplained": 0}
    # AND the GPU's split is its processes'
    assert rec.gpu_summary(0).device is None  # no device samples in this trace


def pool_events() -> np.ndarray:
    """pid 3: the default pool told to keep everything, two blocks, one freed, part of it reused,
    then trimmed; a pool of its own with threshold 0 (a freed block goes back); then the exit."""
    return events(
        ev(Kind.POOL, api=Api.cuDeviceGetDefaultMemPool, pid=3, gpu=0, handle=0xD0, ts=1 * S),
        ev(Kind.POOL_ATTR, pid=3, handle=0xD0, aux=4, size=2**64 - 1, ts=int(1.1 * S)),
        ev(Kind.ALLOC, api=Api.cuMemAllocAsync, pid=3, gpu=0, ptr=0xA, size=64 * MiB, ts=2 * S),
        ev(Kind.ALLOC, api=Api.cuMemAllocAsync, pid=3, gpu=0, ptr=0xB, size=64 * MiB, ts=int(2.1 * S)),
        ev(Kind.FREE, api=Api.cuMemFreeAsync, pid=3, gpu=0, ptr=0xA, ts=3 * S),
        ev(Kind.ALLOC, api=Api.cuMemAllocAsync, pid=3, gpu=0, ptr=0xC, size=32 * MiB, ts=4 * S),
        ev(Kind.POOL_TRIM, pid=3, handle=0xD0, size=0, ts=5 * S),
        ev(Kind.POOL, api=Api.cuMemPoolCreate, pid=3, gpu=0, handle=0xE0, ts=6 * S),
        ev(Kind.ALLOC, api=Api.cuMemAllocFromPoolAsync, pid=3, gpu=0, ptr=0xD, size=16 * MiB, handle=0xE0,
           ts=int(6.1 * S)),
        ev(Kind.FREE, api=Api.cuMemFreeAsync, pid=3, gpu=0, ptr=0xD, ts=int(6.2 * S)),
        ev(Kind.POOL_ATTR, pid=3, handle=0xE0, aux=4, size=8 * MiB, ts=7 * S),
        ev(Kind.FREE, api=Api.cuMemFreeAsync, pid=3, gpu=0, ptr=0xB, ts=8 * S),
        ev(Kind.PROC_EXIT, api=Api.sched_process_exit, pid=3, ts=9 * S),
    )


def test_pool_model_keeps_freed_blocks_up_to_the_threshold_until_a_trim():
    # WHEN the pool model replays the events
    ts, held = pool_held(pool_events())[(0, 3)]
    # THEN: the freed 64 MiB kept; half reused; trimmed; the own pool gives back (threshold 0);
    # the default pool keeps the last block; the exit takes it all
    assert [(t / S, h // MiB) for t, h in zip(ts.tolist(), held.tolist())] == [
        (3.0, 64), (4.0, 32), (5.0, 0), (8.0, 64), (9.0, 0),
    ]


def test_pool_held_bytes_are_shown_as_pools_not_unexplained():
    # GIVEN NVML showing the pool keeping the freed block
    trace = Trace(header={}, events=pool_events(), procmem=procmem(
        (1.5, 0, 3, 500 * MiB), (2.5, 0, 3, 628 * MiB), (3.5, 0, 3, 628 * MiB), (4.5, 0, 3, 628 * MiB),
        (5.5, 0, 3, 596 * MiB),
    ))
    rec = reconcile(trace)
    sp = rec.splits[(0, 3)]
    # THEN the kept bytes are pools, nothing is unexplained
    assert (sp.pools // MiB).tolist() == [0, 0, 64, 32, 0]
    assert sp.unexplained.tolist() == [0] * 5


def test_a_context_on_a_gpu_the_process_allocates_nothing_on_is_foreign():
    trace = Trace(header={}, events=events(
        ev(Kind.CTX, api=Api.cuDevicePrimaryCtxRetain, pid=4, gpu=0, handle=0xC0, ts=1 * S),
        ev(Kind.ALLOC, pid=4, gpu=0, ptr=0x1, size=MiB, ts=2 * S),
        ev(Kind.CTX, api=Api.cuDevicePrimaryCtxRetain, pid=4, gpu=1, handle=0xC1, ts=3 * S),
        ev(Kind.CTX, api=Api.cuDevicePrimaryCtxRetain, pid=4, gpu=1, handle=0xC1, ts=4 * S),  # retained again
    ), procmem=procmem((3.5, 1, 4, 500 * MiB)))
    rec = reconcile(trace)
    assert [(c.gpu, c.foreign, c.cost) for c in rec.contexts] == [(0, False, None), (1, True, 500 * MiB)]
    assert rec.gpu_summary(1).contexts[0].foreign is True


# ------------------------------------------------------------------------------ daemon readings


class FakeNvml:
    def __init__(self) -> None:
        self.calls: list[tuple[list[int], int]] = []

    def process_memory(self, indices: list[int], now: int) -> np.ndarray:
        self.calls.append((indices, now))
        return np.array([(now, g, 7, 100) for g in indices], dtype=PROCMEM_DTYPE)


def stamped(*rows: np.ndarray) -> np.ndarray:
    out = with_gpu(np.concatenate(rows), -1)
    out["gpu"] = out["ordinal"]
    return out


def test_readings_around_binds_are_forced_and_steps_are_deferred_never_dropped():
    # GIVEN readings with a 20 ms rate limit and a 250 ms follow-up, on a clock the test moves
    nvml, written, now = FakeNvml(), [], [10 * S]
    r = UntracedReadings(nvml, [0, 1], written.append, lambda: now[0], fetch_interval=0.02)

    # WHEN a context is about to be bound on GPU 1, THEN NVML is read for GPU 1 at once
    r.after_batch(stamped(raw(Kind.CTX_BEGIN, api=Api.cuDevicePrimaryCtxRetain, ordinal=1)))
    assert nvml.calls == [([1], 10 * S)]
    # WHEN two kernels load on GPU 1 five ms apart, THEN the second reading waits for the limit
    now[0] += 5_000_000
    r.after_batch(stamped(raw(Kind.KERNEL_LOAD, ordinal=1)))
    assert len(nvml.calls) == 1
    now[0] += 20_000_000
    r.tick(now[0])
    assert nvml.calls[-1] == ([1], now[0])
    # AND a follow-up reading comes 250 ms after the step
    now[0] += 250_000_000
    r.tick(now[0])
    assert len(nvml.calls) == 3 and nvml.calls[-1][0] == [1]
    # WHEN a library loads before any context (GPU unknown), THEN every GPU is read
    now[0] += S
    r.after_batch(stamped(raw(Kind.CODE_LOAD, ordinal=-1)))
    assert nvml.calls[-1][0] == [0, 1]
    # WHEN only stream-ordered allocations come, THEN readings are at most every 100 ms
    now[0] += S
    r.tick(now[0])  # the code load's follow-up
    now[0] += S
    n = len(nvml.calls)
    for _ in range(5):
        now[0] += 10_000_000
        r.after_batch(stamped(raw(Kind.ALLOC, api=Api.cuMemAllocAsync, ordinal=0)))
        r.tick(now[0])
    assert len(nvml.calls) == n + 1  # the first; the next is due 100 ms after it
    now[0] += 60_000_000
    r.tick(now[0])
    assert len(nvml.calls) == n + 2 and nvml.calls[-1][0] == [0]
    # AND a failed call, a synchronous allocation and cuCtxGetDevice read nothing
    now[0] += S
    r.tick(now[0])  # the follow-ups
    n = len(nvml.calls)
    now[0] += S
    r.after_batch(stamped(raw(Kind.KERNEL_LOAD, ordinal=0, result=1), raw(Kind.ALLOC, ordinal=0),
                          raw(Kind.CTX, api=Api.cuCtxGetDevice, ordinal=0, aux=2)))
    assert len(nvml.calls) == n
    assert all(len(rows) for rows in written)


def test_limits_graphs_arrays_and_multicast_calls_are_read_at_once():
    # GIVEN a reading just taken for a kernel load on GPU 0 (the next one rate-limited)
    nvml, now = FakeNvml(), [10 * S]
    r = UntracedReadings(nvml, [0, 1], lambda rows: None, lambda: now[0])
    r.after_batch(stamped(raw(Kind.KERNEL_LOAD, ordinal=0)))
    assert len(nvml.calls) == 1
    # WHEN each rare call comes 1 ms after the last, THEN each is read at once
    for kind in (Kind.CTX_LIMIT, Kind.GRAPH_EXEC, Kind.GRAPH_TRIM, Kind.ARRAY_CREATE, Kind.MULTICAST_CREATE):
        now[0] += 1_000_000
        r.after_batch(stamped(raw(kind, ordinal=0)))
        assert nvml.calls[-1] == ([0], now[0])
    assert len(nvml.calls) == 6
    # AND a failed one is not
    now[0] += 1_000_000
    r.after_batch(stamped(raw(Kind.CTX_LIMIT, ordinal=0, result=1)))
    assert len(nvml.calls) == 6
    # AND kernel loads wait 200 ms after the last reading
    r.after_batch(stamped(raw(Kind.KERNEL_LOAD, ordinal=0)))
    assert len(nvml.calls) == 6


def test_the_first_kernel_fetched_after_a_bind_is_read_at_once():
    # GIVEN a context bound on GPU 0 (read at once)
    nvml, now = FakeNvml(), [10 * S]
    r = UntracedReadings(nvml, [0, 1], lambda rows: None, lambda: now[0])
    r.after_batch(stamped(raw(Kind.CTX, api=Api.cuDevicePrimaryCtxRetain, ordinal=0, pid=7)))
    assert len(nvml.calls) == 1
    # WHEN its first kernel is fetched 5 ms later, THEN NVML is read at once (the context's step)
    now[0] += 5_000_000
    r.after_batch(stamped(raw(Kind.KERNEL_LOAD, ordinal=0, pid=7)))
    assert nvml.calls[-1] == ([0], now[0])
    # AND the second waits for the rate limit (module code)
    now[0] += 5_000_000
    r.after_batch(stamped(raw(Kind.KERNEL_LOAD, ordinal=0, pid=7)))
    assert len(nvml.calls) == 2


def test_readings_are_off_without_a_process_memory_query():
    r = UntracedReadings(object(), [0], lambda rows: None, lambda: 0)
    assert not r.enabled
    r.after_batch(stamped(raw(Kind.CTX, api=Api.cuDevicePrimaryCtxRetain, ordinal=0)))


def test_expected_failures_of_code_calls_are_not_failed_calls():
    # GIVEN what an H200 shows at a process's exit (every library unloaded after the driver shut
    # down: CUDA_ERROR_DEINITIALIZED) and NCCL's kernels without a binary for the GPU, beside a
    # module load that ran out of memory
    from memrec.analysis.report.build import build_report

    trace = Trace(header={}, events=events(
        ev(Kind.CTX, api=Api.cuDevicePrimaryCtxRetain, pid=5, gpu=0, handle=0xC0, ts=1 * S),
        ev(Kind.KERNEL_LOAD, api=Api.cuLibraryGetKernel, pid=5, gpu=0, result=209, ts=2 * S),
        ev(Kind.CODE_LOAD, api=Api.cuModuleLoadData, pid=5, gpu=0, result=2, ts=3 * S),
        *[ev(Kind.CODE_UNLOAD, api=Api.cuLibraryUnload, pid=5, gpu=0, handle=h, result=4, ts=int((4 + h / 10) * S))
          for h in range(1, 6)],
    ))
    # WHEN reported
    report = build_report(trace).to_json()
    # THEN only the out-of-memory load is a failed call
    assert report["trace"]["failed_calls"] == 1
    (failure,) = report["gpus"][0]["failures"]
    assert (failure["api"], failure["result_name"]) == ("cuModuleLoadData", "CUDA_ERROR_OUT_OF_MEMORY")
