"""slime's ``build_dp_schedule`` on this planner (pure; :mod:`megatron_dynbatch.integrations.slime` maps
slime's ``args`` onto it).

Contract kept (``slime/utils/dp_schedule.py``, read Aug 2026): plan on the rollout side, for one rollout's
samples; samples sharing a rollout id stay in one optimizer step; a step holds ``global_batch_size`` ROLLOUTS,
however many samples each emitted; trailing rollouts that do not fill a step are dropped; every DP rank runs the
same number of micro-batches per step; the result is ``(partitions, micro_batch_indices, num_microbatches,
global_batch_sizes)`` with ``partitions[r]`` rank ``r``'s global sample indices in execution order,
``micro_batch_indices[r]`` consecutive local index ranges tiling ``range(len(partitions[r]))``,
``num_microbatches[s]`` the per-rank count of step ``s``, ``global_batch_sizes[s] == global_batch_size``.
Config keys ``dp_size, cp_size, vpp_size, microbatch_group_size_per_vp_stage``. A sample over the budget is
placed alone (slime's policy; a warning here). Where slime asserts, the error is a
:class:`~megatron_dynbatch.core.errors.DropinAssertionError` (an ``AssertionError`` too), naming slime's
arguments; a budget under the padding multiple says where the multiple comes from (:func:`check_pad_budget`).

What changes (dynamic batch size): slime packs first-fit in sample order, then deals whole micro-batches to
ranks; its ``--balance-by-flops`` fixes the count at ``ceil(tokens / cap)`` and does not enforce the cap; its
cap ignores its own padding (each CP rank's share is padded to ``tp * data_pad_size_multiplier``). Here the
planner balances time across ranks *and* micro-batches under a hard cap that counts that padding, and the
count follows Megatron's exact VPP rule (with slime's config, which carries no ``pp``, the per-rank count is
a multiple of ``microbatch_group_size_per_vp_stage`` -- slime's own rule; pass ``pp`` for the exact one).

The static path (``micro_batch_size`` chunks, no budget) keeps slime's semantics exactly: chunk each step in
order, deal chunks round-robin, or by Karmarkar-Karp on their FLOPs with ``balance_data``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import numpy as np

from ..alignment import Alignment
from ..checks import as_budget, as_bool, as_int
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig
from ..partitioning import karmarkar_karp
from ..planner import Plan, plan_global_batch
from ..planner.inputs import check_group_ids, check_lengths
from .words import SLIME_WORDS, speaks

if TYPE_CHECKING:
    from ..cost_model import CostModelLike
    from ..model_spec import ModelLike

__all__ = ["SlimeSchedule", "check_pad_budget", "slime_parallel", "slime_schedule"]


@dataclass
class SlimeSchedule:
    """``build_dp_schedule``'s four results, plus the plan behind them (``None`` on the static path)."""

    partitions: List[List[int]]
    micro_batch_indices: List[List[List[int]]]
    num_microbatches: List[int]
    global_batch_sizes: List[int]
    plan: Optional[Plan] = None

    def as_tuple(self):
        return self.partitions, self.micro_batch_indices, self.num_microbatches, self.global_batch_sizes


def slime_parallel(dp: int, cp: int = 1, vpp: int = 1, microbatch_group_size_per_vp_stage: Optional[int] = None,
                   *, tp: int = 1, pp: Optional[int] = None, sequence_parallel: bool = False,
                   ep: int = 1) -> ParallelConfig:
    """The layout of slime's ``train_parallel_config`` (+ what its ``args`` add). Without ``pp`` (slime's config
    does not carry it) and with ``vpp > 1``, ``pp`` is taken as ``microbatch_group_size_per_vp_stage``: then
    Megatron's rule asks for a multiple of it -- exactly slime's own alignment, and safe whatever the real
    ``pp <= N`` is."""
    vpp = 1 if vpp is None else as_int(vpp, "vpp_size", minimum=1)
    n = None
    if vpp > 1:
        n = as_int(microbatch_group_size_per_vp_stage, "microbatch_group_size_per_vp_stage", minimum=1,
                   fix="pass Megatron's microbatch_group_size_per_vp_stage (default pp)")
        if pp is None:
            pp = max(n, 2)
    return ParallelConfig(dp=dp, tp=tp, pp=1 if pp is None else pp, cp=cp, ep=ep, vpp=vpp,
                          microbatch_group_size_per_vp_stage=n, sequence_parallel=sequence_parallel)


def _steps(rollout_indices: Sequence[Any], n: int, global_batch_size: int):
    """Rollouts in first-occurrence order, the number of whole steps, and the samples kept (in rollout order)."""
    rids = check_group_ids(rollout_indices, n, field="rollout_indices")
    gbs = as_int(global_batch_size, "global_batch_size", minimum=1,
                 fix="pass the number of rollouts per training step (slime's --global-batch-size)")
    by_rollout: dict = {}
    for i, r in enumerate(rids):
        by_rollout.setdefault(r, []).append(i)
    order = list(by_rollout)
    steps = len(order) // gbs
    if steps < 1:
        raise DynBatchConfigError("global_batch_size", gbs,
                                  f"the batch has only {len(order)} rollouts (num_rollouts < global_batch_size)",
                                  "pass at least global_batch_size rollouts, or lower --global-batch-size")
    return rids, by_rollout, order, steps, gbs


def check_pad_budget(max_tokens_per_gpu: Any, parallel: ParallelConfig, data_pad_size_multiplier: Any,
                     assumed: bool = False) -> int:
    """The padding multiple ``tp * data_pad_size_multiplier`` slime pads each CP rank's share of a micro-batch to,
    after checking that ``--max-tokens-per-gpu`` holds one such multiple; the error says where the multiple comes
    from (``assumed``: ``args`` has no ``data_pad_size_multiplier``, so slime's default 128 was taken) and how to
    change it."""
    budget = as_budget(max_tokens_per_gpu, "--max-tokens-per-gpu", trainer="slime", fix="pass --max-tokens-per-gpu")
    mult = as_int(data_pad_size_multiplier, "data_pad_size_multiplier", minimum=1,
                  fix="pass slime's --data-pad-size-multiplier (default 128; 1 turns the padding off)")
    pad = mult * parallel.tp
    align = Alignment.for_layout(parallel, None, None, pad)
    cap = budget * parallel.cp
    if align.effective_cap(cap) < align.seq_multiple:
        where = ("slime's default 128, assumed because args has no data_pad_size_multiplier" if assumed
                 else "args.data_pad_size_multiplier")
        raise DynBatchConfigError(
            "--max-tokens-per-gpu", budget,
            f"a micro-batch of {cap} tokens holds nothing: slime pads each CP rank's share of a micro-batch to a "
            f"multiple of tp x data_pad_size_multiplier = {parallel.tp} x {mult} = {pad} ({where})",
            f"use --max-tokens-per-gpu >= {align.budget_for(align.seq_multiple, parallel.cp)}, or set a smaller "
            "--data-pad-size-multiplier (args.data_pad_size_multiplier; 1 turns this padding off)")
    return pad


@speaks(SLIME_WORDS, assertion=True)
def slime_schedule(total_lengths: Sequence[int], *, rollout_indices: Sequence[Any], global_batch_size: int,
                   parallel: ParallelConfig, max_tokens_per_gpu: Optional[int], use_dynamic_batch_size: bool = True,
                   micro_batch_size: Optional[int] = None, balance_data: bool = True,
                   model: Optional[ModelLike] = None,
                   data_pad_size_multiplier: Optional[int] = 128, oversize: str = "alone",
                   cost_model: CostModelLike = None, pad_multiplier_assumed: bool = False) -> SlimeSchedule:
    """slime's schedule for one rollout (see the module docstring). ``data_pad_size_multiplier``: slime pads
    each CP rank's share of a micro-batch to ``tp`` times this (``None``/1: no such padding;
    ``pad_multiplier_assumed``: it is slime's default, taken because ``args`` lacks it -- the error says so).
    Errors are :class:`~megatron_dynbatch.core.errors.DropinAssertionError` (slime asserts on its input), named
    in slime's words (``total_lengths``, ``rollout_indices``, ``global_batch_size``, ``--max-tokens-per-gpu``)."""
    lens = check_lengths(total_lengths, field="total_lengths")
    rids, by_rollout, order, steps, gbs = _steps(rollout_indices, lens.size, global_batch_size)
    kept = [i for r in order[:steps * gbs] for i in by_rollout[r]]
    dp = parallel.dp
    if not as_bool(use_dynamic_batch_size, "use_dynamic_batch_size"):
        return _static(lens, by_rollout, order, steps, gbs, parallel, micro_batch_size, balance_data, model)
    if max_tokens_per_gpu is None:
        raise DynBatchConfigError("max_tokens_per_gpu", None, "dynamic batch size needs a per-GPU token budget",
                                  "pass --max-tokens-per-gpu")
    pad = None
    if data_pad_size_multiplier is not None:
        pad = check_pad_budget(max_tokens_per_gpu, parallel, data_pad_size_multiplier, pad_multiplier_assumed)
    plan = plan_global_batch(lens[kept], model=model, parallel=parallel, max_tokens_per_gpu=max_tokens_per_gpu,
                             cost_model=cost_model, oversize=oversize,  # balance_by: time with a model, else tokens
                             rollout_ids=[rids[i] for i in kept], rollouts_per_step=gbs, microbatch_pad_multiple=pad)
    partitions: List[List[int]] = [[] for _ in range(dp)]
    mbi: List[List[List[int]]] = [[] for _ in range(dp)]
    for r in range(dp):
        for mb in plan.micro_batches[r]:
            start = len(partitions[r])
            partitions[r].extend(kept[i] for i in mb)
            mbi[r].append(list(range(start, start + len(mb))))
    return SlimeSchedule(partitions, mbi, list(plan.microbatches_per_step), [gbs] * steps, plan)


def _static(lens, by_rollout, order, steps, gbs, par: ParallelConfig, micro_batch_size, balance_data,
            model: Optional[ModelLike]):
    """slime's static path: fixed-size chunks in sample order, dealt round-robin or by KK on FLOPs."""
    mbs = as_int(micro_batch_size, "micro_batch_size", minimum=1, fix="pass --micro-batch-size")
    dp = par.dp
    align_to = dp * (par.vp_group_size if par.vpp > 1 else 1)
    flops = _fwd_flops(lens, model)
    partitions: List[List[int]] = [[] for _ in range(dp)]
    mbi: List[List[List[int]]] = [[] for _ in range(dp)]
    counts = []
    for s in range(steps):
        samples = [i for r in order[s * gbs:(s + 1) * gbs] for i in by_rollout[r]]
        if len(samples) < dp:
            raise DynBatchConfigError("global_batch_size", gbs, f"step {s} has {len(samples)} samples < dp={dp}",
                                      "give every step at least one sample per rank")
        chunks = [samples[i:i + mbs] for i in range(0, len(samples), mbs)]
        if len(chunks) % align_to:
            raise DynBatchConfigError(
                "micro_batch_size", mbs, f"step {s} makes {len(chunks)} micro-batches, not a multiple of "
                f"dp x N = {align_to}", f"make the step's sample count a multiple of {align_to * mbs}")
        if as_bool(balance_data, "balance_data"):
            weights = [float(flops[c].sum()) for c in chunks]
            ranks = karmarkar_karp(weights, dp, equal_size=True)
        else:
            ranks = [list(range(r, len(chunks), dp)) for r in range(dp)]
        counts.append(len(chunks) // dp)
        for r in range(dp):
            for j in ranks[r]:
                start = len(partitions[r])
                partitions[r].extend(chunks[j])
                mbi[r].append(list(range(start, start + len(chunks[j]))))
    return SlimeSchedule(partitions, mbi, counts, [gbs] * steps, None)


def _fwd_flops(lens: np.ndarray, model: Optional[ModelLike]) -> np.ndarray:
    if model is None:
        return lens.astype(np.float64)
    from ..flops import flops_coefficients
    from ..model_spec import ModelSpec

    c = flops_coefficients(ModelSpec.from_any(model))
    return c.linear * lens + c.quadratic * lens.astype(np.float64) ** 2
