"""The memory model (``megatron_dynbatch.core.memory``): each GPU's peak for the real layout, the profile (analytic
and fitted, in the cost-model file), the fit of measured slice peaks, the trainers' settings, and the legacy
``estimate_*`` front. Property tests of the budget are in test_memory_budget.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_dynbatch import DynBatchConfigError, ParallelConfig
from megatron_dynbatch.core.cost_files import load_cost_model, resolve_cost_model
from megatron_dynbatch.core.memory import (
    GiB,
    MemoryProfile,
    MemoryRecord,
    MemorySettings,
    check_memory_records,
    choose_budget,
    estimate_max_tokens_per_gpu,
    estimate_memory,
    fit_memory_records,
    layer_activation_bytes,
    load_memory_profile,
    memory_grid,
    parameter_counts,
    peak_memory,
    resolve_memory_profile,
    trainer_settings,
)
from megatron_dynbatch.core.model_spec import ModelSpec
from megatron_dynbatch.core.run_config import RunConfig


def _tiny(**kw) -> ModelSpec:
    d = dict(num_layers=1, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, vocab_size=128)
    d.update(kw)
    return ModelSpec.from_dict(d)


# ------------------------------------------------------------------------------------------- analytic bytes
def test_activation_count_reproduces_korthikanti_without_dropout():
    """Per token per layer, classic MHA + 4h GELU MLP, flash attention, no dropout: 32h bytes; with TP and no
    sequence parallelism 8h + 24h/t; with sequence parallelism 32h/t (plus fp32 softmax statistics)."""
    m, h = _tiny(hidden_dropout=0.0, attention_dropout=0.0), 1024
    stats = lambda t: 4.0 * 8 / t  # noqa: E731
    assert layer_activation_bytes(m, ParallelConfig(), 1, False, 1.0) == pytest.approx(32 * h + stats(1))
    tp4 = layer_activation_bytes(m, ParallelConfig(tp=4), 4, False, 1.0)
    assert tp4 == pytest.approx(8 * h + 24 * h / 4 + stats(4))
    sp = ParallelConfig(tp=4, sequence_parallel=True)
    assert layer_activation_bytes(m, sp, 4, False, 1.0) == pytest.approx(32 * h / 4 + stats(4))


def test_dropout_masks_give_korthikantis_34h_and_flash_keeps_no_attention_mask():
    """Megatron's default dropout (0.1): two 1-byte masks of h per token (after the attention projection and
    after the MLP) -- Korthikanti's 34h (10h + 24h/t without SP, 34h/t with it) less the s x s attention-dropout
    mask that flash / fused attention regenerates from its RNG state; attention dropout alone keeps nothing."""
    h = 1024
    stats = lambda t: 4.0 * 8 / t  # noqa: E731
    m = _tiny()
    assert (m.hidden_dropout, m.attention_dropout) == (0.1, 0.1)
    assert layer_activation_bytes(m, ParallelConfig(), 1, False, 1.0) == pytest.approx(34 * h + stats(1))
    assert layer_activation_bytes(m, ParallelConfig(tp=4), 4, False, 1.0) == pytest.approx(10 * h + 24 * h / 4
                                                                                          + stats(4))
    sp = ParallelConfig(tp=4, sequence_parallel=True)
    assert layer_activation_bytes(m, sp, 4, False, 1.0) == pytest.approx(34 * h / 4 + stats(4))
    only_attn = _tiny(hidden_dropout=0.0, attention_dropout=0.1)
    assert layer_activation_bytes(only_attn, ParallelConfig(), 1, False, 1.0) == pytest.approx(32 * h + stats(1))
    b = peak_memory(m, None, 4096, settings={"optimizer": "cpu_offload"})
    assert b.peak.dropout_bytes == pytest.approx(4096 * 2 * h) and "dropout masks" in b.summary()
    with pytest.raises(ValueError, match="hidden_dropout=1.5: must be a dropout probability"):
        _tiny(hidden_dropout=1.5)


def test_qk_layernorm_keeps_q_and_k_before_their_norms():
    m = ModelSpec.from_yaml("qwen3-8b")
    assert m.qk_layernorm and m.hidden_dropout == 0.0
    plain = m.replace(qk_layernorm=False)
    for p in (ParallelConfig(), ParallelConfig(tp=4)):
        extra = layer_activation_bytes(m, p, p.tp, False, 1.0) - layer_activation_bytes(plain, p, p.tp, False, 1.0)
        assert extra == pytest.approx(2.0 * (32 * 128 + 8 * 128) / p.tp)  # Q and K, bf16, split over TP
    assert "QK-norm inputs" in peak_memory(m, {"dp": 8}, 8192).summary()
    mla = ModelSpec.from_yaml("deepseek-v3")  # MLA: the q / kv latents before their norms
    extra = layer_activation_bytes(mla, ParallelConfig(), 1, False, 1.0) - \
        layer_activation_bytes(mla.replace(qk_layernorm=False), ParallelConfig(), 1, False, 1.0)
    assert extra == pytest.approx(2.0 * (1536 + 512))


def test_routed_experts_count_the_expert_tp_share_of_the_copies():
    """The alltoall dispatcher gathers over the expert-TP group only: with etp < tp one GPU's experts hold
    etp/tp of the micro-batch's routed copies (each copy's FFN part split over etp)."""
    m = ModelSpec.from_yaml("qwen3-30b-a3b")
    sp = ParallelConfig(tp=4, sequence_parallel=True, ep=8)
    from megatron_dynbatch.core.memory.analytic import layer_parts
    full, share = layer_parts(m, sp, 4, True, 1.0), layer_parts(m, sp, 1, True, 1.0)
    h, f, k = 2048, 768, 8
    assert full["routed"] == pytest.approx(k * (2 * h + 2 * (2 * f + f) / 4))
    assert share["routed"] == pytest.approx(k / 4 * (2 * h + 2 * (2 * f + f)))
    assert share["routed"] < full["routed"]
    b = peak_memory(m, sp, 8192, settings={"expert_tensor_parallel_size": 1, "optimizer": "cpu_offload"})
    assert "routed experts" in b.summary() and b.peak.routed_bytes > 0


def test_backward_transient_is_its_own_line_and_vocab_is_padded_for_tp():
    """On a stage without the LM head the backward's gradients (beside every kept activation) set the peak;
    the head's width is the vocabulary padded to make_vocab_size_divisible_by x tp, as Megatron pads it."""
    st = {"optimizer": "cpu_offload"}
    b = peak_memory("llama-3.1-8b", {"pp": 2}, 8192, settings=st)
    first, last = b.stages
    assert first.transient_bytes > 0 and "transient" in b.lines(0)[3]
    assert first.allocated_bytes == pytest.approx(first.static_bytes + first.activation_bytes
                                                  + first.transient_bytes)
    assert last.transient_bytes == 0 and last.logits_bytes > 0  # the head's moment is larger than the layer's
    m = ModelSpec.from_dict(dict(num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024,
                                 vocab_size=50257))
    assert m.padded_vocab_size == 50304 and m.padded_vocab_for(1) == 50304 and m.padded_vocab_for(8) == 51200
    assert parameter_counts(m, tp=8)["embedding"] == 51200 * 256
    tp8 = peak_memory(m, {"tp": 8}, 4096)
    assert tp8.padded_vocab_size == 51200 and "V padded to 51200" in tp8.summary()
    assert tp8.peak.logits_bytes == pytest.approx(4096 * (51200 / 8 * 6 + 2 * 256))


def test_parameter_count_and_fp32_logits_term():
    counts = parameter_counts("qwen3-8b")
    assert counts["total"] == pytest.approx(8.19e9, rel=0.01)
    assert parameter_counts("qwen3-30b-a3b")["total"] == pytest.approx(30.5e9, rel=0.02)
    assert parameter_counts("deepseek-v3")["total"] == pytest.approx(671e9, rel=0.02)
    # fp32 logits for the loss: 4 bytes x T x V/TP; Qwen3, TP=1, T=16384 -> ~10 GB (decimal)
    V = ModelSpec.from_yaml("qwen3-8b").padded_vocab_size
    assert 4 * 16384 * V == pytest.approx(10e9, rel=0.01)
    b = peak_memory("qwen3-8b", {"dp": 8}, 16384)
    assert b.peak.logits_bytes == pytest.approx(16384 * (V * 6 + 2 * 4096), rel=1e-9)
    two = peak_memory("qwen3-8b", {"dp": 8}, 16384, settings={"logits_fp32_copies": 2})
    assert two.peak.logits_bytes - b.peak.logits_bytes == pytest.approx(16384 * 4 * V, rel=1e-9)


# ------------------------------------------------------------------------------------------- the layout
def test_first_stage_holds_pp_microbatches_and_interleaving_adds_korthikantis_factor():
    st = MemorySettings(optimizer="cpu_offload")
    one = peak_memory("llama-3.1-70b", {"tp": 8, "dp": 1}, 4096, settings=st).stages[0].activation_bytes
    pp4 = peak_memory("llama-3.1-70b", {"tp": 8, "pp": 4}, 4096, settings=st)
    # stage s holds pp - s micro-batches of L/pp layers: the first about all L layers' worth
    for s, stage in enumerate(pp4.stages):
        assert stage.activation_bytes == pytest.approx(one * (4 - s) / 4, rel=1e-9)
    vpp = peak_memory("llama-3.1-70b", {"tp": 8, "pp": 4, "vpp": 5}, 4096, settings=st)
    assert vpp.stages[0].activation_bytes == pytest.approx(one * (1 + 3 / (4 * 5)), rel=1e-9)
    # the last stage of an interleaved pipeline holds (vpp-1)*N + 1 chunks, more than one stage's worth
    assert vpp.stages[-1].activation_bytes == pytest.approx(one * (4 * 4 + 1) / 20, rel=1e-9)


def test_which_stage_limits_logits_on_the_last_stage_activations_on_the_first():
    small = peak_memory("qwen3-0.6b", {"pp": 2}, 32768)  # V=151936 against hidden 1024: the logits dominate
    assert small.limiting_stage == 1 and small.stages[1].logits_bytes > small.stages[1].activation_bytes
    assert small.stages[0].logits_bytes == 0 and small.stages[0].activation_bytes > small.stages[1].activation_bytes
    big = peak_memory("llama-3.1-70b", {"tp": 8, "pp": 2}, 16384)
    assert big.limiting_stage == 0
    c = choose_budget("qwen3-0.6b", {"pp": 2}, 80)
    assert c.limiting_stage == 1 and "logits" in c.limited_by and "stage 1" in c.summary()


def test_tp_sp_cp_divide_what_they_divide():
    base = peak_memory("qwen3-8b", {"dp": 8}, 8192).peak
    tp2 = peak_memory("qwen3-8b", {"dp": 8, "tp": 2}, 8192).peak
    sp2 = peak_memory("qwen3-8b", {"dp": 8, "tp": 2, "sequence_parallel": True}, 8192).peak
    assert tp2.static_bytes < base.static_bytes / 1.9 and tp2.logits_bytes < base.logits_bytes / 1.9
    assert sp2.activation_bytes < tp2.activation_bytes < base.activation_bytes
    # CP: the same cost per token on a GPU; the distributed optimizer shards over dp x cp
    cp2 = peak_memory("qwen3-8b", {"dp": 4, "cp": 2}, 8192).peak
    assert cp2.activation_bytes == base.activation_bytes and cp2.static_bytes == base.static_bytes
    assert choose_budget("qwen3-8b", {"dp": 4, "cp": 2}, 80, settings={"recompute": "full"}).tokens_per_microbatch == \
        2 * choose_budget("qwen3-8b", {"dp": 8}, 80, settings={"recompute": "full"}).tokens_per_gpu


def test_recompute_optimizer_and_moe_settings_move_the_peak_the_right_way():
    def peak(model, par, **kw):
        return peak_memory(model, par, 8192, settings=kw).peak_bytes

    assert peak("qwen3-8b", {"dp": 8}, recompute="full") < peak("qwen3-8b", {"dp": 8})
    assert peak("qwen3-8b", {"dp": 8}, recompute="selective") == peak("qwen3-8b", {"dp": 8})
    assert peak("qwen3-8b", {"dp": 8}, optimizer="cpu_offload") < peak("qwen3-8b", {"dp": 8}) < \
        peak("qwen3-8b", {"dp": 8}, optimizer="replicated")
    assert peak("qwen3-30b-a3b", {"dp": 8, "ep": 8}, moe_imbalance=1.5) > peak("qwen3-30b-a3b", {"dp": 8, "ep": 8})
    assert peak("qwen3-30b-a3b", {"dp": 8, "ep": 8}) < peak("qwen3-30b-a3b", {"dp": 8, "ep": 4})
    assert peak("qwen3-8b", {"dp": 8}, grad_dtype="bf16") < peak("qwen3-8b", {"dp": 8})


def test_log_prob_pass_keeps_no_activations_and_the_training_state_unless_told():
    train = peak_memory("qwen3-8b", {"dp": 8}, 8192).peak
    lp = peak_memory("qwen3-8b", {"dp": 8}, 8192, pass_="log_prob").peak
    assert lp.static_bytes == train.static_bytes and lp.activation_bytes < train.activation_bytes / 10
    ref = peak_memory("qwen3-8b", {"dp": 8}, 8192, pass_="log_prob", settings={"log_prob_static": "weights"}).peak
    assert ref.static_bytes == pytest.approx(parameter_counts("qwen3-8b")["total"] * 2)


def test_the_optimizer_steps_temporaries_count_only_when_larger_than_the_activations():
    st = MemorySettings(optimizer="replicated", optimizer_step_bytes_per_param=4.0)
    small = peak_memory("qwen3-0.6b", None, 16, settings=st).peak
    assert small.allocated_bytes == pytest.approx(small.static_bytes + small.optimizer_step_bytes)
    large = peak_memory("qwen3-0.6b", None, 65536, settings=st).peak
    assert large.allocated_bytes == pytest.approx(large.static_bytes + large.activation_bytes + large.logits_bytes)


# ------------------------------------------------------------------------------------------- the budget
def test_cannot_fit_errors_name_what_to_change():
    with pytest.raises(DynBatchConfigError, match="do not fit") as exc:
        choose_budget("qwen3-30b-a3b", {"dp": 8, "ep": 8}, 80)  # unsharded expert Adam state
    assert 'optimizer="cpu_offload"' in exc.value.fix and "parallel.ep" in exc.value.fix  # Python's keywords
    assert exc.value.field == "gpu_memory_gb"
    with pytest.raises(DynBatchConfigError, match="fewer than 256") as exc:
        choose_budget("qwen3-8b", {"dp": 8}, 55.44, settings={"optimizer": "cpu_offload"})
    assert "full recompute" in exc.value.fix and "parallel.tp" in exc.value.fix
    with pytest.raises(DynBatchConfigError, match="fewer than 256") as exc:
        choose_budget("qwen3-8b", {"dp": 8}, 55.44, settings={"optimizer": "cpu_offload", "recompute": "full"})
    assert "full recompute" not in exc.value.fix


def test_summary_is_one_screen_with_every_part():
    c = choose_budget("qwen3-8b", {"dp": 8}, 80, settings={"optimizer": "cpu_offload", "recompute": "full"})
    text = c.summary()
    assert len(text.splitlines()) <= 12 and max(len(x) for x in text.splitlines()) <= 150
    for word in ("static", "activations", "logits", "workspace", "reserve", "headroom", "limited by"):
        assert word in text
    d = c.to_dict()
    assert d["max_tokens_per_gpu"] == c.tokens_per_gpu and d["predicted_peak_gb"] <= 80 * 0.9
    json.dumps(d)


# ------------------------------------------------------------------------------------------- the profile and fit
def _records(coef, budget=4096):
    out = []
    for layers, head, lengths in memory_grid(budget):
        t = sum(lengths)
        out.append(MemoryRecord(layers, head, t, coef["workspace"] + t * (layers * coef["layer"] + (
            coef["head"] if head else coef["backward_extra"]))))
    return out


def test_the_fit_recovers_known_coefficients_and_makes_a_profile():
    coef = {"workspace": 5e6, "layer": 120_000.0, "backward_extra": 40_000.0, "head": 900_000.0}
    fit = fit_memory_records(_records(coef), "qwen3-8b", {"tp": 2, "dp": 4}, fitted_on={"device": "test"})
    for k, v in coef.items():
        assert fit.coefficients[k] == pytest.approx(v, rel=1e-6)
    assert fit.rel_rms_error < 1e-9
    p = fit.profile
    assert p.source == "fitted" and p.tp == 2 and p.layer_peak_bytes == pytest.approx(160_000)
    assert p.fitted_on["device"] == "test" and p.fitted_on["model"].startswith("qwen3-8b")
    assert MemoryProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_records_that_cannot_separate_the_terms_are_refused():
    coef = {"workspace": 1e6, "layer": 1e4, "backward_extra": 1e3, "head": 5e4}
    only_one_slice = [r for r in _records(coef) if r.layers == 1 and not r.lm_head]
    with pytest.raises(DynBatchConfigError, match="cannot be told apart"):
        check_memory_records(only_one_slice + only_one_slice)
    with pytest.raises(DynBatchConfigError, match="at least 4"):
        check_memory_records(_records(coef)[:2])
    for bad in ({"layers": 0, "lm_head": False, "tokens": 1, "peak_bytes": 1},
                {"layers": 1, "lm_head": 1, "tokens": 1, "peak_bytes": 1},
                {"layers": 1, "lm_head": False, "tokens": 1, "peak_bytes": float("nan")},
                {"layers": 1, "lm_head": False, "tokens": -3, "peak_bytes": 1}, "x"):
        with pytest.raises(DynBatchConfigError):
            MemoryRecord.from_any(bad)
    # NumPy scalars are taken
    assert MemoryRecord(np.int64(2), np.bool_(True), np.int32(64), np.float32(1e6)).tokens == 64


def test_memory_grid_stays_within_the_budget_and_varies_layers_tokens_and_head():
    grid = memory_grid(8192)
    assert {(n, h) for n, h, _ in grid} == {(1, False), (2, False), (1, True)}
    assert all(sum(lens) <= 8192 and max(lens) <= 4096 for _, _, lens in grid)
    assert len({sum(lens) for _, _, lens in grid}) >= 3
    assert all(sum(lens) <= 50 for _, _, lens in memory_grid(50))


def test_the_cost_model_file_carries_the_memory_section(tmp_path):
    coef = {"workspace": 5e6, "layer": 120_000.0, "backward_extra": 40_000.0, "head": 900_000.0}
    prof = fit_memory_records(_records(coef), "qwen3-8b", {"tp": 2}).profile
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"linear_s_per_token": 1e-6, "attention_s_per_sq_token": 1e-10, "overhead_s": 1e-3,
                                "memory": prof.to_dict()}))
    load_cost_model(path)  # the cost-model reader accepts (and checks) the section
    resolve_cost_model(str(path), "qwen3-8b", ParallelConfig(tp=2))
    assert load_memory_profile(path) == prof
    assert resolve_memory_profile(str(path), "qwen3-8b", {"tp": 2}) == prof
    fitted = choose_budget("qwen3-8b", {"tp": 2, "dp": 4}, 80, profile=str(path))
    assert fitted.breakdown.profile_source == "fitted" and "fitted memory profile" in fitted.summary()
    # fitted for qwen3-8b at tp=2: refused for another width or model, never silently applied
    with pytest.raises(DynBatchConfigError, match="tp=2"):
        choose_budget("qwen3-8b", {"tp": 4}, 80, profile=str(path))
    with pytest.raises(DynBatchConfigError, match="another model"):
        choose_budget("llama-3.1-8b", {"tp": 2}, 80, profile=str(path))
    # a file without the section: the analytic profile
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"linear_s_per_token": 1e-6, "attention_s_per_sq_token": 1e-10, "overhead_s": 1e-3}))
    assert load_memory_profile(plain) is None
    assert resolve_memory_profile(str(plain), "qwen3-8b", {"tp": 2}).source == "analytic"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"linear_s_per_token": 1e-6, "attention_s_per_sq_token": 1e-10, "overhead_s": 1e-3,
                               "memory": {**prof.to_dict(), "layer_bytes": -1}}))
    with pytest.raises(DynBatchConfigError, match="layer_bytes"):
        load_cost_model(bad)


def test_settings_are_validated_at_construction():
    for kw in ({"optimizer": "adam"}, {"recompute": "some"}, {"param_dtype": "int8"}, {"headroom": 0.95},
               {"headroom": -0.1}, {"reserve_gb": float("nan")}, {"logits_fp32_copies": 1.5},
               {"logits_fp32_copies": True}, {"moe_imbalance": 0.5}, {"log_prob_static": "none"},
               {"expert_tensor_parallel_size": 0}, {"untie_embeddings": "yes"}):
        with pytest.raises(DynBatchConfigError):
            MemorySettings(**kw)
    with pytest.raises(DynBatchConfigError, match="not a memory setting"):
        MemorySettings.from_any({"recompte": "full"})
    assert MemorySettings(reserve_gb=np.float32(2.0), logits_fp32_copies=np.int64(2)) == \
        MemorySettings(reserve_gb=2.0, logits_fp32_copies=2)
    with pytest.raises(DynBatchConfigError, match="pass_"):
        peak_memory("qwen3-8b", None, 10, pass_="eval")
    for tokens in (-1, 2 ** 41, 1.5, True, "8k", None, float("nan")):
        with pytest.raises(DynBatchConfigError, match="tokens_per_gpu"):
            peak_memory("qwen3-8b", None, tokens)
    assert peak_memory("qwen3-8b", None, np.int32(4096)) == peak_memory("qwen3-8b", None, 4096.0)


# ------------------------------------------------------------------------------------------- trainers' words
def test_trainer_lines_say_per_gpu_or_per_microbatch():
    lines = {t.trainer: t for t in trainer_settings(17408, 40000, {"tp": 2, "cp": 4, "dp": 1})}
    assert lines["megatron-lm"].settings == {"--max-tokens-per-gpu": 17408, "--log-probs-max-tokens-per-gpu": 40000}
    assert lines["slime"].settings["--max-tokens-per-gpu"] == 17408 // 256 * 256
    assert lines["verl"].settings["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == 17408
    assert lines["roll"].settings["actor_train.max_tokens_per_microbatch_in_train"] == 17408 * 4
    assert lines["nemo-rl"].settings["policy.sequence_packing.logprob_mb_tokens"] == 40000 * 4
    assert "16" in lines["verl"].note  # verl pads each sequence to tp*cp*2
    tiny = {t.trainer: t for t in trainer_settings(100, 100, None)}
    assert tiny["slime"].settings["--max-tokens-per-gpu"] == 100 and "use the drop-in" in tiny["slime"].note


# ------------------------------------------------------------------------------------------- the legacy front
def test_max_tokens_estimate_moves_the_right_way():
    kw = dict(optimizer="distributed", recompute="full")
    base = estimate_max_tokens_per_gpu("qwen3-8b", {"dp": 8}, 80, **kw)
    assert base > 0 and base % 256 == 0
    assert estimate_max_tokens_per_gpu("qwen3-8b", {"dp": 8}, 141, **kw) > base
    assert estimate_max_tokens_per_gpu("qwen3-8b", {"dp": 4, "tp": 2, "sequence_parallel": True}, 80, **kw) > base
    assert estimate_max_tokens_per_gpu("qwen3-8b", {"dp": 8}, 80, optimizer="cpu_offload", recompute="full") > base
    assert estimate_max_tokens_per_gpu("qwen3-8b", {"dp": 8}, 80, optimizer="distributed") < base
    assert estimate_max_tokens_per_gpu("qwen3-8b", {"dp": 8}, 80, forward_only=True) > base
    assert estimate_max_tokens_per_gpu("qwen3-8b", {"dp": 8}, 80, logits_fp32_copies=2, **kw) < base
    e = estimate_memory("qwen3-8b", {"dp": 8}, base, **kw)
    assert e.total_gb <= 80 * 0.9 + 1e-6 and "ESTIMATE" in e.summary()
    # the same model as choose_budget: no second copy
    assert base == choose_budget("qwen3-8b", {"dp": 8}, 80, settings={"recompute": "full"}).tokens_per_gpu
    assert e.total_gb == pytest.approx(peak_memory("qwen3-8b", {"dp": 8}, base,
                                                   settings={"recompute": "full"}).peak_bytes / GiB)


@pytest.mark.parametrize("name", ["qwen3-8b-grpo", "qwen3-30b-a3b-grpo", "llama-3.1-70b-longcot"])
def test_shipped_presets_budgets_fit_the_card_they_were_written_for(name):
    """Every budget a shipped preset sets (or lets the memory model choose) fits an H100 80GB by the memory model,
    with the memory settings its own Megatron flags imply."""
    from megatron_dynbatch.core.memory import choose_budget

    rc = RunConfig.from_yaml(name)
    for pass_, forward_only in (("train", False), ("log_prob", True)):
        fits = choose_budget(rc.model_spec(), rc.parallel(), rc.options.gpu_memory_gb or 79.1, pass_=pass_,
                             settings=rc.memory_settings()).tokens_per_gpu
        assert rc.budget(forward_only=forward_only) <= fits, (name, pass_)


def test_legacy_errors_are_clear():
    with pytest.raises(DynBatchConfigError, match="do not fit") as exc:
        estimate_max_tokens_per_gpu("qwen3-30b-a3b", {"dp": 8, "ep": 8}, 80)
    assert "offload the optimizer" in exc.value.fix
    with pytest.raises(DynBatchConfigError, match="not one of the choices"):
        estimate_memory("qwen3-8b", {"dp": 8}, 1, recompute="some")
    with pytest.raises(DynBatchConfigError, match="positive number"):
        estimate_max_tokens_per_gpu("qwen3-8b", {"dp": 8}, 0)
    with pytest.raises(DynBatchConfigError, match="weight_bytes"):
        estimate_memory("qwen3-8b", {"dp": 8}, 1, weight_bytes=3)


def test_a_launchs_flags_give_the_model_the_layout_and_its_dropout():
    """``megatron_flags``: an argv list -> ModelSpec (Megatron's 0.1 dropout where unset, padded vocabulary),
    ParallelConfig (VPP from layers per virtual stage, dp from the world size); a run preset's megatron_args set
    the model's dropout and QK-layernorm over the model preset's."""
    from megatron_dynbatch.core.memory.megatron_flags import (
        model_from_megatron,
        model_overrides_from_megatron,
        parallel_from_megatron,
    )

    argv = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
            "--num-query-groups", "8", "--vocab-size", "131073", "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
            "--sequence-parallel"]
    m = model_from_megatron(argv)
    assert (m.hidden_dropout, m.attention_dropout, m.qk_layernorm) == (0.1, 0.1, False)
    assert m.num_query_groups == 8 and m.ffn_hidden_size == 4 * 4096 and m.padded_vocab_size == 131200
    p = parallel_from_megatron(argv, 8)
    assert (p.dp, p.pp, p.vpp, p.sequence_parallel) == (2, 4, 8, True)
    off = model_from_megatron(argv + ["--hidden-dropout=0.0", "--attention-dropout", "0", "--qk-layernorm"])
    assert (off.hidden_dropout, off.attention_dropout, off.qk_layernorm) == (0.0, 0.0, True)
    with pytest.raises(DynBatchConfigError, match="is not a multiple of tp x pp x cp"):
        parallel_from_megatron(argv, 6)
    with pytest.raises(DynBatchConfigError, match="vocab_size"):
        model_from_megatron([a for a in argv if a not in ("--vocab-size", "131073")])
    assert model_overrides_from_megatron(["--bf16", "--hidden-dropout", "0.1"]) == {"hidden_dropout": 0.1}

    rc = RunConfig.from_yaml("qwen3-8b-grpo")
    assert rc.model_spec().hidden_dropout == 0.0
    with_dropout = RunConfig.from_dict({"name": "q", "model": "qwen3-8b", "parallel": {"dp": 8},
                                        "max_tokens_per_gpu": 8192, "megatron_args": ["--hidden-dropout", "0.1"]})
    assert with_dropout.model_spec().hidden_dropout == 0.1 and with_dropout.model_spec().qk_layernorm
