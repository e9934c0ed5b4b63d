"""Megatron-Core's sequence-packing schedulers (``megatron/core/datasets/data_schedule.py``) on this planner --
the pure half; :mod:`megatron_dynbatch.integrations.megatron_packing` puts it behind upstream's scheduler class.

Contract kept (Megatron-LM ``main`` and ``dev``, read Aug 2026). ``wrap_data_iterator`` gathers every DP rank's
sub-samples as ``(global_id, padded_seq_len)`` pairs and asks the scheduler's ``get_groups_and_subsamples`` for
``groups[i][j]``: the ids micro-batch ``i`` runs on DP x CP index ``j``. Upstream's ``DpBalancedScheduler`` and
this planner both promise:

* every id exactly once (upstream asserts it);
* a micro-batch holds at most ``max_seqlen_per_dp_cp_rank * cp`` tokens of the lengths it was given (those are
  already padded per sequence by the dataset; this planner adds CP's ``2*cp`` rounding on top, never less);
* the ``cp`` consecutive indices ``d*cp .. d*cp+cp-1`` of DP rank ``d`` list the same ids: CP peers share a pack;
* the same count on every rank, a multiple of ``microbatch_group_size_per_vp_stage`` when upstream passes one
  (it does under VPP: upstream rounds its pack count to a multiple of ``dp * N``);
* at most ``max_num_seqs`` ids in one micro-batch when given (``dev``: ``thd_max_packed_sequences``).

What changes: upstream fills micro-batches next-fit in loader order and deals them round-robin, by tokens only;
an over-budget sample gets a micro-batch of its own, over the budget. Here the whole global batch is planned at
once: the count is chosen by the cost model, ranks and micro-batches are balanced by modelled time (FLOPs of the
model when it is known, tokens otherwise), and a sample over the budget is refused with the fix (or placed alone
with ``oversize="alone"``, the explicit policy). The sums upstream returns for FLOPs accounting
(``sum(seqlen)``, ``sum(seqlen**2)``) do not depend on the grouping and stay upstream's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

from ..checks import as_int, is_int, whole_number
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig, ParallelLike
from ..planner.api import options_of
from .sequence_limit import plan_with_sequence_limit

if TYPE_CHECKING:
    from ..planner.options import PlanOptions
    from ..planner.plan_kind import PlanKind

__all__ = ["plan_sample_id_groups", "sample_id_groups_from_plan", "split_sample_id_seqlens"]


def sample_id_groups_from_plan(plan: PlanKind, sample_ids: Sequence[int], cp_size: int) -> List[List[List[int]]]:
    """Upstream's grouping format from a :class:`~megatron_dynbatch.Plan`: ``groups[i][j]`` lists the sample
    ids of micro-batch ``i`` on DP x CP index ``j``; the ``cp_size`` consecutive indices of DP rank ``d``
    (``j // cp_size == d``) share DP rank ``d``'s micro-batch, as in upstream's ``DpBalancedScheduler``.
    ``sample_ids[k]`` is the id of the plan's sample ``k``."""
    if not is_int(cp_size) or cp_size < 1:
        raise DynBatchConfigError("cp_size", cp_size, "must be an integer >= 1", "pass the context-parallel size")
    dp = len(plan.micro_batches)
    count = plan.num_microbatches
    return [[[int(sample_ids[k]) for k in plan.micro_batches[j // cp_size][i]] for j in range(dp * cp_size)]
            for i in range(count)]


def split_sample_id_seqlens(sample_id_seqlens: Any) -> Tuple[List[int], List[int]]:
    """``(ids, lengths)`` of upstream's ``[(global_id, seqlen), ...]`` (ints, NumPy scalars or 0-d tensors);
    a malformed entry raises :class:`DynBatchConfigError` naming it."""
    if (isinstance(sample_id_seqlens, (str, bytes)) or not hasattr(sample_id_seqlens, "__len__")
            or getattr(sample_id_seqlens, "ndim", None) == 0):
        raise DynBatchConfigError("sample_id_seqlens", type(sample_id_seqlens).__name__,
                                  "must be a list of (global_id, seqlen) pairs", "pass what upstream gathers")
    ids: List[int] = []
    lengths: List[int] = []
    for k, pair in enumerate(sample_id_seqlens):
        try:
            gid, seqlen = pair
            gid, seqlen = _as_index(gid), _as_index(seqlen)
        except (TypeError, ValueError):
            raise DynBatchConfigError(f"sample_id_seqlens[{k}]", repr(pair)[:60],
                                      "must be a (global_id, seqlen) pair of non-negative integers",
                                      "pass what upstream gathers (padded sequence lengths)") from None
        ids.append(gid)
        lengths.append(seqlen)
    if len(set(ids)) != len(ids):
        raise DynBatchConfigError("sample_id_seqlens", "repeated global ids", "every id must appear once",
                                  "pass each sub-sample once")
    return ids, lengths


def _as_index(value: Any) -> int:
    index = whole_number(value)  # ints, NumPy scalars, whole floats, 0-d arrays / tensors (core/checks.py)
    if index is None or index < 0:
        raise ValueError(value)
    return index


def plan_sample_id_groups(sample_id_seqlens: Any, options: Optional[PlanOptions] = None, *,
                          max_seqlen_per_dp_cp_rank: int, dp: int, cp: int,
                          microbatch_group_size_per_vp_stage: Optional[int] = None,
                          max_num_seqs: Optional[int] = None, parallel: ParallelLike = None,
                          **option_kwargs: Any) -> Tuple[List[List[List[int]]], Any]:
    """Plan upstream's scheduler input and return ``(groups, plan)`` in upstream's format.

    ``dp``, ``cp``, ``max_seqlen_per_dp_cp_rank`` and ``microbatch_group_size_per_vp_stage`` are the scheduler's
    constructor arguments and replace the options' layout and budget; ``parallel`` adds what the model config
    knows (``tp``, ``pp``, ``vpp``, ``sequence_parallel``; default: the options' layout); ``options`` /
    ``option_kwargs`` are :func:`plan_global_batch`'s (``model``, ``cost_model``, ``balance_by``, ``oversize``,
    ``fp8_alignment``, ...)."""
    ids, lengths = split_sample_id_seqlens(sample_id_seqlens)
    dp = as_int(dp, "dp_size", minimum=1, fix="pass the data-parallel size")
    cp = as_int(cp, "cp_size", minimum=1, fix="pass the context-parallel size")
    budget = as_int(max_seqlen_per_dp_cp_rank, "max_seqlen_per_dp_cp_rank", minimum=1,
                    fix="set --max-seqlen-per-dp-cp-rank to the tokens one GPU holds in a micro-batch")
    multiple = None
    if microbatch_group_size_per_vp_stage is not None:
        multiple = as_int(microbatch_group_size_per_vp_stage, "microbatch_group_size_per_vp_stage", minimum=1,
                          fix="pass Megatron's microbatch_group_size_per_vp_stage, or None without VPP")
    if len(lengths) < dp:
        raise DynBatchConfigError("sample_id_seqlens", f"{len(lengths)} sub-samples",
                                  f"cannot give each of the {dp} DP ranks a micro-batch",
                                  "raise the global batch size (at least one sample per DP rank)")
    if parallel is None and options is not None:
        parallel = options.parallel
    base = ParallelConfig.from_any(parallel).to_dict()
    base.update(dp=dp, cp=cp)
    if multiple is not None and base.get("vpp", 1) > 1:
        base["microbatch_group_size_per_vp_stage"] = multiple
    opts = options_of(options, {**option_kwargs, "parallel": ParallelConfig(**base), "max_tokens_per_gpu": budget,
                                "num_microbatches_multiple": multiple})
    plan = plan_with_sequence_limit(lengths, max_num_seqs, opts, field="max_num_seqs")
    return sample_id_groups_from_plan(plan, ids, cp), plan
