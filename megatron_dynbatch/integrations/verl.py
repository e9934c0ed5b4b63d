"""Drop-in for ``verl.utils.seqlen_balancing`` (verl's Megatron backend): change the import in each file that has
one (docs/migrating.md lists them) ::

    from megatron_dynbatch.integrations.verl import (calculate_workload, get_seqlen_balanced_partitions,
                                                     log_seqlen_unbalance, prepare_dynamic_batch,
                                                     rearrange_micro_batches, restore_dynamic_batch)
    # was: from verl.utils.seqlen_balancing import ...

That alone runs verl's own call sites as they are (``_balance_batch`` hands ``get_seqlen_balanced_partitions``
a tensor of workloads; the engine passes ``max_token_len`` as a 0-d tensor). Optionally, for a DP-level
balance that respects the budget, one assignment in the trainer module::

    RayPPOTrainer._balance_batch = megatron_dynbatch.integrations.verl.trainer_balance_batch

Same signatures, same return structures; the contracts kept and what changes are in
:mod:`megatron_dynbatch.core.dropin.verl`. In short: ``rearrange_micro_batches`` / ``prepare_dynamic_batch``
never return a micro-batch over ``max_token_len`` (verl's per-sequence padding ``tp*cp*2`` included), agree on
the count with the same single all-reduce (MAX) over ``dp_group``, keep ``min_num_micro_batch``,
``num_batches_divided_by`` and ``force_group_size``; ``balance_batch`` gives every rank the same number of
samples, balanced by time.

Extra keyword-only arguments (optional): ``model`` (a ``ModelSpec``/dict/preset: balance its FLOPs at kernel
efficiency; default verl's workload ``24576*L + L**2``), ``cost_model``, ``tp_size`` / ``cp_size`` / ``pp_size``
(default: Megatron's ``parallel_state`` when it is initialised, else 1), ``sequence_pad_multiple`` (default
verl's convention for that layout).

Oversize: verl asserts ``max_token_len`` >= the padded sequence width; so does this module (an
``OversizeAssertionError`` naming ``max_token_len``), on the first batch -- before the first step's compute -- and
:func:`check_budget` runs the same check from the config at start-up; a ``force_group_size`` group over the
budget runs alone with a warning (verl's policy). Errors are ``AssertionError``s where verl asserts (and
``DynBatchConfigError``s), in verl's words; an empty batch, a missing or NaN ``attention_mask`` get a clear
error, and with ``dp_group`` a failing rank still joins the count all-reduce so that no rank waits. Data types:
TensorDict / DataProto as verl passes them (verl's own ``index_select_tensor_dict`` is used when verl is
installed; plain dicts of tensors, lists and NumPy arrays work too); torch is imported lazily.

Memory at start-up: :func:`check_budget_memory` judges ``ppo_max_token_len_per_gpu`` and the rollout's (and, with
a reference policy, the ref's) ``log_prob_max_token_len_per_gpu`` against what the memory model says fits the
card, from verl's own config (layout and optimizer from ``actor.megatron``, the model from a local
``actor_rollout_ref.model.path``): a :class:`~megatron_dynbatch.core.errors.BudgetWarning` when one is over it
(out of memory ahead) or under 60% of it (speed left behind), naming the value to use; nothing when the card or
the model is unknown. ``trainer_balance_batch`` runs it once per trainer (verl's driver has no GPU: there it
speaks only with ``gpu_memory_gb``, so call it from a worker or pass the card).
"""

from __future__ import annotations

import copy
import sys
import warnings
from itertools import chain
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..core.checks import as_budget, as_int
from ..core.dropin import verl as core
from ..core.dropin.budgets import verl_budgets
from ..core.dropin.words import VERL_WORDS, trainer_terms
from ..core.errors import BudgetWarning, DropinAssertionError, DynBatchConfigError, OversizeSampleError
from ..core.memory.check import FAR_UNDER
from ..core.planner.inputs import attention_mask_lengths, check_lengths

__all__ = [
    "balance_batch", "calculate_workload", "ceildiv", "check_budget", "check_budget_memory",
    "get_group_balanced_partitions",
    "get_reverse_idx", "get_seqlen_balanced_partitions", "log_seqlen_unbalance", "prepare_dynamic_batch",
    "rearrange_micro_batches", "restore_dynamic_batch", "roundup_divisible", "trainer_balance_batch",
]


# ----------------------------------------------------------------------------------------- verl's helpers
def calculate_workload(seqlen_list: Any) -> Any:
    """verl's workload estimate ``24576 * L + L**2`` (tensor in, tensor out; lists and arrays too)."""
    if isinstance(seqlen_list, (list, tuple)):
        seqlen_list = np.asarray(seqlen_list, dtype=np.int64)
    return int(core.VERL_WORKLOAD_LINEAR) * seqlen_list + seqlen_list ** 2


def ceildiv(a: int, b: int) -> int:
    return -(a // -b)


def roundup_divisible(a: int, b: int) -> int:
    return ((a + b - 1) // b) * b


def get_reverse_idx(idx_map: Sequence[int]) -> List[int]:
    """The inverse permutation: ``out[idx_map[i]] = i``."""
    out = list(idx_map)
    for i, idx in enumerate(idx_map):
        out[idx] = i
    return out


def get_seqlen_balanced_partitions(seqlen_list: Sequence[float], k_partitions: int, equal_size: bool):
    """verl's function (Karmarkar-Karp; partitions sorted, none empty)."""
    return core.seqlen_balanced_partitions(seqlen_list, k_partitions, equal_size)


def get_group_balanced_partitions(seqlen_list: Sequence[int], uid_list: Sequence[Any], k_partitions: int,
                                  *, model: Any = None) -> List[List[int]]:
    """verl's function: consecutive samples with one uid stay together; equal group counts per partition."""
    return core.group_balanced_partitions(seqlen_list, uid_list, k_partitions, model=model)


def log_seqlen_unbalance(seqlen_list: Sequence[int], partitions: List[List[int]], prefix: str) -> Dict[str, Any]:
    """verl's balance metrics: per-partition token sums before (consecutive equal chunks) and after."""
    seqlens = [int(x) for x in seqlen_list]
    k = len(partitions)
    size = max(1, len(seqlens) // k)
    before = [sum(seqlens[o:o + size]) for o in range(0, len(seqlens), size)]
    after = [sum(seqlens[i] for i in p) for p in partitions]
    return {f"{prefix}/min": min(before), f"{prefix}/max": max(before),
            f"{prefix}/minmax_diff": max(before) - min(before), f"{prefix}/balanced_min": min(after),
            f"{prefix}/balanced_max": max(after), f"{prefix}/mean": sum(before) / k}


# ----------------------------------------------------------------------------------------- layout
def _layout(tp_size: Optional[int], cp_size: Optional[int], pp_size: Optional[int]) -> Tuple[int, int, int]:
    """tp / cp / pp: explicit values, else Megatron's parallel_state if it is initialised (never imported here:
    if it was not imported it cannot be initialised), else 1."""
    ps = sys.modules.get("megatron.core.parallel_state")
    live = ps is not None and ps.model_parallel_is_initialized()

    def pick(value: Optional[int], getter: str, field: str) -> int:
        if value is not None:
            return as_int(value, field, minimum=1, fix="pass the parallel size, or None to read parallel_state")
        return int(getattr(ps, getter)()) if live else 1

    return (pick(tp_size, "get_tensor_model_parallel_world_size", "tp_size"),
            pick(cp_size, "get_context_parallel_world_size", "cp_size"),
            pick(pp_size, "get_pipeline_model_parallel_world_size", "pp_size"))


def check_budget(max_token_len: int, max_seq_len: int, *, tp_size: Optional[int] = None,
                 cp_size: Optional[int] = None, sequence_pad_multiple: Optional[int] = None) -> bool:
    """Start-up check: a sequence of ``max_seq_len`` (verl: ``max_prompt_length + max_response_length``) fits
    ``max_token_len`` (``ppo_max_token_len_per_gpu * cp``) with verl's padding; raises otherwise."""
    from ..core.startup import check_max_seq_len_fits

    tp, cp, _ = _layout(tp_size, cp_size, 1)
    pad = core.verl_sequence_pad_multiple(tp, cp) if sequence_pad_multiple is None else sequence_pad_multiple
    budget = as_budget(max_token_len, "max_token_len", trainer="verl")
    return check_max_seq_len_fits(max_seq_len, max_tokens_per_gpu=max(1, budget // cp),
                                  parallel={"tp": tp, "cp": cp}, sequence_pad_multiple=pad,
                                  length_field="max_seq_len", budget_field="max_token_len")


def check_budget_memory(config: Any, *, model: Any = None, gpu_memory_gb: Any = None, settings: Any = None,
                        profile: Any = None, far_under: Any = FAR_UNDER, dp_size: Optional[int] = None) -> list:
    """verl's configured budgets against what fits the card (module docstring): ``config`` verl's trainer config
    (or its ``actor_rollout_ref``); the :class:`~megatron_dynbatch.core.memory.check.BudgetVerdict` of each budget,
    a ``BudgetWarning`` for those over what fits or far under it; ``[]`` when the card or the model is unknown or
    the actor is not on Megatron. ``model`` (else the config's local ``model.path``), ``gpu_memory_gb`` (else this
    process's GPU), ``settings`` (else what ``actor.megatron`` implies; a mapping changes those fields),
    ``profile``, ``far_under`` (the "speed left behind" threshold; 0 turns it off), ``dp_size`` (else
    ``trainer.n_gpus_per_node x nnodes / (tp x pp x cp)``). Bad input raises."""
    from .budget_check import warn_configured_budgets

    return warn_configured_budgets(verl_budgets(config, dp_size), model=model, gpu_memory_gb=gpu_memory_gb,
                                   settings=settings, profile=profile, far_under=far_under)


#: attribute set on verl's trainer once the start-up memory check ran
_CHECKED = "_dynbatch_budget_checked"


# ----------------------------------------------------------------------------------------- data types
def _seq_lengths(batch: Any) -> Tuple[np.ndarray, int]:
    """Per-sample lengths and the padded width, read as verl reads them: nested ``input_ids`` (their offsets),
    else ``attention_mask`` sums. An empty batch gives no lengths; a missing mask, a mask that is not
    ``[batch, seq_len]`` or one whose rows do not sum to whole token counts (NaN) is an error naming it."""
    input_ids = batch["input_ids"] if _has(batch, "input_ids") else None
    if input_ids is not None and getattr(input_ids, "is_nested", False):
        diff = input_ids.offsets().diff()
        lens = check_lengths(diff, field="input_ids.offsets().diff()") if len(diff) else np.zeros(0, np.int64)
        return lens, int(lens.max()) if lens.size else 0
    if not _has(batch, "attention_mask"):
        raise DynBatchConfigError('batch["attention_mask"]', "missing", "verl reads each sample's length from the "
                                  "attention mask (or from nested input_ids)", "pass the batch with its "
                                  "attention_mask of shape [batch, seq_len], or nested input_ids")
    return attention_mask_lengths(batch["attention_mask"])  # an empty batch: no lengths


def _has(batch: Any, key: str) -> bool:
    try:
        return key in batch.keys()
    except AttributeError:
        return False


def _select_value(value: Any, idx: List[int]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        if getattr(value, "is_nested", False):
            parts = value.unbind()
            return torch.nested.as_nested_tensor([parts[i] for i in idx], layout=torch.jagged)
        return value[torch.as_tensor(idx, dtype=torch.long, device=value.device)]
    if isinstance(value, np.ndarray):
        return value[idx]
    if isinstance(value, (list, tuple)):
        return type(value)(value[i] for i in idx)
    return value  # a scalar / non-tensor entry shared by the whole batch


def _index_select(batch: Any, idx: List[int]) -> Any:
    """verl's ``tu.index_select_tensor_dict`` when verl is installed; else per-key selection for plain mappings,
    and ``batch[index_tensor]`` for a TensorDict (which keeps its batch size)."""
    try:
        from verl.utils import tensordict_utils as tu  # type: ignore
    except ImportError:
        tu = None
    if tu is not None:
        return tu.index_select_tensor_dict(batch, idx)
    if isinstance(batch, Mapping) and not hasattr(batch, "batch_size"):  # a TensorDict indexes itself, below
        return type(batch)({k: _select_value(v, idx) for k, v in batch.items()}) if type(batch) is not dict \
            else {k: _select_value(v, idx) for k, v in batch.items()}
    import torch

    return batch[torch.as_tensor(idx, dtype=torch.long)]


# ----------------------------------------------------------------------------------------- micro-batches
def rearrange_micro_batches(batch: Any, max_token_len: int, dp_group: Any = None, num_batches_divided_by: Any = None,
                            same_micro_num_in_dp: bool = True, min_num_micro_batch: Any = None,
                            use_dynamic_bsz_balance: bool = True, force_group_size: int = 1, *, model: Any = None,
                            cost_model: Any = None, tp_size: Optional[int] = None, cp_size: Optional[int] = None,
                            pp_size: Optional[int] = None, sequence_pad_multiple: Optional[int] = None):
    """verl's ``rearrange_micro_batches``: ``(micro_batches, micro_bsz_idx)`` -- this rank's micro-batches and,
    for each, the sorted indices into ``batch``. The count is the first at which this rank packs under the cap
    (with ``min_num_micro_batch``), the MAX over ``dp_group`` when ``same_micro_num_in_dp`` (one all-reduce),
    a multiple of ``num_batches_divided_by``.

    Errors are :class:`~megatron_dynbatch.core.errors.DropinAssertionError` (verl asserts on its input) in verl's
    words. With ``dp_group`` a rank that cannot plan -- an empty batch, a sample over ``max_token_len``, a bad
    argument -- still joins the all-reduce with a failure flag, so every rank raises instead of the others
    waiting forever."""
    sync = same_micro_num_in_dp and dp_group is not None
    layout: Dict[str, Any] = {}
    lens = np.zeros(0, np.int64)
    count, failure = 0, None
    try:
        with trainer_terms(VERL_WORDS, assertion=True):
            max_token_len = as_int(max_token_len, "max_token_len", minimum=1,
                                   fix="pass the token budget of one micro-batch (ppo_max_token_len_per_gpu * cp)")
            lens, width = _seq_lengths(batch)
            if lens.size == 0:
                raise DynBatchConfigError("batch", "0 samples", "an empty batch has no micro-batches (verl's own "
                                          "function fails on it too)", "dispatch at least one sample to every "
                                          "DP rank, or skip the call for an empty batch")
            if max_token_len < width:
                raise OversizeSampleError(
                    "max_token_len", max_token_len, f"is smaller than the sequence length {width} (verl asserts "
                    "max_token_len >= the padded width)", f"raise ppo_max_token_len_per_gpu so that max_token_len "
                    f">= {width}, or lower max_prompt_length + max_response_length")
            tp, cp, pp = _layout(tp_size, cp_size, pp_size)
            layout = dict(tp=tp, cp=cp, pp=pp, model=model, cost_model=cost_model, force_group_size=force_group_size,
                          num_batches_divided_by=num_batches_divided_by, sequence_pad_multiple=sequence_pad_multiple)
            count = core.local_count(lens, max_token_len, min_num_micro_batch=min_num_micro_batch, **layout)
    except DynBatchConfigError as exc:
        if not sync:
            raise
        failure = exc
    if sync:
        from ..megatron.local import all_reduce_max

        flag, count = all_reduce_max([failure is not None, count], dp_group)
        if failure is not None:
            raise failure
        if flag:
            raise DropinAssertionError("dp_group", "another DP rank", "a DP rank could not plan its micro-batches, "
                                       "so no count was agreed", "see that rank's error (its batch or the budget)")
    parts = core.local_partitions(lens, max_token_len, count, use_dynamic_bsz_balance=use_dynamic_bsz_balance,
                                  **layout)
    return [_index_select(batch, p) for p in parts], parts


def prepare_dynamic_batch(data: Any, max_token_len: int, dp_group: Any = None, num_batches_divided_by: Any = None,
                          same_micro_num_in_dp: bool = True, min_num_micro_batch: Any = None,
                          use_dynamic_bsz_balance: bool = True, **extras: Any):
    """verl's ``prepare_dynamic_batch``: a ``DataProto`` in, ``(list of DataProto, index lists)`` out (same class
    as ``data``; non-tensor fields selected, ``meta_info`` copied)."""
    batches, idx_list = rearrange_micro_batches(
        data.batch, max_token_len=max_token_len, dp_group=dp_group, num_batches_divided_by=num_batches_divided_by,
        same_micro_num_in_dp=same_micro_num_in_dp, min_num_micro_batch=min_num_micro_batch,
        use_dynamic_bsz_balance=use_dynamic_bsz_balance, **extras)
    out = []
    for part, idx in zip(batches, idx_list, strict=True):
        tensors = dict(part)
        non_tensors = {k: _select_value(v, idx) for k, v in data.non_tensor_batch.items()}
        out.append(type(data).from_dict(tensors, non_tensors, meta_info=copy.deepcopy(data.meta_info)))
    return out, idx_list


def restore_dynamic_batch(data: Any, batch_idx_list: List[List[int]]) -> Any:
    """verl's ``restore_dynamic_batch``: rows of the concatenated micro-batch outputs back in batch order."""
    import torch

    indices = list(chain.from_iterable(batch_idx_list))
    if len(indices) != data.shape[0] or sorted(indices) != list(range(len(indices))):
        raise DropinAssertionError("batch_idx_list", f"{len(indices)} indices",
                                  f"must be a permutation of the {data.shape[0]} rows",
                                  "pass the index lists prepare_dynamic_batch / rearrange_micro_batches returned")
    revert = torch.tensor(get_reverse_idx(indices), dtype=torch.long)
    if getattr(data, "is_nested", False):
        rows = data.unbind()
        return torch.nested.as_nested_tensor([rows[i] for i in revert.tolist()], layout=torch.jagged)
    return data[revert.to(data.device)]


# ----------------------------------------------------------------------------------------- DP balance
def balance_batch(batch: Any, dp_size: int, metrics: Optional[dict] = None, logging_prefix: str = "global_seqlen",
                  keep_minibatch: bool = False, minibatch_size: Optional[int] = None, *,
                  use_prefix_grouper: bool = False, uid_key: str = "uid", max_token_len: Optional[int] = None,
                  model: Any = None, cost_model: Any = None, tp_size: Optional[int] = None,
                  cp_size: Optional[int] = None, pp_size: Optional[int] = None) -> List[List[int]]:
    """verl's ``_balance_batch`` as a function: reorder ``batch`` (a DataProto) in place so that its ``dp_size``
    equal chunks are balanced rank shares with equal sample counts (per mini-batch of ``minibatch_size`` with
    ``keep_minibatch``; uid groups kept together with ``use_prefix_grouper``). Adds verl's balance metrics to
    ``metrics``; returns the partitions (global indices per rank)."""
    import torch

    with trainer_terms(VERL_WORDS, assertion=True):
        lens = _seq_lengths(batch.batch)[0]
    uids = None
    if use_prefix_grouper and uid_key in getattr(batch, "non_tensor_batch", {}):
        uids = list(batch.non_tensor_batch[uid_key])
    tp, cp, pp = _layout(tp_size, cp_size, pp_size)
    parts = core.balance_partitions(lens, dp_size, minibatch_size=minibatch_size if keep_minibatch else None,
                                    uids=uids, max_token_len=max_token_len, tp=tp, cp=cp, pp=pp, model=model,
                                    cost_model=cost_model)
    batch.reorder(torch.tensor([i for p in parts for i in p]))
    if metrics is not None:
        metrics.update(log_seqlen_unbalance(lens.tolist(), parts, logging_prefix))
    return parts


def trainer_balance_batch(self: Any, batch: Any, metrics: dict, logging_prefix: str = "global_seqlen",
                          keep_minibatch: bool = False) -> None:
    """``RayPPOTrainer._balance_batch`` replacement (assign it to the class): reads the DP size, mini-batch size,
    token budget and context-parallel size from the trainer the way verl does, then :func:`balance_batch`. On its
    first call for a trainer it runs :func:`check_budget_memory` on the trainer's config."""
    if not getattr(self, _CHECKED, False):  # the start-up memory check, once per trainer; it never stops the run
        try:
            check_budget_memory(self.config)
        except DynBatchConfigError as err:
            warnings.warn(f"start-up memory check of verl's token budgets skipped: {err}", BudgetWarning,
                          stacklevel=2)
        try:
            setattr(self, _CHECKED, True)
        except AttributeError:
            pass
    dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
    actor = self.config.actor_rollout_ref.actor
    minibatch = actor.get("ppo_mini_batch_size") if keep_minibatch else None
    cp = None
    megatron_cfg = actor.get("megatron") if hasattr(actor, "get") else None
    if megatron_cfg is not None and hasattr(megatron_cfg, "get"):
        cp = megatron_cfg.get("context_parallel_size")
    per_gpu = actor.get("ppo_max_token_len_per_gpu") if actor.get("use_dynamic_bsz", False) else None
    balance_batch(batch, dp_size, metrics, logging_prefix, keep_minibatch, minibatch,
                  use_prefix_grouper=bool(getattr(self, "use_prefix_grouper", False)),
                  max_token_len=None if per_gpu is None else int(per_gpu) * int(cp or 1), cp_size=cp or 1)
