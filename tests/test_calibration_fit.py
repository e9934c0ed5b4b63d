"""Calibration on the user's hardware, torch-free half (issue 18 item 4): the fit on any device (a CPU is 1e4x
slower than an H100's nominal efficiencies, a newer GPU faster than its peak) and the grid ``calibrate`` times.
Synthetic timings only: no wall clock here."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_dynbatch import DynBatchConfigError
from megatron_dynbatch.core.calibration.grid import (GridPoint, build_grid, check_grid, layout_group_sizes,
                                                      order_points, spread_order)
from megatron_dynbatch.core.cost_fit import fit_records, predict_records
from megatron_dynbatch.core.cost_profiles import FITTED, CostProfile

TINY = {"name": "cpu-bench", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_query_groups": 2,
        "ffn_hidden_size": 1024, "swiglu": True, "vocab_size": 2048}


def _records(profile, grid, model=TINY, layers=2, tp=1, lm_head=False, noise=0.0, seed=0):
    secs = predict_records(profile, [[p.group_size, list(p.lengths), 1.0] for p in grid], model,
                           measured_layers=layers, tp=tp, lm_head=lm_head)
    rng = np.random.default_rng(seed)
    secs = secs * (1.0 + noise * rng.standard_normal(secs.size))
    return [[p.group_size, list(p.lengths), float(s)] for p, s in zip(grid, secs)]


# ------------------------------------------------------------------------------------------- the fit
def test_a_cpu_slow_device_is_fitted_not_put_on_the_floor():
    """CPU-like: efficiencies ~1e-4 of the H100 peak, no floor, a per-layer overhead. The fit's start used to put
    every record on the floor and fail; now it recovers the profile."""
    cpu = FITTED.replace(name="cpu", linear_efficiency=8e-5, attention_efficiency=2e-5, overhead_per_layer_s=5e-3,
                         min_per_layer_s=0.0)
    grid = build_grid(2048, [1])
    cm, report = fit_records(_records(cpu, grid, lm_head=True), TINY, measured_layers=2, lm_head=True)
    got = CostProfile.from_dict(report.profile)
    for name in ("linear_efficiency", "attention_efficiency", "overhead_per_layer_s"):
        assert getattr(got, name) == pytest.approx(getattr(cpu, name), rel=1e-6), name
    assert report.max_rel_error < 1e-6


def test_without_cp_shares_the_cp_member_terms_keep_the_base_profile():
    grid = build_grid(4096, [1])
    _, report = fit_records(_records(FITTED, grid, model="qwen3-8b", tp=2), "qwen3-8b", measured_layers=2, tp=2)
    got = CostProfile.from_dict(report.profile)
    for name in ("cp_min_per_layer_s", "cp_linear_overhead", "cp_chunk_tokens"):
        assert getattr(got, name) == getattr(FITTED, name), name


def test_a_device_faster_than_the_base_peak_raises_the_peak_and_stays_exact():
    fast = FITTED.replace(peak_flops=2.5e15, linear_efficiency=0.7, attention_efficiency=0.5)  # 1.75 / 1.25 PF
    grid = build_grid(16384, [1, 2])
    records = _records(fast, grid, model="qwen3-8b", tp=2)
    _, report = fit_records(records, "qwen3-8b", measured_layers=2, tp=2)
    got = CostProfile.from_dict(report.profile)
    assert got.linear_efficiency <= 1.0 and got.attention_efficiency <= 1.0 and got.peak_flops > FITTED.peak_flops
    assert report.max_rel_error < 1e-6
    again = predict_records(got, records, "qwen3-8b", measured_layers=2, tp=2)
    assert np.allclose(again, [r[2] for r in records], rtol=1e-6)


# ------------------------------------------------------------------------------------------- the grid
def test_default_grid_covers_floor_small_large_and_every_group_size_within_budget():
    grid = build_grid(8192, [1, 2, 4])
    assert {p.group_size for p in grid} == {1, 2, 4}
    for g in (1, 2, 4):
        mine = [p for p in grid if p.group_size == g]
        assert max(p.tokens for p in mine) == 8192 * g  # the budget itself
        assert min(p.tokens for p in mine) <= 64  # floor points
        assert {len(p.lengths) for p in mine} >= {1, 2, 4, 8}
        assert {p.kind for p in mine} == {"packed", "mixed", "floor"}
    assert all(p.tokens <= 8192 * p.group_size for p in grid)  # never over the budget
    assert len({(p.group_size, tuple(sorted(p.lengths))) for p in grid}) == len(grid)  # no point twice


def test_every_prefix_of_the_order_keeps_both_ends_and_every_group_size():
    assert spread_order(5) == [0, 4, 2, 1, 3]
    assert sorted(spread_order(37)) == list(range(37))
    grid = build_grid(4096, [1, 2, 4, 8])
    head = grid[:12]
    assert {p.group_size for p in head} == {1, 2, 4, 8}
    for g in (1, 2, 4, 8):
        sizes = [p.tokens for p in grid if p.group_size == g]
        mine = [p.tokens for p in head if p.group_size == g]
        assert min(sizes) in mine and max(sizes) in mine
    assert order_points(list(reversed(grid))) == order_points(grid) or len(order_points(grid)) == len(grid)


def test_layout_group_sizes():
    assert layout_group_sizes({"dp": 8, "cp": 2}) == [2]
    assert layout_group_sizes({"dp": 4, "cp": 2}, dynamic_cp=True) == [1, 2, 4, 8]
    assert layout_group_sizes({"dp": 3, "cp": 1}, dynamic_cp=True) == [1, 2, 3]


@pytest.mark.parametrize("kwargs, flag", [
    (dict(max_tokens_per_gpu=0, group_sizes=[1]), "--max-tokens-per-gpu"),
    (dict(max_tokens_per_gpu=float("nan"), group_sizes=[1]), "--max-tokens-per-gpu"),
    (dict(max_tokens_per_gpu=1024, group_sizes=[]), "--group-sizes"),
    (dict(max_tokens_per_gpu=1024, group_sizes=[0]), "--group-sizes"),
    (dict(max_tokens_per_gpu=1024, group_sizes="1,2"), "--group-sizes"),
    (dict(max_tokens_per_gpu=1024, group_sizes=[1], tokens=[2048]), "--grid-tokens"),
    (dict(max_tokens_per_gpu=1024, group_sizes=[1], tokens=[-5]), "--grid-tokens"),
    (dict(max_tokens_per_gpu=1024, group_sizes=[1], tokens=[1024], seqs=[1], floor=False), "--grid-tokens"),
    (dict(max_tokens_per_gpu=1024, group_sizes=[1], tokens=[512, 1024], seqs=[1], floor=False), "--grid-tokens"),
    (dict(max_tokens_per_gpu=1024, group_sizes=[1], seqs=[True]), "--grid-seqs"),
    (dict(max_tokens_per_gpu=1024, group_sizes=[1], seqs=[0.5]), "--grid-seqs"),
])
def test_bad_and_degenerate_grids_are_refused_naming_the_flag(kwargs, flag):
    mtpg = kwargs.pop("max_tokens_per_gpu")
    with pytest.raises(DynBatchConfigError) as exc:
        build_grid(mtpg, **kwargs)
    assert exc.value.field == flag


def test_numpy_scalars_and_whole_floats_are_taken():
    grid = build_grid(np.int64(1024), [np.int32(1)], tokens=[np.float64(256.0), 1024], seqs=(1, np.uint8(4)))
    assert grid and all(isinstance(p.group_size, int) for p in grid)
    check_grid(grid)
    with pytest.raises(DynBatchConfigError):
        check_grid([GridPoint(1, (100,))] * 8)


def test_without_measurable_attention_the_fit_keeps_the_bases_split():
    """A tiny model at short lengths: attention is lost in the noise. The fit keeps the base's attention/linear
    efficiency ratio (and says so in the profile's name) instead of failing."""
    from megatron_dynbatch.core.cost_fit import record_features

    grid = build_grid(256, [1])
    records = [[p.group_size, list(p.lengths), 1.0] for p in grid]
    f = record_features("tiny-gpt", records, measured_layers=2, peak_flops=FITTED.peak_flops)
    secs = (2 * 2e-3 + f["lin"] / 8e-5) * (1.0 - 0.02 * f["att"] / f["att"].max())  # no attention cost to see
    records = [[g, L, float(s)] for (g, L, _), s in zip(records, secs)]
    _, report = fit_records(records, "tiny-gpt", measured_layers=2)
    got = CostProfile.from_dict(report.profile)
    assert "attention:linear ratio of fitted" in got.name
    assert got.attention_efficiency / got.linear_efficiency == pytest.approx(
        FITTED.attention_efficiency / FITTED.linear_efficiency, rel=1e-9)
    assert report.uncertainty < 0.05  # the tied fit still reproduces the timings


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_record_weights_must_be_positive_and_finite(weight):
    from megatron_dynbatch.core.cost_fit import fit_profile, record_features

    grid = build_grid(2048, [1])
    f = record_features(TINY, _records(FITTED, grid), measured_layers=2, peak_flops=FITTED.peak_flops)
    f["weight"] = np.full(len(grid), weight)
    with pytest.raises(DynBatchConfigError) as exc:
        fit_profile([f])
    assert exc.value.field == "weight"
