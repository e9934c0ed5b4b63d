"""ROLL drop-in: ``dynamic_batching_shard`` keeps ROLL's contract (the batch reordered into ``dp`` equal shards;
one list of ``[start, end)`` ranges shared by all shards, tiling them; ``micro_batch_lengths`` multiples of the
round that no sample of the micro-batch exceeds; ``rows x length <= max_tokens_per_microbatch``; the meta_info
keys and metrics ROLL reads) and adds ours: Megatron's exact VPP rule, a clear error for a sample over the
budget, a start-up check of the configured width. The micro-batches are consumed here as ROLL's
``make_micro_batch_iter_for_dynamic_batching`` does (slice the shard, cut the columns to the length)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from megatron_dynbatch import DynBatchConfigError, OversizeSampleError  # noqa: E402
from megatron_dynbatch.core.parallel import ParallelConfig  # noqa: E402
from megatron_dynbatch.core.planner.vpp import is_valid_microbatch_count  # noqa: E402
from megatron_dynbatch.integrations.roll import dynamic_batching_shard  # noqa: E402
from megatron_dynbatch.testing.peer_types import grpo_batch  # noqa: E402


def consume(batch, dp):
    """ROLL's consumer: per rank, its shard's micro-batches cut to ``[rows, length]``."""
    n = len(batch) // dp
    out = []
    for r in range(dp):
        shard = batch.slice(r * n, (r + 1) * n)
        mbs = []
        for (a, b), s in zip(batch.meta_info["micro_batch_indices"], batch.meta_info["micro_batch_lengths"]):
            mb = shard.slice(a, b)
            cut = {k: v[:, :s] for k, v in mb.batch.items() if v.dim() == 2}
            mbs.append((mb.non_tensor_batch["sample_id"].tolist(), cut))
        out.append(mbs)
    return out


def check(batch, lengths, dp, cap, rnd):
    meta = batch.meta_info
    n = len(lengths) // dp
    ranges, lens = meta["micro_batch_indices"], meta["micro_batch_lengths"]
    assert meta["num_micro_batchs"] == len(ranges) == len(lens)
    assert meta["global_micro_batch_indices"] == ranges and meta["global_micro_batch_lengths"] == lens
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a < b for a, b in ranges) and all(ranges[k][1] == ranges[k + 1][0] for k in range(len(ranges) - 1))
    assert all(s % rnd == 0 and s >= rnd and (b - a) * s <= cap for (a, b), s in zip(ranges, lens))
    ids = batch.non_tensor_batch["sample_id"].tolist()
    assert sorted(ids) == list(range(len(lengths)))
    for r, mbs in enumerate(consume(batch, dp)):
        for (samples, cut), s in zip(mbs, lens):
            # the cut to [rows, s] keeps every real token (right padding) and stays within the budget
            assert int(cut["attention_mask"].sum()) == sum(lengths[i] for i in samples)
            assert cut["input_ids"].numel() <= cap
        shard_ids = ids[r * n:(r + 1) * n]
        for (a, b), s in zip(ranges, lens):
            assert all(lengths[i] <= s for i in shard_ids[a:b])


def test_contract_and_consumption():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 1000, 32).tolist()
    data = grpo_batch(lengths, width=1024)
    batch, metrics = dynamic_batching_shard(data, 4, 4096, 64, log_prefix="actor_train/train_step")
    check(batch, lengths, 4, 4096, 64)
    assert metrics["dynamic_batching/actor_train/train_step/valid_tokens"] == sum(lengths)
    assert metrics["dynamic_batching/actor_train/train_step/removed_padding_ratio"] > 0


def test_exact_vpp_rule():
    lengths = [100] * 48
    data = grpo_batch(lengths, width=128)
    batch, _ = dynamic_batching_shard(data, 2, 1024, 64, 4, 2, microbatch_group_size_per_vp_stage=6)
    m = batch.meta_info["num_micro_batchs"]
    assert is_valid_microbatch_count(m, ParallelConfig(pp=4, vpp=2, microbatch_group_size_per_vp_stage=6))
    check(batch, lengths, 2, 1024, 64)


def test_errors():
    with pytest.raises(OversizeSampleError, match="max_tokens_per_microbatch_in_train to at least 1024"):
        dynamic_batching_shard(grpo_batch([10, 20], width=1000), 1, 512, 64)
    with pytest.raises(DynBatchConfigError, match="equal"):
        dynamic_batching_shard(grpo_batch([10, 20, 30], width=64), 2, 512, 64)


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.sampled_from([1024, 2048, 5000]), st.sampled_from([16, 64]),
       st.sampled_from([(1, None, None), (2, 2, None), (4, 2, 6)]), st.integers(0, 2 ** 31 - 1))
def test_contract_on_random_batches(dp, per_rank, cap, rnd, pipe, seed):
    pp, vpp, n_group = pipe
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 1000, dp * per_rank).tolist()
    data = grpo_batch(lengths, width=1000)
    try:
        batch, _ = dynamic_batching_shard(data, dp, cap, rnd, pp, vpp, microbatch_group_size_per_vp_stage=n_group)
    except DynBatchConfigError as err:  # too few samples per shard for the interleaved schedule
        assert "interleaved pipeline needs" in str(err), str(err)
        return
    check(batch, lengths, dp, cap, rnd)
    if vpp:
        m = batch.meta_info["num_micro_batchs"]
        assert is_valid_microbatch_count(m, ParallelConfig(pp=pp, vpp=vpp, microbatch_group_size_per_vp_stage=n_group))
