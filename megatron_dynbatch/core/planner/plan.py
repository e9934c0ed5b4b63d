"""The ``Plan``: which samples each DP rank runs in which micro-batch, and what that is predicted to cost.

A plan of a fixed layout: one row of micro-batches per data-parallel rank, each micro-batch run on the layout's
``cp`` GPUs. The fields and the views it shares with the dynamic-CP plan are :class:`~.plan_kind.PlanKind`'s; this
module says what the members that differ mean for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..alignment import Alignment
from .plan_kind import PlanKind


@dataclass
class Plan(PlanKind, kind="plain"):
    """A dynamic-batching plan for one global batch.

    ``micro_batches[r][j]`` lists the sample indices (into the planner's ``lengths``) of rank ``r``'s ``j``-th
    micro-batch, in execution order. Every rank has ``num_microbatches`` micro-batches, none is empty, and
    every sample appears exactly once. When the batch was split into optimizer steps, the first
    ``microbatches_per_step[0]`` micro-batches of every rank form step 0, and so on. ``cap`` and
    ``microbatch_tokens`` count a whole micro-batch (over its ``cp`` GPUs).
    """

    # ------------------------------------------------------------------ PlanKind members
    @property
    def dp(self) -> int:
        return len(self.micro_batches)

    @property
    def num_rows(self) -> int:
        return len(self.micro_batches)

    @property
    def num_samples(self) -> int:
        return sum(len(mb) for rank in self.micro_batches for mb in rank)

    @property
    def cap_violations(self) -> int:
        """Micro-batches over the budget (only possible for samples placed alone with ``oversize='alone'``)."""
        return sum(1 for rank in self.microbatch_tokens for t in rank if t > self.cap)

    @property
    def gpus_per_entry(self) -> int:
        return int(self.parallel.cp)

    @property
    def max_tokens_per_gpu(self) -> int:
        return int(self.cap) // int(self.parallel.cp)

    def row_of(self, dp_rank: int, cp_rank: int) -> int:
        return int(dp_rank)

    def cp_group(self, row: int, j: int) -> Tuple[int, int]:
        cp = int(self.parallel.cp)
        return int(row) * cp, cp

    def group_sizes(self) -> Dict[int, int]:
        return {int(self.parallel.cp): sum(len(rank) for rank in self.micro_batches)}

    def microbatch_alignment(self, row: int, j: int) -> Alignment:
        return self.alignment

    # ------------------------------------------------------------------ serialisation
    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "PlanKind":
        """A plain plan; a dict of another kind (``"kind": "dynamic_cp"``) gives that kind's plan."""
        kind = d.get("kind")
        if kind is not None and kind != cls.kind:
            return PlanKind.from_dict(d)
        return cls(**PlanKind.shared_fields_of(d))

    def validate(self, num_samples: Optional[int] = None) -> None:
        """Assert the structural invariants (used by tests and by the iterator before running a plan)."""
        m = self.num_microbatches
        seen = []
        for r, rank in enumerate(self.micro_batches):
            if len(rank) != m:
                raise AssertionError(f"rank {r} has {len(rank)} micro-batches, rank 0 has {m}")
            for j, mb in enumerate(rank):
                if not mb:
                    raise AssertionError(f"rank {r} micro-batch {j} is empty")
                seen.extend(mb)
        if sum(self.microbatches_per_step) != m:
            raise AssertionError(f"microbatches_per_step {self.microbatches_per_step} does not sum to {m}")
        if len(seen) != len(set(seen)):
            raise AssertionError("a sample is placed twice")
        if num_samples is not None and sorted(seen) != list(range(num_samples)):
            raise AssertionError(f"plan places {len(set(seen))} of {num_samples} samples")
