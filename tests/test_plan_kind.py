"""Both plan kinds implement ``PlanKind`` with one meaning per member (``dp`` = data-parallel ranks, rows, CP
groups, per-GPU budget), neither subclasses the other, and both round-trip through ``to_dict`` / ``from_dict``;
``dynamic_forward_backward``'s keywords of before land in the typed objects they belong to."""

import dataclasses
import json

import numpy as np
import pytest

from megatron_dynbatch import DynamicCPPlan, Plan, PlanKind, plan_global_batch
from megatron_dynbatch.core.errors import DynBatchConfigError

LENGTHS = np.random.default_rng(3).integers(10, 2000, 48)
LAYOUT = {"dp": 2, "cp": 2}


def _plans():
    plain = plan_global_batch(LENGTHS, parallel=LAYOUT, max_tokens_per_gpu=1024, balance_by_flops=False)
    dyn = plan_global_batch(LENGTHS, parallel=LAYOUT, max_tokens_per_gpu=1024, dynamic_cp=True)
    return plain, dyn


def test_kinds_are_siblings_and_no_field_is_redefined():
    plain, dyn = _plans()
    assert isinstance(plain, PlanKind) and isinstance(dyn, PlanKind)
    assert not isinstance(dyn, Plan) and not isinstance(plain, DynamicCPPlan)
    shared = {f.name for f in dataclasses.fields(PlanKind)}
    own = {f.name for f in dataclasses.fields(DynamicCPPlan)} - shared
    assert own == {"groups", "max_tokens_per_gpu", "fp8_tile", "fixed_cp_step_time", "candidate"}
    assert {f.name for f in dataclasses.fields(Plan)} == shared


def test_dp_is_data_parallel_ranks_in_both_kinds():
    plain, dyn = _plans()
    assert plain.dp == dyn.dp == 2 and plain.summary()["dp"] == dyn.summary()["dp"] == 2
    assert plain.num_rows == 2 and dyn.num_rows == dyn.pool_size == 4
    assert plain.max_tokens_per_gpu == dyn.max_tokens_per_gpu == 1024
    assert plain.cap == 2048 and dyn.cap == 1024  # the unit of microbatch_tokens: gpus_per_entry says which
    assert plain.gpus_per_entry == 2 and dyn.gpus_per_entry == 1


def test_rows_groups_and_packed_tokens_agree_with_the_plan():
    plain, dyn = _plans()
    for plan in (plain, dyn):
        for d in range(2):
            for c in range(2):
                row = plan.row_of(d, c)
                assert row == (d * 2 + c if plan.dynamic_cp else d)
                for j, mb in enumerate(plan.micro_batches[row]):
                    start, size = plan.cp_group(row, j)
                    assert start <= d * 2 + c < start + size  # this GPU is in the micro-batch's group
                    assert plan.packed_tokens(row, j, LENGTHS[mb]) == plan.microbatch_tokens[row][j]
    assert plain.group_sizes() == {2: plain.num_microbatches * 2}
    assert sum(dyn.group_sizes().values()) >= dyn.num_microbatches


def test_round_trips_through_either_reader():
    for plan in _plans():
        d = json.loads(plan.to_json())
        for reader in (Plan, PlanKind, type(plan)):
            back = reader.from_dict(d)
            assert type(back) is type(plan)
            assert json.dumps(back.to_dict(), sort_keys=True) == json.dumps(plan.to_dict(), sort_keys=True)
    with pytest.raises(DynBatchConfigError, match="kind"):
        PlanKind.from_dict({**json.loads(_plans()[0].to_json()), "kind": "nope"})


def test_old_keywords_land_in_the_typed_step_objects():
    pytest.importorskip("torch")
    from megatron_dynbatch.megatron.step_config import MegatronSchedule, StepConfig, split_keywords

    cfg, sched, hooks = split_keywords({"loss_mode": "sample_mean", "step": 1, "config": "c", "memory_guard": "g",
                                        "first_val_step": True})
    assert (cfg.loss_mode, cfg.step, sched.config, hooks.memory_guard) == ("sample_mean", 1, "c", "g")
    assert dict(sched.extra) == {"first_val_step": True}  # any other name still goes to forward_backward_func
    cfg, sched, _ = split_keywords({"x": 1}, StepConfig(step=2), MegatronSchedule(extra={"y": 2}))
    assert cfg.step == 2 and dict(sched.extra) == {"y": 2, "x": 1}
    with pytest.raises(DynBatchConfigError, match="loss_mode"):
        StepConfig(loss_mode="mean")
