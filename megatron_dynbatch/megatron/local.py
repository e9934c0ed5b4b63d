"""Local mode across DP ranks: each rank plans its own samples, the ranks agree on the micro-batch count with
ONE all-reduce (MAX) -- the torch.distributed half of :mod:`megatron_dynbatch.core.planner.local`.

::

    from megatron_dynbatch.megatron.local import plan_local_batch_across_dp

    plan = plan_local_batch_across_dp(my_lengths, group=dp_group, max_tokens_per_gpu=16384, model="qwen3-8b",
                                      parallel={"dp": 8, "pp": 2})
    # plan.dp == 1: this rank's micro-batches; plan.microbatches_per_step is the same on every rank

Every rank of ``group`` must call it (it is a collective) with the same number of optimizer steps. The count
vector travels on the CPU for gloo and on the current CUDA device for NCCL.
"""

from __future__ import annotations

from typing import Any, List, Sequence

__all__ = ["all_reduce_max", "plan_local_batch_across_dp"]


def all_reduce_max(values: Sequence[int], group: Any = None) -> List[int]:
    """The element-wise maximum of ``values`` over the ranks of ``group`` (one ``all_reduce``); ``values``
    unchanged when torch.distributed is not initialised (a single process)."""
    import torch
    import torch.distributed as dist

    vals = [int(v) for v in values]
    if not (dist.is_available() and dist.is_initialized()):
        return vals
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)).lower():
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(vals, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.cpu().tolist()]


def plan_local_batch_across_dp(lengths: Sequence[int], options: Any = None, *, group: Any = None, **kwargs: Any):
    """This rank's :class:`~megatron_dynbatch.Plan` in local mode: its own first counts
    (:func:`~megatron_dynbatch.local_microbatch_counts`), the MAX over ``group``, then
    :func:`~megatron_dynbatch.plan_local_batch` with the agreed counts (see the module docstring). ``options`` /
    ``kwargs``: :func:`~megatron_dynbatch.plan_global_batch`'s."""
    from ..core.errors import DynBatchConfigError
    from ..core.planner.api import options_of
    from ..core.planner.local import local_counts, plan_local, resolve_local
    from ..core.planner.options import BATCH_ARGUMENTS

    batch = {k: kwargs.pop(k) for k in BATCH_ARGUMENTS if k in kwargs}
    opts = options_of(options, kwargs)  # the door: keywords -> options, resolved once for both steps below
    resolved = resolve_local(opts)

    # A rank that cannot plan still joins the collective (a flag in front of the counts), so the others raise
    # instead of hanging. With one optimizer step the vector's length is known to all; with several, every
    # rank must have the same number of steps.
    single = opts.samples_per_step is None and opts.rollouts_per_step is None
    try:
        counts, failure = local_counts(lengths, resolved, **batch), None
    except DynBatchConfigError as exc:
        if not single:
            raise
        counts, failure = [0], exc
    agreed = all_reduce_max([1 if failure is not None else 0] + list(counts), group)
    if failure is not None:
        raise failure
    if agreed[0]:
        raise DynBatchConfigError("lengths", "another DP rank's samples",
                                  "a DP rank could not plan its samples, so no count was agreed",
                                  "see that rank's error (its samples or the budget)")
    return plan_local(lengths, resolved, agreed[1:], **batch)
