"""Zig-zag CP slicing: indices vs independent implementations (and Megatron's THD RoPE), round trips."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatron_dynbatch.core.alignment import Alignment  # noqa: E402
from megatron_dynbatch.megatron.context_parallel import (  # noqa: E402
    gather_cp_outputs,
    slice_packed_for_cp,
    zigzag_partition_indices,
)
from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402
from megatron_dynbatch.megatron.packing import pack_microbatch  # noqa: E402
from megatron_dynbatch.core.parallel import ParallelConfig  # noqa: E402


def naive_chunks(padded_lengths, cp, rank):
    """Cut every sequence into 2*cp chunks with plain lists; keep chunks rank and 2cp-1-rank."""
    out, start = [], 0
    for p in padded_lengths:
        seq = list(range(start, start + p))
        c = p // (2 * cp)
        chunks = [seq[i * c:(i + 1) * c] for i in range(2 * cp)]
        out += chunks[rank] + chunks[2 * cp - 1 - rank]
        start += p
    return out


def naive_per_token(padded_lengths, cp, rank):
    """Walk the rank's local token slots one by one (local sequence length = padded/cp)."""
    out, global_start = [], 0
    for p in padded_lengths:
        local = p // cp
        half = local // 2
        for j in range(local):
            chunk = rank if j < half else 2 * cp - 1 - rank
            out.append(global_start + chunk * half + (j % half if half else 0))
        global_start += p
    return out


def _cu(padded):
    return torch.tensor([0] + list(torch.tensor(padded).cumsum(0).tolist()), dtype=torch.int32)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_indices_match_naive(cp):
    padded = [2 * cp * k for k in (1, 3, 0, 2, 5)]
    for rank in range(cp):
        idx = zigzag_partition_indices(_cu(padded), cp, rank)
        assert idx.dtype == torch.int64
        assert idx.tolist() == naive_chunks(padded, cp, rank) == naive_per_token(padded, cp, rank)


def test_known_example_cp2():
    # one sequence of 8 -> chunks [0,1] [2,3] [4,5] [6,7]; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert zigzag_partition_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag_partition_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


@settings(max_examples=80, deadline=None)
@given(chunks=st.lists(st.integers(0, 6), min_size=1, max_size=7), cp=st.integers(1, 5))
def test_ranks_partition_every_token_exactly_once(chunks, cp):
    padded = [2 * cp * c for c in chunks]
    cu = _cu(padded)
    all_idx = [zigzag_partition_indices(cu, cp, r) for r in range(cp)]
    assert all(len(i) == sum(padded) // cp for i in all_idx)
    assert sorted(torch.cat(all_idx).tolist()) == list(range(sum(padded)))
    for r in range(cp):
        assert all_idx[r].tolist() == naive_chunks(padded, cp, r)


def test_matches_megatron_sbhd_cp_split_for_a_single_sequence():
    mutils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    cp, L = 4, 24
    freqs = torch.arange(L).view(L, 1, 1, 1)
    for rank in range(cp):
        ours = zigzag_partition_indices(torch.tensor([0, L], dtype=torch.int32), cp, rank)
        theirs = mutils._get_thd_freqs_on_this_cp_rank(rank, cp, torch.empty(L // cp), freqs).flatten()
        assert ours.tolist() == theirs.tolist()


class _FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_sliced_position_ids_match_megatron_thd_rope_on_each_cp_rank():
    """Megatron's THD RoPE on a CP rank (full cu_seqlens_padded, local tokens) must rotate exactly as the
    full-sequence RoPE does at the positions our slicing gives that rank."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    cp, heads, dim = 2, 2, 8
    align = Alignment.for_layout(ParallelConfig(cp=cp))
    pk = pack_microbatch([{"tokens": list(range(n))} for n in (5, 12, 1, 7)], align)
    T, max_len = pk.num_tokens, pk.max_seqlen
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    ang = torch.outer(torch.arange(max_len).float(), inv)
    freqs = torch.cat([ang, ang], dim=-1).view(max_len, 1, 1, dim)
    x = torch.randn(T, heads, dim)
    full = _apply_rotary_pos_emb_thd(x, pk.cu_seqlens_padded, freqs, cp_group=_FakeGroup(1, 0))
    for rank in range(cp):
        idx = zigzag_partition_indices(pk.cu_seqlens_padded, cp, rank)
        local = _apply_rotary_pos_emb_thd(x[idx], pk.cu_seqlens_padded, freqs, cp_group=_FakeGroup(cp, rank))
        torch.testing.assert_close(local, full[idx], rtol=0, atol=1e-6)
        assert slice_packed_for_cp(pk, cp, rank).position_ids[0].tolist() == pk.position_ids[0][idx].tolist()


def _packed(lengths, cp, seed=0, fp8=None):
    g = torch.Generator().manual_seed(seed)
    samples = [{"tokens": torch.randint(1, 99, (n,), generator=g), "adv": torch.randn(n, generator=g),
                "reward": float(n)} for n in lengths]
    return pack_microbatch(samples, Alignment.for_layout(ParallelConfig(cp=cp), fp8=fp8))


@pytest.mark.parametrize("cp", [2, 4])
def test_slice_then_gather_is_identity(cp):
    pk = _packed([3, 0, 17, 8, 1], cp, fp8="fp8")
    parts = [slice_packed_for_cp(pk, cp, r) for r in range(cp)]
    for p in parts:
        assert p.cp_size == cp and p.num_local_tokens == pk.num_tokens // cp and p.num_tokens == pk.num_tokens
        assert torch.equal(p.cu_seqlens_padded, pk.cu_seqlens_padded)  # FULL cu_seqlens on every rank
        assert p.sample_fields == pk.sample_fields
    for name in ("tokens", "labels", "loss_mask", "position_ids"):
        full = gather_cp_outputs([getattr(p, name) for p in parts], pk.cu_seqlens_padded, cp)
        assert torch.equal(full, getattr(pk, name)), name
        flat = gather_cp_outputs([getattr(p, name)[0] for p in parts], pk.cu_seqlens_padded, cp)  # [T/cp]
        assert torch.equal(flat, getattr(pk, name)[0]), name
    gathered = gather_cp_outputs([p.extras["adv"] for p in parts], pk.cu_seqlens_padded, cp)
    assert torch.equal(gathered, pk.extras["adv"])
    assert sum(p.num_loss_tokens for p in parts) == pk.num_loss_tokens


def test_gather_logits_like_outputs_and_gradients():
    cp = 2
    pk = _packed([6, 9], cp)
    full = torch.randn(pk.num_tokens, 3, requires_grad=True)
    parts = [full[zigzag_partition_indices(pk.cu_seqlens_padded, cp, r)] for r in range(cp)]
    back = gather_cp_outputs(parts, pk.cu_seqlens_padded, cp)
    assert torch.equal(back, full)
    back.sum().backward()
    assert torch.equal(full.grad, torch.ones_like(full))
    pieces = pk.unpack(back)
    assert [p.shape[0] for p in pieces] == [6, 9]


def test_cp1_is_identity():
    pk = _packed([3, 5], 1)
    assert slice_packed_for_cp(pk, 1, 0) is pk
    assert zigzag_partition_indices(pk.cu_seqlens_padded, 1, 0).tolist() == list(range(pk.num_tokens))
    assert gather_cp_outputs([pk.tokens], pk.cu_seqlens_padded, 1) is pk.tokens


def test_errors():
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(DynBatchConfigError, match="not divisible by 2\\*cp=4"):
        zigzag_partition_indices(cu, 2, 0)
    with pytest.raises(DynBatchConfigError, match="cp_rank"):
        zigzag_partition_indices(torch.tensor([0, 8]), 2, 2)
    with pytest.raises(DynBatchConfigError, match="cp_size"):
        zigzag_partition_indices(torch.tensor([0, 8]), 0, 0)
    pk = _packed([3, 5], 2)
    part = slice_packed_for_cp(pk, 2, 1)
    with pytest.raises(DynBatchConfigError, match="already CP-sliced"):
        slice_packed_for_cp(part, 2, 0)
    with pytest.raises(DynBatchConfigError, match="gather_cp_outputs"):
        part.unpack(part.tokens)
    with pytest.raises(DynBatchConfigError, match="one output per CP rank"):
        gather_cp_outputs([part.tokens], pk.cu_seqlens_padded, 2)
    with pytest.raises(DynBatchConfigError, match="T/cp"):
        gather_cp_outputs([pk.tokens, pk.tokens], pk.cu_seqlens_padded, 2)
