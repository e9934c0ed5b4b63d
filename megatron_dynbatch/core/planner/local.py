"""Local mode: every DP rank plans only its own samples, and the ranks agree on the micro-batch count with ONE
collective (verl's ``rearrange_micro_batches`` with ``same_micro_num_in_dp``: each rank's data is already
dispatched, nobody holds the global batch).

1. Each rank calls :func:`local_microbatch_counts` on its samples: per optimizer step, the first count (valid
   under the VPP rule, ``min_num_microbatches`` and ``num_microbatches_multiple``) into which they pack under
   the hard cap.
2. The ranks take the element-wise MAXIMUM (one all-reduce; the torch helper is
   :func:`megatron_dynbatch.megatron.local.plan_local_batch_across_dp`).
3. Each rank calls :func:`plan_local_batch` with the agreed counts.

Why the maximum always works: splitting a micro-batch in two never breaks the cap, so a rank whose samples pack
into ``m`` micro-batches also packs into any ``M >= m`` (as long as it has ``M`` samples; else the clear
"too few samples" error). The agreed count is one of the ranks' valid counts, so it satisfies the count rule.
What local mode cannot do is balance *across* ranks: that needs the global batch (plan it with
:func:`~megatron_dynbatch.core.planner.api.plan_global_batch`, or balance before dispatch as verl's
``balance_batch`` does -- :mod:`megatron_dynbatch.integrations.verl`).

The ``parallel`` argument describes the whole job (its ``dp`` is ignored here: a local plan has one rank);
every other argument is :func:`plan_global_batch`'s. Pure NumPy, no communication.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Sequence, Union

from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig
from .api import plan_global_batch
from .plan import Plan
from .prepare import prepare
from .search import first_feasible_count

__all__ = ["local_microbatch_counts", "plan_local_batch"]


def _one_rank(parallel: Any) -> ParallelConfig:
    return dataclasses.replace(ParallelConfig.from_any(parallel), dp=1)


def local_microbatch_counts(lengths, *, parallel: Any = None, **planner_kwargs: Any) -> List[int]:
    """Per optimizer step, the fewest micro-batches this rank's samples pack into (see the module docstring).

    Takes :func:`plan_global_batch`'s arguments (``max_tokens_per_gpu``, ``model``, ``samples_per_step``,
    ``min_num_microbatches``, ...); ``num_microbatches`` is refused (the count is what this computes)."""
    if planner_kwargs.get("num_microbatches") is not None:
        raise DynBatchConfigError("num_microbatches", planner_kwargs["num_microbatches"],
                                  "local_microbatch_counts computes the count", "leave num_microbatches out")
    prep = prepare(lengths, parallel=_one_rank(parallel), **planner_kwargs)
    return [first_feasible_count(step.inp, prep.par, prep.cm, step.sq, prep.rounds, prep.align, prep.budget,
                                 prep.rule) for step in prep.steps]


def plan_local_batch(lengths, *, num_microbatches: Union[int, Sequence[int]], parallel: Any = None,
                     **planner_kwargs: Any) -> Plan:
    """This rank's plan (``plan.dp == 1``) with the agreed count(s): one int for every step, or one per step
    (the element-wise maximum of every rank's :func:`local_microbatch_counts`)."""
    if num_microbatches is None:
        raise DynBatchConfigError("num_microbatches", None, "local mode needs the count the ranks agreed on",
                                  "pass the maximum over DP ranks of local_microbatch_counts(...)")
    return plan_global_batch(lengths, parallel=_one_rank(parallel), num_microbatches=num_microbatches,
                             **planner_kwargs)
