"""``DynamicCPPlan``: a plan (:class:`~..plan_kind.PlanKind`) whose rows are the GPUs of the dynamic-CP pool.

A sibling of :class:`~..plan.Plan`, not a subclass: every shared statistic keeps its meaning with one
substitution -- a row is a pool GPU (``dp_rank * cp + cp_rank`` of one pipeline stage; ``pool_size`` of them),
not a DP replica; ``dp`` stays the data-parallel ranks (``parallel.dp``):

* ``micro_batches[i][j]``: the samples GPU ``i`` works on in slot ``j`` (execution order). A sample on a group
  of ``g`` GPUs is listed on each of them -- each holds its zig-zag share;
* ``groups[i][j] = (start, size)``: the CP group (a :class:`~.pool.PoolTree` node) GPU ``i`` belongs to in
  slot ``j``; every member lists the same group and the same samples;
* ``cap`` is the per-GPU budget ``max_tokens_per_gpu`` and ``microbatch_tokens[i][j]`` the tokens GPU ``i``
  holds (the group's packed length over its size), so ``cap_violations`` still counts over-budget GPUs;
* ``rank_time`` comes from the synchronised pool simulation (:mod:`.pool_sim`) with the CP communication
  term, ``rank_tokens``/``rank_flops`` are per-GPU shares, ``padding_tokens`` and ``real_tokens`` are totals.

``validate`` checks the pool invariants: equal slot counts, each slot's groups tile the pool with tree
nodes, members agree, no group is empty, and every sample sits in exactly one (slot, group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from ...alignment import Alignment
from ..plan_kind import PlanKind
from .pool import group_alignment, pool_tree

#: a CP group of the pool: ``(first GPU, size)``
Group = Tuple[int, int]
#: one slot's groups in pool order, each ``(start, size, sample indices)`` (``DynamicCPPlan.slot_groups``)
Slot = List[Tuple[int, int, List[int]]]
#: the slots of a plan (or of one optimizer step) in execution order
SlotList = List[Slot]


@dataclass
class DynamicCPPlan(PlanKind, kind="dynamic_cp"):
    """A dynamic context-parallel plan (module docstring); build it with ``plan_global_batch(...,
    dynamic_cp=True)``."""

    groups: List[List[Group]] = field(default_factory=list)
    #: the per-GPU budget (``cap``: a dynamic-CP plan counts tokens per GPU)
    max_tokens_per_gpu: int = 0
    fp8_tile: int = 1
    #: the modelled step time of the fixed-CP plan of the same layout (NaN if it could not be planned)
    fixed_cp_step_time: float = float("nan")
    #: which candidate won each optimizer step, comma-separated: "fixed-cp", "tree-<threshold>",
    #: "cp<cp>-tree-<threshold>" or "all-root" (see candidates.py)
    candidate: str = ""

    dynamic_cp: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.max_tokens_per_gpu:  # a plan of this kind counts per GPU: its cap is that budget
            self.max_tokens_per_gpu = int(self.cap)

    # ------------------------------------------------------------------ PlanKind members
    @property
    def pool_size(self) -> int:
        """GPUs of the pool (``dp * cp``): the rows of ``micro_batches``."""
        return len(self.micro_batches)

    @property
    def dp(self) -> int:
        return int(self.parallel.dp)

    @property
    def num_rows(self) -> int:
        return self.pool_size

    @property
    def num_samples(self) -> int:
        return len({i for rank in self.micro_batches for mb in rank for i in mb})

    @property
    def gpus_per_entry(self) -> int:
        return 1

    def row_of(self, dp_rank: int, cp_rank: int) -> int:
        return int(dp_rank) * int(self.parallel.cp) + int(cp_rank)

    def cp_group(self, row: int, j: int) -> Group:
        start, size = self.groups[row][j]
        return int(start), int(size)

    def microbatch_alignment(self, row: int, j: int) -> Alignment:
        return self.alignment_for(self.group_size(row, j))

    def alignment_for(self, group_size: int) -> Alignment:
        """Padding rules of a micro-batch on a group of ``group_size`` GPUs (``2 * group_size`` per sequence)."""
        return group_alignment(self.parallel, group_size, self.fp8_tile)

    def slot_groups(self, slot: int) -> Slot:
        """Slot ``slot``'s groups in pool order: ``(start, size, samples)`` (lockstep plans: every GPU runs the
        slot)."""
        out = []
        i = 0
        while i < self.pool_size:
            start, size = self.groups[i][slot]
            out.append((start, size, list(self.micro_batches[i][slot])))
            i = start + size
        return out

    def group_sizes(self) -> Dict[int, int]:
        """How many (slot, group) micro-batches use each group size. Each group is counted once, at its first
        GPU, so this also holds for plans whose GPUs run different slot counts (baselines such as
        ``bench/hybrid_cp.py``; the planner's own plans are lockstep)."""
        out: Dict[int, int] = {}
        for i, slots in enumerate(self.groups):
            for start, size in slots:
                if start == i:
                    out[size] = out.get(size, 0) + 1
        return dict(sorted(out.items()))

    @property
    def cap_violations(self) -> int:
        """Micro-batches over the budget (a sample over it even on the whole pool, placed alone there under
        ``oversize='alone'``), each (slot, group) counted once -- at its first GPU, as :meth:`group_sizes` counts --
        not once per GPU of its group."""
        return sum(1 for i, (slots, tokens) in enumerate(zip(self.groups, self.microbatch_tokens, strict=True))
                   for (start, _), t in zip(slots, tokens, strict=True) if start == i and t > self.cap)

    @property
    def speedup_vs_fixed_cp(self) -> float:
        """Modelled fixed-CP step time / this plan's (>= 1 by construction; NaN without a fixed-CP plan)."""
        t = self.predicted_step_time
        return self.fixed_cp_step_time / t if t > 0 else float("nan")

    def summary(self) -> Dict[str, Any]:
        d = super().summary()
        d.update(dynamic_cp=True, pool_size=self.pool_size, group_sizes=self.group_sizes(),
                 fixed_cp_step_time_s=self.fixed_cp_step_time, speedup_vs_fixed_cp=self.speedup_vs_fixed_cp,
                 candidate=self.candidate)
        return d

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> Dict[str, Any]:
        d = super().to_dict()
        d.update(kind="dynamic_cp", groups=[[list(g) for g in rank] for rank in self.groups],
                 max_tokens_per_gpu=self.max_tokens_per_gpu, fp8_tile=self.fp8_tile,
                 fixed_cp_step_time=self.fixed_cp_step_time, candidate=self.candidate)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DynamicCPPlan":
        kw = PlanKind.shared_fields_of(d)
        fixed = d.get("fixed_cp_step_time")
        return cls(**kw, groups=[[(int(g[0]), int(g[1])) for g in rank] for rank in d["groups"]],
                   max_tokens_per_gpu=int(d["max_tokens_per_gpu"]), fp8_tile=int(d.get("fp8_tile", 1)),
                   fixed_cp_step_time=float("nan") if fixed is None else float(fixed),
                   candidate=str(d.get("candidate", "")))

    # ------------------------------------------------------------------ invariants
    def validate(self, num_samples: Optional[int] = None) -> None:
        """Assert the pool invariants (module docstring); raises ``AssertionError`` naming the first problem."""
        par = self.parallel
        pool = par.dp * par.cp
        if self.pool_size != pool:
            raise AssertionError(f"the plan lists {self.pool_size} GPUs, the pool dp*cp has {pool}")
        if len(self.groups) != pool:
            raise AssertionError(f"groups lists {len(self.groups)} GPUs, the pool has {pool}")
        tree = pool_tree(par.dp, par.cp)
        m = self.num_microbatches
        if sum(self.microbatches_per_step) != m:
            raise AssertionError(f"microbatches_per_step {self.microbatches_per_step} does not sum to {m}")
        for i in range(pool):
            if len(self.micro_batches[i]) != m or len(self.groups[i]) != m:
                raise AssertionError(f"GPU {i} has {len(self.micro_batches[i])} slots, GPU 0 has {m}")
        seen: List[int] = []
        for j in range(m):
            i = 0
            while i < pool:
                start, size = self.groups[i][j]
                if start != i or not tree.has_block(start, size):
                    raise AssertionError(f"slot {j}: GPU {i} is in group {(start, size)}, not a pool-tree group "
                                         f"starting there")
                samples = list(self.micro_batches[i][j])
                if not samples:
                    raise AssertionError(f"slot {j}: group {(start, size)} is empty")
                for k in range(start, start + size):
                    if tuple(self.groups[k][j]) != (start, size) or list(self.micro_batches[k][j]) != samples:
                        raise AssertionError(f"slot {j}: GPU {k} disagrees with its group {(start, size)}")
                seen.extend(samples)
                i = start + size
        if len(seen) != len(set(seen)):
            raise AssertionError("a sample is placed in two (slot, group) micro-batches")
        if num_samples is not None and sorted(seen) != list(range(num_samples)):
            raise AssertionError(f"plan places {len(set(seen))} of {num_samples} samples")


__all__ = ["DynamicCPPlan", "Group", "Slot", "SlotList"]
