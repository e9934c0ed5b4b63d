"""SMOKE test of benchmarks/cpu_measured.py (the measured CPU step-time benchmark): a tiny model and batch,
one timed step, every algorithm reported with finite numbers. No timing assertions -- timings on a shared CI
CPU mean nothing; the recorded run lives in docs/benchmarks.md."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

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
    mod = _load()
    argv = [a for a in TINY] + ["--pp", "2", "--steps", "2", "--algorithms", "dynbatch,dynbatch-calibrated,dynbatch-online",
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
