"""Per-rank times of a plan from its per-micro-batch times (shared by fixed-layout and dynamic-CP scoring)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..cost_model import CostModel
from ..smallops import is_small


def rank_times_of(mb_time: Sequence[Sequence[float]], per_step: Sequence[int], cm: CostModel) -> np.ndarray:
    """Per-rank times of per-micro-batch times ``mb_time[r][j]``: optimizer steps one after another (EP groups
    in lockstep inside each step); ranks with different micro-batch counts (baselines) are timed each alone."""
    if len({len(r) for r in mb_time}) == 1:
        rank_time = np.zeros(len(mb_time))
        start = 0
        for count in per_step:
            step = [t[start:start + count] for t in mb_time]
            if cm.ep_group == 1 and is_small(count):  # the same times without NumPy (CostModel.rank_time_of)
                rank_time += [cm.rank_time_of(t) for t in step]
            else:
                rank_time += cm.step_time(step)
            start += count
        return rank_time
    return np.array([cm.rank_time(t) for t in mb_time])


__all__ = ["rank_times_of"]
