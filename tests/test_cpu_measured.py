"""SMOKE test of benchmarks/cpu_measured.py (the measured CPU step-time benchmark): a tiny model and batch,
one timed step, every algorithm reported with finite numbers. No timing assertions -- timings on a shared CI
CPU mean nothing; the recorded run lives in docs/benchmarks.md. One planning-only test (no torch) checks that its
``pred x`` column scores every plan in the same (default) cost model."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_measured.py"


def _load():
    # imported by name (not from a file spec): the spawned ranks unpickle ``cpu_measured._worker`` and find the
    # module through sys.path, which multiprocessing's spawn start method hands to the children
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module("cpu_measured")


TINY = ["--steps", "1", "--warmup", "0", "--num-layers", "1", "--hidden-size", "64", "--heads", "4",
        "--query-groups", "2", "--ffn-hidden-size", "128", "--vocab", "128", "--prompts", "4", "--group-size", "4",
        "--max-len", "256", "--max-tokens-per-gpu", "512", "--timeout", "120"]


def _needs_megatron():
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")


def test_pred_x_scores_every_plan_in_the_default_model(tmp_path):
    """``pred x`` compares like with like: a plan planned with the CPU calibration (``dynbatch-calibrated``, and
    ``dynbatch-online`` started from it) is re-scored by the default (H100-fitted) model, as every other plan is.
    Before, ``dynbatch-online`` kept its CPU-model seconds: 35.370 against 0.500 for every other plan."""
    from megatron_dynbatch.core.calibration.compare import rescore
    from megatron_dynbatch.core.cost_model import CostModel
    from megatron_dynbatch.core.cost_files import save_cost_model
    from megatron_dynbatch.core.model_spec import ModelSpec

    mod = _load()
    spec = ModelSpec.from_dict({"name": "tiny", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
                                "num_query_groups": 2, "kv_channels": 64, "ffn_hidden_size": 1024,
                                "vocab_size": 2048, "swiglu": True})
    cpu = tmp_path / "cpu.json"  # the CPU fit recorded in docs/benchmarks.md: seconds ~100x an H100's
    save_cost_model(CostModel(linear_s_per_token=215.6e-6, attention_s_per_sq_token=115.6e-9, overhead_s=4.1e-3), cpu)
    opts = {"seed": 0, "max_len": 1024, "prompts": 16, "group_size": 4}
    lengths, budget, parallel = mod.make_lengths(opts), 2048, {"dp": 2}
    plans = mod.build_plans(lengths, spec, budget, parallel, mod.ALGORITHMS, calibrated=str(cpu), online_base=str(cpu))
    pred = {name: mod.default_model_step(e, lengths, spec, budget) for name, e in plans.items() if e["plan"]}
    assert set(pred) == set(mod.ALGORITHMS)
    for name in ("dynbatch-calibrated", "dynbatch-online"):  # planned with the CPU model, scored by the default
        assert pred[name] == pytest.approx(rescore(plans[name]["plan"], lengths, model=spec, cost_model=None,
                                                   max_tokens_per_gpu=budget), rel=1e-12)
        assert plans[name]["plan"].predicted_step_time > 10 * pred[name]  # its own (CPU) seconds are not these
    assert pred["dynbatch-online"] == pytest.approx(pred["dynbatch-calibrated"], rel=1e-12)  # same model, same plan
    ratios = {name: pred[name] / pred["fixed_padded"] for name in pred}
    assert all(0.2 < r <= 1.0 + 1e-9 for r in ratios.values()), ratios


def test_help_runs(capsys):
    with pytest.raises(SystemExit) as exc:
        _load().main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--json", "--steps", "--seed"):
        assert flag in out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tiny_run_reports_every_algorithm(tmp_path, capsys):
    _needs_megatron()
    mod = _load()
    out = tmp_path / "measured.json"
    mod.main(TINY + ["--json", str(out)])
    table = capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert set(summary["algorithms"]) == set(mod.ALGORITHMS)
    for name, row in summary["algorithms"].items():
        assert name in table
        assert row["error"] is None, (name, row["error"])  # every algorithm runs on this batch
        for key in ("step_s", "tokens_per_s", "measured_imbalance", "padding_fraction", "predicted_ratio_vs_fixed",
                    "measured_ratio_vs_fixed"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), (name, key, row[key])
        assert row["step_s"] > 0 and 0 <= row["padding_fraction"] < 1
        assert len(row["rank_compute_s"]) == 2 and all(math.isfinite(c) and c > 0 for c in row["rank_compute_s"])
        assert len(row["microbatches_per_rank"]) == 2 and min(row["microbatches_per_rank"]) >= 1
        assert math.isfinite(row["grad_abs_sum"]) and row["grad_abs_sum"] > 0  # a real backward ran
    assert summary["algorithms"]["fixed_padded"]["padding_fraction"] > 0  # padded path really padded
    assert summary["algorithms"]["dynbatch"]["padding_fraction"] == 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tiny_pipeline_run_compares_calibrated_and_online_plans_with_the_default(tmp_path, capsys):
    """--pp 2: the two ranks are one pipeline; dynbatch-calibrated plans with a model calibrated on this CPU first
    (megatron-dynbatch calibrate), dynbatch-online refits after every round. Structure only (no timing asserts)."""
    _needs_megatron()
    mod = _load()
    argv = [a for a in TINY] + ["--pp", "2", "--steps", "2",
                                "--algorithms", "dynbatch,dynbatch-calibrated,dynbatch-online",
                                "--json", str(tmp_path / "pp.json")]
    argv[argv.index("--num-layers") + 1] = "2"
    mod.main(argv)
    table = capsys.readouterr().out
    summary = json.loads((tmp_path / "pp.json").read_text())
    cal = summary["calibration"]
    assert cal["file"].endswith(".json") and 0 <= cal["fit_error"] < 1 and cal["timed"] >= 6
    for key in ("measured_ratio", "modelled_ratio", "modelled_default_plan_s", "modelled_calibrated_plan_s"):
        assert isinstance(cal[key], float) and math.isfinite(cal[key]) and cal[key] > 0, key
    assert "dynbatch-calibrated / dynbatch measured" in table
    rounds = summary["online"]["rounds"]
    assert len(rounds) == 2 and rounds[0]["refit"] is None  # the first round is the calibrator's warm-up
    assert rounds[-1]["refit"]["fit_error"] is not None and "online round 1" in table
    for row in summary["algorithms"].values():
        assert row["error"] is None and row["cap_violations"] == 0
