"""On a GPU: torch's fused varlen flash kernel (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.11) in the
THD attention, forward and backward against the per-sample reference in bf16 -- the kernel alone (GQA, the
bottom-right causal alignment CP relies on), ``ThdDotProductAttention``'s dispatch (padding, GQA, CP chunks) and
a whole megatron-core GPTModel. Skipped on machines without CUDA (every CPU machine of this project); the same
dispatch runs on CPU with the reference kernel in tests/test_attention_varlen.py. How to run it on a lent GPU:
benchmarks/gpu/README.md."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from megatron_dynbatch.megatron import varlen  # noqa: E402
from megatron_dynbatch.testing.attention_ref import cumulative, per_sample_attention  # noqa: E402

KERNEL, WHY = varlen.torch_varlen_kernel()
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or KERNEL is None,
    reason="needs a CUDA GPU and torch's varlen_attn (torch >= 2.11)"
           + ("" if torch.cuda.is_available() else ": no CUDA device here") + (f": {WHY}" if WHY else ""))

BF16 = torch.bfloat16
DEV = "cuda"


def _rel(a, b):
    """max |a - b| / max |b| (bf16 kernels differ by rounding, not by math)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def _leaves(t, heads, groups, d=64, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(t, n, d, generator=g, device=DEV, dtype=BF16).requires_grad_(True)
            for n in (heads, groups, groups)]


def _fwd_bwd(fn, leaves):
    out = fn(*leaves)
    out.float().square().sum().backward()
    grads = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    return out.detach(), grads




# ------------------------------------------------------------------------------------------ the kernel
@pytest.mark.parametrize("causal", [True, False])
def test_flash_kernel_equals_reference_kernel_bf16(causal):
    lens = [300, 1, 1024, 77]
    c = cumulative(lens)
    cu = torch.tensor(c, dtype=torch.int32, device=DEV)
    leaves = _leaves(sum(lens), 8, 2)
    window = (-1, 0) if causal else (-1, -1)
    got = _fwd_bwd(lambda q, k, v: varlen.varlen_attention(
        q, k, v, varlen.thd_segments(c, c, c, c), kernel=KERNEL, scale=0.125,
        causal=causal), leaves)
    want = _fwd_bwd(lambda q, k, v: varlen.reference_varlen_attn(
        q.float(), k.float(), v.float(), cu, cu, 1024, 1024, scale=0.125, window_size=window,
        enable_gqa=True).reshape(len(q), -1), leaves)
    assert _rel(got[0], want[0]) < 2e-2
    for a, b in zip(got[1], want[1]):
        assert _rel(a, b) < 3e-2


def test_flash_causal_mask_is_bottom_right_aligned():
    """Queries at positions [s, s+n) against keys [0, s+n) equal those rows of full causal attention -- the
    alignment the CP chunks rely on (a top-left kernel would fail this)."""
    q, k, v = (x.detach() for x in _leaves(512, 4, 4))
    one = torch.tensor([0, 512], dtype=torch.int32, device=DEV)
    full = KERNEL.fn(q, k, v, one, one, 512, 512, scale=0.125, window_size=(-1, 0))
    for s, n in ((0, 128), (128, 64), (384, 128)):
        cq = torch.tensor([0, n], dtype=torch.int32, device=DEV)
        ck = torch.tensor([0, s + n], dtype=torch.int32, device=DEV)
        part = KERNEL.fn(q[s:s + n], k[:s + n], v[:s + n], cq, ck, n, s + n, scale=0.125, window_size=(-1, 0))
        assert _rel(part, full[s:s + n]) < 1e-2


# ------------------------------------------------------------------------------------------ the dispatch
def _core(groups, cls=None, **cfg):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dynbatch.megatron.attention import ThdDotProductAttention
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    config = megatron_cpu.tiny_gpt_config(num_attention_heads=8, num_query_groups=groups, hidden_size=512,
                                          bf16=True, params_dtype=BF16, deterministic_mode=False, **cfg)
    return (cls or ThdDotProductAttention)(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                           attention_type="self")


def _params(cu, cu_p, **extra):
    from megatron.core.packed_seq_params import PackedSeqParams

    a = torch.tensor(cu, dtype=torch.int32, device=DEV)
    b = torch.tensor(cu_p, dtype=torch.int32, device=DEV)
    m = max(y - x for x, y in zip(cu_p, cu_p[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=a, cu_seqlens_kv=a, cu_seqlens_q_padded=b,
                           cu_seqlens_kv_padded=b, max_seqlen_q=m, max_seqlen_kv=m, **extra)


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_thd_attention_uses_flash_and_matches_per_sample_bf16(cuda_world1, groups):
    core = _core(groups)
    assert core.thd_varlen_kernel is not None and core.thd_varlen_kernel.name == KERNEL.name
    lens, slots = [300, 0, 1000, 77], [304, 8, 1008, 80]
    cu, cu_p = cumulative(lens), cumulative(slots)
    leaves = _leaves(cu_p[-1], 8, groups)
    assert core._varlen_kernel_for(leaves[0]) is not None  # the flash path, not the loop
    got = _fwd_bwd(lambda q, k, v: core(q, k, v, None, packed_seq_params=_params(cu, cu_p)), leaves)
    want = _fwd_bwd(lambda q, k, v: per_sample_attention(q, k, v, cu, cu_p), leaves)
    assert _rel(got[0], want[0]) < 2e-2
    pad = torch.ones(cu_p[-1], dtype=torch.bool, device=DEV)
    for s, n in zip(cu_p[:-1], lens):
        pad[s:s + n] = False
    assert (got[0][pad] == 0).all()
    for a, b in zip(got[1], want[1]):
        assert _rel(a, b) < 3e-2
        assert (a[pad] == 0).all()


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_chunks_through_flash_equal_the_full_batch_bf16(cuda_world1, cp):
    from megatron_dynbatch.megatron.attention import ThdDotProductAttention
    from megatron_dynbatch.megatron.context_parallel import gather_cp_outputs, zigzag_partition_indices

    class OneProcessCP(ThdDotProductAttention):
        def _cp_world(self, group):
            return group.size, group.rank

        def _cp_gather(self, kv, group):
            return group.gathered

    core = _core(2, cls=OneProcessCP)
    lens = [300, 1000, 5, 640]
    slots = [-(-n // (2 * cp)) * 2 * cp for n in lens]
    cu, cu_p = cumulative(lens), cumulative(slots)
    leaves = _leaves(cu_p[-1], 8, 2, seed=cp)
    pad_t = torch.tensor(cu_p, device=DEV)
    idx = [zigzag_partition_indices(pad_t, cp, r) for r in range(cp)]

    def sharded(q, k, v):
        gathered = torch.cat([torch.cat([k[i], v[i]], dim=-1) for i in idx])
        parts = [core(q[idx[r]], k[idx[r]], v[idx[r]], None, packed_seq_params=_params(
            cu, cu_p, local_cp_size=cp, cp_group=SimpleNamespace(size=cp, rank=r, gathered=gathered)))
            for r in range(cp)]
        return gather_cp_outputs(parts, pad_t, cp, seq_dim=0)

    got = _fwd_bwd(sharded, leaves)
    want = _fwd_bwd(lambda q, k, v: per_sample_attention(q, k, v, cu, cu_p), leaves)
    assert _rel(got[0], want[0]) < 2e-2
    for a, b in zip(got[1], want[1]):
        assert _rel(a, b) < 3e-2


def test_gpt_model_packed_equals_per_sample_bf16(cuda_world1):
    """A megatron-core GPTModel (THD local spec, flash inside) on a packed micro-batch vs every sample alone
    (Megatron's own sbhd attention): logits and gradients agree to bf16 rounding."""
    from megatron_dynbatch.core.alignment import Alignment
    from megatron_dynbatch.core.parallel import ParallelConfig
    from megatron_dynbatch.megatron.packing import pack_microbatch
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    torch.manual_seed(0)
    config = megatron_cpu.tiny_gpt_config(hidden_size=256, num_attention_heads=4, num_query_groups=2,
                                          kv_channels=64, ffn_hidden_size=512, bf16=True, params_dtype=BF16,
                                          use_cpu_initialization=False, deterministic_mode=False)
    model = megatron_cpu.build_tiny_gpt(config, vocab_size=256, max_seq_len=1024, thd=True).cuda().bfloat16()
    g = torch.Generator().manual_seed(1)
    samples = [{"tokens": torch.randint(0, 256, (n,), generator=g)} for n in (200, 17, 511)]
    pk = pack_microbatch(samples, Alignment.for_layout(ParallelConfig(cp=2)), device=DEV)
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(pk.tokens, pk.position_ids, None, packed_seq_params=pk.packed_seq_params)
    sum(x.float().square().sum() for x in pk.unpack(logits)).backward()  # real rows only
    packed_grads = [p.grad.float().clone() for p in params]
    model.zero_grad(set_to_none=True)
    alone = []
    for s in samples:
        n = s["tokens"].numel()
        tok = s["tokens"].to(DEV).view(1, n)
        alone.append(model(tok, torch.arange(n, device=DEV).view(1, n), None)[0])
    for got, want in zip(pk.unpack(logits.detach()), alone):
        assert _rel(got, want.detach()) < 3e-2
    sum(a.float().square().sum() for a in alone).backward()
    for a, p in zip(packed_grads, params):
        assert _rel(a, p.grad.float()) < 5e-2
