"""Properties of the budget that chooses itself (``core.memory.choose_budget``): it grows with the card, the log-prob
budget is at least the training one, the model's own peak at the budget fits and one step more does not, every
call (every rank) gets the same answer, hostile input gets a clear error, and it is fast."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynbatch import DynBatchConfigError
from megatron_dynbatch.core.memory import GiB, MemorySettings, choose_budget, peak_memory, settings_from_megatron
from megatron_dynbatch.core.memory.budget import MAX_GPU_MEMORY_GB
from megatron_dynbatch.core.model_spec import ModelSpec

MODELS = ("tiny-gpt", "qwen3-0.6b", "qwen3-8b", "llama-3.1-8b", "qwen3-32b", "llama-3.1-70b", "qwen3-30b-a3b")
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    model = draw(st.sampled_from(MODELS))
    tp = draw(st.sampled_from((1, 2, 4, 8)))
    layers = ModelSpec.from_any(model).num_layers
    pp = draw(st.sampled_from([x for x in (1, 2, 4) if x <= layers]))
    vpp = draw(st.sampled_from([v for v in (1, 2) if pp * v <= layers])) if pp > 1 else 1
    par = {"dp": draw(st.integers(1, 16)), "tp": tp, "pp": pp, "vpp": vpp, "cp": draw(st.sampled_from((1, 2, 4))),
           "sequence_parallel": tp > 1 and draw(st.booleans())}
    if model == "qwen3-30b-a3b":
        par["ep"] = draw(st.sampled_from((1, 2, 4, 8)))
    mem = MemorySettings(optimizer=draw(st.sampled_from(("distributed", "replicated", "cpu_offload"))),
                         recompute=draw(st.sampled_from(("none", "selective", "full"))),
                         moe_imbalance=draw(st.sampled_from((1.0, 1.5))),
                         headroom=draw(st.sampled_from((0.0, 0.1, 0.2))), reserve_gb=draw(st.sampled_from((0, 2, 4))))
    card = draw(st.floats(8.0, 2048.0))
    return model, par, mem, card


def _budget(model, par, card, **kw):
    try:
        return choose_budget(model, par, card, **kw)
    except DynBatchConfigError as exc:
        assert exc.field == "gpu_memory_gb" and "Fix:" in str(exc) and exc.fix
        return None


@SETTINGS
@given(cases(), st.floats(1.0, 4.0))
def test_budget_grows_with_the_card_and_log_prob_is_at_least_train(case, factor):
    model, par, mem, card = case
    small = _budget(model, par, card, settings=mem)
    big = _budget(model, par, card * factor, settings=mem)
    if small is not None:
        assert big is not None and big.tokens_per_gpu >= small.tokens_per_gpu
        lp = _budget(model, par, card, settings=mem, pass_="log_prob")
        assert lp is not None and lp.tokens_per_gpu >= small.tokens_per_gpu


@SETTINGS
@given(cases(), st.sampled_from(("train", "log_prob")), st.sampled_from((1, 64, 256)))
def test_the_budget_fits_what_the_model_predicts_and_is_the_largest(case, pass_, multiple):
    model, par, mem, card = case
    c = _budget(model, par, card, settings=mem, pass_=pass_, multiple=multiple)
    if c is None:
        return
    usable = card * GiB * (1 - mem.headroom)
    assert c.tokens_per_gpu % multiple == 0 and c.tokens_per_gpu >= multiple
    at = peak_memory(model, par, c.tokens_per_gpu, settings=mem, pass_=pass_)
    assert at.peak_bytes <= usable * (1 + 1e-12)
    assert at.peak_bytes == pytest.approx(c.breakdown.peak_bytes)
    above = peak_memory(model, par, c.tokens_per_gpu + multiple, settings=mem, pass_=pass_)
    assert above.peak_bytes > usable * (1 - 1e-9)
    # every rank computes the same budget: repeated calls, NumPy scalars and mapping settings agree
    again = choose_budget(model, par, np.float64(card), settings=mem.to_dict(), pass_=pass_,
                          multiple=np.int64(multiple))
    assert again == c and again.tokens_per_gpu == c.tokens_per_gpu


@pytest.mark.parametrize("card", [None, 0, -5, float("nan"), float("inf"), 1e30, MAX_GPU_MEMORY_GB * 2, True, "80",
                                  [80], np.float32(-1)])
def test_hostile_card_sizes_are_refused_clearly(card):
    with pytest.raises(DynBatchConfigError) as exc:
        choose_budget("qwen3-8b", {"dp": 8}, card)
    assert exc.value.field == "gpu_memory_gb" and "GiB" in exc.value.fix


@pytest.mark.parametrize("kw", [{"multiple": 0}, {"multiple": 2.5}, {"pass_": "eval"}, {"settings": "fast"},
                                {"settings": {"headroom": 1.5}}, {"profile": 3}])
def test_hostile_options_are_refused_clearly(kw):
    with pytest.raises(DynBatchConfigError):
        choose_budget("qwen3-8b", {"dp": 8}, 80, **kw)


def test_a_stage_without_layers_is_refused():
    with pytest.raises(DynBatchConfigError, match="stage without layers"):
        choose_budget("tiny-gpt", {"pp": 2, "vpp": 2}, 80)


def test_a_huge_card_is_capped_not_overflowed():
    c = choose_budget("tiny-gpt", None, MAX_GPU_MEMORY_GB)
    assert 0 < c.tokens_per_gpu <= 2 ** 40 and math.isfinite(c.breakdown.peak_bytes)
    assert choose_budget("qwen3-8b", {"dp": 8}, np.float32(80)).tokens_per_gpu == \
        choose_budget("qwen3-8b", {"dp": 8}, 80).tokens_per_gpu


def test_the_budget_is_closed_form(memory_model_calls):
    """No search over budgets: one evaluation of the memory model per call, whatever the layout (pp=16 here), and
    the chosen budget is the exact fit rounded down to the multiple, at most one multiple lower for float
    rounding. (Its time, ~ms, is measured by ``benchmarks/memory_speed.py``.)"""
    par = {"dp": 8, "pp": 16, "vpp": 2, "ep": 64}
    mem = {"recompute": "full"}
    c = choose_budget("llama-3.1-70b", par, 141, settings=mem)
    assert len(memory_model_calls) == 1
    assert c.exact_tokens // c.multiple * c.multiple - c.tokens_per_gpu in (0, c.multiple)


def test_settings_from_megatron_flags_and_args():
    s = settings_from_megatron(["--recompute-granularity", "full", "--use-distributed-optimizer",
                                "--optimizer-cpu-offload", "--expert-tensor-parallel-size", "2"])
    assert (s.recompute, s.optimizer, s.expert_tensor_parallel_size, s.param_dtype) == ("full", "cpu_offload", 2,
                                                                                        "bf16")
    assert settings_from_megatron([]).optimizer == "replicated"
    assert settings_from_megatron(["--use-distributed-optimizer", "--fp16"], headroom=0.2).param_dtype == "fp16"
    import argparse

    ns = argparse.Namespace(recompute_granularity="selective", use_distributed_optimizer=True, bf16=True, fp16=False,
                            untie_embeddings_and_output_weights=False, optimizer_cpu_offload=False)
    s = settings_from_megatron(ns)
    assert (s.recompute, s.optimizer, s.untie_embeddings) == ("selective", "distributed", False)


def test_the_speed_benchmark_runs_every_case():
    """``benchmarks/memory_speed.py`` (where the memory model's timings live) runs each case; its targets are
    the benchmark's verdict, not this test's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_speed.py"
    spec = importlib.util.spec_from_file_location("memory_speed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.measure(1)
    assert [r["case"] for r in rows] == ["choose_budget", "start-up check", "guard observe"]
    assert all(r["median_s"] >= 0 and r["target_s"] > 0 for r in rows)
