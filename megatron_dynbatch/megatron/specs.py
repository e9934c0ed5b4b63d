"""Layer and block specs for megatron-core's LOCAL (non-Transformer-Engine) GPT model with packed THD input.

Assembles the two pure-torch parts of this package into megatron-core specs: :class:`ThdDotProductAttention`
(:mod:`.attention`) as the core attention, and the sequence-parallel-capable torch norms (:mod:`.norms`) in
place of megatron-core's ``WrappedTorchNorm`` when sequence parallelism is on. For CPU tests, the demo and
debugging; on GPU the Transformer Engine spec is used unchanged. Kept apart from both modules so that neither
imports the other.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from ..core.errors import DynBatchConfigError
from .attention import ThdDotProductAttention
from .norms import SequenceParallelTorchNorm, use_sequence_parallel_norms

__all__ = ["get_thd_local_layer_spec", "get_thd_local_block_spec"]


def get_thd_local_layer_spec(sequence_parallel: bool = False, **kwargs: Any):
    """``get_gpt_layer_local_spec(**kwargs)`` with :class:`ThdDotProductAttention` as core attention.

    ``sequence_parallel=True`` also swaps megatron-core's torch norms (which refuse sequence parallelism) for
    :class:`megatron_dynbatch.megatron.norms.SequenceParallelTorchNorm` (same math, parameters marked
    ``sequence_parallel``). The final norm of the decoder block is not part of a layer spec: use
    :func:`get_thd_local_block_spec` for a whole block under sequence parallelism.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(**kwargs))
    try:
        attn = spec.submodules.self_attention.submodules
        attn.core_attention  # noqa: B018 - existence check
    except AttributeError as exc:
        raise DynBatchConfigError("layer_spec", type(spec).__name__, "has no self_attention.core_attention",
                                  "use a dense or MoE GPT local spec") from exc
    attn.core_attention = ThdDotProductAttention
    if sequence_parallel:
        spec = use_sequence_parallel_norms(spec)
    return spec


def get_thd_local_block_spec(config: Any, *, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                             **layer_kwargs: Any):
    """A ``TransformerBlockSubmodules`` for ``GPTModel(transformer_layer_spec=...)``: this pipeline stage's
    layers built from :func:`get_thd_local_layer_spec` (THD core attention;
    sequence-parallel torch norms when ``config.sequence_parallel``) and, as the final norm,
    :class:`SequenceParallelTorchNorm` (a block built from a layer spec would hard-wire ``WrappedTorchNorm``,
    which refuses sequence parallelism). ``layer_kwargs`` go to ``get_gpt_layer_local_spec`` (``normalization``
    defaults to ``config.normalization``)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer_kwargs.setdefault("normalization", getattr(config, "normalization", None))
    layer_kwargs.setdefault("sequence_parallel", bool(getattr(config, "sequence_parallel", False)))
    layer = get_thd_local_layer_spec(**layer_kwargs)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=SequenceParallelTorchNorm)
