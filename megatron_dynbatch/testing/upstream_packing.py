"""Train a tiny GPT through Megatron-Core's OWN sequence-packing path on gloo ranks (test support).

Runs against whatever ``megatron.core`` is importable -- the tests put ``MEGATRON_LM_DIR`` (a Megatron-LM
``main`` or ``dev`` checkout) first on ``PYTHONPATH``. Each step, every DP rank holds its own samples in the
"already unpacked" form upstream's ``VarlenDataset`` yields (``tokens``, ``labels``, ``loss_mask``,
``position_ids``, ``original_seq_len``, ``padded_seq_len``); upstream's ``wrap_data_iterator`` (scheduler
``dp_balanced``) or ours (:func:`megatron_dynbatch.integrations.megatron_packing.wrap_data_iterator`) regroups
them; upstream's ``get_batch_on_this_rank_for_sequence_packing`` builds every micro-batch's THD tensors and
``PackedSeqParams``; ``get_forward_backward_func()`` runs them with ``calculate_per_token_loss=True`` through
Megatron DDP; plain SGD steps on the DDP gradient buffers. Returns per step: the global token-mean loss, the
gradient norm, the micro-batch count and upstream's returned sums, and the micro-batch lengths of this rank.

The only CPU accommodations are the CPU shims (``megatron/cpu.py``) plus ``Tensor.cuda`` keeping tensors on the CPU
(upstream's gathering calls ``.cuda()``); the local attention is replaced by the THD one of this package.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import types

from typing import Any, Dict, List, Sequence

import torch

VOCAB = 128


def make_samples(lengths: Sequence[int], seed: int) -> List[Dict[str, torch.Tensor]]:
    """One rank's samples in upstream's unpacked form (deterministic in ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(1, VOCAB, (int(n),), generator=g, dtype=torch.int64)
        labels = torch.roll(tokens, -1)
        loss_mask = torch.ones(int(n), dtype=torch.float32)
        loss_mask[-1] = 0.0
        out.append({"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                    "position_ids": torch.arange(int(n), dtype=torch.int64),
                    "original_seq_len": torch.tensor([int(n)], dtype=torch.int32),
                    "padded_seq_len": torch.tensor([int(n)], dtype=torch.int32)})
    return out


def _stand_in_for_te_cp_index(ds: Any) -> None:
    """Without Transformer Engine, put the plain-torch twin of ``tex.thd_get_partitioned_indices`` where upstream
    looks it up: ``data_schedule.tex`` (Megatron-LM ``main``) and ``get_thd_partitioned_indices`` of
    ``extensions/transformer_engine.py`` and ``data_schedule_utils.py`` (``dev``). The twin covers upstream's
    slicing call (``total_tokens == cu_seqlens[-1]``) and refuses anything else."""
    from ..megatron.context_parallel import zigzag_partition_indices

    def index(cu_seqlens: torch.Tensor, total_tokens: int, size: int, rank_: int) -> torch.Tensor:
        if int(total_tokens) != int(cu_seqlens[-1]):
            raise NotImplementedError("the CPU stand-in for TE's thd_get_partitioned_indices covers "
                                      "total_tokens == cu_seqlens[-1] only")
        return zigzag_partition_indices(cu_seqlens, int(size), int(rank_))

    if hasattr(ds, "tex") and ds.tex is None:
        ds.tex = types.SimpleNamespace(thd_get_partitioned_indices=index)
    for name in ("megatron.core.extensions.transformer_engine", "megatron.core.datasets.data_schedule_utils"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "get_thd_partitioned_indices"):
            module.get_thd_partitioned_indices = index


def train(rank: int, world_size: int, scheduler: str, steps: Sequence[Sequence[Sequence[int]]], budget: int,
          lr: float = 0.05, tp: int = 1, pp: int = 1, pad_alignment: Any = None, cp: int = 1) -> Dict[str, Any]:
    """``steps[s][d]``: the sample lengths DP rank ``d`` loads in step ``s``. ``scheduler``: ``"dp_balanced"``
    (upstream's), ``"dynbatch"`` (our ``wrap_data_iterator``) or ``"registered"`` (ours registered in upstream's
    name-keyed map and selected by ``config.sequence_packing_scheduler``, called through upstream's
    ``wrap_data_iterator``: Megatron-LM ``dev`` only). ``pad_alignment``: upstream's
    ``pad_packed_seq_alignment`` (``dev``: each packed micro-batch padded after the grouping). ``cp > 1``:
    upstream slices each micro-batch with Transformer Engine's ``tex.thd_get_partitioned_indices``; without
    TE (CPU) this module's plain-torch twin of it stands in (:func:`megatron_dynbatch.megatron.context_parallel.
    zigzag_partition_indices`, the same token selection), and the THD attention runs the CP ring."""
    from megatron.core import parallel_state as ps
    from megatron.core.datasets import data_schedule as ds
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ..megatron import cpu as mc
    from ..integrations import megatron_packing as ours

    mc.init_cpu_distributed(rank, world_size, tp=tp, pp=pp, cp=cp)
    if cp > 1 and importlib.util.find_spec("transformer_engine") is None:
        _stand_in_for_te_cp_index(ds)
    torch.Tensor.cuda = mc.tensor_stays_on_cpu  # type: ignore[method-assign]
    config = mc.tiny_gpt_config(calculate_per_token_loss=True)
    config.max_seqlen_per_dp_cp_rank = budget
    config.sequence_packing_scheduler = "dp_balanced"
    if pad_alignment is not None:
        config.pad_packed_seq_alignment = pad_alignment
    if scheduler == "registered":
        ours.register_packing_scheduler(strict=True)
        config.sequence_packing_scheduler = ours.SCHEDULER_NAME
    model = mc.wrap_ddp(config, mc.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=budget, thd=True))
    dp_rank = ps.get_data_parallel_rank()
    first_or_last = ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()
    has_data = ps.get_tensor_model_parallel_rank() == 0 and first_or_last

    # dev's batch function takes the config (it pads packed micro-batches per ``pad_packed_seq_alignment``)
    takes_config = "config" in inspect.signature(ds.get_batch_on_this_rank_for_sequence_packing).parameters
    batch_kwargs = {"config": config} if takes_config else {}

    def forward_step(data_iterator: Any, module: Any) -> Any:
        tokens, labels, loss_mask, _, position_ids, psp, _ = ds.get_batch_on_this_rank_for_sequence_packing(
            data_iterator, **batch_kwargs)
        # the rows this GPU holds, upstream's padding included (no tokens on a middle pipeline stage)
        mb_lengths.append(int(tokens.shape[-1]) if tokens is not None else int(psp.cu_seqlens_q_padded[-1]))
        out = module(tokens, position_ids, None, labels=labels, packed_seq_params=psp)

        def loss_func(output: torch.Tensor) -> Any:
            mask = loss_mask.reshape(-1).float()
            total = (output.float().reshape(-1) * mask).sum()
            count = mask.sum()
            return total, count.to(torch.int), {"lm loss": torch.stack([total.detach(), count.detach()])}

        return out, loss_func

    records = []
    for s, per_rank in enumerate(steps):
        samples = make_samples(per_rank[dp_rank], seed=1000 * s + dp_rank)
        it = iter(samples) if has_data else None
        wrap = ours.wrap_data_iterator if scheduler == "dynbatch" else ds.wrap_data_iterator
        new_it, count, seq_sum, sq_sum = wrap(it, config, len(per_rank[dp_rank]))
        model.zero_grad_buffer()
        mb_lengths: List[int] = []
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=new_it, model=[model], num_microbatches=count,
            seq_length=budget, micro_batch_size=1, forward_only=False)
        pair = torch.zeros(2, dtype=torch.float64)
        for d in losses or []:
            pair += d["lm loss"].double()
        torch.distributed.all_reduce(pair, group=ps.get_data_parallel_group(with_context_parallel=True))
        grads = [p.main_grad.reshape(-1) for p in model.parameters() if getattr(p, "main_grad", None) is not None]
        gnorm = float(torch.cat(grads).double().norm())
        with torch.no_grad():
            for p in model.parameters():
                if getattr(p, "main_grad", None) is not None:
                    p.add_(p.main_grad, alpha=-lr)
        records.append({"loss": float(pair[0] / pair[1]) if pair[1] > 0 else float("nan"), "grad_norm": gnorm,
                        "num_microbatches": int(count), "seqlen_sum": float(seq_sum),
                        "seqlen_sq_sum": float(sq_sum), "microbatch_tokens": mb_lengths,
                        "tokens": float(pair[1])})
    mc.destroy()
    return {"rank": rank, "dp_rank": dp_rank, "steps": records}
