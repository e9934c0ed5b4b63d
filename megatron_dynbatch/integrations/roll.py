"""Drop-in for ROLL's ``roll.utils.dynamic_batching.dynamic_batching_shard`` (what ``use_dynamic_batching_in_train``
and ``max_tokens_per_microbatch_in_train`` drive): change the import in ROLL's pipelines::

    from megatron_dynbatch.integrations.roll import dynamic_batching_shard   # was: from roll.utils.dynamic_batching

Same signature ``(origin_batch, dp_size, max_tokens_per_microbatch, sequence_length_round,
pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, log_prefix=None)``, same result
``(batch, metrics)``: the batch reordered into ``dp_size`` equal shards with ``meta_info`` keys
``global_micro_batch_indices``, ``global_micro_batch_lengths``, ``micro_batch_indices``, ``micro_batch_lengths``,
``num_micro_batchs`` as ROLL's ``make_mini_batch_iter_for_dynamic_batching`` / ``make_micro_batch_iter_...``
read them, and ROLL's metric names, and ROLL's micro-batch count (so ROLL's optimizer steps). What changes -- a
cost-model cut of the micro-batches for that count, a snake deal of real tokens over ranks, a clear error for a
sample over the budget -- is in :mod:`megatron_dynbatch.core.dropin.roll`.

Extra keyword-only arguments (optional): ``ga_steps`` (the training batch's ``gradient_accumulation_steps``: lets
the count grow while the optimizer steps, ``ceil(M / ga_steps)``, stay ROLL's; without it the count is ROLL's),
``microbatch_group_size_per_vp_stage`` (Megatron's ``N``; default ``pp``), ``model`` (cost model of the trained
model; default tokens), ``cost_model``.

Start-up check: the padded width of the batch (ROLL's ``sequence_length``, the configured maximum), rounded to
``sequence_length_round``, should fit ``max_tokens_per_microbatch``; when it does not, an ``OversizeSampleWarning``
says a long sample would fail later (ROLL plans such batches, and so does this drop-in while every sample
fits). Samples whose ``attention_mask`` is all zero are planned as empty ones, with a warning on this module's
logger each call, as ROLL logs one (the module docstring of :mod:`~megatron_dynbatch.core.dropin.roll` says how
they keep ROLL's count). Errors are :class:`~megatron_dynbatch.core.errors.DropinAssertionError` (ROLL asserts)
naming ROLL's arguments.

Memory at start-up: ``dynamic_batching_shard`` sees neither the layout nor which pass it serves, so the memory
check is one call at start-up, :func:`check_budget_memory` on a ROLL worker config (``actor_train``,
``reference``): ``max_tokens_per_microbatch_in_train`` / ``_in_infer`` (per micro-batch: ``cp`` x the per-GPU
tokens) against what the memory model says fits the card, layout and memory settings from
``strategy_args.strategy_config``, the model from a local ``model_args.model_name_or_path``: a
:class:`~megatron_dynbatch.core.errors.BudgetWarning` when one is over it (out of memory ahead) or under 60% of it
(speed left behind), naming the value to use; nothing when the card or the model is unknown.

``meta_info`` as ROLL's callers see it: ROLL slices the caller's batch (a slice shares the caller's
``meta_info``), cuts it into the ``dp`` shards and joins them with ``DataProto.concat``, then writes its keys
into the joined batch's ``meta_info``. So does this drop-in, with the batch's own ``concat``: with ``dp_size=1``
the join is the one shard, so the keys land in the caller's own dict and the result shares it; with ``dp_size >
1`` the result has a new dict, ``concat``'s merge of the shards' (ROLL's: the caller's keys, and its
``metrics`` gathered over the ``dp`` shards -- a scalar metric becomes a list of ``dp`` copies, a list metric
``dp`` copies end to end), and the caller's dict is left alone. ``micro_batch_indices`` /
``micro_batch_lengths`` are the same list objects as the ``global_`` ones, as in ROLL. Needs the DataProto
methods ROLL's own function uses (``batch["attention_mask"]``, ``slice()``, ``reorder()``, ``meta_info``, and
``concat`` for ``dp_size > 1``); torch is imported lazily.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional, Tuple

import numpy as np

from ..core.checks import as_budget, as_int
from ..core.dropin.budgets import roll_budgets
from ..core.dropin.roll import roll_shard
from ..core.dropin.words import ROLL_WORDS, speaks
from ..core.errors import DynBatchConfigError, OversizeSampleWarning
from ..core.memory.check import FAR_UNDER
from ..core.planner.inputs import attention_mask_lengths

__all__ = ["check_budget_memory", "dynamic_batching_shard"]

log = logging.getLogger(__name__)


@speaks(ROLL_WORDS, assertion=True)
def dynamic_batching_shard(origin_batch: Any, dp_size: int, max_tokens_per_microbatch: int,
                           sequence_length_round: int, pipeline_model_parallel_size: int = 1,
                           virtual_pipeline_model_parallel_size: Optional[int] = None, log_prefix: Optional[str] = None,
                           *, ga_steps: Optional[int] = None, microbatch_group_size_per_vp_stage: Optional[int] = None,
                           model: Any = None, cost_model: Any = None) -> Tuple[Any, dict]:
    """ROLL's ``dynamic_batching_shard`` with this project's guarantees (see the module docstring)."""
    import torch

    max_tokens_per_microbatch = as_budget(max_tokens_per_microbatch, "max_tokens_per_microbatch", trainer="ROLL",
                                       fix="pass max_tokens_per_microbatch_in_train")
    rnd = as_int(sequence_length_round, "sequence_length_round", minimum=1,
                 fix="pass sequence_length_round_in_train (e.g. 64)")
    seq_lens, width = _lengths(origin_batch)
    batch_size = seq_lens.size
    padded_width = max(-(-width // rnd) * rnd, rnd)
    if padded_width > max_tokens_per_microbatch:
        warnings.warn(f"max_tokens_per_microbatch={max_tokens_per_microbatch}: the configured sequence length "
                      f"{width} ({padded_width} rounded to {rnd}) does not fit one micro-batch; this batch plans "
                      f"because its samples are shorter, but a sample that long would fail. Raise "
                      f"max_tokens_per_microbatch_in_train to at least {padded_width}, or lower the sequence length",
                      OversizeSampleWarning, stacklevel=3)
    _warn_empty(seq_lens, log_prefix)
    shard = roll_shard(seq_lens, dp_size, max_tokens_per_microbatch, rnd, pipeline_model_parallel_size,
                       virtual_pipeline_model_parallel_size, microbatch_group_size_per_vp_stage, ga_steps=ga_steps,
                       model=model, cost_model=cost_model)
    if 0 in shard.micro_batch_lengths:
        log.warning("dynamic_batching_shard (%s): ROLL's micro-batch count needs a micro-batch of length 0 for the "
                    "empty samples here, as ROLL's own cut has; ROLL's micro-batch iterator narrows it to 0 columns "
                    "and fails on fields of seq_len - 1 columns", log_prefix or "no log_prefix")
    batch = origin_batch.slice()
    batch.reorder(torch.tensor(shard.order))
    batch = _join_shards(batch, len(shard.order) // shard.shard_size, shard.shard_size)
    indices = [list(r) for r in shard.micro_batch_indices]
    lengths = list(shard.micro_batch_lengths)
    meta = batch.meta_info  # ROLL's keys, written where ROLL writes them (see the module docstring)
    meta["global_micro_batch_indices"] = indices
    meta["global_micro_batch_lengths"] = lengths
    meta["micro_batch_indices"] = indices
    meta["micro_batch_lengths"] = lengths
    meta["num_micro_batchs"] = len(indices)

    padded_tokens = (sum((b - a) * s for (a, b), s in zip(indices, lengths, strict=True)) * len(shard.order)
                     // shard.shard_size)
    origin_tokens = batch_size * width
    prefix = f"dynamic_batching/{log_prefix}" if log_prefix else "dynamic_batching"
    metrics = {
        f"{prefix}/valid_tokens": int(seq_lens.sum()),
        f"{prefix}/actual_tokens_origin": origin_tokens,
        f"{prefix}/actual_tokens": padded_tokens,
        f"{prefix}/removed_padding_tokens": origin_tokens - padded_tokens,
        f"{prefix}/removed_padding_ratio": (origin_tokens - padded_tokens) / origin_tokens if origin_tokens else 0.0,
    }
    return batch, metrics


def check_budget_memory(worker_config: Any, *, role: str = "actor_train", model: Any = None,
                        gpu_memory_gb: Any = None, settings: Any = None, profile: Any = None,
                        far_under: Any = FAR_UNDER, dp_size: Optional[int] = None) -> list:
    """A ROLL worker's configured budgets against what fits the card (module docstring): ``worker_config`` ROLL's
    ``WorkerConfig`` (``pipeline_config.actor_train``, ``.reference``), ``role`` its name there (it names the
    settings in the messages); the :class:`~megatron_dynbatch.core.memory.check.BudgetVerdict` of each budget its
    dynamic batching uses, a ``BudgetWarning`` for those over what fits or far under it; ``[]`` when the card or
    the model is unknown or the worker is not on Megatron. ``model`` (else a local ``model_args.
    model_name_or_path``), ``gpu_memory_gb`` (else this process's GPU), ``settings`` (else what the strategy
    config implies; a mapping changes those fields), ``profile``, ``far_under`` (the "speed left behind"
    threshold; 0 turns it off), ``dp_size`` (else ``world_size / (tp x pp x cp)``). Bad input raises."""
    from .budget_check import warn_configured_budgets

    return warn_configured_budgets(roll_budgets(worker_config, role, dp_size), model=model,
                                   gpu_memory_gb=gpu_memory_gb, settings=settings, profile=profile, far_under=far_under)


def _lengths(origin_batch: Any) -> Tuple[np.ndarray, int]:
    """Each sample's real length (``attention_mask`` row sums) and the padded width; an empty batch, a missing
    or misshapen mask, or one whose rows are not whole counts (NaN) is an error naming it."""
    try:
        mask = origin_batch.batch["attention_mask"]
    except (KeyError, TypeError, AttributeError):
        raise DynBatchConfigError('origin_batch.batch["attention_mask"]', "missing", "ROLL reads each sample's "
                                  "length from the attention mask", "pass the batch with its attention_mask "
                                  "[batch, seq_len]") from None
    lens, width = attention_mask_lengths(mask)
    if lens.size == 0:  # a [0, seq_len] mask (check_lengths never returns an empty array)
        raise DynBatchConfigError("origin_batch", "0 samples", "an empty batch has nothing to shard (ROLL's own "
                                  "function fails on it too)", "skip dynamic batching for an empty batch")
    return lens, width


def _join_shards(batch: Any, dp: int, shard_size: int) -> Any:
    """The reordered batch cut into its ``dp`` shards and joined again as ROLL joins its shards: one shard is
    returned as it is (sharing the caller's ``meta_info``), several go through the batch's ``concat``."""
    shards = [batch.slice(r * shard_size, (r + 1) * shard_size) for r in range(dp)]
    if dp == 1:
        return shards[0]
    concat = getattr(type(batch), "concat", None)
    if not callable(concat):
        raise DynBatchConfigError("origin_batch", type(batch).__name__, "ROLL joins the dp shards with "
                                  "DataProto.concat, which this batch type lacks (its meta_info merge is part of "
                                  "what ROLL's callers see)", "pass ROLL's DataProto (or a type with its concat)")
    return concat(shards)


def _warn_empty(seq_lens: np.ndarray, log_prefix: Optional[str]) -> None:
    """ROLL logs a warning on every call whose batch has a sample with an all-zero ``attention_mask`` (before it
    plans): so does this, saying how many there are."""
    empty = int(np.count_nonzero(seq_lens == 0))
    if empty:
        log.warning("dynamic_batching_shard (%s): %d of %d samples have an all-zero attention_mask; they are "
                    "planned as empty samples. Check the rollout stage that produced them",
                    log_prefix or "no log_prefix", empty, seq_lens.size)
