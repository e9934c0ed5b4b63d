"""The step-time model: closed forms it must reproduce, and its lower bound."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_dynbatch import CostModel, ParallelConfig
from megatron_dynbatch.core.cost_model import simulate_1f1b


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_1f1b_equal_microbatches_matches_closed_form(pp, m):
    # Equal micro-batches of stage time t: makespan = (m + pp - 1) * t.
    assert simulate_1f1b([0.3] * m, pp) == pytest.approx((m + pp - 1) * 0.3)


def test_1f1b_one_large_microbatch_costs_more_than_its_share():
    small = simulate_1f1b([1.0] * 8, 4)
    lumpy_times = [0.5] * 4 + [4.5] + [0.5] * 3
    assert sum(lumpy_times) == pytest.approx(8.0)  # same total work
    lumpy = simulate_1f1b(lumpy_times, 4)
    assert lumpy > small


def reference_1f1b(times, pp):
    """1F1B written out stage by stage (the definition in pipeline_sim's docstring), run until no stage can move."""
    f = [x / 3.0 for x in times]
    b = [x - x / 3.0 for x in times]
    m = len(times)
    seqs = []
    for s in range(pp):
        w = min(pp - s - 1, m)
        ops = [("F", j) for j in range(w)]
        for i in range(m - w):
            ops += [("F", w + i), ("B", i)]
        seqs.append(ops + [("B", j) for j in range(m - w, m)])
    end, pos, clock, moved = {}, [0] * pp, [0.0] * pp, True
    while moved:
        moved = False
        for s in range(pp):
            while pos[s] < len(seqs[s]):
                kind, j = seqs[s][pos[s]]
                if kind == "F":
                    dep = (s - 1, "F", j) if s > 0 else None
                else:
                    dep = (s + 1, "B", j) if s < pp - 1 else (s, "F", j)
                if dep is not None and dep not in end:
                    break
                start = max(clock[s], end[dep] if dep is not None else 0.0)
                clock[s] = end[(s, kind, j)] = start + (f[j] if kind == "F" else b[j])
                pos[s] += 1
                moved = True
    return max(end.values())


@pytest.mark.parametrize("m,pp", [(1, 1), (3, 2), (5, 4), (8, 8), (4, 9), (12, 3), (7, 70), (3, 130), (40, 30),
                                  (130, 8), (200, 2), (20, 200)])
def test_1f1b_simulation_is_the_schedule_written_out(m, pp):
    """Both forms (operation by operation; compressed for long, full pipelines: issue 28's pp=4096 took 6 s)
    against the schedule simulated stage by stage."""
    from megatron_dynbatch.core.pipeline_sim import simulate_1f1b_batch, uses_fast_form

    rng = np.random.default_rng(m * 1000 + pp)
    rows = rng.uniform(0.0, 1.0, (3, m)) * (rng.random((3, m)) < 0.9)
    want = [reference_1f1b(r.tolist(), pp) for r in rows]
    batch = simulate_1f1b_batch(rows, pp)
    single = [simulate_1f1b(r.tolist(), pp) for r in rows]
    np.testing.assert_allclose(batch, want, rtol=1e-12)
    assert single == batch.tolist()  # one rank and many give the same value, in either form
    if not uses_fast_form(m, pp):
        assert single == want  # operation by operation: the same arithmetic, bit for bit


def test_1f1b_compressed_form_agrees_with_the_operations_on_huge_pipelines():
    from megatron_dynbatch.core import pipeline_sim

    rng = np.random.default_rng(0)
    for m, pp in [(5, 4096), (64, 4096), (300, 100), (2, 2 ** 20)]:
        rows = rng.uniform(0.0, 1.0, (2, m))
        assert pipeline_sim.uses_fast_form(m, pp)
        ops = pipeline_sim._ops_batch(rows, pp, None) if m * pp <= 2 ** 19 else None
        got = pipeline_sim.simulate_1f1b_batch(rows, pp)
        if ops is not None:
            np.testing.assert_allclose(got, ops, rtol=1e-12)
        head = pp - m  # the first stages run every forward, then every backward: a long chain of the largest
        assert (got >= head * rows.max(axis=1) / 3.0 * (1 - 1e-12)).all()


def test_1f1b_schedule_lists_every_operation_once_in_dependency_order():
    from megatron_dynbatch.core.pipeline_sim import _schedule_1f1b

    for m, pp in [(1, 1), (4, 3), (3, 7), (9, 4)]:
        order = _schedule_1f1b(m, pp)
        assert len(order) == 2 * m * pp
        assert all(prev < k and dep < k for k, (_, _, prev, dep) in enumerate(order))
        assert sorted((j, is_b) for j, is_b, _, _ in order) == sorted((j, b) for j in range(m) for b in (False, True)
                                                                      for _ in range(pp))


def test_rank_time_pp1_is_sum_and_vpp_closed_form():
    cm = CostModel(1e-6, 0.0, overhead_s=0.0)
    assert cm.rank_time([1.0, 2.0]) == pytest.approx(3.0)
    cm = CostModel(1e-6, 0.0, overhead_s=0.0, pp=4, vpp=2)
    t = [4.0] * 8
    assert cm.rank_time(t) == pytest.approx(8 * 1.0 + 3 / 2 * 1.0)


def test_ep_lockstep_takes_max_per_microbatch():
    cm = CostModel(1e-6, 0.0, overhead_s=0.0, ep_group=2)
    out = cm.step_time([[1.0, 5.0], [5.0, 1.0]])
    assert out.tolist() == [10.0, 10.0]


def test_from_model_splits_work_over_tp_and_cp():
    one = CostModel.from_model("qwen3-8b", ParallelConfig())
    four = CostModel.from_model("qwen3-8b", ParallelConfig(tp=2, cp=2))
    assert four.linear_s_per_token == pytest.approx(one.linear_s_per_token / 4)
    assert four.attention_s_per_sq_token == pytest.approx(one.attention_s_per_sq_token / 4)


def test_lower_bound_pp1():
    cm = CostModel(1.0, 0.0, overhead_s=0.5)
    assert cm.lower_bound(total_work=100.0, max_sample_work=10.0, dp=4, min_microbatches=2,
                          max_microbatches=10) == pytest.approx(25.0 + 1.0)
    # A single sample larger than the average share dominates.
    assert cm.lower_bound(100.0, 60.0, 4, 1, 10) == pytest.approx(60.5)


def test_lower_bound_never_above_planned_time():
    from megatron_dynbatch import plan_global_batch

    rng = np.random.default_rng(1)
    for par in ({"dp": 4}, {"dp": 2, "pp": 4}, {"dp": 2, "pp": 2, "vpp": 2}):
        lengths = rng.integers(10, 4000, size=200).tolist()
        plan = plan_global_batch(lengths, model="qwen3-0.6b", parallel=par, max_tokens_per_gpu=8192)
        assert plan.lower_bound_step_time <= plan.predicted_step_time * (1 + 1e-9)


def test_fit_recovers_coefficients_and_round_trips(tmp_path):
    from megatron_dynbatch.core.cost_fit import fit_cost_model
    from megatron_dynbatch.core.cost_files import load_cost_model, save_cost_model

    rng = np.random.default_rng(0)
    tokens = rng.integers(256, 32768, size=60).astype(float)
    sq = tokens ** 2 * rng.uniform(0.05, 1.0, size=60)
    true = CostModel(2.0e-7, 3.0e-12, overhead_s=1.5e-3)
    seconds = true.microbatch_time(tokens, sq) * rng.normal(1.0, 0.01, size=60)
    fitted, report = fit_cost_model(tokens, sq, seconds)
    assert fitted.linear_s_per_token == pytest.approx(2.0e-7, rel=0.05)
    assert fitted.attention_s_per_sq_token == pytest.approx(3.0e-12, rel=0.1)
    assert fitted.overhead_s == pytest.approx(1.5e-3, rel=0.25)
    assert report.rel_rms_error < 0.02
    path = tmp_path / "cm.json"
    save_cost_model(fitted, path, report)
    assert load_cost_model(path) == fitted


def test_fit_keeps_coefficients_non_negative():
    from megatron_dynbatch.core.cost_fit import fit_cost_model

    tokens = np.array([100.0, 200.0, 400.0, 800.0])
    model, _ = fit_cost_model(tokens, tokens ** 2, 1e-3 + 1e-6 * tokens)
    assert model.attention_s_per_sq_token >= 0 and model.overhead_s >= 0


def test_calibrated_model_reaches_the_planner_through_args(tmp_path):
    import argparse

    from megatron_dynbatch import plan_global_batch
    from megatron_dynbatch.megatron.args import (add_dynamic_batch_args, plan_options_from_args,
                                              validate_dynamic_batch_args)
    from megatron_dynbatch.core.cost_files import load_cost_model, save_cost_model

    path = tmp_path / "cm.json"
    save_cost_model(CostModel(1e-7, 5e-11, overhead_s=1e-3), path)
    parser = add_dynamic_batch_args(argparse.ArgumentParser())
    args = parser.parse_args(["--use-dynamic-batch-size", "--balance-by-flops", "--max-tokens-per-gpu", "4096",
                              "--dynbatch-cost-model", str(path)])
    for k, v in dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, padded_vocab_size=128,
                     tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                     data_parallel_size=2, world_size=2).items():
        setattr(args, k, v)
    validate_dynamic_batch_args(args, world_size=2)
    opts = plan_options_from_args(args, world_size=2)
    assert opts.resolve().cost_model == load_cost_model(path)
    plan = plan_global_batch(list(range(1, 41)), opts)
    assert plan.num_samples == 40


def test_bad_cost_model_file(tmp_path):
    from megatron_dynbatch import DynBatchConfigError
    from megatron_dynbatch.core.cost_files import load_cost_model

    bad = tmp_path / "bad.json"
    bad.write_text('{"linear_s_per_token": 1e-7}')
    with pytest.raises(DynBatchConfigError, match="missing"):
        load_cost_model(bad)
