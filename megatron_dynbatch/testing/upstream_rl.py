"""Run Megatron RL's OWN ``pack_all_trajectories`` on gloo ranks (test support), with or without this package's
drop-in (:mod:`megatron_dynbatch.integrations.megatron_rl`).

Runs against the ``megatron.rl`` importable here -- the tests put ``MEGATRON_LM_DIR`` first on ``PYTHONPATH``.
CPU accommodations, all outside upstream's code: ``typing.override`` (Python 3.12) defined as the identity on
3.11 (Megatron-LM's training modules only decorate with it), the CPU shims (``megatron/cpu.py``), ``Tensor.cuda``
keeping tensors on the CPU, ``device="cuda"`` factories in ``sequence_packing_utils`` mapped to the CPU, and the
two globals ``pack_all_trajectories`` reads (a tokenizer with ``pad``/``eod``, Megatron's timers).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Dict, List, Sequence

import torch

PAD, EOD = 0, 1


def make_rows(lengths: Sequence[int], seq_length: int, seed: int) -> Any:
    """``(trajs, generation_masks)`` of one rank: rows padded with ``PAD`` to ``seq_length``; the last half of
    every trajectory is 'generated'."""
    g = torch.Generator().manual_seed(seed)
    trajs = torch.full((len(lengths), seq_length), PAD, dtype=torch.long)
    gen = torch.zeros((len(lengths), seq_length), dtype=torch.bool)
    for i, n in enumerate(lengths):
        trajs[i, :n] = torch.randint(2, 100, (int(n),), generator=g)
        gen[i, n // 2:n] = True
    return trajs, gen


def pack(rank: int, world_size: int, algo: str, steps_lengths: Sequence[Sequence[int]], seq_length: int,
         max_per_bin: int, use_dropin: bool) -> Dict[str, Any]:
    """``steps_lengths[d]``: the trajectory lengths DP rank ``d`` generated. Returns this rank's packing."""
    if not hasattr(typing, "override"):
        typing.override = lambda f: f  # type: ignore[attr-defined]
    from ..megatron import cpu as mc

    mc.init_cpu_distributed(rank, world_size)
    torch.Tensor.cuda = mc.tensor_stays_on_cpu  # type: ignore[method-assign]
    import megatron.rl.sequence_packing_utils as spu
    from megatron.core.timers import Timers
    from megatron.training import global_vars as gv

    spu.torch = mc.CpuTorchProxy(torch)
    gv._GLOBAL_TOKENIZER = types.SimpleNamespace(pad=PAD, eod=EOD)
    gv._GLOBAL_TIMERS = Timers(0, "minmax")
    if use_dropin:
        from ..integrations import megatron_rl

        megatron_rl.install()
    trajs, gen = make_rows(steps_lengths[rank], seq_length, seed=rank)
    total = sum(len(x) for x in steps_lengths)
    adv = torch.arange(total, dtype=torch.float32) / 10
    ctx = spu.pack_all_trajectories(trajs, gen, None, adv, seq_length, max_per_bin, algo)
    info = ctx.packing_info
    bins: List[Dict[str, Any]] = []
    for b, members in enumerate(info.bin_seq_indices):
        psp = ctx.cached_packed_seq_params[b]
        bins.append({"members": list(members), "starts": list(info.seq_starts[b]),
                     "tokens": ctx.packed_trajs[b].tolist(), "positions": ctx.packed_position_ids[b].tolist(),
                     "loss_mask": ctx.packed_loss_mask[b].tolist(),
                     "advantages": ctx.bin_advantages[b].tolist(),
                     "cu_seqlens": None if psp is None else psp.cu_seqlens_q.tolist()})
    all_trajs, all_gen = ctx.original_trajs, ctx.original_generation_masks
    mc.destroy()
    return {"rank": rank, "shape": list(ctx.packed_trajs.shape), "algo": info.packing_algo, "bins": bins,
            "seq_lengths": list(info.seq_lengths), "trajs": all_trajs.tolist(), "gen": all_gen.int().tolist(),
            "advantages": adv.tolist()}
