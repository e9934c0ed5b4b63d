"""Choosing the micro-batch count of one optimizer step (see ``api.py`` for the strategy).

1. **Start at a true lower bound.** ``M0`` = the fewest micro-batches per rank any packing could use: the
   bin-packing bounds of :mod:`.bounds` (tokens, Martello-Toth L2, cardinality) over ``dp`` ranks, moved to a
   count Megatron's interleaved schedule accepts.
2. **Find the first count that packs in O(log) packings.** If ``M0`` does not pack, gallop (``M0+1, +2, +4,
   ...``) to a count that does, then bisect between the last failure and the first success. A count "packs"
   when the balancing packer (:mod:`.packer`) or one of the feasibility-first strategies (:mod:`.fallback`)
   fills it. Every tried count is cached, so no count is packed twice, and a count the search only asks about
   is packed, not polished or timed.
3. **Score a few more counts** with the cost model (with ``pp > 1`` up to the count that minimises the modelled
   bubble + per-micro-batch overhead, never past the count whose micro-batches shrink to the cost model's
   floor, nor past the count whose 1F1B simulation would take more than :data:`CANDIDATE_SIM_US`; with
   ``pp == 1`` one more when the first leaves the ranks unbalanced) and apply the **decision
   margin**: a larger count replaces the first feasible one only when its modelled step time is lower by more
   than the margin (``decision_margin``, default the cost model's ``uncertainty``) charged to the share of the
   step a count changes -- per-micro-batch fixed costs and the pipeline bubble (:func:`count_dependent_share`);
   among the counts within that margin of the fastest, the fewest micro-batches win (measured, splitting a rank
   into ever smaller micro-batches costs more than a model without a floor says, docs/cost_model.md).

Planning time is therefore ``O(log n)`` packings of ``O(n log n)`` each plus a constant number of scored
counts, on every input (``megatron-dynbatch bench`` times adversarial shapes; docs/benchmarks.md records them).
Pure NumPy; deterministic.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..alignment import Alignment
from ..cost_model import CostModel
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig
from ..pipeline_sim import simulation_cost_us
from ..smallops import is_small
from .bounds import max_covered_count, min_bins
from .fallback import SearchWork, feasible_packing
from .ordering import TimingMemo, order_and_time, polish_pipeline
from .packer import StepInput, best_fit_bin_count, plan_for_count, plan_global_bins, split_bins
from .portfolio import best_plan
from .counts import CountRule

Result = Tuple[list, float, float]  # (ordered bins, step time, imbalance)

#: pipeline-polish evaluations while scoring a count, and on the chosen count
POLISH_EVALS = 120
FINAL_POLISH_EVALS = 1500
#: simulated pipeline operations one polish may spend while scoring a count, and on the chosen count
POLISH_OPS = 1_200_000
FINAL_POLISH_OPS = 8_000_000
#: samples packed in all while scoring extra counts with pp > 1 (5 counts up to 26k samples, 2 at 64k)
CANDIDATE_SAMPLES = 131_072
#: modelled CPU microseconds one 1F1B simulation of a scored extra count may take (pipeline_sim.simulation_cost_us)
CANDIDATE_SIM_US = 50_000
#: relative tolerance of the count bisection (exact below 256 micro-batches per rank)
COUNT_RTOL = 1 / 256
#: counts the bounded bin search tries before a batch is refused (each within ``fallback.BIN_SEARCH_WORK``)
RESCUE_COUNTS = 4


class _Counts:
    """Packs and scores counts for one step; remembers every count it tried."""

    def __init__(self, inp: StepInput, par: ParallelConfig, cm: CostModel, sq: np.ndarray, rounds: int,
                 align: Alignment, rule: Optional[CountRule] = None, search: Optional[SearchWork] = None) -> None:
        self.inp, self.par, self.cm, self.sq, self.rounds, self.align = inp, par, cm, sq, rounds, align
        self.rule = rule or CountRule(par)
        # Moving single samples between ranks (polish) or dealing global bins would change a rank's sample
        # count, which equal_samples_per_rank fixes: both only run on free singletons.
        free = inp.singletons and not inp.equal_samples
        self.pipeline_polish = par.pp > 1 and cm.ep_group == 1 and free
        self.lockstep = cm.ep_group > 1 and free
        self.cache: Dict[Tuple[int, int, bool], Optional[Result]] = {}
        self._packed: Dict[Tuple[int, bool], Optional[list]] = {}
        self._bfd_bins: Optional[int] = None
        self._global: Dict[int, Optional[list]] = {}
        #: count -> (polished bins before ordering, evaluations, their ordered result)
        self.polished: Dict[int, Tuple[list, int, Optional[Result]]] = {}
        #: rescue mode: also run the bounded bin search (:func:`.fallback.search_bins`); set only once no count
        #: packed without it, so it never costs time on a batch that plans anyway
        self.deep = False
        self.search = search if search is not None else SearchWork()
        self.memo = TimingMemo()  # times of this step's small plans, shared by every count (ordering.py)

    def global_bins(self, m: int) -> Optional[list]:
        """Without groups: ``dp * m`` bins packed over the whole step and dealt by size tier
        (:func:`.packer.plan_global_bins`), once per count; ``None`` with groups, or where best fit already
        says ``dp * m`` bins cannot hold the step (a failing pass over every sample is the expensive case)."""
        if not self.inp.singletons or self.inp.equal_samples:
            return None
        if m not in self._global:
            bfd = self.bfd_count()
            self._global[m] = plan_global_bins(self.inp, self.par.dp, m) if m >= bfd else None
        found = self._global[m]
        return None if found is None else _copy_bins(found)

    def bfd_count(self) -> Optional[int]:
        """Without groups: the first count at which best fit surely packs the step (``None`` with groups)."""
        if not self.inp.singletons or self.inp.equal_samples:
            return None
        if self._bfd_bins is None:
            inp = self.inp
            self._bfd_bins = best_fit_bin_count(inp.aligned[~inp.oversize], inp.cap) + int(inp.oversize.sum())
        return self.rule.next(-(-self._bfd_bins // self.par.dp))

    def evaluate(self, m: int, polish_evals: int = POLISH_EVALS) -> Optional[Result]:
        key = (m, polish_evals, self.deep)
        if key not in self.cache:
            self.cache[key] = self._evaluate(m, polish_evals)
        return self.cache[key]

    def feasible(self, m: int) -> bool:
        """Whether ``m`` packs -- without polishing or timing the packing (the count search asks this of counts
        it never scores; :meth:`evaluate` of the count later starts from the same bins)."""
        return self.packed(m) is not None or (self.lockstep and self.global_bins(m) is not None)

    def packed(self, m: int) -> Optional[list]:
        """The balancing packer's bins for ``m``, else a feasibility-first packing (:mod:`.fallback`), else
        None; once per count (and rescue mode). Do not modify them."""
        key = (m, self.deep)
        if key not in self._packed:
            bins = plan_for_count(self.inp, self.par.dp, m, self.rounds)
            if bins is None:
                bins = feasible_packing(self.inp, self.par.dp, m, global_bins=self.global_bins(m),
                                       search=self.search if self.deep else None)
            self._packed[key] = bins
        return self._packed[key]

    def _evaluate(self, m: int, polish_evals: int) -> Optional[Result]:
        inp = self.inp
        final = polish_evals > POLISH_EVALS
        start = None  # (bins, evaluations, result) of the cheaper polish this one continues
        if final and m in self.polished:  # continue the cheaper polish of this count instead of re-packing
            start = self.polished[m]
            bins, done = _copy_bins(start[0]), start[1]
        else:
            found = self.packed(m)
            bins, done = (None if found is None else _copy_bins(found)), 0
        if bins is not None and self.pipeline_polish:
            done = polish_pipeline(bins, inp.aligned, self.sq, inp.oversize, inp.cap, self.cm, self.align,
                                   max_evals=polish_evals, max_ops=FINAL_POLISH_OPS if final else POLISH_OPS,
                                   start_evals=done, memo=self.memo)
        if start is not None and bins == start[0]:
            return start[2]  # the longer polish moved nothing: these very bins were ordered and timed already
        best = order_and_time(bins, inp.aligned, self.sq, self.cm, self.align, self.memo) if bins is not None else None
        if bins is not None and self.pipeline_polish and not final:
            self.polished[m] = (_copy_bins(bins), done, best)
        if self.lockstep:  # expert-parallel ranks advance together: also try even micro-batches across ranks
            alt = self.global_bins(m)
            if alt is not None and alt != bins:  # (the count's own packing may be these very bins: timed above)
                res = order_and_time(alt, inp.aligned, self.sq, self.cm, self.align)
                if best is None or res[1] < best[1]:
                    best = res
        return best


def _copy_bins(bins: list) -> list:
    return [[list(mb) for mb in rank] for rank in bins]


def lower_bound_count(inp: StepInput, dp: int) -> int:
    """Fewest micro-batches per rank that any packing of the step could use: the whole step's bins spread
    over ``dp`` ranks, and the bins of the largest group, which must all sit on one rank."""
    return max(1, -(-_bins_of(inp, np.ones(inp.aligned.size, dtype=bool)) // dp), _largest_group_bins(inp))


def _bins_of(inp: StepInput, members: np.ndarray) -> int:
    over = inp.oversize & members
    return min_bins(inp.aligned[members & ~over], inp.cap, n_alone=int(over.sum()))


def _largest_group_bins(inp: StepInput) -> int:
    if inp.singletons:
        return 1
    # Only the groups with the most tokens can need the most bins; checking a few keeps this O(n log n).
    heavy = np.argsort(-inp.unit_tokens, kind="stable")[:8]
    best = 1
    for u in heavy.tolist():
        members = np.zeros(inp.aligned.size, dtype=bool)
        members[inp.units[u]] = True
        best = max(best, _bins_of(inp, members))
    return best


@dataclass(frozen=True)
class SearchSettings:
    """The per-batch constants of every optimizer step's count search (built once per planning call by
    :meth:`~.prepare.Prepared.search_settings`)."""

    parallel: ParallelConfig
    cost_model: CostModel
    alignment: Alignment
    #: the per-GPU budget, for the messages of a refused step
    max_tokens_per_gpu: int
    count_rule: CountRule
    #: cap on rank-refinement rounds (:mod:`.packer`)
    refine_rounds: int
    #: the decision margin of step 3 of the module docstring
    margin: float = 0.0


def plan_step(inp: StepInput, sq: np.ndarray, settings: SearchSettings, *, forced: Optional[int] = None,
              search: Optional[SearchWork] = None):
    """``(bins, lower-bound count)`` for one optimizer step (``bins[r][j]``: local item indices; ``sq``: each
    item's sum of squared real lengths; ``forced``: a count the caller imposes; ``search``: the bin-search
    work shared by every step of one plan)."""
    par, cm, align = settings.parallel, settings.cost_model, settings.alignment
    max_tokens_per_gpu, margin = settings.max_tokens_per_gpu, settings.margin
    counts = _Counts(inp, par, cm, sq, settings.refine_rounds, align, settings.count_rule, search)
    dp = par.dp
    n = inp.aligned.size
    lb_m = lower_bound_count(inp, dp)
    m_max = _max_count(inp, dp)

    if forced is not None:
        if forced > m_max:
            raise DynBatchConfigError("num_microbatches", forced,
                                      f"needs {forced} samples on every rank but the step has only {n} "
                                      f"samples for dp={dp}", f"use at most {m_max}")
        best = counts.evaluate(forced)
        if best is None:
            counts.deep = True
            best = counts.evaluate(forced)
        if best is None:
            bins = _split_to_count(counts, forced, lb_m, m_max)
            if bins is None:
                raise _forced_count_error(counts, forced, lb_m, m_max, max_tokens_per_gpu)
            best = order_and_time(bins, inp.aligned, counts.sq, cm, align)
        return _with_portfolio(best, counts, settings, forced), lb_m

    chosen = _first_count(counts, lb_m, m_max, max_tokens_per_gpu)
    first = counts.evaluate(chosen)
    scored = [(chosen, first)]
    for cand in _candidate_counts(chosen, m_max, par, cm, inp, first, counts.rule):
        res = counts.evaluate(cand)
        if res is not None:
            scored.append((cand, res))
    chosen, best = within_margin(scored, margin, cm)
    if counts.pipeline_polish:  # spend the larger polishing work on the winner only ...
        fastest = min(scored, key=lambda mr: mr[1][1])[0]
        finals = [(m, counts.evaluate(m, polish_evals=FINAL_POLISH_EVALS)) for m in sorted({chosen, fastest})]
        finals = [(m, res) for m, res in finals if res is not None]
        if finals:  # ... and on the fastest when the margin kept fewer: polish can widen the gap past the margin
            chosen, final = within_margin(finals, margin, cm)
            if final[1] <= dict(scored)[chosen][1]:
                best = final
            else:
                best = dict(scored)[chosen]
    return _with_portfolio(best, counts, settings), lb_m


def _with_portfolio(best: Result, counts: _Counts, settings: SearchSettings, forced: Optional[int] = None) -> list:
    """The step's ordered bins: the search's ``best`` or a faster peer heuristic's (:mod:`.portfolio`)."""
    cm = settings.cost_model

    def margin_of(m: int, step: float) -> float:
        return settings.margin * count_dependent_share(m, step, cm)

    return best_plan(best, counts.inp, counts.sq, settings, margin_of, forced=forced, memo=counts.memo,
                     search=counts.search)[0]


def first_feasible_count(inp: StepInput, sq: np.ndarray, settings: SearchSettings) -> int:
    """The first valid count at which the step packs (the local mode's per-rank count, :mod:`.local`); raises
    like :func:`plan_step` when none does."""
    par = settings.parallel
    counts = _Counts(inp, par, settings.cost_model, sq, settings.refine_rounds, settings.alignment,
                     settings.count_rule)
    return _first_count(counts, lower_bound_count(inp, par.dp), _max_count(inp, par.dp), settings.max_tokens_per_gpu)


def _first_count(counts: _Counts, lb_m: int, m_max: int, max_tokens_per_gpu: int) -> int:
    par, inp = counts.par, counts.inp
    n = inp.aligned.size
    m = counts.rule.next(lb_m)
    if m > m_max:
        group_bins = _largest_group_bins(inp)
        why = (f" (the largest group of group_ids alone needs {group_bins} micro-batches, all on one rank)"
               if group_bins > 1 and group_bins >= lb_m else "")
        if not counts.rule.is_default:
            why += f" ({counts.rule.describe()})"
        raise _too_few_samples(par, n, m, m_max, max_tokens_per_gpu, why=why)
    chosen = _first_feasible(counts, m, m_max)
    if chosen is None:
        chosen = _rescue_count(counts, m, m_max)
    if chosen is None:
        raise _too_few_samples(par, n, m, m_max, max_tokens_per_gpu, packed=False)
    return chosen


def _rescue_count(counts: _Counts, lo: int, hi_limit: int) -> Optional[int]:
    """The last resort before refusing a batch: no valid count in ``[lo, hi_limit]`` packed with the heuristic
    packers (e.g. Megatron's VPP rule leaves one tight count). Try the largest valid counts -- the most room --
    with the bounded bin search, at most :data:`RESCUE_COUNTS` of them."""
    counts.deep = True
    cand = counts.rule.previous(hi_limit)
    for _ in range(RESCUE_COUNTS):
        if cand is None or cand < lo:
            return None
        if counts.feasible(cand):
            return cand
        cand = counts.rule.previous(cand - 1)
    return None


def _first_feasible(counts: _Counts, lo: int, hi_limit: int) -> Optional[int]:
    """The first valid count in ``[lo, hi_limit]`` that packs, in O(log) packings: a count known to pack
    (best fit's, without groups) or one found by galloping up from ``lo``, then bisection down to the first one
    (``P(x)``: the first valid count ``>= x`` packs). Bisection stops within :data:`COUNT_RTOL` of the first
    count: one micro-batch more in thousands changes the step time by one per-micro-batch overhead."""
    rule = counts.rule
    if counts.feasible(lo):
        return lo
    bad, good = lo, None
    known = counts.bfd_count()
    if known is not None and known <= hi_limit and counts.feasible(known):
        good = known
    step = 1
    while good is None:
        cand = rule.next(bad + step)
        if cand > hi_limit:
            cand = rule.previous(hi_limit)
            if cand is None or cand <= bad:
                return None
        if counts.feasible(cand):
            good = cand
        else:
            if cand == rule.previous(hi_limit):
                return None
            bad, step = cand, step * 2
    # Bisect on x with P(x) = "the first valid count >= x packs": P(bad) is false, P(good) is true, and
    # ``good`` stays the first valid count >= hi.
    lo_x, hi_x = bad, good
    while hi_x - lo_x > max(1, int(good * COUNT_RTOL)):
        mid = (lo_x + hi_x) // 2
        cand = rule.next(mid)
        if counts.feasible(cand):
            hi_x, good = mid, cand
        else:
            lo_x = mid
    return good


def _split_to_count(counts: _Counts, forced: int, lb_m: int, m_max: int) -> Optional[list]:
    """A packing of exactly ``forced`` micro-batches per rank from the first count that packs below it, by
    splitting micro-batches in two (``None`` if no count up to ``forced`` packs, or a rank has too few items).

    Splitting never breaks the cap, so a count above one that packs is feasible as long as every rank has
    enough items: this is what makes "the largest of the ranks' feasible counts" a count every rank can use
    (local mode, :mod:`.local`), and a forced count is never refused for want of a packing heuristic."""
    start = counts.rule.next(max(lb_m, 1))
    if start > forced:
        return None
    first = _first_feasible(counts, start, forced)
    if first is None:
        return None
    bins = _copy_bins(counts.evaluate(first)[0])
    for rank in bins:
        if not split_bins(rank, forced, counts.inp.aligned):
            return None
    return bins


def _max_count(inp: StepInput, dp: int) -> int:
    """Most micro-batches every rank can fill: a micro-batch needs an item and a unit sits on one rank, so for
    every ``j < dp`` the ``dp - j`` ranks holding none of the ``j`` largest units share what the others leave:
    ``M <= (items - top_j) // (dp - j)``. ``j = 0`` is the plain ``items // dp``; larger ``j`` refuse at once a
    step whose one giant group leaves the other ranks too few items (which used to search for minutes).

    With groups, also the covering bound (:func:`.bounds.max_covered_count`): whole groups must give every rank
    ``M`` items, so four groups of 12, 16, 16 and 16 samples fill at most 16 micro-batches on each of 3 ranks
    (not 20): no count above it is tried, and the count search, which gallops upwards, cannot jump over the few
    counts that pack into ones no grouping can fill."""
    if is_small(inp.unit_count.size):  # the same integers in plain Python
        c = sorted(inp.unit_lists.items, reverse=True)
        total = sum(c)
        tops = itertools.accumulate([0] + c)  # the j largest
        # the first min(dp, len(c)) prefix sums only: zip stops at the range on purpose
        bound = min((total - top) // (dp - j) for j, top in zip(range(min(dp, len(c))), tops, strict=False))
    else:
        c = np.sort(inp.unit_count)[::-1]
        j = np.arange(min(dp, c.size))
        top = np.concatenate(([0], np.cumsum(c)))[j]
        bound = int(((int(c.sum()) - top) // (dp - j)).min())
    if inp.singletons or bound < 1:  # one item per unit: the covering bound is items // dp, as above
        return bound
    return max_covered_count(inp.unit_count, dp, bound)


def _too_few_samples(par: ParallelConfig, n: int, m: int, m_max: int, budget: int,
                     packed: bool = True, why: str = "") -> DynBatchConfigError:
    vpp = ""
    if par.vpp > 1:
        vpp = (f" (interleaved pipeline: pp={par.pp}, vpp={par.vpp} needs M >= "
               f"microbatch_group_size_per_vp_stage={par.vp_group_size})")
    if packed:
        problem = (f"{n} samples over dp={par.dp} ranks need at least {m} non-empty micro-batches per rank{vpp}"
                   f"{why}, but at most {m_max} can be filled without leaving one empty")
    else:
        problem = (f"no packing of the {n} samples over dp={par.dp} ranks into the same number of non-empty "
                   f"micro-batches per rank (at most {m_max}){vpp} within the budget was found (with group_ids, "
                   f"a group's samples also count on one rank only)")
    return DynBatchConfigError("max_tokens_per_gpu", budget, problem,
                               "raise max_tokens_per_gpu, lower dp or vpp, or pass more samples")


def _forced_count_error(counts: _Counts, forced: int, lb_m: int, m_max: int, budget: int) -> DynBatchConfigError:
    """The error for a forced count that does not pack: suggest the first larger count that does."""
    cap = counts.inp.cap
    if forced < lb_m:
        why = (f"the samples need at least {lb_m} micro-batches of at most {cap} tokens per rank (a lower bound: "
               f"no packing uses fewer)")
    else:
        why = f"no packing into {forced} micro-batches of at most {cap} tokens per rank was found"
    start = counts.rule.next(max(forced + 1, lb_m))
    better = _first_feasible(counts, start, m_max) if start <= m_max else None
    if better is not None:
        fix = f"use num_microbatches >= {better} (or None to let the planner choose), or raise max_tokens_per_gpu"
    else:
        fix = f"raise max_tokens_per_gpu (now {budget}); no count up to {m_max} packs"
    return DynBatchConfigError("num_microbatches", forced, why, fix)


def within_margin(scored: List[Tuple[int, Result]], margin: float,
                  cm: Optional[CostModel] = None) -> Tuple[int, Result]:
    """The decision rule (module docstring, step 3) over ``(count, result)`` pairs in increasing count order: the
    fewest micro-batches whose modelled step time is within the margin of the fastest (``1e-9`` absorbs rounding,
    so with margin 0 the first of equally fast counts wins). With ``cm`` the margin is ``margin`` times the share
    of the fastest plan's step that rests on the terms a count changes (:func:`count_dependent_share`)."""
    m_fast, fast = min(scored, key=lambda mr: mr[1][1])
    eff = margin if cm is None else margin * count_dependent_share(m_fast, fast[1], cm)
    return next((m, res) for m, res in scored if res[1] <= fast[1] * (1 + eff + 1e-9))


def count_dependent_share(m: int, step: float, cm: CostModel) -> float:
    """The share of a step of ``m`` micro-batches per rank that depends on the count: each micro-batch's fixed
    cost (at least the cost model's per-micro-batch overhead or floor; ``t_mb / pp`` per stage) and, with
    ``pp > 1``, the 1F1B bubble (``(pp - 1) / vpp`` of ``m + (pp - 1) / vpp`` stage slots). The rest -- the
    token-linear and attention work, which every count of the same batch does in full -- is what the
    measurements fit best (DP balance measured level within +-0.5%), so the measured uncertainty is charged to
    this share only: splitting finer wins only when its gain clears the model's uncertainty on what the
    splitting itself costs and saves."""
    if step <= 0:
        return 1.0
    bubble = (cm.pp - 1) / max(cm.vpp, 1) if cm.pp > 1 else 0.0
    fixed = cm.microbatch_time_of(0, 0.0)  # what any micro-batch costs at least: the overhead, or the floor
    return min(1.0, bubble / (m + bubble) + m * fixed / cm.pp / step)


def _affordable(m: int, hi: int, par: ParallelConfig) -> int:
    """The largest count in ``[m, hi]`` whose 1F1B simulation over the ranks stays within
    :data:`CANDIDATE_SIM_US` (``pipeline_sim.simulation_cost_us``): a deep pipeline's target count can be a
    thousand micro-batches per rank, and every scored count is simulated several times (arrangements, polish),
    so more micro-batches are scored only while one simulation of them is cheap."""
    ranks = par.dp
    if simulation_cost_us(hi, par.pp, ranks) <= CANDIDATE_SIM_US:
        return hi
    lo = m  # cost grows with the count: bisect for the last affordable one
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if simulation_cost_us(mid, par.pp, ranks) <= CANDIDATE_SIM_US:
            lo = mid
        else:
            hi = mid
    return lo


def _candidate_counts(m: int, m_max: int, par: ParallelConfig, cm: CostModel, inp: StepInput, best,
                      rule: CountRule) -> List[int]:
    """Extra counts worth scoring after the first feasible ``m``."""
    if rule.next(m + 1) > m_max:  # every candidate is a valid count above m: none fits (the cheap common case)
        return []
    out: List[int] = []
    if par.pp > 1 and cm.overhead_s > 0:
        w = float(cm.work(inp.aligned, 0.0).sum()) / par.dp  # linear part is enough to locate the optimum
        bubble = (par.pp - 1) / max(1, par.vpp)
        target = cm.pipeline_count_target(max(w, 1e-12), bubble)
        hi = _affordable(m, min(m_max, max(m, target)), par)
        if hi > m:
            # Each scored count is a full packing: large steps score fewer (the analytic optimum ``hi`` always).
            num = min(5, hi - m, max(2, CANDIDATE_SAMPLES // max(1, inp.aligned.size)))
            raw = np.unique(np.geomspace(m + 1, hi, num=num).round().astype(int))
            out = sorted({rule.next(int(c)) for c in raw})
    elif best[2] > 1.002:
        out = [rule.next(m + 1)]
    return [c for c in out if m < c <= m_max and rule.is_valid(c)]
