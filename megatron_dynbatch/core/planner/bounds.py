"""Lower bounds on the number of micro-batches (bins) that a set of samples needs.

The count search starts at the fewest micro-batches per rank that can possibly hold the step, so a weak bound
costs real time: with every sample just over half the budget the token bound ``ceil(sum / cap)`` says ``n/2``
bins while ``n`` are needed, and a search that walked up from there one count at a time re-packed ``n/2``
times. The bounds here are all valid (no packing can use fewer bins) and take ``O(n log n)``:

* **L1** -- tokens: ``ceil(sum / cap)``;
* **L2** (Martello & Toth, 1990) -- for a threshold ``k <= cap/2``: items over ``cap - k`` and items over
  ``cap/2`` each need their own bin, and the items in ``[k, cap/2]`` fill the room the latter leave before
  needing more bins; the maximum over every distinct ``k``;
* **cardinality** -- at most ``j`` items larger than ``cap/(j+1)`` share a bin, so those items need
  ``ceil(count / j)`` bins (``j = 2`` catches "every sample just over a third of the budget").

Samples over the budget (``oversize='alone'``) run alone: each adds one bin and is not packed with others.

The opposite direction -- the MOST micro-batches every rank can fill -- is a covering question when samples come
in groups that must share a rank (:func:`max_covered_count`): every rank needs ``M`` items, so the groups must
cover ``dp`` ranks with at least ``M`` items each.
"""

from __future__ import annotations

import bisect
import itertools
from typing import List

import numpy as np

from ..smallops import is_small

#: cardinality bounds for j = 2 .. MAX_J (j = 1 is inside L2)
MAX_J = 8


def min_bins(sizes: np.ndarray, cap: int, n_alone: int = 0) -> int:
    """A lower bound on the bins of capacity ``cap`` that items of ``sizes`` (each ``<= cap``) need, plus
    ``n_alone`` items that must each have a bin of their own: the largest of L1, L2 and the cardinality bounds
    (module docstring). At least 1 when there is anything to place. A few sizes take the plain-Python twin
    :func:`_min_bins_lists` (below), the rest NumPy (:func:`_martello_toth_l2`): the same integers."""
    s = np.asarray(sizes, dtype=np.int64)
    if s.size == 0:
        return int(n_alone)
    if is_small(s.size):  # a few sizes: NumPy's per-call overhead would dominate
        return _min_bins_lists(sorted(s.tolist()), int(cap)) + int(n_alone)
    s = np.sort(s)[::-1]  # descending
    n = int(s.size)
    cap = int(cap)
    total = int(s.sum())
    best = max(1, -(-total // cap))
    best = max(best, _martello_toth_l2(s, cap))
    asc = s[::-1]
    for j in range(2, MAX_J + 1):
        # items strictly larger than cap / (j + 1): at most j of them fit one bin
        count = n - int(np.searchsorted(asc, cap // (j + 1), side="right"))
        if count == 0:
            break
        best = max(best, -(-count // j))
    return best + int(n_alone)


def _min_bins_lists(asc: List[int], cap: int) -> int:
    """:func:`min_bins` of a few sizes (ascending, non-empty) in plain Python, its twin for small steps: the same
    bounds by the same integer arithmetic, with ``bisect`` for ``searchsorted`` and running sums for ``cumsum``
    (exact: all integers)."""
    n = len(asc)
    prefix = list(itertools.accumulate(asc, initial=0))  # prefix[i] = sum of the i smallest
    best = max(1, -(-prefix[n] // cap))
    # Martello-Toth L2 for every distinct k <= cap/2 (see _martello_toth_l2); with no item over cap/2 every k
    # gives ceil(sum of the items >= k / cap), at most the token bound above, so the loop is skipped
    n_small = bisect.bisect_right(asc, cap // 2)  # s <= cap/2
    n_gt_half = n - n_small
    sum_gt_half = prefix[n] - prefix[n_small]
    for k in sorted(set([0] + asc[:n_small])) if n_gt_half else ():
        idx = bisect.bisect_right(asc, cap - k)  # s > cap - k: J1
        j1 = n - idx
        j2 = n_gt_half - j1
        sum_j2 = sum_gt_half - (prefix[n] - prefix[idx])
        sum_j3 = prefix[n_small] - prefix[bisect.bisect_left(asc, k)]
        extra = max(0, -(-(sum_j3 - (j2 * cap - sum_j2)) // cap))
        best = max(best, j1 + j2 + extra)
    for j in range(2, MAX_J + 1):
        count = n - bisect.bisect_right(asc, cap // (j + 1))
        if count == 0:
            break
        best = max(best, -(-count // j))
    return best


def _martello_toth_l2(desc: np.ndarray, cap: int) -> int:
    """Martello-Toth L2 for sizes sorted in decreasing order, every distinct ``k <= cap/2`` tried at once."""
    asc = desc[::-1]
    prefix = np.concatenate(([0], np.cumsum(asc)))  # prefix[i] = sum of the i smallest
    n = asc.size
    half = cap // 2  # "s <= cap/2" for integers is "s <= half" (cap even) or "s <= half" (cap odd: s < cap/2)
    ks = np.unique(np.concatenate(([0], asc[asc <= half])))
    # counts by threshold, via the ascending array
    n_gt_half = n - int(np.searchsorted(asc, half, side="right"))          # s > cap/2
    sum_gt_half = int(prefix[n] - prefix[n - n_gt_half])
    idx_gt_cap_minus_k = np.searchsorted(asc, cap - ks, side="right")        # s > cap - k  (J1)
    j1 = n - idx_gt_cap_minus_k
    # J2: cap/2 < s <= cap - k
    j2 = n_gt_half - j1
    sum_j1 = prefix[n] - prefix[idx_gt_cap_minus_k]
    sum_j2 = sum_gt_half - sum_j1
    # J3: k <= s <= cap/2
    lo = np.searchsorted(asc, ks, side="left")
    hi = n - n_gt_half
    sum_j3 = prefix[hi] - prefix[lo]
    room = j2 * cap - sum_j2
    extra = np.maximum(0, -(-(sum_j3 - room) // cap))
    return int((j1 + j2 + extra).max())


def max_covered_count(unit_counts: np.ndarray, dp: int, hi: int) -> int:
    """An upper bound (at most ``hi``) on the micro-batches per rank a step of units (groups that stay on one
    rank, ``unit_counts`` items each) can fill: every rank needs ``M`` items, so ``dp`` ranks must each be
    covered by whole units holding ``>= M`` items. :func:`_ranks_covered` bounds how many ranks ``M`` can cover;
    a count whose bound is below ``dp`` certainly fails, and so does every larger count (a rank holding ``M + 1``
    items holds ``M``), so the bisection's first failure bounds every feasible count: ``0`` when even ``M = 1``
    fails."""
    desc = np.sort(np.asarray(unit_counts, dtype=np.int64))[::-1]
    prefix = np.concatenate(([0], np.cumsum(desc)))
    lo, top = 0, int(hi) + 1  # covered(lo) holds (or lo == 0), covered(top) fails
    while top - lo > 1:
        mid = (lo + top) // 2
        if _ranks_covered(desc, prefix, mid) >= dp:
            lo = mid
        else:
            top = mid
    return lo


def _ranks_covered(desc: np.ndarray, prefix: np.ndarray, m: int) -> int:
    """A bound on the ranks that units of ``desc`` items (decreasing; ``prefix``: its running sums) can give
    ``m`` items each: a unit of ``>= m`` items covers one rank alone; the smaller units cover at most
    ``floor(sum / m)`` ranks, each with at least ``c`` of them, ``c`` the fewest units whose items reach ``m``
    (the largest ``c``)."""
    big = int(desc.size - np.searchsorted(desc[::-1], m, side="left"))  # units of >= m items
    small_sum = int(prefix[-1] - prefix[big])
    if small_sum < m:
        return big
    c = int(np.searchsorted(prefix[big:] - prefix[big], m, side="left"))  # fewest small units reaching m
    return big + min(small_sum // m, (desc.size - big) // c)
