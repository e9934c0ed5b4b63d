"""Micro-batch execution order and pipeline-aware polishing.

With ``pp == 1`` a rank's time is the sum of its micro-batch times, so order only matters for memory: the
micro-batch with the most padded tokens -- the largest predicted peak -- runs first (:func:`memory_order`; the first
step meets its peak on its first micro-batch, where an out-of-memory shows at once and the start-up probe and the
memory guard look). Ranks of one expert-parallel group advance in lockstep, where order changes the time, so there
the micro-batches run longest first (below). With ``pp > 1`` a
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

from typing import List, Optional, Tuple

import numpy as np

from ..alignment import Alignment
from ..cost_model import CostModel
from ..pipeline_sim import simulated_steps, uses_fast_form
from ..smallops import is_small, np_sum

PATTERNS = ("desc", "asc", "valley")
#: pipelines simulated in the compressed form (``pipeline_sim.uses_fast_form``: long, with many micro-batches)
#: polish with this fraction of the simulated work other plans may spend
FAST_FORM_POLISH_SHARE = 16


def arrangement(times: np.ndarray, pattern: str) -> np.ndarray:
    """Permutation of micro-batch indices for ``pattern`` (ties broken by index: deterministic): ``desc`` longest
    first, ``asc`` its reverse, ``valley`` the even positions of ``asc`` then its odd ones reversed (small at
    both ends). Its plain-Python twin for small steps is :func:`arrangements_of`, right below."""
    idx = np.arange(times.size)
    desc = np.lexsort((idx, -times))
    if pattern == "desc":
        return desc
    asc = desc[::-1]
    if pattern == "asc":
        return asc
    return np.concatenate([asc[0::2], asc[1::2][::-1]])


def arrangements_of(times: List[float]) -> Tuple[List[int], ...]:
    """:func:`arrangement` of a list of Python floats for every pattern of :data:`PATTERNS`, in plain Python (the
    same permutations)."""
    desc = descending(times)
    asc = desc[::-1]
    return desc, asc, asc[0::2] + asc[1::2][::-1]


def descending(times: List[float]) -> List[int]:
    """The positions of ``times`` longest first, ties in index order: the "desc" arrangement."""
    return sorted(range(len(times)), key=times.__getitem__, reverse=True)  # reverse keeps ties in index order


def memory_order(padded_tokens: np.ndarray) -> np.ndarray:
    """The ``pp == 1`` execution order of one rank's micro-batches: most padded tokens first (its peak memory
    grows with them, so the first micro-batch meets the rank's peak, where the start-up probe and the memory
    guard look; NeMo-RL's ``microbatch_order: largest_first``), ties in index order. Its plain-Python twin is
    :func:`descending` of the list."""
    idx = np.arange(padded_tokens.size)
    return np.lexsort((idx, -padded_tokens))


def mb_sums(rank_bins: List[List[int]], values: np.ndarray) -> np.ndarray:
    """Per-micro-batch sums of ``values`` over one rank's (non-empty) micro-batches, in one NumPy call."""
    if not rank_bins:
        return np.zeros(0, dtype=values.dtype)
    flat = [i for mb in rank_bins for i in mb]
    starts = np.cumsum([0] + [len(mb) for mb in rank_bins[:-1]])
    return np.add.reduceat(values[flat], starts)


def segment_sum(values: List[float]) -> float:
    """``np.add.reduceat``'s sum of one non-empty segment: its first value plus NumPy's sum of the rest."""
    return values[0] if len(values) == 1 else values[0] + np_sum(values[1:])


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
    """Per-micro-batch token and attention sums of every rank, kept up to date under sample moves, and the rank
    times they give (NumPy arrays; :meth:`build` picks :class:`SmallRankTimes` for small plans)."""

    @staticmethod
    def build(bins, aligned: np.ndarray, sq: np.ndarray, cm: CostModel, align: Alignment,
              memo: Optional["TimingMemo"] = None) -> "RankTimes":
        """:class:`SmallRankTimes` (sharing ``memo``, if given) for a small step (``smallops.is_small``) whose
        ranks are timed one by one (no expert lockstep) and whose micro-batches are non-empty, else
        :class:`RankTimes`."""
        if (cm.ep_group == 1 and is_small(aligned.size) and sq.dtype == np.float64 and aligned.dtype.kind in "iu"
                and all(mb for rank in bins for mb in rank)):
            return SmallRankTimes(bins, aligned, sq, cm, align, memo)
        return RankTimes(bins, aligned, sq, cm, align, memo)

    def __init__(self, bins, aligned: np.ndarray, sq: np.ndarray, cm: CostModel, align: Alignment,
                 memo: Optional["TimingMemo"] = None) -> None:
        self.bins = bins
        self.aligned, self.sq, self.cm, self.align = aligned, sq, cm, align
        self.memo = memo
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

    def padded(self, r: int) -> np.ndarray:
        """Rank ``r``'s micro-batches' padded tokens (what its peak memory grows with)."""
        tm = self.align.total_multiple
        return -(-self.slots[r] // tm) * tm

    def ranks_timed(self, times: List[np.ndarray]) -> Tuple[np.ndarray, list]:
        """Every rank's time and arrangement (ranks independent: no expert lockstep): with ``pp == 1`` the
        order leaves the time alone, so it is the memory order (:func:`memory_order`), else the best
        arrangement (:func:`best_arrangements`)."""
        if self.cm.pp == 1:
            perms = [memory_order(self.padded(r)) for r in range(len(times))]
            return self.cm.step_time([t[p] for t, p in zip(times, perms, strict=True)]), perms
        return best_arrangements(times, self.cm, None if self.memo is None else self.memo.arranged)

    @staticmethod
    def by_time(times: np.ndarray) -> List[int]:
        """Micro-batch indices by decreasing time (lower index first on ties)."""
        return np.argsort(-times, kind="stable").tolist()

    def fastest_fit(self, r: int, times: np.ndarray, need: int, cap: int) -> Optional[int]:
        """The micro-batch of rank ``r`` with the shortest ``times`` (lowest index on ties) that has room for
        ``need`` more slot tokens under ``cap``; ``None`` if none has."""
        fits = np.flatnonzero(cap - self.slots[r] >= need)
        return int(fits[np.argmin(times[fits])]) if fits.size else None

    def moved(self, a: int, j: int, b: int, k: int, tokens: int, sq: float):
        """Rank ``a``'s and rank ``b``'s ``(slots, sqs)`` after a sample of ``tokens`` and ``sq`` moves from
        micro-batch ``j`` of ``a`` to micro-batch ``k`` of ``b`` (copies; :meth:`commit` keeps them)."""
        sa, qa = self.slots[a].copy(), self.sqs[a].copy()
        sb, qb = self.slots[b].copy(), self.sqs[b].copy()
        sa[j] -= tokens
        qa[j] -= sq
        sb[k] += tokens
        qb[k] += sq
        return sa, qa, sb, qb

    def commit(self, a: int, b: int, moved) -> None:
        self.slots[a], self.sqs[a], self.slots[b], self.sqs[b] = moved


def best_of_list(times: List[float], cm: CostModel) -> Tuple[float, str, List[int]]:
    """:meth:`RankTimes.best_of` of a list of Python floats, in plain Python (the same time and arrangement),
    with the arrangement's permutation (the one of :func:`arrangements_of`)."""
    if cm.pp == 1:
        return cm.rank_time_of(times), "desc", descending(times)
    best = None
    stage = [t / cm.pp for t in times]
    for pattern, perm in zip(PATTERNS, arrangements_of(times), strict=True):
        t = cm.pipeline_time_of([stage[i] for i in perm])
        if best is None or t < best[0] - 1e-15:
            best = (t, pattern, perm)
    return best


class TimingMemo:
    """What one step's plans already computed: for small plans (:class:`SmallRankTimes`) a micro-batch's slot
    tokens and squared tokens by its items, its time by those two sums, a rank's best arrangement by its
    micro-batch times; for large ones a rank's best arrangement and time (:func:`best_arrangements`), so a
    polish and the ordering after it simulate only the ranks the polish changed.
    Each is a pure function of its key for one step's items, cost model and alignment, so one memo serves every
    packing, polish and ordering of a step, which re-time the same micro-batches and ranks many times."""

    def __init__(self) -> None:
        self.sums: dict = {}  # items of a micro-batch (tuple) -> (slot tokens, squared tokens)
        self.mb: dict = {}  # (slot tokens, squared tokens) -> micro-batch time
        self.rank: dict = {}  # micro-batch times (tuple) -> (rank time, pattern, arrangement)
        self.arranged: dict = {}  # micro-batch times (bytes of the array) -> (rank time, arrangement): large steps


class SmallRankTimes(RankTimes):
    """:class:`RankTimes` of a small step in plain Python: Python lists of sums and times, per-micro-batch times
    from :meth:`CostModel.microbatch_time_of` and rank times from :meth:`CostModel.rank_time_of`. Every value is
    the one the NumPy class computes (the same float64 operations in the same order: a micro-batch's sum is its
    first value plus the NumPy sum of the rest, as ``np.add.reduceat`` adds), and every choice breaks ties the
    same way (stable sorts, first minimum); ``tests/test_planner_fast_paths.py`` compares the two."""

    def __init__(self, bins, aligned: np.ndarray, sq: np.ndarray, cm: CostModel, align: Alignment,
                 memo: Optional[TimingMemo] = None) -> None:
        self.bins = bins
        self.aligned, self.sq, self.cm, self.align = aligned, sq, cm, align
        self.memo = memo if memo is not None else TimingMemo()
        self._tok, self._sq = aligned.tolist(), sq.tolist()
        sums = [[self._sums(mb) for mb in rank] for rank in bins]
        self.slots = [[s for s, _ in rank] for rank in sums]
        self.sqs = [[q for _, q in rank] for rank in sums]
        self.times = [self.mb_times(r, self.slots[r], self.sqs[r]) for r in range(len(bins))]

    def _sums(self, mb: List[int]) -> Tuple[int, float]:
        key = tuple(mb)
        found = self.memo.sums.get(key)
        if found is None:
            tok, sqs = self._tok, self._sq
            found = self.memo.sums[key] = (sum([tok[i] for i in mb]), segment_sum([sqs[i] for i in mb]))
        return found

    def mb_times(self, r: int, slots=None, sqs=None) -> List[float]:
        """The times of rank ``r``'s micro-batches (do not modify the list), or of ``slots`` and ``sqs``."""
        if slots is None:
            return self.times[r]
        tm, known, out = self.align.total_multiple, self.memo.mb, []
        for s, q in zip(slots, sqs, strict=True):
            t = known.get((s, q))
            if t is None:
                t = known[s, q] = self.cm.microbatch_time_of(-(-s // tm) * tm, q)
            out.append(t)
        return out

    def commit(self, a: int, b: int, moved) -> None:
        super().commit(a, b, moved)
        self.times[a], self.times[b] = self.mb_times(a, *moved[:2]), self.mb_times(b, *moved[2:])

    def best_rank_time(self, times: List[float]) -> Tuple[float, str]:
        return self._best(times)[:2]

    def _best(self, times: List[float]) -> Tuple[float, str, List[int]]:
        """Rank time, arrangement and its permutation (do not modify it), remembered by ``times``."""
        key = tuple(times)
        found = self.memo.rank.get(key)
        if found is None:
            found = self.memo.rank[key] = best_of_list(times, self.cm)
        return found

    def ranks_timed(self, times: List[List[float]]) -> Tuple[np.ndarray, list]:
        # pp == 1 sums each rank largest first; else each rank's best arrangement is best_arrangements' choice
        # (its vectorised 1F1B simulation is the per-rank one, row by row)
        if self.cm.pp == 1:
            perms = [descending(self.padded(r)) for r in range(len(times))]
            return np.array([self.cm.rank_time_of([t[i] for i in p]) for t, p in zip(times, perms, strict=True)]), perms
        best = [self._best(t) for t in times]
        return np.array([b[0] for b in best]), [b[2] for b in best]

    def padded(self, r: int) -> List[int]:
        tm = self.align.total_multiple
        return [-(-s // tm) * tm for s in self.slots[r]]

    @staticmethod
    def by_time(times: List[float]) -> List[int]:
        return descending(times)

    def fastest_fit(self, r: int, times: List[float], need: int, cap: int) -> Optional[int]:
        best = None
        for k, used in enumerate(self.slots[r]):
            if cap - used >= need and (best is None or times[k] < times[best]):
                best = k
        return best


def best_arrangements(times: List[np.ndarray], cm: CostModel,
                      memo: Optional[dict] = None) -> Tuple[np.ndarray, List[np.ndarray]]:
    """Each rank's best arrangement (as :meth:`RankTimes.best_rank_time` picks it) and its time; ranks with
    equal micro-batch counts are simulated together, one vectorised pass per arrangement. ``memo`` (a
    :class:`TimingMemo`'s ``arranged``): ranks whose micro-batch times it knows are not simulated again (each
    rank's row of a vectorised simulation is computed alone, so the values are the same)."""
    if memo is not None:
        keys = [t.tobytes() for t in times]
        todo = [r for r, key in enumerate(keys) if key not in memo]
        if todo:
            got_t, got_p = best_arrangements([times[r] for r in todo], cm)
            for k, r in enumerate(todo):
                memo[keys[r]] = (float(got_t[k]), got_p[k])
        known = [memo[key] for key in keys]
        return np.array([k[0] for k in known]), [k[1] for k in known]
    if len({t.size for t in times}) != 1 or cm.pp == 1:
        out = [RankTimes.best_of(t, cm) for t in times]
        return np.array([o[0] for o in out]), [arrangement(t, o[1]) for t, o in zip(times, out, strict=True)]
    perms = [arrangement(t, PATTERNS[0]) for t in times]
    rank_t = cm.rank_times(np.stack([t[p] for t, p in zip(times, perms, strict=True)]))
    for pattern in PATTERNS[1:]:
        cand = [arrangement(t, pattern) for t in times]
        cand_t = cm.rank_times(np.stack([t[p] for t, p in zip(times, cand, strict=True)]))
        better = cand_t < rank_t - 1e-15
        for r in np.flatnonzero(better).tolist():
            perms[r] = cand[r]
        rank_t = np.where(better, cand_t, rank_t)
    return rank_t, perms


def order_and_time(bins, aligned, sq, cm: CostModel, align: Alignment, memo: Optional[TimingMemo] = None):
    """Order every rank's micro-batches; return ``(ordered_bins, step_time, imbalance)`` (``memo``: the step's
    :class:`TimingMemo`, for small steps)."""
    rt = RankTimes.build(bins, aligned, sq, cm, align, memo)
    times = [rt.mb_times(r) for r in range(len(bins))]
    if cm.ep_group > 1:  # lockstep: one arrangement for every rank
        patterns = ["desc"] if cm.pp == 1 else list(PATTERNS)
        best = None
        for pattern in patterns:
            perms = [arrangement(t, pattern) for t in times]
            rank_t = cm.step_time([t[p] for t, p in zip(times, perms, strict=True)])
            if best is None or rank_t.max() < best[1].max() - 1e-15:
                best = (perms, rank_t)
        perms, rank_t = best
    else:
        rank_t, perms = rt.ranks_timed(times)
    ordered = [[rank[i] for i in p] for rank, p in zip(bins, perms, strict=True)]
    values = rank_t.tolist()
    top, mean = max(values), np_sum(values) / len(values)  # as rank_t.max() and rank_t.mean()
    return ordered, top, top / mean if mean > 0 else 1.0


def polish_pipeline(bins: List[List[List[int]]], aligned, sq, oversize, cap: int, cm: CostModel,
                    align: Alignment, max_evals: int = 3000, candidates: int = 12, max_ops: int = 3_000_000,
                    start_evals: int = 0, memo: Optional[TimingMemo] = None) -> int:
    """In place: move one sample at a time from the slowest rank to the fastest while the step time drops.

    Only for ``pp > 1`` without expert lockstep and without groups (the caller decides). A move never empties a
    micro-batch and never breaks the cap; the work is bounded by ``max_evals`` evaluations and ``max_ops``
    simulated pipeline operations (:func:`~..pipeline_sim.simulated_steps`; 1/16 of it in the compressed form),
    whichever comes first -- the operations strictly (a round runs only if it fits). Returns the evaluations
    spent, counting from ``start_evals``: the polish is a deterministic greedy walk, so a second call with a
    larger ``max_evals`` and the first call's return value as ``start_evals`` continues exactly as one call with
    the larger limit would.
    ``memo``: the step's :class:`TimingMemo`, for small steps.
    """
    rt = RankTimes.build(bins, aligned, sq, cm, align, memo)
    if isinstance(rt, SmallRankTimes):  # read samples from Python lists (NumPy scalars are slow one at a time)
        aligned, sq, oversize = aligned.tolist(), sq.tolist(), oversize.tolist()
    dp = len(bins)
    rank_t = rt.ranks_timed([rt.mb_times(r) for r in range(dp)])[0]
    # One evaluation simulates two ranks in each arrangement: bound the simulated operations, not only the
    # evaluations, so long pipelines with many micro-batches stay fast.
    m = max(len(b) for b in bins)
    ops_per_eval = 2 * len(PATTERNS) * simulated_steps(m, cm.pp)
    if uses_fast_form(m, cm.pp):  # pipelines this long and full: one simulation takes milliseconds, so the
        max_ops //= FAST_FORM_POLISH_SHARE  # polish gets a smaller share of the planning time
    by_ops = max(2, max_ops // max(1, ops_per_eval))
    # When the operations bound binds, a round of candidate moves runs only if all of it fits (a round may cost
    # 2 * candidates evaluations of two long simulations each); else the evaluation count is checked per round.
    strict = by_ops < max_evals
    max_evals = min(max_evals, by_ops)
    evals = start_evals
    while evals < max_evals:
        a, b = int(np.argmax(rank_t)), int(np.argmin(rank_t))
        if a == b or rank_t[a] - rank_t[b] <= 1e-9 * rank_t[a]:
            return evals
        best = None
        # Candidate samples of the slowest rank: from its largest micro-batches first (they set the bubble).
        cands = []
        for j in rt.by_time(rt.mb_times(a)):
            if len(bins[a][j]) < 2:
                continue
            for i in sorted(bins[a][j], key=lambda s: (-aligned[s], s)):
                if not oversize[i]:
                    cands.append((int(j), int(i)))
            if len(cands) >= candidates:
                break
        if strict and evals + 2 * len(cands[:candidates]) > max_evals:
            return evals
        tb = rt.mb_times(b)
        for j, i in cands[:candidates]:
            k = rt.fastest_fit(b, tb, int(aligned[i]), cap)
            if k is None:
                continue
            moved = rt.moved(a, j, b, k, int(aligned[i]), float(sq[i]))
            ta = rt.best_rank_time(rt.mb_times(a, *moved[:2]))[0]
            tb_new = rt.best_rank_time(rt.mb_times(b, *moved[2:]))[0]
            evals += 2
            new_max = max(ta, tb_new)
            if new_max < rank_t[a] * (1 - 1e-9) and (best is None or new_max < best[0]):
                best = (new_max, j, i, k, ta, tb_new, moved)
        if best is None:
            return evals
        _, j, i, k, ta, tb_new, moved = best
        bins[a][j].remove(i)
        bins[b][k].append(i)
        rt.commit(a, b, moved)
        rank_t[a], rank_t[b] = ta, tb_new
    return evals
