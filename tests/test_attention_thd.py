"""THE key equivalence: a real megatron-core GPTModel run on a packed THD micro-batch (CPU reference core
attention) gives the same per-token logits, losses and gradients as running every sample alone (sbhd)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_dynbatch.core.alignment import Alignment  # noqa: E402
from megatron_dynbatch.megatron.context_parallel import gather_cp_outputs, slice_packed_for_cp  # noqa: E402
from megatron_dynbatch.megatron.context_parallel import zigzag_partition_indices  # noqa: E402
from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402
from megatron_dynbatch.megatron.packing import pack_microbatch  # noqa: E402
from megatron_dynbatch.core.parallel import ParallelConfig  # noqa: E402

VOCAB = 128
ATOL = 1e-5


@pytest.fixture(scope="module")
def models(megatron_world1):
    """Tiny GPTs with the THD spec: GQA (4 heads / 2 groups), MHA and MQA."""
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    out = {}
    for name, groups in (("gqa", 2), ("mha", 4), ("mqa", 1)):
        torch.manual_seed(0)
        cfg = megatron_cpu.tiny_gpt_config(num_query_groups=groups)
        out[name] = megatron_cpu.build_tiny_gpt(cfg, vocab_size=VOCAB, max_seq_len=256, thd=True).eval()
    return out


def _samples(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, VOCAB, (n,), generator=g)} for n in lengths]


def _packed_logits(model, pk):
    return model(pk.tokens, pk.position_ids, None, packed_seq_params=pk.packed_seq_params)


def _alone_logits(model, tokens):
    n = tokens.numel()
    return model(tokens.view(1, n), torch.arange(n).view(1, n), None)[0]  # causal sbhd, batch 1


CASES = [
    ([7, 1, 13, 4], Alignment()),  # no padding at all
    ([5, 0, 9, 1, 12], Alignment.for_layout(ParallelConfig(cp=2))),  # padding between sequences
    ([3, 17, 8], Alignment.for_layout(ParallelConfig(cp=4, tp=2, sequence_parallel=True), fp8="fp8")),
]


@pytest.mark.parametrize("kind", ["gqa", "mha", "mqa"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_packed_forward_equals_per_sample_forward(models, kind, case):
    lengths, align = CASES[case]
    model = models[kind]
    samples = _samples(lengths, seed=case)
    pk = pack_microbatch(samples, align)
    with torch.no_grad():
        logits = _packed_logits(model, pk)
        assert logits.shape == (1, pk.num_tokens, VOCAB)
        for s, got in zip(samples, pk.unpack(logits)):
            if s["tokens"].numel() == 0:
                assert got.shape == (0, VOCAB)
                continue
            want = _alone_logits(model, s["tokens"])
            assert (got - want).abs().max().item() <= ATOL


@pytest.mark.parametrize("seed", range(6))
def test_random_lengths_packed_equals_unpacked(models, seed):
    g = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(1, 7, (1,), generator=g))
    lengths = torch.randint(0, 40, (n,), generator=g).tolist()
    cp = [1, 2, 4][seed % 3]
    align = Alignment.for_layout(ParallelConfig(cp=cp), fp8=[None, "fp8"][seed % 2])
    samples = _samples(lengths, seed=seed)
    pk = pack_microbatch(samples, align)
    with torch.no_grad():
        pieces = pk.unpack(_packed_logits(models["gqa"], pk))
        for s, got in zip(samples, pieces):
            if s["tokens"].numel():
                assert (got - _alone_logits(models["gqa"], s["tokens"])).abs().max().item() <= ATOL


def test_packed_loss_and_gradients_equal_sum_of_per_sample(models):
    model = models["gqa"]
    samples = _samples([6, 11, 0, 3], seed=7)
    pk = pack_microbatch(samples, Alignment.for_layout(ParallelConfig(cp=2)))
    params = [p for p in model.parameters() if p.requires_grad]

    model.zero_grad(set_to_none=True)
    per_token = model(pk.tokens, pk.position_ids, None, labels=pk.labels, packed_seq_params=pk.packed_seq_params)
    assert per_token.shape == (1, pk.num_tokens)
    packed_loss = (per_token * pk.loss_mask).sum()
    packed_loss.backward()
    packed_grads = [p.grad.clone() for p in params]

    model.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for s in samples:
        n = s["tokens"].numel()
        if n < 2:
            continue
        one = pack_microbatch([s], Alignment())  # labels shifted within the sample, last position masked
        loss = model(one.tokens, torch.arange(n).view(1, n), None, labels=one.labels)  # sbhd
        total = total + (loss * one.loss_mask).sum()
    total.backward()
    torch.testing.assert_close(packed_loss, total, rtol=1e-6, atol=1e-5)
    for p, g in zip(params, packed_grads):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


def test_cp_slicing_reassembles_the_packed_forward(models):
    """Slicing the packed inputs for every CP rank and gathering the ranks' shares of the packed forward's output
    gives back exactly the packed forward (the real CP attention on 2 ranks: tests/test_megatron_cp_sp.py)."""
    cp = 2
    samples = _samples([5, 14, 1, 9], seed=3)
    pk = pack_microbatch(samples, Alignment.for_layout(ParallelConfig(cp=cp)))
    with torch.no_grad():
        logits = _packed_logits(models["gqa"], pk)
    parts = [slice_packed_for_cp(pk, cp, r) for r in range(cp)]
    for r, part in enumerate(parts):  # each rank's inputs are the packed inputs at its zig-zag positions
        idx = zigzag_partition_indices(pk.cu_seqlens_padded, cp, r)
        assert torch.equal(part.tokens, pk.tokens[:, idx])
        assert part.packed_seq_params.cu_seqlens_q_padded.tolist() == pk.cu_seqlens_padded.tolist()
    rank_outputs = [logits[:, zigzag_partition_indices(pk.cu_seqlens_padded, cp, r)] for r in range(cp)]
    full = gather_cp_outputs(rank_outputs, pk.cu_seqlens_padded, cp)
    assert torch.equal(full, logits)
    assert torch.equal(gather_cp_outputs([p.tokens for p in parts], pk.cu_seqlens_padded, cp), pk.tokens)
    for s, got in zip(samples, pk.unpack(full)):
        assert (got - _alone_logits(models["gqa"], s["tokens"])).abs().max().item() <= ATOL


# ------------------------------------------------------------------------------------ the module alone
def _core(megatron_world1, groups=2, **cfg_overrides):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dynbatch.megatron.attention import ThdDotProductAttention
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    cfg = megatron_cpu.tiny_gpt_config(num_query_groups=groups, **cfg_overrides)
    return ThdDotProductAttention(cfg, layer_number=2, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _reference(q, k, v, cu, cu_padded, scale):
    """Per-sequence causal SDPA with GQA (torch's own kernel), zeros on padding rows."""
    t, h, d = q.shape
    out = torch.zeros(t, h * d)
    for i in range(len(cu) - 1):
        s, n = int(cu_padded[i]), int(cu[i + 1] - cu[i])
        if n == 0:
            continue
        o = torch.nn.functional.scaled_dot_product_attention(
            q[s:s + n].transpose(0, 1), k[s:s + n].transpose(0, 1), v[s:s + n].transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=True)
        out[s:s + n] = o.transpose(0, 1).reshape(n, h * d)
    return out


@pytest.mark.parametrize("qk_scaling", [False, True])
def test_core_attention_matches_sdpa_and_zeros_padding(megatron_world1, qk_scaling):
    core = _core(megatron_world1, apply_query_key_layer_scaling=qk_scaling)
    pk = pack_microbatch(_samples([3, 0, 6, 2], seed=1), Alignment.for_layout(ParallelConfig(cp=2)))
    T = pk.num_tokens
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, nh, 16, generator=g) for nh in (4, 2, 2))
    out = core(q, k, v, None, packed_seq_params=pk.packed_seq_params)
    assert out.shape == (T, 4 * 16)
    ref = _reference(q, k, v, pk.cu_seqlens, pk.cu_seqlens_padded, scale=16 ** -0.5)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    pad = torch.ones(T, dtype=torch.bool)
    for s, n in zip(pk.cu_seqlens_padded[:-1].tolist(), pk.seqlens):
        pad[s:s + n] = False
    assert (out[pad] == 0).all()
    out4 = core(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None, packed_seq_params=pk.packed_seq_params)
    torch.testing.assert_close(out4, out, rtol=0, atol=0)


def test_core_attention_unpacked_path_is_megatron_dot_product_attention(megatron_world1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    core = _core(megatron_world1)
    ref = DotProductAttention(core.config, layer_number=2, attn_mask_type=AttnMaskType.causal,
                              attention_type="self")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 2, nh, 16, generator=g) for nh in (4, 2, 2))  # [s, b, heads, d]
    torch.testing.assert_close(core(q, k, v, None), ref(q, k, v, None), rtol=0, atol=0)


def test_core_attention_rejects_unsupported_inputs(megatron_world1):
    core = _core(megatron_world1)
    pk = pack_microbatch(_samples([4, 4], seed=0), Alignment.for_layout(ParallelConfig(cp=2)))
    q, k, v = torch.randn(4, 4, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16)  # a CP half of T=8
    with pytest.raises(DynBatchConfigError, match="context-parallel"):
        core(q, k, v, None, packed_seq_params=pk.packed_seq_params)
    windowed = _core(megatron_world1, window_size=(4, 0))
    q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    with pytest.raises(DynBatchConfigError, match="sliding-window"):
        windowed(q, k, v, None, packed_seq_params=pk.packed_seq_params)


def test_thd_spec_swaps_only_core_attention(megatron_world1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_dynbatch.megatron.attention import ThdDotProductAttention
    from megatron_dynbatch.megatron.specs import get_thd_local_layer_spec

    spec = get_thd_local_layer_spec(normalization="RMSNorm")
    assert spec.submodules.self_attention.submodules.core_attention is ThdDotProductAttention
    plain = get_gpt_layer_local_spec(normalization="RMSNorm")
    assert plain.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert spec.submodules.mlp.module is plain.submodules.mlp.module
