"""The FLOPs formula against a real measurement: ``torch.utils.flop_counter.FlopCounterMode`` around the forward
(and backward) of real megatron-core ``GPTModel``s on CPU (fp32, local layer spec, one gloo rank).

How the comparison works
------------------------
* FlopCounterMode counts every matmul (``mm``, ``addmm``, ``bmm``, ``baddbmm``) at 2 FLOPs per MAC and
  nothing else -- the same rule as :mod:`megatron_dynbatch.core.flops`.
* Megatron's local ``DotProductAttention`` computes ``QK^T`` with ``baddbmm`` and ``attn @ V`` with ``bmm``
  (both counted; the CPU SDPA kernel, which torch 2.13 has no formula for, is NOT used). It computes the FULL
  ``L x L`` square and masks afterwards, whereas the formula counts causal attention as half the square. So
  the measured forward of one sequence is ``linear*L + 2*quadratic*L**2``. Measuring two lengths gives both
  coefficients separately: the linear one is compared exactly, the quadratic one with the full-square factor 2.
* MoE: the router GEMM (``hidden x num_experts`` per token and MoE layer) is measured but deliberately not in
  the formula (Megatron-LM does not count it either); it is added to the expectation explicitly.
* MLA: megatron-core's local spec has no core attention that accepts MLA's different q/k and v head widths
  (``k_channels``/``v_channels``; that is Transformer Engine only), so the test plugs in a plain full-square
  causal attention written with ``torch.matmul``. The MLA projections measured are Megatron's own modules.
* The backward is checked to cost 2x the forward (data- and weight-gradient GEMMs), i.e. training = 3x.

Everything runs in one spawned process (``run_ranks(..., 1)``) so the gloo group and Megatron's global
parallel state never leak into other tests. Expected agreement is exact; the tolerance asked for is 2%.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_dynbatch import ModelSpec  # noqa: E402
from megatron_dynbatch.core.flops import flops_coefficients  # noqa: E402
from megatron_dynbatch.megatron.ranks import run_ranks  # noqa: E402

VOCAB = 128
LENGTHS = (16, 96)  # two lengths identify the linear and the quadratic coefficient
REL = 0.02


def _measure(model, L: int, batch: int = 1) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    tokens = torch.randint(0, VOCAB, (batch, L))
    positions = torch.arange(L).unsqueeze(0).expand(batch, L)
    with FlopCounterMode(display=False) as fwd_counter:
        logits = model(tokens, positions, None)
    with FlopCounterMode(display=False) as bwd_counter:
        logits.float().sum().backward()
    ops = {str(k): int(v) for k, v in fwd_counter.get_flop_counts().get("Global", {}).items()}
    return {"fwd": int(fwd_counter.get_total_flops()), "bwd": int(bwd_counter.get_total_flops()), "ops": ops}


def _mla_core_attention_class():
    """A minimal full-square causal core attention taking MLA's ``k_channels``/``v_channels`` (test only)."""
    from megatron.core.transformer.module import MegatronModule

    class FullSquareCausalAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, **kwargs):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            # [s, b, heads, dim] -> [b, heads, s, dim]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            scores = torch.matmul(q, k.transpose(-1, -2)) * (self.softmax_scale or q.shape[-1] ** -0.5)
            s = scores.shape[-1]
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            out = torch.matmul(scores.softmax(-1), v)  # [b, heads, s, dv]
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return FullSquareCausalAttention


def _worker(rank: int, world_size: int) -> dict:
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_dynbatch.megatron import cpu as megatron_cpu

    megatron_cpu.init_cpu_distributed(rank, world_size)
    results: dict = {}
    try:
        def run(name: str, model) -> None:
            results[name] = {
                "spec": ModelSpec.from_megatron(model).to_dict(),
                "runs": {L: _measure(model, L) for L in LENGTHS},
                "batch2": _measure(model, LENGTHS[0], batch=2),
            }

        # 1. tiny-gpt: GQA (4 heads, 2 groups), SwiGLU -- through the shared builder
        run("tiny-gpt", megatron_cpu.build_tiny_gpt(megatron_cpu.tiny_gpt_config(), vocab_size=VOCAB,
                                                    max_seq_len=512))

        # 2. MHA, plain GELU MLP, kv_channels 32 != hidden/heads (output projection is heads*kv_channels wide)
        cfg = megatron_cpu.tiny_gpt_config(num_query_groups=None, kv_channels=32, gated_linear_unit=False,
                                           activation_func=F.gelu, ffn_hidden_size=96)
        run("mha-wide-heads", megatron_cpu.build_tiny_gpt(cfg, vocab_size=VOCAB, max_seq_len=512))

        # 3. MoE: layer 0 dense, layers 1-2 MoE (4 experts, top-2) with a shared expert
        # (install_cpu_shims defines moe_utils.te_general_gemm; the alltoall dispatcher creates a CUDA stream,
        # so the allgather dispatcher with fixed sequence lengths is used here.)
        cfg = megatron_cpu.tiny_gpt_config(
            num_layers=3, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
            moe_shared_expert_intermediate_size=48, moe_layer_freq=[0, 1, 1], moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather", variable_seq_lengths=False,
        )
        block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
        run("moe", GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=VOCAB, max_sequence_length=512,
                            position_embedding_type="rope"))

        # 4. MLA (with and without q compression), Megatron's own MLA projections
        # (install_cpu_shims restores MLA's non-TE path: see the megatron_cpu module docstring, shim 7.)
        base = megatron_cpu.tiny_gpt_config(num_query_groups=None).__dict__
        mla_kwargs = {k: base[k] for k in (
            "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "gated_linear_unit",
            "activation_func", "add_bias_linear", "normalization", "hidden_dropout", "attention_dropout",
            "use_cpu_initialization", "params_dtype", "pipeline_dtype", "masked_softmax_fusion",
            "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion",
            "persist_layer_norm")}
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = _mla_core_attention_class()
        for name, q_lora in (("mla", 32), ("mla-no-q-lora", None)):
            mcfg = MLATransformerConfig(**mla_kwargs, q_lora_rank=q_lora, kv_lora_rank=16, qk_head_dim=8,
                                        qk_pos_emb_head_dim=4, v_head_dim=8, rope_type="rope")
            run(name, GPTModel(config=mcfg, transformer_layer_spec=spec, vocab_size=VOCAB,
                               max_sequence_length=512, position_embedding_type="none"))
    finally:
        megatron_cpu.destroy()
    return results


@pytest.fixture(scope="module")
def measured() -> dict:
    (res,) = run_ranks(_worker, 1, timeout=300, threads_per_rank=2)
    return res


MODELS = ["tiny-gpt", "mha-wide-heads", "moe", "mla", "mla-no-q-lora"]


def _router_flops_per_token(spec: ModelSpec) -> float:
    return 2.0 * spec.hidden_size * (spec.num_experts or 0) * spec.num_moe_layers


def test_spec_read_from_the_real_models(measured):
    assert ModelSpec.from_dict(measured["tiny-gpt"]["spec"]) == ModelSpec.from_yaml("tiny-gpt")
    wide = ModelSpec.from_dict(measured["mha-wide-heads"]["spec"])
    assert (wide.num_query_groups, wide.kv_channels, wide.swiglu) == (4, 32, False)
    moe = ModelSpec.from_dict(measured["moe"]["spec"])
    assert moe.moe_layer_pattern() == [0, 1, 1] and moe.moe_shared_expert_intermediate_size == 48
    assert ModelSpec.from_dict(measured["mla"]["spec"]).multi_latent_attention


def test_attention_is_measured_through_counted_matmuls(measured):
    ops = measured["tiny-gpt"]["runs"][LENGTHS[0]]["ops"]
    assert ops.get("aten.baddbmm", 0) > 0 and ops.get("aten.bmm", 0) > 0  # QK^T and attn@V
    assert not any("scaled_dot_product" in op for op in ops)


@pytest.mark.parametrize("name", MODELS)
def test_forward_flops_match_formula(name, measured):
    spec = ModelSpec.from_dict(measured[name]["spec"])
    c = flops_coefficients(spec)
    router = _router_flops_per_token(spec)
    for L, run in measured[name]["runs"].items():
        # the real kernel computes the whole square: twice the causal half the formula counts
        expected = (c.linear + router) * L + 2 * c.quadratic * L * L
        assert run["fwd"] == pytest.approx(expected, rel=REL), (name, L)


@pytest.mark.parametrize("name", MODELS)
def test_linear_and_quadratic_coefficients_separately(name, measured):
    spec = ModelSpec.from_dict(measured[name]["spec"])
    c = flops_coefficients(spec)
    (l1, r1), (l2, r2) = sorted(measured[name]["runs"].items())
    f1, f2 = r1["fwd"], r2["fwd"]
    # solve f = a*L + b*L^2 from two lengths
    b = (f2 / l2 - f1 / l1) / (l2 - l1)
    a = f1 / l1 - b * l1
    assert a == pytest.approx(c.linear + _router_flops_per_token(spec), rel=1e-6)
    assert b == pytest.approx(2 * c.quadratic, rel=1e-6)  # full square measured = 2 x causal half


@pytest.mark.parametrize("name", MODELS)
def test_backward_is_twice_forward_and_batch_is_linear(name, measured):
    for run in measured[name]["runs"].values():
        assert run["bwd"] == pytest.approx(2 * run["fwd"], rel=REL)
    L = LENGTHS[0]
    assert measured[name]["batch2"]["fwd"] == pytest.approx(2 * measured[name]["runs"][L]["fwd"], rel=1e-9)
