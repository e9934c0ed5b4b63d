"""What trainers pass as lengths and ids, through the planner and every drop-in's core (issue 20 items 4, 6, 7,
10): integer tensors from ``attention_mask.sum(-1)`` (int64 / int32, CPU here and CUDA where a GPU is present;
``core/`` never imports torch), whole-number floats from ``np.loadtxt`` or config files, 0-d tensors, a tensor of
rollout ids grouped by VALUE, and the one-giant-group batch that used to search for minutes. Fractions, 0-d
arrays and booleans stay refused with the messages they always had."""

from __future__ import annotations

import io

import numpy as np
import pytest

from megatron_dynbatch import DynBatchConfigError, plan_global_batch
from megatron_dynbatch.core.checks import as_int
from megatron_dynbatch.core.dropin.nemo_rl import get_packer
from megatron_dynbatch.core.dropin.roll import roll_shard
from megatron_dynbatch.core.dropin.verl import local_count, seqlen_balanced_partitions

torch = pytest.importorskip("torch")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _mask(lengths, width, device="cpu"):
    return (torch.arange(width, device=device) < torch.tensor(lengths, device=device)[:, None]).long()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_integer_tensors_plan_like_lists(device, dtype):
    lengths = [60, 120, 180, 240]
    lens = _mask(lengths, 240, device).sum(-1).to(dtype)  # what verl / ROLL compute
    kw = dict(parallel={"dp": 2}, max_tokens_per_gpu=300, balance_by_flops=False)
    assert plan_global_batch(lens, **kw).micro_batches == plan_global_batch(lengths, **kw).micro_batches
    assert local_count(lens, 300) == local_count(lengths, 300)
    assert get_packer("first_fit_decreasing", 300).pack(lens) == get_packer("first_fit_decreasing", 300).pack(lengths)
    assert roll_shard(lens, 2, 1024, 64).order == roll_shard(lengths, 2, 1024, 64).order


def test_zero_dim_tensors_are_refused_as_for_numpy_and_accepted_as_scalars():
    with pytest.raises(DynBatchConfigError, match=r"lengths='array of shape \(\)': must be a sequence"):
        plan_global_batch(torch.tensor(5), max_tokens_per_gpu=100, balance_by_flops=False)
    # a budget read from a TensorDict is a 0-d tensor; a list of 0-d tensors is list(tensor)
    assert as_int(torch.tensor(4096), "max_token_len") == 4096
    plan = plan_global_batch(list(torch.tensor([10, 20])), max_tokens_per_gpu=torch.tensor(100),
                             balance_by_flops=False)
    assert plan.num_samples == 2


def test_whole_number_floats_are_token_counts_and_fractions_are_not():
    loaded = np.loadtxt(io.StringIO("3636.0\n12.0\n400.0\n"))
    plan = plan_global_batch(loaded, max_tokens_per_gpu=4096.0, balance_by_flops=False)
    assert plan.num_samples == 3 and plan.cap == 4096
    assert plan_global_batch([3636.0, np.float32(12), 400], max_tokens_per_gpu=4096,
                             balance_by_flops=False).num_samples == 3
    assert plan_global_batch(torch.tensor([10.0, 20.0]), max_tokens_per_gpu=100, balance_by_flops=False)
    for bad, where in (([10, 2.5], r"lengths\[1\]=2.5"), (np.array([1.0, np.nan]), r"lengths\[1\]=nan"),
                       (torch.tensor([1.5, 2.0]), r"lengths\[0\]=1.5")):
        with pytest.raises(DynBatchConfigError, match=rf"{where}: token counts must be integers"):
            plan_global_batch(bad, max_tokens_per_gpu=100, balance_by_flops=False)
    with pytest.raises(DynBatchConfigError, match="must be an integer"):
        plan_global_batch([10], max_tokens_per_gpu=100.5, balance_by_flops=False)
    with pytest.raises(DynBatchConfigError, match=r"lengths\[0\]=True: must be a whole token count"):
        plan_global_batch(torch.tensor([True, False]), max_tokens_per_gpu=100, balance_by_flops=False)


@pytest.mark.parametrize("device", DEVICES)
def test_a_tensor_of_group_ids_groups_by_value(device):
    """Iterating a tensor gives 0-d tensors that hash by identity: every sample was its own group."""
    ids = torch.tensor([0, 0, 1, 1], device=device)
    plan = plan_global_batch([10, 20, 30, 40], group_ids=ids, parallel={"dp": 2}, max_tokens_per_gpu=100,
                             balance_by_flops=False)
    ranks = [sorted(plan.rank_samples(r)) for r in range(2)]
    assert sorted(ranks) == [[0, 1], [2, 3]]


def test_verl_partitions_take_the_trainer_s_workload_tensor():
    """verl's ``_balance_batch`` hands ``calculate_workload(attention_mask.sum(-1))`` -- an int64 tensor -- and
    slices of it to ``get_seqlen_balanced_partitions``."""
    seqlens = _mask([5, 9, 3, 7, 2, 8], 9).sum(-1)
    work = 24576 * seqlens + seqlens ** 2
    assert seqlen_balanced_partitions(work, 2, True) == seqlen_balanced_partitions(work.tolist(), 2, True)
    assert sorted(i for p in seqlen_balanced_partitions(work[2:6], 2, True) for i in p) == [0, 1, 2, 3]


def test_one_giant_group_is_refused_at_once():
    """65,536 samples, one group of all but one, dp=2, cap 4096, token mode: the other rank has one sample, so
    no count above 1 can be filled -- refused from a bound, where it used to search for minutes."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, 65_536)
    with pytest.raises(DynBatchConfigError, match="at most 1 can be filled without leaving one empty"):
        plan_global_batch(lengths, group_ids=[0] * 65_535 + [1], parallel={"dp": 2}, max_tokens_per_gpu=4096,
                          balance_by_flops=False)
