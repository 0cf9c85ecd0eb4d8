"""SGLang's KV budget rebuilt from markers: exact numbers (GiB values are dyadic, so every
expected number below is exact in binary floating point)."""

from __future__ import annotations

import pytest

from memrec.analysis.sglang import kv_budget as kv
from memrec.analysis.sglang.kv_budget_diff import compare_budgets
from memrec.terms.events import Marker

GiB = 1 << 30


def mk(name, phase="end", pid=100, ts=0, gpu=None, **values):
    return Marker(ts=ts, pid=pid, uid=0, tid=pid, name=name, phase=phase, gpu=gpu, values=values)


# -- the formula -------------------------------------------------------------------------------


def test_formula_with_exact_numbers():
    # GIVEN a baseline of 80 GiB, 70 GiB left after the weights, and --mem-fraction-static 0.875
    # WHEN the budget is computed
    # THEN rest = 70 − 80 × 0.125 = 60 GiB, the slack is 10 GiB, and with 128 KiB of KV per token
    # that is 60 × 2**30 / 2**17 = 491,520 tokens; the minimum fraction is 1 − 70/80 = 0.125
    assert kv.slack_memory(80.0, 0.875) == 10.0
    assert kv.rest_memory(70.0, 80.0, 0.875) == 60.0
    assert kv.rest_bytes(60.0) == 60 * GiB
    assert kv.tokens_from_rest(60.0, 131072) == 491520
    assert kv.tokens_from_rest(60 * GiB + 131071, 131072, is_bytes=True) == 491520
    assert kv.min_mem_fraction_static(70.0, 80.0) == 0.125
    assert kv.min_mem_fraction_static(70.0, 0.0) is None


def test_negative_budget_gives_negative_tokens_as_sglang_does():
    # GIVEN 9 GiB left after the weights of an 80 GiB baseline at 0.875 (slack 10 GiB)
    # WHEN sized  THEN rest is −1 GiB and the floor division goes below zero, like SGLang's
    # "profiled value -561981" (sgl-project/sglang#7691)
    assert kv.rest_memory(9.0, 80.0, 0.875) == -1.0
    assert kv.tokens_from_rest(-1.0, 131072) == -8192
    assert kv.min_mem_fraction_static(9.0, 80.0) == 0.8875
    with pytest.raises(ValueError):
        kv.tokens_from_rest(1.0, 0)


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.88.",
         "no_memory_for_kv"),
        ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
         "server_args.mem_fraction_static=0.88", "not_enough_memory"),
        ("AssertionError: Memory pool size is too small", "pool_too_small"),
        ("RuntimeError: CUDA error: out of memory", "other"),
        (None, None),
    ],
)
def test_failure_texts_are_classified(text, kind):
    # GIVEN an exception text  WHEN classified  THEN both sizing failures are told apart
    assert kv.classify_error(text) == kind


# -- per rank from markers ---------------------------------------------------------------------


def _rank_0_5_7(pid, tp, available, pre=80.0, fraction=0.875, cell=131072, gpu=None, free=None):
    rest = available - pre * (1 - fraction)
    tokens = int(rest * GiB) // cell
    common = dict(tp_rank=tp, pp_rank=0, gpu_id=tp, is_draft_worker=False)
    extra = {"free_bytes": free} if free is not None else {}
    return [
        mk("dist_init", pid=pid, ts=1, pre_model_load_memory=pre, mem_fraction_static=fraction, **common),
        mk("memory_baseline", "instant", pid=pid, ts=2, pre_model_load_memory=pre, **common),
        mk("load_weights", pid=pid, ts=3, weight_load_mem_usage=pre - available, **common),
        mk("kv_budget", "begin", pid=pid, ts=4, pre_model_load_memory=pre, **common),
        mk("kv_budget", pid=pid, ts=5, gpu=gpu, pre_model_load_memory=pre, mem_fraction_static=fraction,
           available_gpu_memory=available, available_gpu_memory_distributed=True, cell_size=cell,
           max_num_token=tokens, **common, **extra),
        mk("kv_pool", pid=pid, ts=6, max_total_num_tokens=tokens // 64 * 64, max_running_requests=2048, **common),
    ]


def test_budget_of_a_0_5_7_rank_uses_the_cell_size():
    # GIVEN the markers of one 0.5.7 TP rank: 80 GiB baseline, 70 GiB after 10 GiB of weights
    markers = _rank_0_5_7(pid=100, tp=3, available=70.0, gpu=5, free=72 * GiB)
    # WHEN the budget is rebuilt
    (b,) = kv.kv_budgets(markers)
    # THEN every number is the exact one
    assert (b.pid, b.tp_rank, b.pp_rank, b.dp_rank, b.draft, b.gpu) == (100, 3, 0, None, False, 5)
    assert (b.pre_model_load_memory, b.available_gpu_memory, b.mem_fraction_static) == (80.0, 70.0, 0.875)
    assert (b.slack_gib, b.rest_gib, b.rest_bytes) == (10.0, 60.0, 60 * GiB)
    assert (b.cell_size, b.tokens, b.tokens_source) == (131072, 491520, "sglang")
    assert b.sglang_tokens == b.memrec_tokens == 491520 and b.max_total_num_tokens == 491520
    assert b.other_reservations_gib == 0.0 and b.unknown_terms == ()
    assert b.min_mem_fraction_static == 0.125
    assert b.weight_load_mem_usage == 10.0
    assert b.local_free_at_budget_gib == 72.0
    assert b.available_is_world_min is True
    assert b.ok and b.ts == 5 and b.label == "TP3"


def test_budget_of_a_0_4_10_rank_falls_back_to_sglangs_token_count():
    # GIVEN 0.4.10 markers: no cell size (it is computed inline in SGLang)
    markers = [
        mk("memory_baseline", "instant", ts=1, pre_model_load_memory=80.0, tp_rank=0),
        mk("kv_budget", ts=2, pre_model_load_memory=80.0, mem_fraction_static=0.875,
           available_gpu_memory=70.0, max_num_token=983040, tp_rank=0),
    ]
    # WHEN rebuilt  THEN the rest is still exact and the count is SGLang's
    (b,) = kv.kv_budgets(markers)
    assert (b.rest_gib, b.cell_size, b.tokens, b.tokens_source) == (60.0, None, 983040, "sglang")


def test_budget_of_a_0_5_23_rank_reads_sglangs_rest_and_the_pool_cell_size():
    # GIVEN 0.5.23 markers: memory_baseline span, kv_budget returning bytes, kv_pool with the
    # configurator's cell size; SGLang's rest includes a 0.5 GiB multimodal reservation
    markers = [
        mk("memory_baseline", ts=1, pre_model_load_memory=79.5, is_draft_worker=False, tp_rank=1,
           free_bytes=80 * GiB),
        mk("kv_budget", ts=2, pre_model_load_memory=79.5, mem_fraction_static=0.875, tp_rank=1,
           available_gpu_memory=64.0, rest_memory_bytes=int(53.5625 * GiB), is_draft_worker=False),
        mk("kv_pool", ts=3, cell_size=65536, max_total_num_tokens=876544, is_draft_worker=False, tp_rank=1),
    ]
    # WHEN rebuilt
    (b,) = kv.kv_budgets(markers)
    # THEN the formula gives 64 − 79.5 × 0.125 = 54.0625 GiB, SGLang's own rest is 0.5 GiB less,
    # and without SGLang's own count the tokens come from its rest bytes: 53.5625 × 2**30 / 2**16
    assert b.rest_gib == 54.0625 and b.sglang_rest_bytes == int(53.5625 * GiB)
    assert b.other_reservations_gib == -0.5
    assert (b.cell_size, b.tokens, b.tokens_source) == (65536, 877568, "cell_size")
    assert b.max_total_num_tokens == 876544
    assert b.local_free_at_baseline_gib == 80.0
    lines = kv.explain(b)
    assert lines[1] == ("  SGLang's own rest: 53.56 GiB (-0.50 GiB of its other terms: mamba cache, "
                        "multimodal, activation reserve -0.50 GiB)")


def test_draft_runner_is_sized_by_the_target_and_the_worker_error_goes_to_the_target():
    # GIVEN a process with a target and an EAGLE draft runner, whose worker init failed
    markers = _rank_0_5_7(pid=7, tp=0, available=70.0) + [
        mk("memory_baseline", "instant", pid=7, ts=10, pre_model_load_memory=70.0, is_draft_worker=True, tp_rank=0),
        mk("kv_budget", pid=7, ts=11, pre_model_load_memory=70.0, mem_fraction_static=0.875,
           available_gpu_memory=12.0, cell_size=4096, max_num_token=-3, is_draft_worker=True, tp_rank=0),
        mk("init_model_worker", pid=7, ts=12, error="RuntimeError: Not enough memory. Please try to increase "
           "--mem-fraction-static."),
    ]
    # WHEN rebuilt
    target, draft = kv.kv_budgets(markers)
    # THEN target and draft are separate; the draft's own profile (−3 tokens) is not a budget of
    # its own (SGLang overwrites it with the target's pool size), so it fails nothing; the
    # worker's failure is reported on the target
    assert (target.draft, draft.draft, draft.sized_by_target) == (False, True, True)
    assert draft.sglang_tokens == -3 and draft.ok and draft.label == "TP0 draft"
    assert kv.explain(draft) == ["TP0 draft (pid 7): sized by the target (the draft uses the target's pool size; "
                                 "its own profile (-3 tokens) is discarded)"]
    assert target.error_kind == "not_enough_memory" and not target.ok
    assert draft.error is None
    assert kv.summarize([target, draft])["ranks"] == 1


def test_missing_available_falls_back_to_the_profilers_measurement():
    # GIVEN a kv_budget end without the captured measurement, and the measurement instant
    markers = [
        mk("gpu_memory_measured", "instant", ts=1, caller="ModelRunner.load_model", result_gib=71.0, distributed=False),
        mk("gpu_memory_measured", "instant", ts=2, caller="ModelRunnerKVCacheMixin.profile_max_num_token",
           result_gib=70.0, distributed=True),
        mk("kv_budget", ts=3, pre_model_load_memory=80.0, mem_fraction_static=0.875, max_num_token=491520),
    ]
    # WHEN rebuilt  THEN the profiler's own measurement is used
    (b,) = kv.kv_budgets(markers)
    assert (b.available_gpu_memory, b.available_is_world_min, b.rest_gib) == (70.0, True, 60.0)


def test_processes_without_sizing_markers_are_left_out_and_ranks_are_sorted():
    # GIVEN three ranks out of order, a detokenizer that only measured, and a rank that only loaded weights
    markers = (_rank_0_5_7(pid=30, tp=2, available=70.0) + _rank_0_5_7(pid=10, tp=0, available=70.0)
               + _rank_0_5_7(pid=20, tp=1, available=70.0)
               + [mk("gpu_memory_measured", "instant", pid=99, result_gib=1.0, caller="x"),
                  mk("load_weights", pid=98, weight_load_mem_usage=3.0)])
    # WHEN rebuilt  THEN one budget per sizing rank, by TP rank
    assert [(b.tp_rank, b.pid) for b in kv.kv_budgets(markers)] == [(0, 10), (1, 20), (2, 30)]


def test_last_sizing_counts_when_a_rank_sized_twice():
    # GIVEN a rank that sized twice (e.g. a retry with another fraction)
    first = _rank_0_5_7(pid=5, tp=0, available=70.0, fraction=0.75)
    second = [mk(m.name, m.phase, pid=5, ts=m.ts + 100, **m.values)
              for m in _rank_0_5_7(pid=5, tp=0, available=70.0, fraction=0.875)]
    # WHEN rebuilt  THEN the later one is reported
    (b,) = kv.kv_budgets(second + first)
    assert b.mem_fraction_static == 0.875 and b.rest_gib == 60.0


def test_summary_of_a_tp8_run_where_one_gpu_holds_a_foreign_context():
    # GIVEN TP8 where GPU 5 also holds 2 GiB of another process: SGLang's WORLD MIN is what all
    # ranks see (67.5 GiB); the per-GPU free numbers show who pulled it down
    markers = []
    for tp in range(8):
        free = (67.5 if tp == 5 else 69.5) * GiB
        markers += _rank_0_5_7(pid=200 + tp, tp=tp, available=67.5, pre=78.0, free=int(free))
    # WHEN summarized
    budgets = kv.kv_budgets(markers)
    summary = kv.summarize(budgets)
    # THEN: 8 ranks, rest 67.5 − 78 × 0.125 = 57.75 GiB, the fraction needed 1 − 67.5/78, and a
    # 2 GiB spread of local free memory with TP5 lowest
    assert summary["ranks"] == 8 and summary["failed"] is False and summary["errors"] == []
    assert summary["min_rest_gib"] == 57.75
    assert summary["needed_mem_fraction_static"] == 1 - 67.5 / 78.0
    assert summary["local_free_spread_gib"] == 2.0
    assert summary["lowest_free_label"] == "TP5"
    assert summary["min_tokens"] == 57.75 * GiB // 131072


def test_explain_shows_the_formula_with_the_real_numbers():
    # GIVEN a failed rank: 8 GiB left after weights of an 80 GiB baseline at 0.875
    markers = _rank_0_5_7(pid=1, tp=0, available=8.0, gpu=2)
    markers.append(mk("kv_pool", pid=1, ts=7, tp_rank=0, error="RuntimeError: Not enough memory. Please try to "
                      "increase --mem-fraction-static."))
    (b,) = kv.kv_budgets(markers)
    # WHEN explained
    lines = kv.explain(b)
    # THEN the lines read as the formula with this rank's numbers
    assert lines[0] == ("TP0 (pid 1, GPU 2): rest = available 8.00 GiB − pre_model_load_memory 80.00 GiB × "
                        "(1 − 0.875) = -2.00 GiB")
    assert lines[1] == "  → -16,384 tokens (SGLang's own count)"
    assert any("minimum viable mem_fraction_static = 1 − 8.00 / 80.00 = 0.9000" in line for line in lines)
    assert lines[-1].startswith("  sizing failed: RuntimeError: Not enough memory")
    assert b.to_dict()["ok"] is False and b.to_dict()["label"] == "TP0"


def test_sglangs_own_count_wins_when_it_subtracted_more_than_the_formula():
    # GIVEN a 0.5.7 – 0.5.10 mamba model: SGLang's handle_max_mamba_cache took 4 GiB of the 60 GiB
    # rest before dividing, so it profiled 56 × 2**30 / 2**17 = 458,752 tokens
    markers = _rank_0_5_7(pid=1, tp=0, available=70.0)
    budget = next(m for m in markers if m.name == "kv_budget" and m.phase == "end")
    budget.values["max_num_token"] = 458752
    # WHEN rebuilt
    (b,) = kv.kv_budgets(markers)
    # THEN the tokens are SGLang's, and the 4 GiB it subtracted is shown as its other reservations
    assert (b.tokens, b.tokens_source, b.memrec_tokens) == (458752, "sglang", 491520)
    assert b.other_reservations_gib == -4.0
    lines = kv.explain(b)
    assert lines[1] == ("  SGLang's own rest: implied by its token count (-4.00 GiB of its other terms: "
                        "mamba cache, multimodal, activation reserve -4.00 GiB)")
    assert lines[2] == "  → 458,752 tokens (SGLang's own count)"


def test_each_term_sglang_reported_is_shown_with_its_value():
    # GIVEN 0.5.22+ markers of a multimodal hybrid-mamba model: the formula's rest 54.0625 GiB,
    # SGLang took 3 GiB for the mamba cache (its own hook), reserved 0.5 GiB for multimodal, and
    # 0.25 GiB more it did not break down; the pool charged a 64 MiB fixed overhead
    markers = [
        mk("memory_baseline", ts=1, pre_model_load_memory=79.5, tp_rank=0),
        mk("kv_budget", ts=2, pre_model_load_memory=79.5, mem_fraction_static=0.875, tp_rank=0,
           available_gpu_memory=64.0, rest_memory_bytes=int(50.3125 * GiB), mm_reservation_gib=0.5,
           rest_before_mamba_gib=53.5625, rest_after_mamba_gib=50.5625),
        mk("kv_pool", ts=3, cell_size=65536, page_size=64, fixed_overhead_bytes=64 * 1024 * 1024,
           sglang_tokens=822272, available_bytes=int(50.3125 * GiB), max_total_num_tokens=822272, tp_rank=0),
    ]
    # WHEN rebuilt and explained
    (b,) = kv.kv_budgets(markers)
    lines = kv.explain(b)
    # THEN each term has its value: −3 GiB mamba, −0.5 GiB multimodal, −0.25 GiB other; the fixed
    # overhead; and the count is SGLang's (memrec's rest // cell would give 824,320)
    assert (b.mamba_cache_gib, b.mm_reservation_gib, b.other_reservations_gib) == (-3.0, 0.5, -3.75)
    assert (b.fixed_overhead_bytes, b.page_size, b.tokens, b.memrec_tokens) == (64 << 20, 64, 822272, 824320)
    assert lines[1] == ("  SGLang's own rest: 50.31 GiB (-3.75 GiB of its other terms: mamba cache -3.00 GiB, "
                        "multimodal reservation -0.50 GiB, other (activation reserve, …) -0.25 GiB)")
    assert lines[2] == "  pool: fixed overhead 67,108,864 B charged before dividing by the cell size"
    assert lines[3] == "  → 822,272 tokens (SGLang's own count)"


def test_when_sglang_raised_in_its_budget_the_unknown_terms_are_named():
    # GIVEN 0.5.15+: _profile_available_bytes raised ValueError (rest <= 0 after ITS reservations)
    # while the formula alone gives +0.5 GiB
    markers = [
        mk("memory_baseline", ts=1, pre_model_load_memory=80.0, tp_rank=0),
        mk("kv_budget", ts=2, pre_model_load_memory=80.0, mem_fraction_static=0.875, available_gpu_memory=10.5,
           tp_rank=0, error="ValueError: Loaded weights leave no GPU memory for the KV cache under "
           "--mem-fraction-static=0.875. Raise --mem-fraction-static above 0.869 (minimum viable = 1 - "
           "available/pre = 0.8688)."),
    ]
    # WHEN rebuilt and explained
    (b,) = kv.kv_budgets(markers)
    lines = kv.explain(b)
    # THEN the failure stands, SGLang's other reservations are named as unknown, the rest is shown
    # as an upper bound and the minimum fraction as a lower one, not as facts
    assert not b.ok and b.error_kind == "no_memory_for_kv" and b.unknown_terms == ("other_reservations",)
    assert lines[0].endswith("rest ≤ available 10.50 GiB − pre_model_load_memory 80.00 GiB × (1 − 0.875) = 0.50 GiB")
    assert lines[1].startswith("  unknown: SGLang's other reservations")
    assert "minimum viable mem_fraction_static ≥ 1 − 10.50 / 80.00 = 0.8688" in lines[2]


def test_dp_attention_negative_profile_comes_out_per_dp_rank():
    # GIVEN DeepSeek-R1 with DP attention on 0.4.x (sgl-project/sglang#7691): every DP rank
    # profiled −561,981 tokens, the ranks named by SGLang's process titles (DP{d}_TP{t})
    markers = []
    for dp in range(2):
        pid = 300 + dp
        markers += [
            mk("memory_baseline", "instant", pid=pid, ts=1, pre_model_load_memory=60.0, tp_rank=dp, dp_rank=dp,
               rank_source="proctitle"),
            mk("kv_budget", pid=pid, ts=2, pre_model_load_memory=60.0, mem_fraction_static=0.95,
               available_gpu_memory=0.25, max_num_token=-561981, tp_rank=dp, dp_rank=dp),
        ]
    # WHEN rebuilt
    budgets = kv.kv_budgets(markers)
    # THEN each DP rank is its own budget, with SGLang's negative count, failed, and the fraction
    # it would have needed (1 − 0.25/60)
    assert [b.label for b in budgets] == ["DP0 TP0", "DP1 TP1"]
    for b in budgets:
        assert (b.tokens, b.tokens_source, b.ok) == (-561981, "sglang", False)
        assert b.rest_gib == kv.rest_memory(0.25, 60.0, 0.95) and b.min_mem_fraction_static == 1 - 0.25 / 60.0
    assert kv.summarize(budgets)["failed"] is True and kv.summarize(budgets)["min_tokens"] == -561981


# -- two runs ----------------------------------------------------------------------------------


def test_compare_splits_the_change_in_rest_exactly():
    # GIVEN run A (NCCL): baseline 80 GiB, 70 GiB after weights; run B (custom all-reduce): the
    # baseline is 2 GiB lower and so is what is left after the weights
    before = kv.kv_budgets(_rank_0_5_7(pid=1, tp=0, available=70.0, pre=80.0))
    after = kv.kv_budgets(_rank_0_5_7(pid=2, tp=0, available=68.0, pre=78.0))
    # WHEN compared
    (d,) = compare_budgets(before, after)
    # THEN Δrest = −1.75 GiB = Δavailable (−2) − Δslack (−0.25), and the token loss is exact
    assert d.label == "TP0" and d.rank_key == (None, 0, 0, False)
    assert d.deltas["rest_gib"] == -1.75
    assert d.deltas["available_gpu_memory"] == -2.0 and d.deltas["slack_gib"] == -0.25
    assert d.deltas["pre_model_load_memory"] == -2.0
    assert d.deltas["tokens"] == -1.75 * GiB // 131072
    assert d.deltas["rest_gib"] == d.deltas["available_gpu_memory"] - d.deltas["slack_gib"]
    assert d.explanation[0] == ("rest -1.75 GiB (60.00 GiB → 58.25 GiB) = available after weights -2.00 GiB − "
                                "slack -0.25 GiB")
    assert "pre_model_load_memory -2.00 GiB" in d.explanation[1]
    assert d.to_dict()["deltas"]["rest_gib"] == -1.75


def test_compare_says_when_sizing_starts_failing_and_unmatched_ranks():
    # GIVEN run A fine on TP0 and TP1, run B failing on TP0 and without TP1
    before = kv.kv_budgets(_rank_0_5_7(pid=1, tp=0, available=70.0) + _rank_0_5_7(pid=2, tp=1, available=70.0))
    failing = _rank_0_5_7(pid=3, tp=0, available=9.0)
    failing.append(mk("kv_pool", pid=3, ts=9, tp_rank=0, error="RuntimeError: Not enough memory."))
    after = kv.kv_budgets(failing)
    # WHEN compared
    d0, d1 = compare_budgets(before, after)
    # THEN TP0 says it now fails, with the rest going from 60 to −1 GiB; TP1 is only in run A
    assert d0.deltas["rest_gib"] == -61.0
    assert d0.explanation[-1] == "sizing now fails: RuntimeError: Not enough memory."
    assert d1.after is None and d1.explanation == ["only in the first run"]
