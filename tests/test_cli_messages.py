"""What a new user sees when something is off: misspelled flags and subcommands, warnings, missing or broken
optional dependencies, demo settings the planner refuses, ``--plot`` without matplotlib, run preset listing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_dynbatch._argparse import suggestions
from megatron_dynbatch.cli import build_parser, main
from megatron_dynbatch.requirements import SETUP_FIX, import_problem

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "grpo_lengths.txt")


def _cli(*argv: str, env: dict = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_dynbatch.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


# ------------------------------------------------------------------------------------ did you mean
@pytest.mark.parametrize("argv, hint", [
    (["plan", "--lengths", "x.txt", "--max-token-per-gpu", "10"], "did you mean --max-tokens-per-gpu?"),
    (["plan", "--lenghts", "x.txt", "--max-tokens-per-gpu", "10"], "did you mean --lengths?"),
    (["bench", "--seedz", "2"], "did you mean --seeds?"),
    (["benc"], "did you mean 'bench'?"),
    (["runs", "lst"], "did you mean 'list'?"),
    (["flops", "--model", "tiny-gpt", "--seqlens", "5"], "did you mean --seqlen?"),
])
def test_misspelled_flags_and_subcommands_get_a_suggestion(argv, hint, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert hint in err and "--help lists" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, first", [
    (["plan", "--lengths", "x.txt", "--max-tokens-per-gpu", "-5"],
     "megatron-dynbatch plan: error: argument --max-tokens-per-gpu: must be a whole number >= 1, got '-5'"),
    (["plan", "--lengths", "x.txt", "--max-tokens-per-gpu", "64", "--dp", "0"],
     "megatron-dynbatch plan: error: argument --dp: must be a whole number >= 1, got '0'"),
    (["calibrate", "--model", "tiny-gpt", "--tp", "0"], "megatron-dynbatch calibrate: error: argument --tp:"),
    (["demo", "--dp", "x"], "megatron-dynbatch demo: error: argument --dp:"),
    (["plan", "--max-tokens-per-gpu", "64"], "megatron-dynbatch plan: error: the following arguments are required"),
])
def test_a_usage_error_is_its_one_line_and_where_the_flags_are_not_a_usage_dump(argv, first, capsys):
    """Issue 28 item 17: ``--max-tokens-per-gpu -5`` / ``--dp 0`` printed 17 lines of usage before the line that
    matters."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith(first) and "usage:" not in "\n".join(lines)
    assert lines[1:] == [f"({' '.join(first.split(':')[0].split())} --help lists its flags)"]
    assert main(["benc"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "(megatron-dynbatch --help lists the commands)"


def test_suggestions_ignore_known_flags_abbreviations_and_far_misses():
    parser = build_parser()
    assert suggestions(parser, ["bench", "--seed", "2", "--xyzzy"], "unrecognized arguments: --xyzzy") == []
    assert suggestions(parser, ["plan", "--max-tokens-per-gpu=5", "--dpp", "2"], "") in (
        ["--pp for --dpp"], ["--dp for --dpp"])
    # choice lists with or without quotes (the format changed between Python versions)
    assert suggestions(parser, [], "invalid choice: 'flop' (choose from bench, plan, flops)") == ["'flops'"]


def test_demo_flags_get_suggestions_too(capsys):
    assert main(["demo", "--max-token-per-gpu", "10"]) == 2
    assert "did you mean --max-tokens-per-gpu?" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ demo messages
def test_demo_setting_the_planner_refuses_is_one_line_before_any_rank_starts(capsys):
    """No torch needed: the batches are planned in the parent first (the ranks would all raise the same)."""
    assert main(["demo", "--max-tokens-per-gpu", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("megatron-dynbatch demo: error: --max-tokens-per-gpu=10") and "at least 96" in err
    assert main(["demo", "--samples", "3"]) == 2  # 3 samples in groups of 4: one group for 2 ranks
    err = capsys.readouterr().err
    assert "demo step 0 has fewer groups than dp=2" in err and "--group-size 4 make 1 per step" in err


def test_import_problem_tells_missing_from_broken(tmp_path):
    assert import_problem("json") is None
    missing = import_problem("json", "no_such_module_for_dynbatch")
    assert "not installed" in missing and SETUP_FIX in missing and "[megatron]" not in missing
    fake = tmp_path / "fakepkg_dynbatch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('cudnn shared object not found')  # transformer_engine\n")
    sys.path.insert(0, str(tmp_path))
    try:
        broken = import_problem("fakepkg_dynbatch")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("fakepkg_dynbatch", None)
    assert "installed (" in broken and "fails to import: RuntimeError: cudnn shared object not found" in broken
    assert "Transformer Engine" in broken and "import fakepkg_dynbatch" in broken


def test_demo_with_a_broken_megatron_core_quotes_the_real_error(tmp_path):
    """megatron-core present but crashing at import (as with a half-installed Transformer Engine): the message
    says so and quotes the error, instead of asking to install megatron-core."""
    pkg = tmp_path / "megatron" / "core"
    pkg.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("raise RuntimeError('cudnn shared object not found')\n")
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    res = _cli("demo", "--steps", "1", env={"PYTHONPATH": path})
    if "needs torch" in res.stderr:
        pytest.skip("torch is not installed here")
    assert res.returncode == 2, res.stderr
    assert "megatron-core, which is installed" in res.stderr and "RuntimeError: cudnn shared object" in res.stderr
    assert "pip install 'megatron-dynbatch[megatron]'" not in res.stderr and "Traceback" not in res.stderr


# ------------------------------------------------------------------------------------ warnings, runs, plots
def test_package_warnings_print_as_one_cli_line(tmp_path):
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n200\n5000\n300\n")
    res = _cli("plan", "--lengths", str(lengths), "--max-tokens-per-gpu", "1000", "--oversize", "alone", "--dp", "2")
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]  # one line, no source line
    assert res.stderr.startswith("megatron-dynbatch: warning: oversize='alone': sample 2 has 5000 tokens")
    assert "OversizeSampleWarning" not in res.stderr and ".py:" not in res.stderr


def test_runs_list_shows_descriptions(capsys):
    assert main(["runs", "list"]) == 0
    out = capsys.readouterr().out
    from megatron_dynbatch.core.run_config import RunConfig

    line = next(ln for ln in out.splitlines() if ln.startswith("qwen3-8b-grpo "))
    assert RunConfig.from_yaml("qwen3-8b-grpo").description in line
    assert "runs args NAME" in out


def test_help_texts_have_no_rst_markup(capsys):
    for argv in (["--help"], ["runs", "--help"], ["plan", "--help"], ["bench", "--help"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "``" not in out and ":func:" not in out, argv
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "train a tiny GPT" in out and "``" not in out and "PASS" in out


def test_plot_without_matplotlib_fails_before_any_work(monkeypatch, capsys, tmp_path):
    import importlib.util

    import megatron_dynbatch.bench.runner as runner

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("the benchmark ran before the check"))
    assert main(["bench", "--plot", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot=" in err and "needs matplotlib" in err and "pip install matplotlib" in err
    assert main(["plan", "--lengths", EXAMPLE, "--max-tokens-per-gpu", "16384", "--plot", "p.png"]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_plan_plot_draws_the_plan_and_the_baselines(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert main(["plan", "--lengths", EXAMPLE, "--model", "qwen3-8b", "--dp", "8", "--max-tokens-per-gpu", "16384",
                 "--compare", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    cap = capsys.readouterr()
    assert f"wrote {png}" in cap.err and "over budget" in cap.out


def test_timeline_legend_names_every_colour_in_use(monkeypatch, tmp_path):
    """The legend lists the over-budget colour and the hatched wait only when the picture has them."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from megatron_dynbatch import plan_global_batch
    from megatron_dynbatch.bench.baselines import BaselineContext, run_baseline
    from megatron_dynbatch.bench.plot import plot_timelines

    labels = []
    real = matplotlib.figure.Figure.legend

    def spy(self, *a, **k):
        labels.append([h.get_label() for h in k["handles"]])
        return real(self, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "legend", spy)
    lengths = [int(x) for x in Path(EXAMPLE).read_text().split() if x.isdigit()]
    plan = plan_global_batch(lengths, model="qwen3-8b", parallel={"dp": 8}, max_tokens_per_gpu=16384)
    verl = run_baseline("verl", lengths, BaselineContext.build({"dp": 8}, 16384, "qwen3-8b")).plan
    plot_timelines({"dynbatch": plan}, str(tmp_path / "a.png"))
    plot_timelines({"dynbatch": plan, "verl": verl}, str(tmp_path / "b.png"))
    assert verl.cap_violations > 0
    assert not any("over the token budget" in x for x in labels[0]) and "step time (slowest rank)" in labels[0]
    assert any("over the token budget" in x for x in labels[1])
    assert not any("bubble" in x for x in labels[0] + labels[1])  # pp=1, no EP: nothing hatched


def test_bench_report_survives_a_closed_pipe():
    script = textwrap.dedent("""
        import subprocess, sys
        p = subprocess.Popen([sys.executable, "-m", "megatron_dynbatch.cli", "bench", "--workloads", "smoke",
                              "--no-speed"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.readline(); p.stdout.close()
        err = p.stderr.read().decode(); p.wait()
        print(p.returncode, "Traceback" in err)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.stdout.split() in (["141", "False"], ["0", "False"]), res.stdout + res.stderr


def test_demo_check_verdict_names_the_threshold(capsys):
    from megatron_dynbatch.demo import _rank_failure_line, _report

    assert _report([{"steps": [], "max_grad_diff": 3e-3}], check=True) == 1
    assert "check: FAIL (max_grad_diff 3.0e-03 > 1e-05)" in capsys.readouterr().out
    assert _report([{"steps": [], "max_grad_diff": 2e-9}], check=True) == 0
    assert "check: PASS (max_grad_diff 2.0e-09 <= 1e-05)" in capsys.readouterr().out
    # every rank failing with the same configuration error: that one line is the whole story
    text = ("2 of 2 ranks failed in _demo_worker:\n----- rank 0 -----\nTraceback ...\n"
            "megatron_dynbatch.core.errors.DynBatchConfigError: x=1: bad. Fix: y\n----- rank 1 -----\nTraceback ...\n"
            "megatron_dynbatch.core.errors.DynBatchConfigError: x=1: bad. Fix: y\n")
    assert _rank_failure_line(text) == "x=1: bad. Fix: y"
    assert _rank_failure_line(text.replace("DynBatchConfigError: x=1: bad. Fix: y\n----- rank 1",
                                           "RuntimeError: boom\n----- rank 1")) is None
