"""A stand-in for an SGLang TP server's startup, with real CUDA, for the SGLang worked example.

SGLang itself cannot run on the project's GPU host (no package registry there, and it pins
another torch), so this PyTorch program walks the same startup phases as an SGLang TP worker and
sends the same markers the memrec SGLang hooks send, with the values SGLang would measure:

    dist_init -> memory_baseline (pre_model_load_memory = MIN free over ranks)
    -> load_weights -> [custom_ar_init: all-reduce-style buffers exchanged by CUDA IPC]
    -> kv_budget (rest = available - pre * (1 - mem_fraction_static), SGLang's formula)
    -> kv_pool -> cuda_graph_capture

Run as ``python -m memrec.validation.gpu.sglang_standin [--ipc] --tp 2``. Every rank runs on GPU
``rank % device_count`` (on a one-GPU host all ranks share it, which the docs say). With
``--ipc`` each rank allocates a shared buffer after the baseline and opens every peer's buffer
by CUDA IPC (through torch.multiprocessing), the way a lazily created custom all-reduce
workspace would; the KV budget then comes out negative and the rank fails with SGLang's own
"Not enough memory" error: that is a forced or patched build (the original report had one).
With ``--stock-ar`` it builds the custom all-reduce the way stock SGLang does instead: inside
distributed init, before the baseline, two IPC-shared buffers of about 8 MiB and an 8 MiB
rank_data tensor per rank (and stock SGLang builds it only with full NVLink or at most two
PCIe-only GPUs: 0.5.23 custom_all_reduce_utils.py:490-496). It is a stand-in, labelled as such
in every marker (standin=True).
"""

from __future__ import annotations

import argparse
import sys

GiB = 2**30
MiB = 2**20
CELL_SIZE = 160 * 1024  # bytes of KV per token: a 7B-class model, fp16, all layers
NOT_ENOUGH = "Not enough memory. Please try to increase --mem-fraction-static."


def _free_gib(torch) -> float:
    free, _ = torch.cuda.mem_get_info()
    return free / GiB


def _world_min(value: float, rank: int, shared, barrier) -> float:
    """MIN over ranks without a collective library: a shared array and a barrier."""
    shared[rank] = value
    barrier.wait()
    result = min(shared[:])
    barrier.wait()
    return result


#: Stock SGLang's legacy custom all-reduce: max_size 8 MiB (custom_all_reduce.py), a meta
#: buffer of ops.meta_size() + max_size and a data buffer of max_size, both cudaMalloc'd and
#: opened by every peer over CUDA IPC, plus an 8 MiB rank_data tensor.
STOCK_AR_MAX_SIZE = 8 * MiB
STOCK_AR_META = 4 * 1024  # ops.meta_size() is a few KiB


def _stock_custom_all_reduce(torch, memrec, rank, args, device, ids, queues, barrier) -> list:
    """What stock SGLang does inside distributed init, before the memory baseline: a few MiB
    per rank, exchanged by IPC (SGLang builds it only with full NVLink or at most 2 PCIe GPUs)."""
    kept = []
    memrec.mark("custom_ar_init", phase="begin", gpu=device, max_size=STOCK_AR_MAX_SIZE, **ids)
    for size in (STOCK_AR_META + STOCK_AR_MAX_SIZE, STOCK_AR_MAX_SIZE):
        mine = torch.empty(size, dtype=torch.uint8, device="cuda")
        for peer in range(args.tp):
            if peer != rank:
                queues[peer].put(mine)
        kept += [mine] + [queues[rank].get(timeout=120) for _ in range(args.tp - 1)]
        memrec.mark("custom_ar_shared_buffer", gpu=device, size_in_bytes=size, **ids)
        barrier.wait()
    kept.append(torch.empty(STOCK_AR_MAX_SIZE, dtype=torch.uint8, device="cuda"))  # rank_data
    memrec.mark("custom_ar_init", phase="end", gpu=device, custom_ar_class="CustomAllreduce(stand-in)",
                world_size=args.tp, rank=rank, max_size=STOCK_AR_MAX_SIZE, disabled=False, **ids)
    return kept


def rank_main(rank: int, args, shared, barrier, queues) -> None:
    import torch

    import memrec

    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    torch.zeros(1, device="cuda")  # the CUDA context
    ids = dict(tp_rank=rank, pp_rank=0, dp_rank=0, standin=True)
    frac = args.mem_fraction_static

    stock = []
    with memrec.phase("dist_init", gpu=device, mem_fraction_static=frac, tp_size=args.tp,
                      disable_custom_all_reduce=not args.stock_ar, **ids):
        comm_buffer = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        if args.stock_ar:
            stock = _stock_custom_all_reduce(torch, memrec, rank, args, device, ids, queues, barrier)
    barrier.wait()
    pre = _world_min(_free_gib(torch), rank, shared, barrier)
    memrec.mark("memory_baseline", gpu=device, pre_model_load_memory=pre, **ids)

    with memrec.phase("load_weights", gpu=device, **ids):
        weights = torch.empty(args.weights_gib * GiB, dtype=torch.uint8, device="cuda")
    barrier.wait()

    peers = []
    if args.ipc:
        with memrec.phase("custom_ar_init", gpu=device, class_name="CustomAllreduce(stand-in)",
                          max_size=args.ipc_gib * GiB, world_size=args.tp, **ids):
            mine = torch.empty(args.ipc_gib * GiB, dtype=torch.uint8, device="cuda")
            for peer in range(args.tp):
                if peer != rank:
                    queues[peer].put(mine)
            peers = [queues[rank].get(timeout=120) for _ in range(args.tp - 1)]
            barrier.wait()

    available = _world_min(_free_gib(torch), rank, shared, barrier)
    memrec.mark("gpu_memory_measured", gpu=device, caller="profile_max_num_token", result_gib=available,
                distributed=True, **ids)
    rest = available - pre * (1 - frac)
    tokens = int(rest * GiB) // CELL_SIZE
    budget = dict(pre_model_load_memory=pre, available_gpu_memory=available, mem_fraction_static=frac,
                  cell_size=CELL_SIZE, max_num_token=tokens, **ids)
    memrec.mark("kv_budget", phase="begin", gpu=device, **budget)
    if tokens <= 0:
        memrec.mark("kv_budget", phase="end", gpu=device, error=f"RuntimeError: {NOT_ENOUGH}", **budget)
        barrier.wait()
        raise RuntimeError(NOT_ENOUGH)
    memrec.mark("kv_budget", phase="end", gpu=device, **budget)

    with memrec.phase("kv_pool", gpu=device, max_total_num_tokens=tokens, cell_size=CELL_SIZE, **ids):
        kv = torch.empty(tokens * CELL_SIZE, dtype=torch.uint8, device="cuda")

    with memrec.phase("cuda_graph_capture", gpu=device, **ids):
        static_in = torch.ones(64 * MiB // 4, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = static_in * 2 + 1
        graph.replay()
        torch.cuda.synchronize()
    barrier.wait()
    del comm_buffer, weights, peers, kv, static_out, stock


def _entry(rank, args, shared, barrier, queues):
    try:
        rank_main(rank, args, shared, barrier, queues)
    except RuntimeError as error:
        print(f"rank {rank}: {error}", file=sys.stderr)
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ipc", action="store_true", help="exchange all-reduce-style buffers by CUDA IPC")
    parser.add_argument("--weights-gib", type=int, default=25, help="weights per rank")
    parser.add_argument("--ipc-gib", type=int, default=18, help="shared buffer per rank (with --ipc)")
    parser.add_argument("--mem-fraction-static", type=float, default=0.6)
    parser.add_argument("--stock-ar", action="store_true",
                        help="build the custom all-reduce as stock SGLang does: a few MiB, before the baseline")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    shared = ctx.Array("d", args.tp)
    barrier = ctx.Barrier(args.tp)
    queues = [ctx.Queue() for _ in range(args.tp)]
    procs = [ctx.Process(target=_entry, args=(r, args, shared, barrier, queues)) for r in range(args.tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    kind = "stock custom all-reduce" if args.stock_ar else "no custom all-reduce"
    print(f"sglang stand-in ({kind}, {'with' if args.ipc else 'without'} IPC buffers after the baseline): "
          f"rank exit codes {codes}")
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
