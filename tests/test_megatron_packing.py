"""The planner as Megatron-LM's packing scheduler (``--sequence-packing-scheduler dynbatch``).

Pure parts (grouping format, plan arguments, the flag) run everywhere; feature detection is checked against
the installed megatron-core; the scheduler class is run on upstream's REAL ``DpBalancedScheduler`` when the
installed megatron-core, or ``MEGATRON_LM_DIR``'s, has the extension point (Megatron-LM dev, Aug 2026)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
import typing

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynbatch import DynBatchConfigError, plan_global_batch
from megatron_dynbatch.integrations import megatron_lm as ml
from megatron_dynbatch.integrations import megatron_packing as mp


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=60), dp=st.integers(1, 4), cp=st.sampled_from([1, 2]),
       seed=st.integers(0, 10**6))
def test_groups_place_every_sample_once_in_upstream_format(lengths, dp, cp, seed):
    lengths = lengths * dp  # at least one sample per DP rank (the planner refuses fewer, with a clear error)
    ids = list(np.random.default_rng(seed).permutation(1000)[:len(lengths)])
    plan = plan_global_batch(lengths, parallel={"dp": dp, "cp": cp}, max_tokens_per_gpu=320, balance_by_flops=False)
    groups = mp.sample_id_groups_from_plan(plan, ids, cp)
    assert len(groups) == plan.num_microbatches and all(len(g) == dp * cp for g in groups)
    for g in groups:
        for d in range(dp):  # the CP ranks of one DP rank share its micro-batch
            assert all(g[d * cp + c] == g[d * cp] for c in range(cp))
    placed = [i for g in groups for d in range(dp) for i in g[d * cp]]
    assert sorted(placed) == sorted(int(i) for i in ids)


def test_groups_reject_bad_cp():
    plan = plan_global_batch([5, 6], parallel={"dp": 1}, max_tokens_per_gpu=16, balance_by_flops=False)
    with pytest.raises(DynBatchConfigError, match="cp_size"):
        mp.sample_id_groups_from_plan(plan, [0, 1], 0)


def test_plan_options_from_scheduler_settings():
    config = types.SimpleNamespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                   virtual_pipeline_model_parallel_size=2, sequence_parallel=True)
    opts = mp.scheduler_plan_options(max_seqlen_per_dp_cp_rank=4096, dp=4, cp=2, config=config,
                                     microbatch_group_size_per_vp_stage=2)
    par = opts.parallel
    assert (par.dp, par.cp, par.tp, par.pp, par.vpp, par.sequence_parallel) == (4, 2, 2, 2, 2, True)
    assert opts.max_tokens_per_gpu == 4096 and opts.resolve().balance_by == "tokens"  # no vocabulary: tokens
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                              padded_vocab_size=128, seq_length=128, swiglu=True, dynbatch_oversize="alone")
    opts = mp.scheduler_plan_options(max_seqlen_per_dp_cp_rank=256, dp=2, cp=1, args=args)
    assert opts.resolve().balance_by == "time" and opts.model.padded_vocab_size == 128 and opts.oversize == "alone"
    for bad in (None, 0, -3, 1.5):
        with pytest.raises(DynBatchConfigError, match="--max-seqlen-per-dp-cp-rank"):
            mp.scheduler_plan_options(max_seqlen_per_dp_cp_rank=bad, dp=1, cp=1)


def test_upstreams_post_packing_padding_counts_against_the_budget():
    """Megatron-LM dev's ``--pad-packed-seq-alignment`` pads each packed micro-batch after the scheduler ran:
    N -> each CP rank's share to a multiple of N, ``max`` (or any alignment under a THD CUDA graph) -> to the
    budget. The planner counts that padding, so the padded share never exceeds ``max_seqlen_per_dp_cp_rank``."""
    from megatron_dynbatch.core.dropin.megatron_packing import plan_sample_id_groups

    def options(**fields):
        return mp.scheduler_plan_options(max_seqlen_per_dp_cp_rank=1000, dp=2, cp=2,
                                         config=types.SimpleNamespace(**fields))

    assert options().microbatch_pad_multiple is None
    assert options(pad_packed_seq_alignment=None).microbatch_pad_multiple is None
    assert options(pad_packed_seq_alignment=384).microbatch_pad_multiple == 384
    assert options(pad_packed_seq_alignment="384").microbatch_pad_multiple == 384
    assert options(pad_packed_seq_alignment=np.int64(8)).microbatch_pad_multiple == 8
    assert options(pad_packed_seq_alignment="max").microbatch_pad_multiple == 1000
    assert options(pad_packed_seq_alignment=8, cuda_graph_impl="transformer_engine").microbatch_pad_multiple == 1000
    assert options(pad_packed_seq_alignment=8, cuda_graph_impl="none").microbatch_pad_multiple == 8
    for bad in (0, -8, 1001, 2.5, "eight", True):
        with pytest.raises(DynBatchConfigError, match="--pad-packed-seq-alignment"):
            options(pad_packed_seq_alignment=bad)

    rng = np.random.default_rng(3)
    lens = rng.integers(10, 900, 64).tolist()
    pairs = list(enumerate(lens))
    for alignment in (384, "max"):
        opts = options(pad_packed_seq_alignment=alignment)
        groups, plan = plan_sample_id_groups(pairs, opts, max_seqlen_per_dp_cp_rank=opts.max_tokens_per_gpu, dp=2,
                                             cp=2)
        step = 384 if alignment == 384 else 1000
        for g in groups:
            for d in range(2):
                slots = sum(-(-lens[i] // 4) * 4 for i in g[d * 2])  # zig-zag: each sequence to 2*cp
                share = -(-(-(-slots // 2)) // step) * step  # upstream: ceil(total / cp), then up to the multiple
                assert share <= 1000
        # the planner scored the same padding: every micro-batch's tokens are cp x a multiple of the step
        assert all(t % (2 * step) == 0 and t <= 2000 for row in plan.microbatch_tokens for t in row)
    # uncounted, a share the planner fills to 976 tokens would be padded by upstream to 1,152 > 1,000
    plan = plan_sample_id_groups(pairs, max_seqlen_per_dp_cp_rank=1000, dp=2, cp=2, parallel=options().parallel,
                                 balance_by_flops=False)[1]
    assert max(-(-t // 2 // 384) * 384 for row in plan.microbatch_tokens for t in row) > 1000


def test_flag_choices_are_extended_on_a_megatron_style_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequence-packing-scheduler", choices=("dp_balanced", "default_dynamic_cp"), default=None)
    assert mp.extend_scheduler_flag(parser) and mp.extend_scheduler_flag(parser)  # idempotent
    assert parser.parse_args(["--sequence-packing-scheduler", "dynbatch"]).sequence_packing_scheduler == "dynbatch"
    with pytest.raises(SystemExit):
        parser.parse_args(["--sequence-packing-scheduler", "nope"])
    assert not mp.extend_scheduler_flag(argparse.ArgumentParser())  # no such flag: nothing to do
    # the Megatron-LM extra-args provider leaves a parser without the flag alone (no megatron import)
    ml.add_dynamic_batch_args(argparse.ArgumentParser())


def test_feature_detection_on_the_installed_megatron_core():
    pytest.importorskip("megatron.core")
    ok, why = mp.packing_scheduler_support()
    from megatron.core.datasets import data_schedule

    has_map = isinstance(getattr(data_schedule, "scheduler_map", None), dict)
    string_keys = has_map and all(isinstance(k, str) for k in data_schedule.scheduler_map)
    assert ok == bool(string_keys and hasattr(data_schedule, "DpBalancedScheduler"))
    if not ok:
        assert "install()" in why
        assert mp.register_packing_scheduler() is False
        with pytest.raises(DynBatchConfigError, match="--sequence-packing-scheduler"):
            mp.register_packing_scheduler(strict=True)


def test_scheduler_class_plans_on_a_stand_in_base():
    """The override itself (upstream's base replaced by a minimal stand-in with its constructor)."""

    class Base:
        def __init__(self, max_seqlen_per_dp_cp_rank, cp_size, dp_size, microbatch_group_size_per_vp_stage,
                     max_num_seqs=None):
            self.max_seqlen_per_dp_cp_rank, self.cp_size, self.dp_size = max_seqlen_per_dp_cp_rank, cp_size, dp_size
            self.microbatch_group_size_per_vp_stage = microbatch_group_size_per_vp_stage

        def run(self, *a):
            return "ran"

        def get_groups_and_subsamples(self, sample_id_seqlens):
            raise AssertionError("overridden")

    cls = mp.scheduler_class(Base)
    assert mp.scheduler_class(Base) is cls
    sched = cls(100, 1, 2, None)
    lengths = [90, 10, 40, 60, 30, 70, 20, 80]
    groups = sched.get_groups_and_subsamples(list(enumerate(lengths)))
    assert all(sum(lengths[i] for i in g[r]) <= 100 for g in groups for r in range(2))
    assert sorted(i for g in groups for r in g for i in r) == list(range(8))
    with pytest.raises(DynBatchConfigError, match="--calculate-per-token-loss"):
        sched.run(None, 1, None, None, None, None, None, types.SimpleNamespace(calculate_per_token_loss=False))
    assert sched.run(None, 1, None, None, None, None, None,
                     types.SimpleNamespace(calculate_per_token_loss=True)) == "ran"
    with pytest.raises(DynBatchConfigError, match="alone"):  # over the budget: the planner's clear error
        sched.get_groups_and_subsamples([(0, 150), (1, 10)])


_UPSTREAM = r"""
import typing
from megatron.core.datasets import data_schedule as ds
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron_dynbatch.integrations import megatron_packing as mp
ok, why = mp.packing_scheduler_support()
if not ok:
    print("NO-EXTENSION-POINT", why); raise SystemExit(0)
assert mp.register_packing_scheduler() and mp.register_packing_scheduler()
cls = ds.scheduler_map["dynbatch"]
assert issubclass(cls, ds.DpBalancedScheduler) and ds.scheduler_map["dp_balanced"] is ds.DpBalancedScheduler
field = ModelParallelConfig.__dataclass_fields__["sequence_packing_scheduler"]
lit = [a for a in typing.get_args(field.type) if typing.get_origin(a) is typing.Literal][0]
assert "dynbatch" in typing.get_args(lit) and "dp_balanced" in typing.get_args(lit)
sched = cls(128, 1, 2, None)
lengths = [100, 20, 64, 64, 10, 120, 33, 5, 90, 17]
groups = sched.get_groups_and_subsamples(list(enumerate(lengths)))
counts = {len(g) for g in groups}
assert counts == {2}, counts
assert sorted(i for g in groups for r in g for i in r) == list(range(len(lengths)))
assert all(sum(lengths[i] for i in g[r]) <= 128 for g in groups for r in range(2))
up = ds.DpBalancedScheduler(128, 1, 2, None).get_groups_and_subsamples(list(enumerate(lengths)))
print("OK", len(groups), len(up))
"""


def test_registered_on_upstreams_real_scheduler_map():
    """Runs in a fresh interpreter on the installed megatron-core, or on MEGATRON_LM_DIR's when set (e.g. a
    Megatron-LM dev checkout, whose megatron.core has the extension point)."""
    pytest.importorskip("megatron.core")
    env = dict(os.environ)
    root = os.environ.get("MEGATRON_LM_DIR")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.getcwd(), env.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", _UPSTREAM], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    if "NO-EXTENSION-POINT" in res.stdout:
        pytest.skip("no packing-scheduler extension point in this megatron-core (set MEGATRON_LM_DIR to a "
                    f"Megatron-LM dev checkout to run this): {res.stdout.strip()}")
    assert res.stdout.startswith("OK")


def test_literal_extension_keeps_optional_literal():
    import dataclasses

    # real typing objects as field types (this file's annotations are strings: `from __future__ import annotations`)
    Cfg = dataclasses.make_dataclass(
        "Cfg", [("sequence_packing_scheduler", typing.Optional[typing.Literal["dp_balanced"]], None)])
    Derived = dataclasses.make_dataclass("Derived", [("other", int, 0)], bases=(Cfg,))

    for _ in range(2):  # idempotent
        mp._allow_in_config_field("dynbatch", Cfg)
    field = Derived.__dataclass_fields__["sequence_packing_scheduler"]  # the subclass shares the field
    assert typing.get_args(typing.get_args(field.type)[0]) == ("dp_balanced", "dynbatch")
    mp._allow_in_config_field("dynbatch", argparse.Namespace)  # not a dataclass: nothing to do


# ------------------------------------------------------------------------ the planning half, hostile inputs
def test_sample_id_groups_accept_tensors_and_numpy_scalars():
    import torch

    from megatron_dynbatch.core.dropin.megatron_packing import plan_sample_id_groups

    pairs = [(torch.tensor(i), torch.tensor(n)) for i, n in enumerate([100, 20, 64, 64])] + \
        [(np.int64(4), np.int32(10)), (5, 120)]
    groups, plan = plan_sample_id_groups(pairs, max_seqlen_per_dp_cp_rank=np.int64(128), dp=2, cp=np.int64(1),
                                         balance_by_flops=False)
    assert sorted(i for g in groups for r in g for i in r) == list(range(6))
    assert plan.cap == 128


@pytest.mark.parametrize("pairs, field", [
    ([], "sample_id_seqlens"),                      # empty: no rank gets a micro-batch
    ([(0, 5)], "sample_id_seqlens"),                # fewer samples than DP ranks (dp=2)
    ([(0, 5), (0, 6)], "sample_id_seqlens"),        # a repeated id
    ([(0, -5), (1, 6)], "sample_id_seqlens[0]"),
    ([(0, 5.5), (1, 6)], "sample_id_seqlens[0]"),
    ([(0, 5, 1), (1, 6)], "sample_id_seqlens[0]"),
    ("nope", "sample_id_seqlens"),
])
def test_sample_id_groups_reject_bad_input_naming_the_field(pairs, field):
    from megatron_dynbatch.core.dropin.megatron_packing import plan_sample_id_groups

    with pytest.raises(DynBatchConfigError) as exc:
        plan_sample_id_groups(pairs, max_seqlen_per_dp_cp_rank=128, dp=2, cp=1, balance_by_flops=False)
    assert exc.value.field == field


@pytest.mark.parametrize("kw, field", [
    (dict(max_seqlen_per_dp_cp_rank=0), "max_seqlen_per_dp_cp_rank"),
    (dict(max_seqlen_per_dp_cp_rank=1.5), "max_seqlen_per_dp_cp_rank"),
    (dict(dp=0), "dp_size"),
    (dict(cp=True), "cp_size"),
    (dict(microbatch_group_size_per_vp_stage=0), "microbatch_group_size_per_vp_stage"),
    (dict(max_num_seqs=0), "max_num_seqs"),
])
def test_sample_id_groups_reject_bad_settings(kw, field):
    from megatron_dynbatch.core.dropin.megatron_packing import plan_sample_id_groups

    args = {**dict(max_seqlen_per_dp_cp_rank=128, dp=2, cp=1, balance_by_flops=False), **kw}
    with pytest.raises(DynBatchConfigError) as exc:
        plan_sample_id_groups([(i, 10) for i in range(8)], **args)
    assert exc.value.field == field


def test_sample_id_groups_huge_and_oversize_values():
    from megatron_dynbatch.core.dropin.megatron_packing import plan_sample_id_groups
    from megatron_dynbatch.core.errors import OversizeSampleError

    with pytest.raises(OversizeSampleError):
        plan_sample_id_groups([(0, 10**12), (1, 5)], max_seqlen_per_dp_cp_rank=128, dp=1, cp=1,
                              balance_by_flops=False)
    from megatron_dynbatch.core.errors import OversizeSampleWarning

    with pytest.warns(OversizeSampleWarning):
        groups, plan = plan_sample_id_groups([(0, 10**6), (1, 5)], max_seqlen_per_dp_cp_rank=128, dp=1, cp=1,
                                             balance_by_flops=False, oversize="alone")
    assert [0] in [g[0] for g in groups] and plan.oversize_samples == [0]


def test_max_num_seqs_and_count_multiple_on_a_large_batch():
    from megatron_dynbatch.core.dropin.megatron_packing import plan_sample_id_groups

    rng = np.random.default_rng(0)
    lens = np.where(rng.random(16384) < 0.9, rng.integers(20, 200, 16384), rng.integers(2000, 8000, 16384))
    groups, plan = plan_sample_id_groups(list(enumerate(lens.tolist())), max_seqlen_per_dp_cp_rank=8192, dp=64, cp=2,
                                         microbatch_group_size_per_vp_stage=4, max_num_seqs=16,
                                         parallel={"pp": 4, "vpp": 2}, balance_by_flops=False)
    assert len(groups) % 4 == 0 and max(len(g[0]) for g in groups) <= 16
    assert all(sum(int(lens[i]) for i in g[d * 2]) <= 8192 * 2 for g in groups for d in range(64))


def test_planner_options_model_balances_by_flops_on_a_stand_in_base():
    class Base:
        def __init__(self, max_seqlen_per_dp_cp_rank, cp_size, dp_size, microbatch_group_size_per_vp_stage):
            self.max_seqlen_per_dp_cp_rank, self.cp_size, self.dp_size = max_seqlen_per_dp_cp_rank, cp_size, dp_size
            self.microbatch_group_size_per_vp_stage = microbatch_group_size_per_vp_stage

    sched = mp.scheduler_class(Base)(4096, 1, 2, None, max_num_seqs=3, plan_options={"model": "tiny-gpt"})
    groups = sched.get_groups_and_subsamples(list(enumerate([900, 30, 400, 600, 30, 700, 20, 800])))
    assert sched.last_plan.balance_by == "time" and max(len(g[0]) for g in groups) <= 3  # no max_num_seqs in Base


def test_wrap_data_iterator_refuses_a_missing_budget():
    pytest.importorskip("megatron.core")
    groups = types.SimpleNamespace(dp_cp=None, dp=None, tp=None, pp=None)
    with pytest.raises(DynBatchConfigError, match="pg_collection"):
        mp.wrap_data_iterator(None, types.SimpleNamespace(), 1, groups)
    one = types.SimpleNamespace(size=lambda: 1)
    groups = types.SimpleNamespace(dp_cp=one, dp=one, tp=one, pp=one)
    for bad in (None, 0, 2.5, True):
        with pytest.raises(DynBatchConfigError, match="max_seqlen_per_dp_cp_rank"):
            mp.wrap_data_iterator(None, types.SimpleNamespace(max_seqlen_per_dp_cp_rank=bad), 1, groups)
