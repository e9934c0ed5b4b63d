"""The loss of one optimizer step, normalised over the whole step whatever the packing.

One :class:`~.loss.LossNormalizer` per optimizer step of the plan, built from per-sample statistics of the WHOLE
global batch (``T_i`` and loss-token counts, group ids) restricted to the step's samples -- identical on every
rank, so the gradient does not depend on which rank or micro-batch a sample landed in. :meth:`StepLoss.loss_func`
gives Megatron's loss function of one packed micro-batch (:func:`~.loss.make_loss_func`) with its step's
normaliser and micro-batch count.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Optional

import numpy as np

from .loss import LossNormalizer, make_loss_func
from .rank_plan import RankPlan

__all__ = ["StepLoss"]


class StepLoss:
    """Per-step loss normalisation of a plan (module docstring)."""

    def __init__(self, rank_plan: RankPlan, mask_sums: np.ndarray, mask_counts: np.ndarray, *, loss_mode: str,
                 group_reduce: str, group_ids: Optional[List[Hashable]]) -> None:
        self.rank_plan = rank_plan
        self.mask_sums, self.mask_counts = mask_sums, mask_counts
        self.loss_mode, self.group_reduce, self.group_ids = loss_mode, group_reduce, group_ids
        self._normalizers: Dict[int, LossNormalizer] = {}

    def normalizer(self, step: int = 0) -> LossNormalizer:
        """The :class:`LossNormalizer` of optimizer step ``step`` (global totals; identical on every rank)."""
        self.rank_plan.step_range(step)
        if step not in self._normalizers:
            self._normalizers[step] = LossNormalizer.from_stats(
                self.mask_sums, self.mask_counts, self.loss_mode, group_ids=self.group_ids,
                group_reduce=self.group_reduce, subset=self.rank_plan.step_samples(step))
        return self._normalizers[step]

    def loss_func(self, packed: Any, j: int, *, calculate_per_token_loss: bool,
                  per_token_loss: Optional[Callable[[Any, Any], Any]], collect: Optional[Callable[[Any, Any], Any]],
                  dp_size: Optional[int], tuple_size: int, forward_only: bool, num_microbatches: Optional[int],
                  keep_packed: bool) -> Callable[[Any], tuple]:
        """Megatron's loss function for ``packed``, micro-batch ``j`` of this row (arguments: see
        ``DynamicBatchIterator.loss_func``)."""
        rp = self.rank_plan
        step = rp.step_of_microbatch(j)
        m = num_microbatches if num_microbatches is not None else rp.plan.microbatches_per_step[step]
        return make_loss_func(None if forward_only else self.normalizer(step), packed, num_microbatches=m,
                              calculate_per_token_loss=calculate_per_token_loss,
                              dp_size=rp.plan.parallel.dp if dp_size is None else dp_size, cp_size=rp.cp_size,
                              per_token_loss=per_token_loss, collect=collect, tuple_size=tuple_size,
                              keep_packed=keep_packed)
