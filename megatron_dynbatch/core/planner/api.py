"""``plan_global_batch``: lengths in, :class:`Plan` out.

Strategy
--------
For each optimizer step (the whole batch, or consecutive slices of ``samples_per_step`` samples):

1. Pad each sample to its alignment slot (``2*cp`` multiples) and count that padding against the budget
   ``cap = max_tokens_per_gpu * cp`` (less the micro-batch tail padding: ``Alignment.effective_cap``).
2. Start at the fewest micro-batches per rank the budget allows, ``M0 = ceil(slot tokens / (dp * cap))``,
   moved up to the next count Megatron's interleaved schedule accepts, and pack for that ``M``
   (:mod:`.packer`); if the packing is infeasible, try the next valid ``M``.
3. Score a few more counts with the cost model and keep the fastest: with ``pp > 1`` counts up to the one
   that minimises the modelled 1F1B bubble + per-micro-batch overhead, with ``pp == 1`` one more count when
   the first leaves the ranks unbalanced (an extra micro-batch can unlock a better packing).
4. Order each rank's micro-batches: largest first with ``pp == 1`` (an out-of-memory shows on the first
   micro-batch); with ``pp > 1`` the arrangement (decreasing, increasing, small-at-both-ends) with the shortest
   simulated 1F1B makespan. The arrangement is a pattern over the weight ranks, the same on every DP rank,
   so expert-parallel ranks that advance in lockstep meet micro-batches of similar size.

Invariants (asserted by ``tests/test_planner_properties.py`` over thousands of random workloads)
----------------------------------------------------------------------------------------------
* every sample is placed exactly once; no micro-batch is empty;
* every DP rank runs the same number of micro-batches, and the same number in every optimizer step;
* a micro-batch's padded token count never exceeds ``cap`` — the only exception is a sample that is alone
  over budget under ``oversize='alone'`` (it is listed in ``plan.oversize_samples`` and a warning is raised);
* with ``vpp > 1`` the count satisfies ``pp <= N <= M`` and ``M % N in {0} U [pp, N)``;
* the samples of one group (``group_ids``) share a DP rank; each optimizer step holds exactly
  ``samples_per_step`` samples;
* the result depends only on the arguments: every rank computes the same plan without communicating.
"""

from __future__ import annotations

import time
from typing import Any, List, Mapping, Optional, Sequence, Union

import numpy as np

from ..alignment import Alignment
from ..cost_model import CostModel
from ..checks import as_int
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig
from .inputs import (BALANCE_MODES, OVERSIZE_POLICIES, balance_mode, check_budget, check_lengths,
                     check_oversize_policy, oversize_mask, resolve_costs, sample_flops, steps_and_units)
from .ordering import mb_sums
from .packer import StepInput
from .plan import Plan
from .search import plan_step
from .vpp import check_forced_count

__all__ = ["plan_global_batch", "score_assignment", "BALANCE_MODES", "OVERSIZE_POLICIES"]


def plan_global_batch(
    lengths: Union[Sequence[int], np.ndarray],
    *,
    model: Any = None,
    parallel: Union[ParallelConfig, Mapping[str, Any], None] = None,
    max_tokens_per_gpu: int,
    balance_by_flops: bool = True,
    balance_by: Optional[str] = None,
    group_ids: Optional[Sequence[Any]] = None,
    samples_per_step: Optional[int] = None,
    oversize: str = "error",
    fp8_alignment: Union[None, str, int] = None,
    cost_model: Optional[CostModel] = None,
    num_microbatches: Optional[int] = None,
    refine_rounds: Optional[int] = None,
) -> Plan:
    """Split a global batch over DP ranks and into micro-batches (see the module docstring).

    Args:
        lengths: tokens per sample (non-negative integers; 0 is allowed and takes one padding slot).
        model: ``ModelSpec``, a dict of Megatron field names or a preset name; needed to balance by FLOPs.
        parallel: ``ParallelConfig`` or dict with ``dp, tp, pp, cp, ep, vpp`` (missing = 1).
        max_tokens_per_gpu: the per-GPU budget; a micro-batch holds at most ``max_tokens_per_gpu * cp``.
        balance_by_flops: balance compute (True) or tokens (False) across ranks and micro-batches. Compute is
            the model's FLOPs per sample, linear and attention terms each at their kernel efficiency (the
            cost model's seconds), since equal time -- not equal raw FLOPs -- is what makes ranks finish
            together.
        balance_by: explicit mode overriding ``balance_by_flops``: ``"time"`` (the default with a model; pass a
            calibrated ``cost_model`` to balance measured time), ``"flops"`` (raw FLOPs) or ``"tokens"``.
        group_ids: one id per sample; samples sharing an id (a GRPO prompt group) stay on one DP rank.
        samples_per_step: split the batch into optimizer steps of exactly this many consecutive samples.
        oversize: policy for a sample longer than the budget: ``"error"`` (default) or ``"alone"``.
        fp8_alignment: ``None``, ``"fp8"``, ``"mxfp8"``, ``"nvfp4"``/``"blockwise"`` or a token multiple.
        cost_model: step-time model used to choose counts and orders; default from ``model``.
        num_microbatches: force ``M`` per rank and optimizer step (raises if the budget cannot hold it).
        refine_rounds: cap on rank-refinement rounds (default ``4 * dp``).
    """
    t_start = time.perf_counter()
    par = ParallelConfig.from_any(parallel)
    lens = check_lengths(lengths)
    cap, align, cap_eff = check_budget(max_tokens_per_gpu, par, fp8_alignment)
    check_oversize_policy(oversize)
    mode = balance_mode(balance_by, balance_by_flops, model is not None)
    if model is None and mode == "flops":
        raise DynBatchConfigError("model", None, "balancing by FLOPs needs the model's shape",
                                  "pass model=ModelSpec/dict/preset name, or balance_by_flops=False")
    coeffs, cm = resolve_costs(model, par, cost_model)

    aligned = align.seq_len(lens).astype(np.int64)
    sq = lens.astype(np.float64) ** 2
    over = oversize_mask(lens, aligned, cap_eff, align, par, max_tokens_per_gpu, oversize)
    flops = sample_flops(coeffs, aligned, sq)
    weight = {"flops": flops, "tokens": aligned.astype(np.float64)}.get(mode)
    if weight is None:  # "time": the cost model's seconds
        weight = cm.work(aligned, sq)

    units_of_step = steps_and_units(lens.size, group_ids, samples_per_step, par.dp)
    if num_microbatches is not None:
        num_microbatches = check_forced_count(num_microbatches, par)
    rounds = 4 * par.dp if refine_rounds is None else as_int(refine_rounds, "refine_rounds", minimum=0,
                                                            fix="pass None for the default (4 * dp)")

    micro_batches: List[List[List[int]]] = [[] for _ in range(par.dp)]
    per_step: List[int] = []
    lb_time = 0.0
    lb_count = 0
    for step_samples, units in units_of_step:
        inp = StepInput(aligned=aligned[step_samples], weight=weight[step_samples], oversize=over[step_samples],
                        units=units, cap=cap_eff)
        bins, lb_m = plan_step(inp, par, cm, lens[step_samples], num_microbatches, rounds, align,
                               int(max_tokens_per_gpu))
        per_step.append(len(bins[0]))
        for r in range(par.dp):
            micro_batches[r].extend([[int(step_samples[i]) for i in mb] for mb in bins[r]])
        lb_count += lb_m
        work = cm.work(aligned[step_samples], sq[step_samples])
        lb_time += cm.lower_bound(float(work.sum()), float(work.max()), par.dp, lb_m, step_samples.size // par.dp)

    t_mult = align.total_multiple
    tokens = [(-(-mb_sums(rank, aligned) // t_mult) * t_mult).astype(int).tolist() for rank in micro_batches]
    sqs = [mb_sums(rank, sq) for rank in micro_batches]
    plan = _build_plan(micro_batches, per_step, tokens, sqs, flops, lens, par, align, cap, cm,
                       balance_by_flops=(mode != "tokens"), algorithm="dynbatch")
    plan.lower_bound_microbatches = lb_count
    plan.lower_bound_step_time = lb_time
    plan.oversize_samples = [int(i) for i in np.flatnonzero(over)]
    plan.planning_time_s = time.perf_counter() - t_start
    return plan


def score_assignment(
    micro_batches: Sequence[Sequence[Sequence[int]]],
    lengths: Union[Sequence[int], np.ndarray],
    *,
    model: Any = None,
    parallel: Union[ParallelConfig, Mapping[str, Any], None] = None,
    max_tokens_per_gpu: int,
    fp8_alignment: Union[None, str, int] = None,
    cost_model: Optional[CostModel] = None,
    pad_to_longest: bool = False,
    microbatches_per_step: Optional[Sequence[int]] = None,
    algorithm: str = "external",
) -> Plan:
    """Score any assignment (e.g. a baseline's) with the same cost model and statistics as the planner.

    No invariant is enforced here -- ranks may differ in micro-batch count and micro-batches may break the cap
    (``plan.cap_violations`` counts them) -- so baselines are measured honestly. ``pad_to_longest`` models
    fixed-shape ``[b, s]`` micro-batches: every sample is padded to the longest in its micro-batch and attention
    runs over the padded square.
    """
    par = ParallelConfig.from_any(parallel)
    lens = check_lengths(lengths)
    cap, align, _ = check_budget(max_tokens_per_gpu, par, fp8_alignment)
    coeffs, cm = resolve_costs(model, par, cost_model)
    mbs = [[[int(i) for i in mb] for mb in rank] for rank in micro_batches]
    aligned = align.seq_len(lens).astype(np.int64)
    sq = lens.astype(np.float64) ** 2
    if pad_to_longest:
        tokens = [[len(mb) * int(aligned[mb].max()) if mb else 0 for mb in rank] for rank in mbs]
        sqs = [[len(mb) * float(aligned[mb].max()) ** 2 if mb else 0.0 for mb in rank] for rank in mbs]
    else:
        tokens = [[align.padded_total(int(aligned[mb].sum())) if mb else 0 for mb in rank] for rank in mbs]
        sqs = [[float(sq[mb].sum()) for mb in rank] for rank in mbs]
    per_step = list(microbatches_per_step) if microbatches_per_step else [max((len(r) for r in mbs), default=0)]
    plan = _build_plan(mbs, per_step, tokens, sqs, sample_flops(coeffs, aligned, sq), lens, par, align, cap, cm,
                       balance_by_flops=False, algorithm=algorithm)
    work = cm.work(aligned, sq)
    plan.lower_bound_microbatches = max(1, -(-int(aligned.sum()) // (par.dp * cap)))
    plan.lower_bound_step_time = cm.lower_bound(float(work.sum()), float(work.max()), par.dp,
                                                plan.lower_bound_microbatches, lens.size // par.dp)
    return plan


def _build_plan(micro_batches, per_step, tokens, sqs, flops, lens, par: ParallelConfig, align: Alignment, cap: int,
                cm: CostModel, *, balance_by_flops: bool, algorithm: str) -> Plan:
    """A ``Plan`` with per-micro-batch times and per-rank statistics from per-micro-batch token counts and sums
    of squared lengths. Optimizer steps run one after another, so a rank's time is the sum over steps (EP groups
    in lockstep inside each step); ranks with different micro-batch counts (possible for baselines) are timed
    each on its own."""
    mb_time = [cm.microbatch_time(np.asarray(t, dtype=np.float64), np.asarray(q, dtype=np.float64)).tolist()
               for t, q in zip(tokens, sqs)]
    if len({len(r) for r in micro_batches}) == 1:
        rank_time = np.zeros(par.dp)
        start = 0
        for count in per_step:
            rank_time += cm.step_time([t[start:start + count] for t in mb_time])
            start += count
    else:
        rank_time = np.array([cm.rank_time(t) for t in mb_time])
    return Plan(
        micro_batches=micro_batches,
        microbatches_per_step=per_step,
        parallel=par,
        alignment=align,
        cap=cap,
        balance_by_flops=balance_by_flops,
        microbatch_tokens=tokens,
        microbatch_time=mb_time,
        rank_tokens=np.array([sum(t) for t in tokens], dtype=np.int64),
        rank_flops=np.array([float(flops[[i for mb in rank for i in mb]].sum()) for rank in micro_batches]),
        rank_time=rank_time,
        padding_tokens=int(sum(sum(t) for t in tokens) - lens.sum()),
        real_tokens=int(lens.sum()),
        lower_bound_microbatches=0,
        lower_bound_step_time=0.0,
        algorithm=algorithm,
    )
