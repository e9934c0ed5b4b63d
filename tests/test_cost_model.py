"""The step-time model: closed forms it must reproduce, and its lower bound."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_dynbatch import CostModel, ParallelConfig
from megatron_dynbatch.cost_model import simulate_1f1b


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_1f1b_equal_microbatches_matches_closed_form(pp, m):
    # Equal micro-batches of stage time t: makespan = (m + pp - 1) * t.
    assert simulate_1f1b([0.3] * m, pp) == pytest.approx((m + pp - 1) * 0.3)


def test_1f1b_one_large_microbatch_costs_more_than_its_share():
    small = simulate_1f1b([1.0] * 8, 4)
    lumpy_times = [0.5] * 4 + [4.5] + [0.5] * 3
    assert sum(lumpy_times) == pytest.approx(8.0)  # same total work
    lumpy = simulate_1f1b(lumpy_times, 4)
    assert lumpy > small


def test_rank_time_pp1_is_sum_and_vpp_closed_form():
    cm = CostModel(1e-6, 0.0, overhead_s=0.0)
    assert cm.rank_time([1.0, 2.0]) == pytest.approx(3.0)
    cm = CostModel(1e-6, 0.0, overhead_s=0.0, pp=4, vpp=2)
    t = [4.0] * 8
    assert cm.rank_time(t) == pytest.approx(8 * 1.0 + 3 / 2 * 1.0)


def test_ep_lockstep_takes_max_per_microbatch():
    cm = CostModel(1e-6, 0.0, overhead_s=0.0, ep_group=2)
    out = cm.step_time([[1.0, 5.0], [5.0, 1.0]])
    assert out.tolist() == [10.0, 10.0]


def test_from_model_splits_work_over_tp_and_cp():
    one = CostModel.from_model("qwen3-8b", ParallelConfig())
    four = CostModel.from_model("qwen3-8b", ParallelConfig(tp=2, cp=2))
    assert four.linear_s_per_token == pytest.approx(one.linear_s_per_token / 4)
    assert four.attention_s_per_sq_token == pytest.approx(one.attention_s_per_sq_token / 4)


def test_lower_bound_pp1():
    cm = CostModel(1.0, 0.0, overhead_s=0.5)
    assert cm.lower_bound(total_work=100.0, max_sample_work=10.0, dp=4, min_microbatches=2,
                          max_microbatches=10) == pytest.approx(25.0 + 1.0)
    # A single sample larger than the average share dominates.
    assert cm.lower_bound(100.0, 60.0, 4, 1, 10) == pytest.approx(60.5)


def test_lower_bound_never_above_planned_time():
    from megatron_dynbatch import plan_global_batch

    rng = np.random.default_rng(1)
    for par in ({"dp": 4}, {"dp": 2, "pp": 4}, {"dp": 2, "pp": 2, "vpp": 2}):
        lengths = rng.integers(10, 4000, size=200).tolist()
        plan = plan_global_batch(lengths, model="qwen3-0.6b", parallel=par, max_tokens_per_gpu=8192)
        assert plan.lower_bound_step_time <= plan.predicted_step_time * (1 + 1e-9)
