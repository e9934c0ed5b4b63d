"""This rank's place in a plan: plan the global batch (or check the given plan), find the row this GPU runs.

Every rank builds the same plan from the same global batch (:func:`plan_batch`: deterministic, no communication),
then :meth:`RankPlan.resolve` checks it against the batch and the running layout -- the plan places every sample
once, its token counts are what packing these samples gives (:meth:`~..core.planner.plan_kind.PlanKind.
packed_tokens`), its ``dp`` / ``cp`` are Megatron's -- and fixes this GPU's DP rank, CP rank and row
(:meth:`~..core.planner.plan_kind.PlanKind.row_of`: its DP rank under a plain plan, its pool GPU under dynamic CP).

A :class:`RankPlan` answers every question about the schedule of this rank (which micro-batches form an optimizer
step, which samples are whose, the ``seq_length`` Megatron needs) and never touches a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, List, Optional, Sequence

import numpy as np

from ..core.checks import is_int
from ..core.errors import DynBatchConfigError
from ..core.planner.api import plan_resolved
from ..core.planner.options import ResolvedOptions
from ..core.planner.plan_kind import PlanKind

__all__ = ["RankPlan", "plan_batch", "parallel_state"]


def parallel_state() -> Any:
    """Megatron's ``parallel_state`` if it is initialised (never imports megatron-core: if it was not imported
    yet, it cannot have been initialised, and importing it costs seconds)."""
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    return ps if ps is not None and ps.model_parallel_is_initialized() else None


def plan_batch(lengths: np.ndarray, options: ResolvedOptions, group_ids: Optional[List[Hashable]], *,
               microbatch_group_ids: Optional[Sequence[Any]] = None,
               rollout_ids: Optional[Sequence[Any]] = None) -> PlanKind:
    """The plan of the global batch. Under dynamic CP a sample may run on GPUs of several DP ranks, so "a group
    stays on one DP rank" has no meaning (the planner refuses it); the ids still define ``group_mean``'s groups
    (the loss), so they are dropped here only."""
    batch = {k: v for k, v in (("microbatch_group_ids", microbatch_group_ids), ("rollout_ids", rollout_ids))
             if v is not None}
    return plan_resolved(lengths, options, group_ids=None if options.options.dynamic_cp else group_ids, **batch)


@dataclass(frozen=True)
class RankPlan:
    """A checked plan and the row of it this GPU runs (module docstring)."""

    plan: PlanKind
    dp_rank: int
    cp_rank: int
    cp_size: int
    #: the row of ``plan.micro_batches`` this GPU runs
    row: int
    #: every micro-batch of this row padded to the row's longest (module docstring of :mod:`.iterator`)
    uniform_length: bool

    @classmethod
    def resolve(cls, plan: Any, lengths: np.ndarray, num_samples: int, *, dp_rank: Optional[int],
                cp_rank: Optional[int], cp_size: Optional[int], uniform_length: Optional[bool]) -> "RankPlan":
        """Check ``plan`` against the batch (``lengths``, ``num_samples``) and the running layout
        (``parallel_state`` when initialised) and place this GPU in it (``None``: read from ``parallel_state``)."""
        if not isinstance(plan, PlanKind):
            raise DynBatchConfigError("plan", type(plan).__name__, "must be a megatron_dynbatch.Plan",
                                      "build it with plan_global_batch(...) or Plan.from_dict(...)")
        try:
            plan.validate(num_samples=num_samples)
        except AssertionError as exc:
            raise DynBatchConfigError("plan", f"{plan.num_samples} samples / {num_samples} given",
                                      f"does not fit this global batch: {exc}",
                                      "plan the same global batch on every rank (same lengths, same order)") from None
        par = plan.parallel
        ps = parallel_state()
        if ps is not None and dp_rank is None:
            _check_world_dp(ps.get_data_parallel_world_size(), par.dp)
        if dp_rank is None:
            dp_rank = ps.get_data_parallel_rank() if ps is not None else 0
        if cp_size is None:
            cp_size = par.cp
        if cp_rank is None:
            cp_rank = ps.get_context_parallel_rank() if (ps is not None and cp_size > 1) else 0
        if not isinstance(dp_rank, (int, np.integer)) or not 0 <= dp_rank < par.dp:
            raise DynBatchConfigError("dp_rank", dp_rank, f"must be in [0, {par.dp})", "pass this rank's DP rank")
        if cp_size != par.cp:
            raise DynBatchConfigError("cp_size", cp_size, f"the plan was made for cp={par.cp}",
                                      "plan with the running context-parallel size")
        if not isinstance(cp_rank, (int, np.integer)) or not 0 <= cp_rank < cp_size:
            raise DynBatchConfigError("cp_rank", cp_rank, f"must be in [0, {cp_size})", "pass this rank's CP rank")
        row = plan.row_of(int(dp_rank), int(cp_rank))
        # The plan's token counts must be what packing this batch produces (catches a plan of other lengths).
        for j, mb in enumerate(plan.micro_batches[row]):
            want = plan.packed_tokens(row, j, lengths[mb])
            if plan.microbatch_tokens and plan.microbatch_tokens[row][j] != want:
                raise DynBatchConfigError(
                    "plan", f"micro-batch {j} of rank {row}",
                    f"planned as {plan.microbatch_tokens[row][j]} tokens but these samples pack to {want}",
                    "plan the same global batch (same lengths) that is passed to the iterator")
        if plan.dynamic_cp and uniform_length:
            raise DynBatchConfigError("uniform_length", uniform_length, "a dynamic-CP plan runs micro-batches of "
                                      "different CP sizes, which cannot share one length", "pass uniform_length=None")
        uniform = (bool(par.pp == 2 and par.vpp > 1) if uniform_length is None else
                   bool(uniform_length)) and not plan.dynamic_cp
        return cls(plan, int(dp_rank), int(cp_rank), int(cp_size), row, uniform)

    # ------------------------------------------------------------------------------------------ layout
    @property
    def gpu(self) -> int:
        """This GPU in pool numbering (``dp_rank * cp + cp_rank``; :meth:`PlanKind.cp_group` counts so)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def num_steps(self) -> int:
        """Optimizer steps in the plan (1 unless ``samples_per_step`` split the batch)."""
        return len(self.plan.microbatches_per_step)

    @property
    def num_microbatches(self) -> int:
        return self.plan.num_microbatches

    def step_range(self, step: Optional[int] = None) -> range:
        """Indices (into this row's micro-batch list) of ``step``'s micro-batches; ``None`` = all steps."""
        if step is None:
            return range(0, self.num_microbatches)
        if not is_int(step) or not 0 <= step < self.num_steps:
            raise DynBatchConfigError("step", step, f"must be in [0, {self.num_steps})",
                                      "pass the optimizer step index within this global batch")
        start = sum(self.plan.microbatches_per_step[:step])
        return range(start, start + self.plan.microbatches_per_step[step])

    def step_of_microbatch(self, j: int) -> int:
        offsets = np.cumsum(self.plan.microbatches_per_step)
        return int(np.searchsorted(offsets, j, side="right"))

    def step_samples(self, step: int) -> List[int]:
        """Global indices of the samples of optimizer step ``step`` (all rows), ascending."""
        r = self.step_range(step)
        return sorted({i for rank in self.plan.micro_batches for j in r for i in rank[j]})

    def sample_indices(self, step: Optional[int] = None) -> List[int]:
        """Global indices of THIS row's samples (of ``step``, or all), ascending."""
        mbs = self.plan.micro_batches[self.row]
        return sorted(i for j in self.step_range(step) for i in mbs[j])

    def max_seq_length(self, step: Optional[int] = None) -> int:
        """Longest packed micro-batch of this row in ``step`` as Megatron's ``seq_length`` counts it
        (:meth:`~..core.planner.plan_kind.PlanKind.seq_length`); with ``uniform_length`` the longest of the row."""
        return self.plan.seq_length(self.row, self.step_range(None if self.uniform_length else step))


def _check_world_dp(world_dp: int, plan_dp: int) -> None:
    if world_dp != plan_dp:
        local = (" -- a local-mode plan (plan_local_batch) holds only this rank's samples, and a loss "
                 "normalised over them alone would not give plain batching's gradient" if plan_dp == 1 else "")
        raise DynBatchConfigError("plan.parallel.dp", plan_dp,
                                  f"the plan is for dp={plan_dp} but Megatron's data-parallel size is "
                                  f"{world_dp}{local}",
                                  "plan the global batch with parallel=parallel_from_args(args) / the running "
                                  "layout (local mode is for trainers that pack themselves, e.g. the verl "
                                  "drop-in)")
