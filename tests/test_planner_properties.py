"""Property-based tests of the planner's invariants (see the docstring of megatron_dynbatch/core/planner/api.py).

Every generated workload must either produce a plan that satisfies all invariants, or raise a
``DynBatchConfigError`` of the documented kinds (too few samples for the ranks/count, an over-budget sample
under ``oversize='error'``). Nothing else -- no crash, no silent violation.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
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


def check_invariants(plan, lengths, par, groups=None, samples_per_step=None, mb_groups=None):
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
                # The only allowed excess: one over-budget sample alone (oversize='alone') -- or one over-budget
                # micro-batch group (microbatch_group_ids), alone.
                alone = len(mb) == 1 or (mb_groups is not None and len({mb_groups[i] for i in mb}) == 1)
                assert alone and set(mb) <= over, (r, j, mb, tokens, plan.cap)
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
    assert "max_tokens_per_gpu" in msg and "--max-tokens-per-gpu" not in msg and "sample" in msg
    assert str(per_gpu * par["cp"] + 1) in msg


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


# ---------------------------------------------------------------------- the drop-in knobs
@st.composite
def knobs(draw, n):
    """A random combination of the knobs the RL drop-ins need (integrations/), with the ids they take."""
    k = {}
    if draw(st.booleans()):
        k["equal_samples_per_rank"] = True
    if draw(st.booleans()):
        k["min_num_microbatches"] = draw(st.integers(1, 6))
    if draw(st.booleans()):
        k["num_microbatches_multiple"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        size = draw(st.sampled_from([2, 3]))
        k["microbatch_group_ids"] = [i // size for i in range(n)]
    if draw(st.booleans()):
        per = draw(st.sampled_from([1, 2, 3]))
        rollouts = -(-n // per)
        rps = draw(st.sampled_from([d for d in range(1, rollouts + 1) if rollouts % d == 0]))
        k["rollout_ids"] = [i // per for i in range(n)]
        k["rollouts_per_step"] = rps
    if draw(st.booleans()):
        k["sequence_pad_multiple"] = draw(st.sampled_from([2, 4, 8, 16]))
    if draw(st.booleans()):
        k["microbatch_pad_multiple"] = draw(st.sampled_from([2, 16, 64]))
    return k


def check_knobs(plan, lengths, par, k):
    """What each knob promises, on top of :func:`check_invariants`."""
    steps = len(plan.microbatches_per_step)
    for s, count in enumerate(plan.microbatches_per_step):
        assert count >= k.get("min_num_microbatches", 1)
        assert count % k.get("num_microbatches_multiple", 1) == 0
        if k.get("equal_samples_per_rank"):
            sizes = {sum(len(mb) for mb in plan.step_microbatches(r, s)) for r in range(plan.dp)}
            assert len(sizes) == 1, (s, sizes)
    if "microbatch_group_ids" in k:
        where = {i: (r, j) for r, rank in enumerate(plan.micro_batches) for j, mb in enumerate(rank) for i in mb}
        for g in set(k["microbatch_group_ids"]):
            assert len({where[i] for i, gg in enumerate(k["microbatch_group_ids"]) if gg == g}) == 1
    if "rollouts_per_step" in k:
        rids, rps = k["rollout_ids"], k["rollouts_per_step"]
        order = list(dict.fromkeys(rids))
        for s in range(steps):
            placed = {rids[i] for r in range(plan.dp) for mb in plan.step_microbatches(r, s) for i in mb}
            assert placed == set(order[s * rps:(s + 1) * rps])
    a = plan.alignment
    assert a.seq_multiple % k.get("sequence_pad_multiple", 1) == 0
    assert a.total_multiple % (k.get("microbatch_pad_multiple", 1) * par.get("cp", 1)) == 0


KNOB_ERRORS = ("without leaving one empty", "cannot share equally", "empty micro-batch", "spans two",
               "group spans optimizer steps", "smaller than one aligned sequence", "rollouts of the batch")


@SETTINGS
@given(workloads(), st.data())
def test_knobs_keep_the_invariants_or_explain(workload, data):
    par, per_gpu, lengths, groups, kind = workload
    k = data.draw(knobs(len(lengths)))
    if "microbatch_group_ids" in k and groups is not None:
        groups = [k["microbatch_group_ids"][i] for i in range(len(lengths))]  # a pair inside one rank group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        try:
            plan = plan_global_batch(lengths, parallel=par, max_tokens_per_gpu=per_gpu, balance_by_flops=False,
                                     group_ids=groups, oversize="alone", **k)
        except DynBatchConfigError as err:
            assert err.fix and err.field
            assert any(s in str(err) for s in KNOB_ERRORS), str(err)
            return
    check_invariants(plan, lengths, par, groups, mb_groups=k.get("microbatch_group_ids"))
    check_knobs(plan, lengths, par, k)


@SETTINGS
@given(workloads())
def test_knobs_off_change_nothing(workload):
    """Every knob at its default value plans exactly as without it."""
    par, per_gpu, lengths, groups, _ = workload
    kw = dict(parallel=par, max_tokens_per_gpu=per_gpu, balance_by_flops=False, group_ids=groups, oversize="alone")
    off = dict(equal_samples_per_rank=False, microbatch_group_ids=None, min_num_microbatches=1,
               num_microbatches_multiple=1, rollout_ids=None, rollouts_per_step=None, sequence_pad_multiple=1,
               microbatch_pad_multiple=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        try:
            a = plan_global_batch(lengths, **kw)
        except DynBatchConfigError as err:
            with pytest.raises(DynBatchConfigError) as again:
                plan_global_batch(lengths, **kw, **off)
            assert str(again.value) == str(err)
            return
        b = plan_global_batch(lengths, **kw, **off)
    assert a.micro_batches == b.micro_batches and a.microbatch_tokens == b.microbatch_tokens


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**31 - 1), st.data())
def test_equal_samples_always_plan_when_counts_divide(dp, per_rank, seed, data):
    """Every sample within the budget and a batch that divides by dp: an equal-count plan always exists (one
    sample per micro-batch at worst), and the planner finds one."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4000, size=dp * per_rank).tolist()
    group = data.draw(st.sampled_from([None, 1, per_rank]))
    groups = None if group is None else [i // group for i in range(len(lengths))]
    plan = plan_global_batch(lengths, model="tiny-gpt", parallel={"dp": dp}, max_tokens_per_gpu=4096,
                             equal_samples_per_rank=True, group_ids=groups)
    check_invariants(plan, lengths, {"dp": dp}, groups)
    assert {len(plan.rank_samples(r)) for r in range(dp)} == {per_rank}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=60), st.integers(1, 5), st.integers(0, 6),
       st.sampled_from([None, 2, 3]), st.sampled_from([{}, {"pp": 2, "vpp": 2}, {"cp": 2}]))
def test_local_mode_agreed_count_plans_on_every_rank(all_lengths, ranks, extra, multiple, layout):
    """Local mode: the maximum of the ranks' own first counts (one all-reduce) packs on every rank, within the
    cap, and so does any larger valid count the ranks still have samples for."""
    from megatron_dynbatch import local_microbatch_counts, plan_local_batch

    parts = [all_lengths[r::ranks] for r in range(ranks)]
    kw = dict(parallel={"dp": ranks, **layout}, max_tokens_per_gpu=4096, balance_by_flops=False,
              num_microbatches_multiple=multiple, oversize="alone")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        try:
            counts = [local_microbatch_counts(p, **kw) for p in parts if p]
        except DynBatchConfigError as err:
            assert "without leaving one empty" in str(err) or "empty micro-batch" in str(err), str(err)
            return
        agreed = max(c[0] for c in counts)
        for target in (agreed, agreed + extra * (multiple or 1)):
            for p in parts:
                if not p:
                    continue
                if target > len(p):
                    with pytest.raises(DynBatchConfigError):
                        plan_local_batch(p, num_microbatches=target, **kw)
                    continue
                if layout.get("vpp") and not (target >= 2 and target % 2 == 0):
                    continue  # a count the VPP rule refuses is never agreed on
                plan = plan_local_batch(p, num_microbatches=target, **kw)
                check_invariants(plan, p, {"dp": 1, **layout})
                assert plan.num_microbatches == target


def test_forced_count_above_a_packing_one_is_never_refused():
    """A forced count the balancing packer misses still plans: a smaller count's micro-batches are split."""
    lengths = [7, 9, 7, 5, 4, 6] * 3
    for m in range(6, 10):
        plan = plan_global_batch(lengths, parallel={"dp": 2}, max_tokens_per_gpu=11, balance_by_flops=False,
                                 num_microbatches=m)
        check_invariants(plan, lengths, {"dp": 2})
        assert plan.num_microbatches == m


#: one optimizer step of a slime rollout (31 samples, two over the 512-token budget, placed alone): Megatron's
#: VPP rule (pp=3, N=3) leaves M=3 as the only count <= 31 // 6, i.e. 16 micro-batches for 29 samples at 94.6%
#: fill. Best fit needs 17; a packing into 16 exists, and the planner must find it rather than refuse the batch.
TIGHT_STEP = [585, 581, 510, 499, 474, 447, 446, 429, 422, 422, 376, 343, 283, 275, 266, 258, 255, 246, 236, 186,
              185, 164, 154, 154, 153, 147, 114, 106, 77, 70, 49]


def test_tight_count_forced_by_vpp_is_packed_not_refused():
    layout = {"dp": 6, "pp": 3, "vpp": 2, "microbatch_group_size_per_vp_stage": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        plan = plan_global_batch(TIGHT_STEP, parallel=layout, max_tokens_per_gpu=512, balance_by_flops=False,
                                 oversize="alone")
    check_invariants(plan, TIGHT_STEP, layout)
    assert plan.num_microbatches == 3


def test_a_tight_packing_the_item_search_misses_is_found_by_bin_completion():
    """Hypothesis found this step (dp=5, cap 256, M=3 forced by pp=3 vpp=2 N=3): 28 samples that fill 15 bins
    90-100%. The item-by-item dive spends its share without a packing; bin completion finds one."""
    from megatron_dynbatch.core.planner import fallback

    lengths = [253, 249, 246, 240, 238, 237, 219, 169, 162, 134, 129, 110, 106, 103, 98, 96, 93, 89, 88, 86, 79, 76,
               73, 71, 70, 65, 59, 16]
    layout = {"dp": 5, "pp": 3, "vpp": 2, "microbatch_group_size_per_vp_stage": 3}
    plan = plan_global_batch(lengths, parallel=layout, max_tokens_per_gpu=256, balance_by_flops=False)
    check_invariants(plan, lengths, layout)
    assert plan.num_microbatches == 3
    size = sorted(lengths, reverse=True)
    left = np.concatenate((np.cumsum(size[::-1])[::-1], [0])).tolist()
    assert fallback._dive(size, left, 256, 15, fallback.BIN_SEARCH_WORK, [0]) is None
    spent = [0]
    bins = fallback._complete_bins(size, 256, 15, fallback.BIN_SEARCH_WORK, spent)
    assert bins is not None and spent[0] <= fallback.BIN_SEARCH_WORK
    loads = np.bincount(bins, weights=size, minlength=15)
    assert loads.max() <= 256 and sorted(set(bins)) == list(range(15))


@pytest.mark.parametrize("size,cap,k,packs", [
    ([5, 5, 5, 5], 10, 2, True), ([6, 6, 6], 10, 2, False), ([7, 3, 6, 4], 10, 2, True),
    ([], 10, 1, True), ([11], 10, 1, False), ([4, 3, 3], 10, 1, True),
    # the first completion of a bin is a dead end and the search must come back to it:
    ([9, 8, 8, 7, 7, 7, 5, 5], 20, 3, True), ([9, 9, 8, 8, 8, 7, 6, 3, 1, 1], 20, 3, False),
])
def test_bin_completion_small_cases(size, cap, k, packs):
    from megatron_dynbatch.core.planner.fallback import _complete_bins

    size = sorted(size, reverse=True)
    bins = _complete_bins(size, cap, k, 10_000, [0])
    assert (bins is not None) == packs
    if bins:
        assert max(np.bincount(bins, weights=size)) <= cap and max(bins) < k


@SETTINGS
@given(st.integers(2, 8), st.sampled_from([256, 512, 1000, 4096]), st.integers(0, 2 ** 31 - 1))
def test_a_count_that_packs_is_never_refused(dp, cap, seed):
    """Steps built with a known packing into ``dp * 3`` micro-batches (each cut into 1-3 samples, 90-100% full),
    where Megatron's VPP rule (pp=3, N=3) leaves M=3 as the only count: the planner must find a packing. (Best fit
    alone misses some of these; before the bin search the planner refused them.)"""
    rng = np.random.default_rng(seed)
    lengths: list = []
    for _ in range(dp * 3):
        fill = int(cap * rng.uniform(0.9, 1.0))
        pieces = min(int(rng.integers(1, 4)), fill)
        cuts = np.sort(rng.choice(np.arange(1, fill), size=pieces - 1, replace=False)) if pieces > 1 else []
        lengths += np.diff(np.concatenate(([0], cuts, [fill]))).astype(int).tolist()
    rng.shuffle(lengths)
    assume(len(lengths) < 6 * dp)  # M=6 would also be valid: splitting could hide a refused M=3
    layout = {"dp": dp, "pp": 3, "vpp": 2, "microbatch_group_size_per_vp_stage": 3}
    plan = plan_global_batch(lengths, parallel=layout, max_tokens_per_gpu=cap, balance_by_flops=False)
    check_invariants(plan, lengths, layout)
    assert plan.num_microbatches == 3


def test_counts_per_step_can_differ_when_forced():
    lengths = [100] * 8 + [900] * 8
    plan = plan_global_batch(lengths, parallel={"dp": 2}, max_tokens_per_gpu=1000, balance_by_flops=False,
                             samples_per_step=8, num_microbatches=[1, 4])
    assert plan.microbatches_per_step == [1, 4]
    with pytest.raises(DynBatchConfigError, match="one count per optimizer step"):
        plan_global_batch(lengths, parallel={"dp": 2}, max_tokens_per_gpu=1000, balance_by_flops=False,
                          samples_per_step=8, num_microbatches=[1, 4, 4])


def test_rollout_steps_keep_multi_sample_rollouts_together():
    # rollout 0 emits 3 samples, rollout 1 two, rollout 2 four, rollout 3 one: two steps of two rollouts each
    rids = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    lengths = [50] * 10
    plan = plan_global_batch(lengths, parallel={"dp": 1}, max_tokens_per_gpu=120, balance_by_flops=False,
                             rollout_ids=rids, rollouts_per_step=2)
    assert len(plan.microbatches_per_step) == 2
    check_knobs(plan, lengths, {"dp": 1}, {"rollout_ids": rids, "rollouts_per_step": 2})
    with pytest.raises(DynBatchConfigError, match="rollouts_per_step"):
        plan_global_batch(lengths, max_tokens_per_gpu=120, balance_by_flops=False, rollout_ids=rids,
                          rollouts_per_step=3)


def test_padding_conventions_count_against_the_cap():
    # verl pads each sequence to tp*cp*2 = 16 (tp=4, cp=2); slime pads a CP rank's share to tp*128
    lengths = [1000, 17, 33, 4000, 250, 250, 1, 0]
    plan = plan_global_batch(lengths, parallel={"dp": 2, "tp": 4, "cp": 2}, max_tokens_per_gpu=2048,
                             balance_by_flops=False, sequence_pad_multiple=16, microbatch_pad_multiple=4 * 128)
    assert plan.alignment.seq_multiple == 16 and plan.alignment.total_multiple == 1024
    check_invariants(plan, lengths, {"dp": 2, "tp": 4, "cp": 2})
    assert all(t <= plan.cap for rank in plan.microbatch_tokens for t in rank)


def test_microbatch_group_over_the_cap_names_the_group():
    with pytest.raises(OversizeSampleError, match="micro-batch group 'pair-1'"):
        plan_global_batch([300, 300, 600, 600], parallel={"dp": 1}, max_tokens_per_gpu=1000,
                          balance_by_flops=False, microbatch_group_ids=["pair-0", "pair-0", "pair-1", "pair-1"])


# ---------------------------------------------------------------------- grouped batches that have a packing
def test_grouped_batch_whose_counts_pack_only_in_a_window_is_planned():
    """Issue 28, item 5: four prompt groups of 12, 16, 16 and 16 samples just over half the budget each (two per
    micro-batch) over dp=3. One rank must take two groups (28 samples: >= 14 micro-batches), the others hold 16
    each (<= 16 micro-batches): only 14..16 pack. The count search galloped from the token bound (10) over that
    window to 17 and refused the batch."""
    groups = ["prompt-1"] * 12 + ["prompt-2"] * 16 + ["prompt-3"] * 16 + ["prompt-4"] * 16
    plan = plan_global_batch([2049] * 60, parallel={"dp": 3}, max_tokens_per_gpu=4128, group_ids=groups,
                             balance_by_flops=False)
    check_invariants(plan, [2049] * 60, {"dp": 3}, groups)
    assert plan.num_microbatches == 14
    assert sorted(len(plan.rank_samples(r)) for r in range(3)) == [16, 16, 28]


def test_grouped_batch_whose_groups_must_split_exactly_is_planned():
    """Every rank needs exactly M=9 samples (one per micro-batch) and the groups (6, 9, 4, 5, 5, 2, 3, 2) split
    into four sets of 9 only a few ways: no greedy order finds one; the unit search (fallback.py) does."""
    sizes = [6, 9, 4, 5, 5, 2, 3, 2]
    groups = [g for g, k in enumerate(sizes) for _ in range(k)]
    plan = plan_global_batch([51] * 36, parallel={"dp": 4}, max_tokens_per_gpu=100, group_ids=groups,
                             balance_by_flops=False)
    check_invariants(plan, [51] * 36, {"dp": 4}, groups)
    assert plan.num_microbatches == 9


def feasible_grouped_batch(rng: np.random.Generator, dp: int, m: int, cap: int):
    """A batch built from a packing: ``dp`` ranks of ``m`` micro-batches, each filled to 20-100% of ``cap``
    (90-100% when tight) with 1-4 samples -- or with 1..k-1 samples of one size just over ``cap / k`` -- and each
    rank's samples cut into groups (a few large ones, or many small), groups and samples then shuffled."""
    tight, equal = rng.random() < 0.5, rng.random() < 0.4
    k = int(rng.integers(2, 5))
    size = cap // k + 1
    groups = []
    for _ in range(dp):
        items: list = []
        for _ in range(m):
            if equal:
                items += [size] * int(rng.integers(1, k))
                continue
            fill = max(1, int(cap * (rng.uniform(0.9, 1.0) if tight else rng.uniform(0.2, 1.0))))
            pieces = min(int(rng.integers(1, 3 if rng.random() < 0.5 else 5)), fill)
            cuts = np.sort(rng.choice(np.arange(1, fill), size=pieces - 1, replace=False)) if pieces > 1 else []
            items += np.diff(np.concatenate(([0], cuts, [fill]))).astype(int).tolist()
        rng.shuffle(items)
        if rng.random() < 0.5:  # a few large groups: the counts that pack form a narrow window
            cuts = sorted(rng.choice(np.arange(1, len(items)), size=min(int(rng.integers(0, 3)), len(items) - 1),
                                     replace=False).tolist())
            groups += [items[a:b] for a, b in zip([0] + cuts, cuts + [len(items)])]
        else:
            at = 0
            while at < len(items):
                step = int(rng.integers(1, max(2, len(items) // int(rng.integers(1, 4))) + 1))
                groups.append(items[at:at + step])
                at += step
    lengths, ids = [], []
    for g in rng.permutation(len(groups)).tolist():
        lengths += groups[g]
        ids += [f"group-{g}"] * len(groups[g])
    perm = rng.permutation(len(lengths)).tolist()
    return [lengths[p] for p in perm], [ids[p] for p in perm]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 16), st.integers(1, 24), st.sampled_from([64, 100, 1000, 4096]), st.integers(0, 2 ** 31 - 1),
       st.sampled_from(["tokens", "time", "time pp3"]))
@example(dp=10, m=1, cap=64, seed=212828, balance="tokens")  # 17 groups, 10 ranks of one micro-batch: token-tight
@example(dp=16, m=1, cap=64, seed=1372648637, balance="tokens")
@example(dp=14, m=1, cap=4096, seed=1298968589, balance="time")
def test_a_grouped_batch_that_packs_is_never_refused(dp, m, cap, seed, balance):
    """Grouped batches feasible by construction (:func:`feasible_grouped_batch`) always get a plan, within the
    searches' work limits (counted, not timed: the seconds live in the bench's planning-speed section). The
    examples: one micro-batch per rank and more groups than ranks, so ranks must take several groups to fit the
    tokens -- the unit search once grew a rank only until it had its ``m`` micro-batches' worth of samples, and
    refused these."""
    from unittest import mock

    from megatron_dynbatch.core.planner import fallback

    lengths, ids = feasible_grouped_batch(np.random.default_rng(seed), dp, m, cap)
    layout = {"dp": dp, "pp": 3} if balance == "time pp3" else {"dp": dp}
    kw = {"balance_by_flops": False} if balance == "tokens" else {"model": "qwen3-8b"}
    spent = {"units": 0, "bins": 0}
    search = fallback.units_search

    def counted(inp, dp_, m_, work):
        units, bins = work.units_left, work.left
        try:
            return search(inp, dp_, m_, work)
        finally:
            spent["units"] += units - work.units_left
            spent["bins"] += bins - work.left

    with mock.patch.object(fallback, "units_search", counted):
        plan = plan_global_batch(lengths, parallel=layout, max_tokens_per_gpu=cap, group_ids=ids, **kw)
    assert spent["units"] <= fallback.PLAN_UNIT_SEARCH_WORK and spent["bins"] <= fallback.PLAN_SEARCH_WORK
    check_invariants(plan, lengths, layout, ids)
