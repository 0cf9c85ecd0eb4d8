"""Tensor blocks on a real GPU: PyTorch's own memory history against memrec's trace of the same run.

    python3 tensor_truth.py worker OUTDIR GOFILE   # a PyTorch process: waits for GOFILE, then records
    python3 tensor_truth.py compare TRACE OUTDIR... # PyTorch's block events vs memrec's, per process
    python3 tensor_truth.py cost LABEL             # ns per tensor alloc/free pair, ms per training step
    python3 tensor_truth.py stacks TRACE OUTDIR... # PyTorch's innermost user frame vs memrec's, per block

A worker allocates before it is told to go (it may have started before the daemon), then turns
``torch.cuda.memory._record_memory_history`` on, allocates sentinel A (a size nothing else has),
runs a small transformer's forward/backward/optimizer steps and a tight alloc/free loop, takes
PyTorch's snapshot, then allocates sentinel B. The comparison takes PyTorch's ``alloc`` and
``free_requested`` entries, and memrec's TENSOR_ALLOC/TENSOR_FREE events of the worker's pid from
sentinel A's allocation up to sentinel B's (a free's size and device are its allocation's), and
matches them both ways as multisets of (action, address, size, device).

``stacks`` (a trace recorded with ``--stacks``): for every block of at least ``STACK_MIN`` bytes
PyTorch allocated in the window, taken in order per (address, size, device) and paired with
memrec's allocation of the same block, the innermost *user* Python frame of each (the innermost
frame of a ``.py`` file outside the torch package, memrec and the interpreter's import machinery)
must have the same file and line; at least 95 % of the pairs must agree.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

SENTINEL_A = 7 * 1024 * 1024 + 4096 + 3
SENTINEL_B = 7 * 1024 * 1024 + 8192 + 5
LOOP = 20000
#: Blocks this large and larger are compared by stack (``--stack-min-bytes`` of the run).
STACK_MIN = 4096
_NOT_USER = ("/torch/", "/memrec/", "<frozen", "/importlib/", "/runpy.py")


def _model():
    import torch

    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=4).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def _step(model, opt) -> None:
    import torch

    x = torch.randn(16, 128, 256, device="cuda")
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(out: Path, go: Path) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    warm = [torch.empty(1 << 20, device="cuda") for _ in range(4)]  # before the daemon, maybe
    (out / "ready").write_text(str(os.getpid()))
    while not go.exists():
        time.sleep(0.05)
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    a = torch.empty(SENTINEL_A, dtype=torch.uint8, device="cuda")
    model, opt = _model()
    for _ in range(5):
        _step(model, opt)
    for _ in range(LOOP):
        t = torch.empty(256, device="cuda")
        del t
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    b = torch.empty(SENTINEL_B, dtype=torch.uint8, device="cuda")
    entries = []
    for device, trace in enumerate(snap["device_traces"]):
        for e in trace:
            if e["action"] in ("alloc", "free_requested"):
                entries.append([e["action"], int(e["addr"]), int(e["size"]), device])
                if e["action"] == "alloc" and int(e["size"]) >= STACK_MIN:
                    entries[-1].append(_user_frame([(f["filename"], int(f["line"]), f["name"])
                                                    for f in e.get("frames", [])]))
    (out / "torch.json").write_text(json.dumps({"pid": os.getpid(), "entries": entries}))
    del a, b, warm


def _memrec_entries(trace_path: str, pid: int) -> tuple[list[list], str]:
    import numpy as np

    from memrec.terms.events import Kind
    from memrec.trace.reader import load_trace

    trace = load_trace(trace_path)
    ev = trace.events
    ev = ev[(ev["pid"] == pid) & np.isin(ev["kind"], [int(Kind.TENSOR_ALLOC), int(Kind.TENSOR_FREE)])]
    alloc = ev["kind"] == int(Kind.TENSOR_ALLOC)
    starts = np.flatnonzero(alloc & (ev["size"] == SENTINEL_A))
    ends = np.flatnonzero(alloc & (ev["size"] == SENTINEL_B))
    if not len(starts) or not len(ends):
        return [], f"sentinels not found in memrec's trace (A: {len(starts)}, B: {len(ends)}; {len(ev)} tensor events)"
    live: dict[int, tuple[int, int]] = {}
    for e in ev[:starts[0]]:  # blocks allocated before the window: their frees in it need sizes
        if int(e["kind"]) == int(Kind.TENSOR_ALLOC):
            live[int(e["ptr"])] = (int(e["size"]), int(e["ordinal"]))
        else:
            live.pop(int(e["ptr"]), None)
    out = []
    unknown = 0
    for e in ev[starts[0]:ends[0]]:
        ptr = int(e["ptr"])
        if int(e["kind"]) == int(Kind.TENSOR_ALLOC):
            live[ptr] = (int(e["size"]), int(e["ordinal"]))
            out.append(["alloc", ptr, int(e["size"]), int(e["ordinal"])])
        else:
            size, dev = live.pop(ptr, (None, None))
            if size is None:
                unknown += 1
                continue
            out.append(["free_requested", ptr, size, dev])
    return out, f"{unknown} frees of blocks memrec never saw allocated"


def _user_frame(frames) -> list | None:
    """The innermost frame (file, line, function) of user code, innermost first in ``frames``."""
    for file, line, function in frames:
        if file.endswith(".py") and not any(part in file for part in _NOT_USER):
            return [file, line, function]
    return None


def compare_stacks(trace_path: str, outs: list[str]) -> int:
    import numpy as np

    from memrec.terms.events import Kind
    from memrec.trace.reader import load_trace
    from memrec.trace.stacks import Unavailable

    trace = load_trace(trace_path)
    ok = True
    for folder in outs:
        truth = json.loads(Path(folder, "torch.json").read_text())
        ev = trace.events
        ev = ev[(ev["pid"] == truth["pid"]) & (ev["kind"] == int(Kind.TENSOR_ALLOC)) & (ev["size"] >= STACK_MIN)]
        mine: dict[tuple, list] = collections.defaultdict(list)
        for e in ev:
            mine[(int(e["ptr"]), int(e["size"]), int(e["ordinal"]))].append(int(e["stack"]))
        pairs = agree = no_stack = unavailable = same_function = 0
        mismatches = []
        blocks = [e for e in truth["entries"] if e[0] == "alloc" and len(e) == 5]
        total = collections.Counter((e[1], e[2], e[3]) for e in blocks)
        taken: collections.Counter = collections.Counter()
        for entry in blocks:
            key = (entry[1], entry[2], entry[3])
            i = taken[key]
            taken[key] += 1
            if entry[4] is None:  # PyTorch saw no user frame (an allocation from torch's own code)
                continue
            ids = mine.get(key, [])
            # memrec also has this block's allocations before PyTorch's window: pair from the end
            j = len(ids) - total[key] + i
            if not 0 <= j < len(ids) or ids[j] == 0:
                no_stack += 1
                continue
            stack = trace.stack(ids[j])
            if stack is None or isinstance(stack, Unavailable):
                unavailable += 1
                continue
            got = _user_frame([(f.file, f.line, f.function) for f in stack if not f.native])
            pairs += 1
            want = entry[4]
            if got is not None and got[:2] == want[:2]:
                agree += 1
                same_function += got[2].rsplit(".", 1)[-1] == want[2]
            elif len(mismatches) < 5:
                mismatches.append({"pytorch": want, "memrec": got,
                                   "memrec_frames": [f.label() for f in stack if not f.native][:4]})
        share = agree / pairs if pairs else 0.0
        print(f"{folder}: pid {truth['pid']}: {pairs} blocks >= {STACK_MIN} B paired with a memrec stack; "
              f"innermost user frame equal (file, line) in {agree} ({share:.3%}), function name too in "
              f"{same_function}; {no_stack} without a memrec stack, {unavailable} unavailable")
        for m in mismatches:
            print(f"  differs: {m}")
        ok &= pairs > 0 and share >= 0.95
    print("STACKS PASS" if ok else "STACKS FAIL")
    return 0 if ok else 1


def compare(trace_path: str, outs: list[str]) -> int:
    ok = True
    for folder in outs:
        truth = json.loads(Path(folder, "torch.json").read_text())
        mine, note = _memrec_entries(trace_path, truth["pid"])
        want = collections.Counter(tuple(e[:4]) for e in truth["entries"])
        got = collections.Counter(tuple(e) for e in mine)
        both = sum((want & got).values())
        n_want, n_got = sum(want.values()), sum(got.values())
        recall = both / n_want if n_want else 0.0
        precision = both / n_got if n_got else 0.0
        by_action = {a: (sum(v for k, v in (want & got).items() if k[0] == a), sum(v for k, v in want.items() if k[0] == a))
                     for a in ("alloc", "free_requested")}
        print(f"{folder}: pid {truth['pid']}: PyTorch {n_want} block events, memrec {n_got}, matched {both}: "
              f"{recall:.5%} of PyTorch's found in memrec, {precision:.5%} of memrec's found in PyTorch; "
              f"by action (matched/PyTorch's) {by_action}; {note}")
        missing = list((want - got).elements())[:5]
        extra = list((got - want).elements())[:5]
        if missing or extra:
            print(f"  first missing in memrec: {missing}\n  first extra in memrec: {extra}")
        ok &= recall >= 0.999 and precision >= 0.999
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def cost(label: str) -> None:
    import torch

    torch.empty(1, device="cuda")
    pairs = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(LOOP):
            t = torch.empty(256, device="cuda")
            del t
        pairs.append((time.perf_counter_ns() - t0) / LOOP)
    model, opt = _model()
    _step(model, opt)
    torch.cuda.synchronize()
    steps = []
    for _ in range(20):
        t0 = time.perf_counter_ns()
        _step(model, opt)
        torch.cuda.synchronize()
        steps.append((time.perf_counter_ns() - t0) / 1e6)
    print(json.dumps({"label": label, "pair_ns_median": statistics.median(pairs), "pair_ns": pairs,
                      "step_ms_median": statistics.median(steps), "step_ms_min": min(steps)}))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "worker":
        worker(Path(sys.argv[2]), Path(sys.argv[3]))
    elif cmd == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3:]))
    elif cmd == "stacks":
        sys.exit(compare_stacks(sys.argv[2], sys.argv[3:]))
    elif cmd == "cost":
        cost(sys.argv[2])
    else:
        sys.exit(f"unknown command {cmd}")
