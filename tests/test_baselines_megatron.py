"""Megatron-LM's own packing paths as benchmark baselines (``bench/megatron_upstream.py``): their structure,
counts and budget behaviour, and where the planner stands against them on the default workloads (modelled)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_dynbatch.bench.baselines import BaselineContext, get_baseline, run_baseline
from megatron_dynbatch.bench.megatron_upstream import RL_MAX_SEQUENCES_PER_BIN

UPSTREAM = ("megatron-dp-balanced", "megatron-rl-packing", "megatron-rl-packing-rr")


def test_dp_balanced_is_next_fit_in_order_dealt_round_robin():
    ctx = BaselineContext.build({"dp": 2}, 100)
    mbs = get_baseline("megatron-dp-balanced")(np.array([60, 30, 20, 90, 50, 50, 10]), ctx)
    # packs in order: [0,1] [2] [3] [4,5] [6]; 5 is not a multiple of dp=2, and the last pack holding more than
    # one sample ([4,5]) gives up its last one: [0,1] [2] [3] [4] [6] [5], dealt k -> rank k % 2
    assert mbs == [[[0, 1], [3], [6]], [[2], [4], [5]]]


def test_dp_balanced_count_rule_under_vpp_and_its_assertion():
    ctx = BaselineContext.build({"dp": 2, "pp": 2, "vpp": 2}, 4096)
    mbs = get_baseline("megatron-dp-balanced")(np.full(40, 700), ctx)
    assert {len(r) for r in mbs} == {len(mbs[0])} and len(mbs[0]) % 2 == 0  # multiple of dp * N packs
    run = run_baseline("megatron-dp-balanced", np.full(5, 4000), ctx)  # 5 single packs, 8 needed: upstream asserts
    assert "not enough samples" in run.error


def test_dp_balanced_places_an_oversize_sample_alone_over_the_budget():
    run = run_baseline("megatron-dp-balanced", np.array([100, 5000, 100, 100]), BaselineContext.build({"dp": 2}, 4096))
    assert run.plan.cap_violations == 1 and run.plan.max_microbatch_tokens == 5000


def test_rl_packing_longest_first_next_fit_with_the_sequence_cap():
    ctx = BaselineContext.build({"dp": 1}, 100)
    mbs = get_baseline("megatron-rl-packing")(np.array([10, 70, 30, 40, 60]), ctx)
    assert mbs == [[[1], [4, 3], [2, 0]]]  # 70 | 60+40 | 30+10 (next-fit: 30 does not go back to 70's bin)
    many = get_baseline("megatron-rl-packing")(np.ones(2 * RL_MAX_SEQUENCES_PER_BIN + 1, dtype=np.int64),
                                               BaselineContext.build({"dp": 1}, 4096))
    assert [len(b) for b in many[0]] == [RL_MAX_SEQUENCES_PER_BIN, RL_MAX_SEQUENCES_PER_BIN, 1]


def test_rl_packing_dealing_and_filler_bins():
    lengths = np.array([90, 80, 70, 60, 50])  # five bins of one trajectory each at a budget of 100
    ctx = BaselineContext.build({"dp": 2}, 100)
    fifo = get_baseline("megatron-rl-packing")(lengths, ctx)
    rr = get_baseline("megatron-rl-packing-rr")(lengths, ctx)
    assert fifo == [[[0], [1], [2]], [[3], [4], []]]
    assert rr == [[[0], [2], [4]], [[1], [3], []]]
    run = run_baseline("megatron-rl-packing", lengths, ctx)
    assert "1 empty filler bin (executed)" in run.notes and run.plan.cap_violations == 0
    # every bin runs the whole row: tokens = cap, the empty one too; its attention is a full cap x cap square
    assert all(t == 100 for r in run.plan.microbatch_tokens for t in r)


def test_rl_packing_scores_padding_and_filler_bins_as_executed():
    # micro-batches large enough that their work, not the cost model's per-micro-batch floor, sets their time
    lengths = np.array([9000, 8000, 7000, 6000, 5000])
    ctx = BaselineContext.build({"dp": 2}, 10_000, "qwen3-8b")
    from megatron_dynbatch.core.planner import score_assignment

    padded = run_baseline("megatron-rl-packing", lengths, ctx).plan
    same = score_assignment(padded.micro_batches, lengths, model="qwen3-8b", parallel={"dp": 2},
                            max_tokens_per_gpu=10_000)  # the same bins as packed micro-batches of their real length
    assert padded.predicted_step_time > same.predicted_step_time
    assert padded.padding_tokens == 6 * 10_000 - int(lengths.sum())


def test_rl_packing_cannot_take_a_trajectory_longer_than_a_row():
    run = run_baseline("megatron-rl-packing", np.array([10, 5000]), BaselineContext.build({"dp": 1}, 4096))
    assert run.error is not None and "--seq-length" in run.error


@pytest.mark.slow
def test_planner_ahead_of_megatron_lm_on_every_default_workload():
    """Modelled step times (the benchmark's cost model); no budget break of ours where theirs break."""
    from megatron_dynbatch.bench.runner import run_workload
    from megatron_dynbatch.bench.workloads import default_workloads

    for w in default_workloads():
        rows, _ = run_workload(w, 0, ["dynbatch", *UPSTREAM])
        mine = next(r for r in rows if r.algorithm == "dynbatch")
        assert mine.ok and mine.cap_violations == 0 and not mine.notes, w.name
        for r in rows:
            if r.algorithm in UPSTREAM and r.ok:
                assert mine.step_time_s < r.step_time_s, (w.name, r.algorithm)
