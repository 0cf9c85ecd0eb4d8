"""Multi-GPU workloads for the validation on hosts with several GPUs.

Run as ``python -m memrec.validation.gpu.multi_gpu SCENARIO --facts OUT.json [--world N]``; each writes
what it did (pids, the physical GPU each process used, PyTorch's segment history, handle bytes)
so the tests can check memrec's recording of the same run.

Scenarios:
    nccl-cvd     one process per GPU, CUDA_VISIBLE_DEVICES set per rank (as SGLang does), NCCL
                 all-reduce through torch.distributed
    nccl-all     one process per GPU, all GPUs visible, torch.cuda.set_device(rank)
    two-gpus     one process that allocates on two GPUs
    ipc          custom-all-reduce style: each rank allocates a buffer on its GPU, exports it by
                 CUDA IPC (cuIpcGetMemHandle), and every other rank opens it in its own context
                 (ipc and shareable put rank r on GPU r modulo the GPU count, so they also run on
                 one GPU)
    shareable    the same through cuMem shareable handles: cuMemCreate (POSIX fd), the fd passed
                 over a Unix socket (SCM_RIGHTS), cuMemImportFromShareableHandle + cuMemMap
NCCL_CUMEM_ENABLE is taken from the environment (run the nccl scenarios once with 0 and once
with 1). NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the host requires.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

from memrec.base.files import create_file

MiB = 2**20
BUFFER = 24 * MiB + 4096  # distinctive


def _uuid_of(torch, device: int) -> str:
    return "GPU-" + str(torch.cuda.get_device_properties(device).uuid)


def _segments(torch) -> list[dict]:
    snap = torch.cuda.memory._snapshot()
    out = []
    for device, trace in enumerate(snap.get("device_traces", [])):
        for e in trace:
            if e["action"] in ("segment_alloc", "segment_free", "segment_map", "segment_unmap"):
                out.append({"action": e["action"], "addr": int(e["addr"]), "size": int(e["size"]), "device": device})
    return out


def _nccl_rank(rank: int, world: int, visible: str, port: int, queue) -> None:
    if visible == "cvd":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    device = 0 if visible == "cvd" else rank
    torch.cuda.set_device(device)
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=100000)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", device))
    x = torch.full((BUFFER // 4,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    ok = float(x[0].item()) == world * (world + 1) / 2
    free, total = torch.cuda.mem_get_info()
    queue.put({
        "rank": rank, "pid": os.getpid(), "uuid": _uuid_of(torch, device), "allreduce_ok": ok,
        "segments": _segments(torch), "torch_reserved": int(torch.cuda.memory_reserved()),
        "free_bytes": int(free), "nccl_cumem": os.environ.get("NCCL_CUMEM_ENABLE"),
    })
    dist.barrier()
    dist.destroy_process_group()


def run_nccl(world: int, visible: str) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    ranks, codes = _run_ranks(ctx, _nccl_rank, [(r, world, visible, port, queue) for r in range(world)], queue)
    return {"scenario": f"nccl-{visible}", "ranks": ranks, "exit_codes": codes}


def _run_ranks(ctx, target, rank_args: list[tuple], results) -> tuple[list[dict], list[int]]:
    """Start one process per rank, collect each rank's facts from ``results``, wait for all."""
    procs = [ctx.Process(target=target, args=args) for args in rank_args]
    for p in procs:
        p.start()
    ranks = sorted((results.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=300)
    return ranks, [p.exitcode for p in procs]


def run_two_gpus() -> dict:
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", max_entries=100000)
    a = torch.empty(BUFFER, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(2 * BUFFER, dtype=torch.uint8, device="cuda:1")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    facts = {
        "scenario": "two-gpus", "pid": os.getpid(),
        "uuids": [_uuid_of(torch, 0), _uuid_of(torch, 1)],
        "ptrs": [a.data_ptr(), b.data_ptr()], "segments": _segments(torch),
    }
    del a, b
    return facts


def _cu():
    from cuda.bindings import driver

    return driver


def _ok(result, what):
    err, *values = result
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return values[0] if len(values) == 1 else values


def _context(cu, rank: int) -> int:
    """Make rank's GPU (rank modulo the GPU count: ranks share GPUs on smaller hosts) current."""
    _ok(cu.cuInit(0), "cuInit")
    device = rank % int(_ok(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
    dev = _ok(cu.cuDeviceGet(device), "cuDeviceGet")
    ctx = _ok(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return device


def _ipc_rank(rank: int, world: int, queues, barrier, results) -> None:
    cu = _cu()
    device = _context(cu, rank)
    ptr = _ok(cu.cuMemAlloc(BUFFER + rank * MiB), "cuMemAlloc")
    handle = _ok(cu.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
    raw = bytes(handle.reserved) if not isinstance(handle.reserved, bytes) else handle.reserved
    for peer in range(world):
        if peer != rank:
            queues[peer].put((rank, raw))
    opened = []
    for _ in range(world - 1):
        peer, peer_raw = queues[rank].get(timeout=120)
        h = cu.CUipcMemHandle()
        h.reserved = peer_raw
        mapped = _ok(cu.cuIpcOpenMemHandle(h, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        opened.append({"peer": peer, "ptr": int(mapped), "ipc": peer_raw.hex()})
    barrier.wait()
    import time

    time.sleep(1.5)  # let NVML (BAR1, per-process) see every mapping in place
    results.put({"rank": rank, "pid": os.getpid(), "device": device, "ptr": int(ptr), "size": BUFFER + rank * MiB,
                 "ipc": raw.hex(), "opened": opened})
    barrier.wait()
    for o in opened:
        _ok(cu.cuIpcCloseMemHandle(o["ptr"]), "cuIpcCloseMemHandle")
    _ok(cu.cuMemFree(ptr), "cuMemFree")


def _shareable_rank(rank: int, world: int, paths, barrier, results) -> None:
    cu = _cu()
    device = _context(cu, rank)
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    gran = int(_ok(cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity"))
    size = (12 + rank) * gran
    handle = _ok(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
    fd = int(_ok(cu.cuMemExportToShareableHandle(handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "export"))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(paths[rank])
    server.listen(world)
    barrier.wait()
    for peer in range(world):  # send my fd to every peer, receive theirs
        if peer == rank:
            continue
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(paths[peer])
        socket.send_fds(c, [json.dumps({"rank": rank, "size": size}).encode()], [fd])
        c.close()
    mapped = []
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    for _ in range(world - 1):
        conn, _ = server.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 4096, 1)
        conn.close()
        info = json.loads(msg)
        imported = _ok(cu.cuMemImportFromShareableHandle(fds[0], cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "import")
        va = _ok(cu.cuMemAddressReserve(info["size"], 0, 0, 0), "reserve")
        _ok(cu.cuMemMap(va, info["size"], 0, imported, 0), "map")
        _ok(cu.cuMemSetAccess(va, info["size"], [access], 1), "access")
        mapped.append({"peer": info["rank"], "va": int(va), "size": info["size"], "handle": int(imported), "fd": fds[0]})
    barrier.wait()
    import time

    time.sleep(1.5)
    results.put({"rank": rank, "pid": os.getpid(), "device": device, "size": size, "handle": int(handle),
                 "fd": fd, "mapped": mapped})
    barrier.wait()
    for m in mapped:
        _ok(cu.cuMemUnmap(m["va"], m["size"]), "unmap")
        _ok(cu.cuMemRelease(m["handle"]), "release")
    _ok(cu.cuMemRelease(handle), "release")


def run_peers(world: int, shareable: bool) -> dict:
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world)
    results = ctx.Queue()
    if shareable:
        tmp = tempfile.mkdtemp()
        args = [os.path.join(tmp, f"r{r}.sock") for r in range(world)]
        target = _shareable_rank
    else:
        args = [ctx.Queue() for _ in range(world)]
        target = _ipc_rank
    ranks, codes = _run_ranks(ctx, target, [(r, world, args, barrier, results) for r in range(world)], results)
    return {"scenario": "shareable" if shareable else "ipc", "ranks": ranks, "exit_codes": codes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=("nccl-cvd", "nccl-all", "two-gpus", "ipc", "shareable"))
    parser.add_argument("--facts", required=True)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.scenario.startswith("nccl"):
        facts = run_nccl(args.world, args.scenario.split("-")[1])
    elif args.scenario == "two-gpus":
        facts = run_two_gpus()
    else:
        facts = run_peers(args.world, shareable=args.scenario == "shareable")
    with create_file(args.facts, text=True, replace=True) as out:
        json.dump(facts, out)
    return 0 if all(c == 0 for c in facts.get("exit_codes", [0])) else 1


if __name__ == "__main__":
    sys.exit(main())
