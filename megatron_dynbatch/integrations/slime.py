"""Drop-in for slime's ``slime.utils.dp_schedule.build_dp_schedule``: change one import in slime's
``slime/ray/rollout.py``::

    from megatron_dynbatch.integrations.slime import build_dp_schedule   # was: from slime.utils.dp_schedule ...

Same signature, same four results (see :mod:`megatron_dynbatch.core.dropin.slime` for the contract and what
changes). Read from slime's ``args`` (its Megatron args): ``use_dynamic_batch_size``, ``max_tokens_per_gpu``,
``micro_batch_size``, ``balance_data``, ``data_pad_size_multiplier`` (default 128), the model shape (FLOPs
balance; tokens when the args carry no model), ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
``sequence_parallel``, and optionally ``dynbatch_oversize`` (``"alone"`` -- slime's policy -- by default).
From ``train_parallel_config``: ``dp_size``, ``cp_size``, ``vpp_size``, ``microbatch_group_size_per_vp_stage``.

Start-up check: on the first call for an ``args`` object, the longest sample slime can produce
(``rollout_max_prompt_len + rollout_max_response_len``, else ``seq_length``) is checked against the budget
(padding included): an error under ``dynbatch_oversize="error"``, a warning under slime's ``"alone"``.
Then, when the card and the model are known, ``--max-tokens-per-gpu`` and ``--log-probs-max-tokens-per-gpu``
are judged against what the memory model says fits (:func:`check_budget_memory`): a
:class:`~megatron_dynbatch.core.errors.BudgetWarning` when one is over it (out of memory ahead) or under 60% of it
(speed left behind), naming the value to use. The model is the one ``args`` describe; the card is
``args.dynbatch_gpu_memory_gb`` if set, else the GPU of this process when it already uses one (slime's rollout
manager usually does not: call :func:`check_budget` at actor init, where it does). :func:`check_budget` runs the
whole start-up check explicitly. Pure Python: nothing is imported from slime or torch.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional, Tuple

from ..core.checks import as_bool, as_int
from ..core.checks import get_arg as _get
from ..core.dropin.budgets import slime_budgets
from ..core.dropin.slime import check_pad_budget, slime_parallel, slime_schedule
from ..core.dropin.words import SLIME_WORDS, speaks
from ..core.errors import BudgetWarning, DynBatchConfigError
from ..core.memory.check import FAR_UNDER
from .budget_check import warn_configured_budgets

__all__ = ["build_dp_schedule", "check_budget", "check_budget_memory", "model_from_args"]

#: attribute set on slime's args once the start-up check ran
_CHECKED = "_dynbatch_budget_checked"


def model_from_args(args: Any) -> Any:
    """The ``ModelSpec`` of slime's Megatron args, or ``None`` when they do not describe a model."""
    from ..core.model_spec import ModelSpec

    try:
        return ModelSpec.from_megatron(args)
    except (DynBatchConfigError, TypeError, ValueError):
        return None


def _parallel(args: Any, train_parallel_config: dict):
    try:
        dp = train_parallel_config["dp_size"]
        cp = train_parallel_config.get("cp_size", 1)
        vpp = train_parallel_config.get("vpp_size", 1)
        n = train_parallel_config.get("microbatch_group_size_per_vp_stage")
    except (TypeError, KeyError, AttributeError):
        raise DynBatchConfigError("train_parallel_config", train_parallel_config, "needs dp_size (and cp_size, "
                                  "vpp_size, microbatch_group_size_per_vp_stage)",
                                  "pass slime's train_parallel_config dict") from None
    pp = _get(args, "pipeline_model_parallel_size")
    pp = None if pp is None else as_int(pp, "--pipeline-model-parallel-size", minimum=1)
    return slime_parallel(dp, cp, vpp, n,
                          tp=as_int(_get(args, "tensor_model_parallel_size", 1), "--tensor-model-parallel-size",
                                    minimum=1),
                          pp=pp if pp is not None and pp > 1 else None,
                          sequence_parallel=as_bool(_get(args, "sequence_parallel", False), "--sequence-parallel"),
                          ep=as_int(_get(args, "expert_model_parallel_size", 1), "--expert-model-parallel-size",
                                    minimum=1))


def check_budget(args: Any, train_parallel_config: dict, *, gpu_memory_gb: Any = None) -> Optional[bool]:
    """The start-up check of the module docstring: whether the longest sample fits (``None`` when neither a budget
    nor a length is configured), then the memory check (:func:`check_budget_memory`; ``gpu_memory_gb``: the card
    in GiB when this process cannot read it). The memory check never stops the run: a problem with its own input
    becomes a :class:`~megatron_dynbatch.core.errors.BudgetWarning` saying it was skipped."""
    if not _get(args, "use_dynamic_batch_size", False) or _get(args, "max_tokens_per_gpu") is None:
        return None
    fits = _check_longest(args, train_parallel_config)
    try:
        check_budget_memory(args, train_parallel_config, gpu_memory_gb=gpu_memory_gb)
    except DynBatchConfigError as err:
        warnings.warn(f"start-up memory check of --max-tokens-per-gpu skipped: {err}", BudgetWarning, stacklevel=2)
    return fits


def check_budget_memory(args: Any, train_parallel_config: dict, *, gpu_memory_gb: Any = None, model: Any = None,
                        settings: Any = None, profile: Any = None, far_under: Any = FAR_UNDER) -> list:
    """``--max-tokens-per-gpu`` and ``--log-probs-max-tokens-per-gpu`` against what fits the card (module
    docstring): the :class:`~megatron_dynbatch.core.memory.check.BudgetVerdict` of each, a ``BudgetWarning`` for
    those over it or far under it; ``[]`` when the card or the model is unknown. ``gpu_memory_gb`` (else
    ``args.dynbatch_gpu_memory_gb``, else this process's GPU), ``model`` (else the one ``args`` describe),
    ``settings`` (else what the Megatron flags imply; a mapping changes those fields), ``profile``, ``far_under``
    (the "speed left behind" threshold; 0 turns it off): as
    :func:`~megatron_dynbatch.integrations.budget_check.warn_configured_budgets` takes them. Bad input raises."""
    card = gpu_memory_gb if gpu_memory_gb is not None else _get(args, "dynbatch_gpu_memory_gb")
    par = _parallel(args, train_parallel_config)
    return warn_configured_budgets(slime_budgets(args, par, model_from_args(args)), model=model,
                                   gpu_memory_gb=card, settings=settings, profile=profile, far_under=far_under)


def _check_longest(args: Any, train_parallel_config: dict) -> Optional[bool]:
    """The longest sample slime can produce against the budget; ``None`` when no length is configured."""
    prompt, response = _get(args, "rollout_max_prompt_len"), _get(args, "rollout_max_response_len")
    both = prompt is not None and response is not None
    if both:
        prompt = as_int(prompt, "--rollout-max-prompt-len", minimum=0)
        response = as_int(response, "--rollout-max-response-len", minimum=0)
    longest = prompt + response if both else _get(args, "seq_length")
    if longest is None:
        return None
    from ..core.startup import check_max_seq_len_fits

    par = _parallel(args, train_parallel_config)
    pad = check_pad_budget(args.max_tokens_per_gpu, par, _get(args, "data_pad_size_multiplier", 128),
                           assumed=_get(args, "data_pad_size_multiplier") is None)
    return check_max_seq_len_fits(longest, max_tokens_per_gpu=args.max_tokens_per_gpu, parallel=par,
                                  microbatch_pad_multiple=pad,
                                  oversize=_get(args, "dynbatch_oversize", "alone"),
                                  length_field="rollout_max_prompt_len + rollout_max_response_len" if both
                                  else "seq_length",
                                  budget_field="--max-tokens-per-gpu")


@speaks(SLIME_WORDS, assertion=True)
def build_dp_schedule(
        args: Any, train_parallel_config: dict, total_lengths: List[int], *, global_batch_size: int,
        rollout_indices: List[int]) -> Tuple[List[List[int]], List[List[List[int]]], List[int], List[int]]:
    """slime's ``build_dp_schedule`` on megatron-dynbatch's planner: ``(partitions, micro_batch_indices,
    num_microbatches, global_batch_sizes)`` (see the module docstring)."""
    if not getattr(args, _CHECKED, False):  # once per args object (slime keeps one for the whole run)
        check_budget(args, train_parallel_config)
        try:
            setattr(args, _CHECKED, True)
        except AttributeError:  # a frozen args object: check on every call (cheap)
            pass
    dynamic = as_bool(_get(args, "use_dynamic_batch_size", False), "--use-dynamic-batch-size")
    schedule = slime_schedule(
        total_lengths, rollout_indices=rollout_indices, global_batch_size=global_batch_size,
        parallel=_parallel(args, train_parallel_config),
        max_tokens_per_gpu=_get(args, "max_tokens_per_gpu"), use_dynamic_batch_size=dynamic,
        micro_batch_size=_get(args, "micro_batch_size"), balance_data=_get(args, "balance_data", False),
        model=model_from_args(args), data_pad_size_multiplier=_get(args, "data_pad_size_multiplier", 128),
        pad_multiplier_assumed=_get(args, "data_pad_size_multiplier") is None,
        oversize=_get(args, "dynbatch_oversize", "alone"))
    return schedule.as_tuple()
