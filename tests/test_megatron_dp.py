"""PROOF on real megatron-core (CPU, gloo, 2 processes): DP=2 dynamic batching gives the gradients of a
single-process UNPACKED reference (each sample alone, sbhd, plain autograd, same loss definition), for
token_mean and sample_mean, with and without calculate_per_token_loss; forward-only log-probs come back in
sample order; every DP rank builds the identical plan without communicating."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_dynbatch.megatron.ranks import run_ranks  # noqa: E402

VOCAB = 128
TOL = 1e-5
MODES = ("token_mean", "sample_mean")


def plan_json(plan) -> str:
    d = plan.to_dict()
    d.pop("planning_time_s", None)
    d["summary"].pop("planning_time_s", None)
    return json.dumps(d, sort_keys=True)


def _dp_worker(rank: int, world_size: int) -> dict:
    from megatron_dynbatch.demo import (log_prob_max_diff, quiet_megatron_warnings, reference_coefficients,
                                        reference_log_probs, synthetic_rl_batch, unpacked_reference)

    quiet_megatron_warnings()

    from megatron_dynbatch.core.model_spec import ModelSpec
    from megatron_dynbatch.megatron.schedule import dynamic_forward_backward, forward_log_probs
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    megatron_cpu.init_cpu_distributed(rank, world_size)
    try:
        samples = synthetic_rl_batch(12, seed=7, max_len=40, group_size=2)
        samples[3]["loss_mask"] = torch.zeros(len(samples[3]["tokens"]))  # a sample without loss tokens
        out: dict = {"results": {}}
        for per_token in (False, True):
            config = megatron_cpu.tiny_gpt_config(calculate_per_token_loss=per_token)
            torch.manual_seed(1234)
            model = megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=128, thd=True)
            ref = megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=128, thd=True)
            ref.load_state_dict(model.state_dict())
            ddp = megatron_cpu.wrap_ddp(config, model)
            spec = ModelSpec.from_megatron(config, vocab_size=VOCAB)
            plan_kwargs = {"model": spec, "parallel": {"dp": world_size}, "max_tokens_per_gpu": 64}
            for mode in MODES:
                ddp.zero_grad_buffer()
                res = dynamic_forward_backward(ddp, samples, plan_kwargs, loss_mode=mode)
                ref_loss, ref_grads = unpacked_reference(ref, samples, reference_coefficients(samples, mode))
                diffs = {n: float((p.main_grad - ref_grads[n]).abs().max()) for n, p in ddp.module.named_parameters()}
                out["results"][(mode, per_token)] = {
                    "max_diff": max(diffs.values()),
                    "worst": max(diffs, key=diffs.get),
                    "ref_grad_max": max(float(g.abs().max()) for g in ref_grads.values()),
                    "loss": res.loss,
                    "ref_loss": ref_loss,
                    "num_microbatches": res.num_microbatches,
                }
                out["plan"] = plan_json(res.iterator.plan)
                out["microbatch_tokens"] = res.iterator.plan.microbatch_tokens
            if not per_token:  # a plan with two optimizer steps: run step 1 only
                ddp.zero_grad_buffer()
                res = dynamic_forward_backward(ddp, samples, dict(plan_kwargs, samples_per_step=6), step=1)
                sub = samples[6:]
                ref_loss, ref_grads = unpacked_reference(ref, sub, reference_coefficients(sub, "token_mean"))
                out["step1"] = {
                    "max_diff": max(float((p.main_grad - ref_grads[n]).abs().max())
                                    for n, p in ddp.module.named_parameters()),
                    "loss": res.loss, "ref_loss": ref_loss, "num_steps": res.iterator.num_steps,
                    "samples": res.iterator.step_samples(1)}
        # log_probs_from_logits on the model's logits equals minus Megatron's fused cross-entropy
        from megatron_dynbatch.demo import sample_targets
        from megatron_dynbatch.megatron.schedule import log_probs_from_logits

        s0 = samples[0]
        labels, _ = sample_targets(s0)
        with torch.no_grad():
            pos = torch.arange(len(s0["tokens"])).unsqueeze(0)
            logits = ref(s0["tokens"].unsqueeze(0), pos, None)
            ce = ref(s0["tokens"].unsqueeze(0), pos, None, labels=labels.unsqueeze(0))
        out["logits_lp_diff"] = float((log_probs_from_logits(logits, labels.unsqueeze(0)) + ce).abs().max())
        # forward-only log-probs with their own (larger) budget, gathered into global sample order
        lp = forward_log_probs(ddp, samples, {"model": spec, "parallel": {"dp": world_size},
                                              "max_tokens_per_gpu": 96}, gather_outputs=True)
        ref_lp = reference_log_probs(ref, samples)
        out["logprob_lengths"] = [int(t.shape[0]) for t in lp.per_sample]
        out["logprob_diff"] = log_prob_max_diff(lp.per_sample, ref_lp)
        out["logprob_plan_mbs"] = lp.num_microbatches
        out["lengths"] = [len(s["tokens"]) for s in samples]
        # a local-mode plan (this rank's half, dp=1) is refused: its loss would be normalised over half the tokens
        from megatron_dynbatch import DynamicBatchIterator, local_microbatch_counts, plan_local_batch
        from megatron_dynbatch.core.errors import DynBatchConfigError

        mine = samples[rank::world_size]
        kw = {"max_tokens_per_gpu": 64, "balance_by_flops": False}
        my_lengths = [len(s["tokens"]) for s in mine]
        local = plan_local_batch(my_lengths, num_microbatches=local_microbatch_counts(my_lengths, **kw), **kw)
        try:
            DynamicBatchIterator(mine, local)
            out["local_plan_error"] = None
        except DynBatchConfigError as exc:
            out["local_plan_error"] = str(exc)
        return out
    finally:
        megatron_cpu.destroy()


@pytest.fixture(scope="module")
def dp_results():
    return run_ranks(_dp_worker, 2, timeout=180)


@pytest.mark.multiprocess
@pytest.mark.parametrize("per_token", [False, True], ids=["per_mb_loss", "per_token_loss"])
@pytest.mark.parametrize("mode", MODES)
def test_dp2_gradients_match_unpacked_reference(dp_results, mode, per_token):
    for r in dp_results:
        res = r["results"][(mode, per_token)]
        assert res["ref_grad_max"] > 1e-4  # the comparison is not vacuous
        assert res["max_diff"] <= TOL, res
        assert res["loss"] == pytest.approx(res["ref_loss"], rel=1e-5, abs=1e-7)


@pytest.mark.multiprocess
def test_dp2_plan_is_dynamic_and_identical_on_every_rank(dp_results):
    r0, r1 = dp_results
    assert r0["plan"] == r1["plan"]  # no communication needed to agree
    tokens = [t for rank in r0["microbatch_tokens"] for t in rank]
    assert r0["results"][("token_mean", False)]["num_microbatches"] >= 2
    assert len(set(tokens)) > 1  # micro-batches really differ in size


@pytest.mark.multiprocess
def test_dp2_forward_only_log_probs_in_sample_order(dp_results):
    for r in dp_results:
        assert r["logprob_lengths"] == r["lengths"]
        assert r["logprob_diff"] <= TOL


@pytest.mark.multiprocess
def test_dp2_second_optimizer_step_of_a_split_batch(dp_results):
    for r in dp_results:
        st = r["step1"]
        assert st["num_steps"] == 2 and st["samples"] == list(range(6, 12))
        assert st["max_diff"] <= TOL
        assert st["loss"] == pytest.approx(st["ref_loss"], rel=1e-5)


@pytest.mark.multiprocess
def test_log_probs_from_logits_matches_fused_cross_entropy(dp_results):
    assert dp_results[0]["logits_lp_diff"] <= 1e-5


@pytest.mark.multiprocess
def test_a_local_mode_plan_is_refused_by_the_iterator(dp_results):
    for r in dp_results:
        assert r["local_plan_error"] is not None and "local-mode plan" in r["local_plan_error"]
        assert "plain batching's gradient" in r["local_plan_error"]
