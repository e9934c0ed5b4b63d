"""``megatron-dynbatch calibrate`` (issue 18 item 4): every bad flag is a ``DynBatchConfigError`` naming the flag, the
value and the fix; ``--dry-run`` times nothing (and imports no torch); a real CPU run writes the cost-model file that
``plan --cost-model``, ``bench --cost-model``, ``RunConfig.cost_model`` and ``--dynbatch-cost-model`` read; saved
records refit without timing. No wall-clock assertion."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dynbatch.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny-gpt", "--max-tokens-per-gpu", "512", "--device", "cpu"]


def _err(capsys, argv):
    rc = main(["calibrate"] + argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    return err


@pytest.mark.parametrize("argv, flag", [
    (["--max-tokens-per-gpu", "512"], "--model=None"),
    (["--model", "tiny-gpt"], "--max-tokens-per-gpu=None"),
    (TINY[:2] + ["--max-tokens-per-gpu", "x"], "--max-tokens-per-gpu='x'"),
    (TINY[:2] + ["--max-tokens-per-gpu", "0"], "--max-tokens-per-gpu=0"),
    (TINY[:4] + ["--device", "gpu"], "--device='gpu'"),
    (TINY + ["--layers", "0"], "--layers=0"),
    (TINY + ["--layers", "99"], "--layers=99"),
    (TINY + ["--layers", "1.5"], "--layers='1.5'"),
    (TINY + ["--dtype", "int8"], "--dtype='int8'"),
    (TINY + ["--spec", "fast"], "--spec='fast'"),
    (TINY + ["--spec", "te"], "--spec='te'"),
    (TINY + ["--group-sizes", "0"], "--group-sizes=0"),
    (TINY + ["--group-sizes", "1,,2"], "--group-sizes='1,,2'"),
    (TINY + ["--group-sizes", "a"], "--group-sizes='a'"),
    (TINY + ["--grid-tokens", "1024"], "--grid-tokens=1024"),
    (TINY + ["--grid-tokens", "512", "--grid-seqs", "1"], "--grid-tokens="),
    (TINY + ["--grid-seqs", "-1"], "--grid-seqs=-1"),
    (TINY + ["--warmup", "-1"], "--warmup=-1"),
    (TINY + ["--repeats", "0"], "--repeats=0"),
    (TINY + ["--max-seconds", "soon"], "--max-seconds='soon'"),
    (TINY + ["--max-seconds", "1"], "--max-seconds=1.0"),
    (TINY + ["--max-seconds", "nan"], "--max-seconds=nan"),
    (TINY + ["--base", "h200"], "--base='h200'"),
    (TINY + ["--cpu-threads", "0"], "--cpu-threads=0"),
    (TINY + ["--lengths", "/no/such/file.txt"], "--lengths='/no/such/file.txt'"),
    (["--model", "qwen3-30b-a3b", "--max-tokens-per-gpu", "512"], "--model='qwen3-30b-a3b'"),
    (["--model", "qwen3-8b", "--max-tokens-per-gpu", "512", "--tp", "3"], "--tp=3"),
    (["--run", "tiny-cpu-demo", "--tp", "2"], "--tp=2"),
    (["--run", "tiny-cpu-demo", "--max-tokens-per-gpu", "7"], "--max-tokens-per-gpu=7"),
])
def test_every_bad_flag_names_flag_value_and_fix(capsys, argv, flag):
    err = _err(capsys, argv + ["--dry-run"])
    assert err.startswith("megatron-dynbatch: error: " + flag), err
    assert "Fix:" in err and "Traceback" not in err


def test_from_records_refuses_files_that_are_not_records(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{\"records\": []}")
    err = _err(capsys, TINY + ["--from-records", str(bad), "--output", str(tmp_path / "o.json")])
    assert "--from-records=" in err and "Fix:" in err


def test_dry_run_prints_the_grid_and_estimate_without_importing_torch(tmp_path):
    code = ("import sys; from megatron_dynbatch.cli import main; rc = main(['calibrate', '--model', 'qwen3-8b', "
            "'--tp', '2', '--cp', '2', '--dp', '4', '--dynamic-cp', '--max-tokens-per-gpu', '8192', '--dry-run', "
            "'--max-seconds', '20']); assert 'torch' not in sys.modules, 'dry run imported torch'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "group size(s) 1, 2, 4, 8" in out.stdout and "estimated time" in out.stdout
    assert "left out" in out.stdout  # --max-seconds 20 cut the grid
    assert not (tmp_path / "calibrated_cost_model.json").exists()


def test_dry_run_json_lists_every_point_within_the_budget(capsys):
    assert main(["calibrate"] + TINY + ["--dry-run", "--json", "--group-sizes", "1,2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {p["group_size"] for p in out["grid"]} == {1, 2}
    assert all(sum(p["lengths"]) <= 512 * p["group_size"] for p in out["grid"])
    assert out["estimate_s"] > 0


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """One real CPU calibration of tiny-gpt (megatron-core slice; ~10-30 s)."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    d = tmp_path_factory.mktemp("cal")
    argv = ["calibrate", "--model", "tiny-gpt", "--max-tokens-per-gpu", "256", "--device", "cpu", "--dp", "2",
            "--pp", "2", "--repeats", "2", "--cpu-threads", "1", "--output", str(d / "cm.json"),
            "--records", str(d / "records.json"), "--json"]
    out = subprocess.run([sys.executable, "-m", "megatron_dynbatch.cli"] + argv, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return d, json.loads(out.stdout)


@pytest.mark.slow
def test_a_cpu_run_fits_reports_and_writes_the_file_every_reader_takes(calibrated, capsys):
    from megatron_dynbatch import plan_global_batch
    from megatron_dynbatch.core.cost_model import CostModel, load_cost_model, resolve_cost_model
    from megatron_dynbatch.core.run_config import RunConfig

    d, out = calibrated
    path = str(d / "cm.json")
    assert out["timed"] >= 6 and out["fit"]["per_group"]["1"]["n"] == out["timed"]
    assert {"old", "same_plan", "replanned", "model_change"} <= set(out["sample"])
    saved = json.loads(Path(path).read_text())
    assert "profile" in saved and "fit" in saved
    cm = load_cost_model(path)
    assert isinstance(cm, CostModel) and cm.linear_s_per_token > 0
    # plan --cost-model FILE
    lengths = d / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (40, 200, 90, 250, 17, 130, 60, 75)))
    assert main(["plan", "--lengths", str(lengths), "--model", "tiny-gpt", "--dp", "2", "--pp", "2",
                 "--max-tokens-per-gpu", "256", "--cost-model", path]) == 0
    assert "predicted step time" in capsys.readouterr().out
    # bench --cost-model FILE (applied to every workload's own model through the file's profile)
    assert main(["bench", "--workloads", "smoke", "--algorithms", "dynbatch", "--no-speed",
                 "--cost-model", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
    # RunConfig.cost_model and --dynbatch-cost-model
    rc = RunConfig.from_dict({"name": "t", "model": "tiny-gpt", "parallel": {"dp": 2, "pp": 2},
                              "max_tokens_per_gpu": 256, "cost_model": path})
    plan = plan_global_batch([40, 200, 90, 250, 17, 130, 60, 75], rc.plan_options())
    assert plan.cap_violations == 0
    args_mod = pytest.importorskip("megatron_dynbatch.megatron.args")
    ns = args_mod.add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "256", "--dynbatch-cost-model", path])
    ns.data_parallel_size, ns.num_layers, ns.hidden_size, ns.num_attention_heads = 2, 2, 64, 4
    ns.ffn_hidden_size, ns.padded_vocab_size, ns.num_query_groups, ns.swiglu = 128, 128, 2, True
    args_mod.validate_dynamic_batch_args(ns)
    opts = args_mod.plan_options_from_args(ns)
    assert opts.resolved_cost_model == resolve_cost_model(path, opts.model, opts.parallel)


@pytest.mark.slow
def test_saved_records_refit_to_the_same_model_without_timing(calibrated, capsys):
    d, out = calibrated
    assert main(["calibrate", "--model", "tiny-gpt", "--max-tokens-per-gpu", "256", "--device", "cpu", "--dp", "2",
                 "--pp", "2", "--from-records", str(d / "records.json"), "--output", str(d / "again.json")]) == 0
    text = capsys.readouterr().out
    assert "fit error per group size" in text and "re-planned with the calibrated model" in text
    assert json.loads((d / "again.json").read_text())["profile"] == json.loads((d / "cm.json").read_text())["profile"]
