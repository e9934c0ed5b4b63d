"""PROOF on real megatron-core (CPU, gloo, 4 processes) that a dynamic-CP plan trains exactly like unpacked
per-sample batches: every micro-batch on its own CP group (sizes 1, 2 and 4 in one step), zig-zag sliced for
that group, RoPE positions from that group (``dynamic_cp.microbatch_cp_group``), the CPU THD attention
all-gathering K/V over that group, the loss normalised over the whole global batch (each token counted once,
whatever its group), gradients all-reduced over the DP x CP pool by Megatron's DDP.

Layouts (4 ranks each):

* ``pool``: dp=2 x cp=2 -- a pool of 4 GPUs; a hand-made plan with groups of 4, 2 and 1 in different slots,
  and the planner's own plan (``plan_global_batch(..., dynamic_cp=True)``) for samples longer than one GPU's
  budget;
* ``pp``: pp=2 x cp=2 (dp=1) -- a pool of 2 GPUs per stage, the same plan on both stages, 1F1B with
  variable lengths; groups of 2 and single GPUs (which must override the model's fixed CP group of 2).

Each run's gradients (after ``finalize_model_grads``) equal those of an UNPACKED single-process reference
(every sample alone, sbhd, plain autograd, same loss definition) built from the gathered full weights, to 1e-5
in fp32, for token_mean (per-micro-batch loss) and sample_mean (``calculate_per_token_loss``); forward-only
log-probs come back in sample order, gathered over the CP groups and the pool.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_dynbatch.megatron.ranks import run_ranks  # noqa: E402

VOCAB = 128
TOL = 1e-5
CASES = (("token_mean", False), ("sample_mean", True))  # (loss mode, calculate_per_token_loss)

#: hand-made slots: (start, size, samples) per group; every group size of the pool in one step
POOL_SLOTS = [
    [(0, 4, [0, 1])],
    [(0, 2, [2]), (2, 1, [3]), (3, 1, [4, 5])],
    [(0, 1, [6]), (1, 1, [7, 8]), (2, 2, [9, 10])],
    [(0, 1, [11]), (1, 1, [12]), (2, 1, [13]), (3, 1, [14, 15])],
]
PP_SLOTS = [
    [(0, 2, [0, 1])],
    [(0, 1, [2, 3]), (1, 1, [4])],
    [(0, 2, [5])],
    [(0, 1, [6]), (1, 1, [7, 8])],
]


def _global_name(name: str, model) -> str:
    """Parameter name with the decoder layer's GLOBAL index (pipeline stages number their layers from 0)."""
    layers = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{layers[int(m.group(1))]}.", name)


def _worker(rank: int, world_size: int, layout: str) -> dict:
    from megatron_dynbatch.demo import (log_prob_max_diff, quiet_megatron_warnings, reference_coefficients,
                                        reference_log_probs, synthetic_rl_batch, unpacked_reference)

    quiet_megatron_warnings()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_dynbatch import plan_global_batch
    from megatron_dynbatch.core.model_spec import ModelSpec
    from megatron_dynbatch.core.planner.dyncp import build_dynamic_cp_plan
    from megatron_dynbatch.megatron.dynamic_cp import destroy_dynamic_cp_groups, get_dynamic_cp_groups
    from megatron_dynbatch.megatron.schedule import dynamic_forward_backward, forward_log_probs
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    pp = 2 if layout == "pp" else 1
    megatron_cpu.init_cpu_distributed(rank, world_size, pp=pp, cp=2)
    try:
        dp = ps.get_data_parallel_world_size()
        parallel = {"dp": dp, "cp": 2, "pp": pp}
        n = 16 if layout == "pool" else 9
        samples = synthetic_rl_batch(n, seed=11, max_len=60)
        samples[3]["loss_mask"] = torch.zeros(len(samples[3]["tokens"]))  # a sample without loss tokens
        lengths = [len(s["tokens"]) for s in samples]
        slots = POOL_SLOTS if layout == "pool" else PP_SLOTS
        config0 = megatron_cpu.tiny_gpt_config()
        spec = ModelSpec.from_megatron(config0, vocab_size=VOCAB)
        plans = {"hand": build_dynamic_cp_plan(lengths, slots, parallel=parallel, max_tokens_per_gpu=128, model=spec)}
        # the planner: long samples over a small budget need groups of several GPUs
        budget = 24 if layout == "pool" else 48
        plans["planner"] = plan_global_batch(lengths, model=spec, parallel=parallel, max_tokens_per_gpu=budget,
                                             dynamic_cp=True)
        if layout == "pool":  # Megatron-LM dev's schedule (one of the planner's candidates) runs on our groups too
            from megatron_dynbatch.core.parallel import ParallelConfig
            from megatron_dynbatch.core.planner.dyncp.upstream import upstream_microbatches

            ups = upstream_microbatches(lengths, ParallelConfig(**parallel), budget)
            plans["upstream"] = build_dynamic_cp_plan(lengths, ups, parallel=parallel, max_tokens_per_gpu=budget,
                                                      model=spec)
        for plan in plans.values():
            plan.validate(n)
        groups = get_dynamic_cp_groups()
        out: dict = {"runs": {}, "pool_rank": groups.pool_rank, "lengths": lengths,
                     "ps_pool_rank": ps.get_data_parallel_rank(with_context_parallel=True),
                     "group_sizes": {k: sorted(p.group_sizes()) for k, p in plans.items()},
                     "stage": ps.get_pipeline_model_parallel_rank()}
        grads, weights = {}, None
        for mode, per_token in CASES:
            config = megatron_cpu.tiny_gpt_config(calculate_per_token_loss=per_token)
            torch.manual_seed(1234)
            model = megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=128, thd=True)
            ddp = megatron_cpu.wrap_ddp(config, model)
            if weights is None:
                weights = {_global_name(k, model): p.detach().clone() for k, p in model.named_parameters()}
            for name, plan in plans.items():
                ddp.zero_grad_buffer()
                res = dynamic_forward_backward(ddp, samples, plan, loss_mode=mode)
                it = res.iterator
                out["row"] = it.row
                out.setdefault("local", {})[name] = [(mb.cp_size, mb.cp_rank, int(mb.tokens.shape[1]),
                                                      int(mb.cu_seqlens_padded[-1])) for mb in it.microbatches(0)]
                grads[(name, mode, per_token)] = {_global_name(k, model): p.main_grad.detach().clone()
                                                  for k, p in model.named_parameters()}
                out["runs"][(name, mode, per_token)] = {"loss": res.loss}
            if mode == "token_mean":
                lp = forward_log_probs(ddp, samples, plans["hand"], gather_outputs=True)
                out["lp_indices"] = list(lp.sample_indices)
                out["lp"] = [t.clone() for t in lp.per_sample] if lp.per_sample is not None else None

        # ---- full weights on every rank (each pipeline stage holds its layers), then the unpacked reference
        every = [None] * world_size
        dist.all_gather_object(every, weights)
        full = {}
        for w in every:
            full.update(w)
        destroy_dynamic_cp_groups()
        ps.destroy_model_parallel()
        ps.initialize_model_parallel()  # tp = pp = cp = 1
        ref = megatron_cpu.build_tiny_gpt(megatron_cpu.tiny_gpt_config(), vocab_size=VOCAB, max_seq_len=128,
                                          thd=True)
        ref_params = dict(ref.named_parameters())
        assert set(full) == set(ref_params), (sorted(full), sorted(ref_params))
        with torch.no_grad():
            for k, p in ref_params.items():
                p.copy_(full[k])
        for mode, per_token in CASES:
            ref_loss, ref_grads = unpacked_reference(ref, samples, reference_coefficients(samples, mode))
            for name in plans:
                g = grads[(name, mode, per_token)]
                diffs = {k: float((v - ref_grads[k]).abs().max()) for k, v in g.items()}
                run = out["runs"][(name, mode, per_token)]
                run.update(max_diff=max(diffs.values()), worst=max(diffs, key=diffs.get), ref_loss=ref_loss,
                           ref_grad_max=max(float(ref_grads[k].abs().max()) for k in g))
        if out.get("lp") is not None:
            ref_lp = reference_log_probs(ref, samples)
            out["lp_diff"] = log_prob_max_diff(out["lp"], ref_lp, out["lp_indices"])
            out["lp_lengths"] = [int(t.shape[0]) for t in out["lp"]]
            del out["lp"]
        dist.barrier()
        return out
    finally:
        megatron_cpu.destroy()


@pytest.fixture(scope="module")
def dyncp_pool_results():
    return run_ranks(_worker, 4, "pool", timeout=300)


@pytest.fixture(scope="module")
def dyncp_pp_results():
    return run_ranks(_worker, 4, "pp", timeout=300)


def _check(results, plans=("hand", "planner", "upstream")):
    for r in results:
        for (name, mode, per_token), run in r["runs"].items():
            assert name in plans
            assert run["ref_grad_max"] > 1e-4  # the comparison is not vacuous
            assert run["max_diff"] <= TOL, (name, mode, per_token, run)
            if run["loss"] is not None:  # the last pipeline stage reports the loss
                assert run["loss"] == pytest.approx(run["ref_loss"], rel=1e-5, abs=1e-7)


@pytest.mark.multiprocess
def test_dyncp_pool_dp2_cp2_matches_unpacked_reference(dyncp_pool_results):
    res = dyncp_pool_results
    assert [r["pool_rank"] for r in res] == [0, 1, 2, 3] == [r["ps_pool_rank"] for r in res] == [r["row"] for r in res]
    assert res[0]["group_sizes"]["hand"] == [1, 2, 4]
    assert max(res[0]["group_sizes"]["planner"]) > 1  # the planner spread the long samples
    assert len(res[0]["group_sizes"]["upstream"]) > 1  # upstream's schedule mixes group sizes in a slot
    for r in res:  # each GPU holds its share of its group's micro-batch
        for size, cp_rank, local, full in r["local"]["hand"]:
            assert local * size == full and 0 <= cp_rank < size
    _check(res)


@pytest.mark.multiprocess
def test_dyncp_pool_log_probs_in_sample_order(dyncp_pool_results):
    for r in dyncp_pool_results:
        assert r["lp_indices"] == list(range(len(r["lengths"])))
        assert r["lp_lengths"] == r["lengths"]
        assert r["lp_diff"] <= TOL


@pytest.mark.multiprocess
def test_dyncp_pp2_cp2_matches_unpacked_reference(dyncp_pp_results):
    res = dyncp_pp_results
    assert sorted(r["stage"] for r in res) == [0, 0, 1, 1]
    assert [r["pool_rank"] for r in res] == [0, 1, 0, 1]
    assert res[0]["group_sizes"]["hand"] == [1, 2]
    # both stages run the same plan: the same local shapes on the same pool rank
    by_rank = {}
    for r in res:
        by_rank.setdefault(r["pool_rank"], []).append(r["local"])
    for pair in by_rank.values():
        assert pair[0] == pair[1]
    _check(res)
    last = [r for r in res if r["stage"] == 1]
    for r in last:
        assert r["lp_indices"] == list(range(len(r["lengths"])))
        assert r["lp_diff"] <= TOL


# ------------------------------------------------------------------------------ single-process pieces
def test_dyncp_iterator_keeps_group_ids_for_the_loss_only():
    """Samples that carry a ``group_id`` (GRPO prompts; Megatron-LM's mock data does) plan under dynamic CP --
    a dynamic-CP plan has no DP ranks to keep a group on, so the ids are not planning constraints there -- and
    still define ``group_mean``'s groups."""
    from megatron_dynbatch.megatron.iterator import DynamicBatchIterator

    g = torch.Generator().manual_seed(3)
    lengths = [60, 7, 30, 12, 5, 22, 9, 16]
    samples = [{"tokens": torch.randint(1, 100, (n,), generator=g), "group_id": i // 4}
               for i, n in enumerate(lengths)]
    kw = dict(parallel={"dp": 2, "cp": 2}, max_tokens_per_gpu=16, dynamic_cp=True, dp_rank=0, cp_rank=0)
    it = DynamicBatchIterator(samples, loss_mode="group_mean", **kw)
    assert it.dynamic_cp and it.group_ids == [0, 0, 0, 0, 1, 1, 1, 1]
    assert 4 in it.plan.group_sizes()  # the 60-token sample needs the whole pool at 16 tokens per GPU
    # group_mean over the two groups: every group's token weights sum to 1 / G
    w = it.normalizer(0).coefficients
    t = [n - 1 for n in lengths]
    assert [w[i] * t[i] for i in range(8)] == pytest.approx([0.5 * t[i] / sum(t[:4]) for i in range(4)]
                                                           + [0.5 * t[i] / sum(t[4:]) for i in range(4, 8)])
    same = DynamicBatchIterator(samples, it.plan, loss_mode="group_mean", dp_rank=0, cp_rank=0)
    assert same.group_ids == it.group_ids


def test_dynamic_cp_refuses_multi_token_prediction():
    """MTP rolls its labels over the model's fixed CP group (megatron-core 0.16.1 roll_tensor): refused at
    start-up from the flags and per step from the model config."""
    import argparse
    from types import SimpleNamespace

    from megatron_dynbatch.core.errors import DynBatchConfigError
    from megatron_dynbatch.megatron.args import add_dynamic_batch_args, validate_dynamic_batch_args
    from megatron_dynbatch.megatron.dynamic_cp import check_dynamic_cp_model

    args = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(
        "--use-dynamic-batch-size --balance-by-flops --max-tokens-per-gpu 4096 --dynbatch-dynamic-cp".split())
    args.world_size, args.context_parallel_size, args.mtp_num_layers = 8, 2, 1
    with pytest.raises(DynBatchConfigError, match="multi-token prediction") as err:
        validate_dynamic_batch_args(args)
    assert err.value.field == "--mtp-num-layers" and "--dynbatch-dynamic-cp" in err.value.fix
    args.mtp_num_layers = None
    validate_dynamic_batch_args(args)
    args.dynbatch_dynamic_cp, args.mtp_num_layers = False, 2  # fixed CP with MTP is not our business here
    validate_dynamic_batch_args(args)
    with pytest.raises(DynBatchConfigError, match="config.mtp_num_layers"):
        check_dynamic_cp_model(SimpleNamespace(mtp_num_layers=1))
    for ok in (SimpleNamespace(), SimpleNamespace(mtp_num_layers=None), SimpleNamespace(mtp_num_layers=0)):
        check_dynamic_cp_model(ok)
