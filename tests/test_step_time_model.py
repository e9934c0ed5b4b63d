"""A plan of several optimizer steps: every step ends at its own gradient all-reduce, where each rank waits for
that step's slowest, so the plan's predicted time is the sum over steps of each step's slowest rank -- never the
slowest rank's sum over steps, which a rank slow in one step and fast in the next would make too small
(``core/planner/timing.py``). Torch-free."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_dynbatch import plan_global_batch
from megatron_dynbatch.core.planner import Plan
from megatron_dynbatch.core.planner.timing import step_times_of


def _rank_step_times(plan, cm):
    """Each (step, rank) time, recomputed from the plan's micro-batch times one step at a time."""
    out, start = [], 0
    for count in plan.microbatches_per_step:
        out.append([cm.rank_time(np.asarray(t[start:start + count])) for t in plan.microbatch_time])
        start += count
    return np.asarray(out)


@pytest.mark.parametrize("layout", [{"dp": 4}, {"dp": 2, "pp": 2}, {"dp": 4, "ep": 2}])
def test_a_plans_time_is_the_sum_of_its_steps_slowest_ranks(layout):
    lengths = np.random.default_rng(5).integers(50, 8000, 96)
    plan = plan_global_batch(lengths, model="qwen3-8b", parallel=layout, max_tokens_per_gpu=8192, samples_per_step=32)
    assert len(plan.step_time) == len(plan.microbatches_per_step) == 3
    assert plan.predicted_step_time == pytest.approx(sum(plan.step_time), rel=1e-12)
    assert plan.predicted_step_time >= plan.rank_time.max() * (1 - 1e-12)  # waiting at every step costs
    assert plan.imbalance == pytest.approx(plan.predicted_step_time / plan.rank_time.mean())
    if layout.get("ep", 1) == 1:  # expert-parallel ranks run in lockstep: not one rank at a time
        from megatron_dynbatch.core.planner.options import PlanOptions

        cm = PlanOptions(model="qwen3-8b", parallel=layout, max_tokens_per_gpu=8192).resolve().cost_model
        per = _rank_step_times(plan, cm)
        np.testing.assert_allclose(plan.step_time, per.max(axis=1), rtol=1e-12)
        np.testing.assert_allclose(plan.rank_time, per.sum(axis=0), rtol=1e-12)
    again = Plan.from_dict(plan.to_dict())
    assert again.step_time == plan.step_time and again.predicted_step_time == plan.predicted_step_time


def test_a_rank_slow_in_one_step_and_fast_in_the_next_waits_in_both():
    """Two ranks, two steps: rank 0 takes 3 s then 1 s, rank 1 takes 1 s then 3 s. Each rank sums to 4 s, yet
    the steps take 3 s each: 6 s."""
    from megatron_dynbatch.core.cost_model import CostModel

    cm = CostModel(linear_s_per_token=1e-6, attention_s_per_sq_token=0.0, overhead_s=0.0)
    ranks, steps = step_times_of([[3.0, 1.0], [1.0, 3.0]], [1, 1], cm)
    assert ranks.tolist() == [4.0, 4.0] and steps == [3.0, 3.0]


def test_a_single_step_plan_is_unchanged_by_the_step_list():
    lengths = np.random.default_rng(6).integers(50, 8000, 64)
    plan = plan_global_batch(lengths, model="qwen3-8b", parallel={"dp": 4}, max_tokens_per_gpu=8192)
    assert plan.step_time == [float(plan.rank_time.max())]
    assert plan.predicted_step_time == float(plan.rank_time.max())
    legacy = plan.to_dict()
    del legacy["step_time"]  # a plan written before the per-step list: the slowest rank, as then
    assert Plan.from_dict(legacy).predicted_step_time == plan.predicted_step_time


def test_dynamic_cp_plans_add_their_steps_slowest_gpus_too():
    lengths = np.random.default_rng(7).integers(50, 6000, 48)
    plan = plan_global_batch(lengths, model="llama-3.1-8b", parallel={"dp": 2, "cp": 2}, max_tokens_per_gpu=4096,
                             samples_per_step=16, dynamic_cp=True)
    assert len(plan.step_time) == 3
    assert plan.predicted_step_time == pytest.approx(sum(plan.step_time), rel=1e-12)
    assert plan.predicted_step_time <= plan.fixed_cp_step_time * (1 + 1e-9)
