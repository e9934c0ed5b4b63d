"""Real megatron-core on CPU: a tiny GPTModel through get_forward_backward_func() with Megatron DDP under
DP=2, TP=2 and PP=2 (two gloo ranks each), using the shims in megatron_dynbatch.megatron.cpu."""

from __future__ import annotations

from functools import partial

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_dynbatch.megatron.ranks import RankFailure, run_ranks  # noqa: E402

SEQ, MBS, NUM_MB, VOCAB = 16, 2, 2, 128


def _batches(num_mb: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_mb):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return out


def _fwd_bwd_worker(rank: int, world_size: int, tp: int, pp: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dynbatch.megatron import cpu as megatron_cpu

    megatron_cpu.init_cpu_distributed(rank, world_size, tp=tp, pp=pp)
    try:
        config = megatron_cpu.tiny_gpt_config()
        model = megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=SEQ)
        ddp = megatron_cpu.wrap_ddp(config, model)
        ddp.zero_grad_buffer()

        # Each DP replica reads its own data; TP and PP peers of one replica read the same.
        dp_rank = parallel_state.get_data_parallel_rank()
        data = iter(_batches(NUM_MB, seed=dp_rank))
        positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)

        def loss_func(output: torch.Tensor):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # Megatron rescales `loss` in place

        def forward_step(data_iterator, module):
            batch = next(data_iterator)
            out = module(batch["tokens"], positions, None, labels=batch["labels"])
            return out, loss_func

        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[ddp],
            num_microbatches=NUM_MB,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
        return {
            "losses": [float(d["lm loss"]) for d in losses],
            "grad_norm_sq": float(sum((g.double() ** 2).sum() for g in grads.values())),
            "nonzero_grads": sum(int(g.abs().sum() > 0) for g in grads.values()),
            "num_params": len(grads),
            "grads": grads,
            "dp_rank": dp_rank,
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        }
    finally:
        megatron_cpu.destroy()


@pytest.mark.multiprocess
def test_dp2_forward_backward_grads_are_all_reduced():
    r0, r1 = run_ranks(_fwd_bwd_worker, 2, 1, 1, timeout=120)
    assert (r0["dp_rank"], r1["dp_rank"]) == (0, 1)
    assert r0["losses"] != r1["losses"]  # different data per replica ...
    assert r0["nonzero_grads"] == r0["num_params"]
    for name, g in r0["grads"].items():  # ... but identical, averaged gradients after DDP
        torch.testing.assert_close(g, r1["grads"][name], rtol=0, atol=0)


@pytest.mark.multiprocess
def test_tp2_forward_backward():
    r0, r1 = run_ranks(_fwd_bwd_worker, 2, 2, 1, timeout=120)
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)
    assert r0["losses"] == pytest.approx(r1["losses"], abs=1e-6)  # both TP ranks see the full loss
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (r0, r1))
    assert r0["nonzero_grads"] == r0["num_params"] and r1["nonzero_grads"] == r1["num_params"]


@pytest.mark.multiprocess
def test_pp2_forward_backward():
    r0, r1 = run_ranks(_fwd_bwd_worker, 2, 1, 2, timeout=120)
    assert (r0["pp_rank"], r1["pp_rank"]) == (0, 1)
    assert r0["losses"] == [] and len(r1["losses"]) == NUM_MB  # only the last stage computes the loss
    assert r0["nonzero_grads"] == r0["num_params"]  # gradients reached the first stage through p2p
    assert r1["nonzero_grads"] == r1["num_params"]


def _thd_pp_worker(rank: int, world_size: int) -> dict:
    """PP=2, packed THD micro-batches of different lengths vs. the same samples run one by one (sbhd)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dynbatch.core.alignment import Alignment
    from megatron_dynbatch.megatron.packing import pack_microbatch
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    megatron_cpu.init_cpu_distributed(rank, world_size, pp=2)
    try:
        config = megatron_cpu.tiny_gpt_config()
        model = megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=64, thd=True).eval()
        g = torch.Generator().manual_seed(0)
        groups = [[5, 9], [13], [2, 1, 7]]
        samples = [[{"tokens": torch.randint(0, VOCAB, (n,), generator=g)} for n in grp] for grp in groups]
        packed = [pack_microbatch(grp, Alignment(seq_multiple=2, total_multiple=4)) for grp in samples]
        single = [pack_microbatch([s], Alignment()) for grp in samples for s in grp]

        def loss_func(mb, output):
            loss = (output.float() * mb.loss_mask).sum()
            # clone: Megatron divides the returned loss by num_microbatches IN PLACE, and detach() shares storage
            return loss, {"loss_sum": loss.detach().clone()}

        def forward_step(data_iterator, module):
            mb = next(data_iterator)
            psp = mb.packed_seq_params if mb.num_sequences > 1 else None
            out = module(mb.tokens, mb.position_ids, None, labels=mb.labels, packed_seq_params=psp)
            return out, partial(loss_func, mb)

        def run(mbs):
            res = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[model],
                num_microbatches=len(mbs), seq_length=max(m.num_tokens for m in mbs), micro_batch_size=1,
                forward_only=True,
            )
            return sum(float(d["loss_sum"]) for d in res)

        with torch.no_grad():
            return {"packed": run(packed), "single": run(single),
                    "last": parallel_state.is_pipeline_last_stage()}
    finally:
        megatron_cpu.destroy()


@pytest.mark.multiprocess
def test_pp2_packed_thd_microbatches_match_per_sample():
    r0, r1 = run_ranks(_thd_pp_worker, 2, timeout=120)
    assert r1["last"] and not r0["last"]
    assert r1["packed"] == pytest.approx(r1["single"], rel=1e-5)


def _boom(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one exploded")
    import time

    time.sleep(30)


@pytest.mark.multiprocess
def test_run_ranks_surfaces_child_traceback():
    with pytest.raises(RankFailure, match="rank one exploded"):
        run_ranks(_boom, 2, timeout=60)


def _echo(rank: int, world_size: int, x: int) -> tuple:
    return rank, world_size, x


@pytest.mark.multiprocess
def test_run_ranks_returns_in_rank_order():
    assert run_ranks(_echo, 2, 7) == [(0, 2, 7), (1, 2, 7)]


def test_cpu_torch_proxy_keeps_cuda_draws_off_the_cpu_generator():
    """What a module sees through the proxy: ``device="cuda"`` tensors on the CPU; random ones drawn from a
    generator of their own (on a GPU they use the CUDA generator, so the CPU generator that
    ``--use-cpu-initialization`` initialises weights from must not move: Megatron-LM's start-up warm-up draws
    layout-dependent shapes); ``pin_memory`` dropped; draws on the CPU and explicit generators untouched."""
    from megatron_dynbatch.megatron.cpu import CpuTorchProxy

    proxy = CpuTorchProxy(torch)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    for shape in ((128, 1, 64), (7,)):
        x = proxy.rand(*shape, device="cuda")
        assert x.device.type == "cpu" and tuple(x.shape) == shape
    assert proxy.randn(4, device=torch.device("cuda", 0)).device.type == "cpu"
    assert proxy.randint(0, 9, (4,), device="cuda:0").device.type == "cpu"
    assert torch.equal(torch.rand(3), expected)  # the CPU generator did not move
    torch.manual_seed(5)
    assert torch.equal(proxy.rand(3, device="cpu"), expected)  # CPU draws are CPU draws
    g = torch.Generator().manual_seed(1)
    same = torch.rand(3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(proxy.rand(3, device="cuda", generator=g), same)  # an explicit generator is used
    t = proxy.tensor([1, 2], device="cpu", pin_memory=True)
    assert t.tolist() == [1, 2] and not t.is_pinned()
