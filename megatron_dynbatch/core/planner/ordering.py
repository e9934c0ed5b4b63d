"""Micro-batch execution order and pipeline-aware polishing.

With ``pp == 1`` a rank's time is the sum of its micro-batch times, so order only matters for memory: the
largest micro-batch runs first (an out-of-memory shows at once, not minutes into the step). With ``pp > 1`` a
rank's time is the 1F1B makespan, which depends on order (the first micro-batch fills the pipeline, the last
drains it) and on the largest micro-batch (the steady state waits for it on every stage). Two tools:

* :func:`order_and_time` picks, per rank, the arrangement with the shortest simulated makespan among
  decreasing, increasing and *valley* (small at both ends, large in the middle). Ranks of one expert-parallel
  group advance in lockstep, so there one arrangement is used for all ranks (a pattern over size ranks, so the
  ``j``-th micro-batches of the group have similar sizes);
* :func:`polish_pipeline` moves single samples from the slowest rank to the fastest while the simulated step
  time drops: equal FLOPs are not equal makespans when one rank holds a giant micro-batch.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from ..alignment import Alignment
from ..cost_model import CostModel

PATTERNS = ("desc", "asc", "valley")


def arrangement(times: np.ndarray, pattern: str) -> np.ndarray:
    """Permutation of micro-batch indices for ``pattern`` (ties broken by index: deterministic)."""
    idx = np.arange(times.size)
    desc = np.lexsort((idx, -times))
    if pattern == "desc":
        return desc
    asc = desc[::-1]
    if pattern == "asc":
        return asc
    return np.concatenate([asc[0::2], asc[1::2][::-1]])


def mb_sums(rank_bins: List[List[int]], values: np.ndarray) -> np.ndarray:
    """Per-micro-batch sums of ``values`` over one rank's (non-empty) micro-batches, in one NumPy call."""
    if not rank_bins:
        return np.zeros(0, dtype=values.dtype)
    flat = [i for mb in rank_bins for i in mb]
    starts = np.cumsum([0] + [len(mb) for mb in rank_bins[:-1]])
    return np.add.reduceat(values[flat], starts)


def _per_rank_sums(bins: List[List[List[int]]], values: np.ndarray) -> List[np.ndarray]:
    """:func:`mb_sums` of every rank, in one NumPy call for the whole plan."""
    sizes = [len(mb) for rank in bins for mb in rank]
    if not sizes:
        return [np.zeros(0, dtype=values.dtype) for _ in bins]
    flat = [i for rank in bins for mb in rank for i in mb]
    sums = np.add.reduceat(values[flat], np.cumsum([0] + sizes[:-1]))
    bounds = np.cumsum([0] + [len(rank) for rank in bins])
    return [sums[bounds[r]:bounds[r + 1]] for r in range(len(bins))]


class RankTimes:
    """Per-micro-batch token and attention sums of every rank, kept up to date under sample moves."""

    def __init__(self, bins, aligned: np.ndarray, sq: np.ndarray, cm: CostModel, align: Alignment) -> None:
        self.bins = bins
        self.aligned, self.sq, self.cm, self.align = aligned, sq, cm, align
        self.slots = [s.astype(np.int64) for s in _per_rank_sums(bins, aligned)]
        self.sqs = [s.astype(np.float64) for s in _per_rank_sums(bins, sq)]

    def mb_times(self, r: int, slots=None, sqs=None) -> np.ndarray:
        slots = self.slots[r] if slots is None else slots
        sqs = self.sqs[r] if sqs is None else sqs
        padded = -(-slots // self.align.total_multiple) * self.align.total_multiple
        return self.cm.microbatch_time(padded, sqs)

    def best_rank_time(self, times: np.ndarray) -> Tuple[float, str]:
        return self.best_of(times, self.cm)

    @staticmethod
    def best_of(times: np.ndarray, cm: CostModel) -> Tuple[float, str]:
        """The shortest time of one rank's micro-batches over the arrangements, and that arrangement."""
        if cm.pp == 1:
            return float(times.sum()), "desc"
        best = None
        for pattern in PATTERNS:
            t = cm.rank_time(times[arrangement(times, pattern)])
            if best is None or t < best[0] - 1e-15:
                best = (t, pattern)
        return best


def best_arrangements(times: List[np.ndarray], cm: CostModel) -> Tuple[np.ndarray, List[np.ndarray]]:
    """Each rank's best arrangement (as :meth:`RankTimes.best_rank_time` picks it) and its time; ranks with
    equal micro-batch counts are simulated together, one vectorised pass per arrangement."""
    if len({t.size for t in times}) != 1 or cm.pp == 1:
        out = [RankTimes.best_of(t, cm) for t in times]
        return np.array([o[0] for o in out]), [arrangement(t, o[1]) for t, o in zip(times, out)]
    perms = [arrangement(t, PATTERNS[0]) for t in times]
    rank_t = cm.rank_times(np.stack([t[p] for t, p in zip(times, perms)]))
    for pattern in PATTERNS[1:]:
        cand = [arrangement(t, pattern) for t in times]
        cand_t = cm.rank_times(np.stack([t[p] for t, p in zip(times, cand)]))
        better = cand_t < rank_t - 1e-15
        for r in np.flatnonzero(better).tolist():
            perms[r] = cand[r]
        rank_t = np.where(better, cand_t, rank_t)
    return rank_t, perms


def order_and_time(bins, aligned, sq, cm: CostModel, align: Alignment):
    """Order every rank's micro-batches; return ``(ordered_bins, step_time, imbalance)``."""
    rt = RankTimes(bins, aligned, sq, cm, align)
    times = [rt.mb_times(r) for r in range(len(bins))]
    if cm.ep_group > 1 or cm.pp == 1:
        patterns = ["desc"] if cm.pp == 1 else list(PATTERNS)
        best = None
        for pattern in patterns:
            perms = [arrangement(t, pattern) for t in times]
            rank_t = cm.step_time([t[p] for t, p in zip(times, perms)])
            if best is None or rank_t.max() < best[1].max() - 1e-15:
                best = (perms, rank_t)
        perms, rank_t = best
    else:
        rank_t, perms = best_arrangements(times, cm)
    ordered = [[rank[i] for i in p] for rank, p in zip(bins, perms)]
    mean = float(rank_t.mean())
    return ordered, float(rank_t.max()), float(rank_t.max() / mean) if mean > 0 else 1.0


def polish_pipeline(bins: List[List[List[int]]], aligned, sq, oversize, cap: int, cm: CostModel,
                    align: Alignment, max_evals: int = 3000, candidates: int = 12, max_ops: int = 3_000_000,
                    start_evals: int = 0) -> int:
    """In place: move one sample at a time from the slowest rank to the fastest while the step time drops.

    Only for ``pp > 1`` without expert lockstep and without groups (the caller decides). A move never empties a
    micro-batch and never breaks the cap; the work is bounded by ``max_evals`` evaluations and ``max_ops``
    simulated pipeline operations, whichever comes first. Returns the evaluations spent, counting from
    ``start_evals``: the polish is a deterministic greedy walk, so a second call with a larger budget and the
    first call's return value as ``start_evals`` continues exactly as one call with the larger budget would.
    """
    rt = RankTimes(bins, aligned, sq, cm, align)
    dp = len(bins)
    rank_t = best_arrangements([rt.mb_times(r) for r in range(dp)], cm)[0]
    # One evaluation simulates two ranks in each arrangement: bound the simulated operations, not only the
    # evaluations, so long pipelines with many micro-batches stay fast.
    ops_per_eval = 2 * len(PATTERNS) * 2 * cm.pp * max(len(b) for b in bins)
    max_evals = min(max_evals, max(2, max_ops // max(1, ops_per_eval)))
    evals = start_evals
    while evals < max_evals:
        a, b = int(np.argmax(rank_t)), int(np.argmin(rank_t))
        if a == b or rank_t[a] - rank_t[b] <= 1e-9 * rank_t[a]:
            return evals
        best = None
        # Candidate samples of the slowest rank: from its largest micro-batches first (they set the bubble).
        order_mb = np.argsort(-rt.mb_times(a), kind="stable")
        cands = []
        for j in order_mb:
            if len(bins[a][j]) < 2:
                continue
            for i in sorted(bins[a][j], key=lambda s: (-aligned[s], s)):
                if not oversize[i]:
                    cands.append((int(j), int(i)))
            if len(cands) >= candidates:
                break
        for j, i in cands[:candidates]:
            room = cap - rt.slots[b]
            fits = np.flatnonzero(room >= aligned[i])
            if fits.size == 0:
                continue
            tb = rt.mb_times(b)
            k = int(fits[np.argmin(tb[fits])])
            sa, qa = rt.slots[a].copy(), rt.sqs[a].copy()
            sb, qb = rt.slots[b].copy(), rt.sqs[b].copy()
            sa[j] -= aligned[i]
            qa[j] -= sq[i]
            sb[k] += aligned[i]
            qb[k] += sq[i]
            ta = rt.best_rank_time(rt.mb_times(a, sa, qa))[0]
            tb_new = rt.best_rank_time(rt.mb_times(b, sb, qb))[0]
            evals += 2
            new_max = max(ta, tb_new)
            if new_max < rank_t[a] * (1 - 1e-9) and (best is None or new_max < best[0]):
                best = (new_max, j, i, k, ta, tb_new, sa, qa, sb, qb)
        if best is None:
            return evals
        _, j, i, k, ta, tb_new, sa, qa, sb, qb = best
        bins[a][j].remove(i)
        bins[b][k].append(i)
        rt.slots[a], rt.sqs[a], rt.slots[b], rt.sqs[b] = sa, qa, sb, qb
        rank_t[a], rank_t[b] = ta, tb_new
    return evals
