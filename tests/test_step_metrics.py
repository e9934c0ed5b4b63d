"""What a user sees per step (issue 27 item 6): a plan's figures as one flat dict of ``dynbatch/...`` floats, the
same names everywhere (the Megatron-LM writers, the step API, the Ray driver and actors). Torch-free."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_dynbatch import DynBatchConfigError, plan_global_batch
from megatron_dynbatch.core.memory import GiB
from megatron_dynbatch.core.metrics import METRIC_NAMES, PREFIX, plan_budget, step_metrics

LENGTHS = np.random.default_rng(2).integers(30, 3000, 64)


def test_the_figures_are_the_plans():
    plan = plan_global_batch(LENGTHS, model="qwen3-0.6b", parallel={"dp": 2, "cp": 2}, max_tokens_per_gpu=2048)
    m = step_metrics(plan)
    assert all(k.startswith(PREFIX) for k in m) and all(isinstance(v, float) and math.isfinite(v) for v in m.values())
    assert [k[len(PREFIX):] for k in m] == [n for n in METRIC_NAMES if n in {k[len(PREFIX):] for k in m}]
    assert m["dynbatch/microbatches"] == plan.num_microbatches
    assert m["dynbatch/microbatches_lower_bound"] == plan.lower_bound_microbatches
    assert m["dynbatch/imbalance"] == pytest.approx(plan.imbalance)
    assert m["dynbatch/padding_tokens"] == plan.padding_tokens and m["dynbatch/real_tokens"] == int(LENGTHS.sum())
    assert m["dynbatch/padding_fraction"] == pytest.approx(plan.padding_tokens / (plan.padding_tokens + LENGTHS.sum()))
    assert m["dynbatch/max_tokens_per_gpu"] == 2048 == plan_budget(plan)
    assert m["dynbatch/largest_microbatch_tokens"] == plan.max_microbatch_tokens / 2  # per GPU: over cp
    assert 0 < m["dynbatch/budget_fill"] <= 1
    assert m["dynbatch/predicted_step_time_s"] == pytest.approx(plan.predicted_step_time)
    for unknown in ("measured_step_time_s", "peak_memory_gb", "predicted_peak_memory_gb"):
        assert PREFIX + unknown not in m  # left out when not measured


def test_measured_figures_and_steps_and_prefixes():
    plan = plan_global_batch(LENGTHS, parallel={"dp": 2}, max_tokens_per_gpu=4096, samples_per_step=32,
                             balance_by_flops=False)
    m = step_metrics(plan, step=1, measured_step_s=0.25, measured_peak_bytes=30 * GiB, predicted_peak_bytes=31 * GiB,
                     budget=4096, prefix="rl/")
    assert m["rl/microbatches"] == plan.microbatches_per_step[1] and m["rl/measured_step_time_s"] == 0.25
    assert m["rl/peak_memory_gb"] == 30.0 and m["rl/predicted_peak_memory_gb"] == 31.0
    assert m["rl/predicted_step_time_s"] == plan.step_time[1]  # the step's own time, not the whole plan's
    assert step_metrics(plan)["dynbatch/predicted_step_time_s"] == plan.predicted_step_time


def test_a_dynamic_cp_plan_counts_per_gpu():
    plan = plan_global_batch(LENGTHS, model="qwen3-0.6b", parallel={"dp": 2, "cp": 2}, max_tokens_per_gpu=2048,
                             dynamic_cp=True)
    m = step_metrics(plan)
    assert m["dynbatch/max_tokens_per_gpu"] == 2048 and m["dynbatch/largest_microbatch_tokens"] <= 2048


@pytest.mark.parametrize("kw,field", [({"measured_step_s": float("nan")}, "measured_step_s"),
                                      ({"measured_step_s": -1.0}, "measured_step_s"),
                                      ({"measured_peak_bytes": float("inf")}, "measured_peak_bytes"),
                                      ({"measured_peak_bytes": -3}, "measured_peak_bytes"),
                                      ({"measured_peak_bytes": 2.0 ** 70}, "measured_peak_bytes"),
                                      ({"predicted_peak_bytes": "big"}, "predicted_peak_bytes"),
                                      ({"budget": 0}, "budget"), ({"step": 5}, "step"), ({"prefix": 3}, "prefix")])
def test_hostile_inputs_get_clear_errors(kw, field):
    plan = plan_global_batch([100, 200, 300, 400], parallel={"dp": 2}, max_tokens_per_gpu=512,
                             balance_by_flops=False)
    with pytest.raises(DynBatchConfigError, match=field):
        step_metrics(plan, **kw)


def test_not_a_plan():
    for bad in (None, {"micro_batches": []}, "plan"):
        with pytest.raises(DynBatchConfigError, match="is not a plan"):
            step_metrics(bad)
