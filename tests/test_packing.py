"""THD packing: layout, padding, labels/loss mask, extras, unpack, zero-length samples, errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatron_dynbatch.core.alignment import Alignment  # noqa: E402
from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402
from megatron_dynbatch.megatron.packing import PackedMicroBatch, pack_microbatch  # noqa: E402
from megatron_dynbatch.core.parallel import ParallelConfig  # noqa: E402

PAD = 7


def _samples(lengths, seed=0, **fields):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        s = {"tokens": torch.randint(10, 100, (n,), generator=g)}
        for name, kind in fields.items():
            if kind == "float":
                s[name] = torch.randn(n, generator=g)
            elif kind == "scalar":
                s[name] = float(n) / 10
        out.append(s)
    return out


def _expected_layout(lengths, alignment):
    padded = [int(alignment.seq_len(n)) for n in lengths]
    total = alignment.padded_total(sum(padded))
    padded[-1] += total - sum(padded)
    return padded, total


CP2 = Alignment.for_layout(ParallelConfig(cp=2))  # seq 4, total 4
# seq 4, total 64: each of the cp*tp = 4 GPUs holds a 16-token (FP8 tile) share of the sequence-parallel input
CP2_SP_FP8 = Alignment.for_layout(ParallelConfig(cp=2, tp=2, sequence_parallel=True), fp8="fp8")


def test_cu_seqlens_real_and_padded():
    lengths = [3, 5, 8]
    pk = pack_microbatch(_samples(lengths), CP2, pad_token_id=PAD)
    assert pk.seqlens == [3, 5, 8]
    assert pk.seqlens_padded == [4, 8, 8]
    assert pk.cu_seqlens.tolist() == [0, 3, 8, 16]
    assert pk.cu_seqlens_padded.tolist() == [0, 4, 12, 20]
    assert pk.cu_seqlens.dtype == torch.int32 and pk.cu_seqlens_padded.dtype == torch.int32
    assert pk.num_tokens == 20 and pk.num_real_tokens == 16 and pk.num_padding_tokens == 4
    assert pk.tokens.shape == pk.labels.shape == pk.loss_mask.shape == pk.position_ids.shape == (1, 20)


def test_packed_seq_params_fields():
    pytest.importorskip("megatron.core")
    pk = pack_microbatch(_samples([3, 5, 8]), CP2)
    p = pk.packed_seq_params
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 3, 8, 16]
    assert p.cu_seqlens_q_padded.tolist() == p.cu_seqlens_kv_padded.tolist() == [0, 4, 12, 20]
    assert p.cu_seqlens_q.dtype == torch.int32 and p.cu_seqlens_q_padded.dtype == torch.int32
    assert p.max_seqlen_q == p.max_seqlen_kv == 8 and type(p.max_seqlen_q) is int
    assert pk.packed_seq_params is p  # built once


def test_tail_padding_goes_to_last_slot():
    lengths = [3, 5, 8]
    pk = pack_microbatch(_samples(lengths), CP2_SP_FP8)
    padded, total = _expected_layout(lengths, CP2_SP_FP8)
    assert total == 64 and pk.num_tokens == 64
    assert pk.seqlens_padded == padded == [4, 8, 52]
    assert all(p % CP2_SP_FP8.seq_multiple == 0 for p in pk.seqlens_padded)
    assert pk.num_padding_tokens == 64 - 16
    assert (pk.num_tokens // (2 * 2)) % 16 == 0  # every GPU's local share is a whole FP8 tile


def test_labels_shift_within_sample_and_loss_mask():
    samples = _samples([3, 5], seed=1)
    pk = pack_microbatch(samples, CP2, pad_token_id=PAD)
    tok, lab, mask = pk.tokens[0], pk.labels[0], pk.loss_mask[0]
    for s, start, n, p in zip(samples, pk.cu_seqlens_padded[:-1].tolist(), pk.seqlens, pk.seqlens_padded):
        t = s["tokens"]
        assert tok[start:start + n].tolist() == t.tolist()
        assert lab[start:start + n - 1].tolist() == t[1:].tolist()  # never crosses into the next sample
        assert lab[start + n - 1].item() == PAD and mask[start + n - 1].item() == 0.0
        assert mask[start:start + n - 1].tolist() == [1.0] * (n - 1)
        assert (tok[start + n:start + p] == PAD).all() and (lab[start + n:start + p] == PAD).all()
        assert (mask[start + n:start + p] == 0).all()
    assert mask.dtype == torch.float32
    assert pk.num_loss_tokens == (3 - 1) + (5 - 1)


def test_position_ids_restart_and_continue_through_padding():
    pk = pack_microbatch(_samples([3, 5]), CP2)
    assert pk.position_ids[0].tolist() == [0, 1, 2, 3] + list(range(8))


def test_explicit_labels_and_loss_mask_are_used_as_given():
    s = [{"tokens": [1, 2, 3], "labels": [4, 5, 6], "loss_mask": [0, 1, 1]},
         {"tokens": [7, 8], "labels": [9, 10], "loss_mask": [1, 1]}]
    pk = pack_microbatch(s, CP2, pad_token_id=0)
    assert pk.labels[0].tolist() == [4, 5, 6, 0, 9, 10, 0, 0]
    assert pk.loss_mask[0].tolist() == [0, 1, 1, 0, 1, 1, 0, 0]


def test_given_loss_mask_without_labels_still_drops_last_position():
    s = [{"tokens": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}]
    pk = pack_microbatch(s, Alignment())
    assert pk.labels[0].tolist() == [2, 3, 4, 0]
    assert pk.loss_mask[0].tolist() == [0, 1, 1, 0]


def test_extras_per_token_and_per_sample():
    samples = _samples([3, 5], seed=2, advantages="float", reward="scalar")
    for s in samples:
        s["old_log_probs"] = s["advantages"].double() * 2
        s["topk"] = torch.arange(len(s["tokens"]) * 2).view(-1, 2)  # [L, 2]
        s["uid"] = f"id{len(s['tokens'])}"
    pk = pack_microbatch(samples, CP2)
    assert set(pk.extras) == {"advantages", "old_log_probs", "topk"}
    assert pk.extras["advantages"].shape == (1, 12) and pk.extras["advantages"].dtype == torch.float32
    assert pk.extras["old_log_probs"].dtype == torch.float64
    assert pk.extras["topk"].shape == (1, 12, 2)
    assert pk.sample_fields == {"reward": [0.3, 0.5], "uid": ["id3", "id5"]}
    for name in pk.extras:
        back = pk.unpack(pk.extras[name])
        for s, b in zip(samples, back):
            torch.testing.assert_close(b, s[name].to(b.dtype), rtol=0, atol=0)
        full = pk.extras[name][0]
        pad_positions = torch.ones(pk.num_tokens, dtype=torch.bool)
        for start, n in zip(pk.cu_seqlens_padded[:-1].tolist(), pk.seqlens):
            pad_positions[start:start + n] = False
        assert (full[pad_positions] == 0).all()


def test_list_extras_are_per_token_when_lengths_match():
    s = [{"tokens": [1, 2, 3], "adv": [0.5, 0.5, 0.5]}, {"tokens": [4, 5], "adv": [1.0, 2.0]}]
    pk = pack_microbatch(s, Alignment())
    assert pk.extras["adv"][0].tolist() == [0.5, 0.5, 0.5, 1.0, 2.0]


def test_unpack_round_trip_all_shapes():
    samples = _samples([4, 1, 6, 2], seed=3)
    pk = pack_microbatch(samples, CP2_SP_FP8)
    for back, s in zip(pk.unpack(pk.tokens), samples):
        assert back.tolist() == s["tokens"].tolist()
    for back, s in zip(pk.unpack(pk.tokens[0]), samples):  # [T]
        assert back.tolist() == s["tokens"].tolist()
    logits = torch.randn(1, pk.num_tokens, 11)
    pieces = pk.unpack(logits)
    assert [p.shape for p in pieces] == [(4, 11), (1, 11), (6, 11), (2, 11)]
    assert torch.equal(pieces[2], logits[0, pk.cu_seqlens_padded[2]:pk.cu_seqlens_padded[2] + 6])


def test_zero_length_sample():
    samples = [{"tokens": [1, 2, 3]}, {"tokens": []}, {"tokens": torch.tensor([4, 5], dtype=torch.long)}]
    for align in (Alignment(), CP2, CP2_SP_FP8):
        pk = pack_microbatch(samples, align)
        padded, total = _expected_layout([3, 0, 2], align)
        assert pk.seqlens == [3, 0, 2] and pk.seqlens_padded == padded and pk.num_tokens == total
        assert pk.seqlens_padded[1] == align.seq_len(0)
        assert pk.cu_seqlens.tolist() == [0, 3, 3, 5]
        assert pk.num_loss_tokens == 2 + 1
        assert [t.tolist() for t in pk.unpack(pk.tokens)] == [[1, 2, 3], [], [4, 5]]


def test_all_zero_length_still_has_tokens():
    pk = pack_microbatch([{"tokens": []}, {"tokens": []}], CP2)
    assert pk.num_tokens > 0 and pk.num_real_tokens == 0 and pk.num_loss_tokens == 0


def test_sample_indices_and_to():
    pk = pack_microbatch(_samples([2, 3]), Alignment(), sample_indices=[10, 4])
    assert pk.sample_indices == [10, 4]
    moved = pk.to("cpu")
    assert isinstance(moved, PackedMicroBatch) and torch.equal(moved.tokens, pk.tokens)
    assert moved.cu_seqlens_padded.tolist() == pk.cu_seqlens_padded.tolist()


@pytest.mark.parametrize(
    "samples, field",
    [
        ([], "samples"),
        ([{"tokens": [[1, 2]]}], "samples[0]['tokens'].ndim"),
        ([{"toks": [1]}], "samples[0]"),
        ([{"tokens": [1, 2], "adv": torch.ones(3)}], "samples[0]['adv'].shape"),
        ([{"tokens": [1, 2], "loss_mask": [1]}], "samples[0]['loss_mask'].shape"),
        ([{"tokens": [1], "adv": torch.ones(1)}, {"tokens": [2]}], "samples[1] keys"),
        ([{"tokens": [1], "labels": [2]}, {"tokens": [2]}], "samples[1]['labels']"),
    ],
)
def test_bad_inputs_raise_config_error(samples, field):
    with pytest.raises(DynBatchConfigError) as info:
        pack_microbatch(samples, Alignment())
    assert info.value.field == field
    assert "Fix:" in str(info.value)


def test_bad_sample_indices_and_unpack_shape():
    with pytest.raises(DynBatchConfigError, match="sample_indices"):
        pack_microbatch(_samples([2]), Alignment(), sample_indices=[0, 1])
    pk = pack_microbatch(_samples([2, 3]), CP2)
    with pytest.raises(DynBatchConfigError, match="per_token.shape"):
        pk.unpack(torch.zeros(1, pk.num_tokens + 1))


def test_packing_module_does_not_import_megatron():
    code = ("import sys; import megatron_dynbatch.megatron.packing as p; "
            "p.pack_microbatch([{'tokens': [1, 2]}]); assert 'megatron.core' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    cp=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2, 4]),
    sp=st.booleans(),
    fp8=st.sampled_from([None, "fp8", "mxfp8"]),
    explicit_mask=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_packing_invariants(lengths, cp, tp, sp, fp8, explicit_mask, seed):
    align = Alignment.for_layout(ParallelConfig(cp=cp, tp=tp, sequence_parallel=sp), fp8=fp8)
    rng = np.random.default_rng(seed)
    samples = []
    for n in lengths:
        s = {"tokens": torch.from_numpy(rng.integers(1, 50, n)), "adv": torch.from_numpy(rng.normal(size=n))}
        if explicit_mask:
            s["loss_mask"] = torch.from_numpy(rng.integers(0, 2, n))
        samples.append(s)
    pk = pack_microbatch(samples, align, pad_token_id=0)
    padded, total = _expected_layout(lengths, align)

    # layout = what the planner budgets
    assert pk.num_tokens == total == align.padded_total(int(align.seq_len(lengths).sum()))
    assert total % align.total_multiple == 0 and total % cp == 0
    assert pk.seqlens_padded == padded and all(p % align.seq_multiple == 0 for p in padded)
    assert pk.cu_seqlens_padded.tolist() == np.concatenate([[0], np.cumsum(padded)]).tolist()
    assert pk.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert pk.num_padding_tokens == total - sum(lengths)

    # padding is never trained on; the last real token of every sample is never a target
    real = torch.zeros(total, dtype=torch.bool)
    for start, n in zip(pk.cu_seqlens_padded[:-1].tolist(), lengths):
        real[start:start + n] = True
        if n:
            assert pk.loss_mask[0, start + n - 1] == 0
    assert (pk.loss_mask[0][~real] == 0).all()
    assert (pk.extras["adv"][0][~real] == 0).all()
    expected_loss_tokens = sum(
        int(s["loss_mask"][:-1].sum()) if explicit_mask else max(n - 1, 0) for s, n in zip(samples, lengths)
    )
    assert pk.num_loss_tokens == expected_loss_tokens

    # round trip
    for back, s in zip(pk.unpack(pk.tokens), samples):
        assert back.tolist() == s["tokens"].tolist()
    for back, s in zip(pk.unpack(pk.extras["adv"]), samples):
        assert back.tolist() == s["adv"].tolist()
