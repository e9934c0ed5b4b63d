"""The drop-ins' start-up memory check (issue 27 item 4): a trainer's configured budget, in its own units, against
what the memory model says fits -- over it warns "out of memory ahead", far under it "speed left behind", each a
``BudgetWarning`` naming the setting, its value and the value to use; skipped silently without a card or a model.

The trainers' units are stated here independently (slime / verl: per GPU; ROLL / NeMo-RL: per micro-batch, x cp),
so a change to :mod:`megatron_dynbatch.core.memory.trainers` that broke them fails here; the check's recommended
value is also held to ``trainer_settings`` -- the lines ``megatron-dynbatch budget`` prints."""

from __future__ import annotations

import dataclasses

import json
import math
import types
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynbatch import BudgetWarning, DynBatchConfigError
from megatron_dynbatch.core.dropin.budgets import nemo_rl_budgets, roll_budgets, slime_budgets, verl_budgets
from megatron_dynbatch.core.memory import (GiB, MemorySettings, choose_budget, peak_memory, settings_from_megatron,
                                          trainer_settings)
from megatron_dynbatch.core.memory.check import FAR_UNDER, card_or_none, check_configured_budget
from megatron_dynbatch.core.model_spec import ModelSpec
from megatron_dynbatch.core.parallel import ParallelConfig
from megatron_dynbatch.integrations import budget_check, nemo_rl, roll, slime, verl
from megatron_dynbatch.testing.peer_types import (grpo_batch, nemo_rl_config, roll_worker_config, slime_args,
                                                  verl_config)

MODEL, CARD = "qwen3-8b", 79.1
LAYOUT = {"dp": 4, "tp": 2, "cp": 2}
FULL = MemorySettings(recompute="full")

#: each trainer's settings and whether they count per micro-batch (x cp) -- stated here, not read from the code
UNITS = {
    "slime": ("--max-tokens-per-gpu", "--log-probs-max-tokens-per-gpu", False),
    "verl": ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", False),
    "roll": ("max_tokens_per_microbatch_in_train", "max_tokens_per_microbatch_in_infer", True),
    "nemo-rl": ("train_mb_tokens", "logprob_mb_tokens", True),
}

#: Qwen3-8B's config.json (the keys ModelSpec reads), for the configs that name a local checkpoint
QWEN3_8B_HF = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 36,
               "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
               "intermediate_size": 12288, "vocab_size": 151936, "hidden_act": "silu", "tie_word_embeddings": False}


def _setting(trainer, pass_):
    train, log_prob, per_mb = UNITS[trainer]
    return (train if pass_ == "train" else log_prob), per_mb


def _check(trainer, pass_, value, **kw):
    setting, _ = _setting(trainer, pass_)
    kw = {"settings": FULL, **kw}
    return check_configured_budget(setting, value, kw.pop("model", MODEL), kw.pop("parallel", LAYOUT),
                                   kw.pop("card", CARD), trainer=trainer, **kw)


@pytest.fixture
def checkpoint(tmp_path):
    """A local Hugging Face checkpoint directory (config.json only), as the trainers' configs name one."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B_HF), encoding="utf-8")
    return tmp_path


def _budget_warnings(record):
    return [w for w in record if issubclass(w.category, BudgetWarning)]


# ------------------------------------------------------------------------------------------- the verdicts
@pytest.mark.parametrize("trainer", sorted(UNITS))
@pytest.mark.parametrize("pass_", ["train", "log_prob"])
def test_over_near_and_far_under(trainer, pass_):
    setting, per_mb = _setting(trainer, pass_)
    cp = LAYOUT["cp"]
    fit = choose_budget(MODEL, LAYOUT, CARD, pass_=pass_, settings=FULL)
    units = (lambda t: t * cp) if per_mb else (lambda t: t)
    rec = units(fit.tokens_per_gpu)  # tp=2: slime's tp x 128 = 256 divides the 256-multiple budget

    over = _check(trainer, pass_, units(int(fit.exact_tokens * 1.3)))
    assert over.verdict == "over" and over.warn and over.pass_ == pass_
    assert over.tokens_per_gpu == int(fit.exact_tokens * 1.3) and over.recommended == rec
    assert over.predicted_peak_gb > over.usable_gb
    msg = over.message
    assert f"{setting}={units(int(fit.exact_tokens * 1.3))}" in msg and "out of memory" in msg
    assert f"{over.predicted_peak_gb:.1f} GiB on a {CARD:g} GiB card" in msg and f"use {setting}={rec}" in msg.lower()

    for share in (1.0, 0.8, FAR_UNDER + 0.01):  # near what fits: no warning
        near = _check(trainer, pass_, units(int(fit.tokens_per_gpu * share)))
        assert near.verdict == "fits" and not near.warn and near.message == "", (share, near)
        assert near.predicted_peak_gb * GiB <= fit.usable_bytes

    far = _check(trainer, pass_, units(fit.tokens_per_gpu // 2))
    assert far.verdict == "far_under" and far.warn and far.recommended == rec
    assert "speed left behind" in far.message and f"{setting}={rec}" in far.message
    assert f"{setting}={units(fit.tokens_per_gpu // 2)}" in far.message and "50%" in far.message
    assert far.of_fit == pytest.approx(0.5, abs=0.01)


def test_slime_value_to_use_is_budgets_slime_line():
    """slime's own batching pads each CP rank's share to tp x 128: the value to use is rounded down to it, as
    ``megatron-dynbatch budget`` prints slime's line."""
    par = {"dp": 2, "tp": 4}
    fit = choose_budget(MODEL, par, CARD, settings=FULL)
    v = _check("slime", "train", 1, parallel=par)
    assert v.verdict == "far_under" and v.recommended == fit.tokens_per_gpu // 512 * 512
    assert "under 1%" in v.message


def test_pass_is_the_settings_own():
    assert _check("verl", "train", 4096).pass_ == "train"
    v = check_configured_budget("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", 4096, MODEL, LAYOUT, CARD,
                                trainer="verl", settings=FULL)
    assert v.pass_ == "log_prob" and v.setting == "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
    assert check_configured_budget("log_probs_max_tokens_per_gpu", 4096, MODEL, LAYOUT, CARD,
                                   trainer="slime").pass_ == "log_prob"
    with pytest.raises(DynBatchConfigError, match="budgets the training pass") as info:
        check_configured_budget("ppo_max_token_len_per_gpu", 4096, MODEL, LAYOUT, CARD, trainer="verl",
                                pass_="log_prob")
    assert info.value.field == "pass_"


def test_a_card_that_cannot_hold_the_model_is_over():
    v = check_configured_budget("ppo_max_token_len_per_gpu", 8192, "qwen3-32b", {"dp": 1}, 24, trainer="verl")
    assert v.verdict == "over" and v.recommended is None and v.fit_tokens_per_gpu is None and v.of_fit is None
    assert "no token budget fits" in v.message and "Fix:" in v.message


def test_far_under_threshold_is_a_knob():
    fit = choose_budget(MODEL, LAYOUT, CARD, settings=FULL)
    assert _check("verl", "train", 256, far_under=0).verdict == "fits"
    assert _check("verl", "train", int(fit.tokens_per_gpu * 0.7), far_under=0.75).verdict == "far_under"
    with pytest.raises(DynBatchConfigError) as info:
        _check("verl", "train", 4096, far_under=1.5)
    assert info.value.field == "far_under"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(UNITS)), st.sampled_from(["train", "log_prob"]), st.integers(1, 400_000),
       st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 8]),
       st.sampled_from(["qwen3-8b", "qwen3-30b-a3b", "llama-3.1-8b"]), st.sampled_from([40.0, 79.1, 139.8]))
def test_verdict_matches_the_memory_model(trainer, pass_, tokens, tp, cp, pp, dp, model, card):
    """Any budget, layout, model, card: the setting's value means exactly the per-GPU tokens of the trainer's
    units; over iff the predicted peak there is over the usable memory; far under iff below 60% of what fits;
    the value to use is ``trainer_settings``' line (the ``budget`` command's)."""
    setting, per_mb = _setting(trainer, pass_)
    par = {"dp": dp, "tp": tp, "cp": cp, "pp": pp}
    value = tokens * cp if per_mb else tokens
    v = check_configured_budget(setting, value, model, par, card, trainer=trainer, settings=FULL)
    assert v.tokens_per_gpu == tokens and v.pass_ == pass_
    peak = peak_memory(model, par, tokens, pass_=pass_, settings=FULL).peak_bytes
    assert v.predicted_peak_gb == pytest.approx(peak / GiB)
    try:
        fit = choose_budget(model, par, card, pass_=pass_, settings=FULL)
    except DynBatchConfigError:
        assert v.verdict == "over" and v.recommended is None
        return
    usable = card * GiB * (1 - FULL.headroom)
    want = "over" if peak > usable else "far_under" if tokens < FAR_UNDER * fit.tokens_per_gpu else "fits"
    assert v.verdict == want
    line = {x.trainer: x for x in trainer_settings(fit.tokens_per_gpu, fit.tokens_per_gpu, par)}[trainer]
    assert v.recommended in line.settings.values()
    if trainer != "slime":
        assert v.recommended == (fit.tokens_per_gpu * cp if per_mb else fit.tokens_per_gpu)
    else:
        assert v.recommended == (fit.tokens_per_gpu // (tp * 128) * (tp * 128) or fit.tokens_per_gpu)
    assert (v.message != "") == v.warn


def test_a_start_up_check_is_two_evaluations_of_the_memory_model(memory_model_calls):
    """The check a trainer runs once at start-up costs the configured budget's peak and the largest fit: two
    evaluations of the memory model, however large the model and layout (its time is measured by
    ``benchmarks/memory_speed.py``)."""
    v = check_configured_budget("train_mb_tokens", 65536, "deepseek-v3", {"dp": 32, "tp": 8, "pp": 8, "ep": 32},
                                CARD, trainer="nemo-rl")
    assert v.verdict in ("over", "far_under", "fits") and len(memory_model_calls) <= 2


# ------------------------------------------------------------------------------------------- hostile input
@pytest.mark.parametrize("card", [None, 0, -1, float("nan"), float("inf"), "80", True, 2.0 ** 30])
def test_bad_card_is_named(card):
    with pytest.raises(DynBatchConfigError) as info:
        _check("verl", "train", 4096, card=card)
    assert info.value.field == "gpu_memory_gb"


@pytest.mark.parametrize("value", [0, -4096, float("nan"), 2.5, "4096", True, None])
def test_bad_budget_is_named_by_the_trainers_setting(value):
    with pytest.raises(DynBatchConfigError) as info:
        check_configured_budget("max_tokens_per_microbatch_in_train", value, MODEL, LAYOUT, CARD, trainer="roll")
    assert info.value.field == "max_tokens_per_microbatch_in_train" and "positive token count" in info.value.fix


def test_no_model_and_unknown_names():
    with pytest.raises(DynBatchConfigError) as info:
        _check("verl", "train", 4096, model=None)
    assert info.value.field == "model"
    with pytest.raises(DynBatchConfigError):
        _check("verl", "train", 4096, model="no-such-model")
    with pytest.raises(DynBatchConfigError, match="did you mean 'ppo_max_token_len_per_gpu'") as info:
        check_configured_budget("ppo_max_tokens_len_per_gpu", 4096, MODEL, LAYOUT, CARD, trainer="verl")
    assert info.value.field == "setting"
    with pytest.raises(DynBatchConfigError, match="did you mean 'verl'") as info:
        check_configured_budget("ppo_max_token_len_per_gpu", 4096, MODEL, LAYOUT, CARD, trainer="verll")
    assert info.value.field == "trainer"
    for bad in (None, "", "--", 3):
        with pytest.raises(DynBatchConfigError) as info:
            check_configured_budget(bad, 4096, MODEL, LAYOUT, CARD, trainer="verl")
        assert info.value.field == "setting"
    with pytest.raises(DynBatchConfigError) as info:
        _check("verl", "train", 4096, parallel={"tp": 0})
    assert info.value.field == "parallel.tp"


@pytest.mark.parametrize("card, want", [(79.1, 79.1), (80, 80.0), (None, None), (0, None), (-1, None),
                                        (float("nan"), None), (float("inf"), None), (True, None), ("x", None),
                                        (2.0 ** 30, None)])
def test_card_or_none(card, want):
    assert card_or_none(card) == want


# ------------------------------------------------------------------------------------------- the card reader
class _FakeCuda:
    """torch.cuda as the reader asks it (the seam: CPU tests run the reader's own code)."""

    def __init__(self, available=True, initialized=True, total=80 * 2 ** 30, fail=False):
        self.available, self.initialized, self.total, self.fail = available, initialized, total, fail

    def is_available(self):
        return self.available

    def is_initialized(self):
        return self.initialized

    def current_device(self):
        return 0

    def get_device_properties(self, index):
        if self.fail:
            raise RuntimeError("CUDA error: no device")
        return types.SimpleNamespace(total_memory=self.total)


@pytest.mark.parametrize("cuda, want", [
    (_FakeCuda(), 80.0), (_FakeCuda(available=False), None), (_FakeCuda(initialized=False), None),
    (_FakeCuda(total=0), None), (_FakeCuda(total=float("nan")), None), (_FakeCuda(fail=True), None)])
def test_card_reader(cuda, want):
    assert budget_check.device_gpu_memory_gb(types.SimpleNamespace(cuda=cuda)) == want


def test_card_reader_never_initialises_cuda():
    """No CUDA context is made for a warning (a driver that forks workers must not hold one): on this machine the
    reader finds none, and the check is skipped."""
    torch = pytest.importorskip("torch")
    was = torch.cuda.is_initialized()
    card = budget_check.device_gpu_memory_gb()
    assert torch.cuda.is_initialized() == was
    if not was:
        assert card is None


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_card_reader_on_a_gpu():
    import torch

    torch.zeros(1, device="cuda")  # this process now uses the GPU
    want = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2 ** 30
    assert budget_check.device_gpu_memory_gb() == pytest.approx(want)
    assert verl.check_budget_memory(verl_config(), model=MODEL)  # the card is read: the check runs


# ------------------------------------------------------------------------------------------- slime
QWEN3_8B_ARGS = dict(num_layers=36, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=12288,
                     kv_channels=128, vocab_size=151936, num_query_groups=8, group_query_attention=True,
                     use_distributed_optimizer=True)


def test_slime_start_up_warns_once_from_args():
    spec = ModelSpec.from_megatron(slime_args(**QWEN3_8B_ARGS))
    mem = dataclasses.replace(settings_from_megatron(slime_args(**QWEN3_8B_ARGS)), trainer="slime")
    fit = choose_budget(spec, {"dp": 8}, CARD, settings=mem)  # slime's own loss path (its start-up check's)
    args = slime_args(**QWEN3_8B_ARGS, max_tokens_per_gpu=fit.exact_tokens + 4096, dynbatch_gpu_memory_gb=CARD,
                      rollout_max_prompt_len=1024, rollout_max_response_len=3072)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        slime.build_dp_schedule(args, {"dp_size": 8}, [100] * 16, global_batch_size=1, rollout_indices=[0] * 16)
        slime.build_dp_schedule(args, {"dp_size": 8}, [100] * 16, global_batch_size=1, rollout_indices=[0] * 16)
    got = _budget_warnings(record)
    # training over what fits; --log-probs-max-tokens-per-gpu unset: slime uses the training value there
    assert len(got) == 2, [str(w.message) for w in got]
    assert f"--max-tokens-per-gpu={fit.exact_tokens + 4096}" in str(got[0].message)
    assert "out of memory" in str(got[0].message) and f"--max-tokens-per-gpu={fit.tokens_per_gpu}" in str(
        got[0].message)
    assert "--log-probs-max-tokens-per-gpu" in str(got[1].message) and "unset" in str(got[1].message)


def test_slime_skips_silently_and_never_stops_the_run():
    args = slime_args(**QWEN3_8B_ARGS, max_tokens_per_gpu=4096, seq_length=4096)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert slime.check_budget(args, {"dp_size": 8}) is True  # no card on this machine: nothing said
        assert slime.check_budget_memory(args, {"dp_size": 8}) == []
        assert slime.check_budget_memory(slime_args(max_tokens_per_gpu=4096, num_layers=None), {"dp_size": 8},
                                         gpu_memory_gb=CARD) == []  # args describe no model
    assert not _budget_warnings(record)
    bad = slime_args(**QWEN3_8B_ARGS, max_tokens_per_gpu=4096, seq_length=4096, dynbatch_gpu_memory_gb=float("nan"))
    with pytest.warns(BudgetWarning, match="skipped.*gpu_memory_gb"):
        assert slime.check_budget(bad, {"dp_size": 8}) is True
    with pytest.raises(DynBatchConfigError) as info:
        slime.check_budget_memory(bad, {"dp_size": 8})
    assert info.value.field == "gpu_memory_gb"


def test_slime_reads_its_settings():
    args = slime_args(**QWEN3_8B_ARGS, tensor_model_parallel_size=2, recompute_granularity="full",
                      log_probs_max_tokens_per_gpu=30000, optimizer_cpu_offload=True)
    cb = slime_budgets(args, ParallelConfig(dp=4, tp=2))
    assert cb.budgets == (("--max-tokens-per-gpu", 4096, ""), ("--log-probs-max-tokens-per-gpu", 30000, ""))
    assert cb.settings.recompute == "full" and cb.settings.optimizer == "cpu_offload"
    assert slime_budgets(slime_args(use_dynamic_batch_size=False), ParallelConfig()).budgets == ()
    assert slime_budgets(slime_args(train_backend="fsdp"), ParallelConfig()) is None


# ------------------------------------------------------------------------------------------- verl
def test_verl_config_judged_in_verls_words(checkpoint):
    cfg = verl_config({"actor_rollout_ref.model.path": str(checkpoint),
                       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 2,
                       "actor_rollout_ref.actor.megatron.context_parallel_size": 2,
                       "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity": "full",
                       "trainer.nnodes": 2})
    cb = verl_budgets(cfg)
    assert cb.parallel.dp == 4 and cb.parallel.tp == 2 and cb.parallel.cp == 2 and cb.dp_known
    assert cb.settings == MemorySettings(recompute="full", optimizer="distributed", param_dtype="bf16", trainer="verl")
    assert [b[0] for b in cb.budgets] == ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                                          "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"]
    spec = ModelSpec.from_hf_config(checkpoint)
    fit = choose_budget(spec, cb.parallel, CARD, settings=cb.settings)
    with pytest.warns(BudgetWarning) as record:
        out = verl.check_budget_memory(cfg, gpu_memory_gb=CARD)
    assert [v.verdict for v in out] == ["far_under", "far_under"] and len(record) == 2
    assert out[0].tokens_per_gpu == 16384 and out[0].recommended == fit.tokens_per_gpu  # per GPU: verl x cp inside
    assert f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={fit.tokens_per_gpu}" in str(record[0].message)
    kl = verl_config({"actor_rollout_ref.model.path": str(checkpoint), "actor_rollout_ref.actor.use_kl_loss": True})
    with pytest.warns(BudgetWarning):
        assert len(verl.check_budget_memory(kl, gpu_memory_gb=CARD)) == 3  # the reference policy's pass too


def test_verl_skips_silently():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert verl.check_budget_memory(verl_config(), gpu_memory_gb=CARD) == []  # model.path is not local
        assert verl.check_budget_memory(verl_config(), model=MODEL) == []  # no card on this machine
        assert verl.check_budget_memory(verl_config({"actor_rollout_ref.actor.strategy": "fsdp"}), model=MODEL,
                                        gpu_memory_gb=CARD) == []
        off = verl_config({"actor_rollout_ref.actor.use_dynamic_bsz": False,
                           "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": False})
        assert verl.check_budget_memory(off, model=MODEL, gpu_memory_gb=CARD) == []
    assert not _budget_warnings(record)


def test_verl_dp_unknown_is_refused_with_the_distributed_optimizer():
    arr = verl_config()["actor_rollout_ref"]
    cb = verl_budgets(arr)
    assert cb.parallel.dp == 1 and not cb.dp_known and verl_budgets(verl_config()).dp_known
    with pytest.raises(DynBatchConfigError, match="data-parallel size") as info:
        verl.check_budget_memory(arr, model=MODEL, gpu_memory_gb=CARD)
    assert info.value.field == "dp_size"
    assert verl_budgets(arr, dp_size=8).parallel.dp == 8 and verl_budgets(arr, dp_size=8).dp_known
    with pytest.warns(BudgetWarning):
        assert len(verl.check_budget_memory(arr, model=MODEL, gpu_memory_gb=CARD, dp_size=8)) == 2
    # dp does not change the memory of another optimizer: judged with dp = 1
    with pytest.warns(BudgetWarning):
        assert verl.check_budget_memory(arr, model=MODEL, gpu_memory_gb=CARD, settings={"optimizer": "cpu_offload"})


def test_verl_trainer_checks_once(monkeypatch, checkpoint):
    """``trainer_balance_batch`` runs the check on its first call for a trainer (the card through the reader's
    seam, as a worker with the GPU would read it); a config the check cannot read warns and balances anyway."""
    monkeypatch.setattr(budget_check, "device_gpu_memory_gb", lambda: CARD)
    cfg = verl_config({"actor_rollout_ref.model.path": str(checkpoint),
                       "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 512,
                       "actor_rollout_ref.actor.ppo_mini_batch_size": 8})
    trainer = types.SimpleNamespace(_get_dp_size=lambda wg, role: 2, actor_rollout_wg=None,
                                    use_prefix_grouper=False, config=cfg)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            verl.trainer_balance_batch(trainer, grpo_batch(list(range(10, 170, 10)), width=160), {})
    got = _budget_warnings(record)
    assert len(got) == 2, [str(w.message) for w in got]  # actor + rollout, once
    assert "speed left behind" in str(got[0].message) and "out of memory" in str(got[1].message)
    bad = types.SimpleNamespace(_get_dp_size=lambda wg, role: 2, actor_rollout_wg=None, use_prefix_grouper=False,
                                config=verl_config({"actor_rollout_ref.model.path": str(checkpoint),
                                                    "actor_rollout_ref.actor.megatron.context_parallel_size": 3,
                                                    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 512}))
    metrics = {}
    with pytest.warns(BudgetWarning, match="skipped.*world_size"):
        verl.trainer_balance_batch(bad, grpo_batch(list(range(10, 170, 10)), width=160), metrics)
    assert "global_seqlen/balanced_max" in metrics


# ------------------------------------------------------------------------------------------- ROLL
def test_roll_worker_judged_per_micro_batch(checkpoint):
    w = roll_worker_config({"model_args.model_name_or_path": str(checkpoint), "world_size": 16})
    w.strategy_args.strategy_config.update(tensor_model_parallel_size=2, context_parallel_size=2)
    cb = roll_budgets(w)
    assert cb.parallel.dp == 4 and cb.settings.recompute == "full" and cb.settings.optimizer == "distributed"
    spec = ModelSpec.from_hf_config(checkpoint)
    fit = choose_budget(spec, cb.parallel, CARD, settings=cb.settings)
    lp = choose_budget(spec, cb.parallel, CARD, pass_="log_prob", settings=cb.settings)
    with pytest.warns(BudgetWarning):
        out = roll.check_budget_memory(w, gpu_memory_gb=CARD)
    assert [(v.setting, v.pass_, v.tokens_per_gpu) for v in out] == [
        ("actor_train.max_tokens_per_microbatch_in_train", "train", 4096),
        ("actor_train.max_tokens_per_microbatch_in_infer", "log_prob", 8192)]
    assert out[0].recommended == 2 * fit.tokens_per_gpu and out[1].recommended == 2 * lp.tokens_per_gpu
    big = roll_worker_config({"model_args.model_name_or_path": str(checkpoint),
                              "max_tokens_per_microbatch_in_train": 4 * fit.tokens_per_gpu})
    with pytest.warns(BudgetWarning) as record:
        assert roll.check_budget_memory(big, gpu_memory_gb=CARD)[0].verdict == "over"
    assert "max_tokens_per_microbatch_in_train=" in str(record[0].message)
    assert "out of memory" in str(record[0].message)
    ref = roll.check_budget_memory(w, role="reference", gpu_memory_gb=CARD, model=spec, far_under=0)
    assert [v.setting for v in ref] == ["reference.max_tokens_per_microbatch_in_train",
                                        "reference.max_tokens_per_microbatch_in_infer"]


def test_roll_skips_silently():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert roll.check_budget_memory(roll_worker_config(), gpu_memory_gb=CARD) == []  # a hub id, not local
        assert roll.check_budget_memory(roll_worker_config({"strategy_args.strategy_name": "deepspeed_train"}),
                                        model=MODEL, gpu_memory_gb=CARD) == []
        off = roll_worker_config({"use_dynamic_batching_in_train": False, "use_dynamic_batching_in_infer": False})
        assert roll.check_budget_memory(off, model=MODEL, gpu_memory_gb=CARD) == []
    assert not _budget_warnings(record)


# ------------------------------------------------------------------------------------------- NeMo-RL
def test_nemo_rl_config_judged_per_bin(checkpoint):
    cfg = nemo_rl_config({"policy.model_name": str(checkpoint), "policy.megatron_cfg.context_parallel_size": 2,
                          "policy.megatron_cfg.activation_checkpointing": True, "policy.logprob_chunk_size": 1024})
    cb = nemo_rl_budgets(cfg)
    assert cb.parallel.dp == 4 and cb.parallel.cp == 2 and cb.settings.recompute == "full"
    assert cb.settings.trainer == "nemo-rl" and cb.settings.loss_chunk_tokens == 1024  # NeMo-RL's loss path
    assert cb.settings.grad_dtype == "bf16"  # grad_reduce_in_fp32: false
    with pytest.warns(BudgetWarning):
        out = nemo_rl.check_budget_memory(cfg, gpu_memory_gb=CARD)
    assert [(v.setting, v.tokens_per_gpu) for v in out] == [("policy.sequence_packing.train_mb_tokens", 8192),
                                                             ("policy.sequence_packing.logprob_mb_tokens", 8192)]
    fit = choose_budget(ModelSpec.from_hf_config(checkpoint), cb.parallel, CARD, settings=cb.settings)
    assert out[0].recommended == 2 * fit.tokens_per_gpu
    dyn = nemo_rl_config({"policy.model_name": str(checkpoint), "policy.sequence_packing.enabled": False,
                          "policy.dynamic_batching": {"enabled": True, "train_mb_tokens": 4096,
                                                      "logprob_mb_tokens": 8192}})
    # unchunked, NeMo-RL's log-prob keeps 14 bytes per token per V/tp column: 4096 training tokens go over
    with pytest.warns(BudgetWarning, match="policy.dynamic_batching.train_mb_tokens=4096.*out of memory"):
        nemo_rl.check_budget_memory(dyn, gpu_memory_gb=CARD)
    # the policy alone needs the dp size; the settings can be changed field by field
    with pytest.raises(DynBatchConfigError) as info:
        nemo_rl.check_budget_memory(cfg["policy"], gpu_memory_gb=CARD)
    assert info.value.field == "dp_size"
    v = nemo_rl.check_budget_memory(cfg["policy"], gpu_memory_gb=CARD, settings={"headroom": 0.2}, far_under=0,
                                    dp_size=4)
    assert [x.verdict for x in v] == ["fits", "fits"] and v[0].usable_gb == pytest.approx(CARD * 0.8)


def test_nemo_rl_skips_silently_and_refuses_bad_settings():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert nemo_rl.check_budget_memory(nemo_rl_config(), gpu_memory_gb=CARD) == []  # a hub id, not local
        assert nemo_rl.check_budget_memory(nemo_rl_config({"policy.megatron_cfg.enabled": False}), model=MODEL,
                                           gpu_memory_gb=CARD) == []
    assert not _budget_warnings(record)
    with pytest.raises(DynBatchConfigError) as info:
        nemo_rl.check_budget_memory(nemo_rl_config(), model=MODEL, gpu_memory_gb=CARD, settings={"recompte": "full"})
    assert info.value.field == "settings"
    with pytest.raises(DynBatchConfigError) as info:
        nemo_rl.check_budget_memory(nemo_rl_config({"policy.sequence_packing.train_mb_tokens": 0}), model=MODEL,
                                    gpu_memory_gb=CARD)
    assert info.value.field == "policy.sequence_packing.train_mb_tokens"


def test_budget_warnings_can_be_silenced():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=BudgetWarning)
        assert nemo_rl.check_budget_memory(nemo_rl_config(), model=MODEL, gpu_memory_gb=CARD)
    assert not record
    assert math.isfinite(CARD)


def test_docs_state_the_check_as_built():
    """docs/migrating.md (each trainer's paragraph) and docs/tuning.md say the threshold the code uses and how to
    silence the warning."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    silence = 'warnings.filterwarnings("ignore", category=BudgetWarning)'
    tuning = (root / "docs" / "tuning.md").read_text(encoding="utf-8")
    assert f"under {FAR_UNDER:.0%} of it" in tuning and silence in tuning
    migrating = (root / "docs" / "migrating.md").read_text(encoding="utf-8")
    sections = migrating.split("\n## ")
    for title in ("slime", "verl", "NeMo-RL", "ROLL"):
        text = next(s for s in sections if s.startswith(title)).replace("\n", " ")
        assert f"under {FAR_UNDER:.0%} of it" in text and silence.replace("\n", " ") in text, title
