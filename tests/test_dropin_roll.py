"""ROLL drop-in: ``dynamic_batching_shard`` keeps ROLL's contract (the batch reordered into ``dp`` equal shards;
one list of ``[start, end)`` ranges shared by all shards, tiling them; ``micro_batch_lengths`` multiples of the
round that no sample of the micro-batch exceeds; ``rows x length <= max_tokens_per_microbatch``; the meta_info
keys and metrics ROLL reads) and adds ours: Megatron's exact VPP rule, a clear error for a sample over the
budget, a start-up check of the configured width. The micro-batches are consumed here as ROLL's
``make_micro_batch_iter_for_dynamic_batching`` does (slice the shard, cut the columns to the length)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from megatron_dynbatch import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning  # noqa: E402
from megatron_dynbatch.core.parallel import ParallelConfig  # noqa: E402
from megatron_dynbatch.core.planner.vpp import is_valid_microbatch_count  # noqa: E402
from megatron_dynbatch.integrations.roll import dynamic_batching_shard  # noqa: E402
from megatron_dynbatch.testing.peer_types import DataProto, grpo_batch  # noqa: E402


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
    # at least one round -- or 0 for a micro-batch of empty samples only (below), as ROLL's own cut may have
    assert all(s % rnd == 0 and s >= 0 and (b - a) * s <= cap for (a, b), s in zip(ranges, lens))
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
    # the width (the configured sequence length) over the budget warns; the sample that is over it then raises
    with pytest.raises(OversizeSampleError, match="max_tokens_per_microbatch_in_train to at least 1024"), \
            pytest.warns(OversizeSampleWarning, match="configured sequence length 1000"):
        dynamic_batching_shard(grpo_batch([10, 1000], width=1000), 1, 512, 64)
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


# ------------------------------------------------------------------ issue 20: ROLL's own call shapes and types
def _mini_batches(meta, ga_steps):
    """ROLL's ``make_mini_batch_iter_for_dynamic_batching``: ``ga_steps`` consecutive micro-batches per optimizer
    step."""
    ranges = meta["global_micro_batch_indices"]
    return [ranges[i:i + ga_steps] for i in range(0, len(ranges), ga_steps)]


def test_the_count_never_adds_an_optimizer_step():
    """``[6144, 128]``, width 6144, one rank, budget 12288, round 128, ``ga_steps=1``: ROLL makes ONE micro-batch
    (one optimizer step); the drop-in used to make two."""
    data = grpo_batch([6144, 128], width=6144)
    batch, _ = dynamic_batching_shard(data, 1, 12288, 128)
    assert batch.meta_info["micro_batch_indices"] == [[0, 2]] and len(_mini_batches(batch.meta_info, 1)) == 1


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 8]), st.integers(1, 64), st.sampled_from([256, 768]), st.sampled_from([8, 16]),
       st.sampled_from([(1, None), (2, 1), (2, 2), (4, 2)]), st.sampled_from([None, 1, 4, 16]),
       st.integers(0, 2 ** 31 - 1))
def test_same_structure_as_roll_s_own_shard(dp, per_rank, cap, rnd, pipe, ga_steps, seed):
    """Random batches through the drop-in and through a model of ROLL's own ``dynamic_batching_shard``
    (:mod:`megatron_dynbatch.testing.peer_models`): the same rows (row ``i`` = the ``dp`` samples of sorted rank
    ``i*dp..``, one per shard), every sample once, equal shards, shared ranges tiling them, ``rows x length`` within
    the budget, the same refusals (AssertionError) -- and ROLL's micro-batch count, hence ROLL's optimizer steps
    for every ``ga_steps`` (with ``ga_steps`` passed, any count with as many steps). Where they differ: where the
    micro-batches are cut for that count (by modelled time), which shard gets which sample of a row."""
    from megatron_dynbatch.testing.peer_models import roll_dynamic_batching_shard

    pp, vpp = pipe
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(3.5, 1.2, dp * per_rank).astype(int), cap).tolist()  # GRPO-like, scaled
    try:
        theirs = roll_dynamic_batching_shard(lengths, dp, cap, rnd, pp, vpp)
    except AssertionError:
        theirs = None
    try:
        batch, _ = dynamic_batching_shard(grpo_batch(lengths), dp, cap, rnd, pp, vpp, ga_steps=ga_steps)
    except DynBatchConfigError as err:
        assert isinstance(err, AssertionError) and theirs is None, str(err)
        return
    check(batch, lengths, dp, cap, rnd)
    ours = batch.meta_info["micro_batch_indices"]
    if theirs is None:  # ROLL cannot split enough micro-batches for its pipeline rounding; ours cut to the count
        assert pp > 1 and vpp and len(ours) % pp == 0
        return
    m = len(theirs.ranges)
    if ga_steps is None:
        assert len(ours) == m
    else:
        assert m <= len(ours) and -(-len(ours) // ga_steps) == -(-m // ga_steps)
    ids = batch.non_tensor_batch["sample_id"].tolist()
    n = len(lengths) // dp
    shards = [ids[r * n:(r + 1) * n] for r in range(dp)]
    assert [sorted(row) for row in zip(*shards)] == [sorted(row) for row in theirs.rows]


def test_start_up_check_warns_where_roll_plans_and_the_count_follows_roll_s_pipeline_rounding():
    """ROLL plans ``[900, 1000, 700, 800]`` at width 8192 over 2 ranks with a budget of 4096 (every sample
    fits): so does the drop-in, warning that an 8192-token sample would not. ``pp=2, vpp=1``: ROLL (and
    megatron-core 0.16.1) treat a virtual size of 1 as interleaved and round the count to a multiple of pp."""
    with pytest.warns(OversizeSampleWarning, match="configured sequence length 8192"):
        batch, _ = dynamic_batching_shard(grpo_batch([900, 1000, 700, 800], width=8192), 2, 4096, 128)
    check(batch, [900, 1000, 700, 800], 2, 4096, 128)
    batch, _ = dynamic_batching_shard(grpo_batch([2, 2, 2, 6, 6], width=6), 1, 8, 2, 2, 1)
    assert batch.meta_info["num_micro_batchs"] == 4
    batch, _ = dynamic_batching_shard(grpo_batch([2, 2, 2, 6, 6], width=6), 1, 8, 2, 2, None)
    assert batch.meta_info["num_micro_batchs"] == 3  # no virtual pipeline: no rounding


def _metrics_batch(dp):
    data = grpo_batch([10, 20, 30, 40], width=40)
    data.meta_info.update(temperature=0.7, metrics={"reward@sum": 2.5, "lengths": [3, 4]})
    return data


def test_meta_info_with_dp_1_is_the_caller_s_own_dict_as_in_roll():
    """Issue 28 item 3. ROLL slices the caller's batch (the slice shares ``meta_info``) and its ``concat`` of one
    shard returns that shard: its keys land in the caller's own dict, which the result shares. The drop-in used
    to give the result a new dict and leave the caller's alone."""
    data = _metrics_batch(1)
    caller = data.meta_info
    batch, _ = dynamic_batching_shard(data, 1, 64, 16)
    assert batch.meta_info is caller and caller["num_micro_batchs"] == len(caller["micro_batch_indices"])
    assert caller["metrics"] == {"reward@sum": 2.5, "lengths": [3, 4]} and caller["temperature"] == 0.7
    assert caller["micro_batch_indices"] is caller["global_micro_batch_indices"]  # one list, as ROLL writes it
    assert caller["micro_batch_lengths"] is caller["global_micro_batch_lengths"]


def test_meta_info_with_dp_over_1_is_roll_s_concat_merge():
    """Issue 28 item 3. With ``dp > 1`` ROLL joins the shards with ``DataProto.concat``: a new dict with the
    caller's keys, and ``metrics`` gathered over the ``dp`` shards (a scalar into ``dp`` copies, a list ``dp``
    copies end to end); the caller's dict is left alone. The drop-in used to copy ``metrics`` as it was."""
    data = _metrics_batch(2)
    batch, _ = dynamic_batching_shard(data, 2, 64, 16)
    assert data.meta_info == {"temperature": 0.7, "metrics": {"reward@sum": 2.5, "lengths": [3, 4]}}
    meta = batch.meta_info
    assert meta is not data.meta_info and meta["temperature"] == 0.7
    assert meta["metrics"] == {"reward@sum": [2.5, 2.5], "lengths": [3, 4, 3, 4]}
    assert meta["micro_batch_indices"] is meta["global_micro_batch_indices"]
    check(batch, [10, 20, 30, 40], 2, 64, 16)
    data = grpo_batch([10, 20, 30, 40], width=40)
    data.meta_info["metrics"] = [1.0]  # not a dict: the list of the shards' values
    batch, _ = dynamic_batching_shard(data, 2, 64, 16)
    assert batch.meta_info["metrics"] == [[1.0], [1.0]] and data.meta_info == {"metrics": [1.0]}


def test_a_batch_type_without_concat_is_refused_for_dp_over_1():
    class NoConcat(DataProto):
        concat = None

    base = grpo_batch([10, 20, 30, 40], width=40)
    data = NoConcat(base.batch, base.non_tensor_batch)
    with pytest.raises(AssertionError, match="origin_batch='NoConcat'.*DataProto.concat"):
        dynamic_batching_shard(data, 2, 64, 16)
    batch, _ = dynamic_batching_shard(data, 1, 64, 16)  # one shard: no join, as in ROLL
    assert batch.meta_info is data.meta_info


# ------------------------------------------------------------------ issue 28 item 1: rows of empty samples
def _roll_count(lengths, dp, cap, rnd, pp=1, vpp=None):
    from megatron_dynbatch.testing.peer_models import roll_dynamic_batching_shard

    return len(roll_dynamic_batching_shard(lengths, dp, cap, rnd, pp, vpp).ranges)


def test_all_empty_rows_keep_roll_s_count_issue_example():
    """``[0, 0, 0, 0, 0, 8]``, width 8, one rank, budget 8, round 4: ROLL cuts ``[[0, 2], [2, 5], [5, 6]]`` with
    lengths ``[4, 0, 8]`` (M=3; its second micro-batch holds only empty rows, length 0). The drop-in gave every
    micro-batch at least one round and made 4 -- one optimizer step more at ``ga_steps=3``."""
    lengths = [0, 0, 0, 0, 0, 8]
    batch, _ = dynamic_batching_shard(grpo_batch(lengths, width=8), 1, 8, 4)
    meta = batch.meta_info
    assert meta["num_micro_batchs"] == _roll_count(lengths, 1, 8, 4) == 3
    assert meta["micro_batch_lengths"].count(0) == 1  # ROLL's count needs one length-0 micro-batch, as ROLL's
    check(batch, lengths, 1, 8, 4)
    assert len(_mini_batches(meta, 3)) == 1


def test_many_empty_samples_keep_roll_s_count():
    """512 samples, 51 of them empty, round 128, budget 2048, one rank: ROLL's count (the issue's batch made 241
    micro-batches against ROLL's 240; this one 318 against 317)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2049, 512)
    lengths[rng.choice(512, 51, replace=False)] = 0
    batch, _ = dynamic_batching_shard(grpo_batch(lengths.tolist(), width=2048), 1, 2048, 128)
    assert batch.meta_info["num_micro_batchs"] == _roll_count(lengths.tolist(), 1, 2048, 128) == 317
    check(batch, lengths.tolist(), 1, 2048, 128)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(1, 40), st.sampled_from([64, 256, 768]), st.sampled_from([8, 32]),
       st.sampled_from([(1, None), (2, 1), (4, 2)]), st.floats(0.0, 1.0), st.sampled_from([None, 2, 8]),
       st.integers(0, 2 ** 31 - 1))
def test_roll_s_count_whatever_the_rows_hold(dp, per_rank, cap, rnd, pipe, empty_share, ga_steps, seed):
    """Random batches with a random share of empty samples (all-zero masks) against the model of ROLL's own
    ``dynamic_batching_shard``: ROLL's micro-batch count (with ``ga_steps``, as many optimizer steps), every
    micro-batch within the budget, a length-0 micro-batch only of empty samples and only where ROLL's own cut
    has one."""
    from megatron_dynbatch.testing.peer_models import roll_dynamic_batching_shard

    pp, vpp = pipe
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, cap + 1, dp * per_rank)
    lengths[rng.random(lengths.size) < empty_share] = 0
    lengths = lengths.tolist()
    try:
        theirs = roll_dynamic_batching_shard(lengths, dp, cap, rnd, pp, vpp)
    except AssertionError:
        theirs = None
    try:
        batch, _ = dynamic_batching_shard(grpo_batch(lengths, width=cap), dp, cap, rnd, pp, vpp, ga_steps=ga_steps)
    except DynBatchConfigError as err:
        assert isinstance(err, AssertionError) and theirs is None, str(err)
        return
    check(batch, lengths, dp, cap, rnd)
    meta = batch.meta_info
    if theirs is None:  # ROLL cannot split enough micro-batches for its pipeline rounding
        assert pp > 1 and vpp
        return
    m, ours = len(theirs.ranges), meta["num_micro_batchs"]
    assert ours == m if ga_steps is None else -(-ours // ga_steps) == -(-m // ga_steps)
    if 0 in meta["micro_batch_lengths"]:
        assert 0 in theirs.lengths and meta["micro_batch_lengths"].count(0) == 1


def test_all_zero_masks_warn_as_roll_does(caplog):
    """ROLL logs a warning on every call with an all-zero mask: so does the drop-in, naming the stage and the
    count; a batch without one logs nothing."""
    logger = "megatron_dynbatch.integrations.roll"
    with caplog.at_level("WARNING", logger=logger):
        dynamic_batching_shard(grpo_batch([0, 5, 0, 7], width=8), 2, 64, 4, log_prefix="actor_train/train_step")
        dynamic_batching_shard(grpo_batch([0, 5, 0, 7], width=8), 2, 64, 4, log_prefix="actor_train/train_step")
    records = [r for r in caplog.records if r.name == logger]
    assert len(records) == 2 and all(r.levelname == "WARNING" for r in records)
    assert "actor_train/train_step" in records[0].getMessage() and "2 of 4 samples" in records[0].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger=logger):
        dynamic_batching_shard(grpo_batch([0, 0, 0, 0, 0, 8], width=8), 1, 8, 4)
    assert any("length 0" in r.getMessage() for r in caplog.records if r.name == logger)
    caplog.clear()
    with caplog.at_level("WARNING", logger=logger):
        dynamic_batching_shard(grpo_batch([3, 5, 2, 7], width=8), 2, 64, 4)
    assert not [r for r in caplog.records if r.name == logger]


def test_budgets_and_errors_as_roll_passes_and_catches_them():
    """A whole-number float budget from a config and a 0-d tensor work; a sample over the budget is an
    AssertionError as ROLL's; an empty batch, a missing or NaN mask get a clear error naming the field."""
    lengths = [100, 200, 300, 400]
    ref, _ = dynamic_batching_shard(grpo_batch(lengths, width=400), 2, 1024, 64)
    for budget in (1024.0, torch.tensor(1024), np.int32(1024)):
        batch, _ = dynamic_batching_shard(grpo_batch(lengths, width=400), 2, budget, 64)
        assert batch.meta_info["micro_batch_indices"] == ref.meta_info["micro_batch_indices"]
    with pytest.raises(DynBatchConfigError, match="max_tokens_per_microbatch=1024.5: must be an integer"):
        dynamic_batching_shard(grpo_batch(lengths, width=400), 2, 1024.5, 64)
    with pytest.raises(AssertionError, match="sample 1 has 1000 tokens"), pytest.warns(OversizeSampleWarning):
        dynamic_batching_shard(grpo_batch([10, 1000], width=1000), 1, 512, 64)
    with pytest.raises(AssertionError, match="origin_batch='0 samples': an empty batch"):
        dynamic_batching_shard(grpo_batch([], width=8), 1, 512, 64)
    with pytest.raises(DynBatchConfigError, match=r"origin_batch.batch\["):
        dynamic_batching_shard(DataProto({"input_ids": torch.ones(2, 4)}), 1, 512, 64)
    nan = grpo_batch([3, 4], width=4)
    nan.batch["attention_mask"] = nan.batch["attention_mask"].float()
    nan.batch["attention_mask"][0, 0] = float("nan")
    with pytest.raises(DynBatchConfigError, match=r"attention_mask.sum\(-1\)\[0\]=nan"):
        dynamic_batching_shard(nan, 1, 512, 64)


# ------------------------------------------------------------------ against ROLL's own code, where it imports
LAYOUT_KEYS = ("global_micro_batch_indices", "global_micro_batch_lengths", "micro_batch_indices",
               "micro_batch_lengths", "num_micro_batchs")


def _roll_own():
    """ROLL's own ``roll.utils.dynamic_batching`` and ``DataProto``, or a skip that says how to get them."""
    import os
    import tempfile

    os.environ.setdefault("ROLL_LOG_DIR", tempfile.mkdtemp())  # ROLL's logger opens a log file there at import
    mod = pytest.importorskip(
        "roll.utils.dynamic_batching", exc_type=ImportError,
        reason="ROLL is not importable: put its source (alibaba/ROLL) and its dependencies (ray, tensordict, "
               "codetiming, omegaconf, ...) on PYTHONPATH to check the drop-in against ROLL's own function")
    from roll.distributed.scheduler.protocol import DataProto as RollDataProto

    def batch(lengths, width, meta=None):
        mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).int()
        ids = torch.arange(len(lengths))[:, None].expand(len(lengths), width).clone()
        return RollDataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                                       meta_info=copy.deepcopy(meta) if meta else None)

    return mod.dynamic_batching_shard, batch


def _cases():
    rng = np.random.default_rng(28)
    yield [0, 0, 0, 0, 0, 8], 1, 8, 8, 4, 1, None
    big = rng.integers(1, 2049, 512)
    big[rng.choice(512, 51, replace=False)] = 0
    yield big.tolist(), 1, 2048, 2048, 128, 1, None
    for _ in range(24):
        dp = int(rng.choice([1, 2, 4]))
        cap, rnd = int(rng.choice([64, 256, 768])), int(rng.choice([8, 32]))
        pp, vpp = [(1, None), (2, 1), (4, 2)][int(rng.integers(3))]
        lengths = rng.integers(1, cap + 1, dp * int(rng.integers(1, 40)))
        lengths[rng.random(lengths.size) < rng.random()] = 0
        yield lengths.tolist(), dp, cap, cap, rnd, pp, vpp


def test_count_as_roll_s_own_function_and_the_model_is_roll_s():
    """Issue 28 item 1 against ROLL's own ``dynamic_batching_shard`` (its DataProto): the drop-in's micro-batch
    count is ROLL's on the issue's batches and on random ones with empty samples, and the model the other tests
    use (:func:`~megatron_dynbatch.testing.peer_models.roll_dynamic_batching_shard`) gives ROLL's very layout."""
    from megatron_dynbatch.testing.peer_models import roll_dynamic_batching_shard

    theirs_fn, roll_batch = _roll_own()
    for lengths, dp, width, cap, rnd, pp, vpp in _cases():
        try:
            theirs, _ = theirs_fn(roll_batch(lengths, width), dp, cap, rnd, pp, vpp)
        except AssertionError:
            continue
        model = roll_dynamic_batching_shard(lengths, dp, cap, rnd, pp, vpp)
        assert model.ranges == theirs.meta_info["global_micro_batch_indices"]
        assert model.lengths == theirs.meta_info["global_micro_batch_lengths"]
        ours, _ = dynamic_batching_shard(roll_batch(lengths, width), dp, cap, rnd, pp, vpp)
        assert ours.meta_info["num_micro_batchs"] == theirs.meta_info["num_micro_batchs"], (lengths, dp, cap, rnd)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_meta_info_as_roll_s_own_function_leaves_it(dp):
    """Issue 28 item 3 against ROLL's own function and DataProto: what the caller's dict holds afterwards, whether
    the result shares it, the result's keys and (layout aside) values -- ``metrics`` gathered by ROLL's concat
    for ``dp > 1`` -- and the shared list objects, all as ROLL leaves them."""
    theirs_fn, roll_batch = _roll_own()
    meta = {"temperature": 0.7, "metrics": {"reward@sum": 2.5, "lengths": [3, 4]}, "global_step": 3}
    lengths = [10, 20, 30, 40, 0, 50, 60, 70]
    runs = []
    for fn in (theirs_fn, dynamic_batching_shard):
        data = roll_batch(lengths, 72, meta)
        caller = data.meta_info
        out, _ = fn(data, dp, 144, 8, 1, None, "actor_train/train_step")
        runs.append((caller, out.meta_info))
    (their_caller, their_meta), (our_caller, our_meta) = runs

    def without_layout(d):
        return {k: v for k, v in d.items() if k not in LAYOUT_KEYS}

    assert sorted(our_caller) == sorted(their_caller) and without_layout(our_caller) == without_layout(their_caller)
    assert (our_meta is our_caller) == (their_meta is their_caller) == (dp == 1)
    assert sorted(our_meta) == sorted(their_meta) and without_layout(our_meta) == without_layout(their_meta)
    for a, b in [("micro_batch_indices", "global_micro_batch_indices"), ("micro_batch_lengths",
                                                                         "global_micro_batch_lengths")]:
        assert (our_meta[a] is our_meta[b]) == (their_meta[a] is their_meta[b])
