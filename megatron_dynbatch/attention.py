"""A pure-torch core attention for Megatron's LOCAL layer spec that understands THD ``PackedSeqParams``.

Megatron-core's local ``DotProductAttention`` refuses ``packed_seq_params`` (THD is a Transformer Engine
feature), so packed micro-batches could not run on CPU. :class:`ThdDotProductAttention` is a reference
implementation for tests, the CPU demo and debugging -- not a fast kernel; on GPU keep the TE layer spec
(``TEDotProductAttention`` with cuDNN fused / flash attention) unchanged.

What Megatron's ``Attention.forward`` (0.16.x) hands the core attention with ``qkv_format="thd"``:
query ``[t, heads, head_dim]``, key/value ``[t, query_groups, head_dim]`` (GQA not expanded, RoPE already
applied per sequence from ``cu_seqlens_*_padded``); it reshapes our ``[t, heads*head_dim]`` result to
``[t, 1, hidden]`` for the output projection. (This module also accepts a ``[t, 1, heads, head_dim]`` query.)

Semantics, per packed sequence ``i``: the rows ``cu_seqlens_q_padded[i] + [0, L_i)`` (``L_i`` from the real
``cu_seqlens_q``) attend causally to the same rows of key/value -- never to another sequence and never to
padding; padding rows output exactly 0 (so they also get no gradient). Without ``packed_seq_params`` the
module is Megatron's own ``DotProductAttention`` (sbhd), so one spec serves packed and unpacked inputs.

Limits (a clear error, not silent wrong results): no context parallelism (``t`` must equal the full packed
length), no sliding-window attention, no attention sinks (``softmax_type != "vanilla"``), no attention bias.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import Tensor

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from .errors import DynBatchConfigError

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)
_FULL = (AttnMaskType.no_mask, AttnMaskType.padding)


class ThdDotProductAttention(DotProductAttention):
    """Drop-in for ``DotProductAttention`` (same constructor) that also runs THD varlen causal attention."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Any = None) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        # The sbhd path divides the scale by layer_number and FusedScaleMaskSoftmax multiplies it back.
        coeff = self.scale_mask_softmax.scale
        self.thd_softmax_scale = self.softmax_scale * (coeff if coeff is not None else 1.0)
        self.thd_window_size = self.scale_mask_softmax.window_size

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Any = None) -> Tensor:
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
            if packed_seq_params is not None:
                raise DynBatchConfigError("packed_seq_params.qkv_format", packed_seq_params.qkv_format,
                                          "ThdDotProductAttention only understands THD packing",
                                          "pass qkv_format='thd' or no packed_seq_params")
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        self._check_thd_supported(attention_bias)
        if query.dim() == 4:  # [t, 1, heads, head_dim]
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type in _CAUSAL:
            causal = True
        elif mask_type in _FULL:
            causal = False
        else:
            raise DynBatchConfigError("attn_mask_type", mask_type, "not supported with THD packing",
                                      "use AttnMaskType.causal (or no_mask for bidirectional attention)")
        return self._thd_attention(query, key, value, packed_seq_params, causal)

    # ----------------------------------------------------------------------------------------- internals
    def _check_thd_supported(self, attention_bias: Optional[Tensor]) -> None:
        if attention_bias is not None:
            raise DynBatchConfigError("attention_bias", "tensor", "not supported by the CPU THD attention",
                                      "drop the attention bias or use Transformer Engine on GPU")
        if self.softmax_offset is not None:
            raise DynBatchConfigError("config.softmax_type", self.config.softmax_type,
                                      "attention sinks are not implemented in the CPU THD attention",
                                      "use softmax_type='vanilla' or Transformer Engine on GPU")
        if self.thd_window_size is not None:
            raise DynBatchConfigError("config.window_size", self.thd_window_size,
                                      "sliding-window attention is not implemented in the CPU THD attention",
                                      "use full causal attention or Transformer Engine on GPU")

    def _thd_attention(self, query: Tensor, key: Tensor, value: Tensor, params: Any, causal: bool) -> Tensor:
        t, heads, head_dim = query.shape
        groups = key.shape[1]
        cu_q = params.cu_seqlens_q.tolist()
        cu_kv = (params.cu_seqlens_kv if params.cu_seqlens_kv is not None else params.cu_seqlens_q).tolist()
        pad_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        pad_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else pad_q
        pad_q, pad_kv = pad_q.tolist(), pad_kv.tolist()
        if pad_q[-1] != t or pad_kv[-1] != key.shape[0]:
            raise DynBatchConfigError(
                "query.shape[0]", t,
                f"the packed length is cu_seqlens_q_padded[-1]={pad_q[-1]}; context-parallel slices are not "
                "supported by the CPU THD attention",
                "run with cp=1 on CPU (use Transformer Engine for context parallelism)",
            )
        rep = heads // groups
        pieces = []
        cursor = 0
        for i in range(len(cu_q) - 1):
            start, length = pad_q[i], cu_q[i + 1] - cu_q[i]
            k_start, k_len = pad_kv[i], cu_kv[i + 1] - cu_kv[i]
            if start > cursor:  # rows not covered by any sequence (should not happen with our packer)
                pieces.append(query.new_zeros(start - cursor, heads * head_dim))
            if causal and length != k_len:
                raise DynBatchConfigError("cu_seqlens_kv", cu_kv, "causal self-attention needs equal q/kv lengths",
                                          "pass the same cu_seqlens for q and kv")
            if length > 0:
                q = query[start:start + length].transpose(0, 1)  # [heads, L, d]
                k = key[k_start:k_start + k_len].transpose(0, 1)  # [groups, Lk, d]
                v = value[k_start:k_start + k_len].transpose(0, 1)
                if rep > 1:  # head h uses query group h // rep, as Megatron's GQA does
                    k = k.repeat_interleave(rep, dim=0)
                    v = v.repeat_interleave(rep, dim=0)
                pieces.append(self._segment(q, k, v, causal).transpose(0, 1).reshape(length, heads * head_dim))
            cursor = start + length
        if t > cursor:
            pieces.append(query.new_zeros(t - cursor, heads * head_dim))
        return torch.cat(pieces, dim=0) if pieces else query.new_zeros(0, heads * head_dim)

    def _segment(self, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.thd_softmax_scale  # [heads, L, Lk]
        in_dtype = scores.dtype
        if self.config.attention_softmax_in_fp32:
            scores = scores.float()
        if causal:
            future = torch.triu(torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device), diagonal=1)
            scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(in_dtype)
        if self.attention_dropout.p > 0 and self.training:
            from megatron.core import tensor_parallel

            if not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
            else:
                probs = self.attention_dropout(probs)
        return torch.matmul(probs, v)  # [heads, L, d]


def get_thd_local_layer_spec(**kwargs: Any):
    """``get_gpt_layer_local_spec(**kwargs)`` with :class:`ThdDotProductAttention` as core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(**kwargs))
    try:
        attn = spec.submodules.self_attention.submodules
        attn.core_attention  # noqa: B018 - existence check
    except AttributeError as exc:
        raise DynBatchConfigError("layer_spec", type(spec).__name__, "has no self_attention.core_attention",
                                  "use a dense or MoE GPT local spec") from exc
    attn.core_attention = ThdDotProductAttention
    return spec
