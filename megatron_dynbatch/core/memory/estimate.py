"""The first memory API, kept as a thin front over :func:`~.peak.peak_memory` and :func:`~.budget.choose_budget`.

``estimate_memory(model, parallel, tokens, **knobs)`` and ``estimate_max_tokens_per_gpu(model, parallel,
gpu_mem_gb, **knobs)`` keep their keywords (``optimizer``, ``recompute``, ``weight_bytes``, ``grad_bytes``,
``logits_fp32_copies``, ``untie_embeddings``, ``expert_tensor_parallel_size``, ``moe_imbalance``,
``forward_only``, ``reserve_gb``; ``fragmentation`` and ``multiple`` for the budget) and translate them into a
:class:`~.settings.MemorySettings`; the numbers come from the one memory model the budget uses, so there is no
second copy of it. ``forward_only=True`` is a log-prob pass of a separate forward-only model (weights only), as
before. New code should call :func:`~.budget.choose_budget` (what ``megatron-dynbatch budget`` prints).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Union

from ..errors import DynBatchConfigError
from ..model_spec import ModelLike
from ..parallel import ParallelConfig
from .budget import choose_budget
from .peak import peak_memory
from .settings import DTYPE_BYTES, GiB, MemorySettings


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak memory (GiB) of the busiest GPU at ``tokens_per_gpu`` tokens per micro-batch per GPU.

    ``first_stage_gb`` and ``last_stage_gb`` are the first and last pipeline stage's peaks (the same GPU when
    ``pp == 1``); ``total_gb`` the highest stage's, reserve included; the parts are that stage's."""

    tokens_per_gpu: int
    static_gb: float
    activations_gb: float
    logits_gb: float
    reserve_gb: float
    first_stage_gb: float
    last_stage_gb: float
    total_gb: float

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)

    def summary(self) -> str:
        return (f"ESTIMATE at {self.tokens_per_gpu} tokens/GPU: static {self.static_gb:.1f} GiB, activations "
                f"{self.activations_gb:.1f} GiB, logits {self.logits_gb:.1f} GiB, reserve {self.reserve_gb:.1f} GiB "
                f"-> peak {self.total_gb:.1f} GiB")


def _dtype(nbytes: Any, field: str) -> str:
    for name in ("bf16", "fp32"):
        if nbytes == DTYPE_BYTES[name] and not isinstance(nbytes, bool):
            return name
    raise DynBatchConfigError(field, nbytes, "must be 2 (bf16/fp16) or 4 (fp32) bytes", f"pass {field}=2.0 or 4.0")


def legacy_settings(*, optimizer: str = "distributed", recompute: str = "none", weight_bytes: float = 2.0,
                    grad_bytes: float = 4.0, logits_fp32_copies: int = 1, untie_embeddings: bool = True,
                    expert_tensor_parallel_size: Optional[int] = None,
                    moe_imbalance: float = MemorySettings.moe_imbalance,
                    forward_only: bool = False, reserve_gb: float = 4.0, headroom: float = 0.10) -> MemorySettings:
    """The :class:`~.settings.MemorySettings` the old keywords mean."""
    return MemorySettings(optimizer=optimizer, recompute=recompute, param_dtype=_dtype(weight_bytes, "weight_bytes"),
                          grad_dtype=_dtype(grad_bytes, "grad_bytes"), logits_fp32_copies=logits_fp32_copies,
                          log_prob_fp32_copies=logits_fp32_copies, moe_imbalance=moe_imbalance,
                          expert_tensor_parallel_size=expert_tensor_parallel_size, untie_embeddings=untie_embeddings,
                          log_prob_static="weights", reserve_gb=reserve_gb, headroom=headroom)


def estimate_memory(model: ModelLike, parallel: Union[ParallelConfig, Dict[str, Any], None], tokens_per_gpu: int,
                    *, forward_only: bool = False, **knobs: Any) -> MemoryEstimate:
    """Estimated peak memory at ``tokens_per_gpu`` tokens per micro-batch per GPU (module docstring)."""
    st = legacy_settings(forward_only=forward_only, **knobs)
    b = peak_memory(model, parallel, tokens_per_gpu, pass_="log_prob" if forward_only else "train", settings=st)
    s = b.peak
    return MemoryEstimate(tokens_per_gpu=b.tokens_per_gpu, static_gb=s.static_bytes / GiB,
                          activations_gb=(s.activation_bytes + s.transient_bytes) / GiB, logits_gb=s.logits_bytes / GiB,
                          reserve_gb=s.reserve_bytes / GiB, first_stage_gb=b.stages[0].total_bytes / GiB,
                          last_stage_gb=b.stages[-1].total_bytes / GiB, total_gb=b.peak_gb)


def estimate_max_tokens_per_gpu(model: ModelLike, parallel: Union[ParallelConfig, Dict[str, Any], None],
                                gpu_mem_gb: float, *, fragmentation: float = 0.10, multiple: int = 256,
                                forward_only: bool = False, **knobs: Any) -> int:
    """ESTIMATED largest ``--max-tokens-per-gpu`` that fits ``gpu_mem_gb`` GiB (rounded down to ``multiple``;
    ``fragmentation`` of the card kept free). Raises :class:`DynBatchConfigError` when it cannot fit. Same as
    ``choose_budget(...).tokens_per_gpu``."""
    if not isinstance(gpu_mem_gb, (int, float)) or isinstance(gpu_mem_gb, bool) or gpu_mem_gb <= 0:
        raise DynBatchConfigError("gpu_mem_gb", gpu_mem_gb, "must be a positive number", "pass e.g. 80 for an H100")
    if not isinstance(fragmentation, (int, float)) or not 0 <= fragmentation < 1:
        raise DynBatchConfigError("fragmentation", fragmentation, "must be in [0, 1)", "use e.g. 0.1")
    st = legacy_settings(forward_only=forward_only, headroom=min(float(fragmentation), 0.9), **knobs)
    return choose_budget(model, parallel, gpu_mem_gb, pass_="log_prob" if forward_only else "train", settings=st,
                         multiple=multiple).tokens_per_gpu


__all__ = ["MemoryEstimate", "estimate_memory", "estimate_max_tokens_per_gpu", "legacy_settings"]
