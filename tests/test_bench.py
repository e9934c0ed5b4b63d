"""The benchmark: workloads, runner, report and plot on the tiny ``smoke`` workload (fast)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_dynbatch.bench import (
    ALGORITHMS,
    WORKLOADS,
    BenchResult,
    default_workloads,
    format_report,
    format_table,
    run_bench,
    run_speed,
    run_workload,
    select_workloads,
    verdicts,
)
from megatron_dynbatch.bench import workloads as wl
from megatron_dynbatch.bench.runner import DYNCP_ONLY
from megatron_dynbatch.core.errors import DynBatchConfigError

SMOKE = WORKLOADS["smoke"]


@pytest.fixture(scope="module")
def smoke_result() -> BenchResult:
    return run_bench([SMOKE], seeds=2, speed=False, progress=False, keep_plans=True)


def test_smoke_rows_for_every_algorithm(smoke_result):
    for seed in (0, 1):
        names = [r.algorithm for r in smoke_result.rows_for("smoke", seed)]
        # smoke has 8 GRPO groups >= dp=2, so dynbatch-groups runs too; it is no dynamic-CP workload
        assert names == [a for a in ALGORITHMS if a not in DYNCP_ONLY]
    for r in smoke_result.rows:
        assert r.ok, r.error
        assert r.vs_lower_bound >= 1 - 1e-9  # the lower bound is a bound
        assert r.microbatches >= 1 and r.step_time_s > 0


def test_dynbatch_never_breaks_the_cap(smoke_result):
    assert smoke_result.dynbatch_cap_violations == 0
    assert smoke_result.dynbatch_errors == []
    for r in smoke_result.rows:
        if r.family == "dynbatch":
            assert r.cap_violations == 0 and r.peak_over_cap <= 1.0 and r.notes == []


def test_ratios_relate_rows_of_one_batch(smoke_result):
    rows = smoke_result.rows_for("smoke", 0)
    best = min(r.step_time_s for r in rows if r.family == "baseline")
    for r in rows:
        assert math.isclose(r.vs_best_baseline, r.step_time_s / best)
        assert r.lower_bound_s == rows[0].lower_bound_s


def test_json_round_trip(smoke_result):
    text = smoke_result.to_json()
    json.loads(text)  # strict JSON (no NaN)
    again = BenchResult.from_json(text)
    assert again.to_dict() == smoke_result.to_dict()
    assert [r.algorithm for r in again.rows] == [r.algorithm for r in smoke_result.rows]


def test_report_mentions_every_algorithm_and_verdict(smoke_result):
    table = format_table(smoke_result)
    for name in ALGORITHMS:
        assert name in table or name in DYNCP_ONLY  # the dynamic-CP algorithms run on dynamic-CP workloads only
    header = table.splitlines()[0]
    assert "x LB" in header and "cap viol" in header and "plan ms" in header
    lines = verdicts(smoke_result)
    assert lines[-1] == "planner cap violations: 0"
    assert "smoke" in format_report(smoke_result)


def test_plot_writes_png(smoke_result, tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_dynbatch.bench.plot import plot_timelines

    plans = {k[2]: v for k, v in smoke_result.plans.items() if k[1] == 0}
    out = plot_timelines(plans, str(tmp_path / "t.png"), title="smoke")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_algorithm_filter_and_unknown_names():
    rows, _ = run_workload(SMOKE, 0, ["dynbatch", "verl"])
    assert [r.algorithm for r in rows] == ["dynbatch", "verl"]
    with pytest.raises(DynBatchConfigError, match="algorithm"):
        run_bench([SMOKE], algorithms=["nope"], speed=False, progress=False)
    with pytest.raises(DynBatchConfigError, match="--workloads"):
        select_workloads("smoke,nope")
    assert select_workloads(None) == default_workloads()
    assert SMOKE not in default_workloads()


def test_speed_runner_tiny_case():
    res = run_speed([(64, 4, 1e9)], repeats=1)
    assert res[0].samples == 64 and len(res[0].runs_ms) == 1 and res[0].microbatches >= 1
    assert res[0].to_dict()["meets_target"] is True


# ----------------------------------------------------------------------------------------- workloads
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_are_seeded_and_well_formed(name):
    w = WORKLOADS[name]
    a, b, c = w.generate(0), w.generate(0), w.generate(1)
    assert np.array_equal(a.lengths, b.lengths) and not np.array_equal(a.lengths, c.lengths)
    assert a.lengths.dtype == np.int64 and a.lengths.min() >= 1
    assert a.lengths.size % w.parallel.dp == 0  # equal-size DP splits (verl, slime) need it
    if a.group_ids is not None:
        assert a.group_ids.size == a.lengths.size


def test_grpo_lengths_have_a_truncation_spike():
    batch = wl.grpo_lengths(np.random.default_rng(0), prompts=64, group=8, max_response=4096, median_response=1000,
                            prompt_range=(100, 100))
    assert batch.group_ids.tolist()[:9] == [0] * 8 + [1]
    assert batch.lengths.max() == 100 + 4096
    assert (batch.lengths == 100 + 4096).mean() >= 0.08  # the truncated generations pile up at the limit


def test_document_lengths_fallback(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(wl.SHARED_ENV, str(tmp_path))  # an empty shared directory: the file is absent
    wl.document_lengths.cache_clear()
    try:
        data, source = wl.document_lengths()
        assert "stand-in" in source and data.size == 99519
        assert abs(data.mean() / wl.DOC_MEAN - 1) < 0.1
        assert abs(np.percentile(data, 99) / wl.DOC_P99 - 1) < 0.1
        assert "not found" in capsys.readouterr().err
    finally:
        wl.document_lengths.cache_clear()


def test_document_lengths_read_from_env(monkeypatch, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / wl.DOCUMENT_LENGTHS_FILE).write_text("[5, 7, 9]")
    monkeypatch.setenv(wl.SHARED_ENV, str(tmp_path))
    wl.document_lengths.cache_clear()
    try:
        data, source = wl.document_lengths()
        assert data.tolist() == [5, 7, 9] and source.startswith("real")
    finally:
        wl.document_lengths.cache_clear()
