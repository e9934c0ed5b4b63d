"""The ``Plan``: which samples each DP rank runs in which micro-batch, and what that is predicted to cost."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from ..alignment import Alignment
from ..parallel import ParallelConfig


#: ``to_dict()["kind"]`` -> the :class:`Plan` subclass that reads it back (filled by ``__init_subclass__``)
_KINDS: Dict[str, type] = {}


@dataclass
class Plan:
    """A dynamic-batching plan for one global batch.

    ``micro_batches[r][j]`` lists the sample indices (into the planner's ``lengths``) of rank ``r``'s ``j``-th
    micro-batch, in execution order. Every rank has ``num_microbatches`` micro-batches, none is empty, and
    every sample appears exactly once. When the batch was split into optimizer steps, the first
    ``microbatches_per_step[0]`` micro-batches of every rank form step 0, and so on.
    """

    micro_batches: List[List[List[int]]]
    microbatches_per_step: List[int]
    parallel: ParallelConfig
    alignment: Alignment
    cap: int
    #: what the plan balanced: ``"time"``, ``"flops"`` or ``"tokens"`` (:class:`~.options.BalanceBy`)
    balance_by: str
    microbatch_tokens: List[List[int]]
    microbatch_time: List[List[float]]
    rank_tokens: np.ndarray
    rank_flops: np.ndarray
    rank_time: np.ndarray
    padding_tokens: int
    real_tokens: int
    lower_bound_microbatches: int
    lower_bound_step_time: float
    oversize_samples: List[int] = field(default_factory=list)
    planning_time_s: float = 0.0
    algorithm: str = "dynbatch"
    #: each optimizer step's slowest rank's predicted time (every rank waits for it at the step's gradient
    #: all-reduce); empty: one step, the slowest ``rank_time``
    step_time: List[float] = field(default_factory=list)
    #: ``max_tokens_per_gpu="auto"``: the memory model's :class:`~megatron_dynbatch.core.memory.BudgetChoice` (what
    #: limits the budget; :meth:`summary` says it in words); ``None`` for a budget given as a number
    budget_choice: Any = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ derived views
    @property
    def num_microbatches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0

    @property
    def dp(self) -> int:
        return len(self.micro_batches)

    @property
    def num_samples(self) -> int:
        return sum(len(mb) for rank in self.micro_batches for mb in rank)

    @property
    def predicted_step_time(self) -> float:
        """The slowest rank's predicted time: every rank waits for it at the gradient all-reduce. With several
        optimizer steps, the sum of each step's slowest rank (each step ends at its own all-reduce)."""
        if self.step_time:
            return float(sum(self.step_time))
        return float(self.rank_time.max()) if self.rank_time.size else 0.0

    @property
    def imbalance(self) -> float:
        """The predicted step time over the mean rank's time (max / mean of per-rank time with one optimizer
        step; 1.0 is perfect)."""
        mean = float(self.rank_time.mean()) if self.rank_time.size else 0.0
        return float(self.predicted_step_time / mean) if mean > 0 else 1.0

    @property
    def flops_imbalance(self) -> float:
        mean = float(self.rank_flops.mean()) if self.rank_flops.size else 0.0
        return float(self.rank_flops.max() / mean) if mean > 0 else 1.0

    @property
    def max_microbatch_tokens(self) -> int:
        return max((t for rank in self.microbatch_tokens for t in rank), default=0)

    @property
    def cap_violations(self) -> int:
        """Micro-batches over the budget (only possible for samples placed alone with ``oversize='alone'``)."""
        return sum(1 for rank in self.microbatch_tokens for t in rank if t > self.cap)

    @property
    def step_time_vs_lower_bound(self) -> float:
        lb = self.lower_bound_step_time
        return self.predicted_step_time / lb if lb > 0 else 1.0

    def rank_samples(self, rank: int) -> List[int]:
        """Rank ``rank``'s samples, flattened in execution order."""
        return [i for mb in self.micro_batches[rank] for i in mb]

    def step_microbatches(self, rank: int, step: int) -> List[List[int]]:
        """Rank ``rank``'s micro-batches of optimizer step ``step``."""
        start = sum(self.microbatches_per_step[:step])
        return self.micro_batches[rank][start:start + self.microbatches_per_step[step]]

    def summary(self) -> Dict[str, Any]:
        """Headline numbers, JSON-friendly."""
        return {
            "algorithm": self.algorithm,
            "dp": self.dp,
            "num_microbatches": self.num_microbatches,
            "microbatches_per_step": list(self.microbatches_per_step),
            "lower_bound_microbatches": self.lower_bound_microbatches,
            "cap": self.cap,
            "max_microbatch_tokens": self.max_microbatch_tokens,
            "cap_violations": self.cap_violations,
            "imbalance": self.imbalance,
            "flops_imbalance": self.flops_imbalance,
            "padding_tokens": self.padding_tokens,
            "real_tokens": self.real_tokens,
            "predicted_step_time_s": self.predicted_step_time,
            "lower_bound_step_time_s": self.lower_bound_step_time,
            "step_time_vs_lower_bound": self.step_time_vs_lower_bound,
            "oversize_samples": list(self.oversize_samples),
            "planning_time_s": self.planning_time_s,
            **({"budget": self.budget_words()} if self.budget_choice is not None else {}),
        }

    def budget_words(self) -> str:
        """``"auto, limited by ... on stage s (card, headroom, pass)"`` for an automatic budget, else ``"given"``."""
        if self.budget_choice is None:
            return "given"
        from ..memory.auto_fit import limit_words

        return limit_words(self.budget_choice)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> Dict[str, Any]:
        return {
            "micro_batches": self.micro_batches,
            "microbatches_per_step": list(self.microbatches_per_step),
            "parallel": self.parallel.to_dict(),
            "alignment": {"seq_multiple": self.alignment.seq_multiple,
                          "total_multiple": self.alignment.total_multiple},
            "cap": self.cap,
            "balance_by": self.balance_by,
            "microbatch_tokens": self.microbatch_tokens,
            "microbatch_time": self.microbatch_time,
            "rank_tokens": self.rank_tokens.tolist(),
            "rank_flops": self.rank_flops.tolist(),
            "rank_time": self.rank_time.tolist(),
            "step_time": list(self.step_time),
            "padding_tokens": self.padding_tokens,
            "real_tokens": self.real_tokens,
            "lower_bound_microbatches": self.lower_bound_microbatches,
            "lower_bound_step_time": self.lower_bound_step_time,
            "oversize_samples": list(self.oversize_samples),
            "planning_time_s": self.planning_time_s,
            "algorithm": self.algorithm,
            "summary": self.summary(),
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __init_subclass__(cls, kind: Optional[str] = None, **kwargs: Any) -> None:
        """A subclass declaring ``kind=...`` is what :meth:`from_dict` builds for a dict with that ``"kind"`` (so
        this module never imports its subclasses)."""
        super().__init_subclass__(**kwargs)
        if kind is not None:
            _KINDS[kind] = cls

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Plan":
        kind = d.get("kind")
        if kind is not None and cls is Plan and kind in _KINDS:  # a subclass's plan (e.g. dyncp/plan.py)
            return _KINDS[kind].from_dict(d)
        return cls(
            micro_batches=[[list(map(int, mb)) for mb in rank] for rank in d["micro_batches"]],
            microbatches_per_step=list(d["microbatches_per_step"]),
            parallel=ParallelConfig.from_any(d["parallel"]),
            alignment=Alignment(**d["alignment"]),
            cap=int(d["cap"]),
            balance_by=str(d["balance_by"]),
            microbatch_tokens=d["microbatch_tokens"],
            microbatch_time=d["microbatch_time"],
            rank_tokens=np.asarray(d["rank_tokens"]),
            rank_flops=np.asarray(d["rank_flops"], dtype=np.float64),
            rank_time=np.asarray(d["rank_time"], dtype=np.float64),
            padding_tokens=int(d["padding_tokens"]),
            real_tokens=int(d["real_tokens"]),
            lower_bound_microbatches=int(d["lower_bound_microbatches"]),
            lower_bound_step_time=float(d["lower_bound_step_time"]),
            oversize_samples=list(d.get("oversize_samples", [])),
            planning_time_s=float(d.get("planning_time_s", 0.0)),
            algorithm=d.get("algorithm", "dynbatch"),
            step_time=[float(t) for t in d.get("step_time", [])],
        )

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
