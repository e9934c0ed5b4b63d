"""Megatron-LM dev's dynamic-CP scheduler as a bench baseline (``bench/megatron_dynamic_cp.py``), the bench's
check that our dynamic CP is never slower than it, and ``min_cp_size`` (a minimum CP group) from every door."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_dynbatch import DynBatchConfigError, ParallelConfig, PlanOptions, RunConfig, plan_global_batch
from megatron_dynbatch.bench.megatron_dynamic_cp import (NAME, align_for_vpp, dynamic_cp_microbatches, gpus_needed,
                                                         next_microbatch, plan_megatron_dynamic_cp)
from megatron_dynbatch.bench.partitioning import BaselineInfeasible
from megatron_dynbatch.bench.runner import ALGORITHMS, DYNCP_PRIMARY, Row, dyncp_slower_than, run_workload
from megatron_dynbatch.bench.workloads import WORKLOADS

DYNCP_WORKLOADS = [n for n, w in WORKLOADS.items() if w.dynamic_cp]


# ------------------------------------------------------------------------------------ the scheduler's behaviour
def test_gpus_needed_is_the_next_power_of_two_and_at_least_the_minimum():
    assert [gpus_needed(x, 100) for x in (1, 100, 101, 200, 201, 401)] == [1, 1, 2, 2, 4, 8]
    assert gpus_needed(50, 100, min_cp=4) == 4 and gpus_needed(801, 100, min_cp=4) == 16


def test_a_short_sequence_takes_a_larger_group_when_that_shortens_the_critical_path():
    # 104 tokens need 2 GPUs (load 104^2/2 = 5408); 96 fit one GPU, but there its load 9216 would set the
    # micro-batch's peak: on 2 GPUs it is 4608, below the tallest's 5408
    groups, left = next_microbatch([(0, 104), (1, 96)], pool=4, per_rank=100)
    assert groups == [(0, 2, [0]), (2, 2, [1])] and left == []


def test_a_round_packs_under_the_per_rank_length_and_leaves_the_rest_for_the_next():
    groups, left = next_microbatch([(0, 160), (1, 80), (2, 64), (3, 48)], pool=4, per_rank=100)
    assert groups == [(0, 2, [0]), (2, 1, [1]), (3, 1, [2])]
    assert left == [(3, 48)]
    # the next round: one sample, its group doubled in place until no GPU is empty
    assert next_microbatch(left, pool=4, per_rank=100) == ([(0, 4, [3])], [])


def test_microbatches_cover_the_pool_and_place_every_sample_once():
    rng = np.random.default_rng(3)
    lengths = rng.integers(8, 3000, size=300)
    par = ParallelConfig(dp=4, cp=2)
    mbs = dynamic_cp_microbatches(lengths, par, 1024)
    seen = []
    for mb in mbs:
        assert [s for s, _, _ in mb] == sorted(s for s, _, _ in mb)
        assert sum(z for _, z, _ in mb) == 8 and all(b[0] == a[0] + a[1] for a, b in zip(mb, mb[1:], strict=False))
        for _, _, ids in mb:
            seen += ids
    assert sorted(seen) == list(range(lengths.size))


def test_upstreams_refusals_are_baseline_errors():
    with pytest.raises(BaselineInfeasible, match="needs 16 GPUs"):
        dynamic_cp_microbatches([1500], ParallelConfig(dp=4, cp=2), 100)
    with pytest.raises(BaselineInfeasible):
        dynamic_cp_microbatches([0, 10], ParallelConfig(dp=2), 100)


def test_vpp_alignment_splits_microbatches_and_refills_them_by_doubling():
    mbs = [[(0, 2, [0]), (2, 1, [1]), (3, 1, [2])]]
    assert align_for_vpp(mbs, 2, 4) == [[(0, 2, [1]), (2, 2, [2])], [(0, 4, [0])]]
    assert len(align_for_vpp(mbs * 3, 2, 4)) == 4
    with pytest.raises(BaselineInfeasible):  # one whole-pool group cannot split
        align_for_vpp([[(0, 4, [0])]], 2, 4)


def test_plan_is_scored_like_the_dynamic_cp_planners():
    w = WORKLOADS["dyncp-longcot-64k-8b"]
    lengths = w.generate(0).lengths
    plan = plan_megatron_dynamic_cp(lengths, w.parallel, w.max_tokens_per_gpu, model=w.model)
    assert plan.algorithm == NAME and plan.num_samples == lengths.size
    assert len({len(r) for r in plan.micro_batches}) == 1  # one pool-wide slot per micro-batch
    assert plan.predicted_step_time > 0 and plan.cap_violations == 0


# ------------------------------------------------------------------------------------ in the bench, and never ahead
def test_registered_for_dynamic_cp_workloads_only():
    assert NAME in ALGORITHMS
    rows, _ = run_workload(WORKLOADS["smoke"], 0, algorithms=[NAME])
    assert rows == []
    rows, _ = run_workload(WORKLOADS["dyncp-longcot-64k-32b-pp4"], 0, algorithms=[NAME, DYNCP_PRIMARY])
    theirs = next(r for r in rows if r.algorithm == NAME)
    assert theirs.ok and any("1F1B" in n for n in theirs.notes)  # pp=4: the row says how it is modelled


@pytest.mark.parametrize("workload", DYNCP_WORKLOADS)
def test_dynamic_cp_is_never_slower_than_megatrons_dynamic_cp(workload):
    """The bench's own check, on every dyncp workload and seed: with no decision margin ours is never slower;
    with the default margin (which may prefer a plan with a narrower widest group, within the margin) it is
    never slower by more than the margin -- a note on the row would make ``bench`` exit with an error (every
    seed of that: the ``dyncp`` source of tests/test_doc_figures.py)."""
    for seed in range(5):
        for margin in (0.0, None) if seed == 0 else (0.0,):
            rows, _ = run_workload(WORKLOADS[workload], seed, algorithms=[DYNCP_PRIMARY, NAME],
                                   decision_margin=margin)
            by = {r.algorithm: r for r in rows}
            assert by[DYNCP_PRIMARY].ok and by[NAME].ok, (workload, seed)
            assert by[DYNCP_PRIMARY].notes == [], (workload, seed, by[DYNCP_PRIMARY].notes)
            if margin == 0.0:
                assert by[DYNCP_PRIMARY].step_time_s <= by[NAME].step_time_s * (1 + 1e-9), (workload, seed)


def test_the_check_notes_a_slower_dynamic_cp_plan():
    rows = [Row("w", 0, DYNCP_PRIMARY, "dynbatch", step_time_s=1.05), Row("w", 0, NAME, "baseline", step_time_s=1.0)]
    assert dyncp_slower_than(rows, 0.0) == [f"slower than {NAME}: 1.0500 s vs 1.0000 s (beyond the decision margin 0)"]
    assert dyncp_slower_than(rows, 0.06) == []
    rows[1].error = "infeasible"
    assert dyncp_slower_than(rows, 0.0) == []


# ------------------------------------------------------------------------------------ min_cp_size
def _batch(seed=0, n=160):
    return np.random.default_rng(seed).integers(64, 24000, size=n)


@pytest.mark.parametrize("min_cp", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_group_of_the_plan_has_at_least_min_cp_size_gpus(min_cp, seed):
    lengths = _batch(seed)
    kw = dict(model="qwen3-8b", parallel={"dp": 4, "cp": 4, "tp": 2}, max_tokens_per_gpu=12288, dynamic_cp=True,
              decision_margin=0.0)  # no margin: the tree candidates win where they are faster
    plan = plan_global_batch(lengths, min_cp_size=min_cp, **kw)
    plan.validate(lengths.size)
    assert min(plan.group_sizes()) >= min_cp
    assert min(plan_global_batch(lengths, **kw).group_sizes()) == 1  # (without it this batch uses single GPUs)
    # never slower than the fixed-CP plan (its groups have cp >= min_cp_size GPUs), never below its bound
    assert plan.predicted_step_time <= plan.fixed_cp_step_time * (1 + 1e-9)
    assert plan.lower_bound_step_time <= plan.predicted_step_time * (1 + 1e-9)


def test_min_cp_size_on_a_pool_with_a_cp_that_is_not_a_power_of_two():
    lengths = _batch(2, 120)
    plan = plan_global_batch(lengths, model="qwen3-8b", parallel={"dp": 2, "cp": 6, "tp": 2},
                             max_tokens_per_gpu=12288, dynamic_cp=True, min_cp_size=4, decision_margin=0.0)
    plan.validate(lengths.size)
    assert min(plan.group_sizes()) >= 4


def test_the_baseline_honours_min_cp_size_too():
    lengths = _batch(1)
    plan = plan_megatron_dynamic_cp(lengths, ParallelConfig(dp=4, cp=4, tp=2), 12288, model="qwen3-8b",
                                    min_cp_size=4)
    assert min(plan.group_sizes()) >= 4 and plan.num_samples == lengths.size


@pytest.mark.parametrize("value, kwargs, words", [
    (3, {"dynamic_cp": True}, "power of two"),
    (8, {"dynamic_cp": True}, "above the layout's cp=4"),
    (2, {}, "only applies to dynamic CP"),
    (0, {"dynamic_cp": True}, ">= 1"),
    ("two", {"dynamic_cp": True}, None),
    (2.5, {"dynamic_cp": True}, None),
])
def test_min_cp_size_refusals_name_the_field(value, kwargs, words):
    with pytest.raises(DynBatchConfigError, match=words) as err:
        PlanOptions(max_tokens_per_gpu=4096, parallel={"dp": 2, "cp": 4}, min_cp_size=value, **kwargs)
    assert err.value.field == "min_cp_size"


def test_min_cp_size_end_to_end_through_the_plan_command(tmp_path, capsys):
    from megatron_dynbatch.cli import main

    path = tmp_path / "l.txt"
    path.write_text("\n".join(str(x) for x in _batch(0)))
    base = ["plan", "--lengths", str(path), "--model", "qwen3-8b", "--dp", "4", "--cp", "4", "--tp", "2",
            "--max-tokens-per-gpu", "12288", "--dynamic-cp", "--decision-margin", "0", "--json"]
    assert main(base + ["--min-cp-size", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert min(size for rank in plan["groups"] for _, size in rank) >= 2
    assert main(base + ["--min-cp-size", "3"]) == 2
    assert "power of two" in capsys.readouterr().err


def test_min_cp_size_end_to_end_through_a_run_preset_and_its_megatron_flags():
    import argparse

    from megatron_dynbatch import ModelSpec
    from megatron_dynbatch.megatron.args import (add_dynamic_batch_args, plan_options_from_args,
                                                 validate_dynamic_batch_args)

    rc = RunConfig.from_dict({"name": "t", "model": "qwen3-8b", "parallel": {"world_size": 32, "tp": 2, "cp": 4},
                              "max_tokens_per_gpu": 12288, "dynamic_cp": True, "min_cp_size": 2,
                              "decision_margin": 0.0})
    argv = rc.to_megatron_args()
    assert argv[argv.index("--dynbatch-min-cp-size") + 1] == "2"
    lengths = _batch(0)
    assert min(plan_global_batch(lengths, rc.plan_options()).group_sizes()) >= 2

    def launch(flags):  # Megatron's parsed args: its layout and model flags, plus ours
        ns = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(flags)
        spec = ModelSpec.from_any("qwen3-8b")
        for key, value in spec.to_dict().items():
            setattr(ns, key, value)
        ns.num_experts, ns.group_query_attention = spec.num_experts, True
        ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.context_parallel_size = 2, 1, 4
        ns.world_size = 32
        return validate_dynamic_batch_args(ns)

    flags = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "12288", "--balance-by-flops",
             "--dynbatch-decision-margin", "0", "--dynbatch-min-cp-size", "2"]
    opts = plan_options_from_args(launch(flags + ["--dynbatch-dynamic-cp"]))
    assert opts.min_cp_size == 2 and min(plan_global_batch(lengths, opts).group_sizes()) >= 2
    with pytest.raises(DynBatchConfigError, match="only applies to dynamic CP") as err:
        plan_options_from_args(launch(flags))
    assert "--dynbatch-min-cp-size" in str(err.value)  # the launch's error names the launch flag


# ------------------------------------------------------------------------------------ upstream as our candidate
def _random_dyncp_case(seed):
    rng = np.random.default_rng(1000 + seed)
    dp, cp, pp = (int(rng.choice(v)) for v in ([1, 2, 4, 8], [2, 4, 8], [1, 1, 2, 4]))
    budget = int(rng.choice([8192, 16384, 32768]))
    n = int(rng.integers(4, 160))
    lens = np.minimum(rng.lognormal(np.log(budget * cp / 6), 1.2, n).astype(int) + 1, budget * dp * cp // 2)
    return lens, ParallelConfig(dp=dp, cp=cp, pp=pp, tp=2), budget, str(rng.choice(["llama-3.1-8b", "qwen3-8b"]))


@pytest.mark.parametrize("seed", range(24))
def test_never_slower_than_upstream_on_random_batches(seed):
    """Upstream's schedule is one of our candidates (``dyncp/upstream.py``), so with no decision margin our plan is
    never slower than it in our model; with the default margin only where the plan kept fixed CP, and then by less
    than the margin."""
    from megatron_dynbatch.bench.partitioning import BaselineInfeasible as Infeasible

    lens, par, budget, model = _random_dyncp_case(seed)
    try:
        theirs = plan_megatron_dynamic_cp(lens, par, budget, model=model).predicted_step_time
    except Infeasible:
        theirs = float("inf")
    for margin in (0.0, None):
        plan = plan_global_batch(lens, model=model, parallel=par, max_tokens_per_gpu=budget, dynamic_cp=True,
                                 decision_margin=margin)
        plan.validate(lens.size)
        slack = 0.0 if margin == 0.0 or set(plan.candidate.split(",")) != {"fixed-cp"} else 0.032
        assert plan.predicted_step_time <= theirs * (1 + slack + 1e-9), (seed, margin, plan.candidate)


def test_upstreams_schedule_is_taken_where_it_is_fastest_and_keeps_every_rule():
    wins = 0
    for seed in range(24):
        lens, par, budget, model = _random_dyncp_case(seed)
        plan = plan_global_batch(lens, model=model, parallel=par, max_tokens_per_gpu=budget, dynamic_cp=True,
                                 decision_margin=0.0)
        if "megatron-dcp" in plan.candidate.split(","):
            wins += 1
            plan.validate(lens.size)  # every sample once, every GPU the same slot count, within the budget
            assert plan.cap_violations == 0
    assert wins >= 1  # (these seeds include batches where upstream's greedy rounds beat our family)


def test_upstream_candidate_is_skipped_where_it_would_break_a_rule():
    from megatron_dynbatch.core.planner.dyncp import upstream

    lens = _batch(3, 64)
    kw = dict(model="qwen3-8b", max_tokens_per_gpu=12288, dynamic_cp=True, decision_margin=0.0)
    # a pool that is not a power of two (upstream's groups are powers of two tiling the pool)
    assert "megatron-dcp" not in plan_global_batch(lens, parallel={"dp": 3, "cp": 2, "tp": 2}, **kw).candidate
    # a forced slot count it does not meet
    forced = plan_global_batch(lens, parallel={"dp": 2, "cp": 4, "tp": 2}, num_microbatches=9, **kw)
    assert forced.num_microbatches == 9 and "megatron-dcp" not in forced.candidate
    # a step whose scheduling would take too long (hundreds of rounds over thousands of samples)
    many = np.full(2048, 3000)
    assert upstream.scheduling_work(many, 2, 4096) > upstream.UPSTREAM_MAX_WORK
    plan = plan_global_batch(many, parallel={"dp": 1, "cp": 2, "tp": 2}, **{**kw, "max_tokens_per_gpu": 4096})
    assert "megatron-dcp" not in plan.candidate
