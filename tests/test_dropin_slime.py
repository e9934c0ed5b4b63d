"""slime drop-in: ``build_dp_schedule`` keeps slime's contract (``slime/utils/dp_schedule.py``: equal per-rank
counts per step, micro-batch indices tiling each rank's partition, every kept sample once, rollouts kept in one
step, trailing rollouts trimmed, oversize samples alone, VPP alignment, the static path) and adds ours: the cap
holds with slime's own padding counted, the per-rank count follows Megatron's exact VPP rule."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megatron_dynbatch import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning
from megatron_dynbatch.core.alignment import Alignment
from megatron_dynbatch.core.parallel import ParallelConfig
from megatron_dynbatch.core.planner.vpp import is_valid_microbatch_count
from megatron_dynbatch.core.dropin.slime import slime_parallel
from megatron_dynbatch.integrations.slime import build_dp_schedule, check_budget
from megatron_dynbatch.testing.exact import bins_feasible
from megatron_dynbatch.testing.peer_types import slime_args


def align_for(tp, cp, pad_mult):
    """The alignment slime's padding gives (``tp * data_pad_size_multiplier`` per CP rank's share)."""
    return Alignment.for_layout(ParallelConfig(tp=tp, cp=cp), None, None, tp * pad_mult)


def _some_step_cannot_pack(lengths, rids, gbs, steps, cap, align, par):
    """Exactly: some kept optimizer step has no valid per-rank count that packs (over-budget samples alone, no
    micro-batch empty, the same count on every rank). ``None`` answers (undecided) count as packing."""
    order = list(dict.fromkeys(rids))
    cap_eff = align.effective_cap(cap)
    for s in range(steps):
        members = set(order[s * gbs:(s + 1) * gbs])
        slots = align.seq_len(np.asarray([lengths[i] for i, r in enumerate(rids) if r in members]))
        over = int((slots > cap_eff).sum())
        normal = slots[slots <= cap_eff].tolist()
        counts = [m for m in range(1, slots.size // par.dp + 1) if is_valid_microbatch_count(m, par)]
        if not any(bins_feasible(normal, par.dp * m - over, cap_eff) is not False for m in counts
                   if par.dp * m > over):
            return True
    return False


def tpc(dp=1, cp=1, vpp=1, n=1):
    return {"dp_size": dp, "cp_size": cp, "vpp_size": vpp, "microbatch_group_size_per_vp_stage": n}


def check_contract(result, *, dp, kept, lengths, cap=None, align=None, oversize=()):
    """slime's documented invariants, plus the cap counted with slime's padding (``align``)."""
    partitions, mbi, nmb, gbs = result
    seen = set()
    for r in range(dp):
        assert len(mbi[r]) == sum(nmb)  # same count on every rank, every step
        flat = [i for mb in mbi[r] for i in mb]
        assert flat == list(range(len(partitions[r])))  # the ranges tile the rank's partition
        assert seen.isdisjoint(partitions[r])
        seen.update(partitions[r])
        for mb in mbi[r]:
            assert mb  # no empty micro-batch
            if cap is None:
                continue
            samples = [partitions[r][i] for i in mb]
            tokens = align.padded_total(sum(int(align.seq_len(lengths[s])) for s in samples))
            if tokens > cap:
                assert len(samples) == 1 and samples[0] in oversize, (samples, tokens, cap)
    assert seen == set(kept)


def test_dynamic_uniform_and_cap():
    lengths = [5] * 8
    args = slime_args(max_tokens_per_gpu=10, data_pad_size_multiplier=1)
    res = build_dp_schedule(args, tpc(dp=2), lengths, global_batch_size=8, rollout_indices=list(range(8)))
    assert res[3] == [8]
    check_contract(res, dp=2, kept=range(8), lengths=lengths, cap=10, align=Alignment())


def test_oversized_sample_lands_alone_with_a_warning():
    lengths = [15, 3, 3, 3, 3, 3, 3, 3]
    args = slime_args(max_tokens_per_gpu=10, data_pad_size_multiplier=1)
    with pytest.warns(OversizeSampleWarning, match="sample 0"):
        res = build_dp_schedule(args, tpc(dp=2), lengths, global_batch_size=8, rollout_indices=list(range(8)))
    check_contract(res, dp=2, kept=range(8), lengths=lengths, cap=10, align=Alignment(), oversize={0})
    where = [mb for r in range(2) for mb in res[1][r] if 0 in [res[0][r][i] for i in mb]]
    assert len(where) == 1 and len(where[0]) == 1


def test_oversize_error_when_asked():
    args = slime_args(max_tokens_per_gpu=10, data_pad_size_multiplier=1, dynbatch_oversize="error")
    with pytest.raises(OversizeSampleError):
        build_dp_schedule(args, tpc(dp=2), [15, 3, 3, 3], global_batch_size=4, rollout_indices=list(range(4)))


def test_vpp_count_is_a_multiple_of_the_group_size_without_pp():
    """slime's config has no pp: the count is a multiple of microbatch_group_size_per_vp_stage (slime's rule,
    and Megatron's for any pp <= N)."""
    lengths = [4] * 32
    args = slime_args(max_tokens_per_gpu=8, data_pad_size_multiplier=1, pipeline_model_parallel_size=None)
    res = build_dp_schedule(args, tpc(dp=2, vpp=2, n=2), lengths, global_batch_size=16,
                            rollout_indices=list(range(32)))
    assert all(n % 2 == 0 for n in res[2])
    check_contract(res, dp=2, kept=range(32), lengths=lengths, cap=8, align=Alignment())


def test_vpp_uses_megatron_exact_rule_when_pp_is_known():
    # pp=2, N=3: Megatron accepts M >= 3 with M % 3 in {0, 2}: 5 is valid, slime would round up to 6
    lengths = [100] * 10
    args = slime_args(max_tokens_per_gpu=200, data_pad_size_multiplier=1, pipeline_model_parallel_size=2)
    res = build_dp_schedule(args, tpc(dp=1, vpp=2, n=3), lengths, global_batch_size=10,
                            rollout_indices=list(range(10)))
    par = ParallelConfig(pp=2, vpp=2, microbatch_group_size_per_vp_stage=3)
    assert all(is_valid_microbatch_count(m, par) for m in res[2])
    assert res[2] == [5]


def test_multi_sample_rollouts_stay_in_one_step_and_trailing_ones_are_trimmed():
    rollout_indices = [0, 0, 1, 2, 2, 3, 4, 4]  # 5 rollouts, gbs=2: two steps, rollout 4 dropped
    lengths = [3] * 8
    args = slime_args(max_tokens_per_gpu=12, data_pad_size_multiplier=1)
    res = build_dp_schedule(args, tpc(dp=1), lengths, global_batch_size=2, rollout_indices=rollout_indices)
    assert res[3] == [2, 2]
    check_contract(res, dp=1, kept=range(6), lengths=lengths, cap=12, align=Alignment())
    cursor = 0
    steps = []
    for n in res[2]:
        steps.append(sorted(res[0][0][i] for mb in res[1][0][cursor:cursor + n] for i in mb))
        cursor += n
    assert steps == [[0, 1, 2], [3, 4, 5]]


def test_rejects_fewer_rollouts_than_the_global_batch():
    args = slime_args(max_tokens_per_gpu=12, data_pad_size_multiplier=1)
    with pytest.raises(DynBatchConfigError, match="num_rollouts < global_batch_size"):
        build_dp_schedule(args, tpc(dp=1), [3] * 6, global_batch_size=4, rollout_indices=[0, 0, 1, 1, 2, 2])


def test_slime_padding_counts_against_the_cap():
    """slime pads each CP rank's share to tp * data_pad_size_multiplier: with tp=2 and 128, a micro-batch of
    1000 real tokens occupies 1024 -- first-fit on real tokens would put 4 x 250 in a budget of 1000."""
    lengths = [250] * 16
    args = slime_args(max_tokens_per_gpu=1000, tensor_model_parallel_size=2)
    res = build_dp_schedule(args, tpc(dp=2), lengths, global_batch_size=16, rollout_indices=list(range(16)))
    align = Alignment.for_layout(ParallelConfig(tp=2), None, None, 256)
    check_contract(res, dp=2, kept=range(16), lengths=lengths, cap=1000, align=align)
    assert max(len(mb) for r in res[1] for mb in r) == 3


def test_static_path_is_slime_s():
    args = slime_args(use_dynamic_batch_size=False, micro_batch_size=2, balance_data=False)
    res = build_dp_schedule(args, tpc(dp=4), [10] * 16, global_batch_size=16, rollout_indices=list(range(16)))
    assert res[2] == [2] and res[3] == [16]
    assert res[0][0] == [0, 1, 8, 9]  # chunks dealt round-robin
    check_contract(res, dp=4, kept=range(16), lengths=[10] * 16)
    args = slime_args(use_dynamic_batch_size=False, micro_batch_size=2, balance_data=True)
    res = build_dp_schedule(args, tpc(dp=2), list(range(1, 9)) * 2, global_batch_size=8,
                            rollout_indices=list(range(16)))
    assert res[2] == [2, 2]
    check_contract(res, dp=2, kept=range(16), lengths=list(range(1, 9)) * 2)
    with pytest.raises(DynBatchConfigError, match="multiple of"):
        build_dp_schedule(args, tpc(dp=4), [10] * 12, global_batch_size=12, rollout_indices=list(range(12)))


def test_startup_check_reads_slime_lengths():
    args = slime_args(max_tokens_per_gpu=4096, data_pad_size_multiplier=1, rollout_max_prompt_len=1024,
                      rollout_max_response_len=4096)
    with pytest.warns(OversizeSampleWarning, match="rollout_max_prompt_len"):
        assert check_budget(args, tpc(dp=2)) is False
    args.dynbatch_oversize = "error"
    with pytest.raises(OversizeSampleError, match="at least 5120"):
        check_budget(args, tpc(dp=2))
    args.max_tokens_per_gpu = 8192
    assert check_budget(args, tpc(dp=2)) is True
    with pytest.raises(OversizeSampleError):  # the first schedule runs the check too
        build_dp_schedule(slime_args(max_tokens_per_gpu=1024, data_pad_size_multiplier=1, seq_length=2048,
                                     dynbatch_oversize="error"), tpc(dp=1), [100] * 4, global_batch_size=4,
                          rollout_indices=list(range(4)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 6), st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.sampled_from([(1, 1), (2, 2), (2, 3)]),
       st.sampled_from([1, 2, 3]), st.integers(1, 5), st.integers(0, 2 ** 31 - 1), st.sampled_from([1, 8, 128]),
       st.booleans())
def test_contract_and_cap_on_random_rollouts(dp, cp, tp, vpp_n, per_rollout, steps, seed, pad_mult, with_model):
    vpp, n = vpp_n
    rng = np.random.default_rng(seed)
    gbs = dp * int(rng.integers(1, 4))
    n_rollouts = gbs * steps + int(rng.integers(0, gbs))  # a partial trailing step
    rids = np.repeat(np.arange(n_rollouts), rng.integers(1, per_rollout + 1, n_rollouts)).tolist()
    rng.shuffle(rids)  # samples of a rollout need not be adjacent
    budget = int(rng.choice([512, 2048, 8192]))
    lengths = rng.integers(1, int(budget * cp * 1.2), len(rids)).tolist()
    args = slime_args(max_tokens_per_gpu=budget, data_pad_size_multiplier=pad_mult, tensor_model_parallel_size=tp,
                      pipeline_model_parallel_size=None)
    if not with_model:
        args.num_layers = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        try:
            res = build_dp_schedule(args, tpc(dp, cp, vpp, n), lengths, global_batch_size=gbs, rollout_indices=rids)
        except DynBatchConfigError as err:
            if "no packing of the" in str(err):  # a refused count must really not pack: check it exactly
                assert _some_step_cannot_pack(lengths, rids, gbs, steps, budget * cp, align_for(tp, cp, pad_mult),
                                              slime_parallel(dp, cp, vpp, n, tp=tp)), str(err)
                event("proved infeasible")
                return
            assert "without leaving one empty" in str(err) or "smaller than one aligned" in str(err), str(err)
            event("explained error")
            return
    event("planned")
    order = list(dict.fromkeys(rids))
    kept_rollouts = set(order[:steps * gbs])
    kept = [i for i, r in enumerate(rids) if r in kept_rollouts]
    align = align_for(tp, cp, pad_mult)
    slot = align.seq_len(np.asarray(lengths))
    over = {i for i in kept if slot[i] > align.effective_cap(budget * cp)}
    check_contract(res, dp=dp, kept=kept, lengths=lengths, cap=budget * cp, align=align, oversize=over)
    assert len(res[2]) == steps and res[3] == [gbs] * steps
    if vpp > 1:
        assert all(m % n == 0 for m in res[2])


# ------------------------------------------------------------------ issue 20: slime's own call shapes and types
def test_rollout_indices_as_a_tensor_group_by_value():
    """``rollout_indices=tensor([0,0,0,0,1,1,1,1])``, ``global_batch_size=2``: two rollouts, ONE step (iterating a
    tensor gives 0-d tensors that hash by identity: it used to plan 4 steps)."""
    torch = pytest.importorskip("torch")
    args = slime_args(max_tokens_per_gpu=64, data_pad_size_multiplier=1)
    res = build_dp_schedule(args, tpc(dp=2), [8] * 8, global_batch_size=2,
                            rollout_indices=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    assert res[3] == [2] and len(res[2]) == 1
    check_contract(res, dp=2, kept=range(8), lengths=[8] * 8)
    np_ids = build_dp_schedule(args, tpc(dp=2), np.full(8, 8.0), global_batch_size=2,
                               rollout_indices=np.repeat(np.arange(2), 4))  # whole floats, NumPy ids
    assert np_ids[2] == res[2]


def test_slime_s_asserts_stay_assertion_errors_in_slime_s_words():
    """slime asserts ``num_rollouts >= global_batch_size`` and a sample per rank in every step; its callers and
    tests catch ``AssertionError``. Ours are both that and a DynBatchConfigError naming slime's argument."""
    args = slime_args(max_tokens_per_gpu=12, data_pad_size_multiplier=1)
    with pytest.raises(AssertionError, match="num_rollouts") as exc:
        build_dp_schedule(args, tpc(dp=1), [3] * 6, global_batch_size=4, rollout_indices=[0, 0, 1, 1, 2, 2])
    assert isinstance(exc.value, DynBatchConfigError) and exc.value.field == "global_batch_size"
    with pytest.raises(AssertionError, match="dp=4") as exc:
        build_dp_schedule(args, tpc(dp=4), [3] * 3, global_batch_size=3, rollout_indices=[0, 1, 2])
    with pytest.raises(AssertionError, match=r"total_lengths\[1\]=2\.5") as exc:
        build_dp_schedule(args, tpc(dp=1), [3, 2.5], global_batch_size=2, rollout_indices=[0, 1])
    with pytest.raises(AssertionError, match=r"rollout_indices\[1\]=None"):
        build_dp_schedule(args, tpc(dp=1), [3, 2], global_batch_size=2, rollout_indices=[0, None])


def test_a_budget_under_the_padding_multiple_names_data_pad_size_multiplier():
    """slime's unit tests build ``args`` without ``data_pad_size_multiplier``: 128 (slime's default) is assumed,
    and a budget of 10 tokens cannot hold one padded micro-batch -- the message says where 128 comes from."""
    args = slime_args(max_tokens_per_gpu=10)
    del args.data_pad_size_multiplier
    with pytest.raises(AssertionError, match=r"tp x data_pad_size_multiplier = 1 x 128 = 128 \(slime's default "
                       r"128, assumed because args has no data_pad_size_multiplier\)") as exc:
        build_dp_schedule(args, tpc(dp=2), [5] * 8, global_batch_size=8, rollout_indices=list(range(8)))
    assert "--data-pad-size-multiplier" in exc.value.fix and exc.value.field == "--max-tokens-per-gpu"
    args.data_pad_size_multiplier = 1  # the fix
    assert build_dp_schedule(args, tpc(dp=2), [5] * 8, global_batch_size=8, rollout_indices=list(range(8)))[3] == [8]
    with pytest.raises(DynBatchConfigError, match=r"2 x 128 = 256 \(args.data_pad_size_multiplier\)"):
        check_budget(slime_args(max_tokens_per_gpu=100, tensor_model_parallel_size=2, seq_length=50), tpc(dp=1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.sampled_from([(1, 1), (2, 2), (2, 3)]), st.integers(1, 3), st.integers(1, 4),
       st.integers(0, 2 ** 31 - 1))
def test_same_structure_as_slime_s_own_schedule(dp, vpp_n, per_rollout, steps, seed):
    """Random rollouts through the drop-in and through a model of slime's own ``build_dp_schedule``
    (:mod:`megatron_dynbatch.testing.peer_models`): the same kept samples in the same steps (so the same optimizer
    steps -- slime counts them in rollouts, the micro-batch count never changes them), every kept sample once,
    equal counts per rank, the count a multiple of ``N`` under VPP, a sample over the budget alone in both. Ours
    plans whenever slime does; where slime's first fit cannot be split to an aligned count ours may still plan,
    and where ours refuses too it is an AssertionError as slime's. (slime halves a bin of zero-length samples
    into one with all of them and an EMPTY one -- a micro-batch with no sample -- which counts as a refusal.)
    Where they differ: slime's micro-batches can be over the budget once its padding is counted (the multiplier
    is 1 here, so the caps agree), and ours balance time."""
    from megatron_dynbatch.testing.peer_models import slime_build_dp_schedule

    vpp, n = vpp_n
    rng = np.random.default_rng(seed)
    gbs = dp * int(rng.integers(1, 4))
    n_rollouts = gbs * steps + int(rng.integers(0, gbs))  # a partial trailing step is dropped
    rids = np.repeat(np.arange(n_rollouts), rng.integers(1, per_rollout + 1, n_rollouts)).tolist()
    rng.shuffle(rids)
    budget = int(rng.choice([64, 256, 1024]))
    lengths = rng.integers(0, int(budget * 1.3), len(rids)).tolist()
    order = list(dict.fromkeys(rids))  # rollouts in first-occurrence order, gbs per step
    expected = [sorted(i for i, r in enumerate(rids) if r in order[s * gbs:(s + 1) * gbs]) for s in range(steps)]
    try:
        theirs = slime_build_dp_schedule(lengths, rids, gbs, dp, budget, dp * (n if vpp > 1 else 1))
    except AssertionError:
        theirs = None
    if theirs is not None and not all(mb for rank in theirs.micro_batches for mb in rank):
        event("slime emits an empty micro-batch")  # halving a bin of empty samples: a broken plan, not a plan
        theirs = None
    args = slime_args(max_tokens_per_gpu=budget, data_pad_size_multiplier=1, pipeline_model_parallel_size=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        try:
            ours = build_dp_schedule(args, tpc(dp, 1, vpp, n), lengths, global_batch_size=gbs, rollout_indices=rids)
        except DynBatchConfigError as err:
            assert theirs is None and isinstance(err, AssertionError), str(err)
            event("both refuse")
            return
    event("both plan" if theirs is not None else "only ours plans")
    partitions, mbi, nmb, gbs_out = ours
    assert gbs_out == [gbs] * steps and len(nmb) == steps
    cursor = [0] * dp
    for s, (m, samples) in enumerate(zip(nmb, expected)):
        got = []
        for r in range(dp):
            got += [partitions[r][i] for mb in mbi[r][cursor[r]:cursor[r] + m] for i in mb]
            cursor[r] += m
        assert sorted(got) == samples, f"step {s}"
        assert vpp == 1 or m % n == 0
    over = {i for i in range(len(lengths)) if lengths[i] > budget}
    check_contract(ours, dp=dp, kept=[i for st_ in expected for i in st_], lengths=lengths, cap=budget,
                   align=Alignment(), oversize=over)
    if theirs is not None:
        assert theirs.steps == expected
        for rank in theirs.micro_batches:  # slime, too, runs an over-budget sample alone
            assert all(len(mb) == 1 for mb in rank if over & set(mb))
