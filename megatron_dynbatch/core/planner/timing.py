"""Per-rank and per-step times of a plan from its per-micro-batch times (shared by fixed-layout and dynamic-CP
scoring).

Optimizer steps run one after another, and every step ends at the gradient all-reduce, where each rank waits for
the slowest: a plan's time is the sum over its steps of the step's slowest rank (:func:`step_times_of`), not the
slowest rank's sum over steps (step 1's slowest rank may be step 2's fastest, yet waits in both)."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from ..cost_model import CostModel
from ..smallops import is_small


def step_times_of(mb_time: Sequence[Sequence[float]], per_step: Sequence[int],
                  cm: CostModel) -> Tuple[np.ndarray, List[float]]:
    """``(rank_time, step_time)`` of per-micro-batch times ``mb_time[r][j]``: each rank's time summed over the
    optimizer steps (EP groups in lockstep inside each step) and each step's slowest rank. Ranks with different
    micro-batch counts (baselines) are timed each alone, as one step."""
    if len({len(r) for r in mb_time}) == 1:
        rank_time = np.zeros(len(mb_time))
        step_time: List[float] = []
        start = 0
        for count in per_step:
            step = [t[start:start + count] for t in mb_time]
            if cm.ep_group == 1 and is_small(count):  # the same times without NumPy (CostModel.rank_time_of)
                times = [cm.rank_time_of(t) for t in step]
            else:
                times = cm.step_time(step)
            rank_time += times
            step_time.append(float(max(times)) if len(times) else 0.0)
            start += count
        return rank_time, step_time
    rank_time = np.array([cm.rank_time(t) for t in mb_time])
    return rank_time, [float(rank_time.max()) if rank_time.size else 0.0]


__all__ = ["step_times_of"]
