"""What a user sees per step: a plan's figures as one flat dict of ``dynbatch/...`` scalars.

:func:`step_metrics` is the one place these names are made; every consumer writes the same dict -- the
Megatron-LM hook to Megatron's TensorBoard and W&B writers on the iterations Megatron logs
(:mod:`megatron_dynbatch.integrations.megatron_lm.hook`), the step API on its result
(``DynamicStepResult.metrics()``), the Ray integration on the driver's ``RolloutPlan.metrics()`` and on each
actor's ``ShardResult.metrics``.

==========================================  ========================================================================
name                                        value
==========================================  ========================================================================
``dynbatch/microbatches``                   micro-batches every GPU runs (in the step, when ``step`` is given)
``dynbatch/microbatches_lower_bound``       ``ceil(tokens / (dp x cap))`` of the plan
``dynbatch/imbalance``                      slowest over mean rank's predicted time (1.0 is perfect)
``dynbatch/real_tokens``                    tokens of the samples
``dynbatch/padding_tokens``                 alignment padding the plan adds
``dynbatch/padding_fraction``               padding over all planned tokens
``dynbatch/max_tokens_per_gpu``             the budget the plan was made with
``dynbatch/largest_microbatch_tokens``      the largest micro-batch, tokens per GPU
``dynbatch/budget_fill``                    that over the budget
``dynbatch/oversize_samples``               samples placed alone over the budget (``oversize="alone"``)
``dynbatch/predicted_step_time_s``          the cost model's time of the slowest rank (in the step, when given)
``dynbatch/measured_step_time_s``           the schedule call's wall time (when measured)
``dynbatch/predicted_peak_memory_gb``       the memory guard's predicted peak, GiB (when it runs)
``dynbatch/peak_memory_gb``                 the measured allocator peak, the largest over the ranks, GiB (when read)
==========================================  ========================================================================

Every value is a finite Python float; the measured ones are left out when unknown (``None``). Torch-free.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from .checks import as_float, as_int
from .errors import DynBatchConfigError
from .memory.profile import MAX_BYTES
from .memory.settings import GiB
from .planner.plan_kind import PlanKind

__all__ = ["step_metrics", "plan_budget", "METRIC_NAMES", "PREFIX"]

PREFIX = "dynbatch/"
#: every name :func:`step_metrics` may write (without the prefix), in its order
METRIC_NAMES = ("microbatches", "microbatches_lower_bound", "imbalance", "real_tokens", "padding_tokens",
                "padding_fraction", "max_tokens_per_gpu", "largest_microbatch_tokens", "budget_fill",
                "oversize_samples", "predicted_step_time_s", "measured_step_time_s", "predicted_peak_memory_gb",
                "peak_memory_gb")
MAX_SECONDS = 1e7


def plan_budget(plan: PlanKind) -> int:
    """The per-GPU budget a plan was made with (``max_tokens_per_gpu``)."""
    return int(plan.max_tokens_per_gpu)


def _check_plan(plan: Any) -> None:
    if not isinstance(plan, PlanKind):
        raise DynBatchConfigError("plan", type(plan).__name__, "is not a plan", "pass the Plan the step ran")


def _predicted_time(plan: PlanKind, step: Optional[int]) -> float:
    """The plan's predicted time, or its optimizer step ``step``'s where the plan lists each step's."""
    per_step_time = getattr(plan, "step_time", None)
    if step is not None and per_step_time and len(per_step_time) == len(plan.microbatches_per_step):
        return float(per_step_time[step])
    return float(plan.predicted_step_time)


def step_metrics(plan: PlanKind, *, step: Optional[int] = None, budget: Any = None, measured_step_s: Any = None,
                 measured_peak_bytes: Any = None, predicted_peak_bytes: Any = None,
                 prefix: str = PREFIX) -> Dict[str, float]:
    """The plan's figures as ``{prefix + name: float}`` (module docstring). ``step``: an optimizer step of the plan
    (its micro-batch count); ``budget``: the budget it was planned with (default: read from the plan);
    ``measured_step_s`` / ``measured_peak_bytes`` / ``predicted_peak_bytes``: left out when ``None``."""
    _check_plan(plan)
    if not isinstance(prefix, str):
        raise DynBatchConfigError("prefix", prefix, "must be a string", "pass e.g. 'dynbatch/'")
    per_step = list(plan.microbatches_per_step)
    if step is None:
        count = plan.num_microbatches
    else:
        step = as_int(step, "step", minimum=0, maximum=max(0, len(per_step) - 1), fix="pass a step of the plan")
        count = per_step[step]
    cap = plan_budget(plan) if budget is None else as_int(budget, "budget", minimum=1,
                                                           fix="pass the max_tokens_per_gpu the plan was made with")
    largest = plan.max_microbatch_tokens / plan.gpus_per_entry
    real, pad = float(plan.real_tokens), float(plan.padding_tokens)
    out: Dict[str, float] = {
        "microbatches": float(count),
        "microbatches_lower_bound": float(plan.lower_bound_microbatches),
        "imbalance": float(plan.imbalance),
        "real_tokens": real,
        "padding_tokens": pad,
        "padding_fraction": pad / (real + pad) if real + pad > 0 else 0.0,
        "max_tokens_per_gpu": float(cap),
        "largest_microbatch_tokens": float(largest),
        "budget_fill": float(largest) / cap,
        "oversize_samples": float(len(plan.oversize_samples)),
        "predicted_step_time_s": _predicted_time(plan, step),
    }
    if measured_step_s is not None:
        out["measured_step_time_s"] = as_float(measured_step_s, "measured_step_s", minimum=0.0, maximum=MAX_SECONDS,
                                               fix="pass the step's measured seconds, or None")
    for name, field, value in (("predicted_peak_memory_gb", "predicted_peak_bytes", predicted_peak_bytes),
                               ("peak_memory_gb", "measured_peak_bytes", measured_peak_bytes)):
        if value is not None:
            out[name] = as_float(value, field, minimum=0.0, maximum=MAX_BYTES,
                                 fix="pass bytes (a finite number >= 0), or None") / GiB
    bad = [k for k, v in out.items() if not math.isfinite(v)]
    if bad:  # a plan with non-finite figures (a hand-made one): refuse rather than log garbage
        raise DynBatchConfigError("plan", bad[0], "has a non-finite figure", "pass a plan made by the planner")
    return {prefix + k: v for k, v in out.items()}
