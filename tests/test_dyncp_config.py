"""Where users turn dynamic CP on besides the Python API and the Megatron flag: ``RunConfig.dynamic_cp`` (run
presets, ``runs args``) and ``megatron-dynbatch plan --dynamic-cp`` (the pool summary next to the fixed-CP plan,
``--compare``, ``--plot``, ``--json``). Hostile values are fuzzed in ``tests/test_fuzz.py``."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from megatron_dynbatch import DynamicCPPlan, DynBatchConfigError, RunConfig, plan_global_batch
from megatron_dynbatch.cli import main
from megatron_dynbatch.core.planner import Plan
from megatron_dynbatch.core.run_config import dynamic_cp_problem
from megatron_dynbatch.core.parallel import ParallelConfig

#: one document as long as the rest together: the case dynamic CP exists for (docs/dynamic_cp.md)
DOMINATED = [30000] + [1500] * 20


def _run(**overrides):
    d = {"name": "dyn", "model": "llama-3.1-8b", "parallel": {"world_size": 8, "tp": 2, "cp": 2},
         "max_tokens_per_gpu": 16384, "dynamic_cp": True}
    d.update(overrides)
    return d


# ---------------------------------------------------------------------------------------------- RunConfig
def test_run_config_dynamic_cp_reaches_the_planner_and_megatron():
    rc = RunConfig.from_dict(_run(samples_per_step=8))
    assert rc.options.dynamic_cp is True
    assert rc.plan_options().dynamic_cp is True
    assert rc.plan_options(forward_only=True).dynamic_cp is True  # as the Megatron flag: log-probs too
    args = rc.to_megatron_args()
    assert args.count("--dynbatch-dynamic-cp") == 1
    lengths = np.random.default_rng(0).integers(500, 20000, 16)
    plan = plan_global_batch(lengths, rc.plan_options())
    assert isinstance(plan, DynamicCPPlan) and plan.pool_size == 4  # dp=2 x cp=2
    plan.validate(lengths.size)
    assert len(plan.microbatches_per_step) == 2
    assert RunConfig.from_dict(rc.to_dict()) == rc
    off = rc.replace(dynamic_cp=False)
    assert not off.plan_options().dynamic_cp and "--dynbatch-dynamic-cp" not in off.to_megatron_args()
    assert RunConfig.from_dict(_run(dynamic_cp=np.bool_(True))).to_dict()["dynamic_cp"] is True  # stored as bool


def test_run_config_dynamic_cp_from_yaml_and_runs_args(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "pool.yaml").write_text("model: qwen3-8b\nparallel: {dp: 4, cp: 2}\nmax_tokens_per_gpu: 8192\n"
                                    "dynamic_cp: true\n")
    monkeypatch.setenv("MEGATRON_DYNBATCH_CONFIGS", str(tmp_path))
    assert RunConfig.from_yaml("pool").options.dynamic_cp is True
    assert main(["runs", "args", "pool"]) == 0
    assert "--dynbatch-dynamic-cp" in shlex.split(capsys.readouterr().out)
    assert main(["runs", "show", "pool"]) == 0
    assert "dynamic_cp: true" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, field, words", [
    ({"parallel": {"dp": 1}}, "dynamic_cp", "one GPU"),
    ({"parallel": {"dp": 1, "tp": 8}}, "dynamic_cp", "one GPU"),
    ({"parallel": {"dp": 2, "pp": 2, "vpp": 2}}, "dynamic_cp", "pp=2"),
    ({"group_size": 4}, "dynamic_cp", "group_size"),
    ({"balance_by": "tokens"}, "balance_by", "silently ignored"),  # the options' rule (PlanOptions), every door
    ({"balance_by": "flops"}, "balance_by", "silently ignored"),
    ({"megatron_args": ["--hybrid-context-parallel"]}, "dynamic_cp", "--hybrid-context-parallel"),
    ({"megatron_args": ["--dynbatch-dynamic-cp"]}, "megatron_args", "set dynamic_cp: true"),
    ({"megatron_args": ["--dynbatch-dynamic-cp"], "dynamic_cp": False}, "megatron_args", "set dynamic_cp: true"),
    ({"dynamic_cp": "yes"}, "dynamic_cp", "true or false"),
    ({"dynamic_cp": 1}, "dynamic_cp", "true or false"),
    ({"dynamic_cp": None}, "dynamic_cp", "true or false"),
    ({"dynamic_cp": np.int64(1)}, "dynamic_cp", "true or false"),
    ({"dynamic_cps": True}, "dynamic_cps", "did you mean 'dynamic_cp'"),
])
def test_run_config_refuses_dynamic_cp_where_the_run_cannot_use_it(overrides, field, words):
    with pytest.raises(DynBatchConfigError) as exc:
        RunConfig.from_dict(_run(**overrides))
    assert exc.value.field == field and words in str(exc.value) and "Fix:" in str(exc.value)


def test_run_config_replace_rechecks_dynamic_cp():
    rc = RunConfig.from_yaml("qwen3-8b-grpo")  # GRPO groups stay on one DP rank
    assert rc.options.dynamic_cp is False
    with pytest.raises(DynBatchConfigError, match="group_size"):
        rc.replace(dynamic_cp=True)
    assert rc.replace(dynamic_cp=True, group_size=None, loss_mode="token_mean").options.dynamic_cp


def test_dynamic_cp_problem_agrees_with_the_planner():
    """What RunConfig refuses for the layout, the planner refuses too: pp=2 + vpp, and a pool of one GPU (which it
    planned, with nothing to choose, until the door-equivalence check found the two verdicts)."""
    assert dynamic_cp_problem(ParallelConfig(dp=2, cp=2)) is None
    assert dynamic_cp_problem(ParallelConfig(dp=2, pp=2, vpp=2)) is not None
    with pytest.raises(DynBatchConfigError, match="vpp"):
        plan_global_batch([10] * 8, parallel={"dp": 2, "pp": 2, "vpp": 2}, max_tokens_per_gpu=64, dynamic_cp=True)
    with pytest.raises(DynBatchConfigError, match="one GPU") as err:
        plan_global_batch([10, 20], parallel={"dp": 1}, max_tokens_per_gpu=64, dynamic_cp=True)
    assert err.value.field == "parallel"


def test_long_context_preset_states_its_dynamic_cp_choice():
    rc = RunConfig.from_yaml("llama-3.1-70b-longcot")
    assert rc.options.dynamic_cp is False  # why: docs/dynamic_cp.md "Run presets"
    on = rc.replace(dynamic_cp=True)  # the layout can use it: a pool of 2 x 8 GPUs, pp=2 without vpp
    assert "--dynbatch-dynamic-cp" in on.to_megatron_args()


def test_preset_benchmark_runs_and_dynamic_cp_is_never_slower():
    """benchmarks/dyncp_preset.py, the modelled comparison behind the preset's choice (one seed per shape)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "dyncp_preset.py"
    spec = importlib.util.spec_from_file_location("dyncp_preset", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.evaluate("llama-3.1-70b-longcot", seeds=1)
    assert {r["shape"] for r in result["rows"]} >= {"longcot-64k-med20k", "docs-real"}
    for row in result["rows"]:
        assert row["speedup"] >= 1 - 1e-9 and row["over_budget"] == 0, row
    assert "MODELLED" in mod.table(result)


# ---------------------------------------------------------------------------------------------- CLI
@pytest.fixture()
def dominated(tmp_path):
    p = tmp_path / "dominated.txt"
    p.write_text("\n".join(map(str, DOMINATED)))
    return str(p)


def test_plan_dynamic_cp_prints_the_pool_and_the_fixed_cp_plan(dominated, capsys):
    argv = ["plan", "--lengths", dominated, "--model", "llama-3.1-8b", "--dp", "8", "--tp", "2",
            "--max-tokens-per-gpu", "32768", "--dynamic-cp"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dynamic CP over a pool of dp x cp = 8 x 1 = 8 GPUs" in out
    assert "CP groups used" in out and "winning candidate" in out and "over budget: 0" in out
    assert out.count("\n    7     7.0") == 1  # one row per pool GPU (dp_rank.cp_rank)
    fixed = [line for line in out.splitlines() if line.startswith("fixed CP (cp=1)")]
    assert len(fixed) == 1
    speedup = float(fixed[0].split()[-1].rstrip("x"))
    plan = plan_global_batch(DOMINATED, model="llama-3.1-8b", parallel={"dp": 8, "tp": 2}, max_tokens_per_gpu=32768,
                             dynamic_cp=True)
    assert speedup == pytest.approx(plan.speedup_vs_fixed_cp, rel=2e-3) and speedup > 1.2
    assert main(argv + ["--json"]) == 0
    back = Plan.from_dict(json.loads(capsys.readouterr().out))
    assert isinstance(back, DynamicCPPlan) and back.groups == plan.groups


def test_plan_dynamic_cp_compare_and_forced_count(dominated, capsys):
    assert main(["plan", "--lengths", dominated, "--model", "llama-3.1-8b", "--dp", "4", "--cp", "2",
                 "--max-tokens-per-gpu", "16384", "--dynamic-cp", "--compare", "--num-microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "slots per GPU: 2" in out
    for name in ("fixed CP (cp=2)", "verl", "slime", "nemo_rl", "megatron-hybrid-cp"):
        assert any(line.startswith(name) for line in out.splitlines()), name


def test_plan_dynamic_cp_when_only_the_pool_holds_a_sample(tmp_path, capsys):
    path = tmp_path / "l.txt"
    path.write_text("300\n20\n20\n20\n20\n")  # 300 tokens > one GPU's 100, fits the pool of 4
    assert main(["plan", "--lengths", str(path), "--dp", "4", "--max-tokens-per-gpu", "100", "--dynamic-cp"]) == 0
    out = capsys.readouterr().out
    assert "fixed CP (cp=1)" in out and "cannot plan this batch" in out
    assert "model (none: tokens-only cost model)" in out


def test_plan_dynamic_cp_from_a_run_preset_and_no_dynamic_cp(tmp_path, monkeypatch, dominated, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "pool.yaml").write_text("model: llama-3.1-8b\nparallel: {dp: 8, tp: 2}\nmax_tokens_per_gpu: 32768\n"
                                    "dynamic_cp: true\n")
    monkeypatch.setenv("MEGATRON_DYNBATCH_CONFIGS", str(tmp_path))
    assert main(["plan", "--lengths", dominated, "--run", "pool"]) == 0
    assert "dynamic CP over a pool" in capsys.readouterr().out
    assert main(["plan", "--lengths", dominated, "--run", "pool", "--no-dynamic-cp"]) == 0
    out = capsys.readouterr().out
    assert "dynamic CP" not in out and "micro-batches per rank" in out


@pytest.mark.parametrize("extra, words", [
    (["--dp", "1"], "one GPU"),
    (["--dp", "2", "--pp", "2", "--vpp", "2"], "pp=2"),
    (["--dp", "2", "--balance-by", "tokens"], "--balance-by tokens"),
    (["--dp", "2", "--balance-by", "flops"], "--balance-by flops"),
    (["--dp", "2", "--group-ids", "GROUPS"], "(--group-ids)"),
    (["--run", "qwen3-8b-grpo"], "group_size=8"),
])
def test_plan_dynamic_cp_refuses_naming_the_flag(tmp_path, capsys, extra, words):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(["100"] * 16))
    groups = tmp_path / "g.txt"
    groups.write_text("\n".join(str(i // 4) for i in range(16)))
    extra = [str(groups) if e == "GROUPS" else e for e in extra]
    budget = [] if "--run" in extra else ["--max-tokens-per-gpu", "1000"]
    assert main(["plan", "--lengths", str(lengths), "--dynamic-cp", *budget, *extra]) == 2
    err = capsys.readouterr().err
    assert "--dynamic-cp" in err and words in err and "Fix:" in err


def test_plan_dynamic_cp_plot_colours_groups(dominated, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    labels = []
    real = matplotlib.figure.Figure.legend

    def spy(self, *a, **k):
        labels.extend(h.get_label() for h in k["handles"])
        return real(self, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "legend", spy)
    png = tmp_path / "pool.png"
    assert main(["plan", "--lengths", dominated, "--model", "llama-3.1-8b", "--dp", "4", "--cp", "2",
                 "--max-tokens-per-gpu", "16384", "--dynamic-cp", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and f"wrote {png}" in capsys.readouterr().err
    assert any("CP group of" in x for x in labels)
    assert any(x.startswith("micro-batch (shades") for x in labels)  # the fixed-CP panel


def test_group_starts_reproduce_the_simulated_step_with_pp1():
    from megatron_dynbatch.bench.plot import group_starts

    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(200, 3000, 60), [30000, 20000]])
    plan = plan_global_batch(lengths, model="qwen3-8b", parallel={"dp": 4, "cp": 2}, max_tokens_per_gpu=16384,
                             dynamic_cp=True)
    assert max(plan.group_sizes()) > 2  # groups wider than the layout's: members wait for each other
    starts = group_starts(plan)
    ends = starts[:, -1] + np.asarray([t[-1] for t in plan.microbatch_time])
    np.testing.assert_allclose(ends, plan.rank_time, rtol=1e-12)
    for j in range(plan.num_microbatches):  # every group starts together
        for start, size, _ in plan.slot_groups(j):
            assert len(set(starts[start:start + size, j].tolist())) == 1
    fixed = plan_global_batch(lengths, model="qwen3-8b", parallel={"dp": 4, "cp": 2}, max_tokens_per_gpu=16384)
    assert group_starts(fixed) is None
