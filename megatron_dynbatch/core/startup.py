"""Start-up check: the longest sample a run can produce fits one micro-batch of its budget.

A budget too small for the configured maximum sequence length otherwise fails only when such a sample first
appears -- possibly at step 500, hours in. Every launch path calls :func:`check_max_seq_len_fits` before step 1:
``megatron/args.py`` (``--seq-length`` / ``--dynbatch-max-seq-length`` against ``--max-tokens-per-gpu`` and
``--log-probs-max-tokens-per-gpu``, hence the Megatron-LM hook, which validates through it), ``RunConfig``
(``max_seq_len``, checked at construction -- so the Ray driver's ``run_config`` too) and the trainer drop-ins of
``integrations/`` wherever their configuration names a maximum length.

The check counts the same padding the planner does (CP zig-zag, TP sequence parallel, FP8 tile, a trainer's
own multiples), so it passes exactly when a sample of that length would be planned within the cap. Under the
``"error"`` policy a miss raises :class:`OversizeSampleError`; under ``"alone"`` (the trainer placed such a
sample alone, e.g. slime) it warns once with :class:`OversizeSampleWarning`, since the run then accepts
over-budget micro-batches by choice. Pure Python.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Optional, Union

from .checks import MAX_TOKENS, as_int
from .errors import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning
from .parallel import ParallelConfig

if TYPE_CHECKING:
    from .parallel import ParallelLike
    from .planner.options import ResolvedOptions

__all__ = ["check_max_seq_len_fits", "auto_profile"]


def auto_profile(options: Optional[ResolvedOptions]) -> Union[str, os.PathLike, None]:
    """The memory profile an automatic budget was chosen with: the cost-model FILE of the options (its ``memory``
    section), else ``None`` (analytic) -- as :meth:`PlanOptions.resolve` chooses it."""
    cm = options.options.cost_model if options is not None else None
    return cm if isinstance(cm, (str, os.PathLike)) else None


def check_max_seq_len_fits(max_seq_len: int, *, max_tokens_per_gpu: int, parallel: ParallelLike = None,
                           fp8_alignment: Union[None, str, int] = None, sequence_pad_multiple: Optional[int] = None,
                           microbatch_pad_multiple: Optional[int] = None, oversize: str = "error",
                           length_field: str = "max_seq_len", budget_field: str = "max_tokens_per_gpu",
                           dynamic_cp: bool = False, options: Optional[ResolvedOptions] = None) -> bool:
    """``True`` if a sample of ``max_seq_len`` tokens fits one micro-batch of ``max_tokens_per_gpu`` (x cp,
    padding included); else raise (``oversize="error"``) or warn and return ``False`` (``"alone"``).

    ``length_field`` / ``budget_field`` name the settings in the message (e.g. ``--seq-length`` and
    ``--max-tokens-per-gpu``, or verl's ``max_token_len``). ``dynamic_cp``: a sample may spread over the whole
    ``dp x cp`` pool of a stage, so the pool is its largest CP group. ``options``: the
    :class:`~megatron_dynbatch.core.planner.options.ResolvedOptions` behind the budget -- when its budget is ``auto``
    the error says what ``auto`` chose on this card, what limits it and the ways out that fit
    (:func:`~megatron_dynbatch.core.memory.auto_fit.auto_cannot_place`), never "raise the budget"."""
    import dataclasses

    from .planner.inputs import check_budget
    from .planner.options import OVERSIZE_POLICIES

    par = ParallelConfig.from_any(parallel)
    if dynamic_cp:
        par = dataclasses.replace(par, dp=1, cp=par.dp * par.cp)
    length = as_int(max_seq_len, length_field, minimum=1, maximum=MAX_TOKENS,
                    fix="pass the longest sample the run can produce (prompt + response)")
    if oversize not in OVERSIZE_POLICIES:
        raise DynBatchConfigError("oversize", oversize, "unknown oversize-sample policy",
                                  f"use one of {OVERSIZE_POLICIES}")
    _, align, cap_eff = check_budget(max_tokens_per_gpu, par, fp8_alignment, sequence_pad_multiple,
                                     microbatch_pad_multiple, field=budget_field)
    slot = int(align.seq_len(length))
    if slot <= cap_eff:
        return True
    need = align.budget_for(slot, par.cp)
    where = (f"{length_field}={length} takes {slot} tokens after alignment (per-sequence multiple "
             f"{align.seq_multiple}, micro-batch multiple {align.total_multiple}), but a micro-batch of "
             f"{budget_field}={int(max_tokens_per_gpu)} x cp={par.cp} holds {cap_eff}")
    choice = options.budget_choice if options is not None else None
    if oversize == "error" and choice is not None and options.model is not None:
        from .memory.auto_fit import auto_cannot_place

        problem, fix = auto_cannot_place(
            choice, slot, model=options.model, parallel=par, profile=auto_profile(options), fp8_alignment=fp8_alignment,
            sequence_pad_multiple=sequence_pad_multiple, microbatch_pad_multiple=microbatch_pad_multiple,
            what=f"{length_field}={length}", budget_field=budget_field)
        raise OversizeSampleError(budget_field, "auto", f"{problem}; a sample that long would stop training mid-run",
                                  f"{fix}; or lower {length_field} to what the run really produces")
    if oversize == "error":
        raise OversizeSampleError(
            budget_field, int(max_tokens_per_gpu), f"{where}: a sample that long would stop training mid-run",
            f"raise {budget_field} to at least {need}, lower {length_field} to what the run really produces, or "
            f"accept over-budget micro-batches run alone (oversize='alone', --dynbatch-oversize alone)")
    warnings.warn(f"{where}; such samples will run alone in micro-batches over the budget (oversize='alone')",
                  OversizeSampleWarning, stacklevel=2)
    return False
