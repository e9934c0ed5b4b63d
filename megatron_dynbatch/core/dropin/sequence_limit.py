"""A cap on the number of sequences in one micro-batch, on top of :func:`plan_global_batch` -- pure Python.

Upstream's packers bound how many sequences a packed micro-batch may hold, because the THD metadata
(``cu_seqlens``) lives in fixed-size buffers: Megatron RL's ``--rl-sequence-packing-max-sequences-per-bin``
(default 50) and Megatron-Core's ``thd_max_packed_sequences`` (``max_num_seqs`` of the packing schedulers on
Megatron-LM ``dev``). The planner itself knows only the token cap, so :func:`plan_with_sequence_limit` plans
first and, when some micro-batch holds more than ``limit`` sequences, plans again with a forced, larger count
per rank: the next count the planner's count rule accepts that is at least ``ceil(most samples on a rank /
limit)`` (more micro-batches spread the same samples thinner; the packer fills the lightest micro-batch first,
so many short samples spread out). Every plan it returns keeps all of the planner's invariants (every sample
once, equal counts, the hard token cap, the VPP rule); the limit is checked, never assumed. When no count up to
the most samples on a rank meets the limit, it raises :class:`DynBatchConfigError` naming ``field``.

A few extra plans at most: the count rises by at least one each round and the first round already targets the
limit's lower bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..checks import as_int
from ..errors import DynBatchConfigError
from ..planner.options import PlanOptions

if TYPE_CHECKING:
    from ..planner.plan_kind import PlanKind

__all__ = ["max_sequences_per_microbatch", "plan_with_sequence_limit"]


def max_sequences_per_microbatch(plan: PlanKind) -> int:
    """The most samples any micro-batch of ``plan`` holds (0 for an empty plan)."""
    return max((len(mb) for rank in plan.micro_batches for mb in rank), default=0)


def plan_with_sequence_limit(lengths: Any, limit: Optional[int], options: Optional[PlanOptions] = None, *,
                             field: str = "max_sequences", **option_kwargs: Any) -> Any:
    """``plan_global_batch(lengths, options, **option_kwargs)`` whose micro-batches hold at most ``limit`` samples
    each (``None``: no limit). A door: the options (or keywords) become one ``PlanOptions`` and are resolved once,
    here; they must not force ``num_microbatches`` when a limit is given."""
    from ..planner.api import options_of, plan_resolved
    from ..planner.counts import CountRule

    opts = options_of(options, option_kwargs)
    resolved = opts.resolve()
    plan = plan_resolved(lengths, resolved)
    if limit is None:
        return plan
    limit = as_int(limit, field, minimum=1, fix="pass the most sequences one packed micro-batch may hold, or None")
    if max_sequences_per_microbatch(plan) <= limit:
        return plan
    if opts.num_microbatches is not None:
        raise DynBatchConfigError(field, limit, "cannot be met with a forced micro-batch count",
                                  "leave num_microbatches unset so the count can grow")
    rule = CountRule.build(opts.parallel, opts.min_num_microbatches, opts.num_microbatches_multiple)
    count = plan.num_microbatches
    while True:
        most = max(sum(len(mb) for mb in rank) for rank in plan.micro_batches)
        target = rule.next(max(count + 1, -(-most // limit)))
        try:  # the count rises every round; past a rank's sample count the planner refuses, ending the loop
            plan = plan_resolved(lengths, resolved.replace(num_microbatches=target))
        except DynBatchConfigError:
            break  # no rank can be split that far
        count = plan.num_microbatches
        if max_sequences_per_microbatch(plan) <= limit:
            return plan
    raise DynBatchConfigError(field, limit, f"the batch does not pack with at most {limit} sequences per micro-batch "
                              f"(the closest plan has {max_sequences_per_microbatch(plan)} in one)",
                              "raise the limit, or give the step fewer / longer samples")
