"""Bad input raises a ValueError subclass naming the field, the value and the fix."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_dynbatch import CostModel, DynBatchConfigError, ParallelConfig, plan_global_batch


def _raises(match_field, **kwargs):
    base = dict(lengths=[10, 20, 30, 40], parallel={"dp": 2}, max_tokens_per_gpu=100, balance_by_flops=False)
    base.update(kwargs)
    lengths = base.pop("lengths")
    with pytest.raises(ValueError) as info:
        plan_global_batch(lengths, **base)
    err = info.value
    assert isinstance(err, DynBatchConfigError)
    assert match_field in str(err) and "Fix:" in str(err)
    return err


def test_negative_length():
    err = _raises("lengths[1]", lengths=[10, -3, 5, 6])
    assert err.value == -3


def test_non_integer_length():
    err = _raises("lengths[2]", lengths=[10, 20, 2.5, 6])
    assert err.value == 2.5
    _raises("lengths[0]", lengths=["a", 1, 2, 3])


def test_empty_batch():
    _raises("lengths", lengths=[])


def test_two_dimensional_lengths():
    _raises("lengths", lengths=np.ones((2, 2), dtype=int))


@pytest.mark.parametrize("dp", [0, -1, 1.5, True])
def test_bad_dp(dp):
    _raises("parallel.dp", parallel={"dp": dp})


def test_unknown_parallel_field():
    _raises("parallel.zp", parallel={"dp": 2, "zp": 3})


@pytest.mark.parametrize("cap", [0, -5, 3.5, None])
def test_bad_budget(cap):
    _raises("max_tokens_per_gpu", max_tokens_per_gpu=cap)


def test_cap_smaller_than_alignment():
    # cp=4 pads every sequence to a multiple of 8 and sequence parallel (tp=2) needs micro-batch totals that
    # are a multiple of tp*cp=8: a budget of 1 token per GPU (4 per micro-batch) cannot hold one sequence.
    err = _raises("max_tokens_per_gpu", parallel={"dp": 2, "cp": 4, "tp": 2, "sequence_parallel": True},
                  max_tokens_per_gpu=1)
    assert "smaller than one aligned sequence" in str(err)
    _raises("max_tokens_per_gpu", fp8_alignment="nvfp4", max_tokens_per_gpu=100)


def test_vpp_without_pp():
    _raises("parallel.vpp", parallel={"dp": 2, "vpp": 2})


def test_bad_vpp_group_size():
    _raises("microbatch_group_size_per_vp_stage", parallel={"dp": 2, "pp": 4, "vpp": 2,
                                                            "microbatch_group_size_per_vp_stage": 3})


def test_forced_count_breaking_vpp_rule():
    err = _raises("num_microbatches", lengths=[10] * 40,
                  parallel={"dp": 2, "pp": 4, "vpp": 2}, num_microbatches=5)
    assert "use 8" in str(err)


def test_forced_count_too_small_for_budget():
    _raises("num_microbatches", lengths=[90] * 8, num_microbatches=1)


def test_unknown_oversize_policy():
    _raises("oversize", oversize="truncate")


def test_unknown_balance_mode():
    _raises("balance_by", balance_by="vibes")


def test_flops_balance_without_model():
    _raises("model", balance_by_flops=True)


def test_unknown_model_field():
    _raises("hidden_sizee", model={"num_layers": 2, "hidden_sizee": 64}, balance_by_flops=True)


def test_group_ids_length_mismatch():
    _raises("group_ids", group_ids=[0, 1])


def test_samples_per_step_not_dividing():
    _raises("samples_per_step", samples_per_step=3)


def test_group_spanning_steps():
    _raises("group_ids", lengths=[10] * 8, group_ids=[0, 0, 0, 1, 1, 1, 2, 2], samples_per_step=4)


def test_bad_fp8_recipe():
    _raises("fp8_alignment", fp8_alignment="fp7")


def test_bad_cost_model_type():
    _raises("cost_model", cost_model={"linear": 1})


def test_parallel_config_errors_at_construction():
    with pytest.raises(DynBatchConfigError, match="parallel.cp"):
        ParallelConfig(cp=0)
    with pytest.raises(DynBatchConfigError, match="cost_model.overhead_s"):
        CostModel(1e-9, 1e-12, overhead_s=-1.0)


# ------------------------------------------------------------------ parallel= takes what a run preset's parallel: takes
def test_parallel_accepts_what_presets_accept():
    from megatron_dynbatch.core.run_config import RunConfig

    lengths = [100] * 16
    for layout in ({"world_size": 8}, {"world_size": 16, "tp": 2}, {"world_size": 8, "dp": 8},
                   {"tensor_model_parallel_size": 2, "data_parallel_size": 4}, {"world_size": 8, "etp": 1},
                   {"dp": 4, "expert_tensor_parallel_size": 2}):
        plan = plan_global_batch(lengths, parallel=layout, max_tokens_per_gpu=1000, balance_by_flops=False)
        rc = RunConfig.from_dict({"name": "t", "model": "qwen3-8b", "parallel": layout, "max_tokens_per_gpu": 1000})
        assert plan.parallel == rc.parallel(), layout
    assert ParallelConfig.from_any({"world_size": 16, "tp": 2, "cp": 2}).dp == 4


HOSTILE_LAYOUTS = [
    ({"world_size": 12, "tp": 8}, "parallel.world_size", "not divisible by tp x pp x cp"),
    ({"world_size": 8, "dp": 3}, "parallel.dp", "gives dp=8"),
    ({"world_size": 0}, "parallel.world_size", "positive integer"),
    ({"world_size": -8}, "parallel.world_size", "positive integer"),
    ({"world_size": 8.0}, "parallel.world_size", "positive integer"),
    ({"world_size": "8"}, "parallel.world_size", "positive integer"),
    ({"world_size": True}, "parallel.world_size", "positive integer"),
    ({"world_size": 2 ** 40}, "parallel.world_size", "positive integer"),
    ({"etp": 0}, "parallel.etp", "positive integer"),
    ({"etp": 2, "expert_tensor_parallel_size": 4}, "parallel.etp", "conflicts"),
    ({"word_size": 8}, "parallel.word_size", "did you mean 'world_size'"),
    ({"tp": 2, "tensor_model_parallel_size": 4}, "parallel.tensor_model_parallel_size", "second time"),
    ({1: 2}, "parallel.1", "unknown parallel field"),
    ([("dp", 2)], "parallel", "must be a ParallelConfig or a mapping"),
    ("dp=8", "parallel", "must be a ParallelConfig or a mapping"),
    (8, "parallel", "must be a ParallelConfig or a mapping"),
]


@pytest.mark.parametrize("layout,field,problem", HOSTILE_LAYOUTS, ids=[repr(h[0])[:40] for h in HOSTILE_LAYOUTS])
def test_parallel_refuses_what_presets_refuse_in_the_same_words(layout, field, problem):
    """``plan_global_batch(parallel=...)`` and a run preset's ``parallel:`` go through one function: the same
    field, value, problem and fix."""
    from megatron_dynbatch.core.run_config import RunConfig

    with pytest.raises(DynBatchConfigError) as planner:
        plan_global_batch([100] * 8, parallel=layout, max_tokens_per_gpu=1000, balance_by_flops=False)
    assert planner.value.field == field and problem in str(planner.value) and "Fix:" in str(planner.value)
    with pytest.raises(DynBatchConfigError) as preset:
        RunConfig.from_dict({"name": "t", "model": "qwen3-8b", "parallel": layout, "max_tokens_per_gpu": 1000})
    assert str(preset.value) == str(planner.value)
