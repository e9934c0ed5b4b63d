"""``PlanKind``: what every kind of plan offers the code that runs, reports and ships it.

Two kinds implement it: :class:`~.plan.Plan` (a fixed layout: one row of micro-batches per data-parallel rank,
each run on the layout's ``cp`` GPUs) and :class:`~.dyncp.plan.DynamicCPPlan` (dynamic context parallelism: one
row per GPU of the ``dp x cp`` pool, each micro-batch on a CP group of its own). Neither is a subclass of the
other and neither redefines a field it shares: the shared fields are declared here once and mean the same thing
in both kinds, the members that differ are abstract here and each kind says what they are.

Shared vocabulary (both kinds):

* a **row** is one list of ``micro_batches`` (``micro_batches[row][j]``, execution order): a DP rank of a plain
  plan, a pool GPU (``dp_rank * cp + cp_rank``) of a dynamic-CP plan; ``num_rows`` counts them and
  :meth:`PlanKind.row_of` maps a (DP rank, CP rank) to its row;
* ``dp`` is always the data-parallel ranks (``parallel.dp`` of a dynamic-CP plan; the rows of a plain plan,
  which equal ``parallel.dp`` except in hand-made and local plans);
* ``cap`` is the budget in the unit of ``microbatch_tokens``: tokens of a whole micro-batch over its ``cp`` GPUs in
  a plain plan, tokens per GPU in a dynamic-CP plan; ``gpus_per_entry`` says which (so a per-GPU figure is
  ``microbatch_tokens[row][j] / gpus_per_entry``) and ``max_tokens_per_gpu`` is the per-GPU budget in both;
* :meth:`PlanKind.cp_group` is the CP group a micro-batch runs on, as ``(first GPU, size)`` in pool numbering
  (a plain plan's: its DP rank's ``cp`` GPUs -- size 1 without CP --; a dynamic-CP plan's: the micro-batch's own
  group), so a GPU's rank in it is ``dp_rank * cp + cp_rank - first``; :meth:`PlanKind.group_sizes` counts
  micro-batches per group size.

``dynamic_cp`` (a class constant) is left for the few places where the running code itself differs (which process
group a micro-batch uses, which Megatron settings a dynamic-CP run refuses); everything a consumer can ask as a
question of the plan is a member below. ``to_dict`` / ``PlanKind.from_dict`` round-trip every kind (a plain plan's
dict has no ``"kind"``; a dynamic-CP plan's says ``"kind": "dynamic_cp"``).
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..alignment import Alignment
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig
from .options import BalanceBy

if TYPE_CHECKING:
    from ..memory.budget import BudgetChoice

#: ``to_dict()["kind"]`` -> the :class:`PlanKind` that reads it back (filled by ``__init_subclass__``, so this
#: module never imports the kinds)
_KINDS: Dict[str, type] = {}


@dataclass
class PlanKind(abc.ABC):
    """The fields every plan has and the members every consumer may use (module docstring)."""

    micro_batches: List[List[List[int]]]
    microbatches_per_step: List[int]
    parallel: ParallelConfig
    alignment: Alignment
    #: the budget of one ``microbatch_tokens`` entry (module docstring)
    cap: int
    #: what the plan balanced: a :class:`~.options.BalanceBy` (a ``str`` enum: ``plan.balance_by == "time"`` holds;
    #: a plain string given here is parsed, and :meth:`to_dict` writes the plain value)
    balance_by: BalanceBy
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
    #: each optimizer step's slowest row's predicted time (every row waits for it at the step's gradient
    #: all-reduce); empty: one step, the slowest ``rank_time``
    step_time: List[float] = field(default_factory=list)
    #: ``max_tokens_per_gpu="auto"``: the memory model's :class:`~megatron_dynbatch.core.memory.BudgetChoice` (what
    #: limits the budget; :meth:`summary` says it in words); ``None`` for a budget given as a number
    budget_choice: Optional[BudgetChoice] = field(default=None, repr=False, compare=False)

    #: the ``"kind"`` of :meth:`to_dict` (``None``: a plain plan, whose dict carries no kind)
    kind: ClassVar[Optional[str]] = None
    #: whether running a micro-batch needs a CP group of its own (module docstring)
    dynamic_cp: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.balance_by = BalanceBy.parse(self.balance_by)  # one type whoever built the plan ("time" or the member)

    def __init_subclass__(cls, kind: Optional[str] = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            cls.kind = kind
            _KINDS[kind] = cls

    # ------------------------------------------------------------------ what each kind says
    @property
    @abc.abstractmethod
    def dp(self) -> int:
        """Data-parallel ranks."""

    @property
    @abc.abstractmethod
    def num_rows(self) -> int:
        """Rows of ``micro_batches`` (DP ranks, or pool GPUs)."""

    @property
    @abc.abstractmethod
    def num_samples(self) -> int:
        """Distinct samples the plan places."""

    @property
    @abc.abstractmethod
    def cap_violations(self) -> int:
        """Micro-batches over the budget (only samples placed alone under ``oversize='alone'``), each counted once."""

    @property
    @abc.abstractmethod
    def gpus_per_entry(self) -> int:
        """GPUs one ``microbatch_tokens`` entry is spread over (``cp`` for a plain plan, 1 for a per-GPU one)."""

    @property
    @abc.abstractmethod
    def max_tokens_per_gpu(self) -> int:
        """The per-GPU budget the plan was made with."""

    @abc.abstractmethod
    def row_of(self, dp_rank: int, cp_rank: int) -> int:
        """The row the GPU of data-parallel rank ``dp_rank`` and context-parallel rank ``cp_rank`` runs."""

    @abc.abstractmethod
    def cp_group(self, row: int, j: int) -> Tuple[int, int]:
        """``(first GPU, size)`` of the CP group micro-batch ``j`` of ``row`` runs on, GPUs numbered as in the
        dynamic-CP pool (``dp_rank * cp + cp_rank``): a plain plan's is its DP rank's ``cp`` GPUs."""

    def group_size(self, row: int, j: int) -> int:
        """GPUs of the CP group micro-batch ``j`` of ``row`` runs on."""
        return int(self.cp_group(row, j)[1])

    @abc.abstractmethod
    def group_sizes(self) -> Dict[int, int]:
        """How many micro-batches ran on CP groups of each size (each counted once, not once per GPU)."""

    @abc.abstractmethod
    def microbatch_alignment(self, row: int, j: int) -> Alignment:
        """The padding rules micro-batch ``j`` of ``row`` is packed with."""

    @abc.abstractmethod
    def validate(self, num_samples: Optional[int] = None) -> None:
        """Assert the structural invariants; raises ``AssertionError`` naming the first problem."""

    # ------------------------------------------------------------------ shared derived views
    def packed_tokens(self, row: int, j: int, lengths: Sequence[int]) -> int:
        """What ``microbatch_tokens[row][j]`` must be when the micro-batch's samples have ``lengths``: its packed
        length (with :meth:`microbatch_alignment`'s padding) over the GPUs of its group one entry does not span."""
        align = self.microbatch_alignment(row, j)
        total = align.padded_total(int(align.seq_len(np.asarray(lengths, dtype=np.int64)).sum()))
        return total // (self.group_size(row, j) // self.gpus_per_entry)

    def seq_length(self, row: int, js: Sequence[int]) -> int:
        """The longest of ``row``'s micro-batches ``js`` as Megatron's ``seq_length`` counts it: full length over the
        layout's ``cp`` GPUs (Megatron divides it by its CP size)."""
        longest = max(self.microbatch_tokens[row][j] for j in js)
        return longest * self.parallel.cp // self.gpus_per_entry

    @property
    def num_microbatches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0

    @property
    def predicted_step_time(self) -> float:
        """The slowest row's predicted time: every row waits for it at the gradient all-reduce. With several
        optimizer steps, the sum of each step's slowest row (each step ends at its own all-reduce)."""
        if self.step_time:
            return float(sum(self.step_time))
        return float(self.rank_time.max()) if self.rank_time.size else 0.0

    @property
    def imbalance(self) -> float:
        """The predicted step time over the mean row's time (max / mean of per-row time with one optimizer
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
    def step_time_vs_lower_bound(self) -> float:
        lb = self.lower_bound_step_time
        return self.predicted_step_time / lb if lb > 0 else 1.0

    def rank_samples(self, rank: int) -> List[int]:
        """Row ``rank``'s samples, flattened in execution order."""
        return [i for mb in self.micro_batches[rank] for i in mb]

    def step_microbatches(self, rank: int, step: int) -> List[List[int]]:
        """Row ``rank``'s micro-batches of optimizer step ``step``."""
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
        """Every field, JSON-friendly (plus ``"summary"``); :meth:`from_dict` reads it back."""
        return {
            "micro_batches": self.micro_batches,
            "microbatches_per_step": list(self.microbatches_per_step),
            "parallel": self.parallel.to_dict(),
            "alignment": {"seq_multiple": self.alignment.seq_multiple,
                          "total_multiple": self.alignment.total_multiple},
            "cap": self.cap,
            "balance_by": self.balance_by.value,
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

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @staticmethod
    def shared_fields_of(d: Dict[str, Any]) -> Dict[str, Any]:
        """The shared fields of a :meth:`to_dict` dict, typed (what each kind's ``from_dict`` starts from)."""
        return dict(
            micro_batches=[[list(map(int, mb)) for mb in rank] for rank in d["micro_batches"]],
            microbatches_per_step=list(d["microbatches_per_step"]),
            parallel=ParallelConfig.from_any(d["parallel"]),
            alignment=Alignment(**d["alignment"]),
            cap=int(d["cap"]),
            balance_by=BalanceBy.parse(d["balance_by"]),
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

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "PlanKind":
        """The plan of a :meth:`to_dict` dict, of the kind its ``"kind"`` names (none: a plain plan)."""
        kind = d.get("kind")
        target = _KINDS.get(kind) if kind is not None else _KINDS.get("plain")
        if target is None:
            raise DynBatchConfigError("plan['kind']", kind, "is not a plan kind",
                                      f"use one of {sorted(_KINDS)} (a plain plan's dict has no kind)")
        return target.from_dict(d)


__all__ = ["PlanKind"]
