"""Plain-Python twins of the few NumPy reductions the per-step fast paths need, bit-for-bit equal to NumPy.

A plan of many small optimizer steps (thousands of steps of a few samples) spends its time in NumPy's per-call
overhead on arrays of a handful of elements; the planner's fast paths (``planner/packer.py``, ``planner/bounds.py``,
``planner/ordering.py``, ``planner/search.py``, ``planner/timing.py``) and :class:`~.cost_model.CostModel`'s scalar
methods run such steps in plain Python instead. Elementwise float64 arithmetic is the same in Python (IEEE
doubles), and so are comparisons; what differs is summation order, which this module pins down.
``tests/test_planner_fast_paths.py`` checks every twin against NumPy.

Where the pairs are (each rule defined once, in the docstring of the function callers use; its plain-Python twin
right next to it):

* sums: :func:`np_sum` (``np.sum``); ``ordering.segment_sum`` (``ordering.mb_sums``, ``np.add.reduceat``);
* bounds: ``bounds.min_bins`` -> ``_min_bins_lists`` / ``_martello_toth_l2``;
* packing (``packer``): ``_desc_order_of`` (``_desc_order``), ``_units_heaviest_first`` and
  ``_items_heaviest_first`` (both branches in one function), the exchange searches ``pair_exchange`` ->
  ``_pair_lists`` / ``_pair_arrays`` and ``global_exchange`` -> ``_global_lists`` / ``_global_arrays`` (named
  parameters, ``UnitColumns`` / ``RankState``), ``refine_ranks`` (rank loads as lists or arrays);
* the count search: ``search._max_count`` (both branches in one function);
* timing: ``ordering.SmallRankTimes`` (``RankTimes``), ``arrangements_of`` / ``descending`` (``arrangement``),
  ``best_of_list`` (``RankTimes.best_of``), ``timing.step_times_of``; ``CostModel.microbatch_time_of`` shares
  ``_one_size_compute`` with ``microbatch_time`` (derived, not copied), ``rank_time_of`` / ``pipeline_time_of``
  pair with ``rank_time``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: steps (or ranks, or sets of sizes) of at most this many items take the plain-Python paths (:func:`is_small`)
SMALL_STEP = 32

#: NumPy sums float64 pairwise, and below this many elements its pairwise base case is a plain left-to-right loop
#: from 0.0 (``pairwise_sum`` in NumPy's ``loops_utils.h.src``); larger sums go to NumPy itself
SEQUENTIAL_SUM = 8


def np_sum(values: Sequence[float]) -> float:
    """``float(np.sum(np.asarray(values, dtype=np.float64)))``, in plain Python for fewer than 8 values."""
    if len(values) < SEQUENTIAL_SUM:
        total = 0.0
        for v in values:
            total += v
        return total
    return float(np.add.reduce(np.asarray(values, dtype=np.float64)))


def is_small(n: int) -> bool:
    """Whether ``n`` items are few enough for the plain-Python paths (``n <= SMALL_STEP``; tests set
    :data:`SMALL_STEP` to 0 to run every NumPy path instead)."""
    return n <= SMALL_STEP
