"""The drop-ins' errors in their trainer's words and exception types.

A drop-in runs the planner, whose messages name the planner's own arguments (``max_tokens_per_gpu``,
``min_num_microbatches``, ``num_microbatches_multiple``, ``lengths``, ...). A verl user never wrote those;
they wrote ``max_token_len`` and ``num_batches_divided_by``. The maps below give each trainer's words;
:func:`~megatron_dynbatch.core.errors.trainer_terms` (a context manager) and
:func:`~megatron_dynbatch.core.errors.speaks` (the same as a decorator) catch a
:class:`~megatron_dynbatch.core.errors.DynBatchConfigError` and raise it again with

* the field renamed to the trainer's name (``lengths[3]`` -> ``total_lengths[3]``), and its value replaced
  where the trainer counts differently (verl's ``max_token_len`` is the budget times ``cp``);
* every whole-word mention of a planner argument in the problem and the fix renamed the same way;
* with ``assertion=True`` -- where the trainer's own function raises ``AssertionError`` for bad input --
  the type :class:`~megatron_dynbatch.core.errors.DropinAssertionError` (or
  :class:`~megatron_dynbatch.core.errors.OversizeAssertionError` for an over-budget sample): both ours and the
  trainer's, so callers and tests written against the trainer keep catching it.

The traceback still points where the error was raised. Pure Python.
"""

from __future__ import annotations

from ..errors import reword, speaks, trainer_terms  # noqa: F401 -- the drop-ins use them with these maps

__all__ = ["NEMO_RL_WORDS", "ROLL_WORDS", "SLIME_WORDS", "VERL_WORDS", "reword", "speaks", "trainer_terms"]

#: planner argument -> the trainer's name for it
VERL_WORDS = {"max_tokens_per_gpu": "max_token_len", "min_num_microbatches": "min_num_micro_batch",
              "num_microbatches_multiple": "num_batches_divided_by", "num_microbatches": "num_micro_batches",
              "microbatch_group_ids": "force_group_size", "group_ids": "uid", "lengths": "seqlen_list"}
SLIME_WORDS = {"lengths": "total_lengths", "rollout_ids": "rollout_indices", "rollouts_per_step": "global_batch_size"}
NEMO_RL_WORDS = {"max_tokens_per_gpu": "bin_capacity", "min_num_microbatches": "min_bin_count",
                 "num_microbatches_multiple": "bin_count_multiple", "lengths": "sequence_lengths"}
ROLL_WORDS = {"max_tokens_per_gpu": "max_tokens_per_microbatch", "lengths": "attention_mask.sum(-1)"}


