"""``megatron-dynbatch`` subcommands, called in-process through ``main([...])`` (one subprocess check)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from megatron_dynbatch.cli import main
from megatron_dynbatch.core.planner import Plan
from megatron_dynbatch.core.planner.options import PlanOptions

LENGTHS = [300, 1200, 40, 800, 2000, 75, 640, 900, 1500, 60, 333, 1024]


@pytest.fixture()
def lengths_txt(tmp_path):
    p = tmp_path / "lengths.txt"
    p.write_text("# tokens per sample\n" + "\n".join(map(str, LENGTHS)) + "\n\n")
    return str(p)


def test_flops_table(capsys):
    assert main(["flops", "--model", "tiny-gpt", "--seqlen", "128", "4096", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "linear" in out and "quadratic" in out and "1/2" in out
    assert "4096" in out and "attention %" in out


def test_flops_json(capsys):
    assert main(["flops", "--model", "qwen3-30b-a3b", "--ep", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["linear"] > 0 and data["quadratic"] > 0 and data["rows"][0]["seqlen"] == 4096
    assert data["breakdown"]["routed_experts_per_token"] > 0


def test_plan_summary_and_rank_table(lengths_txt, capsys):
    rc = main(["plan", "--lengths", lengths_txt, "--model", "tiny-gpt", "--dp", "2", "--max-tokens-per-gpu", "2500",
               "--compare"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "micro-batches per rank" in out and "predicted step time" in out and "over budget: 0" in out
    assert "rank" in out and "verl" in out and "nemo_rl" in out


@pytest.mark.parametrize("fmt", ["json", "npy"])
def test_plan_json_output_and_file_formats(tmp_path, capsys, fmt):
    path = tmp_path / f"lengths.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(LENGTHS))
    else:
        np.save(path, np.array(LENGTHS))
    groups = tmp_path / "groups.txt"
    groups.write_text("\n".join(str(i // 3) for i in range(len(LENGTHS))))
    rc = main(["plan", "--lengths", str(path), "--dp", "2", "--max-tokens-per-gpu", "2500", "--balance-by", "tokens",
               "--group-ids", str(groups), "--json"])
    assert rc == 0
    plan = Plan.from_dict(json.loads(capsys.readouterr().out))
    plan.validate(len(LENGTHS))
    for g in range(4):  # every group of 3 stays on one rank
        ranks = {r for r in range(plan.dp) for i in plan.rank_samples(r) if i // 3 == g}
        assert len(ranks) == 1


def test_bench_small_workload(capsys):
    assert main(["bench", "--workloads", "smoke", "--no-speed", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "dynbatch" in out and "nemo_rl" in out and "planner cap violations: 0" in out


def test_bench_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    rc = main(["bench", "--workloads", "smoke", "--no-speed", "--json", "--plot", str(png),
               "--algorithms", "dynbatch,verl,fixed_padded"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["algorithm"] for r in data["rows"]} == {"dynbatch", "verl", "fixed_padded"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "grpo-longcot-8b" in out and "slime" in out


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--lengths", "x.txt", "--dp", "0", "--max-tokens-per-gpu", "10"], "--dp"),
    (["plan", "--lengths", "/nonexistent/l.txt", "--max-tokens-per-gpu", "10"], "file not found"),
    (["bench", "--workloads", "nope"], "unknown workload"),
    (["flops", "--model", "qwen3-8b", "--tp", "3"], "parallel.tp=3"),
    (["flops", "--model", "no-such-model"], "unknown model preset"),
])
def test_errors_exit_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_oversize_sample_error_message(lengths_txt, capsys):
    assert main(["plan", "--lengths", lengths_txt, "--max-tokens-per-gpu", "1000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-dynbatch: error: --max-tokens-per-gpu=1000") and "Fix:" in err
    assert len(err.splitlines()) == 1


def test_bad_lengths_value(tmp_path, capsys):
    p = tmp_path / "l.txt"
    p.write_text("12\nabc\n")
    assert main(["plan", "--lengths", str(p), "--max-tokens-per-gpu", "100"]) == 2
    assert "--lengths[1]='abc'" in capsys.readouterr().err


def test_demo_missing_is_a_clear_message(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "megatron_dynbatch.demo", None)  # import now fails as if absent
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert "demo" in err and "Traceback" not in err


def test_console_entry_point_exit_code():
    proc = subprocess.run([sys.executable, "-m", "megatron_dynbatch.cli", "flops", "--model", "tiny-gpt",
                           "--seqlen", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--seqlen" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_accepts_a_run_preset_and_flags_that_agree_with_it(tmp_path, capsys):
    from megatron_dynbatch.cli import main

    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(50 + 7 * i % 100) for i in range(32)))
    assert main(["plan", "--lengths", str(lengths), "--run", "tiny-cpu-demo", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["parallel"]["dp"] == 2 and plan["cap"] == 160
    same = ["--dp", "2", "--tp", "1", "--max-tokens-per-gpu", "160", "--model", "tiny-gpt", "--balance-by", "time",
            "--oversize", "error", "--samples-per-step", "16", "--microbatch-group-size-per-vp-stage", "1"]
    assert main(["plan", "--lengths", str(lengths), "--run", "tiny-cpu-demo", *same, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["micro_batches"] == plan["micro_batches"] and again["parallel"] == plan["parallel"]


def test_override_run_plans_the_preset_with_the_flags_values(tmp_path, capsys):
    from megatron_dynbatch.cli import main

    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(50 + 7 * i % 100) for i in range(32)))
    assert main(["plan", "--lengths", str(lengths), "--run", "tiny-cpu-demo", "--dp", "4", "--max-tokens-per-gpu",
                 "320", "--samples-per-step", "32", "--override-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["parallel"]["dp"] == 4 and plan["cap"] == 320
    # the preset with the flags' values is checked as a preset file is: dp=3 does not divide samples_per_step=16
    assert main(["plan", "--lengths", str(lengths), "--run", "tiny-cpu-demo", "--dp", "3", "--override-run"]) == 2
    err = capsys.readouterr().err
    assert "samples_per_step=16" in err and "dp=3" in err and "--override-run" in err and "--samples-per-step" in err
    assert main(["plan", "--lengths", str(lengths), "--max-tokens-per-gpu", "320", "--override-run"]) == 2
    assert "--override-run=True: only means something with --run PRESET" in capsys.readouterr().err


def test_compare_scores_the_baselines_with_the_run_presets_cost_model(tmp_path, capsys):
    """``plan --run PRESET --compare``: a preset's ``cost_model`` scores the baselines as it scores the plan, the
    same table as that cost model given by flag (found in review: the baselines kept the default model)."""
    import yaml

    from megatron_dynbatch.core.presets import resolve_run_preset

    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(50 + 7 * i % 100) for i in range(32)))
    preset = yaml.safe_load(resolve_run_preset("tiny-cpu-demo").read_text())
    preset["cost_model"] = "analytic"
    path = tmp_path / "analytic.yaml"
    path.write_text(yaml.safe_dump(preset))
    assert main(["plan", "--lengths", str(lengths), "--run", str(path), "--compare"]) == 0
    from_preset = capsys.readouterr().out
    assert main(["plan", "--lengths", str(lengths), "--run", "tiny-cpu-demo", "--cost-model", "analytic",
                 "--override-run", "--compare"]) == 0
    from_flag = capsys.readouterr().out
    table = lambda out: out[out.index("algorithm"):]  # noqa: E731 (the header names the preset differently)
    assert table(from_preset) == table(from_flag)


# tiny-cpu-demo: tiny-gpt, world_size 2 (dp 2), 160 tokens, time, error, samples_per_step 16, groups of 4
CONTRADICTIONS = [
    (["--model", "qwen3-0.6b"], "--model", "model 'tiny-gpt'"),
    (["--max-tokens-per-gpu", "320"], "--max-tokens-per-gpu", "max_tokens_per_gpu=160"),
    (["--dp", "3"], "--dp", "dp=2 (world size 2"),
    (["--tp", "2"], "--tp", "tp=1"),
    (["--pp", "2"], "--pp", "pp=1"),
    (["--cp", "2"], "--cp", "cp=1"),
    (["--ep", "2"], "--ep", "ep=1"),
    (["--vpp", "2"], "--vpp", "vpp=1"),
    (["--microbatch-group-size-per-vp-stage", "2"], "--microbatch-group-size-per-vp-stage",
     "microbatch_group_size_per_vp_stage=1"),
    (["--sequence-parallel"], "--sequence-parallel", "sequence_parallel=false"),
    (["--balance-by", "tokens"], "--balance-by", "balance_by='time'"),
    (["--balance-by", "flops"], "--balance-by", "balance_by='time'"),
    (["--oversize", "alone"], "--oversize", "oversize='error'"),
    (["--fp8", "fp8"], "--fp8", "fp8_alignment=None"),
    (["--samples-per-step", "32"], "--samples-per-step", "samples_per_step=16"),
    (["--cost-model", "analytic"], "--cost-model", "cost_model=None"),
    (["--decision-margin", "0.1"], "--decision-margin", "decision_margin=None"),
    (["--min-cp-size", "2"], "--min-cp-size", "min_cp_size=None"),
    (["--gpu-memory-gb", "80"], "--gpu-memory-gb", "gpu_memory_gb=None"),  # before: ignored under --run
    (["--group-ids", "GROUPS"], "--group-ids", "group_size=4"),
]


def test_every_preset_option_flag_is_checked_against_the_preset():
    """The flags checked against a --run preset come from the PlanOptions field metadata (_cli_run.py): every
    option with a plan flag and a preset key, so a new one joins with no list to edit -- and has a row above."""
    from megatron_dynbatch._cli_run import preset_option_flags
    from megatron_dynbatch.core.run_config import OPTION_KEYS

    checked = {f.field for f in preset_option_flags()}
    assert checked == (set(PlanOptions.spellings("cli")) & set(OPTION_KEYS)) - {"dynamic_cp"}
    assert {f.flag for f in preset_option_flags()} <= {c[1] for c in CONTRADICTIONS}


@pytest.mark.parametrize("flags,flag,preset", CONTRADICTIONS, ids=[c[1] for c in CONTRADICTIONS])
def test_a_flag_that_contradicts_the_run_preset_is_an_error_naming_both(flags, flag, preset, tmp_path, capsys):
    """One meaning per flag: with --run, a flag either agrees with the preset or is refused, naming the flag, the
    preset's value and both fixes (drop it, or --override-run)."""
    from megatron_dynbatch.cli import main

    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(50 + 7 * i % 100) for i in range(32)))
    groups = tmp_path / "g.txt"
    groups.write_text("\n".join(str(i % 8) for i in range(32)))  # 8 groups of 4, but not 4 consecutive samples
    flags = [str(groups) if f == "GROUPS" else f for f in flags]
    assert main(["plan", "--lengths", str(lengths), "--run", "tiny-cpu-demo", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-dynbatch: error: {flag}=") and ("contradicts" in err or "differently" in err), err
    assert preset in err and f"drop {flag}" in err and "--override-run" in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def test_group_ids_that_agree_with_the_preset_or_override_it_plan(tmp_path, capsys):
    from megatron_dynbatch.cli import main

    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(50 + 7 * i % 100) for i in range(32)))
    same, other = tmp_path / "same.txt", tmp_path / "other.txt"
    same.write_text("\n".join(f"prompt-{i // 4}" for i in range(32)))  # the preset's grouping, other labels
    other.write_text("\n".join(str(i // 8) for i in range(32)))  # groups of 8 instead of 4
    base = ["plan", "--lengths", str(lengths), "--run", "tiny-cpu-demo", "--json", "--group-ids"]
    assert main(base + [str(same)]) == 0
    assert main(base + [str(other), "--override-run"]) == 0


def test_plan_without_budget_or_preset_is_a_clear_error(tmp_path, capsys):
    from megatron_dynbatch.cli import main

    lengths = tmp_path / "l.txt"
    lengths.write_text("10\n20\n")
    assert main(["plan", "--lengths", str(lengths)]) == 2
    assert "--max-tokens-per-gpu" in capsys.readouterr().err


# ------------------------------------------------------------- every term of plan's output is said where it appears
def test_plan_says_what_its_bounds_bound_and_why_it_needs_more(tmp_path, capsys):
    """pp=4 vpp=2: more micro-batches than the budget needs, and the line says why; the step time says what its
    bound is; a grouped plan says its groups were kept whole; the rank table has a legend."""
    from megatron_dynbatch.bench.workloads import WORKLOADS
    from megatron_dynbatch.cli import main

    lengths = tmp_path / "vpp.txt"
    lengths.write_text("\n".join(map(str, WORKLOADS["pp4-vpp2-qwen3-32b"].generate(0).lengths)))
    assert main(["plan", "--lengths", str(lengths), "--model", "qwen3-32b", "--dp", "8", "--tp", "4", "--pp", "4",
                 "--vpp", "2", "--max-tokens-per-gpu", "16384"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("micro-batches per rank:"))
    assert "the budget allows as few as" in line and "pp=4 pipeline bubble" in line and "vpp=2" in line, line
    assert "lower bound" in out and "that no plan of this batch beats" in out and "(modelled)" in out
    assert "(mbs: micro-batches of the rank" in out
    assert main(["plan", "--lengths", "examples/grpo_lengths.txt", "--run", "qwen3-8b-grpo",
                 "--override-run", "--max-tokens-per-gpu", "16384"]) == 0
    out = capsys.readouterr().out
    assert "groups: 32 (the run preset's group_size=8), each kept whole on one DP rank" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("micro-batches per rank:"))
    assert "13 (the budget allows as few as 12; more here: groups stay whole on their rank)" in line, line


def test_plan_dynamic_cp_explains_the_winning_candidate(capsys):
    from megatron_dynbatch._cli_dyncp import describe_candidates
    from megatron_dynbatch.cli import main

    assert main(["plan", "--lengths", "examples/longdoc_lengths.txt", "--model", "llama-3.1-8b", "--dp", "8",
                 "--tp", "2", "--max-tokens-per-gpu", "32768", "--dynamic-cp"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("winning candidate:"))
    # one document dominates this batch: a tree candidate widens its group (the fitted model's choice)
    assert "tree-1 -- each sample on a CP group widened while it alone takes over 1x the mean GPU load" in line
    assert "docs/dynamic_cp.md" in line
    assert "every micro-batch runs on the whole pool of 8 GPUs" in describe_candidates("all-root", 8, 2)
    assert "slots per GPU: 2 (a slot: one micro-batch" in out and "(dp.cp: the GPU's DP and CP rank" in out
    for name in ("fixed-cp", "tree-mem", "tree-0.5", "cp2-tree-0.25", "all-root"):  # every family member in words
        text = describe_candidates(name, 8, 2)
        assert not text.startswith(name) and "(the candidates scored" in text, text
    assert "at least cp=2 GPUs" in describe_candidates("cp2-tree-1", 8, 2)
    assert describe_candidates("tree-1,all-root,tree-1", 8, 1).count("each sample on") == 1  # once per winner


def test_bench_times_planning_speed_with_the_default_workloads_only():
    """A run filtered with --workloads is after those rows: the planning-speed cases (most of such a run's time)
    run only in the default run, with --adversarial, or when asked for with --speed."""
    from megatron_dynbatch.cli import _bench_speed, build_parser

    def speed(*argv):
        return _bench_speed(build_parser().parse_args(["bench", *argv]))

    assert speed() is True
    assert speed("--workloads", "smoke") is False
    assert speed("--workloads", "smoke", "--speed") is True
    assert speed("--no-speed") is False
    assert speed("--workloads", "smoke", "--adversarial") is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--speed", "--no-speed"])
