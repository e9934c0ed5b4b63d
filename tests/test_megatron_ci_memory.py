"""The memory model against peaks measured outside this project: Megatron-LM's CI golden values on DGX H100.

``tests/data/megatron_ci_memory.json`` holds, per functional test case of Megatron-LM, the measured
``mem-allocated-bytes`` (static: weights, gradients, optimizer state -- logged after the optimizer step) and
``mem-max-allocated-bytes`` of the last rank, the launch flags of its ``model_config.yaml`` and where each number
comes from (file, commit). ``benchmarks/megatron_ci_memory.py`` turns the flags into a model, a layout and memory
settings with the package's own readers and predicts the last stage's static and dynamic (peak - static) bytes.

Target: every prediction within -3% / +10% of the measurement (under is an OOM, over is speed thrown away). Where a
case is outside it and no physically justified term explains the gap, :data:`KNOWN_GAPS` records the ratio and why
-- never a per-case factor -- and the test pins the ratio (+-0.01) so a change to the model shows up here.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from megatron_dynbatch.core.memory import MemorySettings


ROOT = Path(__file__).resolve().parents[1]
LOW, HIGH = 0.97, 1.10

#: (case, "static" | "dynamic") -> (the ratio ours / measured, why it is outside LOW..HIGH)
KNOWN_GAPS = {
    ("gpt3_7b_tp1_pp4_memory_speed", "static"): (
        0.942, "1.45 GB of the last stage's measured static memory is not weights, gradients or Adam state as "
               "Megatron-LM's own estimator counts them either (it predicts the same 23.36 GB); not explained"),
    ("mixtral_8x7b_tp1pp4ep8vpp8_release", "static"): (
        0.945, "the number of GPUs is not in the repository (dp inferred as the nearest power of two); Megatron-"
               "LM's estimator predicts the same 18.66 GB"),
    ("gpt3_mcore_te_tp1_pp1_resume_torch_dist_uniform_full_recompute", "static"): (
        0.907, "0.11 GB more than 18 bytes per parameter (replicated optimizer) on a 64M-parameter model -- about 4 "
               "bytes per embedding parameter; Megatron-LM's estimator is as low (0.908)"),
    ("mixtral_8x7b_alltoall_tp2pp4ep4_release", "dynamic"): (
        0.881, "the run's highest peak (iteration 20: early-training routing imbalance, 1.41 on the measured GPU's "
               "experts, above the default moe_imbalance 1.1); against the median of its ~4500 logged iterations "
               "1.001 (steady state 1.10). On a GPU the first-step memory probe and the online memory guard cover "
               "such a peak"),
}


def _script():
    spec = importlib.util.spec_from_file_location("megatron_ci_memory", ROOT / "benchmarks" / "megatron_ci_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ci():
    mod = _script()
    return mod, {r["case"]: r for r in mod.rows()}


def test_the_data_names_its_source_and_covers_the_cases_the_issue_asks_for(ci):
    mod, rows = ci
    data = mod.load()
    assert data["source"]["repo"] == "NVIDIA/Megatron-LM" and len(data["source"]["snapshot_commit"]) == 40
    for c in data["cases"]:
        assert len(c["golden_commit"]) == 40 and c["files"]["golden"].endswith("golden_values_dev_dgx_h100.json")
        assert c["mem_max_allocated_bytes"] > c["mem_allocated_bytes"] > 0 and c["vocab_source"]
    assert len(rows) >= 6
    argv = {c["case"]: c["argv"] for c in data["cases"]}
    kinds = {
        "dense with SP": [k for k, a in argv.items() if "--sequence-parallel" in a and "--num-experts" not in a],
        "dense without SP with dropout": [k for k, a in argv.items() if "--sequence-parallel" not in a
                                          and "--hidden-dropout" not in a and "--num-experts" not in a],
        "PP with VPP": [k for k, a in argv.items() if "--num-layers-per-virtual-pipeline-stage" in a
                        and "--num-experts" not in a],
        "MoE expert TP 1": [k for k, r in rows.items() if "etp1" in r["layout"] and "ep" in r["layout"]],
        "MoE expert TP 2": [k for k, a in argv.items() if "--num-experts" in a
                            and "--expert-tensor-parallel-size" not in a and rows[k]["layout"].startswith("tp2")],
        "full recompute": [k for k, a in argv.items() if "full" in a],
    }
    assert all(kinds.values()), kinds


@pytest.mark.parametrize("part", ["static", "dynamic"])
def test_predictions_are_within_minus_3_plus_10_percent_or_a_recorded_gap(ci, part):
    _, rows = ci
    bad = []
    for case, r in rows.items():
        ratio = r[f"{part}_ratio"]
        gap = KNOWN_GAPS.get((case, part))
        if gap is not None:
            assert ratio == pytest.approx(gap[0], abs=0.01), f"{case} {part}: {ratio:.3f}, recorded {gap[0]} -- " \
                "update KNOWN_GAPS (and docs/tuning.md) if the model improved"
            assert not LOW <= ratio <= HIGH, f"{case} {part} is now within the target: drop it from KNOWN_GAPS"
        elif not LOW <= ratio <= HIGH:
            bad.append(f"{case}: {part} {ratio:.3f}")
    assert not bad, bad


def test_the_new_terms_are_what_brings_the_cases_in(ci):
    """Without the dropout masks the 7B TP=4 case is 0.87 of measured (the figure the issue started from); counting
    every routed copy on every TP rank over-predicts the expert-TP-1 Mixtral case by far (1.79 at the default
    moe_imbalance 1.1; 1.77 with the old count at 1.0)."""
    _, rows = ci
    assert rows["gpt3_7b_tp4_pp1_memory_speed"]["ratio_without_dropout"] == pytest.approx(0.873, abs=0.01)
    assert rows["gpt3_7b_tp4_pp1_memory_speed"]["dropout_bytes"] > 0.1 * \
        rows["gpt3_7b_tp4_pp1_memory_speed"]["measured_dynamic"]
    # tp 2, expert TP 1: one GPU's experts hold half the routed copies
    assert rows["mixtral_8x7b_tp1pp4ep8vpp8_release"]["ratio_routed_on_every_tp_rank"] > 1.6


def test_one_routing_imbalance_brings_both_moe_cases_in(ci):
    """The MoE gaps are routing imbalance on the measured GPU's experts: with one value for both cases (the script's
    MOE_IMBALANCE, 1.1 -- the default of ``MemorySettings.moe_imbalance``, not a per-case factor) the expert-TP-1
    case and the expert-TP-2 case's typical iteration are within the target; its early-training peak needs 1.41."""
    mod, rows = ci
    assert mod.MOE_IMBALANCE == 1.1 == MemorySettings().moe_imbalance
    assert rows["mixtral_8x7b_tp1pp4ep8vpp8_release"]["imbalance_needed"] == pytest.approx(1.09, abs=0.01)
    assert rows["mixtral_8x7b_alltoall_tp2pp4ep4_release"]["imbalance_needed_median"] == pytest.approx(1.10, abs=0.01)
    one, two = rows["mixtral_8x7b_tp1pp4ep8vpp8_release"], rows["mixtral_8x7b_alltoall_tp2pp4ep4_release"]
    assert LOW <= one["dynamic_ratio_imbalanced"] <= HIGH and LOW <= two["dynamic_median_ratio_imbalanced"] <= HIGH
    assert two["imbalance_needed"] == pytest.approx(1.41, abs=0.02)
    for r in rows.values():  # dense cases: the setting changes nothing
        if not r["routed_bytes"]:
            assert r["dynamic_ratio_imbalanced"] == pytest.approx(r["dynamic_ratio"])


def test_megatron_lms_own_estimator_is_further_off(ci):
    """Megatron-LM's ``theoretical_memory_usage.py`` (re-derived in the script) on the same cases: the same static
    count, but no term for the last stage's logits under PP, MoE experts or sequence parallelism without selective
    recompute -- its worst dynamic ratio is far outside the target, ours is not."""
    _, rows = ci
    worst = lambda key: max(abs(math.log(r[key])) for r in rows.values())  # noqa: E731
    assert worst("megatron_dynamic_ratio") > worst("dynamic_ratio")
    assert max(r["megatron_dynamic_ratio"] for r in rows.values()) > 2.0
    for r in rows.values():
        assert r["megatron_static_ratio"] == pytest.approx(r["static_ratio"], abs=0.01)
