"""PyTorch workloads recorded by memrec and by PyTorch's own memory history at the same time.

Run as ``python -m memrec.validation.gpu.torch_workloads SCENARIO --facts OUT.json``. Each scenario makes
PyTorch allocate, free, map and share memory, and writes PyTorch's own account of it (the
``segment_*`` actions of ``torch.cuda.memory._record_memory_history``) plus the process ids to
OUT.json, so the validation can check each segment against what memrec recorded.

Scenarios:
    caching     the caching allocator: segments of several sizes, frees, empty_cache
    expandable  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (cuMemCreate + cuMemMap)
    ipc         torch.multiprocessing sends a CUDA tensor to a spawned child (CUDA IPC)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from memrec.base.files import create_file

MiB = 2**20


def _segment_actions(snapshot: dict) -> list[dict]:
    keep = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
    actions = []
    for device, trace in enumerate(snapshot.get("device_traces", [])):
        for entry in trace:
            if entry["action"] in keep:
                actions.append(
                    {"action": entry["action"], "addr": int(entry["addr"]), "size": int(entry["size"]), "device": device}
                )
    return actions


def _churn(torch, sizes_mib: list[int]) -> None:
    """Allocate tensors of the given sizes, free every other one, then release the cache."""
    tensors = [torch.empty(size * MiB, dtype=torch.uint8, device="cuda") for size in sizes_mib]
    for t in tensors:
        t.fill_(1)
    torch.cuda.synchronize()
    del tensors[::2]
    more = [torch.empty(size * MiB + 4096, dtype=torch.uint8, device="cuda") for size in (3, 17)]
    torch.cuda.synchronize()
    del tensors, more
    torch.cuda.empty_cache()


def run_allocator(expandable: bool) -> dict:
    if expandable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    torch.cuda.init()
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=1_000_000)
    _churn(torch, [1, 2, 5, 21, 64, 300, 1024])
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return {"pids": [os.getpid()], "segments": _segment_actions(snapshot)}


def _ipc_child(queue, done) -> None:
    tensor = queue.get()
    tensor.add_(1)
    import torch

    torch.cuda.synchronize()
    done.put(os.getpid())
    del tensor


def run_ipc() -> dict:
    import torch
    import torch.multiprocessing as mp

    torch.cuda.memory._record_memory_history(enabled="all", max_entries=1_000_000)
    tensor = torch.zeros(7 * MiB + 333, dtype=torch.uint8, device="cuda")
    snapshot = torch.cuda.memory._snapshot()
    segment = next(
        s for s in snapshot["segments"] if s["address"] <= tensor.data_ptr() < s["address"] + s["total_size"]
    )
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(queue, done))
    child.start()
    queue.put(tensor)
    child_pid = done.get(timeout=120)
    child.join(timeout=120)
    torch.cuda.synchronize()
    value = int(tensor[0].item())
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return {
        "pids": [os.getpid(), child_pid],
        "segments": _segment_actions(snapshot),
        "ipc": {
            "exporter": os.getpid(),
            "importer": child_pid,
            "segment_addr": int(segment["address"]),
            "segment_size": int(segment["total_size"]),
            "child_wrote": value == 1,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=("caching", "expandable", "ipc"))
    parser.add_argument("--facts", required=True, help="write PyTorch's segment actions here (JSON)")
    args = parser.parse_args(argv)
    if args.scenario == "ipc":
        facts = run_ipc()
    else:
        facts = run_allocator(expandable=args.scenario == "expandable")
    with create_file(args.facts, text=True, replace=True) as out:
        json.dump(facts, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
