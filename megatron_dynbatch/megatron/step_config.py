"""The typed arguments of one dynamic step: what to run (:class:`StepConfig`), Megatron's schedule
(:class:`MegatronSchedule`) and the observers that watch it (:class:`StepHooks`).

:func:`~.schedule.dynamic_forward_backward` takes these three objects (and the model, the batch and the plan or its
options). Its keyword arguments of before (``loss_mode=``, ``step=``, ``memory_guard=``, ``first_val_step=``, ...)
still work: :func:`split_keywords` sorts them into the three objects once, at that boundary -- a name that is no
field of any of them goes to ``forward_backward_func`` (``MegatronSchedule.extra``), as it always did.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ..core.checks import is_int
from ..core.errors import DynBatchConfigError
from .loss import GROUP_REDUCE, LOSS_MODES

__all__ = ["StepConfig", "MegatronSchedule", "StepHooks", "split_keywords"]


@dataclass(frozen=True)
class StepConfig:
    """What one call runs and returns."""

    #: loss normalisation (:mod:`megatron_dynbatch.megatron.loss`)
    loss_mode: str = "token_mean"
    group_reduce: str = "token"
    #: no backward (log-prob / reference passes); runs every step of the plan in one call
    forward_only: bool = False
    #: optimizer step of the plan to run (required when the plan has several; default 0)
    step: Optional[int] = None
    #: all-reduce the loss over the DP x CP group of the last pipeline stage (exact ``L``)
    reduce_loss: bool = True
    #: gather per-sample outputs of all DP ranks into global sample order
    gather_outputs: bool = False
    #: values Megatron's loss function returns (3: loss, num_tokens, logs; 2: loss, logs)
    tuple_size: int = 3
    #: see :func:`megatron_dynbatch.megatron.loss.make_loss_func`; ``collect`` defaults to per-token log-probs
    #: when ``forward_only``
    per_token_loss: Optional[Callable[[Any, Any], Any]] = None
    collect: Optional[Callable[[Any, Any], Any]] = None
    #: a Megatron forward step of your own (default: :func:`~.schedule.default_forward_step`)
    forward_step_func: Optional[Callable[[Any, Any], tuple]] = None
    #: packing: the token id on padding positions, where packed tensors go (default: the current CUDA device,
    #: else the CPU)
    pad_token_id: int = 0
    device: Any = None

    def __post_init__(self) -> None:
        if self.loss_mode not in LOSS_MODES:
            raise DynBatchConfigError("loss_mode", self.loss_mode, "unknown loss normalisation",
                                      f"use one of {LOSS_MODES}")
        if self.group_reduce not in GROUP_REDUCE:
            raise DynBatchConfigError("group_reduce", self.group_reduce, "unknown group reduction",
                                      f"use one of {GROUP_REDUCE}")
        if self.step is not None and (not is_int(self.step) or self.step < 0):
            raise DynBatchConfigError("step", self.step, "must be None or an optimizer step index >= 0",
                                      "pass step=0, 1, ... (one call per optimizer step of the plan)")
        if self.tuple_size not in (2, 3):
            raise DynBatchConfigError("tuple_size", self.tuple_size, "Megatron loss functions return 2 or 3 values",
                                      "use tuple_size=3 (loss, num_tokens, logs) or 2 (loss, logs)")


@dataclass(frozen=True)
class MegatronSchedule:
    """Megatron's side of the call."""

    #: the model's ``TransformerConfig`` (default: read from the model)
    config: Any = None
    #: the schedule (default: ``megatron.core.pipeline_parallel.get_forward_backward_func()``)
    forward_backward_func: Optional[Callable[..., Any]] = None
    #: further keywords for ``forward_backward_func`` (e.g. ``first_val_step``)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepHooks:
    """Observers of a training step (neither changes the loss)."""

    #: an :class:`~.online_calibration.OnlineCalibrator` (online calibration; module docstring of
    #: :mod:`.schedule`)
    calibrator: Any = None
    #: a :class:`~.memory_guard.StepMemoryGuard` (online memory guard)
    memory_guard: Any = None
    #: the first step protected (:mod:`.probe`): a :class:`~.probe.FirstStepProbe`, ``False`` (off) or ``None``
    #: (the options' ``memory_probe``: on where a CUDA device is present)
    memory_probe: Any = None


_OWNERS = (StepConfig, MegatronSchedule, StepHooks)


def split_keywords(keywords: Mapping[str, Any], step_config: Optional[StepConfig] = None,
                   schedule: Optional[MegatronSchedule] = None,
                   hooks: Optional[StepHooks] = None) -> Tuple[StepConfig, MegatronSchedule, StepHooks]:
    """The three objects from the given ones (default: defaults) with the keywords of the older signature put
    where they belong; a keyword that names no field goes to ``forward_backward_func`` (``extra``)."""
    given = [step_config or StepConfig(), schedule or MegatronSchedule(), hooks or StepHooks()]
    routed: list = [{}, {}, {}]
    extra: Dict[str, Any] = {}
    for name, value in keywords.items():
        owner = next((k for k, cls in enumerate(_OWNERS) if name in {f.name for f in fields(cls)} and name != "extra"),
                     None)
        if owner is None:
            extra[name] = value
        else:
            routed[owner][name] = value
    cfg, sched, obs = (replace(obj, **kw) if kw else obj for obj, kw in zip(given, routed, strict=True))
    if extra:
        sched = replace(sched, extra={**sched.extra, **extra})
    return cfg, sched, obs
