"""``megatron-dynbatch calibrate`` (issue 18 item 4): every bad flag is a ``DynBatchConfigError`` naming the flag, the
value and the fix; ``--dry-run`` times nothing (and imports no torch); a real CPU run writes the cost-model file that
``plan --cost-model``, ``bench --cost-model``, ``RunConfig.options`` and ``--dynbatch-cost-model`` read; saved
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


#: the CPU calibration demo's model (configs/models/cpu-demo-gpt.yaml): its per-token cost separates from the fixed
#: cost in CPU timings even on a busy machine; tiny-gpt's does not (issue 28 item 18)
CPU_MODEL = "cpu-demo-gpt"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """One real CPU calibration of the CPU demo's model (megatron-core slice; ~10-30 s)."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    d = tmp_path_factory.mktemp("cal")
    argv = ["calibrate", "--model", CPU_MODEL, "--max-tokens-per-gpu", "512", "--device", "cpu", "--dp", "2",
            "--pp", "2", "--repeats", "2", "--cpu-threads", "1", "--output", str(d / "cm.json"),
            "--records", str(d / "records.json"), "--json"]
    out = subprocess.run([sys.executable, "-m", "megatron_dynbatch.cli"] + argv, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return d, json.loads(out.stdout)


@pytest.mark.slow
def test_a_cpu_run_fits_reports_and_writes_the_file_every_reader_takes(calibrated, capsys):
    from megatron_dynbatch import plan_global_batch
    from megatron_dynbatch.core.cost_model import CostModel
    from megatron_dynbatch.core.cost_files import load_cost_model, resolve_cost_model
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
    assert main(["plan", "--lengths", str(lengths), "--model", CPU_MODEL, "--dp", "2", "--pp", "2",
                 "--max-tokens-per-gpu", "512", "--cost-model", path]) == 0
    cap = capsys.readouterr()
    assert "predicted step time" in cap.out and "warning" not in cap.err  # the model it was fitted for
    # bench --cost-model FILE (applied to every workload's own model through the file's profile)
    assert main(["bench", "--workloads", "smoke", "--algorithms", "dynbatch", "--no-speed",
                 "--cost-model", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
    # RunConfig.options.cost_model and --dynbatch-cost-model
    rc = RunConfig.from_dict({"name": "t", "model": CPU_MODEL, "parallel": {"dp": 2, "pp": 2},
                              "max_tokens_per_gpu": 512, "cost_model": path})
    plan = plan_global_batch([40, 200, 90, 250, 17, 130, 60, 75], rc.plan_options())
    assert plan.cap_violations == 0
    args_mod = pytest.importorskip("megatron_dynbatch.megatron.args")
    ns = args_mod.add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "512", "--dynbatch-cost-model", path])
    ns.data_parallel_size, ns.num_layers, ns.hidden_size, ns.num_attention_heads = 2, 2, 256, 4  # cpu-demo-gpt
    ns.ffn_hidden_size, ns.padded_vocab_size, ns.num_query_groups, ns.swiglu = 1024, 128, 2, True
    args_mod.validate_dynamic_batch_args(ns)
    opts = args_mod.plan_options_from_args(ns)
    resolved = opts.resolve()
    assert resolved.cost_model == resolve_cost_model(path, resolved.model, opts.parallel)


@pytest.mark.slow
def test_saved_records_refit_to_the_same_model_without_timing(calibrated, capsys):
    d, out = calibrated
    assert main(["calibrate", "--model", CPU_MODEL, "--max-tokens-per-gpu", "512", "--device", "cpu", "--dp", "2",
                 "--pp", "2", "--from-records", str(d / "records.json"), "--output", str(d / "again.json")]) == 0
    text = capsys.readouterr().out
    assert "fit error per group size" in text and "re-planned with the calibrated model" in text
    assert json.loads((d / "again.json").read_text())["profile"] == json.loads((d / "cm.json").read_text())["profile"]


# ------------------------------------------------------------------------------------ what a user sees (issue 28)
def _no_cuda_env() -> dict:
    import os

    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def test_dry_run_says_when_no_cuda_device_is_visible(tmp_path):
    """``--device cuda`` (the default) on a machine without one: the GPU grid is printed with a note saying so,
    still without importing torch; ``--device cpu`` has no note."""
    code = ("import sys; from megatron_dynbatch.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'dry run imported torch'; sys.exit(rc)")
    base = [sys.executable, "-c", code, "calibrate", "--run", "tiny-cpu-demo", "--dry-run"]
    out = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=120, env=_no_cuda_env())
    assert out.returncode == 0, out.stderr
    assert "note: no CUDA device is visible on this machine" in out.stdout and "--device cpu" in out.stdout
    out = subprocess.run(base + ["--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=_no_cuda_env())
    assert out.returncode == 0 and "no CUDA device" not in out.stdout, out.stderr


def test_timing_on_cuda_without_a_device_is_refused_naming_the_flag():
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    out = subprocess.run([sys.executable, "-m", "megatron_dynbatch.cli", "calibrate", "--run", "tiny-cpu-demo",
                          "--output", "never-written.json"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=_no_cuda_env())
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-dynbatch: error: --device='cuda': no CUDA device") and "--device cpu" in last
    assert "UserWarning" not in out.stderr and not (ROOT / "never-written.json").exists()


def test_progress_is_a_rewritten_line_on_a_terminal_and_a_line_every_few_seconds_in_a_log():
    import io

    from megatron_dynbatch._cli_calibrate import PROGRESS_EVERY_S, ProgressPrinter

    log = io.StringIO()
    p = ProgressPrinter(log, 30.0)
    for i, t in enumerate([0.0, 3.0, 9.0, PROGRESS_EVERY_S + 0.5, 12.0, 2 * PROGRESS_EVERY_S + 1]):
        p(i, 6, t)
    p.close()
    lines = log.getvalue().splitlines()
    assert [ln.split("/")[0][-1] for ln in lines] == ["1", "4", "6"], lines
    assert lines[0] == "  timing micro-batch share 1/6 (0 s elapsed, ~30 s in all)"

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    p = ProgressPrinter(tty, 30.0)
    for i in range(3):
        p(i, 3, float(i))
    p.close()
    assert tty.getvalue().count("\r") == 3 and tty.getvalue().endswith("\n")


def test_the_progress_line_follows_the_measured_speed():
    """The estimate updates as the run goes: the projected length is the points left at the speed measured so
    far (a device twice as slow as estimated doubles what is left), the dry run's estimate before any point."""
    import io

    from megatron_dynbatch._cli_calibrate import ProgressPrinter
    from megatron_dynbatch.core.calibration.timebox import projected_total

    assert projected_total(0.0, 0.0, 0.0, 30.0) == 30.0
    assert projected_total(10.0, 5.0, 10.0, 25.0) == 60.0   # 5 s estimated took 10 s: the 25 s left take 50 s
    assert projected_total(4.0, 8.0, 4.0, 12.0) == 10.0    # twice as fast
    log = io.StringIO()
    p = ProgressPrinter(log, 30.0, every_s=0.0)
    p(0, 3, 0.0, 30.0)
    p(1, 3, 10.0, projected_total(10.0, 5.0, 10.0, 25.0))
    assert log.getvalue().splitlines()[-1] == "  timing micro-batch share 2/3 (10 s elapsed, ~60 s in all)"


def test_megatron_core_notices_become_one_note_and_other_warnings_still_show(capsys):
    import warnings

    from megatron_dynbatch._cli_calibrate import _megatron_notices

    mc = "/venv/lib/python3.11/site-packages/megatron/core/optimizer/__init__.py"
    caught = [warnings.WarningMessage(UserWarning("Transformer Engine and Apex are not installed. Falling back to "
                                                 "Torch optimizers."), UserWarning, mc, 24),
              warnings.WarningMessage(UserWarning("Apex is not installed. Falling back to Torch Norm"), UserWarning,
                                      mc, 21),
              warnings.WarningMessage(UserWarning("something new and important"), UserWarning, mc, 30),
              warnings.WarningMessage(RuntimeWarning("overflow"), RuntimeWarning, "/elsewhere/x.py", 3)]
    with warnings.catch_warnings(record=True) as shown:
        _megatron_notices(caught, sys.stderr, quiet=False)
    assert "note: 2 notice(s) of megatron-core hidden" in capsys.readouterr().err
    assert [str(w.message) for w in shown] == ["something new and important", "overflow"]


# ------------------------------------------------------------------------------------ the CPU demo (issue 28 item 18)
def _fits_under_load(model, budget, seeds):
    """How many of ``seeds`` simulated busy-machine calibrations of ``model`` fail to fit: the default CPU grid,
    each timing the rough CPU profile's prediction slowed by a random 1-3x (another process had the core) plus
    0-20 ms (a time slice lost)."""
    import numpy as np

    from megatron_dynbatch.core.calibration.timebox import CPU_ESTIMATE
    from megatron_dynbatch.core.calibration.setup import plan_calibration
    from megatron_dynbatch.core.cost_fit import fit_records, predict_records
    from megatron_dynbatch.core.errors import DynBatchConfigError

    setup = plan_calibration(model, parallel={"dp": 2}, max_tokens_per_gpu=budget, device="cpu")
    items = [[p.group_size, list(p.lengths), 1.0] for p in setup.points]
    ideal = predict_records(CPU_ESTIMATE, items, setup.model, measured_layers=setup.layers)
    failed = 0
    for seed in seeds:
        rng = np.random.default_rng(seed)
        seconds = ideal * rng.uniform(1.0, 3.0, ideal.size) + rng.uniform(0.0, 0.02, ideal.size)
        try:
            fit_records([[g, lens, float(t)] for (g, lens, _), t in zip(items, seconds)], setup.model,
                        measured_layers=setup.layers)
        except DynBatchConfigError:
            failed += 1
    return failed


def test_the_cpu_demo_model_separates_its_costs_on_a_busy_machine():
    """The documented ``calibrate --run tiny-cpu-demo --device cpu`` failed under load: tiny-gpt's per-token cost
    (microseconds) drowns in its fixed cost (milliseconds). The CPU demo's model fits on every simulated busy
    run; tiny-gpt at its demo budget fails on a good share of them."""
    from megatron_dynbatch.core.run_config import RunConfig

    demo = RunConfig.from_yaml("cpu-calibrate-demo")
    assert demo.model == CPU_MODEL and demo.budget() == 1024
    assert _fits_under_load(CPU_MODEL, demo.budget(), range(16)) == 0
    assert _fits_under_load(CPU_MODEL, 512, range(16)) == 0  # the fixture's budget too
    tiny = RunConfig.from_yaml("tiny-cpu-demo")
    assert _fits_under_load(tiny.model, tiny.budget(), range(16)) >= 3


def test_quickstart_runs_the_cpu_demo_calibration():
    doc = (ROOT / "docs" / "quickstart.md").read_text()
    assert "megatron-dynbatch calibrate --run cpu-calibrate-demo --device cpu --output" in doc
    assert "calibrate --run tiny-cpu-demo" not in doc


@pytest.mark.slow
def test_the_documented_cpu_calibration_runs_quietly_with_progress(tmp_path):
    """``calibrate --run cpu-calibrate-demo --device cpu`` for real, as the quickstart has it: it fits (on a busy
    2-core machine too), megatron-core's notices are one note (issue 28 item 15: 14 lines of UserWarnings), a
    progress line shows while it times, and the file records what it was fitted for."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    out = tmp_path / "cpu_demo_cost_model.json"
    res = subprocess.run([sys.executable, "-m", "megatron_dynbatch.cli", "calibrate", "--run", "cpu-calibrate-demo",
                          "--device", "cpu", "--output", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Warning" not in res.stderr and "warnings.warn" not in res.stderr, res.stderr
    assert "note: " in res.stderr and "notice(s) of megatron-core hidden" in res.stderr
    assert "  timing micro-batch share 1/" in res.stderr
    assert "fit error per group size" in res.stdout and f"wrote {out}" in res.stdout
    record = json.loads(out.read_text())["fit"]["fitted_for"]
    assert record["model"] == CPU_MODEL and record["device_type"] == "cpu"
