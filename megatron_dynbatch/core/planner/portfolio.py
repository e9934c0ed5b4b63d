"""The planner's portfolio: the peers' cap-safe partitioning heuristics, each turned into a plan under the
planner's own rules and scored by its own cost model; an optimizer step's plan is the best of them and of the
count search (:mod:`.search`), so a plan is never behind one of these peers in the model.

Why: measured against the peers' own code, verl's Karmarkar-Karp partition gave a step up to 0.25% shorter than
the count search on two long-tailed SFT / few-samples-per-rank shapes (issue 33). The search balances ranks by
LPT and pairwise exchanges; Karmarkar-Karp's differencing sometimes ends closer. Rather than hope one heuristic
dominates, the step keeps the best.

The family (:data:`STRATEGIES`; one class per peer behind :class:`Strategy`, :func:`get_strategy` the factory).
Each turns the step's items into ``bins[rank][j]`` at its own natural count -- the first count the VPP rule,
``min_num_microbatches`` and ``num_microbatches_multiple`` accept that its packing fills -- and at the count the
search chose when that is larger (with ``pp > 1`` the one that shortens the bubble), or only at the forced count
(``num_microbatches``):

* ``karmarkar-karp`` -- verl ``balance_batch`` (``get_seqlen_balanced_partitions(..., equal_size=True)``) and
  slime's legacy rank split: the units (a sample, or a ``group_ids`` group) over the DP ranks by Karmarkar-Karp
  with equal unit counts, on the planner's balancing weight (the work measure: modelled seconds, FLOPs or
  tokens); each rank's micro-batches by the planner's packer (:func:`.packer.pack_rank`), because verl's own
  split -- Karmarkar-Karp into ``ceil(tokens / cap)`` micro-batches -- does not keep the cap;
* ``first-fit-kk`` -- slime ``dp_schedule`` ("pack first, distribute second"): first fit in sample order into
  micro-batches under the cap, the count raised to ``dp x M`` by splitting the largest, micro-batches over the
  ranks by Karmarkar-Karp with equal counts on their weight;
* ``mffd`` -- NeMo-RL sequence packing: modified first-fit decreasing, the bin count raised to ``dp x M`` by
  moving single sequences into new bins, bin ``j`` to rank ``j % dp``;
* ``next-fit`` -- Megatron-Core ``DpBalancedScheduler``: next fit in loader order, tail samples split off to
  ``dp x M`` packs, pack ``k`` to rank ``k % dp``.

The primitives are :mod:`megatron_dynbatch.core.partitioning`'s, which the benchmark's models of these peers
(``bench/baselines.py``, ``bench/megatron_upstream.py``) use too: one copy of each algorithm.

Invariants: a candidate is a valid plan under every rule the search obeys -- ``dp`` ranks of ``M`` non-empty
micro-batches, ``M`` a valid count, every item once, no micro-batch over the effective cap (padding included)
unless it is one over-budget item alone, a ``group_ids`` group on one rank, ``equal_samples_per_rank`` kept
(:func:`is_valid`); one that is not is simply not a candidate (bins dealt round-robin rarely keep a group on one
rank: with groups only ``karmarkar-karp`` runs). A candidate is ordered and timed exactly as the search's counts
are (:func:`.ordering.order_and_time`), and replaces the step's plan when it is faster -- by more than the
decision margin (:func:`.search.count_dependent_share`) when it runs more micro-batches, as the search decides
between its own counts; so with ``decision_margin=0`` the step is never slower than any candidate, and with the
default margin never slower by more than that margin, up to float rounding (:data:`NOISE`;
``tests/test_portfolio.py``). Candidates whose rank work
alone already reaches the best step time (:func:`step_bound`, a true lower bound) are neither packed further
nor timed. Deterministic: every rank computes the same choice.

Cost: ``O(n log n)`` per strategy and step. It runs only on steps of at most :data:`MAX_ITEMS` items and on a
plan's first ``SearchWork.portfolio_items`` items (:mod:`.fallback`; counted in items, so every rank decides
alike); other steps keep the search's plan, which keeps the planning-time targets of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import DynBatchConfigError
from ..partitioning import (PartitionInfeasible, adjust_bin_count, first_fit, karmarkar_karp,
                            modified_first_fit_decreasing, next_fit_packs, split_largest_bins)
from .fallback import SearchWork
from .ordering import TimingMemo, order_and_time
from .packer import StepInput, pack_rank

Bins = List[List[List[int]]]
#: ``(ordered bins, step time, imbalance)``, as the count search's ``Result``
Result = Tuple[list, float, float]

#: steps of more items keep the count search's plan: the strategies' packings cost ``O(n log n)`` in Python each,
#: and the planning-time targets (docs/benchmarks.md) leave no room for them on steps of thousands of items
MAX_ITEMS = 1024
#: a candidate must be faster by more than this relative amount: float rounding (a different summation order of
#: the same micro-batches) is no gain, and the search's even micro-batches are worth more than it (memory, and
#: expert-parallel ranks in lockstep that a per-rank plan does not see)
NOISE = 1e-9
#: extra counts the ``karmarkar-karp`` strategy tries above its first one when a rank does not pack there
KK_EXTRA_COUNTS = 2


@dataclass(frozen=True)
class StepContext:
    """What a strategy sees of one optimizer step: its items (:class:`.packer.StepInput`), the per-batch search
    settings (a :class:`.search.SearchSettings`, which imports this module) and a forced count (``None``: the
    strategy's own)."""

    inp: StepInput
    settings: Any
    forced: Optional[int] = None
    #: the count the search chose for the step: every strategy also tries it when it is above its own (with
    #: ``pp > 1`` the search's count is the one that shortens the bubble)
    search_count: Optional[int] = None
    #: ``hopeless(ranks, m)``: whether a plan with these items per rank (local item indices) and ``m``
    #: micro-batches per rank surely cannot win (:func:`step_bound`); strategies ask before packing further
    hopeless: Optional[Callable[[list, int], bool]] = None

    @property
    def dp(self) -> int:
        return self.settings.parallel.dp

    def counts(self, first: int) -> List[int]:
        """The counts a strategy tries when its own packing needs ``first`` micro-batches per rank (a valid
        count): that one and the search's when larger -- or only the forced count."""
        if self.forced is not None:
            return [self.forced]
        return [first] + ([self.search_count] if self.search_count is not None and self.search_count > first else [])

    def count_for(self, bins: int) -> int:
        """The first valid count that holds ``bins`` micro-batches over ``dp`` ranks."""
        return self.settings.count_rule.next(-(-bins // self.dp))


class Strategy:
    """One peer's heuristic: :meth:`plans` are its plans of a step under the planner's rules (each still checked
    by :func:`is_valid`), one per count it tries (:meth:`StepContext.counts`)."""

    name = ""
    #: the peer and the code it follows
    provenance = ""
    #: runs on steps with ``group_ids`` groups (a strategy dealing bins round-robin cannot keep them together)
    groups = False

    def plans(self, ctx: StepContext) -> Iterator[Bins]:
        raise NotImplementedError


class KarmarkarKarp(Strategy):
    name = "karmarkar-karp"
    provenance = ("verl balance_batch (verl/utils/seqlen_balancing.py get_seqlen_balanced_partitions, "
                  "equal_size=True); slime's legacy DP split")
    groups = True

    def plans(self, ctx: StepContext) -> Iterator[Bins]:
        inp, dp = ctx.inp, ctx.dp
        parts = karmarkar_karp(inp.unit_weight, dp, equal_size=True)
        ranks = [np.asarray(p, dtype=np.int64) if inp.singletons else inp.members(p) for p in parts]
        tokens = max(int(inp.unit_tokens[p].sum()) for p in parts)
        m = ctx.count_for(dp * max(1, -(-tokens // inp.cap)))
        tries = 1 + KK_EXTRA_COUNTS  # a rank may need a count or two more than its tokens say
        while tries:
            done = False
            for count in ctx.counts(m):
                if ctx.hopeless is not None and ctx.hopeless(ranks, count):
                    return  # the bound only grows with the count
                packed = [pack_rank(items.tolist(), inp, count) for items in ranks]
                if all(p is not None for p in packed):
                    done = True
                    yield packed
                elif count == m:
                    break  # the strategy's own count does not pack: try the next one
            if done or ctx.forced is not None:
                return
            tries -= 1
            m = ctx.settings.count_rule.next(m + 1)


def _with_oversize_alone(inp: StepInput, pack) -> List[List[int]]:
    """Every over-budget item in a bin of its own (in index order), the others packed by ``pack(items, sizes)``
    (bins of positions into ``items``), as local item indices."""
    over = np.flatnonzero(inp.oversize).tolist()
    normal = np.flatnonzero(~inp.oversize)
    bins = [[i] for i in over]
    if normal.size:
        bins += [[int(normal[j]) for j in b] for b in pack(normal, inp.aligned[normal])]
    return bins


class FirstFitKK(Strategy):
    name = "first-fit-kk"
    provenance = "slime --use-dynamic-batch-size --balance-data (slime/utils/dp_schedule.py build_dp_schedule)"

    def plans(self, ctx: StepContext) -> Iterator[Bins]:
        inp, dp = ctx.inp, ctx.dp
        # first fit in sample order; an over-budget item opens a bin nothing else can join
        base = first_fit(inp.aligned, inp.cap)
        for m in ctx.counts(ctx.count_for(len(base))):
            bins = split_largest_bins(base, dp * m, inp.aligned)
            if len(bins) == dp * m:
                parts = karmarkar_karp([float(inp.weight[b].sum()) for b in bins], dp, equal_size=True)
                yield [[bins[j] for j in part] for part in parts]


class ModifiedFirstFitDecreasing(Strategy):
    name = "mffd"
    provenance = ("NeMo-RL sequence packing (nemo_rl/data/packing/algorithms.py ModifiedFirstFitDecreasingPacker, "
                  "min_bin_count / bin_count_multiple = dp), bins round-robin to ranks")

    def plans(self, ctx: StepContext) -> Iterator[Bins]:
        inp, dp = ctx.inp, ctx.dp
        base = _with_oversize_alone(inp, lambda _, sizes: modified_first_fit_decreasing(sizes, inp.cap))
        for m in ctx.counts(ctx.count_for(len(base))):
            if len(base) <= dp * m:
                try:
                    bins = adjust_bin_count(base, dp * m, 1)
                except PartitionInfeasible:
                    continue
                yield [bins[r::dp] for r in range(dp)]


class NextFit(Strategy):
    name = "next-fit"
    provenance = ("Megatron-Core DpBalancedScheduler (megatron/core/datasets/data_schedule.py): next fit in "
                  "loader order, packs round-robin to ranks")

    def plans(self, ctx: StepContext) -> Iterator[Bins]:
        inp, dp = ctx.inp, ctx.dp
        first = ctx.count_for(len(next_fit_packs(inp.aligned, inp.cap, lambda n: n)))
        for m in ctx.counts(first):
            try:
                packs = next_fit_packs(inp.aligned, inp.cap, lambda n, m=m: dp * m)
            except PartitionInfeasible:
                continue
            if len(packs) == dp * m:  # not so when a forced count is below the packing's own
                yield [packs[r::dp] for r in range(dp)]


STRATEGIES: Dict[str, Strategy] = {s.name: s for s in (KarmarkarKarp(), FirstFitKK(), ModifiedFirstFitDecreasing(),
                                                        NextFit())}


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name`` (see :data:`STRATEGIES`)."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise DynBatchConfigError("strategy", name, "unknown portfolio strategy",
                                  f"use one of {sorted(STRATEGIES)}") from None


def is_valid(bins: Bins, ctx: StepContext) -> bool:
    """Whether ``bins`` is a plan of the step under the planner's rules (module docstring)."""
    inp, dp = ctx.inp, ctx.dp
    if len(bins) != dp or not bins[0]:
        return False
    m = len(bins[0])
    rule = ctx.settings.count_rule
    if (ctx.forced is not None and m != ctx.forced) or not rule.is_valid(m):
        return False
    aligned, oversize = inp.item_lists.aligned, inp.item_lists.oversize
    rank_of = [-1] * len(aligned)
    for r, rank in enumerate(bins):
        if len(rank) != m:
            return False
        for mb in rank:
            if not mb:
                return False
            if sum(aligned[i] for i in mb) > inp.cap and not (len(mb) == 1 and oversize[mb[0]]):
                return False
            for i in mb:
                if rank_of[i] != -1:
                    return False
                rank_of[i] = r
    if -1 in rank_of:
        return False
    if not inp.singletons and any(len({rank_of[i] for i in unit.tolist()}) > 1 for unit in inp.units):
        return False
    if inp.equal_samples:
        per_item = [1] * len(aligned) if inp.samples is None else inp.samples.tolist()
        counts = [sum(per_item[i] for mb in rank for i in mb) for rank in bins]
        if len(set(counts)) > 1:
            return False
    return True


def step_bound(ranks: list, m: int, work: np.ndarray, ctx: StepContext) -> float:
    """A lower bound of the step time of any plan with these items per rank (``ranks[r]``: local item indices, as
    a flat list or array, or as the rank's micro-batches) and ``m`` micro-batches per rank, in any order: its
    busiest rank's compute (each item's work without overhead, padding or floor) plus one overhead per
    micro-batch, over ``pp`` stages (a 1F1B or interleaved makespan is at least one stage's whole share; a
    micro-batch takes at least the overhead plus its work, which is linear in tokens and squared lengths)."""
    cm = ctx.settings.cost_model
    flat = [rank if not len(rank) or not isinstance(rank[0], list) else [i for mb in rank for i in mb]
            for rank in ranks]
    busiest = max(float(work[np.asarray(items, dtype=np.int64)].sum()) for items in flat)
    return (busiest + m * cm.overhead_s) / cm.pp


def candidates(ctx: StepContext) -> Iterator[Tuple[str, Bins]]:
    """Every strategy's plans of the step that are valid under the planner's rules, ``(name, bins)``, one at a
    time (the later ones see a ``hopeless`` that knows the earlier winners), hopeless ones left out."""
    for strategy in STRATEGIES.values():
        if not (ctx.inp.singletons or strategy.groups):
            continue
        for bins in strategy.plans(ctx):
            if ctx.hopeless is not None and ctx.hopeless(bins, len(bins[0])):
                continue
            if is_valid(bins, ctx):
                yield strategy.name, bins


_ENABLED = [True]


@contextlib.contextmanager
def disabled():
    """Inside: every step keeps the count search's plan, as the planner made it before the portfolio (issue 33) --
    for reproducing plans measured with an older planner (``benchmarks/gpu/compare.py``) and for comparing the
    two (``tests/test_portfolio.py``). Not thread-safe: a module-wide switch."""
    saved = _ENABLED[0]
    _ENABLED[0] = False
    try:
        yield
    finally:
        _ENABLED[0] = saved


def best_plan(ours: Result, inp: StepInput, sq: np.ndarray, settings: Any, margin_of: Callable[[int, float], float],
              *, forced: Optional[int] = None, memo: Optional[TimingMemo] = None,
              search: Optional[SearchWork] = None) -> Result:
    """The step's plan: the count search's (``ours``: ordered bins, step time, imbalance) or a faster candidate,
    ordered as the search orders. ``margin_of(m, step_time)``: the relative margin a plan of ``m`` micro-batches
    must win by over one with fewer (the search's decision margin on the count-dependent share). Steps of more
    than :data:`MAX_ITEMS` items keep the search's plan, and so do the steps past the plan's item allowance
    (``search.portfolio_items``, a :class:`.fallback.SearchWork` shared by the plan's steps)."""
    n = inp.aligned.size
    if not _ENABLED[0] or n > MAX_ITEMS or (search is not None and search.portfolio_items < n):
        return ours
    if search is not None:
        search.portfolio_items -= n
    cm, align = settings.cost_model, settings.alignment
    work = cm.work(inp.aligned, sq)
    best = [ours, len(ours[0][0])]

    def need(m: int, step: float) -> float:
        return 1.0 + margin_of(m, step) + NOISE if m > best[1] else 1.0 + NOISE

    def hopeless(ranks: list, m: int) -> bool:
        # a candidate faster than the best has a larger count-dependent share, so its margin is at least this one
        return step_bound(ranks, m, work, ctx) * (1 - 1e-9) * need(m, best[0][1]) >= best[0][1]

    ctx = StepContext(inp, settings, forced, len(ours[0][0]), hopeless)
    for _, bins in candidates(ctx):
        m = len(bins[0])
        res = order_and_time(bins, inp.aligned, sq, cm, align, memo)
        if res[1] * need(m, res[1]) < best[0][1]:
            best = [res, m]
    return best[0]


__all__ = ["MAX_ITEMS", "STRATEGIES", "FirstFitKK", "KarmarkarKarp", "ModifiedFirstFitDecreasing", "NextFit",
           "StepContext", "Strategy", "best_plan", "candidates", "disabled", "get_strategy", "is_valid", "step_bound"]
