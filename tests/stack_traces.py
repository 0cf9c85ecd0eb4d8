"""Traces with stacks (format 2.3) written through the real writer, for the tests of every view:
two ranks of an SGLang-like start-up whose allocations carry Python and native frames."""

from __future__ import annotations

from pathlib import Path

from memrec.terms.events import GpuInfo
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace import format as fmt
from memrec.trace.stacks import Frame
from memrec.trace.stacks import Unavailable
from memrec.trace.writer import TraceWriter
from tests.utils import GiB
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events

S = 10**9
T0 = 1000 * S
SP = "/opt/venv/lib/python3.12/site-packages"

_DRIVER = Frame("/usr/lib/x86_64-linux-gnu/libcuda.so.1", 0x2A1F0, "cuMemAlloc_v2", native=True)
_TORCH = (Frame(f"{SP}/torch/cuda/memory.py", 540, "caching_allocator_alloc"),
          Frame(f"{SP}/torch/utils/_contextlib.py", 116, "decorate_context"))
_STDLIB = (Frame("/usr/lib/python3.12/threading.py", 1010, "Thread.run"),
           Frame("<frozen runpy>", 88, "_run_code"))

#: custom all-reduce's buffers: the site every view must name.
CUSTOM_AR = (_DRIVER, *_TORCH, Frame(f"{SP}/sglang/srt/distributed/device_communicators/custom_all_reduce.py", 123,
                                     "CustomAllreduce.__init__"),
             Frame(f"{SP}/sglang/srt/distributed/parallel_state.py", 310, "init_model_parallel_group"), *_STDLIB)
WEIGHTS = (_DRIVER, *_TORCH, Frame(f"{SP}/sglang/srt/model_loader/loader.py", 377, "DefaultModelLoader.load_model"),
           Frame(f"{SP}/sglang/srt/model_executor/model_runner.py", 88, "ModelRunner.load_model"), *_STDLIB)
SCRATCH = (_DRIVER, Frame(f"{SP}/sglang/srt/model_loader/weight_utils.py", 51, "scratch_buffer"), *_STDLIB)
KV_POOL = (_DRIVER, *_TORCH, Frame(f"{SP}/sglang/srt/mem_cache/memory_pool.py", 210, "MHATokenToKVPool._create_buffers"))
TENSOR = (Frame(f"{SP}/torch/nn/modules/module.py", 1340, "Module.to"),
          Frame(f"{SP}/sglang/srt/models/llama.py", 402, "LlamaForCausalLM.load_weights"))
UNREADABLE = Unavailable("python 3.9: interpreter layout unknown")

RANKS = {100: 0, 101: 1}


def sglang_trace(path: Path, *, custom_ar: int = 18 * GiB, weights: int = 40 * GiB, fail: bool = False,
                 host: str = "h", stacks: bool = True, tensors: bool = True) -> Path:
    """Two ranks (pid 100 on GPU 0, 101 on GPU 1): ``load_weights`` (weights, a scratch buffer
    freed inside the phase, tensor blocks), ``custom_ar_init`` (``custom_ar`` bytes each), then
    ``kv_pool`` (an out-of-memory with ``fail``). ``stacks=False``: the same without stacks;
    ``tensors=False``: without the tensor blocks."""
    header = fmt.make_header(host=host, boot_id="boot", anchor={"monotonic_ns": T0, "wall_ns": 1_764_000_000 * S},
                             gpus=[GpuInfo(g, f"GPU-{g}", "NVIDIA H200", 140 * GiB) for g in (0, 1)])
    with TraceWriter(path, header) as w:
        def sid(stack) -> int:
            return w.intern_stack(stack) if stacks else 0

        rows = []
        for pid, rank in RANKS.items():
            gpu = rank
            base = T0 + rank * 10**6
            w.write_process(ProcessInfo(pid, 1, ["python", "-m", "sglang.launch_server"], None, str(gpu), [gpu], base,
                                        rank={"tp": rank}))

            def mark(name: str, phase: str, at: float) -> None:
                w.write_marker(Marker(ts=base + int(at * S), pid=pid, uid=0, tid=pid, name=name, phase=phase, gpu=gpu,
                                      values={"tp_rank": rank} if phase == "begin" else {}))

            mark("load_weights", "begin", 1)
            mark("load_weights", "end", 3)
            mark("custom_ar_init", "begin", 4)
            mark("custom_ar_init", "end", 5)
            mark("kv_pool", "begin", 6)
            mark("kv_pool", "end", 7)
            ptr = 0x7F00_0000_0000 + rank * 0x100_0000_0000
            rows += [
                ev(Kind.ALLOC, ts=base + int(1.5 * S), pid=pid, tid=pid, gpu=gpu, ptr=ptr, size=weights, stack=sid(WEIGHTS)),
                ev(Kind.ALLOC, ts=base + int(1.6 * S), pid=pid, tid=pid, gpu=gpu, ptr=ptr + 0x40_0000_0000, size=2 * GiB,
                   stack=sid(SCRATCH)),
                ev(Kind.TENSOR_ALLOC, ts=base + int(1.7 * S), pid=pid, tid=pid, gpu=gpu, ptr=ptr, size=512 * MiB,
                   stack=sid(TENSOR)),
                ev(Kind.FREE, ts=base + int(2.5 * S), pid=pid, tid=pid, gpu=gpu, ptr=ptr + 0x40_0000_0000),
                ev(Kind.ALLOC, ts=base + int(4.5 * S), pid=pid, tid=pid + 1, gpu=gpu, ptr=ptr + 0x50_0000_0000,
                   size=custom_ar, stack=sid(CUSTOM_AR)),
                ev(Kind.ALLOC, ts=base + int(4.6 * S), pid=pid, tid=pid, gpu=gpu, ptr=ptr + 0x60_0000_0000, size=MiB,
                   stack=sid(UNREADABLE)),
                ev(Kind.ALLOC, ts=base + int(4.7 * S), pid=pid, tid=pid, gpu=gpu, ptr=ptr + 0x70_0000_0000, size=MiB),
            ]
            if fail:
                rows.append(ev(Kind.ALLOC, ts=base + int(6.5 * S), pid=pid, tid=pid, gpu=gpu, size=100 * GiB,
                               result=2, stack=sid(KV_POOL)))
        if not tensors:
            rows = [r for r in rows if int(r["kind"]) != int(Kind.TENSOR_ALLOC)]
        rows.sort(key=lambda r: int(r["ts"]))
        w.write_events(events(*rows))
    return path


def with_stacks(src: Path, dst: Path, stack_of_phase) -> Path:
    """``src`` (a recording, e.g. one of examples/) written again through the writer with a stack
    on each successful driver allocation: ``stack_of_phase(phase name)``'s (None: no stack). The
    rest (header, processes, markers, keyframes, samples, trailer) is copied as it is."""
    import numpy as np

    from memrec.engine.replay import trace_phases
    from memrec.trace.reader import load_trace

    trace = load_trace(src)
    events = trace.events.copy()
    phases = trace_phases(trace)
    names = [phases.label(int(i)).rsplit("/", 1)[-1] for i in phases.assign(events["pid"].astype(np.int64),
                                                                           events["ts"].astype(np.int64))]
    made = np.isin(events["kind"], (int(Kind.ALLOC), int(Kind.VMM_CREATE))) & (events["result"] == 0)
    header = {k: v for k, v in trace.header.items() if k not in ("magic", "version", "minor", "type", "columns")}
    with TraceWriter(dst, header) as w:
        for i in np.flatnonzero(made).tolist():
            stack = stack_of_phase(names[i])
            if stack is not None:
                events["stack"][i] = w.intern_stack(stack)
        for info in trace.processes.values():
            w.write_process(info)
        for marker in trace.markers:
            w.write_marker(marker)
        done = 0
        for kf in sorted(trace.keyframes, key=lambda k: k.event_index):
            w.write_events(events[done:kf.event_index])
            done = max(done, kf.event_index)
            w.write_keyframe(kf.ts, kf.event_index, kf.state)
        w.write_events(events[done:])
        w.write_nvml(trace.nvml)
        w.write_procmem(trace.procmem)
        if trace.lost:
            w.write_lost(int(events["ts"][-1]) if len(events) else 0, trace.lost)
        w.close({k: v for k, v in (trace.trailer or {}).items() if k not in ("counts", "event_kinds", "lost", "end_ts")})
    return dst
