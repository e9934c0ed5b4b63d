"""DynamicBatchIterator: plan order, packing, steps, VPP iterators, CP slices, order restoration, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # megatron-core is not needed: nothing here touches packed_seq_params

from megatron_dynbatch import plan_global_batch  # noqa: E402
from megatron_dynbatch.megatron.context_parallel import gather_cp_outputs  # noqa: E402
from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402
from megatron_dynbatch.megatron.iterator import DynamicBatchIterator  # noqa: E402
from megatron_dynbatch.megatron.loss import RESULT_KEY  # noqa: E402


def _samples(n=12, seed=0, groups=None):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, 40))
        mask = torch.ones(length)
        mask[: int(rng.integers(0, length))] = 0
        s = {"tokens": torch.randint(1, 100, (length,), generator=g), "loss_mask": mask,
             "advantages": torch.randn(length, generator=g), "reward": float(i)}
        if groups is not None:
            s["group_id"] = i // groups
        out.append(s)
    return out


PLAN = dict(parallel={"dp": 2}, max_tokens_per_gpu=48, balance_by_flops=False)


def _plan_dict(plan):
    d = plan.to_dict()
    d.pop("planning_time_s")
    d["summary"].pop("planning_time_s")
    return d


def test_yields_plan_order_and_covers_batch():
    samples = _samples()
    its = [DynamicBatchIterator(samples, dp_rank=r, **PLAN) for r in range(2)]
    assert json.dumps(_plan_dict(its[0].plan)) == json.dumps(_plan_dict(its[1].plan))  # no communication needed
    seen = []
    for r, it in enumerate(its):
        mbs = list(it)
        assert len(mbs) == it.num_microbatches == it.plan.num_microbatches
        for j, mb in enumerate(mbs):
            assert mb.sample_indices == it.plan.micro_batches[r][j]
            assert mb.num_tokens == it.plan.microbatch_tokens[r][j] <= it.plan.cap
            assert mb.sample_fields["reward"] == [float(i) for i in mb.sample_indices]
            assert mb.extras["advantages"].shape == mb.tokens.shape
            seen.extend(mb.sample_indices)
        assert it.sample_indices() == sorted(i for mb in mbs for i in mb.sample_indices)
        assert it.max_seq_length() == max(mb.num_tokens for mb in mbs)
    assert sorted(seen) == list(range(len(samples)))


def test_restore_order_lists_and_tensors():
    samples = _samples(seed=1)
    it = DynamicBatchIterator(samples, dp_rank=1, **PLAN)
    mbs = it.microbatches()
    # per-sample outputs in packing order
    outs = [[("s", i) for i in mb.sample_indices] for mb in mbs]
    assert it.restore_order(outs) == [("s", i) for i in it.sample_indices()]
    # full per-token tensors: the token ids themselves come back as each sample's tokens
    restored = it.restore_order([mb.tokens.float() for mb in mbs])
    for i, t in zip(it.sample_indices(), restored):
        assert torch.equal(t.long(), samples[i]["tokens"])
    with pytest.raises(DynBatchConfigError, match="per_microbatch_outputs"):
        it.restore_order(outs[:-1])


def test_steps_and_normalizers():
    samples = _samples(n=16, seed=2)
    it = DynamicBatchIterator(samples, dp_rank=0, samples_per_step=8, loss_mode="token_mean", **PLAN)
    assert it.num_steps == 2
    assert sum(len(it.step_range(s)) for s in range(2)) == it.num_microbatches
    for step in range(2):
        assert it.step_samples(step) == list(range(8 * step, 8 * step + 8))
        norm = it.normalizer(step)
        assert set(np.flatnonzero(norm.coefficients)) <= set(it.step_samples(step))
        mask_total = sum(float(samples[i]["loss_mask"][:-1].sum()) for i in it.step_samples(step))
        assert norm.coefficients[8 * step] == pytest.approx(1.0 / mask_total)
        for mb in it.microbatches(step):
            assert set(mb.sample_indices) <= set(it.step_samples(step))
            fn = it.loss_func(mb)
            out = torch.ones(mb.tokens.shape)
            _, n, logs = fn(out)
            assert int(n) == int(torch.count_nonzero(mb.loss_mask))
            assert logs[RESULT_KEY].sample_indices == mb.sample_indices
    with pytest.raises(DynBatchConfigError, match="step"):
        it.microbatches(2)


def test_vpp_iterators_are_independent_and_identical():
    samples = _samples(n=16, seed=3)
    it = DynamicBatchIterator(samples, dp_rank=0, parallel={"dp": 2, "pp": 2, "vpp": 2},
                              max_tokens_per_gpu=48, balance_by_flops=False)
    iters = it.data_iterator(0, num_model_chunks=2)
    assert isinstance(iters, list) and len(iters) == 2
    a = [next(iters[0]) for _ in range(2)]
    b = list(iters[1])
    assert b[:2] == a and len(b) == it.num_microbatches
    assert it.num_microbatches % 2 == 0  # Megatron's interleaved-schedule constraint (N = pp = 2)


def test_context_parallel_slices_and_restore():
    samples = _samples(n=8, seed=4)
    plan = plan_global_batch([len(s["tokens"]) for s in samples], parallel={"dp": 1, "cp": 2},
                             max_tokens_per_gpu=40, balance_by_flops=False)
    ranks = [DynamicBatchIterator(samples, plan, dp_rank=0, cp_rank=c) for c in range(2)]
    for mb0, mb1 in zip(ranks[0].microbatches(), ranks[1].microbatches()):
        assert mb0.cp_size == 2 and mb0.num_local_tokens * 2 == mb0.num_tokens
        assert mb0.sample_indices == mb1.sample_indices
    fulls = [gather_cp_outputs([a.tokens, b.tokens], a.cu_seqlens_padded, 2)
             for a, b in zip(ranks[0].microbatches(), ranks[1].microbatches())]
    restored = ranks[0].restore_order(fulls)
    for i, t in zip(ranks[0].sample_indices(), restored):
        assert torch.equal(t, samples[i]["tokens"])
    # the CP ranks' loss contributions add up to the step's loss (per-token loss = the label id here)
    total = 0.0
    for it in ranks:
        for mb in it.microbatches():
            _, _, logs = it.loss_func(mb, dp_size=1)(mb.labels.float())
            total += float(logs[RESULT_KEY].loss_sum)
    norm = ranks[0].normalizer(0)
    want = sum(norm.coefficients[i]
               * float((s["labels"] if "labels" in s
                        else torch.cat([s["tokens"][1:], torch.zeros(1, dtype=torch.long)])).double()
                       @ torch.cat([s["loss_mask"][:-1], torch.zeros(1)]).double())
               for i, s in enumerate(samples))
    assert total == pytest.approx(want, rel=1e-9)


def test_group_ids_from_samples_keep_groups_on_one_rank():
    samples = _samples(n=12, seed=5, groups=3)
    its = [DynamicBatchIterator(samples, dp_rank=r, loss_mode="group_mean", **PLAN) for r in range(2)]
    for it in its:
        gids = {samples[i]["group_id"] for i in it.sample_indices()}
        other = {samples[i]["group_id"] for i in its[1 - its.index(it)].sample_indices()}
        assert not gids & other
        assert it.normalizer(0).num_units == 4


def test_group_ids_read_from_samples_by_value_whatever_their_type():
    """A sample's group id may be a tensor (one element or several), a NumPy scalar or a Python value: the
    iterator and the Ray driver read it by value through one helper (core.checks.hashable_group_id), so
    ``tensor(3)``, ``np.int64(3)`` and ``3`` are one group."""
    from megatron_dynbatch.core.checks import hashable_group_id

    for value, want in ((torch.tensor(3), 3), (torch.tensor([3]), 3), (torch.tensor([1, 2]), (1, 2)),
                        (np.int64(3), 3), (np.str_("a"), "a"), (3, 3), ("a", "a"), ((1, 2), (1, 2))):
        got = hashable_group_id(value)
        assert got == want and type(got) is type(want), (value, got)
    samples = _samples(n=12, seed=5, groups=3)
    as_tensors = [{**s, "group_id": torch.tensor(s["group_id"])} for s in samples]
    for r in range(2):
        a = DynamicBatchIterator(samples, dp_rank=r, loss_mode="group_mean", **PLAN)
        b = DynamicBatchIterator(as_tensors, dp_rank=r, loss_mode="group_mean", **PLAN)
        assert a.sample_indices() == b.sample_indices() and b.normalizer(0).num_units == 4


def test_errors():
    samples = _samples(n=6)
    plan = plan_global_batch([len(s["tokens"]) for s in samples], parallel={"dp": 2}, max_tokens_per_gpu=64,
                             balance_by_flops=False)
    with pytest.raises(DynBatchConfigError, match="plan"):
        DynamicBatchIterator(samples[:5], plan, dp_rank=0)
    other = [dict(s, tokens=torch.cat([s["tokens"], s["tokens"]]), loss_mask=torch.ones(2 * len(s["tokens"])),
                  advantages=torch.zeros(2 * len(s["tokens"]))) for s in samples]
    with pytest.raises(DynBatchConfigError, match="planned as"):
        DynamicBatchIterator(other, plan, dp_rank=0)
    with pytest.raises(DynBatchConfigError, match="dp_rank"):
        DynamicBatchIterator(samples, plan, dp_rank=2)
    with pytest.raises(DynBatchConfigError, match="cp_size"):
        DynamicBatchIterator(samples, plan, dp_rank=0, cp_size=2)
    with pytest.raises(DynBatchConfigError, match="max_tokens_per_gpu"):
        DynamicBatchIterator(samples, dp_rank=0, parallel={"dp": 2})
    with pytest.raises(DynBatchConfigError, match="plan_kwargs"):
        DynamicBatchIterator(samples, plan, dp_rank=0, max_tokens_per_gpu=3)
    bad = [dict(s) for s in samples]
    del bad[3]["loss_mask"]
    with pytest.raises(DynBatchConfigError, match="same fields"):
        DynamicBatchIterator(bad, plan, dp_rank=0)
    with pytest.raises(DynBatchConfigError, match="loss_mode"):
        DynamicBatchIterator(samples, plan, dp_rank=0, loss_mode="mean")
    it = DynamicBatchIterator(samples, plan, dp_rank=0)
    foreign = DynamicBatchIterator(samples, plan, dp_rank=1).microbatches()[0]
    from dataclasses import replace

    with pytest.raises(DynBatchConfigError, match="not a micro-batch"):
        it.loss_func(replace(foreign))


def _gather_worker(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        samples = _samples(n=10, seed=6)
        it = DynamicBatchIterator(samples, dp_rank=rank, **PLAN)
        local = it.restore_order([[f"out{i}" for i in mb.sample_indices] for mb in it.microbatches()])
        return it.gather_across_dp(local)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_gather_across_dp_gives_global_order():
    from megatron_dynbatch.megatron.ranks import run_ranks

    r0, r1 = run_ranks(_gather_worker, 2, timeout=60)
    assert r0 == r1 == [f"out{i}" for i in range(10)]


def test_uniform_length_for_two_stage_vpp():
    """pp == 2 with VPP: every micro-batch of the rank is padded to its longest (megatron-core 0.16 shape
    exchange workaround); padding never carries loss."""
    samples = _samples(n=16, seed=7)
    kw = dict(parallel={"dp": 2, "pp": 2, "vpp": 2}, max_tokens_per_gpu=48, balance_by_flops=False)
    it = DynamicBatchIterator(samples, dp_rank=0, **kw)
    assert it.uniform_length
    planned = it.plan.microbatch_tokens[0]
    assert len(set(planned)) > 1
    mbs = it.microbatches()
    assert {mb.num_tokens for mb in mbs} == {max(planned)} == {it.max_seq_length(0)}
    for mb in mbs:  # same samples, same loss tokens as without the extra padding
        assert float(mb.loss_mask.sum()) == sum(float(samples[i]["loss_mask"][:-1].sum()) for i in mb.sample_indices)
    plain = DynamicBatchIterator(samples, it.plan, dp_rank=0, uniform_length=False)
    assert [mb.num_tokens for mb in plain.microbatches()] == planned
    assert not DynamicBatchIterator(samples, dp_rank=0, parallel={"dp": 2, "pp": 2}, max_tokens_per_gpu=48,
                                    balance_by_flops=False).uniform_length
