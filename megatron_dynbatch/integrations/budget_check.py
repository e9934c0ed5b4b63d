"""The drop-ins' start-up memory check: the card, and a :class:`~megatron_dynbatch.core.errors.BudgetWarning` per
configured budget that is over what fits (out of memory ahead) or far under it (speed left behind).

Each drop-in reads its trainer's config with :mod:`megatron_dynbatch.core.dropin.budgets` and hands the result to
:func:`warn_configured_budgets`, which judges every budget with
:func:`~megatron_dynbatch.core.memory.check.check_configured_budget` and warns. It is skipped -- silently, nothing
returned -- when the card or the model is not known, or the trainer does not train with Megatron there.

**The card** (:func:`device_gpu_memory_gb`): an explicit ``gpu_memory_gb=`` wins; else the current CUDA device's
memory as torch reports it, read only where this process already uses the GPU -- torch imported and CUDA
initialised. The check never imports torch nor initialises CUDA itself (a trainer's driver or rollout manager
that forks workers must not hold a CUDA context), so where the drop-in runs on a process without the GPU
(verl's driver, slime's rollout manager), pass ``gpu_memory_gb=`` or call the check from a worker. A card that
reads as 0, negative or NaN counts as unknown; an explicit bad value is an error naming ``gpu_memory_gb``.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, List, Optional

from ..core.dropin.budgets import ConfiguredBudgets
from ..core.errors import BudgetWarning, DynBatchConfigError
from ..core.memory.check import FAR_UNDER, BudgetVerdict, card_or_none, check_configured_budget
from ..core.memory.settings import MemorySettings

__all__ = ["device_gpu_memory_gb", "warn_configured_budgets"]


def device_gpu_memory_gb(torch_module: Any = None) -> Optional[float]:
    """The current CUDA device's memory in GiB (``total_memory / 2**30``, as ``measure.whole_model.
    device_memory_gb`` reads it) where this process already uses the GPU, else ``None`` (module docstring).
    ``torch_module``: the torch to ask, default the one already imported (if any) -- the seam CPU tests use."""
    torch = torch_module if torch_module is not None else sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_available() or not cuda.is_initialized():
            return None
        return card_or_none(cuda.get_device_properties(cuda.current_device()).total_memory / float(1 << 30))
    except Exception:  # noqa: BLE001 -- a device that cannot be asked is an unknown card: the check is skipped
        return None


def warn_configured_budgets(configured: Optional[ConfiguredBudgets], *, model: Any = None,
                            gpu_memory_gb: Any = None, settings: Any = None, profile: Any = None,
                            far_under: Any = FAR_UNDER, stacklevel: int = 3) -> List[BudgetVerdict]:
    """Judge every budget of ``configured`` and warn (:class:`~megatron_dynbatch.core.errors.BudgetWarning`) for
    each that is over what fits or far under it; return the verdicts (``[]`` when skipped: no config, no model,
    no card). ``model``: overrides the config's (a preset name, a ``config.json`` path, a ``ModelSpec``);
    ``settings``: a :class:`~megatron_dynbatch.core.memory.MemorySettings` replaces the config's (its ``trainer``
    left at the default ``megatron-lm`` means this drop-in's trainer: its loss path is counted), a mapping
    changes those fields of it; ``profile``: a calibrated cost-model file (its ``memory`` section). A config that
    does not give the data-parallel size, with the distributed optimizer, is an error naming ``dp_size``."""
    if configured is None or not configured.budgets:
        return []
    model = configured.model if model is None else model
    card = device_gpu_memory_gb() if gpu_memory_gb is None else gpu_memory_gb
    if model is None or card is None:
        return []
    if settings is None:
        st = configured.settings
    elif isinstance(settings, MemorySettings):  # left at the default trainer: this drop-in's trainer's loss path
        st = settings if settings.trainer != "megatron-lm" else settings.replace(trainer=configured.trainer)
    else:
        MemorySettings.from_any(settings)  # unknown fields and bad values: an error naming them
        st = configured.settings.replace(**dict(settings))
    if not configured.dp_known and st.optimizer == "distributed":
        raise DynBatchConfigError(
            "dp_size", None, f"{configured.trainer}'s config given does not say the data-parallel size, and the "
            "distributed optimizer's state per GPU depends on it",
            "pass dp_size= (the GPUs that train the model / (tp x pp x cp)), or the whole config that says it")
    out = []
    for setting, value, note in configured.budgets:
        verdict = check_configured_budget(setting, value, model, configured.parallel, card,
                                          trainer=configured.trainer, settings=st, profile=profile,
                                          far_under=far_under, note=note)
        if verdict.warn:
            warnings.warn(verdict.message, BudgetWarning, stacklevel=stacklevel)
        out.append(verdict)
    return out
