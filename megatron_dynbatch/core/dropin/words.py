"""The drop-ins' errors in their trainer's words and exception types.

A drop-in runs the planner, whose messages name the planner's own arguments (``--max-tokens-per-gpu``,
``min_num_microbatches``, ``num_microbatches_multiple``, ``lengths``, ...). A verl user never wrote those;
they wrote ``max_token_len`` and ``num_batches_divided_by``. :func:`trainer_terms` (a context manager) and
:func:`speaks` (the same as a decorator) catch a :class:`~megatron_dynbatch.core.errors.DynBatchConfigError`
and raise it again with

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

import contextlib
import functools
import re
from typing import Any, Callable, Iterator, Mapping, Optional

from ..errors import DropinAssertionError, DynBatchConfigError, OversizeAssertionError, OversizeSampleError

__all__ = ["NEMO_RL_WORDS", "ROLL_WORDS", "SLIME_WORDS", "VERL_WORDS", "reword", "speaks", "trainer_terms"]

#: planner argument -> the trainer's name for it
VERL_WORDS = {"--max-tokens-per-gpu": "max_token_len", "min_num_microbatches": "min_num_micro_batch",
              "num_microbatches_multiple": "num_batches_divided_by", "num_microbatches": "num_micro_batches",
              "microbatch_group_ids": "force_group_size", "group_ids": "uid", "lengths": "seqlen_list"}
SLIME_WORDS = {"lengths": "total_lengths", "rollout_ids": "rollout_indices", "rollouts_per_step": "global_batch_size"}
NEMO_RL_WORDS = {"--max-tokens-per-gpu": "bin_capacity", "min_num_microbatches": "min_bin_count",
                 "num_microbatches_multiple": "bin_count_multiple", "lengths": "sequence_lengths"}
ROLL_WORDS = {"--max-tokens-per-gpu": "max_tokens_per_microbatch", "lengths": "attention_mask.sum(-1)"}


def _pattern(name: str) -> "re.Pattern[str]":
    return re.compile(rf"(?<![\w\-.\[]){re.escape(name)}(?![\w\-])")


def _rename_field(field: str, words: Mapping[str, str]) -> str:
    for ours, theirs in words.items():
        if field == ours or field.startswith((ours + "[", ours + ".")):
            return theirs + field[len(ours):]
    return field


def _rename_text(text: str, words: Mapping[str, str]) -> str:
    for ours, theirs in words.items():
        if ours != "lengths":  # a common English word: renamed as a field only
            text = _pattern(ours).sub(theirs, text)
    return text


def reword(err: DynBatchConfigError, words: Mapping[str, str], *, assertion: bool = False,
           values: Optional[Mapping[str, Any]] = None) -> DynBatchConfigError:
    """``err`` in the trainer's words (see the module docstring); ``values``: the trainer's value of a field,
    by the trainer's name."""
    field = _rename_field(err.field, words)
    value = (values or {}).get(field, err.value)
    if isinstance(err, OversizeSampleError):
        cls = OversizeAssertionError if assertion or isinstance(err, AssertionError) else type(err)
    elif assertion and not isinstance(err, AssertionError):
        cls = DropinAssertionError
    else:
        cls = type(err)
    return cls(field, value, _rename_text(err.problem, words), _rename_text(err.fix, words))


@contextlib.contextmanager
def trainer_terms(words: Mapping[str, str], *, assertion: bool = False,
                  values: Optional[Mapping[str, Any]] = None) -> Iterator[None]:
    """Re-raise a ``DynBatchConfigError`` of the block in the trainer's words and type."""
    try:
        yield
    except DynBatchConfigError as err:
        raise reword(err, words, assertion=assertion, values=values).with_traceback(err.__traceback__) from None


def speaks(words: Mapping[str, str], *, assertion: bool = False) -> Callable[[Callable], Callable]:
    """:func:`trainer_terms` around a whole function."""
    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with trainer_terms(words, assertion=assertion):
                return fn(*args, **kwargs)
        return wrapper
    return deco
