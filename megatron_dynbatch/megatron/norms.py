"""Pure-torch layers that let Megatron's LOCAL layer spec run with sequence parallelism (no Apex, no TE).

megatron-core's torch norm (``WrappedTorchNorm``, used by the local spec when Apex is missing) refuses
``config.sequence_parallel``: with sequence parallelism every TP rank normalises a different ``1/tp`` slice of
the tokens, so each rank's norm-weight gradient is only a partial sum, and Megatron's
``finalize_model_grads`` all-reduces (sums) over TP exactly the gradients of parameters marked
``param.sequence_parallel = True`` (Apex's ``FusedLayerNorm`` and TE's ``TENorm`` set that mark; the torch
norm does not, hence the refusal).

:class:`SequenceParallelTorchNorm` is ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm`` (chosen by
``config.normalization``, same math, same parameter names ``weight`` / ``bias``) whose parameters carry that
mark when ``config.sequence_parallel`` is on. It plugs into the local spec wherever ``WrappedTorchNorm`` does
(``input_layernorm``, ``pre_mlp_layernorm``, the block's ``final_layernorm``):
:func:`megatron_dynbatch.megatron.specs.get_thd_local_block_spec` builds a whole decoder-block spec with it (the
final norm of a block built from a LAYER spec is hard-wired to ``WrappedTorchNorm``, so a block spec is needed).

For tests, the CPU demo and debugging; on GPU use the TE spec (``TENorm``).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from ..core.errors import DynBatchConfigError

__all__ = ["SequenceParallelTorchNorm", "QKTorchNorm", "use_sequence_parallel_norms"]


def _check_config(config: Any) -> None:
    for flag, why in (("layernorm_zero_centered_gamma", "zero-centered gamma"),
                      ("persist_layer_norm", "persistent layer norm kernels"),
                      ("memory_efficient_layer_norm", "memory-efficient layer norm")):
        if getattr(config, flag, False):
            raise DynBatchConfigError(f"config.{flag}", True, f"{why} is not supported by the pure-torch norm",
                                      f"set {flag}=False (or use Transformer Engine on GPU)")


class SequenceParallelTorchNorm:
    """``WrappedTorchNorm`` without the sequence-parallel refusal: returns a ``torch.nn.RMSNorm`` or
    ``torch.nn.LayerNorm`` (per ``config.normalization``) of ``hidden_size`` whose parameters are marked
    ``sequence_parallel = config.sequence_parallel`` so ``finalize_model_grads`` sums their gradients over TP.

    Same constructor as ``WrappedTorchNorm`` (what ``build_module`` passes). ``L2Norm`` has no parameters and
    is returned as megatron-core's own ``L2Norm``.
    """

    #: whether the parameters get the ``sequence_parallel`` mark (q/k norms act on head_dim after a
    #: column-parallel linear, not on sequence-parallel tokens: :class:`QKTorchNorm` leaves it off)
    mark_sequence_parallel = True

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: Optional[str] = None) -> torch.nn.Module:
        _check_config(config)
        kind = getattr(config, "normalization", None) or normalization or "LayerNorm"
        if kind == "RMSNorm":
            module: torch.nn.Module = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        elif kind == "LayerNorm":
            module = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        elif kind == "L2Norm":
            from megatron.core.transformer.torch_norm import L2Norm

            return L2Norm(hidden_size=hidden_size, eps=eps)
        else:
            raise DynBatchConfigError("config.normalization", kind, "not supported by the pure-torch norm",
                                      "use 'RMSNorm', 'LayerNorm' or 'L2Norm'")
        if cls.mark_sequence_parallel:
            sp = bool(getattr(config, "sequence_parallel", False))
            for p in module.parameters():
                setattr(p, "sequence_parallel", sp)
        return module


class QKTorchNorm(SequenceParallelTorchNorm):
    """The same norm for ``q_layernorm`` / ``k_layernorm`` (over ``head_dim``): no ``sequence_parallel`` mark
    (Megatron already sums q/k-norm gradients over TP when ``config.qk_layernorm``)."""

    mark_sequence_parallel = False


def use_sequence_parallel_norms(layer_spec: Any) -> Any:
    """A deep copy of a local GPT LAYER spec whose torch norms (``WrappedTorchNorm``) are replaced by
    :class:`SequenceParallelTorchNorm` (``input_layernorm``, ``pre_mlp_layernorm``) and :class:`QKTorchNorm`
    (``q_layernorm`` / ``k_layernorm`` of the self-attention, when they are norms)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = copy.deepcopy(layer_spec)
    sub = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, name, None) is WrappedTorchNorm:
            setattr(sub, name, SequenceParallelTorchNorm)
    attn_sub = getattr(getattr(sub, "self_attention", None), "submodules", None)
    for name in ("q_layernorm", "k_layernorm"):
        if attn_sub is not None and getattr(attn_sub, name, None) is WrappedTorchNorm:
            setattr(attn_sub, name, QKTorchNorm)
    return spec
