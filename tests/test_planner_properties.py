"""Property-based tests of the planner's invariants (see the docstring of megatron_dynbatch/core/planner/api.py).

Every generated workload must either produce a plan that satisfies all invariants, or raise a
``DynBatchConfigError`` of the documented kinds (too few samples for the ranks/count, an over-budget sample
under ``oversize='error'``). Nothing else -- no crash, no silent violation.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_dynbatch import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning, plan_global_batch
from megatron_dynbatch.core.planner import is_valid_microbatch_count

SETTINGS = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw):
    dp = draw(st.integers(1, 12))
    pp = draw(st.sampled_from([1, 1, 2, 4]))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    n_group = draw(st.sampled_from([None, pp, pp + 1, 2 * pp])) if vpp > 1 else None
    cp = draw(st.sampled_from([1, 1, 2, 4]))
    tp = draw(st.sampled_from([1, 2]))
    sp = draw(st.booleans()) if tp > 1 else False
    ep = draw(st.sampled_from([1, 1, 2, 4]))
    return dict(dp=dp, pp=pp, vpp=vpp, cp=cp, tp=tp, ep=ep, sequence_parallel=sp,
                microbatch_group_size_per_vp_stage=n_group)


@st.composite
def workloads(draw):
    par = draw(layouts())
    per_gpu = draw(st.sampled_from([64, 100, 256, 1000, 4096]))
    cap = per_gpu * par["cp"]
    kind = draw(st.sampled_from(["uniform", "long_tail", "half_plus_one", "tiny", "with_zeros", "at_cap", "giant"]))
    n = draw(st.integers(1, 160))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        lengths = rng.integers(1, cap + 1, size=n)
    elif kind == "long_tail":
        lengths = np.minimum(rng.lognormal(np.log(max(cap, 8) / 8), 1.2, size=n).astype(int), cap)
    elif kind == "half_plus_one":
        lengths = np.full(n, cap // 2 + 1)
    elif kind == "tiny":
        lengths = rng.integers(0, 4, size=n)
    elif kind == "with_zeros":
        lengths = np.where(rng.random(n) < 0.3, 0, rng.integers(1, cap + 1, size=n))
    elif kind == "at_cap":
        lengths = np.where(rng.random(n) < 0.5, cap, rng.integers(1, max(2, cap // 4), size=n))
    else:  # one or two samples far over the budget among small ones
        lengths = rng.integers(1, max(2, cap // 8), size=n)
        lengths[rng.integers(0, n, size=2)] = int(cap * 1.5) + 1
    groups = None
    if draw(st.booleans()):
        size = draw(st.sampled_from([1, 2, 4, 8]))
        groups = [i // size for i in range(n)]
    return par, per_gpu, lengths.astype(int).tolist(), groups, kind


def check_invariants(plan, lengths, par, groups=None, samples_per_step=None):
    n = len(lengths)
    plan.validate(n)  # every sample once, no empty micro-batch, equal counts, steps sum up
    assert plan.dp == par["dp"]
    m = plan.num_microbatches
    assert m >= plan.lower_bound_microbatches
    for count in plan.microbatches_per_step:
        assert is_valid_microbatch_count(count, plan.parallel)
    over = set(plan.oversize_samples)
    for r, rank in enumerate(plan.micro_batches):
        for j, mb in enumerate(rank):
            tokens = plan.microbatch_tokens[r][j]
            assert tokens % plan.alignment.total_multiple == 0
            slots = sum(plan.alignment.seq_len(lengths[i]) for i in mb)
            assert tokens == plan.alignment.padded_total(slots)
            if tokens > plan.cap:
                # The only allowed excess: one over-budget sample alone (oversize='alone').
                assert len(mb) == 1 and mb[0] in over, (r, j, mb, tokens, plan.cap)
    if groups is not None:
        rank_of = {i: r for r in range(plan.dp) for i in plan.rank_samples(r)}
        for g in set(groups):
            assert len({rank_of[i] for i, gg in enumerate(groups) if gg == g}) == 1
    if samples_per_step is not None:
        for s in range(len(plan.microbatches_per_step)):
            placed = sorted(i for r in range(plan.dp) for mb in plan.step_microbatches(r, s) for i in mb)
            assert placed == list(range(s * samples_per_step, (s + 1) * samples_per_step))
    padding = sum(sum(rank) for rank in plan.microbatch_tokens) - sum(lengths)
    assert plan.padding_tokens == padding >= 0


@SETTINGS
@given(workloads(), st.booleans())
def test_invariants_hold_or_clear_error(workload, by_flops):
    par, per_gpu, lengths, groups, _ = workload
    model = "tiny-gpt" if by_flops else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        try:
            plan = plan_global_batch(lengths, model=model, parallel=par, max_tokens_per_gpu=per_gpu,
                                     balance_by_flops=by_flops, group_ids=groups, oversize="alone")
        except DynBatchConfigError as err:
            # Documented infeasibility only: not enough samples/groups to fill every rank's micro-batches.
            assert err.fix and err.field
            assert "empty micro-batch" in str(err) or "without leaving one empty" in str(err), str(err)
            return
    check_invariants(plan, lengths, par, groups)


@SETTINGS
@given(workloads())
def test_oversize_error_policy_names_sample_and_flag(workload):
    par, per_gpu, lengths, _, kind = workload
    assume(kind != "giant")
    lengths = list(lengths) + [per_gpu * par["cp"] + 1]  # one sample that can never fit
    with pytest.raises(OversizeSampleError) as info:
        plan_global_batch(lengths, parallel=par, max_tokens_per_gpu=per_gpu, balance_by_flops=False)
    msg = str(info.value)
    assert "--max-tokens-per-gpu" in msg and "sample" in msg and str(per_gpu * par["cp"] + 1) in msg


@SETTINGS
@given(workloads())
def test_deterministic(workload):
    par, per_gpu, lengths, groups, _ = workload
    kwargs = dict(parallel=par, max_tokens_per_gpu=per_gpu, balance_by_flops=False, group_ids=groups,
                  oversize="alone")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        try:
            a = plan_global_batch(lengths, **kwargs)
        except DynBatchConfigError:
            return
        b = plan_global_batch(list(lengths), **kwargs)
    assert a.micro_batches == b.micro_batches
    assert a.microbatch_tokens == b.microbatch_tokens


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_samples_per_step_and_groups(dp, steps, group_size, seed):
    rng = np.random.default_rng(seed)
    groups_per_step = dp * int(rng.integers(1, 4))
    sps = groups_per_step * group_size
    n = sps * steps
    lengths = rng.integers(1, 3000, size=n).tolist()
    groups = [i // group_size for i in range(n)]
    plan = plan_global_batch(lengths, model="tiny-gpt", parallel={"dp": dp}, max_tokens_per_gpu=4096,
                             group_ids=groups, samples_per_step=sps)
    assert len(plan.microbatches_per_step) == steps
    check_invariants(plan, lengths, {"dp": dp}, groups, sps)


# ---------------------------------------------------------------------- adversarial cases
@pytest.mark.parametrize("dp", [1, 3, 8])
def test_all_lengths_half_cap_plus_one(dp):
    cap = 1000
    lengths = [cap // 2 + 1] * (5 * dp)
    plan = plan_global_batch(lengths, parallel={"dp": dp}, max_tokens_per_gpu=cap, balance_by_flops=False)
    check_invariants(plan, lengths, {"dp": dp})
    assert plan.num_microbatches == 5  # no two fit together
    assert all(len(mb) == 1 for rank in plan.micro_batches for mb in rank)


def test_one_giant_sample_error_and_alone():
    lengths = [100] * 15 + [50_000]
    with pytest.raises(OversizeSampleError, match=r"sample 15 has 50000 tokens"):
        plan_global_batch(lengths, parallel={"dp": 2}, max_tokens_per_gpu=4096, balance_by_flops=False)
    with pytest.warns(OversizeSampleWarning, match="sample 15"):
        plan = plan_global_batch(lengths, parallel={"dp": 2}, max_tokens_per_gpu=4096, balance_by_flops=False,
                                 oversize="alone")
    check_invariants(plan, lengths, {"dp": 2})
    assert plan.oversize_samples == [15]
    assert plan.cap_violations == 1
    giant = [mb for rank in plan.micro_batches for mb in rank if 15 in mb]
    assert giant == [[15]]


def test_fewer_samples_than_dp_ranks():
    with pytest.raises(DynBatchConfigError, match=r"fewer samples than dp=4") as info:
        plan_global_batch([10, 20, 30], parallel={"dp": 4}, max_tokens_per_gpu=100, balance_by_flops=False)
    assert info.value.field == "len(lengths)"


def test_zero_length_samples_take_one_slot():
    lengths = [0, 0, 5, 0, 7, 0]
    plan = plan_global_batch(lengths, parallel={"dp": 2, "cp": 2}, max_tokens_per_gpu=8, balance_by_flops=False)
    check_invariants(plan, lengths, {"dp": 2, "cp": 2})
    assert all(t > 0 for rank in plan.microbatch_tokens for t in rank)


def test_vpp_rule_is_satisfied_exactly():
    lengths = [500] * 40
    par = {"dp": 2, "pp": 4, "vpp": 2, "microbatch_group_size_per_vp_stage": 6}
    plan = plan_global_batch(lengths, parallel=par, max_tokens_per_gpu=1000, balance_by_flops=False)
    m = plan.num_microbatches
    assert m >= 6 and (m % 6 == 0 or m % 6 >= 4)


def test_impossible_vpp_constraint_is_a_clear_error():
    par = {"dp": 2, "pp": 4, "vpp": 2}
    with pytest.raises(DynBatchConfigError, match=r"microbatch_group_size_per_vp_stage=4"):
        plan_global_batch([100] * 6, parallel=par, max_tokens_per_gpu=1000, balance_by_flops=False)


def test_plan_json_round_trip():
    from megatron_dynbatch import Plan

    plan = plan_global_batch(list(range(1, 50)), model="tiny-gpt", parallel={"dp": 3}, max_tokens_per_gpu=128)
    again = Plan.from_dict(__import__("json").loads(plan.to_json()))
    assert again.micro_batches == plan.micro_batches
    assert again.summary()["num_microbatches"] == plan.num_microbatches


def test_flops_balance_beats_token_balance_on_quadratic_workload():
    # Same tokens, very different attention cost: FLOPs balancing must even out FLOPs across ranks.
    rng = np.random.default_rng(0)
    lengths = np.concatenate([np.full(8, 16000), rng.integers(200, 800, size=400)]).tolist()
    kw = dict(model="qwen3-8b", parallel={"dp": 4}, max_tokens_per_gpu=32768)
    flops = plan_global_batch(lengths, balance_by_flops=True, **kw)
    tokens = plan_global_batch(lengths, balance_by_flops=False, **kw)
    assert flops.flops_imbalance <= tokens.flops_imbalance
    assert flops.flops_imbalance < 1.01
