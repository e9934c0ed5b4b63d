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
  groups in one micro-batch; a group over the cap runs as a micro-batch of its own (verl's policy for groups,
  with a warning; :func:`local_plan`'s ``oversize_samples`` / ``cap_violations`` count it), while a single
  sample over the cap is an error (verl asserts on the padded width). Micro-batches are ordered for the
  pipeline by the cost model (``use_dynamic_bsz_balance``; verl puts small ones at both ends) or left in index
  order.
* ``_balance_batch``: reorder the batch so that dispatching equal chunks gives every DP rank the same number of
  samples (of every mini-batch with ``keep_minibatch``; keeping uid groups together with the prefix grouper),
  balanced. Here :func:`balance_partitions` balances the cost model's time under the budget (verl: its fixed
  ``24576*L + L**2``).

Without a model, balancing uses verl's own workload estimate ``24576*L + L**2`` (:func:`verl_cost_model`); pass
the trained model (``model=``) to balance its real FLOPs at kernel efficiency. Errors are
:class:`~megatron_dynbatch.core.errors.DropinAssertionError` (verl asserts on its input) naming verl's arguments
(:data:`~megatron_dynbatch.core.dropin.words.VERL_WORDS`); lengths and workloads may be lists, arrays or tensors.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import numpy as np

from ..alignment import Alignment
from ..checks import as_budget, as_array, as_bool, as_int, scalar
from ..cost_model import CostModel
from ..errors import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning
from ..parallel import ParallelConfig
from ..partitioning import karmarkar_karp
from ..planner import Plan, local_microbatch_counts, plan_global_batch, plan_local_batch
from ..planner.inputs import check_group_ids, check_lengths
from .words import VERL_WORDS, speaks, trainer_terms

if TYPE_CHECKING:
    from ..cost_model import CostModelLike
    from ..model_spec import ModelLike

__all__ = ["VERL_WORKLOAD_LINEAR", "balance_partitions", "group_balanced_partitions", "local_count",
           "local_partitions", "local_plan", "seqlen_balanced_partitions", "verl_cost_model",
           "verl_sequence_pad_multiple", "verl_workload"]

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


def _balance_kwargs(model: Optional[ModelLike], cost_model: Optional[CostModel], par: ParallelConfig) -> dict:
    """What the drop-ins balance by: the model's time when it is given, else verl's own workload estimate
    (:func:`verl_cost_model`) as time -- so an import-only switch balances what verl balances."""
    if model is not None:
        return {"model": model, "cost_model": cost_model}
    return {"balance_by": "time", "cost_model": cost_model or verl_cost_model(par)}


def verl_sequence_pad_multiple(tp: int = 1, cp: int = 1) -> int:
    """What verl's Megatron engine pads each packed sequence to (``preprocess_packed_seqs``)."""
    return tp * cp * 2 if cp > 1 else tp


@speaks(VERL_WORDS, assertion=True)
def seqlen_balanced_partitions(seqlen_list: Sequence[float], k_partitions: int, equal_size: bool) -> List[List[int]]:
    """verl's ``get_seqlen_balanced_partitions`` (Karmarkar-Karp): ``k`` sorted, non-empty partitions. Takes what
    verl's own call sites pass: a list, an array, or a tensor of lengths or workloads (``_balance_batch`` hands
    it ``calculate_workload(attention_mask.sum(-1))`` and slices of it)."""
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
    """Finite, non-negative real numbers (lengths or workloads), one per item, as float64."""
    fix = "pass one length or workload per item: a list, a 1-D array or a 1-D tensor of numbers >= 0"
    arr = as_array(seqlen_list)
    if isinstance(arr, (list, tuple, range)):
        arr = [scalar(v) for v in arr]
        for i, v in enumerate(arr):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float)):
                raise DynBatchConfigError(f"seqlen_list[{i}]", v, "is not a number", fix)
        arr = np.asarray(arr, dtype=np.float64) if arr else np.zeros(0)
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in "iuf":
        what = f"array of shape {arr.shape} and dtype {arr.dtype}" if isinstance(arr, np.ndarray) \
            else type(seqlen_list).__name__
        raise DynBatchConfigError("seqlen_list", what, "must be a 1-D sequence of numbers", fix)
    arr = arr.astype(np.float64)
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DynBatchConfigError(f"seqlen_list[{i}]", arr[i].item(), "is not a finite number >= 0", fix)
    return arr


@speaks(VERL_WORDS, assertion=True)
def group_balanced_partitions(seqlen_list: Sequence[int], uid_list: Sequence[Any], k_partitions: int,
                              model: Optional[ModelLike] = None) -> List[List[int]]:
    """verl's ``get_group_balanced_partitions``: runs of equal consecutive uids stay together; groups are dealt
    to ``k`` partitions with equal group counts, balanced by verl's workload (or the model's time)."""
    lens = check_lengths(seqlen_list, field="seqlen_list")
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


def _work(lens: np.ndarray, model: Optional[ModelLike]) -> np.ndarray:
    if model is None:
        return verl_workload(lens)
    cm = CostModel.from_model(model)
    return cm.work(lens, lens.astype(np.float64) ** 2)


def _planner_kwargs(lens: np.ndarray, max_token_len: int, *, tp: int, cp: int, pp: int, model: Optional[ModelLike],
                    cost_model: CostModelLike,
                    num_batches_divided_by: Optional[int], min_num_micro_batch: Optional[int],
                    force_group_size: Optional[int], sequence_pad_multiple: Optional[int]) -> dict:
    """``plan_global_batch`` arguments for one rank's micro-batches under verl's semantics, after checking that
    every sample fits ``max_token_len`` with verl's padding (verl's own assert is on the padded width; a sample
    over the cap is an error, a ``force_group_size`` group over it runs alone -- see :func:`local_plan`)."""
    cap = as_budget(max_token_len, "max_token_len", trainer="verl", fix="pass the token budget of one micro-batch")
    par = ParallelConfig(dp=1, tp=tp, cp=cp, pp=pp)
    if cap // cp < 1:
        raise DynBatchConfigError("max_token_len", cap, f"smaller than the context-parallel size {cp}",
                                  "pass max_token_len = max_token_len_per_gpu * cp")
    pad = verl_sequence_pad_multiple(tp, cp) if sequence_pad_multiple is None else sequence_pad_multiple
    _check_samples_fit(lens, cap, par, pad)
    kw = dict(parallel=par, max_tokens_per_gpu=cap // cp, oversize="alone", sequence_pad_multiple=pad,
              num_microbatches_multiple=num_batches_divided_by, min_num_microbatches=min_num_micro_batch)
    kw.update(_balance_kwargs(model, cost_model, par))
    fgs = 1 if force_group_size is None else as_int(force_group_size, "force_group_size", minimum=1)
    if lens.size % fgs:
        raise DynBatchConfigError("force_group_size", fgs, f"does not divide the batch size {lens.size}",
                                  f"pass a batch whose size is a multiple of {fgs}")
    if fgs > 1:
        kw["microbatch_group_ids"] = np.arange(lens.size) // fgs
    return kw


def _check_samples_fit(lens: np.ndarray, cap: int, par: ParallelConfig, pad: int) -> None:
    """Every sample fits one micro-batch of ``cap`` tokens after verl's per-sequence padding ``pad`` (the
    planner's ``oversize="alone"`` is then only ever used by ``force_group_size`` groups)."""
    align = Alignment.for_layout(par, None, pad)
    cap_eff = align.effective_cap(cap // par.cp * par.cp)
    slots = align.seq_len(lens)
    if cap_eff < align.seq_multiple or (slots > cap_eff).any():
        i = int(np.argmax(slots))
        need = align.budget_for(int(slots[i]), par.cp) * par.cp
        raise OversizeSampleError(
            "max_token_len", cap, f"sample {i} has {int(lens[i])} tokens, {int(slots[i])} after verl's padding of "
            f"each sequence to a multiple of {pad} (tp={par.tp}, cp={par.cp}), more than a micro-batch of "
            f"max_token_len holds ({cap_eff})", f"raise ppo_max_token_len_per_gpu so that max_token_len "
            f"(ppo_max_token_len_per_gpu x cp) >= {need}, or lower max_prompt_length + max_response_length")


def _group_warning(plan: Plan, fgs: int, cap: int) -> None:
    """verl's policy for a ``force_group_size`` group over ``max_token_len``: it runs as a micro-batch of its
    own (over the budget), with this warning; ``plan.oversize_samples`` / ``plan.cap_violations`` count it."""
    if not plan.oversize_samples:
        return
    groups = sorted({i // fgs for i in plan.oversize_samples})
    shown = ", ".join(f"samples {g * fgs}..{g * fgs + fgs - 1}" for g in groups[:3])
    warnings.warn(f"force_group_size={fgs}: {len(groups)} group(s) ({shown}{', ...' if len(groups) > 3 else ''}) "
                  f"hold more tokens than max_token_len={cap} with verl's padding; each runs as a micro-batch of "
                  "its own, over the budget (verl's policy for groups). Raise ppo_max_token_len_per_gpu to keep "
                  "every micro-batch within it", OversizeSampleWarning, stacklevel=3)


def _quiet_plan(fn, lens: np.ndarray, **kw):
    """``fn(lens, **kw)`` without the planner's own oversize warning (the drop-in warns in verl's words)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        return fn(lens, **kw)


@speaks(VERL_WORDS, assertion=True)
def local_count(lengths: Sequence[int], max_token_len: int, *, num_batches_divided_by: Optional[int] = None,
                min_num_micro_batch: Optional[int] = None, force_group_size: Optional[int] = None, tp: int = 1,
                cp: int = 1, pp: int = 1, model: Optional[ModelLike] = None, cost_model: CostModelLike = None,
                sequence_pad_multiple: Optional[int] = None) -> int:
    """The micro-batches this rank needs (before the MAX over DP): the first count, at least
    ``min_num_micro_batch`` and a multiple of ``num_batches_divided_by``, at which its samples pack under
    ``max_token_len`` with verl's padding."""
    lens = check_lengths(lengths, field="seqlen_list")
    kw = _planner_kwargs(lens, max_token_len, tp=tp, cp=cp, pp=pp, model=model, cost_model=cost_model,
                         num_batches_divided_by=num_batches_divided_by, min_num_micro_batch=min_num_micro_batch,
                         force_group_size=force_group_size, sequence_pad_multiple=sequence_pad_multiple)
    with trainer_terms(VERL_WORDS, assertion=True, values={"max_token_len": int(max_token_len)}):
        return _quiet_plan(local_microbatch_counts, lens, **kw)[0]


@speaks(VERL_WORDS, assertion=True)
def local_plan(lengths: Sequence[int], max_token_len: int, num_micro_batches: int, *,
               num_batches_divided_by: Optional[int] = None, force_group_size: Optional[int] = None, tp: int = 1,
               cp: int = 1, pp: int = 1, model: Optional[ModelLike] = None, cost_model: CostModelLike = None,
               sequence_pad_multiple: Optional[int] = None) -> Plan:
    """This rank's :class:`~megatron_dynbatch.core.planner.Plan` for the agreed ``num_micro_batches``: no
    micro-batch over ``max_token_len`` except a ``force_group_size`` group that alone is over it (verl runs such
    a group on its own; a warning, and ``plan.oversize_samples`` / ``plan.cap_violations`` count it)."""
    lens = check_lengths(lengths, field="seqlen_list")
    kw = _planner_kwargs(lens, max_token_len, tp=tp, cp=cp, pp=pp, model=model, cost_model=cost_model,
                         num_batches_divided_by=num_batches_divided_by, min_num_micro_batch=None,
                         force_group_size=force_group_size, sequence_pad_multiple=sequence_pad_multiple)
    with trainer_terms(VERL_WORDS, assertion=True, values={"max_token_len": int(max_token_len)}):
        plan = _quiet_plan(plan_local_batch, lens, num_microbatches=num_micro_batches, **kw)
    _group_warning(plan, 1 if force_group_size is None else int(force_group_size), int(max_token_len))
    return plan


def local_partitions(lengths: Sequence[int], max_token_len: int, num_micro_batches: int, *,
                     use_dynamic_bsz_balance: bool = True, **kwargs: Any) -> List[List[int]]:
    """This rank's ``num_micro_batches`` micro-batches (each a sorted list of indices into its batch) of
    :func:`local_plan`. ``use_dynamic_bsz_balance``: in the cost model's pipeline order -- with ``pp == 1``
    longest modelled time first (verl orders by workload there too), not the plan's memory order: the ranks of an
    expert-parallel group, which this per-rank plan does not see, advance in lockstep and so meet micro-batches of
    similar time at each position -- else in order of first index."""
    balance = as_bool(use_dynamic_bsz_balance, "use_dynamic_bsz_balance")
    plan = local_plan(lengths, max_token_len, num_micro_batches, **kwargs)
    parts = [sorted(mb) for mb in plan.micro_batches[0]]
    if not balance:
        parts.sort(key=lambda p: p[0])
    elif plan.parallel.pp == 1:
        times = plan.microbatch_time[0]
        parts = [parts[j] for j in sorted(range(len(parts)), key=lambda j: -times[j])]  # stable: ties by position
    return parts


@speaks(VERL_WORDS, assertion=True)
def balance_partitions(lengths: Sequence[int], dp: int, *, minibatch_size: Optional[int] = None,
                       uids: Optional[Sequence[Any]] = None, max_token_len: Optional[int] = None, tp: int = 1,
                       cp: int = 1, pp: int = 1, model: Optional[ModelLike] = None,
                       cost_model: CostModelLike = None) -> List[List[int]]:
    """The DP-level balance of verl's ``_balance_batch``: ``dp`` partitions of global indices with equal sample
    counts (per mini-batch of ``minibatch_size`` samples, in mini-batch order, with ``keep_minibatch``), uid groups
    kept on one rank when ``uids`` is given, balanced by time under the budget ``max_token_len`` (when given)."""
    lens = check_lengths(lengths, field="attention_mask.sum(-1)")
    dp = as_int(dp, "dp_size", minimum=1)
    par = ParallelConfig(dp=dp, tp=tp, cp=cp, pp=pp)
    pad = verl_sequence_pad_multiple(tp, cp)
    if max_token_len is None:  # no budget: pure balancing (every rank's samples fit one micro-batch)
        align = Alignment.for_layout(par, None, pad)
        budget = -(-(int(align.seq_len(lens).sum()) + align.total_multiple) // cp)
    else:
        budget = max(1, as_budget(max_token_len, "max_token_len", trainer="verl") // cp)
    kw: dict = dict(parallel=par, max_tokens_per_gpu=budget, equal_samples_per_rank=True, oversize="alone",
                    samples_per_step=minibatch_size, group_ids=uids, sequence_pad_multiple=pad)
    kw.update(_balance_kwargs(model, cost_model, par))
    with warnings.catch_warnings():  # an over-budget sample is the per-rank step's business (it raises there)
        warnings.simplefilter("ignore", OversizeSampleWarning)
        plan = plan_global_batch(lens, **kw)
    return [plan.rank_samples(r) for r in range(dp)]
