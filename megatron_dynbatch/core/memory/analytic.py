"""The analytic per-token byte counts: what one layer, the LM head and the loss keep, from the model's shape.

Bytes per token on one GPU, bf16 activations (2 bytes), flash / fused attention (no ``s x s`` score matrix),
no dropout -- the Korthikanti et al. (2022) count with flash attention, ``32 h`` per token per layer for a classic
``4h`` GELU MLP:

* **a layer** keeps the norm inputs and GEMM inputs (``2h`` each; divided by ``tp`` only with sequence
  parallelism), Q/K/V and the attention output (``/tp``), fp32 softmax statistics, the MLP's fc1 output (``2 x
  ffn`` wide with SwiGLU) and activation output (``/tp``); an MoE layer the same per routed copy (``topk``
  copies times ``moe_imbalance``, the FFN part ``/etp``) plus router logits and the shared expert;
* **a layer's input** (what full recompute keeps): ``2h`` (``/tp`` with sequence parallelism);
* **the LM head and loss** on the last stage: the bf16 logits ``T x V/tp`` plus one fp32 copy (Megatron's
  vocab-parallel cross entropy, :func:`~.loss_paths.loss_path_bytes` of ``megatron-lm``: this package's loss path)
  plus the final norm's input, for the main head and each MTP head; a trainer whose loss keeps more or less
  differs from it by :func:`~.loss_paths.head_terms` (added in :mod:`.peak`).

Pure Python.
"""

from __future__ import annotations

from typing import Dict, List

from ..model_spec import ModelSpec
from ..parallel import ParallelConfig
from .loss_paths import loss_path_bytes


def layer_activation_bytes(m: ModelSpec, p: ParallelConfig, etp: int, moe_layer: bool, moe_imbalance: float) -> float:
    """Bytes one layer keeps for backward per token on one GPU (module docstring)."""
    t = p.tp
    rep = t if p.sequence_parallel else 1  # norm and GEMM inputs are replicated over TP unless sequence parallel
    h, nq = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        qk = int(m.qk_head_dim or 0) + int(m.qk_pos_emb_head_dim or 0)
        q_w, k_w, v_w = nq * qk, nq * qk, nq * int(m.v_head_dim or 0)
        out_w = v_w
        # compressed latents feeding the up-projections (not split over TP)
        latent = 2.0 * (int(m.q_lora_rank or 0) + int(m.kv_lora_rank or 0) + int(m.qk_pos_emb_head_dim or 0))
    else:
        d, ng = int(m.kv_channels or 0), int(m.num_query_groups or nq)
        q_w, k_w, v_w, out_w = nq * d, ng * d, ng * d, nq * d
        latent = 0.0
    # norm input + QKV GEMM input; Q, K, V and the attention output saved by flash/fused attention; softmax stats
    attn = 2.0 * (2 * h) / rep + latent + 2.0 * (q_w + k_w + v_w + out_w) / t + 4.0 * nq / t
    fc1_width = 2 if m.swiglu else 1
    if not moe_layer:
        f = m.ffn_hidden_size
        mlp = 2.0 * (2 * h) / rep + 2.0 * (fc1_width * f + f) / t  # norm + fc1 inputs; fc1 and activation outputs
    else:
        e, k, f = int(m.num_experts or 0), int(m.moe_router_topk or 0), int(m.moe_ffn_hidden_size or 0)
        # per routed copy: permuted expert input, fc1 and activation outputs, expert output kept for the combine
        per_copy = 2.0 * h + 2.0 * (fc1_width * f + f) / etp + 2.0 * h
        shared = int(m.moe_shared_expert_intermediate_size or 0)
        mlp = (2.0 * (2 * h) / rep + 4.0 * e + moe_imbalance * k * per_copy
               + 2.0 * (fc1_width * shared + shared) / t)
    return attn + mlp


def analytic_bytes(m: ModelSpec, p: ParallelConfig, etp: int, moe_imbalance: float) -> Dict[str, float]:
    """The analytic profile's numbers (bytes per token unless said): ``layer`` (mean over the model's layers),
    ``layer_peak`` (the largest layer), ``layer_input``, ``head`` (LM head + loss with one fp32 copy, every head),
    ``fp32_copy`` (one more fp32 logits copy, every head), ``mtp_layers`` (the MTP layers' activations)."""
    per_layer: List[float] = [layer_activation_bytes(m, p, etp, bool(x), moe_imbalance)
                              for x in m.moe_layer_pattern()]
    mean = sum(per_layer) / len(per_layer)
    heads = 1 + int(m.mtp_num_layers or 0)
    vocab = m.padded_vocab_size / p.tp
    return {
        "layer": mean,
        "layer_peak": max(per_layer),
        "layer_input": 2.0 * m.hidden_size / (p.tp if p.sequence_parallel else 1),
        "head": heads * (vocab * loss_path_bytes("megatron-lm") + 2.0 * m.hidden_size),
        "fp32_copy": heads * 4.0 * vocab,
        "mtp_layers": int(m.mtp_num_layers or 0) * mean,
    }


__all__ = ["layer_activation_bytes", "analytic_bytes"]
