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

The options describe the whole job (the layout's ``dp`` is ignored here: a local plan has one rank); the
arguments are :func:`plan_global_batch`'s. Pure NumPy, no communication.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Union

from ..errors import DynBatchConfigError
from .api import options_of, plan_resolved
from .options import BATCH_ARGUMENTS, PlanOptions, ResolvedOptions
from .plan import Plan
from .prepare import prepare
from .search import first_feasible_count

__all__ = ["local_microbatch_counts", "plan_local_batch", "resolve_local", "local_counts", "plan_local"]


def resolve_local(options: PlanOptions) -> ResolvedOptions:
    """The job's options with the layout cut to this one rank, resolved (once per call: the doors below, and
    :func:`~megatron_dynbatch.megatron.local.plan_local_batch_across_dp` for both of its steps)."""
    return options.replace(parallel=dataclasses.replace(options.parallel, dp=1)).resolve()


def local_microbatch_counts(lengths, options: Optional[PlanOptions] = None, *, group_ids: Any = None,
                            microbatch_group_ids: Any = None, rollout_ids: Any = None,
                            **option_kwargs: Any) -> List[int]:
    """Per optimizer step, the fewest micro-batches this rank's samples pack into (see the module docstring).

    Takes :func:`plan_global_batch`'s arguments (``max_tokens_per_gpu``, ``model``, ``samples_per_step``,
    ``min_num_microbatches``, ...); ``num_microbatches`` is refused (the count is what this computes)."""
    return local_counts(lengths, resolve_local(options_of(options, option_kwargs)), group_ids=group_ids,
                        microbatch_group_ids=microbatch_group_ids, rollout_ids=rollout_ids)


def local_counts(lengths, options: ResolvedOptions, *, group_ids: Any = None, microbatch_group_ids: Any = None,
                 rollout_ids: Any = None) -> List[int]:
    """:func:`local_microbatch_counts` below its door (``options``: :func:`resolve_local`'s)."""
    if options.options.num_microbatches is not None:
        raise DynBatchConfigError("num_microbatches", options.options.num_microbatches,
                                  "local_microbatch_counts computes the count", "leave num_microbatches out")
    prep = prepare(lengths, options, group_ids=group_ids, microbatch_group_ids=microbatch_group_ids,
                   rollout_ids=rollout_ids)
    settings = prep.search_settings()
    return [first_feasible_count(step.inp, step.sq, settings) for step in prep.steps]


def plan_local_batch(lengths, options: Optional[PlanOptions] = None, *,
                     num_microbatches: Union[int, Sequence[int]] = None, **kwargs: Any) -> Plan:
    """This rank's plan (``plan.dp == 1``) with the agreed count(s): one int for every step, or one per step
    (the element-wise maximum of every rank's :func:`local_microbatch_counts`); otherwise
    :func:`plan_global_batch`'s arguments."""
    _check_agreed(num_microbatches)
    batch = {k: kwargs.pop(k) for k in BATCH_ARGUMENTS if k in kwargs}
    return plan_local(lengths, resolve_local(options_of(options, kwargs)), num_microbatches, **batch)


def plan_local(lengths, options: ResolvedOptions, num_microbatches: Union[int, Sequence[int], None],
               **batch: Any) -> Plan:
    """:func:`plan_local_batch` below its door (``options``: :func:`resolve_local`'s; ``batch``: the per-sample
    ids)."""
    _check_agreed(num_microbatches)
    return plan_resolved(lengths, options.replace(num_microbatches=num_microbatches), **batch)


def _check_agreed(num_microbatches: Any) -> None:
    if num_microbatches is None:
        raise DynBatchConfigError("num_microbatches", None, "local mode needs the count the ranks agreed on",
                                  "pass the maximum over DP ranks of local_microbatch_counts(...)")
