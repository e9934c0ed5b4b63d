"""PROOF on real megatron-core (CPU, gloo, 2 processes) for model-parallel layouts:

* PP=2: micro-batches of different lengths through the 1F1B schedule (``variable_seq_lengths``);
* TP=2 with sequence-parallel padding (the plan and the packer pad every micro-batch to a multiple of TP; the
  model here runs without ``sequence_parallel`` -- the real sequence-parallel step, with the
  ``megatron/norms.py`` norm, is in ``tests/test_megatron_cp_sp.py``);

both give the gradients of an UNPACKED single-GPU reference: after the step, the ranks gather their shards /
stages into full weights, switch Megatron to TP=PP=1, build the full model with those weights and run every
sample alone (sbhd, plain autograd, same loss definition); the reference gradients, sharded / split like the
rank's parameters, must match the rank's gradients after ``finalize_model_grads``.

CP=2 through the packing / slicing path in ONE process: each CP rank's share of the per-token loss is taken
from a full-sequence forward of the same packed micro-batch (zig-zag slice) and fed to that CP rank's loss
function; with Megatron's scaling re-enacted, the summed gradient equals the reference. (The real 2-rank CP
step, with the CP attention of ``ThdDotProductAttention``, is in ``tests/test_megatron_cp_sp.py``.)
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


# ---------------------------------------------------------------------------------------- weights
def _layer_map(model) -> dict:
    """Local layer index -> global (0-based) layer index, from Megatron's own 1-based ``layer_number``."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}


def _global_name(name: str, layer_map: dict) -> str:
    return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{layer_map[int(m.group(1))]}.", name)


def _gather_full(model, tp_group) -> dict:
    """This model chunk's parameters as full (TP-gathered) tensors under global layer names."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group)
    layers = _layer_map(model)
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
            pieces = [q.chunk(stride, dim=dim) for q in parts]
            t = torch.cat([pieces[r][j] for j in range(stride) for r in range(tp)], dim=dim)
        out[_global_name(name, layers)] = t
    return out


def _local_view(full, meta, tp: int, tp_rank: int):
    """Shard a full tensor the way this rank's parameter is sharded (inverse of _gather_full)."""
    is_tp, dim, stride = meta
    if not is_tp or tp == 1:
        return full
    chunk = full.shape[dim] // (stride * tp)
    return torch.cat(full.split(chunk, dim=dim)[tp_rank::tp], dim=dim)


# ----------------------------------------------------------------------------------------- CP path
def _cp_path_diffs(ref, samples, spec, coef_fn) -> dict:
    from megatron_dynbatch import plan_global_batch
    from megatron_dynbatch.megatron.context_parallel import zigzag_partition_indices
    from megatron_dynbatch.demo import unpacked_reference
    from megatron_dynbatch.megatron.iterator import DynamicBatchIterator
    from megatron_dynbatch.megatron.packing import pack_microbatch

    dp, cp = 2, 2
    plan = plan_global_batch([len(s["tokens"]) for s in samples], model=spec, parallel={"dp": dp, "cp": cp},
                             max_tokens_per_gpu=20)
    out = {}
    for mode, per_token in CASES:
        _, ref_grads = unpacked_reference(ref, samples, coef_fn(mode))
        for p in ref.parameters():
            p.grad = None
        values, counts, ms = [], [], []
        for r in range(dp):
            for c in range(cp):
                it = DynamicBatchIterator(samples, plan, dp_rank=r, cp_rank=c, loss_mode=mode)
                for mb in it.microbatches():
                    full = pack_microbatch([samples[i] for i in mb.sample_indices], plan.alignment,
                                           sample_indices=mb.sample_indices)
                    ce = ref(full.tokens, full.position_ids, None, labels=full.labels,
                             packed_seq_params=full.packed_seq_params)
                    local = ce.index_select(1, zigzag_partition_indices(full.cu_seqlens_padded, cp, c))
                    value, n, _ = it.loss_func(mb, calculate_per_token_loss=per_token, dp_size=dp)(local)
                    values.append(value)
                    counts.append(int(n))
                    ms.append(it.num_microbatches)
        if per_token:  # DDP sums over DP x CP, finalize divides by the all-reduced token count
            total = sum(values) / sum(counts)
        else:  # Megatron divides by n and M, DDP averages over DP x CP
            total = sum(v / max(n, 1) / m for v, n, m in zip(values, counts, ms)) / (dp * cp)
        total.backward()
        out[(mode, per_token)] = max(float((p.grad - ref_grads[n]).abs().max()) for n, p in ref.named_parameters())
        out["cp_microbatches"] = plan.num_microbatches
    return out


# ------------------------------------------------------------------------------------------ worker
def _layout_worker(rank: int, world_size: int, layout: str) -> dict:
    from megatron_dynbatch.demo import (log_prob_max_diff, quiet_megatron_warnings, reference_coefficients,
                                        reference_log_probs, synthetic_rl_batch, unpacked_reference)

    quiet_megatron_warnings()
    from megatron.core import parallel_state

    from megatron_dynbatch.core.model_spec import ModelSpec
    from megatron_dynbatch.megatron.schedule import dynamic_forward_backward, forward_log_probs
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    tp, pp, vpp = {"tp": (2, 1, 1), "pp": (1, 2, 1), "vpp": (1, 2, 2)}[layout]
    num_layers = 4 if vpp > 1 else 2
    sp = layout == "tp"
    megatron_cpu.init_cpu_distributed(rank, world_size, tp=tp, pp=pp, vpp=vpp if vpp > 1 else None)
    try:
        samples = synthetic_rl_batch(8 if vpp == 1 else 12, seed=11, max_len=40)
        coef = {mode: reference_coefficients(samples, mode) for mode, _ in CASES}
        parallel = {"dp": 1, "tp": tp, "pp": pp, "vpp": vpp, "sequence_parallel": sp}
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        out: dict = {"runs": {}, "pp_rank": pp_rank, "tp_rank": tp_rank, "last": last}
        grads, meta, local_names, full_weights = {}, {}, {}, None
        for mode, per_token in CASES:
            # variable_seq_lengths off: the wrapper must turn it on. batch_p2p_comm off: with two stages and
            # VPP, gloo's batch_isend_irecv pairs the two same-peer transfers of a bidirectional exchange in
            # posting order, which crosses activations and gradients (seen on CPU even at fixed shapes).
            config = megatron_cpu.tiny_gpt_config(calculate_per_token_loss=per_token, num_layers=num_layers,
                                                  variable_seq_lengths=False, batch_p2p_comm=vpp == 1)
            torch.manual_seed(1234)
            chunks = [megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=128, thd=True,
                                                  vp_stage=v if vpp > 1 else None) for v in range(vpp)]
            ddps = megatron_cpu.wrap_ddp(config, list(chunks))
            spec = ModelSpec.from_megatron(config, vocab_size=VOCAB)
            if full_weights is None:
                full_weights = {}
                for m in chunks:
                    full_weights.update(_gather_full(m, parallel_state.get_tensor_model_parallel_group()))
            for d in ddps:
                d.zero_grad_buffer()
            res = dynamic_forward_backward(ddps if vpp > 1 else ddps[0], samples,
                                           {"model": spec, "parallel": parallel, "max_tokens_per_gpu": 48},
                                           loss_mode=mode)
            out["variable_seq_lengths"] = bool(config.variable_seq_lengths)
            out["local_lengths"] = [mb.num_tokens for mb in res.iterator.microbatches(0)]
            out["microbatch_tokens"] = res.iterator.plan.microbatch_tokens
            out["padding_tokens"] = res.iterator.plan.padding_tokens
            grads[(mode, per_token)] = {f"{v}/{n}": p.main_grad.detach().clone()
                                        for v, d in enumerate(ddps) for n, p in d.module.named_parameters()}
            for v, d in enumerate(ddps):
                layers = _layer_map(d.module)
                for n, p in d.module.named_parameters():
                    meta[f"{v}/{n}"] = (bool(getattr(p, "tensor_model_parallel", False)),
                                        getattr(p, "partition_dim", -1), getattr(p, "partition_stride", 1))
                    local_names[f"{v}/{n}"] = _global_name(n, layers)
            out["runs"][(mode, per_token)] = {"loss": res.loss, "num_microbatches": res.num_microbatches}
        ddp = ddps if vpp > 1 else ddps[0]
        lp = forward_log_probs(ddp, samples, {"model": spec, "parallel": parallel, "max_tokens_per_gpu": 64})

        if layout == "tp":  # vocab-parallel logits -> log-probs equals minus the fused vocab-parallel CE
            from megatron_dynbatch.demo import sample_targets
            from megatron_dynbatch.megatron.schedule import log_probs_from_logits

            s0 = samples[0]
            labels, _ = sample_targets(s0)
            pos = torch.arange(len(s0["tokens"])).unsqueeze(0)
            with torch.no_grad():
                logits = chunks[0](s0["tokens"].unsqueeze(0), pos, None)
                ce = chunks[0](s0["tokens"].unsqueeze(0), pos, None, labels=labels.unsqueeze(0))
            out["vocab_shard"] = int(logits.shape[-1])
            out["logits_lp_diff"] = float((log_probs_from_logits(logits, labels.unsqueeze(0)) + ce).abs().max())

        # -------- the single-GPU unpacked reference on the gathered full weights
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel()  # tp = pp = 1 (dp = 2)
        ref_config = megatron_cpu.tiny_gpt_config(num_layers=num_layers)
        ref = megatron_cpu.build_tiny_gpt(ref_config, vocab_size=VOCAB, max_seq_len=128, thd=True)
        import torch.distributed as dist

        everything: list = [None] * world_size
        dist.all_gather_object(everything, full_weights)  # PP stages hold different layers
        merged = {k: v for d in everything for k, v in d.items()}
        ref_names = dict(ref.named_parameters())
        assert set(merged) == set(ref_names), (sorted(merged), sorted(ref_names))
        with torch.no_grad():
            for n, p in ref_names.items():
                p.copy_(merged[n])
        for mode, per_token in CASES:
            ref_loss, ref_grads = unpacked_reference(ref, samples, coef[mode])
            diffs = {n: float((g - _local_view(ref_grads[local_names[n]], meta[n], tp, tp_rank)).abs().max())
                     for n, g in grads[(mode, per_token)].items()}
            run = out["runs"][(mode, per_token)]
            run.update(max_diff=max(diffs.values()), worst=max(diffs, key=diffs.get), ref_loss=ref_loss,
                       ref_grad_max=max(float(g.abs().max()) for g in ref_grads.values()))
        if last:
            ref_lp = reference_log_probs(ref, samples)
            out["logprob_lengths"] = [int(t.shape[0]) for t in lp.per_sample]
            out["logprob_diff"] = log_prob_max_diff(lp.per_sample, ref_lp)
        out["lengths"] = [len(s["tokens"]) for s in samples]
        if layout == "pp" and rank == 0:
            out["cp"] = _cp_path_diffs(ref, samples, ModelSpec.from_megatron(ref_config, vocab_size=VOCAB),
                                       lambda mode: reference_coefficients(samples, mode))
        return out
    finally:
        megatron_cpu.destroy()


@pytest.fixture(scope="module")
def pp_results():
    return run_ranks(_layout_worker, 2, "pp", timeout=180)


@pytest.fixture(scope="module")
def vpp_results():
    return run_ranks(_layout_worker, 2, "vpp", timeout=180)


@pytest.fixture(scope="module")
def tp_results():
    return run_ranks(_layout_worker, 2, "tp", timeout=180)


def _check_runs(results):
    for r in results:
        for (mode, per_token), run in r["runs"].items():
            assert run["ref_grad_max"] > 1e-4
            assert run["max_diff"] <= TOL, (mode, per_token, run)
            if r["last"]:
                assert run["loss"] == pytest.approx(run["ref_loss"], rel=1e-5, abs=1e-7)
            else:
                assert run["loss"] is None  # only the last stage computes the loss


@pytest.mark.multiprocess
def test_pp2_variable_lengths_match_unpacked_reference(pp_results):
    assert [r["pp_rank"] for r in pp_results] == [0, 1]
    assert all(r["variable_seq_lengths"] for r in pp_results)  # turned on by dynamic_forward_backward
    tokens = pp_results[0]["microbatch_tokens"][0]
    assert len(tokens) >= 3 and len(set(tokens)) > 1  # several micro-batches of different lengths
    _check_runs(pp_results)


@pytest.mark.multiprocess
def test_pp2_forward_only_log_probs(pp_results):
    last = pp_results[1]
    assert last["logprob_lengths"] == last["lengths"]
    assert last["logprob_diff"] <= TOL
    assert "logprob_lengths" not in pp_results[0]


@pytest.mark.multiprocess
def test_pp2_vpp2_interleaved_matches_unpacked_reference(vpp_results):
    """Interleaved 1F1B: one iterator per model chunk, M a multiple of N = pp (Megatron's constraint)."""
    m = vpp_results[0]["runs"][CASES[0]]["num_microbatches"]
    assert m >= 2 and m % 2 == 0
    planned = vpp_results[0]["microbatch_tokens"][0]
    assert len(set(planned)) > 1  # the plan has micro-batches of different sizes ...
    for r in vpp_results:  # ... run at one length per step (megatron-core 0.16 pp=2 shape-exchange bug)
        assert set(r["local_lengths"]) == {max(planned)}
        assert not r["variable_seq_lengths"]
    _check_runs(vpp_results)
    last = vpp_results[1]
    assert last["logprob_lengths"] == last["lengths"] and last["logprob_diff"] <= TOL


@pytest.mark.multiprocess
def test_tp2_sequence_parallel_matches_unpacked_reference(tp_results):
    assert [r["tp_rank"] for r in tp_results] == [0, 1]
    tokens = [t for rank in tp_results[0]["microbatch_tokens"] for t in rank]
    assert all(t % 2 == 0 for t in tokens)  # padded to a multiple of TP for sequence parallelism
    assert tp_results[0]["padding_tokens"] > 0  # ... and some micro-batch really needed padding
    _check_runs(tp_results)
    for r in tp_results:
        assert r["logprob_lengths"] == r["lengths"] and r["logprob_diff"] <= TOL
        assert r["vocab_shard"] == VOCAB // 2 and r["logits_lp_diff"] <= 1e-5  # log_probs_from_logits under TP


@pytest.mark.multiprocess
def test_cp2_packing_slicing_path_matches_unpacked_reference(pp_results):
    cp = pp_results[0]["cp"]
    assert cp["cp_microbatches"] >= 2
    for case in CASES:
        assert cp[case] <= TOL, (case, cp[case])
