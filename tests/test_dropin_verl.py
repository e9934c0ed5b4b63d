"""verl drop-in: the functions of ``verl.utils.seqlen_balancing`` keep verl's contracts (order restoration through
``restore_dynamic_batch``, count >= ``min_num_micro_batch`` and divisible by ``num_batches_divided_by``, the
same count on every DP rank after one all-reduce, ``force_group_size`` groups in one micro-batch, balanced
partitions, uid groups together, equal sample counts from ``balance_batch``) and add ours: no micro-batch over
``max_token_len`` with verl's per-sequence padding counted. verl is not installable here: its data types are
the stand-ins of :mod:`megatron_dynbatch.testing.peer_types`; the DP tests run real gloo ranks."""

from __future__ import annotations

import sys
import types
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from megatron_dynbatch import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning  # noqa: E402
from megatron_dynbatch.integrations import verl  # noqa: E402
from megatron_dynbatch.megatron.ranks import run_ranks  # noqa: E402
from megatron_dynbatch.testing.peer_types import DataProto, grpo_batch  # noqa: E402


def padded(n: int, mult: int) -> int:
    return -(-n // mult) * mult if mult > 1 else n


def check_micro_batches(idx_list, lengths, max_token_len, pad=1, groups=1):
    """verl's contract plus our cap: a micro-batch over ``max_token_len`` is one ``force_group_size`` group
    that alone is over it (verl's policy for groups)."""
    flat = [i for mb in idx_list for i in mb]
    assert sorted(flat) == list(range(len(lengths)))
    for mb in idx_list:
        assert mb and mb == sorted(mb)
        tokens = sum(padded(lengths[i], pad) for i in mb)
        assert tokens <= max_token_len or groups > 1 and len(mb) == groups, (mb, tokens, max_token_len)
        if groups > 1:
            assert {i // groups for i in mb} == {i // groups for i in mb if i % groups == 0}
            assert len(mb) % groups == 0


def test_rearrange_restores_order_and_keeps_the_cap():
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 100, 20).tolist()
    data = grpo_batch(lengths, width=100)
    mbs, idx = verl.rearrange_micro_batches(data.batch, max_token_len=300)
    check_micro_batches(idx, lengths, 300)
    cat = torch.cat([mb["input_ids"] for mb in mbs])
    back = verl.restore_dynamic_batch(cat, idx)
    assert torch.equal(back, data.batch["input_ids"])
    inv = torch.tensor(verl.get_reverse_idx([i for mb in idx for i in mb]))
    assert torch.equal(cat[inv], data.batch["input_ids"])


def test_count_floor_multiple_and_groups():
    lengths = [60, 40, 30, 70, 10, 90, 55, 45, 20, 80, 65, 35]
    data = grpo_batch(lengths, width=100)
    _, idx = verl.rearrange_micro_batches(data.batch, 200, min_num_micro_batch=5)
    assert len(idx) >= 5
    _, idx = verl.rearrange_micro_batches(data.batch, 200, num_batches_divided_by=4)
    assert len(idx) % 4 == 0
    check_micro_batches(idx, lengths, 200)
    _, idx = verl.rearrange_micro_batches(data.batch, 200, force_group_size=2)
    check_micro_batches(idx, lengths, 200, groups=2)
    with pytest.raises(DynBatchConfigError, match="force_group_size"):
        verl.rearrange_micro_batches(data.batch, 200, force_group_size=5)


def test_verl_padding_counts_and_parallel_state_is_read(monkeypatch):
    """tp=2, cp=2: verl pads each sequence to tp*cp*2 = 8; 4 x 65 real tokens fit 260, but not after padding."""
    ps = types.SimpleNamespace(model_parallel_is_initialized=lambda: True,
                               get_tensor_model_parallel_world_size=lambda: 2,
                               get_context_parallel_world_size=lambda: 2,
                               get_pipeline_model_parallel_world_size=lambda: 1)
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    lengths = [65] * 8
    data = grpo_batch(lengths, width=65)
    _, idx = verl.rearrange_micro_batches(data.batch, max_token_len=260)
    check_micro_batches(idx, lengths, 260, pad=8)
    assert max(len(mb) for mb in idx) == 3


def test_nested_input_ids_and_the_width_assertion():
    rows = [torch.arange(n) for n in (5, 9, 3, 7)]
    nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    mbs, idx = verl.rearrange_micro_batches({"input_ids": nested}, max_token_len=12)
    check_micro_batches(idx, [5, 9, 3, 7], 12)
    out = torch.nested.as_nested_tensor([r for mb in mbs for r in mb["input_ids"].unbind()], layout=torch.jagged)
    back = verl.restore_dynamic_batch(out, idx)
    assert [t.tolist() for t in back.unbind()] == [r.tolist() for r in rows]
    with pytest.raises(OversizeSampleError, match="max_token_len"):  # the class the module docstring names
        verl.rearrange_micro_batches(grpo_batch([5, 5], width=64).batch, max_token_len=32)


def test_prepare_dynamic_batch_round_trip_with_non_tensors():
    lengths = [30, 10, 50, 20, 40, 60, 5, 15]
    data = grpo_batch(lengths, group_size=2, width=60)
    data.meta_info["temperature"] = 1.0
    parts, idx = verl.prepare_dynamic_batch(data, max_token_len=100)
    assert all(isinstance(p, DataProto) and p.meta_info == {"temperature": 1.0} for p in parts)
    ids = [int(s) for p in parts for s in p.non_tensor_batch["sample_id"]]
    assert ids == [i for mb in idx for i in mb]
    logits = torch.cat([p.batch["attention_mask"].sum(-1, keepdim=True).float() for p in parts])
    assert verl.restore_dynamic_batch(logits, idx).squeeze(1).tolist() == [float(x) for x in lengths]
    with pytest.raises(DynBatchConfigError, match="permutation"):
        verl.restore_dynamic_batch(logits, idx[:-1])


def test_oversize_is_an_error_naming_the_budget():
    with pytest.raises(OversizeSampleError, match="max_token_len|max-tokens"):
        verl.rearrange_micro_batches({"input_ids": torch.nested.as_nested_tensor(
            [torch.arange(50), torch.arange(10)], layout=torch.jagged)}, max_token_len=40)
    with pytest.raises(OversizeSampleError):
        verl.check_budget(8192, 8193)
    assert verl.check_budget(8192, 8192)


def test_seqlen_balanced_partitions_contract():
    values = [7, 3, 9, 1, 4, 4, 8, 2]
    parts = verl.get_seqlen_balanced_partitions(values, 2, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(8)) and all(p == sorted(p) for p in parts)
    assert [len(p) for p in parts] == [4, 4]
    assert abs(sum(values[i] for i in parts[0]) - sum(values[i] for i in parts[1])) <= 1
    with pytest.raises(DynBatchConfigError):
        verl.get_seqlen_balanced_partitions(values, 3, equal_size=True)
    with pytest.raises(DynBatchConfigError):
        verl.get_seqlen_balanced_partitions([1, 2], 3, equal_size=False)


def test_group_balanced_partitions_contract():
    seqlens = [100] * 4 + [200] * 4 + [150] * 4 + [50] * 4
    uids = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    parts = verl.get_group_balanced_partitions(seqlens, uids, 2)
    assert sorted(i for p in parts for i in p) == list(range(16))
    for p in parts:
        for u in {uids[i] for i in p}:
            assert all(i in p for i, uu in enumerate(uids) if uu == u)
    with pytest.raises(DynBatchConfigError):
        verl.get_group_balanced_partitions(seqlens, uids, 5)


def test_balance_batch_equal_counts_and_reorder():
    rng = np.random.default_rng(3)
    lengths = rng.integers(10, 400, 32).tolist()
    data = grpo_batch(lengths, group_size=4, width=400)
    metrics = {}
    parts = verl.balance_batch(data, 4, metrics, keep_minibatch=True, minibatch_size=16, max_token_len=800)
    assert [len(p) for p in parts] == [8] * 4
    # each rank's chunk holds 4 samples of mini-batch 0 then 4 of mini-batch 1
    for p in parts:
        assert all(i < 16 for i in p[:4]) and all(i >= 16 for i in p[4:])
    assert data.non_tensor_batch["sample_id"].tolist() == [i for p in parts for i in p]
    assert metrics["global_seqlen/balanced_max"] - metrics["global_seqlen/balanced_min"] <= \
        metrics["global_seqlen/max"] - metrics["global_seqlen/min"]
    grouped = grpo_batch(lengths, group_size=4, width=400)
    parts = verl.balance_batch(grouped, 4, use_prefix_grouper=True)
    uid = grpo_batch(lengths, group_size=4, width=400).non_tensor_batch["uid"]
    for p in parts:
        assert all(sum(1 for i in p if uid[i] == u) == 4 for u in {uid[i] for i in p})


def test_trainer_method_reads_the_trainer():
    class Cfg(dict):
        def __getattr__(self, k):
            return self[k]

    trainer = types.SimpleNamespace(
        _get_dp_size=lambda wg, role: 2, actor_rollout_wg=None, use_prefix_grouper=False,
        config=Cfg(actor_rollout_ref=Cfg(actor=Cfg(ppo_mini_batch_size=8, use_dynamic_bsz=True,
                                                   ppo_max_token_len_per_gpu=512,
                                                   megatron=Cfg(context_parallel_size=1)))))
    data = grpo_batch(list(range(10, 170, 10)), width=160)
    metrics = {}
    verl.trainer_balance_batch(trainer, data, metrics, keep_minibatch=True)
    assert "global_seqlen/balanced_max" in metrics and len(data) == 16


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 512), min_size=1, max_size=40), st.sampled_from([512, 700, 1024, 4096]),
       st.sampled_from([None, 1, 3]), st.sampled_from([None, 2, 4]), st.sampled_from([1, 2]),
       st.sampled_from([(1, 1), (2, 1), (2, 2)]), st.booleans())
def test_rearrange_contract_on_random_batches(lengths, max_token_len, min_mb, div, fgs, tp_cp, balance):
    tp, cp = tp_cp
    if len(lengths) % fgs:
        lengths = lengths + lengths[: fgs - len(lengths) % fgs]
    data = grpo_batch(lengths, width=512)
    pad = verl.core.verl_sequence_pad_multiple(tp, cp)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OversizeSampleWarning)  # a group over the budget runs alone
            mbs, idx = verl.rearrange_micro_batches(data.batch, max_token_len, min_num_micro_batch=min_mb,
                                                    num_batches_divided_by=div, force_group_size=fgs,
                                                    use_dynamic_bsz_balance=balance, tp_size=tp, cp_size=cp)
    except DynBatchConfigError as err:  # budget below the width, or too few samples for the count rule
        assert isinstance(err, AssertionError) and err.field == "max_token_len", str(err)
        return
    check_micro_batches(idx, lengths, max_token_len, pad=pad, groups=fgs)
    assert len(idx) >= (min_mb or 1) and len(idx) % (div or 1) == 0
    if not balance:
        assert [mb[0] for mb in idx] == sorted(mb[0] for mb in idx)
    cat = torch.cat([mb["attention_mask"] for mb in mbs])
    assert torch.equal(verl.restore_dynamic_batch(cat, idx), data.batch["attention_mask"])


# ------------------------------------------------------------------------------ real DP ranks (gloo)
def _dp_worker(rank, world_size):
    import os

    import torch.distributed as dist

    from megatron_dynbatch import DynBatchConfigError
    from megatron_dynbatch.integrations import verl
    from megatron_dynbatch.megatron.local import plan_local_batch_across_dp
    from megatron_dynbatch.testing.peer_types import grpo_batch

    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}")
    out = {}
    # rank 1 holds much more work: its count must win on both ranks
    lengths = [50] * 6 if rank == 0 else [90, 80, 95, 70, 60, 85, 99, 75, 65, 88]
    data = grpo_batch(lengths, width=100)
    mbs, idx = verl.rearrange_micro_batches(data.batch, 200, dp_group=dist.group.WORLD)
    out["count"] = len(idx)
    out["fits"] = all(sum(lengths[i] for i in mb) <= 200 for mb in idx)
    _, idx_local = verl.rearrange_micro_batches(data.batch, 200, dp_group=dist.group.WORLD,
                                                same_micro_num_in_dp=False)
    out["local_count"] = len(idx_local)
    plan = plan_local_batch_across_dp(lengths, group=dist.group.WORLD, max_tokens_per_gpu=200,
                                      balance_by_flops=False, parallel={"dp": world_size})
    out["plan_count"] = plan.num_microbatches
    out["plan_dp"] = plan.dp
    # a rank that cannot plan makes every rank raise instead of hanging
    bad = [50] * 3 + ([500] if rank == 0 else [])
    try:
        plan_local_batch_across_dp(bad, group=dist.group.WORLD, max_tokens_per_gpu=200, balance_by_flops=False)
        out["failure"] = None
    except DynBatchConfigError as err:
        out["failure"] = err.field
    # the drop-in itself: a rank with an empty batch joins the all-reduce with a failure flag -- no rank hangs
    data = grpo_batch([] if rank == 1 else [10, 20], width=20)
    try:
        verl.rearrange_micro_batches(data.batch, 100, dp_group=dist.group.WORLD)
        out["empty"] = None
    except AssertionError as err:  # verl's callers catch AssertionError; ours is also a DynBatchConfigError
        out["empty"] = err.field
    dist.destroy_process_group()
    return out


def test_dp_ranks_agree_on_one_count_with_one_all_reduce():
    r0, r1 = run_ranks(_dp_worker, 2, timeout=120)
    assert r0["count"] == r1["count"] == max(r0["local_count"], r1["local_count"])
    assert r0["local_count"] < r1["local_count"]
    assert r0["fits"] and r1["fits"]
    assert r0["plan_count"] == r1["plan_count"] and r0["plan_dp"] == r1["plan_dp"] == 1
    assert r0["failure"] == "max_tokens_per_gpu" and r1["failure"] == "lengths"
    assert r0["empty"] == "dp_group" and r1["empty"] == "batch"


# ------------------------------------------------------------------ issue 20: verl's own call shapes and types
def test_the_trainer_s_balance_batch_works_after_the_import_swap_alone():
    """verl's ``RayPPOTrainer._balance_batch`` after swapping only its import line: the attention-mask sums stay
    an int64 tensor, ``calculate_workload`` returns a tensor, ``get_seqlen_balanced_partitions`` gets that tensor
    (or slices of it with ``keep_minibatch``) by keyword, partitions are sorted with tensor elements as keys, and
    ``log_seqlen_unbalance`` gets a list. Written from those call shapes, not copied."""
    data = grpo_batch(np.random.default_rng(1).integers(10, 400, 32).tolist(), width=400)
    dp, minibatch = 4, 16
    seqlens = data.batch["attention_mask"].view(32, -1).sum(-1)
    work = verl.calculate_workload(seqlens)
    assert isinstance(work, torch.Tensor)
    for keep_minibatch in (False, True):
        if keep_minibatch:
            parts = [[] for _ in range(dp)]
            for m in range(32 // minibatch):
                chunk = verl.get_seqlen_balanced_partitions(work[m * minibatch:(m + 1) * minibatch],
                                                            k_partitions=dp, equal_size=True)
                for r, p in enumerate(chunk):
                    parts[r] += [i + m * minibatch for i in p]
        else:
            parts = verl.get_seqlen_balanced_partitions(work, k_partitions=dp, equal_size=True)
        for p in parts:
            p.sort(key=lambda i: (work[i], i))
        assert sorted(i for p in parts for i in p) == list(range(32)) and {len(p) for p in parts} == {8}
        stats = verl.log_seqlen_unbalance(seqlen_list=seqlens.tolist(), partitions=parts, prefix="global_seqlen")
        assert stats["global_seqlen/balanced_max"] >= stats["global_seqlen/balanced_min"]
    uid = list(data.non_tensor_batch["uid"])  # the prefix-grouper branch
    assert len(verl.get_group_balanced_partitions(seqlen_list=seqlens.tolist(), uid_list=uid, k_partitions=2)) == 2


def test_max_token_len_as_the_engine_passes_it():
    """verl's engine reads ``max_token_len_per_gpu`` from a TensorDict (a 0-d tensor) and multiplies it by the
    sequence-parallel size; configs can carry whole floats."""
    data = grpo_batch([30, 10, 50, 20, 40, 60, 5, 15], width=60)
    _, ref = verl.rearrange_micro_batches(data.batch, max_token_len=100)
    _, idx = verl.rearrange_micro_batches(data.batch, max_token_len=torch.tensor(50) * 2)
    _, idx_f = verl.rearrange_micro_batches(data.batch, max_token_len=100.0)
    assert idx == ref == idx_f


@pytest.mark.parametrize("lengths,group,budget,over", [
    ([50, 60, 80, 90, 40, 45, 100, 110], 2, 200, [6, 7]),
    ([100, 110, 90, 95, 200, 210, 190, 205, 50, 60, 70, 80], 4, 500, [4, 5, 6, 7]),
])
def test_a_force_group_size_group_over_the_budget_runs_alone(lengths, group, budget, over):
    """verl runs a reward-model group whose tokens exceed ``max_token_len`` as a micro-batch of its own; so does
    the drop-in (it used to raise), with a warning, and the plan's statistics count it."""
    data = grpo_batch(lengths, width=max(lengths))
    with pytest.warns(OversizeSampleWarning, match=f"force_group_size={group}: 1 group"):
        _, idx = verl.rearrange_micro_batches(data.batch, budget, force_group_size=group)
    check_micro_batches(idx, lengths, budget, groups=group)
    assert over in idx
    with pytest.warns(OversizeSampleWarning):
        plan = verl.core.local_plan(lengths, budget, len(idx), force_group_size=group)
    assert plan.oversize_samples == over and plan.cap_violations == 1
    with pytest.raises(OversizeSampleError, match="max_token_len"):  # a single sample over it stays an error
        verl.rearrange_micro_batches(grpo_batch([300, 10], width=300).batch, 200)


def test_verl_s_asserts_stay_assertion_errors_in_verl_s_words():
    """Where verl asserts -- ``max_token_len`` >= the width, a batch divisible by ``force_group_size``, no more
    micro-batches than groups -- ours is an AssertionError too, and names verl's arguments, not the planner's."""
    data = grpo_batch([60, 40, 30], width=64)
    with pytest.raises(AssertionError, match="max_token_len=32: is smaller than the sequence length 64"):
        verl.rearrange_micro_batches(data.batch, 32)
    with pytest.raises(AssertionError, match="force_group_size=2: does not divide the batch size 3"):
        verl.rearrange_micro_batches(data.batch, 128, force_group_size=2)
    for kw, word in ((dict(min_num_micro_batch=5), "min_num_micro_batch=5"),
                     (dict(num_batches_divided_by=4), "num_batches_divided_by=4")):
        with pytest.raises(AssertionError, match=word) as exc:
            verl.rearrange_micro_batches(data.batch, 128, **kw)
        msg = str(exc.value)
        assert exc.value.field == "max_token_len" and "micro_batches" not in msg and "--max-tokens" not in msg
    with pytest.raises(AssertionError, match="k_partitions=4: more partitions than items"):
        verl.get_seqlen_balanced_partitions(torch.tensor([1, 2, 3]), 4, equal_size=False)
    with pytest.raises(AssertionError, match="permutation"):
        verl.restore_dynamic_batch(torch.zeros(3, 2), [[0, 1]])


def test_hostile_batches_get_a_clear_error_naming_the_field():
    """An empty batch (verl's own function crashes on it), a batch without ``attention_mask``, a mask with NaN."""
    with pytest.raises(AssertionError, match="batch='0 samples': an empty batch has no micro-batches") as exc:
        verl.rearrange_micro_batches(grpo_batch([], width=8).batch, 64)
    assert isinstance(exc.value, DynBatchConfigError)
    with pytest.raises(DynBatchConfigError, match=r"batch\[\"attention_mask\"\]='missing'"):
        verl.rearrange_micro_batches({"input_ids": torch.ones(2, 4, dtype=torch.long)}, 64)
    mask = torch.ones(3, 4)
    mask[1, 2] = float("nan")
    with pytest.raises(DynBatchConfigError, match=r"attention_mask.sum\(-1\)\[1\]=nan: token counts must be"):
        verl.rearrange_micro_batches({"input_ids": torch.ones(3, 4), "attention_mask": mask}, 64)
    with pytest.raises(DynBatchConfigError, match=r"seqlen_list\[1\]=nan"):
        verl.get_seqlen_balanced_partitions([1.0, float("nan")], 1, equal_size=False)


@pytest.mark.parametrize("values", [[0] * 6, [1e6] + [0] * 10, torch.zeros(8, dtype=torch.long), [0, 0, 3, 0]])
def test_partitions_are_never_empty(values):
    """verl's contract: ``k`` non-empty partitions whenever there are at least ``k`` items -- zero workloads
    included (empty responses), which used to leave some partitions empty."""
    n = len(values)
    for k in range(1, n + 1):
        parts = verl.get_seqlen_balanced_partitions(values, k, equal_size=False)
        assert len(parts) == k and all(parts) and sorted(i for p in parts for i in p) == list(range(n))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 512), min_size=1, max_size=24), st.sampled_from([512, 700, 1024]),
       st.sampled_from([None, 2, 5]), st.sampled_from([None, 2, 3]), st.sampled_from([1, 2, 4]))
def test_same_structure_as_verl_s_own_rearrange(lengths, max_token_len, min_mb, div, fgs):
    """Random batches through the drop-in and through a model of verl's own ``rearrange_micro_batches``
    (:mod:`megatron_dynbatch.testing.peer_models`): every sample once, ``force_group_size`` groups intact, the
    count at least ``min_num_micro_batch`` and a multiple of ``num_batches_divided_by``, no more micro-batches
    than groups, the same refusals (as AssertionError). Where they differ -- our stricter cap: verl's count is
    ``ceil(tokens / max_token_len)`` and its micro-batches may exceed the budget; ours is at least verl's (when
    no group is over the budget) and never over the budget (but for a group alone over it). So ours may refuse
    where verl plans over the budget: then no count verl's rules allow packs under the cap (checked exactly)."""
    from megatron_dynbatch.testing.exact import bins_feasible
    from megatron_dynbatch.testing.peer_models import verl_rearrange_micro_batches

    lengths = lengths + [7] * ((-len(lengths)) % fgs)
    data = grpo_batch(lengths, width=512)
    try:
        theirs = verl_rearrange_micro_batches(lengths, max_token_len, 512, min_mb, div, fgs)
    except AssertionError:
        theirs = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OversizeSampleWarning)
            _, ours = verl.rearrange_micro_batches(data.batch, max_token_len, min_num_micro_batch=min_mb,
                                                   num_batches_divided_by=div, force_group_size=fgs)
    except DynBatchConfigError as err:
        assert isinstance(err, AssertionError) and err.field == "max_token_len", str(err)
        event("ours refuses" + (", verl plans over the budget" if theirs is not None else ", so does verl"))
        if theirs is not None:  # our cap: no count verl's rules allow packs the groups under it
            groups = [sum(lengths[g * fgs:(g + 1) * fgs]) for g in range(len(lengths) // fgs)]
            fit = [x for x in groups if x <= max_token_len]
            for m in range(len(theirs), len(groups) + 1):
                if m >= (min_mb or 1) and m % (div or 1) == 0:
                    assert bins_feasible(fit, m - (len(groups) - len(fit)), max_token_len) is False
        return
    event("ours plans" + (", verl refuses" if theirs is None else ""))
    check_micro_batches(ours, lengths, max_token_len, groups=fgs)
    assert len(ours) >= (min_mb or 1) and len(ours) % (div or 1) == 0 and len(ours) <= len(lengths) // fgs
    if theirs is not None:
        assert sorted(i for p in theirs for i in p) == list(range(len(lengths)))
        if all(sum(lengths[g:g + fgs]) <= max_token_len for g in range(0, len(lengths), fgs)):
            assert len(ours) >= len(theirs)  # ceil(tokens / budget) bounds every packing under the budget
