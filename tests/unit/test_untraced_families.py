"""Issue 21: arrays, context limits, graph memory and multicast, attributed only by measurement.

Each test builds a trace of driver events and NVML per-process readings as the daemon records
them (readings bracket the calls; kernel and graph launches are never probed) and checks the
attribution per family, not only the totals.
"""

from __future__ import annotations

import numpy as np

from memrec.analysis.report.answer import build_answer
from memrec.analysis.untraced.reconcile import reconcile
from memrec.analysis.report.build import build_report
from memrec.analysis.untraced.split import explained_share
from memrec.terms.columns import PROCMEM_DTYPE
from memrec.terms.events import Api
from memrec.terms.events import Kind
from memrec.state import LiveState
from memrec.trace.model import Trace
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events

S = 1_000_000_000
GiB = 1 << 30
H200_THREADS = 132 * 2048
PTX = 120  # bytes of a one-line PTX module's text (the probe reads its length)


def procmem(*rows: tuple[float, int]) -> np.ndarray:
    """PROCMEM rows of (seconds, used) for pid 1 on GPU 0."""
    return np.array([(int(t * S), 0, 1, u) for t, u in rows], dtype=PROCMEM_DTYPE)


def header(threads: int | None) -> dict:
    return {"gpus": [{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H200", "total": 141 * GiB, "bar1_total": None,
                      "resident_threads": threads}]}


def context(t: float = 1.0) -> list:
    return [ev(Kind.CTX_BEGIN, api=Api.cuDevicePrimaryCtxRetain, pid=1, gpu=0, ordinal=0, ts=int(t * S)),
            ev(Kind.CTX, api=Api.cuDevicePrimaryCtxRetain, pid=1, gpu=0, ordinal=0, handle=0xC1, ts=int((t + 0.1) * S))]


def split_of(trace: Trace) -> dict:
    rec = reconcile(trace)
    row = next(r for r in rec.gpu_summary(0).to_json()["processes"] if r["pid"] == 1)
    sp, s = rec.splits[(0, 1)], rec.process(0, 1)
    total = sum(getattr(sp, name) for name in row["split"])
    assert (total == s.nvml_used - s.traced).all()  # the identity, at every sample
    return row


STACK_16K = (16384 - 1024) * H200_THREADS  # 3,960 MiB: what the H200 showed for 16 KiB


def module_then_stack_and_array(threads: int | None) -> Trace:
    """The issue's case: a context, a one-line PTX module, then at once a 16 KiB stack limit, an
    8192 x 8192 float array and a launch, all between two NVML readings."""
    return Trace(
        header=header(threads),
        events=events(
            *context(),
            ev(Kind.CODE_LOAD, api=Api.cuModuleLoadData, pid=1, gpu=0, handle=0x11, ptr=0x5000, size=PTX, ts=3 * S),
            ev(Kind.CTX_LIMIT, api=Api.cuCtxSetLimit, pid=1, gpu=0, aux=0, size=16384, ts=int(3.01 * S)),
            ev(Kind.ARRAY_CREATE, api=Api.cuArrayCreate_v2, pid=1, gpu=0, handle=0xA1, size=256 * MiB,
               ts=int(3.02 * S)),
        ),
        procmem=procmem(
            (1.05, 0), (1.2, 518 * MiB),  # the context
            (2.0, 518 * MiB),  # its first launch of a PTX kernel: +0 on the H200
            (3.5, 518 * MiB + 256 * MiB + STACK_16K),  # module + limit + array + launch in one interval
        ),
    )


def test_module_load_right_before_stack_and_array_is_not_module_code():
    row = split_of(module_then_stack_and_array(H200_THREADS))
    # THEN the array is traced (its descriptor's bytes), the stack is the limit's, the one-line
    # module is given nothing, and nothing is left unexplained
    assert row["traced_last"] == 256 * MiB
    assert row["split"]["module_code"] == 0
    assert row["split"]["limits"] == STACK_16K
    assert row["split"]["context"] == 518 * MiB
    assert row["split"]["unexplained"] == 0
    limit_steps = [s for s in row["steps"] if s["category"] == "limits"]
    assert [s["cause"] for s in limit_steps] == ["cuCtxSetLimit"]


def test_without_the_gpus_thread_count_the_stack_is_still_the_limits_within_its_bounds():
    row = split_of(module_then_stack_and_array(None))
    assert row["split"]["module_code"] == 0
    assert row["split"]["limits"] == STACK_16K
    assert row["split"]["unexplained"] == 0


def test_a_step_no_call_explains_stays_unexplained_however_close_to_a_module_load():
    # GIVEN the module load and then 4 GiB with no limit, array or graph behind it
    trace = Trace(
        header=header(H200_THREADS),
        events=events(
            *context(),
            ev(Kind.CODE_LOAD, api=Api.cuModuleLoadData, pid=1, gpu=0, handle=0x11, ptr=0x5000, size=PTX, ts=3 * S),
        ),
        procmem=procmem((1.05, 0), (1.2, 518 * MiB), (2.0, 518 * MiB), (3.1, 518 * MiB), (3.2, 518 * MiB + 4 * GiB)),
    )
    row = split_of(trace)
    # THEN it is unexplained, not module code (there was a 2.5 s window once)
    assert row["split"]["module_code"] == 0
    assert row["split"]["unexplained"] == 4 * GiB


def test_module_code_is_bounded_by_its_image_even_over_the_call():
    # GIVEN a 1 MiB image and a 4 GiB step over its load
    trace = Trace(
        header=header(H200_THREADS),
        events=events(
            *context(),
            ev(Kind.CODE_LOAD, api=Api.cuModuleLoadData, pid=1, gpu=0, handle=0x11, ptr=0x5000, size=1 * MiB, ts=3 * S),
        ),
        procmem=procmem((1.05, 0), (1.2, 518 * MiB), (2.0, 518 * MiB), (3.5, 518 * MiB + 4 * GiB)),
    )
    row = split_of(trace)
    # THEN the module may not explain it (4 x 1 MiB + 2 MiB at most): the whole step is unexplained
    assert row["split"]["module_code"] == 0
    assert row["split"]["unexplained"] == 4 * GiB


def test_the_heap_limit_explains_nothing_it_did_not_show():
    # GIVEN a 256 MiB heap limit (the H200 showed no step for it) and 256 MiB at a later module load
    trace = Trace(
        header=header(H200_THREADS),
        events=events(
            *context(),
            ev(Kind.CTX_LIMIT, api=Api.cuCtxSetLimit, pid=1, gpu=0, aux=2, size=256 * MiB, ts=2 * S),
            ev(Kind.CODE_LOAD, api=Api.cuModuleLoadData, pid=1, gpu=0, handle=0x11, ptr=0x5000, size=PTX, ts=3 * S),
        ),
        procmem=procmem((1.05, 0), (1.2, 518 * MiB), (2.1, 518 * MiB), (3.1, 518 * MiB + 256 * MiB)),
    )
    row = split_of(trace)
    # THEN neither the heap nor the one-line module is named: it is unexplained
    assert row["split"]["limits"] == 0 and row["split"]["module_code"] == 0
    assert row["split"]["unexplained"] == 256 * MiB


def test_a_lowered_stack_gives_back_at_the_call_and_a_raise_counts_from_there():
    # GIVEN 16 KiB (+3,960 MiB), back to 4 KiB (-3,168 MiB), then 32 KiB (+7,392 MiB), as the H200 showed
    trace = Trace(
        header=header(H200_THREADS),
        events=events(
            *context(),
            ev(Kind.CTX_LIMIT, api=Api.cuCtxSetLimit, pid=1, gpu=0, aux=0, size=16384, ts=2 * S),
            ev(Kind.CTX_LIMIT, api=Api.cuCtxSetLimit, pid=1, gpu=0, aux=0, size=4096, ts=3 * S),
            ev(Kind.CTX_LIMIT, api=Api.cuCtxSetLimit, pid=1, gpu=0, aux=0, size=32768, ts=4 * S),
        ),
        procmem=procmem((1.05, 0), (1.2, 518 * MiB), (2.1, 4478 * MiB), (3.1, 1310 * MiB), (4.1, 8702 * MiB)),
    )
    row = split_of(trace)
    assert [s["bytes"] // MiB for s in row["steps"] if s["category"] == "limits"] == [3960, -3168, 7392]
    assert row["split"]["unexplained"] == 0


def graph_trace() -> Trace:
    """A 512 MiB cuMemAllocAsync captured and freed in a graph, instantiated (+2 MiB), launched
    (+512 MiB: the graph pool, no call), trimmed (-514 MiB)."""
    return Trace(
        header=header(H200_THREADS),
        events=events(
            *context(),
            ev(Kind.CAPTURE_BEGIN, api=Api.cuStreamBeginCapture_v2, pid=1, gpu=0, handle=0x5A, ts=2 * S),
            ev(Kind.GRAPH_ALLOC, api=Api.cuMemAllocAsync, pid=1, gpu=0, ptr=0x9000, size=512 * MiB, handle=0x5A,
               ts=int(2.1 * S)),
            ev(Kind.GRAPH_FREE, api=Api.cuMemFreeAsync, pid=1, gpu=0, ptr=0x9000, handle=0x5A, ts=int(2.2 * S)),
            ev(Kind.CAPTURE_END, api=Api.cuStreamEndCapture, pid=1, gpu=0, handle=0x5A, ptr=0x6A, ts=int(2.3 * S)),
            ev(Kind.GRAPH_EXEC, api=Api.cuGraphInstantiateWithFlags, pid=1, gpu=0, ptr=0x6A, handle=0xE1, ts=3 * S),
            ev(Kind.GRAPH_TRIM, api=Api.cuDeviceGraphMemTrim, pid=1, gpu=0, ts=6 * S),
        ),
        procmem=procmem((1.05, 0), (1.2, 518 * MiB), (2.0, 518 * MiB), (2.5, 518 * MiB), (3.1, 520 * MiB),
                        (5.0, 1032 * MiB), (6.1, 518 * MiB)),
    )


def test_captured_allocations_are_graph_owned_and_the_pool_is_graph_memory():
    trace = graph_trace()
    # THEN the captured allocation is never held (the state does not count graph-owned memory)
    state = LiveState()
    state.apply(trace.events.copy())
    assert state.owned_bytes(gpu=0) == 0
    row = split_of(trace)
    graph_steps = [(s["bytes"], s["cause"]) for s in row["steps"] if s["category"] == "graph"]
    # AND the instantiate's 2 MiB, the first launch's 512 MiB and the trim's -514 MiB are graph memory
    assert graph_steps == [(2 * MiB, "cuGraphInstantiateWithFlags"), (512 * MiB, "cuGraphInstantiateWithFlags"),
                           (-514 * MiB, "cuDeviceGraphMemTrim")]
    assert row["split"]["unexplained"] == 0


def test_a_step_two_pending_costs_could_both_hold_stays_unexplained():
    # GIVEN an instantiated graph of 512 MiB and a stack raise on a GPU of unknown thread count:
    # a 400 MiB step fits only the graph; a 6 GiB one only the stack; 1.5 GiB fits neither
    trace = graph_trace()
    ev_ = list(trace.events[:7]) + [ev(Kind.CTX_LIMIT, api=Api.cuCtxSetLimit, pid=1, gpu=0, aux=0, size=2048,
                                       ts=int(3.05 * S))]
    t = Trace(header=header(None), events=events(*ev_),
              procmem=procmem((1.05, 0), (1.2, 518 * MiB), (2.0, 518 * MiB), (3.1, 520 * MiB), (4.0, 520 * MiB + 400 * MiB)))
    row = split_of(t)
    # (a 2 KiB stack costs at least 1 KiB x 16k threads = 16 MiB and at most 2 KiB x 512k = 1 GiB:
    # a 400 MiB step fits both the graph and the stack)
    assert row["split"]["unexplained"] == 400 * MiB
    assert row["split"]["graph"] == 2 * MiB and row["split"]["limits"] == 0


def test_multicast_steps_over_multicast_calls_are_multicast():
    trace = Trace(
        header=header(H200_THREADS),
        events=events(
            *context(),
            ev(Kind.MULTICAST_CREATE, api=Api.cuMulticastCreate, pid=1, gpu=0, handle=0x3C, size=512 * MiB, aux=1,
               ts=3 * S),
            ev(Kind.MULTICAST_ADD, api=Api.cuMulticastAddDevice, pid=1, gpu=0, handle=0x3C, aux=0, ts=int(3.1 * S)),
        ),
        procmem=procmem((1.05, 0), (1.2, 518 * MiB), (2.9, 518 * MiB), (3.2, 518 * MiB + 64 * MiB)),
    )
    row = split_of(trace)
    assert row["split"]["multicast"] == 64 * MiB
    assert row["split"]["unexplained"] == 0


def test_arrays_are_traced_in_their_own_category_and_freed_at_destroy_or_exit():
    state = LiveState()
    state.apply(events(
        ev(Kind.ARRAY_CREATE, api=Api.cuArrayCreate_v2, pid=1, gpu=0, handle=0xA1, size=256 * MiB, ts=1 * S),
        ev(Kind.ARRAY_CREATE, api=Api.cuMipmappedArrayCreate, pid=1, gpu=0, handle=0xA2, size=86 * MiB, ts=2 * S),
    ))
    assert state.owned_bytes(gpu=0, category="array") == 342 * MiB
    assert state.owned_bytes(gpu=0, category="driver") == 0
    state.apply(events(ev(Kind.ARRAY_DESTROY, api=Api.cuArrayDestroy, pid=1, handle=0xA1, ts=3 * S)))
    assert state.owned_bytes(gpu=0, category="array") == 86 * MiB
    state.apply(events(ev(Kind.PROC_EXIT, api=Api.sched_process_exit, pid=1, ts=4 * S)))
    assert state.owned_bytes(gpu=0) == 0


def test_under_98_percent_explained_the_answer_says_how_much_is_unexplained_not_a_cause():
    # GIVEN a process with 4 GiB that no call explains
    trace = Trace(
        header=header(H200_THREADS),
        events=events(*context(), ev(Kind.ALLOC, pid=1, gpu=0, ptr=0x1000, size=1 * GiB, ts=2 * S)),
        procmem=procmem((1.05, 0), (1.2, 518 * MiB), (2.5, 518 * MiB + 1 * GiB), (3.0, 518 * MiB + 5 * GiB)),
    )
    report = build_report(trace)
    row = next(r for r in report.gpus[0].reconciliation.to_json()["processes"] if r["pid"] == 1)
    assert round(row["explained_share"], 3) == round(1 - 4 * GiB / (518 * MiB + 5 * GiB), 3)
    assert abs(report.gpus[0].reconciliation.explained_share - row["explained_share"]) < 1e-9  # one process
    lines = build_answer(report).to_json()["lines"]
    assert ["UNTRACED", "GPU 0: 4.00 GiB (73 %) of pid 1's memory is unexplained"] in lines
    # AND explained_share is traced + explained over NVML used
    assert explained_share(100, 50, {"context": 48, "unexplained": 2}) == 0.98


def test_a_reading_taken_while_a_call_runs_is_that_calls_step():
    # GIVEN a kernel fetch that began at 3.0 s (its entry time in aux) and returned at 3.2 s, and a
    # reading at 3.1 s that already shows its 90 MiB
    trace = Trace(
        header=header(H200_THREADS),
        events=events(
            *context(),
            ev(Kind.CODE_LOAD, api=Api.cuLibraryLoadData, pid=1, gpu=0, handle=0x11, ptr=0x5000, ts=2 * S),
            ev(Kind.KERNEL_LOAD, api=Api.cuLibraryGetKernel, pid=1, gpu=0, handle=0x21, ptr=0x11, aux=3 * S,
               ts=int(3.2 * S)),
        ),
        procmem=procmem((1.05, 0), (1.2, 518 * MiB), (2.5, 518 * MiB), (3.1, 608 * MiB), (3.3, 608 * MiB)),
    )
    row = split_of(trace)
    # THEN the step is the fetch's (the first kernel in the context: the context's), not unexplained
    assert row["split"]["context"] == 608 * MiB and row["split"]["unexplained"] == 0


def test_the_h200_mixed_run_is_attributed_in_full():
    # GIVEN the steps NVML showed on the H200 for family_workloads' "mixed" scenario
    # (docs/validation/runs/2026-12-01-families/families-tests.log): a context (14 + 504 MiB), a
    # 4096^2 float array and a 256 MiB graph captured and instantiated; then in one interval an
    # 8 KiB stack limit, the graph's first launch and a kernel launch (+2,104 MiB); a 512x512x64
    # array; the first array destroyed, the graph trimmed (-256 MiB)
    stack = (8192 - 1024) * H200_THREADS
    trace = Trace(
        header=header(H200_THREADS),
        events=events(
            *context(),
            ev(Kind.CODE_LOAD, api=Api.cuModuleLoadData, pid=1, gpu=0, handle=0x11, ptr=0x5000, size=PTX, ts=2 * S),
            ev(Kind.ARRAY_CREATE, api=Api.cuArrayCreate_v2, pid=1, gpu=0, handle=0xA1, size=64 * MiB, ts=int(2.1 * S)),
            ev(Kind.CAPTURE_BEGIN, api=Api.cuStreamBeginCapture_v2, pid=1, gpu=0, handle=0x5A, ts=int(2.2 * S)),
            ev(Kind.GRAPH_ALLOC, api=Api.cuMemAllocAsync, pid=1, gpu=0, ptr=0x9000, size=256 * MiB, handle=0x5A,
               ts=int(2.21 * S)),
            ev(Kind.GRAPH_FREE, api=Api.cuMemFreeAsync, pid=1, gpu=0, ptr=0x9000, handle=0x5A, ts=int(2.22 * S)),
            ev(Kind.CAPTURE_END, api=Api.cuStreamEndCapture, pid=1, gpu=0, handle=0x5A, ptr=0x6A, ts=int(2.23 * S)),
            ev(Kind.GRAPH_EXEC, api=Api.cuGraphInstantiateWithFlags, pid=1, gpu=0, ptr=0x6A, handle=0xE1,
               ts=int(2.24 * S)),
            ev(Kind.CTX_LIMIT, api=Api.cuCtxSetLimit, pid=1, gpu=0, aux=0, size=8192, ts=3 * S),
            ev(Kind.CTX_LIMIT, api=Api.cuCtxSetLimit, pid=1, gpu=0, aux=2, size=128 * MiB, ts=4 * S),
            ev(Kind.CODE_LOAD, api=Api.cuModuleLoadData, pid=1, gpu=0, handle=0x12, ptr=0x5000, size=PTX, ts=int(4.01 * S)),
            ev(Kind.ARRAY_CREATE, api=Api.cuArray3DCreate_v2, pid=1, gpu=0, handle=0xA2, size=64 * MiB, ts=int(4.02 * S)),
            ev(Kind.ARRAY_DESTROY, api=Api.cuArrayDestroy, pid=1, gpu=0, handle=0xA1, ts=5 * S),
            ev(Kind.GRAPH_TRIM, api=Api.cuDeviceGraphMemTrim, pid=1, gpu=0, ts=int(5.01 * S)),
        ),
        procmem=procmem((1.05, 14 * MiB), (1.2, 518 * MiB), (2.5, 582 * MiB), (3.1, 582 * MiB + stack + 256 * MiB),
                        (4.5, 646 * MiB + stack + 256 * MiB), (5.5, 582 * MiB + stack)),
    )
    row = split_of(trace)
    # THEN the stack is the limit's, the graph's launch and trim the graph's, nothing unexplained
    assert row["split"] == {"context": 518 * MiB, "module_code": 0, "pools": 0, "limits": stack, "graph": 0,
                            "multicast": 0, "before_recording": 0, "unexplained": 0}
    assert [s["bytes"] // MiB for s in row["steps"] if s["category"] == "graph"] == [256, -256]


def fast_context_run(later: float) -> Trace:
    """family_workloads' "fast_context" as the H200 logged it (runs/2026-12-01-lead-final/families.log,
    pid 836): the reading after the bind is stamped at 1.15 s, but NVML answered after the module
    load, the 16 KiB stack limit, the 8192^2 array and the launch (stamped from 1.16 s) had run:
    it showed 518 MiB + the stack + the array, 4.62 GiB; the next reading (the limit's) the same."""
    return Trace(
        header=header(H200_THREADS),
        events=events(
            *context(),
            ev(Kind.CODE_LOAD, api=Api.cuModuleLoadData, pid=1, gpu=0, handle=0x11, ptr=0x5000, size=PTX,
               ts=int(1.16 * S)),
            ev(Kind.CTX_LIMIT, api=Api.cuCtxSetLimit, pid=1, gpu=0, aux=0, size=16384, ts=int(1.17 * S)),
            ev(Kind.ARRAY_CREATE, api=Api.cuArrayCreate_v2, pid=1, gpu=0, handle=0xA1, size=256 * MiB,
               ts=int(1.18 * S)),
        ),
        procmem=procmem((1.05, 14 * MiB), (1.15, 518 * MiB + STACK_16K + 256 * MiB),
                        (later, 518 * MiB + STACK_16K + 256 * MiB), (later + 0.5, 518 * MiB + STACK_16K + 256 * MiB)),
    )


def test_a_reading_that_ran_ahead_of_its_stamp_gives_no_family_anothers_bytes():
    # GIVEN the logged fast_context sequence (the reading after the bind showed the calls after it)
    rec = reconcile(fast_context_run(1.2))
    row = split_of(fast_context_run(1.2))
    # THEN the context is the context's 518 MiB, the stack the limit's, nothing negative anywhere
    assert row["split"] == {"context": 518 * MiB, "module_code": 0, "pools": 0, "limits": STACK_16K, "graph": 0,
                            "multicast": 0, "before_recording": 0, "unexplained": 0}
    sp = rec.splits[(0, 1)]
    for name in ("context", "module_code", "limits", "graph", "multicast", "unexplained"):
        assert (getattr(sp, name) >= 0).all(), name
    # AND at the reading that ran ahead, its step is held unexplained (no family named) until the
    # next reading brackets the calls it showed
    assert int(sp.unexplained[1]) == 504 * MiB + STACK_16K + 256 * MiB
    assert int(sp.context[1]) == 14 * MiB and int(sp.limits[1]) == 0


def test_a_drop_no_bracketed_family_holds_stays_unexplained():
    # GIVEN 100 MiB NVML let go between two readings bracketing only a stack limit never placed
    trace = Trace(
        header=header(H200_THREADS),
        events=events(*context(), ev(Kind.CTX_LIMIT, api=Api.cuCtxSetLimit, pid=1, gpu=0, aux=0, size=4096,
                                     ts=3 * S)),
        procmem=procmem((1.05, 14 * MiB), (1.2, 618 * MiB), (3.5, 518 * MiB)),
    )
    row = split_of(trace)
    # THEN the limits never go negative: the drop is unexplained, the context keeps its bytes
    assert row["split"]["limits"] == 0 and row["split"]["context"] == 618 * MiB
    assert row["split"]["unexplained"] == -100 * MiB


def test_a_bind_running_across_readings_brackets_each_of_them():
    # GIVEN the H200's CUDA_MODULE_LOADING=EAGER context (runs/2026-12-01-truth2/gpu.log, pid 1137):
    # the retain loads every module inside it, and two readings fall while it runs (724 MiB, then
    # 1,184 MiB with no call returning between them); the retain returns after both
    trace = Trace(
        header=header(H200_THREADS),
        events=events(
            ev(Kind.CTX_BEGIN, api=Api.cuDevicePrimaryCtxRetain, pid=1, gpu=0, ordinal=0, ts=1 * S),
            ev(Kind.CTX, api=Api.cuDevicePrimaryCtxRetain, pid=1, gpu=0, ordinal=0, handle=0xC1, ts=int(2.0 * S)),
        ),
        procmem=procmem((1.05, 14 * MiB), (1.5, 724 * MiB), (1.9, 1184 * MiB), (2.1, 1184 * MiB)),
    )
    row = split_of(trace)
    # THEN every interval the bind spans is the context's, none unexplained
    assert row["split"]["context"] == 1184 * MiB and row["split"]["unexplained"] == 0
    assert {s["cause"] for s in row["steps"]} == {"cuDevicePrimaryCtxRetain"}


def test_a_pool_destroy_gives_back_only_what_the_pools_hold():
    # GIVEN the H200's NCCL rank (runs/2026-12-02-truth3/gpu-tests.log, nccl-cumem1): a pool created,
    # 20 MiB arriving with no call to explain it, then the pool destroyed and NVML 6 MiB lower,
    # while the pool model held nothing (no block went through it)
    trace = Trace(
        header=header(H200_THREADS),
        events=events(*context(),
                      ev(Kind.POOL, api=Api.cuMemPoolCreate, pid=1, gpu=0, handle=0xE0, ts=int(1.15 * S)),
                      ev(Kind.POOL_DESTROY, api=Api.cuMemPoolDestroy, pid=1, handle=0xE0, ts=4 * S)),
        procmem=procmem((1.05, 14 * MiB), (1.2, 518 * MiB), (3.0, 538 * MiB), (4.5, 532 * MiB)),
    )
    row = split_of(trace)
    # THEN the pools never go negative: the drop is the unexplained step's, not the pools'
    assert row["split"]["pools"] == 0
    assert row["split"]["unexplained"] == 14 * MiB and row["split"]["context"] == 518 * MiB


def test_a_pool_destroy_gives_back_what_its_steps_put_on_the_pools():
    # GIVEN 24 MiB put on a pool call, then the pool destroyed and NVML 30 MiB lower
    trace = Trace(
        header=header(H200_THREADS),
        events=events(*context(),
                      ev(Kind.POOL, api=Api.cuMemPoolCreate, pid=1, gpu=0, handle=0xE0, ts=2 * S),
                      ev(Kind.POOL_DESTROY, api=Api.cuMemPoolDestroy, pid=1, handle=0xE0, ts=4 * S)),
        procmem=procmem((1.05, 14 * MiB), (1.2, 518 * MiB), (2.5, 542 * MiB), (4.5, 512 * MiB)),
    )
    row = split_of(trace)
    # THEN the pools give back their 24 MiB and the 6 MiB past that stay unexplained
    assert row["split"]["pools"] == 0 and row["split"]["unexplained"] == -6 * MiB


def test_a_small_drop_with_no_call_to_explain_it_is_unexplained():
    # GIVEN NVML 1 MiB lower (under the 2 MiB tolerance) with no call in the interval
    trace = Trace(
        header=header(H200_THREADS),
        events=events(*context()),
        procmem=procmem((1.05, 14 * MiB), (1.2, 518 * MiB), (3.0, 518 * MiB), (5.0, 517 * MiB)),
    )
    row = split_of(trace)
    # THEN the drop is the unexplained step's (no family gives back what no call brackets)
    assert row["split"]["unexplained"] == -1 * MiB and row["split"]["context"] == 518 * MiB
