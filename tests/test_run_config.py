"""Run presets (``megatron_dynbatch.core.run_config``). The memory estimate's tests are in test_memory_model.py."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import numpy as np
import pytest

from megatron_dynbatch import DynBatchConfigError, plan_global_batch
from megatron_dynbatch.core.run_config import (
    GROUP_REDUCE,
    LOSS_MODES,
    RunConfig,
    available_run_presets,
    run_preset_dirs,
)

SHIPPED = ["deepseek-v3-example", "llama-3.1-70b-longcot", "qwen3-30b-a3b-grpo", "qwen3-8b-grpo", "tiny-cpu-demo",
           "cpu-calibrate-demo"]


def _base(**overrides):
    d = {"name": "t", "model": "qwen3-8b", "parallel": {"world_size": 8}, "max_tokens_per_gpu": 8192}
    d.update(overrides)
    return d


def _lengths(rc: RunConfig, n: int, seed: int = 0) -> np.ndarray:
    cap = rc.budget() * rc.parallel().cp
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(cap / 8), 1.0, n).astype(int), 0, cap // 2)


# ------------------------------------------------------------------------------------------- presets
def test_shipped_presets_are_found():
    assert set(SHIPPED) <= set(available_run_presets())
    assert any(d.name == "runs" and d.parent.name == "configs" for d in run_preset_dirs())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_preset_loads_and_plans(name):
    rc = RunConfig.from_yaml(name)
    assert rc.name == name
    assert rc.model_spec().num_layers > 0
    assert rc.parallel().world_size == rc.parallel().dp * rc.parallel().tp * rc.parallel().pp * rc.parallel().cp
    n = rc.options.samples_per_step or 8 * rc.parallel().dp
    lengths = _lengths(rc, n)
    plan = plan_global_batch(lengths, rc.plan_options(), group_ids=rc.group_ids(n))
    plan.validate(num_samples=n)
    assert max(max(t) for t in plan.microbatch_tokens) <= rc.budget() * rc.parallel().cp
    fwd = rc.plan_options(forward_only=True)
    assert fwd.resolve().max_tokens_per_gpu == rc.budget(forward_only=True) >= rc.budget()
    assert fwd.samples_per_step is None
    plan_global_batch(lengths, fwd).validate(num_samples=n)
    assert RunConfig.from_dict(rc.to_dict()) == rc  # YAML form round-trips


def test_preset_layouts_are_what_the_names_promise():
    q8 = RunConfig.from_yaml("qwen3-8b-grpo")
    assert (q8.parallel().dp, q8.parallel().tp, q8.group_size) == (8, 1, 8)
    moe = RunConfig.from_yaml("qwen3-30b-a3b-grpo")
    assert (moe.parallel().ep, moe.moe_token_dispatcher_type) == (8, "alltoall")
    llama = RunConfig.from_yaml("llama-3.1-70b-longcot")
    p = llama.parallel()
    assert (p.tp, p.pp, p.cp, p.dp, p.world_size, p.sequence_parallel) == (8, 2, 8, 2, 256, True)
    ds = RunConfig.from_yaml("deepseek-v3-example")
    assert (ds.parallel().ep, ds.expert_tensor_parallel_size, ds.parallel().dp) == (64, 1, 32)
    assert "--decoder-first-pipeline-num-layers" in ds.megatron_args  # 61 layers over pp=16


def test_tiny_preset_matches_the_demo_defaults():
    demo = pytest.importorskip("megatron_dynbatch.demo")
    rc = RunConfig.from_yaml("tiny-cpu-demo")
    parser = demo._parser()
    assert rc.budget_as_written() == parser.get_default("max_tokens_per_gpu")
    assert rc.parallel().dp == parser.get_default("dp")
    assert rc.model_spec().padded_vocab_size == demo.VOCAB


def test_from_yaml_accepts_a_path_and_env_preset_dirs(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "my-run.yaml").write_text("model: qwen3-0.6b\nparallel: {dp: 2}\nmax_tokens_per_gpu: 4096\n")
    monkeypatch.setenv("MEGATRON_DYNBATCH_CONFIGS", str(tmp_path))
    rc = RunConfig.from_yaml("my-run")
    assert (rc.name, rc.parallel().dp) == ("my-run", 2)
    assert RunConfig.from_yaml(runs / "my-run.yaml") == rc
    assert RunConfig.from_any("my-run") == rc


# -------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("data, field, words", [
    (_base(max_token_per_gpu=1), "max_token_per_gpu", "did you mean 'max_tokens_per_gpu'"),
    (_base(parallel={"world_size": 8, "tpp": 2}), "parallel.tpp", "did you mean 'tp'"),
    (_base(parallel={"world_size": 12, "tp": 8}), "parallel.world_size", "not divisible by tp x pp x cp"),
    (_base(parallel={"world_size": 16, "dp": 4}), "parallel.dp", "dp=16"),
    (_base(parallel={"dp": 8, "ep": 2}), "parallel.ep", "dense"),
    (_base(model="qwen3-30b-a3b", parallel={"dp": 8, "ep": 3}), "parallel.ep", "num_experts=128"),
    (_base(model="qwen3-30b-a3b", parallel={"dp": 2, "pp": 2, "ep": 8}), "parallel.ep", "etp x ep x pp"),
    (_base(model="qwen3-30b-a3b", moe_token_dispatcher_type="allgather"), "moe_token_dispatcher_type", "alltoall"),
    (_base(parallel={"dp": 8, "sequence_parallel": True}), "parallel.sequence_parallel", "tp > 1"),
    (_base(parallel={"dp": 1, "tp": 16}), "parallel.tp", "num_query_groups=8"),
    (_base(parallel={"dp": 1, "pp": 5}), "parallel.pp", "does not divide num_layers=36"),
    (_base(parallel={"dp": 1, "cp": 8}, max_tokens_per_gpu=1), "max_tokens_per_gpu", "use max_tokens_per_gpu >= 2"),
    (_base(max_tokens_per_gpu=0), "max_tokens_per_gpu", "must be >= 1"),
    (_base(log_probs_max_tokens_per_gpu="big"), "log_probs_max_tokens_per_gpu",
     "neither a number of tokens nor 'auto'"),
    (_base(loss_mode="token_means"), "loss_mode", "did you mean 'token_mean'"),
    (_base(balance_by="raw-flops"), "balance_by", "did you mean"),
    (_base(loss_mode="group_mean"), "group_size", "needs groups"),
    (_base(samples_per_step=32, group_size=8), "samples_per_step", "at least 64"),
    (_base(samples_per_step=64, group_size=3), "samples_per_step", "multiple of 3"),
    (_base(samples_per_step=12), "samples_per_step", "--global-batch-size"),
    (_base(fp8_alignment="fp9"), "fp8_alignment", "unknown FP8 recipe"),
    (_base(model="qwen3-9b"), "model", "did you mean 'qwen3-8b'"),
    (_base(megatron_args="--foo"), "megatron_args", "list of strings"),
    ({"model": "qwen3-8b", "parallel": {"dp": 1}}, "max_tokens_per_gpu", "is required"),
])
def test_bad_configs_name_field_value_and_fix(data, field, words):
    with pytest.raises(DynBatchConfigError) as exc:
        RunConfig.from_dict(data)
    assert exc.value.field == field
    assert words in str(exc.value)
    assert "Fix:" in str(exc.value)


def test_uneven_pipeline_is_allowed_with_megatron_flags():
    rc = RunConfig.from_dict(_base(parallel={"dp": 1, "pp": 5},
                                   megatron_args=["--decoder-first-pipeline-num-layers", "4"]))
    assert rc.parallel().pp == 5


def test_unknown_run_preset_suggests_and_points_at_model_presets(tmp_path):
    with pytest.raises(DynBatchConfigError, match="did you mean 'qwen3-8b-grpo'"):
        RunConfig.from_yaml("qwen3-8b-grp")
    with pytest.raises(DynBatchConfigError, match="is a MODEL preset"):
        RunConfig.from_yaml("qwen3-8b")
    with pytest.raises(DynBatchConfigError, match="file not found"):
        RunConfig.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(DynBatchConfigError, match="not valid YAML"):
        RunConfig.from_yaml(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(DynBatchConfigError, match="mapping of run fields"):
        RunConfig.from_yaml(bad)


# ---------------------------------------------------------------------------------------------- views
def test_group_ids_and_replace():
    rc = RunConfig.from_yaml("qwen3-8b-grpo")
    assert rc.group_ids(16) == [i // 8 for i in range(16)]
    with pytest.raises(DynBatchConfigError, match="multiple of group_size"):
        rc.group_ids(12)
    small = rc.replace(parallel={"world_size": 4}, samples_per_step=32)
    assert (small.parallel().dp, small.options.samples_per_step) == (4, 32)
    with pytest.raises(DynBatchConfigError, match="32 groups per step for dp=64"):
        rc.replace(parallel={"world_size": 64})


def test_to_megatron_args_layout_and_batching_flags():
    args = RunConfig.from_yaml("llama-3.1-70b-longcot").to_megatron_args()
    text = " ".join(args)
    for piece in ("--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 2", "--context-parallel-size 8",
                  "--sequence-parallel", "--use-dynamic-batch-size", "--max-tokens-per-gpu 16384",
                  "--balance-by-flops", "--micro-batch-size 1", "--global-batch-size 64"):
        assert piece in text
    moe = " ".join(RunConfig.from_yaml("qwen3-30b-a3b-grpo").to_megatron_args())
    assert "--expert-model-parallel-size 8" in moe and "--moe-token-dispatcher-type alltoall" in moe
    tokens = RunConfig.from_dict(_base(balance_by="tokens", oversize="alone", fp8_alignment="mxfp8",
                                       loss_mode="sample_mean")).to_megatron_args()
    assert "--balance-by-flops" not in tokens
    assert tokens[tokens.index("--dynbatch-oversize") + 1] == "alone"
    assert tokens[tokens.index("--dynbatch-fp8-alignment") + 1] == "mxfp8"
    vpp = RunConfig.from_dict(_base(parallel={"dp": 2, "pp": 2, "vpp": 2, "microbatch_group_size_per_vp_stage": 4}))
    v = vpp.to_megatron_args()
    assert v[v.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert v[v.index("--microbatch-group-size-per-virtual-pipeline-stage") + 1] == "4"


def test_choice_tuples_match_the_modules_that_own_them():
    from megatron_dynbatch.megatron import loss

    assert LOSS_MODES == loss.LOSS_MODES
    assert GROUP_REDUCE == loss.GROUP_REDUCE


_MEGATRON_STUB_FLAGS = {  # the Megatron-LM flags to_megatron_args may emit, with their argument count
    "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--context-parallel-size": 1,
    "--num-virtual-stages-per-pipeline-rank": 1, "--microbatch-group-size-per-virtual-pipeline-stage": 1,
    "--sequence-parallel": 0, "--expert-model-parallel-size": 1, "--expert-tensor-parallel-size": 1,
    "--moe-token-dispatcher-type": 1, "--micro-batch-size": 1, "--global-batch-size": 1,
    # what an automatic budget reads from Megatron's flags (core/memory/megatron_flags.py)
    "--recompute-granularity": 1, "--recompute-method": 1, "--recompute-num-layers": 1,
    "--use-distributed-optimizer": 0, "--optimizer-cpu-offload": 0, "--use-precision-aware-optimizer": 0,
}


@pytest.mark.parametrize("name", SHIPPED + ["dynamic-cp"])
def test_megatron_args_parse_back_to_the_same_plan(name):
    """to_megatron_args -> megatron_dynbatch.megatron.args (the flags' owner) -> the same PlanOptions."""
    args_mod = pytest.importorskip("megatron_dynbatch.megatron.args")
    if name == "dynamic-cp":
        rc = RunConfig.from_dict(_base(parallel={"world_size": 16, "tp": 2, "cp": 4}, samples_per_step=8,
                                       dynamic_cp=True))
    else:
        rc = RunConfig.from_yaml(name)
    parser = argparse.ArgumentParser()
    for flag, nargs in _MEGATRON_STUB_FLAGS.items():
        dest = flag[2:].replace("-", "_")
        if nargs:
            parser.add_argument(flag, dest=dest, type=lambda s: int(s) if s.isdigit() else s)
        else:
            parser.add_argument(flag, dest=dest, action="store_true")
    args_mod.add_dynamic_batch_args(parser)
    ns, rest = parser.parse_known_args(rc.to_megatron_args())
    assert all(r in rc.megatron_args for r in rest)  # only the preset's own extra flags are left
    ns.virtual_pipeline_model_parallel_size = ns.num_virtual_stages_per_pipeline_rank
    ns.microbatch_group_size_per_vp_stage = ns.microbatch_group_size_per_virtual_pipeline_stage
    ns.world_size = rc.world_size
    spec = rc.model_spec()
    for key, value in spec.to_dict().items():  # what Megatron's model flags would give
        setattr(ns, key, value)
    ns.num_experts = spec.num_experts
    ns.group_query_attention = True
    ns.untie_embeddings_and_output_weights = True  # the shipped models' own LM heads (an auto budget counts them)
    args_mod.validate_dynamic_batch_args(ns)
    got = args_mod.plan_options_from_args(ns)
    want = rc.plan_options()
    # A preset's "time" (or its default, balance_by None until resolved) and a launch's --balance-by-flops select
    # the same mode; every other option arrives equal.
    assert got.resolve().balance_by is want.resolve().balance_by
    assert got.replace(balance_by=None) == want.replace(balance_by=None)  # Megatron's flags carry the model's shape
    # (ModelSpec equality ignores the name)
    assert ns.log_probs_max_tokens_per_gpu == rc.effective_log_probs_max_tokens_per_gpu
    assert ns.dynbatch_loss_mode == rc.loss_mode


def test_runs_cli(capsys):
    from megatron_dynbatch.cli import main

    assert main(["runs", "list"]) == 0
    assert "qwen3-8b-grpo" in capsys.readouterr().out.split()
    assert main(["runs", "args", "qwen3-30b-a3b-grpo"]) == 0
    assert shlex.split(capsys.readouterr().out) == RunConfig.from_yaml("qwen3-30b-a3b-grpo").to_megatron_args()
    assert main(["runs", "show", "tiny-cpu-demo"]) == 0
    assert "max_tokens_per_gpu: 160" in capsys.readouterr().out
    assert main(["runs", "args", "nope"]) == 2
    assert "unknown run preset" in capsys.readouterr().err
    assert main(["runs", "show"]) == 2
    assert main(["runs"]) == 2


# ------------------------------------------------------------------------- docs quote the real messages
def _errors_quoted_in_troubleshooting():
    import warnings

    from megatron_dynbatch import ParallelConfig as PC

    def plan(lengths, **kw):
        kw.setdefault("balance_by_flops", False)
        kw.setdefault("max_tokens_per_gpu", 16384)
        return plan_global_batch(lengths, **kw)

    cases = [
        lambda: plan([100, 40000, 50], parallel={"dp": 1}),
        lambda: plan([10] * 4, parallel={"dp": 1, "cp": 8, "tp": 8, "sequence_parallel": True}, max_tokens_per_gpu=4),
        lambda: plan([100] * 3, parallel={"dp": 4}),
        lambda: plan([10] * 8, group_ids=[0] * 4 + [1] * 4, parallel={"dp": 4}, max_tokens_per_gpu=100),
        lambda: PC(pp=4, vpp=2, microbatch_group_size_per_vp_stage=2),
        lambda: PC(pp=1, vpp=2),
        lambda: plan([100] * 64, parallel={"dp": 2, "pp": 4, "vpp": 2}, num_microbatches=5),
        lambda: plan([100] * 4, parallel={"dp": 2, "pp": 2, "vpp": 2, "microbatch_group_size_per_vp_stage": 4}),
        lambda: plan([10] * 4, parallel={"dp": 1}, max_tokens_per_gpu=100, balance_by_flops=True),
        lambda: plan([10] * 10, samples_per_step=4, parallel={"dp": 1}, max_tokens_per_gpu=100),
        lambda: plan([10] * 8, samples_per_step=4, group_ids=[0, 0, 0, 1, 1, 1, 2, 2], parallel={"dp": 1},
                     max_tokens_per_gpu=100),
        lambda: plan([10, -1], parallel={"dp": 1}, max_tokens_per_gpu=100),
        lambda: plan([7, 9, 7, 5, 4, 6], parallel={"dp": 2}, max_tokens_per_gpu=10, num_microbatches=2),
        lambda: plan([1, 2, 3, 4], parallel={"dp": 1}, max_tokens_per_gpu=100, group_ids=[None, None, 1, 1]),
        lambda: plan([5, 2 ** 64], parallel={"dp": 1}, max_tokens_per_gpu=100),
        lambda: plan([10] * 8, parallel={"dp": 1}, max_tokens_per_gpu=100, fp8_alignment="fp9"),
        lambda: RunConfig.from_dict(_base(parallel={"dp": 8, "sequence_parallel": True})),
        lambda: RunConfig.from_dict(_base(parallel={"dp": 1, "tp": 16})),
        lambda: RunConfig.from_dict(_base(parallel={"dp": 1, "pp": 5})),
        lambda: RunConfig.from_dict(_base(parallel={"world_size": 12, "tp": 8})),
        lambda: RunConfig.from_dict(_base(model="qwen3-30b-a3b", parallel={"world_size": 8, "pp": 2, "ep": 8})),
        lambda: RunConfig.from_dict(_base(max_token_per_gpu=1)),
        lambda: RunConfig.from_dict(_base(tp=8)),
        lambda: plan([10, 2.5], parallel={"dp": 1}, max_tokens_per_gpu=100),
        *_dropin_error_cases(),
        *_calibration_error_cases(),
    ]
    out = []
    for case in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(DynBatchConfigError) as exc:
                case()
        out.append(f"{type(exc.value).__name__}: {exc.value}")
    return out


def _dropin_error_cases():
    """The trainer drop-ins' errors docs/troubleshooting.md quotes (issue 20)."""
    from megatron_dynbatch.core.dropin.nemo_rl import get_packer
    from megatron_dynbatch.core.dropin.roll import roll_shard
    from megatron_dynbatch.core.dropin.verl import local_count
    from megatron_dynbatch.integrations.slime import build_dp_schedule
    from megatron_dynbatch.testing.peer_types import slime_args

    args = slime_args(max_tokens_per_gpu=10)
    del args.data_pad_size_multiplier  # as slime's unit tests build args
    cases = [lambda: build_dp_schedule(args, {"dp_size": 2}, [5] * 8, global_batch_size=8,
                                       rollout_indices=list(range(8))),
             lambda: local_count([60, 40, 30], 128, min_num_micro_batch=5),
             lambda: roll_shard([10, 1000], 1, 512, 64),
             lambda: get_packer("best_fit", 100)]
    try:
        from megatron_dynbatch.integrations import verl
        from megatron_dynbatch.testing.peer_types import grpo_batch

        cases += [lambda: verl.rearrange_micro_batches(grpo_batch([], width=8).batch, 64),
                  lambda: verl.rearrange_micro_batches(grpo_batch([5], width=4096).batch, 2048)]
    except ImportError:  # torch
        pass
    return cases


def _calibration_error_cases():
    """Calibration's errors docs/troubleshooting.md quotes (issue 18 item 4)."""
    from megatron_dynbatch.core.calibration.grid import build_grid
    from megatron_dynbatch.core.calibration.setup import plan_calibration

    cases = [lambda: build_grid(1024, [1], tokens=[2048]),
             lambda: build_grid(1024, [1], tokens=[512, 1024], seqs=[1], floor=False),
             lambda: plan_calibration("tiny-gpt", parallel={"dp": 2, "cp": 2}, max_tokens_per_gpu=512, spec="te"),
             lambda: plan_calibration("qwen3-30b-a3b", max_tokens_per_gpu=512),
             lambda: plan_calibration("tiny-gpt", max_tokens_per_gpu=512, device="cpu", max_seconds=5)]
    try:
        from megatron_dynbatch.integrations.ray import plan_rollout

        cases.append(lambda: plan_rollout(lengths=[10, 20], sample_refs=[1, 2], loss_mask_sums=[5, 5], put=False,
                                          run_config=RunConfig.from_dict(_base(online_calibration=True))))
    except ImportError:  # torch
        pass
    return cases


def _dropin_warnings():
    import warnings

    from megatron_dynbatch.core.dropin.verl import local_plan
    from megatron_dynbatch.integrations.roll import dynamic_batching_shard
    from megatron_dynbatch.testing.peer_types import grpo_batch

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        local_plan([50, 60, 80, 90, 40, 45, 100, 110], 200, 3, force_group_size=2)
        dynamic_batching_shard(grpo_batch([900, 1000, 700, 800], width=8192), 2, 4096, 128)
    return [f"{r.category.__name__}: {r.message}" for r in rec]


def test_troubleshooting_quotes_the_real_messages():
    args_mod = pytest.importorskip("megatron_dynbatch.megatron.args")
    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text().split())
    messages = _errors_quoted_in_troubleshooting()
    parser = args_mod.add_dynamic_batch_args(argparse.ArgumentParser())
    for argv, extra in ((["--use-dynamic-batch-size"], {}), (["--balance-by-flops"], {}),
                        (["--dynbatch-online-calibration"], {}), (["--use-dynamic-batch-size", "--max-tokens-per-gpu",
                                                                   "100", "--dynbatch-calibration-interval", "50"], {}),
                        (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "100"],
                         {"num_experts": 8, "expert_model_parallel_size": 2,
                          "moe_token_dispatcher_type": "allgather"})):
        ns = parser.parse_args(argv)
        ns.data_parallel_size = 2
        for k, v in extra.items():
            setattr(ns, k, v)
        with pytest.raises(DynBatchConfigError) as exc:
            args_mod.validate_dynamic_batch_args(ns)
        messages.append(f"DynBatchConfigError: {exc.value}")
    with pytest.warns(UserWarning) as rec:
        plan_global_batch([100, 40000, 50, 60], parallel={"dp": 1}, max_tokens_per_gpu=16384,
                          balance_by_flops=False, oversize="alone")
    messages.append(f"{rec[0].category.__name__}: {rec[0].message}")
    messages += _dropin_warnings()
    for msg in messages:
        assert " ".join(msg.split()) in doc, f"docs/troubleshooting.md does not quote: {msg}"


def test_quickstart_custom_loop_snippet_runs_on_cpu(megatron_world1):
    """docs/quickstart.md section 5 with the tiny preset on one CPU rank."""
    import torch

    from megatron_dynbatch.demo import synthetic_rl_batch
    from megatron_dynbatch.megatron.schedule import dynamic_forward_backward, forward_log_probs
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    rc = RunConfig.from_yaml("tiny-cpu-demo").replace(parallel={"world_size": 1}, samples_per_step=8)
    torch.manual_seed(0)
    model = megatron_cpu.build_tiny_gpt(megatron_cpu.tiny_gpt_config(), vocab_size=128, thd=True)
    samples = synthetic_rl_batch(8, seed=3, group_size=rc.group_size)
    logp = forward_log_probs(model, samples, rc.plan_options(forward_only=True))
    assert logp.sample_indices == list(range(8))
    assert [len(x) for x in logp.per_sample] == [len(s["tokens"]) for s in samples]
    res = dynamic_forward_backward(model, samples, rc.plan_options(), loss_mode=rc.loss_mode, step=0)
    assert res.loss is not None and np.isfinite(res.loss)


def test_max_seq_len_is_checked_at_construction():
    """A budget too small for the longest sample the run produces fails when the config is built (before step 1;
    so also for Ray trainers that pass run_config to plan_rollout), counting the same padding as the planner."""
    import warnings

    from megatron_dynbatch import OversizeSampleError, OversizeSampleWarning

    base = {"name": "t", "model": "tiny-gpt", "parallel": {"dp": 2, "cp": 2}, "max_tokens_per_gpu": 4096}
    ok = RunConfig.from_dict({**base, "max_seq_len": 8192})  # 8192 tokens over cp=2 at 4096 per GPU: fits
    assert ok.to_megatron_args()[-2:] == ["--dynbatch-max-seq-length", "8192"]
    with pytest.raises(OversizeSampleError, match="max_seq_len=8193") as err:
        RunConfig.from_dict({**base, "max_seq_len": 8193})  # 8196 after 2*cp alignment: one token slot too many
    assert err.value.field == "max_tokens_per_gpu" and "4098" in err.value.fix
    with pytest.raises(OversizeSampleError, match="log_probs_max_tokens_per_gpu"):
        RunConfig.from_dict({**base, "max_seq_len": 8192, "log_probs_max_tokens_per_gpu": 2048})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RunConfig.from_dict({**base, "max_seq_len": 10000, "oversize": "alone"})
    assert any(issubclass(w.category, OversizeSampleWarning) for w in caught)
    # dynamic CP: a sample may spread over the whole dp x cp pool (4 GPUs here)
    RunConfig.from_dict({**base, "max_seq_len": 16384, "dynamic_cp": True})
    with pytest.raises(OversizeSampleError):
        RunConfig.from_dict({**base, "max_seq_len": 16384})
    for bad in (0, -1, 2.5, True, "8192", 2 ** 41):
        with pytest.raises(DynBatchConfigError, match="max_seq_len"):
            RunConfig.from_dict({**base, "max_seq_len": bad})


# ------------------------------------------------------------------------------- every trainer it names
#: the card a preset that names none is written for (their comments: an H100 80GB, as torch reports it)
H100_GIB = 79.1


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs" / "runs")
                                         .glob("*.yaml")))
def test_every_preset_fits_every_trainer_it_names(name):
    """Each named trainer's loss path (core/memory/loss_paths.py) at the preset's budgets -- its own ``auto``
    choice, or the number written -- predicts a peak within the usable memory of the preset's card, and the
    longest sample the preset declares fits that trainer's budgets."""
    from megatron_dynbatch.core.memory import choose_budget, peak_memory

    rc = RunConfig.from_yaml(name)
    card = rc.options.gpu_memory_gb or H100_GIB
    st = rc.memory_settings()
    for trainer in rc.named_trainers():
        mine = st.replace(trainer=trainer)
        for pass_, value in (("train", rc.budget_as_written()), ("log_prob", rc.budget_as_written(forward_only=True))):
            choice = choose_budget(rc.model_spec(), rc.parallel(), card, pass_=pass_, settings=mine)
            tokens = choice.tokens_per_gpu if value == "auto" else value
            peak = peak_memory(rc.model_spec(), rc.parallel(), tokens, pass_=pass_, settings=mine)
            assert peak.peak_bytes <= choice.usable_bytes, (name, trainer, pass_, tokens, peak.peak_gb)
            if rc.max_seq_len:
                assert rc.max_seq_len <= tokens * rc.parallel().cp, (name, trainer, pass_, tokens)


def test_the_trainers_a_preset_names_are_checked():
    base = RunConfig.from_yaml("tiny-cpu-demo").to_dict()
    assert RunConfig.from_dict({**base, "trainers": ["slime", "verl"]}).named_trainers() == ("slime", "verl")
    assert RunConfig.from_dict(base).named_trainers() == ("megatron-lm",)
    with pytest.raises(DynBatchConfigError) as exc:
        RunConfig.from_dict({**base, "trainers": ["slmie"]})
    assert exc.value.field == "trainers[0]" and "slime" in exc.value.fix
    with pytest.raises(DynBatchConfigError) as exc:
        RunConfig.from_dict({**base, "trainers": "slime"})
    assert exc.value.field == "trainers"


def test_the_options_are_one_plan_options_and_the_yaml_keys_stay_flat():
    """Issue 31.6: no RunConfig field mirrors an option; the YAML form's flat keys route into ``options``."""
    import dataclasses

    import yaml

    from megatron_dynbatch import BalanceBy, PlanOptions
    from megatron_dynbatch.core.run_config import OPTION_KEYS

    assert set(OPTION_KEYS) == set(PlanOptions.spellings("megatron")) | {"parallel"}  # from the field metadata
    assert {f.name for f in dataclasses.fields(RunConfig)} & set(OPTION_KEYS) == set()
    data = {"name": "t", "model": "qwen3-0.6b", "parallel": {"dp": 2}, "max_tokens_per_gpu": 4096,
            "balance_by": "tokens", "samples_per_step": np.int64(8), "loss_mode": "sample_mean"}
    rc = RunConfig.from_dict(data)
    assert isinstance(rc.options, PlanOptions) and rc.options is rc.plan_options()
    assert rc.options.balance_by is BalanceBy.TOKENS and rc.options.samples_per_step == 8
    assert rc.loss_mode == "sample_mean"
    d = rc.to_dict()
    assert d["balance_by"] == "tokens" and type(d["balance_by"]) is str and type(d["samples_per_step"]) is int
    assert RunConfig.from_dict(yaml.safe_load(yaml.safe_dump(d))) == rc
    # Python construction: the options whole, or as the preset's keys; replace routes keys the same way
    direct = RunConfig(name="t", model="qwen3-0.6b", loss_mode="sample_mean",
                       options=PlanOptions(max_tokens_per_gpu=4096, parallel={"dp": 2}, balance_by="tokens",
                                           samples_per_step=8))
    assert direct == rc == RunConfig(name="t", model="qwen3-0.6b", loss_mode="sample_mean",
                                     options={k: v for k, v in data.items() if k in OPTION_KEYS})
    wider = rc.replace(parallel={"dp": 4}, balance_by="time", group_size=2)
    assert (wider.parallel().dp, wider.options.balance_by, wider.group_size) == (4, BalanceBy.TIME, 2)
    assert wider.options.samples_per_step == 8 and rc.parallel().dp == 2
    assert rc.replace(options=rc.options.replace(samples_per_step=16)).options.samples_per_step == 16
    for bad, field in (({"refine_rounds": 3}, "refine_rounds"),):  # no launch flag: not a preset key
        with pytest.raises(DynBatchConfigError) as exc:
            RunConfig.from_dict({**data, **bad})
        assert exc.value.field == field
    with pytest.raises(DynBatchConfigError) as exc:
        RunConfig(name="t", model="qwen3-0.6b", options=PlanOptions(max_tokens_per_gpu=4096, refine_rounds=3))
    assert exc.value.field == "options.refine_rounds"
    with pytest.raises(DynBatchConfigError) as exc:
        RunConfig(name="t", model="qwen3-0.6b", options=PlanOptions(max_tokens_per_gpu=4096, model="qwen3-8b"))
    assert exc.value.field == "options.model"
