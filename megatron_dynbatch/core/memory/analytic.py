"""The analytic per-token byte counts: what one layer, the LM head and the loss keep, from the model's shape.

Bytes per token on one GPU, bf16 activations (2 bytes), flash / fused attention (no ``s x s`` score matrix) --
the Korthikanti et al. (2022) count with flash attention, ``32 h`` per token per layer for a classic ``4h`` GELU
MLP without dropout -- as Megatron-Core keeps them (``megatron/core/transformer/transformer_layer.py``,
``attention.py``, ``mlp.py``, ``moe/experts.py``, ``moe/token_dispatcher.py``):

* **a layer** keeps the norm inputs and GEMM inputs (``2h`` each; divided by ``tp`` only with sequence
  parallelism), Q/K/V and the attention output (``/tp``), fp32 softmax statistics, the MLP's fc1 output (``2 x
  ffn`` wide with SwiGLU) and activation output (``/tp``);
* **dropout** (``hidden_dropout > 0``): the bias-dropout-add after the attention projection and after the MLP
  each keep a 1-byte mask of ``h`` per token (``/tp`` with sequence parallelism; ``torch.nn.functional.dropout``
  keeps nothing when ``p == 0``). Attention dropout inside flash / fused attention keeps only the RNG seed and
  offset (the mask is regenerated in backward): nothing per token. The embedding's dropout mask (first stage
  only, ``h / tp`` bytes) is left out (< 1% of a layer);
* **QK-layernorm** (``qk_layernorm``): the norms' inputs, Q and K before normalisation (``/tp``); with MLA the
  compressed q / kv latents before their norms;
* **an MoE layer**: norm inputs, fp32 router logits, the shared expert, and per routed copy (``topk`` copies
  times ``moe_imbalance``) the expert's fc1 input (``2h``), fc1 and activation outputs (``/etp``; the router's
  probabilities are applied in the activation, so the combine keeps nothing). The alltoall dispatcher gathers
  tokens over the expert-TP group only (``pg_collection.expt_tp``): one GPU's experts see ``etp / tp`` of the
  micro-batch's routed copies (Megatron requires sequence parallelism for MoE with ``tp > 1``);
* **the backward's transient** (``transient``): while the largest layer runs its backward, beside everything
  kept, the gradient of its output (``2h``, all-gathered under sequence parallelism) and the gradients of its
  widest block -- attention's dQ/dK/dV and output gradient, or the MLP's fc1-output gradient -- are alive;
* **a layer's input** (what full recompute keeps): ``2h`` (``/tp`` with sequence parallelism);
* **the LM head and loss** on the last stage: the bf16 logits ``T x V/tp`` plus one fp32 copy (Megatron's
  vocab-parallel cross entropy, :func:`~.loss_paths.loss_path_bytes` of ``megatron-lm``: this package's loss path)
  plus the final norm's input, for the main head and each MTP head, with ``V`` the vocabulary padded as Megatron
  pads it (``make_vocab_size_divisible_by x tp``); a trainer whose loss keeps more or less differs from it by
  :func:`~.loss_paths.head_terms` (added in :mod:`.peak`).

Pure Python.
"""

from __future__ import annotations

from typing import Dict, List

from ..model_spec import ModelSpec
from ..parallel import ParallelConfig
from .loss_paths import loss_path_bytes


def _attention_widths(m: ModelSpec) -> Dict[str, float]:
    """Per-token widths (elements, before TP) of Q, K, V, the attention output and (MLA) the latents."""
    nq = m.num_attention_heads
    if m.multi_latent_attention:
        qk = int(m.qk_head_dim or 0) + int(m.qk_pos_emb_head_dim or 0)
        v = nq * int(m.v_head_dim or 0)
        return {"q": nq * qk, "k": nq * qk, "v": v, "out": v,
                "latent": int(m.q_lora_rank or 0) + int(m.kv_lora_rank or 0) + int(m.qk_pos_emb_head_dim or 0),
                "normed_latent": int(m.q_lora_rank or 0) + int(m.kv_lora_rank or 0)}
    d, ng = int(m.kv_channels or 0), int(m.num_query_groups or nq)
    return {"q": nq * d, "k": ng * d, "v": ng * d, "out": nq * d, "latent": 0, "normed_latent": 0}


def routed_share(p: ParallelConfig, etp: int) -> float:
    """The share of a micro-batch's routed token copies one GPU's experts hold: ``etp / tp`` (module docstring)."""
    return etp / p.tp


def layer_parts(m: ModelSpec, p: ParallelConfig, etp: int, moe_layer: bool, moe_imbalance: float) -> Dict[str, float]:
    """One layer's bytes per token on one GPU, by part: ``total`` (all it keeps for backward), of which
    ``dropout`` (the masks), ``qk_norm`` (the QK-layernorm inputs) and ``routed`` (the routed experts' share);
    and ``transient`` (the gradients alive beside them while it runs backward). Module docstring."""
    t = p.tp
    rep = t if p.sequence_parallel else 1  # norm and GEMM inputs are replicated over TP unless sequence parallel
    h, nq = m.hidden_size, m.num_attention_heads
    w = _attention_widths(m)
    qkvo = w["q"] + w["k"] + w["v"] + w["out"]
    # norm input + QKV GEMM input; MLA latents; Q, K, V and the attention output saved by flash/fused attention;
    # fp32 softmax statistics
    attn = 2.0 * (2 * h) / rep + 2.0 * w["latent"] + 2.0 * qkvo / t + 4.0 * nq / t
    qk_norm = 0.0
    if m.qk_layernorm:
        qk_norm = 2.0 * w["normed_latent"] if m.multi_latent_attention else 2.0 * (w["q"] + w["k"]) / t
    dropout = 2.0 * h / rep if m.hidden_dropout > 0 else 0.0  # two 1-byte masks: after attention, after the MLP
    fc1_width = 2 if m.swiglu else 1
    routed = 0.0
    if not moe_layer:
        f = m.ffn_hidden_size
        mlp = 2.0 * (2 * h) / rep + 2.0 * (fc1_width * f + f) / t  # norm + fc1 inputs; fc1 and activation outputs
        mlp_grad = 2.0 * fc1_width * f / t
    else:
        e, k, f = int(m.num_experts or 0), int(m.moe_router_topk or 0), int(m.moe_ffn_hidden_size or 0)
        copies = routed_share(p, etp) * moe_imbalance * k
        # per routed copy: the expert's fc1 input, its fc1 and activation outputs
        routed = copies * (2.0 * h + 2.0 * (fc1_width * f + f) / etp)
        shared = int(m.moe_shared_expert_intermediate_size or 0)
        shared_b = (2.0 * h / rep + 2.0 * (fc1_width * shared + shared) / t) if shared else 0.0
        mlp = 2.0 * (2 * h) / rep + 4.0 * e / rep + routed + shared_b
        mlp_grad = max(copies * 2.0 * fc1_width * f / etp, 2.0 * fc1_width * shared / t)
    transient = 2.0 * h + max(2.0 * qkvo / t, mlp_grad)
    return {"total": attn + qk_norm + dropout + mlp, "dropout": dropout, "qk_norm": qk_norm, "routed": routed,
            "transient": transient}


def layer_activation_bytes(m: ModelSpec, p: ParallelConfig, etp: int, moe_layer: bool, moe_imbalance: float) -> float:
    """Bytes one layer keeps for backward per token on one GPU (module docstring)."""
    return layer_parts(m, p, etp, moe_layer, moe_imbalance)["total"]


def analytic_bytes(m: ModelSpec, p: ParallelConfig, etp: int, moe_imbalance: float) -> Dict[str, float]:
    """The analytic profile's numbers (bytes per token unless said): ``layer`` (mean over the model's layers),
    ``layer_peak`` (the largest layer with its backward transient), ``layer_input``, ``transient`` (the largest
    backward transient), ``head`` (LM head + loss with one fp32 copy, every head), ``fp32_copy`` (one more fp32
    logits copy, every head), ``mtp_layers`` (the MTP layers' activations), and the parts of ``layer`` (means):
    ``dropout``, ``qk_norm``, ``routed``."""
    parts = [layer_parts(m, p, etp, bool(x), moe_imbalance) for x in m.moe_layer_pattern()]
    per_layer: List[float] = [x["total"] for x in parts]
    mean = sum(per_layer) / len(per_layer)
    heads = 1 + int(m.mtp_num_layers or 0)
    vocab = m.padded_vocab_for(p.tp) / p.tp
    n = float(len(parts))
    return {
        "layer": mean,
        "layer_peak": max(x["total"] + x["transient"] for x in parts),
        "layer_input": 2.0 * m.hidden_size / (p.tp if p.sequence_parallel else 1),
        "transient": max(x["transient"] for x in parts),
        "head": heads * (vocab * loss_path_bytes("megatron-lm") + 2.0 * m.hidden_size),
        "fp32_copy": heads * 4.0 * vocab,
        "mtp_layers": int(m.mtp_num_layers or 0) * mean,
        "dropout": sum(x["dropout"] for x in parts) / n,
        "qk_norm": sum(x["qk_norm"] for x in parts) / n,
        "routed": sum(x["routed"] for x in parts) / n,
    }


__all__ = ["layer_activation_bytes", "layer_parts", "analytic_bytes", "routed_share"]
