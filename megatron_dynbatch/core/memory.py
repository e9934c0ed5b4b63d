"""A first-order GPU memory ESTIMATE for choosing ``--max-tokens-per-gpu``. Not a measurement.

It answers "about how many tokens per GPU fit?" from the model shape and the parallel layout, so that a first
run starts near the right budget; the real number comes from a short run with the peak-memory log (see
``docs/tuning.md``). Every assumption is a keyword argument with a stated default.

Peak memory of one GPU = static + activations + logits + reserve, where

* **static** -- weights, gradients and optimizer state of the parameters this GPU holds. Bytes per parameter:
  ``weight_bytes + grad_bytes`` plus the fp32 master copy and Adam moments (12 bytes), sharded over the
  data-parallel group with the distributed optimizer (``optimizer="distributed"``: dense parameters over
  ``dp * cp`` ranks, expert parameters over the expert-data-parallel ranks), whole (``"replicated"``) or on
  the host (``"cpu_offload"``). Dense parameters are split over ``tp * pp``, experts over ``etp * ep * pp``.
* **activations** -- what one transformer layer keeps for backward, per token (bf16 = 2 bytes):
  norm inputs and GEMM inputs (``2h`` each; divided by ``tp`` only with sequence parallelism), the Q/K/V and
  attention output that flash/fused attention saves (no ``s^2`` term), the MLP's fc1 output (``2 * ffn`` for
  SwiGLU) and activation output; for MoE layers the same per routed copy (``topk`` copies, ``etp``-split) plus
  router logits and the shared expert. With no dropout this is the Korthikanti et al. (2022) count with flash
  attention (``32 h`` per token per layer for a classic ``4h`` GELU MLP). With 1F1B the first pipeline stage
  holds ``pp`` micro-batches in flight (x ``1 + (pp-1)/(pp*vpp)`` when interleaved), i.e. about all ``L``
  layers' worth whatever ``pp`` is. ``recompute="full"`` keeps only each layer's input plus one layer being
  recomputed; ``"selective"`` is counted like ``"none"`` (with flash attention there is no score matrix left to
  recompute).
* **logits** -- the LM head's output for the loss on the last stage: ``T * V/tp`` in bf16 plus
  ``logits_fp32_copies`` fp32 copies (Megatron's vocab-parallel cross entropy keeps one; RL losses that also
  compute entropy or log-probs over the vocabulary often keep two). ``4 bytes * T * V/tp`` alone is ~10 GB for
  Qwen3 (V = 151936) at T = 16384 and TP = 1: for small models this term, not the layers, sets the budget.
* **reserve** -- CUDA context, NCCL buffers and workspaces (``reserve_gb``), and allocator fragmentation
  (``fragmentation`` of the card is treated as unusable).

``tokens`` here are tokens per GPU, i.e. per CP rank: context parallelism does not change the per-GPU cost of a
token, it lets one micro-batch hold ``max_tokens_per_gpu * cp`` tokens (the planner's cap).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Union

from .checks import is_int
from .errors import DynBatchConfigError
from .model_spec import ModelLike, ModelSpec
from .parallel import ParallelConfig

__all__ = ["MemoryEstimate", "estimate_memory", "estimate_max_tokens_per_gpu", "parameter_counts"]

GB = 1024 ** 3
OPTIMIZERS = ("distributed", "replicated", "cpu_offload")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak memory (GiB) of the busiest GPU at ``tokens_per_gpu`` tokens per micro-batch per GPU.

    ``first_stage_gb`` and ``last_stage_gb`` are the two candidates for the peak (they are the same GPU when
    ``pp == 1``); ``total_gb`` is their maximum plus the reserve."""

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


def _mlp_mult(spec: ModelSpec) -> int:
    """Weight matrices of one MLP: 3 with a gated (SwiGLU) MLP, else 2."""
    return 3 if spec.swiglu else 2


def parameter_counts(model: ModelLike, *, untie_embeddings: bool = True) -> Dict[str, float]:
    """Parameter counts: ``attention`` and ``dense_mlp`` (all layers), ``shared_experts``, ``routed_experts``,
    ``router``, ``embedding`` (input), ``output`` (LM head; 0 when tied) and ``total``. Norms and biases are
    ignored (< 0.1%)."""
    m = ModelSpec.from_any(model)
    h, nq = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        qk = int(m.qk_head_dim or 0) + int(m.qk_pos_emb_head_dim or 0)
        q = h * m.q_lora_rank + m.q_lora_rank * nq * qk if m.q_lora_rank else h * nq * qk
        kv = h * (int(m.kv_lora_rank or 0) + int(m.qk_pos_emb_head_dim or 0)) \
            + int(m.kv_lora_rank or 0) * nq * (int(m.qk_head_dim or 0) + int(m.v_head_dim or 0))
        attn_layer = q + kv + nq * int(m.v_head_dim or 0) * h
    else:
        d, ng = int(m.kv_channels or 0), int(m.num_query_groups or nq)
        attn_layer = h * (nq * d + 2 * ng * d) + nq * d * h
    pattern = m.moe_layer_pattern()
    n_moe = sum(pattern)
    mult = _mlp_mult(m)
    out = {
        "attention": float(attn_layer * m.num_layers),
        "dense_mlp": float(mult * h * m.ffn_hidden_size * (m.num_layers - n_moe)),
        "shared_experts": float(mult * h * int(m.moe_shared_expert_intermediate_size or 0) * n_moe),
        "routed_experts": float(mult * h * int(m.moe_ffn_hidden_size or 0) * int(m.num_experts or 0) * n_moe),
        "router": float(h * int(m.num_experts or 0) * n_moe),
        "embedding": float(m.padded_vocab_size * h),
        "output": float(m.padded_vocab_size * h) if untie_embeddings else 0.0,
    }
    out["total"] = sum(out.values())
    return out


def _layer_activation_bytes(m: ModelSpec, p: ParallelConfig, etp: int, moe_layer: bool, moe_imbalance: float) -> float:
    """Bytes one layer keeps for backward per token on one GPU (bf16 activations; see the module docstring)."""
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


def estimate_memory(
    model: ModelLike,
    parallel: Union[ParallelConfig, Dict[str, Any], None],
    tokens_per_gpu: int,
    *,
    optimizer: str = "distributed",
    recompute: str = "none",
    weight_bytes: float = 2.0,
    grad_bytes: float = 4.0,
    logits_fp32_copies: int = 1,
    untie_embeddings: bool = True,
    expert_tensor_parallel_size: Optional[int] = None,
    moe_imbalance: float = 1.0,
    forward_only: bool = False,
    reserve_gb: float = 4.0,
) -> MemoryEstimate:
    """Estimated peak memory at ``tokens_per_gpu`` tokens per micro-batch per GPU (see the module docstring).

    ``forward_only=True`` estimates a log-prob / reference pass: no activations are kept for backward (one
    layer's working set), no gradients or optimizer state (weights only), logits as in training."""
    m = ModelSpec.from_any(model)
    p = ParallelConfig.from_any(parallel)
    if optimizer not in OPTIMIZERS:
        raise DynBatchConfigError("optimizer", optimizer, "unknown optimizer layout", f"use one of {OPTIMIZERS}")
    if recompute not in RECOMPUTE:
        raise DynBatchConfigError("recompute", recompute, "unknown recompute mode", f"use one of {RECOMPUTE}")
    if not is_int(tokens_per_gpu) or tokens_per_gpu < 0:
        raise DynBatchConfigError("tokens_per_gpu", tokens_per_gpu, "must be an integer >= 0", "pass e.g. 16384")
    etp = expert_tensor_parallel_size or p.tp
    T = float(tokens_per_gpu)

    # ---- static: parameters held by the first and the last pipeline stage
    counts = parameter_counts(m, untie_embeddings=untie_embeddings)
    dense_layers = counts["attention"] + counts["dense_mlp"] + counts["shared_experts"] + counts["router"]
    dense_per_gpu = dense_layers / (p.tp * p.pp)
    expert_per_gpu = counts["routed_experts"] / (etp * p.ep * p.pp)
    emb = counts["embedding"] / p.tp
    out = (counts["output"] if untie_embeddings else counts["embedding"]) / p.tp
    expert_dp = max(1, p.world_size // (etp * p.ep * p.pp))

    def bytes_per_param(shard: int) -> float:
        if forward_only:
            return weight_bytes
        if optimizer == "replicated":
            return weight_bytes + grad_bytes + 12.0
        if optimizer == "cpu_offload":
            return weight_bytes + grad_bytes
        return weight_bytes + grad_bytes + 12.0 / shard

    dense_b = bytes_per_param(p.dp * p.cp)
    expert_b = bytes_per_param(expert_dp)
    base_static = dense_per_gpu * dense_b + expert_per_gpu * expert_b
    static_first = base_static + emb * dense_b + (out * dense_b if p.pp == 1 else 0.0)
    static_last = base_static + out * dense_b + (emb * dense_b if p.pp == 1 else 0.0)

    # ---- activations per token
    pattern = m.moe_layer_pattern()
    per_layer = [_layer_activation_bytes(m, p, etp, bool(x), moe_imbalance) for x in pattern]
    layers_per_stage = m.num_layers / p.pp
    mean_layer = sum(per_layer) / len(per_layer)
    max_layer = max(per_layer)
    layer_input = 2.0 * m.hidden_size / (p.tp if p.sequence_parallel else 1)
    in_flight = p.pp * (1.0 + (p.pp - 1) / (p.pp * p.vpp)) if (p.vpp > 1 and p.pp > 1) else float(p.pp)
    if forward_only:
        act_first = max_layer + in_flight * layer_input
        act_last = max_layer
    elif recompute == "full":
        act_first = in_flight * layers_per_stage * layer_input + max_layer
        act_last = layers_per_stage * layer_input + max_layer
    else:
        act_first = in_flight * layers_per_stage * mean_layer
        act_last = layers_per_stage * mean_layer
    mtp = int(m.mtp_num_layers or 0)
    logits = (1 + mtp) * (m.padded_vocab_size / p.tp) * (2.0 + 4.0 * logits_fp32_copies) \
        + (1 + mtp) * 2.0 * m.hidden_size
    act_last += mtp * mean_layer if not forward_only else 0.0

    if p.pp == 1:
        first = static_first + T * (act_first + logits)
        last = first
        act_gb, logit_gb = T * act_first / GB, T * logits / GB
        static_gb = static_first / GB
    else:
        first = static_first + T * act_first
        last = static_last + T * (act_last + logits)
        if first >= last:
            act_gb, logit_gb, static_gb = T * act_first / GB, 0.0, static_first / GB
        else:
            act_gb, logit_gb, static_gb = T * act_last / GB, T * logits / GB, static_last / GB
    total = max(first, last) / GB + reserve_gb
    return MemoryEstimate(tokens_per_gpu=int(T), static_gb=static_gb, activations_gb=act_gb, logits_gb=logit_gb,
                          reserve_gb=reserve_gb, first_stage_gb=first / GB + reserve_gb,
                          last_stage_gb=last / GB + reserve_gb, total_gb=total)


def estimate_max_tokens_per_gpu(
    model: ModelLike,
    parallel: Union[ParallelConfig, Dict[str, Any], None],
    gpu_mem_gb: float,
    *,
    fragmentation: float = 0.10,
    multiple: int = 256,
    **kwargs: Any,
) -> int:
    """ESTIMATED largest ``--max-tokens-per-gpu`` that fits ``gpu_mem_gb`` GiB (rounded down to ``multiple``).

    ``fragmentation`` of the card is treated as unusable; other keywords are :func:`estimate_memory`'s. Raises
    :class:`DynBatchConfigError` when the weights and optimizer state alone do not fit. Start a real run at this
    value, read the peak-memory log, and adjust: see ``docs/tuning.md``."""
    if not isinstance(gpu_mem_gb, (int, float)) or isinstance(gpu_mem_gb, bool) or gpu_mem_gb <= 0:
        raise DynBatchConfigError("gpu_mem_gb", gpu_mem_gb, "must be a positive number", "pass e.g. 80 for an H100")
    if not 0 <= fragmentation < 1:
        raise DynBatchConfigError("fragmentation", fragmentation, "must be in [0, 1)", "use e.g. 0.1")
    usable = gpu_mem_gb * (1.0 - fragmentation)
    e0 = estimate_memory(model, parallel, 0, **kwargs)
    if e0.total_gb >= usable:
        raise DynBatchConfigError(
            "gpu_mem_gb", gpu_mem_gb,
            f"weights, gradients and optimizer state ({e0.static_gb:.1f} GiB) plus the reserve "
            f"({e0.reserve_gb:.1f} GiB) already exceed the {usable:.1f} GiB usable (estimate)",
            "add tensor/pipeline/expert parallelism, use the distributed optimizer or optimizer CPU offload, or "
            "lower reserve_gb if your runtime needs less")
    probe = 1 << 16
    e1 = estimate_memory(model, parallel, probe, **kwargs)
    per_token_first = (e1.first_stage_gb - e0.first_stage_gb) / probe
    per_token_last = (e1.last_stage_gb - e0.last_stage_gb) / probe
    limits = []
    for base, slope in ((e0.first_stage_gb, per_token_first), (e0.last_stage_gb, per_token_last)):
        if slope > 0:
            limits.append((usable - base) / slope)
    tokens = int(math.floor(min(limits))) if limits else 0
    return max(0, (tokens // multiple) * multiple)
