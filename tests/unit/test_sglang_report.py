"""The SGLang section of ``memrec report``: phases per rank with their memory, the KV budget with
the real numbers, and which phases' allocations made sizing fail.

Two kinds of input:

- the real H200 traces in ``examples/`` (``memrec.validation.gpu.sglang_standin``: two TP ranks sharing one
  GPU, 256 MiB in dist_init, 25 GiB of weights per rank, with ``--ipc`` 18 GiB per rank exchanged
  by CUDA IPC after the baseline, ``--mem-fraction-static 0.6``, 160 KiB of KV per token);
- hand-built traces (:func:`sglang_run`): TP0 on GPU 0 and TP1 on GPU 1, 80 GiB each, with every
  number chosen dyadic so that the expected values are exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memrec.analysis.report.build import build_report
from memrec.analysis.report.text import render_text
from memrec.terms.ranks import format_rank
from memrec.analysis.sglang.section import has_sglang_markers
from memrec.analysis.sglang.windows import kv_times
from memrec.terms.ranks import rank_labels
from memrec.terms.events import Kind
from memrec.terms.events import Marker
from memrec.terms.events import ProcessInfo
from memrec.trace.model import Trace
from memrec.trace.reader import load_trace
from tests.utils import GiB
from tests.utils import MiB
from tests.utils import ev
from tests.utils import events
from tests.utils import handle_bytes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BASE = EXAMPLES / "sglang-standin-base.mrec"
IPC = EXAMPLES / "sglang-standin-ipc.mrec"
NOT_ENOUGH = "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."

# The stand-in's numbers (memrec/validation/gpu/sglang_standin.py and what SGLang-style measuring gave on the H200).
PRE = 138.09130859375  # pre_model_load_memory, GiB, both runs
AVAIL_BASE = 88.09130859375
AVAIL_IPC = 52.09130859375
CELL = 160 * 1024


def ms(x: float) -> int:
    return int(x * 1_000_000)


def mark(t: float, pid: int, name: str, phase: str, gpu: int | None = None, **values) -> Marker:
    return Marker(ts=ms(t), pid=pid, uid=0, tid=pid, name=name, phase=phase, gpu=gpu, values=values)


def sglang_run(
    *, pid0: int = 100, lazy_ar_gib: int = 0, early_ar_gib: int = 0, foreign_gib: int = 0, oom: bool = False,
    frac: float = 0.875,
) -> Trace:
    """TP0 (pid ``pid0``, GPU 0) and TP1 (``pid0 + 1``, GPU 1) start like SGLang on two 80 GiB GPUs.

    Each rank: 1 GiB in dist_init (NCCL); optionally ``early_ar_gib`` in a custom all-reduce nested
    in dist_init (before the baseline); the baseline; 40 GiB of weights; optionally
    ``lazy_ar_gib`` in a custom all-reduce after the weights whose buffer the peer opens by IPC;
    optionally ``foreign_gib`` taken on GPU 1 by pid 999 (no markers) before the sizing; the KV
    sizing with SGLang's formula (cell 1 MiB/token), the pool when it fits; exit.
    available = min over GPUs of free = 39 − early − lazy − foreign.
    """
    pre = 79.0 - early_ar_gib
    available = 39.0 - early_ar_gib - lazy_ar_gib - foreign_gib
    rest = available - pre * (1 - frac)
    tokens = int(rest * GiB) // MiB
    rows: list = []
    markers: list[Marker] = []
    for r in (0, 1):
        pid, g, o = pid0 + r, r, r * 0.1  # TP1 a little after TP0
        ids = {"tp_rank": r, "pp_rank": 0, "dp_rank": 0}
        markers += [
            mark(1 + o, pid, "dist_init", "begin", g, mem_fraction_static=frac, tp_size=2, **ids),
            mark(4 + o, pid, "dist_init", "end", g),
            mark(5 + o, pid, "memory_baseline", "instant", g, pre_model_load_memory=pre, **ids),
            mark(6 + o, pid, "load_weights", "begin", g, **ids),
            mark(8 + o, pid, "load_weights", "end", g, weight_load_mem_usage=40.0, **ids),
            mark(13 + o, pid, "gpu_memory_measured", "instant", g, caller="profile_max_num_token",
                 result_gib=available, distributed=True, **ids),
        ]
        budget = dict(pre_model_load_memory=pre, available_gpu_memory=available, mem_fraction_static=frac,
                      cell_size=MiB, max_num_token=tokens, **ids)
        markers.append(mark(14 + o, pid, "kv_budget", "begin", g, **budget))
        rows.append(ev(Kind.ALLOC, pid=pid, ptr=0x1000, size=GiB, gpu=g, ts=ms(2 + o)))
        rows.append(ev(Kind.ALLOC, pid=pid, ptr=0x100000000, size=40 * GiB, gpu=g, ts=ms(7 + o)))
        if early_ar_gib:
            markers += [mark(2.5 + o, pid, "custom_ar_init", "begin", g, **ids), mark(3.5 + o, pid, "custom_ar_init", "end", g)]
            rows.append(ev(Kind.ALLOC, pid=pid, ptr=0x2000000000, size=early_ar_gib * GiB, gpu=g, ts=ms(3 + o)))
        if lazy_ar_gib:
            markers += [mark(9 + o, pid, "custom_ar_init", "begin", g, **ids), mark(12 + o, pid, "custom_ar_init", "end", g)]
            rows += [
                ev(Kind.ALLOC, pid=pid, ptr=0x3000000000, size=lazy_ar_gib * GiB, gpu=g, ts=ms(10 + o)),
                ev(Kind.IPC_EXPORT, pid=pid, ptr=0x3000000000, gpu=g, ipc=handle_bytes(r), ts=ms(10.5 + o)),
                ev(Kind.IPC_OPEN, pid=pid, ptr=0x4000000000, gpu=g, ipc=handle_bytes(1 - r), ts=ms(11 + o)),
            ]
        if tokens > 0:
            markers += [
                mark(15 + o, pid, "kv_budget", "end", g, **budget),
                mark(16 + o, pid, "kv_pool", "begin", g, max_total_num_tokens=tokens, cell_size=MiB, **ids),
                mark(18 + o, pid, "kv_pool", "end", g),
            ]
            rows.append(ev(Kind.ALLOC, pid=pid, ptr=0x5000000000, size=tokens * MiB, gpu=g, ts=ms(17 + o)))
        else:
            markers.append(mark(15 + o, pid, "kv_budget", "end", g, error=NOT_ENOUGH, **budget))
        if oom and r == 0:
            rows.append(ev(Kind.ALLOC, pid=pid, size=64 * GiB, gpu=g, result=2, ts=ms(14.5)))
        rows.append(ev(Kind.PROC_EXIT, pid=pid, ts=ms(30 + o)))
    if foreign_gib:
        rows.append(ev(Kind.ALLOC, pid=999, ptr=0x7000, size=foreign_gib * GiB, gpu=1, ts=ms(12.5)))
    rows.sort(key=lambda row: int(row["ts"]))
    procs = {
        pid0 + r: ProcessInfo(pid0 + r, 1, ["python3", "-m", "sglang.launch_server"], None, None, [r], ms(0.5), {})
        for r in (0, 1)
    }
    return Trace(
        header={
            "host": "h",
            "anchor": {"monotonic_ns": ms(0.5), "wall_ns": 0},
            "gpus": [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA H200", "total": 80 * GiB} for i in (0, 1)],
        },
        events=events(*rows),
        markers=sorted(markers, key=lambda m: m.ts),
        processes=procs,
        trailer={"type": "trailer", "end_ts": ms(40)},
    )


def phase_mem(rank: dict) -> list[tuple]:
    return [(x["name"], x["when"], x["by_category"]) for x in rank["phases"] if x["kind"] == "phase"]


# ------------------------------------------------------------------------------- the real traces


def test_ipc_example_budget_is_negative_and_the_custom_all_reduce_is_named():
    # GIVEN the H200 stand-in run with 18 GiB per rank exchanged by CUDA IPC after the baseline
    report = build_report(load_trace(IPC)).to_json()
    s = report["sglang"]
    # THEN both ranks are there, sharing GPU 0, labelled by their markers' tp_rank
    assert [(r["label"], r["pid"], r["gpu"]) for r in s["ranks"]] == [("TP0", 1054, 0), ("TP1", 1055, 0)]
    # AND each phase carries the memory it took, by category, and its place against the KV sizing
    tp0 = s["ranks"][0]
    assert phase_mem(tp0) == [
        ("dist_init", "before baseline", {"driver": 256 * MiB}),
        ("load_weights", "baseline→sizing", {"driver": 25 * GiB}),
        ("custom_ar_init", "baseline→sizing", {"driver": 18 * GiB, "ipc_mapped": 18 * GiB}),
        ("kv_budget", "sizing", {}),
    ]
    # AND the budget is SGLang's formula with the recorded numbers
    (b,) = tp0["budgets"]
    assert (b["pre_model_load_memory"], b["available_gpu_memory"], b["mem_fraction_static"]) == (PRE, AVAIL_IPC, 0.6)
    assert b["rest_gib"] == AVAIL_IPC - PRE * (1 - 0.6)
    assert b["tokens"] == -20613 and b["min_mem_fraction_static"] == 1 - AVAIL_IPC / PRE
    assert b["error"] == NOT_ENOUGH and b["ok"] is False
    assert b["formula"][1] == "       = 52.09 GiB − 138.09 GiB × (1 − 0.600) = 52.09 GiB − 55.24 GiB = -3.15 GiB"
    assert b["formula"][2] == "→ -20,613 tokens (SGLang's own count)"
    assert b["memrec_tokens"] == int(b["rest_gib"] * GiB) // 163840 == -20613
    assert b["formula"][3] == "minimum viable --mem-fraction-static = 1 − 52.09 / 138.09 = 0.6228 (ran with 0.600)"
    # AND the diagnosis names the custom all-reduce: its own 18 GiB, then the peer's on the same GPU
    dg = b["diagnosis"]
    assert dg["extra_owned"] == 36 * GiB and dg["weights_owned"] == 50 * GiB
    assert dg["rest_without_extras_gib"] == b["rest_gib"] + 36.0
    assert dg["lines"] == [
        ("between the baseline and the KV sizing, custom_ar_init took 18.00 GiB on GPU 0 (driver 18.00 GiB; "
        "18.00 GiB of peers' memory mapped by IPC, not owned)"),
        ("on the same GPU, TP1's custom_ar_init took 18.00 GiB (driver 18.00 GiB; 18.00 GiB of peers' memory "
        "mapped by IPC, not owned)"),
        "without these 36.00 GiB, rest would have been 32.85 GiB instead of -3.15 GiB",
    ]
    # AND the summary says who failed and what fraction every rank needs
    sm = s["summary"]
    assert (sm["failed"], sm["failed_labels"], sm["errors"]) == (True, ["TP0", "TP1"], [NOT_ENOUGH])
    assert sm["needed_mem_fraction_static"] == 1 - AVAIL_IPC / PRE and sm["mem_fraction_static"] == [0.6]
    # AND the window on GPU 0 lists all four allocations between the baseline and the sizing
    (w,) = s["windows"]
    assert [(x["label"], x["phase"], x["owned"], x["mapped"]) for x in w["between"]] == [
        ("TP1", "load_weights", 25 * GiB, 0), ("TP0", "load_weights", 25 * GiB, 0),
        ("TP1", "custom_ar_init", 18 * GiB, 18 * GiB), ("TP0", "custom_ar_init", 18 * GiB, 18 * GiB),
    ]
    assert [(x["label"], x["phase"], x["owned"]) for x in w["before"]] == [
        ("TP1", "(no phase)", 2 * MiB), ("TP0", "(no phase)", 2 * MiB),
        ("TP1", "dist_init", 256 * MiB), ("TP0", "dist_init", 256 * MiB),
    ]
    # AND the whole section survives JSON
    assert json.loads(json.dumps(s)) == s


def test_base_example_sizes_the_pool_and_needs_a_smaller_fraction():
    # GIVEN the same stand-in without the IPC buffers
    s = build_report(load_trace(BASE)).to_json()["sglang"]
    tp1 = s["ranks"][1]
    # THEN the pool took tokens × cell, rounded up to 2 MiB by PyTorch's caching allocator, and the
    # graphs came out of the slack
    pool = -(-215317 * CELL // (2 * MiB)) * 2 * MiB
    assert pool == 35_278_290_944
    assert phase_mem(tp1) == [
        ("dist_init", "before baseline", {"driver": 256 * MiB}),
        ("load_weights", "baseline→sizing", {"driver": 25 * GiB}),
        ("kv_budget", "sizing", {}),
        ("kv_pool", "after sizing", {"driver": pool}),
        ("cuda_graph_capture", "after sizing", {"driver": 192 * MiB}),
    ]
    (b,) = tp1["budgets"]
    assert (b["label"], b["rest_gib"], b["tokens"], b["ok"]) == ("TP1", AVAIL_BASE - PRE * (1 - 0.6), 215317, True)
    assert b["diagnosis"]["lines"] == [] and b["diagnosis"]["extra_owned"] == 0
    assert (s["summary"]["failed"], s["summary"]["needed_mem_fraction_static"]) == (False, 1 - AVAIL_BASE / PRE)


def test_ipc_example_text_report():
    # WHEN the failing run is rendered
    text = render_text(build_report(load_trace(IPC)), width=1000, show_all=True)
    lines = text.splitlines()
    # THEN the SGLang section comes before the GPU sections, with the verdict and the formula
    assert lines[7] == "SGLang startup per rank: phases, memory by category, KV budget"
    assert lines.index(lines[7]) < next(i for i, line in enumerate(lines) if line.startswith("GPU 0  NVIDIA H200"))
    assert "  KV sizing FAILED on TP0, TP1: " + NOT_ENOUGH in lines
    assert "  every rank needs --mem-fraction-static > 0.6228 (ran with 0.600)" in lines
    assert "TP0  pid 1054  GPU 0" in lines and "TP1  pid 1055  GPU 0" in lines
    assert (
        "    between the baseline and the KV sizing, custom_ar_init took 18.00 GiB on GPU 0 (driver 18.00 GiB; "
        "18.00 GiB of peers' memory mapped by IPC, not owned)"
    ) in lines
    assert "  allocated on GPU 0 between the baseline and the KV sizing: as for TP0 above" in lines
    row = next(line for line in lines if line.strip().startswith("custom_ar_init") and "baseline→sizing" in line)
    assert row.split()[5:9] == ["18.00", "GiB", "18.00", "GiB"]
    # AND the process tables show the ranks the markers carry (the launcher has none)
    procs = lines[lines.index("processes") + 1 :]
    assert [line.split()[:2] for line in procs[1:4]] == [["1030", "-"], ["1054", "TP0"], ["1055", "TP1"]]


# -------------------------------------------------------------------------- hand-built traces


def test_lazy_custom_all_reduce_on_two_gpus_fails_sizing_with_exact_numbers():
    # GIVEN 32 GiB per rank allocated after the weights and opened by the peer (GPU 0 and GPU 1)
    s = build_report(sglang_run(lazy_ar_gib=32)).to_json()["sglang"]
    tp0, tp1 = s["ranks"]
    # THEN available = 39 − 32 = 7 GiB, slack 79 × 0.125 = 9.875, rest −2.875 GiB, −2944 tokens of 1 MiB
    (b,) = tp0["budgets"]
    assert (b["pre_model_load_memory"], b["available_gpu_memory"], b["slack_gib"], b["rest_gib"]) == (79.0, 7.0, 9.875, -2.875)
    assert (b["tokens"], b["min_mem_fraction_static"], b["error_kind"]) == (-2944, 1 - 7 / 79, "not_enough_memory")
    # AND each rank's custom all-reduce is on its own GPU, with the peer's buffer mapped beside it
    assert phase_mem(tp1)[2] == ("custom_ar_init", "baseline→sizing", {"driver": 32 * GiB, "ipc_mapped": 32 * GiB})
    # AND the diagnosis names it, with the MIN-over-GPUs caveat (two GPUs)
    assert b["diagnosis"]["lines"] == [
        ("between the baseline and the KV sizing, custom_ar_init took 32.00 GiB on GPU 0 (driver 32.00 GiB; "
        "32.00 GiB of peers' memory mapped by IPC, not owned)"),
        ("without these 32.00 GiB, rest would have been 29.12 GiB instead of -2.88 GiB (if no other GPU measured "
        "less: available is a MIN over the ranks' GPUs)"),
    ]
    assert [w["gpu"] for w in s["windows"]] == [0, 1]


def test_a_foreign_process_on_the_other_gpu_is_found_through_the_world_min():
    # GIVEN pid 999 (no markers) taking 40 GiB on GPU 1 between the baseline and the sizing
    s = build_report(sglang_run(foreign_gib=40)).to_json()["sglang"]
    (b0,), (b1,) = s["ranks"][0]["budgets"], s["ranks"][1]["budgets"]
    # THEN both ranks fail (available is the MIN over both GPUs: 39 − 40 = −1 GiB)
    assert (b0["rest_gib"], b1["rest_gib"]) == (-10.875, -10.875)
    # AND no fraction can help (1 − (−1)/79 > 1)
    text = render_text(build_report(sglang_run(foreign_gib=40)), width=1000, show_all=True).splitlines()
    assert "  no --mem-fraction-static can fit a KV cache: it would have to exceed 1.0127 (ran with 0.875)" in text
    # AND TP1's own GPU explains it
    assert b1["diagnosis"]["lines"] == [
        "on the same GPU, pid 999 took 40.00 GiB outside any phase (driver 40.00 GiB)",
        ("without these 40.00 GiB, rest would have been 29.12 GiB instead of -10.88 GiB (if no other GPU measured "
        "less: available is a MIN over the ranks' GPUs)"),
    ]
    # AND TP0, whose GPU saw nothing but the weights, is pointed at GPU 1
    assert b0["diagnosis"]["other_gpu"] == 1
    assert b0["diagnosis"]["lines"] == [
        "available_after_weights is a MIN over the ranks' GPUs; on GPU 1 in the same window:",
        "  pid 999 took 40.00 GiB outside any phase (driver 40.00 GiB)",
    ]


def test_weights_alone_too_big_is_said_so():
    # GIVEN no extra allocation, but a fraction so small the slack exceeds what the weights left
    s = build_report(sglang_run(frac=0.5)).to_json()["sglang"]
    (b,) = s["ranks"][0]["budgets"]
    # THEN rest = 39 − 79 × 0.5 = −0.5 GiB and only the weights are blamed
    assert (b["rest_gib"], b["min_mem_fraction_static"]) == (-0.5, 1 - 39 / 79)
    assert b["diagnosis"]["lines"] == [
        ("nothing but the weights (40.00 GiB on GPU 0) was allocated between the baseline and the KV sizing: "
        "they leave too little at --mem-fraction-static=0.500 (shortfall 0.50 GiB)")
    ]


def test_where_sglang_raised_is_printed_once_per_exception():
    # GIVEN a failing run whose kv_budget end markers carry where SGLang raised
    from memrec.analysis.sglang.section import render_sglang

    trace = sglang_run(frac=0.5)
    at = "sglang/srt/model_executor/model_runner.py:1155 in init_memory_pool"
    for m in trace.markers:
        if m.name == "kv_budget" and m.phase == "end":
            m.values.update(error_at=at, error_traceback=f"{at} ← sglang/srt/managers/tp_worker.py:54 in __init__")
    # WHEN reported
    section = build_report(trace).sglang
    s = section.to_json()
    lines = render_sglang(section)
    # THEN each rank's error names the raising line and the traceback, once
    assert s["ranks"][0]["errors"][0]["at"] == at
    assert lines.count(f"    raised at {at}") == 2
    assert lines.count(f"    traceback (innermost first): {at} ← sglang/srt/managers/tp_worker.py:54 in __init__") == 2


def test_custom_all_reduce_facts_are_in_the_verdict():
    # GIVEN a run whose hooks recorded the legacy custom all-reduce on both ranks: world size 2, no
    # full NVLink, disabled by SGLang itself (more than 2 PCIe-only GPUs would do that), two 8 MiB
    # IPC-shared buffers each
    from memrec.analysis.text import human
    from memrec.analysis.sglang.section import render_sglang

    trace = sglang_run()
    for r in (0, 1):
        pid = 100 + r
        trace.markers += [
            mark(2 + r * 0.1, pid, "custom_ar_shared_buffer", "instant", r, size_in_bytes=8 * MiB),
            mark(2.2 + r * 0.1, pid, "custom_ar_shared_buffer", "instant", r, size_in_bytes=8 * MiB),
            mark(3 + r * 0.1, pid, "custom_ar_init", "end", r, custom_ar_class="CustomAllreduce", world_size=2,
                 full_nvlink=False, disabled=True, max_size=8 * MiB),
        ]
    trace.markers.sort(key=lambda m: m.ts)
    # WHEN reported
    section = build_report(trace).sglang
    s = section.to_json()
    # THEN the verdict has the class, world size, NVLink, who disabled it, and the buffers per rank
    c = s["summary"]["custom_all_reduce"]
    assert (c["classes"], c["world_size"], c["full_nvlink"], c["disabled"], c["ranks_built"]) == (
        ["CustomAllreduce"], [2], [False], [True], 2)
    assert c["shared_buffer_bytes"] == [16 * MiB]
    assert (f"  custom all-reduce: CustomAllreduce on 2 rank(s), world size 2, full_nvlink false, disabled true, "
            f"SGLang disabled it after building it (NCCL does the all-reduce), IPC-shared buffers {human(16 * MiB)} "
            "per rank") in render_sglang(section)


def test_a_cuda_oom_after_the_kv_sizing_is_named_with_the_slack():
    # GIVEN a run that sized fine, then TP0 asked the driver for 64 GiB and got
    # CUDA_ERROR_OUT_OF_MEMORY (sglang_run's oom: at 14.5 ms, after the 13 ms measurement)
    from memrec.analysis.sglang.section import render_sglang

    section = build_report(sglang_run(oom=True)).sglang
    s = section.to_json()
    # WHEN reported  THEN the OOM is named with the rank, the size, the slack and the fraction window
    (o,) = s["summary"]["oom_after_sizing"]
    assert (o["label"], o["size"], o["gpu"], o["slack_gib"]) == ("TP0", 64 * GiB, 0, 79.0 * 0.125)
    assert (o["phase"], o["mem_fraction_static"], o["min_mem_fraction_static"]) == ("kv_budget", 0.875, 1 - 39 / 79)
    assert (f"  CUDA out of memory after the KV sizing: TP0 in kv_budget asked for 64.00 GiB; the slack left for "
            f"everything after the pools was 9.88 GiB (--mem-fraction-static 0.875): a smaller fraction leaves more, "
            f"but it must stay above {1 - 39 / 79:.4f} for the pools to fit") in render_sglang(section)
    # AND a run without the failed allocation has none
    assert build_report(sglang_run()).sglang.summary.facts.oom_after_sizing == []


def test_each_phase_splits_into_torch_and_the_rest_when_the_hooks_recorded_torch():
    # GIVEN TP0's load_weights span with PyTorch's reserved bytes at begin (1 GiB) and end (39 GiB):
    # the driver saw 40 GiB in that span
    from memrec.analysis.sglang.section import render_sglang

    trace = sglang_run()
    for m in trace.markers:
        if m.pid == 100 and m.name == "load_weights":
            m.values.update(cuda_device=0, torch_reserved_bytes=(GiB if m.phase == "begin" else 39 * GiB))
    # WHEN reported
    section = build_report(trace).sglang
    s = section.to_json()
    (row,) = [x for x in s["ranks"][0]["phases"] if x["name"] == "load_weights"]
    # THEN 38 GiB of the 40 came through PyTorch's allocator and 2 GiB from elsewhere
    assert (row["net"], row["torch_reserved"], row["non_torch"]) == (40 * GiB, 38 * GiB, 2 * GiB)
    header = next(line for line in render_sglang(section) if line.lstrip().startswith("PHASE"))
    assert "NET OWNED" in header and "TORCH" in header and "NOT TORCH" in header
    # AND TP1, without torch numbers, has no such columns
    assert all("torch_reserved" not in x for x in s["ranks"][1]["phases"])


def test_a_ranks_context_on_a_gpu_it_does_not_compute_on_is_flagged_with_its_nvml_cost():
    # GIVEN TP0 (GPU 0) that also got a context on GPU 1 (what the old hooks' mem_get_info did on
    # GPU 0, or an IPC open does), NVML listing it there at 518 MiB, with no allocation of its own
    import numpy as np

    from memrec.analysis.sglang.section import render_sglang
    from memrec.terms.columns import PROCMEM_DTYPE

    trace = sglang_run()
    trace.events = np.sort(np.concatenate([trace.events, events(ev(Kind.CTX, pid=100, gpu=1, ts=ms(1.5)))]),
                           order="ts")
    trace.procmem = np.array([(ms(20), 0, 100, 41 * GiB), (ms(20), 1, 100, 518 * MiB), (ms(20), 1, 101, 41 * GiB)],
                             dtype=PROCMEM_DTYPE)
    # WHEN reported
    section = build_report(trace).sglang
    s = section.to_json()
    ctxs = {(c["label"], c["gpu"]): c for c in s["summary"]["contexts"]}
    # THEN every context is listed per process and GPU, the one on GPU 1 flagged foreign with its cost
    assert set(ctxs) == {("TP0", 0), ("TP0", 1), ("TP1", 1)}
    assert (ctxs[("TP0", 1)]["foreign"], ctxs[("TP0", 1)]["nvml_peak"], ctxs[("TP0", 1)]["allocated"]) == (
        True, 518 * MiB, False)
    assert not ctxs[("TP0", 0)]["foreign"] and not ctxs[("TP1", 1)]["foreign"]
    assert ("  foreign CUDA contexts (a rank's context on a GPU it does not compute on): TP0 on GPU 1 "
            "(NVML 518.0 MiB)") in render_sglang(section)


def test_nccls_cumem_buffers_in_dist_init_are_named():
    # GIVEN TP0's dist_init also created 512 MiB of cuMem (VMM) physical memory, as NCCL does with
    # NCCL_CUMEM_ENABLE
    import numpy as np

    from memrec.analysis.sglang.section import render_sglang

    trace = sglang_run()
    extra = events(ev(Kind.VMM_CREATE, pid=100, gpu=0, size=512 * MiB, handle=0x77, ts=ms(3)))
    trace.events = np.sort(np.concatenate([trace.events, extra]), order="ts")
    # WHEN reported  THEN they are named as NCCL's, per rank, before the baseline
    section = build_report(trace).sglang
    s = section.to_json()
    assert s["summary"]["nccl_vmm"] == [{"pid": 100, "label": "TP0", "gpu": 0, "bytes": 512 * MiB}]
    assert ("  NCCL's buffers (cuMem VMM in dist_init, outside the custom all-reduce; before the baseline): "
            "TP0 512.0 MiB") in render_sglang(section)


def test_markers_a_rank_dropped_are_reported_with_their_reasons():
    # GIVEN a run where TP1's client dropped 3 markers before the daemon answered and then 1 into
    # a full socket (two cumulative reports: the last counts)
    from memrec.analysis.sglang.section import render_sglang
    from memrec.client import DROPPED_MARKER

    trace = sglang_run()
    reasons = dict(no_daemon=0, socket_full=0, connection_lost=0, busy=0, invalid=0)
    trace.markers += [
        mark(5.5, 101, DROPPED_MARKER, "instant", dropped=3, **{**reasons, "no_daemon": 3}),
        mark(9.5, 101, DROPPED_MARKER, "instant", dropped=4, **{**reasons, "no_daemon": 3, "socket_full": 1}),
    ]
    # WHEN reported
    section = build_report(trace).sglang
    s = section.to_json()
    # THEN the summary names the rank, the count and why, and the text says so under the verdict
    assert s["summary"]["markers_dropped"] == [
        {"pid": 101, "label": "TP1", "dropped": 4, "reasons": {**reasons, "no_daemon": 3, "socket_full": 1}}]
    assert ("  markers lost: TP1 dropped 4 marker(s) (no_daemon 3, socket_full 1); phases around them may be "
            "missing") in render_sglang(section)


def test_an_allocation_before_the_baseline_is_placed_before_it():
    # GIVEN a custom all-reduce nested in dist_init, before the baseline
    s = build_report(sglang_run(early_ar_gib=32)).to_json()["sglang"]
    tp0 = s["ranks"][0]
    # THEN it lowers pre (79 − 32 = 47) and sits before the baseline; the budget still fits
    assert [(x["path"], x["when"], x["by_category"]) for x in tp0["phases"] if x["kind"] == "phase"][:2] == [
        ("dist_init", "before baseline", {"driver": GiB}),
        ("dist_init/custom_ar_init", "before baseline", {"driver": 32 * GiB}),
    ]
    (b,) = tp0["budgets"]
    assert (b["pre_model_load_memory"], b["available_gpu_memory"], b["rest_gib"], b["tokens"], b["ok"]) == (
        47.0, 7.0, 1.125, 1152, True,
    )
    assert [(x["phase"], x["owned"]) for x in s["windows"][0]["before"]] == [
        ("dist_init", GiB), ("dist_init/custom_ar_init", 32 * GiB),
    ]


def test_filters_keep_one_rank_or_one_gpu():
    trace = sglang_run(lazy_ar_gib=32)
    # WHEN filtered by pid, then by GPU
    by_pid = build_report(trace, pid=101).to_json()["sglang"]
    by_gpu = build_report(sglang_run(lazy_ar_gib=32), gpu=1).to_json()["sglang"]
    # THEN only TP1 remains, with GPU 1's window
    assert [r["label"] for r in by_pid["ranks"]] == ["TP1"]
    assert [r["label"] for r in by_gpu["ranks"]] == ["TP1"] and [w["gpu"] for w in by_gpu["windows"]] == [1]


def test_no_sglang_markers_no_section():
    # GIVEN a trace whose markers are not SGLang's ("load_weights" alone does not count)
    trace = sglang_run()
    trace.markers = [m for m in trace.markers if m.name == "load_weights"]
    # WHEN reported  THEN there is no SGLang section and no heading
    report = build_report(trace)
    assert report.sglang is None and not has_sglang_markers(trace.markers)
    assert "SGLang startup" not in render_text(report, width=1000, show_all=True)


# ------------------------------------------------------------------------------------------ ranks


def test_rank_labels_from_markers_show_dp_and_pp_only_when_used():
    # GIVEN markers of three processes, one of them in DP group 1
    markers = [
        mark(1, 10, "dist_init", "begin", tp_rank=0, pp_rank=0, dp_rank=0),
        mark(2, 11, "dist_init", "begin", tp_rank=1, pp_rank=0, dp_rank=1),
        mark(3, 12, "anything", "instant", tp_rank=2),
        mark(4, 12, "anything", "instant", tp_rank=5),  # the first value counts
        mark(5, 13, "anything", "instant", tp_rank=True),  # not a rank
    ]
    # THEN DP is shown (some rank is not 0 in it), PP is not
    assert rank_labels(markers) == {10: "DP0 TP0", 11: "DP1 TP1", 12: "TP2"}
    assert rank_labels(markers[:1]) == {10: "TP0"}
    assert format_rank({"pp": 3}, ("tp",)) == "PP3" and format_rank({"tp": 1}, draft=True) == "TP1 draft"


def test_marker_ranks_fill_the_report_rank_column_and_process_info_stays_the_fallback():
    # GIVEN TP0/TP1 with marker ranks, and a third process known only by ProcessInfo.rank
    trace = sglang_run()
    trace.processes[300] = ProcessInfo(300, 1, ["python3"], None, None, [], ms(1), {"tp": 4})
    # WHEN reported
    procs = {p["pid"]: p["rank"] for p in build_report(trace).to_json()["processes"]}
    # THEN the markers give "TP0"/"TP1"; ProcessInfo keeps its own form
    assert (procs[100], procs[101], procs[300]) == ("TP0", "TP1", "tp4")


def test_kv_times_use_the_profiler_measurement_and_skip_draft_workers():
    markers = [
        mark(1, 7, "memory_baseline", "instant", 2, pre_model_load_memory=10.0),
        mark(2, 7, "memory_baseline", "instant", 2, pre_model_load_memory=9.0, is_draft_worker=True),
        mark(3, 7, "kv_budget", "begin", 2),
        mark(4, 7, "gpu_memory_measured", "instant", 2, caller="KVCacheConfigurator._profile_available_bytes"),
        mark(5, 7, "gpu_memory_measured", "instant", 2, caller="something_else"),
        mark(6, 7, "kv_budget", "end", 2),
    ]
    (t,) = kv_times(markers).values()
    assert (t.pid, t.gpu, t.baseline_ts, t.sizing_ts) == (7, 2, ms(1), ms(4))
    # AND without a measurement the kv_budget span's begin is the sizing
    (t,) = kv_times([markers[0], markers[2], markers[5]]).values()
    assert t.sizing_ts == ms(3)


@pytest.mark.parametrize("path", [BASE, IPC])
def test_report_of_the_examples_is_deterministic(path):
    assert render_text(build_report(load_trace(path)), width=1000, show_all=True) == render_text(build_report(load_trace(path)), width=1000, show_all=True)


def test_an_error_outside_the_kv_sizing_is_shown_and_a_filter_without_sglang_processes_drops_the_section():
    # GIVEN TP0's worker failing after the pool (its init_model_worker span ends with an error)
    trace = sglang_run()
    trace.markers += [
        mark(0.8, 100, "init_model_worker", "begin", 0, tp_rank=0),
        mark(25, 100, "init_model_worker", "end", 0, error="RuntimeError: CUDA error: an illegal memory access"),
    ]
    trace.markers.sort(key=lambda m: m.ts)
    report = build_report(trace)
    # THEN the rank lists the error and the text says where SGLang raised it
    assert report.to_json()["sglang"]["ranks"][0]["errors"] == [
        {"phase": "init_model_worker", "error": "RuntimeError: CUDA error: an illegal memory access", "at": None,
         "traceback": None}
    ]
    assert "  SGLang raised in init_model_worker: RuntimeError: CUDA error: an illegal memory access" in (
        render_text(report, width=1000, show_all=True).splitlines()
    )
    # AND the sizing itself is not blamed: it succeeded (rest 29.125 GiB), the worker failed later
    assert "  startup FAILED on TP0: RuntimeError: CUDA error: an illegal memory access" in render_text(report, width=1000, show_all=True).splitlines()
    (b,) = report.to_json()["sglang"]["ranks"][0]["budgets"]
    assert (b["rest_gib"], b["ok"], b["diagnosis"]["lines"], report.sglang.summary.kv_failed) == (
        29.125, False, [], False,
    )
    assert not any(line.startswith("SGLang raised:") for line in b["formula"])
    # AND nested phases keep their place: the weights are inside init_model_worker now
    assert [x["path"] for x in report.to_json()["sglang"]["ranks"][0]["phases"] if x["kind"] == "phase"][:3] == [
        "init_model_worker", "init_model_worker/dist_init", "init_model_worker/load_weights",
    ]
    # WHEN filtered to a process that is not an SGLang rank  THEN no section
    trace.processes[300] = ProcessInfo(300, 1, ["python3"], None, None, [], ms(1), {})
    assert build_report(trace, pid=999).sglang is None


def test_the_worked_example_in_the_docs_is_this_output():
    # GIVEN docs/sglang.md's worked example  THEN its report block is the SGLang section printed today
    from memrec.analysis.sglang.section import render_sglang

    docs = (EXAMPLES.parent / "docs" / "sglang.md").read_text()
    section = "\n".join(render_sglang(build_report(load_trace(IPC)).sglang)) + "\n"
    assert section in docs
