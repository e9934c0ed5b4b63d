"""``auto`` that cannot place a sample (issue 32 item 5; core/memory/auto_fit.py): the error says that auto chose N
on this card, what limits it, and the ways out that fit -- never "raise the budget" past what fits -- in the
planner, at start-up (RunConfig ``max_seq_len``, Megatron's ``--seq-length``), and a Plan made with ``auto``
carries its BudgetChoice (summary and the ``plan`` header: "auto, limited by ...").

Numbers are read from the memory model at test time (never hard-coded: the model's terms may change)."""

from __future__ import annotations

import argparse

import pytest

from megatron_dynbatch import ModelSpec, PlanOptions, RunConfig, plan_global_batch
from megatron_dynbatch.core.errors import OversizeSampleError
from megatron_dynbatch.core.memory import choose_budget

AUTO = {"max_tokens_per_gpu": "auto", "model": "qwen3-8b", "parallel": {"dp": 8}, "gpu_memory_gb": 79.1}


def _no_raise_advice(text: str) -> None:
    assert "raise max_tokens_per_gpu" not in text and "raise --max-tokens-per-gpu" not in text
    assert "to at least" not in text


def test_the_planner_says_what_auto_chose_and_the_ways_out():
    opts = PlanOptions(**AUTO)
    resolved = opts.resolve()
    n = resolved.max_tokens_per_gpu
    with pytest.raises(OversizeSampleError) as exc:
        plan_global_batch([100] * 15 + [4 * n], opts)
    text = str(exc.value)
    assert exc.value.field == "max_tokens_per_gpu" and exc.value.value == "auto"
    assert f"auto chose {n} on this 79.1 GiB card" in text and f"limited by {resolved.budget_choice.limited_by}" in text
    assert "oversize='alone'" in text and "full recompute" in text and "tp=2" in text
    _no_raise_advice(text)
    # a way out named as one really fits: full recompute's auto budget is at least the sample's need
    full = choose_budget("qwen3-8b", {"dp": 8}, 79.1, settings={"recompute": "full"}).tokens_per_gpu
    assert (f"(auto then chooses {full} tokens per GPU" in text) == (full >= 4 * n)


def test_a_hand_set_budget_still_says_raise_it():
    with pytest.raises(OversizeSampleError, match="raise max_tokens_per_gpu to at least"):
        plan_global_batch([100, 5000], max_tokens_per_gpu=1024, model="qwen3-8b")


def test_a_sample_far_beyond_every_way_out_gets_no_false_promise():
    opts = PlanOptions(**AUTO)
    with pytest.raises(OversizeSampleError) as exc:
        plan_global_batch([100] * 7 + [1_000_000], opts)
    text = str(exc.value)
    fix = text.split("Fix:", 1)[1]
    ways, _, short = fix.partition("Not enough alone:")
    assert "full recompute" not in ways and "tp=2" not in ways and "a larger card:" not in ways
    assert "full recompute" in short and "larger card (it would take" in short and "oversize='alone'" in ways
    _no_raise_advice(text)


def test_a_plan_made_with_auto_carries_its_choice():
    opts = PlanOptions(**AUTO)
    plan = plan_global_batch([500] * 16, opts)
    assert plan.budget_choice == opts.resolve().budget_choice
    assert plan.summary()["budget"].startswith(f"auto, limited by {plan.budget_choice.limited_by} on stage ")
    assert plan.budget_words() == plan.summary()["budget"]
    given = plan_global_batch([500] * 16, max_tokens_per_gpu=2048, model="qwen3-8b", parallel={"dp": 8})
    assert given.budget_choice is None and "budget" not in given.summary() and given.budget_words() == "given"
    dyn = plan_global_batch([500] * 16, opts.replace(parallel={"dp": 4, "cp": 2}, dynamic_cp=True))
    assert dyn.budget_choice is not None and dyn.summary()["budget"].startswith("auto, limited by")


def test_the_plan_header_says_auto_limited_by(tmp_path, capsys):
    from megatron_dynbatch.cli import main

    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(["500"] * 16))
    assert main(["plan", "--lengths", str(lengths), "--max-tokens-per-gpu", "auto", "--model", "qwen3-8b", "--dp",
                 "8", "--gpu-memory-gb", "79.1"]) == 0
    n = PlanOptions(**AUTO).resolve().max_tokens_per_gpu
    out = capsys.readouterr().out
    assert f"budget: max_tokens_per_gpu={n} (auto, limited by " in out
    assert main(["plan", "--lengths", str(lengths), "--max-tokens-per-gpu", "auto", "--model", "qwen3-8b", "--dp",
                 "4", "--cp", "2", "--gpu-memory-gb", "79.1", "--dynamic-cp"]) == 0
    out = capsys.readouterr().out
    assert "per GPU (auto, limited by " in out.splitlines()[1]


def test_run_config_max_seq_len_against_auto():
    n = PlanOptions(**AUTO).resolve().max_tokens_per_gpu
    with pytest.raises(OversizeSampleError) as exc:
        RunConfig.from_dict({"name": "t", "model": "qwen3-8b", "parallel": {"world_size": 8},
                             "max_tokens_per_gpu": "auto", "gpu_memory_gb": 79.1, "max_seq_len": 4 * n,
                             "megatron_args": ["--use-distributed-optimizer", "--bf16"]})
    text = str(exc.value)
    assert f"max_seq_len={4 * n} needs" in text and f"auto chose {n}" in text and "lower max_seq_len" in text
    _no_raise_advice(text)


def test_megatron_seq_length_against_an_auto_budget():
    pytest.importorskip("torch")
    from megatron_dynbatch.megatron.args import add_dynamic_batch_args, validate_dynamic_batch_args

    n = PlanOptions(**AUTO).resolve().max_tokens_per_gpu
    ns = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "auto", "--dynbatch-gpu-memory-gb", "79.1"])
    spec = ModelSpec.from_any("qwen3-8b")
    for key, value in spec.to_dict().items():
        setattr(ns, key, value)
    ns.num_experts, ns.group_query_attention = spec.num_experts, True
    ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.context_parallel_size = 1, 1, 1
    ns.world_size, ns.seq_length, ns.bf16, ns.use_distributed_optimizer = 8, 4 * n, True, True
    with pytest.raises(OversizeSampleError) as exc:
        validate_dynamic_batch_args(ns)
    text = str(exc.value)
    assert text.startswith("--max-tokens-per-gpu='auto':") and f"--seq-length={4 * n} needs" in text
    assert "limited by" in text and "oversize='alone'" in text
    _no_raise_advice(text)
