"""FLOPs formula: hand-derived expectations (every term written out), agreement with the re-derivation of
Megatron-LM's formula, and the API contract (shapes, caching, per-GPU share)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_dynbatch import DynBatchConfigError, ModelSpec, ParallelConfig
from megatron_dynbatch.core.flops import (
    FlopsCoefficients,
    calculate_fwd_flops,
    flops_breakdown,
    flops_coefficients,
    megatron_num_floating_point_operations,
    model_tflops_per_gpu,
    per_gpu_flops,
    sample_fwd_flops,
    split_expert_flops,
)


# ------------------------------------------------------------------------------------------ hand-derived
def test_small_dense_mha_plain_mlp_by_hand():
    # 2 layers, hidden 64, 4 heads of 16 (MHA), plain 2-matrix MLP of 256, vocab 100 -> padded to 128.
    m = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=100)
    assert m.padded_vocab_size == 128 and m.kv_channels == 16 and m.num_query_groups == 4
    # per token, per layer (2 FLOPs per MAC):
    qkv = 2 * 64 * (64 + 64 + 64)  # = 24576
    out = 2 * 64 * 64  # = 8192
    mlp = 2 * 64 * 256 + 2 * 256 * 64  # up + down = 65536
    logits = 2 * 64 * 128  # = 16384
    linear = 2 * (qkv + out + mlp) + logits  # = 212992
    # core attention per layer per L^2: QK^T = 2*4*16 = 128 full square, attn@V = 128; causal halves both
    quadratic = 2 * (0.5 * 128 + 0.5 * 128)  # = 256
    assert (linear, quadratic) == (212992, 256)
    c = flops_coefficients(m)
    assert c.linear == linear and c.quadratic == quadratic
    assert calculate_fwd_flops(10, m) == 212992 * 10 + 256 * 100 == 2155520


def test_gqa_with_explicit_head_dim_by_hand():
    # Qwen3-style: 8 heads of 32 (kv_channels != hidden/heads = 8), 2 KV groups, SwiGLU 96, 3 layers, vocab 256.
    m = ModelSpec(num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=32,
                  ffn_hidden_size=96, swiglu=True, vocab_size=256)
    q = 2 * 64 * (8 * 32)  # 32768
    k = 2 * 64 * (2 * 32)  # 8192
    v = 2 * 64 * (2 * 32)  # 8192
    out = 2 * (8 * 32) * 64  # 32768: heads*kv_channels x hidden, NOT hidden x hidden (= 8192)
    mlp = 2 * 64 * 96 * 2 + 2 * 96 * 64  # gate+up (fused), down = 36864
    logits = 2 * 64 * 256  # 32768
    linear = 3 * (q + k + v + out + mlp) + logits
    quadratic = 3 * (0.5 * 2 * 8 * 32 + 0.5 * 2 * 8 * 32)  # 3 layers * (256 + 256)
    c = flops_coefficients(m)
    assert c.linear == linear == 389120
    assert c.quadratic == quadratic == 1536
    assert calculate_fwd_flops([5, 7], m) == linear * 12 + quadratic * (25 + 49)


def test_output_projection_uses_heads_times_kv_channels():
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=64,
                vocab_size=128)
    narrow = flops_coefficients(ModelSpec(**base))  # kv_channels 8: q width 64
    wide = flops_coefficients(ModelSpec(**base, kv_channels=32))  # q width 256
    # q, k, v and output projections all grow from width 64 to 256: 4 matrices x 2*64*(256-64)
    assert wide.linear - narrow.linear == 4 * 2 * 64 * (256 - 64)


def test_moe_with_layer_frequency_and_shared_experts_by_hand():
    # 4 layers; moe_layer_freq=2 -> layers 0 and 2 MoE (Megatron: i % 2 == 0), 1 and 3 dense.
    m = ModelSpec(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, swiglu=True,
                  vocab_size=128, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16,
                  moe_shared_expert_intermediate_size=48, moe_layer_freq=2)
    assert m.moe_layer_pattern() == [1, 0, 1, 0]
    attn = 2 * 32 * (32 * 3) + 2 * 32 * 32  # qkv + out = 8192
    dense = 3 * 2 * 32 * 128  # 24576
    routed = 2 * 3 * 2 * 32 * 16  # topk * gated(3) * 2*h*moe_ffn = 6144 (the router is not counted)
    shared = 3 * 2 * 32 * 48  # 9216
    logits = 2 * 32 * 128  # 8192
    linear = 4 * attn + 2 * dense + 2 * (routed + shared) + logits
    c = flops_coefficients(m)
    assert c.linear == linear == 120832
    assert c.quadratic == 4 * (2 * 32)
    b = flops_breakdown(m)
    assert b.routed_experts_per_token == 2 * routed and b.shared_experts_per_token == 2 * shared
    assert b.dense_mlp_per_token == 2 * dense
    # list form: first layer dense, rest MoE
    m2 = m.replace(moe_layer_freq=[0, 1, 1, 1])
    assert flops_coefficients(m2).linear == 4 * attn + 1 * dense + 3 * (routed + shared) + logits


def test_mla_with_q_lora_by_hand():
    # 2 layers, hidden 64, 4 heads, q_lora 32, kv_lora 16, qk 8 + rope 4, v 8, SwiGLU 128, vocab 128.
    m = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, swiglu=True,
                  vocab_size=128, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=8,
                  qk_pos_emb_head_dim=4, v_head_dim=8)
    q_down = 2 * 64 * 32  # 4096
    q_up = 2 * 32 * (4 * (8 + 4))  # 3072
    kv_down = 2 * 64 * (16 + 4)  # 2560 (latent + shared rope key)
    kv_up = 2 * 16 * (4 * (8 + 8))  # 2048 (keys without rope + values)
    out = 2 * (4 * 8) * 64  # 4096
    mlp = 3 * 2 * 64 * 128  # 49152
    logits = 2 * 64 * 128  # 16384
    linear = 2 * (q_down + q_up + kv_down + kv_up + out + mlp) + logits
    core = 0.5 * 2 * 4 * (8 + 4) + 0.5 * 2 * 4 * 8  # QK^T over 12 dims, attn@V over 8, causal halves
    c = flops_coefficients(m)
    assert c.linear == linear == 146432
    assert c.quadratic == 2 * core == 160
    # without q compression the query is one hidden x heads*(qk+rope) projection
    m2 = m.replace(q_lora_rank=None)
    assert flops_coefficients(m2).linear == linear - 2 * (q_down + q_up) + 2 * (2 * 64 * 48)


def test_mtp_adds_a_layer_a_projection_and_logits():
    m = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, swiglu=True,
                  vocab_size=128)
    base = flops_coefficients(m)
    with_mtp = flops_coefficients(m.replace(mtp_num_layers=1))
    layer = 2 * 64 * 192 + 2 * 64 * 64 + 3 * 2 * 64 * 128  # one more attention + MLP layer
    eh_proj = 2 * (2 * 64) * 64
    logits = 2 * 64 * 128
    assert with_mtp.linear - base.linear == layer + eh_proj + logits
    assert with_mtp.quadratic == base.quadratic * 3 / 2


def test_causal_attention_is_half_the_square():
    m = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128)
    full_square = 2 * 4 * 16 + 2 * 4 * 16  # QK^T and attn@V without a mask, per L^2
    assert flops_coefficients(m).quadratic == full_square / 2


def test_swiglu_mlp_is_three_halves_of_plain():
    kw = dict(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128)
    plain = flops_breakdown(ModelSpec(**kw)).dense_mlp_per_token
    gated = flops_breakdown(ModelSpec(**kw, swiglu=True)).dense_mlp_per_token
    assert plain == 2 * (2 * 64 * 256) and gated == 3 * (2 * 64 * 256)


def test_packed_sequences_do_not_attend_across_boundaries():
    m = ModelSpec.from_yaml("tiny-gpt")
    c = flops_coefficients(m)
    packed = calculate_fwd_flops([100, 300], m)
    assert packed == c.linear * 400 + c.quadratic * (100**2 + 300**2)
    assert packed < calculate_fwd_flops(400, m)


# -------------------------------------------------------------------- real models: published figures
@pytest.mark.parametrize(
    "preset, params_total, embedding",
    [
        # published total parameter counts (model cards); embedding = vocab x hidden
        ("llama-3.1-8b", 8.03e9, 128256 * 4096),  # untied: input embedding + LM head of the same size
        ("qwen3-8b", 8.19e9, 151936 * 4096),  # untied
    ],
)
def test_linear_term_is_two_flops_per_matmul_parameter(preset, params_total, embedding):
    # Every matmul weight is used once per token (2 FLOPs); the input embedding is a lookup (0 FLOPs).
    c = flops_coefficients(preset)
    assert c.linear == pytest.approx(2 * (params_total - embedding), rel=0.01)


def test_deepseek_v3_active_parameters():
    # 37B activated parameters per token (model card) = matmul weights per token + the input embedding
    c = flops_coefficients("deepseek-v3")
    assert c.linear / 2 + 129280 * 7168 == pytest.approx(37e9, rel=0.02)


# -------------------------------------------------------------------- agreement with Megatron-LM
LENGTH_SETS = {
    "short": [1, 17, 128, 512],
    "long": [32768, 8192, 4096],
    "mixed": list(np.random.default_rng(0).integers(1, 16384, size=200)),
}


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "qwen3-0.6b",
                                    "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"])
@pytest.mark.parametrize("lengths", list(LENGTH_SETS.values()), ids=list(LENGTH_SETS))
@pytest.mark.parametrize("mtp", [None, 1])
def test_matches_megatron_formula(preset, lengths, mtp):
    m = ModelSpec.from_yaml(preset)
    if mtp:
        m = m.replace(mtp_num_layers=mtp)
    arr = np.asarray(lengths, dtype=np.int64)
    ours = 3 * calculate_fwd_flops(arr, m)
    megatron = megatron_num_floating_point_operations(m, int(arr.sum()), int((arr**2).sum()))
    assert ours == pytest.approx(megatron, rel=5e-3)
    # the only differences are the norm MACs Megatron adds for MLA latents and MTP (documented): < 1e-5
    assert abs(ours / megatron - 1) < 1e-5


def test_megatron_bshd_closed_form_for_a_dense_gqa_model():
    # Megatron's BSHD default (batch B of full length S): tokens = B*S, sum of squares = B*S^2.
    m = ModelSpec.from_yaml("llama-3.1-8b")
    B, S = 4, 8192
    expected = (  # Megatron's closed form written out for Llama-3.1-8B (GQA, SwiGLU), training
        3 * 2 * B * S * 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
        + 3 * 2 * B * S * 4096 * 128256
        + 3 * 2 * B * S * S * 32 * 4096 / 2 * 2  # QK^T and attn@V, each half the square
    )
    assert megatron_num_floating_point_operations(m, B * S, B * S * S) == expected
    assert 3 * calculate_fwd_flops([S] * B, m) == pytest.approx(expected, rel=1e-12)


def test_router_omission_is_small():
    # The router GEMM (hidden x num_experts per MoE layer) is omitted, as in Megatron; it stays < 0.5%.
    for preset in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"):
        m = ModelSpec.from_yaml(preset)
        router = 2 * m.hidden_size * m.num_experts * m.num_moe_layers
        assert router / flops_coefficients(m).linear < 5e-3


# -------------------------------------------------------------------------------------------- API
def test_inputs_int_list_array_and_coefficients():
    m = "tiny-gpt"
    c = flops_coefficients(m)
    assert isinstance(c, FlopsCoefficients)
    assert calculate_fwd_flops(7, m) == calculate_fwd_flops([7], m) == calculate_fwd_flops(np.array([7]), m)
    assert calculate_fwd_flops([], m) == 0.0
    assert calculate_fwd_flops([3, 4], c) == calculate_fwd_flops([3, 4], m)
    per = sample_fwd_flops(np.array([[1, 2], [3, 4]]), m)
    assert per.shape == (2, 2) and per.dtype == np.float64
    assert per.sum() == pytest.approx(calculate_fwd_flops([1, 2, 3, 4], m))
    assert flops_coefficients(ModelSpec.from_yaml(m)) is flops_coefficients(ModelSpec.from_yaml(m))


def test_bad_lengths_raise():
    with pytest.raises(ValueError, match=r"seqlens=-3: sequence lengths must be >= 0"):
        calculate_fwd_flops([5, -3], "tiny-gpt")
    with pytest.raises(DynBatchConfigError, match="must be integers"):
        calculate_fwd_flops(["a"], "tiny-gpt")


def test_per_gpu_share():
    f = 1.2e15
    assert per_gpu_flops(f, "qwen3-8b", None) == f
    assert per_gpu_flops(f, "qwen3-8b", {"tp": 2, "pp": 4, "cp": 2, "dp": 8}) == f / 16
    # EP redistributes expert work among ranks: the average share is unchanged
    assert per_gpu_flops(f, "qwen3-30b-a3b", ParallelConfig(tp=1, pp=2, ep=8, dp=8)) == f / 2
    arr = per_gpu_flops(np.array([2.0, 4.0]), "tiny-gpt", {"tp": 2})
    assert np.array_equal(arr, [1.0, 2.0])
    with pytest.raises(ValueError, match=r"parallel\.ep=4: expert parallelism needs an MoE model"):
        per_gpu_flops(f, "qwen3-8b", {"ep": 4})
    with pytest.raises(ValueError, match=r"parallel\.ep=3: does not divide num_experts=128"):
        per_gpu_flops(f, "qwen3-30b-a3b", {"ep": 3})
    with pytest.raises(ValueError, match=r"parallel\.tp=16: does not divide num_query_groups=8"):
        per_gpu_flops(f, "qwen3-8b", {"tp": 16})


def test_expert_split_sums_to_total():
    lengths = [1000, 3000]
    non_expert, expert = split_expert_flops(lengths, "qwen3-30b-a3b")
    assert non_expert + expert == pytest.approx(calculate_fwd_flops(lengths, "qwen3-30b-a3b"))
    assert expert == 4000 * 48 * 8 * 3 * 2 * 2048 * 768
    assert split_expert_flops(lengths, "qwen3-8b")[1] == 0.0


def test_model_tflops_per_gpu():
    lengths = [4096] * 64
    fwd = calculate_fwd_flops(lengths, "qwen3-8b")
    got = model_tflops_per_gpu(lengths, "qwen3-8b", 2.0, 64)
    assert got == pytest.approx(3 * fwd / (2.0 * 64 * 1e12))
    assert model_tflops_per_gpu(lengths, "qwen3-8b", 2.0, {"dp": 8, "tp": 8}) == pytest.approx(got)
    assert model_tflops_per_gpu(lengths, "qwen3-8b", 2.0, 64, training=False) == pytest.approx(got / 3)
    assert math.isfinite(got) and 0 < got < 1e4
    with pytest.raises(ValueError, match="step_time_s"):
        model_tflops_per_gpu(lengths, "qwen3-8b", 0.0, 64)
