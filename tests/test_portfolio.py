"""The planner's portfolio (megatron_dynbatch/core/planner/portfolio.py): a plan is never slower, in the planner's
own model, than any cap-safe peer heuristic made into a valid plan under the planner's rules -- with
``decision_margin=0`` exactly, with the default margin by at most that margin -- and with ``pp == 1`` every rank
runs its micro-batches most padded tokens first (the memory order)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynbatch import DynBatchConfigError, OversizeSampleWarning, plan_global_batch
from megatron_dynbatch.bench.workloads import WORKLOADS
from megatron_dynbatch.core import partitioning
from megatron_dynbatch.core.planner import portfolio
from megatron_dynbatch.core.planner.options import PlanOptions
from megatron_dynbatch.core.planner.ordering import order_and_time
from megatron_dynbatch.core.planner.prepare import prepare

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    dp = draw(st.integers(1, 12))
    pp = draw(st.sampled_from([1, 1, 2, 4]))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    par = dict(dp=dp, pp=pp, vpp=vpp, cp=draw(st.sampled_from([1, 1, 2])), tp=draw(st.sampled_from([1, 2])),
               ep=draw(st.sampled_from([1, 1, 2])))
    per_gpu = draw(st.sampled_from([256, 1000, 4096]))
    cap = per_gpu * par["cp"]
    n = draw(st.integers(dp, 160))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))
    kind = draw(st.sampled_from(["uniform", "long_tail", "few_long", "giant"]))
    if kind == "uniform":
        lengths = rng.integers(1, cap + 1, size=n)
    elif kind == "long_tail":
        lengths = np.minimum(rng.lognormal(np.log(cap / 8), 1.2, size=n).astype(int) + 1, cap)
    elif kind == "few_long":  # long-tailed SFT, few samples per rank
        lengths = np.minimum(rng.pareto(1.2, size=n) * cap / 10 + 1, cap).astype(int)
    else:
        lengths = rng.integers(1, max(2, cap // 8), size=n)
        lengths[rng.integers(0, n)] = int(cap * 1.5)
    groups = None
    if draw(st.booleans()):
        size = draw(st.sampled_from([2, 4]))
        groups = [i // size for i in range(n)]
    steps = draw(st.sampled_from([None, 2])) if groups is None and n % 2 == 0 else None
    model = draw(st.sampled_from([None, "tiny-gpt"]))
    return dict(parallel=par, max_tokens_per_gpu=per_gpu, model=model, oversize="alone",
                samples_per_step=None if steps is None else n // steps), lengths.tolist(), groups


def _plan_and_peers(kwargs, lengths, groups):
    """The plan, and per optimizer step every valid peer candidate's ``(name, step time, count)`` (the
    strategies also try the count the search chose, as in the planner)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        try:
            plan = plan_global_batch(lengths, group_ids=groups, **kwargs)
        except DynBatchConfigError:
            return None, None
        with portfolio.disabled():
            searched = plan_global_batch(lengths, group_ids=groups, **kwargs).microbatches_per_step
        opts = PlanOptions.from_kwargs(kwargs)
        prep = prepare(lengths, opts.resolve(), group_ids=groups)
    sets = prep.search_settings()
    peers = []
    for step, count in zip(prep.steps, searched, strict=True):
        ctx = portfolio.StepContext(step.inp, sets, search_count=count)
        peers.append([(name, order_and_time(bins, step.inp.aligned, step.sq, sets.cost_model, sets.alignment)[1],
                       len(bins[0])) for name, bins in portfolio.candidates(ctx)])
    return plan, peers


@SETTINGS
@given(batches())
def test_never_slower_than_a_peer_heuristic_with_no_margin(batch):
    kwargs, lengths, groups = batch
    plan, peers = _plan_and_peers({**kwargs, "decision_margin": 0.0}, lengths, groups)
    if plan is None:
        return
    for s, step_peers in enumerate(peers):
        for name, t, _ in step_peers:
            assert plan.step_time[s] <= t * (1 + 1e-9), (s, name, plan.step_time[s], t)


@SETTINGS
@given(batches())
def test_never_slower_than_a_peer_heuristic_by_more_than_the_margin(batch):
    kwargs, lengths, groups = batch
    plan, peers = _plan_and_peers(kwargs, lengths, groups)
    if plan is None:
        return
    margin = PlanOptions.from_kwargs(kwargs).resolve().margin
    for s, step_peers in enumerate(peers):
        for name, t, _ in step_peers:
            assert plan.step_time[s] <= t * (1 + margin + 1e-9), (s, name, plan.step_time[s], t)


@SETTINGS
@given(batches())
def test_every_candidate_is_a_valid_plan_under_our_rules(batch):
    kwargs, lengths, groups = batch
    plan, peers = _plan_and_peers(kwargs, lengths, groups)
    if plan is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        prep = prepare(lengths, PlanOptions.from_kwargs(kwargs).resolve(), group_ids=groups)
    for step, count in zip(prep.steps, plan.microbatches_per_step, strict=True):
        ctx = portfolio.StepContext(step.inp, prep.search_settings(), search_count=count)
        for name, bins in portfolio.candidates(ctx):
            assert portfolio.is_valid(bins, ctx), name
            items = sorted(i for rank in bins for mb in rank for i in mb)
            assert items == list(range(step.inp.aligned.size)), name


def test_the_rules_refuse_a_broken_candidate():
    opts = PlanOptions(parallel=dict(dp=2), max_tokens_per_gpu=100)
    prep = prepare([60, 60, 30, 30], opts.resolve(), group_ids=[0, 0, 1, 1])
    ctx = portfolio.StepContext(prep.steps[0].inp, prep.search_settings())
    assert portfolio.is_valid([[[0], [1]], [[2], [3]]], ctx)
    assert not portfolio.is_valid([[[0, 1]], [[2, 3]]], ctx)          # 120 tokens over the cap of 100
    assert not portfolio.is_valid([[[0], [2]], [[1], [3]]], ctx)      # group 0 split over two ranks
    assert not portfolio.is_valid([[[0], [1]], [[2, 3]]], ctx)        # unequal counts
    assert not portfolio.is_valid([[[0], [1]], [[2], [2]]], ctx)      # a sample twice, one lost


def test_the_family_and_its_factory():
    assert set(portfolio.STRATEGIES) == {"karmarkar-karp", "first-fit-kk", "mffd", "next-fit"}
    assert portfolio.get_strategy("mffd").provenance
    with pytest.raises(DynBatchConfigError, match="karmarkar-karp"):
        portfolio.get_strategy("lpt")


def test_a_peer_heuristic_shortens_a_long_tailed_sft_step():
    """sft-longctx-70b-cp4-pp4, seed 1 (1,024 documents, dp=4, pp=4): a peer's partition, ordered and polished as
    the planner's, is 0.26% shorter than the count search's plan in the model; the portfolio keeps it."""
    w = WORKLOADS["sft-longctx-70b-cp4-pp4"]
    lengths = w.generate(1).lengths
    kwargs = dict(model=w.model, parallel=w.parallel, max_tokens_per_gpu=w.max_tokens_per_gpu)
    with_portfolio = plan_global_batch(lengths, **kwargs).predicted_step_time
    with portfolio.disabled():
        alone = plan_global_batch(lengths, **kwargs).predicted_step_time
    assert with_portfolio < alone * (1 - 1e-3)


@SETTINGS
@given(batches())
def test_pp1_ranks_run_the_largest_micro_batch_first(batch):
    kwargs, lengths, groups = batch
    par = {**kwargs["parallel"], "pp": 1, "vpp": 1, "ep": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        try:
            plan = plan_global_batch(lengths, group_ids=groups, **{**kwargs, "parallel": par})
        except DynBatchConfigError:
            return
    for r in range(plan.dp):
        start = 0
        for count in plan.microbatches_per_step:  # within each optimizer step
            tokens = plan.microbatch_tokens[r][start:start + count]
            assert tokens == sorted(tokens, reverse=True), (r, tokens)
            start += count


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 6), st.floats(0, 100, allow_nan=False)), max_size=70),
       st.integers(1, 40), st.booleans())
def test_karmarkar_karp_plain_python_twin_is_the_numpy_one(weights, k, equal):
    saved = partitioning.SMALL_K
    try:
        partitioning.SMALL_K = 0
        numpy_parts = partitioning.karmarkar_karp(weights, k, equal)
        partitioning.SMALL_K = 10 ** 9
        assert partitioning.karmarkar_karp(weights, k, equal) == numpy_parts
    finally:
        partitioning.SMALL_K = saved
