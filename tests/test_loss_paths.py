"""Each trainer's loss path (``core/memory/loss_paths.py``): the bytes per token per V/tp column read from the
trainers' code, the options that change them, and what the budget does with them -- a trainer whose loss keeps
more never gets a larger budget, and budgets grow with the card."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynbatch import DynBatchConfigError
from megatron_dynbatch.core.memory import MemorySettings, choose_budget, peak_memory
from megatron_dynbatch.core.memory.loss_paths import (REFERENCE_BYTES, TRAINERS, LossOptions, loss_path,
                                                      loss_path_bytes)
from megatron_dynbatch.core.model_spec import ModelSpec

V = ModelSpec.from_any("qwen3-8b").padded_vocab_size


@pytest.mark.parametrize("trainer, pass_, options, expected", [
    ("megatron-lm", "train", {}, 6.0), ("megatron-lm", "log_prob", {}, 6.0),
    ("megatron-lm", "train", {"fused": True}, 6.0),            # native and TE fusion keep the same tensors
    ("slime", "train", {}, 8.0), ("slime", "log_prob", {}, 8.0),  # fp32 logits + fp32 softmax
    ("slime", "train", {"temperature": 0.7}, 12.0),             # logits / temperature: one more fp32 copy
    ("slime", "train", {"entropy": True}, 12.0),                # entropy gradient: logits kept + one more buffer
    ("slime", "log_prob", {"chunk_tokens": 1024}, 4.0),         # only a chunk's softmax
    ("slime", "train", {"chunk_tokens": 1024}, 8.0),            # every chunk's softmax is saved for backward
    ("verl", "train", {}, 6.0), ("verl", "train", {"entropy": True}, 12.0),
    ("verl", "log_prob", {}, 12.0),                             # the actor's log-prob pass computes entropy
    ("verl", "train", {"temperature": 0.7}, 6.0),               # divides in place
    ("roll", "train", {}, 6.0), ("roll", "train", {"entropy": True}, 8.0),
    ("roll", "train", {"fused": True}, 2.0),
    ("nemo-rl", "train", {}, 14.0), ("nemo-rl", "log_prob", {"chunk_tokens": 2048}, 2.0),
])
def test_bytes_per_vocab_column_read_from_each_trainers_code(trainer, pass_, options, expected):
    assert loss_path_bytes(trainer, pass_, options) == expected
    path = loss_path(trainer, pass_, options)
    assert path.tensors and "@" in path.source  # every record names its source and commit


def test_fused_kernels_that_need_tp_1_and_chunks_are_counted():
    assert loss_path_bytes("roll", "train", {"fused": True}, tp=2) == 6.0  # ROLL's fused kernels: TP 1 only
    nemo = loss_path("nemo-rl", "train", {"chunk_tokens": 1024})
    assert nemo.chunk_bytes(1000.0) == 1024 * 20.0 * 1000.0 and nemo.bytes_per_token(1000.0) == 4000.0
    verl = loss_path("verl", "train", {"fused": True})
    assert verl.token_bytes == 2 * 9504 and verl.column_bytes < 0.02  # no logits: a fixed-width d_logits split


def test_the_reference_path_is_what_the_profile_counts():
    base = peak_memory("qwen3-8b", {"dp": 8}, 8192)
    assert loss_path_bytes("megatron-lm") == REFERENCE_BYTES
    assert peak_memory("qwen3-8b", {"dp": 8}, 8192, settings={"trainer": "megatron-lm"}) == base
    slime = peak_memory("qwen3-8b", {"dp": 8}, 8192, settings={"trainer": "slime"})
    assert slime.peak.logits_bytes - base.peak.logits_bytes == pytest.approx(2.0 * V * 8192)
    # an explicit fp32-copy count still overrides the path (the settings' escape hatch)
    two = peak_memory("qwen3-8b", {"dp": 8}, 8192, settings={"trainer": "nemo-rl", "logits_fp32_copies": 2})
    assert two.peak.logits_bytes - base.peak.logits_bytes == pytest.approx(4.0 * V * 8192)


def test_the_issues_numbers_slime_at_the_megatron_budgets_of_qwen3_8b_grpo():
    """Issue 32: the budgets chosen with Megatron's path predict 76.2 / 78.0 GiB with slime's loss."""
    mem = MemorySettings(recompute="full", optimizer="cpu_offload")
    for pass_, gib in (("train", 76.2), ("log_prob", 78.0)):
        tokens = choose_budget("qwen3-8b", {"dp": 8}, 79.1, pass_=pass_, settings=mem).tokens_per_gpu
        peak = peak_memory("qwen3-8b", {"dp": 8}, tokens, pass_=pass_, settings=mem.replace(trainer="slime"))
        assert round(peak.peak_gb, 1) == gib
        own = choose_budget("qwen3-8b", {"dp": 8}, 79.1, pass_=pass_, settings=mem.replace(trainer="slime"))
        assert own.tokens_per_gpu < tokens and own.breakdown.peak_gb <= 71.2


@pytest.mark.parametrize("kw, field", [
    ({"trainer": "slmie"}, "settings.trainer"), ({"trainer": 3}, "settings.trainer"),
    ({"loss_chunk_tokens": 0}, "settings.loss_chunk_tokens"),
    ({"loss_chunk_tokens": 1.5}, "settings.loss_chunk_tokens"),
    ({"loss_temperature": 0}, "settings.loss_temperature"),
    ({"loss_temperature": float("nan")}, "settings.loss_temperature"),
    ({"loss_entropy": "yes"}, "settings.loss_entropy"), ({"loss_fused": 1}, "settings.loss_fused"),
])
def test_unknown_trainers_and_bad_loss_options_are_clear_errors(kw, field):
    with pytest.raises(DynBatchConfigError) as exc:
        MemorySettings(**kw)
    assert exc.value.field == field and exc.value.fix


def test_bad_calls_of_the_loss_path_are_clear_errors():
    for args, field in ((("verl", "eval"), "pass_"), (("nemo",), "trainer")):
        with pytest.raises(DynBatchConfigError) as exc:
            loss_path(*args)
        assert exc.value.field == field
    with pytest.raises(DynBatchConfigError):
        loss_path("slime", "train", "fast")
    assert LossOptions(chunk_tokens=None).chunk_tokens is None


def _budget(model, par, card, pass_, s):
    """The budget, 0 when none fits (a chunk's buffers may take the whole card)."""
    try:
        return choose_budget(model, par, card, pass_=pass_, settings=s).tokens_per_gpu
    except DynBatchConfigError as err:
        assert err.field == "gpu_memory_gb"
        return 0


_OPTIONS = st.fixed_dictionaries({"loss_entropy": st.booleans(), "loss_fused": st.booleans(),
                                  "loss_temperature": st.sampled_from([1.0, 0.6]),
                                  "loss_chunk_tokens": st.sampled_from([None, 512, 4096])})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opts=_OPTIONS, pass_=st.sampled_from(["train", "log_prob"]), model=st.sampled_from(["qwen3-8b", "qwen3-0.6b"]),
       tp=st.sampled_from([1, 2]))
def test_a_loss_that_keeps_more_never_gets_a_larger_budget(opts, pass_, model, tp):
    par = {"dp": 8 // tp, "tp": tp}
    base = MemorySettings(recompute="full", **opts)
    cards = (79.1, 139.8)
    rows = []
    for trainer in TRAINERS:
        s = base.replace(trainer=trainer)
        path = loss_path(trainer, pass_, s.loss_options(), tp=tp)
        cols = ModelSpec.from_any(model).padded_vocab_size / tp
        budgets = [_budget(model, par, c, pass_, s) for c in cards]
        assert budgets[0] <= budgets[1]  # budgets grow with the card
        rows.append((path.bytes_per_token(cols), path.chunk_bytes(cols), budgets[0]))
    for a in rows:
        for b in rows:
            if a[0] >= b[0] and a[1] >= b[1]:  # keeps at least as much per token and per micro-batch
                assert a[2] <= b[2], (rows, opts, pass_)


def test_the_drop_ins_read_their_trainers_loss_options():
    from megatron_dynbatch.core.dropin.budgets import nemo_rl_budgets, roll_budgets, slime_budgets, verl_budgets
    from megatron_dynbatch.core.parallel import ParallelConfig
    from megatron_dynbatch.testing.peer_types import nemo_rl_config, roll_worker_config, slime_args, verl_config

    s = slime_budgets(slime_args(entropy_coef=0.01, rollout_temperature=0.8, log_probs_chunk_size=512),
                      ParallelConfig()).settings
    assert (s.trainer, s.loss_entropy, s.loss_temperature, s.loss_chunk_tokens) == ("slime", True, 0.8, 512)
    s = slime_budgets(slime_args(log_probs_chunk_size=-1), ParallelConfig()).settings  # slime's default: off
    assert (s.loss_entropy, s.loss_temperature, s.loss_chunk_tokens) == (False, 1.0, None)
    v = verl_budgets(verl_config({"actor_rollout_ref.actor.entropy_coeff": 0.001,
                                  "actor_rollout_ref.model.use_fused_kernels": True})).settings
    assert (v.trainer, v.loss_entropy, v.loss_fused) == ("verl", True, True)
    assert verl_budgets(verl_config()).settings.loss_entropy is False
    r = roll_budgets(roll_worker_config({"strategy_args.strategy_config.cross_entropy_loss_fusion": True})).settings
    assert (r.trainer, r.loss_fused) == ("roll", True)
    n = nemo_rl_budgets(nemo_rl_config({"policy.logprob_chunk_size": 2048})).settings
    assert (n.trainer, n.loss_chunk_tokens) == ("nemo-rl", 2048)


def test_a_launch_names_the_trainer_and_its_loss_options():
    args = pytest.importorskip("megatron_dynbatch.megatron.args")
    kw = args.parse_memory_flag("trainer=slime,loss_entropy=true,loss_temperature=0.7,loss_chunk_tokens=1024")
    assert MemorySettings(**kw).loss_options() == LossOptions(True, 0.7, False, 1024)
