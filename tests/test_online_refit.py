"""Online calibration's refit (torch-free core; issue 18 item 4): it converges on timings of a known profile, every
rank gets the bit-identical model from the merged vector, hostile timings are dropped, and no calibrated model --
however extreme -- can break the budget. Synthetic timings only (no wall clock)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_dynbatch import DynBatchConfigError, PlanOptions, plan_global_batch
from megatron_dynbatch.core.calibration.online import OnlineCalibration
from megatron_dynbatch.core.calibration.records import MAX_RECORD_S, SliceInfo, clean_records
from megatron_dynbatch.core.calibration.shared import merged_profile, profile_vector, scale_profile
from megatron_dynbatch.core.cost_fit import predict_records
from megatron_dynbatch.core.cost_model import CostModel
from megatron_dynbatch.core.cost_profiles import FITTED, CostProfile
from megatron_dynbatch.core.run_config import RunConfig

SPEC = {"name": "cpu-bench", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_query_groups": 2,
        "ffn_hidden_size": 1024, "swiglu": True, "vocab_size": 2048}
CPU = FITTED.replace(name="cpu", linear_efficiency=8e-5, attention_efficiency=2e-5, overhead_per_layer_s=5e-3,
                     min_per_layer_s=0.0)
PAR = {"dp": 2, "pp": 2}
KW = {"model": SPEC, "parallel": PAR, "max_tokens_per_gpu": 2048}
STAGES = (SliceInfo(1, 1, False), SliceInfo(1, 1, True))


def _train(cal, steps, *, true=CPU, noise=0.03, seed=0, rank=None):
    """``steps`` steps: plan with the calibration's current model, 'time' each rank's micro-batches with ``true``
    (+ noise) on both pipeline stages (or only ``rank``'s DP rank when given), end the step."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        lengths = np.clip(rng.lognormal(np.log(300), 0.8, 48), 32, 1024).astype(int)
        plan = plan_global_batch(lengths, cost_model=cal.current(), **KW)
        assert plan.cap_violations == 0
        for r, mbs in enumerate(plan.micro_batches):
            if rank is not None and r != rank:
                continue
            recs = [[1, [int(lengths[i]) for i in mb], 1.0] for mb in mbs]
            for sl in STAGES:
                secs = predict_records(true, recs, SPEC, measured_layers=1, lm_head=sl.lm_head)
                secs = secs * (1.0 + noise * rng.standard_normal(secs.size))
                if cal.recording:
                    cal.add([[g, L, float(s)] for (g, L, _), s in zip(recs, secs)], sl)
        cal.end_step(plan, lengths, PlanOptions(**KW).resolve())


def test_refits_converge_to_the_hardware_and_report_their_error():
    cal = OnlineCalibration(SPEC, PAR, interval=2, window=512)
    _train(cal, 13)
    assert len(cal.history) == 6 and all(h.profile is not None for h in cal.history)
    for h in cal.history:  # the fit error is reported per refit, per group size
        assert 0 < h.fit_error < 0.1 and set(h.per_group) == {1} and h.change is not None
        assert "fit error" in h.line() and "predicted step time" in h.line()
    got = CostProfile.from_dict(cal.history[-1].profile)
    assert got.linear_efficiency == pytest.approx(CPU.linear_efficiency, rel=0.05)
    assert got.attention_efficiency == pytest.approx(CPU.attention_efficiency, rel=0.1)
    # the first refit moves the prediction by orders of magnitude (H100 default -> CPU); later ones barely
    changes = [abs(h.change.model_change) for h in cal.history]
    assert changes[0] > 10 and max(changes[-3:]) < 0.03, changes


def test_every_rank_builds_the_identical_model_from_the_merged_vector():
    """Two ranks with different windows (different DP ranks' micro-batches); the merge is the SUM all-reduce."""
    a = OnlineCalibration(SPEC, PAR, interval=3)
    b = OnlineCalibration(SPEC, PAR, interval=3)
    _train(a, 3, rank=0, seed=1)
    _train(b, 3, rank=1, seed=1)
    va, vb = (profile_vector(c.local_fit()[0], c.num_records, False) for c in (a, b))
    a.merge = b.merge = lambda v: va + vb  # what the all-reduce returns on every rank
    a.history.clear(), b.history.clear()
    la, lb = a.refit(), b.refit()
    assert la.ranks_fitted == lb.ranks_fitted == 2
    assert a.cost_model == b.cost_model and a.cost_model is not None
    plans = [plan_global_batch(np.arange(40, 1000, 23), cost_model=c.current(), **KW).to_dict() for c in (a, b)]
    for p in plans:
        p.pop("planning_time_s", None), p["summary"].pop("planning_time_s", None)
    assert plans[0] == plans[1]


def test_merged_profile_is_the_mean_of_the_fitted_ranks_and_refuses_garbage():
    p1 = CPU
    p2 = scale_profile(CPU, 3.0)
    both = profile_vector(p1, 10, False) + profile_vector(p2, 20, False) + profile_vector(None, 0, False)
    got = merged_profile(both, FITTED)
    assert got.overhead_per_layer_s == pytest.approx(2 * CPU.overhead_per_layer_s)
    assert got.cp_chunk_tokens == FITTED.cp_chunk_tokens  # no rank timed a CP share: the base's
    for bad in (np.zeros(11), np.full(11, np.nan), np.ones(3), [float("inf")] * 11):
        assert merged_profile(bad, FITTED) is None


@pytest.mark.parametrize("record", [
    [1, [100], float("nan")], [1, [100], -1.0], [1, [100], 0.0], [1, [100], float("inf")], [1, [100], MAX_RECORD_S * 2],
    [0, [100], 0.1], [True, [100], 0.1], [1, [], 0.1], [1, [0], 0.1], [1, [1.5], 0.1], [1, [100], True],
    [1, "abc", 0.1], [1, [100]], "record", None, {"group_size": 1},
])
def test_hostile_records_are_dropped_and_counted(record):
    good, dropped = clean_records([[1, [100, 50], 0.2], record])
    assert good == [[1, [100, 50], 0.2]] and dropped == 1


def test_numpy_scalars_and_tensors_are_taken():
    torch = pytest.importorskip("torch")
    good, dropped = clean_records([[np.int64(2), np.array([64, 32]), np.float32(0.5)],
                                   [torch.tensor(1), torch.tensor([10, 20]), torch.tensor(0.25)]])
    assert dropped == 0 and good == [[2, [64, 32], 0.5], [1, [10, 20], 0.25]]


def test_an_empty_or_tiny_window_skips_the_refit_and_keeps_planning():
    cal = OnlineCalibration(SPEC, PAR, interval=1, skip_steps=0)
    log = cal.end_step()
    assert log is not None and log.profile is None and "skipped" in log.line() and cal.cost_model is None
    cal.add([[1, [100], 0.1]] * 2, STAGES[0])  # fewer than 3 records of a slice
    assert cal.end_step().profile is None
    assert isinstance(cal.current(), CostModel)  # the base until a refit succeeds
    cal.add("garbage", STAGES[0])
    assert cal.dropped == 1


def test_the_window_is_bounded():
    cal = OnlineCalibration(SPEC, PAR, window=16)
    cal.add([[1, [100 + i], 0.1] for i in range(100)], STAGES[0])
    assert cal.num_records == 16


@pytest.mark.parametrize("kwargs, field", [
    (dict(interval=0), "--dynbatch-calibration-interval"), (dict(interval=True), "--dynbatch-calibration-interval"),
    (dict(interval=1.5), "--dynbatch-calibration-interval"), (dict(interval=float("nan")),
                                                                "--dynbatch-calibration-interval"),
    (dict(window=3), "calibration window"), (dict(skip_steps=-1), "skip_steps"),
    (dict(base="no-such-profile"), "--dynbatch-cost-model"),
])
def test_bad_settings_are_refused(kwargs, field):
    with pytest.raises(DynBatchConfigError) as exc:
        OnlineCalibration(SPEC, PAR, **kwargs)
    assert exc.value.field == field


def test_bad_slices_and_timings_payloads_are_refused():
    cal = OnlineCalibration(SPEC, PAR)
    for bad in (dict(measured_layers=0), dict(measured_layers=1, tp=0), dict(measured_layers=1, lm_head="yes")):
        with pytest.raises(DynBatchConfigError):
            SliceInfo(**bad)
    with pytest.raises(DynBatchConfigError):
        cal.add([[1, [10], 0.1]], {"measured_layers": 1})
    with pytest.raises(DynBatchConfigError):
        cal.add_timings({"records": []})
    assert cal.add_timings(None) == 0
    assert cal.add_timings({"slice": {"measured_layers": 1, "tp": 1, "lm_head": True},
                            "records": [[1, [10], 0.1], [1, [10], float("nan")]]}) == 1


@pytest.mark.parametrize("ratio", [1e-6, 1e-3, 1.0, 1e3, 1e6])
def test_no_calibrated_model_can_break_the_budget(ratio):
    """Hard limits are the planner's: whatever the refit says, no micro-batch is over the budget."""
    prof = scale_profile(CPU.replace(min_per_layer_s=1e-3 * ratio, overhead_per_layer_s=0.0), ratio)
    cm = CostModel.from_model(SPEC, None, profile=prof)
    lengths = np.clip(np.random.default_rng(3).lognormal(6, 1, 300), 1, 2048).astype(int)
    for par in ({"dp": 4}, {"dp": 2, "pp": 2}, {"dp": 2, "cp": 2}):
        plan = plan_global_batch(lengths, model=SPEC, parallel=par, max_tokens_per_gpu=2048, cost_model=cm)
        assert plan.cap_violations == 0
        assert max(max(r) for r in plan.microbatch_tokens) <= plan.cap
    assert math.isfinite(prof.linear_efficiency) and prof.linear_efficiency <= 1


def test_run_presets_turn_it_on_and_the_driver_object_comes_from_them():
    base = dict(name="x", model="tiny-gpt", parallel={"dp": 2}, max_tokens_per_gpu=256)
    rc = RunConfig.from_dict(dict(base, online_calibration=True, calibration_interval=7))
    assert rc.to_megatron_args()[-3:] == ["--dynbatch-online-calibration", "--dynbatch-calibration-interval", "7"]
    assert RunConfig.from_dict(rc.to_dict()) == rc
    assert OnlineCalibration.from_run_config(rc).interval == 7
    with pytest.raises(DynBatchConfigError, match="online_calibration"):
        OnlineCalibration.from_run_config(RunConfig.from_dict(base))
    for bad in (dict(online_calibration="yes"), dict(calibration_interval=5),
                dict(online_calibration=True, calibration_interval=0),
                dict(online_calibration=True, calibration_interval=2.5)):
        with pytest.raises(DynBatchConfigError):
            RunConfig.from_dict(dict(base, **bad))
