"""The planner's per-step fast paths compute exactly what its NumPy paths compute.

A plan of many small optimizer steps runs each step in plain Python (``megatron_dynbatch/core/smallops.py``,
``smallops.is_small``): the rank refinement's exchange searches, the packing, the lower bound, the micro-batch
and rank timing of the ordering and the pipeline polish. Each twin is checked here against its NumPy original
on random inputs -- values bit for bit, choices with ties (equal weights and times drawn on purpose) -- and
whole plans with the fast paths on and off (:func:`numpy_paths` sends every step down the NumPy paths).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynbatch import DynBatchConfigError, plan_global_batch
from megatron_dynbatch.core import smallops
from megatron_dynbatch.core.alignment import Alignment
from megatron_dynbatch.core.cost_model import CostModel
from megatron_dynbatch.core.parallel import ParallelConfig
from megatron_dynbatch.core.planner import bounds, ordering, packer, search
from megatron_dynbatch.core.planner.local import local_microbatch_counts
from megatron_dynbatch.core.planner.ordering import PATTERNS, RankTimes, SmallRankTimes, TimingMemo
from megatron_dynbatch.core.planner.packer import StepInput
from megatron_dynbatch.core.planner.options import PlanOptions
from megatron_dynbatch.core.planner.prepare import prepare
from megatron_dynbatch.core.planner.timing import step_times_of

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PLAN_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def numpy_paths():
    """Every step down the NumPy paths: no step is small, no exchange search runs in plain Python."""
    saved = smallops.SMALL_STEP, packer.SMALL_PAIR, packer.SMALL_GLOBAL
    smallops.SMALL_STEP, packer.SMALL_PAIR, packer.SMALL_GLOBAL = 0, -1, -1
    try:
        yield
    finally:
        smallops.SMALL_STEP, packer.SMALL_PAIR, packer.SMALL_GLOBAL = saved


def bits(x) -> bytes:
    """The float64 bits of a float or a list of them (so 0.0 and -0.0 differ, as they would in a plan)."""
    return np.asarray(x, dtype=np.float64).tobytes()


def test_numpy_paths_switch_is_a_real_switch():
    assert smallops.is_small(4)
    with numpy_paths():
        assert not smallops.is_small(1)
    assert smallops.is_small(4)


# ------------------------------------------------------------------------------------------------ sums
magnitudes = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False, allow_infinity=False)
floats = st.one_of(magnitudes, st.floats(min_value=0, max_value=1e-3), st.sampled_from([0.0, 1.0, 0.1, 1e16, 3.0]))


@SETTINGS
@given(st.lists(floats, max_size=20))
def test_np_sum_is_numpys_sum(values):
    assert bits(smallops.np_sum(values)) == bits(np.sum(np.asarray(values, dtype=np.float64)))


@SETTINGS
@given(st.lists(floats, min_size=1, max_size=20))
def test_segment_sum_is_reduceat(values):
    arr = np.asarray([7.5] + values, dtype=np.float64)
    assert bits(ordering.segment_sum(values)) == bits(np.add.reduceat(arr, [0, 1])[1])


@SETTINGS
@given(st.lists(st.sampled_from([0.0, 1.0, 2.5, 2.5, 3.0, 1e-9]), max_size=12))
def test_arrangements_match_numpy_with_ties(times):
    arr = np.asarray(times, dtype=np.float64)
    assert list(ordering.arrangements_of(times)) == [ordering.arrangement(arr, p).tolist() for p in PATTERNS]


# ------------------------------------------------------------------------------------------------ cost model
def cost_models():
    """Cost models with every branch of the per-micro-batch formula: fitted (floor, per-layer overhead), CP
    members (linear overhead, chunk term), analytic, tokens-only; 1F1B, interleaved and no pipeline."""
    out = []
    for par in (ParallelConfig(), ParallelConfig(pp=2), ParallelConfig(pp=3, vpp=2), ParallelConfig(pp=4),
                ParallelConfig(cp=2, pp=2, vpp=2), ParallelConfig(cp=4, tp=2)):
        out.append(CostModel.from_model("qwen3-8b", par))
        out.append(CostModel.from_model("tiny-gpt", par, profile="analytic"))
        out.append(CostModel.tokens_only(par))
    return out


COST_MODELS = cost_models()


@SETTINGS
@given(st.sampled_from(COST_MODELS), st.lists(st.tuples(st.integers(0, 2**22), st.floats(0, 2**44)), min_size=1,
                                                max_size=12))
def test_cost_model_scalar_twins(cm, mbs):
    padded = np.array([p for p, _ in mbs], dtype=np.int64)
    sq = np.array([q for _, q in mbs], dtype=np.float64)
    vector = cm.microbatch_time(padded, sq)
    scalar = [cm.microbatch_time_of(p, q) for p, q in mbs]
    assert bits(scalar) == bits(vector)
    assert bits(cm.rank_time_of(scalar)) == bits(cm.rank_time(vector))
    rows = np.stack([vector, vector[::-1]])
    assert bits([cm.rank_time_of(r.tolist()) for r in rows]) == bits(cm.rank_times(rows))
    assert bits(cm.microbatch_time_of(0, 0.0)) == bits(cm.microbatch_time(0, 0))


# ------------------------------------------------------------------------------------------------ timing
@st.composite
def small_plans(draw):
    """A small step's plan: items with (ties of) slot tokens and squared lengths dealt to ranks' micro-batches."""
    dp = draw(st.integers(1, 4))
    m = draw(st.integers(1, 5))
    extra = draw(st.integers(0, 8))
    n = dp * m + extra
    tokens = draw(st.lists(st.sampled_from([1, 8, 100, 128, 500, 1000, 1024]), min_size=n, max_size=n))
    perm = draw(st.permutations(range(n)))
    bins = [[[i] for i in perm[r * m:(r + 1) * m]] for r in range(dp)]
    for i in perm[dp * m:]:
        r, j = draw(st.integers(0, dp - 1)), draw(st.integers(0, m - 1))
        bins[r][j].append(i)
    aligned = np.array(tokens, dtype=np.int64)
    sq = aligned.astype(np.float64) ** 2 * draw(st.sampled_from([1.0, 0.9, 1.1]))
    align = draw(st.sampled_from([Alignment(), Alignment(2, 4), Alignment(1, 64)]))
    cm = draw(st.sampled_from([c for c in COST_MODELS if c.ep_group == 1]))
    return bins, aligned, sq, cm, align


@SETTINGS
@given(small_plans(), st.integers(0, 3000), st.integers(1, 1200))
def test_small_rank_times_are_rank_times(plan, cap, need):
    bins, aligned, sq, cm, align = plan
    small, ref = SmallRankTimes(bins, aligned, sq, cm, align), RankTimes(bins, aligned, sq, cm, align)
    for r in range(len(bins)):
        assert small.slots[r] == ref.slots[r].tolist()
        assert bits(small.sqs[r]) == bits(ref.sqs[r])
        assert bits(small.mb_times(r)) == bits(ref.mb_times(r))
        assert small.best_rank_time(small.mb_times(r)) == ref.best_rank_time(ref.mb_times(r))
        assert small.by_time(small.mb_times(r)) == ref.by_time(ref.mb_times(r))
        assert small.fastest_fit(r, small.mb_times(r), need, cap) == ref.fastest_fit(r, ref.mb_times(r), need, cap)
    times_s, perms_s = small.ranks_timed([small.mb_times(r) for r in range(len(bins))])
    times_r, perms_r = ref.ranks_timed([ref.mb_times(r) for r in range(len(bins))])
    assert bits(times_s) == bits(times_r)
    assert perms_s == [p.tolist() for p in perms_r]


@SETTINGS
@given(small_plans())
def test_small_ordering_and_polish_are_numpys(plan):
    bins, aligned, sq, cm, align = plan
    oversize = np.zeros(aligned.size, dtype=bool)
    cap = int(max(sum(aligned[mb].sum() for mb in rank) for rank in bins)) + 256

    def run():
        polished = copy.deepcopy(bins)
        memo = TimingMemo()
        evals = ordering.polish_pipeline(polished, aligned, sq, oversize, cap, cm, align, max_evals=40, memo=memo)
        again = ordering.polish_pipeline(polished, aligned, sq, oversize, cap, cm, align, max_evals=80,
                                         start_evals=evals, memo=memo)
        return evals, again, polished, ordering.order_and_time(polished, aligned, sq, cm, align, memo)

    fast = run()
    with numpy_paths():
        ref = run()
    assert fast[:3] == ref[:3]
    assert fast[3][0] == ref[3][0] and bits(fast[3][1:]) == bits(ref[3][1:])


# ------------------------------------------------------------------------------------------------ packing
@st.composite
def steps(draw):
    """A small step's packer input: ties of weights and tokens, optionally groups, oversize items and equal
    samples per rank."""
    dp = draw(st.integers(2, 4))
    n = draw(st.integers(dp, 30))
    weight = np.array(draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, 2.0, 3.5, 7.0, 1e-7]), min_size=n, max_size=n)))
    aligned = np.array(draw(st.lists(st.sampled_from([1, 2, 50, 100, 100, 400]), min_size=n, max_size=n)))
    cap = draw(st.sampled_from([100, 400, 500, 1000]))
    oversize = aligned > cap if draw(st.booleans()) else np.zeros(n, dtype=bool)
    aligned = np.where(oversize, aligned, np.minimum(aligned, cap))
    units = None
    if draw(st.booleans()):
        size = draw(st.sampled_from([2, 3]))
        units = [np.arange(s, min(s + size, n)) for s in range(0, n, size)]
        if len(units) < dp:
            units = None
    equal = draw(st.booleans()) and units is None and n % dp == 0
    inp = StepInput(aligned=aligned.astype(np.int64), weight=weight, oversize=oversize, units=units, cap=cap,
                    equal_samples=equal)
    return inp, dp, draw(st.integers(1, max(1, n // dp)))


def fresh(inp: StepInput) -> StepInput:
    """The same step without the cached lists (each path builds its own)."""
    return StepInput(aligned=inp.aligned, weight=inp.weight, oversize=inp.oversize, units=inp.units, cap=inp.cap,
                     samples=inp.samples, equal_samples=inp.equal_samples)


@SETTINGS
@given(steps())
def test_small_packing_is_numpys(step):
    inp, dp, m = step

    def run():
        s = fresh(inp)
        ranks = packer.assign_ranks(s, dp, m)
        refined = None
        if ranks is not None:
            refined = [list(r) for r in ranks]
            packer.refine_ranks(s, refined, m, 4 * dp)
        packs = [packer.pack_rank(list(range(k, s.aligned.size, dp)), s, m) for k in range(dp)]
        return (ranks, refined, packs, packer.plan_for_count(s, dp, m, 4 * dp), search._max_count(s, dp),
                search.lower_bound_count(s, dp))

    fast = run()
    with numpy_paths():
        assert run() == fast


@st.composite
def exchanges(draw):
    """Two or more ranks of units with tied weights and tight token and count limits: the exchange searches'
    input (per-unit lists, rank state)."""
    dp = draw(st.integers(2, 4))
    n = draw(st.integers(dp, 14))
    w = draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, 2.0, 3.0, 4.5, 9.0]), min_size=n, max_size=n))
    tok = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    cnt = draw(st.lists(st.integers(1, 2), min_size=n, max_size=n))
    smp = draw(st.one_of(st.none(), st.lists(st.integers(1, 2), min_size=n, max_size=n)))
    rank_of = draw(st.lists(st.integers(0, dp - 1), min_size=n, max_size=n))
    ranks = [[u for u in range(n) if rank_of[u] == r] for r in range(dp)]
    loads = [smallops.np_sum([w[u] for u in r]) for r in ranks]
    used = [sum(tok[u] for u in r) for r in ranks]
    counts = [sum(cnt[u] for u in r) for r in ranks]
    return ranks, w, tok, cnt, smp, loads, used, counts, draw(st.integers(0, 20)), draw(st.integers(0, 3))


@SETTINGS
@given(exchanges())
def test_exchange_searches_agree(case):
    ranks, w, tok, cnt, smp, loads, used, counts, capacity, m = case
    arrays = np.array(w, dtype=np.float64), np.array(tok, dtype=np.int64), np.array(cnt, dtype=np.int64)
    smp_arr = None if smp is None else np.array(smp, dtype=np.int64)
    for a in range(len(ranks)):
        for b in range(len(ranks)):
            gap = loads[a] - loads[b]
            if a == b or gap <= 0:
                continue
            query = dict(gap=gap, used_a=used[a], used_b=used[b], items_a=counts[a], items_b=counts[b],
                         capacity=capacity, m=m)
            assert (packer._pair_lists(ranks[a], ranks[b], **query, cols=packer.UnitColumns(w, tok, cnt, smp))
                    == packer._pair_arrays(ranks[a], ranks[b], **query, cols=packer.UnitColumns(*arrays, smp_arr)))
        if ranks[a]:
            bound = loads[a] * (1 - 1e-12)
            got = packer._global_lists(ranks, a, bound, load=loads, used=used, items=counts, capacity=capacity, m=m,
                                       cols=packer.UnitColumns(w, tok, cnt, smp))
            want = packer._global_arrays(ranks, a, bound, load=np.array(loads), used=np.array(used),
                                         items=np.array(counts), capacity=capacity, m=m,
                                         cols=packer.UnitColumns(*arrays, smp_arr))
            assert got == want


@SETTINGS
@given(st.lists(st.integers(0, 1000), max_size=40), st.sampled_from([1000, 999, 1001, 64]), st.integers(0, 3))
def test_small_lower_bound_is_numpys(sizes, cap, alone):
    sizes = np.minimum(np.array(sizes, dtype=np.int64), cap)
    fast = bounds.min_bins(sizes, cap, alone)
    with numpy_paths():
        assert bounds.min_bins(sizes, cap, alone) == fast


# ------------------------------------------------------------------------------------------------ whole plans
@st.composite
def workloads(draw, pipeline: bool = False):
    """Random batches and planner arguments; ``pipeline``: always ``pp > 1`` and several optimizer steps."""
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    layouts = [{"pp": 2}, {"pp": 3, "vpp": 2}, {"pp": 4}] + ([] if pipeline else [{}, {"cp": 2}, {"ep": 2}])
    par = dict(draw(st.sampled_from(layouts)), dp=dp)
    model = draw(st.sampled_from([None, "tiny-gpt", "qwen3-8b"])) if "ep" not in par else "qwen3-30b-a3b"
    cap = draw(st.sampled_from([512, 1000, 4096]))
    sps = draw(st.sampled_from([6 * dp, 12 * dp] if pipeline else [None, 8, 16, 4 * dp, 12 * dp]))
    n = sps * draw(st.integers(1, 4)) if sps else draw(st.integers(dp, 60))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["uniform", "near", "half", "tiny", "ties"]))
    lengths = {"uniform": lambda: rng.integers(1, cap + 1, n), "near": lambda: rng.integers(int(0.9 * cap), cap + 1, n),
               "half": lambda: rng.integers(int(0.45 * cap), cap // 2 + 1, n), "tiny": lambda: rng.integers(0, 9, n),
               "ties": lambda: rng.choice([cap // 4, cap // 3, cap // 2], n)}[kind]()
    kw = dict(model=model, parallel=par, max_tokens_per_gpu=cap, samples_per_step=sps)
    kw["balance_by"] = draw(st.sampled_from(["tokens", "flops", "time"])) if model else "tokens"
    if draw(st.booleans()) and (sps is None or sps % 2 == 0):
        kw["group_ids"] = np.arange(n) // 2
    if draw(st.booleans()):
        kw["equal_samples_per_rank"] = True
    return lengths, kw


def _plan(lengths, kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            d = plan_global_batch(lengths, **kw).to_dict()
            d.pop("planning_time_s")
            d["summary"].pop("planning_time_s")
            return d, local_microbatch_counts(lengths, **kw)
        except DynBatchConfigError as e:
            return str(e)


@PLAN_SETTINGS
@given(workloads())
def test_plans_are_identical_with_the_fast_paths_on_and_off(workload):
    lengths, kw = workload
    fast = _plan(lengths, kw)
    with numpy_paths():
        assert _plan(lengths, kw) == fast


@pytest.mark.parametrize("pp", [{}, {"pp": 3, "vpp": 2}])
def test_many_small_steps_plan_identically_with_the_fast_paths_on_and_off(pp):
    """The shape the fast paths are for (bench/adversarial.py: 4,096 optimizer steps of 16; here 48 of them)."""
    from megatron_dynbatch.bench.adversarial import SHAPES

    for shape in (s for s in SHAPES if "steps of 16" in s.name and ("pp" in s.name) == bool(pp)):
        lengths, kw = shape.build(768)
        fast = _plan(lengths, kw)
        assert isinstance(fast, tuple) and len(fast[1]) == 48
        with numpy_paths():
            assert _plan(lengths, kw) == fast


@PLAN_SETTINGS
@given(workloads(pipeline=True))
def test_the_longer_polish_reuses_an_ordering_only_for_unchanged_bins(workload):
    """``_Counts`` answers the final (longer) polish of a count with the cheaper polish's ordering when that polish
    moved nothing: the same as polishing further and ordering again."""
    lengths, kw = workload
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            opts = {k: v for k, v in kw.items() if k != "group_ids"}
            prep = prepare(lengths, PlanOptions.from_kwargs(opts).resolve(), group_ids=kw.get("group_ids"))
        except DynBatchConfigError:
            return
    for step in prep.steps:
        counts = search._Counts(step.inp, prep.parallel, prep.cost_model, step.sq, prep.refine_rounds, prep.alignment,
                                prep.count_rule)
        m = prep.count_rule.next(search.lower_bound_count(step.inp, prep.parallel.dp))
        if m > search._max_count(step.inp, prep.parallel.dp) or counts.evaluate(m) is None or m not in counts.polished:
            continue
        got = counts.evaluate(m, search.FINAL_POLISH_EVALS)
        bins, done = copy.deepcopy(counts.polished[m][0]), counts.polished[m][1]
        ordering.polish_pipeline(bins, step.inp.aligned, step.sq, step.inp.oversize, step.inp.cap, prep.cost_model,
                                 prep.alignment, max_evals=search.FINAL_POLISH_EVALS, max_ops=search.FINAL_POLISH_OPS,
                                 start_evals=done)
        want = ordering.order_and_time(bins, step.inp.aligned, step.sq, prep.cost_model, prep.alignment)
        assert got[0] == want[0] and bits(got[1:]) == bits(want[1:])


def test_per_step_rank_times_of_a_plan_match_numpy():
    rng = np.random.default_rng(3)
    for cm in COST_MODELS:
        mb_time = rng.random((3, 12)).tolist()
        fast_ranks, fast_steps = step_times_of(mb_time, [4, 3, 5], cm)
        with numpy_paths():
            ranks, steps = step_times_of(mb_time, [4, 3, 5], cm)
        assert bits(ranks) == bits(fast_ranks) and bits(steps) == bits(fast_steps)
