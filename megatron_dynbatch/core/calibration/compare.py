"""What a new cost model changes: the predicted step time of a batch's plan, and of the plan it would make instead.

:func:`step_time_change` answers the three questions a calibration run (offline or online) reports on a sample
batch: what the OLD model predicted for its own plan, what the NEW model predicts for that same plan (how far off the
old model was on this hardware), and what the NEW model predicts for the plan it makes itself (the gain of planning
with it). Plans are scored with :func:`rescore`: the same grouping under another cost model -- a fixed-layout plan
through :func:`~..planner.score_assignment`, a dynamic-CP plan through
:func:`~..planner.dyncp.build_dynamic_cp_plan` (its CP groups kept). :func:`sample_lengths` draws the default
sample batch of ``calibrate``. Pure Python + NumPy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

import numpy as np

from ..parallel import ParallelConfig

if TYPE_CHECKING:
    from ..cost_model import CostModelLike
    from ..model_spec import ModelLike
    from ..parallel import ParallelLike
    from ..planner.options import ResolvedOptions
    from ..planner.plan_kind import PlanKind


@dataclass(frozen=True)
class StepTimeChange:
    """Predicted step seconds: ``old`` (old model, its own plan), ``same_plan`` (new model, that plan), ``replanned``
    (new model, its own plan; ``None`` when not re-planned) and the micro-batches per rank of both plans."""

    old: float
    same_plan: float
    replanned: Optional[float] = None
    old_microbatches: int = 0
    new_microbatches: Optional[int] = None

    @property
    def model_change(self) -> float:
        """Relative change of the prediction for the same plan (new / old - 1)."""
        return self.same_plan / self.old - 1.0 if self.old > 0 else float("nan")

    @property
    def replan_gain(self) -> Optional[float]:
        """Relative change the re-planning makes under the new model (replanned / same_plan - 1; < 0 = faster)."""
        if self.replanned is None or self.same_plan <= 0:
            return None
        return self.replanned / self.same_plan - 1.0

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "model_change": self.model_change, "replan_gain": self.replan_gain}

    def describe(self, old_name: str = "old model", new_name: str = "new model") -> str:
        text = (f"predicted step time {self.old:.4g} s ({old_name}, {self.old_microbatches} micro-batches per rank) "
                f"-> {self.same_plan:.4g} s ({new_name}, same plan: {self.model_change:+.1%})")
        if self.replanned is not None:
            text += (f"; re-planned with the {new_name}: {self.replanned:.4g} s ({self.replan_gain:+.1%}, "
                     f"{self.new_microbatches} micro-batches per rank)")
        return text


def rescore(plan: PlanKind, lengths: Sequence[int], *, model: Optional[ModelLike], cost_model: CostModelLike,
            max_tokens_per_gpu: int,
            fp8_alignment: Any = None) -> float:
    """Predicted step seconds of ``plan``'s grouping (same ranks, micro-batches, order, CP groups) under
    ``cost_model``."""
    from ..planner import score_assignment
    from ..planner.dyncp import build_dynamic_cp_plan
    if plan.dynamic_cp:
        slots = [plan.slot_groups(j) for j in range(plan.num_microbatches)]
        return float(build_dynamic_cp_plan(lengths, slots, parallel=plan.parallel,
                                           max_tokens_per_gpu=max_tokens_per_gpu, model=model, cost_model=cost_model,
                                           fp8_alignment=fp8_alignment,
                                           microbatches_per_step=plan.microbatches_per_step).predicted_step_time)
    return float(score_assignment(plan.micro_batches, lengths, model=model, parallel=plan.parallel,
                                  max_tokens_per_gpu=max_tokens_per_gpu, fp8_alignment=fp8_alignment,
                                  cost_model=cost_model,
                                  microbatches_per_step=plan.microbatches_per_step).predicted_step_time)


def step_time_change(lengths: Sequence[int], *, old_plan: Optional[PlanKind] = None, old: CostModelLike = None,
                     new: CostModelLike, options: Optional[ResolvedOptions] = None, model: Optional[ModelLike] = None,
                     max_tokens_per_gpu: Optional[int] = None) -> StepTimeChange:
    """:class:`StepTimeChange` of a batch. Give ``options`` (the planner's resolved options,
    :class:`~..planner.options.ResolvedOptions`; their cost model is replaced) to plan with ``old`` and re-plan with
    ``new``; or ``old_plan`` (the plan that ran) with ``model`` and ``max_tokens_per_gpu`` to score it under
    ``new`` only (then ``replanned`` is ``None`` unless ``options`` are given too)."""
    from ..planner.api import plan_resolved

    fp8 = None
    if options is not None:
        model, max_tokens_per_gpu, fp8 = options.model, options.max_tokens_per_gpu, options.options.fp8_alignment
    budget = int(max_tokens_per_gpu)
    if old_plan is None:
        old_plan = plan_resolved(lengths, options.replace(cost_model=old))
    old_s = float(old_plan.predicted_step_time)
    same = rescore(old_plan, lengths, model=model, cost_model=new, max_tokens_per_gpu=budget, fp8_alignment=fp8)
    replanned = new_m = None
    if options is not None:
        new_plan = plan_resolved(lengths, options.replace(cost_model=new))
        replanned, new_m = float(new_plan.predicted_step_time), int(new_plan.num_microbatches)
    return StepTimeChange(old_s, same, replanned, int(old_plan.num_microbatches), new_m)


def sample_lengths(max_tokens_per_gpu: int, parallel: ParallelLike, seed: int = 0,
                   microbatches_per_rank: int = 4) -> np.ndarray:
    """A sample batch for ``calibrate``'s report: lognormal lengths (median 1/8 of a micro-batch's capacity, clipped
    to [16, capacity]) filling about ``microbatches_per_rank`` micro-batches on every DP rank."""
    par = ParallelConfig.from_any(parallel)
    cap = int(max_tokens_per_gpu) * par.cp
    rng = np.random.default_rng(seed)
    target = 0.75 * microbatches_per_rank * par.dp * cap
    out = []
    while sum(out) < target or len(out) < par.dp:
        out.append(int(np.clip(rng.lognormal(np.log(cap / 8), 1.0), 16, cap)))
    return np.asarray(out, dtype=np.int64)


__all__ = ["StepTimeChange", "rescore", "step_time_change", "sample_lengths"]
