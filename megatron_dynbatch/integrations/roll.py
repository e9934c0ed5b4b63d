"""Drop-in for ROLL's ``roll.utils.dynamic_batching.dynamic_batching_shard`` (what ``use_dynamic_batching_in_train``
and ``max_tokens_per_microbatch_in_train`` drive): change the import in ROLL's pipelines::

    from megatron_dynbatch.integrations.roll import dynamic_batching_shard   # was: from roll.utils.dynamic_batching

Same signature ``(origin_batch, dp_size, max_tokens_per_microbatch, sequence_length_round,
pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, log_prefix=None)``, same result
``(batch, metrics)``: the batch reordered into ``dp_size`` equal shards with ``meta_info`` keys
``global_micro_batch_indices``, ``global_micro_batch_lengths``, ``micro_batch_indices``, ``micro_batch_lengths``,
``num_micro_batchs`` as ROLL's ``make_mini_batch_iter_for_dynamic_batching`` / ``make_micro_batch_iter_...``
read them, and ROLL's metric names. What changes -- a cost-model cut of the micro-batches, Megatron's exact VPP
rule, a snake deal of real tokens over ranks, a clear error for a sample over the budget -- is in
:mod:`megatron_dynbatch.core.dropin.roll`.

Extra keyword-only arguments (optional): ``microbatch_group_size_per_vp_stage`` (Megatron's ``N``; default
``pp``), ``model`` (cost model of the trained model; default tokens), ``cost_model``.

Start-up check: the padded width of the batch (ROLL's ``sequence_length``, the configured maximum), rounded to
``sequence_length_round``, must fit ``max_tokens_per_microbatch`` -- checked on the first batch, before any
compute, rather than when the first long sample arrives. Needs only the DataProto methods ROLL's own function
uses (``batch["attention_mask"]``, ``slice()``, ``reorder()``, ``meta_info``); torch is imported lazily.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from ..core.checks import as_int
from ..core.dropin.roll import roll_shard
from ..core.errors import OversizeSampleError

__all__ = ["dynamic_batching_shard"]


def dynamic_batching_shard(origin_batch: Any, dp_size: int, max_tokens_per_microbatch: int,
                           sequence_length_round: int, pipeline_model_parallel_size: int = 1,
                           virtual_pipeline_model_parallel_size: Optional[int] = None, log_prefix: Optional[str] = None,
                           *, microbatch_group_size_per_vp_stage: Optional[int] = None, model: Any = None,
                           cost_model: Any = None) -> Tuple[Any, dict]:
    """ROLL's ``dynamic_batching_shard`` with this project's guarantees (see the module docstring)."""
    import torch

    max_tokens_per_microbatch = as_int(max_tokens_per_microbatch, "max_tokens_per_microbatch", minimum=1,
                                       fix="pass max_tokens_per_microbatch_in_train")
    rnd = as_int(sequence_length_round, "sequence_length_round", minimum=1,
                 fix="pass sequence_length_round_in_train (e.g. 64)")
    mask = origin_batch.batch["attention_mask"]
    batch_size = int(mask.shape[0])
    width = int(mask.shape[-1])
    padded_width = max(-(-width // rnd) * rnd, rnd)
    if padded_width > max_tokens_per_microbatch:
        raise OversizeSampleError(
            "max_tokens_per_microbatch", int(max_tokens_per_microbatch),
            f"the configured sequence length {width} ({padded_width} rounded to {rnd}) does not fit one micro-batch",
            f"raise max_tokens_per_microbatch_in_train to at least {padded_width}, or lower the sequence length")
    seq_lens = [int(x) for x in mask.reshape(batch_size, -1).sum(-1).tolist()]
    shard = roll_shard(seq_lens, dp_size, max_tokens_per_microbatch, sequence_length_round,
                       pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
                       microbatch_group_size_per_vp_stage, model=model, cost_model=cost_model)
    batch = origin_batch.slice()
    batch.reorder(torch.tensor(shard.order))
    indices = [list(r) for r in shard.micro_batch_indices]
    lengths = list(shard.micro_batch_lengths)
    batch.meta_info["global_micro_batch_indices"] = indices
    batch.meta_info["global_micro_batch_lengths"] = lengths
    batch.meta_info["micro_batch_indices"] = [list(r) for r in indices]
    batch.meta_info["micro_batch_lengths"] = list(lengths)
    batch.meta_info["num_micro_batchs"] = len(indices)

    padded_tokens = sum((b - a) * s for (a, b), s in zip(indices, lengths)) * len(shard.order) // shard.shard_size
    origin_tokens = batch_size * width
    prefix = f"dynamic_batching/{log_prefix}" if log_prefix else "dynamic_batching"
    metrics = {
        f"{prefix}/valid_tokens": sum(seq_lens),
        f"{prefix}/actual_tokens_origin": origin_tokens,
        f"{prefix}/actual_tokens": padded_tokens,
        f"{prefix}/removed_padding_tokens": origin_tokens - padded_tokens,
        f"{prefix}/removed_padding_ratio": (origin_tokens - padded_tokens) / origin_tokens if origin_tokens else 0.0,
    }
    return batch, metrics
