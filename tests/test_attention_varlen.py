"""The fused-kernel path of the THD attention, on CPU: the varlen layout and ``ThdDotProductAttention``'s
dispatch run with the pure-torch reference kernel in the seam (same signature and semantics as torch's
``varlen_attn``), and must equal the per-sample reference -- outputs and gradients, padding rows 0 with no
gradient, GQA, context parallelism (each local chunk against the keys up to its end, bottom-right causal).
The same checks with torch's flash kernel on a GPU: tests/test_attention_varlen_gpu.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from megatron_dynbatch.megatron import varlen  # noqa: E402
from megatron_dynbatch.megatron.context_parallel import gather_cp_outputs, zigzag_partition_indices  # noqa: E402
from megatron_dynbatch.testing.attention_ref import cumulative, per_sample_attention  # noqa: E402
from megatron_dynbatch.megatron.varlen import (  # noqa: E402
    REFERENCE_KERNEL, cp_segments, reference_varlen_attn, thd_segments, varlen_attention)




def _qkv(t, heads=4, groups=2, d=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, n, d, generator=g).requires_grad_(grad) for n in (heads, groups, groups)]


# ------------------------------------------------------------------------------------------ the kernel
@pytest.mark.parametrize("causal", [True, False])
def test_reference_kernel_equals_per_sample_sdpa(causal):
    lens = [5, 1, 9]
    cu = torch.tensor(cumulative(lens), dtype=torch.int32)
    q, k, v = _qkv(sum(lens), heads=4, groups=4)
    out = reference_varlen_attn(q, k, v, cu, cu, 9, 9, scale=8 ** -0.5, window_size=(-1, 0) if causal else (-1, -1))
    torch.testing.assert_close(out.reshape(len(q), -1), per_sample_attention(q, k, v, cu, cu, causal),
                               rtol=0, atol=1e-6)


def test_reference_kernel_causal_mask_is_bottom_right_aligned():
    """Queries at positions [s, s+n) of a sequence against the keys [0, s+n): bottom-right alignment makes that
    the same rows of full causal attention (what the CP chunks rely on)."""
    q, k, v = _qkv(12, heads=2, groups=2)
    full = reference_varlen_attn(q, k, v, torch.tensor([0, 12], dtype=torch.int32),
                                 torch.tensor([0, 12], dtype=torch.int32), 12, 12, window_size=(-1, 0))
    for s, n in ((0, 3), (4, 3), (9, 3), (5, 7)):
        part = reference_varlen_attn(q[s:s + n], k[:s + n], v[:s + n], torch.tensor([0, n], dtype=torch.int32),
                                     torch.tensor([0, s + n], dtype=torch.int32), n, s + n, window_size=(-1, 0))
        torch.testing.assert_close(part, full[s:s + n], rtol=0, atol=1e-6)
    # (top-left alignment would let the chunk's first query see key 0 only: row 9 would be v[0])
    assert not torch.allclose(full[9], v[0], atol=1e-3)


def test_reference_kernel_rejects_head_mismatch_without_gqa():
    q, k, v = _qkv(4, heads=4, groups=2)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="enable_gqa"):
        reference_varlen_attn(q, k, v, cu, cu, 4, 4)
    assert reference_varlen_attn(q, k, v, cu, cu, 4, 4, enable_gqa=True).shape == (4, 4, 8)


# ------------------------------------------------------------------------------------------ the layout
@pytest.mark.parametrize("gqa_kernel", [True, False])
def test_layout_with_padding_matches_per_sample_and_pads_are_inert(gqa_kernel):
    lens, slots = [3, 0, 6, 2], [4, 4, 8, 4]
    cu, cu_p = cumulative(lens), cumulative(slots)
    q, k, v = _qkv(cu_p[-1], grad=True)
    kernel = REFERENCE_KERNEL if gqa_kernel else varlen.VarlenKernel(
        lambda *a, **kw: reference_varlen_attn(*a, **kw), "expanding", cuda_only=False, gqa=False)
    segs = thd_segments(cu, cu, cu_p, cu_p)
    assert [s[1] for s in segs] == [3, 6, 2]  # the empty sample is no segment
    out = varlen_attention(q, k, v, segs, kernel=kernel, scale=8 ** -0.5, causal=True)
    ref = per_sample_attention(q, k, v, cu, cu_p)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    pad = torch.ones(cu_p[-1], dtype=torch.bool)
    for s, n in zip(cu_p[:-1], lens):
        pad[s:s + n] = False
    assert (out[pad] == 0).all()
    out.square().sum().backward()
    for x in (q, k, v):
        assert (x.grad[pad] == 0).all()  # padding rows get no gradient
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    ref.square().sum().backward()
    for x, g in zip((q, k, v), grads):
        torch.testing.assert_close(g, x.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_cp_segments_reproduce_full_attention_at_the_local_rows(cp, causal):
    lens = [5, 16, 0, 9]
    slots = [-(-max(n, 1) // (2 * cp)) * 2 * cp for n in lens]
    cu, cu_p = cumulative(lens), cumulative(slots)
    q, k, v = _qkv(cu_p[-1], seed=cp)
    full = per_sample_attention(q, k, v, cu, cu_p, causal)
    parts = []
    for r in range(cp):
        idx = zigzag_partition_indices(torch.tensor(cu_p), cp, r)
        segs = cp_segments(cu_p, cu, cp, r, causal)
        parts.append(varlen_attention(q[idx], k, v, segs, kernel=REFERENCE_KERNEL, scale=8 ** -0.5, causal=causal))
    torch.testing.assert_close(gather_cp_outputs(parts, torch.tensor(cu_p), cp, seq_dim=0), full, rtol=0, atol=1e-6)


def test_cp_segments_are_chunks_against_the_keys_up_to_their_end():
    # one sequence of 16 slots, 13 real tokens, cp=2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2
    assert cp_segments([0, 16], [0, 13], 2, 0, causal=True) == [(0, 4, 0, 4), (4, 1, 0, 13)]
    assert cp_segments([0, 16], [0, 13], 2, 1, causal=True) == [(0, 4, 0, 8), (4, 4, 0, 12)]
    assert cp_segments([0, 16], [0, 13], 2, 1, causal=False) == [(0, 4, 0, 13), (4, 4, 0, 13)]


# ------------------------------------------------------------------------------------------ kernel resolution
def test_torch_kernel_is_found_and_declines_cpu_inputs():
    kernel, why = varlen.torch_varlen_kernel()
    if kernel is None:
        pytest.skip(f"this torch has no varlen_attn: {why}")
    assert kernel.name.endswith("varlen_attn") and kernel.cuda_only
    assert not kernel.accepts(torch.zeros(4, 2, 8, dtype=torch.bfloat16))  # CPU: the per-sequence loop runs


def test_missing_kernel_falls_back_with_one_log_line(monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # "import" fails as on torch < 2.11
    kernel, why = varlen.torch_varlen_kernel()
    assert kernel is None and "varlen" in why
    monkeypatch.setattr(varlen, "_DEFAULT", [])
    with caplog.at_level(logging.WARNING, logger=varlen.__name__):
        assert varlen.default_varlen_kernel() is None
        assert varlen.default_varlen_kernel() is None
    lines = [r for r in caplog.records if "per-sequence pure-torch path" in r.getMessage()]
    assert len(lines) == 1


def test_kernel_without_the_parameters_is_refused(monkeypatch):
    from torch.nn.attention import varlen as tv

    monkeypatch.setattr(tv, "varlen_attn", lambda q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False: q)
    kernel, why = varlen.torch_varlen_kernel()
    assert kernel is None and "window_size" in why


# ------------------------------------------------------------------------------------------ the dispatch
@pytest.fixture
def core_factory(megatron_world1):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dynbatch.megatron.attention import ThdDotProductAttention
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    def make(groups=2, mask=AttnMaskType.causal, cls=ThdDotProductAttention, **cfg):
        return cls(megatron_cpu.tiny_gpt_config(num_query_groups=groups, **cfg), layer_number=2,
                   attn_mask_type=mask, attention_type="self")

    return make


def _params(cu, cu_p, **extra):
    from megatron.core.packed_seq_params import PackedSeqParams

    a, b = torch.tensor(cu, dtype=torch.int32), torch.tensor(cu_p, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=a, cu_seqlens_kv=a, cu_seqlens_q_padded=b,
                           cu_seqlens_kv_padded=b, max_seqlen_q=max(y - x for x, y in zip(cu_p, cu_p[1:])),
                           max_seqlen_kv=max(y - x for x, y in zip(cu_p, cu_p[1:])), **extra)


def test_cpu_default_is_the_unchanged_loop_bitwise(core_factory):
    core = core_factory()
    assert core.thd_varlen_kernel is varlen.default_varlen_kernel()
    lens, slots = [3, 6, 2], [4, 8, 4]
    q, k, v = _qkv(16, d=16)
    params = _params(cumulative(lens), cumulative(slots))
    got = core(q, k, v, None, packed_seq_params=params)
    core.thd_varlen_kernel = None
    assert torch.equal(got, core(q, k, v, None, packed_seq_params=params))


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("qk_scaling", [False, True])
def test_dispatch_with_reference_kernel_matches_per_sample(core_factory, groups, qk_scaling):
    core = core_factory(groups=groups, apply_query_key_layer_scaling=qk_scaling)
    lens, slots = [3, 0, 6, 2], [4, 4, 8, 4]
    cu, cu_p = cumulative(lens), cumulative(slots)
    leaves = _qkv(cu_p[-1], heads=4, groups=groups, d=16, grad=True)
    out = {}
    for name, kernel in (("loop", None), ("kernel", REFERENCE_KERNEL)):
        core.thd_varlen_kernel = kernel
        o = core(*leaves, None, packed_seq_params=_params(cu, cu_p))
        o.square().sum().backward()
        out[name] = (o.detach(), [x.grad.clone() for x in leaves])
        for x in leaves:
            x.grad = None
    torch.testing.assert_close(out["kernel"][0], out["loop"][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out["kernel"][0], per_sample_attention(*[x.detach() for x in leaves], cu, cu_p),
                               rtol=0, atol=1e-6)
    for a, b in zip(out["kernel"][1], out["loop"][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_dispatch_keeps_the_loop_for_dropout_in_training_and_says_so_once(core_factory, monkeypatch, caplog):
    monkeypatch.setattr(varlen, "_NOTED", set())
    core = core_factory(attention_dropout=0.1)
    core.thd_varlen_kernel = REFERENCE_KERNEL
    q = torch.zeros(4, 4, 16)
    with caplog.at_level(logging.WARNING, logger=varlen.__name__):
        assert core.train()._varlen_kernel_for(q) is None
        assert core._varlen_kernel_for(q) is None
    assert len([r for r in caplog.records if "no attention dropout" in r.getMessage()]) == 1
    assert core.eval()._varlen_kernel_for(q) is REFERENCE_KERNEL


def _one_process_cp_class():
    from megatron_dynbatch.megatron.attention import ThdDotProductAttention

    class OneProcessCP(ThdDotProductAttention):
        """CP rank ``group.rank`` of ``group.size`` in one process: the gather returns every rank's K/V rows,
        built from the full leaf tensors, so gradients of all ranks add up on the leaves as a real CP run's do."""

        def _cp_world(self, group):
            return group.size, group.rank

        def _cp_gather(self, kv, group):
            return group.gathered

    return OneProcessCP


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kernel", [None, REFERENCE_KERNEL], ids=["loop", "kernel"])
def test_cp_dispatch_equals_the_full_batch(core_factory, cp, kernel):
    """Every CP rank's share through the CP path (the dynamic-CP entry: ``local_cp_size``/``cp_group``), output
    gathered and gradients summed over ranks, equals the cp=1 path on the whole micro-batch."""
    core = core_factory(cls=_one_process_cp_class())
    core.thd_varlen_kernel = kernel
    lens = [5, 16, 0, 9, 1]
    slots = [-(-max(n, 1) // (2 * cp)) * 2 * cp for n in lens]
    cu, cu_p = cumulative(lens), cumulative(slots)
    leaves = _qkv(cu_p[-1], d=16, grad=True, seed=cp)
    pad_t = torch.tensor(cu_p)
    idx = [zigzag_partition_indices(pad_t, cp, r) for r in range(cp)]
    parts = []
    for r in range(cp):
        q, k, v = (x[idx[r]] for x in leaves)
        gathered = torch.cat([torch.cat([leaves[1][i], leaves[2][i]], dim=-1) for i in idx])
        group = SimpleNamespace(size=cp, rank=r, gathered=gathered)
        parts.append(core(q, k, v, None, packed_seq_params=_params(cu, cu_p, local_cp_size=cp, cp_group=group)))
    full = gather_cp_outputs(parts, pad_t, cp, seq_dim=0)
    full.square().sum().backward()
    grads = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    core.thd_varlen_kernel = None
    ref = core(*leaves, None, packed_seq_params=_params(cu, cu_p))
    torch.testing.assert_close(full, ref, rtol=0, atol=1e-6)
    ref.square().sum().backward()
    for g, x in zip(grads, leaves):
        torch.testing.assert_close(g, x.grad, rtol=0, atol=1e-5)


def test_gpt_model_with_reference_kernel_equals_per_sample(megatron_world1):
    """A whole GPTModel (THD spec) with the kernel seam set: packed logits and gradients equal each sample alone."""
    from megatron_dynbatch.core.alignment import Alignment
    from megatron_dynbatch.core.parallel import ParallelConfig
    from megatron_dynbatch.megatron.attention import set_thd_varlen_kernel
    from megatron_dynbatch.megatron.packing import pack_microbatch
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    torch.manual_seed(0)
    model = megatron_cpu.build_tiny_gpt(megatron_cpu.tiny_gpt_config(), vocab_size=128, max_seq_len=64, thd=True)
    assert set_thd_varlen_kernel(model, REFERENCE_KERNEL) == 2
    g = torch.Generator().manual_seed(3)
    samples = [{"tokens": torch.randint(0, 128, (n,), generator=g)} for n in (6, 11, 3)]
    pk = pack_microbatch(samples, Alignment.for_layout(ParallelConfig(cp=2)))
    params = [p for p in model.parameters() if p.requires_grad]
    loss = (model(pk.tokens, pk.position_ids, None, labels=pk.labels, packed_seq_params=pk.packed_seq_params)
            * pk.loss_mask).sum()
    loss.backward()
    packed = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    total = 0.0
    for s in samples:
        one = pack_microbatch([s], Alignment())
        n = s["tokens"].numel()
        total = total + (model(one.tokens, torch.arange(n).view(1, n), None, labels=one.labels) * one.loss_mask).sum()
    total.backward()
    torch.testing.assert_close(loss, total, rtol=1e-6, atol=1e-5)
    for a, p in zip(packed, params):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-5)
