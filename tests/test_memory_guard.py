"""The online memory guard's torch-free state (issue 27 item 5): measured step peaks in, the next step's budget out.

* a step that crossed the headroom lowers the budget before the next one, to a budget whose predicted peak (with
  the measured slope) fits; the planner then never goes over it;
* the budget rises back only as far as measured steps support, never above the ceiling, and one low reading
  moves the refitted slope only a little (the prior);
* the same merged readings give the same decisions on every rank;
* hostile readings, cards and budgets get clear errors (or, on the rank's side, "not measured").
Synthetic readings only: the torch side is in ``tests/test_memory_guard_megatron.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_dynbatch import DynBatchConfigError, PlanOptions, plan_global_batch
from megatron_dynbatch.core.memory import GiB, MemorySettings
from megatron_dynbatch.core.memory.guard import (MISSING, GuardChange, MemoryGuard, largest_peak, merge_readings,
                                                 reading_vector, stage_tokens)

SPEC = "qwen3-0.6b"
ST = MemorySettings(reserve_gb=2.0)
CARD = 48 * GiB  # qwen3-0.6b on dp=2 fits 17408 tokens per GPU here


def guard(start=16384, card=CARD, parallel=None, **kw):
    kw.setdefault("settings", ST)
    kw.setdefault("skip_steps", 0)
    return MemoryGuard(start, card, model=SPEC, parallel=parallel or {"dp": 2}, **kw)


def vec(g, scale, tokens, base=None, pp=1, stage=0):
    """A reading of a step at ``tokens`` per GPU whose per-token cost is ``scale`` x the model's."""
    t = g.terms[stage]
    b = t.static if base is None else base
    v, ok = reading_vector(pp, stage, b, b + t.workspace + scale * tokens * t.per_token)
    assert ok
    return v


def true_fit(g, scale):
    """The largest budget whose TRUE peak (per-token cost ``scale`` x the model's) fits the usable bytes."""
    t = g.terms[0]
    return (g.usable_bytes - t.static - t.workspace) / (scale * t.per_token)


def test_a_start_budget_that_fits_is_kept_and_one_that_does_not_is_lowered_before_step_1():
    lines = []
    ok = guard(4096, log=lines.append)
    assert ok.budget == 4096 and ok.history == [] and not lines
    fit, _ = ok.fit_budget()
    big = guard(fit * 4, log=lines.append)
    assert big.budget == fit and len(big.history) == 1 and big.history[0].reason == "lowered"
    assert big.predicted_peak_bytes(big.budget) <= big.usable_bytes
    assert lines == [big.history[0].line()]
    assert lines[0].startswith("dynbatch memory guard | before step 1 | budget ") and "the memory model's" in lines[0]


def test_a_step_over_the_headroom_lowers_the_budget_before_the_next_step():
    lines = []
    g = guard(8192, log=lines.append)
    assert g.budget == 8192
    scale = 1.1 * true_fit(g, 1.0) / 8192  # so that 8192 tokens really cost 10% more than fits
    change = g.observe(vec(g, scale, 8192), tokens=8192)
    assert isinstance(change, GuardChange) and change.reason == "lowered" and change.new_budget == g.budget < 8192
    assert g.budget <= true_fit(g, scale)  # the next step's true peak fits
    assert g.budget >= true_fit(g, scale) - g.multiple - 1  # and the budget is not thrown away
    assert change.measured_peak_bytes > g.usable_bytes and change.measured_tokens == 8192
    assert lines[-1].startswith("dynbatch memory guard | step 1 | budget 8192 -> ")
    assert "measured peak" in lines[-1] and "GiB usable" in lines[-1] and "x the memory model" in lines[-1]
    assert f"measured peak {change.measured_peak_bytes / GiB:.2f} GiB at 8192 tokens per GPU on stage 0" in lines[-1]
    # the planner keeps the new budget as a hard limit
    opts = g.options(PlanOptions(max_tokens_per_gpu=8192, parallel={"dp": 2}))
    assert opts.max_tokens_per_gpu == g.budget
    lengths = np.random.default_rng(0).integers(100, g.budget, 64)
    assert plan_global_batch(lengths, opts).max_microbatch_tokens <= g.budget


def test_the_budget_rises_back_only_as_far_as_measured_steps_support():
    g = guard(8192, window=3, prior_steps=1.0, max_raise=0.1)
    g.observe(vec(g, 1.1 * true_fit(g, 1.0) / 8192, 8192), tokens=8192)  # one heavy step: lowered
    low = g.budget
    seen = []
    for _ in range(40):  # the steps now cost what the model says: the budget comes back, 10% at a time
        b = g.budget
        g.observe(vec(g, 1.0, b), tokens=b)
        assert g.budget <= max(b, math.floor(1.1 * b)) and g.budget <= 8192
        seen.append(g.budget)
    assert seen[:2] == [low, low]  # the heavy reading stays in the window (3 steps) and holds the budget down
    assert seen[-1] == 8192 and low < seen[3]
    raised = [c for c in g.history if c.reason == "raised"]
    assert raised and all(c.new_budget <= math.floor(1.1 * c.old_budget) for c in raised)
    assert "raised as far as measured steps support" in raised[0].line()


def test_no_raise_before_any_step_and_never_above_the_ceiling():
    g = guard(2048, ceiling=4096)
    assert g.budget == 2048  # nothing measured: nothing to support a raise
    for _ in range(30):
        g.observe(vec(g, 0.3, g.budget), tokens=g.budget)
    assert g.budget == 4096
    with pytest.raises(DynBatchConfigError, match="ceiling"):
        guard(2048, ceiling=1024)


def test_one_noisy_step_moves_the_refitted_slope_only_a_little():
    g = guard(4096, prior_steps=4.0)
    g.observe(vec(g, 0.2, 4096), tokens=4096)  # a reading 80% under the model
    assert g.scales()[0] == pytest.approx((4 * 1.0 + 0.2) / 5)  # the prior holds it
    assert g.budget == 4096
    g = guard(4096, prior_steps=4.0)
    g.observe(vec(g, 3.0, 4096), tokens=4096)  # a heavy reading is real memory: the budget follows it at once
    assert g.scales()[0] == pytest.approx((4 + 3.0) / 5) and g.safe_scales()[0] == pytest.approx(3.0)


def test_warm_up_steps_and_small_steps_do_not_refit_the_slope():
    g = guard(4096, skip_steps=1)
    assert g.observe(vec(g, 5.0, 4096), tokens=4096) is None and g.skipped == 1 and g.scales()[0] == 1.0
    g.observe(vec(g, 5.0, 512), tokens=512)  # 512 of 4096: under min_fill, and within the headroom
    assert g.scales()[0] == 1.0 and g.budget == 4096
    g.observe(vec(g, 1.0, 4096, base=g.terms[0].static + 1 * GiB), tokens=4096)  # the measured base counts
    assert g.bases()[0] == pytest.approx(g.terms[0].static + 1 * GiB)


def test_the_floor_holds_and_is_said_once():
    lines = []
    g = guard(8192, floor=6144, log=lines.append)
    for _ in range(3):
        g.observe(vec(g, 3.0, 8192), tokens=8192)
    assert g.budget == 6144
    floor = [c for c in g.history if c.reason == "floor"]
    assert len(floor) == 1 and "at the floor" in floor[0].line() and "the longest sample must fit" in floor[0].line()
    with pytest.raises(DynBatchConfigError, match="floor"):
        guard(2048, floor=4096)


def test_every_rank_decides_alike_from_the_same_merged_readings():
    rng = np.random.default_rng(3)
    a, b = guard(8192), guard(8192)
    for _ in range(30):
        ranks = [vec(a, float(rng.uniform(0.5, 1.4)), a.budget) for _ in range(4)]
        merged = merge_readings(ranks)
        assert merged[1] == max(r[1] for r in ranks)
        ca, cb = a.observe(merged, tokens=a.budget), b.observe(merged.copy(), tokens=b.budget)
        assert a.budget == b.budget and ca == cb
    assert a.to_dict() == b.to_dict()


def test_random_readings_keep_the_budget_between_floor_and_ceiling_and_the_prediction_under_the_headroom():
    rng = np.random.default_rng(11)
    for case in range(40):
        pp = int(rng.integers(1, 3))
        g = guard(int(rng.integers(1024, 32768)), parallel={"dp": 2, "pp": pp}, floor=512,
                  window=int(rng.integers(1, 10)), prior_steps=float(rng.uniform(0, 8)),
                  max_raise=float(rng.uniform(0, 0.5)), min_fill=float(rng.uniform(0, 1)))
        for _ in range(int(rng.integers(1, 15))):
            merged = np.full(2 * pp, MISSING)
            for s in range(pp):
                if rng.random() < 0.9:
                    t = g.terms[s]
                    base = t.static * float(rng.uniform(0.5, 1.5))
                    merged[2 * s:2 * s + 2] = base, base + float(rng.uniform(0, 3)) * g.budget * t.per_token
            g.observe(merged, tokens=[float(rng.uniform(0, 1)) * g.budget for _ in range(pp)])
            assert g.floor <= g.budget <= g.ceiling, case
            if g.budget > g.floor:
                assert g.predicted_peak_bytes(g.budget) <= g.usable_bytes * (1 + 1e-12), case


def test_observing_does_bounded_work(memory_model_calls):
    """A step's observation never re-evaluates the memory model and keeps at most ``window`` readings per stage,
    so its work is ``O(pp x window)`` however long the run (its time, ~us, is measured by
    ``benchmarks/memory_speed.py``)."""
    g = guard(8192, parallel={"dp": 8, "pp": 4})
    built = len(memory_model_calls)
    v = merge_readings([vec(g, 1.0, 4096, pp=4, stage=s) for s in range(4)])
    for _ in range(1000):
        g.observe(v, tokens=4096)
    assert len(memory_model_calls) == built
    assert all(len(r) <= g.window for r in g._readings) and all(len(b) <= g.window for b in g._bases)


# ------------------------------------------------------------------------------------------------ stage tokens
def test_stage_tokens_are_the_tokens_in_flight_never_more_than_the_largest_micro_batch():
    lengths = np.random.default_rng(5).integers(50, 900, 96)
    one = plan_global_batch(lengths, parallel={"dp": 2, "cp": 2}, max_tokens_per_gpu=1024, balance_by_flops=False)
    assert stage_tokens(one, 4) == [int(one.max_microbatch_tokens // 2)]  # one micro-batch in flight, over cp
    two = plan_global_batch(lengths, parallel={"dp": 2, "pp": 2}, max_tokens_per_gpu=1024, balance_by_flops=False)
    first, last = stage_tokens(two, 4)
    assert last == two.max_microbatch_tokens and first <= last  # stage 0 holds 2 micro-batches: their mean
    rows = two.microbatch_tokens
    assert first == max(int((r[j] + r[j + 1]) / 2) for r in rows for j in range(len(r) - 1))
    split = plan_global_batch(lengths, parallel={"dp": 2}, max_tokens_per_gpu=1024, samples_per_step=48,
                              balance_by_flops=False)
    assert stage_tokens(split, 4, step=1)[0] == max(t for r in rows_of(split, 1) for t in r)
    pool = plan_global_batch(lengths, model=SPEC, parallel={"dp": 2, "cp": 2}, max_tokens_per_gpu=1024,
                             dynamic_cp=True)
    assert stage_tokens(pool, 28) == [pool.max_microbatch_tokens]  # a pool plan's tokens are per GPU already


def test_stage_tokens_refuse_what_is_not_a_plan_or_a_step_of_it():
    plan = plan_global_batch([100, 200, 300, 400], parallel={"dp": 2}, max_tokens_per_gpu=512,
                             balance_by_flops=False)
    for bad_plan in (None, "plan", {"microbatch_tokens": [[1]]}):
        with pytest.raises(DynBatchConfigError, match="is not a plan"):
            stage_tokens(bad_plan, 4)
    with pytest.raises(DynBatchConfigError, match="num_layers"):
        stage_tokens(plan, 0)
    with pytest.raises(DynBatchConfigError, match="step"):
        stage_tokens(plan, 4, step=1)


def rows_of(plan, step):
    start = sum(plan.microbatches_per_step[:step])
    return [r[start:start + plan.microbatches_per_step[step]] for r in plan.microbatch_tokens]


def test_a_guard_predicts_a_plan():
    g = guard(4096)
    plan = plan_global_batch([4000, 100, 3000, 2000], parallel={"dp": 2}, max_tokens_per_gpu=4096,
                             balance_by_flops=False)
    assert g.predict_plan(plan) == pytest.approx(g.predicted_peak_bytes(4000))


# ------------------------------------------------------------------------------------------------ hostile input
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -5.0, 2.0 ** 60, None, "1e9", True])
def test_a_rank_sends_an_untrustworthy_reading_as_not_measured(bad):
    v, ok = reading_vector(2, 1, bad, 1e9)
    assert not ok and (v == MISSING).all()
    v, ok = reading_vector(2, 1, 1e9, bad)
    assert not ok and (v == MISSING).all()
    v, ok = reading_vector(2, 1, 2e9, 1e9)  # a peak under the base
    assert not ok
    v, ok = reading_vector(2, 1, 1e9, 2e9)
    assert ok and list(v) == [MISSING, MISSING, 1e9, 2e9]
    with pytest.raises(DynBatchConfigError, match="stage"):
        reading_vector(2, 2, 1e9, 2e9)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -5.0, 2.0 ** 60])
def test_hostile_merged_readings_are_refused(bad):
    g = guard(4096)
    with pytest.raises(DynBatchConfigError, match="readings"):
        g.observe([1e9, bad], tokens=4096)
    with pytest.raises(DynBatchConfigError, match="2 x pp"):
        g.observe([1e9, 2e9, 1e9], tokens=4096)
    with pytest.raises(DynBatchConfigError, match="do not match"):
        g.observe([MISSING, 2e9], tokens=4096)
    with pytest.raises(DynBatchConfigError, match="do not match"):
        g.observe([3e9, 2e9], tokens=4096)
    with pytest.raises(DynBatchConfigError, match="readings"):
        g.observe("lots", tokens=4096)
    assert g.steps == 0 and g.budget == 4096  # nothing was counted


def test_a_guard_with_no_steps_yet():
    g = guard(4096)
    assert g.scales().tolist() == [1.0] and g.bases() == [g.terms[0].static] and g.last_peak_bytes is None
    assert g.to_dict()["changes"] == [] and g.to_dict()["steps"] == 0
    assert g.observe([MISSING, MISSING], tokens=4096) is None and g.unmeasured == 1  # no rank measured
    with pytest.raises(DynBatchConfigError, match="tokens"):
        g.observe([1e9, 2e9])
    with pytest.raises(DynBatchConfigError, match="tokens"):
        g.observe([1e9, 2e9], tokens=-1)
    with pytest.raises(DynBatchConfigError, match="tokens"):
        g.observe([1e9, 2e9], tokens=[1, 2])
    with pytest.raises(DynBatchConfigError, match="plan"):
        g.observe([1e9, 2e9], plan="a plan")
    with pytest.raises(DynBatchConfigError, match="no rank"):
        merge_readings([None])
    with pytest.raises(DynBatchConfigError, match="differ in length"):
        merge_readings([[1.0, 2.0], [1.0, 2.0, 3.0, 4.0]])


@pytest.mark.parametrize("card,match", [(0, "card_bytes"), (-1, "card_bytes"), (float("nan"), "card_bytes"),
                                        (2.0 ** 80, "card_bytes"), (80, "BYTES"), ("80GB", "card_bytes")])
def test_bad_cards_are_refused(card, match):
    with pytest.raises(DynBatchConfigError, match=match):
        guard(4096, card=card)


@pytest.mark.parametrize("start", [0, -1, "auto", float("nan"), None, 2.5])
def test_bad_start_budgets_are_refused(start):
    with pytest.raises(DynBatchConfigError, match="max_tokens_per_gpu"):
        guard(start)


def test_bad_knobs_are_refused():
    for kw, field in (({"window": 0}, "window"), ({"prior_steps": -1}, "prior_steps"),
                      ({"max_raise": float("nan")}, "max_raise"), ({"min_fill": 2}, "min_fill"),
                      ({"multiple": 0}, "multiple"), ({"skip_steps": -1}, "skip_steps"),
                      ({"settings": {"headroom": 2}}, "headroom"), ({"settings": {"reserve": 1}}, "settings")):
        with pytest.raises(DynBatchConfigError, match=field):
            guard(4096, **kw)
    with pytest.raises(DynBatchConfigError, match="model"):
        MemoryGuard.for_options(PlanOptions(max_tokens_per_gpu=4096), CARD)
    g = MemoryGuard.for_options(PlanOptions(max_tokens_per_gpu=4096, model=SPEC, parallel={"dp": 4}), CARD,
                                settings=ST)
    assert g.budget == 4096 and g.parallel.dp == 4
    with pytest.raises(DynBatchConfigError, match="PlanOptions"):
        g.options({"max_tokens_per_gpu": 1})


def test_largest_peak_reads_the_peaks_of_a_reading_vector():
    """The one reader of a reading vector's peaks (the Megatron guard and the Ray recorder report it)."""
    assert largest_peak(None) is None
    assert largest_peak(np.full(6, MISSING)) is None  # no stage measured
    bad, ok = reading_vector(3, 1, float("nan"), 5.0)
    assert not ok and largest_peak(bad) is None  # an untrusted reading is no reading
    merged = merge_readings([reading_vector(3, s, 10.0 * s, 10.0 * s + p)[0] for s, p in enumerate((7.0, 2.0, 4.0))])
    assert largest_peak(merged) == 24.0  # stage 2: base 20 + 4; bases never count
    assert largest_peak(reading_vector(3, 0, 1.0, 3.0)[0]) == 3.0
