"""Command-line flags: parsing with a plain argparse parser, validation errors, Megatron-args conversions."""

from __future__ import annotations

import argparse

import pytest

from megatron_dynbatch import ModelSpec, ParallelConfig
from megatron_dynbatch.megatron.args import (
    add_dynamic_batch_args,
    fp8_alignment_from_args,
    model_spec_from_args,
    parallel_from_args,
    plan_options_from_args,
    validate_dynamic_batch_args,
)
from megatron_dynbatch.core.errors import DynBatchConfigError


def megatron_like_parser() -> argparse.ArgumentParser:
    """A few of Megatron's own flags (same names and defaults) + ours via extra_args_provider."""
    p = argparse.ArgumentParser()
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=1000)
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall", "flex"])
    p.add_argument("--fp8-format", dest="fp8", default=None, choices=["e4m3", "hybrid"])
    p.add_argument("--fp8-recipe", default="delayed")
    p.add_argument("--fp4-format", dest="fp4", default=None)
    extra = add_dynamic_batch_args(p)
    assert extra is p  # extra_args_provider contract: the parser comes back
    return p


def parse(*argv: str, world_size: int = 8) -> argparse.Namespace:
    args = megatron_like_parser().parse_args(list(argv))
    args.world_size = world_size
    return args


def test_defaults_and_parsing():
    args = parse()
    assert args.use_dynamic_batch_size is False and args.max_tokens_per_gpu is None
    assert args.balance_by_flops is False and args.dynbatch_oversize == "error"
    assert args.dynbatch_loss_mode == "token_mean" and args.dynbatch_cost_model is None
    args = parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--balance-by-flops",
                 "--dynbatch-oversize", "alone", "--dynbatch-loss-mode", "sample_mean",
                 "--dynbatch-samples-per-step", "64", "--dynbatch-fp8-alignment", "mxfp8")
    validate_dynamic_batch_args(args)
    assert args.log_probs_max_tokens_per_gpu == 4096  # defaults to the training budget
    assert args.dynbatch_fp8_alignment == "mxfp8"
    assert parse("--dynbatch-loss-mode", "group_mean").dynbatch_loss_mode == "group_mean"
    with pytest.raises(SystemExit):
        megatron_like_parser().parse_args(["--dynbatch-loss-mode", "median"])


def test_log_probs_budget_kept_when_given():
    args = parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--log-probs-max-tokens-per-gpu", "16384")
    validate_dynamic_batch_args(args)
    assert args.log_probs_max_tokens_per_gpu == 16384
    assert plan_options_from_args(args, forward_only=True).max_tokens_per_gpu == 16384
    assert plan_options_from_args(args).max_tokens_per_gpu == 4096


def test_balance_by_flops_needs_dynamic_batching():
    with pytest.raises(DynBatchConfigError) as e:
        validate_dynamic_batch_args(parse("--balance-by-flops"))
    assert e.value.field == "--balance-by-flops" and "--use-dynamic-batch-size" in e.value.fix


def test_dynamic_batching_needs_budget():
    with pytest.raises(DynBatchConfigError) as e:
        validate_dynamic_batch_args(parse("--use-dynamic-batch-size"))
    assert e.value.field == "--max-tokens-per-gpu" and "--max-tokens-per-gpu" in e.value.fix


@pytest.mark.parametrize("argv, flag", [
    (["--context-parallel-size", "4", "--max-tokens-per-gpu", "1"], "--max-tokens-per-gpu"),  # 2*cp = 8 > 4
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--dynbatch-fp8-alignment", "nvfp4",
      "--max-tokens-per-gpu", "64"], "--max-tokens-per-gpu"),  # micro-batch multiple 128
    (["--fp8-format", "hybrid", "--max-tokens-per-gpu", "8"], "--max-tokens-per-gpu"),  # FP8 tile 16
    (["--max-tokens-per-gpu", "4096", "--log-probs-max-tokens-per-gpu", "8", "--fp8-format", "e4m3"],
     "--log-probs-max-tokens-per-gpu"),
])
def test_budget_smaller_than_one_aligned_sequence(argv, flag):
    with pytest.raises(DynBatchConfigError) as e:
        validate_dynamic_batch_args(parse("--use-dynamic-batch-size", *argv))
    assert e.value.field == flag and ">=" in e.value.fix


def test_budget_exactly_one_aligned_sequence_is_fine():
    args = parse("--use-dynamic-batch-size", "--context-parallel-size", "2", "--max-tokens-per-gpu", "2")
    validate_dynamic_batch_args(args)  # cap = 4 = 2*cp


@pytest.mark.parametrize("layout", [["--pipeline-model-parallel-size", "2"], ["--expert-model-parallel-size", "2"]])
def test_moe_allgather_dispatcher_refused(layout):
    argv = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--num-experts", "8", *layout]
    with pytest.raises(DynBatchConfigError) as e:
        validate_dynamic_batch_args(parse(*argv))
    assert e.value.field == "--moe-token-dispatcher-type" and "alltoall" in e.value.fix
    validate_dynamic_batch_args(parse(*argv, "--moe-token-dispatcher-type", "alltoall"))
    validate_dynamic_batch_args(parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--num-experts", "8"))


def test_fp8_alignment_resolution():
    assert fp8_alignment_from_args(parse()) is None
    assert fp8_alignment_from_args(parse("--fp8-format", "hybrid")) == "fp8"
    assert fp8_alignment_from_args(parse("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8")) == "mxfp8"
    assert fp8_alignment_from_args(parse("--fp8-format", "e4m3", "--fp8-recipe", "blockwise")) == "blockwise"
    assert fp8_alignment_from_args(parse("--fp4-format", "e2m1")) == "nvfp4"
    assert fp8_alignment_from_args(parse("--dynbatch-fp8-alignment", "64")) == 64
    assert fp8_alignment_from_args(parse("--fp8-format", "hybrid", "--dynbatch-fp8-alignment", "none")) is None
    args = parse("--fp8-format", "hybrid", "--dynbatch-fp8-alignment", "none")
    validate_dynamic_batch_args(args)
    assert fp8_alignment_from_args(args) is None  # the explicit choice survives validation
    with pytest.raises(DynBatchConfigError) as e:
        fp8_alignment_from_args(parse("--dynbatch-fp8-alignment", "fp7"))
    assert e.value.field == "--dynbatch-fp8-alignment"


def test_other_value_errors(tmp_path):
    with pytest.raises(DynBatchConfigError, match="--max-tokens-per-gpu"):
        validate_dynamic_batch_args(parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "0"))
    with pytest.raises(DynBatchConfigError, match="--dynbatch-samples-per-step"):
        validate_dynamic_batch_args(parse("--dynbatch-samples-per-step", "0"))
    with pytest.raises(DynBatchConfigError, match="--dynbatch-cost-model"):
        validate_dynamic_batch_args(parse("--dynbatch-cost-model", str(tmp_path / "missing.json")))
    f = tmp_path / "cm.json"
    f.write_text("{}")
    args = validate_dynamic_batch_args(parse("--dynbatch-cost-model", str(f)))
    assert args.dynbatch_cost_model == str(f)  # accepted and stored


def test_parallel_from_args():
    args = parse("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--context-parallel-size", "2", "--expert-model-parallel-size", "4", "--sequence-parallel",
                 "--virtual-pipeline-model-parallel-size", "2", world_size=32)
    par = parallel_from_args(args)
    assert par == ParallelConfig(dp=4, tp=2, pp=2, cp=2, ep=4, vpp=2, sequence_parallel=True)
    args.data_parallel_size = 3  # Megatron's own value wins
    assert parallel_from_args(args).dp == 3
    args = parse("--pipeline-model-parallel-size", "2", "--num-layers", "8",
                 "--num-layers-per-virtual-pipeline-stage", "2", world_size=4)
    assert parallel_from_args(args).vpp == 2 and parallel_from_args(args).dp == 2
    with pytest.raises(DynBatchConfigError, match="world_size"):
        parallel_from_args(parse("--tensor-model-parallel-size", "3", world_size=8))


def test_parallel_from_args_without_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # another test may own a world of one
    ns = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, context_parallel_size=1)
    with pytest.raises(DynBatchConfigError, match="data_parallel_size"):
        parallel_from_args(ns)
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert parallel_from_args(ns).dp == 4


def test_model_spec_and_plan_options():
    args = parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "512", "--balance-by-flops",
                 "--dynbatch-samples-per-step", "8", world_size=2)
    args.swiglu = True
    validate_dynamic_batch_args(args)
    spec = model_spec_from_args(args)
    assert isinstance(spec, ModelSpec) and spec.num_layers == 4 and spec.hidden_size == 256 and spec.swiglu
    opts = plan_options_from_args(args)
    assert opts.parallel.dp == 2 and opts.balance_by == "time" and opts.samples_per_step == 8
    from megatron_dynbatch import plan_global_batch

    plan = plan_global_batch([100, 200, 50, 400, 30, 60, 70, 80] * 2, opts)
    assert plan.microbatches_per_step and len(plan.microbatches_per_step) == 2
