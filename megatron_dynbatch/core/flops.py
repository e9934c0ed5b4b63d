"""Forward FLOPs of a decoder-only transformer, as two numbers per model.

The forward FLOPs of one sequence of length ``L`` through the whole model (all layers, LM head included) are

    fwd(L) = linear * L + quadratic * L**2

where ``linear`` collects everything that is done once per token (projections, MLP / experts, logits) and
``quadratic`` the causal core attention (``QK^T`` and ``softmax(.) V``). A packed micro-batch of
sequences ``L_i`` costs ``linear * sum(L_i) + quadratic * sum(L_i**2)`` because attention never crosses
sequence boundaries. The planner only ever needs these two coefficients, which keeps it fast.

Counting rules (the same as Megatron-LM's ``num_floating_point_operations``; see ``docs/flops.md``):

* a ``[m, k] x [k, n]`` matmul costs ``2*m*k*n`` FLOPs (one multiply + one add per MAC);
* only matmuls are counted: norms, softmax, RoPE, activations, residual adds and the embedding lookup are
  not; the MoE router (``hidden x num_experts``) is not counted either, like Megatron;
* causal attention is counted as half of the full ``L x L`` square;
* training (forward + backward) is ``3 x`` the forward.

This module is pure Python + NumPy (no torch, no megatron).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from .errors import DynBatchConfigError
from .model_spec import ModelLike, ModelSpec
from .parallel import ParallelConfig

__all__ = [
    "FlopsCoefficients",
    "FlopsBreakdown",
    "flops_breakdown",
    "flops_coefficients",
    "calculate_fwd_flops",
    "sample_fwd_flops",
    "split_expert_flops",
    "per_gpu_flops",
    "model_tflops_per_gpu",
    "megatron_num_floating_point_operations",
]

#: Training (forward + backward) costs three forwards: the forward GEMM, the data-gradient GEMM and the
#: weight-gradient GEMM have the same size.
FWD_BWD_FACTOR = 3

SeqLens = Union[int, np.integer, Sequence[int], np.ndarray]


@dataclass(frozen=True)
class FlopsCoefficients:
    """Forward FLOPs of one sequence of length ``L`` = ``linear * L + quadratic * L**2``."""

    linear: float
    quadratic: float

    def fwd_flops(self, seqlens: SeqLens) -> float:
        """Forward FLOPs of a set of independent sequences (e.g. one packed micro-batch)."""
        lengths = _as_lengths(seqlens)
        return float(self.linear * lengths.sum() + self.quadratic * np.square(lengths).sum())

    def sample_fwd_flops(self, lengths: SeqLens) -> np.ndarray:
        """Forward FLOPs of each sequence, vectorised (float64 array of the input's shape)."""
        arr = _as_lengths(lengths)
        return self.linear * arr + self.quadratic * arr * arr


@dataclass(frozen=True)
class FlopsBreakdown:
    """Forward FLOPs of one model split by where they are spent.

    Every ``*_per_token`` field is FLOPs per token for the whole model (summed over layers);
    ``attention_core_per_sq_token`` is FLOPs per unit of ``L**2`` (causal half already applied).
    ``routed_experts_per_token`` is the part that expert parallelism moves between GPUs.
    """

    attention_projections_per_token: float
    dense_mlp_per_token: float
    routed_experts_per_token: float
    shared_experts_per_token: float
    mtp_projections_per_token: float
    logits_per_token: float
    attention_core_per_sq_token: float

    @property
    def linear(self) -> float:
        return (self.attention_projections_per_token + self.dense_mlp_per_token + self.routed_experts_per_token
                + self.shared_experts_per_token + self.mtp_projections_per_token + self.logits_per_token)

    @property
    def quadratic(self) -> float:
        return self.attention_core_per_sq_token

    def coefficients(self) -> FlopsCoefficients:
        return FlopsCoefficients(linear=self.linear, quadratic=self.quadratic)

    def to_dict(self) -> Dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# --------------------------------------------------------------------------------------------- per layer
def _int(value: Optional[int]) -> int:
    """A field that validation has made an int (or that is unused, None -> 0) -- for the type checker."""
    return 0 if value is None else int(value)


def _attention_terms(m: ModelSpec) -> Tuple[float, float]:
    """(projection FLOPs per token, core FLOPs per L^2) of ONE attention layer, forward."""
    h, heads = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        dq, dr, dv = _int(m.qk_head_dim), _int(m.qk_pos_emb_head_dim), _int(m.v_head_dim)
        kvr = _int(m.kv_lora_rank)
        q_out = heads * (dq + dr)  # per-head query = no-RoPE part + RoPE part
        if m.q_lora_rank is None:
            q_macs = h * q_out  # direct query projection
        else:
            q_macs = h * m.q_lora_rank + m.q_lora_rank * q_out  # down to the latent, then up
        kv_down = h * (kvr + dr)  # compressed KV latent + the shared RoPE key
        kv_up = kvr * heads * (dq + dv)  # latent -> per-head no-RoPE key and value
        out = heads * dv * h
        proj = 2.0 * (q_macs + kv_down + kv_up + out)
        # QK^T over (dq + dr) and attn @ V over dv; 2 FLOPs/MAC x 1/2 causal = 1 per (L^2 * width)
        core = 2.0 * 0.5 * heads * (dq + dr) + 2.0 * 0.5 * heads * dv
        return proj, core
    q = heads * _int(m.kv_channels)
    kv = _int(m.num_query_groups) * _int(m.kv_channels)
    proj = 2.0 * (h * (q + 2 * kv) + q * h)  # fused QKV projection + output projection (q_width x hidden)
    core = 2.0 * 0.5 * q + 2.0 * 0.5 * q  # QK^T and attn @ V, each half of the square (causal)
    return proj, core


def _mlp_width_factor(m: ModelSpec) -> int:
    # gated MLP: gate + up (hidden -> 2*ffn, fused) and down (ffn -> hidden) = 3 matrices of hidden x ffn
    return 3 if m.swiglu else 2


@functools.lru_cache(maxsize=256)
def _breakdown_cached(m: ModelSpec) -> FlopsBreakdown:
    h = m.hidden_size
    g = _mlp_width_factor(m)
    pattern = m.moe_layer_pattern()
    n_moe = sum(pattern)
    n_dense = m.num_layers - n_moe
    mtp = m.mtp_num_layers or 0
    if mtp:
        # Megatron builds each MTP depth as one more transformer layer of the same kind as the last layer.
        if pattern[-1]:
            n_moe += mtp
        else:
            n_dense += mtp
    n_attn = m.num_layers + mtp

    attn_proj, attn_core = _attention_terms(m)
    dense = 2.0 * h * m.ffn_hidden_size * g
    routed = 2.0 * h * _int(m.moe_ffn_hidden_size) * _int(m.moe_router_topk) * g
    shared = 2.0 * h * _int(m.moe_shared_expert_intermediate_size) * g
    return FlopsBreakdown(
        attention_projections_per_token=n_attn * attn_proj,
        dense_mlp_per_token=n_dense * dense,
        routed_experts_per_token=n_moe * routed,
        shared_experts_per_token=n_moe * shared,
        # MTP: project concat(embedding, hidden) [2h] back to h once per depth
        mtp_projections_per_token=mtp * 2.0 * (2 * h) * h,
        # LM head once for the main model and once per MTP depth
        logits_per_token=(1 + mtp) * 2.0 * h * _int(m.padded_vocab_size),
        attention_core_per_sq_token=n_attn * attn_core,
    )


def flops_breakdown(model: ModelLike) -> FlopsBreakdown:
    """Forward FLOPs of ``model`` split into attention projections, dense MLP, routed experts, shared experts,
    MTP projections, logits (all per token) and core attention (per ``L**2``)."""
    return _breakdown_cached(ModelSpec.from_any(model))


def flops_coefficients(model: Union[ModelLike, FlopsCoefficients]) -> FlopsCoefficients:
    """``(linear, quadratic)`` such that a length-``L`` sequence costs ``linear*L + quadratic*L**2`` forward
    FLOPs through the whole model. Cached per ``ModelSpec``."""
    if isinstance(model, FlopsCoefficients):
        return model
    return _coefficients_cached(ModelSpec.from_any(model))


@functools.lru_cache(maxsize=256)
def _coefficients_cached(m: ModelSpec) -> FlopsCoefficients:
    return _breakdown_cached(m).coefficients()


# --------------------------------------------------------------------------------------------- public API
def _as_lengths(seqlens: SeqLens) -> np.ndarray:
    arr = np.asarray(seqlens)
    if arr.dtype == object or arr.dtype.kind not in "iuf" and arr.size:
        raise DynBatchConfigError("seqlens", seqlens, "must be integers (tokens per sequence)",
                                  "pass an int, a list of ints or an integer numpy array")
    if arr.size and arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise DynBatchConfigError("seqlens", seqlens, "contains NaN or inf", "pass finite token counts")
    arr = arr.astype(np.float64)
    if arr.size and arr.min() < 0:
        raise DynBatchConfigError("seqlens", int(arr.min()), "sequence lengths must be >= 0",
                                  "pass token counts per sequence")
    return arr


def calculate_fwd_flops(seqlens: SeqLens, model: Union[ModelLike, FlopsCoefficients]) -> float:
    """Forward FLOPs of independent sequences of lengths ``seqlens`` (an int, a list, or a numpy array; e.g.
    one packed THD micro-batch): ``linear*sum(L) + quadratic*sum(L**2)``. Multiply by 3 for training."""
    return flops_coefficients(model).fwd_flops(seqlens)


def sample_fwd_flops(lengths: SeqLens, model: Union[ModelLike, FlopsCoefficients]) -> np.ndarray:
    """Forward FLOPs of each sequence, vectorised: a float64 array shaped like ``lengths``."""
    return flops_coefficients(model).sample_fwd_flops(lengths)


def split_expert_flops(seqlens: SeqLens, model: ModelLike) -> Tuple[float, float]:
    """``(non_expert, routed_expert)`` forward FLOPs of ``seqlens``. Routed-expert work is what expert
    parallelism redistributes across EP ranks; everything else (attention, dense MLP, shared experts, logits)
    stays with the GPUs that hold the micro-batch."""
    b = flops_breakdown(model)
    lengths = _as_lengths(seqlens)
    tokens, sq = float(lengths.sum()), float(np.square(lengths).sum())
    routed = b.routed_experts_per_token * tokens
    total = b.linear * tokens + b.quadratic * sq
    return total - routed, routed


def per_gpu_flops(flops: Union[float, np.ndarray], model: ModelLike,
                  parallel: Union[ParallelConfig, Dict[str, Any], None]) -> Union[float, np.ndarray]:
    """Each GPU's average share of ``flops`` spent on one micro-batch (forward or training, any unit).

    A micro-batch is processed by the ``tp * pp * cp`` GPUs of one model replica: TP splits every GEMM and the
    attention heads, PP splits the layers, CP splits the tokens (zig-zag, so each CP rank gets an equal share
    of the causal square). Expert parallelism does not change the average: EP ranks are drawn from the
    data-parallel (x CP) ranks, each GPU sends its tokens' routed-expert work to the experts' owners and
    receives the same amount on average from the other ranks, so the per-GPU share is still
    ``flops / (tp*pp*cp)`` (with imbalanced routing a GPU may do more or less expert work; see
    :func:`split_expert_flops` for the part that moves). Pipeline stages are assumed balanced; the first and
    last stages also hold the embedding and LM head.

    Validates that the layout fits the model (heads and query groups divisible by ``tp``; ``ep`` divides
    ``num_experts``; ``ep > 1`` only for MoE models).
    """
    m = ModelSpec.from_any(model)
    p = ParallelConfig.from_any(parallel)
    if m.num_attention_heads % p.tp != 0:
        raise DynBatchConfigError("parallel.tp", p.tp, f"does not divide num_attention_heads={m.num_attention_heads}",
                                  "use a tensor-parallel size that divides the head count")
    if not m.multi_latent_attention and _int(m.num_query_groups) % p.tp != 0:
        raise DynBatchConfigError("parallel.tp", p.tp, f"does not divide num_query_groups={m.num_query_groups}",
                                  "use a tensor-parallel size that divides the number of KV heads")
    if p.ep > 1:
        if not m.num_experts:
            raise DynBatchConfigError("parallel.ep", p.ep,
                                      f"expert parallelism needs an MoE model ({m.name or 'this model'} is dense)",
                                      "set ep=1")
        if m.num_experts % p.ep != 0:
            raise DynBatchConfigError("parallel.ep", p.ep, f"does not divide num_experts={m.num_experts}",
                                      "use an expert-parallel size that divides the expert count")
    share = p.tp * p.pp * p.cp
    if isinstance(flops, np.ndarray):
        return flops / share
    return float(flops) / share


def model_tflops_per_gpu(seqlens: SeqLens, model: ModelLike, step_time_s: float,
                         world_size: Union[int, ParallelConfig, Dict[str, Any]], *, training: bool = True) -> float:
    """Model TFLOP/s per GPU for one step that processed ``seqlens`` (all sequences of the global batch) in
    ``step_time_s`` seconds on ``world_size`` GPUs (an int or a parallel layout): the same definition as
    Megatron's ``throughput per GPU`` log line (``training=True``: forward + backward = 3 x forward)."""
    if isinstance(world_size, (int, np.integer)) and not isinstance(world_size, bool):
        gpus = int(world_size)
    else:
        gpus = ParallelConfig.from_any(world_size).world_size  # type: ignore[arg-type]
    if gpus < 1:
        raise DynBatchConfigError("world_size", world_size, "must be >= 1", "pass the number of GPUs")
    if not step_time_s > 0:
        raise DynBatchConfigError("step_time_s", step_time_s, "must be > 0", "pass the measured step time in seconds")
    flops = calculate_fwd_flops(seqlens, model) * (FWD_BWD_FACTOR if training else 1)
    return flops / (step_time_s * gpus * 1e12)


# ------------------------------------------------------------------------------ Megatron-LM re-derivation
def megatron_num_floating_point_operations(model: ModelLike, num_tokens: float, sum_sq_lengths: float) -> float:
    """Training (forward + backward) FLOPs of a batch as Megatron-LM's ``num_floating_point_operations``
    (``megatron/training/training.py``) reports them in its packed-sequence (THD) form, where the token-linear
    work is multiplied by the real token count and core attention by the sum of squared sequence lengths.

    An independent re-derivation, written from reading that function, kept for cross-checking
    :func:`calculate_fwd_flops`. It reproduces Megatron's accounting including the parts
    :func:`flops_breakdown` leaves out: Megatron adds one MAC per latent element for the MLA query/KV norms
    and ``3*hidden`` MACs per MTP depth for the MTP norms. It covers standard (MHA/GQA) and MLA attention,
    dense/MoE/shared-expert MLPs and MTP (not Megatron's hybrid, Mamba or linear-attention variants).
    """
    m = ModelSpec.from_any(model)
    fb, fma = 3, 2
    ffn_mult = 3 if m.swiglu else 2
    h = m.hidden_size

    layers = m.moe_layer_pattern()
    moe_layers = sum(layers)
    dense_layers = m.num_layers - moe_layers
    mtp = m.mtp_num_layers or 0
    last_is_moe = layers[-1]
    moe_layers += last_is_moe * mtp
    dense_layers += (1 - last_is_moe) * mtp
    attn_layers = m.num_layers + mtp
    topk = _int(m.moe_router_topk)
    moe_ffn = _int(m.moe_ffn_hidden_size)
    shared_ffn = _int(m.moe_shared_expert_intermediate_size)
    kv_ch, groups, vocab = _int(m.kv_channels), _int(m.num_query_groups), _int(m.padded_vocab_size)
    dq, dr, dv, kvr = _int(m.qk_head_dim), _int(m.qk_pos_emb_head_dim), _int(m.v_head_dim), _int(m.kv_lora_rank)

    n = m.num_attention_heads
    if m.multi_latent_attention:
        q_width = n * (dq + dr)
        if m.q_lora_rank is None:
            q_part = h * q_width
        else:
            q_part = m.q_lora_rank * (h + q_width + 1)  # down, up, q norm
        kv_part = kvr * (h + n * (dq + dv) + 1) + h * dr
        per_token_attn = fb * fma * (q_part + kv_part + n * dv * h)
        per_sq_attn = fb * fma * (q_width / 2 + n * dv / 2)
    else:
        qp = kv_ch * n
        kvp = kv_ch * groups
        per_token_attn = fb * fma * (h * (qp + 2 * kvp) + qp * h)
        per_sq_attn = fb * fma * qp / 2 * 2

    per_token = (
        fb * fma * h * (m.ffn_hidden_size * ffn_mult * dense_layers
                        + moe_ffn * topk * ffn_mult * moe_layers
                        + shared_ffn * ffn_mult * moe_layers)
        + per_token_attn * attn_layers
        + fb * fma * mtp * (3 * h + 2 * h * h)
        + fb * fma * h * vocab * (mtp + 1)
    )
    return float(num_tokens) * per_token + float(sum_sq_lengths) * per_sq_attn * attn_layers
