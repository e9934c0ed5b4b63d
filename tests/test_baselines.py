"""The baseline family: placement, determinism, the partitioning primitives, and honest accounting."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_dynbatch.bench.baselines import (
    BASELINES,
    BaselineContext,
    adjust_bin_count,
    first_fit,
    fixed_padded,
    get_baseline,
    karmarkar_karp,
    modified_first_fit_decreasing,
    run_baseline,
    slime,
    split_largest_bins,
    verl,
)
from megatron_dynbatch.core.errors import DynBatchConfigError

LAYOUTS = [
    ({"dp": 4}, 4096),
    ({"dp": 2, "tp": 2, "cp": 2}, 2048),
    ({"dp": 2, "pp": 2, "vpp": 2}, 4096),
    ({"dp": 4, "ep": 2}, 4096),
]


def _lengths(seed: int, n: int = 96, hi: int = 3000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(600), 0.9, n), 1, hi).astype(np.int64)


def _brute_max(w, k):
    best = None
    for assign in itertools.product(range(k), repeat=len(w)):
        sums = np.zeros(k)
        for x, a in zip(w, assign):
            sums[a] += x
        best = sums.max() if best is None else min(best, sums.max())
    return best


# ----------------------------------------------------------------------------------------- every baseline
@pytest.mark.parametrize("name", sorted(BASELINES))
@pytest.mark.parametrize("layout,budget", LAYOUTS)
def test_every_sample_placed_exactly_once(name, layout, budget):
    lengths = _lengths(1)
    ctx = BaselineContext.build(layout, budget, "tiny-gpt")
    mbs = get_baseline(name)(lengths, ctx)
    assert len(mbs) == ctx.parallel.dp
    placed = sorted(i for rank in mbs for mb in rank for i in mb)
    assert placed == list(range(lengths.size))


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_deterministic(name):
    lengths = _lengths(2)
    ctx = BaselineContext.build({"dp": 4, "cp": 2}, 2048, "tiny-gpt")
    assert get_baseline(name)(lengths, ctx) == get_baseline(name)(lengths.copy(), ctx)


@pytest.mark.parametrize("name", ["slime", "verl", "nemo_rl", "slime_flops"])
def test_same_count_on_every_rank_and_vpp_multiple(name):
    ctx = BaselineContext.build({"dp": 2, "pp": 2, "vpp": 2}, 4096, "tiny-gpt")
    mbs = get_baseline(name)(_lengths(3), ctx)
    counts = {len(r) for r in mbs}
    assert len(counts) == 1 and counts.pop() % 2 == 0  # N = pp = 2


def test_unknown_baseline_is_a_config_error():
    with pytest.raises(DynBatchConfigError, match="baseline"):
        get_baseline("nope")


def test_run_baseline_scores_with_the_planner_statistics():
    lengths = _lengths(4)
    ctx = BaselineContext.build({"dp": 4}, 4096, "tiny-gpt")
    res = run_baseline("slime", lengths, ctx)
    assert res.error is None and res.plan.algorithm == "slime"
    assert res.plan.real_tokens == int(lengths.sum())
    assert res.plan.cap_violations == 0  # first-fit on real tokens, no alignment padding here
    assert res.notes == []


def test_infeasible_batch_is_reported_not_raised():
    ctx = BaselineContext.build({"dp": 2}, 100, None)
    res = run_baseline("verl", [50, 150, 20, 30], ctx)  # verl asserts every sample fits the budget
    assert res.plan is None and "budget" in res.error


# ----------------------------------------------------------------------------------------- Karmarkar-Karp
def test_kk_two_way_is_optimal_up_to_four_items():
    rng = np.random.default_rng(0)
    for _ in range(150):
        w = rng.integers(1, 60, rng.integers(1, 5))
        parts = karmarkar_karp(w, 2)
        assert sorted(i for p in parts for i in p) == list(range(w.size))
        assert max(w[p].sum() for p in parts) == _brute_max(w, 2)


def test_kk_multiway_within_the_differencing_bound():
    rng = np.random.default_rng(1)
    for _ in range(60):
        k = int(rng.integers(2, 4))
        w = rng.integers(1, 60, rng.integers(1, 8))
        parts = karmarkar_karp(w, k)
        assert len(parts) == k
        assert sorted(i for p in parts for i in p) == list(range(w.size))
        assert max(w[p].sum() for p in parts) <= 4 / 3 * _brute_max(w, k) + 1e-9


def test_kk_equal_size():
    w = np.arange(1, 13)
    parts = karmarkar_karp(w, 3, equal_size=True)
    assert [len(p) for p in parts] == [4, 4, 4]
    assert {int(w[p].sum()) for p in parts} == {26}  # 1..12 splits perfectly
    uneven = karmarkar_karp(np.arange(1, 12), 3, equal_size=True)  # 11 items: sizes differ by at most one
    assert sorted(len(p) for p in uneven) == [3, 4, 4]
    assert sorted(i for p in uneven for i in p) == list(range(11))


def test_kk_more_parts_than_items_and_k_one():
    parts = karmarkar_karp([5, 3], 4)
    assert sorted(len(p) for p in parts) == [0, 0, 1, 1]
    assert karmarkar_karp([1, 2, 3], 1) == [[0, 1, 2]]


# ----------------------------------------------------------------------------------------- packers
def test_first_fit_matches_slime_help_example():
    assert first_fit([100, 200, 300], 300) == [[0, 1], [2]]


def test_split_largest_bins_never_grows_a_bin():
    sizes = np.array([9, 8, 7, 1, 1, 1])
    bins = split_largest_bins([[0, 1, 2], [3, 4, 5]], 4, sizes)
    assert len(bins) == 4 and sorted(i for b in bins for i in b) == list(range(6))
    assert max(sizes[b].sum() for b in bins) <= 24


def test_modified_ffd_respects_capacity():
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 1000, 300)
    bins = modified_first_fit_decreasing(sizes, 1000)
    assert sorted(i for b in bins for i in b) == list(range(sizes.size))
    assert max(sizes[b].sum() for b in bins) <= 1000
    assert len(bins) <= np.ceil(sizes.sum() / 1000) * 1.25 + 1  # near the trivial bound on random items


def test_adjust_bin_count_when_fewer_bins_than_ranks():
    bins = adjust_bin_count([[0, 1, 2]], minimum=2, multiple=2)
    assert len(bins) == 2 and all(bins) and sorted(i for b in bins for i in b) == [0, 1, 2]
    assert len(adjust_bin_count([[0], [1], [2, 3, 4]], minimum=2, multiple=4)) == 4


def test_nemo_rl_pads_bin_count_to_dp():
    ctx = BaselineContext.build({"dp": 4}, 10000, None)
    mbs = get_baseline("nemo_rl")([10, 20, 30, 40, 50], ctx)  # one bin holds all; 4 ranks need 4 bins
    assert [len(r) for r in mbs] == [1, 1, 1, 1]


# ----------------------------------------------------------------------------------------- honest accounting
def test_verl_can_exceed_the_cap_and_it_is_counted():
    # 406 tokens, cap 100: verl asks for ceil(406/100) = 5 micro-batches, but no two samples fit together
    # (52 + 56 > 100), so one of its Karmarkar-Karp micro-batches must go over the budget.
    lengths = [52, 62, 97, 74, 65, 56]
    ctx = BaselineContext.build({"dp": 1}, 100, None)
    mbs = verl(np.array(lengths), ctx)
    assert len(mbs[0]) == 5
    res = run_baseline("verl", lengths, ctx)
    assert res.plan.cap_violations == 1 and res.plan.max_microbatch_tokens == 108
    assert all(len(r) for r in mbs)
    assert run_baseline("slime", lengths, ctx).plan.cap_violations == 0  # first-fit opens a sixth bin


def test_fixed_padded_padding_accounting():
    ctx = BaselineContext.build({"dp": 1}, 80, None)
    mbs = fixed_padded(np.array([10, 20, 30, 40]), ctx)
    assert mbs == [[[0, 1], [2, 3]]]  # mbs = 2: the largest power of two with mbs * 40 <= 80
    plan = run_baseline("fixed_padded", [10, 20, 30, 40], ctx).plan
    assert plan.microbatch_tokens == [[40, 80]]  # each micro-batch padded to its longest sample
    assert plan.padding_tokens == 20 and plan.real_tokens == 100
    assert plan.cap_violations == 0


def test_fixed_padded_contiguous_chunks_and_ragged_tail():
    ctx = BaselineContext.build({"dp": 2}, 64, None)
    mbs = fixed_padded(np.array([8] * 7), ctx)
    assert [i for mb in mbs[0] for i in mb] == [0, 1, 2, 3]  # contiguous chunk of rank 0
    assert [i for mb in mbs[1] for i in mb] == [4, 5, 6]
    res = run_baseline("fixed_padded", [8] * 7, ctx)
    assert res.notes == []  # 1 micro-batch of 4 and 1 of 3: same count, no empty one


def test_slime_alignment_overflow_is_counted_under_cp():
    # cp=2 pads every sequence to a multiple of 4; slime packs on real lengths, so 3 x 33 real tokens fit a
    # 100-token budget before padding (99) but not after (3 x 36 = 108).
    ctx = BaselineContext.build({"dp": 1, "cp": 2}, 50, None)
    res = run_baseline("slime", [33, 33, 33], ctx)
    assert res.plan.cap_violations == 1 and slime(np.array([33, 33, 33]), ctx) == [[[0, 1, 2]]]
