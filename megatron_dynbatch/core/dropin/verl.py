"""verl's batching (``verl/utils/seqlen_balancing.py`` and the trainer's ``_balance_batch``) on this planner --
the pure part; :mod:`megatron_dynbatch.integrations.verl` adds the TensorDict / DataProto / torch.distributed
glue.

Contracts kept (verl, read Aug 2026):

* ``get_seqlen_balanced_partitions(seqlen_list, k_partitions, equal_size)``: ``k`` non-empty partitions of
  ``range(n)``, each sorted, with balanced sums (Karmarkar-Karp); ``equal_size``: equal item counts.
  :func:`seqlen_balanced_partitions` is the same (no budget is involved, so verl's algorithm is sound as is).
* ``get_group_balanced_partitions(seqlen_list, uid_list, k_partitions)``: consecutive samples with the same uid
  stay in one partition, groups balanced by verl's workload, equal group counts per partition.
* ``rearrange_micro_batches``: per DP rank, the rank's micro-batches (index lists into its batch). verl takes
  ``min(n, ceil(tokens / max_token_len))`` micro-batches (raised to ``min_num_micro_batch``, all-reduced to the
  MAX over DP, rounded up to ``num_batches_divided_by``) and splits by its workload estimate without checking
  the budget again, so a micro-batch can exceed ``max_token_len`` (verl #6735, #7553). Here the count is the
  first one at which this rank's samples pack under the cap -- verl's per-sequence padding (``tp*cp*2``, or
  ``tp`` without CP) included -- with the same floor, multiple and MAX (:func:`local_count`), and the plan for
  the agreed count never breaks the cap (:func:`local_partitions`). ``force_group_size`` keeps consecutive
  groups in one micro-batch. Micro-batches are ordered for the pipeline by the cost model
  (``use_dynamic_bsz_balance``; verl puts small ones at both ends) or left in index order.
* ``_balance_batch``: reorder the batch so that dispatching equal chunks gives every DP rank the same number of
  samples (of every mini-batch with ``keep_minibatch``; keeping uid groups together with the prefix grouper),
  balanced. Here :func:`balance_partitions` balances the cost model's time under the budget (verl: its fixed
  ``24576*L + L**2``).

Without a model, balancing uses verl's own workload estimate ``24576*L + L**2`` (:func:`verl_cost_model`); pass
the trained model (``model=``) to balance its real FLOPs at kernel efficiency.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional, Sequence

import numpy as np

from ..alignment import Alignment
from ..checks import as_bool, as_int
from ..cost_model import CostModel
from ..errors import DynBatchConfigError, OversizeSampleWarning
from ..parallel import ParallelConfig
from ..partitioning import karmarkar_karp
from ..planner import local_microbatch_counts, plan_global_batch, plan_local_batch
from ..planner.inputs import check_group_ids, check_lengths

__all__ = ["VERL_WORKLOAD_LINEAR", "balance_partitions", "group_balanced_partitions", "local_count",
           "local_partitions", "seqlen_balanced_partitions", "verl_cost_model", "verl_sequence_pad_multiple",
           "verl_workload"]

#: verl's ``calculate_workload``: ``24576 * L + L**2`` (12 h^2 L + 2 h L^2 per layer with h = 4096, over 2 h)
VERL_WORKLOAD_LINEAR = 24576.0
#: FLOPs per unit of verl's workload for a 32-layer, h = 4096 model (2 h per layer): scales it to FLOPs so the
#: cost model's per-micro-batch overhead weighs as for a 7B model
_VERL_FLOPS_PER_UNIT = 2 * 4096 * 32


def verl_workload(lengths: Sequence[int]) -> np.ndarray:
    """verl's ``calculate_workload``."""
    lens = np.asarray(lengths, dtype=np.float64)
    return VERL_WORKLOAD_LINEAR * lens + lens ** 2


def verl_cost_model(parallel: Optional[ParallelConfig] = None) -> CostModel:
    """A cost model whose per-sample work is proportional to verl's workload estimate (used without a model)."""
    return CostModel.from_flops(VERL_WORKLOAD_LINEAR * _VERL_FLOPS_PER_UNIT, float(_VERL_FLOPS_PER_UNIT), parallel)


def _balance_kwargs(model: Any, cost_model: Optional[CostModel], par: ParallelConfig) -> dict:
    """What the drop-ins balance by: the model's time when it is given, else verl's own workload estimate
    (:func:`verl_cost_model`) as time -- so an import-only switch balances what verl balances."""
    if model is not None:
        return {"model": model, "cost_model": cost_model}
    return {"balance_by": "time", "cost_model": cost_model or verl_cost_model(par)}


def verl_sequence_pad_multiple(tp: int = 1, cp: int = 1) -> int:
    """What verl's Megatron engine pads each packed sequence to (``preprocess_packed_seqs``)."""
    return tp * cp * 2 if cp > 1 else tp


def seqlen_balanced_partitions(seqlen_list: Sequence[float], k_partitions: int, equal_size: bool) -> List[List[int]]:
    """verl's ``get_seqlen_balanced_partitions`` (Karmarkar-Karp): ``k`` sorted, non-empty partitions."""
    values = _values(seqlen_list)
    k = as_int(k_partitions, "k_partitions", minimum=1)
    if values.size < k:
        raise DynBatchConfigError("k_partitions", k, f"more partitions than items ({values.size})",
                                  "use at most as many partitions as items")
    equal = as_bool(equal_size, "equal_size")
    if equal and values.size % k:
        raise DynBatchConfigError("equal_size", True, f"{values.size} items do not split into {k} equal parts",
                                  f"pass a multiple of {k} items, or equal_size=False")
    return [sorted(p) for p in karmarkar_karp(values, k, equal_size=equal)]


def _values(seqlen_list: Any) -> np.ndarray:
    """Finite real numbers (lengths or workloads), one per item, as float64."""
    fix = "pass one finite number per item (lengths or workloads)"
    if not isinstance(seqlen_list, (list, tuple, range, np.ndarray)) or np.ndim(seqlen_list) != 1:
        raise DynBatchConfigError("seqlen_list", type(seqlen_list).__name__, "must be a 1-D sequence of numbers", fix)
    out = []
    for i, v in enumerate(list(seqlen_list)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
                or not np.isfinite(float(v)):
            raise DynBatchConfigError(f"seqlen_list[{i}]", v, "is not a finite number", fix)
        out.append(float(v))
    return np.asarray(out, dtype=np.float64)


def group_balanced_partitions(seqlen_list: Sequence[int], uid_list: Sequence[Any], k_partitions: int,
                              model: Any = None) -> List[List[int]]:
    """verl's ``get_group_balanced_partitions``: runs of equal consecutive uids stay together; groups are dealt
    to ``k`` partitions with equal group counts, balanced by verl's workload (or the model's time)."""
    lens = check_lengths(seqlen_list)
    uids = check_group_ids(uid_list, lens.size, field="uid_list")
    groups: List[List[int]] = []
    for i, u in enumerate(uids):
        if i and u == uids[i - 1]:
            groups[-1].append(i)
        else:
            groups.append([i])
    k = as_int(k_partitions, "k_partitions", minimum=1)
    if len(groups) < k:
        raise DynBatchConfigError("k_partitions", k, f"only {len(groups)} uid groups for {k} partitions",
                                  "reduce the world size or increase the batch size")
    work = _work(lens, model)
    weights = [float(work[g].sum()) for g in groups]
    parts = karmarkar_karp(weights, k, equal_size=True)
    return [sorted(i for gi in part for i in groups[gi]) for part in parts]


def _work(lens: np.ndarray, model: Any) -> np.ndarray:
    if model is None:
        return verl_workload(lens)
    cm = CostModel.from_model(model)
    return cm.work(lens, lens.astype(np.float64) ** 2)


def _planner_kwargs(max_token_len: int, *, tp: int, cp: int, pp: int, model: Any, cost_model: Any,
                    num_batches_divided_by: Optional[int], min_num_micro_batch: Optional[int],
                    force_group_size: Optional[int], n: int, sequence_pad_multiple: Optional[int]) -> dict:
    """``plan_global_batch`` arguments for one rank's micro-batches under verl's semantics."""
    cap = as_int(max_token_len, "max_token_len", minimum=1, fix="pass the token budget of one micro-batch")
    par = ParallelConfig(dp=1, tp=tp, cp=cp, pp=pp)
    if cap // cp < 1:
        raise DynBatchConfigError("max_token_len", cap, f"smaller than the context-parallel size {cp}",
                                  "pass max_token_len = max_token_len_per_gpu * cp")
    kw = dict(parallel=par, max_tokens_per_gpu=cap // cp, oversize="error",
              sequence_pad_multiple=verl_sequence_pad_multiple(tp, cp) if sequence_pad_multiple is None
              else sequence_pad_multiple,
              num_microbatches_multiple=num_batches_divided_by, min_num_microbatches=min_num_micro_batch)
    kw.update(_balance_kwargs(model, cost_model, par))
    fgs = 1 if force_group_size is None else as_int(force_group_size, "force_group_size", minimum=1)
    if n % fgs:
        raise DynBatchConfigError("force_group_size", fgs, f"does not divide the batch size {n}",
                                  f"pass a batch whose size is a multiple of {fgs}")
    if fgs > 1:
        kw["microbatch_group_ids"] = [i // fgs for i in range(n)]
    return kw


def local_count(lengths: Sequence[int], max_token_len: int, *, num_batches_divided_by: Optional[int] = None,
                min_num_micro_batch: Optional[int] = None, force_group_size: Optional[int] = None, tp: int = 1,
                cp: int = 1, pp: int = 1, model: Any = None, cost_model: Any = None,
                sequence_pad_multiple: Optional[int] = None) -> int:
    """The micro-batches this rank needs (before the MAX over DP): the first count, at least
    ``min_num_micro_batch`` and a multiple of ``num_batches_divided_by``, at which its samples pack under
    ``max_token_len`` with verl's padding."""
    lens = check_lengths(lengths)
    kw = _planner_kwargs(max_token_len, tp=tp, cp=cp, pp=pp, model=model, cost_model=cost_model,
                         num_batches_divided_by=num_batches_divided_by, min_num_micro_batch=min_num_micro_batch,
                         force_group_size=force_group_size, n=lens.size, sequence_pad_multiple=sequence_pad_multiple)
    return local_microbatch_counts(lens, **kw)[0]


def local_partitions(lengths: Sequence[int], max_token_len: int, num_micro_batches: int, *,
                     num_batches_divided_by: Optional[int] = None, force_group_size: Optional[int] = None,
                     use_dynamic_bsz_balance: bool = True, tp: int = 1, cp: int = 1, pp: int = 1, model: Any = None,
                     cost_model: Any = None, sequence_pad_multiple: Optional[int] = None) -> List[List[int]]:
    """This rank's ``num_micro_batches`` micro-batches (each a sorted list of indices into its batch), within the
    cap. ``use_dynamic_bsz_balance``: in the cost model's pipeline order, else in order of first index."""
    lens = check_lengths(lengths)
    kw = _planner_kwargs(max_token_len, tp=tp, cp=cp, pp=pp, model=model, cost_model=cost_model,
                         num_batches_divided_by=num_batches_divided_by, min_num_micro_batch=None,
                         force_group_size=force_group_size, n=lens.size, sequence_pad_multiple=sequence_pad_multiple)
    plan = plan_local_batch(lens, num_microbatches=num_micro_batches, **kw)
    parts = [sorted(mb) for mb in plan.micro_batches[0]]
    if not as_bool(use_dynamic_bsz_balance, "use_dynamic_bsz_balance"):
        parts.sort(key=lambda p: p[0])
    return parts


def balance_partitions(lengths: Sequence[int], dp: int, *, minibatch_size: Optional[int] = None,
                       uids: Optional[Sequence[Any]] = None, max_token_len: Optional[int] = None, tp: int = 1,
                       cp: int = 1, pp: int = 1, model: Any = None, cost_model: Any = None) -> List[List[int]]:
    """The DP-level balance of verl's ``_balance_batch``: ``dp`` partitions of global indices with equal sample
    counts (per mini-batch of ``minibatch_size`` samples, in mini-batch order, with ``keep_minibatch``), uid groups
    kept on one rank when ``uids`` is given, balanced by time under the budget ``max_token_len`` (when given)."""
    lens = check_lengths(lengths)
    dp = as_int(dp, "dp_size", minimum=1)
    par = ParallelConfig(dp=dp, tp=tp, cp=cp, pp=pp)
    pad = verl_sequence_pad_multiple(tp, cp)
    if max_token_len is None:  # no budget: pure balancing (every rank's samples fit one micro-batch)
        align = Alignment.for_layout(par, None, pad)
        budget = -(-(int(align.seq_len(lens).sum()) + align.total_multiple) // cp)
    else:
        budget = max(1, as_int(max_token_len, "max_token_len", minimum=1) // cp)
    kw: dict = dict(parallel=par, max_tokens_per_gpu=budget, equal_samples_per_rank=True, oversize="alone",
                    samples_per_step=minibatch_size, group_ids=uids, sequence_pad_multiple=pad)
    kw.update(_balance_kwargs(model, cost_model, par))
    with warnings.catch_warnings():  # an over-budget sample is the per-rank step's business (it raises there)
        warnings.simplefilter("ignore", OversizeSampleWarning)
        plan = plan_global_batch(lens, **kw)
    return [plan.rank_samples(r) for r in range(dp)]
