"""PROOF on real megatron-core (CPU, gloo, 2 processes) for sequence parallelism and context parallelism,
run for real (no padding-only or slicing-only stand-ins):

* TP=2 with ``sequence_parallel=True``: the model uses the sequence-parallel torch norm
  (:mod:`megatron_dynbatch.megatron.norms`), Megatron scatters each packed micro-batch's tokens over TP (the plan
  pads every micro-batch to a multiple of TP), all-gathers them around the attention / MLP, and
  ``finalize_model_grads`` all-reduces the norm-weight gradients over TP;
* CP=2: each CP rank runs its zig-zag half of every packed micro-batch through
  :class:`~megatron_dynbatch.megatron.attention.ThdDotProductAttention`, which all-gathers K/V over the CP group; DDP
  averages the gradients over DP x CP; forward-only log-probs are all-gathered over CP
  (``gather.gather_cp_output``) and split back into samples.

Both give the gradients of an UNPACKED single-process reference (each sample alone, sbhd, plain autograd, same
loss definition) built from the gathered full weights after the step, to 1e-5 in fp32, for token_mean (per
micro-batch loss) and sample_mean (``calculate_per_token_loss``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_dynbatch.megatron.ranks import run_ranks  # noqa: E402

VOCAB = 128
TOL = 1e-5
CASES = (("token_mean", False), ("sample_mean", True))  # (loss mode, calculate_per_token_loss)


def _gather_full(model, tp_group) -> dict:
    """The model's parameters as full (TP-gathered) tensors."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group)
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
            pieces = [q.chunk(stride, dim=dim) for q in parts]
            t = torch.cat([pieces[r][j] for j in range(stride) for r in range(tp)], dim=dim)
        out[name] = t
    return out


def _local_view(full, meta, tp: int, tp_rank: int):
    """Shard a full tensor the way this rank's parameter is sharded (inverse of _gather_full)."""
    is_tp, dim, stride = meta
    if not is_tp or tp == 1:
        return full
    chunk = full.shape[dim] // (stride * tp)
    return torch.cat(full.split(chunk, dim=dim)[tp_rank::tp], dim=dim)


def _core_attention_cp_check(cp_rank: int, cp: int) -> dict:
    """The CP core attention alone, against the cp=1 path on the full batch: outputs and the gradients of q, k
    and v on this rank's zig-zag rows (k/v gradients come back through the reduce-scatter of the K/V gather).
    Padding between sequences, an empty sample, one-token samples (one CP rank then holds only padding rows of
    that sequence, or of the whole micro-batch), causal and bidirectional masks."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dynbatch.core.alignment import Alignment
    from megatron_dynbatch.megatron.attention import ThdDotProductAttention
    from megatron_dynbatch.megatron.context_parallel import zigzag_partition_indices
    from megatron_dynbatch.megatron.packing import pack_microbatch
    from megatron_dynbatch.core.parallel import ParallelConfig
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    cases = {"mixed": ([5, 0, 9, 1, 12], AttnMaskType.causal), "one_token": ([1, 1], AttnMaskType.causal),
             "bidirectional": ([7, 3, 10], AttnMaskType.no_mask)}
    out = {}
    for name, (lengths, mask) in cases.items():
        g = torch.Generator().manual_seed(len(lengths))
        samples = [{"tokens": torch.randint(0, VOCAB, (n,), generator=g)} for n in lengths]
        pk = pack_microbatch(samples, Alignment.for_layout(ParallelConfig(cp=cp)))
        T = pk.num_tokens
        q, k, v = (torch.randn(T, nh, 16, generator=g) for nh in (4, 2, 2))
        w = torch.randn(T, 4 * 16, generator=g)
        cores = {}
        for c in (1, cp):
            cfg = megatron_cpu.tiny_gpt_config(context_parallel_size=c)
            cores[c] = ThdDotProductAttention(cfg, layer_number=1, attn_mask_type=mask, attention_type="self")
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = cores[1](*full, None, attn_mask_type=mask, packed_seq_params=pk.packed_seq_params)
        (ref * w).sum().backward()
        idx = zigzag_partition_indices(pk.cu_seqlens_padded, cp, cp_rank)
        local = [x[idx].clone().requires_grad_() for x in (q, k, v)]
        got = cores[cp](*local, None, attn_mask_type=mask, packed_seq_params=pk.packed_seq_params)
        (got * w[idx]).sum().backward()
        out[name] = {"out": float((got - ref[idx]).abs().max()),
                     "grads": max(float((lx.grad - fx.grad[idx]).abs().max()) for lx, fx in zip(local, full)),
                     "grad_max": max(float(fx.grad.abs().max()) for fx in full)}
    out["sbhd"] = _core_attention_sbhd_cp_check(cp_rank, cp)
    return out


def _core_attention_sbhd_cp_check(cp_rank: int, cp: int) -> dict:
    """UNPACKED ``[s/cp, b, heads, d]`` input under CP (Megatron's own fixed batches, split into chunks ``r`` and
    ``2cp-1-r`` by ``get_batch_on_this_cp_rank``) against Megatron's own cp=1 ``DotProductAttention`` on the full
    sequences: without a mask, with the dataloader's causal mask sliced the same way, and a non-causal mask is
    refused."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dynbatch.core.errors import DynBatchConfigError
    from megatron_dynbatch.megatron.attention import ThdDotProductAttention
    from megatron_dynbatch.megatron.context_parallel import zigzag_partition_indices
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    causal = AttnMaskType.causal
    g = torch.Generator().manual_seed(11)
    s, b = 2 * cp * 5, 3
    q, k, v = (torch.randn(s, b, nh, 16, generator=g) for nh in (4, 2, 2))
    w = torch.randn(s, b, 4 * 16, generator=g)
    cores = {c: ThdDotProductAttention(megatron_cpu.tiny_gpt_config(context_parallel_size=c), layer_number=1,
                                       attn_mask_type=causal, attention_type="self") for c in (1, cp)}
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = cores[1](*full, None, attn_mask_type=causal)  # megatron-core's own sbhd path, [s, b, heads*d]
    (ref * w).sum().backward()
    idx = zigzag_partition_indices(torch.tensor([0, s]), cp, cp_rank)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s)[:, :, idx]  # the dataloader's, CP-split
    res = {"out": 0.0, "grads": 0.0, "grad_max": max(float(fx.grad.abs().max()) for fx in full)}
    for m in (None, mask):
        local = [x[idx].clone().requires_grad_() for x in (q, k, v)]
        got = cores[cp](*local, m, attn_mask_type=causal)
        (got * w[idx]).sum().backward()
        res["out"] = max(res["out"], float((got - ref[idx]).abs().max()))
        res["grads"] = max([res["grads"]] + [float((lx.grad - fx.grad[idx]).abs().max())
                                             for lx, fx in zip(local, full)])
    try:
        cores[cp](*(x[idx] for x in (q, k, v)), torch.zeros_like(mask), attn_mask_type=causal)
        res["refused_bad_mask"] = 0.0
    except DynBatchConfigError:
        res["refused_bad_mask"] = 1.0
    return res


def _worker(rank: int, world_size: int, layout: str) -> dict:
    from megatron_dynbatch.demo import (log_prob_max_diff, quiet_megatron_warnings, reference_coefficients,
                                        reference_log_probs, synthetic_rl_batch, unpacked_reference)

    quiet_megatron_warnings()
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dynbatch.core.model_spec import ModelSpec
    from megatron_dynbatch.megatron.schedule import dynamic_forward_backward, forward_log_probs
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    tp, cp = {"sp": (2, 1), "cp": (1, 2)}[layout]
    sp = layout == "sp"
    megatron_cpu.init_cpu_distributed(rank, world_size, tp=tp, cp=cp)
    try:
        samples = synthetic_rl_batch(8, seed=5, max_len=40)
        samples[2]["loss_mask"] = torch.zeros(len(samples[2]["tokens"]))  # a sample without loss tokens
        # sequence_parallel is NOT in the plan's layout: dynamic_forward_backward adds it from the config
        parallel = {"dp": 1, "tp": tp, "cp": cp}
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        out: dict = {"runs": {}, "tp_rank": tp_rank, "cp_rank": parallel_state.get_context_parallel_rank()}
        grads, meta, full_weights = {}, {}, None
        for mode, per_token in CASES:
            config = megatron_cpu.tiny_gpt_config(calculate_per_token_loss=per_token, sequence_parallel=sp)
            torch.manual_seed(1234)
            model = megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=128, thd=True)
            ddp = megatron_cpu.wrap_ddp(config, model)
            spec = ModelSpec.from_megatron(config, vocab_size=VOCAB)
            if full_weights is None:
                full_weights = _gather_full(model, parallel_state.get_tensor_model_parallel_group())
                out["sp_marked"] = sorted(n for n, p in model.named_parameters()
                                          if getattr(p, "sequence_parallel", False))
            ddp.zero_grad_buffer()
            res = dynamic_forward_backward(ddp, samples, {"model": spec, "parallel": parallel,
                                                          "max_tokens_per_gpu": 48}, loss_mode=mode)
            mbs = res.iterator.microbatches(0)
            out["plan_sp"] = res.iterator.plan.parallel.sequence_parallel
            out["local_tokens"] = [int(mb.tokens.shape[1]) for mb in mbs]
            out["packed_tokens"] = [int(mb.cu_seqlens_padded[-1]) for mb in mbs]
            out["full_tokens"] = res.iterator.plan.microbatch_tokens[0]
            out["padding_tokens"] = res.iterator.plan.padding_tokens
            grads[(mode, per_token)] = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
            for n, p in model.named_parameters():
                meta[n] = (bool(getattr(p, "tensor_model_parallel", False)), getattr(p, "partition_dim", -1),
                           getattr(p, "partition_stride", 1))
            out["runs"][(mode, per_token)] = {"loss": res.loss, "num_microbatches": res.num_microbatches}
        lp = forward_log_probs(ddp, samples, {"model": spec, "parallel": parallel, "max_tokens_per_gpu": 64})
        out["logprob_mbs"] = lp.num_microbatches
        lp_gathered = forward_log_probs(ddp, samples, {"model": spec, "parallel": parallel,
                                                       "max_tokens_per_gpu": 64}, gather_outputs=True)

        if layout == "cp":
            out["core"] = _core_attention_cp_check(parallel_state.get_context_parallel_rank(), cp)

        # -------- the single-process unpacked reference on the gathered full weights
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel()  # tp = cp = 1 (dp = 2)
        ref = megatron_cpu.build_tiny_gpt(megatron_cpu.tiny_gpt_config(), vocab_size=VOCAB, max_seq_len=128,
                                          thd=True)
        ref_names = dict(ref.named_parameters())
        assert set(full_weights) == set(ref_names), (sorted(full_weights), sorted(ref_names))
        with torch.no_grad():
            for n, p in ref_names.items():
                p.copy_(full_weights[n])
        for mode, per_token in CASES:
            ref_loss, ref_grads = unpacked_reference(ref, samples, reference_coefficients(samples, mode))
            diffs = {n: float((g - _local_view(ref_grads[n], meta[n], tp, tp_rank)).abs().max())
                     for n, g in grads[(mode, per_token)].items()}
            run = out["runs"][(mode, per_token)]
            run.update(max_diff=max(diffs.values()), worst=max(diffs, key=diffs.get), ref_loss=ref_loss,
                       ref_grad_max=max(float(g.abs().max()) for g in ref_grads.values()))
        ref_lp = reference_log_probs(ref, samples)

        def lp_diff(per_sample, indices):
            return log_prob_max_diff(per_sample, ref_lp, indices)

        out["logprob_indices"] = list(lp.sample_indices)
        out["logprob_lengths"] = [int(t.shape[0]) for t in lp.per_sample]
        out["logprob_diff"] = lp_diff(lp.per_sample, lp.sample_indices)
        out["gathered_indices"] = list(lp_gathered.sample_indices)
        out["gathered_diff"] = lp_diff(lp_gathered.per_sample, lp_gathered.sample_indices)
        out["lengths"] = [len(s["tokens"]) for s in samples]
        dist.barrier()
        return out
    finally:
        megatron_cpu.destroy()


@pytest.fixture(scope="module")
def sp_results():
    return run_ranks(_worker, 2, "sp", timeout=180)


@pytest.fixture(scope="module")
def cp_results():
    return run_ranks(_worker, 2, "cp", timeout=180)


def _check_runs(results):
    for r in results:
        for (mode, per_token), run in r["runs"].items():
            assert run["ref_grad_max"] > 1e-4  # the comparison is not vacuous
            assert run["max_diff"] <= TOL, (mode, per_token, run)
            assert run["loss"] == pytest.approx(run["ref_loss"], rel=1e-5, abs=1e-7)


def _check_log_probs(results):
    for r in results:
        assert r["logprob_indices"] == sorted(r["logprob_indices"])  # original sample order
        assert r["logprob_lengths"] == [r["lengths"][i] for i in r["logprob_indices"]]
        assert r["logprob_diff"] <= TOL
        assert r["gathered_indices"] == list(range(len(r["lengths"])))
        assert r["gathered_diff"] <= TOL


@pytest.mark.multiprocess
def test_tp2_sequence_parallel_step_matches_unpacked_reference(sp_results):
    assert [r["tp_rank"] for r in sp_results] == [0, 1]
    for r in sp_results:
        assert r["plan_sp"]  # taken from config.sequence_parallel
        assert all(t % 2 == 0 for t in r["full_tokens"])  # padded to a multiple of TP ...
        assert r["padding_tokens"] > 0  # ... and some micro-batch really needed it
        assert len(set(r["full_tokens"])) > 1 and len(r["full_tokens"]) >= 2  # dynamic micro-batches
        # every hidden-state norm weight carries the mark finalize_model_grads all-reduces over TP
        assert any("final_layernorm" in n for n in r["sp_marked"])
        assert sum("input_layernorm" in n for n in r["sp_marked"]) == 2
        assert sum("pre_mlp_layernorm" in n for n in r["sp_marked"]) == 2
    _check_runs(sp_results)


@pytest.mark.multiprocess
def test_tp2_sequence_parallel_forward_only_log_probs(sp_results):
    _check_log_probs(sp_results)


@pytest.mark.multiprocess
def test_cp2_step_matches_unpacked_reference(cp_results):
    assert sorted(r["cp_rank"] for r in cp_results) == [0, 1]
    for r in cp_results:
        assert len(r["full_tokens"]) >= 2 and len(set(r["full_tokens"])) > 1
        assert [2 * t for t in r["local_tokens"]] == r["packed_tokens"]  # each CP rank holds half of every mb
        assert r["packed_tokens"] == r["full_tokens"]  # (the plan counts the full packed length)
    _check_runs(cp_results)


@pytest.mark.multiprocess
def test_cp2_forward_only_log_probs_gathered_across_cp(cp_results):
    """``gather.gather_cp_output``: each CP rank's half of the per-token log-probs is all-gathered and reassembled
    before the split into samples; both CP ranks hold every sample's full log-probs in sample order."""
    assert cp_results[0]["logprob_mbs"] >= 2
    _check_log_probs(cp_results)


@pytest.mark.multiprocess
def test_cp2_core_attention_equals_full_attention_with_gradients(cp_results):
    for r in cp_results:
        for name, d in r["core"].items():
            assert d["grad_max"] > 1e-3, (name, d)
            assert d["out"] <= 1e-6 and d["grads"] <= 1e-6, (name, d)
        assert r["core"]["sbhd"]["refused_bad_mask"] == 1.0  # unpacked CP input: only the causal mask


# ------------------------------------------------------------------------------ single-process pieces
@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_sequence_parallel_norm_is_the_torch_norm_with_the_tp_mark(kind):
    from types import SimpleNamespace

    from megatron_dynbatch.megatron.norms import QKTorchNorm, SequenceParallelTorchNorm

    cfg = SimpleNamespace(normalization=kind, sequence_parallel=True)
    norm = SequenceParallelTorchNorm(config=cfg, hidden_size=8, eps=1e-5)
    ref = getattr(torch.nn, kind)(8, eps=1e-5)
    assert type(norm) is type(ref)
    assert [n for n, _ in norm.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    ref.load_state_dict(norm.state_dict())
    x = torch.randn(5, 1, 8)
    torch.testing.assert_close(norm(x), ref(x), rtol=0, atol=0)
    qk = QKTorchNorm(config=cfg, hidden_size=4)
    assert not any(getattr(p, "sequence_parallel", False) for p in qk.parameters())
    off = SequenceParallelTorchNorm(config=SimpleNamespace(normalization=kind, sequence_parallel=False), hidden_size=8)
    assert not any(getattr(p, "sequence_parallel", False) for p in off.parameters())


def test_thd_spec_with_sequence_parallel_swaps_the_norms():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_dynbatch.megatron.specs import get_thd_local_layer_spec
    from megatron_dynbatch.megatron.norms import SequenceParallelTorchNorm

    plain = get_thd_local_layer_spec(normalization="RMSNorm")
    assert plain.submodules.input_layernorm is WrappedTorchNorm
    sp = get_thd_local_layer_spec(normalization="RMSNorm", sequence_parallel=True)
    assert sp.submodules.input_layernorm is SequenceParallelTorchNorm
    assert sp.submodules.pre_mlp_layernorm is SequenceParallelTorchNorm
    assert plain.submodules.input_layernorm is WrappedTorchNorm  # a copy: the base spec is untouched


def test_sequence_parallel_plan_alignment_is_checked_and_filled_in():
    from types import SimpleNamespace

    from megatron_dynbatch import plan_global_batch
    from megatron_dynbatch.core.errors import DynBatchConfigError
    from megatron_dynbatch.megatron.schedule import _options_for_model, check_sequence_parallel_alignment

    cfg = SimpleNamespace(sequence_parallel=True, tensor_model_parallel_size=2, context_parallel_size=1)
    lengths = [7, 12, 5, 9]
    plan = plan_global_batch(lengths, parallel={"tp": 2}, max_tokens_per_gpu=32, balance_by_flops=False)
    with pytest.raises(DynBatchConfigError, match="sequence_parallel"):
        check_sequence_parallel_alignment(plan, cfg)
    opts = _options_for_model({"parallel": {"tp": 2}, "max_tokens_per_gpu": 32, "balance_by": "tokens"}, cfg)
    assert opts.parallel.tp == 2 and opts.parallel.sequence_parallel
    good = plan_global_batch(lengths, opts.options)  # (the resolved options' own PlanOptions, at the public door)
    check_sequence_parallel_alignment(good, cfg)
    assert all(t % 2 == 0 for rank in good.microbatch_tokens for t in rank)
    check_sequence_parallel_alignment(plan, SimpleNamespace(sequence_parallel=False, tensor_model_parallel_size=2))
