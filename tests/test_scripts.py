"""Launch scripts (scripts/*.sh, scripts/sbatch/*.sbatch), the Megatron-LM integration
(megatron_dynbatch/integrations/megatron_lm/) and its entry point (scripts/pretrain_gpt_dynbatch.py): syntax, DRY_RUN
output, agreement with the run presets, Slurm rendezvous, the pure-Python parts of the hook, and a real
2-process torchrun run of the sbatch body on CPU."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_dynbatch import DynBatchConfigError, PlanOptions
from megatron_dynbatch.integrations import megatron_lm as ml
from megatron_dynbatch.core.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
DENSE = ROOT / "scripts" / "run_dense_qwen3_8b.sh"
MOE = ROOT / "scripts" / "run_moe_qwen3_30b_a3b.sh"
SBATCH = ROOT / "scripts" / "sbatch" / "llama70b_longcot.sbatch"
ENTRY = ROOT / "scripts" / "pretrain_gpt_dynbatch.py"
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NODEID", "SLURM_GPUS_ON_NODE",
              "MASTER_ADDR", "MASTER_PORT", "DRY_RUN", "DYNBATCH_CPU_SMOKE", "DYNBATCH_USE_SRUN", "NODE_RANK")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SLURM_VARS}
    env.update(extra)
    return env


def _run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=_env(**env), timeout=60)


def _dry(script: Path, *args: str, **env: str) -> list:
    res = _run(script, *args, DRY_RUN="1", **env)
    assert res.returncode == 0, res.stderr
    return shlex.split(res.stdout)


def _value(words: list, flag: str) -> str:
    return words[words.index(flag) + 1]


# ------------------------------------------------------------------------------------------ shell scripts
@pytest.mark.parametrize("script", [DENSE, MOE, SBATCH, ROOT / "scripts" / "setup.sh"], ids=lambda p: p.name)
def test_bash_syntax(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_dense_dry_run_has_the_required_flags_and_env():
    words = _dry(DENSE, "--seed", "7", MAX_TOKENS_PER_GPU="12288")
    assert words[0] == "env"
    for var in ("CUDA_DEVICE_MAX_CONNECTIONS=1", "NVTE_FLASH_ATTN=1", "NVTE_FUSED_ATTN=0"):
        assert var in words
    assert "--use-dynamic-batch-size" in words and "--balance-by-flops" in words
    assert _value(words, "--max-tokens-per-gpu") == "12288"
    assert _value(words, "--attention-backend") == "flash"  # megatron-core checks it against NVTE_*
    assert _value(words, "--nproc-per-node") == "8"
    assert words[-2:] == ["--seed", "7"]  # extra arguments are passed through
    assert any(w.endswith("pretrain_gpt_dynbatch.py") for w in words)
    assert "--dynbatch-mock-data" in words
    assert _value(_dry(DENSE, DATA_PATH="/data/x.jsonl"), "--dynbatch-train-data") == "/data/x.jsonl"


def test_moe_dry_run_uses_alltoall_and_expert_parallelism():
    words = _dry(MOE)
    assert _value(words, "--moe-token-dispatcher-type") == "alltoall"
    assert _value(words, "--expert-model-parallel-size") == "8"
    assert "--use-dynamic-batch-size" in words and "--balance-by-flops" in words
    assert "NVTE_FLASH_ATTN=1" in words and "CUDA_DEVICE_MAX_CONNECTIONS=1" in words


def test_attention_backend_switch():
    words = _dry(DENSE, ATTN_BACKEND="fused")
    assert "NVTE_FUSED_ATTN=1" in words and "NVTE_FLASH_ATTN=0" in words
    assert _value(words, "--attention-backend") == "fused"
    res = _run(DENSE, DRY_RUN="1", ATTN_BACKEND="sdpa")
    assert res.returncode == 2 and "ATTN_BACKEND must be flash or fused" in res.stderr


def _assert_script_matches_preset(words: list, preset: str) -> None:
    """Every flag the run preset implies appears in the script's command with the same value."""
    expected = RunConfig.from_yaml(preset).to_megatron_args()
    i = 0
    while i < len(expected):
        flag = expected[i]
        has_value = i + 1 < len(expected) and not expected[i + 1].startswith("--")
        assert flag in words, f"{preset}: {flag} missing from the script"
        if has_value:
            assert _value(words, flag) == expected[i + 1], f"{preset}: {flag}"
            i += 2
        else:
            i += 1


@pytest.mark.parametrize("script, preset, env", [
    (DENSE, "qwen3-8b-grpo", {}),
    (MOE, "qwen3-30b-a3b-grpo", {}),
    (SBATCH, "llama-3.1-70b-longcot", {"SLURM_NNODES": "32", "SLURM_JOB_ID": "1"}),
], ids=["dense", "moe", "sbatch"])
def test_scripts_agree_with_their_run_presets(script, preset, env):
    _assert_script_matches_preset(_dry(script, **env), preset)


def test_sbatch_header_and_rendezvous_from_slurm_env(tmp_path):
    text = SBATCH.read_text()
    assert "#SBATCH --nodes=32" in text and "#SBATCH --gpus-per-node=8" in text
    env = dict(SLURM_JOB_NODELIST="gpu[003-034]", SLURM_NNODES="32", SLURM_NODEID="5", SLURM_JOB_ID="12345",
               SLURM_GPUS_ON_NODE="8(IDX:0-7)", PATH=_path_without("scontrol"))
    words = _dry(SBATCH, **env)
    assert _value(words, "--master-addr") == "gpu003"          # no scontrol: parsed from the node list
    assert _value(words, "--master-port") == str(20000 + 12345 % 20000)
    assert _value(words, "--nnodes") == "32"
    assert _value(words, "--nproc-per-node") == "8"
    assert "NVTE_FUSED_ATTN=1" in words and _value(words, "--attention-backend") == "fused"  # CP > 1
    # with scontrol on PATH its answer wins
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\necho node-a; echo node-b\n")
    (fake / "scontrol").chmod(0o755)
    words = _dry(SBATCH, **{**env, "PATH": f"{fake}:{env['PATH']}", "SLURM_GPUS_ON_NODE": "4"})
    assert _value(words, "--master-addr") == "node-a"
    assert _value(words, "--nproc-per-node") == "4"
    # outside Slurm: the job of the #SBATCH header (32 nodes x 8 GPUs) as node 0 runs it, master on localhost
    res = _run(SBATCH, DRY_RUN="1", PATH=_path_without("scontrol"))
    words = shlex.split(res.stdout)
    assert (_value(words, "--master-addr"), _value(words, "--nnodes"), _value(words, "--nproc-per-node"),
            _value(words, "--node-rank")) == ("127.0.0.1", "32", "8", "0")
    assert "$SLURM_NODEID" not in res.stdout and "node 0 of 32" in res.stderr


def _path_without(tool: str) -> str:
    return os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and not os.path.exists(os.path.join(p, tool)))


def test_sbatch_launches_one_torchrun_per_node_through_srun(tmp_path):
    """A fake srun runs the per-node command as nodes 0 and 1; a fake python prints its arguments."""
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "srun.log"
    (fake / "srun").write_text(
        "#!/usr/bin/env bash\n"
        f"echo \"$*\" > {log}\n"
        "while [[ \"$1\" == --* ]]; do shift; done\n"
        "for id in 0 1; do SLURM_NODEID=$id \"$@\" || exit $?; done\n")
    (fake / "py").write_text("#!/usr/bin/env bash\necho \"ARGS $*\"\n")
    for f in ("srun", "py"):
        (fake / f).chmod(0o755)
    res = _run(SBATCH, PATH=f"{fake}:{os.environ['PATH']}", PYTHON=str(fake / "py"), SLURM_NNODES="2",
               SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n[1-2]", SLURM_GPUS_ON_NODE="8")
    assert res.returncode == 0, res.stderr
    assert "--nodes=2 --ntasks-per-node=1" in log.read_text()
    lines = [shlex.split(line[5:]) for line in res.stdout.splitlines() if line.startswith("ARGS ")]
    assert [_value(w, "--node-rank") for w in lines] == ["0", "1"]
    assert all(_value(w, "--master-addr") == "n1" and _value(w, "--nnodes") == "2" for w in lines)
    assert all(w[:2] == ["-m", "torch.distributed.run"] for w in lines)


@pytest.mark.multiprocess
def test_sbatch_body_runs_cpu_demo():
    """The sbatch body itself, with DYNBATCH_CPU_SMOKE=1: Slurm-style env, torchrun with 2 CPU processes on one
    node (rendezvous on 127.0.0.1), running the CPU demo with real megatron-core."""
    pytest.importorskip("megatron.core")
    from megatron_dynbatch.megatron.ranks import free_port

    env = dict(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", SLURM_NODEID="0",
               SLURM_GPUS_ON_NODE="8", DYNBATCH_CPU_SMOKE="1", MASTER_PORT=str(free_port()),
               PYTHON=sys.executable, DYNBATCH_USE_SRUN="0", DYNBATCH_REPO=str(ROOT))
    res = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=_env(**env), timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    finished = re.findall(r"^demo rank (\d+)/2 finished$", res.stdout, flags=re.MULTILINE)
    assert sorted(finished) == ["0", "1"], out[-4000:]               # exactly once per rank
    assert "smoke=1 nnodes=1 gpus_per_node=2 master=127.0.0.1:" in res.stderr
    assert len(re.findall(r"^step 0: loss=", res.stdout, flags=re.MULTILINE)) == 1, out[-4000:]  # rank 0 only


# ------------------------------------------------------- the Megatron-LM hook and its entry point
def test_entry_point_help_without_megatron_training():
    env = _env(PYTHONPATH=str(ROOT))
    env.pop("MEGATRON_LM_DIR", None)
    res = subprocess.run([sys.executable, str(ENTRY), "--help"], capture_output=True, text=True, env=env, timeout=60)
    if "Megatron-LM's own flags are listed here" not in res.stdout and res.returncode == 0:
        pytest.skip("megatron.training is importable here; --help is Megatron's own")
    assert res.returncode == 0, res.stderr
    for flag in ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "--balance-by-flops", "--dynbatch-train-data",
                 "--dynbatch-mock-data"):
        assert flag in res.stdout
    assert "megatron.training" in res.stdout
    res = subprocess.run([sys.executable, str(ENTRY), "--use-dynamic-batch-size"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert res.returncode == 2 and "MEGATRON_LM_DIR" in res.stderr


def test_entry_point_is_a_thin_script_over_the_package_module():
    """The script holds no hook code of its own: it imports megatron_dynbatch.integrations.megatron_lm."""
    text = ENTRY.read_text()
    assert "from megatron_dynbatch.integrations import megatron_lm" in text
    for name in ("class DynamicForwardBackward", "def install", "class JsonlGlobalBatches", "def parse_sample"):
        assert name not in text
    assert len(text.splitlines()) < 120


def test_megatron_lm_imports_without_torch_or_megatron():
    code = ("import sys, megatron_dynbatch.integrations.megatron_lm as m; "
            "assert not [k for k in sys.modules if k == 'torch' or k.startswith('megatron.')], sorted(sys.modules); "
            "print(m.help_text())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "--use-dynamic-batch-size" in res.stdout and "--dynbatch-train-data" in res.stdout


def test_missing_megatron_training_is_a_clear_import_error(monkeypatch):
    """Without Megatron-LM, import_megatron_training() and install() raise MegatronLMNotFoundError (an
    ImportError) naming megatron.training and MEGATRON_LM_DIR."""
    import builtins

    real_import = builtins.__import__

    def no_megatron_training(name, *a, **k):
        if name == "megatron.training" or name.startswith("megatron.training."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *a, **k)

    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_megatron_training)
    for call in (ml.import_megatron_training, ml.install):
        with pytest.raises(ml.MegatronLMNotFoundError) as exc:
            call()
        assert isinstance(exc.value, ImportError)
        assert "megatron.training" in str(exc.value) and "MEGATRON_LM_DIR" in str(exc.value)


def _valid_args(*extra: str):
    import argparse

    args = ml.add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", *extra])
    args.dataloader_type, args.eval_iters, args.micro_batch_size = "external", 0, 1
    args.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size = 1, 1, 1
    return args


def test_megatron_lm_flags_and_checks():
    import argparse

    args = _valid_args("--dynbatch-mock-data")
    ml.check_megatron_lm_args(args)
    ml.check_data_source_args(args)
    assert ml.validate_megatron_lm_args(args) is args
    for change, flag in (({"dataloader_type": "single"}, "--dataloader-type"), ({"eval_iters": 10}, "--eval-iters"),
                         ({"micro_batch_size": 4}, "--micro-batch-size"),
                         ({"use_dynamic_batch_size": False}, "--use-dynamic-batch-size")):
        bad = argparse.Namespace(**{**vars(args), **change})
        with pytest.raises(DynBatchConfigError) as exc:
            ml.check_megatron_lm_args(bad)
        assert exc.value.field == flag
    # the data-source rule belongs to global_batch_datasets_provider only (a provider of your own needs neither)
    ml.check_megatron_lm_args(argparse.Namespace(**{**vars(args), "dynbatch_mock_data": False}))
    for change in ({"dynbatch_train_data": "x.jsonl"}, {"dynbatch_mock_data": False}):
        with pytest.raises(DynBatchConfigError) as exc:
            ml.check_data_source_args(argparse.Namespace(**{**vars(args), **change}))
        assert exc.value.field == "--dynbatch-train-data"
    with pytest.raises(DynBatchConfigError) as exc:  # validate = the core validation + the Megatron-LM checks
        ml.validate_megatron_lm_args(argparse.Namespace(**{**vars(args), "max_tokens_per_gpu": None}))
    assert exc.value.field == "--max-tokens-per-gpu"


def test_jsonl_global_batches(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"tokens": [1, 2, 3 + i], "loss_mask": [0, 1, 1], "group_id": i // 2} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    src = ml.JsonlGlobalBatches(str(path), 2, start_sample=1, as_torch=False)
    assert [s["tokens"][2] for s in next(src)] == [4, 5]
    assert [s["tokens"][2] for s in next(src)] == [6, 7]
    assert [s["tokens"][2] for s in next(src)] == [3, 4]  # wraps around
    batch = next(ml.JsonlGlobalBatches(str(path), 3))
    assert batch[0]["tokens"].dtype.is_floating_point is False and batch[0]["loss_mask"].tolist() == [0, 1, 1]
    path.write_text('{"tokens": [1, 2], "loss_mask": [1]}\n')
    with pytest.raises(DynBatchConfigError, match="one entry per token"):
        ml.JsonlGlobalBatches(str(path), 1)
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(DynBatchConfigError, match="'tokens'"):
        ml.JsonlGlobalBatches(str(path), 1)
    path.write_text("not json\n")
    with pytest.raises(DynBatchConfigError, match="not valid JSON"):
        ml.JsonlGlobalBatches(str(path), 1)
    with pytest.raises(DynBatchConfigError, match="file not found"):
        ml.JsonlGlobalBatches(str(tmp_path / "missing.jsonl"), 1)


def test_mock_global_batches_are_identical_per_step_and_well_formed():
    a = ml.MockGlobalBatches(16, vocab_size=1000, max_length=512, seed=3, group_size=4, as_torch=False)
    b = ml.MockGlobalBatches(16, vocab_size=1000, max_length=512, seed=3, group_size=4, start_batch=1, as_torch=False)
    first, second = next(a), next(a)
    assert next(b) == second  # batch k depends only on (seed, k): every rank, and resumption, agree
    for s in first + second:
        n = len(s["tokens"])
        assert 2 <= n <= 512 and len(s["loss_mask"]) == n and s["loss_mask"][-1] == 0
        assert max(s["tokens"]) < 1000 and sum(s["loss_mask"]) >= 1
    assert [s["group_id"] for s in first] == [i // 4 for i in range(16)]
    assert [s["group_id"] for s in second] == [4 + i // 4 for i in range(16)]


def test_mock_global_batches_with_a_length_profile():
    """``--dynbatch-mock-lengths``: every batch holds exactly these lengths, in a seeded order per batch."""
    lengths = [128, 120, 100, 40, 36, 32, 30, 28, 24, 20, 20, 18, 16, 16, 12, 2]
    src = ml.MockGlobalBatches(16, vocab_size=128, max_length=128, seed=7, group_size=4, as_torch=False,
                               lengths=lengths)
    batches = [next(src) for _ in range(3)]
    for batch in batches:
        assert sorted(len(s["tokens"]) for s in batch) == sorted(lengths)
        for s in batch:
            n = len(s["tokens"])
            assert len(s["loss_mask"]) == n and s["loss_mask"][-1] == 0 and sum(s["loss_mask"]) >= 1
            assert max(s["tokens"]) < 128
    assert [len(s["tokens"]) for s in batches[0]] != [len(s["tokens"]) for s in batches[1]]  # order per batch
    again = ml.MockGlobalBatches(16, vocab_size=128, max_length=128, seed=7, group_size=4, as_torch=False,
                                 lengths=lengths, start_batch=2)
    assert next(again) == batches[2]  # batch k depends only on (seed, k): every rank, and resumption, agree
    for bad in (lengths[:-1], lengths[:-1] + [1]):
        with pytest.raises(DynBatchConfigError, match="lengths"):
            ml.MockGlobalBatches(16, vocab_size=128, max_length=128, lengths=bad)


def test_mock_lengths_flag():
    import argparse

    parser = ml.add_dynamic_batch_args(argparse.ArgumentParser())
    args = parser.parse_args(["--dynbatch-mock-data", "--dynbatch-mock-lengths", "64,8, 8,4"])
    assert args.dynbatch_mock_lengths == [64, 8, 8, 4]
    for bad in ("64,x", "", "64,1", "0"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--dynbatch-mock-lengths", bad])
    args.global_batch_size, args.seq_length = 4, 64
    ml.check_data_source_args(args)
    for change, problem in (({"global_batch_size": 8}, "one length per sample"), ({"seq_length": 32}, "longer"),
                            ({"dynbatch_mock_data": False, "dynbatch_train_data": "x.jsonl"}, "synthetic")):
        with pytest.raises(DynBatchConfigError, match=problem) as exc:
            ml.check_data_source_args(argparse.Namespace(**{**vars(args), **change}))
        assert exc.value.field == "--dynbatch-mock-lengths"


def test_plan_log_line():
    from megatron_dynbatch import plan_global_batch

    kw = dict(parallel={"dp": 2, "cp": 2}, max_tokens_per_gpu=64, model="llama-3.1-8b")
    lengths = [128, 120, 100, 40, 36, 32, 30, 28, 24, 20, 20, 18, 16, 16, 12, 12]
    fixed = plan_global_batch(lengths, **kw)
    assert ml.plan_log_line(fixed) == (f"micro-batches per GPU: {fixed.num_microbatches} | cp groups (size: "
                                       f"count): 2: {2 * fixed.num_microbatches}")
    dyn = plan_global_batch(lengths, dynamic_cp=True, **kw)
    line = ml.plan_log_line(dyn)
    sizes = ", ".join(f"{g}: {n}" for g, n in sorted(dyn.group_sizes().items()))
    assert f"micro-batches per GPU: {dyn.num_microbatches} | cp groups (size: count): {sizes} |" in line
    assert re.search(r"modelled speed-up vs fixed cp: \d+\.\d{3}$", line)
    only_dyn = plan_global_batch([200, 8, 8, 8], dynamic_cp=True, **kw)  # 200 tokens need all 4 GPUs
    assert ml.plan_log_line(only_dyn).endswith("n/a (the fixed layout cannot hold this batch)")


def test_megatron_loss_dicts():
    assert ml.megatron_loss_dicts(None, 3) == []
    dicts = ml.megatron_loss_dicts(1.25, 3)
    assert len(dicts) == 3 and all(d["lm loss"].tolist() == [1.25] for d in dicts)


def test_dynamic_forward_backward_wrapper_with_a_fake_schedule():
    calls = {}

    def run_step(model, samples, options, **kw):
        calls.update(model=model, samples=samples, options=options, kw=kw)
        return types.SimpleNamespace(loss=0.5, num_microbatches=2)

    args = types.SimpleNamespace(dynbatch_loss_mode="sample_mean", dynbatch_group_reduce="token", eval_iters=0)
    inner = object()
    fb = ml.DynamicForwardBackward(inner, args, run_step=run_step,
                                   plan_options=lambda a: {"max_tokens_per_gpu": 64, "samples_per_step": 8})
    batch = [{"tokens": [1, 2]}]
    out = fb(forward_step_func=None, data_iterator=[iter([batch]), iter([batch])], model=["m"], num_microbatches=99,
             seq_length=4096, micro_batch_size=1, decoder_seq_length=None, forward_only=False,
             force_all_reduce=False, adjust_tensor_shapes_fn=None)
    assert [d["lm loss"].item() for d in out] == [0.5, 0.5]
    assert calls["samples"] is batch and calls["model"] == ["m"]
    assert calls["options"].options == PlanOptions(max_tokens_per_gpu=64)  # one Megatron iteration = one step
    assert calls["kw"]["forward_backward_func"] is inner and calls["kw"]["loss_mode"] == "sample_mean"
    assert "num_microbatches" not in calls["kw"] and calls["kw"]["force_all_reduce"] is False
    with pytest.raises(DynBatchConfigError, match="--eval-iters"):
        fb(forward_step_func=None, data_iterator=iter([batch]), model=None, num_microbatches=1, forward_only=True)
    with pytest.raises(DynBatchConfigError, match="whole global batch"):
        fb(forward_step_func=None, data_iterator=iter([{"tokens": [1]}]), model=None, num_microbatches=1)


def test_install_patches_one_attribute_and_restores_it():
    def real_get_forward_backward_func(**kw):
        return "real-schedule"

    module = types.SimpleNamespace(get_forward_backward_func=real_get_forward_backward_func)
    args = types.SimpleNamespace()
    restore = ml.install(module, get_args=lambda: args, validate=False)
    fb = module.get_forward_backward_func()
    assert isinstance(fb, ml.DynamicForwardBackward) and fb.inner == "real-schedule" and fb.args is args
    ml.install(module, get_args=lambda: args, validate=False)  # idempotent: wraps the real function, not the wrapper
    assert module.get_forward_backward_func().inner == "real-schedule"
    restore()
    assert module.get_forward_backward_func is real_get_forward_backward_func
    with pytest.raises(RuntimeError, match="get_forward_backward_func"):
        ml.install(types.SimpleNamespace(), get_args=lambda: args)


def test_install_validates_the_flags_when_train_fetches_the_schedule():
    module = types.SimpleNamespace(get_forward_backward_func=lambda: "real-schedule")
    current = {"args": _valid_args()}
    restore = ml.install(module, get_args=lambda: current["args"])
    try:
        assert module.get_forward_backward_func().inner == "real-schedule"
        current["args"] = _valid_args()
        current["args"].eval_iters = 10
        with pytest.raises(DynBatchConfigError, match="--eval-iters"):
            module.get_forward_backward_func()
    finally:
        restore()


def test_install_on_real_megatron_training_when_available():
    training = pytest.importorskip("megatron.training.training")  # Megatron-LM checkout on PYTHONPATH
    restore = ml.install(training, get_args=lambda: types.SimpleNamespace(), validate=False)
    try:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        assert training.get_forward_backward_func._dynbatch_original is get_forward_backward_func
    finally:
        restore()


def test_wrapper_runs_a_real_megatron_schedule_on_cpu(megatron_world1):
    """The wrapper around megatron-core's real forward_backward_func, one gloo rank: Megatron's loss dicts
    carry the exact step loss that dynamic_forward_backward computed."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dynbatch.demo import synthetic_rl_batch
    from megatron_dynbatch.core.model_spec import ModelSpec
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    config = megatron_cpu.tiny_gpt_config()
    torch.manual_seed(0)
    model = megatron_cpu.build_tiny_gpt(config, vocab_size=128, thd=True)
    spec = ModelSpec.from_megatron(config, vocab_size=128)
    args = types.SimpleNamespace(dynbatch_loss_mode="token_mean", dynbatch_group_reduce="token", eval_iters=0)
    fb = ml.DynamicForwardBackward(get_forward_backward_func(), args, plan_options=lambda a: {
        "model": spec, "parallel": {"dp": 1}, "max_tokens_per_gpu": 96, "samples_per_step": 8})
    samples = synthetic_rl_batch(8, seed=1)
    out = fb(forward_step_func=None, data_iterator=iter([samples]), model=[model], num_microbatches=8,
             seq_length=1024, micro_batch_size=1, forward_only=False)
    res = fb.last_result
    assert res.num_microbatches >= 2 and len(out) == res.num_microbatches
    assert all(d["lm loss"].item() == pytest.approx(res.loss) for d in out)
    assert any(p.grad is not None or getattr(p, "main_grad", None) is not None for p in model.parameters())


def _documented_lines(doc: Path) -> str:
    """The python block of ``doc`` that imports megatron_dynbatch.integrations.megatron_lm (the lines a user adds)."""
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.DOTALL)
    found = [b for b in blocks if "from megatron_dynbatch.integrations.megatron_lm import" in b]
    assert found, f"{doc.name} shows no megatron_lm lines"
    return found[0]


@pytest.mark.parametrize("doc", ["quickstart.md", "integration.md"])
def test_documented_megatron_lm_lines_drive_a_real_schedule(doc, megatron_world1, monkeypatch):
    """The exact lines of the docs, executed with a stand-in for Megatron-LM (``megatron.training`` with
    ``get_args`` and ``training.get_forward_backward_func``, and a ``pretrain`` that does what Megatron-LM's
    does with them: parse the extra args, apply ``args_defaults``, build the datasets, fetch the schedule once
    and call it per iteration with the fixed micro-batch count) around megatron-core's REAL schedule and a
    tiny GPT on one CPU rank."""
    import argparse
    from functools import partial

    import megatron
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dynbatch.megatron import cpu as megatron_cpu

    state: dict = {}
    training = types.ModuleType("megatron.training.training")
    training.get_forward_backward_func = get_forward_backward_func
    package = types.ModuleType("megatron.training")
    package.training = training
    package.get_args = lambda: state["args"]
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    monkeypatch.setattr(megatron, "training", package, raising=False)

    cli = ["--use-dynamic-batch-size", "--balance-by-flops", "--max-tokens-per-gpu", "96", "--dynbatch-mock-data",
           "--dynbatch-mock-max-length", "64"]
    megatron_args = dict(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
                         num_query_groups=2, ffn_hidden_size=128, swiglu=True, padded_vocab_size=128,
                         tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                         data_parallel_size=1, world_size=1, micro_batch_size=1, global_batch_size=8, eval_iters=0,
                         seq_length=64, seed=1234, consumed_train_samples=0)

    def pretrain(datasets_provider, model_provider, model_type, forward_step_func, args_defaults=None,
                 extra_args_provider=None, **_):
        parser = argparse.ArgumentParser()
        parser.add_argument("--dataloader-type", default=None)
        args = extra_args_provider(parser).parse_args(cli)
        for key, value in megatron_args.items():
            setattr(args, key, value)
        for key, value in (args_defaults or {}).items():  # Megatron: defaults fill what the command line left None
            if getattr(args, key, None) is None:
                setattr(args, key, value)
        state["args"] = args
        model = model_provider()
        assert getattr(datasets_provider, "is_distributed", False)
        train_iter, _, _ = datasets_provider([8, 0, 0])
        fb = training.get_forward_backward_func()  # train(): fetched once
        state["fb"], state["losses"] = fb, []
        for _ in range(2):  # train_step(): the fixed count is ignored by the hook
            out = fb(forward_step_func=forward_step_func, data_iterator=train_iter, model=[model],
                     num_microbatches=args.global_batch_size, seq_length=args.seq_length, micro_batch_size=1,
                     decoder_seq_length=None, forward_only=False)
            state["losses"].append([d["lm loss"].item() for d in out])

    def model_provider(builder, pre_process=True, post_process=True, vp_stage=None):
        torch.manual_seed(0)
        return builder(megatron_cpu.tiny_gpt_config(), vocab_size=128, thd=True)

    def forward_step(data_iterator, model):  # the user's own forward step: must not be called
        raise AssertionError("the hook must use its own packed-THD forward step")

    lines = _documented_lines(ROOT / "docs" / doc)
    exec(compile(lines, f"docs/{doc}", "exec"), {"pretrain": pretrain, "partial": partial, "ModelType": ModelType,
                                                 "model_provider": model_provider,
                                                 "gpt_builder": megatron_cpu.build_tiny_gpt,
                                                 "forward_step": forward_step})
    assert state["args"].dataloader_type == "external"
    assert isinstance(state["fb"], ml.DynamicForwardBackward)
    res = state["fb"].last_result
    assert len(state["losses"]) == 2 and len(state["losses"][-1]) == res.num_microbatches >= 1
    assert all(v == pytest.approx(res.loss) for v in state["losses"][-1])
    assert 3.0 < state["losses"][0][0] < 6.0  # ~ln(128) for an untrained model


def test_install_counts_flops_from_the_real_lengths_of_the_last_batch():
    """Megatron-LM's num_floating_point_operations(args, batch_size) assumes --seq-length per sample; after a
    hooked step the patched one returns the step's FLOPs from its real lengths (fwd+bwd), and restore() undoes it."""
    from megatron_dynbatch.core.flops import calculate_fwd_flops

    def megatron_flops(args, batch_size):
        return 1.0e9 * batch_size

    module = types.SimpleNamespace(get_forward_backward_func=lambda: "real-schedule",
                                   num_floating_point_operations=megatron_flops)
    restore = ml.install(module, get_args=lambda: types.SimpleNamespace(), validate=False)
    try:
        assert module.num_floating_point_operations(None, 4) == 4.0e9  # before any step: Megatron's own
        fb = module.get_forward_backward_func()
        fb.last_lengths, fb.last_model = [10, 300, 7], "qwen3-0.6b"
        want = 3 * calculate_fwd_flops([10, 300, 7], "qwen3-0.6b")
        assert module.num_floating_point_operations(None, 3) == pytest.approx(want)
        ml.install(module, get_args=lambda: types.SimpleNamespace(), validate=False)  # idempotent
        assert module.num_floating_point_operations._dynbatch_original is megatron_flops
    finally:
        restore()
    assert module.num_floating_point_operations is megatron_flops
