"""Loss normalisation: per-micro-batch contributions, after Megatron's own scaling, sum to the exact global loss
(and gradient) whatever the packing. Single process, pure torch: Megatron's schedule / DDP / finalize scaling is
re-enacted here from megatron-core 0.16 (schedules.forward_step_calc_loss, DDP gradient_scaling_factor,
finalize_model_grads)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")  # PackedSeqParams type for pack_microbatch

from megatron_dynbatch.core.alignment import Alignment  # noqa: E402
from megatron_dynbatch.megatron.context_parallel import slice_packed_for_cp, zigzag_partition_indices  # noqa: E402
from megatron_dynbatch.demo import reference_coefficients  # noqa: E402
from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402
from megatron_dynbatch.megatron.loss import (  # noqa: E402
    RESULT_KEY,
    LossNormalizer,
    loss_mask_stats,
    make_loss_func,
    megatron_loss_factor,
    reference_loss,
    sample_loss_mask,
)
from megatron_dynbatch.megatron.packing import pack_microbatch  # noqa: E402
from megatron_dynbatch.core.parallel import ParallelConfig  # noqa: E402


def _random_batch(rng: np.random.Generator, n: int, with_labels: bool = False):
    samples = []
    for i in range(n):
        length = int(rng.integers(0, 24))
        s = {"tokens": torch.as_tensor(rng.integers(1, 50, size=length)), "group_id": int(rng.integers(0, 3))}
        kind = rng.integers(0, 4)
        s["loss_mask"] = torch.ones(length)
        if kind == 1:  # prompt masked
            mask = torch.zeros(length)
            mask[int(rng.integers(0, length + 1)):] = 1.0
            s["loss_mask"] = mask
        elif kind == 2:  # fully masked sample
            s["loss_mask"] = torch.zeros(length)
        if with_labels:
            s["labels"] = torch.as_tensor(rng.integers(1, 50, size=length))
        samples.append(s)
    return samples


def _random_packing(rng: np.random.Generator, n: int, dp: int, m: int):
    """A random assignment of samples to dp ranks x m micro-batches (no empty micro-batch)."""
    order = rng.permutation(n).tolist()
    slots = [(r, j) for r in range(dp) for j in range(m)]
    out = [[[] for _ in range(m)] for _ in range(dp)]
    for k, (r, j) in enumerate(slots):  # one each first
        out[r][j].append(order[k])
    for i in order[len(slots):]:
        r, j = slots[int(rng.integers(0, len(slots)))]
        out[r][j].append(i)
    return out


def _megatron_total(values, counts, *, m, dp, cp, per_token, tuple_size):
    """The quantity whose gradient Megatron applies, given every loss function's returned value."""
    if tuple_size == 3 and not per_token:
        per_rank = [v / max(int(n), 1) / m for v, n in zip(values, counts)]
        return sum(per_rank) / (dp * cp)  # DDP: sum over DP x CP, gradient_scaling_factor 1/(dp*cp)
    if tuple_size == 3 and per_token:
        total_tokens = sum(int(n) for n in counts)
        s = sum(values)
        return s / total_tokens if total_tokens > 0 else s
    if not per_token:
        return sum(v * cp / m for v in values) / (dp * cp)
    return sum(v * cp / m for v in values)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("mode", ["token_mean", "sample_mean", "group_mean", "token_sum"])
def test_contributions_sum_to_global_loss_and_gradient(seed, mode):
    rng = np.random.default_rng(seed)
    dp, cp = int(rng.integers(1, 4)), int(rng.choice([1, 2]))
    m = int(rng.integers(1, 4))
    n = dp * m + int(rng.integers(0, 8))
    samples = _random_batch(rng, n, with_labels=bool(seed % 3 == 0))
    groups = [s["group_id"] for s in samples]
    align = Alignment.for_layout(ParallelConfig(dp=dp, cp=cp, tp=2, sequence_parallel=bool(seed % 2)))
    normalizer = LossNormalizer.from_samples(samples, mode, group_ids=groups)

    # One differentiable per-token loss vector per sample (positive, like a cross-entropy).
    leaves = [torch.rand(len(s["tokens"]), dtype=torch.float64, generator=torch.Generator().manual_seed(i))
              .float().requires_grad_(True) for i, s in enumerate(samples)]
    masks = [torch.from_numpy(sample_loss_mask(s)) for s in samples]
    coef = reference_coefficients(samples, mode, groups)
    expected = sum(c * float((leaf.detach().double() * mk).sum()) for c, leaf, mk in zip(coef, leaves, masks))
    assert reference_loss(normalizer, leaves, masks) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert np.allclose(normalizer.coefficients, coef, rtol=1e-12, atol=0)

    packing = _random_packing(rng, n, dp, m)
    for per_token in (False, True):
        for tuple_size in (3, 2):
            values, counts = [], []
            for r in range(dp):
                for mb in packing[r]:
                    full = pack_microbatch([samples[i] for i in mb], align, sample_indices=mb)
                    # the packed per-token loss tensor, built differentiably from the per-sample leaves
                    starts = full.cu_seqlens_padded[:-1].tolist()
                    pieces, cursor = [], 0
                    for i, s0, ln in zip(mb, starts, full.seqlens):
                        if s0 > cursor:
                            pieces.append(torch.zeros(s0 - cursor))
                        pieces.append(leaves[i])
                        cursor = s0 + ln
                    pieces.append(torch.zeros(full.num_tokens - cursor))
                    per_tok_full = torch.cat(pieces).unsqueeze(0)
                    for c in range(cp):
                        packed = slice_packed_for_cp(full, cp, c) if cp > 1 else full
                        idx = zigzag_partition_indices(full.cu_seqlens_padded, cp, c)
                        out = per_tok_full.index_select(1, idx)
                        fn = make_loss_func(normalizer, packed, num_microbatches=m, calculate_per_token_loss=per_token,
                                            dp_size=dp, cp_size=cp, tuple_size=tuple_size)
                        ret = fn(out)
                        if tuple_size == 3:
                            value, num, logs = ret
                            counts.append(int(num))
                        else:
                            value, logs = ret
                            counts.append(0)
                        assert isinstance(logs[RESULT_KEY].loss_sum, torch.Tensor)
                        values.append(value)
            total = _megatron_total(values, counts, m=m, dp=dp, cp=cp, per_token=per_token, tuple_size=tuple_size)
            assert float(total.detach()) == pytest.approx(expected, rel=1e-5, abs=1e-6), (per_token, tuple_size)
            grads = torch.autograd.grad(total, leaves, allow_unused=True)
            for i, (g, c, mk) in enumerate(zip(grads, coef, masks)):
                want = (c * mk).float()
                got = g if g is not None else torch.zeros_like(want)
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (i, per_token, tuple_size)


def test_loss_sums_logged_add_up():
    rng = np.random.default_rng(3)
    samples = _random_batch(rng, 10)
    norm = LossNormalizer.from_samples(samples, "token_mean")
    losses = {i: torch.rand(len(s["tokens"])) for i, s in enumerate(samples)}
    total = 0.0
    for mb in ([0, 1, 2], [3, 4], [5, 6, 7, 8, 9]):
        packed = pack_microbatch([samples[i] for i in mb], Alignment(), sample_indices=mb)
        out = torch.zeros(1, packed.num_tokens)
        for i, s0, n in zip(mb, packed.cu_seqlens_padded[:-1].tolist(), packed.seqlens):
            out[0, s0:s0 + n] = losses[i]
        _, _, logs = make_loss_func(norm, packed, num_microbatches=3, dp_size=1, cp_size=1)(out)
        total += float(logs[RESULT_KEY].loss_sum)
    masks = {i: torch.from_numpy(sample_loss_mask(s)) for i, s in enumerate(samples)}
    assert total == pytest.approx(reference_loss(norm, losses, masks), rel=1e-9)


def test_sample_loss_mask_matches_packer():
    rng = np.random.default_rng(0)
    for with_labels, with_mask in ((False, True), (True, True), (False, False)):
        samples = _random_batch(rng, 12, with_labels=with_labels)
        if not with_mask:
            for s in samples:
                del s["loss_mask"]
        packed = pack_microbatch(samples, Alignment(seq_multiple=4, total_multiple=8))
        sums, counts = loss_mask_stats(samples)
        for i, (s0, n) in enumerate(zip(packed.cu_seqlens_padded[:-1].tolist(), packed.seqlens)):
            got = packed.loss_mask[0, s0:s0 + n].double().numpy()
            assert np.array_equal(got, sample_loss_mask(samples[i]))
            assert sums[i] == got.sum() and counts[i] == np.count_nonzero(got)


def test_modes_definitions_small_example():
    # three samples, masks sum to 2, 4, 0 ; groups a, a, b
    sums = [2.0, 4.0, 0.0]
    tm = LossNormalizer.from_stats(sums, None, "token_mean")
    assert tm.coefficients.tolist() == [1 / 6, 1 / 6, 1 / 6] and tm.total_loss_tokens == 6
    sm = LossNormalizer.from_stats(sums, None, "sample_mean")
    assert sm.coefficients.tolist() == [1 / 4, 1 / 8, 0.0] and sm.num_units == 2
    gm = LossNormalizer.from_stats(sums, None, "group_mean", group_ids=["a", "a", "b"])
    assert gm.coefficients.tolist() == [1 / 6, 1 / 6, 0.0] and gm.num_units == 1
    gs = LossNormalizer.from_stats(sums, None, "group_mean", group_ids=["a", "a", "b"], group_reduce="sample")
    assert gs.coefficients.tolist() == [1 / 4, 1 / 8, 0.0]
    ts = LossNormalizer.from_stats(sums, None, "token_sum")
    assert ts.coefficients.tolist() == [1.0, 1.0, 1.0]
    sub = LossNormalizer.from_stats(sums, None, "token_mean", subset=[1, 2])
    assert sub.coefficients.tolist() == [0.0, 0.25, 0.25] and sub.total_loss_tokens == 4


def test_all_masked_step_gives_zero_loss_and_no_nan():
    samples = [{"tokens": torch.arange(5), "loss_mask": torch.zeros(5)} for _ in range(2)]
    for mode in ("token_mean", "sample_mean"):
        norm = LossNormalizer.from_samples(samples, mode)
        packed = pack_microbatch(samples, Alignment())
        out = torch.rand(1, packed.num_tokens, requires_grad=True)
        for per_token in (False, True):
            value, num, _ = make_loss_func(norm, packed, num_microbatches=1, calculate_per_token_loss=per_token,
                                           dp_size=1, cp_size=1)(out)
            assert float(value.detach()) == 0.0 and int(num) == 0
            (g,) = torch.autograd.grad(value, out)
            assert torch.isfinite(g).all() and float(g.abs().sum()) == 0.0


def test_factor_table():
    kw = dict(num_microbatches=4, dp_size=2, cp_size=2, total_loss_tokens=100)
    assert megatron_loss_factor(calculate_per_token_loss=False, **kw) == 16
    assert megatron_loss_factor(calculate_per_token_loss=True, **kw) == 100
    assert megatron_loss_factor(calculate_per_token_loss=False, tuple_size=2, **kw) == 8
    assert megatron_loss_factor(calculate_per_token_loss=True, tuple_size=2, **kw) == 2
    with pytest.raises(DynBatchConfigError, match="tuple_size"):
        megatron_loss_factor(calculate_per_token_loss=False, tuple_size=4, **kw)


def test_errors():
    with pytest.raises(DynBatchConfigError, match="loss_mode"):
        LossNormalizer.from_stats([1.0], None, "mean")
    with pytest.raises(DynBatchConfigError, match="group_ids"):
        LossNormalizer.from_stats([1.0], None, "group_mean")
    with pytest.raises(DynBatchConfigError, match="group_reduce"):
        LossNormalizer.from_stats([1.0], None, "group_mean", group_ids=[0], group_reduce="median")
    with pytest.raises(DynBatchConfigError, match="loss_mask"):
        sample_loss_mask({"tokens": [1, 2, 3], "loss_mask": [1, 1]})
    packed = pack_microbatch([{"tokens": torch.arange(4)}], Alignment())
    with pytest.raises(DynBatchConfigError, match="cp_size"):
        make_loss_func(LossNormalizer.from_stats([3.0]), packed, num_microbatches=1, dp_size=1, cp_size=2)
