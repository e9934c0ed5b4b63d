"""Hostile input for the drop-ins and the new planner entry points: every argument, in turn, drawn from the
catalogue of awkward values of ``test_fuzz.py``. Each call must give a valid result or raise a
``DynBatchConfigError`` (a ``ValueError``) naming the field and a fix -- never another exception type, never a
hang."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynbatch import DynBatchConfigError, check_max_seq_len_fits, local_microbatch_counts, plan_local_batch
from megatron_dynbatch.core.dropin.nemo_rl import get_packer
from megatron_dynbatch.core.dropin.roll import roll_shard
from megatron_dynbatch.core.dropin.verl import (balance_partitions, group_balanced_partitions, local_count,
                                                local_partitions, seqlen_balanced_partitions)
from megatron_dynbatch.integrations.slime import build_dp_schedule
from megatron_dynbatch.testing.peer_types import slime_args
from test_fuzz import HOSTILE_SCALARS

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _ok_or_explained(fn, trainer_asserts=None):
    """A result, or a DynBatchConfigError naming a field with a fix -- never another exception type. With
    ``trainer_asserts`` given, the error is also an AssertionError exactly where the trainer's own function
    asserts (slime, verl, ROLL; not NeMo-RL)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn()
        except DynBatchConfigError as exc:
            assert "Fix:" in str(exc) and exc.field, str(exc)
            assert trainer_asserts is None or isinstance(exc, AssertionError) == trainer_asserts, str(exc)
            return None


def _value(data, valid):
    return data.draw(st.one_of(valid, valid, st.sampled_from(HOSTILE_SCALARS)))


@SETTINGS
@given(st.data(), st.sampled_from(["max_tokens_per_gpu", "micro_batch_size", "data_pad_size_multiplier",
                                   "tensor_model_parallel_size", "pipeline_model_parallel_size", "dynbatch_oversize",
                                   "use_dynamic_batch_size", "balance_data", "hidden_size", "dp_size", "cp_size",
                                   "vpp_size", "microbatch_group_size_per_vp_stage", "global_batch_size",
                                   "rollout_indices", "total_lengths"]))
def test_slime_build_dp_schedule_hostile(data, field):
    args = slime_args(max_tokens_per_gpu=2048, data_pad_size_multiplier=8)
    config = {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    lengths, rids, gbs = list(range(100, 1700, 100)), list(range(16)), 8
    hostile = data.draw(st.sampled_from(HOSTILE_SCALARS))
    if field in config:
        config[field] = hostile
    elif field == "global_batch_size":
        gbs = hostile
    elif field == "rollout_indices":
        rids = data.draw(st.sampled_from([hostile, [hostile] * 16, rids[:3], [None] * 16]))
    elif field == "total_lengths":
        lengths = data.draw(st.sampled_from([hostile, [hostile] * 16, lengths[:3], [-1] * 16]))
    else:
        setattr(args, field, hostile)
    res = _ok_or_explained(lambda: build_dp_schedule(args, config, lengths, global_batch_size=gbs,
                                                     rollout_indices=rids))
    if res is not None:
        partitions, mbi, nmb, _ = res
        assert len({len(m) for m in mbi}) == 1 and all(len(m) == sum(nmb) for m in mbi)


@SETTINGS
@given(st.data())
def test_verl_functions_hostile(data):
    lengths = data.draw(st.one_of(st.lists(st.integers(1, 300), min_size=1, max_size=20),
                                  st.sampled_from(HOSTILE_SCALARS)))
    max_token_len = _value(data, st.integers(1, 2000))
    kw = dict(num_batches_divided_by=_value(data, st.sampled_from([None, 2])),
              force_group_size=_value(data, st.sampled_from([None, 1, 2])),
              tp=_value(data, st.sampled_from([1, 2])), cp=_value(data, st.sampled_from([1, 2])))
    _ok_or_explained(lambda: local_count(lengths, max_token_len, min_num_micro_batch=_value(
        data, st.sampled_from([None, 2])), **kw))
    _ok_or_explained(lambda: local_partitions(lengths, max_token_len, _value(data, st.integers(1, 6)),
                                              use_dynamic_bsz_balance=_value(data, st.booleans()), **kw))
    _ok_or_explained(lambda: seqlen_balanced_partitions(lengths if isinstance(lengths, list) else [1, 2],
                                                        _value(data, st.integers(1, 4)), _value(data, st.booleans())))
    _ok_or_explained(lambda: group_balanced_partitions(lengths, _value(data, st.just([0] * 20)),
                                                       _value(data, st.integers(1, 3))))
    _ok_or_explained(lambda: balance_partitions(lengths, _value(data, st.integers(1, 4)),
                                                minibatch_size=_value(data, st.sampled_from([None, 4])),
                                                max_token_len=_value(data, st.sampled_from([None, 600]))))


@SETTINGS
@given(st.data())
def test_nemo_rl_packer_hostile(data):
    def build():
        return get_packer(_value(data, st.sampled_from(["modified_first_fit_decreasing", "concatenative"])),
                          _value(data, st.integers(1, 5000)), _value(data, st.booleans()),
                          _value(data, st.sampled_from([None, 0, 2])), _value(data, st.sampled_from([None, 1, 2])))

    packer = _ok_or_explained(build)
    if packer is None:
        return
    lengths = data.draw(st.one_of(st.lists(st.integers(0, 3000), max_size=20), st.sampled_from(HOSTILE_SCALARS),
                                  st.lists(st.sampled_from(HOSTILE_SCALARS), min_size=1, max_size=3)))
    bins = _ok_or_explained(lambda: packer.pack(lengths))
    if bins:
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))


@SETTINGS
@given(st.data())
def test_roll_shard_hostile(data):
    lengths = data.draw(st.one_of(st.lists(st.integers(0, 900), min_size=1, max_size=24),
                                  st.sampled_from(HOSTILE_SCALARS)))
    res = _ok_or_explained(lambda: roll_shard(lengths, _value(data, st.integers(1, 4)),
                                              _value(data, st.integers(64, 4096)), _value(data, st.integers(1, 128)),
                                              _value(data, st.integers(1, 4)),
                                              _value(data, st.sampled_from([None, 1, 2])),
                                              _value(data, st.sampled_from([None, 4, 5]))))
    if res is not None:
        assert sorted(res.order) == list(range(len(lengths)))


@SETTINGS
@given(st.data())
def test_local_mode_and_startup_check_hostile(data):
    lengths = data.draw(st.one_of(st.lists(st.integers(0, 900), min_size=1, max_size=24),
                                  st.sampled_from(HOSTILE_SCALARS)))
    kw = dict(max_tokens_per_gpu=_value(data, st.integers(1, 2048)), balance_by_flops=False,
              min_num_microbatches=_value(data, st.sampled_from([None, 2])),
              num_microbatches_multiple=_value(data, st.sampled_from([None, 2])))
    counts = _ok_or_explained(lambda: local_microbatch_counts(lengths, **kw))
    target = data.draw(st.one_of(st.just(counts), st.sampled_from(HOSTILE_SCALARS), st.just([1, 2, 3])))
    plan = _ok_or_explained(lambda: plan_local_batch(lengths, num_microbatches=target, **kw))
    if plan is not None:
        assert plan.dp == 1
    _ok_or_explained(lambda: check_max_seq_len_fits(_value(data, st.integers(1, 9000)),
                                                    max_tokens_per_gpu=_value(data, st.integers(1, 9000)),
                                                    parallel=_value(data, st.just({"cp": 2})),
                                                    oversize=_value(data, st.sampled_from(["error", "alone"])),
                                                    sequence_pad_multiple=_value(data, st.sampled_from([None, 8]))))


def test_local_mode_refuses_a_count_it_computes():
    with pytest.raises(DynBatchConfigError, match="num_microbatches"):
        local_microbatch_counts([10, 20], max_tokens_per_gpu=100, num_microbatches=2)
    with pytest.raises(DynBatchConfigError, match="agreed"):
        plan_local_batch([10, 20], num_microbatches=None, max_tokens_per_gpu=100)
    assert np.array_equal(plan_local_batch([10, 20], num_microbatches=np.array([2]), max_tokens_per_gpu=100,
                                           balance_by_flops=False).microbatches_per_step, [2])


@SETTINGS
@given(st.data())
def test_verl_and_roll_integrations_hostile(data):
    pytest.importorskip("torch")
    from megatron_dynbatch.integrations import roll, verl
    from megatron_dynbatch.testing.peer_types import grpo_batch

    lengths = data.draw(st.lists(st.integers(0, 200), min_size=1, max_size=12))
    batch = grpo_batch(lengths, width=200)
    _ok_or_explained(lambda: verl.rearrange_micro_batches(
        batch.batch, _value(data, st.integers(1, 1000)), num_batches_divided_by=_value(data, st.just(None)),
        min_num_micro_batch=_value(data, st.sampled_from([None, 2])),
        force_group_size=_value(data, st.sampled_from([1, 2])), tp_size=_value(data, st.just(1)),
        cp_size=_value(data, st.sampled_from([1, 2]))))
    _ok_or_explained(lambda: roll.dynamic_batching_shard(
        grpo_batch(lengths, width=200), _value(data, st.integers(1, 3)), _value(data, st.integers(64, 2048)),
        _value(data, st.sampled_from([16, 64])), _value(data, st.sampled_from([1, 2])),
        _value(data, st.sampled_from([None, 2]))))


@SETTINGS
@given(st.data())
def test_megatron_packing_scheduler_groups_hostile(data):
    from megatron_dynbatch.core.dropin.megatron_packing import plan_sample_id_groups

    lengths = data.draw(st.one_of(st.lists(st.integers(0, 600), max_size=24),
                                  st.lists(st.sampled_from(HOSTILE_SCALARS), min_size=1, max_size=3)))
    pairs = data.draw(st.one_of(st.just(list(enumerate(lengths))), st.sampled_from(HOSTILE_SCALARS)))
    res = _ok_or_explained(lambda: plan_sample_id_groups(
        pairs, max_seqlen_per_dp_cp_rank=_value(data, st.integers(1, 800)), dp=_value(data, st.integers(1, 4)),
        cp=_value(data, st.integers(1, 2)), microbatch_group_size_per_vp_stage=_value(data, st.sampled_from([None, 2])),
        max_num_seqs=_value(data, st.sampled_from([None, 1, 4])), balance_by_flops=False))
    if res is not None:
        groups, plan = res
        dp = len(plan.micro_batches)
        cp = len(groups[0]) // dp
        assert sorted(i for g in groups for d in range(dp) for i in g[d * cp]) == sorted(i for i, _ in pairs)


@SETTINGS
@given(st.data())
def test_megatron_rl_bins_hostile(data):
    from megatron_dynbatch.core.dropin.megatron_rl import plan_rl_bins

    lengths = data.draw(st.one_of(st.lists(st.integers(0, 600), max_size=24), st.sampled_from(HOSTILE_SCALARS),
                                  st.lists(st.sampled_from(HOSTILE_SCALARS), min_size=1, max_size=3)))
    res = _ok_or_explained(lambda: plan_rl_bins(
        lengths, bin_size=_value(data, st.sampled_from([64, 600, 1024])), dp=_value(data, st.integers(1, 4)),
        seq_length_multiple=_value(data, st.sampled_from([1, 4])),
        max_sequences_per_bin=_value(data, st.sampled_from([None, 1, 50])),
        parallel={"cp": data.draw(st.sampled_from([1, 2]))}))
    if res is not None:
        assert sorted(i for b in res.bins for i in b) == list(range(len(lengths)))


# ------------------------------------------------------------------ every drop-in entry point, as trainers call it
def _as_passed(data, values):
    """``values`` as a trainer may hand them: a list, a NumPy array or a torch tensor of a drawn dtype, a list of
    0-d tensors, or (now and then) something hostile."""
    import torch

    kind = data.draw(st.sampled_from(["list", "array", "tensor", "tensor", "0-d list", "hostile"]))
    if kind == "list":
        return list(values)
    if kind == "array":
        return np.asarray(values).astype(data.draw(st.sampled_from([np.int64, np.int32, np.uint16, np.float64])))
    dtype = data.draw(st.sampled_from([torch.int64, torch.int32, torch.int16, torch.float32, torch.float64]))
    if kind == "tensor":
        return torch.tensor(values, dtype=dtype)
    if kind == "0-d list":
        return list(torch.tensor(values, dtype=dtype))
    return data.draw(st.sampled_from(HOSTILE_SCALARS + [torch.tensor(3), [float("nan")] * len(values),
                                                        [2 ** 41] * len(values), torch.tensor([[1, 2]])]))


def _hostile_batch(data, lengths, width):
    """A verl / ROLL batch (a DataProto stand-in) -- or an empty one, one without ``attention_mask``, one whose
    mask is bool / float / has NaN."""
    from megatron_dynbatch.testing.peer_types import DataProto, grpo_batch

    kind = data.draw(st.sampled_from(["ok", "ok", "ok", "empty", "no mask", "bool", "float", "nan"]))
    batch = grpo_batch([] if kind == "empty" else lengths, width=width)
    mask = batch.batch["attention_mask"]
    if kind == "no mask":
        del batch.batch["attention_mask"]
    elif kind == "bool":
        batch.batch["attention_mask"] = mask.bool()
    elif kind in ("float", "nan"):
        batch.batch["attention_mask"] = mask.float()
        if kind == "nan" and len(lengths):
            batch.batch["attention_mask"][0, 0] = float("nan")
    assert isinstance(batch, DataProto)
    return batch


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(["slime", "verl.rearrange", "verl.prepare", "verl.partitions", "verl.groups",
                                   "verl.balance", "nemo_rl", "roll"]))
def test_every_dropin_entry_point_with_what_trainers_pass(data, entry):
    """Tensors of every integer and float dtype, 0-d tensors in lists, NumPy arrays, hostile scalars, empty
    batches, masks that are bool / float / NaN / missing, values past any sequence: a plan or a clear error (of
    the trainer's type), through the integration each trainer imports."""
    pytest.importorskip("torch")
    from megatron_dynbatch.integrations import nemo_rl, roll, slime, verl

    lengths = data.draw(st.lists(st.integers(0, 300), min_size=1, max_size=16))
    n = len(lengths)
    if entry == "slime":
        rids = data.draw(st.sampled_from([list(range(n)), [i // 2 for i in range(n)]]))
        _ok_or_explained(lambda: slime.build_dp_schedule(
            slime_args(max_tokens_per_gpu=_value(data, st.sampled_from([512, 1024.0])), data_pad_size_multiplier=1),
            {"dp_size": data.draw(st.integers(1, 3)), "cp_size": 1, "vpp_size": 1,
             "microbatch_group_size_per_vp_stage": 1}, _as_passed(data, lengths),
            global_batch_size=_value(data, st.integers(1, 4)), rollout_indices=_as_passed(data, rids)), True)
    elif entry.startswith("verl."):
        batch = _hostile_batch(data, lengths, 300)
        budget = _value(data, st.sampled_from([300, 600, 600.0, "torch"]))
        if budget == "torch":
            import torch

            budget = torch.tensor(600)
        kw = dict(min_num_micro_batch=_value(data, st.sampled_from([None, 2])),
                  num_batches_divided_by=_value(data, st.sampled_from([None, 2])))
        if entry == "verl.rearrange":
            _ok_or_explained(lambda: verl.rearrange_micro_batches(
                batch.batch, budget, force_group_size=_value(data, st.sampled_from([1, 2])), **kw), True)
        elif entry == "verl.prepare":
            _ok_or_explained(lambda: verl.prepare_dynamic_batch(batch, budget, **kw), True)
        elif entry == "verl.partitions":
            parts = _ok_or_explained(lambda: verl.get_seqlen_balanced_partitions(
                _as_passed(data, lengths), _value(data, st.integers(1, 4)), _value(data, st.booleans())), True)
            assert parts is None or all(parts)
        elif entry == "verl.groups":
            _ok_or_explained(lambda: verl.get_group_balanced_partitions(
                _as_passed(data, lengths), _as_passed(data, [i // 2 for i in range(n)]),
                _value(data, st.integers(1, 3))), True)
        else:
            _ok_or_explained(lambda: verl.balance_batch(batch, _value(data, st.integers(1, 4))), True)
    elif entry == "nemo_rl":
        packer = nemo_rl.get_packer("modified_first_fit_decreasing", 1024, min_bin_count=2, bin_count_multiple=2)
        bins = _ok_or_explained(lambda: packer.pack(_as_passed(data, lengths)), False)
        assert bins is None or sorted(i for b in bins for i in b) == list(range(n))
    else:
        batch = _hostile_batch(data, lengths, 300)
        _ok_or_explained(lambda: roll.dynamic_batching_shard(
            batch, _value(data, st.integers(1, 2)), _value(data, st.sampled_from([512, 1024.0])), 64,
            _value(data, st.sampled_from([1, 2])), _value(data, st.sampled_from([None, 1, 2])),
            ga_steps=_value(data, st.sampled_from([None, 2]))), True)
